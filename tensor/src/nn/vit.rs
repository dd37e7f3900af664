//! [`Vit`]: a Vision Transformer encoder. Images `[B, C, H, W]` are cut into `p×p` patches
//! ([`patchify`]), embedded by a Linear ([`PatchEmbed`]), given learned position embeddings and
//! an optional class token, run through full-attention [`TransformerBlock`]s and a final norm,
//! then pooled (class token or mean of patch tokens) and optionally classified by `head`.
//!
//! Video: with `frames > 1` the input is a clip `[B, C, T, H, W]`, cut into `tubelet × p × p`
//! tubes ([`patchify_3d`]): the tokens form a `[T/tubelet, H/p, W/p]` grid, flattened time-major
//! (slot by slot, each slot row by row), the V-JEPA layout. Everything after the embedding is the
//! same code for images and clips; an image is the `frames = 1` case (`tubelet = 1`) and keeps
//! every parameter shape and initial value it always had.
//!
//! The token-level steps are public ([`Vit::embed_patches`], [`Vit::select_tokens`],
//! [`Vit::encode_tokens`]) so a JEPA trainer can encode a subset of patches (context encoder) or
//! feed its own tokens.
//!
//! Parameter names, in visit order (timm's names): `cls_token` `[1, 1, C]` (if any),
//! `pos_embed` `[1, N(+1), C]`, `patch_embed.proj.{weight,bias}` (`[C, in_ch·p·p]`: the
//! flattened `[C, in_ch, p, p]` Conv2d weight of timm, same element order; `[C, in_ch·t·p·p]`, a
//! flattened Conv3d weight, for tubelets of `t` frames), `blocks.{i}.*` as in
//! [`TransformerBlock`], `norm.{weight,bias}`, `head.{weight,bias}` (if `n_classes`).

use super::{join_name, BlockConfig, Dropout, LayerNorm, Linear, Module, TransformerBlock};
use crate::error::{Error, Result};
use crate::ops::unary::GeluApprox;
use crate::rng::Generator;
use crate::tensor::Tensor;
use rtx_kernels::DType;

/// How [`Vit::pool`] turns tokens into one vector per image.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Pooling {
    /// The class token's output (needs `cls_token`).
    Cls,
    /// The mean of the patch tokens (the class token, if any, is left out).
    #[default]
    Mean,
}

/// Sizes and options of a [`Vit`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VitConfig {
    /// Image `[height, width]`, both multiples of `patch_size`.
    pub image_size: [usize; 2],
    /// Patch side p.
    pub patch_size: usize,
    /// Image channels.
    pub in_channels: usize,
    /// Width C.
    pub d_model: usize,
    /// Number of blocks.
    pub n_layers: usize,
    /// Attention heads (divides C).
    pub n_heads: usize,
    /// Feed-forward hidden width as a multiple of C.
    pub mlp_ratio: usize,
    /// Dropout after the embeddings and on residual branches.
    pub dropout: f64,
    /// Whether a learned class token is prepended.
    pub cls_token: bool,
    /// Pooling for [`Vit::pool`] and the head.
    pub pooling: Pooling,
    /// Classifier outputs, or `None` for a pure encoder.
    pub n_classes: Option<usize>,
    /// LayerNorm epsilon (timm uses 1e-6).
    pub layer_norm_eps: f64,
    /// Std of the normal init of weights, position embedding and class token.
    pub init_std: f64,
    /// Parameter dtype.
    pub dtype: DType,
    /// Frames per clip; 1 for images (the input is then `[B, C, H, W]`).
    pub frames: usize,
    /// Frames per tubelet (divides `frames`; 1 for images).
    pub tubelet: usize,
    /// The feed-forward GELU. The default stays the tanh approximation this encoder (and the
    /// I-JEPA runs built on it) has always used; `GeluApprox::None` is timm's and PyTorch's
    /// exact `nn.GELU()`.
    pub gelu: GeluApprox,
}

impl Default for VitConfig {
    /// A small encoder for 28×28 grayscale images: patch 4, C 64, 4 layers, 4 heads.
    fn default() -> Self {
        VitConfig {
            image_size: [28, 28],
            patch_size: 4,
            in_channels: 1,
            d_model: 64,
            n_layers: 4,
            n_heads: 4,
            mlp_ratio: 4,
            dropout: 0.0,
            cls_token: false,
            pooling: Pooling::Mean,
            n_classes: None,
            layer_norm_eps: 1e-6,
            init_std: 0.02,
            dtype: DType::F32,
            frames: 1,
            tubelet: 1,
            gelu: GeluApprox::Tanh,
        }
    }
}

