//! Optimizers against torch's formulas, gradient clipping, schedules, and flat parameter
//! buckets (aliasing, layout, and bit-identical training against unbucketed parameters).
#![allow(clippy::unwrap_used)]

use rtx_tensor::nn::{Activation, Gpt, GptConfig, Mlp, Module};
use rtx_tensor::optim::{clip_grad_norm, AdamW, AdamWConfig, ConstantLr, LrSchedule, Optimizer, ParamBuckets, Sgd, SgdConfig, WarmupCosine};
use rtx_tensor::{DType, Generator, Tensor};

fn leaf64(v: &[f64]) -> Tensor {
    Tensor::from_slice(v, &[v.len()]).unwrap().requires_grad(true)
}

fn set_grad(p: &Tensor, g: &[f64]) {
    p.set_grad(Some(Tensor::from_slice(g, p.shape()).unwrap())).unwrap();
}

/// torch.optim.AdamW's single-tensor update, written out in f64.
#[allow(clippy::too_many_arguments)]
fn adamw_reference(p: &mut [f64], m: &mut [f64], v: &mut [f64], g: &[f64], step: i32, lr: f64, b1: f64, b2: f64, eps: f64, wd: f64) {
    for i in 0..p.len() {
        p[i] *= 1.0 - lr * wd;
        m[i] += (1.0 - b1) * (g[i] - m[i]);
        v[i] = v[i] * b2 + (1.0 - b2) * g[i] * g[i];
        let bc1 = 1.0 - b1.powi(step);
        let bc2 = 1.0 - b2.powi(step);
        let denom = v[i].sqrt() / bc2.sqrt() + eps;
        p[i] -= lr / bc1 * m[i] / denom;
    }
}

#[test]
fn adamw_matches_torch_formulas() {
    // Goal: AdamW's update order, bias correction, eps placement and decoupled decay are
    // torch's. Method: two steps in f64 against the reference, plus one hand-computed value.
    let (lr, b1, b2, eps, wd) = (0.1, 0.9, 0.99, 1e-8, 0.1);
    let w = leaf64(&[1.0, -2.0, 0.5]);
    let b = leaf64(&[0.3]);
    let cfg = AdamWConfig { lr, beta1: b1, beta2: b2, eps, weight_decay: wd };
    let mut opt = AdamW::with_decay_filter(vec![("w".into(), w.clone()), ("b".into(), b.clone())], cfg, |name, _| name == "w").unwrap();
    let (mut p, mut m, mut v) = (vec![1.0, -2.0, 0.5], vec![0.0; 3], vec![0.0; 3]);
    let (mut pb, mut mb, mut vb) = (vec![0.3], vec![0.0], vec![0.0]);
    let grads = [[0.5, -1.0, 2.0], [0.1, 0.3, -0.7]];
    for (step, g) in grads.iter().enumerate() {
        set_grad(&w, g);
        set_grad(&b, &[g[0]]);
        opt.step().unwrap();
        adamw_reference(&mut p, &mut m, &mut v, g, step as i32 + 1, lr, b1, b2, eps, wd);
        adamw_reference(&mut pb, &mut mb, &mut vb, &[g[0]], step as i32 + 1, lr, b1, b2, eps, 0.0);
        let got = w.to_f64_vec().unwrap();
        for (a, e) in got.iter().zip(&p) {
            assert!((a - e).abs() <= 1e-15 * e.abs().max(1.0), "step {step}: {a} vs {e}");
        }
        assert!((b.to_f64_vec().unwrap()[0] - pb[0]).abs() < 1e-15);
        if step == 0 {
            // p·(1 − lr·wd) − lr·g/(|g| + eps) for p = 1, g = 0.5.
            assert!((got[0] - (0.99 - 0.1 * 0.5 / (0.5 + 1e-8))).abs() < 1e-15);
        }
    }
    // f32 parameters follow the same formulas to f32 precision.
    let w32 = Tensor::from_slice(&[1.0f32, -2.0, 0.5], &[3]).unwrap().requires_grad(true);
    let mut opt32 = AdamW::new(vec![("w".into(), w32.clone())], cfg).unwrap();
    let (mut p, mut m, mut v) = (vec![1.0, -2.0, 0.5], vec![0.0; 3], vec![0.0; 3]);
    for (step, g) in grads.iter().enumerate() {
        w32.set_grad(Some(Tensor::from_vec(g.iter().map(|&x| x as f32).collect(), &[3]).unwrap())).unwrap();
        opt32.step().unwrap();
        adamw_reference(&mut p, &mut m, &mut v, g, step as i32 + 1, lr, b1, b2, eps, wd);
    }
    for (a, e) in w32.to_f64_vec().unwrap().iter().zip(&p) {
        assert!((a - e).abs() < 1e-6, "{a} vs {e}");
    }
    let state: Vec<String> = opt32.state_tensors().unwrap().into_iter().map(|(n, _)| n).collect();
    assert_eq!(state, ["w.exp_avg", "w.exp_avg_sq", "w.step"]);
}

