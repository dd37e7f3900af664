//! Remote actor references: a [`Link`] is one QUIC connection between two nodes that carries
//! envelopes (`crate::wire`) on one bidirectional stream, in order. [`RemoteRef`] names an actor
//! on the other side and sends it rkyv messages (`tell`) or calls it (`ask`, answered by an
//! [`Inbound::reply`]). What arrives for local actors comes out of the receiver that
//! [`Link::dial`] and [`LinkListener::accept`] return; the owner routes it (usually through its
//! node's [`crate::Registry`]).
//!
//! Back-pressure: the outgoing queue and the inbound queue are bounded; a slow receiver stops its
//! reader, and QUIC flow control then stops the sender.
//!
//! Inline handlers ([`Link::serve_inline`]): an actor registered on a link as inline is answered by
//! the link's reader as it reads the message, and the reply goes to the link's writer task on the
//! same runtime. Decision, for cheap non-blocking handlers (an echo, a lookup): on a transport's
//! control thread this removes two thread wake-ups per call (the reader to the actor's task on
//! another runtime, and that task back to the writer), so the answering side crosses no thread.
//! The price is actor semantics: no mailbox and no task of its own; messages to that name are
//! still handled one at a time in arrival order, but a slow handler holds up every link on the
//! reader's runtime, so it is opt-in per name and never the default. Other actors keep the inbound
//! receiver.
//!
//! Writer task, kept (issue 20): senders hand envelopes to the link's writer task, on the runtime
//! that drives the connection, rather than writing into the quinn stream themselves. Writing from
//! the sender's task was tried and measured (BENCHMARKS.md, "Actor calls with fewer hops"): it
//! saves no thread wake-up, since a write wakes quinn's connection driver, which runs on that same
//! runtime; calls were no faster idle and about 10% slower under load on one core (likely the
//! sender's thread contending with that runtime for quinn's connection lock). Links over TCP
//! with TLS ([`crate::tls`]) do let senders write themselves when nothing is queued ahead of them:
//! there a write is a system call, not a wake-up of the link's runtime (`crate::outgoing`).
//!
//! Security: the listener presents a self-signed certificate and the dialer accepts any
//! certificate but checks the handshake signatures, so the TLS channel is encrypted but not yet
//! authenticated. Authentication is the caller's job, bound to this very channel through
//! [`Link::export_keying_material`] (the supervisor's join handshake proves knowledge of the
//! cluster token on both sides with an HMAC over it, which a man in the middle cannot relay).
//!
//! Failure: a malformed envelope closes the link with a typed reason; a lost peer (closed
//! connection, or no packet for [`LinkOptions::idle_timeout`]) fails every pending `ask` with
//! `LinkClosed`, and the inbound receiver ends.
//!
//! Other carriers: the envelope protocol only needs an ordered byte stream each way, so
//! [`Link::over_stream`] runs it over any `AsyncRead`/`AsyncWrite` pair with a [`StreamConn`]
//! for closing and keying material, and [`LinkListener::channel`] accepts links a caller hands
//! in. The simulator uses both to carry the very same envelopes over its virtual network.
//!
//! Over the collectives transport: [`Link::over_transport`] and [`Link::accept_over_transport`]
//! run the envelope protocol on a side stream of a [`QuicTransport`] to a peer rank (tagged with a
//! channel, [`ACTOR_CHANNEL`] by convention), under the cluster CA's mutual TLS. The stream rides
//! the transport's control connection (`rtx_collectives::ControlPath`: by default a connection of
//! its own, driven by a thread of its own, so calls do not queue behind the collectives' bulk
//! frames), and the link's reader and writer tasks run on that thread's runtime
//! ([`QuicTransport::control_runtime`]). A call is one request envelope and one reply envelope on
//! the one long-lived stream, no stream or connection per call. Such a link borrows the connection
//! and never closes it: closing the link (or a malformed envelope) resets only its stream; the
//! link is lost with the connection (the peer's transport dropped or closed, or the idle timeout),
//! which fails pending `ask`s with `LinkClosed`.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rtx_collectives::QuicTransport;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, oneshot, watch, Notify};

use crate::error::{ActorError, Result};
use crate::outgoing::{Outgoing, SendFailed};
use crate::wire::{self, Envelope, Kind};

/// ALPN of control links.
const ALPN: &[u8] = b"rtx-control/1";
const STREAM_MAGIC: [u8; 4] = *b"RTXC";
const SERVER_NAME: &str = "rtx-control";
const CLOSE_NORMAL: u32 = 0;
const CLOSE_MALFORMED: u32 = 2;
/// Envelopes queued for sending, and inbound messages waiting for their owner.
const QUEUE: usize = 256;
/// The side-stream channel of actor links over a collectives connection (the tag a
/// [`QuicTransport`] side stream opens with; other protocols take other channels).
pub const ACTOR_CHANNEL: u32 = 1;

