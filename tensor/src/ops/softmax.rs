//! Softmax, log-softmax and the fused softmax-cross-entropy loss (with ignore index and label
//! smoothing), all along the last dimension through the fused row kernels.
//!
//! Cross-entropy follows `torch.nn.functional.cross_entropy`: targets are u32 or i64 class
//! indices, `ignore_index` defaults to -100 ([`DEFAULT_IGNORE_INDEX`]), and the mean is over the
//! rows that are not ignored. When every row is ignored (or there are none) the mean is NaN and
//! the gradient zero, as in PyTorch (0/0 for the loss; no row contributes to the gradient); the
//! sum is then 0.

use super::check_float;
use crate::error::{Error, Result};
use crate::layout::normalize_dim;
use crate::tensor::{FloatSlice, FloatVec, Tensor};
use rtx_kernels::cross_entropy::{cross_entropy_rows, CrossEntropySpec};
use rtx_kernels::{softmax as k, DType};

/// How a loss combines per-row values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Reduction {
    /// Mean over counted rows.
    #[default]
    Mean,
    /// Sum over rows.
    Sum,
    /// One value per row.
    None,
}

/// PyTorch's default `ignore_index` for cross-entropy.
pub const DEFAULT_IGNORE_INDEX: i64 = -100;

/// Settings of [`Tensor::cross_entropy`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CrossEntropyOptions {
    /// Rows whose target is this index contribute nothing (default [`DEFAULT_IGNORE_INDEX`], which
    /// no u32 target can equal).
    pub ignore_index: Option<i64>,
    /// Label smoothing ε in [0, 1).
    pub label_smoothing: f64,
    /// How to combine rows.
    pub reduction: Reduction,
}

impl Default for CrossEntropyOptions {
    fn default() -> Self {
        CrossEntropyOptions { ignore_index: Some(DEFAULT_IGNORE_INDEX), label_smoothing: 0.0, reduction: Reduction::Mean }
    }
}

