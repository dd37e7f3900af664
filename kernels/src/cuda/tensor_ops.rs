//! The kernels of `tensor_ops.cu` behind typed calls on [`Device`], for f32 and bf16 storage
//! ([`StorageElem`]): a binary op of two strided operands broadcast to one shape
//! ([`Device::binary_strided`]), softmax and log-softmax along dense rows with their backward
//! ([`Device::row_softmax`], [`Device::row_softmax_backward`]), and sums over the middle axis of
//! a dense `[outer, reduce, inner]` view ([`Device::sum_axis`]). These are the general forms of
//! `mul`, `softmax`, `log_softmax`, `sum` and `mean` on GPU tensors (`rtx-tensor`'s
//! `cuda/general.rs`).
//!
//! Every call checks its buffers against the shape it is given before launching, so a kernel
//! never reads or writes outside them. Values are read into f32 and sums accumulate in f32 in a
//! fixed order (a block tree fixed by the shape, or one thread per output summing in order; no
//! atomics), so a rerun gives the same bits; results round to the storage type once.

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

use super::alloc::Buffer;
use super::device::Device;
use super::error::{check_len, CudaError, OpContext, Result};
use super::jepa::{extent, StridedSide};
use super::mixed::{grid_stride, int, kernel, StorageElem};
use super::nvrtc::Module;
use super::ops::BinaryOp;

/// Most dimensions of [`Device::binary_strided`] (the kernel's `MAX_BINARY_DIMS`).
pub const MAX_BINARY_DIMS: usize = 8;

/// Most threads of a one-block-per-row kernel.
const ROW_THREADS_MAX: usize = 256;

/// Mirrors `BinaryDims` in tensor_ops.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct BinaryDims {
    shape: [i64; MAX_BINARY_DIMS],
    a_stride: [i64; MAX_BINARY_DIMS],
    b_stride: [i64; MAX_BINARY_DIMS],
    a_offset: i64,
    b_offset: i64,
    n: i64,
    ndim: i32,
}

// SAFETY: plain old data with the field order, types and alignment of the kernel's `BinaryDims`.
unsafe impl DeviceRepr for BinaryDims {}

/// How `[outer, reduce, inner]` sums launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SumLaunch {
    /// `inner == 1`: one block of `threads` per output row.
    Rows { blocks: u32, threads: u32 },
    /// One thread per output, over a grid-stride loop of `n` outputs.
    Mid { n: usize },
}

fn i64_of(op: &'static str, v: usize) -> Result<i64> {
    i64::try_from(v).map_err(|_| CudaError::Unsupported { op, what: format!("{v} exceeds i64") })
}

/// Threads of a one-block-per-row launch over rows of `n`: a multiple of 32 from 32 to
/// [`ROW_THREADS_MAX`] (the block reductions need whole warps).
fn row_threads(n: usize) -> u32 {
    (n.div_ceil(32) * 32).clamp(32, ROW_THREADS_MAX) as u32
}

/// One block per row of `rows` (the grid's x dimension takes at most 2³¹ − 1).
fn per_row(op: &'static str, rows: usize, n: usize) -> Result<LaunchConfig> {
    let blocks = u32::try_from(rows)
        .ok()
        .filter(|&b| b <= i32::MAX as u32)
        .ok_or_else(|| CudaError::Unsupported { op, what: format!("{rows} rows exceed the grid") })?;
    Ok(LaunchConfig { grid_dim: (blocks.max(1), 1, 1), block_dim: (row_threads(n), 1, 1), shared_mem_bytes: 0 })
}

/// The kernel argument of a binary op over `shape` (checked: rank, stride counts).
fn binary_dims(op: &'static str, shape: &[usize], a: &StridedSide<'_>, b: &StridedSide<'_>) -> Result<BinaryDims> {
    if shape.len() > MAX_BINARY_DIMS || a.strides.len() != shape.len() || b.strides.len() != shape.len() {
        return Err(CudaError::Unsupported {
            op,
            what: format!("{} dimensions with {} and {} strides (at most {MAX_BINARY_DIMS})", shape.len(), a.strides.len(), b.strides.len()),
        });
    }
    let n: usize = shape.iter().product();
    let mut d = BinaryDims {
        n: i64_of(op, n)?,
        ndim: int(op, shape.len())?,
        a_offset: i64_of(op, a.offset)?,
        b_offset: i64_of(op, b.offset)?,
        ..BinaryDims::default()
    };
    for (k, &len) in shape.iter().enumerate() {
        d.shape[k] = i64_of(op, len)?;
        d.a_stride[k] = i64_of(op, a.strides[k])?;
        d.b_stride[k] = i64_of(op, b.strides[k])?;
    }
    Ok(d)
}

