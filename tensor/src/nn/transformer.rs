//! The pre-norm transformer block shared by [`super::Gpt`] and [`super::Vit`]:
//! `x + attn(ln1(x))`, then `x + mlp(ln2(x))`, with a two-layer GELU [`FeedForward`]
//! (`mlp.fc` `[hC, C]`, `mlp.proj` `[C, hC]`); [`BlockConfig::gelu`] picks the exact or the tanh
//! GELU.

use super::{join_name, Activation, Dropout, LayerNorm, Linear, Module, MultiHeadAttention};
use crate::error::Result;
use crate::ops::unary::GeluApprox;
use crate::rng::Generator;
use crate::tensor::Tensor;
use rtx_kernels::DType;

/// Sizes and init of a [`TransformerBlock`] (GPT-2 style init: every Linear weight
/// ~ N(0, `init_std`²) except the two residual projections `attn.proj` and `mlp.proj`
/// ~ N(0, `proj_init_std`²); biases zero; norms ones/zeros).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockConfig {
    /// Width C.
    pub d_model: usize,
    /// Attention heads (divides C).
    pub n_heads: usize,
    /// Feed-forward hidden width (4·C in GPT-2).
    pub mlp_hidden: usize,
    /// Causal attention (decoders) or full attention (encoders).
    pub causal: bool,
    /// Whether Linear and LayerNorm layers have biases.
    pub bias: bool,
    /// Residual dropout probability.
    pub dropout: f64,
    /// LayerNorm epsilon.
    pub layer_norm_eps: f64,
    /// Std of Linear weights.
    pub init_std: f64,
    /// Std of the residual projection weights.
    pub proj_init_std: f64,
    /// Parameter dtype.
    pub dtype: DType,
    /// The feed-forward's GELU: exact (`GeluApprox::None`, PyTorch's `nn.GELU()`) or the tanh
    /// approximation GPT-2 uses.
    pub gelu: GeluApprox,
}

/// `proj(act(fc(x)))` followed by dropout.
#[derive(Clone, Debug)]
pub struct FeedForward {
    /// `[hidden, C]`.
    pub fc: Linear,
    /// `[C, hidden]`.
    pub proj: Linear,
    /// The nonlinearity between the two layers.
    pub activation: Activation,
    dropout: Dropout,
}

/// A pre-norm transformer block. Parameter names: `ln1.*`, `attn.qkv.*`, `attn.proj.*`,
/// `ln2.*`, `mlp.fc.*`, `mlp.proj.*`.
#[derive(Clone, Debug)]
pub struct TransformerBlock {
    /// Norm before attention.
    pub ln1: LayerNorm,
    /// Self-attention.
    pub attn: MultiHeadAttention,
    /// Norm before the feed-forward.
    pub ln2: LayerNorm,
    /// Feed-forward.
    pub mlp: FeedForward,
}

impl FeedForward {
    /// A feed-forward from given layers (`fc` `[hidden, C]`, `proj` `[C, hidden]`).
    pub fn from_parts(fc: Linear, proj: Linear, activation: Activation, dropout: f64) -> Result<FeedForward> {
        if fc.out_features() != proj.in_features() || fc.in_features() != proj.out_features() {
            return Err(crate::Error::ShapeMismatch { op: "FeedForward", lhs: fc.weight.shape().to_vec(), rhs: proj.weight.shape().to_vec() });
        }
        Ok(FeedForward { fc, proj, activation, dropout: Dropout::new(dropout)? })
    }

    /// `x [.., C] -> [.., C]`.
    pub fn forward(&self, x: &Tensor, rng: &mut Generator) -> Result<Tensor> {
        let y = match (self.activation, &self.fc.bias, &self.proj.bias) {
            // GPT-2's feed-forward as one op (fused GEMM epilogues on a GPU).
            (Activation::GeluTanh, Some(b1), Some(b2)) if x.rank() > 0 && x.shape()[x.rank() - 1] == self.fc.in_features() => x.linear_gelu_linear(&self.fc.weight, b1, &self.proj.weight, b2)?,
            _ => self.proj.forward(&self.activation.apply(&self.fc.forward(x)?)?)?,
        };
        self.dropout.forward(&y, rng)
    }
}

