//! I-JEPA on the GPU (issue 16): checks and a benchmark of the I-JEPA step built from
//! `rtx_tensor::nn::IJepa` with CUDA tensors.
//!
//! - `jepa_gpu ops [SEED]`: every device op the step added, against the CPU on fresh random
//!   inputs: strided copies (`contiguous` of a permuted view, `cat` along two dims with its
//!   backward, the gradient of `narrow`), the latent losses (mean squared error, smooth L1)
//!   forward and backward, the collapse monitor, the fused EMA (bit-exact with the host's f32
//!   arithmetic); then the whole I-JEPA loss and every parameter's gradient of a small model, GPU
//!   f32 and bf16 against CPU f32; then 40 training steps (AdamW, EMA) on the GPU in bf16 with f32
//!   master weights and an f32 target encoder against the same steps on the CPU in f32.
//! - `jepa_gpu bench [BATCH]`: the step of issue 16's GPU bar: a ViT-B/16 context encoder at
//!   224×224 on 100 of 196 tokens, the EMA target encoder on all 196, 4 target blocks of 32
//!   tokens, a predictor of depth 6 and width 384 (6 heads of 64), batch 128 by default, bf16
//!   with f32 master weights (fused AdamW) and an f32 EMA (one launch), random images. Prints the
//!   median step, images/s and MFU (the FLOP count of `step_flops`, the same formula as
//!   `scripts/peer/ijepa_gpu_torch.py`, over 989 TFLOP/s).
//!
//! Exits non-zero when a check fails. Build: `cargo build --release -p rtx-tensor --features cuda
//! --example jepa_gpu`; run on the GPU machine (`scripts/gpu-jepa-check.sh`).

use std::error::Error;
use std::time::Instant;

use rtx_tensor::cuda::{self, MixedAdamW};
use rtx_tensor::nn::{collapse_std, IJepa, IJepaConfig, JepaLoss, JepaMasks, MaskConfig, Module, VitConfig};
use rtx_tensor::optim::{AdamW, AdamWConfig};
use rtx_tensor::{DType, Device, Generator, GeluApprox, Optimizer, Reduction, Tensor};

type Res<T> = std::result::Result<T, Box<dyn Error>>;

const GPU: Device = Device::Cuda(0);
const PEAK_BF16: f64 = 989e12;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map(String::as_str).unwrap_or("ops");
    let result = match mode {
        "ops" => {
            let seed = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(20261205u64);
            println!("jepa_gpu ops: seed {seed} (replay: jepa_gpu ops {seed})");
            ops(seed).map(|ok| if ok { 0 } else { 1 })
        }
        "bench" => {
            let batch = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(128usize);
            bench(batch).map(|()| 0)
        }
        other => Err(format!("unknown mode {other:?}: ops [SEED] | bench [BATCH]").into()),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("jepa_gpu {mode}: {e}");
            std::process::exit(2);
        }
    }
}

/// Normwise relative error `max|a − b| / max|b|`.
fn rel_err(a: &Tensor, b: &Tensor) -> Res<f64> {
    let (a, b) = (a.to_device(Device::Cpu)?.to_f64_vec()?, b.to_device(Device::Cpu)?.to_f64_vec()?);
    if a.len() != b.len() {
        return Err(format!("length {} vs {}", a.len(), b.len()).into());
    }
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-30);
    let err = a.iter().zip(&b).fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
    Ok(if a.iter().all(|v| v.is_finite()) { err / scale } else { f64::INFINITY })
}

/// Random values in [-1, 1), never exactly zero.
fn random(shape: &[usize], rng: &mut Generator) -> Res<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| (rng.uniform() * 2.0 - 1.0) as f32).map(|x| if x == 0.0 { 1e-3 } else { x }).collect();
    Ok(Tensor::from_vec(v, shape)?)
}

/// Records one check and prints it.
struct Checks {
    failed: usize,
    total: usize,
}

