//! Reductions over the rows or columns of a contiguous matrix.
//!
//! A tensor reduction over any set of dims is brought to one of two shapes by the tensor layer:
//! reduce the last `len` elements of each row ([`rows`]), or reduce the leading rows into one
//! row ([`sum_cols`]). Sums use eight fixed lanes, so results are deterministic (independent of
//! threading) and the loop vectorizes.

use crate::error::{check_eq, Error, Result};
use crate::float::Float;
use crate::threading::should_parallelize;
use rayon::prelude::*;

/// What a row reduction computes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RowOp {
    /// Σ x.
    Sum,
    /// Σ x / n.
    Mean,
    /// max x (NaN propagates).
    Max,
    /// min x (NaN propagates).
    Min,
    /// Σ (x - mean)² / (n - correction).
    Var {
        /// Bessel's correction: 1 for the unbiased estimator, 0 for the population variance.
        correction: usize,
    },
}

/// Deterministic eight-lane sum of a slice.
#[inline(always)]
pub fn sum<T: Float>(xs: &[T]) -> T {
    let mut lanes = [T::zero(); 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            lanes[l] = lanes[l] + c[l];
        }
    }
    let mut s = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for &x in rest {
        s = s + x;
    }
    s
}

fn reduce_row<T: Float>(row: &[T], op: RowOp) -> T {
    let n = row.len();
    match op {
        RowOp::Sum => sum(row),
        RowOp::Mean => sum(row) / T::from_usize(n.max(1)).unwrap_or(T::one()),
        RowOp::Max => row.iter().fold(T::neg_infinity(), |m, &x| if x > m || x.is_nan() || m.is_nan() { if m.is_nan() { m } else { x } } else { m }),
        RowOp::Min => row.iter().fold(T::infinity(), |m, &x| if x < m || x.is_nan() || m.is_nan() { if m.is_nan() { m } else { x } } else { m }),
        RowOp::Var { correction } => {
            let nf = T::from_usize(n).unwrap_or(T::one());
            let mean = sum(row) / nf;
            let mut lanes = [T::zero(); 8];
            let chunks = row.chunks_exact(8);
            let rest = chunks.remainder();
            for c in chunks {
                for l in 0..8 {
                    let d = c[l] - mean;
                    lanes[l] = lanes[l] + d * d;
                }
            }
            let mut s = lanes.iter().fold(T::zero(), |a, &b| a + b);
            for &x in rest {
                s = s + (x - mean) * (x - mean);
            }
            let denom = n.saturating_sub(correction);
            if denom == 0 {
                T::nan()
            } else {
                s / T::from_usize(denom).unwrap_or(T::one())
            }
        }
    }
}

/// Reduces each row of `src` (rows of `row_len`) into one element of `dst`; `src` must hold
/// `row_len · dst.len()` elements.
pub fn rows<T: Float>(src: &[T], row_len: usize, dst: &mut [T], op: RowOp) -> Result<()> {
    check_eq("rows", "src", src, row_len.saturating_mul(dst.len()))?;
    if row_len == 0 {
        let fill = match op {
            RowOp::Sum => T::zero(),
            RowOp::Max => T::neg_infinity(),
            RowOp::Min => T::infinity(),
            RowOp::Mean | RowOp::Var { .. } => T::nan(),
        };
        dst.fill(fill);
        return Ok(());
    }
    if should_parallelize(src.len()) && dst.len() > 1 {
        dst.par_iter_mut().zip(src.par_chunks(row_len)).for_each(|(o, r)| *o = reduce_row(r, op));
    } else {
        for (o, r) in dst.iter_mut().zip(src.chunks(row_len)) {
            *o = reduce_row(r, op);
        }
    }
    Ok(())
}

/// Index of the first maximum (or minimum when `min`) of each row; NaN counts as the maximum.
/// `src` must hold `row_len · dst.len()` elements, and rows must not be empty (unless there are
/// none).
pub fn arg_rows<T: Float>(src: &[T], row_len: usize, dst: &mut [u32], min: bool) -> Result<()> {
    if row_len == 0 && !dst.is_empty() {
        return Err(Error::InvalidArgument { op: "arg_rows", arg: "row_len", reason: "is 0: an empty row has no extremum" });
    }
    check_eq("arg_rows", "src", src, row_len.saturating_mul(dst.len()))?;
    if dst.is_empty() {
        return Ok(());
    }
    for (o, r) in dst.iter_mut().zip(src.chunks(row_len)) {
        let mut best = 0usize;
        for (i, &x) in r.iter().enumerate() {
            let b = r[best];
            if b.is_nan() {
                break;
            }
            let better = if min { x < b } else { x > b };
            if better || x.is_nan() {
                best = i;
            }
        }
        *o = best as u32;
    }
    Ok(())
}