/// Link tuning.
#[derive(Clone, Debug)]
pub struct LinkOptions {
    /// A link with no packet from the peer for this long is lost.
    pub idle_timeout: Duration,
    /// Keep-alive packets are sent this often when idle (must be below `idle_timeout`).
    pub keep_alive: Duration,
    /// How long dialing may take.
    pub connect_timeout: Duration,
}

impl Default for LinkOptions {
    fn default() -> Self {
        LinkOptions { idle_timeout: Duration::from_secs(10), keep_alive: Duration::from_secs(1), connect_timeout: Duration::from_secs(10) }
    }
}

/// One end of a link; cheap to clone.
#[derive(Clone)]
pub struct Link {
    inner: Arc<LinkInner>,
}

struct LinkInner {
    peer: String,
    connection: Conn,
    out: Outgoing,
    pending: Mutex<BTreeMap<u64, oneshot::Sender<Result<Vec<u8>>>>>,
    next_correlation: AtomicU64,
    closed: watch::Sender<Option<String>>,
    /// Handlers the reader runs itself ([`Link::serve_inline`]), by actor name.
    inline: RwLock<BTreeMap<String, Arc<InlineFn>>>,
}

/// An inline handler as the reader holds it: the message's bytes in, the reply's bytes (or an
/// error reason for the caller) out.
type InlineFn = dyn Fn(&[u8]) -> std::result::Result<Vec<u8>, String> + Send + Sync;

/// The connection under a link.
enum Conn {
    Quic(quinn::Connection),
    Stream(Arc<dyn StreamConn>),
    /// A side stream of a collectives connection: the link owns the stream, never the connection.
    Side(SideConn),
}

/// A side stream of a [`QuicTransport`] connection, shared between the link's reader and writer
/// tasks and whoever closes the link.
struct SideConn {
    transport: Weak<QuicTransport>,
    peer: usize,
    address: SocketAddr,
    stream: Arc<SideStream>,
}

/// Both halves of a side stream. Each lock is held for one non-blocking poll or one close, never
/// across an await.
struct SideStream {
    send: Mutex<quinn::SendStream>,
    recv: Mutex<quinn::RecvStream>,
    /// Set by `close`; the reader then ends at its next poll.
    closed: std::sync::atomic::AtomicBool,
    /// The waker of the reader's pending poll: stopping a stream locally does not wake it.
    reader: Mutex<Option<std::task::Waker>>,
}

/// The reading half of a side stream, as the link's reader task holds it.
struct SideRecv(Arc<SideStream>);

/// The writing half of a side stream, as the link's writer task holds it.
struct SideSend(Arc<SideStream>);

/// The connection under a [`Link::over_stream`] link: what the byte streams themselves cannot do.
pub trait StreamConn: Send + Sync + 'static {
    /// Closes the connection: both ends' streams end (the peer sees its reads end).
    fn close(&self, reason: &str);
    /// 32 bytes both ends agree on and nobody else knows (see [`Link::export_keying_material`]).
    fn export_keying_material(&self, label: &[u8]) -> [u8; 32];
    /// The peer's address, as this carrier names it.
    fn remote_address(&self) -> SocketAddr;
}

impl Conn {
    fn close(&self, code: u32, reason: &[u8]) {
        match self {
            Conn::Quic(c) => c.close(code.into(), reason),
            Conn::Stream(c) => c.close(&String::from_utf8_lossy(reason)),
            Conn::Side(side) => {
                // Both directions end at once: the peer's reads fail (reset) and so do its writes
                // (stop). Errors only say the direction had ended already.
                let stream = &side.stream;
                stream.closed.store(true, Ordering::Release);
                let _ = stream.send.lock().unwrap_or_else(PoisonError::into_inner).reset(code.into());
                let _ = stream.recv.lock().unwrap_or_else(PoisonError::into_inner).stop(code.into());
                if let Some(reader) = stream.reader.lock().unwrap_or_else(PoisonError::into_inner).take() {
                    reader.wake();
                }
            }
        }
    }
}

impl AsyncRead for SideRecv {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let stream = &self.0;
        *stream.reader.lock().unwrap_or_else(PoisonError::into_inner) = Some(cx.waker().clone());
        if stream.closed.load(Ordering::Acquire) {
            return Poll::Ready(Err(std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "link closed locally")));
        }
        let mut recv = stream.recv.lock().unwrap_or_else(PoisonError::into_inner);
        Pin::new(&mut *recv).poll_read(cx, buf)
    }
}

