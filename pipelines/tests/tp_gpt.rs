//! Tensor parallelism of the GPT: equivalence with the single-rank model, errors, failures.
//!
//! - tp = 1, 2, 4 (real communicators over the in-process transport, one compute thread per rank),
//!   with and without sequence parallelism: the loss equals the full `Gpt`'s, the gathered
//!   gradients equal its gradients, and after 5 AdamW steps the losses and gathered parameters
//!   match; replicated parameters stay bit-identical across ranks.
//! - With dropout (no sequence parallelism) the same generator on every rank reproduces the full
//!   model's masks.
//! - Pipeline stage parts (embedding + block 0, block 1 + head) chained on each rank give the same
//!   loss, and the two ends of the tied embedding sum to its full gradient.
//! - The ViT's TP form gives the full Vit's loss and gradients (with and without sequence
//!   parallelism).
//! - Sizes that do not split are typed errors naming the numbers; a dead or silent peer, in
//!   forward or backward, is an `Err` within the collective timeout; a call from a runtime thread
//!   is an `Err`.
//!
//! Seeds are fixed; `RTX_TEST_SEED` replays another one.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use rtx_collectives::{CommConfig, Endpoint, InProcessNetwork, Transport};
use rtx_pipelines::tp::{self, gpt_shard_spec, StagePart, TpGpt, TpGroup, TpHandle, TpOptions, TpVit};
use rtx_pipelines::Error;
use rtx_tensor::nn::{Gpt, GptConfig, Module, Pooling, Vit, VitConfig};
use rtx_tensor::optim::{AdamW, AdamWConfig, Optimizer};
use rtx_tensor::{CrossEntropyOptions, DType, GeluApprox, Generator, Tensor};

/// Wall-clock bound on any one multi-rank test body.
const TEST_TIMEOUT: Duration = Duration::from_secs(60);
const CONFIG: GptConfig = GptConfig {
    vocab_size: 64,
    vocab_pad_multiple: 1,
    context: 16,
    d_model: 32,
    n_layers: 2,
    n_heads: 4,
    dropout: 0.0,
    mlp_ratio: 4,
    bias: true,
    tie_embeddings: true,
    layer_norm_eps: 1e-5,
    init_std: 0.02,
    dtype: DType::F32,
    gelu: GeluApprox::Tanh,
};
const T: usize = 16;
const B: usize = 2;
const STEPS: usize = 5;
const ADAMW: AdamWConfig = AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };
/// Relative tolerance of losses, gradients (against the largest |gradient|) and parameters
/// (against the largest |parameter|).
const REL_TOLERANCE: f64 = 1e-5;
/// Elements whose gradient RMS (AdamW's `√v̂`) fell below this are ill-conditioned: AdamW divides
/// their rounding noise by almost nothing (the key part of `attn.qkv.bias`, whose exact gradient
/// is zero). They are only held to a bound of `lr` per step.
const GRAD_RMS_MIN: f32 = 1e-7;

