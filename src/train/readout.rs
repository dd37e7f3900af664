//! Frozen-feature readouts of the I-JEPA probes (`[jepa] probe_features`): how the encoder's
//! token grid of one image becomes the vector a linear probe or the k-NN classifier sees.
//!
//! Inputs are the frozen encoder's outputs of one image as flat row-major `[N, C]` slices, `N =
//! gh·gw` tokens in raster order (row by row of the patch grid):
//! - `mean`: the mean over all tokens of the final (layer-normed) output, `C` values;
//! - `grid2` / `grid3`: the grid cut into `r × r` regions (`r` = 2 / 3), each region's tokens
//!   averaged, concatenated region by region in raster order (`r²·C` values). Rows and columns are
//!   cut the same way, at `round(i·g / r)` for `i = 0..=r` ([`region_bounds`]): a 7-token side is
//!   cut 4 + 3 for `r = 2` and 2 + 3 + 2 for `r = 3`. Every token lies in exactly one region;
//! - `tokens`: every token, concatenated (`N·C` values);
//! - `mean-last4`: the mean over tokens of each of the last 4 blocks' outputs (each through the
//!   encoder's final layer norm, so the last one is `mean`), concatenated from the earliest block
//!   (`min(4, layers)·C` values).

use crate::config::ProbeReadout;

/// Blocks whose outputs `mean-last4` concatenates.
pub(crate) const LAST_BLOCKS: usize = 4;

/// What one image's readouts are computed from.
pub(crate) struct ImageTokens<'a> {
    /// Final layer-normed tokens `[N, C]`.
    pub(crate) last: &'a [f32],
    /// Normed outputs `[N, C]` of the last blocks, earliest first (the last one equals `last`);
    /// empty when no readout needs them.
    pub(crate) blocks: &'a [&'a [f32]],
    /// Patch grid `[gh, gw]`, `gh·gw = N`.
    pub(crate) grid: [usize; 2],
    /// Channels `C`.
    pub(crate) channels: usize,
}

/// Length of `readout`'s vector for a grid of `grid` tokens of `channels`, with `layers` blocks.
pub(crate) fn dim(readout: ProbeReadout, grid: [usize; 2], channels: usize, layers: usize) -> usize {
    match readout {
        ProbeReadout::Mean => channels,
        ProbeReadout::Grid2 => 4 * channels,
        ProbeReadout::Grid3 => 9 * channels,
        ProbeReadout::Tokens => grid[0] * grid[1] * channels,
        ProbeReadout::MeanLast4 => layers.min(LAST_BLOCKS) * channels,
    }
}

/// Whether `readout` needs the intermediate blocks' outputs.
pub(crate) fn needs_blocks(readout: ProbeReadout) -> bool {
    readout == ProbeReadout::MeanLast4
}

/// `[start, end)` of the `r` cuts of a side of `g` tokens: boundaries at `round(i·g / r)`
/// (halves rounded up), so every token is in exactly one cut and no cut is empty while `r <= g`.
pub(crate) fn region_bounds(g: usize, r: usize) -> Vec<(usize, usize)> {
    let edge = |i: usize| (2 * i * g + r) / (2 * r);
    (0..r).map(|i| (edge(i), edge(i + 1))).collect()
}

/// Appends `readout` of one image to `out`.
pub(crate) fn append(readout: ProbeReadout, image: &ImageTokens<'_>, out: &mut Vec<f32>) {
    match readout {
        ProbeReadout::Mean => mean_tokens(image.last, image.channels, out),
        ProbeReadout::Grid2 => grid_pool(image.last, image.grid, image.channels, 2, out),
        ProbeReadout::Grid3 => grid_pool(image.last, image.grid, image.channels, 3, out),
        ProbeReadout::Tokens => out.extend_from_slice(image.last),
        ProbeReadout::MeanLast4 => image.blocks.iter().for_each(|b| mean_tokens(b, image.channels, out)),
    }
}

/// Appends the mean over the rows of `tokens [N, C]` (`C` values); accumulates in f64.
fn mean_tokens(tokens: &[f32], c: usize, out: &mut Vec<f32>) {
    let mut sum = vec![0f64; c];
    let n = tokens.len() / c.max(1);
    for row in tokens.chunks(c.max(1)) {
        row.iter().zip(&mut sum).for_each(|(x, s)| *s += f64::from(*x));
    }
    out.extend(sum.iter().map(|s| (s / n.max(1) as f64) as f32));
}

