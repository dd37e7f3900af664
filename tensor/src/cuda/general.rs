//! The general forms of ops on CUDA tensors, beyond what a GPT step needs: `mul` of two operands
//! broadcast to one shape (views read through their strides, no copies), `matmul` with broadcast
//! batch dims (one cuBLAS strided-batched GEMM), `softmax`/`log_softmax` along the last
//! dimension, and `sum`/`mean` over any dims (a dense `[outer, reduce, inner]` view). f32 and bf16
//! storage, f32 inside every kernel (`rtx_kernels::cuda`'s `tensor_ops` module), sums in a fixed
//! order.
//!
//! `mul` and `matmul` return values only: the op above the switch point (`ops/binary.rs`,
//! `ops/matmul.rs`) records its backward once, in tensor ops, for every device; on a GPU those are
//! these same device ops (`g ⊙ b` summed back to a broadcast operand's shape is a `mul` and a
//! `sum`; `g · bᵀ` is a `matmul` of a transposed view). `softmax` and the sums record a device
//! backward here: the row kernel's, and for sums a dense copy of the broadcast gradient (a stride-0
//! view would reach device ops that need dense gradients).

use rtx_kernels::cuda::{BinaryOp, DeviceElem, Gemm, StridedSide};

use super::{dense, dense_detached, device, device_of, storage_buffer, tensor_from, GpuFloat};
use crate::error::Result;
use crate::ops::matmul::batch_offsets;
use crate::ops::reduce::reduced_shape;
use crate::tensor::Tensor;

// ---------------------------------------------------------------------------------------- mul

/// `a ⊙ b` broadcast to `shape` (checked by the op), without a graph node.
pub(crate) fn mul(a: &Tensor, b: &Tensor, shape: &[usize]) -> Result<Tensor> {
    dispatch!("mul", a.dtype(), mul_t(a, b, shape))
}

fn mul_t<T: GpuFloat>(a: &Tensor, b: &Tensor, shape: &[usize]) -> Result<Tensor> {
    const OP: &str = "mul";
    let (ordinal, dev) = device_of(OP, a)?;
    let (la, lb) = (a.layout().broadcast_to(shape)?, b.layout().broadcast_to(shape)?);
    let mut out = dev.alloc::<T>(shape.iter().product())?;
    {
        let (ba, bb) = (storage_buffer::<T>(OP, a)?, storage_buffer::<T>(OP, b)?);
        let side_a = StridedSide { strides: la.strides(), offset: la.offset() };
        let side_b = StridedSide { strides: lb.strides(), offset: lb.offset() };
        dev.binary_strided(BinaryOp::Mul, &ba, side_a, &bb, side_b, shape, &mut out)?;
    }
    Ok(tensor_from(ordinal, T::wrap(out), shape))
}

// ------------------------------------------------------------------------------------- matmul

/// `a [.., m, k] @ b [.., k, n]` with the batch dims broadcast to `batch` (checked by the op),
/// without a graph node.
pub(crate) fn matmul(a: &Tensor, b: &Tensor, batch: &[usize]) -> Result<Tensor> {
    dispatch!("matmul", a.dtype(), matmul_t(a, b, batch))
}

fn matmul_t<T: GpuFloat>(a: &Tensor, b: &Tensor, batch: &[usize]) -> Result<Tensor> {
    const OP: &str = "matmul";
    let (ordinal, dev) = device_of(OP, a)?;
    let (ra, rb) = (a.rank(), b.rank());
    let (m, k, n) = (a.shape()[ra - 2], a.shape()[ra - 1], b.shape()[rb - 1]);
    let n_batch: usize = batch.iter().product();
    let mut shape = batch.to_vec();
    shape.extend_from_slice(&[m, n]);
    let mut out = dev.alloc::<T>(n_batch * m * n)?;
    if n_batch * m * n == 0 {
        return Ok(tensor_from(ordinal, T::wrap(out), &shape));
    }
    if k == 0 {
        // An empty sum (cuBLAS refuses k = 0).
        dev.fill(&mut out, 0.0)?;
        return Ok(tensor_from(ordinal, T::wrap(out), &shape));
    }
    let ((a, trans_a), (b, trans_b)) = (gemm_operand(a)?, gemm_operand(b)?);
    let a_offs = batch_offsets(batch, a.shape(), a.layout().strides(), a.layout().offset());
    let b_offs = batch_offsets(batch, b.shape(), b.layout().strides(), b.layout().offset());
    let spec = Gemm { trans_a, trans_b, ..Gemm::new(m, n, k) };
    let (ba, bb) = (storage_buffer::<T>(OP, &a)?, storage_buffer::<T>(OP, &b)?);
    match (uniform_stride(&a_offs), uniform_stride(&b_offs)) {
        (Some(sa), Some(sb)) => {
            let batched = Gemm { batch: n_batch, offsets: [a_offs[0], b_offs[0], 0], batch_strides: Some([sa, sb, m * n]), ..spec };
            dev.gemm(&batched, &ba, &bb, &mut out)?;
        }
        // Batch offsets that no single stride describes (a broadcast inside the batch dims,
        // such as [2, 1] against [1, 3]): one product per batch index, in order.
        _ => {
            for (i, (&oa, &ob)) in a_offs.iter().zip(&b_offs).enumerate() {
                dev.gemm(&Gemm { offsets: [oa, ob, i * m * n], ..spec }, &ba, &bb, &mut out)?;
            }
        }
    }
    drop((ba, bb));
    Ok(tensor_from(ordinal, T::wrap(out), &shape))
}

