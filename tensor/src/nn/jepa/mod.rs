//! I-JEPA ([`IJepa`]): a context encoder ([`Vit`] on the context tokens), a target encoder that is
//! an exponential moving average (EMA) of it, kept as buffers, and a narrow predictor
//! ([`JepaPredictor`]) that maps the context tokens plus mask tokens (a learned token plus the
//! fixed 2-D sin-cos position of each target patch) to the target encoder's layer-normed features
//! of the target blocks (`mask`). The loss is L2 or smooth L1 in that latent space; no
//! gradient reaches the target encoder.
//!
//! The training step is: masks for the batch ([`MaskConfig::sample`]), [`IJepa::loss`], backward,
//! the optimizer step on the parameters (`encoder.*`, `predictor.*`), then
//! [`IJepa::ema_update`] with the momentum of the step ([`IJepa::momentum`]: linear from
//! `momentum.0` to `momentum.1` over the run). The target encoder's tensors (`target_encoder.*`)
//! are buffers: checkpoints and elastic state sync carry them, the optimizer never sees them.
//!
//! V-JEPA is the same model over space-time tokens: an encoder with `frames > 1` embeds clips
//! `[B, C, T, H, W]` as tubelets (a `[t, h, w]` token grid, time-major), the positions (the
//! encoder's initial ones and the predictor's fixed ones) are 3-D sin-cos ([`sincos_3d`]), and the
//! masks are tubes ([`JepaMasks::tubes`]: a multi-block mask of the spatial grid repeated in every
//! time slot). Images are the `t = 1` case and keep their 2-D positions.
//!
//! The predictor runs once per target block, as I-JEPA's: the context tokens are repeated `M`
//! times along the batch (block-major, matching [`JepaMasks::targets_tensor`]).

mod mask;

pub use mask::{JepaMasks, MaskConfig, MAX_TRIES};

use super::{join_name, BlockConfig, LayerNorm, Linear, Module, TransformerBlock, Vit, VitConfig};
use crate::error::{Error, Result};
use crate::ops::softmax::Reduction;
use crate::rng::Generator;
use crate::tensor::Tensor;
use std::sync::{Arc, Mutex, PoisonError};

/// The latent loss between predicted and target features.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum JepaLoss {
    /// Mean squared error.
    #[default]
    L2,
    /// Smooth L1 (Huber with β = 1), as I-JEPA's released code.
    SmoothL1,
}

/// Sizes and schedules of an [`IJepa`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IJepaConfig {
    /// The context (and target) encoder: no head, no class token.
    pub encoder: VitConfig,
    /// Predictor width.
    pub predictor_width: usize,
    /// Predictor blocks.
    pub predictor_depth: usize,
    /// Predictor attention heads.
    pub predictor_heads: usize,
    /// Latent loss.
    pub loss: JepaLoss,
    /// EMA momentum at the first and the last step.
    pub momentum: (f64, f64),
    /// Start the encoder's learned position embedding at the 2-D sin-cos values (I-JEPA keeps
    /// it fixed there; here it starts there and trains).
    pub sincos_pos_init: bool,
}

impl Default for IJepaConfig {
    fn default() -> Self {
        IJepaConfig {
            encoder: VitConfig::default(),
            predictor_width: 32,
            predictor_depth: 2,
            predictor_heads: 2,
            loss: JepaLoss::L2,
            momentum: (0.996, 1.0),
            sincos_pos_init: true,
        }
    }
}

/// The narrow transformer that predicts target-block features from context tokens.
/// Parameter names: `mask_token` `[1, 1, P]`, `embed.*` (`[P, C]`), `blocks.{i}.*`, `norm.*`,
/// `proj.*` (`[C, P]`).
#[derive(Clone, Debug)]
pub struct JepaPredictor {
    /// The learned mask token.
    pub mask_token: Tensor,
    /// Encoder width to predictor width.
    pub embed: Linear,
    /// The blocks.
    pub blocks: Vec<TransformerBlock>,
    /// Final norm.
    pub norm: LayerNorm,
    /// Predictor width back to encoder width.
    pub proj: Linear,
    /// `[N, P]` fixed 2-D sin-cos positions (a function of the grid: neither trained nor saved).
    pos: Tensor,
    /// `pos` on the device and in the dtype the last forward ran in (moved once, not per step).
    pos_cache: Arc<Mutex<Option<Tensor>>>,
}