impl Checks {
    fn check(&mut self, name: &str, err: f64, tolerance: f64) {
        self.total += 1;
        let ok = err <= tolerance;
        if !ok {
            self.failed += 1;
        }
        println!("check {name:<48} err {err:.3e} (tolerance {tolerance:.0e}) {}", if ok { "ok" } else { "FAIL" });
    }

    fn exact(&mut self, name: &str, same: bool) {
        self.check(name, if same { 0.0 } else { f64::INFINITY }, 0.0);
    }
}

fn bits(t: &Tensor) -> Res<Vec<u64>> {
    let t = t.to_device(Device::Cpu)?;
    Ok(match t.dtype() {
        DType::U32 => t.to_u32_vec()?.into_iter().map(u64::from).collect(),
        _ => t.to_dtype(DType::F32)?.to_f32_vec()?.into_iter().map(|v| u64::from(v.to_bits())).collect(),
    })
}

/// Runs `f` on the host inputs and on their device copies (in `dtype`); returns (host output,
/// device output, host input gradients, device input gradients) after backward from `grad_out`.
type ViewFn = fn(&[Tensor]) -> rtx_tensor::Result<Tensor>;

fn both(f: ViewFn, host: &[Tensor], dtype: DType, grad_out: &Tensor) -> Res<(Tensor, Tensor, Vec<Tensor>, Vec<Tensor>)> {
    let h: Vec<Tensor> = host.iter().map(|t| Ok(t.to_dtype(dtype)?.requires_grad(true))).collect::<Res<_>>()?;
    let d: Vec<Tensor> = host.iter().map(|t| Ok(t.to_dtype(dtype)?.to_device(GPU)?.requires_grad(true))).collect::<Res<_>>()?;
    let (yh, yd) = (f(&h)?, f(&d)?);
    yh.backward_from(grad_out.to_dtype(yh.dtype())?, |_| {})?;
    yd.backward_from(grad_out.to_dtype(yd.dtype())?.to_device(GPU)?, |_| {})?;
    if yd.device() != GPU {
        return Err(format!("the device op returned a {:?} tensor", yd.device()).into());
    }
    let grads = |ts: &[Tensor]| -> Res<Vec<Tensor>> { ts.iter().map(|t| Ok(t.grad().ok_or("no gradient")?.to_device(Device::Cpu)?)).collect() };
    Ok((yh, yd, grads(&h)?, grads(&d)?))
}

fn view_checks(c: &mut Checks, rng: &mut Generator) -> Res<()> {
    let cases: [(&str, ViewFn, Vec<Vec<usize>>); 5] = [
        ("contiguous of a permuted view [2,3,4,5]", |t| t[0].permute(&[0, 2, 1, 3])?.contiguous(), vec![vec![2, 3, 4, 5]]),
        ("patchify-like reshape [2,3,8,8] p4", |t| t[0].reshape(&[2, 3, 2, 4, 2, 4])?.permute(&[0, 2, 4, 1, 3, 5])?.reshape(&[2, 4, 48]), vec![vec![2, 3, 8, 8]]),
        ("cat dim 0 of three [2,5,8]", |t| rtx_tensor::Tensor::cat(&[&t[0], &t[1], &t[2]], 0), vec![vec![2, 5, 8]; 3]),
        ("cat dim 1 of [3,4,8] and [3,2,8]", |t| rtx_tensor::Tensor::cat(&[&t[0], &t[1]], 1), vec![vec![3, 4, 8], vec![3, 2, 8]]),
        ("narrow dim 1 of [3,7,8] (backward)", |t| t[0].narrow(1, 2, 4)?.contiguous(), vec![vec![3, 7, 8]]),
    ];
    for (name, f, shapes) in cases {
        let host: Vec<Tensor> = shapes.iter().map(|s| random(s, rng)).collect::<Res<_>>()?;
        let out_shape = f(&host)?.shape().to_vec();
        let g = random(&out_shape, rng)?;
        for dtype in [DType::F32, DType::BF16] {
            let (yh, yd, gh, gd) = both(f, &host, dtype, &g)?;
            let same = bits(&yh)? == bits(&yd)? && gh.iter().zip(&gd).all(|(a, b)| bits(a).ok() == bits(b).ok());
            c.exact(&format!("{name} {dtype:?} (values and gradients)"), same);
        }
    }
    let ids = Tensor::from_vec((0..60u32).map(|i| (i * 7) % 13).collect::<Vec<u32>>(), &[3, 4, 5])?;
    let dev = ids.to_device(GPU)?.permute(&[2, 0, 1])?.contiguous()?;
    c.exact("contiguous of a permuted u32 view", bits(&dev)? == bits(&ids.permute(&[2, 0, 1])?.contiguous()?)?);
    Ok(())
}

