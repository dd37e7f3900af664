//! The shared-memory transport between real processes: collectives give correct results; a peer
//! stopped (SIGSTOP) for less than the liveness timeout and resumed breaks nothing; killing a peer
//! with SIGKILL makes the survivor's next collective fail with PeerLost naming it within a second
//! (its lock on its ring files is gone), also when it was killed in the middle of writing a frame
//! that the survivor was reading; and `abort` releases, within milliseconds, a send blocked on a
//! full ring and operations waiting for frames.
//!
//! Method: the tests re-execute their own binary to run the child helpers (`shm_child_process`,
//! `shm_midframe_child`), which do nothing unless the parent set their environment variable. A
//! child reports its own checks to the parent with a point-to-point send, by its exit status, or
//! on its standard output (`MIDFRAME` once it is blocked in the middle of a frame).
#![cfg(feature = "shm")]
#![allow(clippy::unwrap_used)]

mod common;

use std::io::BufRead;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use rtx_collectives::frame::{encode_header_only_checksum, FrameHeader};
use rtx_collectives::{
    BufferPool, CommConfig, Communicator, DType, Endpoint, Error, OpKind, ReduceOp, ShmOptions, ShmTransport, Transport, TransportEvent, DEFAULT_CHUNK_BYTES,
};

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

    // Stopped for half the liveness timeout, then resumed: nothing breaks. The child waits for
    // the go-ahead sent while it is stopped, then both run an all-reduce.
    let pid = i32::try_from(child.0.id()).unwrap();
    signal(pid, libc::SIGSTOP);
    // kill(2) returns before the child is stopped: wait until the kernel shows it stopped, or a
    // loaded machine lets it take the go-ahead below and finish the all-reduce first.
    let stat = format!("/proc/{pid}/stat");
    let waiting = Instant::now();
    while !std::fs::read_to_string(&stat).is_ok_and(|s| s.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('T'))) {
        assert!(waiting.elapsed() < Duration::from_secs(5), "child {pid} did not stop");
        std::thread::sleep(Duration::from_millis(1));
    }
    let stopped = Instant::now();
    c.send(&[1u32], 1).await.unwrap();
    let inputs = exact_inputs::<f32>(seed, 3, 2, 4099);
    let mut buf = inputs[0].clone();
    let reduce = tokio::spawn(async move { c.all_reduce(&mut buf, ReduceOp::Sum).await.map(|()| buf).map(|buf| (c, buf)) });
    tokio::time::sleep(LIVENESS / 2).await;
    assert!(!reduce.is_finished(), "the all-reduce cannot finish while the peer is stopped");
    signal(pid, libc::SIGCONT);
    let (c, buf) = reduce.await.unwrap().expect("a peer resumed within the liveness timeout is not lost");
    assert_eq!(bits(&buf), bits(&reference(ReduceOp::Sum, &inputs)));
    eprintln!("all-reduce across a {:?} stop of the peer: ok", stopped.elapsed());

    child.0.kill().unwrap();
    let started = Instant::now();
    let mut buf = vec![1.0f32; 1000];
    assert_eq!(c.all_reduce(&mut buf, ReduceOp::Sum).await, Err(Error::PeerLost { rank: 1, op: OpKind::AllReduce }));
    eprintln!("killed peer reported lost after {:?}", started.elapsed());
    assert!(started.elapsed() < Duration::from_secs(1), "loss took {:?}", started.elapsed());
    assert!(matches!(c.send(&[1u32], 1).await, Err(Error::PeerLost { rank: 1, .. })));
    child.0.wait().unwrap();
}

