//! Data-parallel equivalence, overlap and failure.
//!
//! - N ranks each stepping on their slice (b rows) of one global batch reach the parameters that
//!   one process reaches on the whole batch (N·b rows), for N = 2 and 4, replicated, ZeRO-1 and ZeRO-2, on
//!   an MLP and a tiny GPT, over several AdamW steps; the averaged gradients match too, replicas
//!   are bit-identical after every step, and ZeRO-1 and ZeRO-2 are bit-identical to replicated.
//! - Large buckets split into channels, on a multi-thread communication runtime
//!   (`DpConfig::comm_threads`), keep replicas bit-identical; the threads change no bit.
//! - Buckets whose parameters the loss never used are still reduced, after backward.
//! - A bucket's all-reduce starts while backward is still running (a gate in the graph makes this
//!   deterministic).
//! - A peer lost mid-step, or a peer that goes silent, makes every rank's step return an error
//!   within the configured timeout instead of hanging.
//!
//! Method: in-process transport, every rank a thread (its engine adds a communication thread).
//! Ranks initialise from different seeds on purpose: construction broadcasts rank 0's parameters.
//! Seeds are fixed; `RTX_TEST_SEED` replays another one.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use rtx_collectives::{CommConfig, Endpoint, InProcessNetwork, InProcessTransport, Transport};
use rtx_pipelines::{adamw, DataParallel, DpConfig, Error, Sharding};
use rtx_tensor::nn::{Activation, Gpt, GptConfig, Linear, Mlp, Module};
use rtx_tensor::optim::{AdamW, AdamWConfig, Optimizer};
use rtx_tensor::{CrossEntropyOptions, DType, FloatVec, GeluApprox, Generator, Tensor};

/// Wall-clock bound on any one multi-rank test body.
const TEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Largest |distributed − single-process| parameter difference allowed on well-conditioned
/// elements (see `GRAD_RMS_MIN`), relative to the largest |parameter|: the summation order of
/// gradients differs. Measured over 40 seeds: at most 4.7e-7 after 4 steps at lr 1e-3.
const REL_TOLERANCE: f64 = 1e-5;

const ADAMW: AdamWConfig = AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };
const STEPS: u64 = 4;

fn seed() -> u64 {
    let seed = std::env::var("RTX_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5EED_2026);
    eprintln!("RTX_TEST_SEED={seed}");
    seed
}

fn decay(_name: &str, shape: &[usize]) -> bool {
    shape.len() >= 2
}

// ------------------------------------------------------------------------------------------ models

#[derive(Clone, Copy, Debug)]
enum Kind {
    Mlp,
    Gpt,
}

const MLP_SIZES: [usize; 4] = [12, 24, 20, 5];
const GPT: GptConfig = GptConfig {
    vocab_size: 17,
    vocab_pad_multiple: 1,
    context: 8,
    d_model: 16,
    n_layers: 2,
    n_heads: 2,
    dropout: 0.0,
    mlp_ratio: 4,
    bias: true,
    tie_embeddings: true,
    layer_norm_eps: 1e-5,
    init_std: 0.02,
    dtype: DType::F32,
    gelu: GeluApprox::Tanh,
};
const GPT_T: usize = 8;

/// An MLP classifier or a tiny GPT behind one type, so one harness drives both.
enum Model {
    Mlp(Mlp),
    Gpt(Gpt),
}

/// Rows of one batch: MLP `(x [B, 12] f32, y [B] u32)`, GPT `(ids [B, T], targets [B, T])`.
#[derive(Clone)]
struct Batch {
    inputs: Tensor,
    targets: Tensor,
}

impl Module for Model {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        match self {
            Model::Mlp(m) => m.visit_params(prefix, f),
            Model::Gpt(m) => m.visit_params(prefix, f),
        }
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        match self {
            Model::Mlp(m) => m.visit_params_mut(prefix, f),
            Model::Gpt(m) => m.visit_params_mut(prefix, f),
        }
    }
}

impl Model {
    fn new(kind: Kind, seed: u64) -> Model {
        let mut rng = Generator::new(seed);
        match kind {
            Kind::Mlp => Model::Mlp(Mlp::new(&MLP_SIZES, Activation::Gelu, DType::F32, &mut rng).unwrap()),
            Kind::Gpt => Model::Gpt(Gpt::new(GPT, &mut rng).unwrap()),
        }
    }

    /// Mean loss over the batch.
    fn loss(&self, batch: &Batch) -> rtx_tensor::Result<Tensor> {
        match self {
            Model::Mlp(m) => m.forward(&batch.inputs)?.cross_entropy(&batch.targets, CrossEntropyOptions::default()),
            Model::Gpt(m) => m.loss(&batch.inputs, &batch.targets, &mut Generator::new(0)),
        }
    }

    /// Every parameter's elements, in visit order.
    fn snapshot(&self) -> Vec<Vec<f32>> {
        self.named_parameters().iter().map(|(_, t)| t.to_f32_vec().unwrap()).collect()
    }
}