#[test]
fn sgd_matches_torch_formulas() {
    // Goal: momentum (first step copies the gradient), dampening, weight decay and Nesterov as
    // torch.optim.SGD. Method: three steps in f64 against a reference written from its docs.
    for nesterov in [false, true] {
        let (lr, mu, damp, wd) = (0.05, 0.9, if nesterov { 0.0 } else { 0.2 }, 0.01);
        let w = leaf64(&[1.0, -0.5]);
        let cfg = SgdConfig { lr, momentum: mu, dampening: damp, weight_decay: wd, nesterov };
        let mut opt = Sgd::new(vec![("w".into(), w.clone())], cfg).unwrap();
        let mut p = [1.0, -0.5];
        let mut buf = [0.0; 2];
        for (step, g) in [[0.2, 0.4], [-0.1, 0.3], [0.5, -0.2]].iter().enumerate() {
            set_grad(&w, g);
            opt.step().unwrap();
            for i in 0..2 {
                let d = g[i] + wd * p[i];
                buf[i] = if step == 0 { d } else { buf[i] * mu + (1.0 - damp) * d };
                let d = if nesterov { d + mu * buf[i] } else { buf[i] };
                p[i] -= lr * d;
            }
            let got = w.to_f64_vec().unwrap();
            for i in 0..2 {
                assert!((got[i] - p[i]).abs() < 1e-15, "nesterov {nesterov} step {step}: {} vs {}", got[i], p[i]);
            }
        }
    }
    // Plain SGD: p − lr·g, and no state.
    let w = leaf64(&[1.0]);
    let mut opt = Sgd::new(vec![("w".into(), w.clone())], SgdConfig { lr: 0.5, ..SgdConfig::default() }).unwrap();
    set_grad(&w, &[0.25]);
    opt.step().unwrap();
    assert_eq!(w.to_f64_vec().unwrap(), vec![0.875]);
    assert!(opt.state_tensors().unwrap().is_empty());
    assert!(Sgd::new(vec![], SgdConfig { nesterov: true, ..SgdConfig::default() }).is_err());
}

/// Four elements of a torch 2.11 CPU run (float32, AVX-512 kernels): the start, three
/// gradients, and the parameters after each step of AdamW, SGD with momentum and dampening, and
/// Nesterov SGD, as f32 bit patterns.
const TORCH_P0: [u32; 4] = [0x3e69c64b, 0xbf57867e, 0xbe78d387, 0x3fc0a793];
const TORCH_GRADS: [[u32; 4]; 3] = [[0xbf7fb5c6, 0xbe00ef71, 0xbf253c96, 0x3e9f16b8], [0x3e94bfbf, 0x3fae21ed, 0x3f65113b, 0xbf987edb], [0x3f7eae0f, 0xbf2fa37e, 0x3f85fa7a, 0xbef82774]];
const TORCH_ADAMW: [[u32; 4]; 3] = [[0x3e73fdc0, 0xbf54f19d, 0xbe6e8fb7, 0x3fbf5af6], [0x3e786d04, 0xbf56a950, 0xbe70b4ab, 0x3fc00aa2], [0x3e765e14, 0xbf571b57, 0xbe7666a6, 0x3fc0d44c]];
const TORCH_SGD: [[u32; 4]; 3] = [[0x3e8e665d, 0xbf55ce50, 0xbe57a78f, 0x3fbe91d5], [0x3e9f5ab0, 0xbf621a7e, 0xbe5e5d4d, 0x3fc2b781], [0x3e9a2cd1, 0xbf660e29, 0xbe879802, 0x3fc8da58]];
const TORCH_NESTEROV: [[u32; 4]; 3] = [[0x3ea55c75, 0xbf544226, 0xbe39ccca, 0x3fbcb176], [0x3eabbcf3, 0xbf73bfc9, 0xbe75ccc7, 0x3fc94fee], [0x3e87b16f, 0xbf6f98e3, 0xbeb41ee8, 0x3fd39829]];

