//! Tensor-parallel layers (Megatron-LM): [`ColumnParallelLinear`], [`RowParallelLinear`],
//! [`ParallelAttention`] (heads split), [`ParallelMlp`], [`VocabParallelEmbedding`] and the
//! transformer block [`TpBlock`] built from them.
//!
//! Each layer holds this rank's slice of the full layer's parameters under the full layer's
//! parameter names, and a [`TpContext`] (the group and whether sequence parallelism is on).
//! Parameters are fresh tensors: slicing never shares storage with the full model.
//!
//! Replicated parameters (layer norms, row-parallel biases) see the same gradient on every rank
//! by construction: their inputs and output gradients are replicated (outputs of all-reduces).
//! With sequence parallelism each rank applies them to its own positions only, so they pass
//! through [`copy_to_tp`] where used: its backward all-reduces their gradient over the group.

use rtx_tensor::nn::{join_name, Activation, Dropout, FeedForward, LayerNorm, Linear, Module, MultiHeadAttention, TransformerBlock};
use rtx_tensor::{DType, Generator, Tensor};

use super::group::TpHandle;
use super::ops::{copy_to_tp, gather_from_sequence, gather_from_tp, mask_rows, reduce_from_tp, reduce_scatter_to_sequence};
use super::shard::ShardSpec;
use crate::error::{Error, Result};

/// The group a layer runs on and how activations between tensor-parallel regions are laid out.
#[derive(Clone, Debug)]
pub struct TpContext {
    /// The tensor-parallel group.
    pub group: TpHandle,
    /// Sequence parallelism: activations outside the tensor-parallel regions are `[B, T/tp, C]`.
    pub sequence_parallel: bool,
}

/// `y = x Wᵀ + b` with W's rows (output features) split: rank r computes outputs
/// `r·out/tp..`. Input replicated (or sequence-split, gathered here); output split unless
/// `gather_output`.
#[derive(Clone, Debug)]
pub struct ColumnParallelLinear {
    /// `[out/tp, in]`.
    pub weight: Tensor,
    /// `[out/tp]`.
    pub bias: Option<Tensor>,
    /// All-gather the output to `[.., out]`.
    pub gather_output: bool,
    ctx: TpContext,
}

/// `y = x Wᵀ + b` with W's columns (input features) split: the input is already split
/// (`[.., in/tp]`), partial products are all-reduced (reduce-scattered along the sequence with
/// sequence parallelism), and the replicated bias is added once, after the reduction.
#[derive(Clone, Debug)]
pub struct RowParallelLinear {
    /// `[out, in/tp]`.
    pub weight: Tensor,
    /// `[out]`, replicated.
    pub bias: Option<Tensor>,
    ctx: TpContext,
}

/// Self-attention with heads split: `qkv` is column parallel keeping the q, k and v rows of the
/// rank's heads together, attention runs on the local heads with the packed attention op, `proj`
/// is row parallel.
#[derive(Clone, Debug)]
pub struct ParallelAttention {
    /// `[3C/tp, C]`: q rows, k rows, v rows of heads `r·H/tp..`.
    pub qkv: ColumnParallelLinear,
    /// `[C, C/tp]`.
    pub proj: RowParallelLinear,
    local_heads: usize,
    causal: bool,
    dropout: Dropout,
}

/// The feed-forward with `fc` column parallel and `proj` row parallel.
#[derive(Clone, Debug)]
pub struct ParallelMlp {
    /// `[hidden/tp, C]`.
    pub fc: ColumnParallelLinear,
    /// `[C, hidden/tp]`.
    pub proj: RowParallelLinear,
    /// Between the two layers.
    pub activation: Activation,
    dropout: Dropout,
}

/// An embedding table with its rows (vocabulary) split: rank r holds ids `r·V/tp..`; ids
/// outside contribute zero and the partial rows are all-reduced (reduce-scattered along the
/// sequence with sequence parallelism).
#[derive(Clone, Debug)]
pub struct VocabParallelEmbedding {
    /// `[V/tp, C]`.
    pub weight: Tensor,
    vocab_size: usize,
    ctx: TpContext,
}

