//! Temporary: writes a GPT checkpoint and reference outputs for a PyTorch cross-check.
#![allow(clippy::unwrap_used)]

use rtx_tensor::checkpoint::{self, CheckpointMeta};
use rtx_tensor::nn::{patchify, Gpt, GptConfig, Linear, Module};
use rtx_tensor::optim::{AdamW, AdamWConfig, Optimizer};
use rtx_tensor::{DType, Generator, Tensor};
use std::path::Path;

#[test]
fn write_fixture() {
    let Ok(dir) = std::env::var("RTX_TORCH_FIXTURE_DIR") else { return };
    let dir = Path::new(&dir);
    let cfg = GptConfig { vocab_size: 17, context: 8, d_model: 32, n_layers: 2, n_heads: 4, dropout: 0.0, ..GptConfig::default() };
    let model = Gpt::new(cfg, &mut Generator::new(3)).unwrap();
    let mut opt = AdamW::with_decay_filter(model.named_parameters(), AdamWConfig { lr: 1e-2, ..AdamWConfig::default() }, AdamW::decay_matrices).unwrap();
    let mut rng = Generator::new(4);
    let ids: Vec<u32> = (0..14).map(|_| rng.below(17) as u32).collect();
    let x = Tensor::from_vec(ids.clone(), &[2, 7]).unwrap();
    let y = Tensor::from_vec(ids.iter().map(|&t| (t + 1) % 17).collect(), &[2, 7]).unwrap();
    // One step so the weights are not the init and the optimizer has state.
    opt.zero_grad().unwrap();
    model.loss(&x, &y, &mut rng).unwrap().backward().unwrap();
    opt.step().unwrap();
    checkpoint::save(&dir.join("gpt.safetensors"), &model, Some(&opt), &CheckpointMeta::default()).unwrap();
    let logits = model.forward(&x, &mut rng).unwrap();
    let loss = model.loss(&x, &y, &mut rng).unwrap();
    // Gradients of the next step, to compare backward too.
    opt.zero_grad().unwrap();
    loss.backward().unwrap();
    let mut out: Vec<(String, Tensor)> = vec![("ids".into(), x.clone()), ("targets".into(), y.clone()), ("logits".into(), logits), ("loss".into(), loss.detach())];
    for (n, p) in model.named_parameters() {
        out.push((format!("grad.{n}"), p.grad().unwrap()));
    }
    // Patch embedding against a Conv2d.
    let mut g = Generator::new(5);
    let images = Tensor::randn(&[2, 3, 8, 8], 0.0, 1.0, DType::F32, &mut g).unwrap();
    let lin = Linear::new(3 * 16, 6, true, DType::F32, &mut g).unwrap();
    let emb = lin.forward(&patchify(&images, 4).unwrap()).unwrap();
    out.push(("patch.images".into(), images));
    out.push(("patch.weight".into(), lin.weight.clone()));
    out.push(("patch.bias".into(), lin.bias.clone().unwrap()));
    out.push(("patch.out".into(), emb));
    checkpoint::save_tensors(&dir.join("expected.safetensors"), &out, &Default::default()).unwrap();
}

#[test]
fn compare_optimizers_with_torch() {
    let Ok(dir) = std::env::var("RTX_TORCH_FIXTURE_DIR") else { return };
    let (tensors, _) = checkpoint::load_tensors(&Path::new(&dir).join("torch_ref.safetensors")).unwrap();
    let get = |n: &str| tensors.iter().find(|(k, _)| k == n).unwrap().1.clone();
    let p0 = get("big.p0");
    let grads: Vec<Tensor> = (1..=3).map(|i| get(&format!("big.g{i}"))).collect();
    use rtx_tensor::optim::{Sgd, SgdConfig};
    let makers: Vec<(&str, Box<dyn Fn(Tensor) -> Box<dyn Optimizer>>)> = vec![
        ("adamw_big", Box::new(|p| Box::new(AdamW::new(vec![("p".into(), p)], AdamWConfig { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }).unwrap()))),
        ("sgd_big", Box::new(|p| Box::new(Sgd::new(vec![("p".into(), p)], SgdConfig { lr: 0.05, momentum: 0.9, dampening: 0.2, weight_decay: 0.01, nesterov: false }).unwrap()))),
        ("nesterov_big", Box::new(|p| Box::new(Sgd::new(vec![("p".into(), p)], SgdConfig { lr: 0.05, momentum: 0.9, dampening: 0.0, weight_decay: 0.01, nesterov: true }).unwrap()))),
    ];
    for (name, make) in makers {
        let p = Tensor::from_vec(p0.to_f32_vec().unwrap(), &[1000]).unwrap().requires_grad(true);
        let mut opt = make(p.clone());
        for (i, g) in grads.iter().enumerate() {
            p.set_grad(Some(g.detach())).unwrap();
            opt.step().unwrap();
            let want = get(&format!("{name}.torch.float32.step{}", i + 1)).to_f32_vec().unwrap();
            let got = p.to_f32_vec().unwrap();
            let ulps: Vec<i64> = got.iter().zip(&want).map(|(a, b)| (a.to_bits() as i64 - b.to_bits() as i64).abs()).collect();
            let exact = ulps.iter().filter(|&&u| u == 0).count();
            println!("{name} step {}: exact {exact}/1000, max ulps {}", i + 1, ulps.iter().max().unwrap());
        }
    }
    for dt in ["float32", "float64"] {
        for step in [1, 2] {
            println!("adamw_small {dt} step{step}: {:?}", get(&format!("adamw_small.torch.{dt}.step{step}")).to_f64_vec().unwrap());
        }
    }
    println!("clip total {:?} g0 {:?} g1 {:?}", get("clip.total").to_f64_vec().unwrap(), get("clip.g0").to_f32_vec().unwrap(), get("clip.g1").to_f32_vec().unwrap());
}