impl AsyncWrite for SideSend {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let mut send = self.0.send.lock().unwrap_or_else(PoisonError::into_inner);
        AsyncWrite::poll_write(Pin::new(&mut *send), cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let mut send = self.0.send.lock().unwrap_or_else(PoisonError::into_inner);
        AsyncWrite::poll_flush(Pin::new(&mut *send), cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let mut send = self.0.send.lock().unwrap_or_else(PoisonError::into_inner);
        AsyncWrite::poll_shutdown(Pin::new(&mut *send), cx)
    }
}

/// A message for a local actor that arrived over a link.
pub struct Inbound {
    to: String,
    body: Vec<u8>,
    reply: Option<(Link, u64)>,
}

/// A named actor on the other side of a link.
pub struct RemoteRef<M> {
    link: Link,
    to: String,
    _msg: std::marker::PhantomData<fn(M)>,
}

/// Accepts links.
pub struct LinkListener {
    kind: ListenerKind,
}

/// A link handed to a [`LinkListener::channel`] listener, with its inbound receiver.
pub type Accepted = (Link, mpsc::Receiver<Inbound>);

enum ListenerKind {
    Quic { endpoint: quinn::Endpoint, options: LinkOptions },
    Channel { addr: SocketAddr, links: tokio::sync::Mutex<mpsc::Receiver<Accepted>>, closed: std::sync::atomic::AtomicBool, close: Notify },
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link").field("peer", &self.inner.peer).finish()
    }
}

impl<M> Clone for RemoteRef<M> {
    fn clone(&self) -> Self {
        RemoteRef { link: self.link.clone(), to: self.to.clone(), _msg: std::marker::PhantomData }
    }
}

impl LinkListener {
    /// Listens on `addr` (port 0 picks one).
    pub fn bind(addr: SocketAddr, options: LinkOptions) -> Result<LinkListener> {
        let connect = |reason: String| ActorError::Connect { peer: addr.to_string(), reason };
        let certified = rcgen::generate_simple_self_signed(vec![SERVER_NAME.to_string()]).map_err(|e| connect(e.to_string()))?;
        let cert = CertificateDer::from(certified.cert.der().to_vec());
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(certified.key_pair.serialize_der()));
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut tls = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| connect(e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(vec![cert], key)
            .map_err(|e| connect(e.to_string()))?;
        tls.alpn_protocols = vec![ALPN.to_vec()];
        let crypto = QuicServerConfig::try_from(tls).map_err(|e| connect(e.to_string()))?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        server.transport_config(Arc::new(transport_config(&options)?));
        let endpoint = quinn::Endpoint::server(server, addr).map_err(|e| connect(e.to_string()))?;
        Ok(LinkListener { kind: ListenerKind::Quic { endpoint, options } })
    }

    /// A listener that accepts the links sent into the returned sender (made with
    /// [`Link::over_stream`] by whoever dials), named `addr`. At most `capacity` wait unaccepted.
    pub fn channel(addr: SocketAddr, capacity: usize) -> (LinkListener, mpsc::Sender<Accepted>) {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        let kind = ListenerKind::Channel { addr, links: tokio::sync::Mutex::new(rx), closed: std::sync::atomic::AtomicBool::new(false), close: Notify::new() };
        (LinkListener { kind }, tx)
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        match &self.kind {
            ListenerKind::Quic { endpoint, .. } => endpoint.local_addr().map_err(|e| ActorError::Connect { peer: "local".into(), reason: e.to_string() }),
            ListenerKind::Channel { addr, .. } => Ok(*addr),
        }
    }

    /// Waits for the next peer and its link. `None` once the listener is closed. A peer whose
    /// handshake fails is skipped (logged), not returned.
    pub async fn accept(&self) -> Option<(Link, mpsc::Receiver<Inbound>)> {
        let (endpoint, options) = match &self.kind {
            ListenerKind::Quic { endpoint, options } => (endpoint, options),
            ListenerKind::Channel { links, closed, close, .. } => {
                let mut links = links.lock().await;
                if closed.load(Ordering::Acquire) {
                    return None;
                }
                return tokio::select! {
                    biased;
                    link = links.recv() => link,
                    () = close.notified() => None,
                };
            }
        };
        loop {
            let incoming = endpoint.accept().await?;
            let peer = incoming.remote_address().to_string();
            let options = options.clone();
            let accepted = async {
                let connection = incoming.await.map_err(|e| e.to_string())?;
                let (send, mut recv) = connection.accept_bi().await.map_err(|e| e.to_string())?;
                let mut magic = [0u8; 4];
                recv.read_exact(&mut magic).await.map_err(|e| e.to_string())?;
                if magic != STREAM_MAGIC {
                    connection.close(CLOSE_MALFORMED.into(), b"bad stream magic");
                    return Err("bad stream magic".to_string());
                }
                Ok(Link::start(peer.clone(), Conn::Quic(connection), send, recv))
            };
            match tokio::time::timeout(options.connect_timeout, accepted).await {
                Ok(Ok(link)) => return Some(link),
                Ok(Err(reason)) => tracing::warn!(%peer, %reason, "link handshake failed"),
                Err(_) => tracing::warn!(%peer, "link handshake timed out"),
            }
        }
    }

