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
//! Topology: [`QuicOptions::stripes`] connections per pair of ranks (one by default), dialed by the
//! lower rank. On each, both sides open one unidirectional stream for their frames and start it with
//! a 12-byte hello (`RTXH`, rank u32, stripe index u16, stripe count u16, LE). Frames
//! are written back to back, each handed to quinn as one pooled buffer without a copy; the reader
//! takes the 64-byte header and validates it (including the payload cap) before reading the
//! payload. A payload of [`CHUNKED_FRAME_MIN_BYTES`] or more is handed to the endpoint as the list
//! of quinn's received pieces ([`EventSink::chunked_frame`]): the operation combines or copies
//! straight out of the decrypted packets, with no copy into a frame buffer first (a Forward step of
//! a ring of three or more, which writes into the frame it forwards, joins them once). Smaller
//! payloads are copied into a pooled buffer. The endpoint (pushed, see [`Transport::attach`])
//! checks the checksum. A header that fails validation, or a frame cut
//! short by a cancelled send, means the stream cannot be resynchronised: the connection is closed and
//! the peer reported lost.
//!
//! Stripes: a connection's packets are sealed, opened, acknowledged and reassembled by its quinn
//! driver task, so one connection is capped by one core (about 0.8 GB/s of all-reduce traffic on the
//! machines we measured) whatever the machine has. A link of several stripes sends its frames round
//! robin over them, so consecutive chunks of a large collective are processed by different drivers
//! on different threads of a multi-threaded runtime. Frame order between stripes is not kept, and
//! need not be: the receiver matches frames by (generation, source, sequence, chunk), never by
//! arrival. What the group's lost-peer rule needs is kept: a peer is reported lost only after every
//! stripe's reader has ended (so every frame it sent is delivered first), and a stripe that breaks
//! closes its siblings at once, so the loss is not held back by the idle timeout. Side streams use
//! stripe 0 when they ride the collectives connection ([`ControlPath::Shared`]). The dialer's count
//! decides; an acceptor takes whatever count a peer's hellos name (up to [`MAX_STRIPES`]) and
//! installs the link when all of them are connected.
//!
//! Frames a ring passes on are not copied on the way out: a received payload of quinn's pieces
//! goes back to quinn as those pieces ([`Transport::send_chunked`]), and a frame combined into (a
//! ring's Forward step, written out of the pieces into a fresh pooled buffer) goes as its buffer.
//! Only a send from the caller's memory copies once, into a pooled frame. QUIC asks for a ring
//! window of `QUIC_RING_WINDOW` (8) frames ([`Transport::preferred_ring_window`]) and keeps the
//! default frame size: 2 MiB frames (`CommConfig::chunk_bytes`) are 4-20% faster on a host with cores
//! to spare, but 14% slower at 64 MiB on 2 cores (BENCHMARKS.md, issue 20).
//!
//! Tuning (measured by `rtx bench collectives`, see BENCHMARKS.md): quinn's defaults send 1200-byte
//! datagrams and allow 1.25 MB per stream in flight, which caps a connection near 0.5 GB/s here.
//! Towards a loopback peer, packets are [`QuicOptions::loopback_datagram_bytes`] (the endpoint's
//! `max_udp_payload_size` is raised with it; raising only the connection's initial MTU makes the
//! peer drop every packet), the UDP socket buffers are [`QuicOptions::socket_buffer_bytes`] (past the
//! kernel's cap where the process may, see `force_buffers`), and flow
//! control allows [`QuicOptions::stream_window_bytes`] per stream. TLS uses AES-128-GCM only, the
//! cheapest TLS 1.3 suite with AES instructions (quinn's handshake suite anyway). Other links keep
//! 1200-byte packets and quinn's path MTU discovery.
//!
//! Side streams: bidirectional streams for other protocols (the actors' envelopes) beside the
//! frames. [`QuicTransport::open_stream`] opens one to a peer, tagged with a `u32` channel written
//! as the stream's first 8 bytes (`RTXS` + channel, LE); the peer's per-connection acceptor reads
//! the tag and queues the stream for [`QuicTransport::accept_stream`] on that channel. Where they
//! travel is [`QuicOptions::control`] ([`ControlPath`]):
//! - by default on a **control connection** per peer pair, between second endpoints that each rank
//!   binds beside its collectives endpoint (a UDP socket of their own, on the same address). Each
//!   hello names its sender's control port (0: none); when both do, the lower rank dials the
//!   higher one's control endpoint with the same certificates (mutual TLS against the cluster CA,
//!   ALPN [`CONTROL_ALPN`]) and an 8-byte hello (`RTXK`, rank u32, LE) that the acceptor checks
//!   against the certificate like a stripe's, and [`QuicTransport::connect`] returns once the
//!   control connections are up too. With [`ControlPath::OwnThread`] (the default) that endpoint
//!   and its connections are driven by a current-thread runtime on a thread of its own, so a call's
//!   packets are neither queued behind bulk packets in a socket or connection driver nor behind
//!   bulk tasks on the caller's runtime (BENCHMARKS.md, issue 20). A control connection that ends
//!   takes only the side streams on it; a link that goes down closes its control connection.
//! - with [`ControlPath::Shared`], on stripe 0, as before the control path existed: one connection
//!   per peer pair, at a higher quinn send priority than frame streams.
//!
//! Collective frames only ever travel on the unidirectional frame streams, so a side stream can
//! neither be mistaken for one nor stall one (QUIC flow control is per stream). At most
//! `SIDE_STREAMS_MAX` (16) side streams are open per connection and direction, and at most
//! `SIDE_QUEUE` (16) wait unaccepted per channel; a stream beyond that, or with a bad tag, is
//! refused (reset and stopped). What the streams carry is the caller's business: this crate only
//! hands out quinn's halves, which are tokio `AsyncRead`/`AsyncWrite`
//! ([`QuicTransport::control_runtime`] names the runtime their tasks best run on).
//!
//! Peer loss is reported once per link, when its stream or connection ends (including the idle
//! timeout, [`QuicOptions::idle_timeout`], for a peer that vanished without closing). Key generation
//! uses the operating system's randomness; nothing else here draws randomness or reads clocks for
//! protocol decisions beyond the connect and idle timeouts.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::sync::{mpsc, watch};

use crate::communicator::DEFAULT_MAX_PAYLOAD_BYTES;
use crate::error::{Error, Result};
use crate::linking::{self, PendingLinks, StripeId, DIAL_RETRY};
use crate::frame::{decode_header, OpKind, HEADER_LEN};
use crate::pool::{BufferPool, PooledBuf};
use crate::sync::lock;
use crate::transport::{BoxFuture, ChunkedBytes, EventSink, Transport, TransportEvent};

/// ALPN protocol id both sides require.
pub const ALPN: &[u8] = b"rtx-collectives/3";
/// ALPN of the control connections ([`ControlPath`]), on the control endpoints only.
pub const CONTROL_ALPN: &[u8] = b"rtx-collectives-control/1";
/// Most received frames waiting for the dispatcher before readers stop reading (QUIC flow control
/// then slows the sender).
pub const QUIC_INBOX_FRAMES: usize = 256;
/// Default [`QuicOptions::loopback_datagram_bytes`]; see BENCHMARKS.md for the sweep it came from.
pub const DEFAULT_LOOPBACK_DATAGRAM_BYTES: u16 = 65_000;
/// Default [`QuicOptions::network_datagram_bytes`]: quinn's, an Ethernet path of MTU 1500.
pub const DEFAULT_NETWORK_DATAGRAM_BYTES: u16 = 1452;
/// Largest loopback packet: the IPv6 UDP payload limit on a 64 KiB-MTU `lo` (IPv4 allows 20 more).
const MAX_LOOPBACK_DATAGRAM_BYTES: u16 = 65_487;

const HELLO_MAGIC: [u8; 4] = *b"RTXH";
/// `RTXH`, the sender's rank (u32), the connection's stripe index and the stripe count (u16 each),
/// the port of the sender's control endpoint (u16; 0: none, side streams stay on stripe 0).
const HELLO_LEN: usize = 14;
/// First bytes of a control connection's only unidirectional stream, followed by the dialer's rank
/// (u32, LE).
const CONTROL_HELLO_MAGIC: [u8; 4] = *b"RTXK";
const CONTROL_HELLO_LEN: usize = 8;
/// Most connections per peer pair ([`QuicOptions::stripes`]).
pub const MAX_STRIPES: usize = 16;
const CLOSE_REFUSED: u32 = 1;
const CLOSE_BAD_FRAME: u32 = 2;
const CLOSE_TORN_FRAME: u32 = 3;
/// Packets quinn puts in one GSO send, and the kernel's limit on its total size.
const GSO_BATCH: usize = 10;
const GSO_MAX_BYTES: usize = 65_535;
/// Largest packet used before the handshake is confirmed (see `transport_config`).
const LONG_HEADER_MTU: u16 = 16_000;
/// Initial congestion window on loopback links, in packets.
const INITIAL_WINDOW_PACKETS: u64 = 16;
/// Largest UDP payload quinn accepts for `max_udp_payload_size`.
const MAX_UDP_PAYLOAD: u16 = 65_527;
/// First bytes of a side stream, followed by its channel (u32, LE).
const SIDE_MAGIC: [u8; 4] = *b"RTXS";
const SIDE_HEADER_LEN: usize = 8;
/// Stream error code of a refused side stream (bad tag, or its channel's queue full).
const SIDE_REFUSED: u32 = 1;
/// quinn send priority of side streams (frame streams keep 0): a control message queued behind a
/// tensor's frames on the same connection goes out first.
const SIDE_PRIORITY: i32 = 1;
/// How long the acceptor waits for a side stream's tag before refusing it.
const SIDE_HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// Most side streams a peer may have open at once on one connection (QUIC's bidirectional stream
/// limit; collective frames use unidirectional streams only).
pub(crate) const SIDE_STREAMS_MAX: u32 = 16;
/// Most accepted side streams waiting per channel for [`QuicTransport::accept_stream`]; more are
/// refused.
pub(crate) const SIDE_QUEUE: usize = 16;
/// [`Transport::preferred_ring_window`] of QUIC: frames a ring sends ahead of those it has
/// received. A frame spends long between the operation and the peer (packetised, sealed, sent,
/// opened and reassembled by other tasks), so two in flight left the cores idle (BENCHMARKS.md,
/// issue 20); see the sweep there.
pub(crate) const QUIC_RING_WINDOW: usize = 8;
/// Payloads from this size on are handed to the endpoint as quinn's pieces instead of being copied
/// into one buffer; below it, the copy is cheaper than keeping a list of pieces.
pub(crate) const CHUNKED_FRAME_MIN_BYTES: usize = 16 << 10;

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
    /// Per-stream flow-control window in bytes (the connection allows twice this).
    pub stream_window_bytes: u32,
    /// UDP payload size of packets to and from loopback addresses (at most 65 487, the IPv6 limit on
    /// a 64 KiB-MTU `lo`); below 1200 (e.g. 0) keeps quinn's 1200 bytes there too.
    pub loopback_datagram_bytes: u16,
    /// Largest UDP payload that path MTU discovery may climb to towards other (non-loopback)
    /// addresses: 1452 (quinn's default, an Ethernet path of MTU 1500) up to 65 487; 8952 for the
    /// 9000-byte MTU of datacenter links. Packets start at 1200 bytes and grow only as far as
    /// probes show the path carries; segmentation offload is used when ten packets fit one 64 KiB
    /// send.
    pub network_datagram_bytes: u16,
    /// Requested send and receive buffer of the UDP socket (the kernel caps it at
    /// `net.core.{r,w}mem_max`).
    pub socket_buffer_bytes: usize,
    /// QUIC connections per peer pair that carry collective frames (at least 1, at most
    /// [`MAX_STRIPES`]); the dialing (lower) rank's value decides. Each connection's packets are
    /// sealed, opened and acknowledged by its own quinn driver task, so on a multi-threaded tokio
    /// runtime `stripes` connections use up to `stripes` cores (see the module doc).
    pub stripes: usize,
    /// Which connection carries side streams (actor calls): see [`ControlPath`].
    pub control: ControlPath,
}

