//! The `ParamShard` role as a spawned actor: it applies averaged gradient segments exactly as an
//! AdamW over the whole model would on its elements, refuses bad input (stale or skipped step,
//! wrong number of segments, wrong length, wrong dtype) with typed errors and no change, keeps
//! serving afterwards, and exports/imports its state so that an imported shard continues
//! bit-identically.
//!
//! Method: an MLP laid out in small buckets (several buckets, parameters cut across segment
//! boundaries). The reference is the same model's buckets updated by AdamW over whole parameters
//! with the full flat gradient; a shard of rank r of n gets that gradient's owned segment. Bits
//! are compared, not values within a tolerance: the arithmetic is the same element by element.
//! Gradients come from a seeded generator (`RTX_TEST_SEED` replays another seed).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ops::Range;
use std::time::Duration;

use rtx_actors::{ActorRef, Exit};
use rtx_pipelines::{adamw, Error, ParamShard, ParamShardMsg, ParamSlice, ShardState, PARAM_SHARD_MAILBOX};
use rtx_tensor::nn::{Activation, Mlp};
use rtx_tensor::optim::{AdamW, AdamWConfig, Optimizer, ParamBuckets};
use rtx_tensor::{CpuData, DType, Generator};

const ADAMW: AdamWConfig = AdamWConfig { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };
/// Small buckets: several per model, so segments cut parameters.
const BUCKET_BYTES: usize = 256;
const SIZES: [usize; 4] = [6, 9, 7, 4];
/// Bound on each test body.
const TEST_TIMEOUT: Duration = Duration::from_secs(60);

