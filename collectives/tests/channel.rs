//! Channels (`CommConfig::channels`): a large ring all_reduce split into `k` rings over contiguous
//! parts of the buffer, each driven by its own thread on a multi-thread runtime and joined on the
//! calling task on a current-thread one.
//!
//! Method: for k in 1..=4, worlds of 2, 3 and 4 ranks and f32, bf16 and f64, over the in-process,
//! shared-memory and QUIC loopback transports, with small frames so that modest buffers split:
//! exact inputs must give the f64 reference exactly; inexact (seeded random) inputs must give bits
//! identical on every rank, in repeated runs, and on both runtime flavours, and within a tolerance
//! of the f64 reference. Faults: a rank whose channel count differs, and a rank lost in the middle
//! of a k = 4 operation, must fail every rank with a typed error, never hang (each test body runs
//! under a bound, `run_ranks` or `TEST_TIMEOUT`).
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use half::bf16;
use rand::Rng;
use rtx_collectives::{CommConfig, Communicator, Endpoint, Error, InProcessNetwork, OpKind, ReduceOp, Transport};

/// Frame payload size in these tests: a buffer of `ELEMS` f32 splits into 4 channels on 4 ranks.
const CHUNK_BYTES: usize = 256;
/// Elements per buffer: not a multiple of anything, so channel parts and segments are uneven.
const ELEMS: usize = 4099;

fn config(channels: usize) -> CommConfig {
    CommConfig {
        op_timeout: Duration::from_secs(20),
        small_message_bytes: 0,
        chunk_bytes: Some(CHUNK_BYTES),
        channels: Some(channels),
        ..CommConfig::default()
    }
}

/// Seeded inputs in [-1, 1]: sums depend on their order in the last bits.
fn inexact_inputs<T: TestElem>(seed: u64, case: u64, n: usize, len: usize) -> Vec<Vec<T>> {
    (0..n)
        .map(|r| {
            let mut rng = rng(seed ^ case.wrapping_mul(0x9E37_79B9_7F4A_7C15), 100 + r as u64);
            (0..len).map(|_| T::from_f64(rng.random_range(-1.0..1.0))).collect()
        })
        .collect()
}

/// One rank's runs of the checks of one element type: the exact case's result, then the inexact
/// case's result twice.
async fn rank_runs<T: TestElem>(c: &Communicator, exact: &[T], inexact: &[T]) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let mut a = exact.to_vec();
    c.all_reduce(&mut a, ReduceOp::Sum).await.unwrap();
    let mut b = inexact.to_vec();
    c.all_reduce(&mut b, ReduceOp::Sum).await.unwrap();
    let mut again = inexact.to_vec();
    c.all_reduce(&mut again, ReduceOp::Sum).await.unwrap();
    (bits(&a), bits(&b), bits(&again))
}

/// Checks one element type on a world of communicators configured with `k` channels; returns the
/// inexact case's bits (the same on every rank) for comparisons across runtimes.
async fn check_type<T: TestElem>(comms: &[Communicator], k: usize, label: &str, tolerance: f64) -> Vec<u8> {
    let n = comms.len();
    let seed = seed();
    let case = (n * 16 + k) as u64;
    let exact: Arc<Vec<Vec<T>>> = Arc::new(exact_inputs(seed, case, n, ELEMS));
    let inexact: Arc<Vec<Vec<T>>> = Arc::new(inexact_inputs(seed, case, n, ELEMS));
    let bytes = ELEMS * std::mem::size_of::<T>();
    assert_eq!(comms[0].all_reduce_channels(bytes), k.min(bytes / (n * CHUNK_BYTES)), "{label}: channels for {bytes} bytes");
    let out = run_ranks(comms, |c| {
        let (exact, inexact) = (Arc::clone(&exact), Arc::clone(&inexact));
        async move {
            let r = c.rank();
            rank_runs(&c, &exact[r], &inexact[r]).await
        }
    })
    .await;
    let want = reference(ReduceOp::Sum, &exact);
    let approx: Vec<f64> = (0..ELEMS).map(|i| inexact.iter().map(|x| x[i].to_f64()).sum()).collect();
    for (rank, (a, b, again)) in out.iter().enumerate() {
        assert_eq!(a, &bits(&want), "{label}: rank {rank} exact sum");
        assert_eq!(b, &out[0].1, "{label}: rank {rank} bits differ from rank 0");
        assert_eq!(b, again, "{label}: rank {rank} repeated run differs");
    }
    let got: &[T] = bytemuck::cast_slice(&out[0].1);
    for (i, (x, y)) in got.iter().zip(&approx).enumerate() {
        assert!((x.to_f64() - y).abs() <= tolerance * (1.0 + y.abs()), "{label}: element {i}: {} against {y}", x.to_f64());
    }
    out[0].1.clone()
}

