//! Seeded shuffling, batching, sharding and resumable cursors for in-memory datasets.
//!
//! # Randomness
//! Every random stream is a `ChaCha8Rng` whose 32-byte seed is `seed` (u64 little-endian),
//! then a counter (the epoch, or the step, little-endian), then an 8-byte purpose tag, then
//! zeros. Shuffles are Fisher–Yates with `j` drawn by rejection sampling from `next_u64`, so the
//! order depends only on these inputs and this file, not on the `rand` version's algorithms.
//!
//! # Epochs, batches and the cursor
//! Epoch `e` visits the samples in the order [`EpochPlan::order`], the permutation drawn from
//! `(seed, e)`. Global batch `b` is `order[b * batch_size..]`, `batch_size` long; the last one
//! is shorter, or dropped with `drop_last`. A [`Cursor`] `(epoch, position)` counts the samples
//! of that epoch's order already handed out; saving it with a checkpoint and passing it to
//! [`Sampler::restore`] continues with exactly the batches that would have come next.
//!
//! # Sharding for data parallelism
//! With [`EpochPlan::shard`] / [`Sampler::shard`] `(rank, world)`, every rank computes the same
//! global batch from the same seed and keeps rows `len * rank / world .. len * (rank + 1) / world`
//! of it: the ranks' parts are disjoint, cover the global batch, and are contiguous. `batch_size`
//! (the global batch) must be a multiple of `world`, so every full batch gives each rank
//! `batch_size / world` samples. A short last batch (without `drop_last`) gives parts differing
//! by at most one sample, possibly empty: weight each rank's mean loss by its part's length, or
//! use `drop_last` for data parallelism. All ranks share one cursor, so any rank's checkpoint
//! resumes all of them.

use std::ops::Range;

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::{bad_argument, DataError, Result};

const TAG_EPOCH: [u8; 8] = *b"rtx:epch";
const TAG_SPLIT: [u8; 8] = *b"rtx:splt";
const TAG_TEXT: [u8; 8] = *b"rtx:text";

/// Where a [`Sampler`] stands: the epoch, and how many samples of its order were handed out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Cursor {
    /// Current epoch, from 0.
    pub epoch: u64,
    /// Samples of this epoch's (global, unsharded) order already handed out.
    pub position: u64,
}

/// The shuffled order of one epoch and its batches, optionally restricted to one rank's part.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EpochPlan {
    order: Vec<usize>,
    batch_size: usize,
    drop_last: bool,
    epoch: u64,
    rank: usize,
    world: usize,
}

/// An endless, resumable stream of index batches over `n_samples`, epoch after epoch.
#[derive(Clone, Debug)]
pub struct Sampler {
    n_samples: usize,
    batch_size: usize,
    seed: u64,
    drop_last: bool,
    rank: usize,
    world: usize,
    cursor: Cursor,
    /// The order of `cursor.epoch`, built on first use.
    order: Option<(u64, Vec<usize>)>,
}

/// Token windows as language-model inputs and next-token targets, each `[batch_size, seq_len]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TextBatch {
    /// `data[s..s + seq_len]` for each window start `s`, row after row.
    pub inputs: Vec<u32>,
    /// `data[s + 1..s + seq_len + 1]`, the token after each input token.
    pub targets: Vec<u32>,
    /// Rows (windows) in this batch.
    pub batch_size: usize,
    /// Tokens per row.
    pub seq_len: usize,
}

/// Draws random windows of `seq_len + 1` tokens from a token slice, seeded by `(seed, step)`.
///
/// The tokens are any `T: Copy + Into<u32>`: bytes (`u8`, a byte-level model) or token ids
/// (`u16`/`u32`, e.g. GPT-2's BPE). The window starts depend only on the slice's length, the
/// seed and the step, never on the element type, so bytes give the same batches whether they
/// are passed as `u8` or widened to `u32` first.
///
/// A batch depends only on the data, the seed and the step number, so resuming training at
/// step `k` needs only `k`. [`TextWindowSampler::eval_batch`] gives fixed, non-overlapping
/// windows for validation instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TextWindowSampler {
    batch_size: usize,
    seq_len: usize,
    seed: u64,
}