#[test]
fn f32_steps_are_bit_identical_to_torch() {
    // Goal: with the same fused multiply-adds as PyTorch's CPU kernels, f32 updates match torch
    // bit for bit. Method: replay recorded torch runs (see the constants) and compare bits.
    let f = |bits: &[u32; 4]| Tensor::from_vec(bits.iter().map(|&b| f32::from_bits(b)).collect(), &[4]).unwrap();
    let cases: [(&str, [[u32; 4]; 3]); 3] = [("adamw", TORCH_ADAMW), ("sgd", TORCH_SGD), ("nesterov", TORCH_NESTEROV)];
    for (name, expected) in cases {
        let p = f(&TORCH_P0).requires_grad(true);
        let params = vec![("p".to_string(), p.clone())];
        let mut opt: Box<dyn Optimizer> = match name {
            "adamw" => Box::new(AdamW::new(params, AdamWConfig { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }).unwrap()),
            "sgd" => Box::new(Sgd::new(params, SgdConfig { lr: 0.05, momentum: 0.9, dampening: 0.2, weight_decay: 0.01, nesterov: false }).unwrap()),
            _ => Box::new(Sgd::new(params, SgdConfig { lr: 0.05, momentum: 0.9, dampening: 0.0, weight_decay: 0.01, nesterov: true }).unwrap()),
        };
        for (step, (g, want)) in TORCH_GRADS.iter().zip(&expected).enumerate() {
            p.set_grad(Some(f(g))).unwrap();
            opt.step().unwrap();
            let got: Vec<u32> = p.to_f32_vec().unwrap().iter().map(|x| x.to_bits()).collect();
            assert_eq!(&got, want, "{name} step {}", step + 1);
        }
    }
}

#[test]
fn params_without_grad_are_skipped_and_zero_grad_keeps_buffers() {
    // Goal: torch semantics for parameters without gradients; zero_grad zeroes in place.
    let a = leaf64(&[1.0]);
    let b = leaf64(&[2.0]);
    let mut opt = AdamW::new(vec![("a".into(), a.clone()), ("b".into(), b.clone())], AdamWConfig::default()).unwrap();
    set_grad(&a, &[1.0]);
    opt.step().unwrap();
    assert_eq!(b.to_f64_vec().unwrap(), vec![2.0]);
    let steps: Vec<f64> = opt.state_tensors().unwrap().iter().filter(|(n, _)| n.ends_with(".step")).map(|(_, t)| t.item().unwrap()).collect();
    assert_eq!(steps, vec![1.0, 0.0]);
    let g = a.grad().unwrap();
    opt.zero_grad().unwrap();
    assert!(a.grad().unwrap().storage().same(g.storage()));
    assert_eq!(g.to_f64_vec().unwrap(), vec![0.0]);
}

#[test]
fn clip_grad_norm_as_torch() {
    // Goal: total norm over all gradients, scaled by max/(total + 1e-6) only when that is < 1.
    let a = leaf64(&[0.0, 0.0]);
    let b = leaf64(&[0.0]);
    let none = leaf64(&[5.0]);
    set_grad(&a, &[3.0, 4.0]);
    set_grad(&b, &[12.0]);
    let total = clip_grad_norm(&[a.clone(), b.clone(), none.clone()], 100.0).unwrap();
    assert_eq!(total, 13.0);
    assert_eq!(a.grad().unwrap().to_f64_vec().unwrap(), vec![3.0, 4.0]);
    let total = clip_grad_norm(&[a.clone(), b.clone(), none], 1.3).unwrap();
    assert_eq!(total, 13.0);
    let k = 1.3 / (13.0 + 1e-6);
    assert_eq!(a.grad().unwrap().to_f64_vec().unwrap(), vec![3.0 * k, 4.0 * k]);
    assert_eq!(b.grad().unwrap().to_f64_vec().unwrap(), vec![12.0 * k]);
    assert!(clip_grad_norm(&[a], 0.0).is_err());
}

#[test]
fn schedules() {
    // Goal: warmup then cosine, nanoGPT's formula, at the landmarks.
    let s = WarmupCosine { max_lr: 1.0, min_lr: 0.1, warmup_steps: 10, total_steps: 110 };
    let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
    assert!(close(s.lr(0), 0.1));
    assert!(close(s.lr(4), 0.5));
    assert!(close(s.lr(9), 1.0));
    assert!(close(s.lr(10), 1.0));
    assert!(close(s.lr(60), 0.55));
    assert!(close(s.lr(35), 0.1 + 0.45 * (1.0 + (std::f64::consts::PI / 4.0).cos())));
    assert!(close(s.lr(110), 0.1));
    assert!(close(s.lr(1000), 0.1));
    assert_eq!(ConstantLr { lr: 0.3 }.lr(12345), 0.3);
}

