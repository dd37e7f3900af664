//! Actor links over TCP with mutual TLS (`rtx_actors::tls`): asks both ways (inline handlers and
//! an ordinary inbound task), the same TLS exporter bytes on both ends, and the refusals: a
//! certificate from another CA, a listener that is not the rank the dialer asked for, a dialer
//! whose hello claims another rank than its certificate names; a peer that closes its end fails
//! the pending ask with `LinkClosed` instead of a hang; large envelopes from several tasks at once
//! (socket buffers full, so senders' direct writes and the writer task's queue interleave) all
//! arrive, each sender's in the order it sent them.
//!
//! Method: real TCP sockets on 127.0.0.1 and certificates from `ClusterCa`, as the collectives'
//! QUIC transport uses them; every test body runs under a wall-clock bound.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use rtx_actors::{ActorError, Inbound, Link, LinkOptions, TlsLinkListener};
use rtx_collectives::{ClusterCa, NodeIdentity};
use tokio::sync::mpsc::Receiver;

const TEST_TIMEOUT: Duration = Duration::from_secs(30);
const ASK_TIMEOUT: Duration = Duration::from_secs(10);

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn options() -> LinkOptions {
    LinkOptions { connect_timeout: Duration::from_secs(5), ..LinkOptions::default() }
}

/// The identity of `rank` with the hello claiming `claimed` instead (same certificate and key).
fn claiming(identity: &NodeIdentity, ca: &ClusterCa, claimed: usize) -> NodeIdentity {
    let (cert, key) = identity.to_der().unwrap();
    NodeIdentity::from_der(claimed, ca.certificate().as_ref().to_vec(), cert, key)
}

