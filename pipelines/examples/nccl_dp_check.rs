//! GPU check of the device data-parallel path (feature `nccl`): `DataParallel::with_device_reduce`
//! over `NcclReduce`, one rank per GPU (threads of this process, each with its own tokio
//! runtime; the host world on the in-process transport carries the NCCL unique id).
//!
//! Each rank builds a small MLP from its own seed (so the opening broadcast has work to do),
//! moves it to its GPU and trains `STEPS` steps on its own batches; the same ranks then train the
//! same model on the CPU through `HostReduce` (the stand-in the CPU tests use). Checks: after the
//! broadcast and after every step the GPU replicas are bit-identical, and the GPU parameters
//! match the CPU ones within a tolerance (cuBLAS and the CPU kernels round differently).
//!
//! Usage: `nccl_dp_check [--ranks N]` (default: every visible GPU; needs 2); `RTX_SEED` sets the
//! seed. Exit status 1 if a check fails. Not yet run on a multi-GPU machine.
#![allow(clippy::print_stdout)]

use std::sync::{Arc, Barrier};
use std::time::Duration;

use rtx_collectives::{CommConfig, Communicator, Endpoint, InProcessNetwork, NcclCommunicator, Transport};
use rtx_pipelines::{adamw, DataParallel, DpConfig, HostReduce, NcclReduce};
use rtx_tensor::nn::{Activation, Mlp, Module};
use rtx_tensor::optim::AdamWConfig;
use rtx_tensor::{CrossEntropyOptions, DType, Device, Generator, Tensor};

/// Examples may box errors (anyhow is not a dependency of this crate).
type Result<T, E = Box<dyn std::error::Error + Send + Sync>> = std::result::Result<T, E>;

const STEPS: u64 = 5;
const ROWS: usize = 8;
const DIMS: [usize; 4] = [32, 64, 64, 10];
const TOLERANCE: f32 = 1e-3;
const ADAMW: AdamWConfig = AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };

fn main() {
    match run() {
        Ok(true) => println!("nccl_dp_check: ok"),
        Ok(false) => {
            println!("nccl_dp_check: FAILED");
            std::process::exit(1);
        }
        Err(e) => {
            println!("nccl_dp_check: error: {e}");
            std::process::exit(1);
        }
    }
}

fn run() -> Result<bool> {
    let seed: u64 = std::env::var("RTX_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(7);
    let args: Vec<String> = std::env::args().collect();
    let gpus = rtx_kernels::cuda::Device::count()?;
    let ranks = match args.iter().position(|a| a == "--ranks") {
        Some(i) => args.get(i + 1).and_then(|s| s.parse().ok()).ok_or("--ranks takes a number")?,
        None => gpus,
    };
    println!("seed {seed}, {ranks} ranks, {gpus} GPUs visible");
    if ranks < 2 || ranks > gpus {
        return Err(format!("needs 2 to {gpus} ranks, one per GPU").into());
    }
    let gpu = on_ranks(ranks, seed, true)?;
    let cpu = on_ranks(ranks, seed, false)?;
    let mut ok = true;
    for step in 0..=STEPS as usize {
        let identical = gpu.iter().all(|r| bits(&r[step]) == bits(&gpu[0][step]));
        let worst = gpu[0][step].iter().zip(&cpu[0][step]).map(|(g, c)| (g - c).abs() / c.abs().max(1.0)).fold(0.0f32, f32::max);
        println!(
            "after {}: GPU replicas identical {identical}, worst difference from CPU {worst:.2e}",
            if step == 0 { "broadcast".to_string() } else { format!("step {step}") }
        );
        ok &= identical && worst <= TOLERANCE;
    }
    Ok(ok)
}

/// Every rank's parameter values after construction and after every step, on its GPU (`gpu`) or
/// on the CPU.
fn on_ranks(ranks: usize, seed: u64, gpu: bool) -> Result<Vec<Vec<Vec<f32>>>> {
    let (_net, transports) = InProcessNetwork::new(ranks);
    let done = Arc::new(Barrier::new(ranks));
    let handles: Vec<_> = transports
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let done = Arc::clone(&done);
            std::thread::spawn(move || -> Result<Vec<Vec<f32>>> {
                let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                runtime.block_on(async move {
                    let config = CommConfig { op_timeout: Duration::from_secs(60), ..CommConfig::default() };
                    let comm = Endpoint::new(Arc::new(t) as Arc<dyn Transport>, config)?.world()?;
                    train(rank, seed, gpu, comm, done).await
                })
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().map_err(|_| "a rank panicked")?).collect()
}

async fn train(rank: usize, seed: u64, gpu: bool, comm: Communicator, done: Arc<Barrier>) -> Result<Vec<Vec<f32>>> {
    let device = if gpu { Device::Cuda(rank) } else { Device::Cpu };
    let mut model = Mlp::new(&DIMS, Activation::GeluTanh, DType::F32, &mut Generator::new(seed + rank as u64))?;
    let config = DpConfig { bucket_bytes_max: 16 << 10, collective_timeout: Duration::from_secs(60), ..DpConfig::default() };
    let make = adamw(ADAMW, |_, shape| shape.len() > 1);
    let mut dp = if gpu {
        rtx_tensor::cuda::move_module(&mut model, rank, DType::F32)?;
        let nccl = NcclCommunicator::new(&comm, rtx_tensor::cuda::device(rank)?).await?;
        DataParallel::with_device_reduce(model, config, NcclReduce::new(nccl)?, make).await?
    } else {
        DataParallel::with_device_reduce(model, config, HostReduce::new(comm), make).await?
    };
    let mut out = vec![values(dp.model())?];
    for step in 0..STEPS {
        let mut g = Generator::new(seed * 1000 + step * 10 + rank as u64);
        let x = Tensor::randn(&[ROWS, DIMS[0]], 0.0, 1.0, DType::F32, &mut g)?.to_device(device)?;
        let y = Tensor::from_vec((0..ROWS).map(|i| ((i * 3 + rank + step as usize) % DIMS[3]) as u32).collect::<Vec<u32>>(), &[ROWS])?.to_device(device)?;
        dp.step_async(|m| m.forward(&x)?.cross_entropy(&y, CrossEntropyOptions::default())).await?;
        out.push(values(dp.model())?);
    }
    // Ranks meet before dropping their engines (see the engine's teardown note); the runtime
    // keeps running meanwhile.
    tokio::task::spawn_blocking(move || done.wait()).await?;
    drop(dp);
    Ok(out)
}

fn values(m: &Mlp) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    for p in m.parameters() {
        out.extend(p.to_f32_vec()?);
    }
    Ok(out)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