fn loss_checks(c: &mut Checks, rng: &mut Generator) -> Res<()> {
    // Differences around ±1 so both branches of smooth L1 are taken.
    let p = random(&[6, 10, 24], rng)?.mul_scalar(2.0)?;
    let t = random(&[6, 10, 24], rng)?;
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
        let mse: ViewFn = |x| x[0].mse(&x[1], Reduction::Mean);
        let (yh, yd, gh, gd) = both(mse, &[p.clone(), t.clone()], DType::F32, &Tensor::from_vec(vec![0.75f32], &[])?)?;
        if dtype == DType::F32 {
            c.check("mse mean f32 forward", rel_err(&yd, &yh)?, tol);
            c.check("mse mean f32 backward (pred)", rel_err(&gd[0], &gh[0])?, tol);
            c.check("mse mean f32 backward (target)", rel_err(&gd[1], &gh[1])?, tol);
        }
        // The device in `dtype` against f32 on the host of the same inputs rounded to `dtype`.
        let (pb, tb) = (p.to_dtype(dtype)?.to_dtype(DType::F32)?, t.to_dtype(dtype)?.to_dtype(DType::F32)?);
        let yref = pb.mse(&tb, Reduction::Mean)?;
        let ydev = p.to_dtype(dtype)?.to_device(GPU)?.mse(&t.to_dtype(dtype)?.to_device(GPU)?, Reduction::Mean)?;
        c.check(&format!("mse mean {dtype:?} forward vs host f32"), rel_err(&ydev, &yref)?, tol);
    }
    let z = random(&[5, 7, 16], rng)?;
    for dtype in [DType::F32, DType::BF16] {
        let want = collapse_std(&z.to_dtype(dtype)?.to_dtype(DType::F32)?)?;
        let got = collapse_std(&z.to_dtype(dtype)?.to_device(GPU)?)?;
        c.check(&format!("collapse std [5,7,16] {dtype:?}"), (got - want).abs() / want.abs().max(1e-30), 1e-5);
    }
    Ok(())
}

fn ema_checks(c: &mut Checks) -> Res<()> {
    let cfg = small_config(DType::F32, JepaLoss::L2);
    for source_dtype in [DType::F32, DType::BF16] {
        let mut host = IJepa::new(cfg, &mut Generator::new(7))?;
        // Sources that differ from the targets.
        host.encoder.visit_params_mut("", &mut |_, p| {
            let r = random(p.shape(), &mut Generator::new(p.numel() as u64)).expect("random");
            *p = r.to_dtype(source_dtype).expect("dtype").to_dtype(DType::F32).expect("dtype").requires_grad(true);
        });
        let mut dev = host.clone();
        dev.encoder.visit_params_mut("", &mut |_, p| *p = p.detach().to_dtype(source_dtype).expect("dtype").to_device(GPU).expect("upload").requires_grad(true));
        dev.target_encoder.visit_params_mut("", &mut |_, p| *p = p.detach().to_device(GPU).expect("upload"));
        for m in [0.996, 0.9, 0.5] {
            host.ema_update(m)?;
            dev.ema_update(m)?;
        }
        let (hb, db) = (host.named_buffers(), dev.named_buffers());
        let same = hb.iter().zip(&db).all(|((_, a), (_, b))| bits(a).ok() == bits(b).ok());
        c.exact(&format!("EMA of {} tensors, {source_dtype:?} sources, 3 updates (bit-exact)", hb.len()), same);
    }
    Ok(())
}

