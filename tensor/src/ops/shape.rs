//! Joining and splitting: cat, stack, split, chunk. Split and chunk are narrow views; cat and
//! stack copy into a fresh storage and route gradient slices back to their inputs.

use crate::error::{Error, Result};
use crate::layout::normalize_dim;
use crate::pool::{self, Pooled};
use crate::storage::CpuData;
use crate::tensor::Tensor;

fn concat_data(parts: &[CpuData], outer: usize, inner: &[usize]) -> CpuData {
    macro_rules! join {
        ($variant:ident) => {{
            let slices: Vec<&[_]> = parts.iter().filter_map(|p| if let CpuData::$variant(v) = p { Some(v.as_slice()) } else { None }).collect();
            debug_assert_eq!(slices.len(), parts.len(), "concat_data: mixed dtypes");
            CpuData::$variant(join_blocks(&slices, outer, inner).into())
        }};
    }
    match parts.first() {
        Some(CpuData::F64(_)) => join!(F64),
        Some(CpuData::BF16(_)) => join!(BF16),
        Some(CpuData::U32(_)) => join!(U32),
        Some(CpuData::I64(_)) => join!(I64),
        _ => join!(F32),
    }
}

/// For each of `outer` rows, the `inner[p]`-long block `o` of every part in turn.
fn join_blocks<T: Pooled>(parts: &[&[T]], outer: usize, inner: &[usize]) -> Vec<T> {
    let row: usize = inner.iter().sum();
    let mut out = pool::take::<T>(row * outer);
    let mut pos = 0;
    for o in 0..outer {
        for (p, &w) in parts.iter().zip(inner) {
            out[pos..pos + w].copy_from_slice(&p[o * w..(o + 1) * w]);
            pos += w;
        }
    }
    debug_assert_eq!(pos, out.len());
    out
}

impl Tensor {
    /// Concatenates along `dim`; all other dims must match.
    pub fn cat(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let first = tensors.first().ok_or_else(|| Error::InvalidArgument { op: "cat", reason: "no tensors".into() })?;
        let d = normalize_dim("cat", dim, first.rank())?;
        for t in tensors.iter().skip(1) {
            super::check_same("cat", first, t)?;
            let same_rank = t.rank() == first.rank();
            if !same_rank || t.shape().iter().zip(first.shape()).enumerate().any(|(i, (a, b))| i != d && a != b) {
                return Err(Error::ShapeMismatch { op: "cat", lhs: first.shape().to_vec(), rhs: t.shape().to_vec() });
            }
        }
        if let Some(device) = crate::backend::of(tensors) {
            return device.cat(tensors, d);
        }
        let outer: usize = first.shape()[..d].iter().product();
        let inner: Vec<usize> = tensors.iter().map(|t| t.shape()[d..].iter().product()).collect();
        let parts: Vec<CpuData> = tensors.iter().map(|t| t.to_data()).collect::<Result<_>>()?;
        let data = concat_data(&parts, outer, &inner);
        parts.into_iter().for_each(pool::give_data);
        let sizes: Vec<usize> = tensors.iter().map(|t| t.shape()[d]).collect();
        let mut shape = first.shape().to_vec();
        shape[d] = sizes.iter().sum();
        let dtype = first.dtype();
        let t = Tensor::from_data(data, &shape)?;
        Ok(Tensor::with_node(t.storage().clone(), t.layout().clone(), dtype, "cat", tensors, move |g: &Tensor, _: &Tensor| {
            let mut start = 0;
            let mut grads = Vec::with_capacity(sizes.len());
            for &s in &sizes {
                grads.push(Some(g.narrow(d as isize, start, s)?));
                start += s;
            }
            Ok(grads)
        }))
    }

    /// Stacks equal-shaped tensors along a new dim.
    pub fn stack(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let first = tensors.first().ok_or_else(|| Error::InvalidArgument { op: "stack", reason: "no tensors".into() })?;
        let d = normalize_dim("stack", dim, first.rank() + 1)?;
        let expanded = tensors.iter().map(|t| t.unsqueeze(d as isize)).collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Tensor> = expanded.iter().collect();
        Tensor::cat(&refs, d as isize)
    }

    /// Splits along `dim` into pieces of `size` (the last may be shorter); views.
    pub fn split(&self, size: usize, dim: isize) -> Result<Vec<Tensor>> {
        if size == 0 {
            return Err(Error::InvalidArgument { op: "split", reason: "split size must be positive".into() });
        }
        let d = normalize_dim("split", dim, self.rank())?;
        let n = self.shape()[d];
        (0..n).step_by(size).map(|s| self.narrow(d as isize, s, size.min(n - s))).collect()
    }

    /// Splits along `dim` into `chunks` nearly equal views (as `torch.chunk`).
    pub fn chunk(&self, chunks: usize, dim: isize) -> Result<Vec<Tensor>> {
        if chunks == 0 {
            return Err(Error::InvalidArgument { op: "chunk", reason: "chunk count must be positive".into() });
        }
        let d = normalize_dim("chunk", dim, self.rank())?;
        let size = self.shape()[d].div_ceil(chunks).max(1);
        self.split(size, d as isize)
    }
}