/// A Linear over flattened patches: `[B, C_in, H, W] -> [B, N, C]`, or over flattened tubelets:
/// `[B, C_in, T, H, W] -> [B, N, C]`.
#[derive(Clone, Debug)]
pub struct PatchEmbed {
    /// `[C, C_in·t·p·p]` (`t` = 1 for images).
    pub proj: Linear,
    patch_size: usize,
    tubelet: usize,
}

/// A Vision Transformer encoder with an optional classification head.
#[derive(Clone, Debug)]
pub struct Vit {
    /// Patch embedding.
    pub patch_embed: PatchEmbed,
    /// `[1, 1, C]` class token.
    pub cls_token: Option<Tensor>,
    /// `[1, N(+1), C]` learned positions (class token's position first).
    pub pos_embed: Tensor,
    /// The blocks.
    pub blocks: Vec<TransformerBlock>,
    /// Final norm.
    pub norm: LayerNorm,
    /// Classifier on the pooled features.
    pub head: Option<Linear>,
    drop: Dropout,
    config: VitConfig,
}

/// Cuts `images [B, C, H, W]` into non-overlapping `p×p` patches: `[B, (H/p)·(W/p), C·p·p]`,
/// patches in row-major grid order, each flattened in `(c, i, j)` order (as a Conv2d with
/// kernel and stride p sees them). Differentiable.
#[allow(clippy::manual_is_multiple_of, reason = "is_multiple_of needs Rust 1.87; the workspace says 1.85")]
pub fn patchify(images: &Tensor, patch_size: usize) -> Result<Tensor> {
    let p = patch_size;
    if images.rank() != 4 || p == 0 || images.shape()[2] % p != 0 || images.shape()[3] % p != 0 {
        return Err(Error::BadShape {
            op: "patchify",
            shape: images.shape().to_vec(),
            reason: format!("expected [B, C, H, W] with H and W multiples of patch size {p}"),
        });
    }
    let (b, c, h, w) = (images.shape()[0], images.shape()[1], images.shape()[2], images.shape()[3]);
    let (gh, gw) = (h / p, w / p);
    images.reshape(&[b, c, gh, p, gw, p])?.permute(&[0, 2, 4, 1, 3, 5])?.reshape(&[b, gh * gw, c * p * p])
}

/// Cuts `clips [B, C, T, H, W]` into non-overlapping `t×p×p` tubelets:
/// `[B, (T/t)·(H/p)·(W/p), C·t·p·p]`, tubelets in time-major grid order (slot, row, column), each
/// flattened in `(c, dt, i, j)` order (as a Conv3d with kernel and stride `(t, p, p)` sees them).
/// Differentiable.
#[allow(clippy::manual_is_multiple_of, reason = "is_multiple_of needs Rust 1.87; the workspace says 1.85")]
pub fn patchify_3d(clips: &Tensor, tubelet: usize, patch_size: usize) -> Result<Tensor> {
    let (t, p) = (tubelet, patch_size);
    let s = clips.shape();
    if clips.rank() != 5 || p == 0 || t == 0 || s[2] % t != 0 || s[3] % p != 0 || s[4] % p != 0 {
        return Err(Error::BadShape {
            op: "patchify_3d",
            shape: s.to_vec(),
            reason: format!("expected [B, C, T, H, W] with T a multiple of tubelet {t} and H, W multiples of patch size {p}"),
        });
    }
    let (b, c, f, h, w) = (s[0], s[1], s[2], s[3], s[4]);
    let (gt, gh, gw) = (f / t, h / p, w / p);
    clips.reshape(&[b, c, gt, t, gh, p, gw, p])?.permute(&[0, 2, 4, 6, 1, 3, 5, 7])?.reshape(&[b, gt * gh * gw, c * t * p * p])
}

impl PatchEmbed {
    /// A patch embedding with weight ~ N(0, std²) and zero bias.
    pub fn new(in_channels: usize, patch_size: usize, d_model: usize, std: f64, dtype: DType, rng: &mut Generator) -> Result<PatchEmbed> {
        PatchEmbed::tubelets(in_channels, 1, patch_size, d_model, std, dtype, rng)
    }

