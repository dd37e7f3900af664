//! Matrix multiplication through the `gemm` crate, on strided operands so transposes are free.
//!
//! `dst[m×n] (row-major, contiguous) = lhs[m×k] · rhs[k×n]` (+ `dst` when accumulating), where
//! `lhs` and `rhs` are described by an offset and a row and column stride into their slices.
//! Batches are a loop over offsets; the caller computes them. Large products use the shared
//! thread pool (see [`crate::threading`]).

use crate::error::{Error, Result};
use crate::float::Float;
use crate::threading::num_threads;

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
    if k == 0 {
        if !accumulate {
            dst[dst_offset..dst_needed].fill(T::zero());
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
    let parallelism = if m.saturating_mul(n).saturating_mul(k) >= PARALLEL_MIN_FLOPS && num_threads() > 1 {
        gemm::Parallelism::Rayon(num_threads())
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the three bounds checks above guarantee every index gemm touches,
    // offset + i*row_stride + j*col_stride for i < rows, j < cols, lies inside its slice;
    // dst does not alias lhs or rhs because it is borrowed mutably.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr().add(dst_offset),
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
