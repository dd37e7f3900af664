//! The device data-parallel path (`DataParallel::with_device_reduce`): per bucket, gradients
//! packed into a flat tensor where the parameters are, averaged by a `DeviceReduce`, handed back.
//! Here the host communicator stands in for NCCL (`HostReduce`), so the path must give the
//! host-staging path's parameter bits after every step, on every rank. Method: 1-3 ranks, each on
//! its own thread with its own tokio runtime, over the shared-memory transport; f32 and bf16
//! models with a parameter the loss never uses; the same seeds for both engines (printed). Also:
//! the opening broadcast, and the typed refusals (ZeRO, a reducer on another device, disagreeing
//! group sizes), and a failed collective named by step and bucket, then a broken engine.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use support::{bits, loss, with_unused, WithUnused, BATCH_SEED, MODEL_SEED};

use rtx_collectives::{CommConfig, Communicator, Endpoint, InProcessNetwork, ShmOptions, ShmTransport, Transport};
use rtx_pipelines::{adamw, DataParallel, DeviceReduce, DpConfig, Error, HostReduce, ReduceFuture, Sharding};
use rtx_tensor::nn::Module;
use rtx_tensor::optim::{AdamW, AdamWConfig};
use rtx_tensor::{DType, Device, Tensor};

const STEPS: u64 = 4;
const ADAMW: AdamWConfig = AdamWConfig { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };

type Engine = DataParallel<WithUnused, AdamW>;

fn config() -> DpConfig {
    // Small buckets: several per model, so bucket order, offsets and the unused parameter's
    // place in its bucket matter.
    DpConfig { bucket_bytes_max: 512, collective_timeout: Duration::from_secs(20), ..DpConfig::default() }
}

/// Different initial parameters per rank: the opening broadcast must make them rank 0's.
fn model(rank: usize) -> WithUnused {
    with_unused(rank, DType::F32)
}