    /// A tubelet embedding of `tubelet` frames (1: the image patch embedding of [`PatchEmbed::new`],
    /// same draws), weight ~ N(0, std²), zero bias.
    pub fn tubelets(in_channels: usize, tubelet: usize, patch_size: usize, d_model: usize, std: f64, dtype: DType, rng: &mut Generator) -> Result<PatchEmbed> {
        if patch_size == 0 || tubelet == 0 {
            return Err(Error::InvalidArgument { op: "PatchEmbed", reason: "patch size and tubelet must be positive".into() });
        }
        Ok(PatchEmbed { proj: Linear::normal(in_channels * tubelet * patch_size * patch_size, d_model, true, std, dtype, rng)?, patch_size, tubelet })
    }

    /// Patch side.
    pub fn patch_size(&self) -> usize {
        self.patch_size
    }

    /// Frames per tubelet (1 for images).
    pub fn tubelet(&self) -> usize {
        self.tubelet
    }

    /// `[B, C_in, H, W] -> [B, N, C]` (images), or `[B, C_in, T, H, W] -> [B, N, C]` (clips).
    pub fn forward(&self, input: &Tensor) -> Result<Tensor> {
        if input.rank() == 5 {
            return self.proj.forward(&patchify_3d(input, self.tubelet, self.patch_size)?);
        }
        if self.tubelet != 1 {
            return Err(Error::BadShape {
                op: "PatchEmbed",
                shape: input.shape().to_vec(),
                reason: format!("a tubelet embedding of {} frames takes [B, C, T, H, W]", self.tubelet),
            });
        }
        self.proj.forward(&patchify(input, self.patch_size)?)
    }
}

impl Module for PatchEmbed {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        self.proj.visit_params(&join_name(prefix, "proj"), f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        self.proj.visit_params_mut(&join_name(prefix, "proj"), f);
    }
}

impl Vit {
    /// An encoder initialised from `rng`; draws, in order: `cls_token`, `pos_embed`,
    /// `patch_embed`, blocks, `head`.
    pub fn new(config: VitConfig, rng: &mut Generator) -> Result<Vit> {
        let c = config;
        let [h, w] = c.image_size;
        if c.patch_size == 0 || h % c.patch_size != 0 || w % c.patch_size != 0 || h == 0 || w == 0 {
            return Err(Error::InvalidArgument { op: "Vit", reason: format!("image {h}x{w} is not a positive multiple of patch size {}", c.patch_size) });
        }
        if c.n_layers == 0 || c.mlp_ratio == 0 || c.in_channels == 0 {
            return Err(Error::InvalidArgument { op: "Vit", reason: "n_layers, mlp_ratio and in_channels must be positive".into() });
        }
        if c.frames == 0 || c.frames.checked_rem(c.tubelet) != Some(0) {
            return Err(Error::InvalidArgument { op: "Vit", reason: format!("{} frames do not split into tubelets of {}", c.frames, c.tubelet) });
        }
        if c.pooling == Pooling::Cls && !c.cls_token {
            return Err(Error::InvalidArgument { op: "Vit", reason: "class-token pooling needs cls_token = true".into() });
        }
        let n_patches = (c.frames / c.tubelet) * (h / c.patch_size) * (w / c.patch_size);
        let n_tokens = n_patches + usize::from(c.cls_token);
        let cls_token = if c.cls_token { Some(super::param(Tensor::randn(&[1, 1, c.d_model], 0.0, c.init_std, c.dtype, rng)?)) } else { None };
        let pos_embed = super::param(Tensor::randn(&[1, n_tokens, c.d_model], 0.0, c.init_std, c.dtype, rng)?);
        let patch_embed = PatchEmbed::tubelets(c.in_channels, c.tubelet, c.patch_size, c.d_model, c.init_std, c.dtype, rng)?;
        let block = BlockConfig {
            d_model: c.d_model,
            n_heads: c.n_heads,
            mlp_hidden: c.mlp_ratio * c.d_model,
            causal: false,
            bias: true,
            dropout: c.dropout,
            layer_norm_eps: c.layer_norm_eps,
            init_std: c.init_std,
            proj_init_std: c.init_std,
            dtype: c.dtype,
            gelu: c.gelu,
        };
        let blocks = (0..c.n_layers).map(|_| TransformerBlock::new(&block, rng)).collect::<Result<Vec<_>>>()?;
        let norm = LayerNorm::new(c.d_model, true, c.layer_norm_eps, c.dtype)?;
        let head = match c.n_classes {
            Some(n) => Some(Linear::normal(c.d_model, n, true, c.init_std, c.dtype, rng)?),
            None => None,
        };
        Ok(Vit { patch_embed, cls_token, pos_embed, blocks, norm, head, drop: Dropout::new(c.dropout)?, config })
    }