/// The global batch of `step`: `rows` rows drawn from `(seed, step)`.
fn global_batch(kind: Kind, seed: u64, step: u64, rows: usize) -> Batch {
    let mut rng = Generator::with_stream(seed, 1000 + step);
    match kind {
        Kind::Mlp => {
            let x = Tensor::randn(&[rows, MLP_SIZES[0]], 0.0, 1.0, DType::F32, &mut rng).unwrap();
            let y: Vec<u32> = (0..rows).map(|_| rng.below(MLP_SIZES[3] as u64) as u32).collect();
            Batch { inputs: x, targets: Tensor::from_vec(y, &[rows]).unwrap() }
        }
        Kind::Gpt => {
            let tokens: Vec<u32> = (0..rows * (GPT_T + 1)).map(|_| rng.below(GPT.vocab_size as u64) as u32).collect();
            let ids: Vec<u32> = tokens.chunks(GPT_T + 1).flat_map(|s| s[..GPT_T].to_vec()).collect();
            let next: Vec<u32> = tokens.chunks(GPT_T + 1).flat_map(|s| s[1..].to_vec()).collect();
            Batch { inputs: Tensor::from_vec(ids, &[rows, GPT_T]).unwrap(), targets: Tensor::from_vec(next, &[rows, GPT_T]).unwrap() }
        }
    }
}

/// Rank `rank`'s `rows` rows of a global batch.
fn local_slice(batch: &Batch, rank: usize, rows: usize) -> Batch {
    let cut = |t: &Tensor| t.narrow(0, rank * rows, rows).unwrap().contiguous().unwrap();
    Batch { inputs: cut(&batch.inputs), targets: cut(&batch.targets) }
}

// ------------------------------------------------------------------------------------------ harness

/// Runs `body(rank, transport, done)` on one thread per rank; results in rank order. Panics if a
/// rank panics or the whole run exceeds `TEST_TIMEOUT`.
///
/// A rank that drops its engine drops its transport, which peers see as a lost peer, even when
/// they still only have to read frames it already sent; so bodies that finish normally wait on
/// `done` (an out-of-band barrier) before dropping their engine.
fn run_ranks<R: Send + 'static>(transports: Vec<InProcessTransport>, body: impl Fn(usize, InProcessTransport, &Barrier) -> R + Send + Sync + 'static) -> Vec<R> {
    let n = transports.len();
    let body = Arc::new(body);
    let done = Arc::new(Barrier::new(n));
    let (tx, rx) = mpsc::channel();
    for (rank, transport) in transports.into_iter().enumerate() {
        let (tx, body, done) = (tx.clone(), Arc::clone(&body), Arc::clone(&done));
        std::thread::Builder::new()
            .name(format!("rank-{rank}"))
            .spawn(move || {
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(rank, transport, &done)));
                let _ = tx.send((rank, result));
            })
            .unwrap();
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

/// A `connect` closure forming the world group over `transport`.
fn connect(transport: InProcessTransport, config: CommConfig) -> impl FnOnce() -> rtx_collectives::Result<rtx_collectives::Communicator> + Send + 'static {
    move || {
        let transport: Arc<dyn Transport> = Arc::new(transport);
        Endpoint::new(transport, config)?.world()
    }
}

fn comm_config(n_ranks: usize) -> CommConfig {
    let base = CommConfig { op_timeout: Duration::from_secs(20), ..CommConfig::default() };
    if n_ranks >= 4 {
        // Ring all-reduce in small pipelined frames (the default picks recursive doubling here).
        CommConfig { small_message_bytes: 0, chunk_bytes: Some(256), ..base }
    } else {
        base
    }
}

/// What one step of a run leaves behind.
struct StepRecord {
    /// Every parameter after the step, in visit order.
    params: Vec<Vec<f32>>,
    /// The gradients the optimizer used: `(name, elements of the flattened parameter, values)`.
    grads: Vec<(String, std::ops::Range<usize>, Vec<f32>)>,
    /// Single process only: per element, the smallest gradient RMS AdamW has divided by so far
    /// (`√v̂`, bias-corrected second moment; an error made at one step persists).
    grad_rms: Vec<Vec<f32>>,
}

/// One process, the whole global batch each step: the reference trajectory.
fn single_process(kind: Kind, seed: u64, rows: usize) -> Vec<StepRecord> {
    let model = Model::new(kind, seed);
    let mut opt = AdamW::with_decay_filter(model.named_parameters(), ADAMW, |_, p| decay("", p.shape())).unwrap();
    let mut min_rms: Option<Vec<Vec<f32>>> = None;
    (0..STEPS)
        .map(|step| {
            opt.zero_grad().unwrap();
            model.loss(&global_batch(kind, seed, step, rows)).unwrap().backward().unwrap();
            let grads = model.named_parameters().into_iter().map(|(name, p)| (name, 0..p.numel(), p.grad().unwrap().to_f32_vec().unwrap())).collect();
            opt.step().unwrap();
            let correction = 1.0 - ADAMW.beta2.powi(step as i32 + 1);
            let rms: Vec<Vec<f32>> = opt
                .state_tensors()
                .unwrap()
                .into_iter()
                .filter(|(name, _)| name.ends_with(".exp_avg_sq"))
                .map(|(_, v)| v.to_f32_vec().unwrap().into_iter().map(|v| (f64::from(v) / correction).sqrt() as f32).collect())
                .collect();
            let grad_rms = match min_rms.take() {
                None => rms,
                Some(prev) => prev.iter().zip(&rms).map(|(a, b)| a.iter().zip(b).map(|(x, y)| x.min(*y)).collect()).collect(),
            };
            min_rms = Some(grad_rms.clone());
            StepRecord { params: model.snapshot(), grads, grad_rms }
        })
        .collect()
}