/// `x` as a GEMM operand: every matrix (the last two dims, `[r, c]`) packed row-major (`false`)
/// or packed transposed, i.e. stored `[c, r]` row-major (`true`: a transposed view, as backward's
/// `bᵀ`), read in place; any other layout becomes a dense copy. The batch dims keep their strides.
fn gemm_operand(x: &Tensor) -> Result<(Tensor, bool)> {
    let (shape, strides) = (x.shape(), x.layout().strides());
    let rank = shape.len();
    Ok(match matrix_layout(shape[rank - 2], shape[rank - 1], strides[rank - 2], strides[rank - 1]) {
        Some(trans) => (x.detach(), trans),
        None => (dense_detached(x)?, false),
    })
}

/// How a matrix `[r, c]` with element strides `(rs, cs)` sits: `Some(false)` packed row-major,
/// `Some(true)` packed column-major (row-major `[c, r]`), `None` neither. A dimension of one
/// element takes any stride.
fn matrix_layout(r: usize, c: usize, rs: usize, cs: usize) -> Option<bool> {
    if (c <= 1 || cs == 1) && (r <= 1 || rs == c) {
        Some(false)
    } else if (r <= 1 || rs == 1) && (c <= 1 || cs == r) {
        Some(true)
    } else {
        None
    }
}

/// The common difference of `offsets` when they step evenly (0 for a broadcast operand, and for
/// a single offset); `None` when they do not.
fn uniform_stride(offsets: &[usize]) -> Option<usize> {
    let (&first, rest) = offsets.split_first()?;
    let Some(&second) = rest.first() else { return Some(0) };
    let step = second.checked_sub(first)?;
    offsets.windows(2).all(|w| w[1].checked_sub(w[0]) == Some(step)).then_some(step)
}

// ------------------------------------------------------------------------------------ softmax

/// Softmax (log-softmax with `log`) along the last dimension, recording its device backward.
pub(crate) fn softmax(x: &Tensor, log: bool) -> Result<Tensor> {
    dispatch!(if log { "log_softmax" } else { "softmax" }, x.dtype(), softmax_t(x, log))
}

fn softmax_t<T: GpuFloat>(x: &Tensor, log: bool) -> Result<Tensor> {
    let op = if log { "log_softmax" } else { "softmax" };
    let (ordinal, dev) = device_of(op, x)?;
    let n = x.shape().last().copied().unwrap_or(1);
    let mut y = dev.alloc::<T>(x.numel())?;
    {
        let src = dense_detached(x)?;
        dev.row_softmax(&*dense::<T>(op, &src)?, n, log, &mut y)?;
    }
    let out = tensor_from(ordinal, T::wrap(y), x.shape());
    Ok(Tensor::with_node(out.storage().clone(), out.layout().clone(), <T as DeviceElem>::DTYPE, op, &[x], move |g: &Tensor, y: &Tensor| {
        let dev = device(ordinal)?;
        let (g, y) = (dense_detached(g)?, dense_detached(y)?);
        let mut dx = dev.alloc::<T>(y.numel())?;
        dev.row_softmax_backward(&*dense::<T>(op, &y)?, &*dense::<T>(op, &g)?, n, log, &mut dx)?;
        Ok(vec![Some(tensor_from(ordinal, T::wrap(dx), y.shape()))])
    }))
}

// --------------------------------------------------------------------------------- sum, mean

/// The sum (with `mean`, the mean) over `dims` (sorted, unique, in range: checked by the op),
/// recording a backward that hands the input a dense gradient.
pub(crate) fn sum(x: &Tensor, dims: &[usize], keepdim: bool, mean: bool) -> Result<Tensor> {
    dispatch!(if mean { "mean" } else { "sum" }, x.dtype(), sum_t(x, dims, keepdim, mean))
}