fn signal(pid: i32, signal: i32) {
    // SAFETY: plain kill(2) on our own child process.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0, "kill({pid}, {signal})");
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
    // The parent stops this process, sends the go-ahead, and resumes it.
    let mut go = [0u32];
    c.recv(&mut go, 0).await.unwrap();
    let inputs = exact_inputs::<f32>(seed, 3, 2, 4099);
    let mut buf = inputs[1].clone();
    c.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
    assert_eq!(bits(&buf), bits(&reference(ReduceOp::Sum, &inputs)));
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

/// Two ranks of one process over shared memory: the raw transports.
async fn transport_pair(job: &str) -> (Arc<ShmTransport>, Arc<ShmTransport>) {
    let (a, b) = tokio::join!(ShmTransport::connect(0, 2, options(job)), ShmTransport::connect(1, 2, options(job)));
    (Arc::new(a.unwrap()), Arc::new(b.unwrap()))
}

fn frame_header(src: u32, payload_len: usize) -> [u8; 64] {
    let header = FrameHeader { group: 0, generation: 0, seq: 0, op: OpKind::Send, chunk: 0, src, dtype: Some(DType::F32), payload_len: 0, channels: 0 };
    encode_header_only_checksum(&header, payload_len)
}

// Goal: abort releases at once a send blocked on the full ring of a peer that never reads, every
// later send fails the same way, and the peer sees the link end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_abort_releases_a_writer_blocked_on_a_full_ring() {
    let job = format!("test-abort-writer-{}", std::process::id());
    let (a, b) = transport_pair(&job).await;
    let blocked = {
        let a = Arc::clone(&a);
        tokio::spawn(async move {
            let payload = vec![3u8; 1 << 20];
            let header = frame_header(0, payload.len());
            let result = a.send_parts(1, &header, &payload, &BufferPool::new()).await;
            (result, Instant::now())
        })
    };
    // Long enough for the writer to fill the 64 KiB ring and sleep for space several times.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!blocked.is_finished(), "a 1 MiB frame cannot fit a 64 KiB ring nobody reads");
    let aborted = Instant::now();
    a.abort();
    let (result, done) = tokio::time::timeout(Duration::from_secs(5), blocked).await.expect("abort did not release the writer").unwrap();
    let took = done.duration_since(aborted);
    eprintln!("blocked writer released {took:?} after abort");
    assert_eq!(result, Err(Error::TransportClosed));
    // Measured at about 0.1 ms; below the writer's nap (20 ms), so the abort's wake-up released it,
    // not the end of a nap.
    assert!(took < Duration::from_millis(15), "released only after {took:?}");
    let payload = [0u8; 64];
    assert_eq!(a.send_parts(1, &frame_header(0, 64), &payload, &BufferPool::new()).await, Err(Error::TransportClosed));
    assert!(a.recv().await.is_none(), "recv ends after abort");
    // The peer's reader takes what was published, finds the writer closed in the middle of the
    // frame, and reports the link lost (never the partial frame).
    let event = tokio::time::timeout(Duration::from_secs(1), b.recv()).await.expect("the peer did not see the link end");
    assert!(matches!(event, Some(TransportEvent::PeerLost(0))), "{event:?}");
    // Still TransportClosed now that the peer closed its end too.
    assert_eq!(a.send_parts(1, &frame_header(0, 64), &payload, &BufferPool::new()).await, Err(Error::TransportClosed));
}