/// `n_ranks` ranks of `rows_per_rank` each: every rank's record of every step.
fn data_parallel(kind: Kind, seed: u64, n_ranks: usize, rows_per_rank: usize, sharding: Sharding, bucket_bytes_max: usize) -> Vec<Vec<StepRecord>> {
    let (_net, transports) = InProcessNetwork::new(n_ranks);
    run_ranks(transports, move |rank, transport, done| {
        // Different initialisations on purpose: the engine starts from rank 0's parameters.
        let model = Model::new(kind, seed + rank as u64);
        let config = DpConfig { bucket_bytes_max, sharding, ..DpConfig::default() };
        let mut dp = DataParallel::new(model, config, connect(transport, comm_config(n_ranks)), adamw(ADAMW, decay)).unwrap();
        assert!(dp.buckets().buckets().len() >= 2, "the test wants several buckets");
        let trajectory = (0..STEPS)
            .map(|step| {
                let batch = local_slice(&global_batch(kind, seed, step, n_ranks * rows_per_rank), rank, rows_per_rank);
                let stats = dp.step(|m| m.loss(&batch)).unwrap();
                assert_eq!((stats.step, stats.flushed_buckets), (step, 0));
                let grads = dp.param_slices().iter().map(|s| (s.name.clone(), s.elements.clone(), s.tensor.grad().unwrap().to_f32_vec().unwrap())).collect();
                StepRecord { params: dp.model().snapshot(), grads, grad_rms: Vec::new() }
            })
            .collect();
        done.wait();
        trajectory
    })
}

/// Largest |distributed − single-process| gradient difference allowed, relative to the largest
/// |gradient| of the step. Measured over 40 seeds: at most 3.6e-6.
const GRAD_REL_TOLERANCE: f64 = 2e-5;

/// AdamW moves an element by `lr · m̂ / (√v̂ + ε)`, so an absolute gradient error δ becomes an
/// update error of about `lr · δ / √v̂`: the smaller an element's gradient, the more AdamW
/// magnifies rounding. Elements whose gradient RMS `√v̂` fell below this are ill-conditioned and
/// only held to a sanity bound. Among them are gradients that are exactly zero in exact
/// arithmetic and pure rounding noise in floating point (the key part of attention's `qkv.bias`:
/// softmax ignores a shift shared by all scores of a query).
const GRAD_RMS_MIN: f32 = 1e-7;

/// Parameter differences between a data-parallel run and the reference.
#[derive(Debug, Default)]
struct Diff {
    /// max |dp − single| over well-conditioned elements.
    max: f64,
    /// max |single| over all elements (the parameter scale).
    scale: f64,
    /// max |dp − single| over ill-conditioned elements.
    ill_max: f64,
    /// Number of ill-conditioned elements, and of all elements.
    ill: usize,
    total: usize,
}

fn param_diff(dp: &[Vec<f32>], reference: &StepRecord) -> Diff {
    let mut d = Diff::default();
    for ((x, y), rms) in dp.iter().zip(&reference.params).zip(&reference.grad_rms) {
        assert_eq!((x.len(), y.len()), (rms.len(), rms.len()));
        for ((&p, &q), &r) in x.iter().zip(y).zip(rms) {
            let e = f64::from((p - q).abs());
            if r < GRAD_RMS_MIN {
                d.ill += 1;
                d.ill_max = d.ill_max.max(e);
            } else {
                d.max = d.max.max(e);
            }
            d.scale = d.scale.max(f64::from(q.abs()));
            d.total += 1;
        }
    }
    d
}

/// max |dp − single| over the gradient elements the ranks hold (each rank's slices, all ranks
/// together covering every element), max |single gradient|, and how many elements were compared.
fn grad_diff(ranks: &[&StepRecord], reference: &StepRecord) -> (f64, f64, usize) {
    let full: std::collections::BTreeMap<&str, &Vec<f32>> = reference.grads.iter().map(|(n, _, g)| (n.as_str(), g)).collect();
    let scale = full.values().flat_map(|g| g.iter()).map(|g| f64::from(g.abs())).fold(0.0, f64::max);
    let (mut max, mut n) = (0f64, 0);
    for rank in ranks {
        for (name, elements, g) in &rank.grads {
            for (&a, &b) in g.iter().zip(&full[name.as_str()][elements.clone()]) {
                max = max.max(f64::from((a - b).abs()));
                n += 1;
            }
        }
    }
    (max, scale, n)
}