/// An I-JEPA model: `encoder.*` and `predictor.*` are parameters, `target_encoder.*` buffers.
#[derive(Clone, Debug)]
pub struct IJepa {
    /// The context encoder (the representation that is evaluated).
    pub encoder: Vit,
    /// The predictor.
    pub predictor: JepaPredictor,
    /// The EMA target encoder (buffers; no gradient).
    pub target_encoder: Vit,
    config: IJepaConfig,
}

/// What one I-JEPA loss evaluation returns.
pub struct JepaOutput {
    /// The scalar latent loss (differentiable with respect to the parameters).
    pub loss: Tensor,
    /// Mean over feature dimensions of the standard deviation across the batch of the
    /// mean-pooled context-encoder features (a collapse monitor; 0 when every image maps to the
    /// same vector).
    pub feature_std: f64,
}

/// `[h·w, dim]` 2-D sin-cos position embedding (MAE's `get_2d_sincos_pos_embed`): the first half
/// of the features encodes the column, the second half the row, each as `sin | cos` of
/// `pos / 10000^(2i/(dim/2))`. `dim` must be a multiple of 4.
#[allow(clippy::manual_is_multiple_of, reason = "is_multiple_of needs Rust 1.87; the workspace says 1.85")]
pub fn sincos_2d(grid: [usize; 2], dim: usize) -> Result<Vec<f32>> {
    if dim == 0 || dim % 4 != 0 {
        return Err(Error::InvalidArgument { op: "sincos_2d", reason: format!("embedding width {dim} is not a positive multiple of 4") });
    }
    let [gh, gw] = grid;
    let quarter = dim / 4;
    let mut out = Vec::with_capacity(gh * gw * dim);
    for r in 0..gh {
        for c in 0..gw {
            for (pos, _) in [(c, 0), (r, 1)] {
                let omega = |i: usize| 1.0 / 10000f64.powf(i as f64 / quarter as f64);
                out.extend((0..quarter).map(|i| (pos as f64 * omega(i)).sin() as f32));
                out.extend((0..quarter).map(|i| (pos as f64 * omega(i)).cos() as f32));
            }
        }
    }
    Ok(out)
}

/// 3-D sin-cos positions of a `[t, h, w]` token grid (time-major, as [`JepaMasks::tubes`] and
/// tubelet embeddings order tokens) of width `dim` (a multiple of 8), V-JEPA's layout: the
/// column's 1-D sin-cos in `dim/4` values, then the row's in `dim/4`, then the time slot's in
/// `dim/2`. A grid of one time slot (an image) gets the 2-D positions of [`sincos_2d`] instead,
/// so image models are unchanged.
#[allow(clippy::manual_is_multiple_of, reason = "is_multiple_of needs Rust 1.87; the workspace says 1.85")]
pub fn sincos_3d(grid: [usize; 3], dim: usize) -> Result<Vec<f32>> {
    let [gt, gh, gw] = grid;
    if gt == 1 {
        return sincos_2d([gh, gw], dim);
    }
    if dim == 0 || dim % 8 != 0 {
        return Err(Error::InvalidArgument { op: "sincos_3d", reason: format!("embedding width {dim} of a {gt}-slot grid is not a positive multiple of 8") });
    }
    let one_d = |pos: usize, width: usize, out: &mut Vec<f32>| {
        let half = width / 2;
        let omega = |i: usize| 1.0 / 10000f64.powf(i as f64 / half as f64);
        out.extend((0..half).map(|i| (pos as f64 * omega(i)).sin() as f32));
        out.extend((0..half).map(|i| (pos as f64 * omega(i)).cos() as f32));
    };
    let mut out = Vec::with_capacity(gt * gh * gw * dim);
    for t in 0..gt {
        for r in 0..gh {
            for c in 0..gw {
                one_d(c, dim / 4, &mut out);
                one_d(r, dim / 4, &mut out);
                one_d(t, dim / 2, &mut out);
            }
        }
    }
    debug_assert_eq!(out.len(), gt * gh * gw * dim);
    Ok(out)
}

