//! The I-JEPA side of a run (`model.kind = "ijepa"`, `[jepa]`): the model built from the config,
//! the masks of a step, the weight-decay schedule, and the frozen-feature evaluation. A V-JEPA run
//! (`model.kind = "vjepa"`, `[video]`) is the same code over clips: the encoder embeds tubelets,
//! the masks are tubes (the spatial masks of the step in every time slot), and the probes score
//! two labels (the item's class and its motion direction) and add an attentive probe
//! ([`super::attentive`]) over the frozen tokens.
//!
//! Masks of step `s` are drawn for the whole global batch from `Generator::with_stream(seed ^
//! mix(s), MASK_STREAM)`, so they do not depend on the world size: a data-parallel rank takes its
//! rows with `JepaMasks::rows`. Validation masks use the same function at steps counted down from
//! `u64::MAX`, so every validation pass scores the same masks.
//!
//! Evaluation ([`probes`]) freezes the context encoder, runs it on whole images and reads its
//! tokens out as each `[jepa] probe_features` readout asks (mean pooling by default; grids of
//! regions, all tokens, the last blocks: [`super::readout`]). A GPU run's encoder runs on its
//! device, `FEATURE_BATCH` images at a time in the run's precision; its outputs come back as f32
//! host copies, and the readouts and every probe below are computed on the host, so CPU and GPU
//! runs are scored by the same code. For every readout, a linear probe (multinomial logistic regression on standardised features, AdamW with
//! a cosine rate, seeded order) is trained on the train split and scored on the test split, and a
//! k-NN classifier (cosine similarity, k neighbours voting with weights `exp(sim / 0.07)`, as
//! DINO's) is scored on the same test images. A linear probe on raw pixels, trained the same way,
//! is the baseline (images only: a clip has `frames·canvas²` pixels). Periodic probes use the first
//! `probe_train_images` / `probe_test_images` images; the final one uses every image of both
//! splits. Probe clips are fixed: train items at [`PROBE_EPOCH`], test items at [`EVAL_EPOCH`].

use rtx_tensor::data::ImageDataset;
use rtx_tensor::nn::{IJepa, IJepaConfig, JepaLoss, JepaMasks, Linear, MaskConfig, Module, Pooling, VitConfig};
use rtx_tensor::optim::{AdamW, AdamWConfig, Optimizer};
use rtx_tensor::{no_grad, CrossEntropyOptions, DType, Device, Generator, Tensor};

use crate::config::{JepaConfig, JepaLossKind, ModelConfig, ProbeReadout, TrainConfig};

use super::task::{ClipSplit, ImageSplits, EVAL_EPOCH, PROBE_EPOCH};
use super::{attentive, readout, Result, TrainError};

/// Mask stream of the run's seed.
const MASK_STREAM: u64 = 3;
/// Probe stream of the run's seed (initialisation and order of the logistic regression).
const PROBE_STREAM: u64 = 4;
/// Images per feature-extraction batch.
const FEATURE_BATCH: usize = 500;
/// Rows per logistic-regression step.
const PROBE_BATCH: usize = 256;
/// Peak learning rate of the logistic regression.
const PROBE_LR: f64 = 1e-2;
/// Fewest logistic-regression steps (small training sets get more epochs).
const PROBE_MIN_STEPS: usize = 600;
/// Weight decay of the logistic regression.
const PROBE_WEIGHT_DECAY: f64 = 1e-4;
/// Temperature of the k-NN vote weights.
const KNN_TEMPERATURE: f64 = 0.07;

/// What the model side of an I-JEPA run needs besides the network: the masks, the patch grid, the
/// image shape, the seed and the run length (for the EMA momentum).
#[derive(Clone, Debug)]
pub struct JepaSetup {
    pub(crate) masks: MaskConfig,
    pub(crate) grid: [usize; 2],
    pub(crate) image: [usize; 2],
    pub(crate) seed: u64,
    pub(crate) total_steps: u64,
    /// V-JEPA: `(frames, time slots)` of a clip; `None` for images.
    pub(crate) video: Option<(usize, usize)>,
}

