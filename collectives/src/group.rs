//! Per-group state on one rank: generation, sequence counters and the mailbox that matches incoming
//! frames to waiting operations.
//!
//! Protocol. The endpoint's dispatcher task calls [`GroupState::deliver`] for every valid frame of
//! this group; operations claim one specific slot with [`GroupState::register`] (possibly ahead of
//! time: a posted receive) and wait for it, keyed by
//! `(generation, lane, source rank, sequence, chunk)`. Whichever comes first parks: a frame in
//! `stored`, or a waiter in `waiters`. Everything lives under one mutex, never held across `.await`.
//!
//! Legal transitions: the generation only grows. Advancing it fails every waiter of an older
//! generation with [`Error::StaleGeneration`], drops (and counts) stored frames of older generations,
//! resets the sequence counters and clears the lost-peer mark. Frames of a newer generation than the
//! local one are kept (a peer may have been bumped first); frames of an older one are dropped and
//! counted, never applied.
//!
//! Lost peers. Frames a peer delivered before it was reported lost are still good: transports
//! deliver a peer's frames before its [`crate::TransportEvent::PeerLost`], so a frame that is not
//! here when the loss is known will never come. Hence a loss fails exactly the receives that need a
//! frame from the lost rank that has not arrived: its waiters at once, and later claims of a slot
//! it did not fill. A peer that finished its part of the last collective and then went away
//! (shut down, dropped its transport) does not fail ranks that are still reading what it sent.
//! Receives from live peers keep waiting; they end when that peer's operation fails too and tells
//! the group with an abort frame ([`OpKind::Abort`], chunk field = the lost rank; see
//! `OpCtx::relay_loss`), which fails every receive of that operation, or by the timeout. A rank
//! aborted that way also tells the member the abort named, if that member is alive and linked to
//! it (a link that broke between two live ranks; `OpCtx::tell_the_lost`), naming the abort's
//! sender: the relaying rank cannot reach it, and it may be waiting on others. A new
//! collective on a group with a lost member fails at once, unless the lost member already sent this
//! rank frames of it (it ran it before leaving). All of this holds until the generation advances.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::oneshot;

use crate::error::{Error, Result};
use crate::frame::{Frame, OpKind};
use crate::pool::BufferPool;

/// Polls of the transport an operation makes for a frame before it sleeps: about 50 µs, longer than
/// a small-message exchange between two processes (a wake-up of a sleeping thread costs 10-50 µs
/// on our VMs). Measured with `rtx bench collectives` on 2 pinned cores: 500, 2000 and 8000 rounds
/// and yielding every 16, 64, 256 or never; 2000 and 256 gave the best 4 KiB latency and 1-16 MiB
/// bandwidth with two ranks, and within noise of the best with four.
const POLL_ROUNDS: u32 = 2000;
/// Every this many empty polls, the spinning thread yields its CPU to any other runnable thread
/// (with four ranks on two cores, the peer it waits for may need this one). Yielding more often
/// cost bandwidth: each yield is a system call.
const POLL_YIELD_EVERY: u32 = 256;

/// Frames of point-to-point traffic and of collectives are numbered separately.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Lane {
    Collective,
    PointToPoint,
}

/// Mailbox slot: generation, lane, global source rank, sequence, chunk.
pub(crate) type Key = (u64, Lane, usize, u64, u32);

/// A claimed mailbox slot: the frame, or where it will arrive.
#[derive(Debug)]
pub(crate) enum Slot {
    Ready(Frame),
    Waiting(oneshot::Receiver<Result<Frame>>),
}

/// What a frame was dropped for, for counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Delivery {
    Accepted,
    Stale,
    Overflow,
    ForeignSource,
}

#[derive(Debug)]
pub(crate) struct GroupState {
    pub(crate) id: u64,
    /// Global ranks, indexed by group rank.
    pub(crate) members: Vec<usize>,
    /// Group rank of the local rank.
    pub(crate) my_index: usize,
    max_stored: usize,
    inner: Mutex<GroupInner>,
    stale_dropped: AtomicU64,
    overflow_dropped: AtomicU64,
}

#[derive(Debug)]
struct GroupInner {
    generation: u64,
    next_seq: u64,
    split_count: u64,
    p2p_sent: BTreeMap<usize, u64>,
    p2p_received: BTreeMap<usize, u64>,
    /// Lost members (global ranks), in the order they were reported.
    lost: Vec<usize>,
    /// Collectives a peer reported failed: (generation, seq) -> the lost rank it named.
    aborted: BTreeMap<(u64, u64), Aborted>,
    closed: bool,
    stored: BTreeMap<Key, Frame>,
    waiters: BTreeMap<Key, (OpKind, oneshot::Sender<Result<Frame>>)>,
}

