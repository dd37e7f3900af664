//! [`TpVit`]: the tensor-parallel form of [`Vit`], built from the same [`VitConfig`].
//!
//! The blocks are split as the GPT's ([`TpBlock`]: heads and hidden features over the ranks,
//! full attention); the patch embedding, class token, position embedding, final norm and the
//! classifier head are small and replicated. With sequence parallelism the embedded tokens are
//! split along the token dimension (`N(+1)` must divide by tp) before the blocks and gathered
//! after the final norm, so pooling and the head run on every rank alike. Parameter names are
//! the full model's; [`vit_shard_spec`] says which are split.

use rtx_tensor::nn::{join_name, Dropout, LayerNorm, Linear, Module, Pooling, Vit, VitConfig};
use rtx_tensor::{DType, Generator, Tensor};

use super::gpt::gpt_shard_spec;
use super::group::TpHandle;
use super::layers::{fresh_param, replicated_norm, TpBlock, TpContext};
use super::ops::{gather_sequence_to_replicated, scatter_to_sequence};
use super::shard::{gather_full_state, load_full_state, ShardSpec};
use super::TpOptions;
use crate::error::{Error, Result};

/// The tensor-parallel ViT on one rank (see the module doc).
#[derive(Clone, Debug)]
pub struct TpVit {
    /// Replicated `[C, C_in·p·p]` patch projection.
    pub patch_proj: Linear,
    /// Replicated `[1, 1, C]` class token.
    pub cls_token: Option<Tensor>,
    /// Replicated `[1, N(+1), C]` positions.
    pub pos_embed: Tensor,
    /// The blocks.
    pub blocks: Vec<TpBlock>,
    /// Replicated final norm.
    pub norm: LayerNorm,
    /// Replicated classifier.
    pub head: Option<Linear>,
    drop: Dropout,
    config: VitConfig,
    ctx: TpContext,
}

impl TpVit {
    /// Builds the full [`Vit`] from `rng` exactly as `Vit::new` does (transiently, once per
    /// rank) and keeps this rank's slices.
    pub fn new(config: VitConfig, rng: &mut Generator, group: TpHandle, options: TpOptions) -> Result<TpVit> {
        check_vit_config(&config, group.size())?;
        Self::from_full(&Vit::new(config, rng)?, group, options)
    }

    /// This rank's slices of every parameter of `full`.
    pub fn from_full(full: &Vit, group: TpHandle, options: TpOptions) -> Result<TpVit> {
        let config = *full.config();
        check_vit_config(&config, group.size())?;
        let ctx = TpContext { group, sequence_parallel: options.sequence_parallel };
        let linear = |l: &Linear| -> Result<Linear> { Ok(Linear { weight: fresh_param(&l.weight)?, bias: l.bias.as_ref().map(fresh_param).transpose()? }) };
        Ok(TpVit {
            patch_proj: linear(&full.patch_embed.proj)?,
            cls_token: full.cls_token.as_ref().map(fresh_param).transpose()?,
            pos_embed: fresh_param(&full.pos_embed)?,
            blocks: full.blocks.iter().map(|b| TpBlock::from_full(b, config.dropout, ctx.clone())).collect::<Result<Vec<_>>>()?,
            norm: replicated_norm(&full.norm)?,
            head: full.head.as_ref().map(linear).transpose()?,
            drop: Dropout::new(config.dropout)?,
            config,
            ctx,
        })
    }

    /// The configuration of the full model.
    pub fn config(&self) -> &VitConfig {
        &self.config
    }

    /// Which dimension of parameter `name` is split over the group.
    pub fn shard_spec(&self, name: &str) -> Option<ShardSpec> {
        vit_shard_spec(name, self.ctx.size())
    }

    /// Encoded tokens `[B, N(+1), C]` of `images [B, C_in, H, W]` (class token first), on every
    /// rank, as [`Vit::forward_features`].
    pub fn forward_features(&self, images: &Tensor, rng: &mut Generator) -> Result<Tensor> {
        let [h, w] = self.config.image_size;
        if images.rank() != 4 || images.shape()[1..] != [self.config.in_channels, h, w] {
            let reason = format!("expected [B, {}, {h}, {w}]", self.config.in_channels);
            return Err(Error::Tensor(rtx_tensor::Error::BadShape { op: "TpVit", shape: images.shape().to_vec(), reason }));
        }
        let (b, c) = (images.shape()[0], self.config.d_model);
        let n_patches = (h / self.config.patch_size) * (w / self.config.patch_size);
        let first = usize::from(self.cls_token.is_some());
        let patches = rtx_tensor::nn::patchify(images, self.config.patch_size)?;
        let x = self.patch_proj.forward(&patches)?.add(&self.pos_embed.narrow(1, first, n_patches)?)?;
        let x = match &self.cls_token {
            Some(cls) => Tensor::cat(&[&cls.add(&self.pos_embed.narrow(1, 0, 1)?)?.expand(&[b, 1, c])?, &x], 1)?,
            None => x,
        };
        let mut x = self.drop.forward(&x, rng)?;
        if self.ctx.sequence_parallel {
            x = scatter_to_sequence(&x, &self.ctx.group)?;
        }
        for block in &self.blocks {
            x = block.forward(&x, rng)?;
        }
        let x = self.ctx.layer_norm(&self.norm, &x)?;
        if self.ctx.sequence_parallel {
            gather_sequence_to_replicated(&x, &self.ctx.group)
        } else {
            Ok(x)
        }
    }

