//! The TLS-over-TCP transport on loopback: collectives with exact results over one and several
//! connections per pair and across key updates, peer loss, close without waiting for the peer
//! (leaving right after the last collective: tests/shutdown.rs), refusal of peers that cannot prove their rank, and a byte
//! flipped on the wire failing the operation instead of corrupting it.
//!
//! Method: every rank binds 127.0.0.1:0 in this process. Refusals use the transport itself with a
//! wrong identity (another CA's certificate; a certificate naming one rank used to claim another)
//! and raw sockets (junk instead of a handshake). The tampering test puts a TCP proxy between two
//! ranks that flips one byte of the dialer's data stream past the handshake.
#![cfg(feature = "quic")]
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use rtx_collectives::{AllReduceAlgorithm, Cipher, ClusterCa, CommConfig, Error, OpKind, ReduceOp, TlsOptions, TlsTransport, Transport, TransportEvent};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const LOOPBACK: &str = "127.0.0.1:0";

fn options() -> TlsOptions {
    TlsOptions { connect_timeout: Duration::from_secs(20), ..TlsOptions::default() }
}

// Goal: collectives over TLS give correct results on the large ring and small doubling paths, with
// one and three connections per pair (frames overtake each other across them), and a rank that
// goes away makes the survivors' next collective fail with PeerLost naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_over_tls_and_peer_loss() {
    let _ = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).try_init();
    for stripes in [1, 3] {
        let ca = ClusterCa::generate("rtx test cluster").unwrap();
        let transports = TlsTransport::loopback_world(&ca, 3, TlsOptions { stripes, ..options() }).await.unwrap();
        for (r, t) in transports.iter().enumerate() {
            let expected: Vec<usize> = (0..3).filter(|&p| p != r).collect();
            assert_eq!(t.connected_peers(), expected);
            assert_eq!(t.open_connections(), 2 * stripes, "rank {r}: {stripes} connections per peer");
        }
        let config = CommConfig { op_timeout: Duration::from_secs(20), ..CommConfig::default() };
        let comms = network_comms(&transports, &config);
        drop(transports);
        collectives_then_peer_loss(comms).await;
    }
}

// Goal: exact, bit-identical results when both directions of every connection update their keys
// every few records (the KeyUpdate record, rustls's next secret, sequence numbers from 0 again),
// with frames small and large (pieces of the read buffers), every reduce op and an odd length;
// with 1 MiB frames both by the ring and by the direct exchange (TLS's choice at this size).
// Method: 4 ranks, exact inputs (RTX_TEST_SEED), key update every 3 records, 2 stripes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_updates_and_frames_of_every_size_give_exact_results() {
    let seed = seed();
    let n = 4;
    let len = 300_007;
    let ca = ClusterCa::generate("rtx test cluster").unwrap();
    for (chunk, direct_ranks) in [(4 << 10, None), (20 << 10, None), (1 << 20, Some(0)), (1 << 20, None)] {
        // One endpoint per transport: a world per configuration.
        let transports = TlsTransport::loopback_world(&ca, n, TlsOptions { stripes: 2, key_update_records: 3, ..options() }).await.unwrap();
        let config = CommConfig {
            op_timeout: Duration::from_secs(20),
            small_message_bytes: 0,
            chunk_bytes: Some(chunk),
            direct_all_reduce_ranks: direct_ranks,
            ..CommConfig::default()
        };
        let comms = network_comms(&transports, &config);
        let algorithm = comms[0].all_reduce_algorithm(4 * len);
        let want_algorithm = if chunk == 1 << 20 && direct_ranks.is_none() { AllReduceAlgorithm::Direct } else { AllReduceAlgorithm::Ring };
        assert_eq!(algorithm, want_algorithm, "chunk {chunk}, direct up to {direct_ranks:?} ranks");
        for (case, op) in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg].into_iter().enumerate() {
            let inputs = exact_inputs::<f32>(seed, case as u64, n, len);
            let want = reference(op, &inputs);
            let out = run_ranks(&comms, |c| {
                let mut buf = inputs[c.rank()].clone();
                async move {
                    c.all_reduce(&mut buf, op).await.unwrap();
                    buf
                }
            })
            .await;
            for (rank, got) in out.iter().enumerate() {
                assert_eq!(bits(got), bits(&want), "seed {seed}, chunk {chunk}, {algorithm:?}, {op:?}, rank {rank}");
            }
        }
        // The all-gather frames of 16 KiB and more were handed over sealed and opened into the
        // output by the operation, key updates in the middle of their records included.
        let sealed: u64 = transports.iter().map(|t| t.payloads_left_sealed()).sum();
        if chunk >= 16 << 10 {
            assert!(sealed > 0, "chunk {chunk}: no payload was left sealed");
        } else {
            assert_eq!(sealed, 0, "chunk {chunk}: frames under 16 KiB are opened by the reader");
        }
    }
}