/// Where a transport's side streams (the actors' control messages) travel.
///
/// Measured by `rtx bench actors` (BENCHMARKS.md, issue 20): on the collectives connection a call
/// waits behind the bulk packets queued ahead of it in the same UDP socket and connection driver,
/// up to hundreds of microseconds during a large all_reduce.
///
/// Decision: the default is [`ControlPath::Shared`]. The other two bind a second UDP socket, run a
/// second TLS handshake per peer pair in every generation's `connect` (and `OwnThread` a thread per
/// transport), which a transport that carries no actor links (every worker generation today: the
/// runtime's control traffic travels on the supervisor link) pays for nothing. A transport that
/// carries latency-sensitive actor calls beside bulk collectives chooses `OwnThread`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ControlPath {
    /// On stripe 0 of the collectives connection: one connection per peer pair.
    #[default]
    Shared,
    /// On a control connection per peer pair between second endpoints (a UDP socket of their own,
    /// dialed by the lower rank to the port the peer's hello names), driven by the caller's runtime.
    OwnEndpoint,
    /// As `OwnEndpoint`, with the control endpoint, its connections and the actor links on them
    /// driven by a thread of their own (a current-thread runtime), so that bulk work queued on the
    /// caller's runtime does not delay their packets.
    OwnThread,
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
    /// Client configuration towards loopback peers (jumbo packets).
    loopback_client_config: quinn::ClientConfig,
    links: Mutex<BTreeMap<usize, Link>>,
    /// Stripes of links still being set up, by peer, until all of them are connected.
    pending: Mutex<PendingLinks<StripeParts>>,
    lost: Mutex<BTreeSet<usize>>,
    /// Ranks this transport does not link (served by another transport; see `connect_except`).
    unlinked: Mutex<BTreeSet<usize>>,
    dial_errors: Mutex<BTreeMap<usize, String>>,
    links_changed: watch::Sender<()>,
    /// Where link tasks deliver; `None` until the endpoint attaches or polls.
    route: watch::Sender<Option<Route>>,
    /// The sender half for polled delivery, until the route is chosen.
    pull_events: Mutex<Option<mpsc::Sender<TransportEvent>>>,
    pool: BufferPool,
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
    /// Accepted side streams by channel, waiting for `accept_stream`; `None` once the transport
    /// is closed or dropped, which ends every waiting `accept_stream`.
    side: Mutex<Option<BTreeMap<u32, SideQueue>>>,
    /// The control endpoint, unless side streams ride stripe 0 ([`ControlPath::Shared`]).
    control: Option<ControlEndpoint>,
    /// Live control connections by peer.
    controls: Mutex<BTreeMap<usize, quinn::Connection>>,
    /// Peers whose side streams travel on a control connection (both ends have a control endpoint):
    /// such a peer is linked only once its control connection is up too.
    control_wanted: Mutex<BTreeSet<usize>>,
}

/// The second endpoint of a transport, for control connections only, and what drives it.
struct ControlEndpoint {
    endpoint: quinn::Endpoint,
    client_config: quinn::ClientConfig,
    /// The dedicated thread under [`ControlPath::OwnThread`].
    thread: Option<ControlThread>,
}

/// A current-thread tokio runtime on a thread of its own that drives the control endpoint. It stops
/// (after closing the endpoint, so every stream on it fails rather than hangs) when this is dropped.
struct ControlThread {
    handle: tokio::runtime::Handle,
    /// Dropped with this: the thread then closes its endpoint and ends.
    _stop: tokio::sync::oneshot::Sender<()>,
    /// Where [`ControlThread::watch`] hands the endpoint over.
    endpoint: Mutex<Option<tokio::sync::oneshot::Sender<quinn::Endpoint>>>,
}

/// An accepted side stream: the peer's rank and quinn's two halves.
type SideStream = (usize, quinn::SendStream, quinn::RecvStream);

/// The queue of one side-stream channel.
#[derive(Clone)]
struct SideQueue {
    tx: mpsc::Sender<SideStream>,
    rx: Arc<tokio::sync::Mutex<mpsc::Receiver<SideStream>>>,
}

/// Where link tasks deliver events.
#[derive(Clone)]
enum Route {
    Push(Weak<dyn EventSink>),
    Pull(mpsc::Sender<TransportEvent>),
}

/// Everything connected to one peer: one or more stripes (connections carrying frames).
#[derive(Clone)]
struct Link {
    /// Never empty (a link is installed only once all of its stripes are connected).
    stripes: Arc<Vec<Stripe>>,
    /// Round-robin position of the next frame sent.
    next: Arc<AtomicUsize>,
}

/// One connection of a link and the unidirectional stream this rank writes its frames to.
struct Stripe {
    conn: quinn::Connection,
    send: tokio::sync::Mutex<quinn::SendStream>,
}

/// A stripe's connection with both of its frame streams, once hellos are exchanged.
type StripeParts = (quinn::Connection, quinn::SendStream, quinn::RecvStream);

impl Link {
    /// Stripe 0's connection: it also carries the side streams, and names the link.
    fn control(&self) -> &quinn::Connection {
        &self.stripes[0].conn
    }

    /// The stripe the next frame goes on: round robin, so consecutive chunks of a large
    /// collective are sealed and opened by different connection drivers (different threads).
    fn next_stripe(&self) -> &Stripe {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.stripes.len();
        &self.stripes[i]
    }

    fn close_all(&self, code: u32, reason: &[u8]) {
        for stripe in self.stripes.iter() {
            stripe.conn.close(code.into(), reason);
        }
    }

    /// Finishes this rank's frame streams and waits until the peer has read them.
    async fn drain(&self) {
        for stripe in self.stripes.iter() {
            let mut send = stripe.send.lock().await;
            if send.finish().is_ok() {
                let _ = send.stopped().await;
            }
        }
    }
}

impl Default for QuicOptions {
    fn default() -> Self {
        QuicOptions {
            connect_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(10),
            keep_alive: Duration::from_secs(2),
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            stream_window_bytes: 16 << 20,
            loopback_datagram_bytes: DEFAULT_LOOPBACK_DATAGRAM_BYTES,
            network_datagram_bytes: DEFAULT_NETWORK_DATAGRAM_BYTES,
            socket_buffer_bytes: 4 << 20,
            stripes: 1,
            control: ControlPath::default(),
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

impl NodeIdentity {
    /// An identity from DER bytes: the cluster CA certificate, the rank's certificate and its
    /// PKCS#8 private key (as [`to_der`](Self::to_der) writes them, e.g. to hand to a process).
    pub fn from_der(rank: usize, ca: Vec<u8>, cert: Vec<u8>, key_pkcs8: Vec<u8>) -> NodeIdentity {
        NodeIdentity {
            rank,
            ca: CertificateDer::from(ca),
            cert_chain: vec![CertificateDer::from(cert)],
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key_pkcs8)),
        }
    }

    /// The leaf certificate and the PKCS#8 private key in DER; `None` for a key in another format
    /// or an empty chain.
    pub fn to_der(&self) -> Option<(Vec<u8>, Vec<u8>)> {
        let PrivateKeyDer::Pkcs8(key) = &self.key else { return None };
        Some((self.cert_chain.first()?.to_vec(), key.secret_pkcs8_der().to_vec()))
    }
}

impl Clone for NodeIdentity {
    fn clone(&self) -> Self {
        NodeIdentity { rank: self.rank, ca: self.ca.clone(), cert_chain: self.cert_chain.clone(), key: self.key.clone_key() }
    }
}

/// The AEAD a secure transport seals with (TLS 1.3 suites with SHA-256).
///
/// Constraint: per byte on the wire a secure transport pays a seal and an open, and which AEAD is
/// cheaper depends on the CPU: with AES instructions (x86-64 AES-NI + PCLMULQDQ, aarch64 AES +
/// PMULL) AES-128-GCM is several times faster than ChaCha20-Poly1305; without them (older or small
/// ARM cores, as federated edge hosts may have) ChaCha20-Poly1305 is. Choice: [`Cipher::Auto`]
/// offers both, the one this CPU runs faster first; in TLS 1.3 the server takes the first suite of
/// the client's list that it offers (rustls's default), so the dialing side's CPU decides. A forced
/// choice offers that suite alone (QUIC always offers AES-128-GCM too: its initial packets need it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Cipher {
    /// AES-128-GCM first where the CPU has AES instructions ([`cpu_has_aes`]), else
    /// ChaCha20-Poly1305 first; both offered.
    #[default]
    Auto,
    /// TLS13_AES_128_GCM_SHA256 only.
    Aes128Gcm,
    /// TLS13_CHACHA20_POLY1305_SHA256 only.
    ChaCha20Poly1305,
}