    /// Class logits `[B, n_classes]` with a head, else the pooled features `[B, C]`, as
    /// [`Vit::forward`].
    pub fn forward(&self, images: &Tensor, rng: &mut Generator) -> Result<Tensor> {
        let features = self.forward_features(images, rng)?;
        let first = usize::from(self.cls_token.is_some());
        let pooled = match self.config.pooling {
            Pooling::Cls => features.narrow(1, 0, 1)?.squeeze(1)?,
            Pooling::Mean => features.narrow(1, first, features.shape()[1] - first)?.mean(&[1], false)?,
        };
        match &self.head {
            Some(head) => Ok(head.forward(&pooled)?),
            None => Ok(pooled),
        }
    }

    /// Every parameter as the full tensor (a collective), as [`super::TpGpt::gather_full`].
    pub fn gather_full(&self) -> Result<Vec<(String, Tensor)>> {
        gather_full_state(self, |n| self.shard_spec(n), &self.ctx.group, |t| Ok(t.clone()))
    }

    /// Every parameter's gradient as the full tensor (zeros where none).
    pub fn gather_full_grads(&self) -> Result<Vec<(String, Tensor)>> {
        gather_full_state(self, |n| self.shard_spec(n), &self.ctx.group, |t| Ok(t.grad().unwrap_or_else(|| t.zeros_like())))
    }

    /// Copies this rank's slices of a full state in, in place.
    pub fn load_full(&mut self, full: &[(String, Tensor)]) -> Result<()> {
        load_full_state(self, |n| self.shard_spec(n), self.ctx.rank(), full)
    }
}

impl Module for TpVit {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        if let Some(cls) = &self.cls_token {
            f(&join_name(prefix, "cls_token"), cls);
        }
        f(&join_name(prefix, "pos_embed"), &self.pos_embed);
        self.patch_proj.visit_params(&join_name(prefix, "patch_embed.proj"), f);
        self.blocks.visit_params(&join_name(prefix, "blocks"), f);
        self.norm.visit_params(&join_name(prefix, "norm"), f);
        self.head.visit_params(&join_name(prefix, "head"), f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        if let Some(cls) = &mut self.cls_token {
            f(&join_name(prefix, "cls_token"), cls);
        }
        f(&join_name(prefix, "pos_embed"), &mut self.pos_embed);
        self.patch_proj.visit_params_mut(&join_name(prefix, "patch_embed.proj"), f);
        self.blocks.visit_params_mut(&join_name(prefix, "blocks"), f);
        self.norm.visit_params_mut(&join_name(prefix, "norm"), f);
        self.head.visit_params_mut(&join_name(prefix, "head"), f);
    }

    fn set_training(&mut self, training: bool) {
        self.drop.set_training(training);
        self.blocks.set_training(training);
    }
}

/// Which dimension of the ViT parameter `name` is split over `tp` ranks: the blocks' as in
/// [`gpt_shard_spec`]; everything else is replicated.
pub fn vit_shard_spec(name: &str, tp: usize) -> Option<ShardSpec> {
    if name.starts_with("blocks.") {
        gpt_shard_spec(name, tp)
    } else {
        None
    }
}

/// Checks that a ViT of `config` splits over `tp` ranks (heads; with sequence parallelism the
/// token count is checked at forward time).
pub fn check_vit_config(config: &VitConfig, tp: usize) -> Result<()> {
    if tp == 0 {
        return Err(Error::TpIndivisible { what: "tensor-parallel size", value: 0, tp });
    }
    for (what, value) in [("n_heads", config.n_heads), ("mlp_hidden", config.mlp_ratio * config.d_model)] {
        if value % tp != 0 {
            return Err(Error::TpIndivisible { what, value, tp });
        }
    }
    if config.dtype != DType::F32 {
        return Err(Error::Tensor(rtx_tensor::Error::UnsupportedDType { op: "TpVit (tensor parallelism moves f32)", dtype: config.dtype }));
    }
    Ok(())
}