/// max |a − b|.
fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    a.iter().flatten().zip(b.iter().flatten()).map(|(&p, &q)| f64::from((p - q).abs())).fold(0.0, f64::max)
}

fn bits(snapshot: &[Vec<f32>]) -> Vec<Vec<u32>> {
    snapshot.iter().map(|v| v.iter().map(|x| x.to_bits()).collect()).collect()
}

/// Runs replicated and ZeRO-1 data parallelism over `n_ranks` and checks both against one process.
fn check_equivalence(kind: Kind, n_ranks: usize, bucket_bytes_max: usize) {
    let seed = seed();
    let rows_per_rank = 3;
    let initial = Model::new(kind, seed).snapshot();
    let n_elements: usize = initial.iter().map(Vec::len).sum();
    let reference = single_process(kind, seed, n_ranks * rows_per_rank);
    let replicated = data_parallel(kind, seed, n_ranks, rows_per_rank, Sharding::Replicated, bucket_bytes_max);
    let zero1 = data_parallel(kind, seed, n_ranks, rows_per_rank, Sharding::Zero1, bucket_bytes_max);
    let zero2 = data_parallel(kind, seed, n_ranks, rows_per_rank, Sharding::Zero2, bucket_bytes_max);
    for (sharding, ranks) in [(Sharding::Replicated, &replicated), (Sharding::Zero1, &zero1), (Sharding::Zero2, &zero2)] {
        for step in 0..STEPS as usize {
            let case = format!("{kind:?} N={n_ranks} {sharding:?} step {step}");
            for (rank, trajectory) in ranks.iter().enumerate().skip(1) {
                assert!(bits(&trajectory[step].params) == bits(&ranks[0][step].params), "{case}: rank {rank} differs from rank 0");
            }
            let owned: Vec<&StepRecord> = match sharding {
                Sharding::Replicated => vec![&ranks[0][step]],
                Sharding::Zero1 | Sharding::Zero2 => ranks.iter().map(|r| &r[step]).collect(),
            };
            let (grad_max, grad_scale, compared) = grad_diff(&owned, &reference[step]);
            assert_eq!(compared, n_elements, "{case}: the ranks' gradient slices cover every element once");
            let d = param_diff(&ranks[0][step].params, &reference[step]);
            let moved = max_abs_diff(&reference[step].params, &initial);
            eprintln!(
                "{case}: grads max |dp - single| {grad_max:.2e} = {:.2e} x grad scale; params max |dp - single| {:.2e} = {:.2e} x param scale {:.2e}; \
                 ill-conditioned {}/{} up to {:.2e}; params moved up to {moved:.2e}",
                grad_max / grad_scale,
                d.max,
                d.max / d.scale,
                d.scale,
                d.ill,
                d.total,
                d.ill_max
            );
            assert!(grad_max <= GRAD_REL_TOLERANCE * grad_scale, "{case}: gradient diff {grad_max:e} over {GRAD_REL_TOLERANCE} x scale {grad_scale:e}");
            assert!(d.max <= REL_TOLERANCE * d.scale, "{case}: parameter diff {:e} over {REL_TOLERANCE} x scale {:e}", d.max, d.scale);
            assert!(moved > 1e2 * d.max, "{case}: the comparison must not be vacuous (parameters moved {moved:e})");
            assert!(d.ill * 20 < d.total, "{case}: too many ill-conditioned elements to call this a test ({}/{})", d.ill, d.total);
            // Each AdamW step moves an element by about lr at most.
            assert!(d.ill_max <= ADAMW.lr * (step + 1) as f64, "{case}: ill-conditioned elements differ by {:e}", d.ill_max);
        }
    }
    // Replicated all_reduce and ZeRO-1 reduce_scatter sum in the same (ring) order in these
    // configurations, and AdamW is elementwise, so sharding changes no bit.
    for step in 0..STEPS as usize {
        assert!(bits(&replicated[0][step].params) == bits(&zero1[0][step].params), "{kind:?} N={n_ranks} step {step}: ZeRO-1 differs from replicated");
        assert!(bits(&zero2[0][step].params) == bits(&zero1[0][step].params), "{kind:?} N={n_ranks} step {step}: ZeRO-2 differs from ZeRO-1");
    }
}

// ------------------------------------------------------------------------------------------ equivalence

// Goal: DP over N ranks equals one process on the concatenated batch, replicas bit-identical.
// Method: four AdamW steps; compare every step against the single-process trajectory.
#[test]
fn equivalence_mlp() {
    for n in [2, 4] {
        check_equivalence(Kind::Mlp, n, 1024);
    }
}

// Goal: as `equivalence_mlp` on a tiny GPT (tied embeddings: one parameter used by two ops,
// finished last by backward; layer norms; attention).
#[test]
fn equivalence_gpt() {
    for n in [2, 4] {
        check_equivalence(Kind::Gpt, n, 8 << 10);
    }
}

