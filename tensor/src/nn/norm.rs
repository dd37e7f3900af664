//! Normalisation layers over the last dimension: [`LayerNorm`] (parameters `weight`, `bias`)
//! and [`RmsNorm`] (parameter `weight`), as `torch.nn.LayerNorm` / `torch.nn.RMSNorm`.

use super::{param, visit_opt, visit_opt_mut, Module};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use rtx_kernels::DType;

/// Layer normalisation over the last dimension, with optional learned scale and shift.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    /// Scale `[dim]` (ones at init), absent without an elementwise affine.
    pub weight: Option<Tensor>,
    /// Shift `[dim]` (zeros at init), absent without an affine or with `bias = false`.
    pub bias: Option<Tensor>,
    /// Added to the variance.
    pub eps: f64,
    dim: usize,
}

/// Root-mean-square normalisation over the last dimension, with an optional learned scale.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    /// Scale `[dim]` (ones at init).
    pub weight: Option<Tensor>,
    /// Added to the mean square.
    pub eps: f64,
    dim: usize,
}

impl LayerNorm {
    /// A layer norm over `dim` features with weight (and bias if `bias`), eps as given
    /// (PyTorch's default is 1e-5).
    pub fn new(dim: usize, bias: bool, eps: f64, dtype: DType) -> Result<LayerNorm> {
        check("LayerNorm", dim, eps)?;
        Ok(LayerNorm { weight: Some(param(Tensor::ones(&[dim], dtype))), bias: bias.then(|| param(Tensor::zeros(&[dim], dtype))), eps, dim })
    }

    /// A layer norm without learned parameters.
    pub fn without_affine(dim: usize, eps: f64) -> Result<LayerNorm> {
        check("LayerNorm", dim, eps)?;
        Ok(LayerNorm { weight: None, bias: None, eps, dim })
    }

    /// Normalised feature count.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// `x [.., dim] -> [.., dim]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        check_input("LayerNorm", x, self.dim)?;
        x.layer_norm(self.weight.as_ref(), self.bias.as_ref(), self.eps)
    }

    /// `(s, forward(s))` for the residual sum `s = x + branch`, fused where the device can
    /// ([`Tensor::add_layer_norm`]).
    pub fn forward_add(&self, x: &Tensor, branch: &Tensor) -> Result<(Tensor, Tensor)> {
        x.add_layer_norm(branch, self.weight.as_ref(), self.bias.as_ref(), self.eps)
    }
}

impl Module for LayerNorm {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        visit_opt(prefix, "weight", &self.weight, f);
        visit_opt(prefix, "bias", &self.bias, f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        visit_opt_mut(prefix, "weight", &mut self.weight, f);
        visit_opt_mut(prefix, "bias", &mut self.bias, f);
    }
}

impl RmsNorm {
    /// An RMS norm over `dim` features with a learned scale.
    pub fn new(dim: usize, eps: f64, dtype: DType) -> Result<RmsNorm> {
        check("RmsNorm", dim, eps)?;
        Ok(RmsNorm { weight: Some(param(Tensor::ones(&[dim], dtype))), eps, dim })
    }

    /// Normalised feature count.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// `x [.., dim] -> [.., dim]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        check_input("RmsNorm", x, self.dim)?;
        x.rms_norm(self.weight.as_ref(), self.eps)
    }
}

impl Module for RmsNorm {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        visit_opt(prefix, "weight", &self.weight, f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        visit_opt_mut(prefix, "weight", &mut self.weight, f);
    }
}

fn check(op: &'static str, dim: usize, eps: f64) -> Result<()> {
    if dim == 0 || !(eps >= 0.0 && eps.is_finite()) {
        return Err(Error::InvalidArgument { op, reason: format!("dim must be positive and eps finite and >= 0, got dim={dim} eps={eps}") });
    }
    Ok(())
}

fn check_input(op: &'static str, x: &Tensor, dim: usize) -> Result<()> {
    if x.rank() == 0 || x.shape()[x.rank() - 1] != dim {
        return Err(Error::ShapeMismatch { op, lhs: x.shape().to_vec(), rhs: vec![dim] });
    }
    Ok(())
}
