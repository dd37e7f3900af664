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
//! counted, never applied. A lost peer fails every waiter and every later operation of the current
//! generation with [`Error::PeerLost`] until the generation advances.

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
    lost: Option<usize>,
    closed: bool,
    stored: BTreeMap<Key, Frame>,
    waiters: BTreeMap<Key, (OpKind, oneshot::Sender<Result<Frame>>)>,
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
                lost: None,
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

    /// Starts a collective: checks the group is usable and takes the next sequence number.
    pub(crate) fn begin_collective(&self, op: OpKind) -> Result<(u64, u64)> {
        let mut inner = self.lock();
        inner.check_usable(op)?;
        let seq = inner.next_seq;
        inner.next_seq += 1;
        Ok((inner.generation, seq))
    }

    /// Starts a point-to-point transfer with `peer` (global rank): takes the pair's next sequence.
    pub(crate) fn begin_p2p(&self, peer: usize, sending: bool) -> Result<(u64, u64)> {
        let mut inner = self.lock();
        inner.check_usable(OpKind::Send)?;
        let counters = if sending { &mut inner.p2p_sent } else { &mut inner.p2p_received };
        let counter = counters.entry(peer).or_insert(0);
        let seq = *counter;
        *counter += 1;
        Ok((inner.generation, seq))
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
        inner.check_usable(op)?;
        if let Some(frame) = inner.stored.remove(&key) {
            return Ok(Slot::Ready(frame));
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
    pub(crate) async fn wait_slot(&self, key: Key, slot: Slot, op: OpKind, timeout: Duration, mut poll: impl FnMut() -> Option<usize>) -> Result<Frame> {
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
    /// `lost` is a member already known to be gone, which keeps the group failing fast.
    pub(crate) fn advance_generation(&self, generation: u64, lost: Option<usize>) -> Result<()> {
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
        drop(inner);
        self.add_stale(dropped);
        Ok(())
    }

    /// Takes the parked frames (for a group that replaces this one).
    pub(crate) fn take_stored(&self) -> Vec<Frame> {
        std::mem::take(&mut self.lock().stored).into_values().collect()
    }

    /// Marks `rank` (global) lost and fails every waiter.
    pub(crate) fn peer_lost(&self, rank: usize) {
        let mut inner = self.lock();
        if inner.lost.is_none() {
            inner.lost = Some(rank);
        }
        let lost = inner.lost.unwrap_or(rank);
        for (_, (op, waiter)) in std::mem::take(&mut inner.waiters) {
            let _ = waiter.send(Err(Error::PeerLost { rank: lost, op }));
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
    fn check_usable(&self, op: OpKind) -> Result<()> {
        if self.closed {
            return Err(Error::TransportClosed);
        }
        if let Some(rank) = self.lost {
            return Err(Error::PeerLost { rank, op });
        }
        Ok(())
    }
}