// Goal: channels (`CommConfig::channels`) on a multi-thread communication runtime
// (`DpConfig::comm_threads`) keep replicas bit-identical, and the threads change no bit: the sums
// depend on the channel count only. Method: 2 and 3 ranks, replicated, the ring in 256-byte frames
// so buckets of 1-2 KiB split into 2 rings; each rank records its communication runtime's
// flavour and threads and how many of its buckets are split, and runs are compared step by step:
// 2 channels on 2 threads twice, 2 channels joined on one thread, and one ring.
#[test]
fn channels_on_comm_threads_keep_replicas_identical_and_deterministic() {
    let seed = seed();
    for n_ranks in [2, 3] {
        let threaded = data_parallel_channels(seed, n_ranks, 2, 2);
        let again = data_parallel_channels(seed, n_ranks, 2, 2);
        let joined = data_parallel_channels(seed, n_ranks, 1, 2);
        let one_ring = data_parallel_channels(seed, n_ranks, 1, 1);
        for step in 0..STEPS as usize {
            let case = format!("N={n_ranks} step {step}");
            for run in [&threaded, &again, &joined, &one_ring] {
                for (rank, trajectory) in run.iter().enumerate().skip(1) {
                    assert!(bits(&trajectory[step]) == bits(&run[0][step]), "{case}: rank {rank} differs from rank 0");
                }
            }
            assert!(bits(&again[0][step]) == bits(&threaded[0][step]), "{case}: two runs with 2 channels on 2 threads differ");
            assert!(bits(&joined[0][step]) == bits(&threaded[0][step]), "{case}: 2 channels on one thread differ from 2 threads");
            // Against one ring only the summation order differs.
            let scale = threaded[0][step].iter().flatten().map(|p| f64::from(p.abs())).fold(0.0, f64::max);
            let diff = max_abs_diff(&threaded[0][step], &one_ring[0][step]);
            assert!(diff <= REL_TOLERANCE * scale, "{case}: 2 channels differ from one ring by {diff:e} (scale {scale:e})");
        }
    }
}

/// `n_ranks` replicated ranks of the MLP, their engines' communication runtime on `comm_threads`
/// threads and their communicators splitting large all-reduces into up to `channels` rings: every
/// rank's parameters after every step. Checks on every rank that the runtime and the split are
/// the ones asked for.
fn data_parallel_channels(seed: u64, n_ranks: usize, comm_threads: usize, channels: usize) -> Vec<Vec<Vec<Vec<f32>>>> {
    let (_net, transports) = InProcessNetwork::new(n_ranks);
    run_ranks(transports, move |rank, transport, done| {
        let model = Model::new(Kind::Mlp, seed + rank as u64);
        let config = DpConfig { bucket_bytes_max: 1024, comm_threads, ..DpConfig::default() };
        let comm = CommConfig { op_timeout: Duration::from_secs(20), small_message_bytes: 0, chunk_bytes: Some(256), channels: Some(channels), ..CommConfig::default() };
        // What `connect` saw on the communication thread: its runtime, and the communicator.
        let seen = Arc::new(std::sync::Mutex::new(None));
        let formed = {
            let seen = Arc::clone(&seen);
            move || {
                let metrics = tokio::runtime::Handle::current().metrics();
                let flavor = tokio::runtime::Handle::current().runtime_flavor();
                let comm = connect(transport, comm)()?;
                *seen.lock().unwrap() = Some((flavor, metrics.num_workers(), comm.clone()));
                Ok(comm)
            }
        };
        let mut dp = DataParallel::new(model, config, formed, adamw(ADAMW, decay)).unwrap();
        let (flavor, workers, comm) = seen.lock().unwrap().take().unwrap();
        let expected = if comm_threads > 1 { tokio::runtime::RuntimeFlavor::MultiThread } else { tokio::runtime::RuntimeFlavor::CurrentThread };
        assert_eq!((flavor, workers), (expected, comm_threads), "rank {rank}: the communication runtime");
        let split = dp.buckets().buckets().iter().filter(|b| comm.all_reduce_channels(b.numel() * 4) == channels).count();
        assert!(split >= 1, "rank {rank}: no bucket is split into {channels} channels");
        drop(comm);
        let trajectory = (0..STEPS)
            .map(|step| {
                let batch = local_slice(&global_batch(Kind::Mlp, seed, step, n_ranks * 3), rank, 3);
                dp.step(|m| m.loss(&batch)).unwrap();
                dp.model().snapshot()
            })
            .collect();
        done.wait();
        trajectory
    })
}