    /// Stops accepting and closes every link made by this listener.
    pub fn close(&self) {
        match &self.kind {
            ListenerKind::Quic { endpoint, .. } => endpoint.close(CLOSE_NORMAL.into(), b"listener closed"),
            ListenerKind::Channel { closed, close, .. } => {
                closed.store(true, Ordering::Release);
                close.notify_waiters();
            }
        }
    }
}

impl Link {
    /// Dials the listener at `addr`.
    pub async fn dial(addr: SocketAddr, options: LinkOptions) -> Result<(Link, mpsc::Receiver<Inbound>)> {
        let peer = addr.to_string();
        let connect = |reason: String| ActorError::Connect { peer: peer.clone(), reason };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut tls = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| connect(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(ChannelOnly(provider)))
            .with_no_client_auth();
        tls.alpn_protocols = vec![ALPN.to_vec()];
        let crypto = QuicClientConfig::try_from(tls).map_err(|e| connect(e.to_string()))?;
        let mut client = quinn::ClientConfig::new(Arc::new(crypto));
        client.transport_config(Arc::new(transport_config(&options)?));
        let local: SocketAddr = if addr.is_ipv4() { (Ipv4Addr::UNSPECIFIED, 0).into() } else { (Ipv6Addr::UNSPECIFIED, 0).into() };
        let mut endpoint = quinn::Endpoint::client(local).map_err(|e| connect(e.to_string()))?;
        endpoint.set_default_client_config(client);
        let dialed = async {
            let connection = endpoint.connect(addr, SERVER_NAME).map_err(|e| e.to_string())?.await.map_err(|e| e.to_string())?;
            let (mut send, recv) = connection.open_bi().await.map_err(|e| e.to_string())?;
            send.write_all(&STREAM_MAGIC).await.map_err(|e| e.to_string())?;
            Ok::<_, String>(Link::start(peer.clone(), Conn::Quic(connection), send, recv))
        };
        match tokio::time::timeout(options.connect_timeout, dialed).await {
            Ok(Ok(link)) => Ok(link),
            Ok(Err(reason)) => Err(connect(reason)),
            Err(_) => Err(connect(format!("no answer within {:?}", options.connect_timeout))),
        }
    }

