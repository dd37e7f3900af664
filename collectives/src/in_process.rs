//! In-process transport: every rank is a set of tokio tasks in one process, linked by channels.
//!
//! [`InProcessNetwork::new`] builds `n` connected [`InProcessTransport`]s. Each rank has one inbox
//! (an unbounded channel) carrying frames and connection events in send order; frames additionally
//! hold a permit from the receiver's semaphore, so at most [`IN_PROCESS_INBOX_FRAMES`] frames wait
//! in an inbox and a fast sender waits instead of growing memory without bound. Events need no
//! permit, so faults can be injected from synchronous code.
//!
//! Fault injection: [`InProcessNetwork::disconnect`] cuts a rank off from everyone (each side sees
//! [`TransportEvent::PeerLost`]); dropping a transport does the same. [`InProcessNetwork::reconnect`]
//! heals the cut with [`TransportEvent::PeerUp`].

use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use crate::error::{Error, Result};
use crate::frame::OpKind;
use crate::pool::PooledBuf;
use crate::sync::lock;
use crate::transport::{BoxFuture, Transport, TransportEvent};

/// Most frames waiting in one rank's inbox before senders wait.
pub const IN_PROCESS_INBOX_FRAMES: usize = 1024;

/// The shared fabric of an in-process job; clone it to inject faults from a test.
#[derive(Clone, Debug)]
pub struct InProcessNetwork {
    shared: Arc<NetShared>,
}

/// One rank's end of an [`InProcessNetwork`].
#[derive(Debug)]
pub struct InProcessTransport {
    rank: usize,
    shared: Arc<NetShared>,
    inbox: tokio::sync::Mutex<mpsc::UnboundedReceiver<Inbound>>,
}

#[derive(Debug)]
struct NetShared {
    inboxes: Vec<mpsc::UnboundedSender<Inbound>>,
    /// Inbox permits per rank; a cut-off rank's semaphore is closed so blocked senders fail.
    permits: Mutex<Vec<Arc<Semaphore>>>,
    alive: Mutex<Vec<bool>>,
}

#[derive(Debug)]
enum Inbound {
    Frame { from: usize, bytes: PooledBuf, _permit: OwnedSemaphorePermit },
    Event(TransportEvent),
}

impl InProcessNetwork {
    /// A network of `n_ranks` connected ranks; transport `i` is rank `i`.
    pub fn new(n_ranks: usize) -> (InProcessNetwork, Vec<InProcessTransport>) {
        let mut inboxes = Vec::with_capacity(n_ranks);
        let mut receivers = Vec::with_capacity(n_ranks);
        for _ in 0..n_ranks {
            let (tx, rx) = mpsc::unbounded_channel();
            inboxes.push(tx);
            receivers.push(rx);
        }
        let shared = Arc::new(NetShared {
            inboxes,
            permits: Mutex::new((0..n_ranks).map(|_| Arc::new(Semaphore::new(IN_PROCESS_INBOX_FRAMES))).collect()),
            alive: Mutex::new(vec![true; n_ranks]),
        });
        let transports = receivers
            .into_iter()
            .enumerate()
            .map(|(rank, rx)| InProcessTransport { rank, shared: Arc::clone(&shared), inbox: tokio::sync::Mutex::new(rx) })
            .collect();
        (InProcessNetwork { shared }, transports)
    }

    /// Cuts `rank` off: every other live rank sees `PeerLost(rank)` and `rank` sees `PeerLost` for
    /// every other live rank. Does nothing if `rank` is already cut off or out of range.
    pub fn disconnect(&self, rank: usize) {
        self.shared.disconnect(rank);
    }

    /// Heals a cut made by [`disconnect`](Self::disconnect): `rank` and every live rank see `PeerUp`.
    pub fn reconnect(&self, rank: usize) {
        let peers: Vec<usize> = {
            let mut alive = lock(&self.shared.alive);
            match alive.get_mut(rank) {
                Some(a) if !*a => *a = true,
                _ => return,
            }
            lock(&self.shared.permits)[rank] = Arc::new(Semaphore::new(IN_PROCESS_INBOX_FRAMES));
            (0..alive.len()).filter(|&p| p != rank && alive[p]).collect()
        };
        for peer in peers {
            self.shared.event(peer, TransportEvent::PeerUp(rank));
            self.shared.event(rank, TransportEvent::PeerUp(peer));
        }
    }
}

impl NetShared {
    fn disconnect(&self, rank: usize) {
        let peers: Vec<usize> = {
            let mut alive = lock(&self.alive);
            match alive.get_mut(rank) {
                Some(a) if *a => *a = false,
                _ => return,
            }
            // Senders blocked on a full inbox of the cut-off rank must not wait for ever.
            lock(&self.permits)[rank].close();
            (0..alive.len()).filter(|&p| p != rank && alive[p]).collect()
        };
        for peer in peers {
            self.event(peer, TransportEvent::PeerLost(rank));
            self.event(rank, TransportEvent::PeerLost(peer));
        }
    }

    fn event(&self, to: usize, event: TransportEvent) {
        // A closed inbox means that rank's transport is gone; it needs no events.
        let _ = self.inboxes[to].send(Inbound::Event(event));
    }

    fn is_alive(&self, rank: usize) -> bool {
        lock(&self.alive).get(rank).copied().unwrap_or(false)
    }
}

impl Transport for InProcessTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.inboxes.len()
    }

    fn send(&self, peer: usize, frame: PooledBuf) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let size = self.shared.inboxes.len();
            if peer >= size {
                return Err(Error::RankOutOfRange { rank: peer, size });
            }
            if !self.shared.is_alive(self.rank) {
                return Err(Error::TransportClosed);
            }
            let lost = Error::PeerLost { rank: peer, op: OpKind::Send };
            if !self.shared.is_alive(peer) {
                return Err(lost);
            }
            let permits = Arc::clone(&lock(&self.shared.permits)[peer]);
            let permit = permits.acquire_owned().await.map_err(|_| lost.clone())?;
            // Re-check after a possible wait: frames must not reach a rank after it was cut off.
            if !self.shared.is_alive(peer) || !self.shared.is_alive(self.rank) {
                return Err(lost);
            }
            self.shared.inboxes[peer].send(Inbound::Frame { from: self.rank, bytes: frame, _permit: permit }).map_err(|_| lost)
        })
    }

    fn checks_integrity(&self) -> bool {
        // Frames are buffers handed over in memory.
        true
    }

    fn recv(&self) -> BoxFuture<'_, Option<TransportEvent>> {
        Box::pin(async move {
            let mut inbox = self.inbox.lock().await;
            match inbox.recv().await? {
                // Frames sent before a cut are delivered before the `PeerLost` that follows them,
                // as data before a FIN is on TCP.
                Inbound::Frame { from, bytes, _permit } => Some(TransportEvent::Frame { from, bytes }),
                Inbound::Event(event) => Some(event),
            }
        })
    }
}

impl Drop for InProcessTransport {
    fn drop(&mut self) {
        self.shared.disconnect(self.rank);
    }
}
