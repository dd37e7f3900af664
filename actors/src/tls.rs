//! Actor links over TCP with mutual TLS 1.3 against the cluster CA: [`TlsLinkListener`] and
//! [`Link::dial_tls`]. The envelopes, `ask`/`tell`, inline handlers and failure rules are those
//! of every [`Link`] (this module only makes the byte streams, then calls [`Link::over_stream`]).
//!
//! Why a second carrier (issue 20, BENCHMARKS.md "Actor calls"): an actor call over QUIC costs
//! 2.5-2.7x a loopback TCP round trip on a 16-core host even with no thread hand-off left (49 us
//! against 19), because every call pays quinn's per-packet work (packet assembly, ACK and loss
//! bookkeeping, timers) and two UDP sends and receives on top of the kernel's socket path. A
//! control message is one small record each way, which TCP with `TCP_NODELAY` carries in one
//! segment each way; TLS adds one AES-GCM seal and open per record. So the latency-critical
//! control plane rides TCP, and bulk tensors stay on QUIC, where the stripes, the flow control
//! and the loss of one peer not stalling the others matter.
//!
//! Security: both sides present certificates issued by the cluster CA ([`NodeIdentity`], as the
//! collectives' QUIC transport does), TLS 1.3 with AES-128-GCM only (the collectives' rustls
//! configuration, under its own ALPN [`TLS_LINK_ALPN`]). The dialer checks that the listener's
//! certificate names the rank it dialed ([`rank_name`]); the listener reads the dialer's 8-byte
//! hello (`RTXT`, rank u32 LE) and checks that the dialer's certificate names that rank
//! ([`certificate_names_rank`]), else drops the connection and logs why. A peer without a
//! certificate from this CA fails the handshake.
//!
//! Liveness: TCP keep-alive probes after [`LinkOptions::keep_alive`] of silence, every
//! `keep_alive`, and `TCP_USER_TIMEOUT` of [`LinkOptions::idle_timeout`], so a peer that vanished
//! without closing (a dead machine) fails the link after about the idle timeout, like a QUIC
//! link; a killed process closes its socket and fails the link at once.
//!
//! Runtime: the link's reader and writer tasks run on the tokio runtime that calls
//! [`Link::dial_tls`] or [`TlsLinkListener::accept`]. A caller whose own runtime is busy with bulk
//! work (a trainer's) dials or accepts from a runtime of its own (a current-thread runtime on a
//! thread of its own, as the QUIC control path does), so that the link's reads are not queued
//! behind that work.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};

use rtx_collectives::{certificate_names_rank, client_tls_config, rank_name, server_tls_config, NodeIdentity};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::{TlsAcceptor, TlsConnector, TlsStream};

use crate::error::{ActorError, Result};
use crate::link::{Inbound, Link, LinkOptions, StreamConn};

/// ALPN of actor links over TLS.
pub const TLS_LINK_ALPN: &[u8] = b"rtx-actors-tls/1";
const HELLO_MAGIC: [u8; 4] = *b"RTXT";
const HELLO_LEN: usize = 8;
/// Context of the TLS exporter behind [`StreamConn::export_keying_material`].
const EXPORTER_CONTEXT: &[u8] = b"rtx-actors";

/// Accepts [`Link::dial_tls`] links from ranks of the same cluster CA.
pub struct TlsLinkListener {
    listener: TcpListener,
    acceptor: TlsAcceptor,
    options: LinkOptions,
}

impl std::fmt::Debug for TlsLinkListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsLinkListener").field("addr", &self.listener.local_addr().ok()).finish_non_exhaustive()
    }
}

impl TlsLinkListener {
    /// Listens on `addr` (port 0 picks one) as `identity`'s rank. Must be called inside a tokio
    /// runtime (the socket registers with its reactor).
    pub async fn bind(identity: &NodeIdentity, addr: SocketAddr, options: LinkOptions) -> Result<TlsLinkListener> {
        let connect = |reason: String| ActorError::Connect { peer: addr.to_string(), reason };
        let mut config = server_tls_config(identity).map_err(|e| connect(e.to_string()))?;
        config.alpn_protocols = vec![TLS_LINK_ALPN.to_vec()];
        let listener = TcpListener::bind(addr).await.map_err(|e| connect(e.to_string()))?;
        Ok(TlsLinkListener { listener, acceptor: TlsAcceptor::from(Arc::new(config)), options })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener.local_addr().map_err(|e| ActorError::Connect { peer: "local".into(), reason: e.to_string() })
    }

