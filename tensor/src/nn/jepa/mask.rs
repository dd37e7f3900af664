//! I-JEPA multi-block masking ([`MaskConfig`], [`JepaMasks`]), as I-JEPA's `MaskCollator`.
//!
//! For one batch over an `h×w` patch grid: one target block size is drawn (scale in
//! `target_scale` of the grid, aspect ratio `h/w` log-uniform in `target_aspect`) and one context
//! block size (scale in `context_scale`, aspect 1); then per image, `n_targets` target blocks are
//! placed uniformly at random (they may overlap each other), and one context block is placed and
//! the union of the targets removed from it (targets and context are redrawn up to [`MAX_TRIES`]
//! times while fewer than `min_keep` context tokens remain; after that every non-target token of
//! the last draw is context). Every
//! target block of the batch has the same token count (one size per batch); the context sets are
//! trimmed to the smallest one in the batch (their first tokens in grid order, as I-JEPA does), so
//! the batch is rectangular.
//!
//! Every draw comes from the [`Generator`] handed in, in a fixed order, so a seed fixes the masks.
//! [`JepaMasks::rows`] cuts out a contiguous range of images (a data-parallel rank's part).
//! [`JepaMasks::tubes`] turns the masks of a spatial grid into V-JEPA's tube masks of a clip's
//! `[t, h, w]` token grid: the same blocks in every time slot.

use crate::error::{Error, Result};
use crate::rng::Generator;
use crate::tensor::Tensor;

/// Placements tried per image before the context falls back to every non-target token.
pub const MAX_TRIES: usize = 20;

/// Block sizes and counts of I-JEPA's multi-block masking.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MaskConfig {
    /// Target blocks per image (M).
    pub n_targets: usize,
    /// Range of a target block's area as a fraction of the grid.
    pub target_scale: (f64, f64),
    /// Range of a target block's aspect ratio (height / width).
    pub target_aspect: (f64, f64),
    /// Range of the context block's area as a fraction of the grid (aspect 1).
    pub context_scale: (f64, f64),
    /// Fewest context tokens an image may keep.
    pub min_keep: usize,
}

impl Default for MaskConfig {
    /// I-JEPA's ImageNet settings: 4 targets at scale 0.15-0.2 and aspect 0.75-1.5, context
    /// at scale 0.85-1.0, at least 4 context tokens.
    fn default() -> Self {
        MaskConfig { n_targets: 4, target_scale: (0.15, 0.2), target_aspect: (0.75, 1.5), context_scale: (0.85, 1.0), min_keep: 4 }
    }
}

/// The masks of one batch: per image, the context token indices and `n_targets` target blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JepaMasks {
    /// Images in the batch.
    pub batch: usize,
    /// Context tokens per image (Kc).
    pub n_context: usize,
    /// Target blocks per image (M).
    pub n_targets: usize,
    /// Tokens per target block (Kt).
    pub n_target_tokens: usize,
    /// `[B, Kc]` row-major: the context token indices of each image, ascending.
    pub context: Vec<u32>,
    /// `[M, B, Kt]` row-major: block `m` of image `b`, ascending.
    pub targets: Vec<u32>,
    /// The block size `(height, width)` of the targets of this batch.
    pub target_block: (usize, usize),
}

impl MaskConfig {
    /// Checks the ranges against a `grid` of `[h, w]` patches.
    pub fn validate(&self, grid: [usize; 2]) -> Result<()> {
        let bad = |reason: String| Err(Error::InvalidArgument { op: "MaskConfig", reason });
        let ok_range = |(lo, hi): (f64, f64)| lo.is_finite() && hi.is_finite() && lo > 0.0 && lo <= hi;
        if grid[0] == 0 || grid[1] == 0 {
            return bad(format!("empty patch grid {grid:?}"));
        }
        if self.n_targets == 0 {
            return bad("n_targets must be at least 1".into());
        }
        if !ok_range(self.target_scale) || self.target_scale.1 > 1.0 {
            return bad(format!("target_scale {:?} must be 0 < lo <= hi <= 1", self.target_scale));
        }
        if !ok_range(self.context_scale) || self.context_scale.1 > 1.0 {
            return bad(format!("context_scale {:?} must be 0 < lo <= hi <= 1", self.context_scale));
        }
        if !ok_range(self.target_aspect) {
            return bad(format!("target_aspect {:?} must be 0 < lo <= hi", self.target_aspect));
        }
        if self.min_keep == 0 || self.min_keep >= grid[0] * grid[1] {
            return bad(format!("min_keep {} must be in 1..{}", self.min_keep, grid[0] * grid[1]));
        }
        Ok(())
    }