fn seed() -> u64 {
    let seed = std::env::var("RTX_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x7E45_2026);
    eprintln!("RTX_TEST_SEED={seed}");
    seed
}

// ------------------------------------------------------------------------------------------ harness

/// `n` tensor-parallel groups over one in-process network, driven by a current-thread runtime on
/// a thread of its own (compute threads block on its handle).
struct Groups {
    net: InProcessNetwork,
    groups: Vec<TpHandle>,
    handle: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    driver: Option<std::thread::JoinHandle<()>>,
}

impl Groups {
    fn new(n: usize, op_timeout: Duration) -> Groups {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let handle = runtime.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let driver = std::thread::spawn(move || {
            runtime.block_on(async move {
                let _ = stopped.await;
            })
        });
        let (net, transports) = InProcessNetwork::new(n);
        let config = CommConfig { op_timeout, ..CommConfig::default() };
        let groups = transports
            .into_iter()
            .map(|t| {
                let transport: Arc<dyn Transport> = Arc::new(t);
                let comm = handle.block_on(async { Endpoint::new(transport, config.clone())?.world() }).unwrap();
                TpGroup::new(comm, handle.clone()).into_handle()
            })
            .collect();
        Groups { net, groups, handle, stop: Some(stop), driver: Some(driver) }
    }

    /// Runs `body(rank, group)` on one thread per rank; results in rank order.
    fn run<R: Send + 'static>(&self, body: impl Fn(usize, TpHandle) -> R + Send + Sync + 'static) -> Vec<R> {
        let n = self.groups.len();
        let body = Arc::new(body);
        let (tx, rx) = mpsc::channel();
        for (rank, group) in self.groups.iter().enumerate() {
            let (tx, body, group) = (tx.clone(), Arc::clone(&body), TpHandle::clone(group));
            std::thread::spawn(move || {
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(rank, group)));
                let _ = tx.send((rank, result));
            });
        }
        let deadline = Instant::now() + TEST_TIMEOUT;
        let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
        for _ in 0..n {
            let left = deadline.saturating_duration_since(Instant::now());
            let (rank, result) = rx.recv_timeout(left).expect("ranks did not finish within the test timeout (hang?)");
            match result {
                Ok(r) => out[rank] = Some(r),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        out.into_iter().map(|r| r.unwrap()).collect()
    }
}

impl Drop for Groups {
    fn drop(&mut self) {
        self.groups.clear();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(driver) = self.driver.take() {
            let _ = driver.join();
        }
    }
}

/// The batch of `step`: `(ids [B, T], targets [B, T])` drawn from `(seed, step)`.
fn batch(seed: u64, step: usize) -> (Tensor, Tensor) {
    let mut rng = Generator::with_stream(seed, 1000 + step as u64);
    let tokens: Vec<u32> = (0..B * (T + 1)).map(|_| rng.below(CONFIG.vocab_size as u64) as u32).collect();
    let ids: Vec<u32> = tokens.chunks(T + 1).flat_map(|s| s[..T].to_vec()).collect();
    let next: Vec<u32> = tokens.chunks(T + 1).flat_map(|s| s[1..].to_vec()).collect();
    (Tensor::from_vec(ids, &[B, T]).unwrap(), Tensor::from_vec(next, &[B, T]).unwrap())
}

type Named = Vec<(String, Vec<f32>)>;

fn values(named: Vec<(String, Tensor)>) -> Named {
    named.into_iter().map(|(n, t)| (n, t.to_f32_vec().unwrap())).collect()
}

fn decay(_: &str, p: &Tensor) -> bool {
    p.rank() >= 2
}

/// What a run leaves behind, per step (full tensors: gathered from the ranks).
#[derive(Default)]
struct Trajectory {
    losses: Vec<f32>,
    /// Step 0's gradients.
    grads: Named,
    /// Parameters after each step.
    params: Vec<Named>,
    /// Reference only: per element, the smallest gradient RMS AdamW divided by so far.
    grad_rms: BTreeMap<String, Vec<f32>>,
}

/// The single-rank model on the same batches.
fn reference(seed: u64) -> Trajectory {
    let model = Gpt::new(CONFIG, &mut Generator::new(seed)).unwrap();
    let mut opt = AdamW::with_decay_filter(model.named_parameters(), ADAMW, decay).unwrap();
    let mut out = Trajectory::default();
    for step in 0..STEPS {
        opt.zero_grad().unwrap();
        let (ids, targets) = batch(seed, step);
        let loss = model.loss(&ids, &targets, &mut Generator::new(0)).unwrap();
        loss.backward().unwrap();
        out.losses.push(loss.item().unwrap() as f32);
        if step == 0 {
            out.grads = model.named_parameters().into_iter().map(|(n, p)| (n, p.grad().unwrap().to_f32_vec().unwrap())).collect();
        }
        opt.step().unwrap();
        let correction = 1.0 - ADAMW.beta2.powi(step as i32 + 1);
        for (name, v) in opt.state_tensors().unwrap() {
            let Some(param) = name.strip_suffix(".exp_avg_sq") else { continue };
            let rms: Vec<f32> = v.to_f32_vec().unwrap().into_iter().map(|v| (f64::from(v) / correction).sqrt() as f32).collect();
            let slot = out.grad_rms.entry(param.to_string()).or_insert_with(|| rms.clone());
            slot.iter_mut().zip(&rms).for_each(|(a, b)| *a = a.min(*b));
        }
        out.params.push(values(model.named_parameters()));
    }
    out
}

