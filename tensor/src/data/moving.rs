//! Moving Fashion-MNIST clips ([`MovingConfig`], [`Clip`]): one dataset item travelling in a
//! straight line across a larger blank canvas, made on the fly and deterministically, the data of
//! V-JEPA runs (issue 16).
//!
//! A clip of item `index` is `frames` canvases of `canvas × canvas` pixels. Its motion is drawn
//! from a [`Generator`] seeded by `(seed, index, epoch)` on the stream of its split
//! ([`ClipKey`]), in this order: the direction (one of `directions`, evenly spaced angles
//! counter-clockwise from "right", `0` = right; with 8, `2` = up), the speed in pixels per frame
//! (uniform in `speed`), then the start position (uniform over the integer positions that keep the
//! whole item inside the canvas in every frame). Frame `t` pastes the item at
//! `start + round(t · v)`, whole pixels only, so nothing is ever interpolated or clipped; the
//! background is 0. Any process that knows the key regenerates the same clip.
//!
//! The labels of a clip are its item's class and its direction.

use super::{DataError, Result};
use crate::rng::Generator;

/// Clip generator stream of the training split.
pub const TRAIN_CLIP_STREAM: u64 = 0x0C11_0001;
/// Clip generator stream of the held-out (validation and test) splits.
pub const TEST_CLIP_STREAM: u64 = 0x0C11_0002;

/// The shape and motion of moving-item clips.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MovingConfig {
    /// Canvas side in pixels.
    pub canvas: usize,
    /// Frames per clip.
    pub frames: usize,
    /// Number of motion directions (the direction label's classes).
    pub directions: usize,
    /// Range of the speed in pixels per frame.
    pub speed: (f64, f64),
}

impl Default for MovingConfig {
    /// 48×48 canvas, 8 frames, 8 directions, 1.5 to 2.5 pixels per frame: a 28×28 item has 20
    /// pixels of room and travels at most 17.5 pixels, so every direction and speed fits.
    fn default() -> Self {
        MovingConfig { canvas: 48, frames: 8, directions: 8, speed: (1.5, 2.5) }
    }
}

/// What fixes a clip: the run seed, the split's stream, the item and the epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClipKey {
    /// The run seed.
    pub seed: u64,
    /// [`TRAIN_CLIP_STREAM`] or [`TEST_CLIP_STREAM`].
    pub stream: u64,
    /// The item's index in its split.
    pub index: u64,
    /// The epoch (a fixed value for evaluation clips).
    pub epoch: u64,
}

/// One generated clip.
#[derive(Clone, Debug, PartialEq)]
pub struct Clip {
    /// `[frames, canvas, canvas]` row-major raw pixel values (the item's bytes, 0 elsewhere).
    pub pixels: Vec<u8>,
    /// The direction label, `0..directions`.
    pub direction: u32,
    /// The item's top-left corner `(row, col)` in each frame.
    pub positions: Vec<(usize, usize)>,
}

impl MovingConfig {
    /// Checks that an `item` of `[h, w]` pixels fits the canvas at every direction and speed.
    pub fn validate(&self, item: [usize; 2]) -> Result<()> {
        let bad = |reason: String| Err(DataError::BadArgument { reason });
        if self.frames < 2 || self.directions < 2 {
            return bad(format!("moving clips need at least 2 frames and 2 directions, got {} and {}", self.frames, self.directions));
        }
        let (lo, hi) = self.speed;
        if !(lo.is_finite() && hi.is_finite() && lo >= 0.0 && lo <= hi) {
            return bad(format!("clip speed range {:?} must be 0 <= lo <= hi", self.speed));
        }
        let room = self.canvas.saturating_sub(item[0].max(item[1]));
        let travel = hi * (self.frames - 1) as f64;
        if item[0] > self.canvas || item[1] > self.canvas || travel.round() > room as f64 {
            return bad(format!("a {}x{} item moving up to {travel} pixels does not fit a {} canvas ({room} pixels of room)", item[0], item[1], self.canvas));
        }
        Ok(())
    }

    /// Pixels per clip, `frames · canvas²`.
    pub fn pixels_per_clip(&self) -> usize {
        self.frames * self.canvas * self.canvas
    }