/// A peer's abort of a collective: the member it named lost, and the peer that sent it.
#[derive(Clone, Copy, Debug)]
struct Aborted {
    lost: usize,
    from: usize,
}

impl GroupState {
    pub(crate) fn new(id: u64, members: Vec<usize>, my_index: usize, generation: u64, max_stored: usize) -> Self {
        assert!(my_index < members.len(), "group: local index inside the member list");
        GroupState {
            id,
            members,
            my_index,
            max_stored,
            inner: Mutex::new(GroupInner {
                generation,
                next_seq: 0,
                split_count: 0,
                p2p_sent: BTreeMap::new(),
                p2p_received: BTreeMap::new(),
                lost: Vec::new(),
                aborted: BTreeMap::new(),
                closed: false,
                stored: BTreeMap::new(),
                waiters: BTreeMap::new(),
            }),
            stale_dropped: AtomicU64::new(0),
            overflow_dropped: AtomicU64::new(0),
        }
    }

    pub(crate) fn generation(&self) -> u64 {
        self.lock().generation
    }

    pub(crate) fn stale_dropped(&self) -> u64 {
        self.stale_dropped.load(Ordering::Relaxed)
    }

    pub(crate) fn overflow_dropped(&self) -> u64 {
        self.overflow_dropped.load(Ordering::Relaxed)
    }