impl Cipher {
    /// The suites offered, most preferred first.
    fn suites(self) -> &'static [rustls::CipherSuite] {
        use rustls::CipherSuite::{TLS13_AES_128_GCM_SHA256 as AES, TLS13_CHACHA20_POLY1305_SHA256 as CHACHA};
        match self {
            Cipher::Auto if cpu_has_aes() => &[AES, CHACHA],
            Cipher::Auto => &[CHACHA, AES],
            Cipher::Aes128Gcm => &[AES],
            Cipher::ChaCha20Poly1305 => &[CHACHA],
        }
    }
}

/// Whether this CPU has the instructions that make AES-GCM fast (x86-64: AES-NI and PCLMULQDQ;
/// aarch64: AES and PMULL); `false` elsewhere.
pub fn cpu_has_aes() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("aes") && std::arch::is_x86_feature_detected!("pclmulqdq")
    }
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("aes") && std::arch::is_aarch64_feature_detected!("pmull")
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

/// The rustls server configuration of a rank: its certificate, and client certificates required to
/// chain to the cluster CA.
pub fn server_tls_config(identity: &NodeIdentity) -> Result<rustls::ServerConfig> {
    server_tls_config_with(identity, Cipher::Auto)
}

/// [`server_tls_config`] offering the suites of `cipher`.
pub fn server_tls_config_with(identity: &NodeIdentity, cipher: Cipher) -> Result<rustls::ServerConfig> {
    let provider = Arc::new(crypto_provider(cipher));
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
    client_tls_config_with(identity, Cipher::Auto)
}

/// [`client_tls_config`] offering the suites of `cipher`.
pub fn client_tls_config_with(identity: &NodeIdentity, cipher: Cipher) -> Result<rustls::ClientConfig> {
    let provider = Arc::new(crypto_provider(cipher));
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

/// rustls with the `aws-lc-rs` provider, offering the suites of `cipher` in its order: of the
/// AES suites only TLS13_AES_128_GCM_SHA256 (with AES instructions the cheapest TLS 1.3 suite: 10
/// AES rounds against 14 for AES-256; QUIC needs it for its initial packets anyway), and
/// TLS13_CHACHA20_POLY1305_SHA256 for CPUs without them ([`Cipher`]). aws-lc rather than ring: its
/// AES-GCM has AVX-512 (VAES + VPCLMULQDQ) code where the CPU has it, 1.7x ring's seal rate on the
/// same core, and the cipher is most of what a secure transport spends per byte (ARCHITECTURE.md,
/// "Cipher").
fn crypto_provider(cipher: Cipher) -> rustls::crypto::CryptoProvider {
    let mut provider = rustls::crypto::aws_lc_rs::default_provider();
    let order = cipher.suites();
    provider.cipher_suites.retain(|suite| order.contains(&suite.suite()));
    provider.cipher_suites.sort_by_key(|suite| order.iter().position(|s| *s == suite.suite()));
    provider
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
        if options.stripes == 0 || options.stripes > MAX_STRIPES {
            return Err(Error::InvalidConfig { reason: "stripes must be 1 to 16 connections per peer pair" });
        }
        let EndpointParts { endpoint, client_config, loopback_client_config } = EndpointParts::new(identity, listen, &options)?;
        let control = match options.control {
            ControlPath::Shared => None,
            path => Some(ControlEndpoint::bind(identity, SocketAddr::new(listen.ip(), 0), &options, path == ControlPath::OwnThread)?),
        };
        let (events, inbox) = mpsc::channel(QUIC_INBOX_FRAMES);
        let shared = Arc::new(QuicShared {
            rank,
            world: world_size,
            options,
            endpoint,
            client_config,
            loopback_client_config,
            links: Mutex::new(BTreeMap::new()),
            pending: Mutex::new(PendingLinks::default()),
            lost: Mutex::new(BTreeSet::new()),
            unlinked: Mutex::new(BTreeSet::new()),
            dial_errors: Mutex::new(BTreeMap::new()),
            links_changed: watch::channel(()).0,
            route: watch::channel(None).0,
            pull_events: Mutex::new(Some(events)),
            pool: BufferPool::new(),
            tasks: Mutex::new(Vec::new()),
            side: Mutex::new(Some(BTreeMap::new())),
            control,
            controls: Mutex::new(BTreeMap::new()),
            control_wanted: Mutex::new(BTreeSet::new()),
        });
        let accept_task = tokio::spawn(accept_loop(Arc::clone(&shared))).abort_handle();
        if shared.control.is_some() {
            let task = tokio::spawn(control_accept_loop(Arc::clone(&shared))).abort_handle();
            lock(&shared.tasks).push(task);
        }
        Ok(QuicTransport { shared, inbox: tokio::sync::Mutex::new(inbox), accept_task })
    }

    /// The bound address (useful after binding port 0).
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.shared.endpoint.local_addr().map_err(|e| io("local_addr", e))
    }

    /// Dials every higher rank at `addrs[rank]` and waits until links to all ranks are up, or fails
    /// with [`Error::Connect`] after [`QuicOptions::connect_timeout`].
    pub async fn connect(&self, addrs: &[SocketAddr]) -> Result<()> {
        self.connect_except(addrs, &[]).await
    }

    /// [`connect`](Self::connect), leaving out the ranks in `others`: they are neither dialed nor
    /// waited for, and must leave this rank out alike (they are served by another transport, as
    /// the ranks of the same host are under a [`crate::RoutedTransport`]). Their addresses are not
    /// used. Sends to them fail with [`Error::PeerLost`].
    pub async fn connect_except(&self, addrs: &[SocketAddr], others: &[usize]) -> Result<()> {
        let shared = &self.shared;
        if addrs.len() != shared.world {
            return Err(Error::InvalidConfig { reason: "one address per rank is required" });
        }
        let of = shared.options.stripes;
        for (peer, addr) in linking::dial_targets(shared.rank, addrs, others, &shared.unlinked)? {
            for stripe in 0..of {
                let task = tokio::spawn(dial(Arc::clone(shared), peer, addr, StripeId { stripe, of })).abort_handle();
                lock(&shared.tasks).push(task);
            }
        }
        linking::wait_linked(&shared.links_changed, || shared.missing_peer(), shared.options.connect_timeout, &shared.dial_errors).await
    }

    /// Binds all `world_size` ranks in this process on `127.0.0.1` with certificates issued by `ca`,
    /// and connects them to each other: a whole QUIC world over real loopback sockets, for
    /// single-process multi-rank runs, tests and benchmarks. Fails like [`bind`](Self::bind) and
    /// [`connect`](Self::connect) do; every rank is connected when it returns.
    pub async fn loopback_world(ca: &ClusterCa, world_size: usize, options: QuicOptions) -> Result<Vec<Arc<QuicTransport>>> {
        linking::loopback_world(
            ca,
            world_size,
            |identity, listen| QuicTransport::bind(identity, world_size, listen, options.clone()),
            QuicTransport::local_addr,
            |transport: Arc<QuicTransport>, addrs| async move { transport.connect(&addrs).await },
        )
        .await
    }

    /// Shuts down gracefully: finishes this rank's streams, waits (at most `timeout`) until every
    /// peer has read all that was sent on them, then closes the endpoint. Dropping the transport
    /// does the same in the background (see its `Drop`); `close` lets the caller wait for it.
    /// Peers see the link end ([`TransportEvent::PeerLost`]); sends after `close` fail.
    pub async fn close(&self, timeout: Duration) {
        let links: Vec<Link> = lock(&self.shared.links).values().cloned().collect();
        let drain = async {
            for link in links {
                link.drain().await;
            }
        };
        let _ = tokio::time::timeout(timeout, drain).await;
        lock(&self.shared.side).take();
        self.shared.endpoint.close(0u32.into(), b"closed");
        if let Some(control) = &self.shared.control {
            control.endpoint.close(0u32.into(), b"closed");
        }
        let _ = tokio::time::timeout(timeout, self.shared.endpoint.wait_idle()).await;
    }

    /// Ranks with a live link now, in rank order.
    pub fn connected_peers(&self) -> Vec<usize> {
        lock(&self.shared.links).keys().copied().collect()
    }

    /// Opens a side stream to `peer` on the connection that carries the collectives, tagged
    /// `channel` (see the module doc), and returns quinn's halves (tokio `AsyncWrite` and
    /// `AsyncRead`). The peer gets it from [`accept_stream`](Self::accept_stream)`(channel)`.
    /// Fails with `PeerLost` when there is no live connection to `peer`, and with `Timeout` when
    /// the stream cannot be opened within [`QuicOptions::connect_timeout`] (the peer holds
    /// `SIDE_STREAMS_MAX` (16) streams open already).
    pub async fn open_stream(&self, peer: usize, channel: u32) -> Result<(quinn::SendStream, quinn::RecvStream)> {
        let shared = &self.shared;
        if peer >= shared.world {
            return Err(Error::RankOutOfRange { rank: peer, size: shared.world });
        }
        if peer == shared.rank {
            return Err(Error::SelfPeer { op: OpKind::Send, rank: peer });
        }
        let lost = Error::PeerLost { rank: peer, op: OpKind::Send };
        let Some(conn) = shared.side_conn(peer) else {
            return Err(lost);
        };
        let span = tracing::debug_span!("side_stream", op = "open", rank = shared.rank, peer, channel);
        let opened = async {
            let (mut send, recv) = conn.open_bi().await.map_err(|_| lost.clone())?;
            // Control before bulk: quinn sends higher-priority streams' data first.
            let _ = send.set_priority(SIDE_PRIORITY);
            // The peer learns of the stream only when its first bytes arrive: the tag.
            send.write_all(&side_header(channel)).await.map_err(|_| lost.clone())?;
            Ok::<_, Error>((send, recv))
        };
        let timeout = shared.options.connect_timeout;
        match tokio::time::timeout(timeout, tracing::Instrument::instrument(opened, span)).await {
            Ok(result) => result,
            Err(_) => Err(Error::Timeout { op: OpKind::Send, waiting_for: peer, timeout_ms: millis(timeout) }),
        }
    }

    /// Waits for the next side stream a peer opened on `channel` (in arrival order) and returns
    /// the peer's rank with quinn's halves. Fails with `TransportClosed` once the transport is
    /// dropped or closed. Streams that arrive before anyone waits are queued (at most
    /// `SIDE_QUEUE` (16) per channel).
    pub async fn accept_stream(&self, channel: u32) -> Result<(usize, quinn::SendStream, quinn::RecvStream)> {
        let queue = self.shared.side_queue(channel).ok_or(Error::TransportClosed)?;
        let mut rx = queue.rx.lock().await;
        drop(queue.tx);
        rx.recv().await.ok_or(Error::TransportClosed)
    }

    /// quinn's stable id of the connection to `peer` that carries side streams while it is live:
    /// the control connection, or stripe 0 under [`ControlPath::Shared`] (with one stripe,
    /// collective frames and side streams then share this one connection).
    pub fn connection_id(&self, peer: usize) -> Option<usize> {
        self.shared.side_conn(peer).map(|conn| conn.stable_id())
    }

    /// quinn's stable id of stripe 0 of the link to `peer` (frames), while it is live.
    pub fn frame_connection_id(&self, peer: usize) -> Option<usize> {
        lock(&self.shared.links).get(&peer).map(|link| link.control().stable_id())
    }

    /// The address of this rank's control endpoint (`None` under [`ControlPath::Shared`]).
    pub fn control_addr(&self) -> Option<SocketAddr> {
        self.shared.control.as_ref().and_then(|c| c.endpoint.local_addr().ok())
    }

    /// Connections open on the control endpoint now (one per peer with a control connection).
    pub fn open_control_connections(&self) -> usize {
        self.shared.control.as_ref().map_or(0, |c| c.endpoint.open_connections())
    }

    /// The runtime that drives the control connections under [`ControlPath::OwnThread`]: tasks
    /// that read and write side streams belong there, off the caller's (busy) runtime.
    pub fn control_runtime(&self) -> Option<tokio::runtime::Handle> {
        self.shared.control.as_ref().and_then(|c| c.thread.as_ref()).map(|t| t.handle.clone())
    }

    /// The address of `peer`'s end of the connection, while it is live.
    pub fn peer_address(&self, peer: usize) -> Option<SocketAddr> {
        lock(&self.shared.links).get(&peer).map(|link| link.control().remote_address())
    }

    /// 32 bytes of TLS keying material of the connection to `peer` that carries side streams (RFC 5705 exporter with
    /// `label`), the same on both ends, for binding a proof to this channel.
    pub fn export_keying_material(&self, peer: usize, label: &[u8]) -> Result<[u8; 32]> {
        let conn = self.shared.side_conn(peer).ok_or(Error::PeerLost { rank: peer, op: OpKind::Send })?;
        let mut out = [0u8; 32];
        conn.export_keying_material(&mut out, label, b"rtx-collectives").map_err(|_| Error::Tls { reason: "TLS exporter unavailable".into() })?;
        Ok(out)
    }

    /// Connections open on this rank's endpoint now ([`QuicOptions::stripes`] per live peer when
    /// all is well).
    pub fn open_connections(&self) -> usize {
        self.shared.endpoint.open_connections()
    }

    /// quinn's statistics of the connections to `peer` (one per stripe, in stripe order) while the
    /// link is live: packets sent and lost, congestion events, the congestion window. For
    /// benchmarks and diagnosis.
    pub fn link_stats(&self, peer: usize) -> Vec<quinn::ConnectionStats> {
        lock(&self.shared.links).get(&peer).map(|link| link.stripes.iter().map(|s| s.conn.stats()).collect()).unwrap_or_default()
    }

    /// The endpoint's handshake counters (accepted, dialed, refused) over its life.
    pub fn endpoint_stats(&self) -> quinn::EndpointStats {
        self.shared.endpoint.stats()
    }
}