/// The pre-norm transformer block over parallel attention and MLP; parameter names as
/// [`TransformerBlock`].
#[derive(Clone, Debug)]
pub struct TpBlock {
    /// Replicated.
    pub ln1: LayerNorm,
    /// Heads split.
    pub attn: ParallelAttention,
    /// Replicated.
    pub ln2: LayerNorm,
    /// Hidden features split.
    pub mlp: ParallelMlp,
    ctx: TpContext,
}

impl TpContext {
    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// A replicated parameter as used in the sequence-split region: through [`copy_to_tp`] with
    /// sequence parallelism (its gradient is summed over the ranks' positions), as is otherwise.
    pub fn replicated(&self, param: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel {
            copy_to_tp(param, &self.group)
        } else {
            Ok(param.clone())
        }
    }

    /// Into a tensor-parallel region: all-gather along the sequence, or f.
    pub fn enter(&self, x: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel {
            gather_from_sequence(x, &self.group)
        } else {
            copy_to_tp(x, &self.group)
        }
    }

    /// Out of a tensor-parallel region (partial sums): reduce-scatter along the sequence, or g.
    pub fn exit(&self, x: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel {
            reduce_scatter_to_sequence(x, &self.group)
        } else {
            reduce_from_tp(x, &self.group)
        }
    }

    /// Layer norm with replicated parameters (see [`TpContext::replicated`]).
    pub fn layer_norm(&self, ln: &LayerNorm, x: &Tensor) -> Result<Tensor> {
        let weight = ln.weight.as_ref().map(|w| self.replicated(w)).transpose()?;
        let bias = ln.bias.as_ref().map(|b| self.replicated(b)).transpose()?;
        Ok(x.layer_norm(weight.as_ref(), bias.as_ref(), ln.eps)?)
    }

    /// This rank's part of `full` under `spec` (as a parameter).
    fn shard(&self, full: &Tensor, spec: ShardSpec, what: &'static str) -> Result<Tensor> {
        spec.check_full(what, full.shape())?;
        Ok(spec.slice(full, self.rank())?.requires_grad(true))
    }
}

impl ColumnParallelLinear {
    /// This rank's part of `full` (`[out, in]`; `out` must divide by tp).
    pub fn from_full(full: &Linear, gather_output: bool, ctx: TpContext) -> Result<ColumnParallelLinear> {
        Self::from_full_blocks(full, 1, gather_output, ctx, "out_features")
    }

    /// As [`ColumnParallelLinear::from_full`] with the rows in `blocks` blocks split alike.
    fn from_full_blocks(full: &Linear, blocks: usize, gather_output: bool, ctx: TpContext, what: &'static str) -> Result<ColumnParallelLinear> {
        check_dtype(&full.weight)?;
        let spec = ShardSpec { dim: 0, parts: ctx.size(), blocks };
        let weight = ctx.shard(&full.weight, spec, what)?;
        let bias = full.bias.as_ref().map(|b| ctx.shard(b, spec, what)).transpose()?;
        Ok(ColumnParallelLinear { weight, bias, gather_output, ctx })
    }

    /// `x [.., in]` (replicated, or `[B, T/tp, in]` with sequence parallelism) `-> [.., out/tp]`
    /// (or `[.., out]` gathered).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.ctx.enter(x)?.linear(&self.weight, self.bias.as_ref())?;
        if self.gather_output {
            gather_from_tp(&y, &self.ctx.group)
        } else {
            Ok(y)
        }
    }
}

impl RowParallelLinear {
    /// This rank's part of `full` (`[out, in]`; `in` must divide by tp).
    pub fn from_full(full: &Linear, ctx: TpContext) -> Result<RowParallelLinear> {
        check_dtype(&full.weight)?;
        let weight = ctx.shard(&full.weight, ShardSpec::new(1, ctx.size()), "in_features")?;
        let bias = full.bias.as_ref().map(fresh_param).transpose()?;
        Ok(RowParallelLinear { weight, bias, ctx })
    }

