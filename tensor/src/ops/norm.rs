//! Layer normalization and RMS normalization over the last dimension, through the fused row
//! kernels in `rtx_kernels::norm`.
//!
//! The forward keeps what the backward needs: the (detached) input, the per-row statistics
//! (mean and reciprocal standard deviation, in the compute type) and the weight. The backward
//! produces the input, weight and bias gradients in one pass over the rows. bf16 tensors compute
//! in f32 and round on output, like every other op.

use super::{check_float, check_same};
use crate::error::{Error, Result};
use crate::ops::binary::compute_form;
use crate::tensor::{FloatSlice, FloatVec, Tensor};
use rtx_kernels::norm as k;
use rtx_kernels::{DType, Float};

impl Tensor {
    /// Layer normalization over the last dimension: `(x − mean) / sqrt(var + eps) · weight + bias`
    /// with the biased variance, as `torch.nn.functional.layer_norm`. `weight` and `bias` have
    /// shape `[last dim]` and the dtype of `self`.
    pub fn layer_norm(&self, weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f64) -> Result<Tensor> {
        let n = check_norm_args("layer_norm", self, &[weight, bias], eps)?;
        if let Some(device) = crate::backend::of(&[self]) {
            return device.layer_norm(self, weight, bias, eps);
        }
        if self.dtype() == DType::F64 {
            layer_norm_typed::<f64>(self, n, weight, bias, eps)
        } else {
            layer_norm_typed::<f32>(self, n, weight, bias, eps)
        }
    }

    /// The residual add fused with the layer norm that follows it, as a pre-norm transformer
    /// runs them: returns `(s, s.layer_norm(weight, bias, eps))` for `s = self + other`
    /// (`other`'s shape equal to or a suffix of `self`'s). The graph is the one of the two ops;
    /// on a GPU, bf16 rows of GPT widths take one kernel pass for both (the sum is not read back),
    /// and the norm's backward adds the sum's other gradient in its own pass. Elsewhere it is
    /// the two ops.
    pub fn add_layer_norm(&self, other: &Tensor, weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f64) -> Result<(Tensor, Tensor)> {
        if let Some(device) = crate::backend::of(&[self]) {
            check_norm_args("add_layer_norm", self, &[weight, bias], eps)?;
            return device.add_layer_norm(self, other, weight, bias, eps);
        }
        let s = self.add(other)?;
        let y = s.layer_norm(weight, bias, eps)?;
        Ok((s, y))
    }

    /// RMS normalization over the last dimension: `x / sqrt(mean(x²) + eps) · weight`.
    /// `weight` has shape `[last dim]` and the dtype of `self`.
    pub fn rms_norm(&self, weight: Option<&Tensor>, eps: f64) -> Result<Tensor> {
        let n = check_norm_args("rms_norm", self, &[weight], eps)?;
        if self.dtype() == DType::F64 {
            rms_norm_typed::<f64>(self, n, weight, eps)
        } else {
            rms_norm_typed::<f32>(self, n, weight, eps)
        }
    }
}

