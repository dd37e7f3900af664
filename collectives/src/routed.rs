//! [`RoutedTransport`]: one transport made of two, a host-local one (shared memory) for the ranks on
//! this host and a network one (QUIC) for every other rank, so a job spread over several machines
//! with several ranks each moves host-internal frames through memory and only the rest over the
//! network. Together with [`crate::CommConfig::host_of`] (which makes `all_reduce` hierarchical:
//! reduce inside each host, all-reduce among the hosts' leaders, broadcast inside each host) only
//! the leaders' frames cross hosts.
//!
//! Ranks: the routed transport speaks global ranks `0..world`, like the network transport. The
//! local transport numbers the host's ranks `0..local.len()` in the order of `local_ranks`; frames,
//! events and errors coming from it are renamed to global ranks here, so the endpoint never sees a
//! local number. The network transport is expected to link only the ranks of other hosts (see
//! `QuicTransport::connect_except`); a send to a local rank never reaches it.
//!
//! Delivery: both halves are attached to the endpoint's sink (push delivery) when the local one
//! accepts that; the sink is told the transport closed once both halves have closed. A network
//! half that only supports pulling is pumped into the sink by a task. When the local half refuses
//! push delivery, both are pulled, and [`Transport::recv`] takes whichever has an event first.
//!
//! Guarantees are the weaker of the two halves': frames are integrity-checked by the channel only
//! if both halves check it, and a transport's frame-size preference is used only if both halves
//! prefer the same size (otherwise the endpoint's default applies, on every rank alike).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use crate::error::{Error, Result};
use crate::frame::HEADER_LEN;
use crate::pool::{BufferPool, PooledBuf};
use crate::transport::{AwaitedFrame, BoxFuture, ChunkedBytes, EventSink, LentBytes, SealedPayload, Transport, TransportEvent};

/// A transport that sends to the ranks of this host over `local` and to all others over `network`.
pub struct RoutedTransport {
    rank: usize,
    world: usize,
    network: Arc<dyn Transport>,
    local: Arc<dyn Transport>,
    /// Local index -> global rank.
    local_ranks: Arc<[usize]>,
    /// Global rank -> local index, for the ranks of this host.
    local_index: Vec<Option<usize>>,
    /// Which halves have ended `recv` (pull mode): bit 0 local, bit 1 network.
    pull_closed: tokio::sync::Mutex<u8>,
    /// The halves' sinks once attached (each half holds its sink weakly).
    sinks: std::sync::Mutex<Vec<Arc<dyn EventSink>>>,
}