/// One rank of a tensor-parallel run: its trajectory (gathered tensors) and, after the last step,
/// its local replicated parameters.
fn tp_rank(seed: u64, group: TpHandle, options: TpOptions) -> (Trajectory, Named) {
    let model = TpGpt::new(CONFIG, &mut Generator::new(seed), group, options).unwrap();
    let mut opt = AdamW::with_decay_filter(model.named_parameters(), ADAMW, decay).unwrap();
    let mut out = Trajectory::default();
    for step in 0..STEPS {
        opt.zero_grad().unwrap();
        let (ids, targets) = batch(seed, step);
        let loss = model.loss(&ids, &targets, &mut Generator::new(0)).unwrap();
        tp::backward(&loss).unwrap();
        out.losses.push(loss.item().unwrap() as f32);
        if step == 0 {
            out.grads = values(model.gather_full_grads().unwrap());
        }
        opt.step().unwrap();
        out.params.push(values(model.gather_full().unwrap()));
    }
    let replicated = model.named_parameters().into_iter().filter(|(n, _)| model.shard_spec(n).is_none()).map(|(n, t)| (n, t.to_f32_vec().unwrap())).collect();
    (out, replicated)
}

fn max_abs(named: &Named) -> f64 {
    named.iter().flat_map(|(_, v)| v.iter()).map(|x| f64::from(x.abs())).fold(0.0, f64::max)
}

/// max |a − b| over the elements of identically named tensors; every name must match.
fn max_diff(a: &Named, b: &Named) -> f64 {
    assert_eq!(a.iter().map(|(n, v)| (n, v.len())).collect::<Vec<_>>(), b.iter().map(|(n, v)| (n, v.len())).collect::<Vec<_>>(), "names and sizes");
    a.iter().zip(b).flat_map(|((_, x), (_, y))| x.iter().zip(y)).map(|(p, q)| f64::from((p - q).abs())).fold(0.0, f64::max)
}

fn check_equivalence(tp: usize, options: TpOptions) {
    let seed = seed();
    let reference = reference(seed);
    let groups = Groups::new(tp, Duration::from_secs(20));
    let runs = groups.run(move |_, group| tp_rank(seed, group, options));
    let case = format!("tp={tp} {options:?}");
    for (rank, (run, replicated)) in runs.iter().enumerate().skip(1) {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&run.losses), bits(&runs[0].0.losses), "{case}: rank {rank}'s losses differ from rank 0's");
        for ((name, a), (_, b)) in replicated.iter().zip(&runs[0].1) {
            assert_eq!(bits(a), bits(b), "{case}: replicated {name} differs between rank {rank} and rank 0");
        }
    }
    let run = &runs[0].0;
    for (step, (&l, &r)) in run.losses.iter().zip(&reference.losses).enumerate() {
        let rel = f64::from((l - r).abs()) / f64::from(r.abs());
        eprintln!("{case} step {step}: loss {l} vs {r} (rel {rel:.1e})");
        assert!(rel <= REL_TOLERANCE, "{case} step {step}: loss {l} vs reference {r}");
    }
    let (grad_diff, grad_scale) = (max_diff(&run.grads, &reference.grads), max_abs(&reference.grads));
    eprintln!("{case}: grads max diff {grad_diff:.2e} = {:.2e} x scale {grad_scale:.2e}", grad_diff / grad_scale);
    assert!(grad_diff <= REL_TOLERANCE * grad_scale, "{case}: gradient diff {grad_diff:e} over {REL_TOLERANCE} x {grad_scale:e}");
    let initial = values(Gpt::new(CONFIG, &mut Generator::new(seed)).unwrap().named_parameters());
    for step in 0..STEPS {
        let (ours, theirs) = (&run.params[step], &reference.params[step]);
        let scale = max_abs(theirs);
        let (mut well, mut ill, mut n_ill) = (0f64, 0f64, 0);
        for ((name, x), (_, y)) in ours.iter().zip(theirs) {
            for ((p, q), rms) in x.iter().zip(y).zip(&reference.grad_rms[name]) {
                let d = f64::from((p - q).abs());
                if *rms < GRAD_RMS_MIN {
                    ill = ill.max(d);
                    n_ill += 1;
                } else {
                    well = well.max(d);
                }
            }
        }
        let moved = max_diff(theirs, &initial);
        eprintln!("{case} step {step}: params max diff {well:.2e} = {:.2e} x scale {scale:.2e}; {n_ill} ill-conditioned up to {ill:.2e}; moved {moved:.2e}", well / scale);
        assert!(well <= REL_TOLERANCE * scale, "{case} step {step}: parameter diff {well:e} over {REL_TOLERANCE} x {scale:e}");
        assert!(moved > 100.0 * well, "{case} step {step}: parameters must move for the comparison to mean something");
        assert!(ill <= ADAMW.lr * (step + 1) as f64, "{case} step {step}: ill-conditioned elements differ by {ill:e}");
    }
}