// Goal: ZeRO-1 owned segments tile every bucket, split as the collectives split them, and the
// optimizer holds state only for this rank's part. Method: a 3-rank group (uneven splits).
#[test]
fn zero1_segments_tile_buckets() {
    let (_net, transports) = InProcessNetwork::new(3);
    let out = run_ranks(transports, |rank, transport, done| {
        let config = DpConfig { bucket_bytes_max: 1024, sharding: Sharding::Zero1, ..DpConfig::default() };
        let dp = DataParallel::new(Model::new(Kind::Mlp, 7), config, connect(transport, comm_config(3)), adamw(ADAMW, decay)).unwrap();
        let state: usize = dp.optimizer().parameters().iter().map(|(_, t)| t.numel()).sum();
        let sizes: Vec<usize> = dp.buckets().buckets().iter().map(|b| b.numel()).collect();
        done.wait();
        (rank, dp.owned_segments().unwrap(), state, sizes)
    });
    let sizes = &out[0].3;
    for (bucket, &numel) in sizes.iter().enumerate() {
        let mut next = 0;
        for (rank, segments, _, _) in &out {
            let segment = &segments[bucket];
            assert_eq!(*segment, rtx_collectives::segment_range(numel, 3, *rank));
            assert_eq!(segment.start, next);
            next = segment.end;
        }
        assert_eq!(next, numel);
    }
    let total: usize = out.iter().map(|o| o.2).sum();
    assert_eq!(total, sizes.iter().sum::<usize>(), "optimizer state is partitioned, not replicated");
}

// ------------------------------------------------------------------------------------------ overlap

/// Two layers with a gate between them whose backward waits until the engine has begun a bucket
/// collective: backward cannot finish unless communication overlaps it.
struct Gated {
    l1: Linear,
    l2: Linear,
}

impl Module for Gated {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        self.l1.visit_params(&format!("{prefix}l1"), f);
        self.l2.visit_params(&format!("{prefix}l2"), f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        self.l1.visit_params_mut(&format!("{prefix}l1"), f);
        self.l2.visit_params_mut(&format!("{prefix}l2"), f);
    }
}