impl JepaPredictor {
    /// A predictor for a `grid` of `[t, h, w]` tokens (`t = 1` for images) of an encoder of width
    /// `encoder_width`.
    pub fn new(
        encoder_width: usize,
        width: usize,
        depth: usize,
        heads: usize,
        grid: [usize; 3],
        encoder: &VitConfig,
        rng: &mut Generator,
    ) -> Result<JepaPredictor> {
        if depth == 0 {
            return Err(Error::InvalidArgument { op: "JepaPredictor", reason: "predictor depth must be at least 1".into() });
        }
        let dtype = encoder.dtype;
        let std = encoder.init_std;
        let mask_token = super::param(Tensor::randn(&[1, 1, width], 0.0, std, dtype, rng)?);
        let embed = Linear::normal(encoder_width, width, true, std, dtype, rng)?;
        let block = BlockConfig {
            d_model: width,
            n_heads: heads,
            mlp_hidden: encoder.mlp_ratio * width,
            causal: false,
            bias: true,
            dropout: 0.0,
            layer_norm_eps: encoder.layer_norm_eps,
            init_std: std,
            proj_init_std: std,
            dtype,
            gelu: encoder.gelu,
        };
        let blocks = (0..depth).map(|_| TransformerBlock::new(&block, rng)).collect::<Result<Vec<_>>>()?;
        let norm = LayerNorm::new(width, true, encoder.layer_norm_eps, dtype)?;
        let proj = Linear::normal(width, encoder_width, true, std, dtype, rng)?;
        let pos = Tensor::from_vec(sincos_3d(grid, width)?, &[grid.iter().product(), width])?.to_dtype(dtype)?;
        Ok(JepaPredictor { mask_token, embed, blocks, norm, proj, pos, pos_cache: Arc::default() })
    }

    /// The positions on `like`'s device and in its dtype.
    fn positions(&self, like: &Tensor) -> Result<Tensor> {
        if self.pos.device() == like.device() && self.pos.dtype() == like.dtype() {
            return Ok(self.pos.clone());
        }
        let mut cache = self.pos_cache.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(p) = cache.as_ref().filter(|p| p.device() == like.device() && p.dtype() == like.dtype()) {
            return Ok(p.clone());
        }
        let p = self.pos.to_dtype(like.dtype())?.to_device(like.device())?;
        *cache = Some(p.clone());
        Ok(p)
    }

    /// Predicts `[M·B, Kt, C]` target features from context features `z [B, Kc, C]` at
    /// `context [B, Kc]` and target positions `targets [M·B, Kt]` (block-major).
    #[allow(clippy::manual_is_multiple_of, reason = "is_multiple_of needs Rust 1.87; the workspace says 1.85")]
    pub fn forward(&self, z: &Tensor, context: &Tensor, targets: &Tensor, rng: &mut Generator) -> Result<Tensor> {
        let (b, kc) = (z.shape()[0], z.shape()[1]);
        let (mb, kt) = (targets.shape()[0], targets.shape()[1]);
        if context.shape() != [b, kc] || mb % b != 0 || mb == 0 {
            return Err(Error::ShapeMismatch { op: "JepaPredictor", lhs: context.shape().to_vec(), rhs: targets.shape().to_vec() });
        }
        let m = mb / b;
        let width = self.embed.out_features();
        let pos = self.positions(z)?;
        let x = self.embed.forward(z)?.add(&Tensor::embedding(&pos, context)?)?;
        let repeated: Vec<&Tensor> = std::iter::repeat_n(&x, m).collect();
        let x = if m == 1 { x.clone() } else { Tensor::cat(&repeated, 0)? };
        // The mask token as a `[P]` row broadcast over the queries (the device's add takes it).
        let queries = Tensor::embedding(&pos, targets)?.add(&self.mask_token.reshape(&[width])?)?;
        debug_assert_eq!(queries.shape(), [mb, kt, width]);
        let mut x = Tensor::cat(&[&x, &queries], 1)?;
        for block in &self.blocks {
            x = block.forward(&x, None, rng)?;
        }
        let x = self.norm.forward(&x)?.narrow(1, kc, kt)?.contiguous()?;
        self.proj.forward(&x)
    }
}