/// Splits `0..n` into `(train, val)` index lists by a seeded shuffle: `round(n * val_fraction)`
/// random indices are validation. Both lists are sorted ascending, disjoint, and cover `0..n`.
/// Use with [`super::ImageDataset::subset`].
pub fn train_val_split(n: usize, val_fraction: f64, seed: u64) -> Result<(Vec<usize>, Vec<usize>)> {
    if !(val_fraction > 0.0 && val_fraction < 1.0) {
        return Err(bad_argument(format!(
            "val_fraction {val_fraction} must lie in (0, 1)"
        )));
    }
    let n_val = ((n as f64) * val_fraction).round() as usize;
    if n_val == 0 || n_val >= n {
        return Err(DataError::Empty {
            what: format!("a side of the split of {n} samples at val_fraction {val_fraction} ({n_val} validation)"),
        });
    }
    let order = permutation(n, &mut rng_for(seed, TAG_SPLIT, 0));
    let mut val = order[..n_val].to_vec();
    let mut train = order[n_val..].to_vec();
    val.sort_unstable();
    train.sort_unstable();
    debug_assert_eq!(train.len() + val.len(), n);
    Ok((train, val))
}

impl EpochPlan {
    /// The plan of epoch `epoch` over `n_samples` samples, for the whole world (rank 0 of 1).
    pub fn new(
        n_samples: usize,
        batch_size: usize,
        seed: u64,
        epoch: u64,
        drop_last: bool,
    ) -> Result<Self> {
        check_sizes(n_samples, batch_size, drop_last)?;
        let order = epoch_order(n_samples, seed, epoch);
        Ok(Self {
            order,
            batch_size,
            drop_last,
            epoch,
            rank: 0,
            world: 1,
        })
    }

    /// This plan restricted to `rank`'s part of every global batch (see the module docs). The
    /// batch count and order stay those of the global plan; only each batch's rows narrow.
    pub fn shard(self, rank: usize, world: usize) -> Result<Self> {
        check_shard(self.batch_size, self.world, rank, world)?;
        Ok(Self {
            rank,
            world,
            ..self
        })
    }

    /// The epoch this plan shuffles for.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// This plan's `(rank, world)`.
    pub fn rank_world(&self) -> (usize, usize) {
        (self.rank, self.world)
    }

    /// The epoch's global order: a permutation of `0..n_samples`.
    pub fn order(&self) -> &[usize] {
        &self.order
    }

    /// Number of (global) batches in the epoch.
    pub fn n_batches(&self) -> usize {
        n_batches(self.order.len(), self.batch_size, self.drop_last)
    }

    /// This rank's indices of global batch `batch_idx`, or `None` past the last batch.
    pub fn batch(&self, batch_idx: usize) -> Option<&[usize]> {
        if batch_idx >= self.n_batches() {
            return None;
        }
        let start = batch_idx * self.batch_size;
        let global = global_batch(self.order.len(), self.batch_size, start, self.drop_last)?;
        let part = shard_range(global.len(), self.rank, self.world);
        Some(&self.order[global][part])
    }

    /// This rank's part of every batch of the epoch, in order.
    pub fn batches(&self) -> impl Iterator<Item = &[usize]> + '_ {
        (0..self.n_batches()).filter_map(move |batch_idx| self.batch(batch_idx))
    }
}

impl Sampler {
    /// A sampler at epoch 0, position 0, for the whole world (rank 0 of 1). Fails on a zero
    /// batch size, no samples, or `drop_last` with fewer samples than one batch.
    pub fn new(n_samples: usize, batch_size: usize, seed: u64, drop_last: bool) -> Result<Self> {
        check_sizes(n_samples, batch_size, drop_last)?;
        Ok(Self {
            n_samples,
            batch_size,
            seed,
            drop_last,
            rank: 0,
            world: 1,
            cursor: Cursor::default(),
            order: None,
        })
    }

    /// This sampler handing out only `rank`'s part of each global batch (see the module docs).
    pub fn shard(self, rank: usize, world: usize) -> Result<Self> {
        check_shard(self.batch_size, self.world, rank, world)?;
        Ok(Self {
            rank,
            world,
            ..self
        })
    }

    /// Where the sampler stands; save it with a checkpoint.
    pub fn cursor(&self) -> Cursor {
        self.cursor
    }