impl Transport for QuicTransport {
    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn send(&self, peer: usize, frame: PooledBuf) -> BoxFuture<'_, Result<()>> {
        // quinn keeps the bytes until they are acknowledged, then the buffer goes back to the pool.
        Box::pin(async move { self.write_frame(peer, &mut [bytes::Bytes::from_owner(frame)]).await })
    }

    fn send_chunked<'a>(&'a self, peer: usize, header: &'a [u8; HEADER_LEN], payload: ChunkedBytes, _pool: &'a BufferPool) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            // The pieces are quinn's own received bytes: they go back to quinn as they are, and
            // live until the peer acknowledges them.
            let mut frame = Vec::with_capacity(1 + payload.len() / CHUNKED_FRAME_MIN_BYTES.max(1));
            frame.push(bytes::Bytes::copy_from_slice(header));
            frame.extend(payload.into_pieces().map(bytes::Bytes::from_owner));
            self.write_frame(peer, &mut frame).await
        })
    }

    fn preferred_ring_window(&self) -> Option<usize> {
        Some(QUIC_RING_WINDOW)
    }

    fn checks_integrity(&self) -> bool {
        // Every QUIC packet is authenticated (AES-GCM): altered bytes never decrypt.
        true
    }

    fn recv(&self) -> BoxFuture<'_, Option<TransportEvent>> {
        Box::pin(async move {
            if let Some(events) = lock(&self.shared.pull_events).take() {
                self.shared.route.send_replace(Some(Route::Pull(events)));
            }
            self.inbox.lock().await.recv().await
        })
    }

    fn attach(&self, sink: Weak<dyn EventSink>) -> bool {
        if lock(&self.shared.pull_events).take().is_none() {
            return false;
        }
        self.shared.route.send_replace(Some(Route::Push(sink)));
        true
    }

    fn abort(&self) {
        lock(&self.shared.side).take();
        self.shared.endpoint.close(1u32.into(), b"aborted");
        if let Some(control) = &self.shared.control {
            control.endpoint.close(1u32.into(), b"aborted");
        }
    }
}

impl QuicTransport {
    /// Writes one frame, given as its pieces in order, on the next stripe of the link to `peer`.
    async fn write_frame(&self, peer: usize, frame: &mut [bytes::Bytes]) -> Result<()> {
        if peer >= self.shared.world {
            return Err(Error::RankOutOfRange { rank: peer, size: self.shared.world });
        }
        let lost = Error::PeerLost { rank: peer, op: OpKind::Send };
        let Some(link) = lock(&self.shared.links).get(&peer).cloned() else {
            return Err(lost);
        };
        let stripe = link.next_stripe();
        let mut send = stripe.send.lock().await;
        let mut torn = TornFrame { conn: &stripe.conn, armed: true };
        let result = send.write_all_chunks(frame).await.map_err(|_| lost);
        torn.armed = false;
        result
    }
}

/// Closes the connection if a frame write is abandoned half-way (the future dropped): the peer
/// could not find the next frame boundary.
struct TornFrame<'a> {
    conn: &'a quinn::Connection,
    armed: bool,
}

impl Drop for TornFrame<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.conn.close(CLOSE_TORN_FRAME.into(), b"send cancelled mid-frame");
        }
    }
}