// ------------------------------------------------------------------------------------------ equivalence

// Goal: TP over 1, 2 and 4 ranks computes the single-rank model's loss, gradients and AdamW
// trajectory. Method: same init (TpGpt::new slices Gpt::new's draw), same batches, 5 steps;
// gather the sharded tensors and compare.
#[test]
fn tp_matches_full_model() {
    for tp in [1, 2, 4] {
        check_equivalence(tp, TpOptions::default());
    }
}

// Goal: as `tp_matches_full_model` with sequence parallelism (layer norms, residuals and the
// embeddings on T/tp positions per rank; replicated gradients all-reduced).
#[test]
fn sequence_parallel_matches_full_model() {
    for tp in [2, 4] {
        check_equivalence(tp, TpOptions { sequence_parallel: true });
    }
}

// Goal: with dropout and without sequence parallelism, the same generator on every rank draws the
// full model's masks (the dropped tensors are replicated and drawn in the same order), so the loss
// and gradients still match. Method: p = 0.2, training mode, tp=2, one step.
#[test]
fn dropout_masks_match_full_model() {
    let seed = seed();
    let config = GptConfig { dropout: 0.2, ..CONFIG };
    let full = Gpt::new(config, &mut Generator::new(seed)).unwrap();
    assert!(full.is_training());
    let (ids, targets) = batch(seed, 0);
    let loss = full.loss(&ids, &targets, &mut Generator::new(5)).unwrap();
    loss.backward().unwrap();
    let (expected_loss, expected_grads) = (loss.item().unwrap(), values(full.named_parameters().into_iter().map(|(n, p)| (n, p.grad().unwrap())).collect()));
    let plain = Gpt::new(CONFIG, &mut Generator::new(seed)).unwrap();
    plain.loss(&ids, &targets, &mut Generator::new(5)).unwrap().backward().unwrap();
    let plain_grads = values(plain.named_parameters().into_iter().map(|(n, p)| (n, p.grad().unwrap())).collect());
    let scale = max_abs(&expected_grads);
    assert!(max_diff(&plain_grads, &expected_grads) > 100.0 * REL_TOLERANCE * scale, "dropout must change the gradients for this test to mean something");
    let groups = Groups::new(2, Duration::from_secs(20));
    let runs = groups.run(move |_, group| {
        let model = TpGpt::new(config, &mut Generator::new(seed), group, TpOptions::default()).unwrap();
        assert!(model.is_training());
        let loss = model.loss(&ids, &targets, &mut Generator::new(5)).unwrap();
        tp::backward(&loss).unwrap();
        (loss.item().unwrap(), values(model.gather_full_grads().unwrap()))
    });
    for (loss, grads) in runs {
        let d = max_diff(&grads, &expected_grads);
        assert!((loss - expected_loss).abs() <= REL_TOLERANCE * expected_loss, "loss {loss} vs {expected_loss}");
        assert!(d <= REL_TOLERANCE * scale, "gradient diff {d:e} over {REL_TOLERANCE} x {scale:e}");
    }
}

