//! Register-tiled products of attention's tiny per-head matrices (head widths up to
//! [`SMALL_HEAD`]: a ViT with 4 heads of 16, a predictor with heads of 12), where the `gemm`
//! crate's per-call packing and dispatch cost more than the arithmetic.
//!
//! Every product is in "row-axpy" form, `dst[i, ..] (=|+=) scale · Σ_p lhs(i, p) · rhs[p, ..]`,
//! with rows of `rhs` and `dst` contiguous: the loop over `p` keeps a tile of [`MR`] × `W` sums
//! in registers (`W` = 16, 12, 8, 4 or 1 columns, so no width needs padding) and
//! multiplies each broadcast `lhs(i, p)` into one row of `rhs`. Each sum runs over `p` in order
//! with `mul_add`, then is scaled once and stored or added: the result of an element does not
//! depend on the tile it fell in, the ISA, or the thread count.

use crate::float::Float;

/// The largest head width (`d` and `dv`) that takes these kernels instead of `gemm`.
pub const SMALL_HEAD: usize = 32;

/// Rows of `dst` per register tile.
const MR: usize = 4;

/// An operand read at `data[offset + i·row_stride + j·col_stride]`.
#[derive(Clone, Copy)]
pub(super) struct Mat<'a, T> {
    pub(super) data: &'a [T],
    pub(super) offset: usize,
    pub(super) row_stride: usize,
    pub(super) col_stride: usize,
}

impl<'a, T> Mat<'a, T> {
    pub(super) fn new(data: &'a [T], offset: usize, row_stride: usize, col_stride: usize) -> Self {
        Mat { data, offset, row_stride, col_stride }
    }

    /// Whether elements `(i, j)` for `i < rows`, `j < cols` lie inside `data`.
    pub(super) fn fits(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || self.offset + (rows - 1) * self.row_stride + (cols - 1) * self.col_stride < self.data.len()
    }
}

/// `dst[dst_off + i·dst_rs + j] (=|+=) scale · Σ_{p<k} lhs(i, p) · rhs(p, j)` for `i < m`,
/// `j < n`; `rhs` must have unit column stride. Panics (a bug in the caller) when an operand
/// reaches past its slice.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn matmul<T: Float>(m: usize, n: usize, k: usize, dst: &mut [T], dst_off: usize, dst_rs: usize, accumulate: bool, lhs: Mat<'_, T>, rhs: Mat<'_, T>, scale: T) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(rhs.col_stride == 1, "attention tile: rhs needs unit column stride");
    assert!(dst.len() >= dst_off + (m - 1) * dst_rs + n, "attention tile: dst too short");
    assert!(lhs.fits(m, k) && rhs.fits(k, n), "attention tile: operand too short");
    let mut i = 0;
    while i + MR <= m {
        row_tile::<T, MR>(i, n, k, dst, dst_off, dst_rs, accumulate, lhs, rhs, scale);
        i += MR;
    }
    while i < m {
        row_tile::<T, 1>(i, n, k, dst, dst_off, dst_rs, accumulate, lhs, rhs, scale);
        i += 1;
    }
}

/// Rows `i0..i0 + R` of [`matmul`], across all columns.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn row_tile<T: Float, const R: usize>(i0: usize, n: usize, k: usize, dst: &mut [T], dst_off: usize, dst_rs: usize, accumulate: bool, lhs: Mat<'_, T>, rhs: Mat<'_, T>, scale: T) {
    let mut j = 0;
    while j < n {
        let left = n - j;
        let w = if left >= 16 {
            tile::<T, R, 16>(i0, j, k, dst, dst_off, dst_rs, accumulate, lhs, rhs, scale);
            16
        } else if left >= 12 {
            tile::<T, R, 12>(i0, j, k, dst, dst_off, dst_rs, accumulate, lhs, rhs, scale);
            12
        } else if left >= 8 {
            tile::<T, R, 8>(i0, j, k, dst, dst_off, dst_rs, accumulate, lhs, rhs, scale);
            8
        } else if left >= 4 {
            tile::<T, R, 4>(i0, j, k, dst, dst_off, dst_rs, accumulate, lhs, rhs, scale);
            4
        } else {
            tile::<T, R, 1>(i0, j, k, dst, dst_off, dst_rs, accumulate, lhs, rhs, scale);
            1
        };
        j += w;
    }
}

/// One `R × W` tile at `(i0, j0)`: the sums stay in registers over the whole `k` loop.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn tile<T: Float, const R: usize, const W: usize>(i0: usize, j0: usize, k: usize, dst: &mut [T], dst_off: usize, dst_rs: usize, accumulate: bool, lhs: Mat<'_, T>, rhs: Mat<'_, T>, scale: T) {
    let mut acc = [[T::zero(); W]; R];
    for p in 0..k {
        let start = rhs.offset + p * rhs.row_stride + j0;
        let b: &[T; W] = match rhs.data[start..start + W].try_into() {
            Ok(b) => b,
            Err(_) => unreachable!("a slice of W elements"),
        };
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let a = lhs.data[lhs.offset + (i0 + r) * lhs.row_stride + p * lhs.col_stride];
            for l in 0..W {
                acc_r[l] = a.mul_add(b[l], acc_r[l]);
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        let start = dst_off + (i0 + r) * dst_rs + j0;
        let out = &mut dst[start..start + W];
        for l in 0..W {
            let v = acc_r[l] * scale;
            out[l] = if accumulate { out[l] + v } else { v };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_match_a_plain_product_at_every_edge() {
        // Goal: every row/column remainder (widths 1..40 cross the 16/12/8/4/1 tiles, rows cross
        // the 4-row tile), strided and transposed lhs, accumulate and scale, against a plain
        // triple loop in f64.
        let mut seed = 11u64;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        };
        for &(m, n, k) in &[(1, 1, 1), (5, 12, 16), (4, 16, 3), (7, 29, 12), (9, 40, 5), (3, 3, 0)] {
            let lhs: Vec<f64> = (0..(m + 2) * (k + 3)).map(|_| rnd()).collect();
            let rhs: Vec<f64> = (0..(k + 1) * (n + 5)).map(|_| rnd()).collect();
            let start: Vec<f64> = (0..m * (n + 2)).map(|_| rnd()).collect();
            for (transposed, accumulate) in [(false, false), (true, true)] {
                // lhs(i, p) at 1 + i·(k+3) + p, or transposed at 1 + i + p·(m+2).
                let l = if transposed { Mat::new(&lhs, 1, 1, m + 2) } else { Mat::new(&lhs, 1, k + 3, 1) };
                let r = Mat::new(&rhs, 2, n + 5, 1);
                let mut dst = start.clone();
                matmul(m, n, k, &mut dst, 0, n + 2, accumulate, l, r, 0.5);
                for i in 0..m {
                    for j in 0..n {
                        let sum: f64 = (0..k).map(|p| l.data[l.offset + i * l.row_stride + p * l.col_stride] * rhs[2 + p * (n + 5) + j]).sum();
                        let want = if accumulate { start[i * (n + 2) + j] + 0.5 * sum } else { 0.5 * sum };
                        assert!((dst[i * (n + 2) + j] - want).abs() < 1e-12, "({m},{n},{k}) at ({i},{j})");
                    }
                    // Columns past n are untouched.
                    assert_eq!(dst[i * (n + 2) + n..i * (n + 2) + n + 2], start[i * (n + 2) + n..i * (n + 2) + n + 2]);
                }
            }
        }
    }
}