    /// `x [.., in/tp] -> [.., out]` (replicated, or `[B, T/tp, out]` with sequence parallelism).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.ctx.exit(&x.linear(&self.weight, None)?)?;
        match &self.bias {
            Some(b) => Ok(y.add(&self.ctx.replicated(b)?)?),
            None => Ok(y),
        }
    }
}

impl ParallelAttention {
    /// This rank's heads of `full` (`n_heads` must divide by tp).
    pub fn from_full(full: &MultiHeadAttention, dropout: f64, ctx: TpContext) -> Result<ParallelAttention> {
        let (heads, tp) = (full.n_heads(), ctx.size());
        if heads % tp != 0 {
            return Err(Error::TpIndivisible { what: "n_heads", value: heads, tp });
        }
        let qkv = ColumnParallelLinear::from_full_blocks(&full.qkv, 3, false, ctx.clone(), "qkv out_features")?;
        let proj = RowParallelLinear::from_full(&full.proj, ctx)?;
        Ok(ParallelAttention { qkv, proj, local_heads: heads / tp, causal: full.is_causal(), dropout: Dropout::new(dropout)? })
    }

    /// Heads on this rank.
    pub fn local_heads(&self) -> usize {
        self.local_heads
    }

    /// `x [B, T, C] -> [B, T, C]` (`[B, T/tp, C]` in and out with sequence parallelism).
    pub fn forward(&self, x: &Tensor, rng: &mut Generator) -> Result<Tensor> {
        let qkv = self.qkv.forward(x)?;
        let y = Tensor::scaled_dot_product_attention_packed(&qkv, self.local_heads, self.causal, None)?;
        Ok(self.dropout.forward(&self.proj.forward(&y)?, rng)?)
    }
}

impl ParallelMlp {
    /// This rank's hidden features of `full` (the hidden width must divide by tp).
    pub fn from_full(full: &FeedForward, dropout: f64, ctx: TpContext) -> Result<ParallelMlp> {
        let (hidden, tp) = (full.fc.out_features(), ctx.size());
        if hidden % tp != 0 {
            return Err(Error::TpIndivisible { what: "mlp_hidden", value: hidden, tp });
        }
        let fc = ColumnParallelLinear::from_full(&full.fc, false, ctx.clone())?;
        let proj = RowParallelLinear::from_full(&full.proj, ctx)?;
        Ok(ParallelMlp { fc, proj, activation: full.activation, dropout: Dropout::new(dropout)? })
    }

    /// `x [.., C] -> [.., C]`.
    pub fn forward(&self, x: &Tensor, rng: &mut Generator) -> Result<Tensor> {
        let h = self.activation.apply(&self.fc.forward(x)?)?;
        Ok(self.dropout.forward(&self.proj.forward(&h)?, rng)?)
    }
}

impl VocabParallelEmbedding {
    /// This rank's rows of `full` (`[V, C]`; V must divide by tp).
    pub fn from_full(full: &Tensor, ctx: TpContext) -> Result<VocabParallelEmbedding> {
        check_dtype(full)?;
        let vocab_size = full.shape().first().copied().unwrap_or(0);
        let weight = ctx.shard(full, ShardSpec::new(0, ctx.size()), "vocab_size")?;
        Ok(VocabParallelEmbedding { weight, vocab_size, ctx })
    }

    /// The full vocabulary size V.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The first id of this rank's rows.
    pub fn vocab_start(&self) -> usize {
        self.ctx.rank() * (self.vocab_size / self.ctx.size())
    }

    /// This rank's partial lookup `ids [..] -> [.., C]`: its rows, zeros for other ids. Not reduced.
    pub fn forward_partial(&self, ids: &Tensor) -> Result<Tensor> {
        let ids_v = ids.to_u32_vec()?;
        if let Some(&bad) = ids_v.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(Error::Tensor(rtx_tensor::Error::IndexOutOfRange { op: "VocabParallelEmbedding", index: bad as usize, size: self.vocab_size }));
        }
        let (start, rows) = (self.vocab_start(), self.weight.shape()[0]);
        let local = |id: u32| (id as usize).checked_sub(start).filter(|&j| j < rows);
        let local_ids: Vec<u32> = ids_v.iter().map(|&id| local(id).map_or(0, |j| j as u32)).collect();
        let mask: Vec<f32> = ids_v.iter().map(|&id| if local(id).is_some() { 1.0 } else { 0.0 }).collect();
        let rows = Tensor::embedding(&self.weight, &Tensor::from_vec(local_ids, ids.shape())?)?;
        // On a device, a mask of ones (every id here: a group of one) is skipped, not staged.
        if self.weight.device() != rtx_tensor::Device::Cpu && mask.iter().all(|&m| m == 1.0) {
            return Ok(rows);
        }
        mask_rows(&rows, mask)
    }

    /// `ids [B, T] -> [B, T, C]` (`[B, T/tp, C]` with sequence parallelism), summed over ranks.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.ctx.exit(&self.forward_partial(ids)?)
    }
}

