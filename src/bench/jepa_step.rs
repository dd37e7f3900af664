//! `rtx bench step --model ijepa`: one I-JEPA training step of `configs/ijepa_fashion.toml`'s
//! shapes — the ViT context encoder (28×28 grayscale, patch 4: 49 tokens, width 64, 4 layers, 4
//! heads, tanh-GELU MLP 4×) on 20 context tokens, the EMA target encoder on all 49, a predictor of
//! width 48, depth 3, 4 heads run once per target block (4 blocks of 3×3 tokens), the L2 latent
//! loss, backward, AdamW (weight decay 0.04 on matrices, betas 0.9/0.95), the EMA update, zero_grad
//! — on a fixed random batch of 128 images and fixed-shape masks
//! ([`JepaMasks::fixed_blocks`]), so only compute is timed. `scripts/peer/torch_bench.py step
//! --model ijepa` is the identical step in PyTorch (keep the two in step). `state_digest` is
//! [`rtx_supervisor::worker::parameter_checksum`] of the model (parameters and EMA buffers) after
//! the timed steps: equal digests of runs with the same step counts mean bit-identical training
//! (e.g. across `RTX_NUM_THREADS`).

use super::timing::measure;
use super::{emit, threads};
use rtx_tensor::nn::{IJepa, IJepaConfig, JepaLoss, JepaMasks, Module, Pooling, VitConfig};
use rtx_tensor::optim::{AdamW, AdamWConfig, Optimizer};
use rtx_tensor::{DType, Generator, Tensor};

// Shapes: keep equal to scripts/peer/torch_bench.py (`ijepa`).
const BATCH: usize = 128;
const GRID: usize = 7;
const CONTEXT: usize = 20;
const TARGETS: usize = 4;
const BLOCK: (usize, usize) = (3, 3);

/// Runs the benchmark and prints one JSON line (`impl`, `bench`, `model`, `shape`, `params`,
/// `threads` and the timing fields).
pub(crate) fn run(warmup: usize, repeats: usize) -> anyhow::Result<()> {
    let mut rng = Generator::new(0);
    let encoder = VitConfig { image_size: [28, 28], patch_size: 4, in_channels: 1, d_model: 64, n_layers: 4, n_heads: 4, pooling: Pooling::Mean, ..VitConfig::default() };
    let config = IJepaConfig { encoder, predictor_width: 48, predictor_depth: 3, predictor_heads: 4, loss: JepaLoss::L2, momentum: (0.996, 1.0), sincos_pos_init: true };
    let model = IJepa::new(config, &mut rng)?;
    let images = Tensor::randn(&[BATCH, 1, 28, 28], 0.0, 1.0, DType::F32, &mut rng)?;
    let masks = JepaMasks::fixed_blocks(BATCH, [GRID, GRID], CONTEXT, TARGETS, BLOCK, &mut rng)?;
    let params = model.named_parameters();
    let n_params: usize = params.iter().map(|(_, t)| t.numel()).sum();
    let mut opt = AdamW::with_decay_filter(params, AdamWConfig { lr: 1e-3, weight_decay: 0.04, beta2: 0.95, ..AdamWConfig::default() }, AdamW::decay_matrices)?;
    let mut step = 0u64;
    let mut step_once = || -> anyhow::Result<()> {
        let out = model.loss(&images, &masks, &mut Generator::new(0))?;
        out.loss.backward()?;
        opt.step()?;
        model.ema_update(model.momentum(step, 1000))?;
        opt.zero_grad()?;
        step += 1;
        anyhow::ensure!(out.loss.item()?.is_finite() && out.feature_std.is_finite(), "loss or collapse monitor is not finite");
        Ok(())
    };
    for _ in 0..warmup {
        step_once()?;
    }
    let stats = measure(0, repeats, step_once)?;
    // The replicas' checksum of the elastic jobs: every parameter and buffer (the EMA target), by name.
    let digest = rtx_supervisor::worker::parameter_checksum(&model)?;
    let mut obj = serde_json::Map::new();
    obj.insert("impl".into(), "rustytorch".into());
    obj.insert("bench".into(), "step".into());
    obj.insert("model".into(), "ijepa".into());
    obj.insert(
        "shape".into(),
        format!("ijepa vit 28x28 p4 d64 L4 h4, context {CONTEXT} of 49, {TARGETS} targets of {}x{}, predictor 3x48 h4, batch {BATCH}", BLOCK.0, BLOCK.1).into(),
    );
    obj.insert("params".into(), n_params.into());
    obj.insert("threads".into(), threads().into());
    obj.insert("state_digest".into(), format!("{digest:016x}").into());
    obj.insert("buffer_pool_held_mib".into(), (rtx_tensor::buffer_pool_held_bytes() >> 20).into());
    stats.json_fields(&mut obj);
    emit(obj.into());
    Ok(())
}
