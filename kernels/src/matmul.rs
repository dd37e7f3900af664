//! Matrix multiplication through the `gemm` crate, on strided operands so transposes are free.
//!
//! `dst[m×n] (row-major, contiguous) = lhs[m×k] · rhs[k×n]` (+ `dst` when accumulating), where
//! `lhs` and `rhs` are described by an offset and a row and column stride into their slices.
//! Batches are a loop over offsets; the caller computes them. Large products use the shared
//! thread pool (see [`crate::threading`]).
//!
//! [`linear`] is a fully connected layer's forward, `x · wᵀ + b`, in blocks of rows: each block
//! starts as copies of the bias and gets its product added while it is still in cache, and
//! blocks run in parallel (the bias copy is no serial pass over the whole output).

use crate::error::{check_len, Error, Result};
use crate::float::Float;
use crate::threading::num_threads;
use rayon::prelude::*;

/// Describes one strided operand: element offset, row stride and column stride.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Operand {
    /// Offset of element (0, 0).
    pub offset: usize,
    /// Distance between consecutive rows.
    pub row_stride: usize,
    /// Distance between consecutive columns.
    pub col_stride: usize,
}

impl Operand {
    /// A contiguous row-major matrix with `cols` columns starting at `offset`.
    pub fn row_major(offset: usize, cols: usize) -> Self {
        Operand { offset, row_stride: cols, col_stride: 1 }
    }

    fn last_index(&self, rows: usize, cols: usize) -> usize {
        if rows == 0 || cols == 0 {
            return self.offset;
        }
        // Saturating: strides from a caller's mistake are refused, never wrap around.
        self.offset.saturating_add((rows - 1).saturating_mul(self.row_stride)).saturating_add((cols - 1).saturating_mul(self.col_stride))
    }
}

/// Products with fewer multiply-adds than this run single-threaded.
const PARALLEL_MIN_FLOPS: usize = 48 * 48 * 48;

/// Computes `dst[dst_offset..][m×n] (=|+=) lhs · rhs`.
///
/// `accumulate` adds into `dst` instead of overwriting it. Returns an error when an operand
/// reaches past its slice.
#[allow(clippy::too_many_arguments)]
pub fn matmul<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    lhs: &[T],
    lhs_op: Operand,
    rhs: &[T],
    rhs_op: Operand,
    dst: &mut [T],
    dst_offset: usize,
    accumulate: bool,
) -> Result<()> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    let dst_needed = dst_offset.saturating_add(m.saturating_mul(n));
    if dst.len() < dst_needed {
        return Err(Error::BufferTooSmall { op: "matmul", buffer: "dst", needed: dst_needed, actual: dst.len() });
    }
    let parallelism = if m.saturating_mul(n).saturating_mul(k) >= PARALLEL_MIN_FLOPS && num_threads() > 1 {
        gemm::Parallelism::Rayon(num_threads())
    } else {
        gemm::Parallelism::None
    };
    gemm_checked(m, n, k, lhs, lhs_op, rhs, rhs_op, &mut dst[dst_offset..dst_needed], accumulate, parallelism)
}

/// `dst[m×n] (row-major, contiguous) (=|+=) lhs · rhs` through `gemm`, after checking that every
/// element it touches lies inside its slice.
#[allow(clippy::too_many_arguments)]
fn gemm_checked<T: Float>(m: usize, n: usize, k: usize, lhs: &[T], lhs_op: Operand, rhs: &[T], rhs_op: Operand, dst: &mut [T], accumulate: bool, parallelism: gemm::Parallelism) -> Result<()> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    let dst_needed = m.saturating_mul(n);
    if dst.len() < dst_needed {
        return Err(Error::BufferTooSmall { op: "matmul", buffer: "dst", needed: dst_needed, actual: dst.len() });
    }
    if k == 0 {
        if !accumulate {
            dst[..dst_needed].fill(T::zero());
        }
        return Ok(());
    }
    for (arg, op) in [("lhs", &lhs_op), ("rhs", &rhs_op)] {
        if isize::try_from(op.row_stride.max(op.col_stride)).is_err() {
            return Err(Error::InvalidArgument { op: "matmul", arg, reason: "has a stride over isize::MAX" });
        }
    }
    let lhs_needed = lhs_op.last_index(m, k).saturating_add(1);
    if lhs.len() < lhs_needed {
        return Err(Error::BufferTooSmall { op: "matmul", buffer: "lhs", needed: lhs_needed, actual: lhs.len() });
    }
    let rhs_needed = rhs_op.last_index(k, n).saturating_add(1);
    if rhs.len() < rhs_needed {
        return Err(Error::BufferTooSmall { op: "matmul", buffer: "rhs", needed: rhs_needed, actual: rhs.len() });
    }
    // SAFETY: the three bounds checks above guarantee every index gemm touches,
    // offset + i*row_stride + j*col_stride for i < rows, j < cols, lies inside its slice;
    // dst does not alias lhs or rhs because it is borrowed mutably.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            lhs.as_ptr().add(lhs_op.offset),
            lhs_op.col_stride as isize,
            lhs_op.row_stride as isize,
            rhs.as_ptr().add(rhs_op.offset),
            rhs_op.col_stride as isize,
            rhs_op.row_stride as isize,
            T::one(),
            T::one(),
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}

