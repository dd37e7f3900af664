//! Client availability and per-client fault draws. An availability trace is a text file of
//! `client on_s off_s` lines (`#` comments, blank lines allowed, several intervals per client): a
//! listed client is online only inside its intervals `[on_s, off_s)` of virtual time; an unlisted
//! client is always online. Dropouts and latencies are pure functions of
//! `(seed, round, client)`, so the same seed cuts the same clients on any machine and thread count.

use std::path::Path;

use crate::error::{FedError, Result};
use crate::population::unit_hash;

/// On/off intervals per client, sorted by client (a compact table, no per-client objects).
#[derive(Clone, Debug, Default)]
pub struct AvailabilityTrace {
    /// `(client, on_s, off_s)` sorted by client then `on_s`.
    intervals: Vec<(u32, f64, f64)>,
}

impl AvailabilityTrace {
    /// Reads a trace file for a population of `n_clients`.
    pub fn from_file(path: &Path, n_clients: u32) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| FedError::Trace { path: path.display().to_string(), line: 0, reason: e.to_string() })?;
        Self::parse(&text, n_clients).map_err(|(line, reason)| FedError::Trace { path: path.display().to_string(), line, reason })
    }

    /// Parses trace text; the error is `(1-based line, reason)`.
    pub fn parse(text: &str, n_clients: u32) -> std::result::Result<Self, (usize, String)> {
        let mut intervals = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() != 3 {
                return Err((i + 1, format!("expected `client on_s off_s`, got {line:?}")));
            }
            let client: u32 = fields[0].parse().map_err(|_| (i + 1, format!("client {:?} is not an index", fields[0])))?;
            if client >= n_clients {
                return Err((i + 1, format!("client {client} is out of range for {n_clients} clients")));
            }
            let on: f64 = fields[1].parse().map_err(|_| (i + 1, format!("on time {:?} is not a number", fields[1])))?;
            let off: f64 = fields[2].parse().map_err(|_| (i + 1, format!("off time {:?} is not a number", fields[2])))?;
            if !(on.is_finite() && off.is_finite() && on < off) {
                return Err((i + 1, format!("interval [{on}, {off}) is empty or not finite")));
            }
            intervals.push((client, on, off));
        }
        intervals.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
        Ok(AvailabilityTrace { intervals })
    }

    /// Appends to `out` (cleared first) the clients of `0..n_clients` online at virtual time `t`,
    /// ascending.
    pub fn online_into(&self, n_clients: u32, t: f64, out: &mut Vec<u32>) {
        out.clear();
        let mut next = 0u32;
        let mut i = 0;
        while i < self.intervals.len() {
            let client = self.intervals[i].0;
            out.extend(next..client);
            let mut online = false;
            while i < self.intervals.len() && self.intervals[i].0 == client {
                let (_, on, off) = self.intervals[i];
                online |= on <= t && t < off;
                i += 1;
            }
            if online {
                out.push(client);
            }
            next = client + 1;
        }
        out.extend(next..n_clients);
    }

    /// Whether client `c` is online at virtual time `t`.
    pub fn is_online(&self, c: u32, t: f64) -> bool {
        let start = self.intervals.partition_point(|iv| iv.0 < c);
        let mine = self.intervals[start..].iter().take_while(|iv| iv.0 == c);
        let mut listed = false;
        for &(_, on, off) in mine {
            listed = true;
            if on <= t && t < off {
                return true;
            }
        }
        !listed
    }
}

/// Whether client `c` drops out of `round` (never answers), at rate `rate`.
pub fn drops_out(seed: u64, round: u64, c: u32, rate: f64) -> bool {
    rate > 0.0 && unit_hash(&[seed, round, u64::from(c), 0xD207]) < rate
}

/// Client `c`'s virtual round-trip time in `round`: log-normal with this median and sigma.
pub fn latency_ms(seed: u64, round: u64, c: u32, median_ms: f64, sigma: f64) -> f64 {
    if sigma == 0.0 {
        return median_ms;
    }
    // Box-Muller on two hashes; u1 in (0, 1] so the log is finite.
    let u1 = 1.0 - unit_hash(&[seed, round, u64::from(c), 0x1A71]);
    let u2 = unit_hash(&[seed, round, u64::from(c), 0x1A72]);
    let normal = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
    median_ms * (sigma * normal).exp()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_switches_listed_clients_and_leaves_others_on() {
        let trace = AvailabilityTrace::parse("# client on off\n2 0 10\n2 20 30\n5 5 6\n\n", 8).unwrap();
        let mut out = Vec::new();
        trace.online_into(8, 0.0, &mut out);
        assert_eq!(out, vec![0, 1, 2, 3, 4, 6, 7]);
        trace.online_into(8, 15.0, &mut out);
        assert_eq!(out, vec![0, 1, 3, 4, 6, 7]);
        trace.online_into(8, 5.5, &mut out);
        assert_eq!(out, vec![0, 1, 2, 3, 4, 5, 6, 7]);
        assert!(trace.is_online(2, 25.0) && !trace.is_online(2, 30.0) && trace.is_online(3, 1e9));
    }

    #[test]
    fn bad_trace_lines_name_the_line() {
        for (text, line) in [("0 1 2\n1 x 3\n", 2), ("9 0 1\n", 1), ("1 5 5\n", 1), ("1 2\n", 1)] {
            let (at, why) = AvailabilityTrace::parse(text, 8).unwrap_err();
            assert_eq!(at, line, "{text:?}: {why}");
        }
        let err = AvailabilityTrace::from_file(Path::new("/nonexistent/trace.txt"), 8).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/trace.txt"), "{err}");
    }

    #[test]
    fn dropouts_follow_the_rate_and_latencies_the_median() {
        let dropped = (0..10_000).filter(|&c| drops_out(7, 3, c, 0.2)).count();
        assert!((1_800..2_200).contains(&dropped), "{dropped} of 10000 at rate 0.2");
        let mut lat: Vec<f64> = (0..10_001).map(|c| latency_ms(7, 3, c, 100.0, 0.5)).collect();
        lat.sort_by(f64::total_cmp);
        assert!((95.0..105.0).contains(&lat[5_000]), "median {}", lat[5_000]);
        assert_eq!(latency_ms(7, 3, 1, 100.0, 0.5), latency_ms(7, 3, 1, 100.0, 0.5));
    }
}