    /// Continues from `cursor`, as saved by [`Sampler::cursor`] of a sampler with the same
    /// `n_samples` and seed. Fails when `cursor.position > n_samples`.
    pub fn restore(&mut self, cursor: Cursor) -> Result<()> {
        if cursor.position > self.n_samples as u64 {
            return Err(bad_argument(format!(
                "cursor position {} beyond {} samples",
                cursor.position, self.n_samples
            )));
        }
        self.cursor = cursor;
        Ok(())
    }

    /// Global batches per epoch.
    pub fn batches_per_epoch(&self) -> usize {
        n_batches(self.n_samples, self.batch_size, self.drop_last)
    }

    /// The full plan of `epoch`, sharded like this sampler.
    pub fn epoch_plan(&self, epoch: u64) -> EpochPlan {
        EpochPlan {
            order: epoch_order(self.n_samples, self.seed, epoch),
            batch_size: self.batch_size,
            drop_last: self.drop_last,
            epoch,
            rank: self.rank,
            world: self.world,
        }
    }

    /// This rank's part of the next global batch, moving to the next epoch when the current one
    /// is used up. After the call, `cursor().epoch` is the epoch the batch came from.
    pub fn next_batch(&mut self) -> Vec<usize> {
        let n = self.n_samples;
        let position = usize::try_from(self.cursor.position).unwrap_or(usize::MAX);
        let global = match global_batch(n, self.batch_size, position, self.drop_last) {
            Some(range) => range,
            None => {
                self.cursor = Cursor {
                    epoch: self.cursor.epoch + 1,
                    position: 0,
                };
                global_batch(n, self.batch_size, 0, self.drop_last)
                    .expect("check_sizes guarantees a first batch in every epoch")
            }
        };
        let epoch = self.cursor.epoch;
        if self
            .order
            .as_ref()
            .is_some_and(|(cached, _)| *cached != epoch)
        {
            self.order = None;
        }
        let seed = self.seed;
        let (_, order) = self
            .order
            .get_or_insert_with(|| (epoch, epoch_order(n, seed, epoch)));
        self.cursor.position = global.end as u64;
        let part = shard_range(global.len(), self.rank, self.world);
        order[global][part].to_vec()
    }
}

impl TextWindowSampler {
    /// Batches of `batch_size` windows of `seq_len` inputs (plus one target token each).
    pub fn new(batch_size: usize, seq_len: usize, seed: u64) -> Result<Self> {
        if batch_size == 0 || seq_len == 0 {
            return Err(bad_argument(format!(
                "batch_size {batch_size} and seq_len {seq_len} must be non-zero"
            )));
        }
        Ok(Self {
            batch_size,
            seq_len,
            seed,
        })
    }

    /// Rows per (global) batch.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Tokens per row.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The training batch of step `step`: `batch_size` windows with starts drawn uniformly from
    /// `0..=data.len() - seq_len - 1`. Fails when `data` is shorter than `seq_len + 1`.
    pub fn batch<T: Copy + Into<u32>>(&self, data: &[T], step: u64) -> Result<TextBatch> {
        self.batch_shard(data, step, 0, 1)
    }

    /// `rank`'s rows of the global batch of step `step` (rows `B * rank / world..`, as in the
    /// module docs); `batch_size` must be a multiple of `world`.
    pub fn batch_shard<T: Copy + Into<u32>>(
        &self,
        data: &[T],
        step: u64,
        rank: usize,
        world: usize,
    ) -> Result<TextBatch> {
        check_shard(self.batch_size, 1, rank, world)?;
        let window = self.seq_len + 1;
        if data.len() < window {
            return Err(DataError::Empty {
                what: format!("text of {} tokens for windows of {window} tokens", data.len()),
            });
        }
        let n_starts = (data.len() - window + 1) as u64;
        let mut rng = rng_for(self.seed, TAG_TEXT, step);
        let starts: Vec<usize> = (0..self.batch_size)
            .map(|_| uniform_below(&mut rng, n_starts) as usize)
            .collect();
        let part = shard_range(self.batch_size, rank, world);
        Ok(self.windows(data, &starts[part]))
    }