impl Module for JepaPredictor {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        f(&join_name(prefix, "mask_token"), &self.mask_token);
        self.embed.visit_params(&join_name(prefix, "embed"), f);
        self.blocks.visit_params(&join_name(prefix, "blocks"), f);
        self.norm.visit_params(&join_name(prefix, "norm"), f);
        self.proj.visit_params(&join_name(prefix, "proj"), f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        f(&join_name(prefix, "mask_token"), &mut self.mask_token);
        self.embed.visit_params_mut(&join_name(prefix, "embed"), f);
        self.blocks.visit_params_mut(&join_name(prefix, "blocks"), f);
        self.norm.visit_params_mut(&join_name(prefix, "norm"), f);
        self.proj.visit_params_mut(&join_name(prefix, "proj"), f);
    }
}

impl IJepa {
    /// A model initialised from `rng` (encoder, then predictor); the target encoder starts as an
    /// exact copy of the encoder.
    pub fn new(config: IJepaConfig, rng: &mut Generator) -> Result<IJepa> {
        let mut enc_cfg = config.encoder;
        enc_cfg.n_classes = None;
        enc_cfg.cls_token = false;
        enc_cfg.pooling = super::Pooling::Mean;
        let (m0, m1) = config.momentum;
        if !(0.0..=1.0).contains(&m0) || !(0.0..=1.0).contains(&m1) {
            return Err(Error::InvalidArgument { op: "IJepa", reason: format!("EMA momentum range {:?} must lie in [0, 1]", config.momentum) });
        }
        let encoder = Vit::new(enc_cfg, rng)?;
        let grid = encoder.token_grid();
        if config.sincos_pos_init {
            let values = sincos_3d(grid, enc_cfg.d_model)?;
            encoder.pos_embed.copy_from_(&Tensor::from_vec(values, encoder.pos_embed.shape())?.to_dtype(enc_cfg.dtype)?)?;
        }
        let predictor = JepaPredictor::new(enc_cfg.d_model, config.predictor_width, config.predictor_depth, config.predictor_heads, grid, &enc_cfg, rng)?;
        // A second encoder (its init draws come from a scratch generator and are overwritten),
        // detached: its tensors never require a gradient.
        let mut target_encoder = Vit::new(enc_cfg, &mut Generator::new(0))?;
        target_encoder.visit_params_mut("", &mut |_, t| *t = t.detach());
        for ((_, src), (_, dst)) in encoder.named_parameters().iter().zip(target_encoder.named_parameters_all()) {
            dst.copy_from_(src)?;
        }
        Ok(IJepa { encoder, predictor, target_encoder, config: IJepaConfig { encoder: enc_cfg, ..config } })
    }

    /// The configuration.
    pub fn config(&self) -> &IJepaConfig {
        &self.config
    }

    /// The spatial patch grid `[h, w]` (the masks' grid).
    pub fn grid(&self) -> [usize; 2] {
        let c = &self.config.encoder;
        [c.image_size[0] / c.patch_size, c.image_size[1] / c.patch_size]
    }