    /// The clip of `item` (`[h, w]` row-major pixels) under `key`.
    pub fn clip(&self, item: &[u8], size: [usize; 2], key: ClipKey) -> Result<Clip> {
        self.validate(size)?;
        if item.len() != size[0] * size[1] {
            return Err(DataError::BadArgument { reason: format!("an item of {} pixels is not {}x{}", item.len(), size[0], size[1]) });
        }
        let mix = key.seed ^ key.index.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ key.epoch.wrapping_mul(0xD1B5_4A32_D192_ED03);
        let mut rng = Generator::with_stream(mix, key.stream);
        let direction = rng.below(self.directions as u64) as u32;
        let speed = self.speed.0 + rng.uniform() * (self.speed.1 - self.speed.0);
        let angle = std::f64::consts::TAU * f64::from(direction) / self.directions as f64;
        // Rows grow downwards: "up" is a negative row step.
        let (v_row, v_col) = (-speed * angle.sin(), speed * angle.cos());
        let offsets: Vec<(i64, i64)> = (0..self.frames).map(|t| ((t as f64 * v_row).round() as i64, (t as f64 * v_col).round() as i64)).collect();
        let start = |lo: i64, hi: i64, side: usize, rng: &mut Generator| -> i64 {
            // The first corner keeps `corner + offset` in `0..=canvas - side` for every offset.
            let (first, last) = (-lo, self.canvas as i64 - side as i64 - hi);
            debug_assert!(first <= last, "validate admits only motions that fit");
            first + rng.below((last - first + 1) as u64) as i64
        };
        let (row_lo, row_hi) = offsets.iter().fold((0, 0), |(lo, hi), &(r, _)| (lo.min(r), hi.max(r)));
        let (col_lo, col_hi) = offsets.iter().fold((0, 0), |(lo, hi), &(_, c)| (lo.min(c), hi.max(c)));
        let row0 = start(row_lo, row_hi, size[0], &mut rng);
        let col0 = start(col_lo, col_hi, size[1], &mut rng);
        let c = self.canvas;
        let mut pixels = vec![0u8; self.pixels_per_clip()];
        let mut positions = Vec::with_capacity(self.frames);
        for (t, &(dr, dc)) in offsets.iter().enumerate() {
            let (r, col) = ((row0 + dr) as usize, (col0 + dc) as usize);
            assert!(r + size[0] <= c && col + size[1] <= c, "frame {t}: item at ({r}, {col}) leaves the {c} canvas");
            let frame = &mut pixels[t * c * c..(t + 1) * c * c];
            for (i, line) in item.chunks(size[1]).enumerate() {
                frame[(r + i) * c + col..(r + i) * c + col + size[1]].copy_from_slice(line);
            }
            positions.push((r, col));
        }
        Ok(Clip { pixels, direction, positions })
    }

