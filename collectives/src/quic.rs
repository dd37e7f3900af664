//! QUIC transport over quinn, with mutual TLS against a cluster CA (rustls with the `ring`
//! provider, TLS 1.3 only).
//!
//! Identity: [`ClusterCa`] (made with rcgen) issues each rank a certificate whose only name is
//! `rank-<r>.rtx` ([`rank_name`]), usable for both server and client authentication. A peer without a
//! certificate, or with one from another CA, fails the TLS handshake. Ranks are authenticated both
//! ways: the dialer checks the server name it dialed, and the acceptor checks that the client's
//! certificate is valid for the rank the client claims in its hello; a mismatch closes the
//! connection.
//!
//! Topology: one connection per pair of ranks, dialed by the lower rank. Each side opens one
//! unidirectional stream for its frames and starts it with an 8-byte hello (`RTXH` + rank, LE). Frames
//! are written back to back; the reader takes the 64-byte header, validates it (including the
//! payload cap) before reading the payload into a pooled buffer, and hands the whole frame to the
//! endpoint, which checks the checksum. A header that fails validation means the stream cannot be
//! resynchronised: the connection is closed and the peer reported lost.
//!
//! Peer loss is reported once per link, when its stream or connection ends (including the idle
//! timeout, [`QuicOptions::idle_timeout`], for a peer that vanished without closing). Key generation
//! uses the operating system's randomness; nothing else here draws randomness or reads clocks for
//! protocol decisions beyond the connect and idle timeouts.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::sync::{mpsc, watch};

use crate::communicator::DEFAULT_MAX_PAYLOAD_BYTES;
use crate::error::{Error, Result};
use crate::frame::{decode_header, OpKind, HEADER_LEN};
use crate::pool::BufferPool;
use crate::transport::{BoxFuture, Transport, TransportEvent};

/// ALPN protocol id both sides require.
pub const ALPN: &[u8] = b"rtx-collectives/1";
/// Most received frames waiting for the dispatcher before readers stop reading (QUIC flow control
/// then slows the sender).
pub const QUIC_INBOX_FRAMES: usize = 256;

const HELLO_MAGIC: [u8; 4] = *b"RTXH";
const HELLO_LEN: usize = 8;
const CLOSE_REFUSED: u32 = 1;
const CLOSE_BAD_FRAME: u32 = 2;
const DIAL_RETRY: Duration = Duration::from_millis(50);

/// The name a rank's certificate carries.
pub fn rank_name(rank: usize) -> String {
    format!("rank-{rank}.rtx")
}

/// A cluster certificate authority: issues one certificate per rank.
pub struct ClusterCa {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
}

/// What a rank needs to join: its rank, the cluster CA certificate, its certificate chain and key.
#[derive(Debug)]
pub struct NodeIdentity {
    /// The global rank the certificate names.
    pub rank: usize,
    /// The cluster CA certificate peers must chain to.
    pub ca: CertificateDer<'static>,
    /// This rank's certificate (first) and any intermediates.
    pub cert_chain: Vec<CertificateDer<'static>>,
    /// This rank's private key.
    pub key: PrivateKeyDer<'static>,
}

/// Timeouts and limits of a [`QuicTransport`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuicOptions {
    /// How long [`QuicTransport::connect`] waits for every link.
    pub connect_timeout: Duration,
    /// A connection silent for this long is closed and its peer reported lost.
    pub idle_timeout: Duration,
    /// Keep-alive interval (must be below `idle_timeout`).
    pub keep_alive: Duration,
    /// Frames declaring a larger payload close the connection; match [`crate::CommConfig`].
    pub max_payload_bytes: usize,
    /// Per-stream flow-control window in bytes.
    pub stream_window_bytes: u32,
}

/// A rank's QUIC endpoint and its links to every other rank.
pub struct QuicTransport {
    shared: Arc<QuicShared>,
    inbox: tokio::sync::Mutex<mpsc::Receiver<TransportEvent>>,
    accept_task: tokio::task::AbortHandle,
}

