//! Views that share storage: reshape, permute, transpose, narrow, expand, squeeze, unsqueeze,
//! flatten. Their backward maps the gradient back through the inverse view (expand sums).

use crate::error::{Error, Result};
use crate::layout::{normalize_dim, Layout};
use crate::pool::{self, Pooled};
use crate::storage::{CpuData, Storage};
use crate::tensor::Tensor;

impl Tensor {
    /// The same elements in a new shape (one dimension may be `usize::MAX` meaning "infer").
    /// A view when the layout allows, a copy otherwise.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        let shape = infer_shape(self, shape)?;
        if shape == self.shape() {
            return Ok(self.clone());
        }
        let src = if self.is_contiguous() { self.clone() } else { self.contiguous()? };
        let layout = src.layout().reshaped(&shape).ok_or_else(|| Error::BadShape { op: "reshape", shape: shape.clone(), reason: "layout not contiguous".into() })?;
        let orig = self.shape().to_vec();
        Ok(Tensor::with_node(src.storage().clone(), layout, src.dtype(), "reshape", &[&src], move |g: &Tensor, _: &Tensor| Ok(vec![Some(g.reshape(&orig)?)])))
    }

    /// Alias of [`Tensor::reshape`].
    pub fn view(&self, shape: &[usize]) -> Result<Tensor> {
        self.reshape(shape)
    }

    /// Dimensions reordered: output dim `i` is input dim `perm[i]`.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        let layout = self.layout().permuted(perm)?;
        let mut inverse = vec![0; perm.len()];
        for (i, &p) in perm.iter().enumerate() {
            inverse[p] = i;
        }
        Ok(Tensor::with_node(self.storage().clone(), layout, self.dtype(), "permute", &[self], move |g: &Tensor, _: &Tensor| Ok(vec![Some(g.permute(&inverse)?)])))
    }

    /// Swaps two dimensions (negative counts from the end).
    pub fn transpose(&self, d0: isize, d1: isize) -> Result<Tensor> {
        let rank = self.rank();
        let a = normalize_dim("transpose", d0, rank)?;
        let b = normalize_dim("transpose", d1, rank)?;
        let mut perm: Vec<usize> = (0..rank).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }

    /// Transpose of a matrix (last two dims).
    pub fn t(&self) -> Result<Tensor> {
        if self.rank() < 2 {
            return Err(Error::BadShape { op: "t", shape: self.shape().to_vec(), reason: "needs at least 2 dims".into() });
        }
        self.transpose(-2, -1)
    }

    /// Elements `start..start+len` along `dim`.
    pub fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor> {
        let d = normalize_dim("narrow", dim, self.rank())?;
        let layout = self.layout().narrowed(d, start, len)?;
        let full = self.shape()[d];
        Ok(Tensor::with_node(self.storage().clone(), layout, self.dtype(), "narrow", &[self], move |g: &Tensor, _: &Tensor| Ok(vec![Some(narrow_grad(g, d, start, full)?)])))
    }

    /// Broadcasts to `shape` without copying (stride 0 on expanded dims).
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Tensor> {
        if shape == self.shape() {
            return Ok(self.clone());
        }
        let layout = self.layout().broadcast_to(shape)?;
        let orig = self.shape().to_vec();
        Ok(Tensor::with_node(self.storage().clone(), layout, self.dtype(), "expand", &[self], move |g: &Tensor, _: &Tensor| Ok(vec![Some(g.sum_to_shape(&orig)?)])))
    }

    /// Alias of [`Tensor::broadcast_to`].
    pub fn expand(&self, shape: &[usize]) -> Result<Tensor> {
        self.broadcast_to(shape)
    }

    /// Inserts a dimension of size 1 at `dim` (negative counts from the end of the new rank).
    pub fn unsqueeze(&self, dim: isize) -> Result<Tensor> {
        let d = normalize_dim("unsqueeze", dim, self.rank() + 1)?;
        let mut shape = self.shape().to_vec();
        shape.insert(d, 1);
        let mut strides = self.layout().strides().to_vec();
        let s = if d < strides.len() { strides[d] * self.shape()[d] } else { 1 };
        strides.insert(d, s);
        let layout = Layout::new(shape, strides, self.layout().offset());
        let orig = self.shape().to_vec();
        Ok(Tensor::with_node(self.storage().clone(), layout, self.dtype(), "unsqueeze", &[self], move |g: &Tensor, _: &Tensor| Ok(vec![Some(g.reshape(&orig)?)])))
    }

    /// Removes dimension `dim`, which must have size 1.
    pub fn squeeze(&self, dim: isize) -> Result<Tensor> {
        let d = normalize_dim("squeeze", dim, self.rank())?;
        if self.shape()[d] != 1 {
            return Err(Error::BadShape { op: "squeeze", shape: self.shape().to_vec(), reason: format!("dim {d} has size {}", self.shape()[d]) });
        }
        let mut shape = self.shape().to_vec();
        let mut strides = self.layout().strides().to_vec();
        shape.remove(d);
        strides.remove(d);
        let layout = Layout::new(shape, strides, self.layout().offset());
        let orig = self.shape().to_vec();
        Ok(Tensor::with_node(self.storage().clone(), layout, self.dtype(), "squeeze", &[self], move |g: &Tensor, _: &Tensor| Ok(vec![Some(g.reshape(&orig)?)])))
    }

    /// Merges dims `start..=end` into one.
    pub fn flatten(&self, start: isize, end: isize) -> Result<Tensor> {
        if self.rank() == 0 {
            return self.reshape(&[1]);
        }
        let s = normalize_dim("flatten", start, self.rank())?;
        let e = normalize_dim("flatten", end, self.rank())?;
        if s > e {
            return Err(Error::InvalidArgument { op: "flatten", reason: format!("start {s} after end {e}") });
        }
        let mut shape: Vec<usize> = self.shape()[..s].to_vec();
        shape.push(self.shape()[s..=e].iter().product());
        shape.extend_from_slice(&self.shape()[e + 1..]);
        self.reshape(&shape)
    }
}