#[test]
fn buckets_alias_parameters_in_reverse_order() {
    // Goal: bucket layout is reverse visit order within a byte limit, and params/grads alias
    // the flat buffers both ways. Method: inspect the table and write through the buffers.
    let mut model = Mlp::new(&[4, 8, 8, 3], Activation::Relu, DType::F32, &mut Generator::new(1)).unwrap();
    let before = model.named_parameters();
    let buckets = ParamBuckets::new(&mut model, 200).unwrap();
    // Sizes in elements: l0.w 32, l0.b 8, l1.w 64, l1.b 8, l2.w 24, l2.b 3; limit 50 elements.
    // Reverse order: [l2.b, l2.w, l1.b] = 35 | [l1.w] = 64 (oversized, alone) | [l0.b, l0.w] = 40.
    let layout: Vec<(String, usize, usize)> = buckets.entries().iter().map(|e| (e.name.clone(), e.bucket, e.offset)).collect();
    let expect = [("layers.0.weight", 2, 8), ("layers.0.bias", 2, 0), ("layers.1.weight", 1, 0), ("layers.1.bias", 0, 27), ("layers.2.weight", 0, 3), ("layers.2.bias", 0, 0)];
    assert_eq!(layout, expect.map(|(n, b, o)| (n.to_string(), b, o)));
    assert_eq!(buckets.buckets().iter().map(|b| b.numel()).collect::<Vec<_>>(), vec![35, 64, 40]);
    assert_eq!(buckets.buckets()[0].entries(), &[5, 4, 3]);
    assert_eq!(buckets.numel(), model.num_parameters());

    let after = model.named_parameters();
    for ((name, old), (name2, new)) in before.iter().zip(&after) {
        assert_eq!(name, name2);
        assert_eq!(old.to_f32_vec().unwrap(), new.to_f32_vec().unwrap());
        let e = buckets.entry(name).unwrap();
        assert!(new.storage().same(buckets.buckets()[e.bucket].param_storage()));
        assert_eq!(buckets.bucket_of(new), Some(e.bucket));
        assert!(new.grad().unwrap().storage().same(buckets.buckets()[e.bucket].grad_storage()));
    }
    // Writing the bucket changes the parameter, and the reverse.
    let b0 = &buckets.buckets()[0];
    b0.params().copy_from_(&Tensor::full(&[35], 7.0, DType::F32)).unwrap();
    assert!(model.layers[2].weight.to_f32_vec().unwrap().iter().all(|&v| v == 7.0));
    model.layers[2].bias.as_ref().unwrap().update_f32_(|v| v.fill(-1.0)).unwrap();
    assert_eq!(&b0.params().to_f32_vec().unwrap()[..4], &[-1.0, -1.0, -1.0, 7.0]);

    // Backward accumulates into the gradient buckets; zero_grad clears them in place.
    let x = Tensor::ones(&[2, 4], DType::F32);
    model.forward(&x).unwrap().sum_all().unwrap().backward().unwrap();
    let g = model.layers[2].bias.as_ref().unwrap().grad().unwrap().to_f32_vec().unwrap();
    assert_eq!(g, vec![2.0, 2.0, 2.0]);
    assert_eq!(&b0.grads().to_f32_vec().unwrap()[..3], &[2.0, 2.0, 2.0]);
    buckets.zero_grad().unwrap();
    assert!(buckets.buckets().iter().all(|b| b.grads().to_f32_vec().unwrap().iter().all(|&v| v == 0.0)));
}

fn train_gpt(bucket_bytes_max: Option<usize>) -> (Vec<(String, Vec<u32>)>, Vec<u32>) {
    let cfg = GptConfig { vocab_size: 13, context: 6, d_model: 16, n_layers: 2, n_heads: 2, dropout: 0.1, ..GptConfig::default() };
    let mut model = Gpt::new(cfg, &mut Generator::new(21)).unwrap();
    let buckets = bucket_bytes_max.map(|max| ParamBuckets::new(&mut model, max).unwrap());
    let mut opt = AdamW::with_decay_filter(model.named_parameters(), AdamWConfig { lr: 3e-3, ..AdamWConfig::default() }, AdamW::decay_matrices).unwrap();
    let mut data = Generator::new(5);
    let mut drop = Generator::new(6);
    for _ in 0..4 {
        let ids: Vec<u32> = (0..12).map(|_| data.below(13) as u32).collect();
        let x = Tensor::from_vec(ids[..].to_vec(), &[2, 6]).unwrap();
        let y = Tensor::from_vec(ids.iter().map(|&t| (t + 1) % 13).collect(), &[2, 6]).unwrap();
        match &buckets {
            Some(b) => b.zero_grad().unwrap(),
            None => opt.zero_grad().unwrap(),
        }
        model.loss(&x, &y, &mut drop).unwrap().backward().unwrap();
        let params: Vec<Tensor> = model.parameters();
        clip_grad_norm(&params, 0.5).unwrap();
        opt.step().unwrap();
    }
    let bits = |t: &Tensor| t.to_f32_vec().unwrap().into_iter().map(f32::to_bits).collect::<Vec<u32>>();
    let flat_grads = buckets.map(|b| b.buckets().iter().flat_map(|k| bits(&k.grads())).collect()).unwrap_or_default();
    (model.named_parameters().iter().map(|(n, t)| (n.clone(), bits(t))).collect(), flat_grads)
}

