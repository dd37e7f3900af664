//! Fully connected layers: [`Linear`] (`y = x Wᵀ + b`, PyTorch layout and init), the
//! [`Activation`] choice, and a plain multi-layer perceptron [`Mlp`].

use super::{join_name, param, visit_opt, visit_opt_mut, Module};
use crate::error::{Error, Result};
use crate::ops::unary::GeluApprox;
use crate::rng::Generator;
use crate::tensor::Tensor;
use rtx_kernels::DType;

/// `y = x Wᵀ + b` over the last dimension. Parameters: `weight` `[out, in]`, `bias` `[out]`
/// (as `torch.nn.Linear`).
#[derive(Clone, Debug)]
pub struct Linear {
    /// `[out_features, in_features]`.
    pub weight: Tensor,
    /// `[out_features]`, if the layer has a bias.
    pub bias: Option<Tensor>,
}

/// A pointwise nonlinearity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum Activation {
    /// max(x, 0).
    Relu,
    /// GELU, exact erf form (`nn.GELU()`, PyTorch's default).
    #[default]
    Gelu,
    /// GELU, tanh approximation (`nn.GELU(approximate="tanh")`, as GPT-2).
    GeluTanh,
    /// x·σ(x).
    Silu,
    /// tanh x.
    Tanh,
}

/// A stack of [`Linear`] layers with an activation between them (none after the last):
/// `sizes = [784, 512, 512, 10]` gives three layers named `layers.0`, `layers.1`, `layers.2`.
#[derive(Clone, Debug)]
pub struct Mlp {
    /// The layers, input side first.
    pub layers: Vec<Linear>,
    /// The activation between layers.
    pub activation: Activation,
}

impl Linear {
    /// A layer with PyTorch's default init: weight and bias ~ U(−1/√in, 1/√in), weight drawn
    /// first.
    pub fn new(in_features: usize, out_features: usize, bias: bool, dtype: DType, rng: &mut Generator) -> Result<Linear> {
        check_sizes(in_features, out_features)?;
        let bound = 1.0 / (in_features as f64).sqrt();
        let weight = param(Tensor::rand(&[out_features, in_features], -bound, bound, dtype, rng)?);
        let bias = if bias { Some(param(Tensor::rand(&[out_features], -bound, bound, dtype, rng)?)) } else { None };
        Ok(Linear { weight, bias })
    }

    /// A layer with weight ~ N(0, std²) and zero bias (GPT-2 style init).
    pub fn normal(in_features: usize, out_features: usize, bias: bool, std: f64, dtype: DType, rng: &mut Generator) -> Result<Linear> {
        check_sizes(in_features, out_features)?;
        let weight = param(Tensor::randn(&[out_features, in_features], 0.0, std, dtype, rng)?);
        let bias = bias.then(|| param(Tensor::zeros(&[out_features], dtype)));
        Ok(Linear { weight, bias })
    }

    /// A layer from given tensors (marked as parameters): `weight` `[out, in]`, `bias` `[out]`.
    pub fn from_tensors(weight: Tensor, bias: Option<Tensor>) -> Result<Linear> {
        if weight.rank() != 2 {
            return Err(Error::BadShape { op: "Linear", shape: weight.shape().to_vec(), reason: "weight must be [out, in]".into() });
        }
        if let Some(b) = &bias {
            if b.shape() != [weight.shape()[0]] {
                return Err(Error::ShapeMismatch { op: "Linear", lhs: weight.shape().to_vec(), rhs: b.shape().to_vec() });
            }
        }
        Ok(Linear { weight: param(weight), bias: bias.map(param) })
    }

    /// Input size.
    pub fn in_features(&self) -> usize {
        self.weight.shape()[1]
    }

    /// Output size.
    pub fn out_features(&self) -> usize {
        self.weight.shape()[0]
    }

    /// `x [.., in] -> [.., out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.rank() == 0 || x.shape()[x.rank() - 1] != self.in_features() {
            return Err(Error::ShapeMismatch { op: "Linear", lhs: x.shape().to_vec(), rhs: self.weight.shape().to_vec() });
        }
        x.linear(&self.weight, self.bias.as_ref())
    }
}

impl Module for Linear {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        f(&join_name(prefix, "weight"), &self.weight);
        visit_opt(prefix, "bias", &self.bias, f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        f(&join_name(prefix, "weight"), &mut self.weight);
        visit_opt_mut(prefix, "bias", &mut self.bias, f);
    }
}

impl Activation {
    /// Applies the nonlinearity.
    pub fn apply(self, x: &Tensor) -> Result<Tensor> {
        match self {
            Activation::Relu => x.relu(),
            Activation::Gelu => x.gelu(),
            Activation::GeluTanh => x.gelu_with(GeluApprox::Tanh),
            Activation::Silu => x.silu(),
            Activation::Tanh => x.tanh(),
        }
    }
}

impl Mlp {
    /// Layers `sizes[i] -> sizes[i+1]` with biases and PyTorch init, drawn in order.
    pub fn new(sizes: &[usize], activation: Activation, dtype: DType, rng: &mut Generator) -> Result<Mlp> {
        if sizes.len() < 2 {
            return Err(Error::InvalidArgument { op: "Mlp", reason: format!("needs at least an input and an output size, got {sizes:?}") });
        }
        let layers = sizes.windows(2).map(|w| Linear::new(w[0], w[1], true, dtype, rng)).collect::<Result<Vec<_>>>()?;
        Ok(Mlp { layers, activation })
    }

    /// `x [.., sizes[0]] -> [.., sizes[last]]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        let last = self.layers.len().saturating_sub(1);
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(&h)?;
            if i < last {
                h = self.activation.apply(&h)?;
            }
        }
        Ok(h)
    }
}

impl Module for Mlp {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        self.layers.visit_params(&join_name(prefix, "layers"), f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        self.layers.visit_params_mut(&join_name(prefix, "layers"), f);
    }
}

fn check_sizes(in_features: usize, out_features: usize) -> Result<()> {
    if in_features == 0 || out_features == 0 {
        return Err(Error::InvalidArgument { op: "Linear", reason: format!("sizes must be positive, got in={in_features} out={out_features}") });
    }
    Ok(())
}