impl Tensor {
    /// Softmax along `dim`.
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        self.softmax_impl(dim, false)
    }

    /// Log-softmax along `dim`.
    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        self.softmax_impl(dim, true)
    }

    fn softmax_impl(&self, dim: isize, log: bool) -> Result<Tensor> {
        let name = if log { "log_softmax" } else { "softmax" };
        check_float(name, self)?;
        let d = normalize_dim(name, dim, self.rank())?;
        let last = self.rank() - 1;
        if d != last {
            return self.transpose(d as isize, last as isize)?.softmax_impl(-1, log)?.transpose(d as isize, last as isize);
        }
        if let Some(device) = crate::backend::of(&[self]) {
            return device.softmax(self, log);
        }
        let n = self.shape()[last];
        let values = crate::try_float_map!(self, |x: T| {
            let mut out = crate::pool::take::<T>(x.len());
            if log {
                k::log_softmax_rows(x, n, &mut out)
            } else {
                k::softmax_rows(x, n, &mut out)
            }
            .map(|()| out)
        })?;
        let dtype = self.dtype();
        Tensor::from_op(values, self.shape(), dtype, name, &[self], move |g: &Tensor, y: &Tensor| {
            let (y, g) = (crate::ops::binary::compute_form(y)?, crate::ops::binary::compute_form(g)?);
            let dx = y.with_float_slice(|ys| {
                g.with_float_slice(|gs| match (ys, gs) {
                    (FloatSlice::F32(a), FloatSlice::F32(b)) => {
                        let mut o = crate::pool::take::<f32>(a.len());
                        if log { k::log_softmax_backward_rows(a, b, n, &mut o) } else { k::softmax_backward_rows(a, b, n, &mut o) }.map(|()| FloatVec::F32(o))
                    }
                    (FloatSlice::F64(a), FloatSlice::F64(b)) => {
                        let mut o = crate::pool::take::<f64>(a.len());
                        if log { k::log_softmax_backward_rows(a, b, n, &mut o) } else { k::softmax_backward_rows(a, b, n, &mut o) }.map(|()| FloatVec::F64(o))
                    }
                    _ => Ok(FloatVec::F64(Vec::new())),
                })
            })???;
            Ok(vec![Some(Tensor::from_data(dx.into_data(dtype), y.shape())?)])
        })
    }

    /// Cross-entropy between logits `[.., C]` and u32 or i64 class targets `[..]`, fused with
    /// the softmax. With `Reduction::Mean` the mean is over rows that are not ignored (NaN when
    /// all are, as PyTorch). A target outside `0..C` that is not the ignore index is an error
    /// naming its row.
    pub fn cross_entropy(&self, targets: &Tensor, options: CrossEntropyOptions) -> Result<Tensor> {
        check_float("cross_entropy", self)?;
        if !matches!(targets.dtype(), DType::U32 | DType::I64) {
            return Err(Error::DTypeMismatch { op: "cross_entropy", lhs: targets.dtype(), rhs: DType::I64 });
        }
        if self.rank() == 0 || self.shape()[..self.rank() - 1] != *targets.shape() {
            return Err(Error::ShapeMismatch { op: "cross_entropy", lhs: self.shape().to_vec(), rhs: targets.shape().to_vec() });
        }
        if !(0.0..1.0).contains(&options.label_smoothing) {
            return Err(Error::InvalidArgument { op: "cross_entropy", reason: format!("label_smoothing {} outside [0, 1)", options.label_smoothing) });
        }
        if let Some(device) = crate::backend::of(&[self]) {
            if options != CrossEntropyOptions::default() || self.rank() != 2 || targets.dtype() != DType::U32 {
                return Err(Error::UnsupportedDevice { op: "cross_entropy (options other than mean over [N, V] logits)", device: self.device() });
            }
            return device.cross_entropy(self, targets);
        }
        let c = self.shape()[self.rank() - 1];
        let t = Targets::of(targets)?;
        let spec = CrossEntropySpec { n_classes: c, ignore_index: options.ignore_index, label_smoothing: options.label_smoothing };
        let want_grad = self.is_requires_grad() && crate::autograd::is_grad_enabled();
        let mut kernel_err = None;
        let (losses, grad, counted) = match self.with_float_slice(|x| match x {
            FloatSlice::F32(x) => {
                let mut l = vec![0f32; t.len()];
                let mut g = if want_grad { crate::pool::zeroed::<f32>(x.len()) } else { Vec::new() };
                let r = t.rows(x, spec, &mut l, want_grad.then_some(g.as_mut_slice()));
                (FloatVec::F32(l), FloatVec::F32(g), r)
            }
            FloatSlice::F64(x) => {
                let mut l = vec![0f64; t.len()];
                let mut g = if want_grad { crate::pool::zeroed::<f64>(x.len()) } else { Vec::new() };
                let r = t.rows(x, spec, &mut l, want_grad.then_some(g.as_mut_slice()));
                (FloatVec::F64(l), FloatVec::F64(g), r)
            }
        })? {
            (l, g, Ok(n)) => (l, g, n),
            (_, _, Err(e)) => {
                kernel_err = Some(e);
                (FloatVec::F32(Vec::new()), FloatVec::F32(Vec::new()), 0)
            }
        };
        if let Some(e) = kernel_err {
            return Err(e.into());
        }
        let dtype = self.dtype();
        let per_row = Tensor::from_data(losses.into_data(dtype), targets.shape())?;
        let (value, scale) = match options.reduction {
            Reduction::None => (per_row, None),
            Reduction::Sum => (per_row.sum_all()?, Some(1.0)),
            // No counted row: 0/0 = NaN as PyTorch, and a zero gradient (no row contributes).
            Reduction::Mean if counted == 0 => (per_row.sum_all()?.mul_scalar(f64::NAN)?, Some(0.0)),
            Reduction::Mean => (per_row.sum_all()?.mul_scalar(1.0 / counted as f64)?, Some(1.0 / counted as f64)),
        };
        let grad_logits = if want_grad { Some(Tensor::from_data(grad.into_data(dtype), self.shape())?) } else { None };
        let rows_shape = targets.shape().to_vec();
        let out_shape = value.shape().to_vec();
        Ok(Tensor::with_node(value.storage().clone(), value.layout().clone(), dtype, "cross_entropy", &[self], move |g: &Tensor, _: &Tensor| {
            let Some(gl) = &grad_logits else { return Ok(vec![None]) };
            let mut gshape = rows_shape.clone();
            gshape.push(1);
            let g_rows = match scale {
                Some(s) => g.reshape(&[1])?.mul_scalar(s)?,
                None => g.reshape(&gshape)?,
            };
            let _ = &out_shape;
            Ok(vec![Some(gl.mul(&g_rows)?)])
        }))
    }

    /// Mean squared error against `target` (same shape).
    pub fn mse(&self, target: &Tensor, reduction: Reduction) -> Result<Tensor> {
        if self.shape() != target.shape() {
            return Err(Error::ShapeMismatch { op: "mse", lhs: self.shape().to_vec(), rhs: target.shape().to_vec() });
        }
        if let Some(device) = crate::backend::of(&[self, target]) {
            return match reduction {
                Reduction::Mean => device.latent_loss(self, target, crate::backend::LatentLossKind::Squared),
                _ => Err(Error::UnsupportedDevice { op: "mse (reductions other than mean)", device: self.device() }),
            };
        }
        let sq = self.sub(target)?.square()?;
        match reduction {
            Reduction::Mean => sq.mean_all(),
            Reduction::Sum => sq.sum_all(),
            Reduction::None => Ok(sq),
        }
    }
}

/// Class targets in the width they came in (no copy into another type for u32 labels).
pub(super) enum Targets {
    U32(Vec<u32>),
    I64(Vec<i64>),
}

impl Targets {
    pub(super) fn of(targets: &Tensor) -> Result<Targets> {
        Ok(match targets.dtype() {
            DType::I64 => Targets::I64(targets.to_i64_vec()?),
            _ => Targets::U32(targets.to_u32_vec()?),
        })
    }

    fn len(&self) -> usize {
        match self {
            Targets::U32(v) => v.len(),
            Targets::I64(v) => v.len(),
        }
    }

    fn rows<T: rtx_kernels::Float>(&self, logits: &[T], spec: CrossEntropySpec, losses: &mut [T], grad: Option<&mut [T]>) -> rtx_kernels::Result<usize> {
        self.rows_at(0, logits, spec, losses, grad)
    }

    /// [`Targets::rows`] for the `losses.len()` rows from row `start` on: `logits` holds just those
    /// rows. Returns how many of them were counted (not ignored).
    pub(super) fn rows_at<T: rtx_kernels::Float>(&self, start: usize, logits: &[T], spec: CrossEntropySpec, losses: &mut [T], grad: Option<&mut [T]>) -> rtx_kernels::Result<usize> {
        let rows = start..start + losses.len();
        let out_of_range = || rtx_kernels::Error::LengthMismatch { op: "cross_entropy", arg: "targets", expected: rows.end, actual: self.len() };
        match self {
            Targets::U32(t) => cross_entropy_rows(logits, t.get(rows.clone()).ok_or_else(out_of_range)?, spec, losses, grad),
            Targets::I64(t) => cross_entropy_rows(logits, t.get(rows.clone()).ok_or_else(out_of_range)?, spec, losses, grad),
        }
    }
}
