//! The shared-memory link model of the simulated network (`WireModel::Shm`) and the faults of
//! issue 19, on raw transports in virtual time: a send to a crashed peer waits once the peer's
//! ring is full and fails only when the liveness timeout reports the peer lost (a stream link
//! never waits); the frame a dying writer was writing is torn (never delivered) while what it
//! wrote before arrives; a stalled rank's sends wait and nothing is read for it until it is
//! released; and `Transport::abort` fails a waiting send at once and tells the peers now.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use rtx_collectives::{PooledBuf, Transport, TransportEvent};
use rtx_sim::{run, LinkModel, SimConfig, SimNetwork, SimTransport, WireModel};
use tokio::time::Instant;

const RING: usize = 16 << 10;

fn shm(loss_detect_ms: u64) -> SimConfig {
    SimConfig { seed: 1, link: LinkModel { jitter: Duration::ZERO, ..LinkModel::default() }, loss_detect: Duration::from_millis(loss_detect_ms), wire: WireModel::Shm { ring_bytes: RING } }
}

fn frame(len: usize, tag: u8) -> PooledBuf {
    PooledBuf::unpooled(vec![tag; len])
}

/// Takes the next frame event (skipping connection events) within `wait`.
async fn next_frame(t: &SimTransport, wait: Duration) -> Option<(usize, Vec<u8>)> {
    let deadline = Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(deadline, t.recv()).await {
            Ok(Some(TransportEvent::Frame { from, bytes })) => return Some((from, bytes.to_vec())),
            Ok(Some(_)) => continue,
            Ok(None) | Err(_) => return None,
        }
    }
}

// Goal: before the fix a crashed peer is noticed only by the liveness timeout and a send to it
// waits for ring space meanwhile. Method: rank 1 crashes; rank 0 writes 8 KiB frames to it: two
// fit in the 16 KiB ring, the third waits, and fails with PeerLost exactly when the 700 ms
// liveness timeout reports the loss. The same sends over a stream link never wait.
#[test]
fn a_send_to_a_crashed_peer_waits_for_its_ring_until_the_liveness_timeout() {
    run(async {
        let (net, mut ts) = SimNetwork::new(2, shm(700));
        let t0 = ts.remove(0);
        net.crash(1);
        let started = Instant::now();
        t0.send(1, frame(RING / 2, 1)).await.unwrap();
        t0.send(1, frame(RING / 2, 2)).await.unwrap();
        assert_eq!(started.elapsed(), Duration::ZERO, "frames that fit are written at once");
        assert_eq!(net.in_flight(0, 1), RING);
        let err = t0.send(1, frame(RING / 2, 3)).await.unwrap_err();
        assert!(matches!(err, rtx_collectives::Error::PeerLost { rank: 1, .. }), "{err}");
        assert_eq!(started.elapsed(), Duration::from_millis(700), "the send waited for the liveness timeout");
        assert_eq!(net.in_flight(0, 1), 0, "the dead peer's ring was let go");
    })
    .unwrap();
    run(async {
        let (net, mut ts) = SimNetwork::new(2, SimConfig { wire: WireModel::Stream, ..shm(700) });
        let t0 = ts.remove(0);
        net.crash(1);
        let started = Instant::now();
        for i in 0..8 {
            t0.send(1, frame(RING / 2, i)).await.unwrap();
        }
        assert_eq!(started.elapsed(), Duration::ZERO, "a stream link never waits");
    })
    .unwrap();
}

// Goal: a dying writer's frames: what it had written arrives, the frame it was writing is torn.
// Method: 2 MB/s links (a 4 KiB frame takes 2 ms to write); rank 1 sends two frames, then is
// crashed 3 ms later (the first is written, the second half-way): rank 0 gets the first only.
#[test]
fn the_frame_a_dying_writer_was_writing_is_torn() {
    run(async {
        let mut config = shm(500);
        config.link.bandwidth_bytes_per_s = 2e6;
        let (net, mut ts) = SimNetwork::new(2, config);
        let t1 = ts.remove(1);
        let t0 = ts.remove(0);
        t1.send(0, frame(4096, 7)).await.unwrap();
        t1.send(0, frame(4096, 8)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(3)).await;
        net.crash(1);
        let (from, bytes) = next_frame(&t0, Duration::from_millis(100)).await.expect("the frame written before the crash");
        assert_eq!((from, bytes[0], bytes.len()), (1, 7, 4096));
        assert_eq!(next_frame(&t0, Duration::from_millis(400)).await, None, "the torn frame must never be delivered");
    })
    .unwrap();
}

