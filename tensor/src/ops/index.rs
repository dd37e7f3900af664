//! Indexing by u32 index tensors: embedding lookup, `index_select` and `gather`.
//!
//! The forward copies the selected elements bit-exactly (any dtype) into a fresh storage,
//! reading a contiguous input in place (an embedding table is never copied whole). The backward
//! scatter-adds the output gradient into zeros of the input's shape, serially in output order, so
//! repeated indices accumulate and the result is deterministic. Every index is range-checked
//! before anything is read: an out-of-range index is `Error::IndexOutOfRange`, never a panic.

use super::check_float;
use crate::error::{Error, Result};
use crate::layout::{contiguous_strides, normalize_dim};
use crate::ops::binary::compute_form;
use crate::storage::CpuData;
use crate::tensor::{FloatVec, Tensor};
use rtx_kernels::{DType, Float};

impl Tensor {
    /// Looks up rows of `weight` (`[V, D]`, float) for u32 `ids` of any shape; the result has
    /// shape `ids.shape + [D]`. The gradient with respect to `weight` adds each output row into
    /// the row it came from.
    pub fn embedding(weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
        const OP: &str = "embedding";
        check_float(OP, weight)?;
        check_index_dtype(OP, ids)?;
        if weight.rank() != 2 {
            return Err(Error::BadShape { op: OP, shape: weight.shape().to_vec(), reason: "weight must be [num_embeddings, dim]".into() });
        }
        if let Some(device) = crate::backend::of(&[weight]) {
            return device.embedding(weight, ids);
        }
        let idx = checked_indices(OP, ids, weight.shape()[0])?;
        let mut shape = ids.shape().to_vec();
        shape.push(weight.shape()[1]);
        select_along(OP, weight, 0, idx, &shape)
    }

    /// The slices of `self` along `dim` picked by the 1-d u32 `index` (repeats allowed), as
    /// `torch.index_select`. Works on every dtype; differentiable for floats.
    pub fn index_select(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        const OP: &str = "index_select";
        check_index_dtype(OP, index)?;
        let d = normalize_dim(OP, dim, self.rank())?;
        if index.rank() != 1 {
            return Err(Error::BadShape { op: OP, shape: index.shape().to_vec(), reason: "index must be 1-d".into() });
        }
        let idx = checked_indices(OP, index, self.shape()[d])?;
        let mut shape = self.shape().to_vec();
        shape[d] = idx.len();
        select_along(OP, self, d, idx, &shape)
    }

    /// `out[p] = self[p with p[dim] replaced by index[p]]`, as `torch.gather`: `index` (u32) has
    /// the rank of `self`, no dimension larger than `self`'s except `dim`, and gives the output
    /// shape. Works on every dtype; differentiable for floats.
    pub fn gather(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        const OP: &str = "gather";
        check_index_dtype(OP, index)?;
        let d = normalize_dim(OP, dim, self.rank())?;
        let fits = index.rank() == self.rank() && index.shape().iter().zip(self.shape()).enumerate().all(|(i, (&a, &b))| i == d || a <= b);
        if !fits {
            return Err(Error::ShapeMismatch { op: OP, lhs: self.shape().to_vec(), rhs: index.shape().to_vec() });
        }
        let idx = checked_indices(OP, index, self.shape()[d])?;
        let offsets = gather_offsets(self.shape(), index.shape(), d, &idx);
        debug_assert_eq!(offsets.len(), index.numel());
        let data = with_packed_data(self, |data, base| match data {
            CpuData::F32(v) => CpuData::F32(take(v, base, &offsets).into()),
            CpuData::F64(v) => CpuData::F64(take(v, base, &offsets).into()),
            CpuData::BF16(v) => CpuData::BF16(take(v, base, &offsets).into()),
            CpuData::U32(v) => CpuData::U32(take(v, base, &offsets).into()),
            CpuData::I64(v) => CpuData::I64(take(v, base, &offsets).into()),
        })?;
        let out = Tensor::from_data(data, index.shape())?;
        let in_shape = self.shape().to_vec();
        let dtype = self.dtype();
        Ok(Tensor::with_node(out.storage().clone(), out.layout().clone(), dtype, OP, &[self], move |g: &Tensor, _: &Tensor| {
            let numel: usize = in_shape.iter().product();
            let grad = crate::float_map!(compute_form(g)?, |gs: T| {
                let mut dst = crate::pool::zeroed::<T>(numel);
                for (&o, &v) in offsets.iter().zip(gs) {
                    dst[o] += v;
                }
                dst
            })?;
            Ok(vec![Some(Tensor::from_data(grad.into_data(dtype), &in_shape)?)])
        }))
    }
}