    /// Number of validation batches [`TextWindowSampler::eval_batch`] gives for `data_len` tokens.
    pub fn n_eval_batches(&self, data_len: usize) -> usize {
        self.n_eval_windows(data_len).div_ceil(self.batch_size)
    }

    /// Validation batch `batch_idx`: window `k` starts at `k * seq_len`, so the windows tile
    /// `data` and every token after the first is a target exactly once (up to a final partial
    /// window, left out). The last batch may have fewer rows. `None` past the last batch.
    pub fn eval_batch<T: Copy + Into<u32>>(&self, data: &[T], batch_idx: usize) -> Option<TextBatch> {
        let n_windows = self.n_eval_windows(data.len());
        let first = batch_idx
            .checked_mul(self.batch_size)
            .filter(|&k| k < n_windows)?;
        let last = (first + self.batch_size).min(n_windows);
        let starts: Vec<usize> = (first..last).map(|k| k * self.seq_len).collect();
        Some(self.windows(data, &starts))
    }

    fn n_eval_windows(&self, data_len: usize) -> usize {
        data_len.saturating_sub(1) / self.seq_len
    }

    fn windows<T: Copy + Into<u32>>(&self, data: &[T], starts: &[usize]) -> TextBatch {
        let mut inputs = Vec::with_capacity(starts.len() * self.seq_len);
        let mut targets = Vec::with_capacity(starts.len() * self.seq_len);
        for &start in starts {
            let window = &data[start..start + self.seq_len + 1];
            inputs.extend(window[..self.seq_len].iter().map(|&b| b.into()));
            targets.extend(window[1..].iter().map(|&b| b.into()));
        }
        debug_assert_eq!(inputs.len(), targets.len());
        TextBatch {
            inputs,
            targets,
            batch_size: starts.len(),
            seq_len: self.seq_len,
        }
    }
}

fn check_sizes(n_samples: usize, batch_size: usize, drop_last: bool) -> Result<()> {
    if batch_size == 0 {
        return Err(bad_argument("batch_size must be non-zero"));
    }
    if n_samples == 0 || (drop_last && n_samples < batch_size) {
        return Err(DataError::Empty {
            what: format!(
                "epoch of {n_samples} samples in batches of {batch_size} (drop_last {drop_last})"
            ),
        });
    }
    Ok(())
}

#[allow(
    clippy::manual_is_multiple_of,
    reason = "is_multiple_of needs Rust 1.87; the workspace says 1.85"
)]
fn check_shard(batch_size: usize, current_world: usize, rank: usize, world: usize) -> Result<()> {
    if current_world != 1 {
        return Err(bad_argument(format!(
            "already sharded over {current_world} ranks"
        )));
    }
    if world == 0 || rank >= world {
        return Err(bad_argument(format!(
            "rank {rank} out of range for world {world}"
        )));
    }
    if batch_size % world != 0 {
        return Err(bad_argument(format!(
            "global batch_size {batch_size} is not a multiple of world {world}"
        )));
    }
    Ok(())
}

fn n_batches(n_samples: usize, batch_size: usize, drop_last: bool) -> usize {
    if drop_last {
        n_samples / batch_size
    } else {
        n_samples.div_ceil(batch_size)
    }
}

/// Range of `order` forming the global batch that starts at `start`, or `None` when the epoch
/// has no batch left there.
fn global_batch(
    n_samples: usize,
    batch_size: usize,
    start: usize,
    drop_last: bool,
) -> Option<Range<usize>> {
    let end = start.checked_add(batch_size)?.min(n_samples);
    if start >= n_samples || (drop_last && end - start < batch_size) {
        return None;
    }
    Some(start..end)
}

/// `rank`'s rows of a global batch of `len` rows.
fn shard_range(len: usize, rank: usize, world: usize) -> Range<usize> {
    debug_assert!(rank < world);
    let range = len * rank / world..len * (rank + 1) / world;
    debug_assert!(range.end <= len);
    range
}

fn epoch_order(n_samples: usize, seed: u64, epoch: u64) -> Vec<usize> {
    permutation(n_samples, &mut rng_for(seed, TAG_EPOCH, epoch))
}

fn rng_for(seed: u64, tag: [u8; 8], counter: u64) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&counter.to_le_bytes());
    key[16..24].copy_from_slice(&tag);
    ChaCha8Rng::from_seed(key)
}

