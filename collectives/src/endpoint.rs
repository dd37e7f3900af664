//! The endpoint: one per rank and transport. It validates incoming frames and routes them to the
//! group they name, and keeps the registry of groups. Frames reach it either from its dispatcher
//! task, which pulls them from [`Transport::recv`], or pushed by the transport itself through
//! [`EventSink`] when the transport accepts [`Transport::attach`] (then there is no dispatcher task).
//!
//! Ownership: [`Endpoint`] handles (and every [`Communicator`] made from them) share one
//! `EndpointShared`; the dispatcher task holds it too and is aborted when the last handle goes, which
//! drops the transport. A pushing transport holds only a weak reference to it. Lock order is registry, then a group's mailbox; the registry lock is released
//! before a frame is handed to its group.
//!
//! Frames for a group this rank has not formed yet (a peer finished `split` first) wait as orphans,
//! at most [`CommConfig::max_stored_frames`] of them, and move into the group when it is formed.
//! Malformed frames, and frames whose claimed source differs from the transport's authenticated
//! sender, are dropped and counted ([`Endpoint::malformed_frames`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tracing::Instrument;

use crate::channel::{DEFAULT_CHANNELS, MAX_CHANNELS};
use crate::communicator::{CommConfig, Communicator, DEFAULT_CHUNK_BYTES, DEFAULT_RING_WINDOW, MAX_RING_WINDOW};
use crate::error::{Error, Result};
use crate::frame::Frame;
use crate::group::{Delivery, GroupState};
use crate::pool::{BufferPool, PooledBuf};
use crate::sync::lock;
use crate::transport::{EventSink, Transport, TransportEvent};

/// Id of the group of all ranks made by [`Endpoint::world`].
pub const WORLD_GROUP_ID: u64 = 0;

/// One rank's attachment to a transport; cheap to clone.
#[derive(Clone, Debug)]
pub struct Endpoint {
    handle: Arc<EndpointHandle>,
}

#[derive(Debug)]
struct EndpointHandle {
    shared: Arc<EndpointShared>,
    /// `None` when the transport pushes its events.
    dispatcher: Option<tokio::task::AbortHandle>,
}

pub(crate) struct EndpointShared {
    pub(crate) transport: Arc<dyn Transport>,
    pub(crate) config: CommConfig,
    pub(crate) pool: BufferPool,
    registry: Mutex<Registry>,
    malformed: AtomicU64,
}

#[derive(Default)]
struct Registry {
    groups: BTreeMap<u64, Weak<GroupState>>,
    orphans: BTreeMap<u64, Vec<Frame>>,
    n_orphans: usize,
    lost: BTreeSet<usize>,
    closed: bool,
}