// Goal: a pipeline split (stage 0: embeddings + block 0, stage 1: block 1 + head) built at each
// TP rank gives the full loss, and the tied embedding's two ends sum to the full gradient.
// Method: chain the stages on each rank's thread, backward through both, gather.
#[test]
fn stage_parts_chain_to_the_full_model() {
    let seed = seed();
    let full = Gpt::new(CONFIG, &mut Generator::new(seed)).unwrap();
    let (ids, targets) = batch(seed, 0);
    let loss = full.loss(&ids, &targets, &mut Generator::new(0)).unwrap();
    loss.backward().unwrap();
    let full_grads: BTreeMap<String, Vec<f32>> = full.named_parameters().into_iter().map(|(n, p)| (n, p.grad().unwrap().to_f32_vec().unwrap())).collect();
    let expected_loss = loss.item().unwrap();
    let groups = Groups::new(2, Duration::from_secs(20));
    let runs = groups.run(move |_, group| {
        let mut rng = Generator::new(seed);
        let first = StagePart { layers: 0..1, embedding: true, head: false };
        let last = StagePart { layers: 1..2, embedding: false, head: true };
        let full = Gpt::new(CONFIG, &mut rng).unwrap();
        let s0 = TpGpt::from_full_part(&full, TpHandle::clone(&group), TpOptions::default(), first).unwrap();
        let s1 = TpGpt::from_full_part(&full, group, TpOptions::default(), last).unwrap();
        assert!(s0.needs_embedding_sync() && s1.needs_embedding_sync());
        assert!(s0.embed(&ids, &mut Generator::new(0)).is_ok() && s1.embed(&ids, &mut Generator::new(0)).is_err());
        let names = |m: &TpGpt| m.named_parameters().into_iter().map(|(n, _)| n).collect::<Vec<_>>();
        assert_eq!(names(&s0), ["tok_emb.weight", "pos_emb.weight"].into_iter().map(String::from).chain(names(&s0)[2..].iter().cloned()).collect::<Vec<_>>());
        assert!(names(&s0).iter().all(|n| !n.starts_with("blocks.1")) && names(&s1).iter().all(|n| !n.starts_with("blocks.0")));
        assert_eq!(names(&s1).last().map(String::as_str), Some(tp::TIED_EMBEDDING_PARAM));
        let mut rng = Generator::new(0);
        let h = s0.forward_blocks(&s0.embed(&ids, &mut rng).unwrap(), &mut rng).unwrap();
        let loss = s1.head_loss(&s1.forward_blocks(&h, &mut rng).unwrap(), &targets).unwrap();
        tp::backward(&loss).unwrap();
        let mut grads: BTreeMap<String, Vec<f32>> = values(s0.gather_full_grads().unwrap()).into_iter().collect();
        for (name, g) in values(s1.gather_full_grads().unwrap()) {
            match grads.get_mut(&name) {
                // The embedding group's all-reduce, done by hand.
                Some(sum) => sum.iter_mut().zip(&g).for_each(|(a, b)| *a += b),
                None => {
                    grads.insert(name, g);
                }
            }
        }
        (loss.item().unwrap(), grads)
    });
    for (loss, grads) in runs {
        assert!((loss - expected_loss).abs() <= REL_TOLERANCE * expected_loss, "stage loss {loss} vs {expected_loss}");
        assert_eq!(grads.keys().collect::<Vec<_>>(), full_grads.keys().collect::<Vec<_>>());
        let scale = full_grads.values().flatten().map(|x| f64::from(x.abs())).fold(0.0, f64::max);
        for (name, g) in &grads {
            let d = g.iter().zip(&full_grads[name]).map(|(a, b)| f64::from((a - b).abs())).fold(0.0, f64::max);
            assert!(d <= REL_TOLERANCE * scale, "{name}: gradient diff {d:e} over {REL_TOLERANCE} x {scale:e}");
        }
    }
}