/// Accuracies of one evaluation of frozen features.
#[derive(Clone, Debug, PartialEq)]
pub struct ProbeReport {
    /// The first configured readout, whose accuracies `probe_acc` / `knn_acc` are.
    pub readout: ProbeReadout,
    /// Linear-probe test accuracy on the first readout.
    pub probe_acc: f64,
    /// k-NN test accuracy on the first readout.
    pub knn_acc: f64,
    /// Every configured readout's accuracies, in the config's order (the first one included).
    pub readouts: Vec<ReadoutReport>,
    /// V-JEPA: the attentive probe's test accuracies (class, direction).
    pub attentive: Option<(f64, f64)>,
    /// Linear-probe test accuracy on raw pixels (when the baseline is on).
    pub pixel_probe_acc: Option<f64>,
    /// Training images the probes used.
    pub train_images: usize,
    /// Test images scored.
    pub test_images: usize,
}

/// Accuracies of one readout of the frozen features.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReadoutReport {
    /// The readout.
    pub readout: ProbeReadout,
    /// Its feature length.
    pub dim: usize,
    /// Linear-probe test accuracy.
    pub probe_acc: f64,
    /// k-NN test accuracy.
    pub knn_acc: f64,
    /// V-JEPA: the linear probe's and k-NN's test accuracies on the motion direction.
    pub direction: Option<(f64, f64)>,
}

/// The I-JEPA encoder's ViT for grayscale images of `image` = `[h, w]`, mean-pooled, no head; the
/// supervised twin (`model.kind = "vit"`) is this plus a head.
pub(crate) fn encoder_config(image: [usize; 2], patch_size: usize, d_model: usize, n_layers: usize, n_heads: usize) -> VitConfig {
    VitConfig { image_size: image, patch_size, in_channels: 1, d_model, n_layers, n_heads, pooling: Pooling::Mean, ..VitConfig::default() }
}

/// The I-JEPA model of `config` for images of `image` = `[h, w]` (grayscale), drawn from `rng`.
pub(crate) fn build(config: &TrainConfig, image: [usize; 2], rng: &mut Generator) -> Result<(IJepa, JepaSetup)> {
    let ModelConfig::IJepa { patch_size, d_model, n_layers, n_heads, ref video } = config.model else {
        return Err(TrainError::Internal("an I-JEPA setup for another model kind".into()));
    };
    let j = jepa_config(config)?;
    let mut encoder = encoder_config(image, patch_size, d_model, n_layers, n_heads);
    if let Some(v) = video {
        encoder.image_size = [v.canvas, v.canvas];
        encoder.frames = v.frames;
        encoder.tubelet = v.tubelet;
    }
    let loss = match j.loss {
        JepaLossKind::L2 => JepaLoss::L2,
        JepaLossKind::SmoothL1 => JepaLoss::SmoothL1,
    };
    let cfg = IJepaConfig {
        encoder,
        predictor_width: j.predictor_width,
        predictor_depth: j.predictor_depth,
        predictor_heads: j.predictor_heads,
        loss,
        momentum: j.ema_momentum,
        sincos_pos_init: true,
    };
    let model = IJepa::new(cfg, rng)?;
    let setup = setup(config, image)?;
    if setup.grid != model.grid() {
        return Err(TrainError::Internal(format!("mask grid {:?}, model grid {:?}", setup.grid, model.grid())));
    }
    Ok((model, setup))
}