struct QuicShared {
    rank: usize,
    world: usize,
    options: QuicOptions,
    endpoint: quinn::Endpoint,
    client_config: quinn::ClientConfig,
    links: Mutex<BTreeMap<usize, Link>>,
    lost: Mutex<BTreeSet<usize>>,
    dial_errors: Mutex<BTreeMap<usize, String>>,
    links_changed: watch::Sender<()>,
    events: mpsc::Sender<TransportEvent>,
    pool: BufferPool,
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
}

#[derive(Clone)]
struct Link {
    conn: quinn::Connection,
    send: Arc<tokio::sync::Mutex<quinn::SendStream>>,
}

impl Default for QuicOptions {
    fn default() -> Self {
        QuicOptions {
            connect_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(10),
            keep_alive: Duration::from_secs(2),
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            stream_window_bytes: 16 << 20,
        }
    }
}

impl ClusterCa {
    /// A fresh CA with a new key pair.
    pub fn generate(common_name: &str) -> Result<ClusterCa> {
        let key = rcgen::KeyPair::generate().map_err(tls)?;
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(tls)?;
        params.distinguished_name.push(rcgen::DnType::CommonName, common_name);
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign, rcgen::KeyUsagePurpose::DigitalSignature];
        let cert = params.self_signed(&key).map_err(tls)?;
        Ok(ClusterCa { cert, key })
    }

    /// The CA certificate (what peers trust).
    pub fn certificate(&self) -> CertificateDer<'static> {
        self.cert.der().clone()
    }

    /// Issues the certificate and key of `rank`, named [`rank_name`]`(rank)`.
    pub fn issue(&self, rank: usize) -> Result<NodeIdentity> {
        let key = rcgen::KeyPair::generate().map_err(tls)?;
        let mut params = rcgen::CertificateParams::new(vec![rank_name(rank)]).map_err(tls)?;
        params.distinguished_name.push(rcgen::DnType::CommonName, rank_name(rank));
        params.is_ca = rcgen::IsCa::ExplicitNoCa;
        params.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth, rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &self.cert, &self.key).map_err(tls)?;
        Ok(NodeIdentity {
            rank,
            ca: self.certificate(),
            cert_chain: vec![cert.der().clone()],
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        })
    }
}

impl Clone for NodeIdentity {
    fn clone(&self) -> Self {
        NodeIdentity { rank: self.rank, ca: self.ca.clone(), cert_chain: self.cert_chain.clone(), key: self.key.clone_key() }
    }
}

/// The rustls server configuration of a rank: its certificate, and client certificates required to
/// chain to the cluster CA.
pub fn server_tls_config(identity: &NodeIdentity) -> Result<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(identity.ca.clone()).map_err(tls)?;
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&provider)).build().map_err(tls)?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(identity.cert_chain.clone(), identity.key.clone_key())
        .map_err(tls)?;
    config.alpn_protocols = vec![ALPN.to_vec()];
    Ok(config)
}

/// The rustls client configuration of a rank: trusts only the cluster CA and presents the rank's
/// certificate.
pub fn client_tls_config(identity: &NodeIdentity) -> Result<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(identity.ca.clone()).map_err(tls)?;
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls)?
        .with_root_certificates(roots)
        .with_client_auth_cert(identity.cert_chain.clone(), identity.key.clone_key())
        .map_err(tls)?;
    config.alpn_protocols = vec![ALPN.to_vec()];
    Ok(config)
}