// Goal: the fused ring over TLS (every frame left sealed until the operation reads it, Forward
// steps combined into the outgoing records as they are sealed) gives the reference's bits for
// reduce_scatter (both forms), all_reduce and all_gather, for 8-byte elements (f64) and for bf16
// (2-byte elements, reduced in f32 accumulators on the wire), with frames of 20 KiB + 24 bytes
// (a 16 KiB record and a tail of another size per frame; elements split across pieces are covered
// by `frame::tests::plain_stream_takes_elements_across_any_cuts`) and a key update every 5
// records, over one connection and over two shared by four channels. Method: 3 ranks (a ring
// with a Forward and a Gather step), exact inputs (RTX_TEST_SEED).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fused_rings_over_sealed_records_give_exact_results_for_every_element_size() {
    async fn check<T: TestElem>(comms: &[rtx_collectives::Communicator], seed: u64, len: usize) {
        for (case, op) in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min].into_iter().enumerate() {
            let inputs = exact_inputs::<T>(seed, case as u64, comms.len(), len);
            let want = reference(op, &inputs);
            let inputs = Arc::new(inputs);
            let out = run_ranks(comms, |c| {
                let inputs = Arc::clone(&inputs);
                async move {
                    let r = c.rank();
                    let seg = c.segment(len, r);
                    let mut scattered = vec![T::from_f64(99.0); seg.len()];
                    c.reduce_scatter(&inputs[r], &mut scattered, op).await.unwrap();
                    let mut in_place = inputs[r].clone();
                    c.reduce_scatter_in_place(&mut in_place, op).await.unwrap();
                    let mut reduced = inputs[r].clone();
                    c.all_reduce(&mut reduced, op).await.unwrap();
                    let mut gathered = vec![T::from_f64(99.0); len];
                    gathered[seg.clone()].copy_from_slice(&scattered);
                    c.all_gather_in_place(&mut gathered).await.unwrap();
                    (seg, scattered, in_place, reduced, gathered)
                }
            })
            .await;
            for (rank, (seg, scattered, in_place, reduced, gathered)) in out.iter().enumerate() {
                let what = format!("seed {seed}, {} {op:?}, rank {rank}", T::DTYPE);
                assert_eq!(bits(scattered), bits(&want[seg.clone()]), "{what}: reduce_scatter");
                assert_eq!(bits(&in_place[seg.clone()]), bits(&want[seg.clone()]), "{what}: reduce_scatter_in_place");
                assert_eq!(bits(reduced), bits(&want), "{what}: all_reduce");
                assert_eq!(bits(gathered), bits(&want), "{what}: all_gather");
            }
        }
    }
    let seed = seed();
    let ca = ClusterCa::generate("rtx test cluster").unwrap();
    // One connection and one ring; then 2 connections shared by the 4 channels of each all_reduce,
    // sending at once from their own threads, so frames take whichever connection is free
    // (`Link::claim`) and overtake each other.
    for (stripes, channels) in [(1, None), (2, Some(4))] {
        let transports = TlsTransport::loopback_world(&ca, 3, TlsOptions { stripes, key_update_records: 5, ..options() }).await.unwrap();
        let config = CommConfig { op_timeout: Duration::from_secs(20), small_message_bytes: 0, chunk_bytes: Some((20 << 10) + 24), channels, ..CommConfig::default() };
        let comms = network_comms(&transports, &config);
        if channels.is_some() {
            assert_eq!(comms[0].all_reduce_channels(8 * 100_003), 4, "the f64 all_reduce runs in 4 channels");
        }
        check::<f64>(&comms, seed, 100_003).await;
        check::<half::bf16>(&comms, seed, 150_001).await;
        assert!(transports.iter().map(|t| t.payloads_left_sealed()).sum::<u64>() > 0, "no payload was left sealed");
    }
}