// Goal: at least one bucket's all-reduce starts before backward finishes, for a model with ≥ 2
// buckets. Method: the last bucket in backward order (l1) sits behind a gate op whose backward
// blocks until the communication thread has begun a collective; the step succeeds only if bucket 0
// (l2) was handed over mid-backward. Also read the engine's own count of overlapped buckets.
#[test]
fn bucket_all_reduce_overlaps_backward() {
    let (_net, transports) = InProcessNetwork::new(2);
    let out = run_ranks(transports, |_rank, transport, done| {
        let mut rng = Generator::new(3);
        let model = Gated { l1: Linear::new(64, 32, true, DType::F32, &mut rng).unwrap(), l2: Linear::new(32, 16, true, DType::F32, &mut rng).unwrap() };
        // Bucket 0: l2.bias + l2.weight (2112 bytes); l1.bias and l1.weight go to later buckets.
        let config = DpConfig { bucket_bytes_max: 2200, ..DpConfig::default() };
        let mut dp = DataParallel::new(model, config, connect(transport, comm_config(2)), adamw(ADAMW, decay)).unwrap();
        let names = |b: usize| dp.buckets().buckets()[b].entries().iter().map(|&e| dp.buckets().entries()[e].name.clone()).collect::<Vec<_>>();
        assert_eq!(names(0), ["l2.bias", "l2.weight"]);
        assert!(dp.buckets().buckets().len() >= 2);
        let monitor = dp.monitor();
        let mut overlapped = Vec::new();
        for step in 0..3 {
            let x = Tensor::randn(&[4, 64], 0.0, 1.0, DType::F32, &mut Generator::with_stream(5, step)).unwrap();
            let before = monitor.collectives_started();
            let gate_monitor = monitor.clone();
            let stats = dp
                .step(|m| {
                    let h = m.l1.forward(&x)?;
                    let gated = Tensor::from_op(FloatVec::F32(h.to_f32_vec()?), h.shape(), h.dtype(), "gate", &[&h], move |g: &Tensor, _: &Tensor| {
                        let deadline = Instant::now() + Duration::from_secs(20);
                        while gate_monitor.collectives_started() == before {
                            if Instant::now() > deadline {
                                return Err(rtx_tensor::Error::InvalidArgument { op: "gate", reason: "no bucket collective began during backward".into() });
                            }
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        assert!(gate_monitor.backward_running());
                        Ok(vec![Some(g.clone())])
                    })?;
                    m.l2.forward(&gated.relu()?)?.square()?.mean_all()
                })
                .unwrap();
            overlapped.push(stats.overlapped_buckets);
        }
        done.wait();
        (overlapped, monitor.started_during_backward())
    });
    for (overlapped, during) in out {
        eprintln!("overlapped buckets per step {overlapped:?}, collectives begun during backward {during}");
        assert!(overlapped.iter().all(|&n| n >= 1));
        assert!(during >= 3);
    }
}

// ------------------------------------------------------------------------------------------ failure

/// How a rank's training loop ended.
#[derive(Debug)]
struct Ending {
    failed_at: u64,
    error: String,
    after_failure: Option<Error>,
    since_fault: Duration,
}

// Goal: a peer cut off in the middle of a step makes every rank's step fail (no hang), promptly:
// well within the communicator's op_timeout. Method: 4 ranks; rank 2 cuts itself off from inside
// the forward of step 2; every rank steps until one fails (step 2, or step 1 for a rank still
// finishing step 1's collectives), and must then be refused (`Broken`).
#[test]
fn peer_lost_mid_step_fails_every_rank() {
    let op_timeout = Duration::from_secs(10);
    let (net, transports) = InProcessNetwork::new(4);
    let fault_at = Arc::new(std::sync::OnceLock::<Instant>::new());
    let fault = Arc::clone(&fault_at);
    let started = Instant::now();
    let endings = run_ranks(transports, move |rank, transport, done| {
        let config = DpConfig { bucket_bytes_max: 1024, ..DpConfig::default() };
        let comm = CommConfig { op_timeout, ..comm_config(4) };
        let mut dp = DataParallel::new(Model::new(Kind::Mlp, 1), config, connect(transport, comm), adamw(ADAMW, decay)).unwrap();
        for step in 0..50 {
            let batch = local_slice(&global_batch(Kind::Mlp, 1, step, 8), rank, 2);
            let (net, fault) = (net.clone(), Arc::clone(&fault));
            let result = dp.step(|m| {
                if rank == 2 && step == 2 {
                    let _ = fault.set(Instant::now());
                    net.disconnect(2);
                }
                m.loss(&batch)
            });
            if let Err(e) = result {
                let since_fault = fault.get().map(|t| t.elapsed()).unwrap_or_default();
                let after_failure = dp.step(|m| m.loss(&batch)).err();
                // Keep this rank's transport up until every rank has failed, so the only loss any
                // rank sees is rank 2's.
                done.wait();
                return Ending { failed_at: step, error: e.to_string(), after_failure, since_fault };
            }
        }
        panic!("rank {rank} never failed");
    });
    assert!(fault_at.get().is_some());
    for (rank, ending) in endings.iter().enumerate() {
        eprintln!("rank {rank}: {ending:?}");
        assert!(ending.failed_at == 1 || ending.failed_at == 2, "rank {rank} failed at step {}", ending.failed_at);
        assert!(ending.since_fault < op_timeout, "rank {rank} took {:?} to fail", ending.since_fault);
        // The others see rank 2 lost; rank 2 sees its transport closed or every peer lost.
        let named = if rank == 2 { ending.error.contains("transport closed") || ending.error.contains("peer rank") } else { ending.error.contains("peer rank 2 lost") };
        assert!(named, "rank {rank}: {}", ending.error);
        assert!(matches!(ending.after_failure, Some(Error::Broken { failed_step }) if failed_step == ending.failed_at));
    }
    assert!(started.elapsed() < TEST_TIMEOUT);
}

// Goal: a peer that stays connected but stops stepping makes the others fail with a timeout within
// a small multiple of op_timeout instead of waiting for ever. Method: 3 ranks, rank 2 leaves after
// step 1 while keeping its engine (and transport) alive until the others have failed.
#[test]
fn silent_peer_times_out() {
    let op_timeout = Duration::from_millis(500);
    let (_net, transports) = InProcessNetwork::new(3);
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let release_rx = Arc::new(std::sync::Mutex::new(release_rx));
    let release_tx = Arc::new(std::sync::Mutex::new(Some(release_tx)));
    let (failed_tx, failed_rx) = mpsc::channel::<()>();
    let failed_tx = Arc::new(std::sync::Mutex::new(failed_tx));
    // Releases the silent rank once both others have failed.
    std::thread::spawn(move || {
        for _ in 0..2 {
            if failed_rx.recv_timeout(TEST_TIMEOUT).is_err() {
                break;
            }
        }
        if let Some(tx) = release_tx.lock().unwrap().take() {
            let _ = tx.send(());
        }
    });
    let endings = run_ranks(transports, move |rank, transport, _| {
        let config = DpConfig { bucket_bytes_max: 1024, ..DpConfig::default() };
        let comm = CommConfig { op_timeout, ..comm_config(3) };
        let mut dp = DataParallel::new(Model::new(Kind::Mlp, 1), config, connect(transport, comm), adamw(ADAMW, decay)).unwrap();
        for step in 0..50 {
            if rank == 2 && step == 2 {
                let _ = release_rx.lock().unwrap().recv_timeout(TEST_TIMEOUT);
                return None;
            }
            let batch = local_slice(&global_batch(Kind::Mlp, 1, step, 6), rank, 2);
            let began = Instant::now();
            if let Err(e) = dp.step(|m| m.loss(&batch)) {
                let _ = failed_tx.lock().unwrap().send(());
                return Some((step, e, began.elapsed()));
            }
        }
        panic!("rank {rank} never failed");
    });
    for (rank, ending) in endings.iter().enumerate().take(2) {
        let (step, error, took) = ending.as_ref().unwrap();
        eprintln!("rank {rank}: step {step} failed after {took:?}: {error}");
        assert_eq!(*step, 2);
        assert!(matches!(error, Error::Collective { source: rtx_collectives::Error::Timeout { .. }, .. } | Error::Collective { source: rtx_collectives::Error::PeerLost { .. }, .. }), "rank {rank}: {error}");
        assert!(*took < 4 * op_timeout, "rank {rank} took {took:?}");
    }
}

// ------------------------------------------------------------------------------------------ misuse

// Goal: clear errors for misuse, and an engine that refuses to go on after a failed step.
// Method: a one-rank group.
#[test]
fn misuse_is_refused() {
    let (_net, transports) = InProcessNetwork::new(1);
    run_ranks(transports, |_, transport, _| {
        let bad = DpConfig { queue_depth: 0, ..DpConfig::default() };
        let err = DataParallel::new(Model::new(Kind::Mlp, 0), bad, || unreachable!(), adamw(ADAMW, decay)).unwrap_err();
        assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
        for comm_threads in [0, 17] {
            let bad = DpConfig { comm_threads, ..DpConfig::default() };
            let err = DataParallel::new(Model::new(Kind::Mlp, 0), bad, || unreachable!(), adamw(ADAMW, decay)).unwrap_err();
            assert!(matches!(err, Error::InvalidConfig { reason } if reason.contains("comm_threads")), "comm_threads = {comm_threads}");
        }

        // An optimizer over tensors the engine did not hand out.
        let stray = Tensor::zeros(&[3], DType::F32).requires_grad(true);
        let err = DataParallel::new(Model::new(Kind::Mlp, 0), DpConfig::default(), connect(transport, CommConfig::default()), move |_: &[rtx_pipelines::ParamSlice]| AdamW::new(vec![("stray".into(), stray)], ADAMW)).unwrap_err();
        assert!(matches!(&err, Error::ForeignOptimizerParam { name } if name == "stray"), "{err}");
    });
    let (_net, transports) = InProcessNetwork::new(1);
    run_ranks(transports, |_, transport, _| {
        let mut dp = DataParallel::new(Model::new(Kind::Mlp, 0), DpConfig::default(), connect(transport, CommConfig::default()), adamw(ADAMW, decay)).unwrap();
        let err = dp.step(|_| Ok(Tensor::zeros(&[2], DType::F32))).unwrap_err();
        assert!(matches!(err, Error::NonScalarLoss { .. }), "{err}");
        assert!(matches!(dp.step(|_| unreachable!()), Err(Error::Broken { failed_step: 0 })));
    });
}

// Goal: a step runs on a thread that has a tokio runtime handle entered, as `spawn_blocking`
// threads do (tokio's own `blocking_send` would be fine there too, but must not be refused).
#[test]
fn step_runs_on_a_blocking_pool_thread() {
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let (_net, mut transports) = InProcessNetwork::new(1);
    let transport = transports.remove(0);
    let stats = runtime
        .block_on(async {
            tokio::task::spawn_blocking(move || {
                let mut dp = DataParallel::new(Model::new(Kind::Mlp, 0), DpConfig::default(), connect(transport, CommConfig::default()), adamw(ADAMW, decay)).unwrap();
                let batch = global_batch(Kind::Mlp, 0, 0, 4);
                dp.step(|m| m.loss(&batch)).unwrap()
            })
            .await
        })
        .unwrap();
    assert_eq!(stats.step, 0);
}

// Goal: buckets holding parameters the loss never used are still reduced (after backward, with
// zero gradients), so every rank issues the same collectives. Method: skip the first layer.
#[test]
fn unused_parameters_are_flushed() {
    let (_net, transports) = InProcessNetwork::new(2);
    let out = run_ranks(transports, |rank, transport, done| {
        let mut rng = Generator::new(4);
        let model = Gated { l1: Linear::new(64, 32, true, DType::F32, &mut rng).unwrap(), l2: Linear::new(32, 16, true, DType::F32, &mut rng).unwrap() };
        let config = DpConfig { bucket_bytes_max: 2200, ..DpConfig::default() };
        let mut dp = DataParallel::new(model, config, connect(transport, comm_config(2)), adamw(ADAMW, decay)).unwrap();
        let l1_before = dp.model().l1.weight.to_f32_vec().unwrap();
        let mut stats = Vec::new();
        for step in 0..2 {
            let x = Tensor::randn(&[4, 32], 0.0, 1.0, DType::F32, &mut Generator::with_stream(rank as u64, step)).unwrap();
            stats.push(dp.step(|m| m.l2.forward(&x)?.square()?.mean_all()).unwrap());
        }
        let l1_grad = dp.model().l1.weight.grad().unwrap().to_f32_vec().unwrap();
        assert!(l1_grad.iter().all(|&g| g == 0.0));
        // Unused, so only weight decay moved l1: p ← p·(1 − lr·λ) per step.
        let decayed: Vec<f32> = l1_before.iter().map(|&p| p * (1.0 - (ADAMW.lr * ADAMW.weight_decay) as f32) * (1.0 - (ADAMW.lr * ADAMW.weight_decay) as f32)).collect();
        assert_eq!(dp.model().l1.weight.to_f32_vec().unwrap(), decayed);
        done.wait();
        (stats, dp.model().l2.weight.to_f32_vec().unwrap())
    });
    for (stats, _) in &out {
        assert!(stats.iter().all(|s| s.n_buckets >= 2 && s.flushed_buckets == s.n_buckets - 1), "{stats:?}");
    }
    assert_eq!(out[0].1, out[1].1);
}
