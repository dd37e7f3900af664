//! Names of state: [`Unit`]s of the model, and [`ShardId`]s as intervals of a unit, so a shard of
//! one mesh shape can be cut from, or assembled out of, shards of another.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A piece of the model that a pipeline stage owns whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Unit {
    /// Token and position embeddings.
    Embed,
    /// Transformer block `i`.
    Block(usize),
    /// Final norm and language-model head.
    Head,
}

impl Unit {
    /// The unit a parameter belongs to, from its name; `None` for a name outside the GPT layout.
    pub fn of_param(name: &str) -> Option<Unit> {
        if name.starts_with("tok_emb.") || name.starts_with("pos_emb.") {
            return Some(Unit::Embed);
        }
        if name.starts_with("ln_f.") || name.starts_with("lm_head.") {
            return Some(Unit::Head);
        }
        let rest = name.strip_prefix("blocks.")?;
        let (index, tail) = rest.split_once('.')?;
        if tail.is_empty() {
            return None;
        }
        index.parse().ok().map(Unit::Block)
    }
}

impl fmt::Display for Unit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unit::Embed => f.write_str("embed"),
            Unit::Block(i) => write!(f, "block{i}"),
            Unit::Head => f.write_str("head"),
        }
    }
}

/// One shard of the state: slice `tp_index` of `tp_size` of a unit, and with ZeRO segment
/// `s` of `n` of that slice.
///
/// `zero_segment: None` is the slice's parameters (and with ZeRO-0 its optimizer moments);
/// `Some((s, n))` is segment `s` of `n` of its optimizer moments (ZeRO-1/2), or of its
/// parameters and moments (ZeRO-3). The two kinds never stand in for each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ShardId {
    /// The unit.
    pub unit: Unit,
    /// Tensor-parallel slice.
    pub tp_index: usize,
    /// Slices of the unit.
    pub tp_size: usize,
    /// ZeRO segment `(index, count)` over `dp`.
    pub zero_segment: Option<(usize, usize)>,
}

impl ShardId {
    /// The whole unit (one slice, no segment).
    pub fn whole(unit: Unit) -> ShardId {
        ShardId { unit, tp_index: 0, tp_size: 1, zero_segment: None }
    }

    /// The shard as the interval `[lo/den, hi/den)` of its unit.
    fn interval(&self) -> (u128, u128, u128) {
        let (t, size) = (self.tp_index as u128, self.tp_size.max(1) as u128);
        match self.zero_segment {
            None => (t, t + 1, size),
            Some((s, n)) => {
                let n = n.max(1) as u128;
                (t * n + s as u128, t * n + s as u128 + 1, size * n)
            }
        }
    }

    fn same_kind(&self, other: &ShardId) -> bool {
        self.unit == other.unit && self.zero_segment.is_some() == other.zero_segment.is_some()
    }

    /// Whether this shard contains all of `other` (same unit and kind, interval containment).
    pub fn covers(&self, other: &ShardId) -> bool {
        if !self.same_kind(other) {
            return false;
        }
        let (a_lo, a_hi, a_d) = self.interval();
        let (b_lo, b_hi, b_d) = other.interval();
        a_lo * b_d <= b_lo * a_d && b_hi * a_d <= a_hi * b_d
    }

    /// Whether the two shards share any part (same unit and kind).
    pub fn overlaps(&self, other: &ShardId) -> bool {
        self.overlap(other) > 0.0
    }

    /// The fraction of `other` that this shard holds.
    pub(super) fn overlap(&self, other: &ShardId) -> f64 {
        if !self.same_kind(other) {
            return 0.0;
        }
        let (a_lo, a_hi, a_d) = self.interval();
        let (b_lo, b_hi, b_d) = other.interval();
        // On the common denominator a_d·b_d.
        let lo = (a_lo * b_d).max(b_lo * a_d);
        let hi = (a_hi * b_d).min(b_hi * a_d);
        if hi <= lo {
            return 0.0;
        }
        (hi - lo) as f64 / ((b_hi - b_lo) * a_d) as f64
    }
}

impl fmt::Display for ShardId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/tp{}of{}", self.unit, self.tp_index, self.tp_size)?;
        if let Some((s, n)) = self.zero_segment {
            write!(f, "/z{s}of{n}")?;
        }
        Ok(())
    }
}

/// Parts held by members whose union covers `need`: a greedy interval cover that extends the
/// covered prefix with the part reaching furthest (ties: least loaded holder, then lowest rank).
pub(super) fn cover(need: &ShardId, held: &[Vec<ShardId>], load: &[u64]) -> Option<Vec<(usize, ShardId)>> {
    let (lo, hi, den) = need.interval();
    let mut parts: Vec<(u64, usize, ShardId)> = Vec::new();
    for (r, shards) in held.iter().enumerate() {
        parts.extend(shards.iter().filter(|h| h.overlaps(need)).map(|h| (load.get(r).copied().unwrap_or(0), r, *h)));
    }
    parts.sort();
    let (mut reached, end) = ((lo, den), (hi, den));
    let mut chosen = Vec::new();
    while less(reached, end) {
        let mut best: Option<(usize, (u128, u128))> = None;
        for (k, (_, _, shard)) in parts.iter().enumerate() {
            let (a, b, d) = shard.interval();
            if !less(reached, (a, d)) && less(reached, (b, d)) && best.is_none_or(|(_, e)| less(e, (b, d))) {
                best = Some((k, (b, d)));
            }
        }
        let (k, stop) = best?;
        let (_, r, shard) = parts.remove(k);
        chosen.push((r, shard));
        reached = stop;
    }
    chosen.sort_by(|a, b| {
        let (a0, _, ad) = a.1.interval();
        let (b0, _, bd) = b.1.interval();
        (a0 * bd).cmp(&(b0 * ad)).then(a.0.cmp(&b.0))
    });
    Some(chosen)
}

/// `a < b` for fractions `(numerator, denominator)`.
fn less(a: (u128, u128), b: (u128, u128)) -> bool {
    a.0 * b.1 < b.0 * a.1
}

/// Whether the union of `shards` covers `need`.
pub(super) fn union_covers(shards: impl Iterator<Item = ShardId>, need: &ShardId) -> bool {
    let held = vec![shards.collect::<Vec<_>>()];
    cover(need, &held, &[0]).is_some()
}