// Goal: a rank that goes away while the others wait in a mid-size all_reduce (the direct
// exchange, TLS's choice at this size: every rank waits on every other) fails their operation
// with PeerLost naming it, well within the operation timeout, instead of a hang. Method: 3 ranks;
// ranks 0 and 1 start the all_reduce, rank 2 never does and its transport is aborted 300 ms later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_lost_during_the_direct_exchange_fails_it_with_peer_lost() {
    let ca = ClusterCa::generate("rtx test cluster").unwrap();
    let transports = TlsTransport::loopback_world(&ca, 3, options()).await.unwrap();
    let config = CommConfig { op_timeout: Duration::from_secs(60), ..CommConfig::default() };
    let mut comms = network_comms(&transports, &config);
    assert_eq!(comms[0].all_reduce_algorithm(4 << 20), AllReduceAlgorithm::Direct);
    let _silent = comms.pop();
    let doomed = Arc::clone(&transports[2]);
    drop(transports);
    let started = std::time::Instant::now();
    let abort = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        doomed.abort();
    });
    let out = run_ranks(&comms, |c| async move {
        let mut buf = vec![1.0f32; 1 << 20];
        c.all_reduce(&mut buf, ReduceOp::Sum).await
    })
    .await;
    abort.await.unwrap();
    for (rank, result) in out.into_iter().enumerate() {
        assert_eq!(result, Err(Error::PeerLost { rank: 2, op: OpKind::AllReduce }), "rank {rank}");
    }
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(20), "the survivors failed after {took:?}");
}

// Goal: ChaCha20-Poly1305 (the suite for CPUs without AES instructions, or forced) runs the whole
// data path: records sealed out of place, opened in place by the reader, all-gather payloads left
// sealed and opened into the output, key updates; results bit-exact. Method: 3 ranks offering only
// that suite (so a finished handshake means it was negotiated), key update every 5 records,
// 64 KiB frames, exact inputs (RTX_TEST_SEED); then a dialer offering only AES-128-GCM to an
// acceptor offering only ChaCha20-Poly1305: no common suite, so connect fails with an error
// within its timeout instead of hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chacha20_poly1305_carries_the_collectives_and_no_common_suite_is_an_error() {
    let seed = seed();
    let (n, len) = (3, 200_003);
    let ca = ClusterCa::generate("rtx test cluster").unwrap();
    let chacha = TlsOptions { cipher: Cipher::ChaCha20Poly1305, key_update_records: 5, ..options() };
    let transports = TlsTransport::loopback_world(&ca, n, chacha.clone()).await.unwrap();
    let config = CommConfig { op_timeout: Duration::from_secs(20), chunk_bytes: Some(64 << 10), ..CommConfig::default() };
    let comms = network_comms(&transports, &config);
    let inputs = exact_inputs::<f32>(seed, 0, n, len);
    let want = reference(ReduceOp::Sum, &inputs);
    let out = run_ranks(&comms, |c| {
        let mut buf = inputs[c.rank()].clone();
        async move {
            c.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
            buf
        }
    })
    .await;
    for (rank, got) in out.iter().enumerate() {
        assert_eq!(bits(got), bits(&want), "seed {seed}, rank {rank}");
    }
    assert!(transports.iter().map(|t| t.payloads_left_sealed()).sum::<u64>() > 0, "all-gather payloads were left sealed");

    let quick = Duration::from_secs(2);
    let aes_only = TlsOptions { cipher: Cipher::Aes128Gcm, connect_timeout: quick, ..options() };
    let r0 = TlsTransport::bind(&ca.issue(0).unwrap(), 2, LOOPBACK.parse().unwrap(), aes_only).unwrap();
    let r1 = TlsTransport::bind(&ca.issue(1).unwrap(), 2, LOOPBACK.parse().unwrap(), TlsOptions { connect_timeout: quick, ..chacha }).unwrap();
    let addrs = [r0.local_addr(), r1.local_addr()];
    let started = std::time::Instant::now();
    let (a, b) = tokio::join!(r0.connect(&addrs), r1.connect(&addrs));
    assert!(a.is_err() && b.is_err(), "no common suite, yet connect gave {a:?} and {b:?}");
    assert!(started.elapsed() < Duration::from_secs(10), "connect failed only after {:?}", started.elapsed());
}

// Goal: close writes what is queued and half-closes at once, while the peer is still alive: it
// does not wait for the peer to go first (both sides closing would otherwise wait for each other
// until the timeout), and the peer then sees the link end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_finishes_without_waiting_for_the_peer() {
    let ca = ClusterCa::generate("rtx test cluster").unwrap();
    let transports = TlsTransport::loopback_world(&ca, 2, options()).await.unwrap();
    // Readers start once someone listens: attach both ranks to endpoints.
    let _comms = network_comms(&transports, &CommConfig::default());
    let started = tokio::time::Instant::now();
    transports[0].close(Duration::from_secs(60)).await;
    assert!(started.elapsed() < Duration::from_secs(10), "close waited {:?} for a live peer", started.elapsed());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !transports[1].connected_peers().is_empty() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(transports[1].connected_peers().is_empty(), "the peer never saw the link end");
}

