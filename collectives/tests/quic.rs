//! The QUIC transport over loopback: collectives between ranks that each own a quinn endpoint,
//! peer loss when a rank goes away, and mutual TLS refusing peers without a certificate, with a
//! certificate from another CA, or claiming a rank their certificate does not name.
//!
//! Method: every rank binds 127.0.0.1:0 in this process; rogue clients are plain quinn endpoints
//! with hand-built rustls configs (ALPN set, so a refusal can only come from the certificate
//! checks). A positive control shows the same rogue path is accepted with a matching certificate.
#![cfg(feature = "quic")]
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use quinn::crypto::rustls::QuicClientConfig;
use rtx_collectives::{
    client_tls_config, rank_name, tls_packet_cipher_throughput, ClusterCa, CommConfig, Communicator, ControlPath, Error, NodeIdentity, QuicOptions,
    QuicTransport, ReduceOp, Transport, ALPN, CONTROL_ALPN,
};

const LOOPBACK: &str = "127.0.0.1:0";

fn options() -> QuicOptions {
    QuicOptions { connect_timeout: Duration::from_secs(20), loopback_datagram_bytes: 65000, ..QuicOptions::default() }
}

// Goal: collectives over QUIC give correct results (large ring and small doubling paths), and a
// rank that goes away makes the survivors' next collective fail with PeerLost naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_over_quic_and_peer_loss() {
    collectives_and_peer_loss(1).await;
}

// Goal: the same with three connections per rank pair: frames of one peer overtake each other
// across stripes and still land in their slots; every stripe is connected; the loss of a rank is
// reported once all of its stripes end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_over_striped_quic_and_peer_loss() {
    collectives_and_peer_loss(3).await;
}

async fn collectives_and_peer_loss(stripes: usize) {
    let _ = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).try_init();
    let ca = ClusterCa::generate("rtx test cluster").unwrap();
    let transports = QuicTransport::loopback_world(&ca, 3, QuicOptions { stripes, ..options() }).await.unwrap();
    for (r, t) in transports.iter().enumerate() {
        let mut expected: Vec<usize> = (0..3).collect();
        expected.retain(|&p| p != r);
        assert_eq!(t.connected_peers(), expected);
        assert_eq!(t.open_connections(), 2 * stripes, "rank {r}: {stripes} connections per peer");
    }
    let config = CommConfig { op_timeout: Duration::from_secs(20), ..CommConfig::default() };
    let comms = network_comms(&transports, &config);
    drop(transports);
    collectives_then_peer_loss(comms).await;
}

/// Connects to `addr` as a plain quinn client, sends a hello claiming `claim`, and waits for the
/// server's hello. `Ok` means the server accepted the peer.
async fn rogue_connect(client: rustls::ClientConfig, addr: SocketAddr, server_rank: usize, claim: u32) -> Result<(), String> {
    rogue_connect_stripe(client, addr, server_rank, claim, 0, 1).await
}

/// As [`rogue_connect`], with the hello naming stripe `stripe` of `of`.
async fn rogue_connect_stripe(client: rustls::ClientConfig, addr: SocketAddr, server_rank: usize, claim: u32, stripe: u16, of: u16) -> Result<(), String> {
    let endpoint = quinn::Endpoint::client(LOOPBACK.parse().unwrap()).unwrap();
    let config = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(client).unwrap()));
    let attempt = async {
        let conn = endpoint.connect_with(config, addr, &rank_name(server_rank)).unwrap().await.map_err(|e| e.to_string())?;
        let mut hello = b"RTXH".to_vec();
        hello.extend_from_slice(&claim.to_le_bytes());
        hello.extend_from_slice(&stripe.to_le_bytes());
        hello.extend_from_slice(&of.to_le_bytes());
        // No control endpoint: side streams would stay on this connection.
        hello.extend_from_slice(&0u16.to_le_bytes());
        let exchange = async {
            let mut send = conn.open_uni().await?;
            send.write_all(&hello).await?;
            let mut recv = conn.accept_uni().await?;
            let mut answer = [0u8; 14];
            recv.read_exact(&mut answer).await?;
            Ok::<(), BoxError>(())
        };
        exchange.await.map_err(|e| close_reason_or(&conn, e))
    };
    tokio::time::timeout(Duration::from_secs(10), attempt).await.expect("refusal must be prompt, not a hang")
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why `conn` failed: in TLS 1.3 the client finishes its handshake before the server has checked the
/// client's certificate, so a refusal often surfaces as a stream error ("connection lost") whose
/// text hides the server's alert. The connection's close reason carries it; fall back to `err`.
fn close_reason_or(conn: &quinn::Connection, err: BoxError) -> String {
    match conn.close_reason() {
        Some(reason) => reason.to_string(),
        None => err.to_string(),
    }
}