/// Indices are u32, or i64 as PyTorch's (each value is checked to fit when read).
fn check_index_dtype(op: &'static str, index: &Tensor) -> Result<()> {
    if !matches!(index.dtype(), DType::U32 | DType::I64) {
        return Err(Error::DTypeMismatch { op, lhs: index.dtype(), rhs: DType::U32 });
    }
    Ok(())
}

/// The indices, each checked to be below `size`.
fn checked_indices(op: &'static str, index: &Tensor, size: usize) -> Result<Vec<u32>> {
    let idx = index.to_u32_vec()?;
    if let Some(&bad) = idx.iter().find(|&&i| i as usize >= size) {
        return Err(Error::IndexOutOfRange { op, index: bad as usize, size });
    }
    Ok(idx)
}

/// Runs `f` on the packed row-major elements of `t` and the offset of its first element: the
/// storage itself when `t` is contiguous, a gathered copy otherwise.
fn with_packed_data<R>(t: &Tensor, f: impl FnOnce(&CpuData, usize) -> R) -> Result<R> {
    if t.is_contiguous() {
        let data = t.storage().read()?;
        Ok(f(&data, t.layout().offset()))
    } else {
        Ok(f(&t.to_data()?, 0))
    }
}

/// Selects the slices `idx` along dim `d` of `x` (indices already checked) into a tensor of
/// `out_shape`, recording the scatter-add backward.
fn select_along(op: &'static str, x: &Tensor, d: usize, idx: Vec<u32>, out_shape: &[usize]) -> Result<Tensor> {
    let outer: usize = x.shape()[..d].iter().product();
    let size = x.shape()[d];
    let inner: usize = x.shape()[d + 1..].iter().product();
    let data = with_packed_data(x, |data, base| match data {
        CpuData::F32(v) => CpuData::F32(take_rows(v, base, outer, size, inner, &idx).into()),
        CpuData::F64(v) => CpuData::F64(take_rows(v, base, outer, size, inner, &idx).into()),
        CpuData::BF16(v) => CpuData::BF16(take_rows(v, base, outer, size, inner, &idx).into()),
        CpuData::U32(v) => CpuData::U32(take_rows(v, base, outer, size, inner, &idx).into()),
        CpuData::I64(v) => CpuData::I64(take_rows(v, base, outer, size, inner, &idx).into()),
    })?;
    let out = Tensor::from_data(data, out_shape)?;
    let in_shape = x.shape().to_vec();
    let dtype = x.dtype();
    Ok(Tensor::with_node(out.storage().clone(), out.layout().clone(), dtype, op, &[x], move |g: &Tensor, _: &Tensor| {
        let grad: FloatVec = crate::float_map!(compute_form(g)?, |gs: T| scatter_add_rows(gs, outer, size, inner, &idx))?;
        Ok(vec![Some(Tensor::from_data(grad.into_data(dtype), &in_shape)?)])
    }))
}

/// `out[o, j, :] = src[base + (o, idx[j], :)]` for a packed `[outer, size, inner]` source.
fn take_rows<T: Copy>(src: &[T], base: usize, outer: usize, size: usize, inner: usize, idx: &[u32]) -> Vec<T> {
    let mut out = Vec::with_capacity(outer * idx.len() * inner);
    for o in 0..outer {
        for &i in idx {
            let start = base + (o * size + i as usize) * inner;
            out.extend_from_slice(&src[start..start + inner]);
        }
    }
    out
}