/// Two TLS ranks whose operations time out only after 60 s: a wait that the abort must end shows
/// as a test timeout, not as a typed error.
async fn two_ranks_with_long_timeout() -> (Vec<Arc<TlsTransport>>, Vec<rtx_collectives::Communicator>) {
    let ca = ClusterCa::generate("rtx test cluster").unwrap();
    let config = CommConfig { op_timeout: Duration::from_secs(60), ..CommConfig::default() };
    let transports = TlsTransport::loopback_world(&ca, 2, options()).await.unwrap();
    let comms = network_comms(&transports, &config);
    (transports, comms)
}

// Goal: aborting a transport fails a collective waiting on it at once with a typed error (no hang
// until the operation timeout), and later sends fail with TransportClosed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_fails_waiting_operations_promptly() {
    let (transports, comms) = two_ranks_with_long_timeout().await;
    // Rank 1 never joins; rank 0 waits for it until its peer's transport is aborted.
    let waiting = {
        let c = comms[0].clone();
        tokio::spawn(async move {
            let mut buf = vec![1.0f32; 1 << 16];
            c.all_reduce(&mut buf, ReduceOp::Sum).await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    transports[1].abort();
    let result = tokio::time::timeout(Duration::from_secs(10), waiting).await.expect("abort must end the wait promptly").unwrap();
    assert_eq!(result, Err(Error::PeerLost { rank: 1, op: OpKind::AllReduce }));
    let frame = rtx_collectives::PooledBuf::unpooled(vec![0; 64]);
    assert_eq!(transports[1].send(0, frame).await, Err(Error::TransportClosed));
}

// Goal: the aborted rank's own operations fail at once too, with TransportClosed: one already
// waiting to receive, and a receive-only one started after the generation moved on (a worker
// whose generation is superseded while it starts: the agent moves the group on, then aborts the
// transport, and the start goes on to its first broadcast). Found by the chaos harness: such a
// worker waited the whole operation timeout, and the supervisor evicted it as hung.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_transport_fails_its_own_receives_at_once() {
    let (transports, comms) = two_ranks_with_long_timeout().await;
    let waiting = {
        let c = comms[1].clone();
        tokio::spawn(async move {
            let mut buf = vec![0.0f32; 1 << 10];
            c.broadcast(&mut buf, 0).await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    comms[1].set_generation(comms[1].generation() + 1).unwrap();
    transports[1].abort();
    let result = tokio::time::timeout(Duration::from_secs(10), waiting).await.expect("the waiting receive must end promptly").unwrap();
    assert!(matches!(result, Err(Error::StaleGeneration { .. } | Error::TransportClosed)), "{result:?}");
    let mut buf = vec![0.0f32; 1 << 10];
    let later = tokio::time::timeout(Duration::from_secs(10), comms[1].broadcast(&mut buf, 0)).await.expect("a receive after the abort must fail at once");
    assert_eq!(later, Err(Error::TransportClosed));
}

// Goal: connect gives a typed error naming the missing peer when a rank never shows up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_times_out_with_missing_peer() {
    let ca = ClusterCa::generate("rtx test cluster").unwrap();
    let opts = TlsOptions { connect_timeout: Duration::from_millis(500), ..TlsOptions::default() };
    let t0 = TlsTransport::bind(&ca.issue(0).unwrap(), 2, LOOPBACK.parse().unwrap(), opts).unwrap();
    // Rank 1's address is a bound-then-dropped listener: nobody answers there.
    let silent = std::net::TcpListener::bind(LOOPBACK).unwrap();
    let addrs = vec![t0.local_addr(), silent.local_addr().unwrap()];
    drop(silent);
    let err = t0.connect(&addrs).await.unwrap_err();
    assert!(matches!(err, Error::Connect { peer: 1, timeout_ms: 500, .. }), "{err}");
}

// Goal: a stripe count of 0 or over MAX_STRIPES, and keep-alive not below the idle timeout, are
// typed configuration errors at bind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bind_refuses_impossible_options() {
    let ca = ClusterCa::generate("rtx test cluster").unwrap();
    let id = ca.issue(0).unwrap();
    for stripes in [0, rtx_collectives::MAX_STRIPES + 1] {
        let err = TlsTransport::bind(&id, 2, LOOPBACK.parse().unwrap(), TlsOptions { stripes, ..options() }).unwrap_err();
        assert!(matches!(err, Error::InvalidConfig { .. }), "stripes = {stripes}: {err}");
    }
    let err = TlsTransport::bind(&id, 2, LOOPBACK.parse().unwrap(), TlsOptions { keep_alive: Duration::from_secs(20), ..options() }).unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
    let err = TlsTransport::bind(&id, 0, LOOPBACK.parse().unwrap(), options()).unwrap_err();
    assert!(matches!(err, Error::RankOutOfRange { .. }), "{err}");
}

/// Rank 1 of 2 listening, and rank 0 made from `identity` trying to connect to it within 1 s.
async fn try_join(ca: &ClusterCa, identity: rtx_collectives::NodeIdentity) -> (Result<(), Error>, Vec<usize>) {
    let quick = TlsOptions { connect_timeout: Duration::from_secs(1), ..TlsOptions::default() };
    let server = TlsTransport::bind(&ca.issue(1).unwrap(), 2, LOOPBACK.parse().unwrap(), quick.clone()).unwrap();
    let client = TlsTransport::bind(&identity, 2, LOOPBACK.parse().unwrap(), quick).unwrap();
    let addrs = vec![client.local_addr(), server.local_addr()];
    let joined = client.connect(&addrs).await;
    (joined, server.connected_peers())
}

// Goal: the acceptor refuses a dialer whose certificate comes from another CA and one whose
// certificate names a rank other than the one it claims; junk instead of a handshake is refused
// without disturbing the listener; the right identity joins (positive control).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_that_cannot_prove_their_rank_are_refused() {
    let ca = ClusterCa::generate("rtx test cluster").unwrap();
    let other = ClusterCa::generate("some other cluster").unwrap();

    let (joined, accepted) = try_join(&ca, other.issue(0).unwrap()).await;
    assert!(matches!(joined, Err(Error::Connect { peer: 1, .. })), "another CA's certificate joined: {joined:?}");
    assert!(accepted.is_empty());

    // Rank 1's certificate, presented by a process that says it is rank 0.
    let mut impostor = ca.issue(1).unwrap();
    impostor.rank = 0;
    let (joined, accepted) = try_join(&ca, impostor).await;
    assert!(matches!(joined, Err(Error::Connect { peer: 1, .. })), "an impostor joined: {joined:?}");
    assert!(accepted.is_empty());

    // Junk first, then the real rank 0 on the same listener.
    let quick = TlsOptions { connect_timeout: Duration::from_secs(5), ..TlsOptions::default() };
    let server = TlsTransport::bind(&ca.issue(1).unwrap(), 2, LOOPBACK.parse().unwrap(), quick.clone()).unwrap();
    let mut junk = tokio::net::TcpStream::connect(server.local_addr()).await.unwrap();
    junk.write_all(&[0x16, 3, 1, 0, 8, 1, 2, 3, 4, 5, 6, 7, 8]).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), junk.read_to_end(&mut answer)).await.expect("junk must be refused promptly, not left hanging");
    let client = TlsTransport::bind(&ca.issue(0).unwrap(), 2, LOOPBACK.parse().unwrap(), quick).unwrap();
    client.connect(&[client.local_addr(), server.local_addr()]).await.unwrap();
    assert_eq!(client.connected_peers(), vec![1]);
}