fn client_config(roots_from: &ClusterCa, client_cert: Option<&NodeIdentity>) -> rustls::ClientConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(roots_from.certificate()).unwrap();
    let builder =
        rustls::ClientConfig::builder_with_provider(provider).with_protocol_versions(&[&rustls::version::TLS13]).unwrap().with_root_certificates(roots);
    let mut config = match client_cert {
        Some(id) => builder.with_client_auth_cert(id.cert_chain.clone(), id.key.clone_key()).unwrap(),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![ALPN.to_vec()];
    config
}

// Goal: the server side refuses a peer with no certificate and one whose certificate comes from
// another CA, accepts a correct one (positive control), and refuses a correct certificate used to
// claim a different rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_refuses_unauthenticated_peers() {
    let ca = ClusterCa::generate("rtx test cluster").unwrap();
    let other = ClusterCa::generate("some other cluster").unwrap();
    // Rank 2 of 3 accepts connections from ranks 0 and 1.
    let server = QuicTransport::bind(&ca.issue(2).unwrap(), 3, LOOPBACK.parse().unwrap(), options()).unwrap();
    let addr = server.local_addr().unwrap();

    let no_cert = rogue_connect(client_config(&ca, None), addr, 2, 0).await;
    eprintln!("no certificate: {no_cert:?}");
    assert!(no_cert.unwrap_err().contains("no certificates"), "peer without a certificate was not refused by TLS");

    let foreign = other.issue(0).unwrap();
    let foreign_ca = rogue_connect(client_config(&ca, Some(&foreign)), addr, 2, 0).await;
    eprintln!("other CA: {foreign_ca:?}");
    assert!(foreign_ca.unwrap_err().contains("UnknownIssuer"), "another CA's certificate was not refused by TLS");

    let rank1 = ca.issue(1).unwrap();
    let impostor = rogue_connect(client_config(&ca, Some(&rank1)), addr, 2, 0).await;
    eprintln!("impostor: {impostor:?}");
    assert!(impostor.unwrap_err().contains("does not name the claimed rank"), "rank 1's certificate was not refused as rank 0");
    assert!(server.connected_peers().is_empty());

    // A correct certificate whose hello names an impossible stripe (index past the count, a zero
    // count, more than MAX_STRIPES) is refused.
    let rank0 = ca.issue(0).unwrap();
    for (stripe, of) in [(2u16, 2u16), (0, 0), (0, 17)] {
        let bad = rogue_connect_stripe(client_config(&ca, Some(&rank0)), addr, 2, 0, stripe, of).await;
        eprintln!("stripe {stripe} of {of}: {bad:?}");
        assert!(bad.unwrap_err().contains("impossible stripe"), "stripe {stripe} of {of} was not refused");
    }
    // Stripe 0 of 2 is a valid hello, but the link waits for stripe 1 before it is installed.
    rogue_connect_stripe(client_config(&ca, Some(&rank0)), addr, 2, 0, 0, 2).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(server.connected_peers().is_empty(), "a link was installed before all its stripes connected");

    // Positive control: the same path with a certificate naming the claimed rank is accepted.
    rogue_connect(client_config(&ca, Some(&rank0)), addr, 2, 0).await.unwrap();
    // The server installs the link right after writing its hello; give it a moment.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while server.connected_peers().is_empty() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(server.connected_peers(), vec![0]);

    // And the transport's own client config refuses a server from another CA.
    let stranger = QuicTransport::bind(&other.issue(2).unwrap(), 3, LOOPBACK.parse().unwrap(), options()).unwrap();
    let refused = rogue_connect(client_tls_config(&rank0).unwrap(), stranger.local_addr().unwrap(), 2, 0).await;
    eprintln!("server from another CA: {refused:?}");
    assert!(refused.unwrap_err().contains("UnknownIssuer"), "client did not refuse a server from another CA");
}

