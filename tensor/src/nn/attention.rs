//! [`MultiHeadAttention`]: self-attention with a fused `qkv` projection (`[3C, C]`, output
//! split as q | k | v, each as heads of `C/H`, as nanoGPT's `c_attn`) and an output `proj`,
//! computed by [`Tensor::scaled_dot_product_attention`].

use super::{join_name, Dropout, Linear, Module};
use crate::error::{Error, Result};
use crate::rng::Generator;
use crate::tensor::Tensor;
use rtx_kernels::DType;

/// Multi-head self-attention. Dropout is applied to the output projection (residual dropout);
/// the attention weights themselves are not dropped.
#[derive(Clone, Debug)]
pub struct MultiHeadAttention {
    /// `[3C, C]` fused query/key/value projection.
    pub qkv: Linear,
    /// `[C, C]` output projection.
    pub proj: Linear,
    n_heads: usize,
    causal: bool,
    dropout: Dropout,
}

impl MultiHeadAttention {
    /// Attention over `d_model` features in `n_heads` heads with PyTorch Linear init and biases.
    pub fn new(d_model: usize, n_heads: usize, causal: bool, dropout: f64, dtype: DType, rng: &mut Generator) -> Result<Self> {
        check_heads(d_model, n_heads)?;
        let qkv = Linear::new(d_model, 3 * d_model, true, dtype, rng)?;
        let proj = Linear::new(d_model, d_model, true, dtype, rng)?;
        Self::from_parts(qkv, proj, n_heads, causal, dropout)
    }

    /// Attention from given projections (`qkv` `[3C, C]`, `proj` `[C, C]`).
    pub fn from_parts(qkv: Linear, proj: Linear, n_heads: usize, causal: bool, dropout: f64) -> Result<Self> {
        let c = proj.out_features();
        check_heads(c, n_heads)?;
        if qkv.in_features() != c || qkv.out_features() != 3 * c || proj.in_features() != c {
            return Err(Error::ShapeMismatch { op: "MultiHeadAttention", lhs: qkv.weight.shape().to_vec(), rhs: proj.weight.shape().to_vec() });
        }
        Ok(MultiHeadAttention { qkv, proj, n_heads, causal, dropout: Dropout::new(dropout)? })
    }

    /// Number of heads.
    pub fn n_heads(&self) -> usize {
        self.n_heads
    }

    /// Whether position t attends only to positions ≤ t.
    pub fn is_causal(&self) -> bool {
        self.causal
    }

    /// `x [B, T, C] -> [B, T, C]`; `mask` is passed to the attention op as is (broadcastable to
    /// `[B, H, T, T]`).
    pub fn forward(&self, x: &Tensor, mask: Option<&Tensor>, rng: &mut Generator) -> Result<Tensor> {
        let c = self.proj.out_features();
        if x.rank() != 3 || x.shape()[2] != c {
            return Err(Error::BadShape { op: "MultiHeadAttention", shape: x.shape().to_vec(), reason: format!("expected [B, T, {c}]") });
        }
        let (b, t) = (x.shape()[0], x.shape()[1]);
        let h = self.n_heads;
        let d = c / h;
        if mask.is_none() {
            // One fused op from the packed projection to the merged heads.
            let y = Tensor::scaled_dot_product_attention_packed(&self.qkv.forward(x)?, h, self.causal, None)?;
            return self.dropout.forward(&self.proj.forward(&y)?, rng);
        }
        // [B, T, 3C] -> [B, T, 3, H, D] -> [3, B, H, T, D]: q, k, v are views, no copy.
        let qkv = self.qkv.forward(x)?.reshape(&[b, t, 3, h, d])?.permute(&[2, 0, 3, 1, 4])?;
        let q = qkv.narrow(0, 0, 1)?.squeeze(0)?;
        let k = qkv.narrow(0, 1, 1)?.squeeze(0)?;
        let v = qkv.narrow(0, 2, 1)?.squeeze(0)?;
        let y = Tensor::scaled_dot_product_attention(&q, &k, &v, mask, self.causal, None)?;
        let y = y.transpose(1, 2)?.reshape(&[b, t, c])?;
        self.dropout.forward(&self.proj.forward(&y)?, rng)
    }
}

impl Module for MultiHeadAttention {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        self.qkv.visit_params(&join_name(prefix, "qkv"), f);
        self.proj.visit_params(&join_name(prefix, "proj"), f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        self.qkv.visit_params_mut(&join_name(prefix, "qkv"), f);
        self.proj.visit_params_mut(&join_name(prefix, "proj"), f);
    }

    fn set_training(&mut self, training: bool) {
        self.dropout.set_training(training);
    }
}

#[allow(clippy::manual_is_multiple_of, reason = "is_multiple_of needs Rust 1.87; the workspace says 1.85")]
fn check_heads(d_model: usize, n_heads: usize) -> Result<()> {
    if n_heads == 0 || d_model == 0 || d_model % n_heads != 0 {
        return Err(Error::InvalidArgument { op: "MultiHeadAttention", reason: format!("d_model {d_model} must be a positive multiple of n_heads {n_heads}") });
    }
    Ok(())
}