/// A TCP proxy for one connection to `target` that flips one byte of the client-to-server stream
/// once `flip_at` bytes have passed; returns its address.
async fn tampering_proxy(target: SocketAddr, flip_at: usize) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind(LOOPBACK).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (client, _) = listener.accept().await.unwrap();
        let server = tokio::net::TcpStream::connect(target).await.unwrap();
        let (mut client_read, mut client_write) = client.into_split();
        let (mut server_read, mut server_write) = server.into_split();
        tokio::spawn(async move {
            let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
        });
        let mut passed = 0usize;
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if passed <= flip_at && flip_at < passed + n {
                buf[flip_at - passed] ^= 0x40;
            }
            passed += n;
            if server_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    });
    addr
}

// Goal: a byte altered on the wire after the handshake never reaches a result: the record fails to
// authenticate, the link goes down, and the all_reduce fails with a typed error within the
// operation timeout instead of returning corrupted sums (a rank that read nothing altered and got
// every frame it needed may return the exact sum). Three places: the ring's frames (flagged,
// so the reader leaves their payloads sealed and the operation finds the altered record as it
// combines or copies from it: `Unauthentic` at rank 1) at 300 KiB and 800 KiB, and recursive
// doubling's frames (not flagged: rank 1's reader finds it and breaks the link: `PeerLost`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_on_the_wire_fails_the_operation() {
    for (flip_at, doubling) in [(300 << 10, false), (800 << 10, false), (300 << 10, true)] {
        let ca = ClusterCa::generate("rtx test cluster").unwrap();
        let r0 = Arc::new(TlsTransport::bind(&ca.issue(0).unwrap(), 2, LOOPBACK.parse().unwrap(), options()).unwrap());
        let r1 = Arc::new(TlsTransport::bind(&ca.issue(1).unwrap(), 2, LOOPBACK.parse().unwrap(), options()).unwrap());
        let proxy = tampering_proxy(r1.local_addr(), flip_at).await;
        let (via_proxy, direct) = ([r0.local_addr(), proxy], [r0.local_addr(), r1.local_addr()]);
        let (a, b) = tokio::join!(r0.connect(&via_proxy), r1.connect(&direct));
        a.unwrap();
        b.unwrap();
        let small_message_bytes = if doubling { 8 << 20 } else { 0 };
        let config = CommConfig { op_timeout: Duration::from_secs(10), chunk_bytes: Some(512 << 10), small_message_bytes, ..CommConfig::default() };
        let comms = network_comms(&[r0, r1], &config);
        let out = run_ranks(&comms, |c| async move {
            let mut buf = vec![1.0f32; 1 << 20];
            let result = c.all_reduce(&mut buf, ReduceOp::Sum).await;
            (result, buf)
        })
        .await;
        for (rank, (result, buf)) in out.iter().enumerate() {
            eprintln!("flip at {flip_at}, doubling {doubling}: rank {rank}: {result:?}");
            assert!(!matches!(result, Err(Error::Timeout { .. })), "flip at {flip_at}: rank {rank} waited for the timeout instead of seeing the broken link");
            // Rank 1 reads the altered stream and must fail. Rank 0 fails too, except under
            // recursive doubling when rank 1 had sent its whole buffer before its reader found
            // the bad record: rank 0 then holds the exact sum (nothing it read was altered).
            if rank == 1 || !doubling {
                assert!(result.is_err(), "flip at {flip_at}: rank {rank} returned a result through a tampered link");
            } else if result.is_ok() {
                assert!(buf.iter().all(|&v| v == 2.0), "flip at {flip_at}: rank {rank} returned a wrong sum");
            }
        }
        // Rank 1 reads what the proxy altered: its reader finds the bad record, or its operation
        // does when it reads a payload left sealed.
        assert_eq!(matches!(out[1].0, Err(Error::Unauthentic { src: 0, .. })), !doubling, "flip at {flip_at}: rank 1 got {:?}", out[1].0);
    }
}