/// Dials the control endpoint at `addr` as a plain quinn client with `client` (ALPN set to the
/// control ALPN) and sends `hello` on a unidirectional stream. `Ok` means the connection was still
/// open a second later (accepted); `Err` carries the server's close reason.
async fn rogue_control(mut client: rustls::ClientConfig, addr: SocketAddr, server_rank: usize, hello: &[u8]) -> Result<(), String> {
    client.alpn_protocols = vec![CONTROL_ALPN.to_vec()];
    let endpoint = quinn::Endpoint::client(LOOPBACK.parse().unwrap()).unwrap();
    let config = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(client).unwrap()));
    let conn = endpoint.connect_with(config, addr, &rank_name(server_rank)).unwrap().await.map_err(|e| e.to_string())?;
    let send = async {
        let mut send = conn.open_uni().await?;
        send.write_all(hello).await?;
        Ok::<(), BoxError>(())
    };
    send.await.map_err(|e| close_reason_or(&conn, e))?;
    match tokio::time::timeout(Duration::from_secs(1), conn.closed()).await {
        Ok(reason) => Err(reason.to_string()),
        Err(_) => Ok(()),
    }
}

fn control_hello(claim: u32) -> Vec<u8> {
    [&b"RTXK"[..], &claim.to_le_bytes()].concat()
}

// Goal: the control endpoint (where actor links travel) is as closed as the collectives' one: no
// certificate, another CA's, a certificate used to claim another rank, a rank that does not dial
// this one and a bad hello are all refused; the right certificate for the claimed lower rank is
// accepted (positive control).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_endpoint_refuses_unauthenticated_peers() {
    let ca = ClusterCa::generate("rtx test cluster").unwrap();
    let other = ClusterCa::generate("some other cluster").unwrap();
    let server = QuicTransport::bind(&ca.issue(1).unwrap(), 3, LOOPBACK.parse().unwrap(), QuicOptions { control: ControlPath::OwnThread, ..options() }).unwrap();
    let addr = server.control_addr().expect("the OwnThread control path has its own endpoint");
    assert_ne!(addr, server.local_addr().unwrap());
    let no_cert = rogue_control(client_config(&ca, None), addr, 1, &control_hello(0)).await;
    assert!(no_cert.unwrap_err().contains("no certificates"), "peer without a certificate was not refused by TLS");
    let foreign = rogue_control(client_config(&ca, Some(&other.issue(0).unwrap())), addr, 1, &control_hello(0)).await;
    assert!(foreign.unwrap_err().contains("UnknownIssuer"), "another CA's certificate was not refused by TLS");
    let rank0 = ca.issue(0).unwrap();
    let impostor = rogue_control(client_config(&ca, Some(&ca.issue(2).unwrap())), addr, 1, &control_hello(0)).await;
    assert!(impostor.unwrap_err().contains("does not name the claimed rank"));
    let higher = rogue_control(client_config(&ca, Some(&ca.issue(2).unwrap())), addr, 1, &control_hello(2)).await;
    assert!(higher.unwrap_err().contains("does not dial this one"));
    let garbage = rogue_control(client_config(&ca, Some(&rank0)), addr, 1, b"RTXH\0\0\0\0").await;
    assert!(garbage.unwrap_err().contains("bad control hello magic"));
    rogue_control(client_config(&ca, Some(&rank0)), addr, 1, &control_hello(0)).await.unwrap();
}