impl std::fmt::Debug for EndpointShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EndpointShared")
            .field("rank", &self.transport.rank())
            .field("world_size", &self.transport.world_size())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Endpoint {
    /// Attaches to `transport` and starts the dispatcher task on the current tokio runtime.
    pub fn new(transport: Arc<dyn Transport>, mut config: CommConfig) -> Result<Endpoint> {
        config.validate_for(transport.world_size())?;
        if config.chunk_bytes.is_none() {
            config.chunk_bytes = Some(transport.preferred_chunk_bytes().unwrap_or(DEFAULT_CHUNK_BYTES).max(8).min(config.max_payload_bytes));
        }
        if config.ring_window.is_none() {
            config.ring_window = Some(transport.preferred_ring_window().unwrap_or(DEFAULT_RING_WINDOW).clamp(1, MAX_RING_WINDOW));
        }
        if config.direct_all_reduce_ranks.is_none() {
            config.direct_all_reduce_ranks = Some(transport.preferred_direct_all_reduce_ranks().unwrap_or(0));
        }
        if config.channels.is_none() {
            config.channels = Some(transport.preferred_channels().unwrap_or(DEFAULT_CHANNELS).clamp(1, MAX_CHANNELS));
        }
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| Error::InvalidConfig { reason: "endpoint must be created inside a tokio runtime" })?;
        let rank = transport.rank();
        let shared =
            Arc::new(EndpointShared { transport, config, pool: BufferPool::new(), registry: Mutex::new(Registry::default()), malformed: AtomicU64::new(0) });
        let sink: Arc<dyn EventSink> = Arc::clone(&shared) as Arc<dyn EventSink>;
        let dispatcher = if shared.transport.attach(Arc::downgrade(&sink)) {
            None
        } else {
            let span = tracing::debug_span!("dispatcher", rank);
            Some(runtime.spawn(dispatch(Arc::clone(&shared)).instrument(span)).abort_handle())
        };
        Ok(Endpoint { handle: Arc::new(EndpointHandle { shared, dispatcher }) })
    }

    /// The group of all ranks, id [`WORLD_GROUP_ID`], generation 0, group rank = global rank.
    pub fn world(&self) -> Result<Communicator> {
        let n = self.shared().transport.world_size();
        self.group(WORLD_GROUP_ID, (0..n).collect(), 0)
    }

    /// Forms (or re-forms) group `id` with `members` (global ranks, in group-rank order) at
    /// `generation`. Every member must call it with the same arguments. Re-forming a live group
    /// needs a higher generation and aborts the old one's operations with
    /// [`Error::StaleGeneration`].
    pub fn group(&self, id: u64, members: Vec<usize>, generation: u64) -> Result<Communicator> {
        let state = self.shared().register(id, members, generation)?;
        Ok(Communicator::new(self.clone(), state))
    }

    /// Local global rank.
    pub fn rank(&self) -> usize {
        self.shared().transport.rank()
    }

    /// Number of global ranks.
    pub fn world_size(&self) -> usize {
        self.shared().transport.world_size()
    }

    /// Frames dropped because they failed validation or lied about their source.
    pub fn malformed_frames(&self) -> u64 {
        self.shared().malformed.load(Ordering::Relaxed)
    }

    /// The pool frame buffers come from.
    pub fn pool(&self) -> &BufferPool {
        &self.shared().pool
    }

    pub(crate) fn shared(&self) -> &EndpointShared {
        &self.handle.shared
    }
}

impl Drop for EndpointHandle {
    fn drop(&mut self) {
        if let Some(dispatcher) = &self.dispatcher {
            dispatcher.abort();
        }
    }
}

impl EndpointShared {
    fn register(&self, id: u64, members: Vec<usize>, generation: u64) -> Result<Arc<GroupState>> {
        let world = self.transport.world_size();
        let me = self.transport.rank();
        if members.is_empty() {
            return Err(Error::InvalidGroup { group: id, reason: "no members" });
        }
        if let Some(&rank) = members.iter().find(|&&m| m >= world) {
            return Err(Error::RankOutOfRange { rank, size: world });
        }
        if members.iter().collect::<BTreeSet<_>>().len() != members.len() {
            return Err(Error::InvalidGroup { group: id, reason: "duplicate member" });
        }
        let Some(my_index) = members.iter().position(|&m| m == me) else {
            return Err(Error::InvalidGroup { group: id, reason: "local rank is not a member" });
        };
        let mut registry = lock(&self.registry);
        if registry.closed {
            return Err(Error::TransportClosed);
        }
        let state = Arc::new(GroupState::new(id, members, my_index, generation, self.config.max_stored_frames));
        let mut inherited = Vec::new();
        if let Some(old) = registry.groups.get(&id).and_then(Weak::upgrade) {
            old.advance_generation(generation, Vec::new())?;
            inherited = old.take_stored();
        }
        if let Some(orphans) = registry.orphans.remove(&id) {
            registry.n_orphans -= orphans.len();
            inherited.extend(orphans);
        }
        for frame in inherited {
            if state.deliver(frame, &self.pool) == Delivery::ForeignSource {
                self.malformed.fetch_add(1, Ordering::Relaxed);
            }
        }
        for &lost in registry.lost.iter().filter(|&&r| state.contains(r)) {
            state.peer_lost(lost);
        }
        registry.groups.insert(id, Arc::downgrade(&state));
        Ok(state)
    }