/// The masks, image shape and schedule length of an I-JEPA `config` for images of `image`.
pub(crate) fn setup(config: &TrainConfig, image: [usize; 2]) -> Result<JepaSetup> {
    let ModelConfig::IJepa { patch_size, ref video, .. } = config.model else {
        return Err(TrainError::Internal("an I-JEPA setup for another model kind".into()));
    };
    let j = jepa_config(config)?;
    let image = video.as_ref().map_or(image, |v| [v.canvas, v.canvas]);
    let grid = [image[0] / patch_size.max(1), image[1] / patch_size.max(1)];
    let video = video.as_ref().map(|v| (v.frames, v.frames / v.tubelet.max(1)));
    let masks = MaskConfig {
        n_targets: j.n_targets,
        target_scale: j.target_scale,
        target_aspect: j.target_aspect,
        context_scale: j.context_scale,
        min_keep: j.min_keep,
    };
    Ok(JepaSetup { masks, grid, image, seed: config.train.seed, total_steps: config.train.steps, video })
}

/// The `[jepa]` section (present for I-JEPA configs).
pub(crate) fn jepa_config(config: &TrainConfig) -> Result<&JepaConfig> {
    config.jepa.as_ref().ok_or_else(|| TrainError::Internal("an I-JEPA config without its [jepa] section".into()))
}

impl JepaSetup {
    /// The masks of global batch `step` (`rows` images).
    pub(crate) fn masks_for_step(&self, step: u64, rows: usize) -> Result<JepaMasks> {
        let mut rng = Generator::with_stream(self.seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15), MASK_STREAM);
        let masks = self.masks.sample(self.grid, rows, &mut rng)?;
        match self.video {
            // V-JEPA's tube masks: the same blocks in every time slot.
            Some((_, slots)) => Ok(masks.tubes(self.grid[0] * self.grid[1], slots)?),
            None => Ok(masks),
        }
    }

    /// The masks of validation batch `i`.
    pub(crate) fn masks_for_eval(&self, i: usize, rows: usize) -> Result<JepaMasks> {
        self.masks_for_step(u64::MAX - i as u64, rows)
    }

    /// `[B, H·W]` flat pixels as `[B, 1, H, W]` images, or `[B, T·H·W]` as `[B, 1, T, H, W]`
    /// clips.
    pub(crate) fn images(&self, flat: &Tensor) -> Result<Tensor> {
        let b = flat.shape()[0];
        match self.video {
            Some((frames, _)) => Ok(flat.reshape(&[b, 1, frames, self.image[0], self.image[1]])?),
            None => Ok(flat.reshape(&[b, 1, self.image[0], self.image[1]])?),
        }
    }

    /// Time slots of the token grid (1 for images).
    pub(crate) fn slots(&self) -> usize {
        self.video.map_or(1, |(_, slots)| slots)
    }

    /// The token grid as the readouts see it: `[slots·h, w]` rows of tokens (time-major), so
    /// `mean`, `tokens` and `mean-last4` cover every token of a clip.
    pub(crate) fn readout_grid(&self) -> [usize; 2] {
        [self.slots() * self.grid[0], self.grid[1]]
    }
}

/// The weight decay of step `step` (0-based): cosine from `optim.weight_decay` to
/// `jepa.final_weight_decay` over `train.steps`; `None` without a schedule.
pub(crate) fn weight_decay_at(config: &TrainConfig, step: u64) -> Option<f64> {
    let end = config.jepa.as_ref()?.final_weight_decay?;
    let start = config.optim.weight_decay;
    let t = (step as f64 / config.train.steps.max(1) as f64).min(1.0);
    Some(end + 0.5 * (start - end) * (1.0 + (std::f64::consts::PI * t).cos()))
}

/// Frozen encoder outputs of some rows: one flat row-major `[n, dim]` buffer per readout, and for
/// clips their direction labels.
struct Features {
    readouts: Vec<Vec<f32>>,
    directions: Option<Vec<u32>>,
}

