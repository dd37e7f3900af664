//! [`TpGpt`]: the tensor-parallel form of [`Gpt`], built from the same [`GptConfig`], or a
//! pipeline stage's part of it ([`StagePart`]: a range of blocks, with or without the embeddings
//! and the final norm + head).
//!
//! Layout on rank r of tp: `tok_emb.weight` rows `r·V/tp..` (vocab-parallel), `pos_emb`
//! replicated, per block the heads `r·H/tp..` (`attn.qkv` rows of those heads' q, k and v,
//! `attn.proj` the matching columns) and hidden features `r·4C/tp..` (`mlp.fc` rows, `mlp.proj`
//! columns), layer norms and row-parallel biases replicated, and the head tied to (or, untied, a
//! vocab slice like) the embedding. The loss is the vocab-parallel cross-entropy: no rank holds
//! full-vocabulary logits. [`gpt_shard_spec`] says which dimension of each parameter is split.
//!
//! Parameter names are the full model's (`blocks.{i}` with the global block index), shapes local,
//! so optimizers, buckets and checkpoints work unchanged; [`TpGpt::gather_full`] and
//! [`TpGpt::load_full`] convert to and from full tensors.
//!
//! Replicated parameters receive identical gradients on every rank: without sequence parallelism
//! their inputs and output gradients are replicated; with it they go through `copy_to_tp`, whose
//! backward all-reduces their gradient over the group (each rank saw other positions).
//!
//! Dropout: without sequence parallelism every dropped tensor is replicated and drawn in the full
//! model's order, so handing every rank the same generator reproduces the full model's masks. With
//! sequence parallelism each rank drops its own positions `[B, T/tp, C]`; hand each rank its own
//! generator stream (Megatron's model-parallel RNG) or the ranks' masks repeat across positions.
//!
//! Tied embeddings across pipeline stages: a stage with the head but not the embedding holds its
//! own copy of its `tok_emb.weight` slice, under that name ([`TIED_EMBEDDING_PARAM`]); the engine
//! all-reduces that parameter's gradient between the first and last stage (Megatron's embedding
//! group). [`TpGpt::tied_embedding`] gives it on both ends and
//! [`TpGpt::needs_embedding_sync`] says whether a stage takes part.

use std::ops::Range;

use rtx_tensor::nn::{join_name, Dropout, Embedding, Gpt, GptConfig, LayerNorm, Module};
use rtx_tensor::{DType, Generator, Tensor};

use super::group::TpHandle;
use super::layers::{fresh_param, replicated_norm, TpBlock, TpContext, VocabParallelEmbedding};
use super::ops::vocab_parallel_cross_entropy;
use super::shard::{gather_full_state, load_full_state, ShardSpec};
use crate::error::{Error, Result};

/// The name of the token embedding, also the tied head's weight on a last stage.
pub const TIED_EMBEDDING_PARAM: &str = "tok_emb.weight";

/// Options of a tensor-parallel model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TpOptions {
    /// Split activations along the sequence outside the tensor-parallel regions (layer norms,
    /// dropout, residuals): `[B, T/tp, C]` between blocks, T must divide by tp.
    pub sequence_parallel: bool,
}

/// Which part of the model a pipeline stage builds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagePart {
    /// Global indices of the blocks.
    pub layers: Range<usize>,
    /// Token and position embeddings (the first stage).
    pub embedding: bool,
    /// Final norm and language-model head (the last stage).
    pub head: bool,
}

/// The tensor-parallel GPT on one rank (see the module doc).
#[derive(Clone, Debug)]
pub struct TpGpt {
    /// Vocab-parallel token embedding (stages with the embedding).
    pub tok_emb: Option<VocabParallelEmbedding>,
    /// Replicated position embedding (stages with the embedding).
    pub pos_emb: Option<Embedding>,
    /// This stage's blocks, `part().layers` in order.
    pub blocks: Vec<TpBlock>,
    /// Replicated final norm (stages with the head).
    pub ln_f: Option<LayerNorm>,
    head: Option<Head>,
    drop: Dropout,
    config: GptConfig,
    ctx: TpContext,
    part: StagePart,
    training: bool,
}

