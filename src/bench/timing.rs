//! Wall-clock timing of repeated runs: warm-up, then the median of the rest.

use std::time::Instant;

/// Summary of repeated timings, in milliseconds.
#[derive(Clone, Debug, PartialEq)]
pub struct Stats {
    /// Median run time.
    pub median_ms: f64,
    /// Fastest run.
    pub min_ms: f64,
    /// Slowest run.
    pub max_ms: f64,
    /// Number of timed runs.
    pub repeats: usize,
}

impl Stats {
    /// Summarizes `samples_ms` (at least one).
    pub fn from_samples(mut samples_ms: Vec<f64>) -> Stats {
        assert!(!samples_ms.is_empty(), "no samples to summarize");
        samples_ms.sort_by(f64::total_cmp);
        let n = samples_ms.len();
        let median_ms = if n % 2 == 1 { samples_ms[n / 2] } else { 0.5 * (samples_ms[n / 2 - 1] + samples_ms[n / 2]) };
        Stats { median_ms, min_ms: samples_ms[0], max_ms: samples_ms[n - 1], repeats: n }
    }

    /// The fields every result line carries.
    pub(crate) fn json_fields(&self, obj: &mut serde_json::Map<String, serde_json::Value>) {
        obj.insert("median_ms".into(), round3(self.median_ms).into());
        obj.insert("min_ms".into(), round3(self.min_ms).into());
        obj.insert("max_ms".into(), round3(self.max_ms).into());
        obj.insert("repeats".into(), self.repeats.into());
    }
}

/// Runs `f` `warmup` times untimed, then `repeats` times timed.
pub(crate) fn measure(warmup: usize, repeats: usize, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<Stats> {
    anyhow::ensure!(repeats > 0, "--repeats must be at least 1");
    for _ in 0..warmup {
        f()?;
    }
    let mut samples = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let start = Instant::now();
        f()?;
        samples.push(start.elapsed().as_secs_f64() * 1e3);
    }
    Ok(Stats::from_samples(samples))
}

pub(crate) fn round3(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        // Goal: the summary picks the middle sample (mean of the two middles when even).
        let s = Stats::from_samples(vec![5.0, 1.0, 3.0]);
        assert_eq!((s.median_ms, s.min_ms, s.max_ms, s.repeats), (3.0, 1.0, 5.0, 3));
        assert_eq!(Stats::from_samples(vec![4.0, 1.0, 2.0, 3.0]).median_ms, 2.5);
    }
}
