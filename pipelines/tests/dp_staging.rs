//! Host staging (`DpConfig::host_staging`), the path parameters on a GPU take: the module keeps
//! its tensors, gradients are copied into host mirror buckets, all-reduced by the same
//! communicator and copied back before the optimizer steps. On the CPU the copies are exact, so
//! the staged engine must give the bucket engine's parameter bits after every step, on every
//! rank, threaded and inline, with replicas bit-identical. Method: 3 ranks (and a group of one)
//! over the in-process transport, each rank on its own thread (or all as tasks of one runtime),
//! the same seeds for both engines. ZeRO-1/2 with staging: `dp_staging_zero.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Barrier};
use std::time::Duration;

use rtx_collectives::{CommConfig, Endpoint, InProcessNetwork, Transport};
use rtx_pipelines::{adamw, DataParallel, DpConfig};
use rtx_tensor::nn::{Activation, Mlp, Module};
use rtx_tensor::optim::{AdamW, AdamWConfig};
use rtx_tensor::{CrossEntropyOptions, DType, Device, Generator, Tensor};

const ROWS: usize = 4;
const STEPS: u64 = 4;
const ADAMW: AdamWConfig = AdamWConfig { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };

fn config(host_staging: bool) -> DpConfig {
    // Small buckets: several per model, so bucket order and offsets matter.
    DpConfig { bucket_bytes_max: 512, collective_timeout: Duration::from_secs(20), host_staging, ..DpConfig::default() }
}

fn batch(step: u64, rank: usize) -> (Tensor, Tensor) {
    let mut g = Generator::new(2000 + step * 10 + rank as u64);
    let x = Tensor::randn(&[ROWS, 12], 0.0, 1.0, DType::F32, &mut g).unwrap();
    let y = Tensor::from_vec((0..ROWS).map(|i| ((i + rank + step as usize) % 5) as u32).collect::<Vec<u32>>(), &[ROWS]).unwrap();
    (x, y)
}

/// Different initial parameters per rank: the opening broadcast must make them rank 0's.
fn model(rank: usize) -> Mlp {
    Mlp::new(&[12, 16, 5], Activation::Relu, DType::F32, &mut Generator::new(11 + rank as u64)).unwrap()
}

fn loss(m: &mut Mlp, step: u64, rank: usize) -> rtx_tensor::Result<Tensor> {
    let (x, y) = batch(step, rank);
    m.forward(&x)?.cross_entropy(&y, CrossEntropyOptions::default())
}

fn bits(m: &Mlp) -> Vec<u32> {
    m.named_parameters().into_iter().flat_map(|(_, p)| p.to_f32_vec().unwrap()).map(f32::to_bits).collect()
}

/// Every rank's parameter bits after every step, each rank on its own thread.
fn threaded(ranks: usize, host_staging: bool) -> Vec<Vec<Vec<u32>>> {
    let (_net, transports) = InProcessNetwork::new(ranks);
    let done = Arc::new(Barrier::new(ranks));
    let handles: Vec<_> = transports
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let done = Arc::clone(&done);
            std::thread::spawn(move || {
                let connect = move || Endpoint::new(Arc::new(t) as Arc<dyn Transport>, CommConfig::default())?.world();
                let mut dp = DataParallel::new(model(rank), config(host_staging), connect, adamw(ADAMW, |_, _| true)).unwrap();
                assert_eq!(dp.device(), Device::Cpu);
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

/// The staged engine inline: every rank a task of one single-thread runtime.
fn inline_staged(ranks: usize) -> Vec<Vec<Vec<u32>>> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, async move {
        let (_net, transports) = InProcessNetwork::new(ranks);
        let done = Arc::new(tokio::sync::Barrier::new(ranks));
        let tasks: Vec<_> = transports
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                let done = Arc::clone(&done);
                tokio::task::spawn_local(async move {
                    let comm = Endpoint::new(Arc::new(t) as Arc<dyn Transport>, CommConfig::default()).unwrap().world().unwrap();
                    let mut dp = DataParallel::new_inline(model(rank), config(true), comm, adamw(ADAMW, |_, _| true)).await.unwrap();
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
fn staged_engine_matches_the_bucket_engine_bit_for_bit() {
    for ranks in [3, 1] {
        let buckets = threaded(ranks, false);
        let staged = threaded(ranks, true);
        assert_eq!(buckets, staged, "{ranks} rank(s): staged and bucket engines differ");
        for step in 0..STEPS as usize {
            assert!(staged.iter().all(|rank| rank[step] == staged[0][step]), "{ranks} rank(s): replicas differ at step {step}");
        }
        assert_ne!(staged[0][0], staged[0][STEPS as usize - 1], "training moved the parameters");
    }
    assert_eq!(inline_staged(3), threaded(3, true), "inline and threaded staged engines differ");
}

#[test]
fn staging_keeps_the_modules_own_tensors() {
    // Goal: with staging the module's parameters are not rebound to bucket views, so tensors held
    // before the engine was built (as an optimizer built on a device would) see every update.
    // Method: keep handles to the parameters, train one step, compare.
    let (_net, mut transports) = InProcessNetwork::new(1);
    let t = transports.remove(0);
    let m = model(0);
    let held: Vec<Tensor> = m.parameters();
    let connect = move || Endpoint::new(Arc::new(t) as Arc<dyn Transport>, CommConfig::default())?.world();
    let mut dp =
        DataParallel::new(m, config(true), connect, |slices: &[rtx_pipelines::ParamSlice]| AdamW::new(rtx_pipelines::named_slices(slices), ADAMW)).unwrap();
    let before: Vec<Vec<f32>> = held.iter().map(|p| p.to_f32_vec().unwrap()).collect();
    dp.step(|m| loss(m, 0, 0)).unwrap();
    let ids: Vec<_> = dp.model().parameters().iter().map(Tensor::id).collect();
    assert_eq!(ids, held.iter().map(Tensor::id).collect::<Vec<_>>(), "the module kept its tensors");
    let after: Vec<Vec<f32>> = held.iter().map(|p| p.to_f32_vec().unwrap()).collect();
    assert_ne!(before, after, "the held tensors were updated in place");
}
