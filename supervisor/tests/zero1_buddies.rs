//! ZeRO-1 without re-runs, in one process: four ranks train a small MLP under ZeRO-1 over the
//! in-process collectives network, exchanging segment states with their buddies after every step
//! (`rtx_supervisor::zero1`), exactly as the elastic worker does. A rank is lost; the survivors
//! and a replacement rebuild the state from the buddy copies and train on, and their parameters
//! must be bit-identical to an uninterrupted run's. Losing a rank with its buddy leaves a hole, and
//! the plan falls back to the last snapshot. The same recovery with staged engines (the GPU path,
//! its shards where the parameters live) is bit-identical to the host-bucket run. Data, model and optimizer are seeded: no randomness
//! beyond the fixed seeds below.
#![allow(clippy::unwrap_used)] // helpers of a test

use std::time::{Duration, Instant};

use rtx_collectives::{CommConfig, Communicator, Endpoint, InProcessNetwork, WORLD_GROUP_ID};
use rtx_pipelines::{DataParallel, DpConfig, ParamSlice, Sharding};
use rtx_supervisor::protocol::StateSource;
use rtx_supervisor::recovery::{plan_recovery, Holding};
use rtx_supervisor::state::{self, NamedTensors};
use rtx_supervisor::zero1::{self, BuddyCopies, Layout};
use rtx_tensor::nn::{Activation, Mlp};
use rtx_tensor::optim::{AdamW, AdamWConfig};
use rtx_tensor::{DType, Generator, Module, Optimizer, Reduction, Tensor};

const IN: usize = 12;
const OUT: usize = 5;
const GLOBAL: usize = 24;
/// Steps of the whole run.
const STEPS: u64 = 8;
/// The last step every rank committed before the loss.
const LOST_AFTER: u64 = 4;

fn model() -> Mlp {
    Mlp::new(&[IN, 16, 16, OUT], Activation::Tanh, DType::F32, &mut Generator::new(3)).unwrap()
}

fn optimizer(slices: &[ParamSlice], full: Option<&NamedTensors>) -> rtx_tensor::Result<AdamW> {
    let named = slices.iter().map(|s| (s.name.clone(), s.tensor.clone())).collect();
    let mut o = AdamW::new(named, AdamWConfig { lr: 0.02, weight_decay: 0.01, ..AdamWConfig::default() })?;
    if let Some(full) = full {
        let local = o.state_tensors()?;
        let mine = state::slice_full_state(full, &local, slices).map_err(|e| rtx_tensor::Error::InvalidArgument { op: "test", reason: e.to_string() })?;
        o.load_state(&mine)?;
    }
    Ok(o)
}

fn template() -> NamedTensors {
    state::full_template(&model(), |slices| optimizer(slices, None).map_err(|e| e.to_string())).unwrap()
}

/// Small buckets: several buckets, and segments that cut parameters apart. `staged`: the
/// parameters stay in the module and the shard is made where they live (the GPU path).
fn dp(staged: bool) -> DpConfig {
    DpConfig { sharding: Sharding::Zero1, bucket_bytes_max: 700, collective_timeout: Duration::from_secs(20), host_staging: staged, ..DpConfig::default() }
}

/// This rank's rows of the global batch of `step` (the same global batch whatever the world).
fn batch(step: u64, rank: usize, world: usize) -> (Tensor, Tensor, usize) {
    let mut rng = Generator::new(1000 + step);
    let x = Tensor::randn(&[GLOBAL, IN], 0.0, 1.0, DType::F32, &mut rng).unwrap();
    let y = Tensor::randn(&[GLOBAL, OUT], 0.0, 1.0, DType::F32, &mut rng).unwrap();
    let rows = rtx_collectives::segment_range(GLOBAL, world, rank);
    (x.narrow(0, rows.start, rows.len()).unwrap(), y.narrow(0, rows.start, rows.len()).unwrap(), rows.len())
}