impl Drop for QuicTransport {
    /// Stops reading and accepting at once, but lets what was already sent reach the peers, as
    /// closing a TCP socket does: a rank whose collective returned may drop its transport while
    /// its last frames are still in flight to peers that need them. A background task finishes
    /// every stream, waits (at most [`QuicOptions::idle_timeout`]) until the peers have read them,
    /// then closes the endpoint. Without a tokio runtime it closes at once.
    fn drop(&mut self) {
        self.accept_task.abort();
        for task in lock(&self.shared.tasks).drain(..) {
            task.abort();
        }
        // Ends every waiting `accept_stream`; queued streams are dropped (the peers see them end).
        lock(&self.shared.side).take();
        let links: Vec<Link> = lock(&self.shared.links).values().cloned().collect();
        let endpoint = self.shared.endpoint.clone();
        // Control messages need no draining (a side stream lives with its connection): the control
        // endpoint closes at once, so the peers' actor links see the loss without waiting.
        if let Some(control) = &self.shared.control {
            control.endpoint.close(0u32.into(), b"closed");
        }
        let linger = self.shared.options.idle_timeout;
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) if !links.is_empty() => {
                runtime.spawn(async move {
                    let drain = async {
                        for link in &links {
                            link.drain().await;
                        }
                    };
                    let _ = tokio::time::timeout(linger, drain).await;
                    endpoint.close(0u32.into(), b"closed");
                });
            }
            _ => endpoint.close(0u32.into(), b"closed"),
        }
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
    /// The port this rank's hellos name for its control endpoint (0: none).
    fn control_port(&self) -> u16 {
        self.control.as_ref().and_then(|c| c.endpoint.local_addr().ok()).map_or(0, |a| a.port())
    }

    /// The connection that carries side streams to `peer`: its control connection when both ends
    /// have one, else stripe 0 of the link.
    fn side_conn(&self, peer: usize) -> Option<quinn::Connection> {
        let link = lock(&self.links).get(&peer).map(|link| link.control().clone())?;
        if lock(&self.control_wanted).contains(&peer) {
            return lock(&self.controls).get(&peer).cloned();
        }
        Some(link)
    }

    /// Records the control connection to `peer` (replacing and closing an older one) and starts
    /// accepting the side streams it carries; it leaves the map when it closes.
    fn install_control(self: &Arc<Self>, peer: usize, conn: quinn::Connection) {
        if let Some(old) = lock(&self.controls).insert(peer, conn.clone()) {
            old.close(CLOSE_REFUSED.into(), b"control connection dialed again");
        }
        let side = tokio::spawn(accept_side_streams(Arc::clone(self), peer, conn.clone()));
        let shared = Arc::clone(self);
        let watch = tokio::spawn(async move {
            let reason = conn.closed().await;
            let mut controls = lock(&shared.controls);
            if controls.get(&peer).is_some_and(|c| c.stable_id() == conn.stable_id()) {
                controls.remove(&peer);
                tracing::debug!(rank = shared.rank, peer, %reason, "quic control connection closed");
            }
        });
        lock(&self.tasks).extend([side.abort_handle(), watch.abort_handle()]);
        self.links_changed.send_replace(());
        tracing::debug!(rank = self.rank, peer, "quic control connection up");
    }

    fn missing_peer(&self) -> Option<usize> {
        let (links, unlinked) = (lock(&self.links), lock(&self.unlinked));
        let (controls, wanted) = (lock(&self.controls), lock(&self.control_wanted));
        let up = |p: &usize| links.contains_key(p) && (!wanted.contains(p) || controls.contains_key(p));
        (0..self.world).find(|p| *p != self.rank && !up(p) && !unlinked.contains(p))
    }

    /// Records one connected stripe of the link to `peer`; when all of its stripes are connected,
    /// installs the link and starts reading its frames.
    fn register(self: &Arc<Self>, peer: usize, id: StripeId, peer_control_port: u16, parts: StripeParts) {
        if id.stripe == 0 {
            let mut wanted = lock(&self.control_wanted);
            if self.control.is_some() && peer_control_port != 0 {
                wanted.insert(peer);
            } else {
                wanted.remove(&peer);
            }
        }
        let (stale, complete) = lock(&self.pending).add(peer, id, parts);
        if let Some((stale, ..)) = stale {
            stale.close(CLOSE_REFUSED.into(), b"stripe dialed again");
        }
        let Some(complete) = complete else {
            return;
        };
        let mut stripes = Vec::with_capacity(complete.len());
        let mut readers = Vec::with_capacity(complete.len());
        for (conn, send, recv) in complete {
            readers.push((conn.clone(), recv));
            stripes.push(Stripe { conn, send: tokio::sync::Mutex::new(send) });
        }
        if stripes.is_empty() {
            return;
        }
        let link = Link { stripes: Arc::new(stripes), next: Arc::new(AtomicUsize::new(0)) };
        let control = link.control().clone();
        lock(&self.links).insert(peer, link.clone());
        let came_back = lock(&self.lost).remove(&peer);
        let shared = Arc::clone(self);
        let task = tokio::spawn(async move {
            // Nothing is read before someone listens; until then quinn's flow control holds the peer.
            let route = shared.route().await;
            if came_back {
                deliver(&route, TransportEvent::PeerUp(peer)).await;
            }
            // One reader per stripe, on its own task: frames of different stripes are read (and,
            // pushed, combined) in parallel. The link is down when the last reader ends; a stripe
            // that breaks takes the others down with it, or they would wait for the idle timeout.
            let mut stripe_readers = tokio::task::JoinSet::new();
            for (conn, recv) in readers {
                let (shared, route, link) = (Arc::clone(&shared), route.clone(), link.clone());
                stripe_readers.spawn(async move {
                    if read_frames(&shared, &route, peer, &conn, recv).await == StreamEnd::Broken {
                        link.close_all(CLOSE_BAD_FRAME, b"another stripe of this link broke");
                    }
                });
            }
            while stripe_readers.join_next().await.is_some() {}
            shared.link_down(&route, peer, link.control()).await;
        });
        lock(&self.tasks).push(task.abort_handle());
        // Side streams on stripe 0 too: a peer without a control endpoint opens them there.
        let side = tokio::spawn(accept_side_streams(Arc::clone(self), peer, control));
        lock(&self.tasks).push(side.abort_handle());
        self.links_changed.send_replace(());
        tracing::debug!(rank = self.rank, peer, stripes = id.of, "quic link up");
    }

    /// The queue of `channel`, made on first use; `None` once the transport is dropped.
    fn side_queue(&self, channel: u32) -> Option<SideQueue> {
        let mut side = lock(&self.side);
        let side = side.as_mut()?;
        if let Some(queue) = side.get(&channel) {
            return Some(queue.clone());
        }
        let (tx, rx) = mpsc::channel(SIDE_QUEUE);
        let queue = SideQueue { tx, rx: Arc::new(tokio::sync::Mutex::new(rx)) };
        side.insert(channel, queue.clone());
        Some(queue)
    }

    /// The delivery route, once the endpoint has attached or polled.
    async fn route(&self) -> Route {
        let mut rx = self.route.subscribe();
        loop {
            if let Some(route) = rx.borrow_and_update().clone() {
                return route;
            }
            if rx.changed().await.is_err() {
                // The sender lives in `self`; it cannot be gone while we hold `self`.
                std::future::pending::<()>().await;
            }
        }
    }

    async fn link_down(&self, route: &Route, peer: usize, conn: &quinn::Connection) {
        {
            let mut links = lock(&self.links);
            if links.get(&peer).is_some_and(|l| l.control().stable_id() == conn.stable_id()) {
                links.remove(&peer);
                // Side streams end with the link: its control connection goes too.
                if let Some(control) = lock(&self.controls).remove(&peer) {
                    control.close(0u32.into(), b"link lost");
                }
            }
        }
        let first = lock(&self.lost).insert(peer);
        if first {
            tracing::info!(rank = self.rank, peer, reason = %conn.close_reason().map(|r| r.to_string()).unwrap_or_default(), "quic link lost");
            deliver(route, TransportEvent::PeerLost(peer)).await;
        }
    }
}

/// Hands `event` to the endpoint; `false` once nobody receives any more.
async fn deliver(route: &Route, event: TransportEvent) -> bool {
    match route {
        Route::Push(sink) => match sink.upgrade() {
            Some(sink) => {
                sink.event(event);
                true
            }
            None => false,
        },
        Route::Pull(events) => events.send(event).await.is_ok(),
    }
}

/// A UDP socket that receives one datagram per buffer (no GRO).
///
/// quinn sizes its receive buffer as `max_udp_payload_size × GRO segments × batch`: with 64 KB
/// packets and Linux's 64 GRO segments that is 134 MB, whose pages the kernel zeroes again and again
/// (on our VMs, idle huge pages are reclaimed): 65% of the CPU time of a QUIC all-reduce went to
/// `clear_page`. Jumbo loopback packets are never GSO batches, so GRO gains nothing here; with it
/// off the buffer is 2 MB.
#[derive(Debug)]
struct NoGro(Arc<dyn quinn::AsyncUdpSocket>);

impl quinn::AsyncUdpSocket for NoGro {
    fn create_io_poller(self: Arc<Self>) -> std::pin::Pin<Box<dyn quinn::UdpPoller>> {
        Arc::clone(&self.0).create_io_poller()
    }

    fn try_send(&self, transmit: &quinn::udp::Transmit) -> std::io::Result<()> {
        self.0.try_send(transmit)
    }