impl QuicTransport {
    /// Binds rank `identity.rank` of `world_size` to `listen` and starts accepting peers. Call
    /// [`connect`](Self::connect) next, once every rank's address is known.
    pub fn bind(identity: &NodeIdentity, world_size: usize, listen: SocketAddr, options: QuicOptions) -> Result<Self> {
        let rank = identity.rank;
        if rank >= world_size {
            return Err(Error::RankOutOfRange { rank, size: world_size });
        }
        if options.keep_alive >= options.idle_timeout {
            return Err(Error::InvalidConfig { reason: "keep_alive must be below idle_timeout" });
        }
        let transport_config = Arc::new(transport_config(&options)?);
        let server_crypto = QuicServerConfig::try_from(server_tls_config(identity)?).map_err(tls)?;
        let mut server_config = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
        server_config.transport_config(Arc::clone(&transport_config));
        let client_crypto = QuicClientConfig::try_from(client_tls_config(identity)?).map_err(tls)?;
        let mut client_config = quinn::ClientConfig::new(Arc::new(client_crypto));
        client_config.transport_config(transport_config);
        let endpoint = quinn::Endpoint::server(server_config, listen).map_err(|e| io("bind", e))?;
        let (events, inbox) = mpsc::channel(QUIC_INBOX_FRAMES);
        let shared = Arc::new(QuicShared {
            rank,
            world: world_size,
            options,
            endpoint,
            client_config,
            links: Mutex::new(BTreeMap::new()),
            lost: Mutex::new(BTreeSet::new()),
            dial_errors: Mutex::new(BTreeMap::new()),
            links_changed: watch::channel(()).0,
            events,
            pool: BufferPool::new(),
            tasks: Mutex::new(Vec::new()),
        });
        let accept_task = tokio::spawn(accept_loop(Arc::clone(&shared))).abort_handle();
        Ok(QuicTransport { shared, inbox: tokio::sync::Mutex::new(inbox), accept_task })
    }

    /// The bound address (useful after binding port 0).
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.shared.endpoint.local_addr().map_err(|e| io("local_addr", e))
    }

    /// Dials every higher rank at `addrs[rank]` and waits until links to all ranks are up, or fails
    /// with [`Error::Connect`] after [`QuicOptions::connect_timeout`].
    pub async fn connect(&self, addrs: &[SocketAddr]) -> Result<()> {
        let shared = &self.shared;
        if addrs.len() != shared.world {
            return Err(Error::InvalidConfig { reason: "one address per rank is required" });
        }
        for (peer, &addr) in addrs.iter().enumerate().skip(shared.rank + 1) {
            let task = tokio::spawn(dial(Arc::clone(shared), peer, addr)).abort_handle();
            lock(&shared.tasks).push(task);
        }
        let mut changed = shared.links_changed.subscribe();
        let all_up = async {
            loop {
                changed.borrow_and_update();
                if shared.missing_peer().is_none() {
                    return;
                }
                if changed.changed().await.is_err() {
                    return;
                }
            }
        };
        let timeout = shared.options.connect_timeout;
        if tokio::time::timeout(timeout, all_up).await.is_err() {
            if let Some(peer) = shared.missing_peer() {
                let reason = lock(&shared.dial_errors).get(&peer).cloned().unwrap_or_else(|| "no connection".into());
                return Err(Error::Connect { peer, timeout_ms: millis(timeout), reason });
            }
        }
        Ok(())
    }

    /// Ranks with a live link now, in rank order.
    pub fn connected_peers(&self) -> Vec<usize> {
        lock(&self.shared.links).keys().copied().collect()
    }
}

impl Transport for QuicTransport {
    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn send(&self, peer: usize, frame: crate::pool::PooledBuf) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            if peer >= self.shared.world {
                return Err(Error::RankOutOfRange { rank: peer, size: self.shared.world });
            }
            let lost = Error::PeerLost { rank: peer, op: OpKind::Send };
            let Some(link) = lock(&self.shared.links).get(&peer).cloned() else {
                return Err(lost);
            };
            let mut send = link.send.lock().await;
            send.write_all(&frame).await.map_err(|_| lost)
        })
    }

    fn recv(&self) -> BoxFuture<'_, Option<TransportEvent>> {
        Box::pin(async move { self.inbox.lock().await.recv().await })
    }
}

impl Drop for QuicTransport {
    fn drop(&mut self) {
        self.accept_task.abort();
        for task in lock(&self.shared.tasks).drain(..) {
            task.abort();
        }
        self.shared.endpoint.close(0u32.into(), b"closed");
    }
}

impl std::fmt::Debug for QuicTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicTransport")
            .field("rank", &self.shared.rank)
            .field("world_size", &self.shared.world)
            .field("connected_peers", &self.connected_peers())
            .finish_non_exhaustive()
    }
}