#[test]
fn bucketed_training_is_bit_identical() {
    // Goal: flattening changes nothing numerically. Method: train the same tied-embedding GPT
    // (dropout, clipping, AdamW with decay groups) with and without buckets; compare bits.
    let (plain, _) = train_gpt(None);
    let (bucketed, grads) = train_gpt(Some(4096));
    assert!(!grads.is_empty());
    assert_eq!(plain.len(), bucketed.len());
    for ((n, a), (m, b)) in plain.iter().zip(&bucketed) {
        assert_eq!(n, m);
        assert!(a == b, "{n} differs after bucketed training");
    }
}

#[test]
fn optimizer_state_round_trip_through_tensors() {
    // Goal: load_state restores exactly and rejects mismatches.
    let w = Tensor::from_slice(&[1.0f32, 2.0], &[2]).unwrap().requires_grad(true);
    let mut opt = AdamW::new(vec![("w".into(), w.clone())], AdamWConfig::default()).unwrap();
    w.set_grad(Some(Tensor::from_slice(&[0.5f32, -0.5], &[2]).unwrap())).unwrap();
    opt.step().unwrap();
    let state = opt.state_tensors().unwrap();
    let mut fresh = AdamW::new(vec![("w".into(), w.clone())], AdamWConfig::default()).unwrap();
    fresh.load_state(&state).unwrap();
    let again = fresh.state_tensors().unwrap();
    for ((n, a), (m, b)) in state.iter().zip(&again) {
        assert_eq!(n, m);
        assert_eq!(a.to_f64_vec().unwrap(), b.to_f64_vec().unwrap());
    }
    assert!(fresh.load_state(&state[..2]).is_err());
    let mut wrong = state.clone();
    wrong[0].1 = Tensor::zeros(&[3], DType::F32);
    assert!(fresh.load_state(&wrong).is_err());
}

// Goal: `ParamBuckets::grouped` puts each parameter in the bucket the caller names (one per
// layer here), packs each in reverse visit order, and refuses an empty bucket. Method: an MLP
// bucketed per layer; inspect the table; a grouping that skips bucket 1 is a typed error.
#[test]
fn grouped_buckets_follow_the_caller() {
    let mut model = Mlp::new(&[4, 8, 8, 3], Activation::Relu, DType::F32, &mut Generator::new(1)).unwrap();
    let before = model.named_parameters();
    let layer = |name: &str| name.split('.').nth(1).and_then(|i| i.parse::<usize>().ok()).unwrap_or(0);
    let buckets = ParamBuckets::grouped(&mut model, &layer).unwrap();
    let layout: Vec<(String, usize, usize)> = buckets.entries().iter().map(|e| (e.name.clone(), e.bucket, e.offset)).collect();
    let expect = [("layers.0.weight", 0, 8), ("layers.0.bias", 0, 0), ("layers.1.weight", 1, 8), ("layers.1.bias", 1, 0), ("layers.2.weight", 2, 3), ("layers.2.bias", 2, 0)];
    assert_eq!(layout, expect.map(|(n, b, o)| (n.to_string(), b, o)));
    assert_eq!(buckets.buckets().iter().map(|b| b.numel()).collect::<Vec<_>>(), vec![40, 72, 27]);
    for ((_, old), (_, new)) in before.iter().zip(&model.named_parameters()) {
        assert_eq!(old.to_f32_vec().unwrap(), new.to_f32_vec().unwrap());
    }
    let mut other = Mlp::new(&[4, 8, 8, 3], Activation::Relu, DType::F32, &mut Generator::new(1)).unwrap();
    let err = ParamBuckets::grouped(&mut other, &|name: &str| if layer(name) == 0 { 0 } else { 2 }).unwrap_err();
    assert!(err.to_string().contains("bucket 1 of 0..3 holds no parameter"), "{err}");
}