    /// The token grid `[t, h, w]` (`t` = 1 for images).
    pub fn token_grid(&self) -> [usize; 3] {
        self.encoder.token_grid()
    }

    /// The EMA momentum after step `step` (0-based) of `total_steps`: linear from `momentum.0`
    /// to `momentum.1`.
    pub fn momentum(&self, step: u64, total_steps: u64) -> f64 {
        let (m0, m1) = self.config.momentum;
        let t = if total_steps == 0 { 1.0 } else { (step as f64 / total_steps as f64).min(1.0) };
        m0 + (m1 - m0) * t
    }

    /// `target = m·target + (1 − m)·encoder`, element by element in f32 (f64 for f64 models),
    /// in place, outside autograd.
    pub fn ema_update(&self, m: f64) -> Result<()> {
        let sources = self.encoder.named_parameters();
        let targets = self.target_encoder.named_parameters_all();
        if sources.len() != targets.len() {
            return Err(Error::InvalidArgument {
                op: "IJepa::ema_update",
                reason: format!("{} encoder tensors, {} target tensors", sources.len(), targets.len()),
            });
        }
        let (mf, nf) = (m as f32, (1.0 - m) as f32);
        // On a GPU: every tensor in one launch, bit-exact with the f32 loop below. The targets
        // must be f32 there (the EMA state of a bf16 encoder).
        if let Some(device) = targets.iter().find_map(|(_, t)| crate::backend::of(&[t])) {
            let t: Vec<Tensor> = targets.into_iter().map(|(_, t)| t).collect();
            let s: Vec<Tensor> = sources.into_iter().map(|(_, s)| s).collect();
            return device.ema_update(&t, &s, mf, nf);
        }
        for ((_, src), (_, dst)) in sources.iter().zip(&targets) {
            if src.shape() != dst.shape() {
                return Err(Error::ShapeMismatch { op: "IJepa::ema_update", lhs: src.shape().to_vec(), rhs: dst.shape().to_vec() });
            }
            if src.dtype() == rtx_kernels::DType::F64 {
                let s = src.to_f64_vec()?;
                dst.update_(|_| {}, |d| d.iter_mut().zip(&s).for_each(|(d, s)| *d = m * *d + (1.0 - m) * s))?;
            } else {
                let s = src.to_f32_vec()?;
                dst.update_f32_(|d| d.iter_mut().zip(&s).for_each(|(d, s)| *d = mf * *d + nf * s))?;
            }
        }
        Ok(())
    }

    /// The latent loss of a batch `images [B, C, H, W]` (clips `[B, C, T, H, W]` for a video
    /// encoder, with tube masks) under `masks`, and the collapse monitor.
    pub fn loss(&self, images: &Tensor, masks: &JepaMasks, rng: &mut Generator) -> Result<JepaOutput> {
        if !(images.rank() == 4 || images.rank() == 5) || images.shape()[0] != masks.batch {
            return Err(Error::BadShape {
                op: "IJepa::loss",
                shape: images.shape().to_vec(),
                reason: format!("expected [{}, C, (T,) H, W] (the masks' batch)", masks.batch),
            });
        }
        let context = masks.context_tensor()?;
        let targets = masks.targets_tensor()?;
        let eps = self.config.encoder.layer_norm_eps;
        let h = crate::no_grad(|| -> Result<Tensor> {
            // An f32 target encoder of a bf16 model (the GPU's EMA state) runs in bf16.
            let dtype = self.encoder.pos_embed.dtype();
            let cast;
            let target = if self.target_encoder.pos_embed.dtype() == dtype {
                &self.target_encoder
            } else {
                cast = self.target_encoder.cast_copy(dtype)?;
                &cast
            };
            let all = target.forward_features(images, rng)?;
            let all = all.layer_norm(None, None, eps)?;
            let m = masks.n_targets;
            let repeated: Vec<&Tensor> = std::iter::repeat_n(&all, m).collect();
            let all = if m == 1 { all.clone() } else { Tensor::cat(&repeated, 0)? };
            Ok(Vit::select_tokens(&all, &targets)?.detach())
        })?;
        let z = self.encoder.forward_features_subset(images, &context, rng)?;
        let feature_std = collapse_std(&z)?;
        let pred = self.predictor.forward(&z, &context, &targets, rng)?;
        let loss = match self.config.loss {
            JepaLoss::L2 => pred.mse(&h, Reduction::Mean)?,
            JepaLoss::SmoothL1 => smooth_l1(&pred, &h)?,
        };
        Ok(JepaOutput { loss, feature_std })
    }