    /// Draws the masks of a batch of `batch` images over a `grid` of `[h, w]` patches.
    pub fn sample(&self, grid: [usize; 2], batch: usize, rng: &mut Generator) -> Result<JepaMasks> {
        self.validate(grid)?;
        if batch == 0 {
            return Err(Error::InvalidArgument { op: "MaskConfig::sample", reason: "empty batch".into() });
        }
        let [gh, gw] = grid;
        let target_block = block_size(grid, self.target_scale, self.target_aspect, rng);
        let context_block = block_size(grid, self.context_scale, (1.0, 1.0), rng);
        let n = gh * gw;
        let mut targets_by_image: Vec<Vec<Vec<u32>>> = Vec::with_capacity(batch);
        let mut contexts: Vec<Vec<u32>> = Vec::with_capacity(batch);
        for _ in 0..batch {
            let mut blocks = Vec::new();
            let mut covered = vec![false; n];
            let mut context = Vec::new();
            for _ in 0..MAX_TRIES {
                covered.iter_mut().for_each(|c| *c = false);
                blocks = (0..self.n_targets).map(|_| place(grid, target_block, rng)).collect();
                for &i in blocks.iter().flatten() {
                    covered[i as usize] = true;
                }
                context = place(grid, context_block, rng).into_iter().filter(|&i| !covered[i as usize]).collect();
                if context.len() >= self.min_keep {
                    break;
                }
            }
            if context.len() < self.min_keep {
                context = (0..n as u32).filter(|&i| !covered[i as usize]).collect();
            }
            if context.is_empty() {
                return Err(Error::InvalidArgument {
                    op: "MaskConfig::sample",
                    reason: format!("the {} target blocks of {target_block:?} cover the whole {gh}x{gw} grid in {MAX_TRIES} placements", self.n_targets),
                });
            }
            targets_by_image.push(blocks);
            contexts.push(context);
        }
        let n_context = contexts.iter().map(Vec::len).min().unwrap_or(0);
        let n_target_tokens = target_block.0 * target_block.1;
        let context: Vec<u32> = contexts.iter().flat_map(|c| c[..n_context].iter().copied()).collect();
        let mut targets = Vec::with_capacity(self.n_targets * batch * n_target_tokens);
        for m in 0..self.n_targets {
            for blocks in &targets_by_image {
                targets.extend_from_slice(&blocks[m]);
            }
        }
        debug_assert_eq!(targets.len(), self.n_targets * batch * n_target_tokens);
        Ok(JepaMasks { batch, n_context, n_targets: self.n_targets, n_target_tokens, context, targets, target_block })
    }
}

impl JepaMasks {
    /// The masks of images `start..start + len` (a rank's part of the global batch).
    pub fn rows(&self, start: usize, len: usize) -> Result<JepaMasks> {
        if len == 0 || start + len > self.batch {
            return Err(Error::InvalidArgument { op: "JepaMasks::rows", reason: format!("rows {start}..{} of a batch of {}", start + len, self.batch) });
        }
        let kc = self.n_context;
        let kt = self.n_target_tokens;
        let context = self.context[start * kc..(start + len) * kc].to_vec();
        let mut targets = Vec::with_capacity(self.n_targets * len * kt);
        for m in 0..self.n_targets {
            let base = m * self.batch * kt;
            targets.extend_from_slice(&self.targets[base + start * kt..base + (start + len) * kt]);
        }
        Ok(JepaMasks { batch: len, context, targets, ..self.clone() })
    }