/// The elements of an `[outer, reduce, inner]` view and the launch of its sums (checked sizes).
fn sum_launch(op: &'static str, outer: usize, reduce: usize, inner: usize) -> Result<(usize, SumLaunch)> {
    let too_big = || CudaError::Unsupported { op, what: format!("[{outer}, {reduce}, {inner}] overflows") };
    let n_in = outer.checked_mul(reduce).and_then(|v| v.checked_mul(inner)).ok_or_else(too_big)?;
    let n_out = outer.checked_mul(inner).ok_or_else(too_big)?;
    i64_of(op, n_in)?;
    let launch = if inner == 1 {
        let blocks = u32::try_from(outer).ok().filter(|&b| b <= i32::MAX as u32).ok_or_else(too_big)?;
        SumLaunch::Rows { blocks, threads: row_threads(reduce) }
    } else {
        SumLaunch::Mid { n: n_out }
    };
    Ok((n_in, launch))
}

impl Device {
    /// `out = a ∘ b` over `shape` for `op` ∈ {add, sub, mul, div}: `out` is dense in `shape`
    /// (row-major), `a` and `b` are read through their own strides and offsets (a stride of 0
    /// broadcasts a dimension; views need no copy). Both sides must lie inside their buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn binary_strided<T: StorageElem>(
        &self,
        op: BinaryOp,
        a: &Buffer<T>,
        a_side: StridedSide<'_>,
        b: &Buffer<T>,
        b_side: StridedSide<'_>,
        shape: &[usize],
        out: &mut Buffer<T>,
    ) -> Result<()> {
        const OP: &str = "binary_strided";
        if !matches!(op, BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Div) {
            return Err(CudaError::Unsupported { op: OP, what: format!("{op:?} (add, sub, mul and div only)") });
        }
        let d = binary_dims(OP, shape, &a_side, &b_side)?;
        check_len(OP, "a", a.len(), extent(shape, &a_side))?;
        check_len(OP, "b", b.len(), extent(shape, &b_side))?;
        let n: usize = shape.iter().product();
        check_len(OP, "out", out.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(Module::TensorOps, kernel!(T, "binary_strided"))?;
        let (opi, ap, bp, op_) = (op as i32, a.device_ptr(), b.device_ptr(), out.device_ptr());
        let mut l = self.stream().launch_builder(&f);
        l.arg(&opi).arg(&ap).arg(&bp).arg(&op_).arg(&d);
        // SAFETY: every index the kernel forms lies below the extents checked above (out: n);
        // `BinaryDims` mirrors the kernel's struct.
        unsafe { l.launch(grid_stride(n)) }.op(OP)?;
        Ok(())
    }

    /// Softmax (or, with `log`, log-softmax) of each dense row of `n_cols` of `x` into `y`
    /// (`x.len()` a whole number of rows; `y` as long).
    pub fn row_softmax<T: StorageElem>(&self, x: &Buffer<T>, n_cols: usize, log: bool, y: &mut Buffer<T>) -> Result<()> {
        const OP: &str = "row_softmax";
        let rows = whole_rows(OP, x.len(), n_cols)?;
        check_len(OP, "y", y.len(), x.len())?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(Module::TensorOps, kernel!(T, "row_softmax"))?;
        let (xp, yp, n, take_log) = (x.device_ptr(), y.device_ptr(), int(OP, n_cols)?, log as i32);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&xp).arg(&yp).arg(&n).arg(&take_log);
        // SAFETY: rows·n_cols elements in both buffers, checked above.
        unsafe { l.launch(per_row(OP, rows, n_cols)?) }.op(OP)?;
        Ok(())
    }

    /// The backward of [`Device::row_softmax`] from its output `y` and the upstream gradient
    /// `dy`: softmax `dx = y ⊙ (dy − Σ y ⊙ dy)`, log-softmax `dx = dy − exp(y) · Σ dy`, per row.
    pub fn row_softmax_backward<T: StorageElem>(&self, y: &Buffer<T>, dy: &Buffer<T>, n_cols: usize, log: bool, dx: &mut Buffer<T>) -> Result<()> {
        const OP: &str = "row_softmax_backward";
        let rows = whole_rows(OP, y.len(), n_cols)?;
        check_len(OP, "dy", dy.len(), y.len())?;
        check_len(OP, "dx", dx.len(), y.len())?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(Module::TensorOps, kernel!(T, "row_softmax_backward"))?;
        let (yp, gp, dp, n, take_log) = (y.device_ptr(), dy.device_ptr(), dx.device_ptr(), int(OP, n_cols)?, log as i32);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&yp).arg(&gp).arg(&dp).arg(&n).arg(&take_log);
        // SAFETY: rows·n_cols elements in every buffer, checked above.
        unsafe { l.launch(per_row(OP, rows, n_cols)?) }.op(OP)?;
        Ok(())
    }

    /// `out[o, i] = scale · Σ_r x[o, r, i]` over the dense view `x [outer, reduce, inner]`
    /// (`out [outer, inner]`; `scale` 1 for a sum, `1/reduce` for a mean). Deterministic: the
    /// terms of each output are added in an order fixed by the shape.
    pub fn sum_axis<T: StorageElem>(&self, x: &Buffer<T>, outer: usize, reduce: usize, inner: usize, scale: f32, out: &mut Buffer<T>) -> Result<()> {
        const OP: &str = "sum_axis";
        let (n_in, launch) = sum_launch(OP, outer, reduce, inner)?;
        check_len(OP, "x", x.len(), n_in)?;
        check_len(OP, "out", out.len(), outer * inner)?;
        if outer * inner == 0 {
            return Ok(());
        }
        let (xp, op_, r) = (x.device_ptr(), out.device_ptr(), i64_of(OP, reduce)?);
        match launch {
            SumLaunch::Rows { blocks, threads } => {
                let f = self.function(Module::TensorOps, kernel!(T, "reduce_sum_rows"))?;
                let mut l = self.stream().launch_builder(&f);
                l.arg(&xp).arg(&op_).arg(&r).arg(&scale);
                let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
                // SAFETY: x holds outer·reduce elements and out outer, checked above.
                unsafe { l.launch(cfg) }.op(OP)?;
            }
            SumLaunch::Mid { n } => {
                let f = self.function(Module::TensorOps, kernel!(T, "reduce_sum_mid"))?;
                let (o, i) = (i64_of(OP, outer)?, i64_of(OP, inner)?);
                let mut l = self.stream().launch_builder(&f);
                l.arg(&xp).arg(&op_).arg(&o).arg(&r).arg(&i).arg(&scale);
                // SAFETY: x holds outer·reduce·inner elements and out outer·inner, checked above.
                unsafe { l.launch(grid_stride(n)) }.op(OP)?;
            }
        }
        Ok(())
    }
}