/// A compute type (f32 for f32/bf16 tensors, f64 for f64 ones) and how to reach a tensor's
/// elements in it.
pub(crate) trait Compute: Float + crate::pool::Pooled {
    /// The slice when `s` holds this type.
    fn pick(s: FloatSlice<'_>) -> Option<&[Self]>;
    /// Wraps results.
    fn wrap(v: Vec<Self>) -> FloatVec;
    /// A contiguous owned copy of a (small) tensor's elements.
    fn owned(t: &Tensor) -> Result<Vec<Self>>;
}

impl Compute for f32 {
    fn pick(s: FloatSlice<'_>) -> Option<&[f32]> {
        match s {
            FloatSlice::F32(x) => Some(x),
            FloatSlice::F64(_) => None,
        }
    }
    fn wrap(v: Vec<f32>) -> FloatVec {
        FloatVec::F32(v)
    }
    fn owned(t: &Tensor) -> Result<Vec<f32>> {
        t.to_f32_vec()
    }
}

impl Compute for f64 {
    fn pick(s: FloatSlice<'_>) -> Option<&[f64]> {
        match s {
            FloatSlice::F64(x) => Some(x),
            FloatSlice::F32(_) => None,
        }
    }
    fn wrap(v: Vec<f64>) -> FloatVec {
        FloatVec::F64(v)
    }
    fn owned(t: &Tensor) -> Result<Vec<f64>> {
        t.to_f64_vec()
    }
}

/// Runs `f` on the compute slices of two tensors of one dtype (`b` is widened first when bf16).
pub(crate) fn with_two_slices<T: Compute, R>(op: &'static str, a: &Tensor, b: &Tensor, f: impl FnOnce(&[T], &[T]) -> R) -> Result<R> {
    let b = compute_form(b)?;
    let mismatch = || Error::DTypeMismatch { op, lhs: a.dtype(), rhs: b.dtype() };
    a.with_float_slice(|sa| {
        b.with_float_slice(|sb| match (T::pick(sa), T::pick(sb)) {
            (Some(x), Some(y)) => Ok(f(x, y)),
            _ => Err(mismatch()),
        })
    })?
    .and_then(|r| r)
}

/// Validates a normalization's operands; returns the normalized length.
fn check_norm_args(op: &'static str, x: &Tensor, params: &[Option<&Tensor>], eps: f64) -> Result<usize> {
    check_float(op, x)?;
    if x.rank() == 0 {
        return Err(Error::BadShape { op, shape: x.shape().to_vec(), reason: "needs at least one dimension to normalize".into() });
    }
    let n = x.shape()[x.rank() - 1];
    for p in params.iter().flatten() {
        check_same(op, x, p)?;
        if p.shape() != [n] {
            return Err(Error::ShapeMismatch { op, lhs: x.shape().to_vec(), rhs: p.shape().to_vec() });
        }
    }
    if !(eps >= 0.0 && eps.is_finite()) {
        return Err(Error::InvalidArgument { op, reason: format!("eps {eps} must be finite and non-negative") });
    }
    Ok(n)
}

/// Number of rows of `n` in `x` (0 when the rows are empty).
fn n_rows(x: &Tensor, n: usize) -> usize {
    x.numel().checked_div(n).unwrap_or(0)
}

/// Converts computed values to a tensor of `dtype` in `shape` (a gradient).
fn grad_tensor<T: Compute>(values: Vec<T>, dtype: DType, shape: &[usize]) -> Result<Tensor> {
    Tensor::from_data(T::wrap(values).into_data(dtype), shape)
}

fn layer_norm_typed<T: Compute>(x: &Tensor, n: usize, weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    const OP: &str = "layer_norm";
    let w = weight.map(T::owned).transpose()?;
    let b = bias.map(T::owned).transpose()?;
    let rows = n_rows(x, n);
    let mut mean = vec![T::zero(); rows];
    let mut rstd = vec![T::zero(); rows];
    let y = x.with_float_slice(|s| {
        T::pick(s).map(|xs| {
            let mut y = crate::pool::take::<T>(xs.len());
            k::layer_norm_forward(xs, n, w.as_deref(), b.as_deref(), T::from_f64_lossy(eps), &mut y, &mut mean, &mut rstd).map(|()| y)
        })
    })?
    .transpose()?;
    let y = y.ok_or(Error::UnsupportedDType { op: OP, dtype: x.dtype() })?;
    debug_assert_eq!(y.len(), x.numel());

    let mut inputs = vec![x];
    inputs.extend(weight);
    inputs.extend(bias);
    let (want_w, want_b) = (weight.is_some_and(|t| t.is_requires_grad()), bias.is_some_and(|t| t.is_requires_grad()));
    let (has_w, has_b) = (weight.is_some(), bias.is_some());
    let input = x.detach();
    let dtype = x.dtype();
    Tensor::from_op(T::wrap(y), x.shape(), dtype, OP, &inputs, move |g: &Tensor, _: &Tensor| {
        let (dx, dw, db) = with_two_slices::<T, _>(OP, &input, g, |xs, gs| {
            let mut dx = crate::pool::take::<T>(xs.len());
            let mut dw = want_w.then(|| vec![T::zero(); n]);
            let mut db = want_b.then(|| vec![T::zero(); n]);
            k::layer_norm_backward(xs, n, w.as_deref(), &mean, &rstd, gs, &mut dx, dw.as_deref_mut(), db.as_deref_mut()).map(|()| (dx, dw, db))
        })??;
        let mut grads = vec![Some(grad_tensor(dx, dtype, input.shape())?)];
        if has_w {
            grads.push(dw.map(|v| grad_tensor(v, dtype, &[n])).transpose()?);
        }
        if has_b {
            grads.push(db.map(|v| grad_tensor(v, dtype, &[n])).transpose()?);
        }
        Ok(grads)
    })
}

fn rms_norm_typed<T: Compute>(x: &Tensor, n: usize, weight: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    const OP: &str = "rms_norm";
    let w = weight.map(T::owned).transpose()?;
    let rows = n_rows(x, n);
    let mut rstd = vec![T::zero(); rows];
    let y = x.with_float_slice(|s| {
        T::pick(s).map(|xs| {
            let mut y = crate::pool::take::<T>(xs.len());
            k::rms_norm_forward(xs, n, w.as_deref(), T::from_f64_lossy(eps), &mut y, &mut rstd).map(|()| y)
        })
    })?
    .transpose()?;
    let y = y.ok_or(Error::UnsupportedDType { op: OP, dtype: x.dtype() })?;
    debug_assert_eq!(y.len(), x.numel());

    let mut inputs = vec![x];
    inputs.extend(weight);
    let want_w = weight.is_some_and(|t| t.is_requires_grad());
    let has_w = weight.is_some();
    let input = x.detach();
    let dtype = x.dtype();
    Tensor::from_op(T::wrap(y), x.shape(), dtype, OP, &inputs, move |g: &Tensor, _: &Tensor| {
        let (dx, dw) = with_two_slices::<T, _>(OP, &input, g, |xs, gs| {
            let mut dx = crate::pool::take::<T>(xs.len());
            let mut dw = want_w.then(|| vec![T::zero(); n]);
            k::rms_norm_backward(xs, n, w.as_deref(), &rstd, gs, &mut dx, dw.as_deref_mut()).map(|()| (dx, dw))
        })??;
        let mut grads = vec![Some(grad_tensor(dx, dtype, input.shape())?)];
        if has_w {
            grads.push(dw.map(|v| grad_tensor(v, dtype, &[n])).transpose()?);
        }
        Ok(grads)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_norm_rows_have_zero_mean_unit_variance() {
        let x = Tensor::from_vec(vec![1.0f64, 2.0, 3.0, 4.0, -2.0, 0.0, 2.0, 8.0], &[2, 4]).unwrap();
        let y = x.layer_norm(None, None, 0.0).unwrap().to_f64_vec().unwrap();
        for row in y.chunks(4) {
            let mean: f64 = row.iter().sum::<f64>() / 4.0;
            let var: f64 = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / 4.0;
            assert!(mean.abs() < 1e-12 && (var - 1.0).abs() < 1e-12, "{row:?}");
        }
    }

    #[test]
    fn rms_norm_with_weight_scales_columns() {
        let x = Tensor::from_vec(vec![3.0f32, 4.0], &[1, 2]).unwrap();
        let w = Tensor::from_vec(vec![1.0f32, 2.0], &[2]).unwrap();
        let y = x.rms_norm(Some(&w), 0.0).unwrap().to_f32_vec().unwrap();
        let rms = (12.5f32).sqrt();
        assert!((y[0] - 3.0 / rms).abs() < 1e-6 && (y[1] - 8.0 / rms).abs() < 1e-6, "{y:?}");
    }
}