    /// Frozen features for evaluation: the mean-pooled context-encoder output `[B, C]` of whole
    /// images (call inside `no_grad`, in evaluation mode).
    pub fn features(&self, images: &Tensor, rng: &mut Generator) -> Result<Tensor> {
        self.encoder.forward(images, rng)
    }
}

/// The collapse monitor of encoded tokens `z [B, K, C]`: the mean over features of the standard
/// deviation (unbiased) across the batch of each image's token-mean feature; 0 when `B < 2` or
/// every image maps to the same vector. Computed on `z`'s device, outside autograd.
pub fn collapse_std(z: &Tensor) -> Result<f64> {
    if z.rank() != 3 {
        return Err(Error::BadShape { op: "collapse_std", shape: z.shape().to_vec(), reason: "expected [B, K, C]".into() });
    }
    crate::no_grad(|| -> Result<f64> {
        if let Some(device) = crate::backend::of(&[z]) {
            return device.collapse_std(z);
        }
        let pooled = z.mean(&[1], false)?;
        if pooled.shape()[0] < 2 {
            return Ok(0.0);
        }
        pooled.var(&[0], false, 1)?.sqrt()?.mean_all()?.item()
    })
}

/// Mean smooth L1 (β = 1): `0.5·d²` where `|d| < 1`, else `|d| − 0.5`.
fn smooth_l1(pred: &Tensor, target: &Tensor) -> Result<Tensor> {
    if let Some(device) = crate::backend::of(&[pred, target]) {
        return device.latent_loss(pred, target, crate::backend::LatentLossKind::SmoothL1);
    }
    let d = pred.sub(target)?;
    let a = d.abs()?;
    let quadratic = d.square()?.mul_scalar(0.5)?;
    let linear = a.add_scalar(-0.5)?;
    let small = a.lt(&Tensor::full(a.shape(), 1.0, a.dtype()))?;
    Tensor::where_(&small, &quadratic, &linear)?.mean_all()
}

/// Every tensor a [`Vit`] visits as a parameter, without deduplication (the target encoder's
/// tensors, which are buffers of the [`IJepa`]).
trait AllTensors {
    fn named_parameters_all(&self) -> Vec<(String, Tensor)>;
}

impl AllTensors for Vit {
    fn named_parameters_all(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        self.visit_params("", &mut |name, t| out.push((name.to_string(), t.clone())));
        out
    }
}

impl Module for IJepa {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        self.encoder.visit_params(&join_name(prefix, "encoder"), f);
        self.predictor.visit_params(&join_name(prefix, "predictor"), f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        self.encoder.visit_params_mut(&join_name(prefix, "encoder"), f);
        self.predictor.visit_params_mut(&join_name(prefix, "predictor"), f);
    }

    fn visit_buffers(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        self.target_encoder.visit_params(&join_name(prefix, "target_encoder"), f);
    }

    fn visit_buffers_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        self.target_encoder.visit_params_mut(&join_name(prefix, "target_encoder"), f);
    }

    fn set_training(&mut self, training: bool) {
        self.encoder.set_training(training);
        self.predictor.blocks.set_training(training);
        // The target encoder is always in evaluation mode.
        self.target_encoder.set_training(false);
    }
}

#[cfg(test)]
mod tests;
