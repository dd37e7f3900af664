//! GPU tensors end to end, on a CUDA machine (`scripts/gpu-check.sh` runs every mode):
//!
//! - `ops`: each tensor op GPT training uses (linear, layer norm, GELU, broadcast add, embedding,
//!   packed causal attention, cross-entropy), forward and backward on the GPU against the CPU op
//!   on fresh random inputs, in f32 (tolerance 1e-5, normwise relative: `max|gpu − cpu| /
//!   max|cpu|`) and bf16 (1e-2, against the CPU op on the same bf16-rounded inputs).
//! - `optim`: the [`MixedAdamW`] state round trip: a few steps, `state_tensors`, `load_state` into
//!   a fresh optimizer over a differently initialised model, then one more step of both on the
//!   same gradients; parameters and state must be bit-identical.
//! - `curve`: a small GPT trained 300 steps on the State of the Union bytes from one seed on the
//!   CPU (f32), the GPU in f32, and the GPU in mixed precision (bf16 with f32 master weights);
//!   the loss curves must match (10-step window means within 1% for f32, 5% for bf16: bf16
//!   rounding moves the trajectory, most while the loss falls fastest).
//! - `curve-bpe`: the same three-way check on GPT-2's BPE vocabulary (50,257 tokens padded to
//!   50,304, the head fused with the loss) for a reduced-width twin (2 layers, C 64, one head of 64, T 64, B 8),
//!   then GPT-2 124M itself trained 300 steps on the GPU in bf16 (its curve printed), and a
//!   sample generated from it decoded through the tokenizer.
//! - `bench`: GPT-2 124M (12 layers, C 768, 12 heads, context 1024, the BPE vocabulary padded to
//!   50,304 with the tied head, batch 16, bf16, AdamW) training steps on the State of the Union
//!   token ids: median step time, tokens/s and MFU against the H200's 989 TFLOP/s dense bf16
//!   peak, printed as one `RESULT` line for the comparison table. `bench-bytes` is the same model
//!   with the byte vocabulary 256 (the earlier benchmark).
//!
//! - `profile`: where the bench step's time goes: forward, backward and optimizer phases, and
//!   each op at the model's shapes (forward, forward + backward), timed on the device.
//!
//! Usage: `gpt_gpu [ops|optim|curve|curve-bpe|bench|bench-bytes|profile|all]`; data from
//! `$RTX_DATA` (default `data`; the token ids are cached in `sotu/gpt2-tokens.bin` there), seed from
//! `$RTX_SEED` (printed). Exits non-zero when a check fails.

use std::error::Error;
use std::path::PathBuf;
use std::time::Instant;

use rtx_tensor::cuda::{self, MixedAdamW};
use rtx_tensor::data::{tokenize_corpus_cached, Gpt2Tokenizer, TextCorpus, GPT2_VOCAB};
use rtx_tensor::nn::{Gpt, GptConfig, Module};
use rtx_tensor::optim::{AdamW, AdamWConfig};
use rtx_tensor::{CrossEntropyOptions, DType, Device, Generator, Optimizer, Tensor};

type Res<T> = std::result::Result<T, Box<dyn Error>>;

const GPU: Device = Device::Cuda(0);
/// Dense bf16 tensor-core peak of an H200 (SXM), FLOP/s.
const PEAK_BF16: f64 = 989e12;