/// The adjoint of [`take_rows`]: `dst[o, idx[j], :] += g[o, j, :]`, in order.
fn scatter_add_rows<T: Float + crate::pool::Pooled>(g: &[T], outer: usize, size: usize, inner: usize, idx: &[u32]) -> Vec<T> {
    assert_eq!(g.len(), outer * idx.len() * inner, "scatter_add_rows: gradient length");
    let mut dst = crate::pool::zeroed::<T>(outer * size * inner);
    let mut rows = g.chunks_exact(inner.max(1));
    for o in 0..outer {
        for &i in idx {
            let Some(row) = rows.next() else { break };
            let start = (o * size + i as usize) * inner;
            for (a, &b) in dst[start..start + inner].iter_mut().zip(row) {
                *a = *a + b;
            }
        }
    }
    dst
}

/// `out[i] = src[base + offsets[i]]`.
fn take<T: Copy>(src: &[T], base: usize, offsets: &[usize]) -> Vec<T> {
    offsets.iter().map(|&o| src[base + o]).collect()
}

/// For every element of an index of `index_shape` (row-major), the packed offset in a source of
/// `src_shape` that gather reads: the element's own coordinates with `dim` replaced by its index.
fn gather_offsets(src_shape: &[usize], index_shape: &[usize], dim: usize, idx: &[u32]) -> Vec<usize> {
    let strides = contiguous_strides(src_shape);
    let rank = index_shape.len();
    let mut coord = vec![0usize; rank];
    let mut offsets = Vec::with_capacity(idx.len());
    for &i in idx {
        let off: usize = (0..rank).map(|d| if d == dim { i as usize } else { coord[d] } * strides[d]).sum();
        offsets.push(off);
        // Advance the row-major counter.
        for d in (0..rank).rev() {
            coord[d] += 1;
            if coord[d] < index_shape[d] {
                break;
            }
            coord[d] = 0;
        }
    }
    offsets
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedding_picks_rows_and_keeps_id_shape() {
        let w = Tensor::from_vec((0..6).map(|v| v as f32).collect(), &[3, 2]).unwrap();
        let ids = Tensor::from_vec(vec![2u32, 0, 2, 1], &[2, 2]).unwrap();
        let e = Tensor::embedding(&w, &ids).unwrap();
        assert_eq!(e.shape(), &[2, 2, 2]);
        assert_eq!(e.to_f32_vec().unwrap(), vec![4., 5., 0., 1., 4., 5., 2., 3.]);
        let bad = Tensor::from_vec(vec![3u32], &[1]).unwrap();
        assert!(matches!(Tensor::embedding(&w, &bad), Err(Error::IndexOutOfRange { op: "embedding", index: 3, size: 3 })));
    }

    #[test]
    fn gather_follows_torch_semantics() {
        // torch.gather([[1,2],[3,4]], 1, [[0,0],[1,0]]) == [[1,1],[4,3]]
        let x = Tensor::from_vec(vec![1.0f64, 2., 3., 4.], &[2, 2]).unwrap();
        let i = Tensor::from_vec(vec![0u32, 0, 1, 0], &[2, 2]).unwrap();
        assert_eq!(x.gather(1, &i).unwrap().to_f64_vec().unwrap(), vec![1., 1., 4., 3.]);
        // Along dim 0 with a shorter index.
        let i0 = Tensor::from_vec(vec![1u32, 0], &[1, 2]).unwrap();
        assert_eq!(x.gather(0, &i0).unwrap().to_f64_vec().unwrap(), vec![3., 2.]);
    }

    #[test]
    fn index_select_on_a_transposed_view() {
        let x = Tensor::from_vec((0..6).map(|v| v as f64).collect(), &[2, 3]).unwrap().t().unwrap();
        let i = Tensor::from_vec(vec![1u32, 1], &[2]).unwrap();
        assert_eq!(x.index_select(1, &i).unwrap().to_f64_vec().unwrap(), vec![3., 3., 4., 4., 5., 5.]);
    }
}