impl QuicShared {
    fn missing_peer(&self) -> Option<usize> {
        let links = lock(&self.links);
        (0..self.world).find(|&p| p != self.rank && !links.contains_key(&p))
    }

    /// Installs the link to `peer` and starts reading its frames.
    fn register(self: &Arc<Self>, peer: usize, conn: quinn::Connection, send: quinn::SendStream, recv: quinn::RecvStream) {
        let link = Link { conn: conn.clone(), send: Arc::new(tokio::sync::Mutex::new(send)) };
        lock(&self.links).insert(peer, link);
        let came_back = lock(&self.lost).remove(&peer);
        let shared = Arc::clone(self);
        let task = tokio::spawn(async move {
            if came_back {
                let _ = shared.events.send(TransportEvent::PeerUp(peer)).await;
            }
            read_frames(&shared, peer, &conn, recv).await;
            shared.link_down(peer, &conn).await;
        });
        lock(&self.tasks).push(task.abort_handle());
        self.links_changed.send_replace(());
        tracing::debug!(rank = self.rank, peer, "quic link up");
    }

    async fn link_down(&self, peer: usize, conn: &quinn::Connection) {
        {
            let mut links = lock(&self.links);
            if links.get(&peer).is_some_and(|l| l.conn.stable_id() == conn.stable_id()) {
                links.remove(&peer);
            }
        }
        let first = lock(&self.lost).insert(peer);
        if first {
            tracing::info!(rank = self.rank, peer, reason = %conn.close_reason().map(|r| r.to_string()).unwrap_or_default(), "quic link lost");
            // The receiver is gone only when the transport itself is being dropped.
            let _ = self.events.send(TransportEvent::PeerLost(peer)).await;
        }
    }
}

fn transport_config(options: &QuicOptions) -> Result<quinn::TransportConfig> {
    let mut config = quinn::TransportConfig::default();
    let idle = quinn::IdleTimeout::try_from(options.idle_timeout).map_err(|_| Error::InvalidConfig { reason: "idle_timeout out of range" })?;
    config.max_idle_timeout(Some(idle));
    config.keep_alive_interval(Some(options.keep_alive));
    config.max_concurrent_bidi_streams(0u32.into());
    config.max_concurrent_uni_streams(8u32.into());
    let window = quinn::VarInt::from_u32(options.stream_window_bytes);
    config.stream_receive_window(window);
    config.receive_window(quinn::VarInt::from_u32(options.stream_window_bytes.saturating_mul(2)));
    config.send_window(u64::from(options.stream_window_bytes) * 2);
    Ok(config)
}

async fn accept_loop(shared: Arc<QuicShared>) {
    while let Some(incoming) = shared.endpoint.accept().await {
        let handler = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            if let Err(reason) = accept_one(&handler, incoming).await {
                tracing::warn!(rank = handler.rank, %reason, "refused incoming connection");
            }
        });
        lock(&shared.tasks).push(task.abort_handle());
    }
}

async fn accept_one(shared: &Arc<QuicShared>, incoming: quinn::Incoming) -> std::result::Result<(), String> {
    let conn = incoming.await.map_err(|e| e.to_string())?;
    let refuse = |conn: &quinn::Connection, why: &str| {
        conn.close(CLOSE_REFUSED.into(), why.as_bytes());
        why.to_string()
    };
    let mut recv = conn.accept_uni().await.map_err(|e| e.to_string())?;
    let peer = read_hello(&mut recv).await?;
    if peer >= shared.world || peer >= shared.rank {
        return Err(refuse(&conn, "hello names a rank that does not dial this one"));
    }
    if !cert_names_rank(&conn, peer) {
        return Err(refuse(&conn, "client certificate does not name the claimed rank"));
    }
    let mut send = conn.open_uni().await.map_err(|e| e.to_string())?;
    send.write_all(&hello(shared.rank)).await.map_err(|e| e.to_string())?;
    shared.register(peer, conn, send, recv);
    Ok(())
}

