//! The shared-memory transport between two real processes: collectives give correct results, and
//! killing the peer process makes the survivor's next collective fail with PeerLost naming it
//! within the liveness timeout.
//!
//! Method: the test re-executes its own binary to run `shm_child_process` as rank 1 (that helper
//! does nothing unless the parent set `RTX_SHM_CHILD_JOB`). The child reports its own checks to the
//! parent with a point-to-point send, then idles until the parent kills it with SIGKILL.
#![cfg(feature = "shm")]
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use rtx_collectives::{CommConfig, Communicator, Endpoint, Error, OpKind, ReduceOp, ShmOptions, ShmTransport, Transport, DEFAULT_CHUNK_BYTES};

const CHILD_ENV: &str = "RTX_SHM_CHILD_JOB";
const LIVENESS: Duration = Duration::from_secs(2);

fn options(job: &str) -> ShmOptions {
    ShmOptions {
        job: job.into(),
        // Small rings so that large frames must stream through them.
        ring_bytes: 1 << 16,
        connect_timeout: Duration::from_secs(30),
        heartbeat: Duration::from_millis(50),
        liveness_timeout: LIVENESS,
        ..ShmOptions::default()
    }
}

async fn communicator(rank: usize, job: &str) -> Communicator {
    let t: Arc<dyn Transport> = Arc::new(ShmTransport::connect(rank, 2, options(job)).await.unwrap());
    // Frames of the default size, larger than an eighth of the small ring: they stream through it.
    let config = CommConfig { op_timeout: Duration::from_secs(30), chunk_bytes: Some(DEFAULT_CHUNK_BYTES), ..CommConfig::default() };
    Endpoint::new(t, config).unwrap().world().unwrap()
}

/// Runs the same collectives on both ranks; returns whether this rank's results were right.
async fn exchange(c: &Communicator, seed: u64) -> bool {
    let n = 2;
    let big = exact_inputs::<f32>(seed, 1, n, 300_007);
    let mut buf = big[c.rank()].clone();
    c.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
    let mut ok = bits(&buf) == bits(&reference(ReduceOp::Sum, &big));
    let small = exact_inputs::<f64>(seed, 2, n, 17);
    let mut buf = small[c.rank()].clone();
    c.all_reduce(&mut buf, ReduceOp::Max).await.unwrap();
    ok &= bits(&buf) == bits(&reference(ReduceOp::Max, &small));
    let mut b = if c.rank() == 0 { big[0].clone() } else { vec![0.0; big[0].len()] };
    c.broadcast(&mut b, 0).await.unwrap();
    ok &= bits(&b) == bits(&big[0]);
    ok
}

struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

// Goal: two processes exchange collectives through shared memory, and a killed peer is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_between_processes() {
    let seed = seed();
    let job = format!("test-{}-{seed}", std::process::id());
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "shm_child_process", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, &job)
        .env("RTX_TEST_SEED", seed.to_string())
        .spawn()
        .unwrap();
    let mut child = KillOnDrop(child);
    let c = communicator(0, &job).await;
    assert!(exchange(&c, seed).await, "rank 0 results differ from the reference");
    let mut child_ok = [0u32];
    c.recv(&mut child_ok, 1).await.unwrap();
    assert_eq!(child_ok, [1], "rank 1 results differ from the reference");

    child.0.kill().unwrap();
    child.0.wait().unwrap();
    let started = tokio::time::Instant::now();
    let mut buf = vec![1.0f32; 1000];
    assert_eq!(c.all_reduce(&mut buf, ReduceOp::Sum).await, Err(Error::PeerLost { rank: 1, op: OpKind::AllReduce }));
    assert!(started.elapsed() < LIVENESS * 5, "loss took {:?}", started.elapsed());
}

// Helper, not a test of its own: rank 1 of `shm_between_processes`, run in a child process. Without
// the parent's environment variable it returns at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_child_process() {
    let Ok(job) = std::env::var(CHILD_ENV) else {
        return;
    };
    let seed = seed();
    let c = communicator(1, &job).await;
    let ok = exchange(&c, seed).await;
    c.send(&[u32::from(ok)], 0).await.unwrap();
    // Stay alive (heartbeating) until the parent kills this process.
    tokio::time::sleep(Duration::from_secs(120)).await;
}

// Goal: a missing peer gives a typed connect error naming it.
#[tokio::test]
async fn shm_connect_times_out_with_missing_peer() {
    let job = format!("test-missing-{}", std::process::id());
    let opts = ShmOptions { connect_timeout: Duration::from_millis(200), ..options(&job) };
    let err = ShmTransport::connect(0, 2, opts).await.unwrap_err();
    assert!(matches!(err, Error::Connect { peer: 1, timeout_ms: 200, .. }), "{err}");
}

/// Two ranks of one process over shared memory, each with its own endpoint made with `config`.
async fn in_process_pair(job: &str, ring_bytes: usize, config: CommConfig) -> Vec<Communicator> {
    let opts = ShmOptions { ring_bytes, ..options(job) };
    let (a, b) = tokio::join!(ShmTransport::connect(0, 2, opts.clone()), ShmTransport::connect(1, 2, opts));
    [a.unwrap(), b.unwrap()]
        .into_iter()
        .map(|t| {
            let t: Arc<dyn Transport> = Arc::new(t);
            Endpoint::new(t, config.clone()).unwrap().world().unwrap()
        })
        .collect()
}

// Goal: an unset chunk size takes the transport's preference (a sixteenth of the ring), an explicit
// one wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_frames_default_to_a_sixteenth_of_the_ring() {
    let job = format!("test-chunk-{}", std::process::id());
    let comms = in_process_pair(&job, 4 << 20, CommConfig::default()).await;
    assert!(comms.iter().all(|c| c.config().chunk_bytes == Some(256 << 10)));
    let job = format!("test-chunk-explicit-{}", std::process::id());
    let explicit = CommConfig { chunk_bytes: Some(1000), ..CommConfig::default() };
    let comms = in_process_pair(&job, 4 << 20, explicit).await;
    assert!(comms.iter().all(|c| c.config().chunk_bytes == Some(1000)));
}

// Goal: results stay exact when operations alternate between taking frames themselves (polling)
// and sleeping while the reader threads deliver: rank 1 starts every other operation late, so
// rank 0's spin runs out and its readers must take over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_operations_that_stop_polling_still_get_their_frames() {
    let job = format!("test-standback-{}", std::process::id());
    let config = CommConfig { op_timeout: Duration::from_secs(20), ..CommConfig::default() };
    let comms = in_process_pair(&job, 1 << 20, config).await;
    let tasks: Vec<_> = comms
        .into_iter()
        .map(|c| {
            tokio::spawn(async move {
                for round in 0..6u64 {
                    if c.rank() == 1 && round % 2 == 1 {
                        tokio::time::sleep(Duration::from_millis(30)).await;
                    }
                    let inputs = exact_inputs::<f32>(round, 3, 2, 1_000_003);
                    let mut buf = inputs[c.rank()].clone();
                    c.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
                    assert_eq!(bits(&buf), bits(&reference(ReduceOp::Sum, &inputs)), "round {round}, rank {}", c.rank());
                }
            })
        })
        .collect();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(60), task).await.unwrap().unwrap();
    }
}