/// Frozen encoder readouts of images (or clips) `indices` of `set`: one flat row-major `[n, dim]`
/// buffer per entry of `readouts` (see [`super::readout`]), all from one pass of the encoder.
fn features(model: &IJepa, setup: &JepaSetup, splits: &ImageSplits, set: &ImageDataset, indices: &[usize], split: ClipSplit, readouts: &[ProbeReadout]) -> Result<Features> {
    let mut scratch = Generator::new(0);
    let mut out = vec![Vec::new(); readouts.len()];
    let mut directions: Option<Vec<u32>> = None;
    let last_blocks = if readouts.iter().any(|&r| readout::needs_blocks(r)) { readout::LAST_BLOCKS } else { 0 };
    let channels = model.encoder.config().d_model;
    let grid = setup.readout_grid();
    let per_image = grid[0] * grid[1] * channels;
    let epoch = if split == ClipSplit::Train { PROBE_EPOCH } else { EVAL_EPOCH };
    no_grad(|| -> Result<()> {
        for chunk in indices.chunks(FEATURE_BATCH) {
            let (batch, dirs) = splits.rows(set, chunk, split, epoch)?;
            if let Some(d) = dirs {
                directions.get_or_insert_with(Vec::new).extend(d);
            }
            let images = on_encoder(model, &setup.images(&batch.inputs)?)?;
            let (last, blocks) = encoder_tokens(model, &images, last_blocks, &mut scratch)?;
            // Host copies (f32) of the encoder's outputs: every readout is computed on the host.
            let last = last.to_f32_vec()?;
            let blocks = blocks.iter().map(|b| b.to_f32_vec()).collect::<std::result::Result<Vec<_>, _>>()?;
            if last.len() != chunk.len() * per_image || blocks.iter().any(|b| b.len() != last.len()) {
                return Err(TrainError::Internal(format!("encoder output of {} values for {} images of {per_image}", last.len(), chunk.len())));
            }
            for i in 0..chunk.len() {
                let rows = i * per_image..(i + 1) * per_image;
                let block_rows: Vec<&[f32]> = blocks.iter().map(|b| &b[rows.clone()]).collect();
                let image = readout::ImageTokens { last: &last[rows.clone()], blocks: &block_rows, grid, channels };
                for (r, buf) in readouts.iter().zip(&mut out) {
                    readout::append(*r, &image, buf);
                }
            }
        }
        Ok(())
    })?;
    Ok(Features { readouts: out, directions })
}

/// `images` where `model`'s context encoder lives and in its dtype: uploaded (bf16 or f32) for an
/// encoder on a GPU, as they are for one on the host.
fn on_encoder(model: &IJepa, images: &Tensor) -> Result<Tensor> {
    let pos = &model.encoder.pos_embed;
    match pos.device() {
        Device::Cpu => Ok(images.clone()),
        device => Ok(images.to_dtype(pos.dtype())?.to_device(device)?),
    }
}

/// The frozen context encoder on whole `images`: the final layer-normed tokens `[B, N, C]` and,
/// when `last_blocks > 0`, the outputs of the last `last_blocks` blocks (at most all of them),
/// each through the final norm, earliest first (the last one is the final output). Without
/// intermediate outputs this is exactly [`rtx_tensor::nn::Vit::forward_features`]; with them it
/// runs the same blocks one by one (the encoder has no class token and, in evaluation mode, no
/// dropout).
pub(crate) fn encoder_tokens(model: &IJepa, images: &Tensor, last_blocks: usize, rng: &mut Generator) -> Result<(Tensor, Vec<Tensor>)> {
    let enc = &model.encoder;
    if last_blocks == 0 {
        return Ok((enc.forward_features(images, rng)?, Vec::new()));
    }
    if enc.cls_token.is_some() {
        return Err(TrainError::Internal("intermediate readouts of an encoder with a class token".into()));
    }
    let first = enc.blocks.len().saturating_sub(last_blocks);
    let mut x = enc.embed_patches(images)?;
    let mut kept = Vec::new();
    for (i, block) in enc.blocks.iter().enumerate() {
        x = block.forward(&x, None, rng)?;
        if i >= first {
            kept.push(enc.norm.forward(&x)?);
        }
    }
    let last = kept.last().cloned().ok_or_else(|| TrainError::Internal("an encoder without blocks".into()))?;
    Ok((last, kept))
}

