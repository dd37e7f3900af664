//! Tests of the I-JEPA model: buffers, the EMA update, a finite-difference gradient check, and
//! checkpoints that carry the target encoder; and of its V-JEPA form (tubelets, 3-D positions,
//! tube masks): the tubelet embedding's layout and gradients, and the video loss's gradients.

use super::*;
use crate::checkpoint::{self, CheckpointMeta};
use crate::nn::Pooling;
use rtx_kernels::DType;

fn tiny(dtype: DType, loss: JepaLoss) -> IJepaConfig {
    let encoder = VitConfig {
        image_size: [8, 8],
        patch_size: 2,
        in_channels: 1,
        d_model: 8,
        n_layers: 1,
        n_heads: 2,
        mlp_ratio: 2,
        dtype,
        pooling: Pooling::Mean,
        ..VitConfig::default()
    };
    IJepaConfig { encoder, predictor_width: 8, predictor_depth: 1, predictor_heads: 2, loss, momentum: (0.9, 1.0), sincos_pos_init: true }
}

fn images(b: usize, dtype: DType, seed: u64) -> Tensor {
    Tensor::randn(&[b, 1, 8, 8], 0.0, 1.0, dtype, &mut Generator::new(seed)).expect("images")
}

fn masks(b: usize, seed: u64) -> JepaMasks {
    MaskConfig { n_targets: 2, ..MaskConfig::default() }.sample([4, 4], b, &mut Generator::new(seed)).expect("masks")
}

#[test]
fn target_encoder_is_buffers_not_parameters() {
    let model = IJepa::new(tiny(DType::F32, JepaLoss::L2), &mut Generator::new(1)).expect("model");
    let params = model.named_parameters();
    let buffers = model.named_buffers();
    assert!(params.iter().all(|(n, t)| (n.starts_with("encoder.") || n.starts_with("predictor.")) && t.is_requires_grad()));
    assert!(!buffers.is_empty());
    assert!(buffers.iter().all(|(n, t)| n.starts_with("target_encoder.") && !t.is_requires_grad()));
    let enc: Vec<(String, Vec<f32>)> = model.encoder.named_parameters().into_iter().map(|(n, t)| (n, t.to_f32_vec().expect("values"))).collect();
    let tgt: Vec<(String, Vec<f32>)> =
        buffers.into_iter().map(|(n, t)| (n.trim_start_matches("target_encoder.").to_string(), t.to_f32_vec().expect("values"))).collect();
    assert_eq!(enc, tgt, "the target encoder starts as an exact copy of the encoder");
    let names: Vec<String> = model.named_state().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names.len(), params.len() + tgt.len());
}

#[test]
fn ema_update_is_exact() {
    let model = IJepa::new(tiny(DType::F32, JepaLoss::L2), &mut Generator::new(2)).expect("model");
    // Move the encoder away from the target so the update has something to do.
    let mut rng = Generator::new(3);
    for (_, p) in model.encoder.named_parameters() {
        p.copy_from_(&Tensor::randn(p.shape(), 0.0, 1.0, DType::F32, &mut rng).expect("randn")).expect("copy");
    }
    let before: Vec<Vec<f32>> = model.named_buffers().iter().map(|(_, t)| t.to_f32_vec().expect("values")).collect();
    let source: Vec<Vec<f32>> = model.encoder.named_parameters().iter().map(|(_, t)| t.to_f32_vec().expect("values")).collect();
    let m = model.momentum(30, 100);
    assert_eq!(m, 0.9 + 0.1 * 0.3);
    model.ema_update(m).expect("ema");
    let after: Vec<Vec<f32>> = model.named_buffers().iter().map(|(_, t)| t.to_f32_vec().expect("values")).collect();
    let (mf, nf) = (m as f32, (1.0 - m) as f32);
    for ((b, s), a) in before.iter().zip(&source).zip(&after) {
        for ((b, s), a) in b.iter().zip(s).zip(a) {
            assert_eq!(a.to_bits(), (mf * b + nf * s).to_bits());
        }
    }
    // Momentum 1 leaves the target alone; momentum 0 copies the encoder.
    model.ema_update(1.0).expect("ema");
    let same: Vec<Vec<f32>> = model.named_buffers().iter().map(|(_, t)| t.to_f32_vec().expect("values")).collect();
    assert_eq!(same, after);
    model.ema_update(0.0).expect("ema");
    let copied: Vec<Vec<f32>> = model.named_buffers().iter().map(|(_, t)| t.to_f32_vec().expect("values")).collect();
    assert_eq!(copied, source);
    assert_eq!(model.momentum(100, 100), 1.0);
    assert_eq!(model.momentum(0, 100), 0.9);
}