    pub(crate) fn add_stale(&self, n: u64) {
        self.stale_dropped.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn contains(&self, global_rank: usize) -> bool {
        self.members.contains(&global_rank)
    }

    /// Starts a collective: takes the next sequence number. Fails if the transport is closed.
    ///
    /// The sequence number is taken even when the operation then cannot run (see
    /// [`lost_before`](Self::lost_before)), so the failing rank can name it to its peers.
    pub(crate) fn begin_collective(&self) -> Result<(u64, u64)> {
        self.begin_collectives(1)
    }

    /// [`begin_collective`](Self::begin_collective) for an operation split into `count` channels:
    /// takes `count` consecutive sequence numbers at once and returns the first.
    pub(crate) fn begin_collectives(&self, count: u64) -> Result<(u64, u64)> {
        debug_assert!(count >= 1, "an operation takes at least one sequence number");
        let mut inner = self.lock();
        if inner.closed {
            return Err(Error::TransportClosed);
        }
        let seq = inner.next_seq;
        inner.next_seq += count;
        Ok((inner.generation, seq))
    }

    /// The lost member that dooms collective `(generation, seq)` before it starts: one that is
    /// lost and sent this rank no frame of it; or the rank a peer's abort of it named.
    pub(crate) fn lost_before(&self, generation: u64, seq: u64) -> Option<usize> {
        let inner = self.lock();
        if let Some(aborted) = inner.aborted.get(&(generation, seq)) {
            return Some(aborted.lost);
        }
        inner.lost.iter().copied().find(|&rank| !inner.has_frames_from(generation, Lane::Collective, rank, seq))
    }

    /// Whether a peer aborted collective `(generation, seq)` (its failure was already relayed).
    pub(crate) fn is_aborted(&self, generation: u64, seq: u64) -> bool {
        self.lock().aborted.contains_key(&(generation, seq))
    }

    /// The first abort of collective `(generation, seq)` this rank received: the member it named
    /// lost, and the peer that sent it.
    pub(crate) fn abort_of(&self, generation: u64, seq: u64) -> Option<(usize, usize)> {
        self.lock().aborted.get(&(generation, seq)).map(|a| (a.lost, a.from))
    }

    /// Starts a point-to-point transfer with `peer` (global rank): takes the pair's next sequence.
    /// Fails if `peer` is lost, unless this is a receive of frames it sent before it went away.
    pub(crate) fn begin_p2p(&self, peer: usize, sending: bool) -> Result<(u64, u64)> {
        let mut inner = self.lock();
        if inner.closed {
            return Err(Error::TransportClosed);
        }
        let generation = inner.generation;
        let counters = if sending { &mut inner.p2p_sent } else { &mut inner.p2p_received };
        let seq = counters.get(&peer).copied().unwrap_or(0);
        if inner.lost.contains(&peer) && (sending || !inner.has_frames_from(generation, Lane::PointToPoint, peer, seq)) {
            return Err(Error::PeerLost { rank: peer, op: OpKind::Send });
        }
        let counters = if sending { &mut inner.p2p_sent } else { &mut inner.p2p_received };
        counters.insert(peer, seq + 1);
        Ok((generation, seq))
    }

    /// Counts a `split` (all ranks count them in the same order, so the count names the child).
    pub(crate) fn next_split(&self) -> u64 {
        let mut inner = self.lock();
        let n = inner.split_count;
        inner.split_count += 1;
        n
    }

    /// Hands a valid frame of this group to its waiter or parks it.
    ///
    /// A frame lent by the transport goes to its waiter as is; with no waiter yet it is copied
    /// into a buffer from `pool` before it is parked, so lent memory is only ever held by running
    /// operations.
    pub(crate) fn deliver(&self, frame: Frame, pool: &BufferPool) -> Delivery {
        let h = frame.header;
        let src = h.src as usize;
        if !self.contains(src) {
            return Delivery::ForeignSource;
        }
        let lane = if h.op == OpKind::Send { Lane::PointToPoint } else { Lane::Collective };
        let key: Key = (h.generation, lane, src, h.seq, h.chunk);
        let mut inner = self.lock();
        if h.generation < inner.generation {
            drop(inner);
            self.add_stale(1);
            return Delivery::Stale;
        }
        if h.op == OpKind::Abort {
            let lost = h.chunk as usize;
            if !self.contains(lost) || frame.payload_len() != 0 {
                return Delivery::ForeignSource;
            }
            if inner.aborted.len() >= self.max_stored && !inner.aborted.contains_key(&(h.generation, h.seq)) {
                drop(inner);
                self.overflow_dropped.fetch_add(1, Ordering::Relaxed);
                return Delivery::Overflow;
            }
            inner.aborted.entry((h.generation, h.seq)).or_insert(Aborted { lost, from: h.src as usize });
            let doomed: Vec<Key> = inner.waiters.keys().filter(|k| k.0 == h.generation && k.1 == Lane::Collective && k.3 == h.seq).copied().collect();
            for key in doomed {
                if let Some((op, waiter)) = inner.waiters.remove(&key) {
                    let _ = waiter.send(Err(Error::PeerLost { rank: lost, op }));
                }
            }
            return Delivery::Accepted;
        }
        if let Some((_, waiter)) = inner.waiters.remove(&key) {
            // A waiter whose operation was dropped no longer wants the frame.
            let _ = waiter.send(Ok(frame));
            return Delivery::Accepted;
        }
        if inner.stored.len() >= self.max_stored {
            drop(inner);
            self.overflow_dropped.fetch_add(1, Ordering::Relaxed);
            return Delivery::Overflow;
        }
        inner.stored.insert(key, frame.into_owned(pool));
        Delivery::Accepted
    }

    /// Claims slot `key` for an operation: the frame if it is already parked, or a receiver it
    /// will be handed to (a posted receive). Fails on a generation bump or a lost peer.
    pub(crate) fn register(&self, key: Key, op: OpKind) -> Result<Slot> {
        let mut inner = self.lock();
        if key.0 != inner.generation {
            return Err(Error::StaleGeneration { expected: inner.generation, got: key.0 });
        }
        // Frames that arrived are taken even if their sender is gone by now.
        if let Some(frame) = inner.stored.remove(&key) {
            return Ok(Slot::Ready(frame));
        }
        if inner.closed {
            return Err(Error::TransportClosed);
        }
        if key.1 == Lane::Collective {
            if let Some(aborted) = inner.aborted.get(&(key.0, key.3)) {
                return Err(Error::PeerLost { rank: aborted.lost, op });
            }
        }
        if inner.lost.contains(&key.2) {
            return Err(Error::PeerLost { rank: key.2, op });
        }
        let (tx, rx) = oneshot::channel();
        inner.waiters.insert(key, (op, tx));
        Ok(Slot::Waiting(rx))
    }

    /// Withdraws a receive posted with [`register`](Self::register) that will not be waited for.
    pub(crate) fn cancel(&self, key: &Key) {
        self.lock().waiters.remove(key);
    }

    /// Waits for the frame of a slot claimed with [`register`](Self::register), failing on a
    /// generation bump, a lost peer or `timeout`.
    ///
    /// Before sleeping it spins for a short while calling `poll` (the transport's
    /// [`crate::Transport::poll_incoming`]), which may deliver the frame from this thread; `poll`
    /// returning `None` ends the spin at once. The spin is bounded by a count of polls, not a clock,
    /// so it behaves the same under a paused test clock.
    /// `poll_ended` runs once if the spin ends without the frame, before the task sleeps (the
    /// transport's [`crate::Transport::poll_ended`]).
    pub(crate) async fn wait_slot(
        &self,
        key: Key,
        slot: Slot,
        op: OpKind,
        timeout: Duration,
        mut poll: impl FnMut() -> Option<usize>,
        poll_ended: impl FnOnce(),
    ) -> Result<Frame> {
        let mut rx = match slot {
            Slot::Ready(frame) => return Ok(frame),
            Slot::Waiting(rx) => rx,
        };
        for round in 0..POLL_ROUNDS {
            match rx.try_recv() {
                Ok(result) => return result,
                Err(oneshot::error::TryRecvError::Closed) => return Err(Error::TransportClosed),
                Err(oneshot::error::TryRecvError::Empty) => {}
            }
            let delivered = match poll() {
                None => break,
                Some(n) => n,
            };
            if delivered == 0 {
                if round % POLL_YIELD_EVERY == POLL_YIELD_EVERY - 1 {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
        poll_ended();
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(result)) => result,
            // The sender half lives in `waiters`; it is only dropped with the group itself.
            Ok(Err(_)) => Err(Error::TransportClosed),
            Err(_elapsed) => {
                self.lock().waiters.remove(&key);
                Err(Error::Timeout { op, waiting_for: key.2, timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX) })
            }
        }
    }

    /// Moves to `generation`; see the module doc for what that aborts and drops.
    ///
    /// `lost` are members already known to be gone, which keeps the group failing fast.
    pub(crate) fn advance_generation(&self, generation: u64, lost: Vec<usize>) -> Result<()> {
        let mut inner = self.lock();
        if generation <= inner.generation {
            return Err(Error::GenerationNotIncreasing { current: inner.generation, requested: generation });
        }
        let keep = inner.stored.split_off(&(generation, Lane::Collective, 0, 0, 0));
        let dropped = std::mem::replace(&mut inner.stored, keep).len() as u64;
        let waiters = std::mem::take(&mut inner.waiters);
        for ((got, ..), (_, waiter)) in waiters {
            let _ = waiter.send(Err(Error::StaleGeneration { expected: generation, got }));
        }
        inner.generation = generation;
        inner.next_seq = 0;
        inner.p2p_sent.clear();
        inner.p2p_received.clear();
        inner.lost = lost;
        let aborted_kept = inner.aborted.split_off(&(generation, 0));
        inner.aborted = aborted_kept;
        drop(inner);
        self.add_stale(dropped);
        Ok(())
    }

    /// Takes the parked frames (for a group that replaces this one).
    pub(crate) fn take_stored(&self) -> Vec<Frame> {
        std::mem::take(&mut self.lock().stored).into_values().collect()
    }

    /// Marks `rank` (global) lost and fails every waiter for a frame from it: the transport
    /// delivered all its frames before reporting the loss, so those frames will never come.
    /// Waiters for frames from other members keep waiting (see the module doc).
    pub(crate) fn peer_lost(&self, rank: usize) {
        let mut inner = self.lock();
        if !inner.lost.contains(&rank) {
            inner.lost.push(rank);
        }
        let doomed: Vec<Key> = inner.waiters.keys().filter(|k| k.2 == rank).copied().collect();
        for key in doomed {
            if let Some((op, waiter)) = inner.waiters.remove(&key) {
                let _ = waiter.send(Err(Error::PeerLost { rank, op }));
            }
        }
    }

    /// The transport is gone: fails every waiter and every later operation.
    pub(crate) fn close(&self) {
        let mut inner = self.lock();
        inner.closed = true;
        for (_, (_, waiter)) in std::mem::take(&mut inner.waiters) {
            let _ = waiter.send(Err(Error::TransportClosed));
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GroupInner> {
        // Critical sections only move entries between maps; a panic cannot leave them half-done.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl GroupInner {
    /// Whether frames of operation `seq` on `lane` from global rank `src` are parked here.
    fn has_frames_from(&self, generation: u64, lane: Lane, src: usize, seq: u64) -> bool {
        self.stored.range((generation, lane, src, seq, 0)..=(generation, lane, src, seq, u32::MAX)).next().is_some()
    }
}