fn seed() -> u64 {
    let seed = std::env::var("RTX_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5EED_2026);
    eprintln!("RTX_TEST_SEED={seed}");
    seed
}

fn decay(_name: &str, shape: &[usize]) -> bool {
    shape.len() >= 2
}

/// A fresh model (always the same initial values) and its buckets.
fn model() -> (Mlp, ParamBuckets) {
    let mut model = Mlp::new(&SIZES, Activation::Gelu, DType::F32, &mut Generator::new(11)).unwrap();
    let buckets = ParamBuckets::new(&mut model, BUCKET_BYTES).unwrap();
    (model, buckets)
}

/// The reference: whole-model AdamW over the buckets' parameters, gradients bound to the buckets.
struct Reference {
    _model: Mlp,
    buckets: ParamBuckets,
    optimizer: AdamW,
}

impl Reference {
    fn new() -> Reference {
        let (model, buckets) = model();
        buckets.bind_grads().unwrap();
        let slices: Vec<ParamSlice> = buckets
            .named_parameters()
            .into_iter()
            .zip(buckets.entries())
            .map(|((name, tensor), entry)| ParamSlice { name, tensor, param_shape: entry.shape.clone(), elements: 0..entry.numel })
            .collect();
        let optimizer = adamw(ADAMW, decay)(&slices).unwrap();
        Reference { _model: model, buckets, optimizer }
    }

    /// One step with the full flat gradient of each bucket.
    fn step(&mut self, grads: &[Vec<f32>]) {
        for (bucket, grad) in self.buckets.buckets().iter().zip(grads) {
            *bucket.grad_storage().write().unwrap() = CpuData::F32(grad.clone().into());
        }
        self.optimizer.step().unwrap();
    }

    /// The parameters of bucket `b`'s range `own`.
    fn segment(&self, b: usize, own: Range<usize>) -> Vec<f32> {
        self.buckets.buckets()[b].params().to_f32_vec().unwrap()[own].to_vec()
    }
}

/// Full flat gradients of every bucket for `step`.
fn gradients(buckets: &ParamBuckets, seed: u64, step: u64) -> Vec<Vec<f32>> {
    let mut rng = Generator::with_stream(seed, step);
    buckets.buckets().iter().map(|b| (0..b.numel()).map(|_| rng.normal() as f32).collect()).collect()
}

/// This shard's segments of full gradients.
fn owned(grads: &[Vec<f32>], segments: &[Range<usize>]) -> Vec<CpuData> {
    grads.iter().zip(segments).map(|(g, own)| CpuData::F32(g[own.clone()].to_vec().into())).collect()
}

fn bits(data: &CpuData) -> Vec<u8> {
    data.as_bytes().to_vec()
}

/// A comparable fingerprint of a whole state.
#[derive(Debug, PartialEq)]
struct Fingerprint {
    step: u64,
    segments: Vec<Range<usize>>,
    params: Vec<Vec<u8>>,
    optimizer: Vec<(String, Vec<u8>)>,
}

/// The step, the segments, the parameter bits and the optimizer state bits.
fn fingerprint(state: &ShardState) -> Fingerprint {
    let optimizer = state.optimizer.iter().map(|(name, t)| (name.clone(), bits(&t.to_data().unwrap()))).collect();
    Fingerprint { step: state.step, segments: state.segments.clone(), params: state.params.iter().map(bits).collect(), optimizer }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn spawn_shard(rank: usize, n_ranks: usize) -> (ActorRef<ParamShardMsg>, rtx_actors::ActorHandle, Vec<Range<usize>>, Mlp) {
    let (model, buckets) = model();
    let shard = ParamShard::new(&buckets, rank, n_ranks, adamw(ADAMW, decay)).unwrap();
    let segments = shard.segments();
    let (shard_ref, handle) = rtx_actors::spawn(format!("param-shard-{rank}"), shard, PARAM_SHARD_MAILBOX);
    (shard_ref, handle, segments, model)
}

async fn apply(shard: &ActorRef<ParamShardMsg>, step: u64, grads: Vec<CpuData>) -> Result<Vec<CpuData>, Error> {
    shard.ask(|reply| ParamShardMsg::Apply { step, grads, reply }).await?
}

async fn export(shard: &ActorRef<ParamShardMsg>) -> ShardState {
    shard.ask(|reply| ParamShardMsg::Export { reply }).await.unwrap().unwrap()
}

async fn import(shard: &ActorRef<ParamShardMsg>, state: ShardState) -> Result<(), Error> {
    shard.ask(|reply| ParamShardMsg::Import { state, reply }).await?
}

// Goal: every rank's shard, fed its segment of the averaged gradient, returns exactly the bits a
// whole-model AdamW gives on those elements, over several steps and a learning-rate change; the
// segments of all ranks tile every bucket. Method: ranks of 2 and 3 against one reference.
#[test]
fn apply_matches_whole_model_adamw_on_the_owned_segments() {
    let seed = seed();
    runtime().block_on(async {
        tokio::time::timeout(TEST_TIMEOUT, async {
            for n_ranks in [1, 2, 3] {
                let mut reference = Reference::new();
                let shards: Vec<_> = (0..n_ranks).map(|rank| spawn_shard(rank, n_ranks)).collect();
                for (b, bucket) in reference.buckets.buckets().iter().enumerate() {
                    let covered: usize = shards.iter().map(|(_, _, segments, _)| segments[b].len()).sum();
                    assert_eq!(covered, bucket.numel(), "segments tile bucket {b}");
                }
                for step in 0..4u64 {
                    if step == 2 {
                        reference.optimizer.set_lr(ADAMW.lr / 2.0);
                        for (shard, ..) in &shards {
                            shard.send(ParamShardMsg::SetLr { lr: ADAMW.lr / 2.0 }).await.unwrap();
                        }
                    }
                    let grads = gradients(&reference.buckets, seed, step);
                    reference.step(&grads);
                    for (rank, (shard, _, segments, _)) in shards.iter().enumerate() {
                        let updated = apply(shard, step, owned(&grads, segments)).await.unwrap();
                        for (b, (segment, own)) in updated.iter().zip(segments).enumerate() {
                            let CpuData::F32(got) = segment else { panic!("f32 segment") };
                            let want = reference.segment(b, own.clone());
                            assert_eq!(
                                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                                "n={n_ranks} rank {rank} bucket {b} step {step}"
                            );
                        }
                    }
                }
                for (shard, handle, ..) in shards {
                    assert_eq!(export(&shard).await.step, 4);
                    drop(shard);
                    assert_eq!(handle.join().await, Exit::Normal);
                }
            }
        })
        .await
        .expect("test timed out");
    });
}

// Goal: bad input gets a typed error, changes nothing, and does not stop the actor. Method: after
// one good step, send a replayed step, a skipped step, too few segments, a short segment and an
// f64 segment; compare full exports before and after; then the next good step still applies.
#[test]
fn bad_input_gets_a_typed_error_and_changes_nothing() {
    let seed = seed();
    runtime().block_on(async {
        tokio::time::timeout(TEST_TIMEOUT, async {
            let (shard, handle, segments, _model) = spawn_shard(1, 2);
            let (_m, buckets) = model();
            let good = |step| owned(&gradients(&buckets, seed, step), &segments);
            apply(&shard, 0, good(0)).await.unwrap();
            let before = fingerprint(&export(&shard).await);

            let stale = apply(&shard, 0, good(0)).await;
            assert!(matches!(stale, Err(Error::StaleStep { expected: 1, got: 0 })), "{stale:?}");
            let skipped = apply(&shard, 5, good(5)).await;
            assert!(matches!(skipped, Err(Error::StaleStep { expected: 1, got: 5 })), "{skipped:?}");
            let mut few = good(1);
            few.pop();
            let n = segments.len();
            let count = apply(&shard, 1, few).await;
            assert!(matches!(count, Err(Error::SegmentCount { expected, got }) if expected == n && got == n - 1), "{count:?}");
            let mut short = good(1);
            let last = short.len() - 1;
            if let CpuData::F32(v) = &mut short[last] {
                v.vec_mut().pop();
            }
            let want = segments[last].len();
            let length = apply(&shard, 1, short).await;
            assert!(
                matches!(length, Err(Error::SegmentLength { bucket, expected, got }) if bucket == last && expected == want && got == want - 1),
                "{length:?}"
            );
            let mut wide = good(1);
            wide[0] = CpuData::F64(vec![0.5; segments[0].len()].into());
            let dtype = apply(&shard, 1, wide).await;
            assert!(matches!(dtype, Err(Error::SegmentDType { bucket: 0, expected: DType::F32, got: DType::F64 })), "{dtype:?}");

            assert_eq!(fingerprint(&export(&shard).await), before, "a refused message changed the shard");
            assert!(!handle.is_finished(), "bad input stopped the actor");
            apply(&shard, 1, good(1)).await.unwrap();
            assert_eq!(export(&shard).await.step, 2);
        })
        .await
        .expect("test timed out");
    });
}

// Goal: export/import carries the whole state: a fresh shard that imports another's state
// continues bit-identically; a state of another rank, or with a missing optimizer tensor, is
// refused with a typed error and changes nothing. Method: two spawned shards of rank 0 of 2.
#[test]
fn export_then_import_continues_identically() {
    let seed = seed();
    runtime().block_on(async {
        tokio::time::timeout(TEST_TIMEOUT, async {
            let (a, _ha, segments, _ma) = spawn_shard(0, 2);
            let (b, _hb, _, _mb) = spawn_shard(0, 2);
            let (_m, buckets) = model();
            let good = |step| owned(&gradients(&buckets, seed, step), &segments);
            for step in 0..3 {
                apply(&a, step, good(step)).await.unwrap();
            }
            let state = export(&a).await;
            assert_eq!(state.step, 3);
            let fresh = fingerprint(&export(&b).await);

            let (other_rank, _ho, _, _mo) = spawn_shard(1, 2);
            let wrong_layout = import(&b, export(&other_rank).await).await;
            assert!(matches!(wrong_layout, Err(Error::SegmentLayout { bucket: 0, .. })), "{wrong_layout:?}");
            let mut missing = state.clone();
            let dropped = missing.optimizer.pop().unwrap().0;
            let mismatch = import(&b, missing).await;
            assert!(matches!(&mismatch, Err(Error::ShardStateMismatch { name, .. }) if *name == dropped), "{mismatch:?}");
            assert_eq!(fingerprint(&export(&b).await), fresh, "a refused import changed the shard");

            import(&b, state.clone()).await.unwrap();
            assert_eq!(fingerprint(&export(&b).await), fingerprint(&state));
            let from_a = apply(&a, 3, good(3)).await.unwrap();
            let from_b = apply(&b, 3, good(3)).await.unwrap();
            assert_eq!(from_a.iter().map(bits).collect::<Vec<_>>(), from_b.iter().map(bits).collect::<Vec<_>>());
            assert_eq!(fingerprint(&export(&a).await), fingerprint(&export(&b).await));
        })
        .await
        .expect("test timed out");
    });
}

// Goal: a shard refuses an optimizer that updates tensors other than its slices, and a rank
// outside the group. Method: direct construction.
#[test]
fn construction_checks_its_inputs() {
    let (_model, buckets) = model();
    let stray = rtx_tensor::Tensor::zeros(&[3], DType::F32);
    let foreign = ParamShard::new(&buckets, 0, 2, move |_: &[ParamSlice]| AdamW::new(vec![("stray".into(), stray)], ADAMW));
    assert!(matches!(foreign, Err(Error::ForeignOptimizerParam { ref name }) if name == "stray"), "{foreign:?}");
    let outside = ParamShard::new(&buckets, 2, 2, adamw(ADAMW, decay));
    assert!(matches!(outside, Err(Error::InvalidConfig { .. })), "{outside:?}");
}

// Goal: the ZeRO-1 engine runs its optimizer step through its ParamShard: after N steps the
// shard has applied N steps, its parameter segments are exactly what the all-gather put in the
// buckets, the engine's slices and optimizer are the shard's, and a fresh shard importing the
// engine shard's export holds the same state (the elastic-recovery path). Replicated engines
// have no shard. Method: 2 inline ranks as tasks of one single-thread runtime, in-process
// transport.
#[test]
fn the_zero1_engine_steps_through_its_param_shard() {
    use std::sync::Arc;

    use rtx_collectives::{CommConfig, Endpoint, InProcessNetwork, Transport};
    use rtx_pipelines::{DataParallel, DpConfig, Sharding};
    use rtx_tensor::CrossEntropyOptions;

    const RANKS: usize = 2;
    const STEPS: u64 = 3;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, async move {
        tokio::time::timeout(TEST_TIMEOUT, async {
            for sharding in [Sharding::Zero1, Sharding::Replicated] {
                let (_net, transports) = InProcessNetwork::new(RANKS);
                let done = Arc::new(tokio::sync::Barrier::new(RANKS));
                let tasks: Vec<_> = transports
                    .into_iter()
                    .enumerate()
                    .map(|(rank, t)| {
                        let done = Arc::clone(&done);
                        tokio::task::spawn_local(async move {
                            let comm = Endpoint::new(Arc::new(t) as Arc<dyn Transport>, CommConfig::default()).unwrap().world().unwrap();
                            let config = DpConfig { bucket_bytes_max: BUCKET_BYTES, sharding, ..DpConfig::default() };
                            let model = Mlp::new(&SIZES, Activation::Gelu, DType::F32, &mut Generator::new(3)).unwrap();
                            let mut dp = DataParallel::new_inline(model, config, comm, adamw(ADAMW, decay)).await.unwrap();
                            for step in 0..STEPS {
                                dp.step_async(|m| {
                                    let mut g = Generator::new(100 + step * 10 + rank as u64);
                                    let x = rtx_tensor::Tensor::randn(&[4, SIZES[0]], 0.0, 1.0, DType::F32, &mut g)?;
                                    let y = rtx_tensor::Tensor::from_vec((0..4).map(|i| ((i + rank) % SIZES[3]) as u32).collect::<Vec<u32>>(), &[4])?;
                                    m.forward(&x)?.cross_entropy(&y, CrossEntropyOptions::default())
                                })
                                .await
                                .unwrap();
                            }
                            let Some(shard) = dp.param_shard() else {
                                assert_eq!(sharding, Sharding::Replicated);
                                done.wait().await;
                                return;
                            };
                            assert_eq!(shard.next_step(), STEPS);
                            assert_eq!(shard.placement(), (rank, RANKS));
                            let state = shard.export().unwrap();
                            for (b, (own, params)) in state.segments.iter().zip(&state.params).enumerate() {
                                let bucket = dp.buckets().buckets()[b].params().to_data().unwrap();
                                assert_eq!(bits(params), bucket.as_bytes()[own.start * 4..own.end * 4].to_vec(), "rank {rank} bucket {b}");
                            }
                            let engine_ids: Vec<_> = dp.param_slices().iter().map(|s| s.tensor.id()).collect();
                            let optimizer_ids: Vec<_> = dp.optimizer().parameters().iter().map(|(_, t)| t.id()).collect();
                            assert_eq!(engine_ids, shard.slices().iter().map(|s| s.tensor.id()).collect::<Vec<_>>());
                            assert_eq!(optimizer_ids, engine_ids);
                            let mut fresh = ParamShard::new(dp.buckets(), rank, RANKS, adamw(ADAMW, decay)).unwrap();
                            fresh.import(state.clone()).unwrap();
                            assert_eq!(fingerprint(&fresh.export().unwrap()), fingerprint(&state));
                            done.wait().await;
                        })
                    })
                    .collect();
                for task in tasks {
                    task.await.unwrap();
                }
            }
        })
        .await
        .expect("test timed out");
    });
}