async fn dial(shared: Arc<QuicShared>, peer: usize, addr: SocketAddr) {
    loop {
        match dial_once(&shared, peer, addr).await {
            Ok(()) => return,
            Err(reason) => {
                tracing::debug!(rank = shared.rank, peer, %reason, "dial failed, retrying");
                lock(&shared.dial_errors).insert(peer, reason);
                tokio::time::sleep(DIAL_RETRY).await;
            }
        }
    }
}

async fn dial_once(shared: &Arc<QuicShared>, peer: usize, addr: SocketAddr) -> std::result::Result<(), String> {
    let connecting = shared.endpoint.connect_with(shared.client_config.clone(), addr, &rank_name(peer)).map_err(|e| e.to_string())?;
    let conn = connecting.await.map_err(|e| e.to_string())?;
    let mut send = conn.open_uni().await.map_err(|e| e.to_string())?;
    send.write_all(&hello(shared.rank)).await.map_err(|e| e.to_string())?;
    let mut recv = conn.accept_uni().await.map_err(|e| e.to_string())?;
    let claimed = read_hello(&mut recv).await?;
    if claimed != peer {
        conn.close(CLOSE_REFUSED.into(), b"hello names another rank");
        return Err(format!("rank {peer} answered as rank {claimed}"));
    }
    shared.register(peer, conn, send, recv);
    Ok(())
}

async fn read_frames(shared: &QuicShared, peer: usize, conn: &quinn::Connection, mut recv: quinn::RecvStream) {
    let mut header = [0u8; HEADER_LEN];
    loop {
        if recv.read_exact(&mut header).await.is_err() {
            return;
        }
        let payload_len = match decode_header(&header, shared.options.max_payload_bytes) {
            // Bounded by the cap just checked, so it fits in usize.
            Ok(h) => h.payload_len as usize,
            Err(error) => {
                tracing::warn!(rank = shared.rank, peer, %error, "bad frame header on stream, closing link");
                conn.close(CLOSE_BAD_FRAME.into(), b"bad frame header");
                return;
            }
        };
        let mut buf = shared.pool.take(HEADER_LEN + payload_len);
        buf.extend_from_slice(&header);
        buf.resize(HEADER_LEN + payload_len, 0);
        if recv.read_exact(&mut buf[HEADER_LEN..]).await.is_err() {
            return;
        }
        if shared.events.send(TransportEvent::Frame { from: peer, bytes: buf }).await.is_err() {
            return;
        }
    }
}

fn hello(rank: usize) -> [u8; HELLO_LEN] {
    let mut out = [0u8; HELLO_LEN];
    out[..4].copy_from_slice(&HELLO_MAGIC);
    out[4..].copy_from_slice(&(rank as u32).to_le_bytes());
    out
}

async fn read_hello(recv: &mut quinn::RecvStream) -> std::result::Result<usize, String> {
    let mut buf = [0u8; HELLO_LEN];
    recv.read_exact(&mut buf).await.map_err(|e| e.to_string())?;
    if buf[..4] != HELLO_MAGIC {
        return Err("bad hello magic".into());
    }
    Ok(u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]) as usize)
}

/// Whether the peer's (already CA-verified) leaf certificate is valid for `rank`'s name.
fn cert_names_rank(conn: &quinn::Connection, rank: usize) -> bool {
    let Some(identity) = conn.peer_identity() else {
        return false;
    };
    let Ok(certs) = identity.downcast::<Vec<CertificateDer<'static>>>() else {
        return false;
    };
    let Some(leaf) = certs.first() else {
        return false;
    };
    let Ok(cert) = webpki::EndEntityCert::try_from(leaf) else {
        return false;
    };
    let Ok(name) = ServerName::try_from(rank_name(rank)) else {
        return false;
    };
    cert.verify_is_valid_for_subject_name(&name).is_ok()
}

fn tls(e: impl std::fmt::Display) -> Error {
    Error::Tls { reason: e.to_string() }
}

fn io(op: &'static str, e: std::io::Error) -> Error {
    Error::Io { op, reason: e.to_string() }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Each critical section is one map or vector operation; a panic cannot leave it half-done.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