/// Raw normalised pixels `[n, H·W]` of images `indices` of `set`.
fn pixels(set: &ImageDataset, indices: &[usize], mean: f32, std: f32) -> Vec<f32> {
    set.batch(indices, mean, std).pixels
}

/// Linear probe, k-NN and (optionally) the pixel baseline for `model` on the train split of
/// `splits` / `test`: the first `n_train` / `n_test` images (all of them when `None`), for every
/// readout of `j.probe_features` (features from one encoder pass; each readout probed
/// separately). For clips, every readout is also probed on the direction label, and with
/// `attentive`'s epochs the attentive probe runs on the final tokens for both labels.
#[allow(clippy::too_many_arguments)]
pub(crate) fn probes(
    model: &mut IJepa,
    setup: &JepaSetup,
    j: &JepaConfig,
    splits: &ImageSplits,
    test: &ImageDataset,
    limit: Option<(usize, usize)>,
    pixel_baseline: bool,
    attentive_epochs: Option<usize>,
) -> Result<ProbeReport> {
    let (train, mean, std) = (&splits.train, splits.mean, splits.std);
    let (n_train, n_test) = limit.map_or((train.n, test.n), |(a, b)| (a.min(train.n), b.min(test.n)));
    let train_idx: Vec<usize> = (0..n_train).collect();
    let test_idx: Vec<usize> = (0..n_test).collect();
    let train_y = &train.labels[..n_train];
    let test_y = &test.labels[..n_test];
    let n_classes = train.n_classes.max(test.n_classes);
    let primary = *j.probe_features.first().ok_or_else(|| TrainError::Internal("no probe readout configured".into()))?;
    // The attentive probe reads every final token: computed with the readouts, not reported as one.
    let mut readouts = j.probe_features.clone();
    let attentive_at = match attentive_epochs {
        Some(_) if splits.clips.is_some() => Some(readouts.iter().position(|&r| r == ProbeReadout::Tokens).unwrap_or_else(|| {
            readouts.push(ProbeReadout::Tokens);
            readouts.len() - 1
        })),
        _ => None,
    };
    model.set_training(false);
    let feats = features(model, setup, splits, train, &train_idx, ClipSplit::Train, &readouts)
        .and_then(|tr| Ok((tr, features(model, setup, splits, test, &test_idx, ClipSplit::HeldOut, &readouts)?)));
    model.set_training(true);
    let (train_f, test_f) = feats?;
    let (train_x, test_x) = (&train_f.readouts, &test_f.readouts);
    let directions = match (&train_f.directions, &test_f.directions, &splits.clips) {
        (Some(tr), Some(te), Some(c)) => Some((tr.as_slice(), te.as_slice(), c.moving.directions)),
        _ => None,
    };
    let (channels, layers) = (model.encoder.config().d_model, model.encoder.blocks.len());
    let grid = setup.readout_grid();
    let mut results = Vec::with_capacity(j.probe_features.len());
    for ((&readout, tr), te) in j.probe_features.iter().zip(train_x).zip(test_x) {
        // linear_probe and knn refuse buffers whose length is not rows x dim.
        let dim = readout::dim(readout, grid, channels, layers);
        let probe_acc = linear_probe(tr, train_y, te, test_y, dim, n_classes, j.probe_epochs, setup.seed)?;
        let knn_acc = knn(tr, train_y, te, test_y, dim, n_classes, j.knn_k)?;
        let direction = match directions {
            Some((dtr, dte, n_dir)) => {
                Some((linear_probe(tr, dtr, te, dte, dim, n_dir, j.probe_epochs, setup.seed)?, knn(tr, dtr, te, dte, dim, n_dir, j.knn_k)?))
            }
            None => None,
        };
        results.push(ReadoutReport { readout, dim, probe_acc, knn_acc, direction });
    }
    let attentive = match (attentive_at, attentive_epochs, directions) {
        (Some(at), Some(epochs), Some((dtr, dte, n_dir))) => {
            let n_tokens = grid[0] * grid[1];
            let (tr, te) = (&train_x[at], &test_x[at]);
            let class = attentive::attentive_probe(tr, train_y, te, test_y, n_tokens, channels, n_classes, epochs, setup.seed)?;
            let direction = attentive::attentive_probe(tr, dtr, te, dte, n_tokens, channels, n_dir, epochs, setup.seed)?;
            Some((class, direction))
        }
        _ => None,
    };
    drop((train_f, test_f));
    let pixel_probe_acc = if pixel_baseline && splits.clips.is_none() {
        let (px_train, px_test) = (pixels(train, &train_idx, mean, std), pixels(test, &test_idx, mean, std));
        Some(linear_probe(&px_train, train_y, &px_test, test_y, train.pixels_per_image(), n_classes, j.probe_epochs, setup.seed)?)
    } else {
        None
    };
    let (probe_acc, knn_acc) = results.first().map_or((0.0, 0.0), |r| (r.probe_acc, r.knn_acc));
    Ok(ProbeReport { readout: primary, probe_acc, knn_acc, readouts: results, attentive, pixel_probe_acc, train_images: n_train, test_images: n_test })
}