/// Output elements per block of [`linear`] (its rows: this over `n_out`, at least
/// [`LINEAR_MIN_BLOCK_ROWS`]): a block of 128 KiB of f32 stays in L2 between the bias copy and
/// the product.
const LINEAR_BLOCK_ELEMS: usize = 32 * 1024;
/// Every gemm call packs the whole weight again, so a block has at least this many rows (an MLP
/// layer of 128 rows × 784 × 512 in two blocks of 64 was 20% slower than in one).
const LINEAR_MIN_BLOCK_ROWS: usize = 256;

/// `out[rows × n_out] = x[rows × n_in] · wᵀ (+ bias)`: `x` row-major from `x_off`, `w` an
/// `[n_out, n_in]` row-major weight from `w_off`, `bias` of `n_out`.
///
/// The rows go in blocks whose size depends only on `n_out`; a block is the bias copied into
/// its rows, then one gemm adding the product. With at least two blocks, and at least half as
/// many as threads, they run in parallel, each gemm on one thread; otherwise one after the other,
/// each gemm on the pool. Either way every element is the same sum, so the result does not depend
/// on the thread count.
#[allow(clippy::too_many_arguments)]
pub fn linear<T: Float>(rows: usize, n_in: usize, n_out: usize, x: &[T], x_off: usize, w: &[T], w_off: usize, bias: Option<&[T]>, out: &mut [T]) -> Result<()> {
    const OP: &str = "linear";
    check_len(OP, "out", out, rows.saturating_mul(n_out))?;
    check_len(OP, "x", x, x_off.saturating_add(rows.saturating_mul(n_in)))?;
    check_len(OP, "w", w, w_off.saturating_add(n_out.saturating_mul(n_in)))?;
    if let Some(b) = bias {
        check_len(OP, "bias", b, n_out)?;
    }
    if rows == 0 || n_out == 0 {
        return Ok(());
    }
    let block_rows = (LINEAR_BLOCK_ELEMS / n_out).max(LINEAR_MIN_BLOCK_ROWS);
    let threads = num_threads();
    let blocks = rows.div_ceil(block_rows);
    let flops = rows.saturating_mul(n_in).saturating_mul(n_out);
    let rhs = Operand { offset: w_off, row_stride: 1, col_stride: n_in };
    let block = |i: usize, dst: &mut [T], parallelism: gemm::Parallelism| -> Result<()> {
        let r = dst.len() / n_out;
        if let Some(b) = bias {
            for row in dst.chunks_exact_mut(n_out) {
                row.copy_from_slice(&b[..n_out]);
            }
        }
        let lhs = Operand { offset: x_off + i * block_rows * n_in, row_stride: n_in, col_stride: 1 };
        gemm_checked(r, n_out, n_in, x, lhs, w, rhs, dst, bias.is_some(), parallelism)
    };
    let out = &mut out[..rows * n_out];
    // Blocks in parallel as soon as there are two and they fill half the pool: a gemm fanned out
    // over the pool on these narrow products costs more than idle threads (I-JEPA's 6,272 × 64 →
    // 192 at 16 threads: 1.84 ms fanned out, 0.29 ms at 8 threads in blocks; the whole step 104 ->
    // 63 ms, torch 61 ms; BENCHMARKS "The fix: linear blocks at 16 threads").
    if threads > 1 && flops >= PARALLEL_MIN_FLOPS && blocks >= 2 && 2 * blocks >= threads {
        out.par_chunks_mut(block_rows * n_out).enumerate().try_for_each(|(i, dst)| block(i, dst, gemm::Parallelism::None))
    } else {
        let parallelism = if threads > 1 && block_rows.min(rows) * n_in * n_out >= PARALLEL_MIN_FLOPS { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
        out.chunks_mut(block_rows * n_out).enumerate().try_for_each(|(i, dst)| block(i, dst, parallelism))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(m: usize, n: usize, k: usize, a: &[f64], b: &[f64]) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        c
    }

    #[test]
    fn matches_naive_including_transposed_operands() {
        let (m, n, k) = (37, 29, 53);
        let a: Vec<f64> = (0..m * k).map(|i| ((i * 7) % 13) as f64 - 6.0).collect();
        let b: Vec<f64> = (0..k * n).map(|i| ((i * 5) % 11) as f64 - 5.0).collect();
        let want = naive(m, n, k, &a, &b);
        let mut got = vec![0.0; m * n];
        matmul(m, n, k, &a, Operand::row_major(0, k), &b, Operand::row_major(0, n), &mut got, 0, false).unwrap();
        assert_eq!(got, want);
        // b transposed in memory: bt[j*k + p] = b[p*n + j]; read it with swapped strides.
        let mut bt = vec![0.0; k * n];
        for p in 0..k {
            for j in 0..n {
                bt[j * k + p] = b[p * n + j];
            }
        }
        let mut got_t = vec![0.0; m * n];
        let bt_op = Operand { offset: 0, row_stride: 1, col_stride: k };
        matmul(m, n, k, &a, Operand::row_major(0, k), &bt, bt_op, &mut got_t, 0, false).unwrap();
        assert_eq!(got_t, want);
        // accumulate adds
        matmul(m, n, k, &a, Operand::row_major(0, k), &b, Operand::row_major(0, n), &mut got, 0, true).unwrap();
        assert!(got.iter().zip(&want).all(|(g, w)| *g == 2.0 * w));
    }

    #[test]
    fn linear_matches_naive_across_blocks() {
        // Goal: the blocked fully connected forward equals x·wᵀ + b for row counts below, at and
        // across block boundaries, with and without bias, at an offset into x and w.
        for &(rows, n_in, n_out) in &[(1usize, 3usize, 5usize), (70, 9, 600), (1000, 5, 48), (300, 17, 256)] {
            let x: Vec<f64> = (0..2 + rows * n_in).map(|i| ((i * 7) % 13) as f64 - 6.0).collect();
            let w: Vec<f64> = (0..1 + n_out * n_in).map(|i| ((i * 5) % 11) as f64 - 5.0).collect();
            let b: Vec<f64> = (0..n_out).map(|j| j as f64 * 0.5).collect();
            for bias in [Some(b.as_slice()), None] {
                let mut out = vec![f64::NAN; rows * n_out];
                linear(rows, n_in, n_out, &x, 2, &w, 1, bias, &mut out).unwrap();
                for r in 0..rows {
                    for j in 0..n_out {
                        let want: f64 = (0..n_in).map(|p| x[2 + r * n_in + p] * w[1 + j * n_in + p]).sum::<f64>() + bias.map_or(0.0, |b| b[j]);
                        assert_eq!(out[r * n_out + j], want, "({rows},{n_in},{n_out}) at ({r},{j})");
                    }
                }
            }
        }
        let mut out = vec![0.0f32; 4];
        assert!(matches!(linear(2, 2, 2, &[1.0f32; 3], 0, &[1.0; 4], 0, None, &mut out), Err(Error::BufferTooSmall { buffer: "x", .. })));
        assert!(matches!(linear(2, 2, 2, &[1.0f32; 4], 0, &[1.0; 4], 0, Some(&[0.0]), &mut out), Err(Error::BufferTooSmall { buffer: "bias", .. })));
    }

    #[test]
    fn short_buffers_are_an_error_not_ub() {
        let a = vec![1.0f32; 5];
        let b = vec![1.0f32; 6];
        let mut c = vec![0.0f32; 6];
        let err = matmul(2, 3, 3, &a, Operand::row_major(0, 3), &b, Operand::row_major(0, 3), &mut c, 0, false);
        assert!(matches!(err, Err(Error::BufferTooSmall { buffer: "lhs", .. })));
    }

    #[test]
    fn every_bad_length_is_a_typed_error() {
        let (a, b) = (vec![1.0f32; 6], vec![1.0f32; 6]);
        let mut c = vec![0.0f32; 4];
        let rm = Operand::row_major;
        let short = |buffer, needed, actual| Err(Error::BufferTooSmall { op: "matmul", buffer, needed, actual });
        assert_eq!(matmul(2, 2, 3, &a, rm(0, 3), &b, rm(0, 2), &mut c[..3], 0, false), short("dst", 4, 3));
        assert_eq!(matmul(2, 2, 3, &a, rm(0, 3), &b, rm(0, 2), &mut c, 1, false), short("dst", 5, 4));
        assert_eq!(matmul(2, 2, 3, &a, rm(1, 3), &b, rm(0, 2), &mut c, 0, false), short("lhs", 7, 6));
        assert_eq!(matmul(2, 2, 3, &a, rm(0, 3), &b, rm(1, 2), &mut c, 0, false), short("rhs", 7, 6));
        // Sizes and strides that would overflow are refused, not wrapped.
        assert_eq!(matmul(usize::MAX, 2, 3, &a, rm(0, 3), &b, rm(0, 2), &mut c, 0, false), short("dst", usize::MAX, 4));
        assert_eq!(matmul(2, 2, 3, &a, Operand { offset: 0, row_stride: usize::MAX / 2, col_stride: 1 }, &b, rm(0, 2), &mut c, 0, false), short("lhs", usize::MAX / 2 + 3, 6));
        assert!(matches!(matmul(1, 2, 3, &a, Operand { offset: 0, row_stride: usize::MAX, col_stride: 1 }, &b, rm(0, 2), &mut c, 0, false), Err(Error::InvalidArgument { arg: "lhs", .. })));
        assert_eq!(matmul(2, 2, 3, &a, rm(0, 3), &b, rm(0, 2), &mut c, 0, false), Ok(()));
        assert_eq!(c, [3.0; 4]);
    }
}