struct Rank {
    engine: DataParallel<Mlp, AdamW>,
    comm: Communicator,
    copies: BuddyCopies,
    layout: Layout,
    generation: u64,
}

fn comms(world: usize, generation: u64) -> (InProcessNetwork, Vec<Communicator>) {
    let (network, transports) = InProcessNetwork::new(world);
    let comms = transports
        .into_iter()
        .map(|t| Endpoint::new(std::sync::Arc::new(t), CommConfig::default()).unwrap().group(WORLD_GROUP_ID, (0..world).collect(), generation).unwrap())
        .collect();
    (network, comms)
}

/// Every rank of a new generation: a fresh model holding `flat` and an optimizer holding its part
/// of `full` (fresh state when `None`), as the worker does after its sync.
async fn form(comms: Vec<Communicator>, generation: u64, state: Vec<Option<(Vec<f32>, NamedTensors)>>, staged: bool) -> Vec<Rank> {
    let tasks: Vec<_> = comms
        .into_iter()
        .zip(state)
        .map(|(comm, state)| {
            tokio::spawn(async move {
                let m = model();
                let layout = Layout::new(&m, &template()).unwrap();
                if let Some((flat, _)) = &state {
                    state::install_parameters(&m.named_parameters(), flat).unwrap();
                }
                let full = state.map(|(_, full)| full);
                let engine = DataParallel::new_inline(m, dp(staged), comm.clone(), |slices| optimizer(slices, full.as_ref())).await.unwrap();
                Rank { engine, comm, copies: BuddyCopies::default(), layout, generation }
            })
        })
        .collect();
    let mut ranks = Vec::new();
    for t in tasks {
        ranks.push(t.await.unwrap());
    }
    ranks
}

/// Trains `step` on one rank: forward, backward, reduce-scatter, update, all-gather.
async fn compute(mut r: Rank, step: u64) -> Rank {
    let (rank, world) = (r.comm.rank(), r.comm.size());
    let (x, y, rows) = batch(step, rank, world);
    r.engine
        .step_async(move |m| {
            let loss = m.forward(&x)?.mse(&y, Reduction::Mean)?;
            loss.mul_scalar(rows as f64 * world as f64 / GLOBAL as f64)
        })
        .await
        .unwrap();
    r
}

/// The buddy exchange of `step` on one rank (what the worker does before reporting the step).
async fn exchange(mut r: Rank, step: u64) -> (Rank, rtx_supervisor::Result<()>) {
    r.copies.drop_previous();
    let own = r.layout.encode(step, r.engine.param_slices(), &r.engine.optimizer().state_tensors().unwrap()).unwrap();
    let result = r.copies.exchange_step(&r.comm, r.generation, step, own).await;
    (r, result)
}

