//! ZeRO-1 and ZeRO-2 on staged parameters (`DpConfig::host_staging`, the path of parameters on a
//! GPU): gradients are downloaded into the host mirror and reduce-scattered into this rank's
//! `ParamShard` landing segments; the shard's slices, optimizer and optimizer state live where
//! the parameters are (`ParamShard::new_on`), and the updated segments are all-gathered through
//! the mirror and installed into the module. On the CPU every transfer is exact, so the staged
//! engine must give the host-bucket ZeRO-1 engine's parameter bits after every step.
//!
//! Checked: bit-identity with host ZeRO-1 (and ZeRO-2 staged with host ZeRO-1) at 1-3 ranks, f32
//! and bf16 models with a parameter the loss never uses, with and without gradient clipping (a
//! bound active on every step); the shard holds `1/n` of the optimizer state (its AdamW moments
//! cover exactly its owned segments, and the ranks' segments tile the model once); under ZeRO-2
//! no parameter keeps a gradient and the mirror no flat gradient between steps; the staged
//! shard's export equals the host shard's, and a staged shard's export imported into a fresh
//! staged shard and into a host shard continues bit-identically.
//!
//! Method: ranks are threads with real communicators over the in-process transport; the same
//! seeds for every engine; different initial parameters per rank (the opening broadcast must
//! make them rank 0's).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::{Arc, Barrier};
use std::time::Duration;

use support::{bits, loss, with_unused, WithUnused};

use rtx_collectives::{CommConfig, Endpoint, InProcessNetwork, Transport};
use rtx_pipelines::{adamw, DataParallel, DpConfig, ParamShard, ParamSlice, ShardState, Sharding};
use rtx_tensor::nn::Module;
use rtx_tensor::optim::{AdamW, AdamWConfig, ParamBuckets};
use rtx_tensor::{CpuData, DType, Device, Generator, Optimizer, Tensor};

const STEPS: u64 = 4;
const ADAMW: AdamWConfig = AdamWConfig { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };
/// Small enough to clip on every step of these runs.
const CLIP: f64 = 0.05;

fn decay(_name: &str, shape: &[usize]) -> bool {
    shape.len() >= 2
}

/// One engine's configuration in these runs.
#[derive(Clone, Copy, Debug)]
struct Run {
    sharding: Sharding,
    host_staging: bool,
    dtype: DType,
    clip: Option<f64>,
}

/// What a rank saw: parameter bits after every step, gradient norms, and its shard's export.
struct RankOut {
    bits: Vec<Vec<u32>>,
    norms: Vec<Option<f64>>,
    export: Option<ShardState>,
}