#[test]
fn sgd_fma_hypothesis() {
    let Ok(dir) = std::env::var("RTX_TORCH_FIXTURE_DIR") else { return };
    let (tensors, _) = checkpoint::load_tensors(&Path::new(&dir).join("torch_ref.safetensors")).unwrap();
    let get = |n: &str| tensors.iter().find(|(k, _)| k == n).unwrap().1.to_f32_vec().unwrap();
    let fma = |a: f32, b: f32, c: f32| ((a as f64) * (b as f64) + c as f64) as f32;
    let mut p = get("big.p0");
    let mut buf = vec![0f32; 1000];
    for s in 0..3 {
        let g = get(&format!("big.g{}", s + 1));
        for i in 0..1000 {
            let d = fma(p[i], 0.01f64 as f32, g[i]);
            buf[i] = if s == 0 { d } else { fma(d, (1.0f64 - 0.2) as f32, buf[i] * 0.9f32) };
            p[i] = fma(buf[i], -0.05f64 as f32, p[i]);
        }
        let want = get(&format!("sgd_big.torch.float32.step{}", s + 1));
        println!("fma-emulated sgd step {}: exact {}/1000", s + 1, p.iter().zip(&want).filter(|(a, b)| a.to_bits() == b.to_bits()).count());
    }
}

#[test]
fn adamw_fma_hypothesis() {
    let Ok(dir) = std::env::var("RTX_TORCH_FIXTURE_DIR") else { return };
    let (tensors, _) = checkpoint::load_tensors(&Path::new(&dir).join("torch_ref.safetensors")).unwrap();
    let get = |n: &str| tensors.iter().find(|(k, _)| k == n).unwrap().1.to_f32_vec().unwrap();
    let fma = |a: f32, b: f32, c: f32| ((a as f64) * (b as f64) + c as f64) as f32;
    for variant in 0..4 {
        let mut p = get("big.p0");
        let (mut m, mut v) = (vec![0f32; 1000], vec![0f32; 1000]);
        let (lr, b1, b2, eps, wd) = (0.01f64, 0.9f64, 0.999f64, 1e-8f64, 0.01f64);
        let mut res = vec![];
        for s in 0..3 {
            let g = get(&format!("big.g{}", s + 1));
            let step = (s + 1) as f64;
            let bc1 = 1.0 - b1.powf(step);
            let bc2s = (1.0 - b2.powf(step)).sqrt() as f32;
            let nss = (-(lr / bc1)) as f32;
            let w = (1.0 - b1) as f32;
            for i in 0..1000 {
                p[i] *= (1.0 - lr * wd) as f32;
                m[i] = fma(w, g[i] - m[i], m[i]);
                v[i] = match variant & 1 { 0 => v[i] * b2 as f32 + ((1.0 - b2) as f32 * g[i]) * g[i], _ => fma((1.0 - b2) as f32 * g[i], g[i], v[i] * b2 as f32) };
                let denom = v[i].sqrt() / bc2s + eps as f32;
                p[i] = match variant & 2 { 0 => p[i] + nss * m[i] / denom, _ => fma(nss * m[i], 1.0 / denom, p[i]) };
            }
            let want = get(&format!("adamw_big.torch.float32.step{}", s + 1));
            res.push(p.iter().zip(&want).filter(|(a, b)| a.to_bits() == b.to_bits()).count());
        }
        println!("adamw variant {variant}: exact {res:?}");
    }
}