impl RoutedTransport {
    /// Joins `local` (whose rank `i` is global rank `local_ranks[i]`) and `network` (global ranks).
    /// Fails with [`Error::InvalidConfig`] unless the two agree on this rank, `local_ranks` are
    /// distinct ranks of the world that include this one, and `local` has exactly that many ranks.
    pub fn new(network: Arc<dyn Transport>, local: Arc<dyn Transport>, local_ranks: Vec<usize>) -> Result<RoutedTransport> {
        let (rank, world) = (network.rank(), network.world_size());
        if local.world_size() != local_ranks.len() {
            return Err(Error::InvalidConfig { reason: "the local transport must have one rank per local rank" });
        }
        let mut local_index = vec![None; world];
        for (i, &global) in local_ranks.iter().enumerate() {
            let slot = local_index.get_mut(global).ok_or(Error::InvalidConfig { reason: "a local rank is outside the world" })?;
            if slot.replace(i).is_some() {
                return Err(Error::InvalidConfig { reason: "a local rank is listed twice" });
            }
        }
        if local_ranks.get(local.rank()) != Some(&rank) {
            return Err(Error::InvalidConfig { reason: "the local transport's rank is not this rank" });
        }
        Ok(RoutedTransport {
            rank,
            world,
            network,
            local,
            local_ranks: local_ranks.into(),
            local_index,
            pull_closed: tokio::sync::Mutex::new(0),
            sinks: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// Connects rank `quic.rank()` of a job spread over machines by `host_of` (rank -> machine):
    /// shared-memory rings with the ranks of its machine (ring names `{shm.job}-h{machine}`, so
    /// each machine has its own) and `quic` (bound, not yet connected) to every other rank at
    /// `addrs`, both at once. Fails with [`Error::InvalidConfig`] when `host_of` does not name
    /// every rank of the world.
    #[cfg(all(feature = "quic", feature = "shm"))]
    pub async fn connect_over_quic(
        quic: Arc<crate::QuicTransport>,
        addrs: &[std::net::SocketAddr],
        host_of: &[u32],
        shm: crate::ShmOptions,
    ) -> Result<RoutedTransport> {
        let (local, index, shm) = Self::host_part(quic.as_ref(), host_of, shm)?;
        let (shm, linked) = tokio::join!(crate::ShmTransport::connect(index, local.len(), shm), quic.connect_except(addrs, &local));
        linked?;
        RoutedTransport::new(quic, Arc::new(shm?), local)
    }

    /// [`connect_over_quic`](Self::connect_over_quic) with a [`crate::TlsTransport`] (TLS over
    /// TCP) between the machines.
    #[cfg(all(feature = "quic", feature = "shm"))]
    pub async fn connect_over_tls(
        tls: Arc<crate::TlsTransport>,
        addrs: &[std::net::SocketAddr],
        host_of: &[u32],
        shm: crate::ShmOptions,
    ) -> Result<RoutedTransport> {
        let (local, index, shm) = Self::host_part(tls.as_ref(), host_of, shm)?;
        let (shm, linked) = tokio::join!(crate::ShmTransport::connect(index, local.len(), shm), tls.connect_except(addrs, &local));
        linked?;
        RoutedTransport::new(tls, Arc::new(shm?), local)
    }

    /// This rank's machine from `host_of`: the global ranks on it, this rank's index among them,
    /// and the shared-memory options of that machine's ring set.
    #[cfg(all(feature = "quic", feature = "shm"))]
    fn host_part(network: &dyn Transport, host_of: &[u32], shm: crate::ShmOptions) -> Result<(Vec<usize>, usize, crate::ShmOptions)> {
        let (rank, world) = (network.rank(), network.world_size());
        if host_of.len() != world {
            return Err(Error::InvalidConfig { reason: "the host map must name the machine of every rank" });
        }
        let host = host_of[rank];
        let local: Vec<usize> = (0..world).filter(|&r| host_of[r] == host).collect();
        let index = local.iter().position(|&r| r == rank).ok_or(Error::InvalidConfig { reason: "this rank is not on its own machine" })?;
        let shm = crate::ShmOptions { job: format!("{}-h{host}", shm.job), ..shm };
        Ok((local, index, shm))
    }

    /// The global ranks served by the local transport, in its rank order.
    pub fn local_ranks(&self) -> &[usize] {
        &self.local_ranks
    }

    fn route(&self, peer: usize) -> Result<Route> {
        match self.local_index.get(peer) {
            None => Err(Error::RankOutOfRange { rank: peer, size: self.world }),
            Some(Some(i)) => Ok(Route::Local(*i)),
            Some(None) => Ok(Route::Network),
        }
    }

    /// A local transport's error names local ranks; the caller knows global ones.
    fn globalize(&self, error: Error) -> Error {
        rename_error(&self.local_ranks, error)
    }
}

enum Route {
    Local(usize),
    Network,
}

fn rename_error(local_ranks: &[usize], error: Error) -> Error {
    let global = |r: usize| local_ranks.get(r).copied().unwrap_or(r);
    match error {
        Error::PeerLost { rank, op } => Error::PeerLost { rank: global(rank), op },
        Error::RankOutOfRange { rank, size } => Error::RankOutOfRange { rank: global(rank), size },
        other => other,
    }
}

fn rename_event(local_ranks: &[usize], event: TransportEvent) -> TransportEvent {
    let global = |r: usize| local_ranks.get(r).copied().unwrap_or(r);
    match event {
        TransportEvent::Frame { from, bytes } => TransportEvent::Frame { from: global(from), bytes },
        TransportEvent::PeerUp(r) => TransportEvent::PeerUp(global(r)),
        TransportEvent::PeerLost(r) => TransportEvent::PeerLost(global(r)),
    }
}

/// The endpoint's sink as one half sees it: renames the local half's ranks, and reports the
/// whole transport closed only when both halves have closed.
struct HalfSink {
    sink: Weak<dyn EventSink>,
    /// `Some` for the local half.
    local_ranks: Option<Arc<[usize]>>,
    closed: Arc<AtomicUsize>,
}

impl HalfSink {
    fn rank(&self, r: usize) -> usize {
        self.local_ranks.as_ref().and_then(|l| l.get(r).copied()).unwrap_or(r)
    }
}

impl EventSink for HalfSink {
    fn event(&self, event: TransportEvent) {
        if let Some(sink) = self.sink.upgrade() {
            let event = match &self.local_ranks {
                Some(l) => rename_event(l, event),
                None => event,
            };
            sink.event(event);
        }
    }

    fn lent_frame(&self, from: usize, header: [u8; HEADER_LEN], payload: LentBytes) {
        if let Some(sink) = self.sink.upgrade() {
            sink.lent_frame(self.rank(from), header, payload);
        }
    }

    fn chunked_frame(&self, from: usize, header: [u8; HEADER_LEN], payload: ChunkedBytes) {
        if let Some(sink) = self.sink.upgrade() {
            sink.chunked_frame(self.rank(from), header, payload);
        }
    }

    fn sealed_frame(&self, from: usize, header: [u8; HEADER_LEN], payload: Box<dyn SealedPayload>) {
        if let Some(sink) = self.sink.upgrade() {
            sink.sealed_frame(self.rank(from), header, payload);
        }
    }

    fn closed(&self) {
        if self.closed.fetch_add(1, Ordering::AcqRel) + 1 == 2 {
            if let Some(sink) = self.sink.upgrade() {
                sink.closed();
            }
        }
    }
}

impl Transport for RoutedTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn send(&self, peer: usize, frame: PooledBuf) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            match self.route(peer)? {
                Route::Local(i) => self.local.send(i, frame).await.map_err(|e| self.globalize(e)),
                Route::Network => self.network.send(peer, frame).await,
            }
        })
    }

    fn send_parts<'a>(&'a self, peer: usize, header: &'a [u8; HEADER_LEN], payload: &'a [u8], pool: &'a BufferPool) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            match self.route(peer)? {
                Route::Local(i) => self.local.send_parts(i, header, payload, pool).await.map_err(|e| self.globalize(e)),
                Route::Network => self.network.send_parts(peer, header, payload, pool).await,
            }
        })
    }

    fn send_chunked<'a>(&'a self, peer: usize, header: &'a [u8; HEADER_LEN], payload: ChunkedBytes, pool: &'a BufferPool) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            match self.route(peer)? {
                Route::Local(i) => self.local.send_chunked(i, header, payload, pool).await.map_err(|e| self.globalize(e)),
                Route::Network => self.network.send_chunked(peer, header, payload, pool).await,
            }
        })
    }

    fn recv(&self) -> BoxFuture<'_, Option<TransportEvent>> {
        Box::pin(async move {
            // One caller at a time (the dispatcher); the lock also keeps the closed bits.
            let mut closed = self.pull_closed.lock().await;
            loop {
                let event = match *closed {
                    0 => tokio::select! {
                        e = self.local.recv() => e.map(|e| rename_event(&self.local_ranks, e)).ok_or(1),
                        e = self.network.recv() => e.ok_or(2),
                    },
                    1 => self.network.recv().await.ok_or(2),
                    2 => self.local.recv().await.map(|e| rename_event(&self.local_ranks, e)).ok_or(1),
                    _ => return None,
                };
                match event {
                    Ok(event) => return Some(event),
                    Err(bit) => *closed |= bit,
                }
            }
        })
    }

    fn checks_integrity(&self) -> bool {
        self.local.checks_integrity() && self.network.checks_integrity()
    }

    fn poll_incoming(&self, awaited: AwaitedFrame) -> Option<usize> {
        match (self.local.poll_incoming(awaited), self.network.poll_incoming(awaited)) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
        }
    }

    fn poll_ended(&self, awaited: AwaitedFrame) {
        self.local.poll_ended(awaited);
        self.network.poll_ended(awaited);
    }

    fn preferred_chunk_bytes(&self) -> Option<usize> {
        let (local, network) = (self.local.preferred_chunk_bytes(), self.network.preferred_chunk_bytes());
        (local == network).then_some(local).flatten()
    }

    fn preferred_channels(&self) -> Option<usize> {
        // As for frames: a preference only where both halves share it.
        let (local, network) = (self.local.preferred_channels(), self.network.preferred_channels());
        (local == network).then_some(local).flatten()
    }

    fn preferred_direct_all_reduce_ranks(&self) -> Option<usize> {
        // As for frames: a preference only where both halves share it.
        let (local, network) = (self.local.preferred_direct_all_reduce_ranks(), self.network.preferred_direct_all_reduce_ranks());
        (local == network).then_some(local).flatten()
    }

    fn abort(&self) {
        self.local.abort();
        self.network.abort();
    }

    fn attach(&self, sink: Weak<dyn EventSink>) -> bool {
        let closed = Arc::new(AtomicUsize::new(0));
        let local: Arc<dyn EventSink> =
            Arc::new(HalfSink { sink: sink.clone(), local_ranks: Some(Arc::clone(&self.local_ranks)), closed: Arc::clone(&closed) });
        // The halves keep their sinks alive; the endpoint's sink stays weak behind them.
        let local_weak = Arc::downgrade(&local);
        if !self.local.attach(local_weak) {
            return false;
        }
        let network: Arc<dyn EventSink> = Arc::new(HalfSink { sink, local_ranks: None, closed });
        if !self.network.attach(Arc::downgrade(&network)) {
            // Pump the pull-only half into the sink.
            let (transport, pump) = (Arc::clone(&self.network), Arc::clone(&network));
            tokio::spawn(async move {
                while let Some(event) = transport.recv().await {
                    pump.event(event);
                }
                pump.closed();
            });
        }
        // The halves hold their sinks weakly; the transport keeps them alive as long as it lives.
        self.sinks.lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend([local, network]);
        true
    }
}

impl std::fmt::Debug for RoutedTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoutedTransport").field("rank", &self.rank).field("world", &self.world).field("local_ranks", &self.local_ranks).finish()
    }
}