// Goal: a payload that fails to open while a ring combines it into the frame it sends on
// (`send_combined`: each received record opened, combined and sealed into the outgoing one) fails
// the operation with `Unauthentic` and sends nothing of that frame: the records already sealed
// for it are taken back, so the link to the next rank stays usable (no broken sequence), while the
// tampered link goes down and every rank fails fast. Where a key update was sealed into the frame
// before the bad record (a key update every 3 records), the records cannot be taken back (the old
// key is gone): the link to the next rank goes down instead. Every rank fails fast, rank 0
// included when its only pending receive is from rank 2: rank 1 cannot reach rank 0 (their link
// broke), and rank 2, aborted by rank 1's frame naming rank 0, tells rank 0 (`tell_the_lost`;
// without it rank 0 waited for the operation timeout in about one run in three). Method: 3 ranks,
// a proxy flipping a byte at 300 KiB of rank 0's stream to rank 1, whose first frame is the one
// rank 1 combines and sends on to rank 2 (ring all_reduce, 512 KiB frames), repeated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_record_met_while_sending_on_takes_back_the_outgoing_frame() {
    for key_update_records in [TlsOptions::default().key_update_records, 3, TlsOptions::default().key_update_records, 3, TlsOptions::default().key_update_records] {
        let kept = key_update_records > 3;
        let ca = ClusterCa::generate("rtx test cluster").unwrap();
        let options = TlsOptions { key_update_records, ..options() };
        let ranks: Vec<Arc<TlsTransport>> = (0..3).map(|r| Arc::new(TlsTransport::bind(&ca.issue(r).unwrap(), 3, LOOPBACK.parse().unwrap(), options.clone()).unwrap())).collect();
        let proxy = tampering_proxy(ranks[1].local_addr(), 300 << 10).await;
        let direct: Vec<SocketAddr> = ranks.iter().map(|t| t.local_addr()).collect();
        let via_proxy = [direct[0], proxy, direct[2]];
        let (a, b, c) = tokio::join!(ranks[0].connect(&via_proxy), ranks[1].connect(&direct), ranks[2].connect(&direct));
        a.unwrap();
        b.unwrap();
        c.unwrap();
        let config = CommConfig { op_timeout: Duration::from_secs(10), chunk_bytes: Some(512 << 10), small_message_bytes: 0, ..CommConfig::default() };
        let comms = network_comms(&ranks, &config);
        let out = run_ranks(&comms, |c| async move {
            let mut buf = vec![1.0f32; 1 << 20];
            c.all_reduce(&mut buf, ReduceOp::Sum).await
        })
        .await;
        for (rank, result) in out.iter().enumerate() {
            eprintln!("key update every {key_update_records}: rank {rank}: {result:?}");
            assert!(result.is_err(), "rank {rank} returned a result through a tampered link");
            assert!(!matches!(result, Err(Error::Timeout { .. })), "key update every {key_update_records}: rank {rank} waited for the timeout");
        }
        assert!(matches!(out[1], Err(Error::Unauthentic { src: 0, .. })), "rank 1 got {:?}", out[1]);
        // The tampered link is gone. Rank 1 has since sent rank 2 an abort frame (its relay of the
        // loss): had the records sealed for the failed frame not been taken back, that frame's
        // record would carry the wrong sequence number, fail to open at rank 2, and rank 2's
        // reader would have broken the link.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!ranks[1].connected_peers().contains(&0), "rank 1 still links rank 0: {:?}", ranks[1].connected_peers());
        assert_eq!(ranks[1].connected_peers().contains(&2), kept, "key update every {key_update_records}: rank 1's link to rank 2: {:?}", ranks[1].connected_peers());
        assert_eq!(ranks[2].connected_peers().contains(&1), kept, "key update every {key_update_records}: rank 2's link to rank 1: {:?}", ranks[2].connected_peers());
    }
}