fn main() {
    let mode = std::env::args().nth(1).unwrap_or_else(|| "all".into());
    let seed = std::env::var("RTX_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(20261201u64);
    println!("gpt_gpu {mode} seed={seed} (replay with RTX_SEED={seed})");
    let run = || -> Res<bool> {
        let dev = cuda::device(0)?;
        dev.warm_up()?;
        println!("device: {} ", dev.name());
        let mut ok = true;
        if mode == "ops" || mode == "all" {
            ok &= ops(seed)?;
        }
        if mode == "optim" || mode == "all" {
            ok &= optim_round_trip(seed)?;
        }
        if mode == "curve" || mode == "all" {
            ok &= curve(seed, &bytes_as_ids(&corpus()?), BYTE_TWIN, "bytes")?;
        }
        if mode == "curve-bpe" || mode == "all" {
            ok &= curve(seed, &gpt2_ids()?, BPE_TWIN, "gpt2 bpe")?;
            train_124m(seed, &gpt2_ids()?)?;
        }
        if mode == "bench" || mode == "all" {
            // `GPT_GPU_FORMS=128/128,64/64/cached` times the step once per listed form of the
            // kernels (attention forward query rows / backward keys per block, and `cached` for
            // the classifier's shared-memory row cache: an A/B in one process); unset: the
            // defaults only.
            match std::env::var("GPT_GPU_FORMS") {
                Ok(list) => {
                    for form in list.split(',') {
                        let parts: Vec<&str> = form.split('/').map(str::trim).collect();
                        let [rows, keys, rest @ ..] = parts.as_slice() else { return Err("GPT_GPU_FORMS: forms are ROWS/KEYS[/cached]".into()) };
                        dev.set_flash_forward_bf16_rows(rows.parse()?);
                        dev.set_flash_backward_bf16_keys(keys.parse()?);
                        dev.set_fused_classifier_regs(rest.first() != Some(&"cached"));
                        bench(seed, &gpt2_ids()?, gpt2_124m(GPT2_VOCAB, 128), &format!("rustytorch-{}", parts.join("-")))?;
                    }
                    dev.set_flash_forward_bf16_rows(0);
                    dev.set_flash_backward_bf16_keys(0);
                    dev.set_fused_classifier_regs(true);
                }
                Err(_) => bench(seed, &gpt2_ids()?, gpt2_124m(GPT2_VOCAB, 128), "rustytorch")?,
            }
        }
        if mode == "bench-bytes" || mode == "all" {
            bench(seed, &bytes_as_ids(&corpus()?), gpt2_124m(256, 1), "rustytorch-bytes")?;
        }
        if mode == "profile" || mode == "all" {
            profile(seed, &gpt2_ids()?)?;
        }
        Ok(ok)
    };
    match run() {
        Ok(true) => println!("gpt_gpu: all checks passed"),
        Ok(false) => {
            println!("gpt_gpu: CHECKS FAILED (replay with RTX_SEED={seed})");
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("gpt_gpu: error: {e}");
            std::process::exit(2);
        }
    }
}

fn sotu_dir() -> PathBuf {
    PathBuf::from(std::env::var("RTX_DATA").unwrap_or_else(|_| "data".into())).join("sotu")
}

fn corpus() -> Res<TextCorpus> {
    let dir = sotu_dir();
    Ok(TextCorpus::load_dir(&dir).map_err(|e| format!("{}: {e} (run scripts/fetch-data.sh)", dir.display()))?)
}

/// The corpus's bytes as token ids (the byte vocabulary).
fn bytes_as_ids(corpus: &TextCorpus) -> Vec<u32> {
    corpus.bytes().iter().map(|&b| u32::from(b)).collect()
}

/// The corpus as GPT-2 BPE token ids, cached in `sotu/gpt2-tokens.bin`.
fn gpt2_ids() -> Res<Vec<u32>> {
    let corpus = corpus()?;
    let start = Instant::now();
    let ids = tokenize_corpus_cached(&corpus, &sotu_dir().join("gpt2-tokens.bin"))?;
    println!(
        "gpt2 token ids: {} bytes -> {} tokens ({:.2} bytes/token) in {:.1} s",
        corpus.len(),
        ids.len(),
        corpus.len() as f64 / ids.len() as f64,
        start.elapsed().as_secs_f64()
    );
    Ok(ids)
}

/// GPT-2 124M's shape with vocabulary `vocab` padded to a multiple of `pad`.
fn gpt2_124m(vocab: usize, pad: usize) -> GptConfig {
    GptConfig { vocab_size: vocab, vocab_pad_multiple: pad, context: 1024, d_model: 768, n_layers: 12, n_heads: 12, ..GptConfig::default() }
}

/// The curve check's model on bytes.
const BYTE_TWIN: Twin = Twin { vocab: 256, pad: 1, context: 128, d_model: 128, layers: 2, heads: 2, batch: 8, f32_tolerance: 0.01 };
/// The reduced-width twin of `configs/gpt2_124m.toml` on GPT-2's BPE vocabulary.
///
/// Its GPU f32 curve is held to 3%, not 1%: the first-step gradients agree to ~1e-6 (checked
/// first, tolerance 1e-4), but over 300 AdamW steps the rounding differences of a 50,304-row
/// tied embedding grow: on the H200 two GPU f32 runs alone (the embedding gradient adds with
/// atomics) ended 0.25% apart, and GPU f32 against CPU f32 stayed within 1.9% (2026-12-03).
const BPE_TWIN: Twin = Twin { vocab: GPT2_VOCAB, pad: 128, context: 64, d_model: 64, layers: 2, heads: 1, batch: 8, f32_tolerance: 0.03 };

/// A small GPT for the curve checks.
#[derive(Clone, Copy)]
struct Twin {
    vocab: usize,
    pad: usize,
    context: usize,
    d_model: usize,
    layers: usize,
    heads: usize,
    batch: usize,
    /// Worst 10-step-window relative difference allowed between the GPU f32 and CPU f32 curves.
    f32_tolerance: f64,
}

// ------------------------------------------------------------------------------------- ops

/// Normwise relative error `max|a − b| / max|b|`.
fn rel_err(a: &Tensor, b: &Tensor) -> Res<f64> {
    let (a, b) = (a.to_f64_vec()?, b.to_f64_vec()?);
    if a.len() != b.len() {
        return Err(format!("length {} vs {}", a.len(), b.len()).into());
    }
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-30);
    let err = a.iter().zip(&b).fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
    Ok(if a.iter().all(|v| v.is_finite()) { err / scale } else { f64::INFINITY })
}

/// Random values in [-1, 1) (never exactly zero) of `shape`.
fn random(shape: &[usize], rng: &mut Generator) -> Res<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| ((rng.uniform() * 2.0 - 1.0) as f32).max(-1.0)).map(|x| if x == 0.0 { 1e-3 } else { x }).collect();
    Ok(Tensor::from_vec(v, shape)?)
}

/// An op under test: inputs (float leaves) and extra index inputs → output.
type OpFn = fn(&[Tensor], &[Tensor]) -> rtx_tensor::Result<Tensor>;

struct OpCase {
    name: &'static str,
    inputs: Vec<Vec<usize>>,
    ids: Vec<(Vec<usize>, u64)>,
    scalar_out: bool,
    f: OpFn,
}