/// Central differences of the whole JEPA loss against autograd, in f64, for elements of the
/// encoder (patch embedding, attention, positions) and the predictor (mask token, blocks, proj),
/// with both losses; the target encoder gets no gradient.
#[test]
fn jepa_loss_gradcheck() {
    for loss in [JepaLoss::L2, JepaLoss::SmoothL1] {
        gradcheck(tiny(DType::F64, loss), &images(3, DType::F64, 6), &masks(3, 7));
    }
}

/// A V-JEPA config: 8x8 clips of 4 frames, tubelets of 2 frames x 2x2 pixels (a [2, 4, 4] grid).
fn tiny_video(dtype: DType, loss: JepaLoss) -> IJepaConfig {
    let mut cfg = tiny(dtype, loss);
    cfg.encoder.frames = 4;
    cfg.encoder.tubelet = 2;
    cfg
}

/// The same gradient check for the video model: tubelet embedding, 3-D positions, tube masks.
#[test]
fn vjepa_loss_gradcheck() {
    for loss in [JepaLoss::L2, JepaLoss::SmoothL1] {
        let clips = Tensor::randn(&[3, 1, 4, 8, 8], 0.0, 1.0, DType::F64, &mut Generator::new(16)).expect("clips");
        gradcheck(tiny_video(DType::F64, loss), &clips, &masks(3, 17).tubes(16, 2).expect("tubes"));
    }
}

fn gradcheck(config: IJepaConfig, x: &Tensor, mk: &JepaMasks) {
    let loss = config.loss;
    {
        let model = IJepa::new(config, &mut Generator::new(4)).expect("model");
        // Make the target differ from the encoder, as after some training.
        model.ema_update(0.0).expect("ema");
        let mut rng = Generator::new(5);
        for (_, p) in model.encoder.named_parameters() {
            p.update_(|_| {}, |d| d.iter_mut().for_each(|v| *v += 0.3 * rng.normal())).expect("perturb");
        }
        let eval = |m: &IJepa| -> f64 { m.loss(x, mk, &mut Generator::new(0)).expect("loss").loss.item().expect("item") };
        model.zero_grad().expect("zero");
        let out = model.loss(x, mk, &mut Generator::new(0)).expect("loss");
        out.loss.backward().expect("backward");
        assert!(model.named_buffers().iter().all(|(_, t)| t.grad().is_none()), "a target tensor got a gradient");
        let eps = 1e-5;
        let mut checked = 0;
        for (name, p) in model.named_parameters() {
            let grad = p.grad().unwrap_or_else(|| panic!("{name} has no gradient")).to_f64_vec().expect("grad");
            let n = p.numel();
            for &i in &[0, n / 2, n - 1] {
                let bump = |delta: f64| p.update_(|_| {}, |d| d[i] += delta).expect("bump");
                bump(eps);
                let up = eval(&model);
                bump(-2.0 * eps);
                let down = eval(&model);
                bump(eps);
                let numeric = (up - down) / (2.0 * eps);
                let err = (numeric - grad[i]).abs() / numeric.abs().max(1e-3);
                assert!(err < 1e-4, "{loss:?} {name}[{i}]: autograd {} vs numeric {numeric}", grad[i]);
                checked += 1;
            }
        }
        assert!(checked > 30);
    }
}

#[test]
fn loss_is_deterministic_and_rejects_bad_shapes() {
    let model = IJepa::new(tiny(DType::F32, JepaLoss::L2), &mut Generator::new(8)).expect("model");
    let x = images(4, DType::F32, 9);
    let mk = masks(4, 10);
    let a = model.loss(&x, &mk, &mut Generator::new(0)).expect("loss");
    let b = model.loss(&x, &mk, &mut Generator::new(0)).expect("loss");
    assert_eq!(a.loss.item().expect("item").to_bits(), b.loss.item().expect("item").to_bits());
    assert!(a.feature_std > 0.0);
    assert!(model.loss(&images(3, DType::F32, 9), &mk, &mut Generator::new(0)).is_err());
    let bad = IJepaConfig { momentum: (0.9, 1.5), ..tiny(DType::F32, JepaLoss::L2) };
    assert!(IJepa::new(bad, &mut Generator::new(0)).is_err());
    assert!(sincos_2d([2, 2], 6).is_err());
}