/// All three element types on one world; the inexact bits of each.
async fn check_world(comms: &[Communicator], k: usize, label: &str) -> [Vec<u8>; 3] {
    [
        check_type::<f32>(comms, k, &format!("{label} f32"), 1e-5).await,
        check_type::<bf16>(comms, k, &format!("{label} bf16"), 1e-2).await,
        check_type::<f64>(comms, k, &format!("{label} f64"), 1e-12).await,
    ]
}

async fn in_process_sweep() -> Vec<[Vec<u8>; 3]> {
    let mut all = Vec::new();
    for n in 2..=4 {
        for k in 1..=4 {
            let (_net, comms) = world(n, config(k));
            all.push(check_world(&comms, k, &format!("in-process n={n} k={k}")).await);
        }
    }
    all
}

// Goal: channels driven by threads (multi-thread runtime) match the reference and are
// deterministic; and give the same bits as the same channels joined on one task (current-thread
// runtime, built here so both run in one test).
#[test]
fn in_process_channels_on_threads_and_on_one_task() {
    let threaded = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap().block_on(in_process_sweep());
    let joined = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(in_process_sweep());
    assert_eq!(threaded, joined, "threads and one task give the same bits");
}

// Goal: different channel counts are different reductions of the same inputs: the bits may differ
// in the last place, but each count is deterministic (checked above) and all are within tolerance.
// Here: the split really happens (a buffer of k channels takes k sequence numbers, so the next
// operation's frames still match) and mixed sizes (split and not) interleave correctly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_and_unsplit_operations_interleave() {
    let (_net, comms) = world(3, config(4));
    let out = run_ranks(&comms, |c| async move {
        let r = c.rank() as f32;
        let mut results = Vec::new();
        for len in [ELEMS, 10, 3 * 64, ELEMS * 3, 1] {
            let mut buf: Vec<f32> = (0..len).map(|i| (i % 11) as f32 + r).collect();
            c.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
            results.push(buf);
        }
        c.barrier().await.unwrap();
        results
    })
    .await;
    for results in &out {
        for (buf, len) in results.iter().zip([ELEMS, 10, 3 * 64, ELEMS * 3, 1]) {
            let want: Vec<f32> = (0..len).map(|i| 3.0 * (i % 11) as f32 + 3.0).collect();
            assert_eq!(buf, &want);
        }
    }
}

#[cfg(feature = "shm")]
async fn shm_world(n: usize, k: usize, job: &str) -> Vec<Communicator> {
    use rtx_collectives::{ShmOptions, ShmTransport};
    let options = ShmOptions { job: job.into(), ring_bytes: 1 << 16, connect_timeout: Duration::from_secs(30), ..ShmOptions::default() };
    let connects: Vec<_> = (0..n).map(|r| ShmTransport::connect(r, n, options.clone())).collect();
    let mut comms = Vec::new();
    for t in futures_join(connects).await {
        let t: Arc<dyn Transport> = Arc::new(t.unwrap());
        comms.push(Endpoint::new(t, config(k)).unwrap().world().unwrap());
    }
    comms
}

/// Awaits every future concurrently (connects must overlap: each waits for its peers).
async fn futures_join<F: std::future::Future + Send + 'static>(futs: Vec<F>) -> Vec<F::Output>
where
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futs.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

// Goal: the same checks over shared memory, whose frames are lent in place and polled for by
// waiting operations: several channel threads poll one transport at once.
#[cfg(feature = "shm")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_channels() {
    for n in 2..=4 {
        for k in 1..=4 {
            let job = format!("test-channels-{}-{n}-{k}", std::process::id());
            let comms = shm_world(n, k, &job).await;
            check_world(&comms, k, &format!("shm n={n} k={k}")).await;
        }
    }
}