fn cases() -> Vec<OpCase> {
    vec![
        OpCase {
            name: "linear+bias",
            inputs: vec![vec![64, 96], vec![192, 96], vec![192]],
            ids: vec![],
            scalar_out: false,
            f: |x, _| x[0].linear(&x[1], Some(&x[2])),
        },
        OpCase { name: "linear", inputs: vec![vec![2, 32, 128], vec![64, 128]], ids: vec![], scalar_out: false, f: |x, _| x[0].linear(&x[1], None) },
        OpCase {
            name: "layer_norm",
            inputs: vec![vec![48, 200], vec![200], vec![200]],
            ids: vec![],
            scalar_out: false,
            f: |x, _| x[0].layer_norm(Some(&x[1]), Some(&x[2]), 1e-5),
        },
        // The residual add fused with the layer norm after it, and the norm's backward adding
        // the sum's other gradient (`y + s` gives `s` two consumers): at GPT-2's width (3 words
        // per lane, 300 rows over 5 blocks of the parameter partials, the last one partial), at
        // 1024 (4 words) with the plain norm on a non-leaf input, broadcast at 256 (1 word), and
        // at 200 (not 8-wide: the unfused kernels and an add).
        OpCase {
            name: "add+layer_norm 768",
            inputs: vec![vec![3, 100, 768], vec![3, 100, 768], vec![768], vec![768]],
            ids: vec![],
            scalar_out: false,
            f: |x, _| {
                let (s, y) = x[0].add_layer_norm(&x[1], Some(&x[2]), Some(&x[3]), 1e-5)?;
                y.add(&s)
            },
        },
        OpCase {
            name: "layer_norm+residual 1024",
            inputs: vec![vec![2, 50, 1024], vec![2, 50, 1024], vec![1024], vec![1024]],
            ids: vec![],
            scalar_out: false,
            f: |x, _| {
                let s = x[0].add(&x[1])?;
                s.layer_norm(Some(&x[2]), Some(&x[3]), 1e-5)?.add(&s)
            },
        },
        OpCase {
            name: "add+layer_norm bcast 256",
            inputs: vec![vec![4, 24, 256], vec![24, 256], vec![256], vec![256]],
            ids: vec![],
            scalar_out: false,
            f: |x, _| {
                let (s, y) = x[0].add_layer_norm(&x[1], Some(&x[2]), Some(&x[3]), 1e-5)?;
                y.add(&s)
            },
        },
        OpCase {
            name: "add+layer_norm 200",
            inputs: vec![vec![48, 200], vec![48, 200], vec![200], vec![200]],
            ids: vec![],
            scalar_out: false,
            f: |x, _| {
                let (s, y) = x[0].add_layer_norm(&x[1], Some(&x[2]), Some(&x[3]), 1e-5)?;
                y.add(&s)
            },
        },
        // The feed-forward as one op: in bf16 the GELU, its derivative and the first bias's
        // gradient run in cuBLASLt epilogues (f32 runs the three ops).
        OpCase {
            name: "linear+gelu+linear",
            inputs: vec![vec![2, 40, 96], vec![384, 96], vec![384], vec![96, 384], vec![96]],
            ids: vec![],
            scalar_out: false,
            f: |x, _| x[0].linear_gelu_linear(&x[1], &x[2], &x[3], &x[4]),
        },
        OpCase { name: "gelu", inputs: vec![vec![37, 129]], ids: vec![], scalar_out: false, f: |x, _| x[0].gelu() },
        OpCase { name: "gelu (tanh)", inputs: vec![vec![37, 129]], ids: vec![], scalar_out: false, f: |x, _| x[0].gelu_with(rtx_tensor::GeluApprox::Tanh) },
        OpCase {
            name: "layer_norm (8-wide)",
            inputs: vec![vec![40, 256], vec![256], vec![256]],
            ids: vec![],
            scalar_out: false,
            f: |x, _| x[0].layer_norm(Some(&x[1]), Some(&x[2]), 1e-5),
        },
        OpCase { name: "gelu (8-wide)", inputs: vec![vec![16, 256]], ids: vec![], scalar_out: false, f: |x, _| x[0].gelu() },
        OpCase {
            name: "gelu (tanh, 8-wide)",
            inputs: vec![vec![16, 256]],
            ids: vec![],
            scalar_out: false,
            f: |x, _| x[0].gelu_with(rtx_tensor::GeluApprox::Tanh),
        },
        OpCase { name: "add (same)", inputs: vec![vec![5, 77], vec![5, 77]], ids: vec![], scalar_out: false, f: |x, _| x[0].add(&x[1]) },
        OpCase { name: "add (same, 8-wide)", inputs: vec![vec![8, 64], vec![8, 64]], ids: vec![], scalar_out: false, f: |x, _| x[0].add(&x[1]) },
        OpCase { name: "add (broadcast)", inputs: vec![vec![4, 16, 32], vec![16, 32]], ids: vec![], scalar_out: false, f: |x, _| x[0].add(&x[1]) },
        OpCase { name: "embedding", inputs: vec![vec![50, 64]], ids: vec![(vec![3, 40], 50)], scalar_out: false, f: |x, i| Tensor::embedding(&x[0], &i[0]) },
        OpCase {
            name: "attention d64 causal",
            inputs: vec![vec![2, 96, 3 * 128]],
            ids: vec![],
            scalar_out: false,
            f: |x, _| Tensor::scaled_dot_product_attention_packed(&x[0], 2, true, None),
        },
        OpCase {
            name: "attention d128 causal",
            inputs: vec![vec![1, 130, 3 * 256]],
            ids: vec![],
            scalar_out: false,
            f: |x, _| Tensor::scaled_dot_product_attention_packed(&x[0], 2, true, None),
        },
        OpCase {
            name: "cross_entropy",
            inputs: vec![vec![64, 50]],
            ids: vec![(vec![64], 50)],
            scalar_out: true,
            f: |x, i| x[0].cross_entropy(&i[0], CrossEntropyOptions::default()),
        },
        // The fused head + loss: 300 rows in chunks of 128 (the last one partial), 130 classes
        // of a 136-row (padded) weight; mean and sum. The hidden states are scaled so the logits
        // have a language model's magnitudes (std ~0.7, not ~5): in bf16 the logits themselves
        // are rounded (as under torch's autocast), which moves each probability by about
        // |logit|·2⁻⁸, and that would dominate the comparison for logits of 10.
        OpCase {
            name: "linear_cross_entropy",
            inputs: vec![vec![300, 64], vec![136, 64]],
            ids: vec![(vec![300], 130)],
            scalar_out: true,
            f: |x, i| x[0].mul_scalar(0.25)?.linear_cross_entropy_valid(&x[1], &i[0], 130, CrossEntropyOptions::default(), 128),
        },
        OpCase {
            name: "linear_cross_entropy sum",
            inputs: vec![vec![200, 96], vec![256, 96]],
            ids: vec![(vec![200], 250)],
            scalar_out: true,
            f: |x, i| {
                x[0].mul_scalar(0.25)?.linear_cross_entropy_valid(
                    &x[1],
                    &i[0],
                    250,
                    CrossEntropyOptions { reduction: rtx_tensor::Reduction::Sum, ..CrossEntropyOptions::default() },
                    64,
                )
            },
        },
    ]
}

/// Runs one case on `device` in `dtype`; returns the output and the input gradients (f32, host).
fn run_case(case: &OpCase, host_inputs: &[Tensor], ids: &[Tensor], grad_out: Option<&Tensor>, device: Device, dtype: DType) -> Res<(Tensor, Vec<Tensor>)> {
    let inputs: Vec<Tensor> = host_inputs.iter().map(|t| Ok(t.to_dtype(dtype)?.to_device(device)?.requires_grad(true))).collect::<Res<_>>()?;
    let y = (case.f)(&inputs, ids)?;
    match grad_out {
        Some(g) => y.backward_from(g.to_dtype(y.dtype())?.to_device(device)?, |_| {})?,
        None => y.backward()?,
    }
    let grads = inputs.iter().map(|t| Ok(t.grad().ok_or("no gradient")?.to_device(Device::Cpu)?.to_dtype(DType::F32)?)).collect::<Res<_>>()?;
    Ok((y.to_device(Device::Cpu)?.to_dtype(DType::F32)?, grads))
}