// Goal: a stripe count of 0 or over MAX_STRIPES is a typed configuration error at bind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bind_refuses_impossible_stripe_counts() {
    let ca = ClusterCa::generate("rtx test cluster").unwrap();
    for stripes in [0, rtx_collectives::MAX_STRIPES + 1] {
        let err = QuicTransport::bind(&ca.issue(0).unwrap(), 2, LOOPBACK.parse().unwrap(), QuicOptions { stripes, ..options() }).unwrap_err();
        assert!(matches!(err, Error::InvalidConfig { .. }), "stripes = {stripes}: {err}");
    }
}

// Goal: connect gives a typed error naming the missing peer when a rank never shows up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_times_out_with_missing_peer() {
    let ca = ClusterCa::generate("rtx test cluster").unwrap();
    let opts = QuicOptions { connect_timeout: Duration::from_millis(500), ..QuicOptions::default() };
    let t0 = QuicTransport::bind(&ca.issue(0).unwrap(), 2, LOOPBACK.parse().unwrap(), opts).unwrap();
    // Rank 1's address is a bound-then-dropped socket: nobody answers there.
    let silent = std::net::UdpSocket::bind(LOOPBACK).unwrap();
    let addrs = vec![t0.local_addr().unwrap(), silent.local_addr().unwrap()];
    drop(silent);
    let err = t0.connect(&addrs).await.unwrap_err();
    assert!(matches!(err, Error::Connect { peer: 1, timeout_ms: 500, .. }), "{err}");
}

// Goal: the cipher probe behind the benchmark's TLS bound measures the transport's cipher (both
// directions positive and finite) and refuses a packet size of zero with a typed error.
#[test]
fn tls_cipher_probe_measures_and_validates() {
    let rate = tls_packet_cipher_throughput(65_000, 4 << 20).unwrap();
    assert!(rate.seal_bps.is_finite() && rate.seal_bps > 0.0, "{rate:?}");
    assert!(rate.open_bps.is_finite() && rate.open_bps > 0.0, "{rate:?}");
    let err = tls_packet_cipher_throughput(0, 1 << 20).unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
}

/// `n` QUIC ranks on loopback with `stripes` connections per pair, and their world communicators
/// on `config`; the transports too (to abort one).
async fn quic_world(n: usize, stripes: usize, config: &CommConfig) -> (Vec<Arc<QuicTransport>>, Vec<Communicator>) {
    let ca = ClusterCa::generate("rtx test cluster").unwrap();
    let transports = QuicTransport::loopback_world(&ca, n, QuicOptions { stripes, ..options() }).await.unwrap();
    let comms = network_comms(&transports, config);
    (transports, comms)
}