    /// Moves `group` to `generation`, keeping it failing fast if members are still known lost.
    pub(crate) fn advance(&self, group: &GroupState, generation: u64) -> Result<()> {
        let lost = lock(&self.registry).lost.iter().copied().filter(|&r| group.contains(r)).collect();
        group.advance_generation(generation, lost)
    }

    /// Global ranks known lost now, in rank order.
    pub(crate) fn lost_ranks(&self) -> Vec<usize> {
        lock(&self.registry).lost.iter().copied().collect()
    }

    fn on_frame(&self, from: usize, bytes: PooledBuf) {
        self.route_frame(from, Frame::decode(bytes, self.config.max_payload_bytes));
    }

    fn route_frame(&self, from: usize, frame: Result<Frame>) {
        let frame = match frame {
            Ok(frame) => frame,
            Err(error) => {
                self.malformed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(from, %error, "dropped malformed frame");
                return;
            }
        };
        if frame.header.src as usize != from {
            self.malformed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(from, claimed = frame.header.src, "dropped frame with a forged source");
            return;
        }
        let id = frame.header.group;
        let group = {
            let mut registry = lock(&self.registry);
            match registry.groups.get(&id).and_then(Weak::upgrade) {
                Some(group) => group,
                None => {
                    if registry.n_orphans < self.config.max_stored_frames {
                        registry.n_orphans += 1;
                        registry.orphans.entry(id).or_default().push(frame.into_owned(&self.pool));
                    } else {
                        tracing::warn!(group = id, "dropped frame for an unknown group: orphan queue full");
                    }
                    return;
                }
            }
        };
        match group.deliver(frame, &self.pool) {
            Delivery::Accepted | Delivery::Stale => {}
            Delivery::Overflow => tracing::warn!(group = id, "dropped frame: mailbox full"),
            Delivery::ForeignSource => {
                self.malformed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(group = id, from, "dropped frame from a rank outside the group");
            }
        }
    }

    fn live_groups(&self, registry: &Registry) -> Vec<Arc<GroupState>> {
        registry.groups.values().filter_map(Weak::upgrade).collect()
    }

    fn on_peer_lost(&self, rank: usize) {
        tracing::info!(peer = rank, "peer lost");
        let groups = {
            let mut registry = lock(&self.registry);
            registry.lost.insert(rank);
            self.live_groups(&registry)
        };
        for group in groups.iter().filter(|g| g.contains(rank)) {
            group.peer_lost(rank);
        }
    }

    fn on_peer_up(&self, rank: usize) {
        tracing::info!(peer = rank, "peer up");
        lock(&self.registry).lost.remove(&rank);
    }

    fn on_closed(&self) {
        let groups = {
            let mut registry = lock(&self.registry);
            registry.closed = true;
            self.live_groups(&registry)
        };
        for group in groups {
            group.close();
        }
    }
}

impl EventSink for EndpointShared {
    fn event(&self, event: TransportEvent) {
        match event {
            TransportEvent::Frame { from, bytes } => self.on_frame(from, bytes),
            TransportEvent::PeerLost(rank) => self.on_peer_lost(rank),
            TransportEvent::PeerUp(rank) => self.on_peer_up(rank),
        }
    }

    fn lent_frame(&self, from: usize, header: [u8; crate::frame::HEADER_LEN], payload: crate::transport::LentBytes) {
        self.route_frame(from, Frame::decode_lent(&header, payload, self.config.max_payload_bytes));
    }

    fn chunked_frame(&self, from: usize, header: [u8; crate::frame::HEADER_LEN], payload: crate::transport::ChunkedBytes) {
        self.route_frame(from, Frame::decode_chunked(&header, payload, self.config.max_payload_bytes));
    }

    fn sealed_frame(&self, from: usize, header: [u8; crate::frame::HEADER_LEN], payload: Box<dyn crate::transport::SealedPayload>) {
        self.route_frame(from, Frame::decode_sealed(&header, payload, self.config.max_payload_bytes));
    }

    fn closed(&self) {
        self.on_closed();
    }
}

async fn dispatch(shared: Arc<EndpointShared>) {
    while let Some(event) = shared.transport.recv().await {
        shared.event(event);
    }
    shared.on_closed();
}