fn ops(seed: u64) -> Res<bool> {
    let mut rng = Generator::new(seed);
    let mut ok = true;
    println!("{:<24} {:>6} {:>12} {:>12}  tol", "op", "dtype", "forward", "backward");
    for case in cases() {
        let host: Vec<Tensor> = case.inputs.iter().map(|s| random(s, &mut rng)).collect::<Res<_>>()?;
        let ids: Vec<Tensor> = case
            .ids
            .iter()
            .map(|(s, bound)| Ok(Tensor::from_vec((0..s.iter().product::<usize>()).map(|_| rng.below(*bound) as u32).collect::<Vec<u32>>(), s)?))
            .collect::<Res<_>>()?;
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
            // The reference sees the same (rounded) inputs as the GPU.
            let rounded: Vec<Tensor> = host.iter().map(|t| Ok(t.to_dtype(dtype)?.to_dtype(DType::F32)?)).collect::<Res<_>>()?;
            let out_shape = (case.f)(&rounded, &ids)?.shape().to_vec();
            let grad_out = if case.scalar_out { None } else { Some(random(&out_shape, &mut rng)?.to_dtype(dtype)?.to_dtype(DType::F32)?) };
            let (y_ref, g_ref) = run_case(&case, &rounded, &ids, grad_out.as_ref(), Device::Cpu, DType::F32)?;
            let (y_gpu, g_gpu) = run_case(&case, &rounded, &ids, grad_out.as_ref(), GPU, dtype)?;
            let fwd = rel_err(&y_gpu, &y_ref)?;
            let mut bwd = 0.0f64;
            for (a, b) in g_gpu.iter().zip(&g_ref) {
                bwd = bwd.max(rel_err(a, b)?);
            }
            let pass = fwd <= tol && bwd <= tol;
            ok &= pass;
            println!("{:<24} {:>6} {:>12.3e} {:>12.3e}  {:.0e} {}", case.name, dtype.to_string(), fwd, bwd, tol, if pass { "ok" } else { "FAIL" });
        }
    }
    // A target in the padding is a typed error.
    let (h, w) = (random(&[4, 8], &mut rng)?.to_device(GPU)?, random(&[16, 8], &mut rng)?.to_device(GPU)?);
    match h.linear_cross_entropy_valid(&w, &Tensor::from_vec(vec![1u32, 2, 12, 3], &[4])?, 12, CrossEntropyOptions::default(), 2) {
        Err(e) => println!("linear_cross_entropy with target 12 of 12 classes: refused ({e})"),
        Ok(_) => {
            println!("linear_cross_entropy with a target in the padding was accepted: FAIL");
            ok = false;
        }
    }
    // A bad index is a typed error, not a device fault.
    let table = random(&[10, 8], &mut rng)?.to_device(GPU)?;
    match Tensor::embedding(&table, &Tensor::from_vec(vec![3u32, 10], &[2])?) {
        Err(e) => println!("embedding with id 10 of 10 rows: refused ({e})"),
        Ok(_) => {
            println!("embedding with an out-of-range id was accepted: FAIL");
            ok = false;
        }
    }
    // The replica checksum hashed on the device equals the host's definition, bit for bit, for
    // every storage dtype, lengths around the chunk size, and a strided view.
    let chunk = rtx_tensor::CHECKSUM_CHUNK;
    for n in [1, chunk - 1, chunk, 8 * chunk + 3, 38_633_472] {
        let host = random(&[n], &mut rng)?;
        for t in [host.clone(), host.to_dtype(DType::BF16)?] {
            let (h, d) = (t.bits_checksum()?, t.to_device(GPU)?.bits_checksum()?);
            let pass = h == d;
            ok &= pass;
            println!("bits_checksum {:>6} n={n:<9} host {h:016x} device {d:016x} {}", t.dtype().to_string(), if pass { "ok" } else { "FAIL" });
        }
    }
    let ids = Tensor::from_vec((0..10_000u32).map(|i| i.wrapping_mul(2_654_435_761)).collect::<Vec<u32>>(), &[100, 100])?;
    let m = random(&[96, 80], &mut rng)?;
    for (name, t) in [("u32", ids.clone()), ("f32 transposed", m.transpose(0, 1)?)] {
        let d = match name {
            "u32" => ids.to_device(GPU)?.bits_checksum()?,
            _ => m.to_device(GPU)?.transpose(0, 1)?.bits_checksum()?,
        };
        let pass = t.bits_checksum()? == d;
        ok &= pass;
        println!("bits_checksum {name}: {}", if pass { "ok" } else { "FAIL" });
    }
    // Its cost on GPT-2 124M's parameters in bf16 (what a verified step pays).
    let mut model = Gpt::new(gpt2_124m(GPT2_VOCAB, 128), &mut Generator::new(seed))?;
    cuda::move_module(&mut model, 0, DType::BF16)?;
    let params = model.named_parameters();
    let tensors: Vec<Tensor> = params.iter().map(|(_, p)| p.clone()).collect();
    let ms = time_ms(5, || {
        rtx_tensor::bits_checksums(&tensors)?;
        Ok(())
    })?;
    // The batched form equals the one-by-one digests.
    let one_by_one = tensors.iter().map(Tensor::bits_checksum).collect::<Result<Vec<u64>, _>>()?;
    let pass = rtx_tensor::bits_checksums(&tensors)? == one_by_one;
    ok &= pass;
    println!("bits_checksums of a model = its tensors' bits_checksum one by one: {}", if pass { "ok" } else { "FAIL" });
    let host_ms = time_ms(1, || {
        for (_, p) in &params {
            p.to_f32_vec()?;
        }
        Ok(())
    })?;
    println!("bits_checksum of GPT-2 124M's bf16 parameters on the device: {ms:.2} ms (copying them to the host as f32 alone: {host_ms:.1} ms)");
    Ok(ok)
}

// ---------------------------------------------------------------------- optimizer state

/// The bits of every parameter (as f32, exact for bf16) of `model`.
fn param_bits(model: &Gpt) -> Res<Vec<Vec<u32>>> {
    model
        .named_parameters()
        .iter()
        .map(|(_, p)| Ok(p.to_device(Device::Cpu)?.to_dtype(DType::F32)?.to_f32_vec()?.iter().map(|v| v.to_bits()).collect()))
        .collect()
}

/// The bits of every state tensor of `opt` (as f32), by name.
fn state_bits(opt: &dyn Optimizer) -> Res<Vec<(String, Vec<u32>)>> {
    opt.state_tensors()?.into_iter().map(|(n, t)| Ok((n, t.to_dtype(DType::F32)?.to_f32_vec()?.iter().map(|v| v.to_bits()).collect()))).collect()
}