    fn poll_recv(
        &self,
        cx: &mut std::task::Context,
        bufs: &mut [std::io::IoSliceMut<'_>],
        meta: &mut [quinn::udp::RecvMeta],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.0.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.0.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.0.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        1
    }

    fn may_fragment(&self) -> bool {
        self.0.may_fragment()
    }
}

/// Turns UDP generic receive offload off on `socket` (Linux; elsewhere quinn does not enable it).
#[cfg(not(target_os = "linux"))]
fn disable_gro(_socket: &std::net::UdpSocket) -> Result<()> {
    Ok(())
}

/// Turns UDP generic receive offload off on `socket`.
#[cfg(target_os = "linux")]
fn disable_gro(socket: &std::net::UdpSocket) -> Result<()> {
    use std::os::fd::AsRawFd;
    let off: libc::c_int = 0;
    // SAFETY: a valid socket descriptor and a pointer to a c_int of the length passed.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_UDP,
            libc::UDP_GRO,
            (&off as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io("disable UDP GRO", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Where the kernel capped the socket's buffers below `bytes` (`net.core.{r,w}mem_max`, 208 KiB
/// unless raised: three jumbo packets), asks past the cap, which a process with `CAP_NET_ADMIN`
/// may; otherwise the capped buffers stay. A burst of packets over the receive buffer is dropped
/// and costs a loss-recovery round and a halved congestion window.
#[cfg(target_os = "linux")]
fn force_buffers(socket: &socket2::Socket, bytes: usize) {
    use std::os::fd::AsRawFd;
    let want = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    // Linux reports twice the size set (its bookkeeping overhead).
    let short = |got: std::io::Result<usize>| !matches!(got, Ok(got) if got / 2 >= bytes);
    for (option, got) in [(libc::SO_RCVBUFFORCE, socket.recv_buffer_size()), (libc::SO_SNDBUFFORCE, socket.send_buffer_size())] {
        if !short(got) {
            continue;
        }
        // SAFETY: a valid socket descriptor and a pointer to a c_int of the length passed.
        let _ = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                option,
                (&want as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
    }
}

#[cfg(not(target_os = "linux"))]
fn force_buffers(_socket: &socket2::Socket, _bytes: usize) {}

/// A UDP socket bound to `listen` with larger kernel buffers (a burst of 64 KB packets overflows
/// the 208 KiB default, and every drop costs a loss-recovery round).
fn udp_socket(listen: SocketAddr, buffer_bytes: usize) -> Result<std::net::UdpSocket> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(listen), socket2::Type::DGRAM, Some(socket2::Protocol::UDP)).map_err(|e| io("socket", e))?;
    if listen.is_ipv6() {
        // As `std::net::UdpSocket::bind` does on Linux: a v6 socket stays v6-only unless asked.
        let _ = socket.set_only_v6(false);
    }
    // Best effort: the kernel clamps to its maximum, and a smaller buffer still works.
    let _ = socket.set_recv_buffer_size(buffer_bytes);
    let _ = socket.set_send_buffer_size(buffer_bytes);
    force_buffers(&socket, buffer_bytes);
    socket.bind(&listen.into()).map_err(|e| io("bind", e))?;
    Ok(socket.into())
}

/// Transport parameters; `datagram` is the fixed packet size for loopback links (`None`: quinn's
/// 1200 bytes and path MTU discovery).
fn transport_config(options: &QuicOptions, datagram: Option<u16>) -> Result<quinn::TransportConfig> {
    let mut config = quinn::TransportConfig::default();
    if datagram.is_none() && options.network_datagram_bytes != DEFAULT_NETWORK_DATAGRAM_BYTES {
        let bytes = options.network_datagram_bytes;
        let mut discovery = quinn::MtuDiscoveryConfig::default();
        discovery.upper_bound(bytes);
        config.mtu_discovery_config(Some(discovery));
        config.enable_segmentation_offload(usize::from(bytes) * GSO_BATCH <= GSO_MAX_BYTES);
    }
    if let Some(bytes) = datagram {
        // Handshake packets carry a 14-bit length: quinn panics building one over 16 KiB. Start
        // below that and let path MTU discovery climb to `bytes` (a few round trips of a few
        // microseconds on loopback).
        config.initial_mtu(bytes.min(LONG_HEADER_MTU));
        let mut discovery = quinn::MtuDiscoveryConfig::default();
        discovery.upper_bound(bytes);
        config.mtu_discovery_config((bytes > LONG_HEADER_MTU).then_some(discovery));
        // quinn batches up to 10 packets per GSO send, and the kernel refuses a batch over 64 KiB
        // (quinn-udp then drops it silently: the connection stalls). Jumbo packets gain nothing
        // from GSO anyway.
        config.enable_segmentation_offload(usize::from(bytes) * GSO_BATCH <= GSO_MAX_BYTES);
        // quinn's initial congestion window (14 720 bytes) is smaller than one jumbo packet: the
        // handshake would never be sent. Start with a window of several packets instead.
        let mut cubic = quinn::congestion::CubicConfig::default();
        cubic.initial_window(u64::from(bytes) * INITIAL_WINDOW_PACKETS);
        config.congestion_controller_factory(Arc::new(cubic));
    }
    let idle = quinn::IdleTimeout::try_from(options.idle_timeout).map_err(|_| Error::InvalidConfig { reason: "idle_timeout out of range" })?;
    config.max_idle_timeout(Some(idle));
    config.keep_alive_interval(Some(options.keep_alive));
    // Bidirectional streams are side streams only (see the module doc).
    config.max_concurrent_bidi_streams(SIDE_STREAMS_MAX.into());
    config.max_concurrent_uni_streams(8u32.into());
    let window = quinn::VarInt::from_u32(options.stream_window_bytes);
    config.stream_receive_window(window);
    config.receive_window(quinn::VarInt::from_u32(options.stream_window_bytes.saturating_mul(2)));
    config.send_window(u64::from(options.stream_window_bytes) * 2);
    config.datagram_receive_buffer_size(None);
    Ok(config)
}

/// A quinn endpoint configured for this transport, and the client configurations to dial with.
struct EndpointParts {
    endpoint: quinn::Endpoint,
    client_config: quinn::ClientConfig,
    loopback_client_config: quinn::ClientConfig,
}

impl EndpointParts {
    fn new(identity: &NodeIdentity, listen: SocketAddr, options: &QuicOptions) -> Result<Self> {
        // Jumbo packets only on a loopback-bound endpoint: its peers are all on this machine, and
        // its socket can do without GRO (see `NoGro`).
        let jumbo = options.loopback_datagram_bytes >= 1200 && listen.ip().is_loopback();
        if options.loopback_datagram_bytes > MAX_LOOPBACK_DATAGRAM_BYTES {
            return Err(Error::InvalidConfig { reason: "loopback_datagram_bytes over 65487" });
        }
        if !(1200..=MAX_LOOPBACK_DATAGRAM_BYTES).contains(&options.network_datagram_bytes) {
            return Err(Error::InvalidConfig { reason: "network_datagram_bytes outside 1200..=65487" });
        }
        let wan = Arc::new(transport_config(options, None)?);
        let loopback = if jumbo { Arc::new(transport_config(options, Some(options.loopback_datagram_bytes))?) } else { Arc::clone(&wan) };
        let server_crypto = Arc::new(QuicServerConfig::try_from(server_tls_config(identity)?).map_err(tls)?);
        let mut server_config = quinn::ServerConfig::with_crypto(server_crypto);
        // Accepted connections send with the listen address's kind of packets.
        server_config.transport_config(if listen.ip().is_loopback() { Arc::clone(&loopback) } else { Arc::clone(&wan) });
        let client_crypto = Arc::new(QuicClientConfig::try_from(client_tls_config(identity)?).map_err(tls)?);
        let mut client_config = quinn::ClientConfig::new(Arc::clone(&client_crypto) as Arc<dyn quinn::crypto::ClientConfig>);
        client_config.transport_config(wan);
        let mut loopback_client_config = quinn::ClientConfig::new(client_crypto);
        loopback_client_config.transport_config(loopback);
        let mut endpoint_config = quinn::EndpointConfig::default();
        if jumbo {
            // The receiving endpoint must accept what a loopback peer sends: raising only the
            // connections' MTU gets every large packet dropped.
            endpoint_config.max_udp_payload_size(MAX_UDP_PAYLOAD).map_err(|_| Error::InvalidConfig { reason: "max_udp_payload_size" })?;
        } else if options.network_datagram_bytes > DEFAULT_NETWORK_DATAGRAM_BYTES {
            // Likewise for what discovery lets a network peer send.
            endpoint_config.max_udp_payload_size(options.network_datagram_bytes).map_err(|_| Error::InvalidConfig { reason: "max_udp_payload_size" })?;
        }
        let socket = udp_socket(listen, options.socket_buffer_bytes)?;
        let runtime = quinn::default_runtime().ok_or(Error::InvalidConfig { reason: "QUIC transport must be bound inside a tokio runtime" })?;
        let endpoint = if jumbo {
            let gro_off = socket.try_clone().map_err(|e| io("socket", e))?;
            let wrapped = runtime.wrap_udp_socket(socket).map_err(|e| io("bind", e))?;
            // quinn-udp turned GRO on while wrapping; turn it off on the same socket.
            disable_gro(&gro_off)?;
            let socket: Arc<dyn quinn::AsyncUdpSocket> = Arc::new(NoGro(wrapped));
            quinn::Endpoint::new_with_abstract_socket(endpoint_config, Some(server_config), socket, runtime).map_err(|e| io("bind", e))?
        } else {
            quinn::Endpoint::new(endpoint_config, Some(server_config), socket, runtime).map_err(|e| io("bind", e))?
        };
        Ok(EndpointParts { endpoint, client_config, loopback_client_config })
    }
}

impl ControlEndpoint {
    /// Binds the control endpoint on `listen` (port 0 picks one) with the rank's identity under
    /// the same mutual TLS as the collectives' endpoint (ALPN [`CONTROL_ALPN`]), driven by the
    /// caller's runtime or, with `own_thread`, by a runtime on a thread of its own.
    fn bind(identity: &NodeIdentity, listen: SocketAddr, options: &QuicOptions, own_thread: bool) -> Result<ControlEndpoint> {
        let config = Arc::new(control_transport_config(options)?);
        let mut server_tls = server_tls_config(identity)?;
        server_tls.alpn_protocols = vec![CONTROL_ALPN.to_vec()];
        let mut server_config = quinn::ServerConfig::with_crypto(Arc::new(QuicServerConfig::try_from(server_tls).map_err(tls)?));
        server_config.transport_config(Arc::clone(&config));
        let mut client_tls = client_tls_config(identity)?;
        client_tls.alpn_protocols = vec![CONTROL_ALPN.to_vec()];
        let mut client_config = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(client_tls).map_err(tls)?));
        client_config.transport_config(config);
        let socket = std::net::UdpSocket::bind(listen).map_err(|e| io("bind control endpoint", e))?;
        let (runtime, thread): (Arc<dyn quinn::Runtime>, _) = if own_thread {
            let thread = ControlThread::start(identity.rank)?;
            (Arc::new(OnHandle(thread.handle.clone())), Some(thread))
        } else {
            (quinn::default_runtime().ok_or(Error::InvalidConfig { reason: "QUIC transport must be bound inside a tokio runtime" })?, None)
        };
        let endpoint =
            quinn::Endpoint::new(quinn::EndpointConfig::default(), Some(server_config), socket, runtime).map_err(|e| io("bind control endpoint", e))?;
        if let Some(thread) = &thread {
            thread.watch(endpoint.clone());
        }
        Ok(ControlEndpoint { endpoint, client_config, thread })
    }
}

impl ControlThread {
    /// Starts the thread and its runtime.
    fn start(rank: usize) -> Result<ControlThread> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| io("control runtime", e))?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (endpoint_tx, endpoint_rx) = tokio::sync::oneshot::channel::<quinn::Endpoint>();
        std::thread::Builder::new()
            .name(format!("rtx-quic-control-{rank}"))
            .spawn(move || {
                runtime.block_on(async move {
                    let endpoint = endpoint_rx.await.ok();
                    let _ = stopped.await;
                    // Close before the runtime goes: every stream on the endpoint then fails at
                    // once instead of waiting on a driver that no longer runs.
                    if let Some(endpoint) = endpoint {
                        endpoint.close(0u32.into(), b"closed");
                        let _ = tokio::time::timeout(Duration::from_millis(200), endpoint.wait_idle()).await;
                    }
                });
                runtime.shutdown_timeout(Duration::from_millis(100));
            })
            .map_err(|e| io("control thread", e))?;
        Ok(ControlThread { handle, _stop: stop, endpoint: Mutex::new(Some(endpoint_tx)) })
    }

    /// Hands the thread the endpoint it closes when it stops.
    fn watch(&self, endpoint: quinn::Endpoint) {
        if let Some(tx) = lock(&self.endpoint).take() {
            let _ = tx.send(endpoint);
        }
    }
}

/// quinn's tokio runtime bound to one runtime's handle: timers, sockets and the tasks quinn spawns
/// (the endpoint's and connections' drivers) all live on that runtime, whoever calls.
#[derive(Debug)]
struct OnHandle(tokio::runtime::Handle);

impl quinn::Runtime for OnHandle {
    fn new_timer(&self, at: std::time::Instant) -> std::pin::Pin<Box<dyn quinn::AsyncTimer>> {
        let _entered = self.0.enter();
        quinn::Runtime::new_timer(&quinn::TokioRuntime, at)
    }

    fn spawn(&self, future: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>) {
        self.0.spawn(future);
    }

    fn wrap_udp_socket(&self, socket: std::net::UdpSocket) -> std::io::Result<Arc<dyn quinn::AsyncUdpSocket>> {
        let _entered = self.0.enter();
        quinn::Runtime::wrap_udp_socket(&quinn::TokioRuntime, socket)
    }

    fn now(&self) -> std::time::Instant {
        let _entered = self.0.enter();
        quinn::Runtime::now(&quinn::TokioRuntime)
    }
}

/// Transport parameters of control connections: small messages, quinn's packet size and windows;
/// bidirectional streams are side streams, one unidirectional stream carries the hello.
fn control_transport_config(options: &QuicOptions) -> Result<quinn::TransportConfig> {
    let mut config = quinn::TransportConfig::default();
    let idle = quinn::IdleTimeout::try_from(options.idle_timeout).map_err(|_| Error::InvalidConfig { reason: "idle_timeout out of range" })?;
    config.max_idle_timeout(Some(idle));
    config.keep_alive_interval(Some(options.keep_alive));
    config.max_concurrent_bidi_streams(SIDE_STREAMS_MAX.into());
    config.max_concurrent_uni_streams(1u32.into());
    config.datagram_receive_buffer_size(None);
    Ok(config)
}