    /// A link over a caller's ordered byte streams (`reader` from the peer, `writer` to it),
    /// speaking the same envelope protocol as a QUIC link. Both ends call this with their halves.
    pub fn over_stream<R, W>(peer: String, conn: Arc<dyn StreamConn>, reader: R, writer: W) -> (Link, mpsc::Receiver<Inbound>)
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        Link::start(peer, Conn::Stream(conn), writer, reader)
    }

    /// [`over_stream`](Self::over_stream) for a stream that is a kernel socket: senders write
    /// their envelopes into `writer` themselves when nothing is queued before them (see
    /// `crate::outgoing`), instead of always handing them to the link's writer task.
    pub(crate) fn over_stream_direct<R, W>(peer: String, conn: Arc<dyn StreamConn>, reader: R, writer: W) -> (Link, mpsc::Receiver<Inbound>)
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        Link::start_on(None, peer, Conn::Stream(Arc::clone(&conn)), writer, reader, Some(conn))
    }

    /// A link to rank `peer` on a side stream of `transport`'s connection to it, tagged
    /// `channel` (the peer takes it with [`accept_over_transport`](Self::accept_over_transport) on
    /// the same channel). Actor envelopes then share that one QUIC connection with the
    /// collectives. The link holds the transport weakly: dropping the transport ends the link.
    pub async fn over_transport(transport: &Arc<QuicTransport>, peer: usize, channel: u32) -> Result<(Link, mpsc::Receiver<Inbound>)> {
        let name = side_peer_name(peer);
        let connect = |reason: String| ActorError::Connect { peer: name.clone(), reason };
        let (send, recv) = transport.open_stream(peer, channel).await.map_err(|e| connect(e.to_string()))?;
        let address = transport.peer_address(peer).ok_or_else(|| connect("connection lost while opening the stream".into()))?;
        tracing::debug!(peer, channel, %address, "actor link over the collectives connection opened");
        Ok(Link::over_side(transport, peer, address, send, recv))
    }

    /// Waits for the next link a peer opened with [`over_transport`](Self::over_transport) on
    /// `channel` and returns the peer's rank with it. Fails with `Connect` once the transport is
    /// closed.
    pub async fn accept_over_transport(transport: &Arc<QuicTransport>, channel: u32) -> Result<(usize, Link, mpsc::Receiver<Inbound>)> {
        let (peer, send, recv) =
            transport.accept_stream(channel).await.map_err(|e| ActorError::Connect { peer: format!("channel {channel}"), reason: e.to_string() })?;
        let address = transport
            .peer_address(peer)
            .ok_or_else(|| ActorError::Connect { peer: side_peer_name(peer), reason: "connection lost while accepting the stream".into() })?;
        tracing::debug!(peer, channel, %address, "actor link over the collectives connection accepted");
        let (link, inbound) = Link::over_side(transport, peer, address, send, recv);
        Ok((peer, link, inbound))
    }

    fn over_side(
        transport: &Arc<QuicTransport>,
        peer: usize,
        address: SocketAddr,
        send: quinn::SendStream,
        recv: quinn::RecvStream,
    ) -> (Link, mpsc::Receiver<Inbound>) {
        let stream = Arc::new(SideStream {
            send: Mutex::new(send),
            recv: Mutex::new(recv),
            closed: std::sync::atomic::AtomicBool::new(false),
            reader: Mutex::new(None),
        });
        let conn = SideConn { transport: Arc::downgrade(transport), peer, address, stream: Arc::clone(&stream) };
        // The link's reader and writer run where the control connection is driven (its own thread
        // when the transport has one), so a busy caller runtime does not hold a call's hops back.
        let on = transport.control_runtime();
        Link::start_on(on.as_ref(), side_peer_name(peer), Conn::Side(conn), SideSend(Arc::clone(&stream)), SideRecv(stream), None)
    }

    fn start<R, W>(peer: String, connection: Conn, send: W, recv: R) -> (Link, mpsc::Receiver<Inbound>)
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        Link::start_on(None, peer, connection, send, recv, None)
    }

    /// Starts the link's writer and reader tasks on `runtime` (`None`: the caller's); with
    /// `direct`, senders may write into `send` themselves (`crate::outgoing`).
    fn start_on<R, W>(
        runtime: Option<&tokio::runtime::Handle>,
        peer: String,
        connection: Conn,
        send: W,
        mut recv: R,
        direct: Option<Arc<dyn StreamConn>>,
    ) -> (Link, mpsc::Receiver<Inbound>)
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (out, writing) = Outgoing::new(QUEUE, send, direct);
        let (inbound_tx, inbound_rx) = mpsc::channel(QUEUE);
        let link = Link {
            inner: Arc::new(LinkInner {
                peer,
                connection,
                out,
                pending: Mutex::new(BTreeMap::new()),
                next_correlation: AtomicU64::new(1),
                closed: watch::channel(None).0,
                inline: RwLock::new(BTreeMap::new()),
            }),
        };
        let writer = link.clone();
        let spawn = |task: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>| match runtime {
            Some(runtime) => drop(runtime.spawn(task)),
            None => drop(tokio::spawn(task)),
        };
        spawn(Box::pin(async move {
            if let Err(e) = writing.await {
                writer.mark_closed(format!("write failed: {e}"));
            }
        }));
        // The reader holds only a weak reference so that dropping every `Link` closes the connection.
        let weak = Arc::downgrade(&link.inner);
        spawn(Box::pin(async move {
            let reason = read_loop(&weak, &mut recv, &inbound_tx).await;
            if let Some(inner) = weak.upgrade() {
                Link { inner }.mark_closed(reason);
            }
        }));
        (link, inbound_rx)
    }

    /// The peer's address, as text.
    pub fn peer(&self) -> &str {
        &self.inner.peer
    }

    /// The peer's socket address.
    pub fn remote_address(&self) -> SocketAddr {
        match &self.inner.connection {
            Conn::Quic(c) => c.remote_address(),
            Conn::Stream(c) => c.remote_address(),
            Conn::Side(side) => side.address,
        }
    }

    /// A reference to the actor `to` on the other side.
    pub fn remote<M>(&self, to: impl Into<String>) -> RemoteRef<M> {
        RemoteRef { link: self.clone(), to: to.into(), _msg: std::marker::PhantomData }
    }

    /// Serves the actor `to` inline: its tells and asks are handled by `handler` on the link's
    /// reader task, as they are read, and an ask's answer goes from there to the link's writer
    /// task on the same runtime, instead of through the inbound receiver to an actor task (on
    /// another runtime) and from it back to the writer. For handlers that are cheap and never
    /// block or wait (an echo, a lookup in shared state, a counter): the reader runs on the link's
    /// runtime (for a link over a collectives transport with `ControlPath::OwnThread`, the control
    /// thread that every link of that transport shares), so a slow handler delays every message
    /// behind it.
    ///
    /// Semantics, against an actor task: messages to `to` are still handled one at a time and in
    /// arrival order, but on the reader rather than in a mailbox, so there is no mailbox bound to
    /// push back: the reader stops reading while the link's outgoing queue is full (the peer's
    /// flow control holding the writer back). An error returned by `handler` (or a message that
    /// does not decode as `M`) answers the ask as `Remote { reason }`; a panic is caught and
    /// answered the same way, and the handler stays. A tell's result is dropped. Messages read
    /// before this call went to the inbound receiver, so register before the peer learns the name
    /// (or accept that early ones take the old way). Registering a name again replaces its handler.
    pub fn serve_inline<M, R, F>(&self, to: impl Into<String>, handler: F)
    where
        M: rkyv::Archive,
        M::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rkyv::rancor::Error>>
            + rkyv::Deserialize<M, rkyv::api::high::HighDeserializer<rkyv::rancor::Error>>,
        R: for<'a> rkyv::Serialize<rkyv::api::high::HighSerializer<rkyv::util::AlignedVec, rkyv::ser::allocator::ArenaHandle<'a>, rkyv::rancor::Error>>,
        F: Fn(M) -> std::result::Result<R, String> + Send + Sync + 'static,
    {
        let handler = move |body: &[u8]| -> std::result::Result<Vec<u8>, String> {
            let msg: M = wire::decode(body).map_err(|e| e.to_string())?;
            let reply = handler(msg)?;
            wire::encode(&reply).map_err(|e| e.to_string())
        };
        self.inner.inline.write().unwrap_or_else(PoisonError::into_inner).insert(to.into(), Arc::new(handler));
    }

    /// Stops serving `to` inline ([`serve_inline`](Self::serve_inline)); its messages go to the
    /// inbound receiver again. Returns whether it was served inline.
    pub fn stop_serving_inline(&self, to: &str) -> bool {
        self.inner.inline.write().unwrap_or_else(PoisonError::into_inner).remove(to).is_some()
    }

    /// 32 bytes of TLS keying material unique to this connection (RFC 5705 exporter), for
    /// binding an authentication proof to the channel.
    pub fn export_keying_material(&self, label: &[u8]) -> Result<[u8; 32]> {
        let mut out = [0u8; 32];
        match &self.inner.connection {
            Conn::Quic(c) => c
                .export_keying_material(&mut out, label, b"rtx")
                .map_err(|_| ActorError::Connect { peer: self.inner.peer.clone(), reason: "TLS exporter unavailable".into() })?,
            Conn::Stream(c) => out = c.export_keying_material(label),
            Conn::Side(side) => {
                let transport = side.transport.upgrade().ok_or_else(|| self.closed_error())?;
                out = transport
                    .export_keying_material(side.peer, label)
                    .map_err(|e| ActorError::Connect { peer: self.inner.peer.clone(), reason: e.to_string() })?;
            }
        }
        Ok(out)
    }

    /// Sends raw envelope bytes, waiting while the outgoing queue is full.
    async fn send_envelope(&self, envelope: Envelope) -> Result<()> {
        let bytes = envelope.to_bytes()?;
        self.inner.out.send(bytes).await.map_err(|e| self.send_failed(e))
    }

    fn send_failed(&self, failed: SendFailed) -> ActorError {
        if let SendFailed::Write(e) = failed {
            self.mark_closed(format!("write failed: {e}"));
        }
        self.closed_error()
    }

    /// Sends `msg` to the actor `to` on the other side.
    pub async fn tell_bytes(&self, to: &str, body: Vec<u8>) -> Result<()> {
        self.check_open()?;
        self.send_envelope(Envelope { kind: Kind::Tell, correlation: 0, to: to.to_string(), body }).await
    }

    /// Like [`tell_bytes`](Self::tell_bytes), from a thread outside the runtime.
    pub fn blocking_tell_bytes(&self, to: &str, body: Vec<u8>) -> Result<()> {
        self.check_open()?;
        let bytes = Envelope { kind: Kind::Tell, correlation: 0, to: to.to_string(), body }.to_bytes()?;
        self.inner.out.blocking_send(bytes).map_err(|e| self.send_failed(e))
    }

    /// Calls the actor `to` with `body` and waits up to `timeout` for the reply's bytes.
    pub async fn ask_bytes(&self, to: &str, body: Vec<u8>, timeout: Duration) -> Result<Vec<u8>> {
        self.check_open()?;
        let correlation = self.inner.next_correlation.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.inner.pending.lock().unwrap_or_else(PoisonError::into_inner).insert(correlation, tx);
        let sent = self.send_envelope(Envelope { kind: Kind::Ask, correlation, to: to.to_string(), body }).await;
        if let Err(e) = sent {
            self.inner.pending.lock().unwrap_or_else(PoisonError::into_inner).remove(&correlation);
            return Err(e);
        }
        let answer = tokio::time::timeout(timeout, rx).await;
        self.inner.pending.lock().unwrap_or_else(PoisonError::into_inner).remove(&correlation);
        match answer {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(self.closed_error()),
            Err(_) => Err(ActorError::Timeout { peer: self.inner.peer.clone(), to: to.to_string(), after_ms: timeout.as_millis() as u64 }),
        }
    }

    /// Sends bytes as they are, bypassing the envelope encoder: for tests of the peer's decoder.
    #[doc(hidden)]
    pub async fn raw_send_for_tests(&self, bytes: Vec<u8>) -> Result<()> {
        self.inner.out.send(bytes).await.map_err(|e| self.send_failed(e))
    }

    /// Closes the link; pending calls on both sides fail.
    pub fn close(&self, reason: &str) {
        self.inner.connection.close(CLOSE_NORMAL, reason.as_bytes());
        self.mark_closed(format!("closed locally: {reason}"));
    }

    /// Whether the link is closed, and why.
    pub fn closed_reason(&self) -> Option<String> {
        self.inner.closed.borrow().clone()
    }

    /// Waits until the link is closed or lost; returns why.
    pub async fn closed(&self) -> String {
        let mut rx = self.inner.closed.subscribe();
        loop {
            if let Some(reason) = rx.borrow_and_update().clone() {
                return reason;
            }
            if rx.changed().await.is_err() {
                return "link dropped".into();
            }
        }
    }

    fn check_open(&self) -> Result<()> {
        match self.closed_reason() {
            Some(_) => Err(self.closed_error()),
            None => Ok(()),
        }
    }

    fn closed_error(&self) -> ActorError {
        ActorError::LinkClosed { peer: self.inner.peer.clone(), reason: self.closed_reason().unwrap_or_else(|| "connection closed".into()) }
    }

    fn mark_closed(&self, reason: String) {
        let first = self.inner.closed.send_if_modified(|state| {
            if state.is_none() {
                *state = Some(reason.clone());
                true
            } else {
                false
            }
        });
        if first {
            tracing::debug!(peer = %self.inner.peer, %reason, "link closed");
            let pending = std::mem::take(&mut *self.inner.pending.lock().unwrap_or_else(PoisonError::into_inner));
            for (_, tx) in pending {
                let _ = tx.send(Err(ActorError::LinkClosed { peer: self.inner.peer.clone(), reason: reason.clone() }));
            }
        }
    }

    fn answer(&self, correlation: u64, result: Result<Vec<u8>>) {
        if let Some(tx) = self.inner.pending.lock().unwrap_or_else(PoisonError::into_inner).remove(&correlation) {
            let _ = tx.send(result);
        }
    }
}