// Goal: rings over QUIC whose frames arrive in quinn's pieces (frames of 20 KiB, above the
// chunked-delivery threshold) give exact, bit-identical results on every rank: a Forward step
// combines out of the pieces into a fresh frame and a Gather step passes quinn's received bytes on
// unchanged. Method: 4 ranks, exact inputs (RTX_TEST_SEED), every reduce op, an odd length (uneven
// segments, short last pieces), ring windows of 1, 8 and 64 frames, 1 and 2 stripes (frames
// overtake each other); reduce_scatter and all_gather on the same links.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deep_windows_and_passed_on_frames_give_exact_results() {
    let seed = seed();
    let n = 4;
    let len = 100_003;
    for (stripes, window) in [(1, 1), (1, 8), (2, 64)] {
        let config = CommConfig {
            op_timeout: Duration::from_secs(20),
            small_message_bytes: 0,
            chunk_bytes: Some(20 << 10),
            ring_window: Some(window),
            ..CommConfig::default()
        };
        let (_transports, comms) = quic_world(n, stripes, &config).await;
        for (case, op) in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg].into_iter().enumerate() {
            let inputs = Arc::new(exact_inputs::<f32>(seed, case as u64, n, len));
            let expected = reference(op, &inputs);
            let out = run_ranks(&comms, |c| {
                let inputs = Arc::clone(&inputs);
                async move {
                    let mut buf = inputs[c.rank()].clone();
                    c.all_reduce(&mut buf, op).await.unwrap();
                    buf
                }
            })
            .await;
            for (rank, got) in out.iter().enumerate() {
                assert!(bits(got) == bits(&expected), "all_reduce {op:?}, window {window}, stripes {stripes}: rank {rank} differs");
            }
        }
        let inputs = Arc::new(exact_inputs::<f32>(seed, 9, n, len));
        let expected = reference(ReduceOp::Sum, &inputs);
        let out = run_ranks(&comms, |c| {
            let inputs = Arc::clone(&inputs);
            async move {
                let (rank, n) = (c.rank(), c.size());
                let own = rtx_collectives::segment_range(len, n, rank);
                let mut part = vec![0.0f32; own.len()];
                c.reduce_scatter(&inputs[rank], &mut part, ReduceOp::Sum).await.unwrap();
                let mut full = vec![0.0f32; len];
                c.all_gather(&part, &mut full).await.unwrap();
                (own, part, full)
            }
        })
        .await;
        for (rank, (own, part, full)) in out.iter().enumerate() {
            assert!(bits(part) == bits(&expected[own.clone()]), "reduce_scatter, window {window}: rank {rank} differs");
            assert!(bits(full) == bits(&expected), "all_gather, window {window}: rank {rank} differs");
        }
    }
}

// Goal: a rank that vanishes in the middle of a deep-window ring (many frames in flight, some of
// them quinn's received pieces held to be passed on) makes the survivors' all_reduce fail with
// PeerLost naming it, well before the operation timeout, instead of hanging. Method: 3 ranks,
// window 64, 32 KiB frames, 32 MiB buffers; rank 2 starts the all_reduce, is cancelled after
// 10 ms and aborts its transport.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_lost_mid_deep_window_ring_is_reported() {
    let config =
        CommConfig { op_timeout: Duration::from_secs(30), small_message_bytes: 0, chunk_bytes: Some(32 << 10), ring_window: Some(64), ..CommConfig::default() };
    let (transports, mut comms) = quic_world(3, 1, &config).await;
    let victim = comms.pop().unwrap();
    let victim_transport = Arc::clone(&transports[2]);
    let len = 8 << 20;
    let killer = tokio::spawn(async move {
        let mut buf = vec![1.0f32; len];
        let finished = tokio::time::timeout(Duration::from_millis(10), victim.all_reduce(&mut buf, ReduceOp::Sum)).await.is_ok();
        victim_transport.abort();
        finished
    });
    let start = std::time::Instant::now();
    let out = run_ranks(&comms, |c| async move {
        let mut buf = vec![1.0f32; len];
        c.all_reduce(&mut buf, ReduceOp::Sum).await
    })
    .await;
    assert!(!killer.await.unwrap(), "the victim's 32 MiB all_reduce finished within 10 ms: the test did not cut it short");
    for (rank, result) in out.into_iter().enumerate() {
        assert!(matches!(result, Err(Error::PeerLost { rank: 2, .. })), "rank {rank}: {result:?}");
    }
    assert!(start.elapsed() < Duration::from_secs(20), "loss reported after {:?}", start.elapsed());
}

// Goal: a ring window of 0 or over MAX_RING_WINDOW is a typed configuration error.
#[test]
fn ring_window_out_of_range_is_refused() {
    for window in [0, rtx_collectives::MAX_RING_WINDOW + 1] {
        let err = CommConfig { ring_window: Some(window), ..CommConfig::default() }.validate().unwrap_err();
        assert!(matches!(err, Error::InvalidConfig { .. }), "ring_window = {window}: {err}");
    }
    assert!(CommConfig { ring_window: Some(rtx_collectives::MAX_RING_WINDOW), ..CommConfig::default() }.validate().is_ok());
}
