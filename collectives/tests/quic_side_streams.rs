//! Side streams of the QUIC transport: extra bidirectional streams to a peer rank, routed by
//! channel, on the control connection `connect` made beside the collectives' with
//! `ControlPath::OwnThread` (no connection is opened per stream), that do not stall the collectives when nobody reads them; and typed errors
//! for bad peers and a closed transport.
//!
//! Method: two or three ranks on 127.0.0.1 with certificates from one `ClusterCa`; side streams
//! echo bytes; the connection is identified by quinn's stable id and the endpoints' counters.
#![cfg(feature = "quic")]
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use rtx_collectives::{ClusterCa, CommConfig, ControlPath, Endpoint, Error, OpKind, QuicOptions, QuicTransport, ReduceOp, Transport};

fn options() -> QuicOptions {
    QuicOptions {
        connect_timeout: Duration::from_secs(20),
        idle_timeout: Duration::from_secs(3),
        keep_alive: Duration::from_millis(500),
        control: ControlPath::OwnThread,
        ..QuicOptions::default()
    }
}

async fn cluster(ca: &ClusterCa, n: usize) -> Vec<Arc<QuicTransport>> {
    QuicTransport::loopback_world(ca, n, options()).await.unwrap()
}

// Goal: streams reach the acceptor of their own channel with the opener's rank, carry bytes both
// ways, and share the collectives' connection. Method: rank 2 opens one stream on channel 7 and
// one on channel 9 to rank 0, rank 1 one on channel 7; rank 0 accepts per channel and echoes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn side_streams_are_routed_by_channel_on_the_one_connection() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let ca = ClusterCa::generate("rtx side-stream test").unwrap();
        let t = cluster(&ca, 3).await;
        let ids = (t[0].connection_id(2).unwrap(), t[2].connection_id(0).unwrap());
        let echo = |t: Arc<QuicTransport>, channel: u32, n: usize| {
            tokio::spawn(async move {
                let mut peers = Vec::new();
                for _ in 0..n {
                    let (peer, mut send, mut recv) = t.accept_stream(channel).await.unwrap();
                    let mut buf = [0u8; 5];
                    recv.read_exact(&mut buf).await.unwrap();
                    buf[4] = channel as u8;
                    send.write_all(&buf).await.unwrap();
                    send.finish().unwrap();
                    peers.push(peer);
                }
                peers.sort_unstable();
                peers
            })
        };
        let sevens = echo(Arc::clone(&t[0]), 7, 2);
        let nines = echo(Arc::clone(&t[0]), 9, 1);
        let ask = |t: Arc<QuicTransport>, channel: u32| async move {
            let (mut send, mut recv) = t.open_stream(0, channel).await.unwrap();
            send.write_all(b"ping\0").await.unwrap();
            recv.read_to_end(64).await.unwrap()
        };
        assert_eq!(ask(Arc::clone(&t[2]), 9).await, b"ping\x09");
        assert_eq!(ask(Arc::clone(&t[2]), 7).await, b"ping\x07");
        assert_eq!(ask(Arc::clone(&t[1]), 7).await, b"ping\x07");
        assert_eq!(sevens.await.unwrap(), vec![1, 2]);
        assert_eq!(nines.await.unwrap(), vec![2]);
        assert_eq!((t[0].connection_id(2).unwrap(), t[2].connection_id(0).unwrap()), ids);
        for transport in &t {
            assert_eq!(transport.open_connections(), 2);
            // With `OwnThread` side streams ride a control connection of their own per peer pair.
            assert_eq!(transport.open_control_connections(), 2);
        }
        assert_ne!(t[0].connection_id(2), t[0].frame_connection_id(2));
        assert_eq!(t[0].export_keying_material(2, b"x").unwrap(), t[2].export_keying_material(0, b"x").unwrap());
        assert_ne!(t[0].export_keying_material(2, b"x").unwrap(), t[0].export_keying_material(1, b"x").unwrap());
    })
    .await
    .unwrap();
}

// Goal: a side stream nobody reads cannot stall the collectives (QUIC flow control is per
// stream). Method: rank 0 writes far more than a stream window into a stream rank 1 accepted but
// never reads, while both ranks run all_reduces of 4 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unread_side_stream_does_not_stall_collectives() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let ca = ClusterCa::generate("rtx side-stream test").unwrap();
        let t = cluster(&ca, 2).await;
        let acceptor = Arc::clone(&t[1]);
        let accepted = tokio::spawn(async move { acceptor.accept_stream(3).await.unwrap() });
        let (mut send, _recv) = t[0].open_stream(1, 3).await.unwrap();
        let _held = accepted.await.unwrap();
        let flood = tokio::spawn(async move {
            let chunk = vec![0xA5u8; 1 << 20];
            // Blocks once the peer's stream window is full; aborted at the end.
            loop {
                if send.write_all(&chunk).await.is_err() {
                    return;
                }
            }
        });
        let comms: Vec<_> = t
            .iter()
            .map(|t| {
                let t: Arc<dyn Transport> = Arc::clone(t) as Arc<dyn Transport>;
                Endpoint::new(t, CommConfig { op_timeout: Duration::from_secs(20), ..CommConfig::default() }).unwrap().world().unwrap()
            })
            .collect();
        let out = run_ranks(&comms, |c| async move {
            for round in 0..5 {
                let mut v = vec![c.rank() as f32 + round as f32; 1 << 20];
                c.all_reduce(&mut v, ReduceOp::Sum).await.unwrap();
                assert!(v.iter().all(|&x| x == 1.0 + 2.0 * round as f32));
            }
        })
        .await;
        assert_eq!(out.len(), 2);
        assert!(!flood.is_finished(), "the flood should still be held by flow control");
        flood.abort();
    })
    .await
    .unwrap();
}

// Goal: bad requests get typed errors, not hangs. Method: a stream to oneself, to a rank outside
// the world, to a lost peer; an accept on a closed transport.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn side_stream_errors_are_typed() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let ca = ClusterCa::generate("rtx side-stream test").unwrap();
        let mut t = cluster(&ca, 2).await;
        assert_eq!(t[0].open_stream(0, 1).await.err(), Some(Error::SelfPeer { op: OpKind::Send, rank: 0 }));
        assert_eq!(t[0].open_stream(5, 1).await.err(), Some(Error::RankOutOfRange { rank: 5, size: 2 }));
        // A waiting accept ends when its transport closes.
        let waiting = tokio::spawn({
            let t1 = Arc::clone(&t[1]);
            async move { t1.accept_stream(1).await.err() }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        t[1].close(Duration::from_secs(2)).await;
        assert_eq!(waiting.await.unwrap(), Some(Error::TransportClosed));
        assert_eq!(t[1].accept_stream(1).await.err(), Some(Error::TransportClosed));
        drop(t.pop());
        // Once rank 0 has seen the connection close, opening a stream to rank 1 fails as a lost
        // peer (until then it may still succeed: the close is in flight).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let refused = loop {
            match t[0].open_stream(1, 1).await {
                Err(e) => break Some(e),
                Ok(_) if tokio::time::Instant::now() > deadline => break None,
                Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        assert_eq!(refused, Some(Error::PeerLost { rank: 1, op: OpKind::Send }));
    })
    .await
    .unwrap();
}