impl Drop for LinkInner {
    fn drop(&mut self) {
        self.connection.close(CLOSE_NORMAL, b"link dropped");
    }
}

async fn read_loop<R: AsyncRead + Unpin>(link: &std::sync::Weak<LinkInner>, recv: &mut R, inbound: &mpsc::Sender<Inbound>) -> String {
    loop {
        let mut len = [0u8; 4];
        if let Err(e) = recv.read_exact(&mut len).await {
            return format!("peer went away: {e}");
        }
        let Some(inner) = link.upgrade() else { return "link dropped".into() };
        let this = Link { inner };
        let malformed = |reason: String| {
            tracing::warn!(peer = %this.inner.peer, %reason, "malformed envelope; closing the link");
            this.inner.connection.close(CLOSE_MALFORMED, b"malformed envelope");
            format!("malformed envelope: {reason}")
        };
        let len = match Envelope::check_len(u32::from_le_bytes(len)) {
            Ok(len) => len,
            Err(reason) => return malformed(reason),
        };
        let mut rest = vec![0u8; len];
        if let Err(e) = recv.read_exact(&mut rest).await {
            return format!("peer went away mid-envelope: {e}");
        }
        let envelope = match Envelope::parse(rest) {
            Ok(envelope) => envelope,
            Err(reason) => return malformed(reason),
        };
        match envelope.kind {
            Kind::Reply => this.answer(envelope.correlation, Ok(envelope.body)),
            Kind::ErrorReply => {
                let reason = String::from_utf8_lossy(&envelope.body).into_owned();
                this.answer(envelope.correlation, Err(ActorError::Remote { peer: this.inner.peer.clone(), to: envelope.to, reason }));
            }
            Kind::Tell | Kind::Ask => {
                let handler = this.inner.inline.read().unwrap_or_else(PoisonError::into_inner).get(&envelope.to).cloned();
                if let Some(handler) = handler {
                    let out = this.inner.out.clone();
                    drop(this);
                    let Some(answer) = run_inline(handler.as_ref(), envelope) else { continue };
                    // To the stream (or the writer task on this runtime); the reader holds the link
                    // only weakly.
                    if out.send(answer).await.is_err() {
                        return "writer ended".into();
                    }
                    continue;
                }
                let reply = (envelope.kind == Kind::Ask).then(|| (this.clone(), envelope.correlation));
                drop(this);
                if inbound.send(Inbound { to: envelope.to, body: envelope.body, reply }).await.is_err() {
                    return "inbound receiver dropped".into();
                }
            }
        }
    }
}