    /// Waits for the next peer and returns its rank with the link. A peer whose handshake or
    /// hello fails (no certificate of this CA, a certificate of another rank than it claims, a
    /// bad hello, no hello within `connect_timeout`) is logged and skipped, not returned; an
    /// error of the listening socket itself is returned.
    pub async fn accept(&self) -> Result<(usize, Link, mpsc::Receiver<Inbound>)> {
        loop {
            let (tcp, address) = self.listener.accept().await.map_err(|e| ActorError::Connect { peer: "listener".into(), reason: e.to_string() })?;
            let accepted = async {
                tune(&tcp, &self.options)?;
                let mut tls = self.acceptor.accept(tcp).await.map_err(|e| format!("TLS handshake: {e}"))?;
                let mut hello = [0u8; HELLO_LEN];
                tls.read_exact(&mut hello).await.map_err(|e| format!("hello: {e}"))?;
                let rank = decode_hello(&hello)?;
                let names_rank = tls.get_ref().1.peer_certificates().is_some_and(|certs| certificate_names_rank(certs, rank));
                if !names_rank {
                    let _ = tls.shutdown().await;
                    return Err(format!("the peer claims rank {rank}, its certificate does not name it"));
                }
                Ok::<_, String>((rank, TlsStream::from(tls)))
            };
            match tokio::time::timeout(self.options.connect_timeout, accepted).await {
                Ok(Ok((rank, tls))) => {
                    let (link, inbound) = start(rank, address, tls)?;
                    tracing::debug!(peer = rank, %address, "actor link over TLS accepted");
                    return Ok((rank, link, inbound));
                }
                Ok(Err(reason)) => tracing::warn!(%address, %reason, "actor TLS link refused"),
                Err(_) => tracing::warn!(%address, "actor TLS link handshake timed out"),
            }
        }
    }
}

impl Link {
    /// Dials rank `peer`'s [`TlsLinkListener`] at `addr` as `identity`'s rank (see the module
    /// doc: mutual TLS against the cluster CA, each side's certificate checked against its rank).
    /// The link's tasks run on the calling runtime. Fails with `Connect` on any handshake error
    /// or after `options.connect_timeout`.
    pub async fn dial_tls(identity: &NodeIdentity, addr: SocketAddr, peer: usize, options: LinkOptions) -> Result<(Link, mpsc::Receiver<Inbound>)> {
        let connect = |reason: String| ActorError::Connect { peer: format!("rank {peer} at {addr}"), reason };
        let mut config = client_tls_config(identity).map_err(|e| connect(e.to_string()))?;
        config.alpn_protocols = vec![TLS_LINK_ALPN.to_vec()];
        let name = ServerName::try_from(rank_name(peer)).map_err(|e| connect(e.to_string()))?;
        let dialed = async {
            let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
            tune(&tcp, &options)?;
            let mut tls = TlsConnector::from(Arc::new(config)).connect(name, tcp).await.map_err(|e| format!("TLS handshake: {e}"))?;
            tls.write_all(&encode_hello(identity.rank)?).await.map_err(|e| format!("hello: {e}"))?;
            tls.flush().await.map_err(|e| format!("hello: {e}"))?;
            Ok::<_, String>(TlsStream::from(tls))
        };
        let tls = match tokio::time::timeout(options.connect_timeout, dialed).await {
            Ok(Ok(tls)) => tls,
            Ok(Err(reason)) => return Err(connect(reason)),
            Err(_) => return Err(connect(format!("no answer within {:?}", options.connect_timeout))),
        };
        tracing::debug!(peer, %addr, "actor link over TLS dialed");
        start(peer, addr, tls)
    }
}