/// Rank 0 dials rank 1's listener: rank 0's link and inbound queue, then rank 1's.
async fn connected_pair() -> ((Link, Receiver<Inbound>), (Link, Receiver<Inbound>)) {
    let ca = ClusterCa::generate("tls link test").unwrap();
    let (id0, id1) = (ca.issue(0).unwrap(), ca.issue(1).unwrap());
    let listener = TlsLinkListener::bind(&id1, loopback(), options()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = tokio::spawn(async move { listener.accept().await });
    let dialed = Link::dial_tls(&id0, addr, 1, options()).await.unwrap();
    let (peer, link1, inbound1) = accepted.await.unwrap().unwrap();
    assert_eq!(peer, 0, "the listener learns the dialer's rank");
    (dialed, (link1, inbound1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asks_go_both_ways_and_the_exporter_agrees() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let ((link0, mut inbound0), (link1, _inbound1)) = connected_pair().await;

        // Rank 1 answers inline, rank 0 from an ordinary task reading its inbound queue.
        link1.serve_inline("add", |(a, b): (u64, u64)| Ok::<u64, String>(a + b));
        let serving = tokio::spawn(async move {
            let mut answered = 0u64;
            while let Some(msg) = inbound0.recv().await {
                let v: u64 = msg.decode().unwrap();
                msg.reply(&(v * 3)).await.unwrap();
                answered += 1;
            }
            answered
        });
        for i in 0..200u64 {
            let sum: u64 = link0.remote::<(u64, u64)>("add").ask(&(i, 7), ASK_TIMEOUT).await.unwrap();
            assert_eq!(sum, i + 7);
            let tripled: u64 = link1.remote::<u64>("triple").ask(&i, ASK_TIMEOUT).await.unwrap();
            assert_eq!(tripled, 3 * i);
        }
        let (k0, k1) = (link0.export_keying_material(b"join").unwrap(), link1.export_keying_material(b"join").unwrap());
        assert_eq!(k0, k1, "both ends export the same keying material");
        assert_ne!(k0, [0u8; 32]);
        assert_ne!(k0, link0.export_keying_material(b"other label").unwrap());

        link0.close("test done");
        assert_eq!(serving.await.unwrap(), 200, "rank 0's task answered every ask, and its queue ended with the link");
        link1.closed().await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_closes_fails_the_pending_ask() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let ((link0, _inbound0), (link1, mut inbound1)) = connected_pair().await;
        // Rank 1 takes the ask and closes its link instead of answering.
        let closer = tokio::spawn(async move {
            let msg = inbound1.recv().await.expect("the ask arrives");
            link1.close("going away");
            drop(msg);
        });
        let err = link0.remote::<u64>("hold").ask::<u64>(&1, ASK_TIMEOUT).await.unwrap_err();
        assert!(matches!(err, ActorError::LinkClosed { .. }), "got {err:?}");
        closer.await.unwrap();
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_and_impostors_are_refused() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let ca = ClusterCa::generate("tls link test").unwrap();
        let other_ca = ClusterCa::generate("another cluster").unwrap();
        let (id0, id1) = (ca.issue(0).unwrap(), ca.issue(1).unwrap());
        let listener = TlsLinkListener::bind(&id1, loopback(), options()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepting = tokio::spawn(async move { listener.accept().await });

        // A certificate from another CA fails the handshake.
        let stranger = other_ca.issue(0).unwrap();
        let err = Link::dial_tls(&stranger, addr, 1, options()).await.unwrap_err();
        assert!(matches!(err, ActorError::Connect { .. }), "got {err:?}");

        // Dialing rank 2 at rank 1's address: the listener's certificate does not name rank 2.
        let err = Link::dial_tls(&id0, addr, 2, options()).await.unwrap_err();
        assert!(matches!(err, ActorError::Connect { .. }), "got {err:?}");

        // Rank 0's certificate with a hello claiming rank 5: the listener drops it, so the
        // dialer's ask fails with a closed link, and the listener returns no link for it.
        let impostor = claiming(&id0, &ca, 5);
        let (link, _inbound) = Link::dial_tls(&impostor, addr, 1, options()).await.unwrap();
        let err = link.remote::<u64>("anything").ask::<u64>(&1, ASK_TIMEOUT).await.unwrap_err();
        assert!(matches!(err, ActorError::LinkClosed { .. }), "got {err:?}");
        assert!(!accepting.is_finished(), "no refused peer came out of accept");

        // The listener still accepts an honest rank afterwards.
        let (honest, _inbound) = Link::dial_tls(&id0, addr, 1, options()).await.unwrap();
        let (peer, link1, _inbound1) = accepting.await.unwrap().unwrap();
        assert_eq!(peer, 0);
        link1.serve_inline("ping", |v: u64| Ok::<u64, String>(v + 1));
        let v: u64 = honest.remote::<u64>("ping").ask(&41, ASK_TIMEOUT).await.unwrap();
        assert_eq!(v, 42);
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_large_tells_keep_each_senders_order() {
    const SENDERS: u64 = 4;
    const TELLS: u64 = 40;
    const BODY: usize = 256 * 1024;
    tokio::time::timeout(TEST_TIMEOUT, async {
        let ((link0, _inbound0), (_link1, mut inbound1)) = connected_pair().await;
        let senders: Vec<_> = (0..SENDERS)
            .map(|sender| {
                let remote = link0.remote::<(u64, u64, Vec<u8>)>("sink");
                tokio::spawn(async move {
                    for seq in 0..TELLS {
                        let fill = u8::try_from((sender * 31 + seq) % 251).unwrap();
                        remote.tell(&(sender, seq, vec![fill; BODY])).await.unwrap();
                    }
                })
            })
            .collect();
        let mut next = [0u64; SENDERS as usize];
        for _ in 0..SENDERS * TELLS {
            let msg = inbound1.recv().await.expect("every tell arrives");
            let (sender, seq, body): (u64, u64, Vec<u8>) = msg.decode().unwrap();
            let fill = u8::try_from((sender * 31 + seq) % 251).unwrap();
            assert_eq!(seq, next[sender as usize], "sender {sender}'s tells arrive in order");
            assert!(body.len() == BODY && body.iter().all(|b| *b == fill), "sender {sender} tell {seq} arrives whole");
            next[sender as usize] += 1;
        }
        for sender in senders {
            sender.await.unwrap();
        }
    })
    .await
    .expect("test timed out");
}