/// Fisher–Yates shuffle of `0..n`.
fn permutation(n: usize, rng: &mut impl RngCore) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = uniform_below(rng, i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

/// Uniform in `0..bound` by rejection: draws below `2^64 mod bound` are redrawn, so the
/// accepted range is a whole number of `bound`-sized blocks.
fn uniform_below(rng: &mut impl RngCore, bound: u64) -> u64 {
    debug_assert!(bound > 0);
    let threshold = bound.wrapping_neg() % bound;
    loop {
        let x = rng.next_u64();
        if x >= threshold {
            return x % bound;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted(mut v: Vec<usize>) -> Vec<usize> {
        v.sort_unstable();
        v
    }

    #[test]
    fn epoch_order_is_a_seeded_permutation() {
        for seed in 0..20u64 {
            for n in [1usize, 2, 7, 100] {
                let plan = EpochPlan::new(n, 3, seed, 0, false).expect("plan");
                assert_eq!(
                    sorted(plan.order().to_vec()),
                    (0..n).collect::<Vec<_>>(),
                    "seed {seed} n {n}"
                );
                assert_eq!(
                    plan,
                    EpochPlan::new(n, 3, seed, 0, false).expect("plan"),
                    "seed {seed}"
                );
            }
        }
        let a = EpochPlan::new(100, 10, 7, 0, false).expect("plan");
        let b = EpochPlan::new(100, 10, 7, 1, false).expect("plan");
        let c = EpochPlan::new(100, 10, 8, 0, false).expect("plan");
        assert_ne!(a.order(), b.order(), "epochs differ");
        assert_ne!(a.order(), c.order(), "seeds differ");
    }

    /// Pins the order itself: a change here silently changes every training run's batches.
    #[test]
    fn epoch_order_golden() {
        let plan = EpochPlan::new(10, 4, 42, 0, false).expect("plan");
        assert_eq!(plan.order(), GOLDEN_SEED42_N10);
    }
    const GOLDEN_SEED42_N10: &[usize] = &[8, 6, 2, 7, 1, 5, 0, 9, 3, 4];

    #[test]
    fn batches_cover_epoch_with_and_without_drop_last() {
        let plan = EpochPlan::new(10, 4, 1, 0, false).expect("plan");
        let batches: Vec<&[usize]> = plan.batches().collect();
        assert_eq!(
            batches.iter().map(|b| b.len()).collect::<Vec<_>>(),
            [4, 4, 2]
        );
        assert_eq!(batches.concat(), plan.order());
        assert_eq!(plan.batch(3), None);

        let plan = EpochPlan::new(10, 4, 1, 0, true).expect("plan");
        assert_eq!(plan.n_batches(), 2);
        assert_eq!(
            plan.batches().collect::<Vec<_>>().concat(),
            plan.order()[..8]
        );
    }

    #[test]
    fn bad_sizes_are_errors() {
        assert!(matches!(
            Sampler::new(10, 0, 0, false),
            Err(DataError::BadArgument { .. })
        ));
        assert!(matches!(
            Sampler::new(0, 4, 0, false),
            Err(DataError::Empty { .. })
        ));
        assert!(matches!(
            Sampler::new(3, 4, 0, true),
            Err(DataError::Empty { .. })
        ));
        assert!(Sampler::new(3, 4, 0, false).is_ok());
        let plan = || EpochPlan::new(10, 4, 0, 0, false).expect("plan");
        assert!(matches!(
            plan().shard(2, 2),
            Err(DataError::BadArgument { .. })
        ));
        assert!(matches!(
            plan().shard(0, 3),
            Err(DataError::BadArgument { .. })
        ));
        let sharded = plan().shard(0, 2).expect("shard");
        assert!(matches!(
            sharded.shard(0, 2),
            Err(DataError::BadArgument { .. })
        ));
    }

    #[test]
    fn shards_are_disjoint_and_cover_each_global_batch() {
        for (n, batch_size, drop_last) in [
            (100, 12, false),
            (100, 12, true),
            (7, 4, false),
            (64, 8, false),
        ] {
            for world in [1usize, 2, 4] {
                if batch_size % world != 0 {
                    continue;
                }
                let global = EpochPlan::new(n, batch_size, 3, 5, drop_last).expect("plan");
                let shards: Vec<EpochPlan> = (0..world)
                    .map(|rank| global.clone().shard(rank, world).expect("shard"))
                    .collect();
                for batch_idx in 0..global.n_batches() {
                    let whole = global.batch(batch_idx).expect("batch");
                    let parts: Vec<&[usize]> = shards
                        .iter()
                        .map(|s| s.batch(batch_idx).expect("part"))
                        .collect();
                    // Contiguous, in rank order: concatenation is the global batch.
                    assert_eq!(
                        parts.concat(),
                        whole,
                        "n {n} B {batch_size} world {world} batch {batch_idx}"
                    );
                    if whole.len() == batch_size {
                        assert!(parts.iter().all(|p| p.len() == batch_size / world));
                    }
                }
                assert!(shards.iter().all(|s| s.n_batches() == global.n_batches()));
            }
        }
    }

    #[test]
    fn sampler_walks_epochs_like_plans() {
        let mut sampler = Sampler::new(10, 4, 9, false).expect("sampler");
        for epoch in 0..3 {
            let plan = sampler.epoch_plan(epoch);
            for expected in plan.batches() {
                assert_eq!(sampler.next_batch(), expected);
                assert_eq!(sampler.cursor().epoch, epoch);
            }
        }
        assert_eq!(
            sampler.cursor(),
            Cursor {
                epoch: 2,
                position: 10
            }
        );
    }

    #[test]
    fn restored_cursor_reproduces_next_batches() {
        for world in [1usize, 2] {
            let make = || {
                Sampler::new(23, 6, 11, false)
                    .and_then(|s| s.shard(world - 1, world))
                    .expect("sampler")
            };
            let mut original = make();
            for _ in 0..7 {
                original.next_batch(); // crosses an epoch boundary (4 batches per epoch)
            }
            let saved = serde_json::to_string(&original.cursor()).expect("serialize cursor");
            let expected: Vec<Vec<usize>> = (0..9).map(|_| original.next_batch()).collect();

            let mut resumed = make();
            resumed
                .restore(serde_json::from_str(&saved).expect("deserialize cursor"))
                .expect("restore");
            let got: Vec<Vec<usize>> = (0..9).map(|_| resumed.next_batch()).collect();
            assert_eq!(got, expected, "world {world}");
            assert_eq!(resumed.cursor(), original.cursor());
        }
        let mut sampler = Sampler::new(5, 2, 0, false).expect("sampler");
        assert!(sampler
            .restore(Cursor {
                epoch: 0,
                position: 6
            })
            .is_err());
        // A cursor at the end of an epoch resumes with the first batch of the next.
        sampler
            .restore(Cursor {
                epoch: 3,
                position: 5,
            })
            .expect("restore");
        assert_eq!(
            sampler.next_batch(),
            sampler.epoch_plan(4).batch(0).expect("batch")
        );
        assert_eq!(
            sampler.cursor(),
            Cursor {
                epoch: 4,
                position: 2
            }
        );
    }

    #[test]
    fn image_split_is_seeded_disjoint_and_covering() {
        let (train, val) = train_val_split(1000, 0.1, 5).expect("split");
        assert_eq!((train.len(), val.len()), (900, 100));
        let mut all = [train.clone(), val.clone()].concat();
        all.sort_unstable();
        assert_eq!(all, (0..1000).collect::<Vec<_>>());
        assert_eq!(
            train_val_split(1000, 0.1, 5).expect("split"),
            (train, val.clone())
        );
        assert_ne!(train_val_split(1000, 0.1, 6).expect("split").1, val);
        assert!(matches!(
            train_val_split(5, 0.01, 0),
            Err(DataError::Empty { .. })
        ));
        assert!(matches!(
            train_val_split(5, 1.5, 0),
            Err(DataError::BadArgument { .. })
        ));
    }

    #[test]
    fn text_windows_are_seeded_and_shifted_by_one() {
        let data: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        let sampler = TextWindowSampler::new(4, 8, 1).expect("sampler");
        let batch = sampler.batch(&data, 17).expect("batch");
        assert_eq!(
            (batch.batch_size, batch.seq_len, batch.inputs.len()),
            (4, 8, 32)
        );
        for row in 0..4 {
            let inputs = &batch.inputs[row * 8..(row + 1) * 8];
            let targets = &batch.targets[row * 8..(row + 1) * 8];
            assert_eq!(inputs[1..], targets[..7]);
            assert_eq!((inputs[7] + 1) % 256, targets[7]);
        }
        assert_eq!(sampler.batch(&data, 17).expect("batch"), batch);
        assert_ne!(sampler.batch(&data, 18).expect("batch"), batch);

        // Shards of the global batch are its rows, in rank order.
        let parts: Vec<TextBatch> = (0..2)
            .map(|r| sampler.batch_shard(&data, 17, r, 2).expect("shard"))
            .collect();
        assert_eq!(
            [parts[0].inputs.clone(), parts[1].inputs.clone()].concat(),
            batch.inputs
        );
        assert!(sampler.batch_shard(&data, 17, 0, 3).is_err());

        // Exactly seq_len + 1 bytes: one possible window.
        let tiny = sampler.batch(&data[..9], 0).expect("one window");
        assert_eq!(tiny.inputs[..8], tiny.inputs[8..16]);
        assert!(matches!(
            sampler.batch(&data[..8], 0),
            Err(DataError::Empty { .. })
        ));
    }

    #[test]
    fn bytes_and_the_same_values_as_token_ids_give_identical_batches() {
        // Goal: the sampler is generic over the token type without changing byte runs: bytes
        // passed as u8 and widened to u32 (or u16) give the same windows, training and eval.
        let bytes: Vec<u8> = (0..5000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
        let wide: Vec<u32> = bytes.iter().map(|&b| u32::from(b)).collect();
        let half: Vec<u16> = bytes.iter().map(|&b| u16::from(b)).collect();
        let sampler = TextWindowSampler::new(6, 32, 11).expect("sampler");
        for step in [0, 1, 17, 1_000_003] {
            let b = sampler.batch(&bytes, step).expect("bytes");
            assert_eq!(sampler.batch(&wide, step).expect("u32"), b);
            assert_eq!(sampler.batch(&half, step).expect("u16"), b);
            assert_eq!(sampler.batch_shard(&wide, step, 1, 2).expect("shard"), sampler.batch_shard(&bytes, step, 1, 2).expect("shard"));
        }
        assert_eq!(sampler.n_eval_batches(bytes.len()), sampler.n_eval_batches(wide.len()));
        for i in 0..sampler.n_eval_batches(bytes.len()) {
            assert_eq!(sampler.eval_batch(&wide, i), sampler.eval_batch(&bytes, i));
        }
        // Token ids beyond a byte pass through unchanged.
        let ids: Vec<u32> = (0..100).map(|i| 50_000 + i).collect();
        let b = sampler.eval_batch(&ids, 0).expect("batch");
        assert_eq!(b.inputs[..3], [50_000, 50_001, 50_002]);
        assert_eq!(b.targets[..3], [50_001, 50_002, 50_003]);
    }

    #[test]
    fn eval_windows_tile_the_data() {
        let data: Vec<u8> = (0..=100u8).collect(); // 101 bytes: 100 targets
        let sampler = TextWindowSampler::new(3, 10, 0).expect("sampler");
        assert_eq!(sampler.n_eval_batches(data.len()), 4); // 10 windows in batches of 3
        let batches: Vec<TextBatch> = (0..4)
            .map(|i| sampler.eval_batch(&data, i).expect("batch"))
            .collect();
        assert_eq!(batches[3].batch_size, 1);
        let targets: Vec<u32> = batches.iter().flat_map(|b| b.targets.clone()).collect();
        assert_eq!(targets, (1..=100u32).collect::<Vec<_>>());
        assert!(sampler.eval_batch(&data, 4).is_none());
        assert_eq!(sampler.n_eval_batches(5), 0);
    }

    #[test]
    fn uniform_below_stays_in_range() {
        let mut rng = rng_for(0, TAG_TEXT, 0);
        let mut seen = [false; 7];
        for _ in 0..1000 {
            let x = uniform_below(&mut rng, 7);
            seen[x as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(uniform_below(&mut rng, 1), 0);
    }
}