    /// Masks of fixed shapes, for benchmarks that must match a peer's shapes exactly: per image,
    /// `n_targets` target blocks of `block` = (height, width) patches at uniformly drawn places
    /// of a `grid`, and `n_context` context tokens drawn without replacement from the patches no
    /// target covers (topped up from the covered ones when too few are free), ascending.
    pub fn fixed_blocks(batch: usize, grid: [usize; 2], n_context: usize, n_targets: usize, block: (usize, usize), rng: &mut Generator) -> Result<JepaMasks> {
        let [gh, gw] = grid;
        let (bh, bw) = block;
        let cells = gh * gw;
        if batch == 0 || n_targets == 0 || bh == 0 || bw == 0 || bh > gh || bw > gw || n_context == 0 || n_context > cells {
            return Err(Error::InvalidArgument {
                op: "JepaMasks::fixed_blocks",
                reason: format!("batch {batch}, {n_targets} blocks of {bh}x{bw} and {n_context} context tokens on a {gh}x{gw} grid"),
            });
        }
        let mut context = Vec::with_capacity(batch * n_context);
        let mut targets = vec![0u32; n_targets * batch * bh * bw];
        for b in 0..batch {
            let mut covered = vec![false; cells];
            for k in 0..n_targets {
                let (r0, c0) = (rng.below((gh - bh + 1) as u64) as usize, rng.below((gw - bw + 1) as u64) as usize);
                for i in 0..bh {
                    for j in 0..bw {
                        let id = (r0 + i) * gw + c0 + j;
                        covered[id] = true;
                        targets[(k * batch + b) * bh * bw + i * bw + j] = id as u32;
                    }
                }
            }
            // The uncovered patches first, then the covered ones; draws stay among the uncovered
            // ones until they run out.
            let mut free: Vec<u32> = (0..cells).filter(|&i| !covered[i]).map(|i| i as u32).collect();
            let uncovered = free.len();
            free.extend((0..cells).filter(|&i| covered[i]).map(|i| i as u32));
            for i in 0..n_context {
                let pool = if i < uncovered { uncovered } else { cells };
                let j = i + rng.below((pool - i) as u64) as usize;
                free.swap(i, j);
            }
            let mut chosen = free[..n_context].to_vec();
            chosen.sort_unstable();
            context.extend(chosen);
        }
        Ok(JepaMasks { batch, n_context, n_targets, n_target_tokens: bh * bw, context, targets, target_block: block })
    }

    /// The tube masks of clips whose token grid is `slots` time slots of this mask's spatial grid
    /// of `tokens_per_slot` (= h·w) tokens, time-major: every spatial index `s` becomes
    /// `t·tokens_per_slot + s` for each slot `t`, so a target block is hidden (and the context
    /// kept) through the whole clip. Indices stay ascending; token counts grow `slots`-fold.
    pub fn tubes(&self, tokens_per_slot: usize, slots: usize) -> Result<JepaMasks> {
        let too_big = self.context.iter().chain(&self.targets).any(|&i| i as usize >= tokens_per_slot);
        if slots == 0 || too_big || u32::try_from(tokens_per_slot * slots).is_err() {
            return Err(Error::InvalidArgument {
                op: "JepaMasks::tubes",
                reason: format!("{slots} slots of {tokens_per_slot} tokens do not hold these masks"),
            });
        }
        let expand = |ids: &[u32], out: &mut Vec<u32>| {
            for t in 0..slots {
                out.extend(ids.iter().map(|&i| (t * tokens_per_slot) as u32 + i));
            }
        };
        let (kc, kt) = (self.n_context, self.n_target_tokens);
        let mut context = Vec::with_capacity(self.context.len() * slots);
        for row in self.context.chunks(kc.max(1)) {
            expand(row, &mut context);
        }
        let mut targets = Vec::with_capacity(self.targets.len() * slots);
        for block in self.targets.chunks(kt.max(1)) {
            expand(block, &mut targets);
        }
        debug_assert_eq!(context.len(), self.batch * kc * slots);
        debug_assert_eq!(targets.len(), self.n_targets * self.batch * kt * slots);
        Ok(JepaMasks { n_context: kc * slots, n_target_tokens: kt * slots, context, targets, ..self.clone() })
    }