fn encode_hello(rank: usize) -> std::result::Result<[u8; HELLO_LEN], String> {
    let rank = u32::try_from(rank).map_err(|_| format!("rank {rank} does not fit the hello"))?;
    let mut hello = [0u8; HELLO_LEN];
    hello[..4].copy_from_slice(&HELLO_MAGIC);
    hello[4..].copy_from_slice(&rank.to_le_bytes());
    Ok(hello)
}

fn decode_hello(hello: &[u8; HELLO_LEN]) -> std::result::Result<usize, String> {
    if hello[..4] != HELLO_MAGIC {
        return Err("bad hello magic".into());
    }
    let rank = u32::from_le_bytes([hello[4], hello[5], hello[6], hello[7]]);
    usize::try_from(rank).map_err(|_| format!("rank {rank} does not fit this platform"))
}

/// `TCP_NODELAY` (a call's envelope goes at once), keep-alive probes and the user timeout (see
/// the module doc, "Liveness").
fn tune(tcp: &TcpStream, options: &LinkOptions) -> std::result::Result<(), String> {
    tcp.set_nodelay(true).map_err(|e| format!("TCP_NODELAY: {e}"))?;
    rtx_collectives::set_tcp_liveness(socket2::SockRef::from(tcp), options.keep_alive, options.idle_timeout)
}

/// Splits the TLS stream into the halves the link's tasks hold and starts the link.
fn start(peer: usize, address: SocketAddr, tls: TlsStream<TcpStream>) -> Result<(Link, mpsc::Receiver<Inbound>)> {
    let shared = Arc::new(Shared { stream: Mutex::new(tls), address });
    let conn: Arc<dyn StreamConn> = Arc::clone(&shared) as Arc<dyn StreamConn>;
    Ok(Link::over_stream_direct(rank_name(peer), conn, TlsRead(Arc::clone(&shared)), TlsWrite(shared)))
}

/// The TLS stream both halves poll. Each lock is held for one non-blocking poll, never across an
/// await (what `tokio::io::split` does, kept here because closing the link and the TLS exporter
/// need the stream too).
struct Shared {
    stream: Mutex<TlsStream<TcpStream>>,
    address: SocketAddr,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, TlsStream<TcpStream>> {
        // A poll cannot leave the stream half-changed to anyone but its own next poll.
        self.stream.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl StreamConn for Shared {
    fn close(&self, reason: &str) {
        // Shutting the socket down wakes this side's reader (end of stream) and the peer's.
        tracing::debug!(address = %self.address, reason, "actor TLS link closed");
        let _ = socket2::SockRef::from(self.lock().get_ref().0).shutdown(std::net::Shutdown::Both);
    }

    fn export_keying_material(&self, label: &[u8]) -> [u8; 32] {
        let mut out = [0u8; 32];
        let stream = self.lock();
        let exported = match &*stream {
            TlsStream::Client(s) => s.get_ref().1.export_keying_material(&mut out, label, Some(EXPORTER_CONTEXT)).map(|_| ()),
            TlsStream::Server(s) => s.get_ref().1.export_keying_material(&mut out, label, Some(EXPORTER_CONTEXT)).map(|_| ()),
        };
        if exported.is_err() {
            // Only before the handshake completes, which no link ever sees: all zeros binds nothing.
            tracing::warn!(address = %self.address, "TLS exporter unavailable");
        }
        out
    }

    fn remote_address(&self) -> SocketAddr {
        self.address
    }
}

struct TlsRead(Arc<Shared>);
struct TlsWrite(Arc<Shared>);

impl AsyncRead for TlsRead {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0.lock()).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsWrite {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut *self.0.lock()).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0.lock()).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0.lock()).poll_shutdown(cx)
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[std::io::IoSlice<'_>]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut *self.0.lock()).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.lock().is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trips_and_rejects_bad_magic() {
        let hello = encode_hello(7).expect("fits");
        assert_eq!(decode_hello(&hello), Ok(7));
        let mut bad = hello;
        bad[0] = b'X';
        assert!(decode_hello(&bad).is_err());
    }
}