/// A small I-JEPA whose attention runs the device's head-dim-64 kernels: 32×32 RGB, patch 8
/// (16 tokens), width 128 with 2 heads, 2 layers; predictor width 64, 1 head, 2 layers.
fn small_config(dtype: DType, loss: JepaLoss) -> IJepaConfig {
    IJepaConfig {
        encoder: VitConfig { image_size: [32, 32], patch_size: 8, in_channels: 3, d_model: 128, n_layers: 2, n_heads: 2, dtype, gelu: GeluApprox::Tanh, ..VitConfig::default() },
        predictor_width: 64,
        predictor_depth: 2,
        predictor_heads: 1,
        loss,
        momentum: (0.99, 1.0),
        sincos_pos_init: true,
    }
}

fn small_masks(batch: usize, seed: u64) -> Res<JepaMasks> {
    let mc = MaskConfig { n_targets: 2, target_scale: (0.15, 0.25), target_aspect: (0.75, 1.5), context_scale: (0.85, 1.0), min_keep: 2 };
    Ok(mc.sample([4, 4], batch, &mut Generator::new(seed))?)
}

/// The loss and every parameter's gradient of one I-JEPA step, host f32 against the device.
fn model_checks(c: &mut Checks, seed: u64) -> Res<()> {
    for loss in [JepaLoss::L2, JepaLoss::SmoothL1] {
        let host = IJepa::new(small_config(DType::F32, loss), &mut Generator::new(seed))?;
        let images = random(&[6, 3, 32, 32], &mut Generator::new(seed ^ 1))?;
        let masks = small_masks(6, seed ^ 2)?;
        let out = host.loss(&images, &masks, &mut Generator::new(0))?;
        out.loss.backward()?;
        for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 3e-2)] {
            let mut dev = IJepa::new(small_config(DType::F32, loss), &mut Generator::new(seed))?;
            cuda::move_module(&mut dev, 0, dtype)?;
            cuda::move_buffers(&mut dev, 0, DType::F32)?;
            let o = dev.loss(&images.to_dtype(dtype)?.to_device(GPU)?, &masks, &mut Generator::new(0))?;
            o.loss.backward()?;
            c.check(&format!("I-JEPA {loss:?} loss {dtype:?}"), rel_err(&o.loss, &out.loss)?, tol);
            c.check(&format!("I-JEPA {loss:?} feature std {dtype:?}"), (o.feature_std - out.feature_std).abs() / out.feature_std.max(1e-30), tol);
            let mut worst = (0.0f64, String::new());
            for ((name, a), (_, b)) in dev.named_parameters().iter().zip(host.named_parameters()) {
                let (ga, gb) = (a.grad().ok_or(format!("{name}: no gradient on the device"))?, b.grad().ok_or(format!("{name}: no gradient on the host"))?);
                let e = rel_err(&ga.to_dtype(DType::F32)?, &gb)?;
                if e > worst.0 || !e.is_finite() {
                    worst = (e, name.clone());
                }
            }
            c.check(&format!("I-JEPA {loss:?} gradients {dtype:?} (worst: {})", worst.1), worst.0, tol * 3.0);
            if dev.named_buffers().iter().any(|(_, t)| t.grad().is_some()) {
                c.exact("no gradient reaches the target encoder", false);
            }
        }
    }
    Ok(())
}

