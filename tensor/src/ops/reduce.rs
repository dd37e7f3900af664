//! Reductions over dimensions: sum, mean, max, min, var, argmax/argmin, and `sum_to_shape`
//! (the adjoint of broadcasting). Any set of dims is brought to a row or column reduction for the
//! kernels in `rtx_kernels::reduce`.

use super::check_float;
use crate::error::{Error, Result};
use crate::layout::normalize_dim;
use crate::tensor::Tensor;
use rtx_kernels::reduce::{self, RowOp};
use rtx_kernels::{DType, Float};

/// Normalised, sorted, unique dims; empty input means every dim.
fn reduce_dims(op: &'static str, x: &Tensor, dims: &[isize]) -> Result<Vec<usize>> {
    if dims.is_empty() {
        return Ok((0..x.rank()).collect());
    }
    let mut out = dims.iter().map(|&d| normalize_dim(op, d, x.rank())).collect::<Result<Vec<_>>>()?;
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// [`reduce_dims`] of a float tensor (the checks every reduction makes before it runs).
fn float_reduce_dims(op: &'static str, x: &Tensor, dims: &[isize]) -> Result<Vec<usize>> {
    check_float(op, x)?;
    reduce_dims(op, x, dims)
}

/// Output shape of a reduction.
pub(crate) fn reduced_shape(shape: &[usize], dims: &[usize], keepdim: bool) -> Vec<usize> {
    let mut out = Vec::new();
    for (i, &s) in shape.iter().enumerate() {
        if dims.contains(&i) {
            if keepdim {
                out.push(1);
            }
        } else {
            out.push(s);
        }
    }
    out
}

/// Arranges `x` so the reduced dims are the trailing, contiguous ones; returns it with the
/// number of rows and the row length.
fn as_rows(x: &Tensor, dims: &[usize]) -> Result<(Tensor, usize, usize)> {
    let rank = x.rank();
    let kept: Vec<usize> = (0..rank).filter(|d| !dims.contains(d)).collect();
    let row_len: usize = dims.iter().map(|&d| x.shape()[d]).product();
    let n_rows: usize = kept.iter().map(|&d| x.shape()[d]).product();
    let mut perm = kept;
    perm.extend_from_slice(dims);
    let arranged = if perm.iter().enumerate().all(|(i, &p)| i == p) { x.detach() } else { x.detach().permute(&perm)? };
    Ok((arranged, n_rows, row_len))
}

#[allow(clippy::assign_op_pattern)] // the element types implement `Mul`, not `MulAssign`
fn reduce_values(op_name: &'static str, x: &Tensor, dims: &[usize], op: RowOp) -> Result<crate::tensor::FloatVec> {
    let rank = x.rank();
    let leading = dims.iter().enumerate().all(|(i, &d)| i == d);
    let is_sum = matches!(op, RowOp::Sum | RowOp::Mean);
    if leading && is_sum && dims.len() < rank && x.is_contiguous() {
        // Column sums: reduce the leading dims without a transpose.
        let n_rows: usize = dims.iter().map(|&d| x.shape()[d]).product();
        let n_cols = x.numel() / n_rows.max(1);
        let mean = matches!(op, RowOp::Mean);
        return crate::try_float_map!(x, |s: T| {
            let mut out = crate::pool::zeroed::<T>(n_cols);
            if n_rows > 0 {
                reduce::sum_cols(s, n_rows, n_cols, &mut out)?;
            }
            if mean {
                let k = T::from_f64_lossy(1.0 / n_rows as f64);
                out.iter_mut().for_each(|v| *v = *v * k);
            }
            Ok::<_, Error>(out)
        });
    }
    let _ = op_name;
    let (rows, n_rows, row_len) = as_rows(x, dims)?;
    crate::try_float_map!(rows, |s: T| {
        let mut out = crate::pool::zeroed::<T>(n_rows);
        reduce::rows(s, row_len, &mut out, op).map(|()| out)
    })
}

impl Tensor {
    fn reduce_op(&self, name: &'static str, dims: &[isize], keepdim: bool, op: RowOp) -> Result<(Tensor, Vec<usize>, Vec<usize>)> {
        check_float(name, self)?;
        super::check_host(name, self)?;
        let d = reduce_dims(name, self, dims)?;
        let values = reduce_values(name, self, &d, op)?;
        let shape = reduced_shape(self.shape(), &d, keepdim);
        let keep_shape = reduced_shape(self.shape(), &d, true);
        let t = Tensor::from_data(values.into_data(self.dtype()), &shape)?;
        Ok((t, d, keep_shape))
    }

    /// Sum over `dims` (all dims when empty).
    pub fn sum(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        if let Some(device) = crate::backend::of(&[self]) {
            return device.sum(self, &float_reduce_dims("sum", self, dims)?, keepdim, false);
        }
        let (t, _, keep) = self.reduce_op("sum", dims, keepdim, RowOp::Sum)?;
        let in_shape = self.shape().to_vec();
        Ok(Tensor::with_node(t.storage().clone(), t.layout().clone(), t.dtype(), "sum", &[self], move |g: &Tensor, _: &Tensor| Ok(vec![Some(g.reshape(&keep)?.broadcast_to(&in_shape)?)])))
    }

    /// Sum of every element, as a scalar.
    pub fn sum_all(&self) -> Result<Tensor> {
        self.sum(&[], false)
    }

    /// Mean over `dims` (all dims when empty).
    pub fn mean(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        if let Some(device) = crate::backend::of(&[self]) {
            return device.sum(self, &float_reduce_dims("mean", self, dims)?, keepdim, true);
        }
        let (t, d, keep) = self.reduce_op("mean", dims, keepdim, RowOp::Mean)?;
        let count: usize = d.iter().map(|&i| self.shape()[i]).product();
        let in_shape = self.shape().to_vec();
        Ok(Tensor::with_node(t.storage().clone(), t.layout().clone(), t.dtype(), "mean", &[self], move |g: &Tensor, _: &Tensor| {
            Ok(vec![Some(g.reshape(&keep)?.mul_scalar(1.0 / count.max(1) as f64)?.broadcast_to(&in_shape)?)])
        }))
    }

    /// Mean of every element, as a scalar.
    pub fn mean_all(&self) -> Result<Tensor> {
        self.mean(&[], false)
    }

    /// Maximum over `dims`; the gradient is shared evenly among tied maxima.
    pub fn max(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        self.extreme("max", dims, keepdim, RowOp::Max)
    }

    /// Minimum over `dims`; the gradient is shared evenly among tied minima.
    pub fn min(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        self.extreme("min", dims, keepdim, RowOp::Min)
    }

    fn extreme(&self, name: &'static str, dims: &[isize], keepdim: bool, op: RowOp) -> Result<Tensor> {
        if self.numel() == 0 {
            return Err(Error::BadShape { op: name, shape: self.shape().to_vec(), reason: "reduction over an empty tensor has no identity".into() });
        }
        let (t, d, keep) = self.reduce_op(name, dims, keepdim, op)?;
        let input = self.detach();
        let dims_i: Vec<isize> = d.iter().map(|&x| x as isize).collect();
        Ok(Tensor::with_node(t.storage().clone(), t.layout().clone(), t.dtype(), name, &[self], move |g: &Tensor, out: &Tensor| {
            let hit = input.eq(&out.reshape(&keep)?)?.to_dtype(input.dtype())?;
            let ties = hit.sum(&dims_i, true)?;
            Ok(vec![Some(hit.div(&ties)?.mul(&g.reshape(&keep)?)?)])
        }))
    }

    /// Variance over `dims` with Bessel's `correction` (1 = unbiased, as PyTorch's default).
    pub fn var(&self, dims: &[isize], keepdim: bool, correction: usize) -> Result<Tensor> {
        let (t, d, keep) = self.reduce_op("var", dims, keepdim, RowOp::Var { correction })?;
        let count: usize = d.iter().map(|&i| self.shape()[i]).product();
        let input = self.detach();
        let dims_i: Vec<isize> = d.iter().map(|&x| x as isize).collect();
        Ok(Tensor::with_node(t.storage().clone(), t.layout().clone(), t.dtype(), "var", &[self], move |g: &Tensor, _: &Tensor| {
            let centered = input.sub(&input.mean(&dims_i, true)?)?;
            let k = 2.0 / (count.saturating_sub(correction).max(1)) as f64;
            Ok(vec![Some(centered.mul_scalar(k)?.mul(&g.reshape(&keep)?)?)])
        }))
    }

    /// Index of the maximum along `dim` (first on ties), as u32.
    pub fn argmax(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        self.arg_extreme("argmax", dim, keepdim, false)
    }

    /// Index of the minimum along `dim` (first on ties), as u32.
    pub fn argmin(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        self.arg_extreme("argmin", dim, keepdim, true)
    }

    fn arg_extreme(&self, name: &'static str, dim: isize, keepdim: bool, min: bool) -> Result<Tensor> {
        check_float(name, self)?;
        let d = normalize_dim(name, dim, self.rank())?;
        if self.shape()[d] == 0 {
            return Err(Error::BadShape { op: name, shape: self.shape().to_vec(), reason: format!("dim {d} is empty") });
        }
        let (rows, n_rows, row_len) = as_rows(self, &[d])?;
        let mut out = vec![0u32; n_rows];
        rows.with_float_slice(|s| match s {
            crate::tensor::FloatSlice::F32(x) => reduce::arg_rows(x, row_len, &mut out, min),
            crate::tensor::FloatSlice::F64(x) => reduce::arg_rows(x, row_len, &mut out, min),
        })??;
        Tensor::from_vec(out, &reduced_shape(self.shape(), &[d], keepdim))
    }

    /// Sums a broadcast result back to `shape` (the adjoint of [`Tensor::broadcast_to`]).
    pub fn sum_to_shape(&self, shape: &[usize]) -> Result<Tensor> {
        if self.shape() == shape {
            return Ok(self.clone());
        }
        let rank = self.rank();
        if shape.len() > rank {
            return Err(Error::ShapeMismatch { op: "sum_to_shape", lhs: self.shape().to_vec(), rhs: shape.to_vec() });
        }
        let lead = rank - shape.len();
        let mut dims = Vec::new();
        for i in 0..rank {
            if i < lead || (shape[i - lead] == 1 && self.shape()[i] != 1) {
                dims.push(i as isize);
            } else if shape[i - lead] != self.shape()[i] {
                return Err(Error::ShapeMismatch { op: "sum_to_shape", lhs: self.shape().to_vec(), rhs: shape.to_vec() });
            }
        }
        if dims.is_empty() {
            return self.reshape(shape);
        }
        self.sum(&dims, true)?.reshape(shape)
    }

    /// Fraction of positions where `self` (u32 labels) equals `other`.
    pub fn accuracy(predictions: &Tensor, labels: &Tensor) -> Result<f64> {
        if predictions.dtype() != DType::U32 || labels.dtype() != DType::U32 {
            return Err(Error::DTypeMismatch { op: "accuracy", lhs: predictions.dtype(), rhs: labels.dtype() });
        }
        if predictions.shape() != labels.shape() {
            return Err(Error::ShapeMismatch { op: "accuracy", lhs: predictions.shape().to_vec(), rhs: labels.shape().to_vec() });
        }
        let (p, l) = (predictions.to_u32_vec()?, labels.to_u32_vec()?);
        let hits = p.iter().zip(&l).filter(|(a, b)| a == b).count();
        Ok(hits as f64 / p.len().max(1) as f64)
    }
}