fn sum_t<T: GpuFloat>(x: &Tensor, dims: &[usize], keepdim: bool, mean: bool) -> Result<Tensor> {
    let op = if mean { "mean" } else { "sum" };
    let (ordinal, dev) = device_of(op, x)?;
    let shape = x.shape();
    let count: usize = dims.iter().map(|&d| shape[d]).product();
    // A run of reduced dims is the middle of [outer, reduce, inner]; other sets are moved last
    // (kept dims first, in order) by a dense copy, which makes them a run with inner = 1.
    let (src, outer, inner) = if is_run(dims) {
        let (outer, inner) = axis_view(shape, dims);
        (dense_detached(x)?, outer, inner)
    } else {
        let kept: Vec<usize> = (0..shape.len()).filter(|d| !dims.contains(d)).collect();
        let outer = kept.iter().map(|&d| shape[d]).product();
        let perm: Vec<usize> = kept.iter().chain(dims).copied().collect();
        (dense_detached(&x.detach().permute(&perm)?)?, outer, 1)
    };
    let scale = if mean { (1.0 / count as f64) as f32 } else { 1.0 };
    let mut out = dev.alloc::<T>(outer * inner)?;
    dev.sum_axis(&*dense::<T>(op, &src)?, outer, count, inner, scale, &mut out)?;
    drop(src);
    let (out_shape, keep_shape, in_shape) = (reduced_shape(shape, dims, keepdim), reduced_shape(shape, dims, true), shape.to_vec());
    let y = tensor_from(ordinal, T::wrap(out), &out_shape);
    let inv_count = 1.0 / count.max(1) as f64;
    Ok(Tensor::with_node(y.storage().clone(), y.layout().clone(), <T as DeviceElem>::DTYPE, op, &[x], move |g: &Tensor, _: &Tensor| {
        let spread = super::views::contiguous(&g.reshape(&keep_shape)?.broadcast_to(&in_shape)?.detach())?;
        Ok(vec![Some(if mean { super::ops::mul_scalar(&spread, inv_count)? } else { spread })])
    }))
}

/// `(outer, inner)`: the products of the dims before the first and after the last of `dims`
/// (the whole tensor as one row when `dims` is empty).
fn axis_view(shape: &[usize], dims: &[usize]) -> (usize, usize) {
    match (dims.first(), dims.last()) {
        (Some(&first), Some(&last)) => (shape[..first].iter().product(), shape[last + 1..].iter().product()),
        _ => (shape.iter().product(), 1),
    }
}

/// Whether sorted `dims` are consecutive (an empty list is).
fn is_run(dims: &[usize]) -> bool {
    dims.windows(2).all(|w| w[1] == w[0] + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matrices_are_read_in_place_when_packed_either_way() {
        // Goal: which views the GEMM reads without a copy. Method: a [3, 4] matrix dense
        // (strides 4, 1), transposed from [4, 3] (strides 1, 3), a narrowed row-major slice
        // (row stride 8: neither), a broadcast one (stride 0: neither), and 1-wide shapes.
        assert_eq!(matrix_layout(3, 4, 4, 1), Some(false));
        assert_eq!(matrix_layout(3, 4, 1, 3), Some(true));
        assert_eq!(matrix_layout(3, 4, 8, 1), None);
        assert_eq!(matrix_layout(3, 4, 0, 1), None);
        assert_eq!(matrix_layout(1, 4, 99, 1), Some(false));
        assert_eq!(matrix_layout(3, 1, 1, 7), Some(false));
        assert_eq!(matrix_layout(1, 4, 5, 1), Some(false));
        assert_eq!(matrix_layout(1, 4, 1, 2), None);
        assert_eq!(matrix_layout(3, 4, 1, 4), None);
    }

    #[test]
    fn batch_offsets_become_one_stride_or_a_loop() {
        // Goal: when one strided-batched GEMM covers a batch. Method: packed, broadcast
        // (all equal), a single product, an uneven broadcast inside the batch, and a descent.
        assert_eq!(uniform_stride(&[0, 12, 24]), Some(12));
        assert_eq!(uniform_stride(&[5, 5, 5]), Some(0));
        assert_eq!(uniform_stride(&[7]), Some(0));
        assert_eq!(uniform_stride(&[0, 0, 0, 20, 20, 20]), None);
        assert_eq!(uniform_stride(&[20, 0]), None);
        assert_eq!(uniform_stride(&[]), None);
    }

    #[test]
    fn reductions_view_their_input_as_outer_reduce_inner() {
        // Goal: the [outer, reduce, inner] view of a reduction over a run of dims. Method:
        // [2, 3, 4, 5] over dims {1, 2}, {0}, {3}, all dims, and none (a rank-0 input).
        assert_eq!(axis_view(&[2, 3, 4, 5], &[1, 2]), (2, 5));
        assert_eq!(axis_view(&[2, 3, 4, 5], &[0]), (1, 60));
        assert_eq!(axis_view(&[2, 3, 4, 5], &[3]), (24, 1));
        assert_eq!(axis_view(&[2, 3, 4, 5], &[0, 1, 2, 3]), (1, 1));
        assert_eq!(axis_view(&[], &[]), (1, 1));
        assert!(is_run(&[1, 2, 3]) && is_run(&[]) && !is_run(&[0, 2]));
    }
}