/// 40 steps of AdamW + EMA: the device in bf16 (f32 masters, f32 EMA) against the host in f32.
fn curve_check(c: &mut Checks, seed: u64) -> Res<()> {
    let steps = 40u64;
    let adamw = AdamWConfig { lr: 1e-3, weight_decay: 0.05, ..AdamWConfig::default() };
    let cfg = small_config(DType::F32, JepaLoss::SmoothL1);
    let mut host = IJepa::new(cfg, &mut Generator::new(seed))?;
    let mut host_opt = AdamW::with_decay_filter(host.named_parameters(), adamw, AdamW::decay_matrices)?;
    let mut dev = IJepa::new(cfg, &mut Generator::new(seed))?;
    let masters = cuda::move_module(&mut dev, 0, DType::BF16)?;
    cuda::move_buffers(&mut dev, 0, DType::F32)?;
    let mut dev_opt = MixedAdamW::new(dev.named_parameters(), Some(&masters), adamw, AdamW::decay_matrices)?;
    let (mut lh, mut ld) = (Vec::new(), Vec::new());
    for step in 0..steps {
        let images = random(&[16, 3, 32, 32], &mut Generator::new(seed ^ (100 + step)))?;
        let masks = small_masks(16, seed ^ (200 + step))?;
        let m = host.momentum(step, steps);
        for (model, opt, losses, on_gpu) in [(&mut host, &mut host_opt as &mut dyn Optimizer, &mut lh, false), (&mut dev, &mut dev_opt as &mut dyn Optimizer, &mut ld, true)] {
            for (_, p) in model.named_parameters() {
                p.set_grad(None)?;
            }
            let x = if on_gpu { images.to_dtype(DType::BF16)?.to_device(GPU)? } else { images.clone() };
            let out = model.loss(&x, &masks, &mut Generator::new(0))?;
            out.loss.backward()?;
            opt.step()?;
            model.ema_update(m)?;
            losses.push(out.loss.item()?);
        }
    }
    let window = |v: &[f64], i: usize| v[i..i + 10].iter().sum::<f64>() / 10.0;
    let worst = (0..=lh.len() - 10).map(|i| (window(&ld, i) - window(&lh, i)).abs() / window(&lh, i).abs()).fold(0.0f64, f64::max);
    println!("curve host f32: {:?}", lh.iter().step_by(5).map(|v| format!("{v:.4}")).collect::<Vec<_>>());
    println!("curve gpu bf16: {:?}", ld.iter().step_by(5).map(|v| format!("{v:.4}")).collect::<Vec<_>>());
    c.check("40 training steps, bf16 GPU vs f32 host (worst 10-step window)", worst, 5e-2);
    Ok(())
}

fn ops(seed: u64) -> Res<bool> {
    let mut c = Checks { failed: 0, total: 0 };
    let mut rng = Generator::new(seed);
    view_checks(&mut c, &mut rng)?;
    loss_checks(&mut c, &mut rng)?;
    ema_checks(&mut c)?;
    model_checks(&mut c, seed)?;
    curve_check(&mut c, seed)?;
    println!("jepa_gpu ops: {} of {} checks passed (seed {seed})", c.total - c.failed, c.total);
    Ok(c.failed == 0)
}

// ------------------------------------------------------------------------------------ bench

/// The shapes [`step_flops`] counts.
struct StepShape {
    /// Patches per image.
    n: usize,
    /// Context tokens.
    kc: usize,
    /// Target blocks.
    m: usize,
    /// Tokens per target block.
    kt: usize,
    /// Encoder width.
    c: usize,
    /// Encoder blocks.
    layers: usize,
    /// Inputs of the patch embedding (channels · p · p).
    patch_in: usize,
    /// Predictor width.
    p: usize,
    /// Predictor blocks.
    depth: usize,
}

/// FLOPs of one I-JEPA step per image (matrix products and attention; forward 1×, backward 2×
/// for the trained parts): context encoder fwd+bwd on `kc` tokens, target encoder forward on all
/// `n` tokens, predictor fwd+bwd on `m` sequences of `kc + kt` tokens, the patch embedding on all
/// `n` patches (forward; its weight gradient once more). The same formula as the torch peer's.
fn step_flops(s: &StepShape) -> f64 {
    let block = |t: usize, w: usize| 24.0 * (w * w * t) as f64 + 4.0 * (t * t * w) as f64;
    let encoder = |t: usize| s.layers as f64 * block(t, s.c);
    let patch = 2.0 * (s.patch_in * s.c * s.n) as f64;
    let ctx = 3.0 * encoder(s.kc) + 2.0 * patch;
    let tgt = encoder(s.n) + patch;
    let seq = s.kc + s.kt;
    let pred = 3.0 * s.m as f64 * (2.0 * (s.c * s.p * s.kc) as f64 + s.depth as f64 * block(seq, s.p) + 2.0 * (s.p * s.c * s.kt) as f64);
    ctx + tgt + pred
}