    /// A model of `config` holding the given tensors (a `state_dict` under this module's
    /// names), as [`super::Gpt::from_state_dict`].
    pub fn from_state_dict(config: VitConfig, state: &[(String, Tensor)]) -> Result<Vit> {
        // The init is overwritten, so the generator's seed does not matter.
        let model = Vit::new(config, &mut Generator::new(0))?;
        model.load_state_dict(state, true)?;
        Ok(model)
    }

    /// The configuration.
    pub fn config(&self) -> &VitConfig {
        &self.config
    }

    /// Number of patches (tokens, without the class token) per image or clip.
    pub fn n_patches(&self) -> usize {
        self.token_grid().iter().product()
    }

    /// The token grid `[time slots, rows, columns]` (`[1, H/p, W/p]` for images).
    pub fn token_grid(&self) -> [usize; 3] {
        let c = &self.config;
        [c.frames / c.tubelet, c.image_size[0] / c.patch_size, c.image_size[1] / c.patch_size]
    }

    /// Patch tokens with their position embeddings: `[B, C_in, H, W] -> [B, N, C]` (images) or
    /// `[B, C_in, T, H, W] -> [B, N, C]` (clips, `frames > 1`); no class token.
    pub fn embed_patches(&self, images: &Tensor) -> Result<Tensor> {
        let [h, w] = self.config.image_size;
        let (ch, frames) = (self.config.in_channels, self.config.frames);
        let ok =
            if frames == 1 { images.rank() == 4 && images.shape()[1..] == [ch, h, w] } else { images.rank() == 5 && images.shape()[1..] == [ch, frames, h, w] };
        if !ok {
            let expected = if frames == 1 { format!("[B, {ch}, {h}, {w}]") } else { format!("[B, {ch}, {frames}, {h}, {w}]") };
            return Err(Error::BadShape { op: "Vit", shape: images.shape().to_vec(), reason: format!("expected {expected}") });
        }
        let x = self.patch_embed.forward(images)?;
        let first = usize::from(self.cls_token.is_some());
        // `[N, C]` rather than `[1, N, C]`: a broadcast over the leading dimension, which the
        // device's add takes.
        x.add(&self.pos_embed.narrow(1, first, self.n_patches())?.reshape(&[self.n_patches(), self.config.d_model])?)
    }

    /// Gathers tokens `x [B, N, C]` at per-image indices `ids [B, K]` (u32 < N) into
    /// `[B, K, C]`. Differentiable with respect to `x`.
    pub fn select_tokens(x: &Tensor, ids: &Tensor) -> Result<Tensor> {
        if x.rank() != 3 || ids.rank() != 2 || ids.shape()[0] != x.shape()[0] {
            return Err(Error::ShapeMismatch { op: "Vit::select_tokens", lhs: x.shape().to_vec(), rhs: ids.shape().to_vec() });
        }
        let (b, n, c) = (x.shape()[0], x.shape()[1], x.shape()[2]);
        let k = ids.shape()[1];
        let local = ids.to_u32_vec()?;
        let mut global = Vec::with_capacity(local.len());
        for (i, &id) in local.iter().enumerate() {
            if id as usize >= n {
                return Err(Error::IndexOutOfRange { op: "Vit::select_tokens", index: id as usize, size: n });
            }
            let row = u32::try_from((i / k) * n).map_err(|_| Error::InvalidArgument { op: "Vit::select_tokens", reason: "B·N exceeds u32".into() })?;
            global.push(row + id);
        }
        let flat = x.reshape(&[b * n, c])?;
        Tensor::embedding(&flat, &Tensor::from_vec(global, &[b, k])?)
    }