// Goal: abort fails operations waiting for frames (in their polling spin or asleep) with
// TransportClosed at once, and every later operation too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_abort_releases_waiting_operations() {
    for wait in [Duration::ZERO, Duration::from_millis(50)] {
        let job = format!("test-abort-ops-{}-{}", std::process::id(), wait.as_millis());
        let (a, b) = transport_pair(&job).await;
        let config = CommConfig { op_timeout: Duration::from_secs(30), ..CommConfig::default() };
        let c = Endpoint::new(a.clone() as Arc<dyn Transport>, config.clone()).unwrap().world().unwrap();
        let _peer = Endpoint::new(b as Arc<dyn Transport>, config).unwrap().world().unwrap();
        let op = tokio::spawn(async move {
            let mut buf = vec![0.0f32; 1 << 16];
            let result = c.recv(&mut buf, 1).await;
            (result, Instant::now(), c)
        });
        tokio::time::sleep(wait).await;
        let aborted = Instant::now();
        a.abort();
        let (result, done, c) = tokio::time::timeout(Duration::from_secs(5), op).await.expect("abort did not release the operation").unwrap();
        let took = done.saturating_duration_since(aborted);
        eprintln!("operation (abort after {wait:?}) released {took:?} after abort");
        assert_eq!(result, Err(Error::TransportClosed));
        // Measured at about 0.1 ms; the bound leaves room for a loaded machine and is still far below
        // the heartbeat and the operation timeout (30 s), which would release it otherwise.
        assert!(took < Duration::from_millis(250), "released only after {took:?}");
        let mut buf = vec![0.0f32; 8];
        assert_eq!(c.all_reduce(&mut buf, ReduceOp::Sum).await, Err(Error::TransportClosed));
    }
}

const MIDFRAME_ENV: &str = "RTX_SHM_MIDFRAME";
/// Payload of the frame the victim dies in the middle of: 16 times the ring.
const MIDFRAME_FLOATS: usize = 1 << 18;

/// A config whose point-to-point sends of `MIDFRAME_FLOATS` go as one frame.
fn midframe_config() -> CommConfig {
    CommConfig { op_timeout: Duration::from_secs(30), chunk_bytes: Some(MIDFRAME_FLOATS * 4), ..CommConfig::default() }
}

async fn communicator_of(rank: usize, world: usize, job: &str) -> Communicator {
    let t: Arc<dyn Transport> = Arc::new(ShmTransport::connect(rank, world, options(job)).await.unwrap());
    Endpoint::new(t, midframe_config()).unwrap().world().unwrap()
}