// Goal: the same checks over QUIC loopback (mutual TLS, quinn's reader tasks delivering frames to
// receives waited for on channel threads), with two stripes.
#[cfg(feature = "quic")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_channels() {
    use rtx_collectives::{ClusterCa, QuicOptions, QuicTransport};
    let ca = ClusterCa::generate("rtx channels test").unwrap();
    let options = QuicOptions { connect_timeout: Duration::from_secs(20), loopback_datagram_bytes: 65000, stripes: 2, ..QuicOptions::default() };
    for n in 2..=4 {
        for k in 1..=4 {
            let transports = QuicTransport::loopback_world(&ca, n, options.clone()).await.unwrap();
            let comms: Vec<Communicator> = transports
                .into_iter()
                .map(|t| {
                    let t: Arc<dyn Transport> = t;
                    Endpoint::new(t, config(k)).unwrap().world().unwrap()
                })
                .collect();
            check_world(&comms, k, &format!("quic n={n} k={k}")).await;
        }
    }
}

/// Two in-process ranks whose configs differ only in `channels`.
fn mismatched_pair(op_timeout: Duration) -> Vec<Communicator> {
    let (_net, transports) = InProcessNetwork::new(2);
    transports
        .into_iter()
        .zip([2, 1])
        .map(|(t, k)| {
            let t: Arc<dyn Transport> = Arc::new(t);
            Endpoint::new(t, CommConfig { op_timeout, ..config(k) }).unwrap().world().unwrap()
        })
        .collect()
}

async fn mismatch(comms: &[Communicator]) -> Vec<Result<(), Error>> {
    run_ranks(comms, |c| async move {
        let mut buf = vec![1.0f32; ELEMS];
        c.all_reduce(&mut buf, ReduceOp::Sum).await
    })
    .await
}

// Goal: ranks configured with different channel counts fail the operation with a typed error on
// both sides (the frames name the count), on threads; never a hang or a wrong result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_count_mismatch_fails_typed_on_threads() {
    for result in mismatch(&mismatched_pair(Duration::from_secs(20))).await {
        assert!(matches!(result, Err(Error::ChannelMismatch { .. })), "{result:?}");
    }
}

// Goal: the same on one task, on a paused clock: a channel that never gets a frame (no peer runs
// it) would end by the timeout, but the first mismatch stops it at once.
#[tokio::test(start_paused = true)]
async fn channel_count_mismatch_fails_typed_on_one_task() {
    let results = mismatch(&mismatched_pair(Duration::from_secs(5))).await;
    assert!(matches!(results[0], Err(Error::ChannelMismatch { expected: 2, got: 0, .. })), "{:?}", results[0]);
    assert!(matches!(results[1], Err(Error::ChannelMismatch { expected: 0, got: 2, .. })), "{:?}", results[1]);
}

/// Starts a k = 4 all_reduce on every rank but `lost`, cuts `lost` off, and returns the results.
async fn lose_rank_mid_op(lost: usize) -> Vec<Result<(), Error>> {
    let (net, comms) = world(4, CommConfig { op_timeout: Duration::from_secs(60), ..config(4) });
    assert_eq!(comms[0].all_reduce_channels(ELEMS * 16 * 4), 4);
    let tasks: Vec<_> = (0..4)
        .filter(|&r| r != lost)
        .map(|r| {
            let c = comms[r].clone();
            tokio::spawn(async move {
                let mut buf = vec![1.0f32; ELEMS * 16];
                c.all_reduce(&mut buf, ReduceOp::Sum).await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(10)).await;
    net.disconnect(lost);
    let mut results = Vec::new();
    for t in tasks {
        results.push(tokio::time::timeout(TEST_TIMEOUT, t).await.expect("a rank hung").unwrap());
    }
    results
}

// Goal: a rank lost in the middle of a k = 4 operation fails every survivor with PeerLost naming
// it, before the 60 s operation timeout (the test's own bound), with channels on threads: survivors
// blocked on live peers learn it from the relayed aborts of every channel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_peer_fails_every_channel_on_threads() {
    for result in lose_rank_mid_op(2).await {
        assert_eq!(result, Err(Error::PeerLost { rank: 2, op: OpKind::AllReduce }));
    }
}

// Goal: the same with the channels joined on one task, on a paused clock.
#[tokio::test(start_paused = true)]
async fn lost_peer_fails_every_channel_on_one_task() {
    for result in lose_rank_mid_op(1).await {
        assert_eq!(result, Err(Error::PeerLost { rank: 1, op: OpKind::AllReduce }));
    }
}