/// One frame of `len` payload bytes from `src`, encoded; `copied`: flagged as copied whole by the
/// receiver (`FLAG_COPIED`, header-only checksum), so the reader leaves a large payload sealed.
fn frame_from(src: u32, len: usize, copied: bool) -> rtx_collectives::PooledBuf {
    let header = rtx_collectives::frame::FrameHeader {
        group: 1,
        generation: 1,
        seq: 0,
        op: OpKind::Send,
        chunk: 0,
        src,
        dtype: None,
        payload_len: len as u64,
        channels: 0,
    };
    let pool = rtx_collectives::BufferPool::new();
    if !copied {
        return rtx_collectives::frame::encode(&pool, &header, &vec![7u8; len]);
    }
    let mut frame = pool.take(64 + len);
    frame.extend_from_slice(&rtx_collectives::frame::encode_header_copied(&header, len));
    frame.resize(64 + len, 7);
    frame
}

// Goal: a rank that goes away and comes back (a new process dialing the same peer) is reported
// lost once and up again, in that order, and its new link carries frames, small and large
// (delivered as pieces, or left sealed by the reader and opened for pull delivery), byte for
// byte. Method: pull delivery (`Transport::recv`) on rank 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_comes_back_is_reported_lost_then_up_and_its_link_works() {
    let ca = ClusterCa::generate("rtx test cluster").unwrap();
    let listen = LOOPBACK.parse().unwrap();
    let r1 = TlsTransport::bind(&ca.issue(1).unwrap(), 2, listen, options()).unwrap();
    let next_event = || async {
        tokio::time::timeout(Duration::from_secs(10), r1.recv()).await.expect("an event within 10 s").expect("transport open")
    };
    for life in 0..2 {
        let r0 = TlsTransport::bind(&ca.issue(0).unwrap(), 2, listen, options()).unwrap();
        let addrs = [r0.local_addr(), r1.local_addr()];
        let (a, b) = tokio::join!(r0.connect(&addrs), r1.connect(&addrs));
        a.unwrap();
        b.unwrap();
        let sealed_before = r1.payloads_left_sealed();
        for (len, copied) in [(100usize, false), (300_000, false), (300_000, true)] {
            r0.send(1, frame_from(0, len, copied)).await.unwrap();
            let mut event = next_event().await;
            if life == 1 && len == 100 {
                assert!(matches!(event, TransportEvent::PeerUp(0)), "the second life starts with PeerUp: {event:?}");
                event = next_event().await;
            }
            match event {
                TransportEvent::Frame { from: 0, bytes } => {
                    assert_eq!(bytes.len(), 64 + len);
                    assert!(bytes[64..].iter().all(|&b| b == 7), "life {life}, {len} bytes (copied {copied}): payload altered");
                }
                other => panic!("life {life}: expected a frame of {len} bytes, got {other:?}"),
            }
        }
        assert_eq!(r1.payloads_left_sealed(), sealed_before + 1, "life {life}: the copied frame's payload was left sealed");
        r0.close(Duration::from_secs(5)).await;
        drop(r0);
        assert!(matches!(next_event().await, TransportEvent::PeerLost(0)), "life {life}: the loss is reported");
    }
}