/// Rows of `n_cols` in `len` elements (an error unless whole; no rows of zero columns unless empty).
fn whole_rows(op: &'static str, len: usize, n_cols: usize) -> Result<usize> {
    if n_cols == 0 {
        return if len == 0 { Ok(0) } else { Err(CudaError::Unsupported { op, what: "rows of zero columns".into() }) };
    }
    if !len.is_multiple_of(n_cols) {
        return Err(CudaError::Unsupported { op, what: format!("length {len} is not a whole number of rows of {n_cols}") });
    }
    Ok(len / n_cols)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_dims_mirror_the_kernel_struct() {
        // Goal: the launcher's argument for a broadcast view, checked without a GPU. Method: a
        // [2, 3] operand against a row [3] broadcast with stride 0 at offset 5; the struct's size
        // matches the CUDA struct (3·8 i64, 3 i64, an int padded to 8).
        let (sa, sb) = ([3usize, 1], [0usize, 1]);
        let d = binary_dims("t", &[2, 3], &StridedSide { strides: &sa, offset: 0 }, &StridedSide { strides: &sb, offset: 5 }).unwrap();
        assert_eq!((d.ndim, d.n, d.a_offset, d.b_offset), (2, 6, 0, 5));
        assert_eq!((&d.shape[..2], &d.a_stride[..2], &d.b_stride[..2]), (&[2i64, 3][..], &[3i64, 1][..], &[0i64, 1][..]));
        assert_eq!(std::mem::size_of::<BinaryDims>(), 3 * 8 * MAX_BINARY_DIMS + 3 * 8 + 8);
        // A scalar (rank 0) is one element; too many dims or a stride count off is refused.
        assert_eq!(binary_dims("t", &[], &StridedSide { strides: &[], offset: 2 }, &StridedSide { strides: &[], offset: 0 }).unwrap().n, 1);
        assert!(binary_dims("t", &[1; 9], &StridedSide { strides: &[1; 9], offset: 0 }, &StridedSide { strides: &[1; 9], offset: 0 }).is_err());
        assert!(binary_dims("t", &[2, 3], &StridedSide { strides: &[1], offset: 0 }, &StridedSide { strides: &sb, offset: 0 }).is_err());
    }

    #[test]
    fn sums_launch_by_rows_or_by_outputs() {
        // Goal: the choice of kernel and the sizes checked before a sum launches. Method: a row
        // reduction (inner 1), a column reduction, and an overflowing shape.
        assert_eq!(sum_launch("t", 3, 5, 1).unwrap(), (15, SumLaunch::Rows { blocks: 3, threads: 32 }));
        assert_eq!(sum_launch("t", 1, 100_000, 1).unwrap(), (100_000, SumLaunch::Rows { blocks: 1, threads: ROW_THREADS_MAX as u32 }));
        assert_eq!(sum_launch("t", 2, 3, 5).unwrap(), (30, SumLaunch::Mid { n: 10 }));
        assert_eq!(sum_launch("t", 1, 3, 5).unwrap(), (15, SumLaunch::Mid { n: 5 }));
        assert!(sum_launch("t", usize::MAX, 2, 1).is_err());
        assert!(sum_launch("t", 1 << 32, 1, 1).is_err());
    }

    #[test]
    fn rows_are_whole_and_blocks_are_whole_warps() {
        // Goal: the row checks and block sizes of the softmax launches.
        assert_eq!(whole_rows("t", 36, 9).unwrap(), 4);
        assert_eq!(whole_rows("t", 0, 0).unwrap(), 0);
        assert!(whole_rows("t", 10, 0).is_err());
        assert!(whole_rows("t", 10, 3).is_err());
        assert_eq!([row_threads(1), row_threads(33), row_threads(50_257)], [32, 64, ROW_THREADS_MAX as u32]);
        assert_eq!(ROW_THREADS_MAX % 32, 0);
    }
}