/// A shared-memory job name unique to this process and call.
fn job(tag: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!("rtx-dpdev-{}-{tag}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Runs `body(rank, communicator, meet)` on `ranks` threads, each with its own single-thread
/// runtime and a communicator over shared memory; `meet` is an out-of-band barrier (ranks meet
/// before dropping their engines, see the engine's teardown note) that keeps the runtime running.
fn on_ranks<T, F, Fut>(ranks: usize, tag: &str, body: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(usize, Communicator, Meet) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = T>,
{
    let job = job(tag);
    let body = Arc::new(body);
    let barrier = Arc::new(Barrier::new(ranks));
    let handles: Vec<_> = (0..ranks)
        .map(|rank| {
            let (job, body, barrier) = (job.clone(), Arc::clone(&body), Arc::clone(&barrier));
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                runtime.block_on(async move {
                    let options = ShmOptions { job, connect_timeout: Duration::from_secs(30), ..ShmOptions::default() };
                    let transport: Arc<dyn Transport> = Arc::new(ShmTransport::connect(rank, ranks, options).await.unwrap());
                    let comm = Endpoint::new(transport, CommConfig { op_timeout: Duration::from_secs(20), ..CommConfig::default() }).unwrap().world().unwrap();
                    body(rank, comm, Meet(barrier)).await
                })
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// An out-of-band barrier awaited without blocking the rank's runtime.
struct Meet(Arc<Barrier>);

impl Meet {
    async fn wait(self) {
        tokio::task::spawn_blocking(move || self.0.wait()).await.unwrap();
    }
}

/// Every rank's parameter bits after construction and after every step: the device path with
/// the host stand-in, or host staging.
fn train(ranks: usize, dtype: DType, device_path: bool) -> Vec<Vec<Vec<u32>>> {
    on_ranks(ranks, if device_path { "device" } else { "staged" }, move |rank, comm, meet| async move {
        let make = adamw(ADAMW, |_, _| true);
        let mut dp: Engine = if device_path {
            DataParallel::with_device_reduce(with_unused(rank, dtype), config(), HostReduce::new(comm), make).await.unwrap()
        } else {
            DataParallel::new_inline(with_unused(rank, dtype), DpConfig { host_staging: true, ..config() }, comm, make).await.unwrap()
        };
        assert_eq!((dp.device(), dp.params_in_place(), dp.world_size()), (Device::Cpu, true, ranks));
        let mut out = vec![bits(dp.model())];
        for step in 0..STEPS {
            dp.step_async(|m| loss(m, step, rank)).await.unwrap();
            out.push(bits(dp.model()));
        }
        meet.wait().await;
        out
    })
}

#[test]
fn device_path_with_the_host_stand_in_matches_host_staging_bit_for_bit() {
    // Goal: the device path's bits are host staging's after every step, and replicas agree.
    // Method: the same ranks, seeds and data through both engines; compare every step's bits.
    println!("seeds: model {MODEL_SEED} + rank, batch {BATCH_SEED} + 10 * step + rank");
    for (ranks, dtype) in [(2, DType::F32), (3, DType::F32), (1, DType::F32), (3, DType::BF16)] {
        let staged = train(ranks, dtype, false);
        let device = train(ranks, dtype, true);
        for step in 0..=STEPS as usize {
            for rank in 0..ranks {
                assert_eq!(
                    device[rank][step], staged[rank][step],
                    "{ranks} rank(s), {dtype}: rank {rank} differs from host staging after step {step} (0 = construction)"
                );
                assert_eq!(device[rank][step], device[0][step], "{ranks} rank(s), {dtype}: replica {rank} differs from rank 0 after step {step}");
            }
        }
        assert_ne!(device[0][0], device[0][STEPS as usize], "{ranks} rank(s), {dtype}: training moved the parameters");
    }
}

#[test]
fn a_parameter_the_loss_does_not_use_gets_a_zero_gradient() {
    // Goal: the unused parameter's slice of every bucket it sits in is zeros on every rank, while
    // the used parameters get nonzero averaged gradients. Method: one step on 2 ranks, then read
    // the gradients the optimizer saw.
    let grads = on_ranks(2, "unused", |rank, comm, meet| async move {
        let mut dp: Engine = DataParallel::with_device_reduce(model(rank), config(), HostReduce::new(comm), adamw(ADAMW, |_, _| true)).await.unwrap();
        dp.step_async(|m| loss(m, 0, rank)).await.unwrap();
        let unused = dp.model().unused.grad().expect("the unused parameter has a gradient").to_f32_vec().unwrap();
        let used = dp.model().mlp.parameters()[0].grad().expect("a used parameter has a gradient").to_f32_vec().unwrap();
        meet.wait().await;
        (unused, used)
    });
    for (rank, (unused, used)) in grads.iter().enumerate() {
        assert_eq!(unused, &vec![0.0; 7], "rank {rank}: unused parameter's gradient");
        assert!(used.iter().any(|&g| g != 0.0), "rank {rank}: a used parameter's gradient is not all zeros");
        assert_eq!(used, &grads[0].1, "rank {rank}: averaged gradients agree across ranks");
    }
}

#[test]
fn the_opening_broadcast_makes_differently_initialised_replicas_identical() {
    // Goal: replicas built from different seeds hold rank 0's values once built. Method: 3
    // ranks, model seed MODEL_SEED + rank; compare with a fresh rank-0 model.
    println!("seeds: model {MODEL_SEED} + rank");
    let expected = bits(&model(0));
    assert_ne!(expected, bits(&model(1)), "the replicas start different");
    let built = on_ranks(3, "broadcast", |rank, comm, meet| async move {
        let dp: Engine = DataParallel::with_device_reduce(model(rank), config(), HostReduce::new(comm), adamw(ADAMW, |_, _| true)).await.unwrap();
        let out = bits(dp.model());
        meet.wait().await;
        out
    });
    for (rank, b) in built.iter().enumerate() {
        assert_eq!(b, &expected, "rank {rank} holds rank 0's initial parameters");
    }
}

/// A reducer that misreports its group or its device, for the refusals.
#[derive(Debug)]
struct Misreporting {
    inner: HostReduce,
    size: usize,
    device: Device,
}

impl DeviceReduce for Misreporting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.size
    }
    fn device(&self) -> Device {
        self.device
    }
    fn all_reduce_avg<'a>(&'a self, flat: &'a Tensor) -> ReduceFuture<'a> {
        self.inner.all_reduce_avg(flat)
    }
    fn broadcast<'a>(&'a self, flat: &'a Tensor, root: usize) -> ReduceFuture<'a> {
        self.inner.broadcast(flat, root)
    }
}

/// One in-process rank's communicator, in the current runtime.
fn solo_comm() -> Communicator {
    let (_net, mut transports) = InProcessNetwork::new(1);
    Endpoint::new(Arc::new(transports.remove(0)) as Arc<dyn Transport>, CommConfig::default()).unwrap().world().unwrap()
}

#[test]
fn zero_sharding_and_a_reducer_elsewhere_are_typed_errors() {
    // Goal: ZeRO-1/2 and a reducer whose device is not the parameters' are refused before any
    // collective. Method: a group of one; a reducer that says it works on a GPU.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        for sharding in [Sharding::Zero1, Sharding::Zero2] {
            let cfg = DpConfig { sharding, ..config() };
            match DataParallel::with_device_reduce(model(0), cfg, HostReduce::new(solo_comm()), adamw(ADAMW, |_, _| true)).await {
                Err(Error::ShardedDeviceReduce { sharding: s }) => assert_eq!(s, sharding),
                other => panic!("{sharding:?}: expected ShardedDeviceReduce, got {:?}", other.map(|_: Engine| ())),
            }
        }
        let elsewhere = Misreporting { inner: HostReduce::new(solo_comm()), size: 1, device: Device::Cuda(0) };
        match DataParallel::with_device_reduce(model(0), config(), elsewhere, adamw(ADAMW, |_, _| true)).await {
            Err(Error::ReducerDevice { params: Device::Cpu, reducer: Device::Cuda(0) }) => {}
            other => panic!("expected ReducerDevice, got {:?}", other.map(|_: Engine| ())),
        }
        let impossible = Misreporting { inner: HostReduce::new(solo_comm()), size: 0, device: Device::Cpu };
        match DataParallel::with_device_reduce(model(0), config(), impossible, adamw(ADAMW, |_, _| true)).await {
            Err(Error::ReducerWorld { rank: 0, size: 0, root_size: None, agreeing: None }) => {}
            other => panic!("expected ReducerWorld, got {:?}", other.map(|_: Engine| ())),
        }
    });
}

#[test]
fn a_reducer_whose_group_size_disagrees_is_refused_on_every_rank() {
    // Goal: when one member's reducer reports another group size, every member gets a typed
    // error from construction (none trains). Method: 2 ranks over shared memory; rank 1's
    // reducer claims 3.
    let results = on_ranks(2, "world", |rank, comm, meet| async move {
        let size = if rank == 1 { 3 } else { 2 };
        let reduce = Misreporting { inner: HostReduce::new(comm), size, device: Device::Cpu };
        let result = DataParallel::with_device_reduce(model(rank), config(), reduce, adamw(ADAMW, |_, _| true)).await.map(|_: Engine| ());
        meet.wait().await;
        result
    });
    for (rank, result) in results.into_iter().enumerate() {
        match result {
            Err(Error::ReducerWorld { rank: r, size, root_size: Some(2), agreeing: Some(1) }) => assert_eq!((r, size), (rank, if rank == 1 { 3 } else { 2 })),
            other => panic!("rank {rank}: expected ReducerWorld, got {other:?}"),
        }
    }
}

#[test]
fn a_failed_device_collective_names_its_step_and_bucket_then_the_engine_is_broken() {
    // Goal: a collective that fails on the device path is `Error::Collective` with the step,
    // bucket and operation, and the engine refuses later steps (`Error::Broken`), as on the host
    // paths. Method: 2 ranks build their engines, then rank 1 leaves (dropping its engine and
    // transport) and rank 0 steps alone.
    let results = on_ranks(2, "failure", |rank, comm, meet| async move {
        let mut dp: Engine = DataParallel::with_device_reduce(model(rank), config(), HostReduce::new(comm), adamw(ADAMW, |_, _| true)).await.unwrap();
        meet.wait().await;
        if rank == 1 {
            drop(dp);
            return None;
        }
        let first = dp.step_async(|m| loss(m, 0, rank)).await.map(|_| ());
        let second = dp.step_async(|m| loss(m, 1, rank)).await.map(|_| ());
        Some((first, second))
    });
    let Some((first, second)) = results.into_iter().next().flatten() else { panic!("rank 0 reports") };
    match first {
        Err(Error::Collective { step: 0, bucket: 0, op: "all_reduce", .. }) | Err(Error::CollectiveTimeout { step: 0, bucket: 0, op: "all_reduce", .. }) => {}
        other => panic!("expected the bucket-0 all_reduce of step 0 to fail, got {other:?}"),
    }
    assert!(matches!(second, Err(Error::Broken { failed_step: 0 })), "{second:?}");
}