/// Multinomial logistic regression on standardised `train_x [n, dim]`, scored on `test_x`:
/// `epochs` passes (at least [`PROBE_MIN_STEPS`] steps) of AdamW (cosine rate from [`PROBE_LR`]
/// to 0) over a seeded order, batches of [`PROBE_BATCH`]. Returns the test accuracy.
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear_probe(
    train_x: &[f32],
    train_y: &[u32],
    test_x: &[f32],
    test_y: &[u32],
    dim: usize,
    n_classes: usize,
    epochs: usize,
    seed: u64,
) -> Result<f64> {
    let n = train_y.len();
    if n == 0 || dim == 0 || train_x.len() != n * dim || test_x.len() != test_y.len() * dim {
        return Err(TrainError::Internal(format!(
            "probe data: {} values for {n} rows of {dim}, {} test values for {} rows",
            train_x.len(),
            test_x.len(),
            test_y.len()
        )));
    }
    // Standardise with the train statistics.
    let mut mu = vec![0f64; dim];
    let mut var = vec![0f64; dim];
    for row in train_x.chunks(dim) {
        row.iter().zip(&mut mu).for_each(|(x, m)| *m += f64::from(*x));
    }
    mu.iter_mut().for_each(|m| *m /= n as f64);
    for row in train_x.chunks(dim) {
        row.iter().zip(&mu).zip(&mut var).for_each(|((x, m), v)| *v += (f64::from(*x) - m).powi(2));
    }
    let inv: Vec<f32> = var.iter().map(|v| (1.0 / (v / n as f64 + 1e-6).sqrt()) as f32).collect();
    let mu: Vec<f32> = mu.iter().map(|m| *m as f32).collect();
    let standardise =
        |x: &[f32]| -> Vec<f32> { x.chunks(dim).flat_map(|row| row.iter().zip(&mu).zip(&inv).map(|((x, m), s)| (x - m) * s).collect::<Vec<_>>()).collect() };
    let train_s = standardise(train_x);
    let test_s = standardise(test_x);

    let mut rng = Generator::with_stream(seed, PROBE_STREAM);
    let head = Linear::new(dim, n_classes, true, DType::F32, &mut rng)?;
    let mut opt = AdamW::new(head.named_parameters(), AdamWConfig { lr: PROBE_LR, weight_decay: PROBE_WEIGHT_DECAY, ..AdamWConfig::default() })?;
    let steps_per_epoch = n.div_ceil(PROBE_BATCH);
    let epochs = epochs.max(PROBE_MIN_STEPS.div_ceil(steps_per_epoch));
    let total = (epochs * steps_per_epoch).max(1);
    let mut order: Vec<usize> = (0..n).collect();
    let mut step = 0usize;
    for _ in 0..epochs {
        for i in (1..n).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        for rows in order.chunks(PROBE_BATCH) {
            let mut xb = Vec::with_capacity(rows.len() * dim);
            for &r in rows {
                xb.extend_from_slice(&train_s[r * dim..(r + 1) * dim]);
            }
            let yb: Vec<u32> = rows.iter().map(|&r| train_y[r]).collect();
            let x = Tensor::from_vec(xb, &[rows.len(), dim])?;
            let y = Tensor::from_vec(yb, &[rows.len()])?;
            head.zero_grad()?;
            let loss = head.forward(&x)?.cross_entropy(&y, CrossEntropyOptions::default())?;
            loss.backward()?;
            opt.set_lr(PROBE_LR * 0.5 * (1.0 + (std::f64::consts::PI * step as f64 / total as f64).cos()));
            opt.step()?;
            step += 1;
        }
    }
    let correct = no_grad(|| -> Result<usize> {
        let mut correct = 0;
        for (chunk, labels) in test_s.chunks(FEATURE_BATCH * dim).zip(test_y.chunks(FEATURE_BATCH)) {
            let x = Tensor::from_vec(chunk.to_vec(), &[labels.len(), dim])?;
            let pred = head.forward(&x)?.argmax(-1, false)?.to_u32_vec()?;
            correct += pred.iter().zip(labels).filter(|(p, l)| p == l).count();
        }
        Ok(correct)
    })?;
    Ok(correct as f64 / test_y.len().max(1) as f64)
}