/// [`MixedAdamW`] save → load → step: a bf16 model takes three steps on random gradients, its
/// optimizer state goes into a fresh optimizer over a differently initialised model, then both
/// take one more step on the same gradients. Parameters must match bit for bit after the load
/// (the parameter is the master rounded) and after the step, and so must the states.
fn optim_round_trip(seed: u64) -> Res<bool> {
    let config = GptConfig { vocab_size: 256, context: 64, d_model: 128, n_layers: 2, n_heads: 2, ..GptConfig::default() };
    let adamw = AdamWConfig { lr: 1e-3, weight_decay: 0.1, ..AdamWConfig::default() };
    let mut rng = Generator::new(seed ^ 0x0971);
    let mut grads = |model: &Gpt| -> Res<Vec<Tensor>> {
        model.named_parameters().iter().map(|(_, p)| Ok(random(p.shape(), &mut rng)?.to_dtype(DType::BF16)?.to_device(GPU)?)).collect()
    };
    let set = |model: &Gpt, g: &[Tensor]| -> Res<()> {
        for ((_, p), g) in model.named_parameters().iter().zip(g) {
            p.set_grad(Some(g.clone()))?;
        }
        Ok(())
    };
    let mut a = Trainer::new(config, seed, GPU, DType::BF16, adamw)?;
    for _ in 0..3 {
        let g = grads(&a.model)?;
        set(&a.model, &g)?;
        a.opt.step()?;
    }
    let saved = a.opt.state_tensors()?;
    let mut b = Trainer::new(config, seed ^ 0xfeed, GPU, DType::BF16, adamw)?;
    let differed = param_bits(&a.model)? != param_bits(&b.model)?;
    b.opt.load_state(&saved)?;
    let after_load = param_bits(&a.model)? == param_bits(&b.model)?;
    let g = grads(&a.model)?;
    set(&a.model, &g)?;
    set(&b.model, &g)?;
    a.opt.step()?;
    b.opt.step()?;
    let after_step = param_bits(&a.model)? == param_bits(&b.model)?;
    let states = state_bits(a.opt.as_ref())? == state_bits(b.opt.as_ref())?;
    let ok = differed && after_load && after_step && states;
    println!(
        "optim MixedAdamW save/load round trip: models differed before load {differed}, params bit-identical after load {after_load}, after one more step {after_step}, states bit-identical {states}: {}",
        if ok { "ok" } else { "FAIL" }
    );
    Ok(ok)
}

// ------------------------------------------------------------------------------- training

/// A batch of `b` windows of `t + 1` token ids at seeded offsets: inputs and next-token targets.
fn batch(ids: &[u32], b: usize, t: usize, rng: &mut Generator) -> Res<(Tensor, Tensor)> {
    let mut x = Vec::with_capacity(b * t);
    let mut y = Vec::with_capacity(b * t);
    for _ in 0..b {
        let start = rng.below((ids.len() - t - 1) as u64) as usize;
        x.extend_from_slice(&ids[start..start + t]);
        y.extend_from_slice(&ids[start + 1..start + t + 1]);
    }
    Ok((Tensor::from_vec(x, &[b, t])?, Tensor::from_vec(y, &[b, t])?))
}

/// A model and optimizer on one device in one precision.
struct Trainer {
    model: Gpt,
    opt: Box<dyn Optimizer>,
    device: Device,
}

impl Trainer {
    fn new(config: GptConfig, seed: u64, device: Device, dtype: DType, adamw: AdamWConfig) -> Res<Trainer> {
        let mut model = Gpt::new(config, &mut Generator::new(seed))?;
        let opt: Box<dyn Optimizer> = match device {
            Device::Cpu => Box::new(AdamW::with_decay_filter(model.named_parameters(), adamw, AdamW::decay_matrices)?),
            Device::Cuda(i) => {
                let masters = cuda::move_module(&mut model, i, dtype)?;
                Box::new(MixedAdamW::new(model.named_parameters(), Some(&masters), adamw, AdamW::decay_matrices)?)
            }
        };
        Ok(Trainer { model, opt, device })
    }

    /// One step; returns the loss tensor (on the device: reading it waits for the step).
    fn step(&mut self, x: &Tensor, y: &Tensor) -> Res<Tensor> {
        for (_, p) in self.model.named_parameters() {
            p.set_grad(None)?;
        }
        let mut rng = Generator::new(0);
        let (x, y) = match self.device {
            Device::Cpu => (x.clone(), y.clone()),
            d => (x.to_device(d)?, y.to_device(d)?),
        };
        let loss = self.model.loss(&x, &y, &mut rng)?;
        loss.backward()?;
        self.opt.step()?;
        Ok(loss)
    }
}