/// Runs an inline handler on a tell or ask; returns the encoded answer of an ask (a reply, or an
/// error reply with the handler's reason), `None` for a tell.
fn run_inline(handler: &InlineFn, envelope: Envelope) -> Option<Vec<u8>> {
    let answer = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler(&envelope.body)))
        .unwrap_or_else(|panic| Err(format!("inline handler panicked: {}", crate::actor::panic_text(panic))));
    if envelope.kind != Kind::Ask {
        if let Err(reason) = answer {
            tracing::debug!(to = %envelope.to, %reason, "inline handler failed on a tell");
        }
        return None;
    }
    let (kind, body) = match answer {
        Ok(body) => (Kind::Reply, body),
        Err(reason) => (Kind::ErrorReply, reason.into_bytes()),
    };
    let reply = Envelope { kind, correlation: envelope.correlation, to: envelope.to, body };
    match reply.to_bytes() {
        Ok(bytes) => Some(bytes),
        // Too large an answer: the caller still gets one.
        Err(e) => Envelope { kind: Kind::ErrorReply, correlation: reply.correlation, to: reply.to, body: e.to_string().into_bytes() }.to_bytes().ok(),
    }
}

impl Inbound {
    /// The local actor this is for.
    pub fn to(&self) -> &str {
        &self.to
    }