    /// Runs tokens `[B, K, C]` (already position-embedded) through the encoder: prepends the
    /// class token (with its position) if any, dropout, the blocks, the final norm. Returns
    /// `[B, K(+1), C]`.
    pub fn encode_tokens(&self, tokens: &Tensor, rng: &mut Generator) -> Result<Tensor> {
        let c = self.config.d_model;
        if tokens.rank() != 3 || tokens.shape()[2] != c {
            return Err(Error::BadShape { op: "Vit::encode_tokens", shape: tokens.shape().to_vec(), reason: format!("expected [B, K, {c}]") });
        }
        let b = tokens.shape()[0];
        let x = match &self.cls_token {
            Some(cls) => {
                let cls = cls.add(&self.pos_embed.narrow(1, 0, 1)?)?.expand(&[b, 1, c])?;
                Tensor::cat(&[&cls, tokens], 1)?
            }
            None => tokens.clone(),
        };
        let mut x = self.drop.forward(&x, rng)?;
        for block in &self.blocks {
            x = block.forward(&x, None, rng)?;
        }
        self.norm.forward(&x)
    }

    /// A detached copy whose tensors are cast to `dtype` (on their device): how an f32 EMA
    /// target encoder runs its forward in a bf16 model's precision.
    pub fn cast_copy(&self, dtype: DType) -> Result<Vit> {
        let mut copy = self.clone();
        let mut failure = None;
        copy.visit_params_mut("", &mut |_, t| {
            if failure.is_none() {
                match t.detach().to_dtype(dtype) {
                    Ok(c) => *t = c,
                    Err(e) => failure = Some(e),
                }
            }
        });
        failure.map_or(Ok(copy), Err)
    }

    /// Encoded tokens `[B, N(+1), C]` of `images [B, C_in, H, W]` (class token first).
    pub fn forward_features(&self, images: &Tensor, rng: &mut Generator) -> Result<Tensor> {
        self.encode_tokens(&self.embed_patches(images)?, rng)
    }

    /// Encoded tokens of the patches `ids [B, K]` only (a JEPA context encoder).
    pub fn forward_features_subset(&self, images: &Tensor, ids: &Tensor, rng: &mut Generator) -> Result<Tensor> {
        self.encode_tokens(&Self::select_tokens(&self.embed_patches(images)?, ids)?, rng)
    }

    /// Pools encoded tokens `[B, K(+1), C]` into `[B, C]` as configured.
    pub fn pool(&self, features: &Tensor) -> Result<Tensor> {
        let first = usize::from(self.cls_token.is_some());
        if features.rank() != 3 || features.shape()[1] <= first {
            return Err(Error::BadShape {
                op: "Vit::pool",
                shape: features.shape().to_vec(),
                reason: "expected [B, tokens, C] with at least one patch token".into(),
            });
        }
        match self.config.pooling {
            Pooling::Cls => features.narrow(1, 0, 1)?.squeeze(1),
            Pooling::Mean => features.narrow(1, first, features.shape()[1] - first)?.mean(&[1], false),
        }
    }

    /// Class logits `[B, n_classes]` with a head, else the pooled features `[B, C]`.
    pub fn forward(&self, images: &Tensor, rng: &mut Generator) -> Result<Tensor> {
        let pooled = self.pool(&self.forward_features(images, rng)?)?;
        match &self.head {
            Some(head) => head.forward(&pooled),
            None => Ok(pooled),
        }
    }
}

impl Module for Vit {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        super::visit_opt(prefix, "cls_token", &self.cls_token, f);
        f(&join_name(prefix, "pos_embed"), &self.pos_embed);
        self.patch_embed.visit_params(&join_name(prefix, "patch_embed"), f);
        self.blocks.visit_params(&join_name(prefix, "blocks"), f);
        self.norm.visit_params(&join_name(prefix, "norm"), f);
        self.head.visit_params(&join_name(prefix, "head"), f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        super::visit_opt_mut(prefix, "cls_token", &mut self.cls_token, f);
        f(&join_name(prefix, "pos_embed"), &mut self.pos_embed);
        self.patch_embed.visit_params_mut(&join_name(prefix, "patch_embed"), f);
        self.blocks.visit_params_mut(&join_name(prefix, "blocks"), f);
        self.norm.visit_params_mut(&join_name(prefix, "norm"), f);
        self.head.visit_params_mut(&join_name(prefix, "head"), f);
    }

    fn set_training(&mut self, training: bool) {
        self.drop.set_training(training);
        self.blocks.set_training(training);
    }
}