/// The head's weight: the stage's own embedding, or a tensor of its own.
#[derive(Clone, Debug)]
enum Head {
    Tied,
    Own { name: &'static str, weight: Tensor },
}

impl StagePart {
    /// The whole model: every block, the embeddings and the head.
    pub fn whole(n_layers: usize) -> StagePart {
        StagePart { layers: 0..n_layers, embedding: true, head: true }
    }
}

impl TpGpt {
    /// The whole model for this rank: builds the full [`Gpt`] from `rng` exactly as
    /// `Gpt::new(config, rng)` does, then keeps this rank's slices. The full model exists
    /// transiently (its parameters once more, per rank), so a TP run starts from the single-rank
    /// init bit for bit.
    pub fn new(config: GptConfig, rng: &mut Generator, group: TpHandle, options: TpOptions) -> Result<TpGpt> {
        Self::new_part(config, rng, group, options, StagePart::whole(config.n_layers))
    }

    /// As [`TpGpt::new`] for a stage's part.
    pub fn new_part(config: GptConfig, rng: &mut Generator, group: TpHandle, options: TpOptions, part: StagePart) -> Result<TpGpt> {
        check_config(&config, group.size())?;
        let full = Gpt::new(config, rng)?;
        Self::from_full_part(&full, group, options, part)
    }

    /// This rank's slices of every parameter of `full`.
    pub fn from_full(full: &Gpt, group: TpHandle, options: TpOptions) -> Result<TpGpt> {
        Self::from_full_part(full, group, options, StagePart::whole(full.config().n_layers))
    }

    /// This rank's slices of `full`'s parameters for a stage's part.
    pub fn from_full_part(full: &Gpt, group: TpHandle, options: TpOptions, part: StagePart) -> Result<TpGpt> {
        let config = *full.config();
        check_config(&config, group.size())?;
        if part.layers.start > part.layers.end || part.layers.end > config.n_layers {
            return Err(Error::TpStagePart { layers: part.layers.clone(), n_layers: config.n_layers });
        }
        let ctx = TpContext { group, sequence_parallel: options.sequence_parallel };
        let span = tracing::info_span!("tp_gpt_build", rank = ctx.rank(), tp = ctx.size(), layers = ?part.layers, embedding = part.embedding, head = part.head);
        let _entered = span.enter();
        let (tok_emb, pos_emb) = if part.embedding {
            (Some(VocabParallelEmbedding::from_full(&full.tok_emb.weight, ctx.clone())?), Some(Embedding::from_tensor(fresh_param(&full.pos_emb.weight)?)?))
        } else {
            (None, None)
        };
        let blocks = full.blocks[part.layers.clone()].iter().map(|b| TpBlock::from_full(b, config.dropout, ctx.clone())).collect::<Result<Vec<_>>>()?;
        let (ln_f, head) = if part.head {
            let head = match (&full.lm_head, part.embedding) {
                (None, true) => Head::Tied,
                (None, false) => Head::Own { name: TIED_EMBEDDING_PARAM, weight: vocab_shard(&full.tok_emb.weight, &ctx)? },
                (Some(lm_head), _) => Head::Own { name: "lm_head.weight", weight: vocab_shard(&lm_head.weight, &ctx)? },
            };
            (Some(replicated_norm(&full.ln_f)?), Some(head))
        } else {
            (None, None)
        };
        Ok(TpGpt { tok_emb, pos_emb, blocks, ln_f, head, drop: Dropout::new(config.dropout)?, config, ctx, part, training: full.is_training() })
    }

    /// The configuration of the full model.
    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    /// Whether the model is in training mode (dropout on).
    pub fn is_training(&self) -> bool {
        self.training
    }

    /// The part of the model this stage holds.
    pub fn part(&self) -> &StagePart {
        &self.part
    }

    /// The group and layout.
    pub fn context(&self) -> &TpContext {
        &self.ctx
    }

    /// Which dimension of parameter `name` is split over the group (`None`: replicated or unknown).
    pub fn shard_spec(&self, name: &str) -> Option<ShardSpec> {
        gpt_shard_spec(name, self.ctx.size())
    }

    /// The tied embedding this stage holds (the embedding, or the last stage's copy), if the
    /// model ties the head to the embedding and this stage has either end.
    pub fn tied_embedding(&self) -> Option<&Tensor> {
        if !self.config.tie_embeddings {
            return None;
        }
        match (&self.tok_emb, &self.head) {
            (Some(emb), _) => Some(&emb.weight),
            (None, Some(Head::Own { name, weight })) if *name == TIED_EMBEDDING_PARAM => Some(weight),
            _ => None,
        }
    }

    /// Whether this stage holds one end of a tied embedding whose other end is on another stage
    /// (its [`TpGpt::tied_embedding`] gradient must be all-reduced with that stage's).
    pub fn needs_embedding_sync(&self) -> bool {
        self.config.tie_embeddings && self.part.embedding != self.part.head
    }