    /// Whether the sender waits for a reply.
    pub fn wants_reply(&self) -> bool {
        self.reply.is_some()
    }

    /// The link it came over (the sender).
    pub fn link(&self) -> Option<&Link> {
        self.reply.as_ref().map(|(link, _)| link)
    }

    /// Validates and decodes the message.
    pub fn decode<T>(&self) -> Result<T>
    where
        T: rkyv::Archive,
        T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rkyv::rancor::Error>>
            + rkyv::Deserialize<T, rkyv::api::high::HighDeserializer<rkyv::rancor::Error>>,
    {
        wire::decode(&self.body)
    }

    /// Answers an `ask` with `value` (a tell has nobody to answer: ignored).
    pub async fn reply<R>(self, value: &R) -> Result<()>
    where
        R: for<'a> rkyv::Serialize<rkyv::api::high::HighSerializer<rkyv::util::AlignedVec, rkyv::ser::allocator::ArenaHandle<'a>, rkyv::rancor::Error>>,
    {
        let Some((link, correlation)) = self.reply else { return Ok(()) };
        let body = wire::encode(value)?;
        link.send_envelope(Envelope { kind: Kind::Reply, correlation, to: self.to, body }).await
    }

    /// Answers an `ask` with an error the caller sees as `Remote { reason }`.
    pub async fn reply_error(self, reason: &str) -> Result<()> {
        let Some((link, correlation)) = self.reply else { return Ok(()) };
        link.send_envelope(Envelope { kind: Kind::ErrorReply, correlation, to: self.to, body: reason.as_bytes().to_vec() }).await
    }
}

impl<M> RemoteRef<M>
where
    M: for<'a> rkyv::Serialize<rkyv::api::high::HighSerializer<rkyv::util::AlignedVec, rkyv::ser::allocator::ArenaHandle<'a>, rkyv::rancor::Error>>,
{
    /// The remote actor's name.
    pub fn name(&self) -> &str {
        &self.to
    }

    /// The link this reference uses.
    pub fn link(&self) -> &Link {
        &self.link
    }

    /// Sends `msg` without waiting for an answer.
    pub async fn tell(&self, msg: &M) -> Result<()> {
        self.link.tell_bytes(&self.to, wire::encode(msg)?).await
    }

    /// Sends `msg` from a thread outside the runtime.
    pub fn blocking_tell(&self, msg: &M) -> Result<()> {
        self.link.blocking_tell_bytes(&self.to, wire::encode(msg)?)
    }

    /// Calls the actor with `msg` and decodes its reply as `R`.
    pub async fn ask<R>(&self, msg: &M, timeout: Duration) -> Result<R>
    where
        R: rkyv::Archive,
        R::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rkyv::rancor::Error>>
            + rkyv::Deserialize<R, rkyv::api::high::HighDeserializer<rkyv::rancor::Error>>,
    {
        let bytes = self.link.ask_bytes(&self.to, wire::encode(msg)?, timeout).await?;
        wire::decode(&bytes)
    }
}

/// How a link over a collectives connection names its peer.
fn side_peer_name(rank: usize) -> String {
    format!("rank {rank}")
}

fn transport_config(options: &LinkOptions) -> Result<quinn::TransportConfig> {
    if options.keep_alive >= options.idle_timeout {
        return Err(ActorError::Connect { peer: "local".into(), reason: "keep_alive must be below idle_timeout".into() });
    }
    let mut config = quinn::TransportConfig::default();
    let idle = quinn::IdleTimeout::try_from(options.idle_timeout).map_err(|e| ActorError::Connect { peer: "local".into(), reason: e.to_string() })?;
    config.max_idle_timeout(Some(idle));
    config.keep_alive_interval(Some(options.keep_alive));
    Ok(config)
}

/// Accepts any server certificate but verifies the handshake signatures with it: the channel
/// is encrypted, and the caller authenticates it (see the module docs).
#[derive(Debug)]
struct ChannelOnly(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for ChannelOnly {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