fn curve(seed: u64, ids: &[u32], twin: Twin, label: &str) -> Res<bool> {
    let config = GptConfig {
        vocab_size: twin.vocab,
        vocab_pad_multiple: twin.pad,
        context: twin.context,
        d_model: twin.d_model,
        n_layers: twin.layers,
        n_heads: twin.heads,
        ..GptConfig::default()
    };
    let adamw = AdamWConfig { lr: 1e-3, weight_decay: 0.1, ..AdamWConfig::default() };
    let (b, t, steps, window) = (twin.batch, twin.context, 300, 10);
    println!(
        "curve ({label}): vocabulary {} (padded {}), {} layers, C {}, T {t}, B {b}, {steps} AdamW steps",
        config.vocab_size,
        config.padded_vocab(),
        config.n_layers,
        config.d_model
    );
    let runs = [("cpu f32", Device::Cpu, DType::F32), ("gpu f32", GPU, DType::F32), ("gpu bf16", GPU, DType::BF16)];
    // The whole model's first gradient, GPU f32 against CPU f32 (the curves below can only
    // drift apart by rounding amplified over steps if this agrees).
    {
        let (x, y) = batch(ids, b, t, &mut Generator::new(seed ^ 0x5eed))?;
        let mut grads = Vec::new();
        for (_, device, dtype) in &runs[..2] {
            let trainer = Trainer::new(config, seed, *device, *dtype, adamw)?;
            let (xd, yd) = match device {
                Device::Cpu => (x.clone(), y.clone()),
                d => (x.to_device(*d)?, y.to_device(*d)?),
            };
            trainer.model.loss(&xd, &yd, &mut Generator::new(0))?.backward()?;
            grads.push(
                trainer
                    .model
                    .named_parameters()
                    .iter()
                    .map(|(n, p)| Ok((n.clone(), p.grad().ok_or("no gradient")?.to_device(Device::Cpu)?.to_dtype(DType::F32)?)))
                    .collect::<Res<Vec<_>>>()?,
            );
        }
        let mut worst = (String::new(), 0.0f64);
        for ((name, a), (_, b)) in grads[1].iter().zip(&grads[0]) {
            let e = rel_err(a, b)?;
            if e > worst.1 {
                worst = (name.clone(), e);
            }
        }
        let pass = worst.1 <= 1e-4;
        println!("curve {label} first-step gradients gpu f32 vs cpu f32: worst {:.3e} ({}) (tol 1e-4) {}", worst.1, worst.0, if pass { "ok" } else { "FAIL" });
        if !pass {
            return Ok(false);
        }
    }
    let mut curves = Vec::new();
    for (name, device, dtype) in runs {
        let mut trainer = Trainer::new(config, seed, device, dtype, adamw)?;
        let mut data_rng = Generator::new(seed ^ 0x5eed);
        let start = Instant::now();
        let mut losses = Vec::with_capacity(steps);
        for _ in 0..steps {
            let (x, y) = batch(ids, b, t, &mut data_rng)?;
            losses.push(trainer.step(&x, &y)?.item()?);
        }
        println!("curve {label} {name}: {steps} steps in {:.1} s, first loss {:.4}, last {:.4}", start.elapsed().as_secs_f64(), losses[0], losses[steps - 1]);
        curves.push(losses);
    }
    let means = |c: &[f64]| c.chunks(window).map(|w| w.iter().sum::<f64>() / w.len() as f64).collect::<Vec<f64>>();
    let cpu = means(&curves[0]);
    let mut ok = true;
    for (run, tol) in [(1usize, twin.f32_tolerance), (2, 0.05)] {
        let other = means(&curves[run]);
        let (at, worst) =
            cpu.iter().zip(&other).map(|(a, b)| (a - b).abs() / a.abs().max(1e-12)).enumerate().fold((0, 0.0f64), |m, (i, d)| if d > m.1 { (i, d) } else { m });
        let pass = worst <= tol;
        ok &= pass;
        println!(
            "curve {label} {} vs cpu f32: worst {window}-step window mean rel diff {:.4} at steps {}..{} (tol {tol}) {}",
            runs[run].0,
            worst,
            at * window + 1,
            (at + 1) * window,
            if pass { "ok" } else { "FAIL" }
        );
    }
    println!("{:>6} {:>10} {:>10} {:>10}", "step", "cpu f32", "gpu f32", "gpu bf16");
    for i in (0..cpu.len()).step_by(3) {
        println!("{:>6} {:>10.4} {:>10.4} {:>10.4}", (i + 1) * window, cpu[i], means(&curves[1])[i], means(&curves[2])[i]);
    }
    Ok(ok)
}