fn bench(batch: usize) -> Res<()> {
    let steps = std::env::var("RTX_BENCH_STEPS").ok().and_then(|s| s.parse().ok()).unwrap_or(20usize);
    let (grid, kc, m) = (14usize, 100usize, 4usize);
    let config = IJepaConfig {
        encoder: VitConfig { image_size: [224, 224], patch_size: 16, in_channels: 3, d_model: 768, n_layers: 12, n_heads: 12, dtype: DType::F32, gelu: GeluApprox::Tanh, ..VitConfig::default() },
        predictor_width: 384,
        predictor_depth: 6,
        predictor_heads: 6,
        loss: JepaLoss::SmoothL1,
        momentum: (0.996, 1.0),
        sincos_pos_init: true,
    };
    let t0 = Instant::now();
    let mut model = IJepa::new(config, &mut Generator::new(1))?;
    let masters = cuda::move_module(&mut model, 0, DType::BF16)?;
    cuda::move_buffers(&mut model, 0, DType::F32)?;
    let adamw = AdamWConfig { lr: 1e-4, weight_decay: 0.05, beta2: 0.95, ..AdamWConfig::default() };
    let mut opt = MixedAdamW::new(model.named_parameters(), Some(&masters), adamw, AdamW::decay_matrices)?;
    let n_params: usize = model.named_parameters().iter().map(|(_, p)| p.numel()).sum();
    println!("bench: model built and moved in {:.1} s, {n_params} trained parameters", t0.elapsed().as_secs_f64());
    let mut rng = Generator::new(7);
    let mut times = Vec::new();
    let mut last = (0.0, 0.0);
    let total = (steps + 3) as u64;
    for i in 0..total {
        // The batch is uploaded before the clock starts (the torch peer does the same).
        let x = random(&[batch, 3, 224, 224], &mut rng)?.to_dtype(DType::BF16)?.to_device(GPU)?;
        let masks = JepaMasks::fixed_blocks(batch, [grid, grid], kc, m, (4, 8), &mut rng)?;
        let start = Instant::now();
        for (_, p) in model.named_parameters() {
            p.set_grad(None)?;
        }
        let out = model.loss(&x, &masks, &mut Generator::new(0))?;
        out.loss.backward()?;
        opt.step()?;
        model.ema_update(model.momentum(i, total))?;
        last = (out.loss.item()?, out.feature_std);
        if i >= 3 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let flops = step_flops(&StepShape { n: grid * grid, kc, m, kt: 32, c: 768, layers: 12, patch_in: 3 * 16 * 16, p: 384, depth: 6 }) * batch as f64;
    let img_s = batch as f64 / median;
    let mfu = flops / median / PEAK_BF16;
    let stats = cuda::device(0)?.memory_stats();
    println!("bench I-JEPA ViT-B/16 224x224: batch {batch}, context {kc} of 196 tokens, {m} targets of 32, predictor 6x384, bf16 + f32 master AdamW, f32 EMA, {steps} steps");
    println!(
        "bench step median {:.2} ms (min {:.2}), {img_s:.0} images/s, MFU {:.1}% ({:.1} GFLOP per image), last loss {:.4}, feature std {:.4}, peak device memory {:.2} GiB",
        median * 1e3,
        times[0] * 1e3,
        mfu * 100.0,
        flops / batch as f64 / 1e9,
        last.0,
        last.1,
        stats.peak_reserved as f64 / (1u64 << 30) as f64
    );
    println!("RESULT rustytorch batch={batch} img_s={img_s:.0} step_ms={:.2} mfu={mfu:.4}", median * 1e3);
    Ok(())
}