/// A reference measurement for benchmarks: the throughput of one raw quinn stream (no frames, no
/// copies out of quinn's buffers) between two endpoints of this process on 127.0.0.1, configured
/// exactly as [`QuicTransport`] with `options`, mutual TLS included. Sends `bytes` in 1 MiB chunks;
/// with `duplex`, both endpoints send at once on their own stream (the traffic of a two-rank ring).
/// Returns bytes per second per direction. Call it on a runtime with at least two worker threads.
pub async fn quic_stream_throughput(options: &QuicOptions, bytes: u64, duplex: bool) -> Result<f64> {
    let ca = ClusterCa::generate("rtx quic throughput probe")?;
    let listen: SocketAddr = SocketAddr::from(([127, 0, 0, 1], 0));
    let a = EndpointParts::new(&ca.issue(0)?, listen, options)?;
    let b = EndpointParts::new(&ca.issue(1)?, listen, options)?;
    let b_addr = b.endpoint.local_addr().map_err(|e| io("local_addr", e))?;
    let failed = |e: &dyn std::fmt::Display| Error::Io { op: "quic throughput probe", reason: e.to_string() };
    let accept = async { b.endpoint.accept().await.ok_or_else(|| failed(&"endpoint closed"))?.await.map_err(|e| failed(&e)) };
    let dial =
        async { a.endpoint.connect_with(a.loopback_client_config.clone(), b_addr, &rank_name(1)).map_err(|e| failed(&e))?.await.map_err(|e| failed(&e)) };
    let (conn_b, conn_a) = tokio::try_join!(accept, dial)?;
    // Let path MTU discovery reach the loopback packet size, as it has on a transport in use.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let chunk = bytes::Bytes::from(vec![0x5Au8; 1 << 20]);
    let send = |conn: quinn::Connection| {
        let chunk = chunk.clone();
        async move {
            let mut stream = conn.open_uni().await.map_err(|e| failed(&e))?;
            let mut left = bytes;
            while left > 0 {
                let n = left.min(chunk.len() as u64) as usize;
                stream.write_chunk(chunk.slice(..n)).await.map_err(|e| failed(&e))?;
                left -= n as u64;
            }
            stream.finish().map_err(|e| failed(&e))?;
            // Done once the peer has read everything.
            let _ = stream.stopped().await;
            Ok::<(), Error>(())
        }
    };
    let recv = |conn: quinn::Connection| async move {
        let mut stream = conn.accept_uni().await.map_err(|e| failed(&e))?;
        let mut got = 0u64;
        while let Some(chunk) = stream.read_chunk(usize::MAX, true).await.map_err(|e| failed(&e))? {
            got += chunk.bytes.len() as u64;
        }
        Ok::<u64, Error>(got)
    };
    let start = std::time::Instant::now();
    let received = if duplex {
        let (ab, ba, _, _) =
            tokio::try_join!(tokio::spawn(recv(conn_b.clone())), tokio::spawn(recv(conn_a.clone())), tokio::spawn(send(conn_a)), tokio::spawn(send(conn_b)),)
                .map_err(|e| failed(&e))?;
        ab?.min(ba?)
    } else {
        let (got, _) = tokio::try_join!(tokio::spawn(recv(conn_b)), tokio::spawn(send(conn_a))).map_err(|e| failed(&e))?;
        got?
    };
    let seconds = start.elapsed().as_secs_f64();
    a.endpoint.close(0u32.into(), b"done");
    b.endpoint.close(0u32.into(), b"done");
    if received != bytes {
        return Err(failed(&format!("received {received} of {bytes} bytes")));
    }
    Ok(bytes as f64 / seconds)
}

/// Single-core throughput of the transport's packet protection, in bytes per second: the AEAD
/// that rustls hands quinn for this transport's one cipher suite (AES-128-GCM with the `aws-lc-rs`
/// provider, the implementation the TLS transport's records use too), run exactly as quinn runs
/// it, in place on packets of `packet_bytes` payload bytes.
///
/// This is the cost TLS adds to every byte on the wire, whatever the transport around it does.
/// A benchmark uses it to bound what any encrypting transport can reach on CPUs that are busy
/// anyway: a rank that moves `B` bytes each way must also spend `B / seal + B / open` seconds in
/// the cipher (see `rtx bench collectives`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CipherThroughput {
    /// Encryption (sender side), bytes per second.
    pub seal_bps: f64,
    /// Decryption and tag check (receiver side), bytes per second.
    pub open_bps: f64,
}

/// Measures [`CipherThroughput`] on the calling thread over `total_bytes` bytes (rounded up to
/// whole packets), after a warm-up of the same size. Keys are QUIC initial keys derived for the
/// transport's suite; the cipher and its implementation are those of 1-RTT packets.
pub fn tls_packet_cipher_throughput(packet_bytes: usize, total_bytes: u64) -> Result<CipherThroughput> {
    use rustls::quic::{Keys, Version};
    use rustls::Side;
    let failed = |what: &str| Error::Io { op: "TLS cipher probe", reason: what.to_string() };
    if packet_bytes == 0 {
        return Err(Error::InvalidConfig { reason: "cipher probe packet size must be positive" });
    }
    let provider = crypto_provider(Cipher::Auto);
    let (suite, quic) = provider
        .cipher_suites
        .iter()
        .find_map(|s| s.tls13().and_then(|t| t.quic.map(|q| (t, q))))
        .ok_or_else(|| failed("the provider has no TLS 1.3 QUIC suite"))?;
    let connection_id = [0x52u8, 0x54, 0x58, 0x21, 0x00, 0x01, 0x02, 0x03];
    let client = Keys::initial(Version::V1, suite, quic, &connection_id, Side::Client);
    let server = Keys::initial(Version::V1, suite, quic, &connection_id, Side::Server);
    let (sealer, opener) = (&client.local.packet, &server.remote.packet);
    let tag_len = sealer.tag_len();
    let header = [0x40u8, 0x52, 0x54, 0x58, 0x21, 0x00, 0x01, 0x02, 0x03, 0x00, 0x00];
    let packets = total_bytes.div_ceil(packet_bytes as u64).max(1);
    let mut packet = vec![0x5Au8; packet_bytes + tag_len];
    let mut run = |count: u64| -> Result<(f64, f64)> {
        let (mut seal, mut open) = (Duration::ZERO, Duration::ZERO);
        for number in 0..count {
            let start = std::time::Instant::now();
            let (payload, tag_out) = packet.split_at_mut(packet_bytes);
            let tag = sealer.encrypt_in_place(number, &header, payload).map_err(|e| failed(&e.to_string()))?;
            tag_out.copy_from_slice(tag.as_ref());
            let sealed = start.elapsed();
            let start = std::time::Instant::now();
            let plain = opener.decrypt_in_place(number, &header, &mut packet).map_err(|e| failed(&e.to_string()))?;
            if plain.len() != packet_bytes {
                return Err(failed("decrypted length differs"));
            }
            open += start.elapsed();
            seal += sealed;
        }
        let bytes = (count * packet_bytes as u64) as f64;
        Ok((bytes / seal.as_secs_f64().max(1e-9), bytes / open.as_secs_f64().max(1e-9)))
    };
    run(packets)?;
    let (seal_bps, open_bps) = run(packets)?;
    Ok(CipherThroughput { seal_bps, open_bps })
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
    let (peer, id, peer_control) = read_hello(&mut recv).await?;
    if peer >= shared.world || peer >= shared.rank {
        return Err(refuse(&conn, "hello names a rank that does not dial this one"));
    }
    if !id.is_possible() {
        return Err(refuse(&conn, "hello names an impossible stripe"));
    }
    if !cert_names_rank(&conn, peer) {
        return Err(refuse(&conn, "client certificate does not name the claimed rank"));
    }
    let mut send = conn.open_uni().await.map_err(|e| e.to_string())?;
    send.write_all(&hello(shared.rank, id, shared.control_port())).await.map_err(|e| e.to_string())?;
    shared.register(peer, id, peer_control, (conn, send, recv));
    Ok(())
}

async fn dial(shared: Arc<QuicShared>, peer: usize, addr: SocketAddr, id: StripeId) {
    linking::dial_until_up(shared.rank, peer, &shared.dial_errors, || dial_once(&shared, peer, addr, id)).await;
}

async fn dial_once(shared: &Arc<QuicShared>, peer: usize, addr: SocketAddr, id: StripeId) -> std::result::Result<(), String> {
    let config = if addr.ip().is_loopback() { &shared.loopback_client_config } else { &shared.client_config };
    let connecting = shared.endpoint.connect_with(config.clone(), addr, &rank_name(peer)).map_err(|e| e.to_string())?;
    let conn = connecting.await.map_err(|e| e.to_string())?;
    let mut send = conn.open_uni().await.map_err(|e| e.to_string())?;
    send.write_all(&hello(shared.rank, id, shared.control_port())).await.map_err(|e| e.to_string())?;
    let mut recv = conn.accept_uni().await.map_err(|e| e.to_string())?;
    let (claimed, echoed, peer_control) = read_hello(&mut recv).await?;
    if claimed != peer || echoed != id {
        conn.close(CLOSE_REFUSED.into(), b"hello names another rank or stripe");
        return Err(format!("rank {peer} answered as rank {claimed}, stripe {echoed:?} for {id:?}"));
    }
    shared.register(peer, id, peer_control, (conn, send, recv));
    if id.stripe == 0 && peer_control != 0 && shared.control.is_some() {
        let task = tokio::spawn(dial_control(Arc::clone(shared), peer, SocketAddr::new(addr.ip(), peer_control))).abort_handle();
        lock(&shared.tasks).push(task);
    }
    Ok(())
}