/// Trains `run` at `ranks` ranks, each rank on its own thread; results in rank order. Between
/// steps, checks what a rank holds (see the module doc).
fn train(ranks: usize, run: Run) -> Vec<RankOut> {
    let (_net, transports) = InProcessNetwork::new(ranks);
    let done = Arc::new(Barrier::new(ranks));
    let handles: Vec<_> = transports
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let done = Arc::clone(&done);
            std::thread::spawn(move || {
                let connect = move || {
                    Endpoint::new(Arc::new(t) as Arc<dyn Transport>, CommConfig { op_timeout: Duration::from_secs(20), ..CommConfig::default() })?.world()
                };
                let config = DpConfig {
                    bucket_bytes_max: 512,
                    collective_timeout: Duration::from_secs(20),
                    sharding: run.sharding,
                    host_staging: run.host_staging,
                    grad_clip: run.clip,
                    ..DpConfig::default()
                };
                let mut dp = DataParallel::new(with_unused(rank, run.dtype), config, connect, adamw(ADAMW, decay)).unwrap();
                assert_eq!(dp.params_in_place(), run.host_staging);
                let mut out = RankOut { bits: Vec::new(), norms: Vec::new(), export: None };
                for step in 0..STEPS {
                    let stats = dp.step(|m| loss(m, step, rank)).unwrap();
                    out.norms.push(stats.grad_norm);
                    out.bits.push(bits(dp.model()));
                    check_holdings(&dp, run, ranks);
                }
                out.export = dp.param_shard().map(|s| s.export().unwrap());
                done.wait();
                out
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// A rank's holdings between steps: under ZeRO its optimizer's moments cover exactly its owned
/// segments (1/n of the model); under staged ZeRO-2 no gradient outlives the step but the
/// landing segments.
fn check_holdings(dp: &DataParallel<WithUnused, AdamW>, run: Run, ranks: usize) {
    let Some(shard) = dp.param_shard() else { return };
    assert_eq!(shard.device(), Device::Cpu);
    let owned: usize = shard.segments().iter().map(|r| r.len()).sum();
    let moments: usize = dp.optimizer().state_tensors().unwrap().iter().filter(|(n, _)| !n.ends_with(".step")).map(|(_, t)| t.numel()).sum();
    assert_eq!(moments, 2 * owned, "{run:?}: the optimizer's moments cover the owned segments only");
    let total: usize = dp.model().parameters().iter().map(Tensor::numel).sum();
    let expected: usize = dp.buckets().buckets().iter().map(|b| rtx_collectives::segment_range(b.numel(), ranks, dp.rank()).len()).sum();
    assert_eq!(owned, expected);
    assert!(owned <= total / ranks + dp.buckets().buckets().len(), "{run:?}: rank {} owns {owned} of {total}", dp.rank());
    let memory = dp.memory().unwrap();
    let size = run.dtype.size_in_bytes();
    if run.host_staging && run.sharding == Sharding::Zero2 {
        assert!(dp.model().parameters().iter().all(|p| p.grad().is_none()), "zero2: the parameters' gradients were released");
        assert!(dp.buckets().buckets().iter().all(|b| b.grad_storage().is_empty()), "zero2: the mirror keeps no flat gradient");
    }
    if run.host_staging {
        // The landing segments (1/n), the slices' uploaded gradients (1/n), and under ZeRO-1 the
        // mirror's flat gradients.
        let mirror = if run.sharding == Sharding::Zero1 { total * size } else { 0 };
        assert_eq!(memory.grads_bytes, mirror + 2 * owned * size, "{run:?}");
    }
}

fn shardings() -> [(Sharding, &'static str); 2] {
    [(Sharding::Zero1, "zero1"), (Sharding::Zero2, "zero2")]
}

// Goal: staged ZeRO-1/2 is host ZeRO-1, bit for bit, after every step on every rank, with the
// same clipping norms; the shard's export is the same state. Method: every combination of rank
// count, dtype and clipping, host-bucket ZeRO-1 as the reference.
#[test]
fn staged_zero_matches_host_zero1_bit_for_bit() {
    for ranks in [1, 2, 3] {
        for dtype in [DType::F32, DType::BF16] {
            for clip in [None, Some(CLIP)] {
                let reference = train(ranks, Run { sharding: Sharding::Zero1, host_staging: false, dtype, clip });
                for (sharding, name) in shardings() {
                    let staged = train(ranks, Run { sharding, host_staging: true, dtype, clip });
                    let what = format!("{ranks} rank(s), {dtype}, clip {clip:?}, staged {name}");
                    for (rank, (r, s)) in reference.iter().zip(&staged).enumerate() {
                        assert_eq!(r.bits, s.bits, "{what}: rank {rank}'s parameters differ from host zero1");
                        assert_eq!(r.norms, s.norms, "{what}: rank {rank}'s gradient norms differ");
                        let (re, se) = (r.export.as_ref().unwrap(), s.export.as_ref().unwrap());
                        assert_eq!((re.step, &re.segments), (se.step, &se.segments), "{what}");
                        assert_eq!(data_bits(&re.params), data_bits(&se.params), "{what}: exported parameter segments");
                        assert_eq!(state_bits(&re.optimizer), state_bits(&se.optimizer), "{what}: exported optimizer state");
                    }
                    for step in 0..STEPS as usize {
                        assert!(staged.iter().all(|r| r.bits[step] == staged[0].bits[step]), "{what}: replicas differ at step {step}");
                    }
                    assert_ne!(staged[0].bits[0], staged[0].bits[STEPS as usize - 1], "{what}: training moved the parameters");
                    if clip.is_some() {
                        assert!(staged[0].norms.iter().all(|n| n.is_some_and(|n| n > CLIP)), "{what}: the bound clipped every step: {:?}", staged[0].norms);
                    }
                }
            }
        }
    }
}

fn state_bits(state: &[(String, Tensor)]) -> Vec<(String, Vec<u64>)> {
    state.iter().map(|(n, t)| (n.clone(), t.to_f64_vec().unwrap().into_iter().map(f64::to_bits).collect())).collect()
}

/// The bits of host data (every dtype here widens to f64 exactly).
fn data_bits(data: &[CpuData]) -> Vec<Vec<u64>> {
    data.iter().map(|d| Tensor::from_data(d.clone(), &[d.len()]).unwrap().to_f64_vec().unwrap().into_iter().map(f64::to_bits).collect()).collect()
}

/// Rank `rank`'s averaged gradient segments of a made-up step (the same for every shard).
fn fake_grads(buckets: &ParamBuckets, rank: usize, n_ranks: usize, step: u64) -> Vec<CpuData> {
    buckets
        .buckets()
        .iter()
        .enumerate()
        .map(|(b, bucket)| {
            let own = rtx_collectives::segment_range(bucket.numel(), n_ranks, rank);
            let mut g = Generator::new(500 + step * 7 + b as u64);
            Tensor::randn(&[own.len()], 0.0, 0.1, bucket.dtype(), &mut g).unwrap().to_data().unwrap()
        })
        .collect()
}

// Goal: a staged shard's state (exported as host data) moves into a fresh staged shard and into
// a host shard, and both continue exactly as the uninterrupted staged shard; bad state is refused
// before anything changes. Method: `ParamShard::new_on(Device::Cpu, ..)` over a bf16 model's
// buckets, rank 1 of 2, gradients made up per step.
#[test]
fn staged_shard_state_round_trips() {
    let n_ranks = 2;
    let rank = 1;
    let mut m = with_unused(0, DType::BF16);
    let buckets = ParamBuckets::new(&mut m, 512).unwrap();
    let make = |slices: &[ParamSlice]| AdamW::new(rtx_pipelines::named_slices(slices), ADAMW);
    let mut whole = ParamShard::new_on(Device::Cpu, &buckets, rank, n_ranks, make).unwrap();
    assert_eq!(whole.device(), Device::Cpu);
    let mut outputs = Vec::new();
    for step in 0..4 {
        outputs.push(data_bits(&whole.apply(step, fake_grads(&buckets, rank, n_ranks, step)).unwrap()));
    }
    let mut first = ParamShard::new_on(Device::Cpu, &buckets, rank, n_ranks, make).unwrap();
    for step in 0..2 {
        assert_eq!(data_bits(&first.apply(step, fake_grads(&buckets, rank, n_ranks, step)).unwrap()), outputs[step as usize]);
    }
    let state = first.export().unwrap();
    assert_eq!(state.step, 2);
    assert!(state.params.iter().zip(&state.segments).all(|(p, r)| p.len() == r.len() && p.dtype() == DType::BF16), "host data, one segment per bucket");
    let mut staged = ParamShard::new_on(Device::Cpu, &buckets, rank, n_ranks, make).unwrap();
    let mut host = ParamShard::new(&buckets, rank, n_ranks, make).unwrap();
    // Refused before anything changes: the wrong layout.
    let mut wrong = state.clone();
    wrong.segments[0] = 0..1;
    assert!(staged.import(wrong).is_err());
    assert_eq!(staged.next_step(), 0);
    staged.import(state.clone()).unwrap();
    host.import(state).unwrap();
    for step in 2..4 {
        let grads = fake_grads(&buckets, rank, n_ranks, step);
        assert_eq!(data_bits(&staged.apply(step, grads.clone()).unwrap()), outputs[step as usize], "staged import, step {step}");
        assert_eq!(data_bits(&host.apply(step, grads).unwrap()), outputs[step as usize], "host import, step {step}");
    }
    assert_eq!(state_bits(&staged.export().unwrap().optimizer), state_bits(&whole.export().unwrap().optimizer));
}
