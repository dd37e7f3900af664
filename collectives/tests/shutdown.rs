//! Shutdown races: a rank that finishes its last collective and goes away at once (drops its
//! communicator, endpoint and transport) must not fail peers that are still reading frames it
//! already sent. A lost peer fails only receives whose frame from it never arrived.
//!
//! Method: in-process worlds on a paused clock, where the finishing rank is made to finish first
//! (a broadcast root needs nothing back; a peer joins later), plus a sweep of ring and doubling
//! all-reduces with the dropping rank racing the others; and the same over QUIC on loopback,
//! where dropping the transport must let its last frames reach the peers. A positive control
//! checks that a rank that leaves *before* sending what a peer needs still fails that peer fast.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use rtx_collectives::{CommConfig, Communicator, Error, OpKind, ReduceOp};

const OP_TIMEOUT: Duration = Duration::from_secs(5);

fn config(small_message_bytes: usize, chunk_bytes: usize) -> CommConfig {
    CommConfig { op_timeout: OP_TIMEOUT, small_message_bytes, chunk_bytes: Some(chunk_bytes), ..CommConfig::default() }
}

/// Runs the same all-reduce on every rank; rank `leaver` drops its communicator (the only handle
/// to its endpoint and transport) as soon as its call returns. Returns every rank's result.
async fn all_reduce_then_leave(comms: Vec<Communicator>, leaver: usize, len: usize) -> Vec<Result<Vec<f32>, Error>> {
    let tasks: Vec<_> = comms
        .into_iter()
        .map(|c| {
            tokio::spawn(async move {
                let r = c.rank();
                let mut buf: Vec<f32> = (0..len).map(|i| ((i + r) % 5) as f32).collect();
                let result = c.all_reduce(&mut buf, ReduceOp::Sum).await;
                if r == leaver {
                    drop(c);
                }
                result.map(|()| buf)
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(tokio::time::timeout(TEST_TIMEOUT, t).await.expect("rank hung").unwrap());
    }
    out
}

fn expected(n: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| (0..n).map(|r| ((i + r) % 5) as f32).sum()).collect()
}

// Goal: with two ranks, the one that finishes a collective first and drops its transport right
// away does not fail the other, for ring and doubling all-reduces of several sizes and whichever
// rank leaves.
#[tokio::test(start_paused = true)]
async fn leaving_right_after_all_reduce_does_not_fail_the_peer() {
    for (small, chunk) in [(0, 64), (usize::MAX, 40), (0, 1 << 20)] {
        for len in [1, 7, 100, 5000] {
            for leaver in 0..2 {
                let (_net, comms) = world(2, config(small, chunk));
                let out = all_reduce_then_leave(comms, leaver, len).await;
                for (rank, result) in out.into_iter().enumerate() {
                    assert_eq!(result, Ok(expected(2, len)), "rank {rank}, leaver {leaver}, len {len}, small {small}, chunk {chunk}");
                }
            }
        }
    }
}

// Goal: the same with 3 and 4 ranks: ranks further round the ring that only wait on live peers
// are not failed by the leaver's departure either.
#[tokio::test(start_paused = true)]
async fn leaving_right_after_ring_all_reduce_does_not_fail_the_others() {
    for n in [3, 4] {
        for leaver in 0..n {
            let (_net, comms) = world(n, config(0, 64));
            let out = all_reduce_then_leave(comms, leaver, 1000).await;
            for (rank, result) in out.into_iter().enumerate() {
                assert_eq!(result, Ok(expected(n, 1000)), "n {n}, rank {rank}, leaver {leaver}");
            }
        }
    }
}

// Goal: the deterministic form of the race. The broadcast root sends everything, returns and
// drops its transport before the other rank even starts the broadcast; that rank still gets the
// data (it was delivered before the loss), and only its next collective fails with PeerLost.
#[tokio::test(start_paused = true)]
async fn receiver_starting_after_root_left_still_gets_the_data() {
    for (small, chunk) in [(usize::MAX, 64), (0, 64)] {
        let (_net, mut comms) = world(2, config(small, chunk));
        let root = comms.pop().unwrap();
        let mut data = vec![2.5f64; 300];
        root.broadcast(&mut data, 1).await.unwrap();
        drop(root);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let late = &comms[0];
        let mut got = vec![0.0f64; 300];
        late.broadcast(&mut got, 1).await.unwrap();
        assert_eq!(got, data);
        assert_eq!(late.barrier().await, Err(Error::PeerLost { rank: 1, op: OpKind::Barrier }));
    }
}

// Goal (positive control): a rank that leaves before sending what a peer needs still fails that
// peer at once with PeerLost, and a peer that only waits on live ranks is told by the rank that
// saw the loss (abort frame) instead of waiting for the timeout.
#[tokio::test(start_paused = true)]
async fn leaving_early_still_fails_peers_fast() {
    let (_net, mut comms) = world(3, config(0, 64));
    drop(comms.pop());
    let started = tokio::time::Instant::now();
    let out = run_ranks(&comms, |c| async move {
        let mut buf = vec![1.0f32; 1000];
        c.all_reduce(&mut buf, ReduceOp::Sum).await
    })
    .await;
    for result in out {
        assert_eq!(result, Err(Error::PeerLost { rank: 2, op: OpKind::AllReduce }));
    }
    assert!(started.elapsed() < OP_TIMEOUT);
}

#[cfg(feature = "quic")]
mod quic {

    use rtx_collectives::{ClusterCa, QuicOptions, QuicTransport};

    use super::*;

    async fn quic_world(n: usize, config: CommConfig) -> Vec<Communicator> {
        let ca = ClusterCa::generate("rtx shutdown test").unwrap();
        let options = QuicOptions { connect_timeout: Duration::from_secs(20), ..QuicOptions::default() };
        network_comms(&QuicTransport::loopback_world(&ca, n, options).await.unwrap(), &config)
    }

    // Goal: over QUIC, a rank that drops its endpoint (and so its transport) right after its last
    // collective returns does not fail its peer: its last frames still arrive (the transport
    // lingers to deliver them), and frames that arrived before the link ended are used.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn quic_leaving_right_after_last_collective_does_not_fail_the_peer() {
        for leaver in 0..2 {
            let comms = quic_world(2, config(0, 256 << 10)).await;
            let out = all_reduce_then_leave(comms, leaver, 1 << 20).await;
            for (rank, result) in out.into_iter().enumerate() {
                assert!(result == Ok(expected(2, 1 << 20)), "rank {rank}, leaver {leaver}: {:?}", result.err());
            }
        }
        root_leaves_before_the_receiver_starts(quic_world(2, config(0, 256 << 10)).await).await;
    }

    /// The deterministic form: the root broadcasts 4 MiB and drops its transport at once; the
    /// other rank starts only after the link is gone.
    pub(super) async fn root_leaves_before_the_receiver_starts(mut comms: Vec<Communicator>) {
        let root = comms.pop().unwrap();
        let data: Vec<f32> = (0..(1 << 20)).map(|i| i as f32).collect();
        let mut sent = data.clone();
        root.broadcast(&mut sent, 1).await.unwrap();
        drop(root);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut got = vec![0.0f32; 1 << 20];
        comms[0].broadcast(&mut got, 1).await.unwrap();
        assert!(got == data);
    }
}

#[cfg(feature = "quic")]
mod tls {
    use rtx_collectives::{ClusterCa, TlsOptions, TlsTransport};

    use super::*;

    async fn tls_world(n: usize, config: CommConfig) -> Vec<Communicator> {
        let ca = ClusterCa::generate("rtx shutdown test").unwrap();
        let options = TlsOptions { connect_timeout: Duration::from_secs(20), ..TlsOptions::default() };
        network_comms(&TlsTransport::loopback_world(&ca, n, options).await.unwrap(), &config)
    }

    // Goal: over TLS on TCP, a rank that drops its transport right after its last collective does
    // not fail its peer: queued frames are still written before the connection half-closes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tls_leaving_right_after_last_collective_does_not_fail_the_peer() {
        for leaver in 0..2 {
            let comms = tls_world(2, config(0, 256 << 10)).await;
            let out = all_reduce_then_leave(comms, leaver, 1 << 20).await;
            for (rank, result) in out.into_iter().enumerate() {
                assert!(result == Ok(expected(2, 1 << 20)), "rank {rank}, leaver {leaver}: {:?}", result.err());
            }
        }
        super::quic::root_leaves_before_the_receiver_starts(tls_world(2, config(0, 256 << 10)).await).await;
    }
}
