//! Unit checks of [`ShmTransport::abort`] that need the transport's insides: the reader threads
//! exit (one of them in the middle of a frame) within milliseconds. The public behaviour (waiting
//! sends and operations released, peers told) is tested in `tests/shm.rs`.

use std::time::{Duration, Instant};

use super::*;
use crate::frame::{encode_header_only_checksum, FrameHeader};

fn options(job: &str) -> ShmOptions {
    ShmOptions { job: job.into(), ring_bytes: 1 << 16, heartbeat: Duration::from_millis(50), liveness_timeout: Duration::from_secs(5), ..ShmOptions::default() }
}

fn frame_header(src: u32, payload_len: usize) -> [u8; HEADER_LEN] {
    let header =
        FrameHeader { group: 0, generation: 0, seq: 0, op: OpKind::Send, chunk: 0, src, dtype: Some(rtx_kernels::DType::F32), payload_len: 0, channels: 0 };
    encode_header_only_checksum(&header, payload_len)
}

fn readers_running(t: &ShmTransport) -> usize {
    lock(&t.shared.readers).iter().filter(|h| !h.is_finished()).count()
}

/// Waits up to `limit` for `done`; how long it took, or `None`.
async fn within(limit: Duration, mut done: impl FnMut() -> bool) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() < limit {
        if done() {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    None
}

// Goal: abort stops a reader thread that sleeps in the middle of a frame (the peer wrote part of
// it and stalled), and ends `recv`, within a few milliseconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_stops_a_reader_in_the_middle_of_a_frame() {
    let job = format!("unit-midframe-{}", std::process::id());
    let (a, b) = tokio::join!(ShmTransport::connect(0, 2, options(&job)), ShmTransport::connect(1, 2, options(&job)));
    let (a, b) = (Arc::new(a.unwrap()), b.unwrap());
    // Rank 1 writes the first ring-full of a 1 MiB frame while nobody reads, then is not polled
    // again (its send stays pending, not cancelled).
    let payload = vec![7u8; 1 << 20];
    let header = frame_header(1, payload.len());
    let pool = BufferPool::new();
    let send = b.send_parts(0, &header, &payload, &pool);
    tokio::pin!(send);
    assert!(tokio::time::timeout(Duration::from_millis(100), &mut send).await.is_err(), "a 1 MiB frame cannot fit a 64 KiB ring");
    // Rank 0 starts reading: its reader takes the partial frame and waits for the rest.
    let receiver = {
        let a = Arc::clone(&a);
        tokio::spawn(async move { a.recv().await.map(|e| format!("{e:?}")) })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(readers_running(&a), 1);
    assert!(!receiver.is_finished(), "a partial frame must not be delivered");
    let started = Instant::now();
    a.abort();
    let abort_took = started.elapsed();
    let stopped = within(Duration::from_secs(2), || readers_running(&a) == 0).await;
    eprintln!("abort returned in {abort_took:?}; reader thread stopped after {stopped:?}");
    assert!(abort_took < Duration::from_millis(20), "abort blocked for {abort_took:?}");
    assert!(stopped.is_some_and(|t| t < Duration::from_millis(250)), "reader stopped after {stopped:?}");
    let received = tokio::time::timeout(Duration::from_millis(100), receiver).await.unwrap().unwrap();
    assert_eq!(received, None, "recv must end after abort");
    // The peer sees the link end: its pending send fails once polled again.
    let result = tokio::time::timeout(Duration::from_millis(500), &mut send).await.unwrap();
    assert_eq!(result, Err(Error::PeerLost { rank: 0, op: OpKind::Send }));
}

// Goal: the writer's lock on its ring file is held while the ring lives (the reader's probe says
// alive, and reads the writer's pid) and released when the writer closes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_lock_is_held_for_the_writers_life() {
    let job = format!("unit-lock-{}", std::process::id());
    let path = ring_path(&options(&job), 0, 1);
    let ring = Ring::create(&path, 1 << 16).unwrap();
    let reader = Ring::open(&path, 1 << 16).unwrap().unwrap();
    assert!(!reader.writer_gone(), "the writer holds its lock");
    assert_eq!(reader.writer_pid(), u64::from(std::process::id()));
    drop(ring);
    assert!(reader.writer_gone(), "a closed ring file releases the lock");
}