#[test]
fn checkpoints_carry_the_target_encoder() {
    let dir = std::env::temp_dir().join(format!("rtx-jepa-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("a.safetensors");
    let model = IJepa::new(tiny(DType::F32, JepaLoss::L2), &mut Generator::new(11)).expect("model");
    let mut rng = Generator::new(12);
    for (_, p) in model.encoder.named_parameters() {
        p.copy_from_(&Tensor::randn(p.shape(), 0.0, 1.0, DType::F32, &mut rng).expect("randn")).expect("copy");
    }
    model.ema_update(0.5).expect("ema");
    checkpoint::save(&path, &model, None, &CheckpointMeta::default()).expect("save");
    let fresh = IJepa::new(tiny(DType::F32, JepaLoss::L2), &mut Generator::new(13)).expect("model");
    checkpoint::load(&path, &fresh, None).expect("load");
    let values = |m: &IJepa| -> Vec<(String, Vec<f32>)> { m.named_state().into_iter().map(|(n, t)| (n, t.to_f32_vec().expect("values"))).collect() };
    assert_eq!(values(&fresh), values(&model));
    // A file without the buffers does not load into a model that has them.
    let params_only = dir.join("b.safetensors");
    checkpoint::save_tensors(&params_only, &model.named_parameters(), &checkpoint::file_metadata(&CheckpointMeta::default(), None).expect("meta"))
        .expect("save");
    let err = checkpoint::load(&params_only, &fresh, None).expect_err("loaded without buffers");
    assert!(err.to_string().contains("target_encoder"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fixed_block_masks_have_the_asked_shapes() {
    let seed = 20261205;
    println!("seed {seed}");
    let m = JepaMasks::fixed_blocks(5, [14, 14], 100, 4, (4, 8), &mut Generator::new(seed)).expect("masks");
    assert_eq!((m.batch, m.n_context, m.n_targets, m.n_target_tokens), (5, 100, 4, 32));
    assert_eq!(m.context.len(), 5 * 100);
    assert_eq!(m.targets.len(), 4 * 5 * 32);
    for b in 0..5 {
        let ctx = &m.context[b * 100..(b + 1) * 100];
        assert!(ctx.windows(2).all(|w| w[0] < w[1]), "context of image {b} is ascending and distinct");
        for k in 0..4 {
            let block = &m.targets[(k * 5 + b) * 32..(k * 5 + b + 1) * 32];
            let (r0, c0) = (block[0] / 14, block[0] % 14);
            for (i, &id) in block.iter().enumerate() {
                assert_eq!((id / 14, id % 14), (r0 + (i / 8) as u32, c0 + (i % 8) as u32), "block {k} of image {b} is a 4x8 rectangle");
            }
        }
    }
    // Few targets on a large grid: the context never touches a target.
    let m = JepaMasks::fixed_blocks(3, [7, 7], 20, 2, (2, 2), &mut Generator::new(seed)).expect("masks");
    for b in 0..3 {
        let covered: Vec<u32> = (0..2).flat_map(|k| m.targets[(k * 3 + b) * 4..(k * 3 + b + 1) * 4].to_vec()).collect();
        assert!(m.context[b * 20..(b + 1) * 20].iter().all(|c| !covered.contains(c)));
    }
    assert!(JepaMasks::fixed_blocks(2, [7, 7], 50, 1, (2, 2), &mut Generator::new(seed)).is_err(), "more context tokens than patches");
    assert!(JepaMasks::fixed_blocks(2, [7, 7], 10, 1, (8, 2), &mut Generator::new(seed)).is_err(), "a block taller than the grid");
    let again = JepaMasks::fixed_blocks(3, [7, 7], 20, 2, (2, 2), &mut Generator::new(seed)).expect("masks");
    assert_eq!(again, m, "the same seed gives the same masks");
}

#[test]
fn tubelets_are_cut_time_major_like_a_conv3d() {
    // Goal: patchify_3d puts input element (b, c, f, y, x) at token (f/t, y/p, x/p) in time-major
    // order and feature (c, f%t, y%p, x%p), as a Conv3d of kernel and stride (t, p, p) reads it.
    let (b, c, f, h, w, t, p) = (2, 2, 4, 6, 4, 2, 2);
    let n = b * c * f * h * w;
    let x = Tensor::from_vec((0..n).map(|i| i as f32).collect::<Vec<_>>(), &[b, c, f, h, w]).expect("x");
    let tokens = crate::nn::patchify_3d(&x, t, p).expect("patchify");
    let (gt, gh, gw) = (f / t, h / p, w / p);
    assert_eq!(tokens.shape(), &[b, gt * gh * gw, c * t * p * p]);
    let v = tokens.to_f32_vec().expect("values");
    for bi in 0..b {
        for ci in 0..c {
            for fi in 0..f {
                for yi in 0..h {
                    for xi in 0..w {
                        let src = (((bi * c + ci) * f + fi) * h + yi) * w + xi;
                        let token = ((fi / t) * gh + yi / p) * gw + xi / p;
                        let feature = ((ci * t + fi % t) * p + yi % p) * p + xi % p;
                        assert_eq!(v[(bi * gt * gh * gw + token) * c * t * p * p + feature], src as f32);
                    }
                }
            }
        }
    }
    assert!(crate::nn::patchify_3d(&x, 3, p).is_err());
    assert!(crate::nn::patchify_3d(&x.reshape(&[b * c, f, h, w]).expect("4-d"), t, p).is_err());
}

/// Central differences against autograd for the tubelet embedding alone (weight, bias, input),
/// in f64, under a fixed random weighting of its outputs.
#[test]
fn tubelet_embedding_gradcheck() {
    let mut rng = Generator::new(18);
    let embed = crate::nn::PatchEmbed::tubelets(2, 2, 2, 5, 0.5, DType::F64, &mut rng).expect("embed");
    let x = Tensor::randn(&[2, 2, 4, 4, 4], 0.0, 1.0, DType::F64, &mut rng).expect("x").requires_grad(true);
    let weights = Tensor::randn(&[2, 8, 5], 0.0, 1.0, DType::F64, &mut rng).expect("weights");
    let eval = || -> f64 { embed.forward(&x).expect("forward").mul(&weights).expect("mul").sum_all().expect("sum").item().expect("item") };
    let out = embed.forward(&x).expect("forward").mul(&weights).expect("mul").sum_all().expect("sum");
    out.backward().expect("backward");
    let mut tensors = embed.named_parameters();
    tensors.push(("input".into(), x.clone()));
    for (name, p) in tensors {
        let grad = p.grad().unwrap_or_else(|| panic!("{name} has no gradient")).to_f64_vec().expect("grad");
        let n = p.numel();
        for i in [0, 1, n / 3, n / 2, n - 1] {
            let eps = 1e-6;
            let bump = |delta: f64| p.update_(|_| {}, |d| d[i] += delta).expect("bump");
            bump(eps);
            let up = eval();
            bump(-2.0 * eps);
            let down = eval();
            bump(eps);
            let numeric = (up - down) / (2.0 * eps);
            assert!((numeric - grad[i]).abs() < 1e-6 * numeric.abs().max(1.0), "{name}[{i}]: autograd {} vs numeric {numeric}", grad[i]);
        }
    }
}

#[test]
fn vjepa_loss_is_deterministic_and_positions_are_3d() {
    // Goal: the video model's loss is a pure function of (model, clips, masks); its encoder
    // starts at the 3-D sin-cos positions, its predictor's are the same layout; image-shaped
    // input and 2-D masks are refused; a width that is not a multiple of 8 is refused.
    let model = IJepa::new(tiny_video(DType::F32, JepaLoss::L2), &mut Generator::new(19)).expect("model");
    assert_eq!(model.token_grid(), [2, 4, 4]);
    let expected = sincos_3d([2, 4, 4], 8).expect("positions");
    assert_eq!(model.encoder.pos_embed.to_f32_vec().expect("pos"), expected);
    // Slot 0 and slot 1 of the same spatial token share the spatial half and differ in time.
    assert_eq!(expected[..4], expected[16 * 8..16 * 8 + 4]);
    assert_ne!(expected[4..8], expected[16 * 8 + 4..16 * 8 + 8]);
    assert_eq!(sincos_3d([1, 4, 4], 8).expect("2-d"), sincos_2d([4, 4], 8).expect("2-d"));
    assert!(sincos_3d([2, 2, 2], 12).is_err());
    let clips = Tensor::randn(&[4, 1, 4, 8, 8], 0.0, 1.0, DType::F32, &mut Generator::new(20)).expect("clips");
    let mk = masks(4, 21).tubes(16, 2).expect("tubes");
    let a = model.loss(&clips, &mk, &mut Generator::new(0)).expect("loss");
    let b = model.loss(&clips, &mk, &mut Generator::new(0)).expect("loss");
    assert_eq!(a.loss.item().expect("item").to_bits(), b.loss.item().expect("item").to_bits());
    assert!(a.loss.item().expect("item") > 0.0 && a.feature_std > 0.0);
    assert!(model.loss(&images(4, DType::F32, 9), &masks(4, 21), &mut Generator::new(0)).is_err());
    assert_eq!(model.features(&clips, &mut Generator::new(0)).expect("features").shape(), &[4, 8]);
    let mut narrow = tiny_video(DType::F32, JepaLoss::L2);
    narrow.predictor_width = 12;
    assert!(IJepa::new(narrow, &mut Generator::new(0)).is_err());
}
