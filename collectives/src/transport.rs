//! The [`Transport`] trait: reliable, ordered, framed messages between ranks, plus connection events.
//!
//! A transport moves whole encoded frames (see [`crate::frame`]) between global ranks `0..world_size`.
//! Guarantees a transport must give: messages between one ordered pair of ranks arrive complete, in
//! order, at most once; a peer that goes away is reported once with [`TransportEvent::PeerLost`]; and
//! `from` in a received frame is the authenticated sender, not a claim read from the frame.
//!
//! Exactly one task (the endpoint's dispatcher) calls [`Transport::recv`]; any task may call
//! [`Transport::send`]. The trait holds no QUIC or tokio-channel types so that the simulator can
//! implement it in memory. Methods return boxed futures so `Arc<dyn Transport>` works.

use std::future::Future;
use std::pin::Pin;

use crate::error::Result;
use crate::pool::PooledBuf;

/// A boxed, sendable future, as returned by [`Transport`] methods.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Something a transport delivers to the local rank.
#[derive(Debug)]
pub enum TransportEvent {
    /// A whole frame from `from` (not yet decoded or validated).
    Frame {
        /// The authenticated global rank of the sender.
        from: usize,
        /// The encoded frame bytes.
        bytes: PooledBuf,
    },
    /// A connection to the peer was (re-)established.
    PeerUp(usize),
    /// The connection to the peer is gone; frames it had not delivered are lost.
    PeerLost(usize),
}

/// Reliable, ordered, framed messaging between the ranks of one job.
pub trait Transport: Send + Sync + 'static {
    /// The local global rank.
    fn rank(&self) -> usize;

    /// Number of addressable ranks (`0..world_size`).
    fn world_size(&self) -> usize;

    /// Sends one encoded frame to `peer`. May wait for back-pressure. Fails with
    /// [`crate::Error::PeerLost`] when the peer is known to be gone.
    fn send(&self, peer: usize, frame: PooledBuf) -> BoxFuture<'_, Result<()>>;

    /// The next event for the local rank; `None` once the transport is shut down for good.
    fn recv(&self) -> BoxFuture<'_, Option<TransportEvent>>;
}