/// Every rank trains `steps`, each committed by its exchange.
async fn train(ranks: Vec<Rank>, steps: std::ops::Range<u64>) -> Vec<Rank> {
    let tasks: Vec<_> = ranks
        .into_iter()
        .map(|r| {
            let steps = steps.clone();
            tokio::spawn(async move {
                let mut r = r;
                for step in steps {
                    let (next, result) = exchange(compute(r, step).await, step).await;
                    result.unwrap();
                    r = next;
                }
                r
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// The whole state, gathered on every rank (the snapshot path), from rank 0.
async fn gathered(ranks: &[Rank]) -> (Vec<f32>, NamedTensors) {
    let template = template();
    let tasks: Vec<_> = ranks
        .iter()
        .map(|r| {
            let (comm, local, slices, template) =
                (r.comm.clone(), r.engine.optimizer().state_tensors().unwrap(), r.engine.param_slices().to_vec(), template.clone());
            tokio::spawn(async move { state::gather_full_state(&comm, &local, &slices, &template).await.unwrap() })
        })
        .collect();
    let mut fulls = Vec::new();
    for t in tasks {
        fulls.push(t.await.unwrap());
    }
    (state::flat_parameters(ranks[0].engine.model()).unwrap(), fulls.swap_remove(0))
}

fn bits(flat: &[f32]) -> Vec<u32> {
    flat.iter().map(|v| v.to_bits()).collect()
}

fn state_bits(full: &NamedTensors) -> Vec<(String, Vec<u64>)> {
    full.iter().map(|(n, t)| (n.clone(), t.to_f64_vec().unwrap().iter().map(|v| v.to_bits()).collect())).collect()
}

fn holding(r: Option<&Rank>, snapshot: Option<u64>) -> Holding {
    Holding { completed: snapshot, zero1: r.map(|r| r.copies.held()).unwrap_or_default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_lost_mid_exchange_is_rebuilt_from_buddy_copies_bit_identically() {
    lost_mid_exchange(false).await;
}

// Goal: the same recovery when the engines stage their parameters (`DpConfig::host_staging`, the
// path of a GPU job, whose `ParamShard` lives on the device): the segment states they encode are
// host data, and the staged run, the rebuild and the resumed staged run are bit-identical to the
// uninterrupted host-bucket run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_rank_lost_mid_exchange_is_rebuilt_from_buddy_copies_bit_identically() {
    lost_mid_exchange(true).await;
}

/// The loss of rank 2 mid-exchange and the rebuild; the reference run uses host buckets, the
/// lossy and the resumed runs are `staged` or not.
async fn lost_mid_exchange(staged: bool) {
    let started = Instant::now();
    // The uninterrupted run: four ranks, every step.
    let (_net, c) = comms(4, 1);
    let reference = train(form(c, 1, vec![None, None, None, None], false).await, 0..LOST_AFTER + 1).await;
    let (ref_flat, ref_full) = gathered(&reference).await;
    let reference = train(reference, LOST_AFTER + 1..STEPS).await;
    let ref_final = state::flat_parameters(reference[0].engine.model()).unwrap();
    for r in &reference {
        assert_eq!(bits(&state::flat_parameters(r.engine.model()).unwrap()), bits(&ref_final), "reference replicas differ");
    }

    // The same run, with rank 2 lost during the exchange of step LOST_AFTER + 1: every rank
    // finished that step's all-gather; ranks 0 and 1 committed it, rank 3 never got rank 2's copy.
    let (net, c) = comms(4, 1);
    let ranks = train(form(c, 1, vec![None, None, None, None], staged).await, 0..LOST_AFTER + 1).await;
    let step = LOST_AFTER + 1;
    let mut ranks: Vec<Option<Rank>> = {
        let tasks: Vec<_> = ranks.into_iter().map(|r| tokio::spawn(compute(r, step))).collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(Some(t.await.unwrap()));
        }
        out
    };
    let lost = ranks[2].take();
    let third = tokio::spawn(exchange(ranks[3].take().unwrap(), step));
    let firsts: Vec<_> = [0, 1].into_iter().map(|i| tokio::spawn(exchange(ranks[i].take().unwrap(), step))).collect();
    for (i, t) in firsts.into_iter().enumerate() {
        let (r, result) = t.await.unwrap();
        result.unwrap();
        ranks[i] = Some(r);
    }
    net.disconnect(2);
    drop(lost);
    let (r3, result) = third.await.unwrap();
    assert!(result.is_err(), "rank 3's buddy copy of step {step} cannot have arrived");
    ranks[3] = Some(r3);
    assert_eq!(ranks[0].as_ref().unwrap().copies.latest_step(), Some(step));
    assert_eq!(ranks[3].as_ref().unwrap().copies.latest_step(), Some(LOST_AFTER));

    // The supervisor's plan over the survivors and a fresh replacement (new ranks 0, 1, 2, 3 =
    // old 0, 1, 3 and nobody): segment 2 survives at old rank 3, as of LOST_AFTER.
    let members = [holding(ranks[0].as_ref(), None), holding(ranks[1].as_ref(), None), holding(ranks[3].as_ref(), None), holding(None, None)];
    let plan = plan_recovery(&members, None, 0, Some(LOST_AFTER), false);
    assert_eq!(plan.source, StateSource::Zero1Segments { step: LOST_AFTER, world: 4, holders: vec![0, 1, 2, 0] });
    assert_eq!(plan.next_step, LOST_AFTER + 1, "at most the step whose exchange was cut runs again");
    let StateSource::Zero1Segments { step: at, world, holders } = plan.source else { unreachable!() };

    // The new generation rebuilds the whole state from the segments: bit-identical to what the
    // uninterrupted run held after step LOST_AFTER.
    let survivors = [ranks[0].take().unwrap(), ranks[1].take().unwrap(), ranks[3].take().unwrap()];
    let (_net2, c2) = comms(4, 2);
    let template = template();
    let tasks: Vec<_> = c2
        .into_iter()
        .enumerate()
        .map(|(new_rank, comm)| {
            let copies = survivors.get(new_rank).map(|r| r.copies.clone()).unwrap_or_default();
            let (template, holders) = (template.clone(), holders.clone());
            tokio::spawn(async move {
                let layout = Layout::new(&model(), &template).unwrap();
                let rebuilt = zero1::rebuild_from_segments(&comm, &copies, &layout, &template, at, world, &holders).await.unwrap();
                (comm, rebuilt)
            })
        })
        .collect();
    let (mut c3, mut rebuilt) = (Vec::new(), Vec::new());
    for t in tasks {
        let (comm, state) = t.await.unwrap();
        assert_eq!(bits(&state.0), bits(&ref_flat), "rebuilt parameters differ from the uninterrupted run's");
        assert_eq!(state_bits(&state.1), state_bits(&ref_full), "rebuilt optimizer state differs from the uninterrupted run's");
        c3.push(comm);
        rebuilt.push(Some(state));
    }
    drop(survivors);
    // ... and training on from there ends bit-identical to the uninterrupted run.
    let resumed = train(form(c3, 2, rebuilt, staged).await, plan.next_step..STEPS).await;
    for r in &resumed {
        assert_eq!(bits(&state::flat_parameters(r.engine.model()).unwrap()), bits(&ref_final), "the resumed run diverged from the uninterrupted one");
    }
    eprintln!("zero1 buddy recovery test (staged {staged}): {:.2} s", started.elapsed().as_secs_f64());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_lost_with_its_buddy_falls_back_to_the_snapshot() {
    let (_net, c) = comms(4, 1);
    let ranks = train(form(c, 1, vec![None, None, None, None], false).await, 0..LOST_AFTER + 1).await;
    // Each rank holds its own and its buddy's segment, of the last two steps.
    for r in &ranks {
        let held: Vec<u64> = r.copies.held().iter().map(|h| h.step).collect();
        assert_eq!(held, vec![LOST_AFTER, LOST_AFTER - 1]);
        assert!(r.copies.bytes() > 0);
    }
    // Ranks 1 and 2 lost together: segment 1 was held by 1 and by its buddy 2 only. The members
    // fall back to the last snapshot (say of step 2), not to a state with a hole.
    let members = [holding(Some(&ranks[0]), Some(2)), holding(Some(&ranks[3]), Some(2))];
    let plan = plan_recovery(&members, None, 0, Some(LOST_AFTER), false);
    assert_eq!(plan.source, StateSource::Member { rank: 0 });
    assert_eq!(plan.next_step, 3);
    assert_eq!(plan.regressed_from, Some(LOST_AFTER));
    // Rebuilding from segments that are not all there fails cleanly instead of inventing state.
    let template = template();
    let layout = Layout::new(&model(), &template).unwrap();
    let (_net, c) = comms(1, 2);
    let err = zero1::rebuild_from_segments(&c[0], &ranks[0].copies, &layout, &template, LOST_AFTER, 4, &[0, 0, 0, 0]).await;
    assert!(err.is_err(), "rank 0 does not hold segment 1");
}