// Goal: `load_full` slices a full state in, and `gather_full` gives it back exactly.
// Method: load a differently seeded model's parameters into a TpGpt at tp=2, gather, compare bits.
#[test]
fn load_full_then_gather_full_round_trips() {
    let seed = seed();
    let other = values(Gpt::new(CONFIG, &mut Generator::new(seed + 1)).unwrap().named_parameters());
    let groups = Groups::new(2, Duration::from_secs(20));
    let expected = other.clone();
    let runs = groups.run(move |_, group| {
        let mut model = TpGpt::new(CONFIG, &mut Generator::new(seed), group, TpOptions::default()).unwrap();
        let state: Vec<(String, Tensor)> = other.iter().map(|(n, v)| (n.clone(), Tensor::from_vec(v.clone(), &full_shape(n)).unwrap())).collect();
        model.load_full(&state).unwrap();
        let bad: Vec<(String, Tensor)> = state.iter().map(|(n, t)| (n.clone(), if n == "blocks.0.mlp.fc.weight" { t.narrow(0, 0, 8).unwrap() } else { t.clone() })).collect();
        let err = model.load_full(&bad).unwrap_err();
        assert!(matches!(&err, Error::TpLoad { name, .. } if name == "blocks.0.mlp.fc.weight"), "{err}");
        values(model.gather_full().unwrap())
    });
    for gathered in runs {
        assert!(gathered == expected, "gather_full(load_full(x)) != x");
    }
    assert_eq!(gpt_shard_spec("blocks.1.attn.qkv.bias", 2).map(|s| (s.dim, s.blocks)), Some((0, 3)));
    assert_eq!(gpt_shard_spec("blocks.1.attn.proj.bias", 2), None);
}

fn full_shape(name: &str) -> Vec<usize> {
    let full = Gpt::new(CONFIG, &mut Generator::new(0)).unwrap();
    full.named_parameters().into_iter().find(|(n, _)| n == name).map(|(_, t)| t.shape().to_vec()).unwrap()
}

// ------------------------------------------------------------------------------------------ ViT

const VIT: VitConfig = VitConfig {
    image_size: [8, 8],
    patch_size: 4,
    in_channels: 1,
    d_model: 32,
    n_layers: 2,
    n_heads: 4,
    mlp_ratio: 4,
    dropout: 0.0,
    cls_token: true,
    pooling: Pooling::Cls,
    n_classes: Some(5),
    layer_norm_eps: 1e-6,
    init_std: 0.02,
    dtype: DType::F32,
    frames: 1,
    tubelet: 1,
    gelu: GeluApprox::Tanh,
};

// Goal: the TP ViT computes the full Vit's loss and gradients, with and without sequence
// parallelism. Method: class-token pooling at tp=2; mean pooling without class token (4 tokens)
// with sequence parallelism at tp=2 and 4; one batch, classifier cross-entropy, gathered grads.
#[test]
fn tp_vit_matches_full_model() {
    let seed = seed();
    let cases = [
        (2, VIT, false),
        (2, VitConfig { cls_token: false, pooling: Pooling::Mean, ..VIT }, true),
        (4, VitConfig { cls_token: false, pooling: Pooling::Mean, ..VIT }, true),
    ];
    for (tp, config, sequence_parallel) in cases {
        let mut rng = Generator::with_stream(seed, 7);
        let images = Tensor::randn(&[B, 1, 8, 8], 0.0, 1.0, DType::F32, &mut rng).unwrap();
        let labels = Tensor::from_vec((0..B).map(|_| rng.below(5) as u32).collect::<Vec<_>>(), &[B]).unwrap();
        let full = Vit::new(config, &mut Generator::new(seed)).unwrap();
        let loss = full.forward(&images, &mut Generator::new(0)).unwrap().cross_entropy(&labels, CrossEntropyOptions::default()).unwrap();
        loss.backward().unwrap();
        let (expected_loss, expected_grads) = (loss.item().unwrap(), values(full.named_parameters().into_iter().map(|(n, p)| (n, p.grad().unwrap())).collect()));
        let groups = Groups::new(tp, Duration::from_secs(20));
        let runs = groups.run(move |_, group| {
            let model = TpVit::new(config, &mut Generator::new(seed), group, TpOptions { sequence_parallel }).unwrap();
            let loss = model.forward(&images, &mut Generator::new(0)).unwrap().cross_entropy(&labels, CrossEntropyOptions::default()).unwrap();
            tp::backward(&loss).unwrap();
            (loss.item().unwrap(), values(model.gather_full_grads().unwrap()))
        });
        let case = format!("ViT tp={tp} cls={} sp={sequence_parallel}", config.cls_token);
        let scale = max_abs(&expected_grads);
        for (loss, grads) in runs {
            let d = max_diff(&grads, &expected_grads);
            eprintln!("{case}: loss {loss} vs {expected_loss}; grads max diff {d:.2e} = {:.2e} x scale {scale:.2e}", d / scale);
            assert!((loss - expected_loss).abs() <= REL_TOLERANCE * expected_loss, "{case}: loss {loss} vs {expected_loss}");
            assert!(d <= REL_TOLERANCE * scale, "{case}: gradient diff {d:e} over {REL_TOLERANCE} x {scale:e}");
        }
    }
}