    /// Mean and standard deviation of clip pixels on the `[0, 1]` scale, from those of the items
    /// (`mean`, `std`, as [`super::ImageDataset::pixel_mean_std`]) of `[h, w]` pixels: a fraction
    /// `f = h·w / canvas²` of every frame is the item, the rest 0.
    pub fn pixel_mean_std(&self, item: [usize; 2], mean: f32, std: f32) -> (f32, f32) {
        let f = (item[0] * item[1]) as f64 / (self.canvas * self.canvas) as f64;
        let (m, s) = (f64::from(mean), f64::from(std));
        let second = f * (s * s + m * m);
        let clip_mean = f * m;
        (clip_mean as f32, (second - clip_mean * clip_mean).max(1e-12).sqrt() as f32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 28x28 item: a bright 6x4 bar at rows 2..8, cols 20..24 and a dimmer square elsewhere,
    /// so its centroid is off-centre.
    fn item() -> Vec<u8> {
        let mut px = vec![0u8; 28 * 28];
        for r in 0..28 {
            for c in 0..28 {
                px[r * 28 + c] = if (2..8).contains(&r) && (20..24).contains(&c) {
                    250
                } else if (10..20).contains(&r) && (5..15).contains(&c) {
                    90
                } else {
                    0
                };
            }
        }
        px
    }

    fn centroid(frame: &[u8], c: usize) -> (f64, f64) {
        let (mut sr, mut sc, mut m) = (0.0, 0.0, 0.0);
        for (i, &p) in frame.iter().enumerate() {
            let w = f64::from(p);
            sr += w * (i / c) as f64;
            sc += w * (i % c) as f64;
            m += w;
        }
        (sr / m, sc / m)
    }

    fn seed() -> u64 {
        std::env::var("RTX_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(16)
    }

    #[test]
    fn clips_are_deterministic_by_key() {
        // Goal: the same key gives the same clip; another item, epoch or stream gives another.
        let seed = seed();
        println!("seed {seed} (RTX_TEST_SEED replays)");
        let cfg = MovingConfig::default();
        let px = item();
        let key = ClipKey { seed, stream: TRAIN_CLIP_STREAM, index: 7, epoch: 3 };
        let a = cfg.clip(&px, [28, 28], key).expect("clip");
        assert_eq!(a, cfg.clip(&px, [28, 28], key).expect("clip"), "seed {seed}");
        let others = [ClipKey { index: 8, ..key }, ClipKey { epoch: 4, ..key }, ClipKey { stream: TEST_CLIP_STREAM, ..key }, ClipKey { seed: seed + 1, ..key }];
        let differ = others.iter().filter(|k| cfg.clip(&px, [28, 28], **k).expect("clip").positions != a.positions).count();
        // A collision of all three draws is possible but rare; three of four must differ.
        assert!(differ >= 3, "seed {seed}: only {differ} of 4 other keys moved the item differently");
    }

    #[test]
    fn item_stays_inside_and_direction_matches_displacement() {
        // Goal: for many keys, every frame holds the whole item (no pixel lost at an edge) and the
        // centroid's displacement from the first to the last frame points in the labelled
        // direction (within half a sector). Method: compare pixel mass and the centroid angle.
        let seed = seed();
        println!("seed {seed} (RTX_TEST_SEED replays)");
        for directions in [4, 8] {
            let cfg = MovingConfig { directions, ..MovingConfig::default() };
            let px = item();
            let mass: u64 = px.iter().map(|&p| u64::from(p)).sum();
            let c = cfg.canvas;
            let mut seen = vec![false; directions];
            for index in 0..300u64 {
                let key = ClipKey { seed, stream: TRAIN_CLIP_STREAM, index, epoch: 0 };
                let clip = cfg.clip(&px, [28, 28], key).expect("clip");
                assert!((clip.direction as usize) < directions);
                seen[clip.direction as usize] = true;
                for t in 0..cfg.frames {
                    let frame = &clip.pixels[t * c * c..(t + 1) * c * c];
                    assert_eq!(frame.iter().map(|&p| u64::from(p)).sum::<u64>(), mass, "seed {seed} item {index} frame {t}: pixels lost");
                }
                let (r0, c0) = centroid(&clip.pixels[..c * c], c);
                let (r1, c1) = centroid(&clip.pixels[(cfg.frames - 1) * c * c..], c);
                let angle = (-(r1 - r0)).atan2(c1 - c0);
                let expected = std::f64::consts::TAU * f64::from(clip.direction) / directions as f64;
                let diff = (angle - expected + 3.0 * std::f64::consts::PI).rem_euclid(std::f64::consts::TAU) - std::f64::consts::PI;
                assert!(
                    diff.abs() < std::f64::consts::PI / directions as f64,
                    "seed {seed} item {index}: moved at {angle:.3} rad, label {} ({expected:.3})",
                    clip.direction
                );
                let travel = ((r1 - r0).powi(2) + (c1 - c0).powi(2)).sqrt();
                assert!(travel >= cfg.speed.0 * (cfg.frames - 1) as f64 - 1.5, "seed {seed} item {index}: moved only {travel}");
            }
            assert!(seen.iter().all(|&s| s), "seed {seed}: some direction never drawn in 300 clips: {seen:?}");
        }
    }

    #[test]
    fn bad_configs_are_refused() {
        let px = item();
        let key = ClipKey { seed: 0, stream: TRAIN_CLIP_STREAM, index: 0, epoch: 0 };
        for cfg in [
            MovingConfig { canvas: 30, ..MovingConfig::default() },
            MovingConfig { frames: 1, ..MovingConfig::default() },
            MovingConfig { speed: (2.0, 1.0), ..MovingConfig::default() },
            MovingConfig { directions: 1, ..MovingConfig::default() },
        ] {
            assert!(cfg.clip(&px, [28, 28], key).is_err(), "{cfg:?} accepted");
        }
        assert!(MovingConfig::default().clip(&px[..100], [28, 28], key).is_err());
        let (m, s) = MovingConfig::default().pixel_mean_std([28, 28], 0.3, 0.35);
        assert!(m > 0.0 && m < 0.3 && s > 0.0, "{m} {s}");
    }
}