// Goal: frames written by the thread that seals them keep their order and bytes when the socket
// fills, the writer thread finishing what the sending thread began. Method: rank 1 pulls nothing
// until rank 0 has sent 400 frames of 256 KiB (100 MiB: more than its inbox of 256 frames and the
// socket buffers hold, so the reader stops and the socket fills); each frame's sequence number
// and payload byte name it; then rank 1 pulls them all, in order and intact, and rank 0 reports
// frames its writer thread finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_keep_their_order_when_the_socket_fills_mid_frame() {
    let ca = ClusterCa::generate("rtx test cluster").unwrap();
    let ranks = TlsTransport::loopback_world(&ca, 2, options()).await.unwrap();
    let (r0, r1) = (Arc::clone(&ranks[0]), Arc::clone(&ranks[1]));
    let (frames, len) = (400u64, 256 << 10);
    let pool = rtx_collectives::BufferPool::new();
    let sender = tokio::spawn(async move {
        for i in 0..frames {
            let header = rtx_collectives::frame::FrameHeader { group: 1, generation: 1, seq: i, op: OpKind::Send, chunk: 0, src: 0, dtype: None, payload_len: len as u64, channels: 0 };
            r0.send(1, rtx_collectives::frame::encode(&pool, &header, &vec![(i % 251) as u8; len])).await.unwrap();
        }
        r0
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    for i in 0..frames {
        let event = tokio::time::timeout(Duration::from_secs(20), r1.recv()).await.expect("a frame within 20 s").expect("transport open");
        let TransportEvent::Frame { from: 0, bytes } = event else { panic!("frame {i}: {event:?}") };
        let header = rtx_collectives::frame::decode_header(&bytes[..64], 1 << 30).unwrap();
        assert_eq!(header.seq, i, "frames out of order");
        assert_eq!(bytes.len(), 64 + len);
        assert!(bytes[64..].iter().all(|&b| b == (i % 251) as u8), "frame {i}: payload altered");
    }
    let r0 = sender.await.unwrap();
    assert!(r0.frames_finished_by_writer() > 0, "the socket never filled mid-frame: the test did not test the hand-over");
}

// Goal: an operation waiting for a small frame reads it from its connection itself (the reader
// threads stand back while it polls), over one connection and over two (a frame's connection
// follows from its sequence and chunk, on both sides), across key updates, with exact results;
// and a peer that goes away while the survivor polls fails its next collective with PeerLost
// instead of leaving it waiting. Method: 2 ranks, exact inputs (RTX_TEST_SEED), 64 KiB frames
// (under the polling bound), 200 all_reduces, key update every 7 records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_read_their_small_frames_themselves() {
    let seed = seed();
    let len = 48_013;
    let ca = ClusterCa::generate("rtx test cluster").unwrap();
    for stripes in [1, 2] {
        let transports = TlsTransport::loopback_world(&ca, 2, TlsOptions { stripes, key_update_records: 7, ..options() }).await.unwrap();
        let config = CommConfig { op_timeout: Duration::from_secs(20), chunk_bytes: Some(64 << 10), ..CommConfig::default() };
        let comms = network_comms(&transports, &config);
        for case in 0..200u64 {
            let inputs = Arc::new(exact_inputs::<f32>(seed, case, 2, len));
            let want = reference(ReduceOp::Sum, &inputs);
            let out = run_ranks(&comms, |c| {
                let inputs = Arc::clone(&inputs);
                async move {
                    let mut buf = inputs[c.rank()].clone();
                    c.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
                    buf
                }
            })
            .await;
            for (rank, got) in out.iter().enumerate() {
                assert_eq!(bits(got), bits(&want), "seed {seed}, {stripes} connections, case {case}, rank {rank}");
            }
        }
        let polled: u64 = transports.iter().map(|t| t.frames_read_by_operations()).sum();
        assert!(polled > 0, "{stripes} connections: no operation read its own frame");
        // Rank 1 goes away while rank 0 waits in its next all_reduce (polling first).
        let mut comms = comms;
        let gone = comms.pop().unwrap();
        let survivor = comms.pop().unwrap();
        let waiting = tokio::spawn(async move {
            let mut buf = vec![1.0f32; len];
            survivor.all_reduce(&mut buf, ReduceOp::Sum).await
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(gone);
        transports[1].abort();
        let failed = tokio::time::timeout(Duration::from_secs(10), waiting).await.expect("the survivor fails within 10 s, not at the operation timeout").unwrap();
        assert!(matches!(failed, Err(Error::PeerLost { rank: 1, .. }) | Err(Error::TransportClosed)), "{stripes} connections: {failed:?}");
    }
}