    /// Embeddings `ids [B, T] -> [B, T, C]` (`[B, T/tp, C]` with sequence parallelism, this rank's
    /// positions), after dropout.
    pub fn embed(&self, ids: &Tensor, rng: &mut Generator) -> Result<Tensor> {
        let (Some(tok_emb), Some(pos_emb)) = (&self.tok_emb, &self.pos_emb) else {
            return Err(Error::TpMissingPart { what: "embedding", layers: self.part.layers.clone() });
        };
        if ids.dtype() != DType::U32 {
            return Err(Error::Tensor(rtx_tensor::Error::DTypeMismatch { op: "TpGpt", lhs: ids.dtype(), rhs: DType::U32 }));
        }
        let t = if ids.rank() == 2 { ids.shape()[1] } else { 0 };
        if t == 0 || t > self.config.context {
            let reason = format!("ids must be [B, T] with 1 <= T <= context {}", self.config.context);
            return Err(Error::Tensor(rtx_tensor::Error::BadShape { op: "TpGpt", shape: ids.shape().to_vec(), reason }));
        }
        let (tp, rank) = (self.ctx.size(), self.ctx.rank());
        let positions = if self.ctx.sequence_parallel {
            if t % tp != 0 {
                return Err(Error::TpIndivisible { what: "sequence length", value: t, tp });
            }
            let local = t / tp;
            (rank * local) as u32..((rank + 1) * local) as u32
        } else {
            0..t as u32
        };
        let n_positions = positions.len();
        let positions = Tensor::from_vec(positions.collect::<Vec<u32>>(), &[n_positions])?;
        let pos = Tensor::embedding(&self.ctx.replicated(&pos_emb.weight)?, &positions)?;
        let x = tok_emb.forward(ids)?.add(&pos)?;
        Ok(self.drop.forward(&x, rng)?)
    }

    /// This stage's blocks, in order.
    pub fn forward_blocks(&self, x: &Tensor, rng: &mut Generator) -> Result<Tensor> {
        let mut x = x.clone();
        for block in &self.blocks {
            x = block.forward(&x, rng)?;
        }
        Ok(x)
    }

    /// The final norm (stages with the head).
    pub fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        let Some(ln_f) = &self.ln_f else {
            return Err(Error::TpMissingPart { what: "final norm", layers: self.part.layers.clone() });
        };
        self.ctx.layer_norm(ln_f, x)
    }

    /// Final hidden states (after `ln_f`) for `ids [B, T]`, as [`Gpt::forward_hidden`]:
    /// `[B, T, C]`, or this rank's `[B, T/tp, C]` with sequence parallelism.
    pub fn forward_hidden(&self, ids: &Tensor, rng: &mut Generator) -> Result<Tensor> {
        self.final_norm(&self.forward_blocks(&self.embed(ids, rng)?, rng)?)
    }

    /// Mean next-token cross-entropy from the last block's output `x` (before `ln_f`; `[B, T, C]`,
    /// or `[B, T/tp, C]` with sequence parallelism) against `targets [B, T]`: final norm, then the
    /// vocab-parallel head and cross-entropy. The same value on every rank.
    pub fn head_loss(&self, x: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let weight = match &self.head {
            Some(Head::Tied) => self.tok_emb.as_ref().map(|e| &e.weight),
            Some(Head::Own { weight, .. }) => Some(weight),
            None => None,
        };
        let Some(weight) = weight else {
            return Err(Error::TpMissingPart { what: "head", layers: self.part.layers.clone() });
        };
        let h = self.ctx.enter(&self.final_norm(x)?)?;
        let (b, t, c) = (h.shape()[0], h.shape()[1], h.shape()[2]);
        if targets.shape() != [b, t] {
            return Err(Error::Tensor(rtx_tensor::Error::ShapeMismatch { op: "TpGpt::head_loss", lhs: vec![b, t], rhs: targets.shape().to_vec() }));
        }
        let logits = h.reshape(&[b * t, c])?.linear(weight, None)?;
        vocab_parallel_cross_entropy(&logits, &targets.reshape(&[b * t])?, self.config.vocab_size, &self.ctx.group)
    }

    /// Mean next-token cross-entropy of `ids [B, T]` against `targets [B, T]`, as [`Gpt::loss`]
    /// (stages holding the whole model).
    pub fn loss(&self, ids: &Tensor, targets: &Tensor, rng: &mut Generator) -> Result<Tensor> {
        self.head_loss(&self.forward_blocks(&self.embed(ids, rng)?, rng)?, targets)
    }