fn infer_shape(t: &Tensor, shape: &[usize]) -> Result<Vec<usize>> {
    let numel = t.numel();
    let unknown: Vec<usize> = shape.iter().enumerate().filter(|(_, &s)| s == usize::MAX).map(|(i, _)| i).collect();
    let bad = |reason: String| Error::BadShape { op: "reshape", shape: t.shape().to_vec(), reason };
    let mut out = shape.to_vec();
    match unknown.len() {
        0 => {}
        1 => {
            let known: usize = shape.iter().filter(|&&s| s != usize::MAX).product();
            if known == 0 || (numel / known) * known != numel {
                return Err(bad(format!("cannot infer a dimension of {shape:?}")));
            }
            out[unknown[0]] = numel / known;
        }
        _ => return Err(bad("at most one dimension can be inferred".into())),
    }
    if out.iter().product::<usize>() != numel {
        return Err(bad(format!("cannot view {numel} elements as {out:?}")));
    }
    Ok(out)
}

/// The gradient of a narrow: `g` placed at `start` along `dim` of a zero tensor `full` long there
/// (one pass over the output: copies the blocks of `g`, zero-fills the rest).
fn narrow_grad(g: &Tensor, dim: usize, start: usize, full: usize) -> Result<Tensor> {
    let shape = g.shape();
    let len = shape[dim];
    debug_assert!(start + len <= full, "narrow_grad: {start}+{len} > {full}");
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
    let mut full_shape = shape.to_vec();
    full_shape[dim] = full;
    let (block, full_block, at) = (len * inner, full * inner, start * inner);
    if let Some(device) = crate::backend::of(&[g]) {
        return device.narrow_grad(g, dim, start, full);
    }
    let src = g.to_data()?;
    let data = match &src {
        CpuData::F32(v) => CpuData::F32(pad_blocks(v, outer, block, full_block, at).into()),
        CpuData::F64(v) => CpuData::F64(pad_blocks(v, outer, block, full_block, at).into()),
        CpuData::BF16(v) => CpuData::BF16(pad_blocks(v, outer, block, full_block, at).into()),
        CpuData::U32(v) => CpuData::U32(pad_blocks(v, outer, block, full_block, at).into()),
        CpuData::I64(v) => CpuData::I64(pad_blocks(v, outer, block, full_block, at).into()),
    };
    pool::give_data(src);
    let dtype = g.dtype();
    Ok(Tensor::with_node(Storage::new(data), Layout::contiguous(&full_shape), dtype, "narrow_backward", &[g], move |gg: &Tensor, _: &Tensor| {
        Ok(vec![Some(gg.narrow(dim as isize, start, len)?)])
    }))
}

/// `outer` blocks of `block` elements of `src`, each placed at `at` inside a zeroed block of
/// `full_block`.
fn pad_blocks<T: Pooled>(src: &[T], outer: usize, block: usize, full_block: usize, at: usize) -> Vec<T> {
    assert_eq!(src.len(), outer * block, "pad_blocks: source length");
    assert!(at + block <= full_block, "pad_blocks: block past the end");
    let mut out = pool::take::<T>(outer * full_block);
    if full_block == 0 {
        return out;
    }
    for (dst, s) in out.chunks_mut(full_block).zip(src.chunks(block.max(1))) {
        dst[..at].fill(T::default());
        dst[at..at + block].copy_from_slice(s);
        dst[at + block..].fill(T::default());
    }
    out
}