/// k-NN accuracy on cosine similarity: the `k` most similar train rows vote for their class with
/// weight `exp(sim / T)`; ties go to the lower class.
pub(crate) fn knn(train_x: &[f32], train_y: &[u32], test_x: &[f32], test_y: &[u32], dim: usize, n_classes: usize, k: usize) -> Result<f64> {
    let n = train_y.len();
    if n == 0 || k == 0 || train_x.len() != n * dim || test_x.len() != test_y.len() * dim {
        return Err(TrainError::Internal(format!("k-NN data: {} values for {n} rows of {dim}", train_x.len())));
    }
    let normalise = |x: &[f32]| -> Vec<f32> {
        x.chunks(dim)
            .flat_map(|row| {
                let norm = row.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
                row.iter().map(move |v| v / norm)
            })
            .collect()
    };
    let train_t = Tensor::from_vec(normalise(train_x), &[n, dim])?.t()?.contiguous()?;
    let test_n = normalise(test_x);
    let k = k.min(n);
    let mut correct = 0usize;
    no_grad(|| -> Result<()> {
        for (chunk, labels) in test_n.chunks(FEATURE_BATCH * dim).zip(test_y.chunks(FEATURE_BATCH)) {
            let q = Tensor::from_vec(chunk.to_vec(), &[labels.len(), dim])?;
            let sims = q.matmul(&train_t)?.to_f32_vec()?;
            for (row, &label) in sims.chunks(n).zip(labels) {
                let mut idx: Vec<usize> = (0..n).collect();
                idx.select_nth_unstable_by(k - 1, |&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
                let mut votes = vec![0f64; n_classes];
                for &i in &idx[..k] {
                    let class = train_y[i] as usize;
                    if class < n_classes {
                        votes[class] += (f64::from(row[i]) / KNN_TEMPERATURE).exp();
                    }
                }
                let best = votes.iter().enumerate().fold((0, f64::MIN), |acc, (c, &v)| if v > acc.1 { (c, v) } else { acc }).0;
                correct += usize::from(best as u32 == label);
            }
        }
        Ok(())
    })?;
    Ok(correct as f64 / test_y.len().max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two Gaussian blobs per class in 8 dimensions: both classifiers separate them, and fail on
    /// shuffled labels (so the tests can fail).
    fn blobs(n: usize, seed: u64, shuffle_labels: bool) -> (Vec<f32>, Vec<u32>) {
        let mut rng = Generator::new(seed);
        let mut x = Vec::new();
        let mut y = Vec::new();
        for i in 0..n {
            let class = (i % 3) as u32;
            for d in 0..8 {
                let centre = if d == class as usize { 3.0 } else { 0.0 };
                x.push((centre + rng.normal()) as f32);
            }
            y.push(if shuffle_labels { rng.below(3) as u32 } else { class });
        }
        (x, y)
    }

    /// A 3-block encoder on 8x8 images (4x4 grid of width 8), and a batch of images.
    fn tiny() -> (IJepa, Tensor) {
        let mut rng = Generator::new(7);
        let encoder = VitConfig {
            image_size: [8, 8],
            patch_size: 2,
            in_channels: 1,
            d_model: 8,
            n_layers: 3,
            n_heads: 2,
            pooling: Pooling::Mean,
            ..VitConfig::default()
        };
        let cfg = IJepaConfig { encoder, predictor_width: 8, predictor_depth: 1, predictor_heads: 2, ..IJepaConfig::default() };
        let model = IJepa::new(cfg, &mut rng).expect("model");
        let images = Tensor::randn(&[5, 1, 8, 8], 0.0, 1.0, DType::F32, &mut rng).expect("images");
        (model, images)
    }

    #[test]
    fn intermediate_outputs_leave_the_final_tokens_and_the_mean_readout_unchanged() {
        let (mut model, images) = tiny();
        model.set_training(false);
        let mut rng = Generator::new(0);
        no_grad(|| {
            let (plain, none) = encoder_tokens(&model, &images, 0, &mut rng).expect("plain");
            assert!(none.is_empty());
            let (last, blocks) = encoder_tokens(&model, &images, readout::LAST_BLOCKS, &mut rng).expect("blocks");
            // 3 blocks: mean-last4 takes all 3, the last being the final output.
            assert_eq!(blocks.len(), 3);
            assert_eq!(plain.shape(), &[5, 16, 8]);
            let plain = plain.to_f32_vec().expect("f32");
            assert_eq!(last.to_f32_vec().expect("f32"), plain, "bit-identical final tokens");
            assert_eq!(blocks[2].to_f32_vec().expect("f32"), plain);
            assert_ne!(blocks[0].to_f32_vec().expect("f32"), plain);
            // The "mean" readout is the encoder's own mean pooling (the features probed before
            // readouts existed), up to the f64 accumulation.
            let pooled = model.features(&images, &mut rng).expect("features").to_f32_vec().expect("f32");
            let mut mean = Vec::new();
            for img in plain.chunks(16 * 8) {
                readout::append(ProbeReadout::Mean, &readout::ImageTokens { last: img, blocks: &[], grid: [4, 4], channels: 8 }, &mut mean);
            }
            assert_eq!(mean.len(), pooled.len());
            assert!(mean.iter().zip(&pooled).all(|(a, b)| (a - b).abs() < 1e-5), "{mean:?} vs {pooled:?}");
        });
    }

    #[test]
    fn linear_probe_and_knn_separate_blobs() {
        let (train_x, train_y) = blobs(600, 1, false);
        let (test_x, test_y) = blobs(300, 2, false);
        let lp = linear_probe(&train_x, &train_y, &test_x, &test_y, 8, 3, 5, 0).expect("probe");
        let nn = knn(&train_x, &train_y, &test_x, &test_y, 8, 3, 20).expect("knn");
        assert!(lp > 0.9 && nn > 0.85, "probe {lp}, knn {nn}");
        let (noise_x, noise_y) = blobs(600, 3, true);
        let lp = linear_probe(&noise_x, &noise_y, &test_x, &test_y, 8, 3, 5, 0).expect("probe");
        assert!(lp < 0.6, "probe on random labels scored {lp}");
        assert!(linear_probe(&train_x, &train_y, &test_x, &test_y, 7, 3, 5, 0).is_err());
    }
}