/// Dials `peer`'s control endpoint at `addr` until it answers (the caller's `connect` bounds the
/// wait), proves nothing beyond TLS (the certificate names the rank, checked by the acceptor), and
/// installs the connection.
async fn dial_control(shared: Arc<QuicShared>, peer: usize, addr: SocketAddr) {
    let Some(control) = &shared.control else { return };
    loop {
        let attempt = async {
            let connecting = control.endpoint.connect_with(control.client_config.clone(), addr, &rank_name(peer)).map_err(|e| e.to_string())?;
            let conn = connecting.await.map_err(|e| e.to_string())?;
            let mut send = conn.open_uni().await.map_err(|e| e.to_string())?;
            send.write_all(&control_hello(shared.rank)).await.map_err(|e| e.to_string())?;
            let _ = send.finish();
            Ok::<_, String>(conn)
        };
        match attempt.await {
            Ok(conn) => {
                shared.install_control(peer, conn);
                return;
            }
            Err(reason) => {
                tracing::debug!(rank = shared.rank, peer, %reason, "control dial failed, retrying");
                lock(&shared.dial_errors).insert(peer, format!("control connection: {reason}"));
                tokio::time::sleep(DIAL_RETRY).await;
            }
        }
    }
}

/// Accepts control connections from lower ranks on the control endpoint.
async fn control_accept_loop(shared: Arc<QuicShared>) {
    let Some(control) = &shared.control else { return };
    let endpoint = control.endpoint.clone();
    while let Some(incoming) = endpoint.accept().await {
        let handler = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            if let Err(reason) = accept_control(&handler, incoming).await {
                tracing::warn!(rank = handler.rank, %reason, "refused incoming control connection");
            }
        });
        lock(&shared.tasks).push(task.abort_handle());
    }
}

async fn accept_control(shared: &Arc<QuicShared>, incoming: quinn::Incoming) -> std::result::Result<(), String> {
    let conn = incoming.await.map_err(|e| e.to_string())?;
    let refuse = |conn: &quinn::Connection, why: &str| {
        conn.close(CLOSE_REFUSED.into(), why.as_bytes());
        why.to_string()
    };
    let hello = async {
        let mut recv = conn.accept_uni().await.map_err(|e| e.to_string())?;
        let mut buf = [0u8; CONTROL_HELLO_LEN];
        recv.read_exact(&mut buf).await.map_err(|e| e.to_string())?;
        Ok::<_, String>(buf)
    };
    let buf = match tokio::time::timeout(SIDE_HEADER_TIMEOUT, hello).await {
        Ok(Ok(buf)) => buf,
        Ok(Err(reason)) => return Err(refuse(&conn, &format!("control hello: {reason}"))),
        Err(_) => return Err(refuse(&conn, "no control hello in time")),
    };
    if buf[..4] != CONTROL_HELLO_MAGIC {
        return Err(refuse(&conn, "bad control hello magic"));
    }
    let peer = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]) as usize;
    if peer >= shared.world || peer >= shared.rank {
        return Err(refuse(&conn, "control hello names a rank that does not dial this one"));
    }
    if !cert_names_rank(&conn, peer) {
        return Err(refuse(&conn, "client certificate does not name the claimed rank"));
    }
    shared.install_control(peer, conn);
    Ok(())
}

fn control_hello(rank: usize) -> [u8; CONTROL_HELLO_LEN] {
    let mut out = [0u8; CONTROL_HELLO_LEN];
    out[..4].copy_from_slice(&CONTROL_HELLO_MAGIC);
    out[4..].copy_from_slice(&(rank as u32).to_le_bytes());
    out
}

/// How a stripe's frame stream ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StreamEnd {
    /// The peer finished it at a frame boundary (a graceful close), or nobody listens any more.
    Clean,
    /// Cut mid-frame, reset, a bad header, or the connection lost.
    Broken,
}

async fn read_frames(shared: &QuicShared, route: &Route, peer: usize, conn: &quinn::Connection, mut recv: quinn::RecvStream) -> StreamEnd {
    let mut header = [0u8; HEADER_LEN];
    loop {
        match recv.read_exact(&mut header).await {
            Ok(()) => {}
            Err(quinn::ReadExactError::FinishedEarly(0)) => return StreamEnd::Clean,
            Err(_) => return StreamEnd::Broken,
        }
        let payload_len = match decode_header(&header, shared.options.max_payload_bytes) {
            // Bounded by the cap just checked, so it fits in usize.
            Ok(h) => h.payload_len as usize,
            Err(error) => {
                tracing::warn!(rank = shared.rank, peer, %error, "bad frame header on stream, closing link");
                conn.close(CLOSE_BAD_FRAME.into(), b"bad frame header");
                return StreamEnd::Broken;
            }
        };
        if let (Route::Push(sink), true) = (route, payload_len >= CHUNKED_FRAME_MIN_BYTES) {
            // quinn hands out the decrypted packets' bytes without copying; pass them on as they
            // are, and the operation reads them in place (see `EventSink::chunked_frame`).
            let mut payload = ChunkedBytes::new();
            while payload.len() < payload_len {
                match recv.read_chunk(payload_len - payload.len(), true).await {
                    Ok(Some(chunk)) => payload.push(chunk.bytes),
                    Ok(None) | Err(_) => return StreamEnd::Broken,
                }
            }
            match sink.upgrade() {
                Some(sink) => sink.chunked_frame(peer, header, payload),
                None => return StreamEnd::Clean,
            }
            continue;
        }
        let total = HEADER_LEN + payload_len;
        let mut buf = shared.pool.take(total);
        buf.extend_from_slice(&header);
        // Small frames (and polled delivery): one copy puts quinn's chunks in the frame.
        while buf.len() < total {
            match recv.read_chunk(total - buf.len(), true).await {
                Ok(Some(chunk)) => buf.extend_from_slice(&chunk.bytes),
                Ok(None) | Err(_) => return StreamEnd::Broken,
            }
        }
        if !deliver(route, TransportEvent::Frame { from: peer, bytes: buf }).await {
            return StreamEnd::Clean;
        }
    }
}

/// Accepts the side streams `peer` opens on `conn` for as long as the connection lives: reads
/// each one's tag and queues it on its channel, or refuses it.
async fn accept_side_streams(shared: Arc<QuicShared>, peer: usize, conn: quinn::Connection) {
    while let Ok((mut send, mut recv)) = conn.accept_bi().await {
        let _ = send.set_priority(SIDE_PRIORITY);
        let mut header = [0u8; SIDE_HEADER_LEN];
        let channel = match tokio::time::timeout(SIDE_HEADER_TIMEOUT, recv.read_exact(&mut header)).await {
            Ok(Ok(())) if header[..4] == SIDE_MAGIC => u32::from_le_bytes([header[4], header[5], header[6], header[7]]),
            outcome => {
                tracing::warn!(rank = shared.rank, peer, timed_out = outcome.is_err(), "side stream without a valid tag; refused");
                refuse_side(&mut send, &mut recv);
                continue;
            }
        };
        let Some(queue) = shared.side_queue(channel) else {
            refuse_side(&mut send, &mut recv);
            return;
        };
        match queue.tx.try_send((peer, send, recv)) {
            Ok(()) => tracing::debug!(rank = shared.rank, peer, channel, "side stream accepted"),
            Err(mpsc::error::TrySendError::Full((_, mut send, mut recv)) | mpsc::error::TrySendError::Closed((_, mut send, mut recv))) => {
                tracing::warn!(rank = shared.rank, peer, channel, queue = SIDE_QUEUE, "side stream queue full or closed; refused");
                refuse_side(&mut send, &mut recv);
            }
        }
    }
}

fn side_header(channel: u32) -> [u8; SIDE_HEADER_LEN] {
    let mut out = [0u8; SIDE_HEADER_LEN];
    out[..4].copy_from_slice(&SIDE_MAGIC);
    out[4..].copy_from_slice(&channel.to_le_bytes());
    out
}

/// Ends both directions of a refused side stream at once: the opener's reads and writes fail.
fn refuse_side(send: &mut quinn::SendStream, recv: &mut quinn::RecvStream) {
    let _ = send.reset(SIDE_REFUSED.into());
    let _ = recv.stop(SIDE_REFUSED.into());
}

fn hello(rank: usize, id: StripeId, control_port: u16) -> [u8; HELLO_LEN] {
    let mut out = [0u8; HELLO_LEN];
    out[..12].copy_from_slice(&linking::hello_head(HELLO_MAGIC, rank, id));
    out[12..14].copy_from_slice(&control_port.to_le_bytes());
    out
}

/// Reads a hello: the sender's rank, the stripe it names, and its control endpoint's port (0: none).
async fn read_hello(recv: &mut quinn::RecvStream) -> std::result::Result<(usize, StripeId, u16), String> {
    let mut buf = [0u8; HELLO_LEN];
    recv.read_exact(&mut buf).await.map_err(|e| e.to_string())?;
    let (rank, id) = linking::read_hello_head(HELLO_MAGIC, &buf)?;
    Ok((rank, id, u16::from_le_bytes([buf[12], buf[13]])))
}

/// Whether the peer's (already CA-verified) leaf certificate is valid for `rank`'s name.
fn cert_names_rank(conn: &quinn::Connection, rank: usize) -> bool {
    let Some(identity) = conn.peer_identity() else {
        return false;
    };
    let Ok(certs) = identity.downcast::<Vec<CertificateDer<'static>>>() else {
        return false;
    };
    certificate_names_rank(&certs, rank)
}

/// Whether the leaf (first) certificate of a chain a TLS handshake already verified against the
/// cluster CA is valid for `rank`'s name ([`rank_name`]): how an acceptor checks that a peer is
/// the rank it claims to be (this transport's stripes and control connections, and other
/// carriers under the same CA, such as the actors' TLS links).
pub fn certificate_names_rank(certs: &[CertificateDer<'_>], rank: usize) -> bool {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_offers_both_suites_the_faster_one_first_and_a_forced_cipher_only_itself() {
        use rustls::CipherSuite::{TLS13_AES_128_GCM_SHA256 as AES, TLS13_CHACHA20_POLY1305_SHA256 as CHACHA};
        let offered = |c: Cipher| crypto_provider(c).cipher_suites.iter().map(|s| s.suite()).collect::<Vec<_>>();
        let first = if cpu_has_aes() { AES } else { CHACHA };
        assert_eq!(offered(Cipher::Auto).first(), Some(&first), "cpu_has_aes = {}", cpu_has_aes());
        assert_eq!(offered(Cipher::Auto).len(), 2);
        assert_eq!(offered(Cipher::Aes128Gcm), vec![AES]);
        assert_eq!(offered(Cipher::ChaCha20Poly1305), vec![CHACHA]);
    }
}