    /// Every parameter of this stage as the full tensor (all-gathered where split), full names,
    /// visit order. A collective: every rank of the group calls it.
    pub fn gather_full(&self) -> Result<Vec<(String, Tensor)>> {
        gather_full_state(self, |n| self.shard_spec(n), &self.ctx.group, |t| Ok(t.clone()))
    }

    /// Every parameter's gradient as the full tensor (zeros where a parameter has none), as
    /// [`TpGpt::gather_full`].
    pub fn gather_full_grads(&self) -> Result<Vec<(String, Tensor)>> {
        gather_full_state(self, |n| self.shard_spec(n), &self.ctx.group, |t| Ok(t.grad().unwrap_or_else(|| t.zeros_like())))
    }

    /// Copies this rank's slices of the full tensors `full` (named as the full model's
    /// parameters; extra entries are ignored) into this stage's parameters, in place.
    pub fn load_full(&mut self, full: &[(String, Tensor)]) -> Result<()> {
        load_full_state(self, |n| self.shard_spec(n), self.ctx.rank(), full)
    }
}

impl Module for TpGpt {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        self.tok_emb.visit_params(&join_name(prefix, "tok_emb"), f);
        self.pos_emb.visit_params(&join_name(prefix, "pos_emb"), f);
        for (i, block) in self.blocks.iter().enumerate() {
            block.visit_params(&join_name(prefix, &format!("blocks.{}", self.part.layers.start + i)), f);
        }
        self.ln_f.visit_params(&join_name(prefix, "ln_f"), f);
        if let Some(Head::Own { name, weight }) = &self.head {
            f(&join_name(prefix, name), weight);
        }
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        self.tok_emb.visit_params_mut(&join_name(prefix, "tok_emb"), f);
        self.pos_emb.visit_params_mut(&join_name(prefix, "pos_emb"), f);
        for (i, block) in self.blocks.iter_mut().enumerate() {
            block.visit_params_mut(&join_name(prefix, &format!("blocks.{}", self.part.layers.start + i)), f);
        }
        self.ln_f.visit_params_mut(&join_name(prefix, "ln_f"), f);
        if let Some(Head::Own { name, weight }) = &mut self.head {
            f(&join_name(prefix, name), weight);
        }
    }

    fn set_training(&mut self, training: bool) {
        self.training = training;
        self.drop.set_training(training);
        self.blocks.set_training(training);
    }
}

/// Which dimension of the GPT parameter `name` is split over `tp` ranks: vocabulary rows of
/// `tok_emb.weight` and `lm_head.weight`, output rows of `attn.qkv` (in three blocks: q, k, v)
/// and `mlp.fc`, input columns of `attn.proj.weight` and `mlp.proj.weight`. `None` for
/// replicated parameters (`pos_emb`, norms, row-parallel biases) and unknown names.
pub fn gpt_shard_spec(name: &str, tp: usize) -> Option<ShardSpec> {
    let split = |dim| Some(ShardSpec::new(dim, tp));
    if name == TIED_EMBEDDING_PARAM || name == "lm_head.weight" {
        return split(0);
    }
    let rest = name.strip_prefix("blocks.")?;
    let (_, layer_param) = rest.split_once('.')?;
    match layer_param {
        "attn.qkv.weight" | "attn.qkv.bias" => Some(ShardSpec { dim: 0, parts: tp, blocks: 3 }),
        "mlp.fc.weight" | "mlp.fc.bias" => split(0),
        "attn.proj.weight" | "mlp.proj.weight" => split(1),
        _ => None,
    }
}

/// Checks that a GPT of `config` splits over `tp` ranks.
pub fn check_config(config: &GptConfig, tp: usize) -> Result<()> {
    if tp == 0 {
        return Err(Error::TpIndivisible { what: "tensor-parallel size", value: 0, tp });
    }
    let mlp_hidden = config.mlp_ratio * config.d_model;
    for (what, value) in [("n_heads", config.n_heads), ("vocab_size", config.vocab_size), ("mlp_hidden", mlp_hidden)] {
        if value % tp != 0 {
            return Err(Error::TpIndivisible { what, value, tp });
        }
    }
    if config.dtype != DType::F32 {
        return Err(Error::Tensor(rtx_tensor::Error::UnsupportedDType { op: "TpGpt (tensor parallelism moves f32)", dtype: config.dtype }));
    }
    Ok(())
}

fn vocab_shard(full: &Tensor, ctx: &TpContext) -> Result<Tensor> {
    let spec = ShardSpec::new(0, ctx.size());
    spec.check_full("vocab_size", full.shape())?;
    Ok(spec.slice(full, ctx.rank())?.requires_grad(true))
}