    /// `[B, Kc]` u32 context indices.
    pub fn context_tensor(&self) -> Result<Tensor> {
        Tensor::from_vec(self.context.clone(), &[self.batch, self.n_context])
    }

    /// `[M·B, Kt]` u32 target indices (block-major: all images' block 0, then block 1, ...).
    pub fn targets_tensor(&self) -> Result<Tensor> {
        Tensor::from_vec(self.targets.clone(), &[self.n_targets * self.batch, self.n_target_tokens])
    }
}

/// A block `(height, width)` of area `scale·h·w` (scale uniform in `scale`) and aspect ratio
/// `height/width` log-uniform in `aspect`, at least 1 and smaller than the grid on each side
/// (when the grid allows).
fn block_size(grid: [usize; 2], scale: (f64, f64), aspect: (f64, f64), rng: &mut Generator) -> (usize, usize) {
    let [gh, gw] = grid;
    let s = scale.0 + rng.uniform() * (scale.1 - scale.0);
    let area = s * (gh * gw) as f64;
    let ar = (aspect.0.ln() + rng.uniform() * (aspect.1.ln() - aspect.0.ln())).exp();
    let mut h = (area * ar).sqrt().round() as usize;
    let mut w = (area / ar).sqrt().round() as usize;
    // As I-JEPA: shrink until the block fits strictly inside the grid (full-grid context allowed).
    let (max_h, max_w) = if s >= 1.0 { (gh, gw) } else { (gh.saturating_sub(1).max(1), gw.saturating_sub(1).max(1)) };
    h = h.clamp(1, max_h);
    w = w.clamp(1, max_w);
    (h, w)
}

