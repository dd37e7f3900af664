//! The inline engine (`DataParallel::new_inline` + `step_async`, collectives on the caller's
//! task, no communication thread) against the threaded one: the same ranks, data and seeds give
//! bit-identical parameters after every step, replicated and ZeRO-1. Method: 3 ranks over the
//! in-process transport; the threaded run puts each rank on an OS thread, the inline run puts all
//! ranks as tasks on one single-thread runtime (as the simulator does).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Barrier};
use std::time::Duration;

use rtx_collectives::{CommConfig, Endpoint, InProcessNetwork, Transport};
use rtx_pipelines::{adamw, DataParallel, DpConfig, Sharding};
use rtx_tensor::nn::{Activation, Mlp, Module};
use rtx_tensor::optim::AdamWConfig;
use rtx_tensor::{CrossEntropyOptions, DType, Generator, Tensor};

const RANKS: usize = 3;
const ROWS: usize = 4;
const STEPS: u64 = 4;
const ADAMW: AdamWConfig = AdamWConfig { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };

fn config(sharding: Sharding) -> DpConfig {
    DpConfig { bucket_bytes_max: 512, sharding, collective_timeout: Duration::from_secs(20), ..DpConfig::default() }
}

fn batch(step: u64, rank: usize) -> (Tensor, Tensor) {
    let mut g = Generator::new(1000 + step * 10 + rank as u64);
    let x = Tensor::randn(&[ROWS, 12], 0.0, 1.0, DType::F32, &mut g).unwrap();
    let y = Tensor::from_vec((0..ROWS).map(|i| ((i + rank + step as usize) % 5) as u32).collect::<Vec<u32>>(), &[ROWS]).unwrap();
    (x, y)
}

fn model(rank: usize) -> Mlp {
    Mlp::new(&[12, 16, 5], Activation::Relu, DType::F32, &mut Generator::new(7 + rank as u64)).unwrap()
}

fn loss(m: &mut Mlp, step: u64, rank: usize) -> rtx_tensor::Result<Tensor> {
    let (x, y) = batch(step, rank);
    m.forward(&x)?.cross_entropy(&y, CrossEntropyOptions::default())
}

fn bits(m: &Mlp) -> Vec<u32> {
    m.named_parameters().into_iter().flat_map(|(_, p)| p.to_f32_vec().unwrap()).map(f32::to_bits).collect()
}

/// Every rank's parameter bits after every step, each rank on its own thread.
fn threaded(sharding: Sharding) -> Vec<Vec<Vec<u32>>> {
    let (_net, transports) = InProcessNetwork::new(RANKS);
    let done = Arc::new(Barrier::new(RANKS));
    let handles: Vec<_> = transports
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let done = Arc::clone(&done);
            std::thread::spawn(move || {
                let connect = move || Endpoint::new(Arc::new(t) as Arc<dyn Transport>, CommConfig::default())?.world();
                let mut dp = DataParallel::new(model(rank), config(sharding), connect, adamw(ADAMW, |_, _| true)).unwrap();
                let out: Vec<Vec<u32>> = (0..STEPS)
                    .map(|step| {
                        dp.step(|m| loss(m, step, rank)).unwrap();
                        bits(dp.model())
                    })
                    .collect();
                done.wait();
                out
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// The same with every rank a task of one single-thread runtime and inline engines.
fn inline(sharding: Sharding) -> Vec<Vec<Vec<u32>>> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, async move {
        let (_net, transports) = InProcessNetwork::new(RANKS);
        let done = Arc::new(tokio::sync::Barrier::new(RANKS));
        let tasks: Vec<_> = transports
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                let done = Arc::clone(&done);
                tokio::task::spawn_local(async move {
                    let comm = Endpoint::new(Arc::new(t) as Arc<dyn Transport>, CommConfig::default()).unwrap().world().unwrap();
                    let mut dp = DataParallel::new_inline(model(rank), config(sharding), comm, adamw(ADAMW, |_, _| true)).await.unwrap();
                    let mut out = Vec::new();
                    for step in 0..STEPS {
                        dp.step_async(|m| loss(m, step, rank)).await.unwrap();
                        out.push(bits(dp.model()));
                    }
                    done.wait().await;
                    out
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    })
}

#[test]
fn inline_engine_matches_the_threaded_one_bit_for_bit() {
    for sharding in [Sharding::Replicated, Sharding::Zero1] {
        let a = threaded(sharding);
        let b = inline(sharding);
        assert_eq!(a, b, "{sharding:?}: inline and threaded engines differ");
        for step in 0..STEPS as usize {
            assert!(a.iter().all(|rank| rank[step] == a[0][step]), "{sharding:?}: replicas differ at step {step}");
        }
        assert_ne!(a[0][0], a[0][STEPS as usize - 1], "training moved the parameters");
    }
}