fn bench(seed: u64, ids: &[u32], config: GptConfig, label: &str) -> Res<()> {
    let (b, t) = (16usize, 1024usize);
    let steps = std::env::var("RTX_BENCH_STEPS").ok().and_then(|s| s.parse().ok()).unwrap_or(20usize);
    let adamw = AdamWConfig { lr: 6e-4, weight_decay: 0.1, beta2: 0.95, ..AdamWConfig::default() };
    let mut trainer = Trainer::new(config, seed, GPU, DType::BF16, adamw)?;
    let n_params: usize = trainer.model.named_parameters().iter().map(|(_, p)| p.numel()).sum();
    let mut data_rng = Generator::new(seed ^ 0xbe7c);
    let mut times = Vec::new();
    let mut last = 0.0;
    for i in 0..steps + 3 {
        let (x, y) = batch(ids, b, t, &mut data_rng)?;
        let start = Instant::now();
        last = trainer.step(&x, &y)?.item()?;
        if i >= 3 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let tokens = (b * t) as f64;
    let flops_per_token = 6.0 * n_params as f64 + 12.0 * (config.n_layers * config.d_model * t) as f64;
    let tok_s = tokens / median;
    let mfu = flops_per_token * tok_s / PEAK_BF16;
    let stats = cuda::device(0)?.memory_stats();
    println!(
        "bench {label}: GPT-2 124M shape, vocabulary {} (padded {}), {n_params} parameters, B={b} T={t}, bf16 + f32 master AdamW, {steps} steps",
        config.vocab_size,
        config.padded_vocab()
    );
    println!(
        "bench step median {:.2} ms (min {:.2}), {:.0} tokens/s, MFU {:.1}%, final loss {last:.4}, peak device memory {:.2} GiB",
        median * 1e3,
        times[0] * 1e3,
        tok_s,
        mfu * 100.0,
        stats.peak_reserved as f64 / (1u64 << 30) as f64
    );
    println!("RESULT {label} tok_s={tok_s:.0} step_ms={:.2} mfu={:.4} params={n_params}", median * 1e3, mfu);
    Ok(())
}

/// GPT-2 124M (`configs/gpt2_124m.toml`'s model) trained 300 steps on the GPU in bf16 from one
/// seed on the BPE token ids (AdamW, lr 6e-4 after a 30-step linear warm-up), its loss every 25
/// steps, then 48 tokens sampled (temperature 0.8, top-k 40) after a prompt, decoded.
fn train_124m(seed: u64, ids: &[u32]) -> Res<()> {
    let config = gpt2_124m(GPT2_VOCAB, 128);
    let adamw = AdamWConfig { lr: 6e-4, weight_decay: 0.1, beta2: 0.95, ..AdamWConfig::default() };
    let mut trainer = Trainer::new(config, seed, GPU, DType::BF16, adamw)?;
    let mut data_rng = Generator::new(seed ^ 0x124);
    let (b, t, steps, warmup) = (16usize, 1024usize, 300usize, 30usize);
    let start = Instant::now();
    let mut window = Vec::new();
    println!("train 124M (gpt2 bpe, bf16): {steps} steps, B={b} T={t}; mean loss per 25 steps:");
    for step in 0..steps {
        trainer.opt.set_lr(6e-4 * ((step + 1) as f64 / warmup as f64).min(1.0));
        let (x, y) = batch(ids, b, t, &mut data_rng)?;
        window.push(trainer.step(&x, &y)?.item()?);
        if window.len() == 25 {
            println!("train 124M steps {:>3}-{:>3}: {:.4}", step - 23, step + 1, window.iter().sum::<f64>() / 25.0);
            window.clear();
        }
    }
    println!("train 124M: {steps} steps in {:.1} s", start.elapsed().as_secs_f64());
    let tokenizer = Gpt2Tokenizer::new()?;
    let prompt_text = "The state of our Union is";
    let prompt = tokenizer.encode(prompt_text);
    let sample = trainer.model.generate(&prompt, 48, 0.8, Some(40), &mut Generator::new(seed))?;
    println!("sample after 300 steps: {prompt_text:?} + {:?}", String::from_utf8_lossy(&tokenizer.decode_bytes(&sample)?));
    Ok(())
}

/// Milliseconds per call of `f` (after one warm-up call), waiting for the device at both ends.
fn time_ms(iters: usize, mut f: impl FnMut() -> Res<()>) -> Res<f64> {
    let dev = cuda::device(0)?;
    f()?;
    dev.synchronize()?;
    let start = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    dev.synchronize()?;
    Ok(start.elapsed().as_secs_f64() * 1e3 / iters as f64)
}

fn profile(seed: u64, ids: &[u32]) -> Res<()> {
    let config = gpt2_124m(GPT2_VOCAB, 128);
    let (b, t, c) = (16usize, 1024usize, 768usize);
    let adamw = AdamWConfig { lr: 6e-4, weight_decay: 0.1, beta2: 0.95, ..AdamWConfig::default() };
    let mut trainer = Trainer::new(config, seed, GPU, DType::BF16, adamw)?;
    let mut data_rng = Generator::new(seed ^ 0xbe7c);
    let (x, y) = batch(ids, b, t, &mut data_rng)?;
    let (x, y) = (x.to_device(GPU)?, y.to_device(GPU)?);
    let mut rng = Generator::new(0);
    let dev = cuda::device(0)?;
    let forward = time_ms(5, || {
        trainer.model.loss(&x, &y, &mut rng)?;
        Ok(())
    })?;
    let fwd_bwd = time_ms(5, || {
        for (_, p) in trainer.model.named_parameters() {
            p.set_grad(None)?;
        }
        trainer.model.loss(&x, &y, &mut rng)?.backward()?;
        Ok(())
    })?;
    let opt = time_ms(5, || Ok(trainer.opt.step()?))?;
    println!("profile phases: forward {forward:.2} ms, backward {:.2} ms, optimizer {opt:.2} ms", fwd_bwd - forward);
    dev.synchronize()?;
    // The host's time to queue each phase (no waits inside) against the device's time for the
    // whole step: a phase whose host time is near its device time is host-bound.
    for _ in 0..3 {
        for (_, p) in trainer.model.named_parameters() {
            p.set_grad(None)?;
        }
        dev.synchronize()?;
        let t0 = Instant::now();
        let loss = trainer.model.loss(&x, &y, &mut rng)?;
        let t1 = Instant::now();
        loss.backward()?;
        let t2 = Instant::now();
        trainer.opt.step()?;
        let t3 = Instant::now();
        dev.synchronize()?;
        let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
        println!(
            "profile host queueing: forward {:.2} ms, backward {:.2} ms, optimizer {:.2} ms; step done on the device after {:.2} ms",
            ms(t0, t1),
            ms(t1, t2),
            ms(t2, t3),
            ms(t0, Instant::now())
        );
    }

    let mut r = Generator::new(seed);
    let bf = |shape: &[usize], r: &mut Generator| -> Res<Tensor> { Ok(random(shape, r)?.to_dtype(DType::BF16)?.to_device(GPU)?.requires_grad(true)) };
    let rows = b * t;
    let cases: Vec<(&str, Vec<Tensor>, OpFn)> = vec![
        ("attention [16,1024,3x768] h12", vec![bf(&[b, t, 3 * c], &mut r)?], |x, _| Tensor::scaled_dot_product_attention_packed(&x[0], 12, true, None)),
        ("linear qkv 768->2304", vec![bf(&[rows, c], &mut r)?, bf(&[3 * c, c], &mut r)?, bf(&[3 * c], &mut r)?], |x, _| x[0].linear(&x[1], Some(&x[2]))),
        ("linear proj 768->768", vec![bf(&[rows, c], &mut r)?, bf(&[c, c], &mut r)?, bf(&[c], &mut r)?], |x, _| x[0].linear(&x[1], Some(&x[2]))),
        ("linear fc 768->3072", vec![bf(&[rows, c], &mut r)?, bf(&[4 * c, c], &mut r)?, bf(&[4 * c], &mut r)?], |x, _| x[0].linear(&x[1], Some(&x[2]))),
        ("linear fc2 3072->768", vec![bf(&[rows, 4 * c], &mut r)?, bf(&[c, 4 * c], &mut r)?, bf(&[c], &mut r)?], |x, _| x[0].linear(&x[1], Some(&x[2]))),
        ("lm head 768->50304 (unfused)", vec![bf(&[rows, c], &mut r)?, bf(&[50304, c], &mut r)?], |x, _| x[0].linear(&x[1], None)),
        ("layer_norm 768", vec![bf(&[rows, c], &mut r)?, bf(&[c], &mut r)?, bf(&[c], &mut r)?], |x, _| x[0].layer_norm(Some(&x[1]), Some(&x[2]), 1e-5)),
        (
            "mlp 768->3072->768 (fused)",
            vec![bf(&[rows, c], &mut r)?, bf(&[4 * c, c], &mut r)?, bf(&[4 * c], &mut r)?, bf(&[c, 4 * c], &mut r)?, bf(&[c], &mut r)?],
            |x, _| x[0].linear_gelu_linear(&x[1], &x[2], &x[3], &x[4]),
        ),
        ("gelu [16384,3072]", vec![bf(&[rows, 4 * c], &mut r)?], |x, _| x[0].gelu_with(rtx_tensor::GeluApprox::Tanh)),
        ("add residual", vec![bf(&[b, t, c], &mut r)?, bf(&[b, t, c], &mut r)?], |x, _| x[0].add(&x[1])),
        ("add+layer_norm 768 (fused)", vec![bf(&[b, t, c], &mut r)?, bf(&[b, t, c], &mut r)?, bf(&[c], &mut r)?, bf(&[c], &mut r)?], |x, _| {
            let (s, y) = x[0].add_layer_norm(&x[1], Some(&x[2]), Some(&x[3]), 1e-5)?;
            y.add(&s)
        }),
        ("add pos [B,T,C]+[T,C]", vec![bf(&[b, t, c], &mut r)?, bf(&[t, c], &mut r)?], |x, _| x[0].add(&x[1])),
    ];
    println!("{:<32} {:>10} {:>12} {:>10}", "op (bf16)", "fwd ms", "fwd+bwd ms", "x per step");
    let per_step = [12usize, 12, 12, 12, 12, 1, 25, 12, 12, 24, 24, 1];
    for ((name, inputs, f), n) in cases.into_iter().zip(per_step) {
        let fwd = time_ms(10, || {
            rtx_tensor::no_grad(|| f(&inputs, &[]))?;
            Ok(())
        })?;
        let out_shape = rtx_tensor::no_grad(|| f(&inputs, &[]))?.shape().to_vec();
        let g = random(&out_shape, &mut r)?.to_dtype(DType::BF16)?.to_device(GPU)?;
        let both = time_ms(10, || {
            for t in &inputs {
                t.set_grad(None)?;
            }
            f(&inputs, &[])?.backward_from(g.clone(), |_| {})?;
            Ok(())
        })?;
        println!("{name:<32} {fwd:>10.3} {both:>12.3} {n:>10}");
    }
    let table = bf(&[50304, c], &mut r)?;
    let ids = Tensor::from_vec((0..rows).map(|_| r.below(GPT2_VOCAB as u64) as u32).collect::<Vec<u32>>(), &[b, t])?.to_device(GPU)?;
    let g = random(&[b, t, c], &mut r)?.to_dtype(DType::BF16)?.to_device(GPU)?;
    let emb = time_ms(10, || {
        table.set_grad(None)?;
        Tensor::embedding(&table, &ids)?.backward_from(g.clone(), |_| {})?;
        Ok(())
    })?;
    println!("{:<32} {:>10} {emb:>12.3} {:>10}", "embedding 50304x768 fwd+bwd", "", 1);
    let hidden = bf(&[rows, c], &mut r)?;
    let targets = ids.reshape(&[rows])?;
    let fused_fwd = time_ms(10, || {
        rtx_tensor::no_grad(|| {
            hidden.linear_cross_entropy_valid(&table, &targets, GPT2_VOCAB, CrossEntropyOptions::default(), rtx_tensor::nn::head_chunk_rows(rows, 50304))
        })?;
        Ok(())
    })?;
    let fused = time_ms(10, || {
        hidden.set_grad(None)?;
        table.set_grad(None)?;
        hidden
            .linear_cross_entropy_valid(&table, &targets, GPT2_VOCAB, CrossEntropyOptions::default(), rtx_tensor::nn::head_chunk_rows(rows, 50304))?
            .backward()?;
        Ok(())
    })?;
    println!("{:<32} {fused_fwd:>10.3} {fused:>12.3} {:>10}", "head+loss fused 768->50304", 1);
    // The same with fewer, larger chunks (the logits of a chunk: rows x 50,304 bf16).
    for chunk in [8192usize, 16384] {
        let fused = time_ms(10, || {
            hidden.set_grad(None)?;
            table.set_grad(None)?;
            hidden.linear_cross_entropy_valid(&table, &targets, GPT2_VOCAB, CrossEntropyOptions::default(), chunk)?.backward()?;
            Ok(())
        })?;
        println!("{:<32} {:>10} {fused:>12.3} {:>10}", format!("head+loss fused, chunks of {chunk}"), "", 1);
    }
    head_parts(rows, c, &mut r)
}

/// The fused head's pieces for one chunk of 4,096 rows, each timed alone on the device: the
/// logits GEMM, the classifier kernel, the dhidden GEMM, and the weight-gradient GEMM as the
/// head runs it (f32 out, accumulating) beside bf16 and f32 outputs that overwrite.
fn head_parts(rows: usize, c: usize, r: &mut Generator) -> Res<()> {
    use rtx_kernels::cuda::Gemm;
    let dev = cuda::device(0)?;
    let (chunk, padded) = (4096usize.min(rows), 50304usize);
    let bf16_buf = |n: usize, r: &mut Generator| -> Res<_> {
        let host: Vec<f32> = (0..n).map(|_| (r.uniform() as f32 - 0.5) * 0.04).collect();
        let f = dev.htod(&host)?;
        let mut b = dev.alloc::<half::bf16>(n)?;
        dev.cast_f32_to_bf16(&f, &mut b)?;
        Ok(b)
    };
    let (hb, wb) = (bf16_buf(rows * c, r)?, bf16_buf(padded * c, r)?);
    let mut logits = bf16_buf(chunk * padded, r)?;
    let targets = dev.htod(&(0..chunk).map(|_| r.below(GPT2_VOCAB as u64) as u32).collect::<Vec<u32>>())?;
    let mut losses = dev.alloc::<f32>(chunk)?;
    let mut dh = dev.alloc::<half::bf16>(chunk * c)?;
    let mut dw32 = dev.alloc::<f32>(padded * c)?;
    let mut dw16 = dev.alloc::<half::bf16>(padded * c)?;
    let logits_gemm = Gemm { trans_b: true, ..Gemm::new(chunk, padded, c) };
    let dw_gemm = Gemm { trans_a: true, ..Gemm::new(padded, c, chunk) };
    let t_logits = time_ms(10, || Ok(dev.gemm(&logits_gemm, &hb, &wb, &mut logits)?))?;
    let t_class = time_ms(10, || Ok(dev.fused_classifier(&mut logits, chunk, padded, GPT2_VOCAB, &targets, 0, &mut losses, None, Some(1.0))?))?;
    dev.set_fused_classifier_regs(false);
    let t_class_cached = time_ms(10, || Ok(dev.fused_classifier(&mut logits, chunk, padded, GPT2_VOCAB, &targets, 0, &mut losses, None, Some(1.0))?));
    dev.set_fused_classifier_regs(true);
    let t_class_cached = t_class_cached?;
    let t_dh = time_ms(10, || Ok(dev.gemm(&Gemm::new(chunk, c, padded), &logits, &wb, &mut dh)?))?;
    let t_dw_acc = time_ms(10, || Ok(dev.gemm_f32_out(&Gemm { beta: 1.0, ..dw_gemm }, &logits, &hb, &mut dw32)?))?;
    let t_dw32 = time_ms(10, || Ok(dev.gemm_f32_out(&dw_gemm, &logits, &hb, &mut dw32)?))?;
    let t_dw16 = time_ms(10, || Ok(dev.gemm(&dw_gemm, &logits, &hb, &mut dw16)?))?;
    println!(
        "head parts per chunk of {chunk} rows (ms): logits GEMM {t_logits:.3}, classifier {t_class:.3} (row cached in shared memory: {t_class_cached:.3}), dhidden GEMM {t_dh:.3}, dweight GEMM f32 += {t_dw_acc:.3} (f32 = {t_dw32:.3}, bf16 = {t_dw16:.3})"
    );
    Ok(())
}