/// Appends the means of `tokens [gh·gw, C]` over the `r × r` regions of the grid, region rows
/// first (`r²·C` values); accumulates in f64.
fn grid_pool(tokens: &[f32], grid: [usize; 2], c: usize, r: usize, out: &mut Vec<f32>) {
    let [gh, gw] = grid;
    for &(y0, y1) in &region_bounds(gh, r) {
        for &(x0, x1) in &region_bounds(gw, r) {
            let mut sum = vec![0f64; c];
            for y in y0..y1 {
                for x in x0..x1 {
                    let t = &tokens[(y * gw + x) * c..(y * gw + x + 1) * c];
                    t.iter().zip(&mut sum).for_each(|(v, s)| *s += f64::from(*v));
                }
            }
            let count = ((y1 - y0) * (x1 - x0)).max(1) as f64;
            out.extend(sum.iter().map(|s| (s / count) as f32));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Token `t` of a `[gh, gw]` grid carries `[t, 10·t]`.
    fn ramp(grid: [usize; 2]) -> Vec<f32> {
        (0..grid[0] * grid[1]).flat_map(|t| [t as f32, 10.0 * t as f32]).collect()
    }

    fn readout(r: ProbeReadout, last: &[f32], blocks: &[&[f32]], grid: [usize; 2], channels: usize) -> Vec<f32> {
        let mut out = Vec::new();
        append(r, &ImageTokens { last, blocks, grid, channels }, &mut out);
        out
    }

    #[test]
    fn regions_cover_every_token_exactly_once() {
        assert_eq!(region_bounds(7, 2), vec![(0, 4), (4, 7)]);
        assert_eq!(region_bounds(7, 3), vec![(0, 2), (2, 5), (5, 7)]);
        assert_eq!(region_bounds(2, 2), vec![(0, 1), (1, 2)]);
        for g in 1..12 {
            for r in 1..=g {
                let cuts = region_bounds(g, r);
                let mut hits = vec![0usize; g];
                for (a, b) in cuts {
                    assert!(a < b, "empty cut of {g} into {r}");
                    (a..b).for_each(|i| hits[i] += 1);
                }
                assert!(hits.iter().all(|&h| h == 1), "{g} into {r}: {hits:?}");
            }
        }
        // And on the 2-D grid: the 3x3 regions of 7x7 count 49 tokens.
        let sizes: usize = region_bounds(7, 3).iter().flat_map(|(a, b)| region_bounds(7, 3).into_iter().map(move |(c, d)| (b - a) * (d - c))).sum();
        assert_eq!(sizes, 49);
    }

    #[test]
    fn shapes_match_dim() {
        let grid = [7, 7];
        let last = ramp(grid);
        let blocks: Vec<&[f32]> = vec![&last, &last, &last, &last];
        for r in ProbeReadout::ALL {
            let out = readout(r, &last, &blocks, grid, 2);
            assert_eq!(out.len(), dim(r, grid, 2, 4), "{}", r.name());
        }
        assert_eq!(dim(ProbeReadout::Grid3, grid, 64, 4), 576);
        assert_eq!(dim(ProbeReadout::Tokens, grid, 64, 4), 3136);
        assert_eq!(dim(ProbeReadout::MeanLast4, grid, 64, 2), 128);
    }

    #[test]
    fn values_on_a_hand_made_grid() {
        // 3x3 grid, token t = [t, 10t]: rows cut 2 + 1 for r = 2 (round(1.5) = 2).
        let grid = [3, 3];
        let last = ramp(grid);
        assert_eq!(readout(ProbeReadout::Mean, &last, &[], grid, 2), vec![4.0, 40.0]);
        // Regions: {0,1,3,4} {2,5} {6,7} {8}.
        assert_eq!(readout(ProbeReadout::Grid2, &last, &[], grid, 2), vec![2.0, 20.0, 3.5, 35.0, 6.5, 65.0, 8.0, 80.0]);
        // r = 3 on a side of 3: every token is its own region, in raster order.
        assert_eq!(readout(ProbeReadout::Grid3, &last, &[], grid, 2), last);
        assert_eq!(readout(ProbeReadout::Tokens, &last, &[], grid, 2), last);
        // mean-last4 concatenates each block's mean, earliest first.
        let zeros = vec![0f32; 18];
        let blocks: Vec<&[f32]> = vec![&zeros, &last];
        assert_eq!(readout(ProbeReadout::MeanLast4, &last, &blocks, grid, 2), vec![0.0, 0.0, 4.0, 40.0]);
        // 7x7: the centre region of grid3 is rows and columns 2..5, mean token (3·7 + 3) = 24.
        let g7 = ramp([7, 7]);
        let out = readout(ProbeReadout::Grid3, &g7, &[], [7, 7], 2);
        assert_eq!(&out[8..10], &[24.0, 240.0]);
        // Top-left region: rows/cols 0..2, tokens {0, 1, 7, 8}, mean 4.
        assert_eq!(&out[0..2], &[4.0, 40.0]);
    }

    #[test]
    fn readout_names_round_trip() {
        for r in ProbeReadout::ALL {
            assert_eq!(ProbeReadout::from_name(r.name()), Some(r));
        }
        assert_eq!(ProbeReadout::from_name("grid4"), None);
        assert!(ProbeReadout::allowed().contains("\"mean-last4\""));
    }
}