// ------------------------------------------------------------------------------------------ errors

// Goal: sizes that do not split over tp are typed errors naming both numbers, not panics.
// Method: n_heads 4 over 3 ranks, vocab 66 over 4 and 64 over 3, sequence 16 over 3 with sequence
// parallelism.
#[test]
fn indivisible_sizes_are_typed_errors() {
    let three = Groups::new(3, Duration::from_secs(5));
    let err = TpGpt::new(CONFIG, &mut Generator::new(0), TpHandle::clone(&three.groups[0]), TpOptions::default()).unwrap_err();
    assert!(matches!(err, Error::TpIndivisible { what: "n_heads", value: 4, tp: 3 }), "{err:?}");
    assert_eq!(err.to_string(), "n_heads 4 is not divisible by the tensor-parallel size 3");
    let four = Groups::new(4, Duration::from_secs(5));
    let config = GptConfig { vocab_size: 66, ..CONFIG };
    let err = TpGpt::new(config, &mut Generator::new(0), TpHandle::clone(&four.groups[0]), TpOptions::default()).unwrap_err();
    assert!(matches!(err, Error::TpIndivisible { what: "vocab_size", value: 66, tp: 4 }), "{err:?}");
    let config = GptConfig { n_heads: 6, d_model: 48, vocab_size: 64, ..CONFIG };
    let model = TpGpt::new(GptConfig { vocab_size: 67, ..config }, &mut Generator::new(0), TpGroup::solo().into_handle(), TpOptions { sequence_parallel: true }).unwrap();
    assert!(model.loss(&batch(0, 0).0, &batch(0, 0).1, &mut Generator::new(0)).is_ok(), "tp=1 splits anything");
    let err = TpGpt::new(config, &mut Generator::new(0), TpHandle::clone(&three.groups[0]), TpOptions::default()).unwrap_err();
    assert!(matches!(err, Error::TpIndivisible { what: "vocab_size", value: 64, tp: 3 }), "{err:?}");
    // Sequence parallelism needs T % tp == 0: checked before any collective, so one rank suffices.
    let config = GptConfig { n_heads: 6, d_model: 48, vocab_size: 66, ..CONFIG };
    let model = TpGpt::new(config, &mut Generator::new(0), TpHandle::clone(&three.groups[0]), TpOptions { sequence_parallel: true }).unwrap();
    let err = model.loss(&batch(0, 0).0, &batch(0, 0).1, &mut Generator::new(0)).unwrap_err();
    assert!(matches!(err, Error::TpIndivisible { what: "sequence length", value: 16, tp: 3 }), "{err:?}");
}

// Goal: a blocking TP collective called on a runtime thread is an error, not tokio's panic.
#[test]
fn runtime_thread_is_refused() {
    let groups = Groups::new(2, Duration::from_secs(5));
    let group = TpHandle::clone(&groups.groups[0]);
    let result = groups.handle.block_on(async move { group.all_reduce_sum(&mut [1.0]) });
    assert!(matches!(result, Err(Error::TpOnRuntimeThread { op: "all_reduce_sum" })), "{result:?}");
}