// Goal: a peer killed (SIGKILL) in the middle of writing a large frame that this rank is reading
// fails the pending receive with PeerLost within a second (no hang, no partial frame delivered),
// a send blocked on the dead peer's full ring fails the same way, later sends too, and the
// survivors then work over a new transport.
//
// Method: three processes over one job: this one (rank 0), a victim (rank 1) and a survivor (rank
// 2). The victim (a bare transport: nothing reads its incoming rings) sends rank 0 a 1 MiB frame
// through the 64 KiB ring, and stops driving the send once it blocks (the send stays pending, so
// nothing closes the link), then prints MIDFRAME. Rank 0 then starts receiving (its reader takes
// the first ring-full and waits for the rest) and sends the victim a 1 MiB frame (which blocks on
// the full ring). Rank 0 kills the victim and times both failures. Then rank 0 and the survivor run
// an all-reduce over a new job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_peer_killed_in_the_middle_of_a_frame() {
    let seed = seed();
    let job = format!("test-midframe-{}-{seed}", std::process::id());
    let spawn = |role: &str| {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "shm_midframe_child", "--nocapture", "--test-threads=1"])
            .env(MIDFRAME_ENV, format!("{role}:{job}"))
            .env("RTX_TEST_SEED", seed.to_string())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut victim = KillOnDrop(spawn("victim"));
    let mut survivor = KillOnDrop(spawn("survivor"));
    // Rank 0 connects without an endpoint: nothing reads its rings yet.
    let t: Arc<dyn Transport> = Arc::new(ShmTransport::connect(0, 3, options(&job)).await.unwrap());
    let victim_out = victim.0.stdout.take().unwrap();
    let midframe = tokio::task::spawn_blocking(move || std::io::BufReader::new(victim_out).lines().map_while(|l| l.ok()).any(|l| l.contains("MIDFRAME")));
    assert!(tokio::time::timeout(Duration::from_secs(60), midframe).await.unwrap().unwrap(), "the victim did not report blocking mid-frame");

    let endpoint = Endpoint::new(Arc::clone(&t), midframe_config()).unwrap();
    let c = endpoint.world().unwrap();
    let receive = tokio::spawn(async move {
        let mut buf = vec![0.0f32; MIDFRAME_FLOATS];
        let result = c.recv(&mut buf, 1).await;
        (result, Instant::now(), c)
    });
    let blocked_send = tokio::spawn(async move {
        let payload = vec![5u8; 1 << 20];
        let result = t.send_parts(1, &frame_header(0, payload.len()), &payload, &BufferPool::new()).await;
        (result, Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!receive.is_finished(), "the frame is incomplete: the receive must wait");
    assert!(!blocked_send.is_finished(), "nobody reads the victim's rings: the send must wait");
    // SIGKILL; not reaped yet (a zombie holds no locks either).
    victim.0.kill().unwrap();
    let killed = Instant::now();
    let (result, failed, c) = tokio::time::timeout(Duration::from_secs(10), receive).await.expect("the receive hung").unwrap();
    let took = failed.duration_since(killed);
    eprintln!("receive from a peer killed mid-frame failed {took:?} after the kill: {result:?}");
    assert!(matches!(result, Err(Error::PeerLost { rank: 1, .. })), "{result:?}");
    assert!(took < Duration::from_secs(1), "took {took:?}");
    let (sent, failed) = tokio::time::timeout(Duration::from_secs(10), blocked_send).await.expect("the send hung").unwrap();
    let took = failed.duration_since(killed);
    eprintln!("send blocked on the full ring of a peer killed failed {took:?} after the kill: {sent:?}");
    assert_eq!(sent, Err(Error::PeerLost { rank: 1, op: OpKind::Send }));
    assert!(took < Duration::from_secs(1), "took {took:?}");
    assert_eq!(endpoint.malformed_frames(), 0, "a partial frame was delivered");
    assert!(matches!(c.send(&[1.0f32], 1).await, Err(Error::PeerLost { rank: 1, .. })));
    victim.0.wait().unwrap();

    // The survivors over a new job.
    let c2 = communicator_of(0, 2, &format!("{job}-after")).await;
    let inputs = exact_inputs::<f32>(seed, 5, 2, 100_003);
    let mut buf = inputs[0].clone();
    c2.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
    assert_eq!(bits(&buf), bits(&reference(ReduceOp::Sum, &inputs)));
    let status = tokio::task::spawn_blocking(move || survivor.0.wait()).await.unwrap().unwrap();
    assert!(status.success(), "survivor: {status}");
    drop(c);
}

// Helper, not a test of its own: the victim or the survivor of `shm_peer_killed_in_the_middle_of_a_frame`,
// run in a child process. Without the parent's environment variable it returns at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_midframe_child() {
    let Ok(spec) = std::env::var(MIDFRAME_ENV) else {
        return;
    };
    let (role, job) = spec.split_once(':').unwrap();
    let seed = seed();
    if role == "victim" {
        let t = ShmTransport::connect(1, 3, options(job)).await.unwrap();
        let payload = vec![7u8; MIDFRAME_FLOATS * 4];
        let pool = BufferPool::new();
        let header = frame_header(1, payload.len());
        let send = t.send_parts(0, &header, &payload, &pool);
        tokio::pin!(send);
        // Rank 0 does not read yet: the send fills the ring and blocks in the middle of the frame.
        assert!(tokio::time::timeout(Duration::from_millis(300), &mut send).await.is_err(), "a 1 MiB frame cannot fit a 64 KiB ring");
        println!("MIDFRAME");
        // Stay alive with the send pending (not driven, not cancelled) until killed.
        tokio::time::sleep(Duration::from_secs(120)).await;
        return;
    }
    let _first = communicator_of(2, 3, job).await;
    let c = communicator_of(1, 2, &format!("{job}-after")).await;
    let inputs = exact_inputs::<f32>(seed, 5, 2, 100_003);
    let mut buf = inputs[1].clone();
    c.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
    assert_eq!(bits(&buf), bits(&reference(ReduceOp::Sum, &inputs)));
}