impl TpBlock {
    /// This rank's part of `full`, with the residual dropout probability `dropout`.
    pub fn from_full(full: &TransformerBlock, dropout: f64, ctx: TpContext) -> Result<TpBlock> {
        Ok(TpBlock {
            ln1: replicated_norm(&full.ln1)?,
            attn: ParallelAttention::from_full(&full.attn, dropout, ctx.clone())?,
            ln2: replicated_norm(&full.ln2)?,
            mlp: ParallelMlp::from_full(&full.mlp, dropout, ctx.clone())?,
            ctx,
        })
    }

    /// `x [B, T, C] -> [B, T, C]` (`[B, T/tp, C]` with sequence parallelism).
    pub fn forward(&self, x: &Tensor, rng: &mut Generator) -> Result<Tensor> {
        let x = x.add(&self.attn.forward(&self.ctx.layer_norm(&self.ln1, x)?, rng)?)?;
        Ok(x.add(&self.mlp.forward(&self.ctx.layer_norm(&self.ln2, &x)?, rng)?)?)
    }
}

impl Module for ColumnParallelLinear {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        visit_linear(prefix, &self.weight, &self.bias, f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        visit_linear_mut(prefix, &mut self.weight, &mut self.bias, f);
    }
}

impl Module for RowParallelLinear {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        visit_linear(prefix, &self.weight, &self.bias, f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        visit_linear_mut(prefix, &mut self.weight, &mut self.bias, f);
    }
}

impl Module for ParallelAttention {
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

impl Module for ParallelMlp {
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

impl Module for VocabParallelEmbedding {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        f(&join_name(prefix, "weight"), &self.weight);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        f(&join_name(prefix, "weight"), &mut self.weight);
    }
}

impl Module for TpBlock {
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

/// A fresh copy of a replicated parameter (sharing no storage with the full model).
pub(crate) fn fresh_param(t: &Tensor) -> Result<Tensor> {
    check_dtype(t)?;
    Ok(Tensor::from_vec(t.to_f32_vec()?, t.shape())?.requires_grad(true))
}

/// A layer norm with fresh copies of `full`'s parameters.
pub(crate) fn replicated_norm(full: &LayerNorm) -> Result<LayerNorm> {
    let mut ln = full.clone();
    let mut result = Ok(());
    ln.visit_params_mut("", &mut |_, t| {
        if result.is_ok() {
            match fresh_param(t) {
                Ok(fresh) => *t = fresh,
                Err(e) => result = Err(e),
            }
        }
    });
    result.map(|()| ln)
}

fn check_dtype(t: &Tensor) -> Result<()> {
    super::shard::check_f32("tensor-parallel parameter", t)?;
    debug_assert_eq!(t.dtype(), DType::F32);
    Ok(())
}

fn visit_linear(prefix: &str, weight: &Tensor, bias: &Option<Tensor>, f: &mut dyn FnMut(&str, &Tensor)) {
    f(&join_name(prefix, "weight"), weight);
    if let Some(b) = bias {
        f(&join_name(prefix, "bias"), b);
    }
}

fn visit_linear_mut(prefix: &str, weight: &mut Tensor, bias: &mut Option<Tensor>, f: &mut dyn FnMut(&str, &mut Tensor)) {
    f(&join_name(prefix, "weight"), weight);
    if let Some(b) = bias {
        f(&join_name(prefix, "bias"), b);
    }
}