/// The token indices (ascending) of a `block` placed uniformly at random in the grid.
fn place(grid: [usize; 2], block: (usize, usize), rng: &mut Generator) -> Vec<u32> {
    let [gh, gw] = grid;
    let (bh, bw) = block;
    let top = rng.below((gh - bh + 1) as u64) as usize;
    let left = rng.below((gw - bw + 1) as u64) as usize;
    let mut ids = Vec::with_capacity(bh * bw);
    for r in top..top + bh {
        for c in left..left + bw {
            ids.push((r * gw + c) as u32);
        }
    }
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_are_deterministic_by_seed_and_respect_bounds() {
        let cfg = MaskConfig::default();
        let grid = [14, 14];
        for seed in 0..40u64 {
            let a = cfg.sample(grid, 8, &mut Generator::new(seed)).expect("masks");
            let b = cfg.sample(grid, 8, &mut Generator::new(seed)).expect("masks");
            assert_eq!(a, b, "seed {seed}: same seed, different masks");
            let (bh, bw) = a.target_block;
            let n = (grid[0] * grid[1]) as f64;
            // Rounding each side moves the area by at most about one row and one column.
            let area = (bh * bw) as f64;
            assert!(area >= cfg.target_scale.0 * n - (bh + bw) as f64 && area <= cfg.target_scale.1 * n + (bh + bw) as f64, "seed {seed}: block {bh}x{bw}");
            let ar = bh as f64 / bw as f64;
            let slack_lo = (bh as f64 - 0.5) / (bw as f64 + 0.5);
            let slack_hi = (bh as f64 + 0.5) / (bw as f64 - 0.5);
            assert!(slack_hi >= cfg.target_aspect.0 && slack_lo <= cfg.target_aspect.1, "seed {seed}: aspect {ar}");
            assert!(a.n_context >= cfg.min_keep);
            for img in 0..a.batch {
                let ctx = &a.context[img * a.n_context..(img + 1) * a.n_context];
                for m in 0..a.n_targets {
                    let base = (m * a.batch + img) * a.n_target_tokens;
                    let block = &a.targets[base..base + a.n_target_tokens];
                    // A target block is a bh x bw rectangle of the grid.
                    let rows: Vec<usize> = block.iter().map(|&i| i as usize / grid[1]).collect();
                    let cols: Vec<usize> = block.iter().map(|&i| i as usize % grid[1]).collect();
                    assert_eq!(rows.iter().max().unwrap() - rows.iter().min().unwrap() + 1, bh);
                    assert_eq!(cols.iter().max().unwrap() - cols.iter().min().unwrap() + 1, bw);
                    // The context never sees a target token.
                    assert!(block.iter().all(|t| !ctx.contains(t)), "seed {seed}: context overlaps a target");
                }
            }
        }
        let a = cfg.sample(grid, 8, &mut Generator::new(1)).expect("masks");
        let c = cfg.sample(grid, 8, &mut Generator::new(2)).expect("masks");
        assert_ne!(a, c, "different seeds gave the same masks");
    }

    #[test]
    fn rows_cut_out_a_rank_part() {
        let cfg = MaskConfig::default();
        let all = cfg.sample([7, 7], 6, &mut Generator::new(3)).expect("masks");
        let part = all.rows(2, 3).expect("rows");
        assert_eq!(part.batch, 3);
        assert_eq!(part.context, all.context[2 * all.n_context..5 * all.n_context]);
        for m in 0..all.n_targets {
            let kt = all.n_target_tokens;
            assert_eq!(part.targets[m * 3 * kt..(m + 1) * 3 * kt], all.targets[(m * 6 + 2) * kt..(m * 6 + 5) * kt]);
        }
        assert!(all.rows(5, 2).is_err());
    }

    #[test]
    fn tubes_repeat_the_blocks_in_every_time_slot() {
        // Goal: a tube mask is the spatial mask in every slot (time-major, ascending), cutting rows
        // commutes with making tubes, and masks that do not fit the slot are refused.
        let cfg = MaskConfig { n_targets: 2, ..MaskConfig::default() };
        let flat = cfg.sample([6, 6], 4, &mut Generator::new(5)).expect("masks");
        let tubes = flat.tubes(36, 3).expect("tubes");
        assert_eq!((tubes.n_context, tubes.n_target_tokens), (3 * flat.n_context, 3 * flat.n_target_tokens));
        for img in 0..4 {
            let ctx = &tubes.context[img * tubes.n_context..(img + 1) * tubes.n_context];
            assert!(ctx.windows(2).all(|w| w[0] < w[1]));
            let spatial = &flat.context[img * flat.n_context..(img + 1) * flat.n_context];
            for t in 0..3u32 {
                let slot: Vec<u32> = ctx.iter().filter(|&&i| i / 36 == t).map(|&i| i % 36).collect();
                assert_eq!(slot, spatial, "image {img} slot {t}");
            }
        }
        assert_eq!(tubes.rows(1, 2).expect("rows"), flat.rows(1, 2).expect("rows").tubes(36, 3).expect("tubes"));
        assert!(flat.tubes(10, 3).is_err());
        assert!(flat.tubes(36, 0).is_err());
    }

    #[test]
    fn bad_configs_are_typed_errors() {
        let grid = [7, 7];
        for cfg in [
            MaskConfig { n_targets: 0, ..MaskConfig::default() },
            MaskConfig { target_scale: (0.3, 0.2), ..MaskConfig::default() },
            MaskConfig { context_scale: (0.5, 1.5), ..MaskConfig::default() },
            MaskConfig { target_aspect: (0.0, 1.0), ..MaskConfig::default() },
            MaskConfig { min_keep: 49, ..MaskConfig::default() },
        ] {
            assert!(matches!(cfg.validate(grid), Err(Error::InvalidArgument { .. })), "{cfg:?} accepted");
        }
        assert!(MaskConfig::default().sample(grid, 0, &mut Generator::new(0)).is_err());
    }
}