/// Short, so the silent-peer case is quick; the lost-peer cases do not wait for it.
const OP_TIMEOUT: Duration = Duration::from_millis(500);

// Goal: a peer lost before a TP forward makes the forward return Err (no hang, no panic), and the
// group refuses later calls. Method: cut rank 1 off, run rank 0's loss.
#[test]
fn dead_peer_fails_forward() {
    let groups = Groups::new(2, OP_TIMEOUT);
    let model = TpGpt::new(CONFIG, &mut Generator::new(1), TpHandle::clone(&groups.groups[0]), TpOptions::default()).unwrap();
    groups.net.disconnect(1);
    let (ids, targets) = batch(1, 0);
    let start = Instant::now();
    let err = groups.run(move |rank, _| (rank == 0).then(|| model.loss(&ids, &targets, &mut Generator::new(0)).unwrap_err())).remove(0).unwrap();
    assert!(matches!(err, Error::TpCollective { rank: 0, size: 2, source: rtx_collectives::Error::PeerLost { .. } | rtx_collectives::Error::TransportClosed, .. }), "{err:?}");
    assert!(start.elapsed() < OP_TIMEOUT * 4, "failed after {:?}", start.elapsed());
    let again = groups.groups[0].all_reduce_sum(&mut [1.0]);
    assert!(matches!(again, Err(Error::TpBroken { rank: 0, .. })), "{again:?}");
}

// Goal: a peer lost between forward and backward makes the backward return the typed collective
// error (carried through the tensor crate's error). Method: both ranks run the forward, rank 1 is
// cut off, rank 0 runs `tp::backward`.
#[test]
fn dead_peer_fails_backward() {
    let groups = Groups::new(2, OP_TIMEOUT);
    let net = groups.net.clone();
    let forward_done = Arc::new(Barrier::new(2));
    let cut = Arc::new(Barrier::new(2));
    let errors = groups.run(move |rank, group| {
        let model = TpGpt::new(CONFIG, &mut Generator::new(2), group, TpOptions::default()).unwrap();
        let (ids, targets) = batch(2, 0);
        let loss = model.loss(&ids, &targets, &mut Generator::new(0)).unwrap();
        forward_done.wait();
        if rank == 1 {
            net.disconnect(1);
        }
        cut.wait();
        let start = Instant::now();
        let result = tp::backward(&loss);
        (result.err(), start.elapsed())
    });
    for (rank, (err, elapsed)) in errors.into_iter().enumerate() {
        let err = err.unwrap_or_else(|| panic!("rank {rank}: backward succeeded without its peer"));
        assert!(matches!(err, Error::TpCollective { op: "all_reduce_sum", .. }), "rank {rank}: {err:?}");
        assert!(elapsed < OP_TIMEOUT * 4, "rank {rank} failed after {elapsed:?}");
    }
}

// Goal: a peer that never joins the collective (alive but silent) makes the forward fail with a
// timeout within the configured bound. Method: rank 1 does nothing; rank 0 runs its loss.
#[test]
fn silent_peer_times_out() {
    let groups = Groups::new(2, OP_TIMEOUT);
    let results = groups.run(move |rank, group| {
        if rank == 1 {
            return None;
        }
        let model = TpGpt::new(CONFIG, &mut Generator::new(3), group, TpOptions::default()).unwrap();
        let (ids, targets) = batch(3, 0);
        let start = Instant::now();
        let err = model.loss(&ids, &targets, &mut Generator::new(0)).unwrap_err();
        Some((err, start.elapsed()))
    });
    let (err, elapsed) = results.into_iter().next().flatten().unwrap();
    assert!(matches!(err, Error::TpCollective { source: rtx_collectives::Error::Timeout { .. }, .. }), "{err:?}");
    assert!(elapsed >= OP_TIMEOUT && elapsed < OP_TIMEOUT * 4, "timed out after {elapsed:?}");
}