impl Module for FeedForward {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        self.fc.visit_params(&join_name(prefix, "fc"), f);
        self.proj.visit_params(&join_name(prefix, "proj"), f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        self.fc.visit_params_mut(&join_name(prefix, "fc"), f);
        self.proj.visit_params_mut(&join_name(prefix, "proj"), f);
    }

    fn set_training(&mut self, training: bool) {
        self.dropout.set_training(training);
    }
}

impl TransformerBlock {
    /// A block initialised from `config`, drawing `attn.qkv`, `attn.proj`, `mlp.fc`, `mlp.proj`
    /// weights in that order.
    pub fn new(config: &BlockConfig, rng: &mut Generator) -> Result<TransformerBlock> {
        let c = *config;
        let ln1 = LayerNorm::new(c.d_model, c.bias, c.layer_norm_eps, c.dtype)?;
        let qkv = Linear::normal(c.d_model, 3 * c.d_model, c.bias, c.init_std, c.dtype, rng)?;
        let proj = Linear::normal(c.d_model, c.d_model, c.bias, c.proj_init_std, c.dtype, rng)?;
        let attn = MultiHeadAttention::from_parts(qkv, proj, c.n_heads, c.causal, c.dropout)?;
        let ln2 = LayerNorm::new(c.d_model, c.bias, c.layer_norm_eps, c.dtype)?;
        let fc = Linear::normal(c.d_model, c.mlp_hidden, c.bias, c.init_std, c.dtype, rng)?;
        let proj = Linear::normal(c.mlp_hidden, c.d_model, c.bias, c.proj_init_std, c.dtype, rng)?;
        let activation = match c.gelu {
            GeluApprox::None => Activation::Gelu,
            GeluApprox::Tanh => Activation::GeluTanh,
        };
        let mlp = FeedForward::from_parts(fc, proj, activation, c.dropout)?;
        Ok(TransformerBlock { ln1, attn, ln2, mlp })
    }

    /// A block from its parts.
    pub fn from_parts(ln1: LayerNorm, attn: MultiHeadAttention, ln2: LayerNorm, mlp: FeedForward) -> TransformerBlock {
        TransformerBlock { ln1, attn, ln2, mlp }
    }

    /// `x [B, T, C] -> [B, T, C]`.
    pub fn forward(&self, x: &Tensor, mask: Option<&Tensor>, rng: &mut Generator) -> Result<Tensor> {
        let x = x.add(&self.attn.forward(&self.ln1.forward(x)?, mask, rng)?)?;
        x.add(&self.mlp.forward(&self.ln2.forward(&x)?, rng)?)
    }

    /// The block on the residual stream `x` given `x_normed = ln1(x)`, returning the new stream
    /// `y` and `next(y)`: each residual add runs fused with the norm after it
    /// ([`LayerNorm::forward_add`]), so a stack of blocks passes each block's first norm along.
    /// The same values as [`TransformerBlock::forward`] followed by `next`.
    pub fn forward_norm_fused(&self, x: &Tensor, x_normed: &Tensor, next: &LayerNorm, mask: Option<&Tensor>, rng: &mut Generator) -> Result<(Tensor, Tensor)> {
        let (x, h) = self.ln2.forward_add(x, &self.attn.forward(x_normed, mask, rng)?)?;
        next.forward_add(&x, &self.mlp.forward(&h, rng)?)
    }
}

impl Module for TransformerBlock {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        self.ln1.visit_params(&join_name(prefix, "ln1"), f);
        self.attn.visit_params(&join_name(prefix, "attn"), f);
        self.ln2.visit_params(&join_name(prefix, "ln2"), f);
        self.mlp.visit_params(&join_name(prefix, "mlp"), f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        self.ln1.visit_params_mut(&join_name(prefix, "ln1"), f);
        self.attn.visit_params_mut(&join_name(prefix, "attn"), f);
        self.ln2.visit_params_mut(&join_name(prefix, "ln2"), f);
        self.mlp.visit_params_mut(&join_name(prefix, "mlp"), f);
    }

    fn set_training(&mut self, training: bool) {
        self.attn.set_training(training);
        self.mlp.set_training(training);
    }
}