// Goal: a stalled rank (compute stuck in a collective, process alive): its own sends wait, and
// frames to it are held, so a peer's send of more than its ring waits too; nobody reports it lost.
// Released, everything flows in order.
#[test]
fn a_stalled_rank_blocks_its_sends_and_its_readers_until_released() {
    run(async {
        let (net, ts) = SimNetwork::new(2, shm(300));
        let ts: Vec<Arc<SimTransport>> = ts.into_iter().map(Arc::new).collect();
        net.stall(1);
        let t1 = Arc::clone(&ts[1]);
        let stuck_send = tokio::spawn(async move { t1.send(0, frame(100, 9)).await });
        let t0 = Arc::clone(&ts[0]);
        let to_stuck = tokio::spawn(async move {
            t0.send(1, frame(RING / 2, 1)).await?;
            t0.send(1, frame(RING, 2)).await
        });
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(!stuck_send.is_finished(), "the stalled rank's send completed");
        assert!(!to_stuck.is_finished(), "a send into the stalled rank's full ring completed");
        assert_eq!(net.in_flight(0, 1), RING / 2);
        net.unstall(1);
        stuck_send.await.unwrap().unwrap();
        to_stuck.await.unwrap().unwrap();
        let (_, first) = next_frame(&ts[1], Duration::from_millis(10)).await.unwrap();
        let (_, second) = next_frame(&ts[1], Duration::from_millis(10)).await.unwrap();
        assert_eq!((first[0], second[0]), (1, 2));
        assert_eq!(next_frame(&ts[0], Duration::from_millis(10)).await.map(|(f, b)| (f, b[0])), Some((1, 9)));
    })
    .unwrap();
}

// Goal: `Transport::abort` releases what waits at once, and the peers know now. Method: rank 1
// is stalled; rank 0's send into its full ring waits; rank 1's own send waits. Aborting rank 1's
// transport fails its send with TransportClosed and rank 0's with PeerLost in zero virtual time,
// rank 0 gets PeerLost(1), and rank 1 reads nothing more.
#[test]
fn abort_fails_waiting_sends_at_once_and_tells_the_peers() {
    run(async {
        let (net, ts) = SimNetwork::new(2, shm(10_000));
        let ts: Vec<Arc<SimTransport>> = ts.into_iter().map(Arc::new).collect();
        net.stall(1);
        let t1 = Arc::clone(&ts[1]);
        let own = tokio::spawn(async move { t1.send(0, frame(100, 9)).await });
        let t0 = Arc::clone(&ts[0]);
        let into = tokio::spawn(async move { t0.send(1, frame(2 * RING, 1)).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!own.is_finished() && !into.is_finished());
        let aborted_at = Instant::now();
        Transport::abort(ts[1].as_ref());
        let own = own.await.unwrap().unwrap_err();
        let into = into.await.unwrap().unwrap_err();
        assert_eq!(aborted_at.elapsed(), Duration::ZERO, "abort must release at once");
        assert!(matches!(own, rtx_collectives::Error::TransportClosed), "{own}");
        assert!(matches!(into, rtx_collectives::Error::PeerLost { rank: 1, .. }), "{into}");
        let lost = tokio::time::timeout(Duration::from_millis(1), ts[0].recv()).await.unwrap();
        assert!(matches!(lost, Some(TransportEvent::PeerLost(1))), "{lost:?}");
        assert!(tokio::time::timeout(Duration::from_millis(1), ts[1].recv()).await.unwrap().is_none(), "an aborted transport reads nothing");
        assert!(ts[1].send(0, frame(10, 0)).await.is_err(), "later sends fail");
    })
    .unwrap();
}