/// Sums the `n_rows` rows of a `n_rows × n_cols` matrix into `dst[n_cols]` (column sums),
/// in row order, so the result is deterministic.
pub fn sum_cols<T: Float>(src: &[T], n_rows: usize, n_cols: usize, dst: &mut [T]) -> Result<()> {
    check_eq("sum_cols", "src", src, n_rows.saturating_mul(n_cols))?;
    check_eq("sum_cols", "dst", dst, n_cols)?;
    if should_parallelize(src.len()) && n_cols >= 64 {
        let w = n_cols.div_ceil(crate::threading::num_threads()).max(16);
        dst.par_chunks_mut(w).enumerate().for_each(|(i, out)| sum_cols_run(src, n_rows, n_cols, i * w, out));
    } else {
        sum_cols_run(src, n_rows, n_cols, 0, dst);
    }
    Ok(())
}

/// Columns `col0..col0 + out.len()` of [`sum_cols`], row by row.
#[inline(always)]
fn sum_cols_body<T: Float>(src: &[T], n_rows: usize, n_cols: usize, col0: usize, out: &mut [T]) {
    out.fill(T::zero());
    let w = out.len();
    for r in 0..n_rows {
        let row = &src[r * n_cols + col0..r * n_cols + col0 + w];
        for (o, &x) in out.iter_mut().zip(row) {
            *o = *o + x;
        }
    }
}

crate::simd::dispatch! {
    fn sum_cols_run[T](src: &[T], n_rows: usize, n_cols: usize, col0: usize, out: &mut [T]) = sum_cols_body where [T: Float];
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_reductions() {
        let x = [1.0f64, 2., 3., 4., 10., -1., 5., 0.];
        let mut out = [0.0f64; 2];
        rows(&x, 4, &mut out, RowOp::Sum).unwrap();
        assert_eq!(out, [10., 14.]);
        rows(&x, 4, &mut out, RowOp::Max).unwrap();
        assert_eq!(out, [4., 10.]);
        rows(&x, 4, &mut out, RowOp::Min).unwrap();
        assert_eq!(out, [1., -1.]);
        rows(&x, 4, &mut out, RowOp::Var { correction: 1 }).unwrap();
        assert!((out[0] - 5.0 / 3.0).abs() < 1e-12);
        let mut idx = [0u32; 2];
        arg_rows(&x, 4, &mut idx, false).unwrap();
        assert_eq!(idx, [3, 0]);
        let mut cols = [0.0f64; 4];
        sum_cols(&x, 2, 4, &mut cols).unwrap();
        assert_eq!(cols, [11., 1., 8., 4.]);
    }

    #[test]
    fn nan_propagates_through_max() {
        let x = [1.0f32, f32::NAN, 3.0];
        let mut out = [0.0f32];
        rows(&x, 3, &mut out, RowOp::Max).unwrap();
        assert!(out[0].is_nan());
    }

    #[test]
    fn wrong_lengths_are_typed_errors() {
        let x = [1.0f64; 8];
        let mut out = [0.0f64; 3];
        assert_eq!(rows(&x, 4, &mut out, RowOp::Sum), Err(Error::LengthMismatch { op: "rows", arg: "src", expected: 12, actual: 8 }));
        assert_eq!(rows(&x, 0, &mut out, RowOp::Sum), Err(Error::LengthMismatch { op: "rows", arg: "src", expected: 0, actual: 8 }));
        assert_eq!(rows(&x, usize::MAX, &mut out, RowOp::Sum), Err(Error::LengthMismatch { op: "rows", arg: "src", expected: usize::MAX, actual: 8 }));
        assert_eq!(rows(&[], 0, &mut out, RowOp::Sum), Ok(()));
        let mut idx = [0u32; 3];
        assert_eq!(arg_rows(&x, 4, &mut idx, true), Err(Error::LengthMismatch { op: "arg_rows", arg: "src", expected: 12, actual: 8 }));
        assert!(matches!(arg_rows(&[] as &[f64], 0, &mut idx, true), Err(Error::InvalidArgument { op: "arg_rows", arg: "row_len", .. })));
        assert_eq!(arg_rows(&[] as &[f64], 0, &mut [], true), Ok(()));
        let mut cols = [0.0f64; 4];
        assert_eq!(sum_cols(&x, 3, 4, &mut cols), Err(Error::LengthMismatch { op: "sum_cols", arg: "src", expected: 12, actual: 8 }));
        assert_eq!(sum_cols(&x, 2, 4, &mut cols[..3]), Err(Error::LengthMismatch { op: "sum_cols", arg: "dst", expected: 4, actual: 3 }));
    }
}
