//! The simulated network and its transports. All randomness comes from one ChaCha8 generator
//! seeded by [`SimConfig::seed`], drawn in the order frames are sent (which, on the single-thread
//! runtime of [`run`], is itself deterministic); all time is tokio's virtual clock.
//!
//! Each directed link has one delivery task that hands frames over in send order at their
//! delivery instants: `max(link free, now) + size / bandwidth (twice when duplicated) + latency +
//! jitter (+ a retransmit timeout per lost packet, + a gap when reordered)`, never before the previous frame on that link. A cut link holds its
//! frames (a reliable transport retransmits across a short partition) until it heals, or until
//! the peers are reported lost after [`SimConfig::loss_detect`], when the held frames are dropped.
//!
//! Two wire models ([`WireModel`]): a **stream** transport (QUIC; the default) whose sends never
//! wait (inboxes are unbounded: memory, not time, is the only thing back-pressure would change),
//! where whatever a crashed rank had in flight vanishes with it; and **shared-memory rings as
//! they were before the transport could be aborted**: every directed link is a ring of
//! `ring_bytes` bytes in flight (sent, not yet read). A rank that stops reading (crashed, stuck,
//! cut off) lets its incoming rings fill, and a send that does not fit then *waits* (a frame
//! larger than the ring streams through it only while the reader reads). Nobody is told of a
//! crash at once (no connection reset): peers notice after the liveness timeout
//! ([`SimConfig::loss_detect`]), and only then do waiting sends to it fail. A crashed writer's
//! frames already written stay readable, but the frame it was writing when it died is torn (its
//! first part is in the ring, the rest never comes), so it is never delivered, nor anything after it.
//!
//! Faults beyond the network's own: [`SimNetwork::stall`] (a rank whose compute is stuck in a
//! collective: its sends wait and nothing is read for it, while its control link, elsewhere,
//! lives on) and [`SimTransport::abort`] (the transport is aborted at once, without draining:
//! waiting and later sends fail, reading stops, peers see the link end).

use std::collections::{BTreeSet, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rtx_collectives::{BoxFuture, PooledBuf, Transport, TransportEvent};
use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;

use crate::trace::TraceHash;

/// Where a frame header holds the group generation (little-endian u64; see `rtx_collectives`'
/// frame layout).
const GENERATION_FIELD: std::ops::Range<usize> = 16..24;

/// The behaviour of one directed link.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkModel {
    /// One-way latency.
    pub latency: Duration,
    /// Extra latency drawn uniformly from `0..=jitter` per frame.
    pub jitter: Duration,
    /// Bytes per second; 0 means unlimited.
    pub bandwidth_bytes_per_s: f64,
    /// Probability that a frame needs a retransmission (drawn again after each one).
    pub loss: f64,
    /// Delay a retransmission adds.
    pub retransmit_after: Duration,
    /// Probability that a frame's packets are duplicated on the wire: the copies take link time
    /// (the receiving transport discards them, as QUIC does), so duplication shows as lost
    /// bandwidth, never as a second delivery.
    pub duplicate: f64,
    /// Probability that a frame's packets arrive out of order: the ordered stream waits for the
    /// gap, modelled as [`LinkModel::reorder_delay`] added to that frame (frames still leave the
    /// link in send order, as the `Transport` contract promises).
    pub reorder: f64,
    /// How long a reordering gap holds delivery.
    pub reorder_delay: Duration,
}

impl Default for LinkModel {
    fn default() -> Self {
        LinkModel {
            latency: Duration::from_micros(50),
            jitter: Duration::from_micros(20),
            bandwidth_bytes_per_s: 1e9,
            loss: 0.0,
            retransmit_after: Duration::from_millis(1),
            duplicate: 0.0,
            reorder: 0.0,
            reorder_delay: Duration::from_micros(200),
        }
    }
}

/// What a link does when its reader stops reading or a peer dies; see the module doc.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WireModel {
    /// A stream transport (QUIC): sends never wait; a crashed rank's frames in flight vanish.
    #[default]
    Stream,
    /// Shared-memory rings of `ring_bytes` bytes per directed link, without abort: sends wait
    /// for ring space, crashes are noticed only after the liveness timeout, frames being written
    /// by a dying rank are torn.
    Shm {
        /// Bytes in flight a directed link holds before a send waits.
        ring_bytes: usize,
    },
}

/// Settings of a simulated network.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// The master seed of every random draw.
    pub seed: u64,
    /// The model of every link unless [`SimNetwork::set_link`] changes one.
    pub link: LinkModel,
    /// How long a silent (partitioned or crashed) peer takes to be reported lost (for shared
    /// memory: the liveness timeout).
    pub loss_detect: Duration,
    /// Stream or shared-memory rings.
    pub wire: WireModel,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig { seed: 0, link: LinkModel::default(), loss_detect: Duration::from_millis(500), wire: WireModel::Stream }
    }
}

/// The shared fabric; clone it to inject faults.
#[derive(Clone)]
pub struct SimNetwork {
    shared: Arc<Shared>,
}

/// One rank's end of a [`SimNetwork`].
pub struct SimTransport {
    rank: usize,
    shared: Arc<Shared>,
    inbox: tokio::sync::Mutex<mpsc::UnboundedReceiver<TransportEvent>>,
}

struct Shared {
    n: usize,
    epoch: Instant,
    config: SimConfig,
    state: Mutex<State>,
    wake: Vec<Notify>,
    /// Notified whenever a waiting send may go on: ring space freed, a peer lost, a rank
    /// released or aborted.
    space: Notify,
}

struct State {
    rng: ChaCha8Rng,
    links: Vec<LinkModel>,
    busy_until: Vec<Instant>,
    last_delivery: Vec<Instant>,
    /// Per link: frames in send order, each with its delivery instant and the instant its
    /// writing ends.
    queues: Vec<VecDeque<(Instant, Instant, PooledBuf)>>,
    /// Per link: bytes sent and not yet delivered or dropped (a ring's fill).
    in_flight: Vec<usize>,
    cut: BTreeSet<(usize, usize)>,
    crashed: Vec<bool>,
    /// When each crashed rank died.
    crashed_at: Vec<Option<Instant>>,
    /// Ranks stuck in a collective ([`SimNetwork::stall`]).
    stuck: Vec<bool>,
    /// Ranks whose transport was aborted.
    aborted: Vec<bool>,
    lost: BTreeSet<(usize, usize)>,
    inboxes: Vec<Option<mpsc::UnboundedSender<TransportEvent>>>,
    trace: TraceHash,
    delivered: u64,
    /// The group generation every frame on this network must carry, when set.
    generation: Option<u64>,
    /// Frames delivered whose header named another generation.
    foreign_generation: u64,
}

impl SimNetwork {
    /// A network of `n` ranks (call inside the simulation runtime: it starts the link tasks).
    pub fn new(n: usize, config: SimConfig) -> (SimNetwork, Vec<SimTransport>) {
        let now = Instant::now();
        let mut inboxes = Vec::with_capacity(n);
        let mut receivers = Vec::with_capacity(n);
        for _ in 0..n {
            let (tx, rx) = mpsc::unbounded_channel();
            inboxes.push(Some(tx));
            receivers.push(rx);
        }
        let state = State {
            rng: ChaCha8Rng::seed_from_u64(config.seed),
            links: vec![config.link; n * n],
            busy_until: vec![now; n * n],
            last_delivery: vec![now; n * n],
            queues: (0..n * n).map(|_| VecDeque::new()).collect(),
            in_flight: vec![0; n * n],
            cut: BTreeSet::new(),
            crashed: vec![false; n],
            crashed_at: vec![None; n],
            stuck: vec![false; n],
            aborted: vec![false; n],
            lost: BTreeSet::new(),
            inboxes,
            trace: TraceHash::default(),
            delivered: 0,
            generation: None,
            foreign_generation: 0,
        };
        let shared = Arc::new(Shared { n, epoch: now, config, state: Mutex::new(state), wake: (0..n * n).map(|_| Notify::new()).collect(), space: Notify::new() });
        for link in 0..n * n {
            if link / n != link % n {
                tokio::spawn(deliver(Arc::clone(&shared), link));
            }
        }
        let transports = receivers.into_iter().enumerate().map(|(rank, rx)| SimTransport { rank, shared: Arc::clone(&shared), inbox: tokio::sync::Mutex::new(rx) }).collect();
        (SimNetwork { shared }, transports)
    }

    /// Changes the model of the directed link `from → to`.
    pub fn set_link(&self, from: usize, to: usize, model: LinkModel) {
        let n = self.shared.n;
        self.shared.lock().links[from * n + to] = model;
    }

    /// Cuts `from → to` (one-way); with `symmetric`, also `to → from`. After
    /// [`SimConfig::loss_detect`] of the cut, both ends see each other as lost.
    pub fn partition(&self, a: usize, b: usize, symmetric: bool) {
        {
            let mut state = self.shared.lock();
            state.cut.insert((a, b));
            if symmetric {
                state.cut.insert((b, a));
            }
            state.trace.absorb(b"partition");
            state.trace.absorb_u64((a * self.shared.n + b) as u64);
        }
        let shared = Arc::clone(&self.shared);
        tokio::spawn(async move {
            tokio::time::sleep(shared.config.loss_detect).await;
            let mut state = shared.lock();
            if state.cut.contains(&(a, b)) || state.cut.contains(&(b, a)) {
                report_lost(&mut state, a, b);
                drop(state);
                // What was held for the lost peer is dropped now, and sends waiting for ring
                // space towards it fail.
                shared.wake[a * shared.n + b].notify_one();
                shared.wake[b * shared.n + a].notify_one();
                shared.space.notify_waiters();
            }
        });
    }

    /// Heals every cut between `a` and `b`; peers reported lost see each other up again.
    pub fn heal(&self, a: usize, b: usize) {
        let mut state = self.shared.lock();
        state.cut.remove(&(a, b));
        state.cut.remove(&(b, a));
        for (x, y) in [(a, b), (b, a)] {
            if state.lost.remove(&(x, y)) {
                if let Some(Some(tx)) = state.inboxes.get(x) {
                    let _ = tx.send(TransportEvent::PeerUp(y));
                }
            }
        }
        state.trace.absorb(b"heal");
        drop(state);
        // Held frames flow again.
        let n = self.shared.n;
        self.shared.wake[a * n + b].notify_one();
        self.shared.wake[b * n + a].notify_one();
        self.shared.space.notify_waiters();
    }

    /// Crashes `rank`: it stops at once (its receive ends); the others see it lost after
    /// [`SimConfig::loss_detect`]. On shared-memory rings, what it had written stays readable
    /// except the frame it was writing (torn), and sends to it wait once its rings are full.
    pub fn crash(&self, rank: usize) {
        {
            let mut state = self.shared.lock();
            if state.crashed[rank] {
                return;
            }
            state.crashed[rank] = true;
            state.crashed_at[rank] = Some(Instant::now());
            state.inboxes[rank] = None;
            state.trace.absorb(b"crash");
            state.trace.absorb_u64(rank as u64);
        }
        let shared = Arc::clone(&self.shared);
        tokio::spawn(async move {
            tokio::time::sleep(shared.config.loss_detect).await;
            let mut state = shared.lock();
            for peer in 0..shared.n {
                if peer != rank {
                    report_lost(&mut state, peer, rank);
                }
            }
            drop(state);
            for peer in 0..shared.n {
                if peer != rank {
                    shared.wake[peer * shared.n + rank].notify_one();
                    shared.wake[rank * shared.n + peer].notify_one();
                }
            }
            shared.space.notify_waiters();
        });
    }

    /// Stalls `rank` (its compute is stuck in a collective): its sends wait, and frames to it
    /// are held unread (on shared-memory rings its peers' sends then wait too) until
    /// [`unstall`](Self::unstall) or its transport is aborted. Nobody sees it lost: it is alive.
    pub fn stall(&self, rank: usize) {
        let mut state = self.shared.lock();
        state.stuck[rank] = true;
        state.trace.absorb(b"stall");
        state.trace.absorb_u64(rank as u64);
    }

    /// Ends a [`stall`](Self::stall): held frames flow, waiting sends go on.
    pub fn unstall(&self, rank: usize) {
        {
            let mut state = self.shared.lock();
            if !std::mem::replace(&mut state.stuck[rank], false) {
                return;
            }
            state.trace.absorb(b"unstall");
            state.trace.absorb_u64(rank as u64);
        }
        let n = self.shared.n;
        for peer in 0..n {
            if peer != rank {
                self.shared.wake[peer * n + rank].notify_one();
            }
        }
        self.shared.space.notify_waiters();
    }

    /// Aborts `rank`'s transport (see [`SimTransport::abort`]).
    pub fn abort(&self, rank: usize) {
        {
            let mut state = self.shared.lock();
            if state.aborted[rank] || state.crashed[rank] {
                return;
            }
            state.aborted[rank] = true;
            state.inboxes[rank] = None;
            state.trace.absorb(b"abort");
            state.trace.absorb_u64(rank as u64);
            // Its peers see the link end at once (the ring's closed flags), not after a timeout.
            for peer in 0..self.shared.n {
                if peer != rank {
                    report_lost(&mut state, peer, rank);
                }
            }
        }
        let n = self.shared.n;
        for peer in 0..n {
            if peer != rank {
                self.shared.wake[peer * n + rank].notify_one();
                self.shared.wake[rank * n + peer].notify_one();
            }
        }
        self.shared.space.notify_waiters();
    }

    /// Bytes sent on `from → to` and not yet read (or dropped).
    pub fn in_flight(&self, from: usize, to: usize) -> usize {
        self.shared.lock().in_flight[from * self.shared.n + to]
    }

    /// The trace hash of everything delivered so far.
    pub fn trace(&self) -> TraceHash {
        self.shared.lock().trace
    }

    /// Frames delivered so far.
    pub fn delivered(&self) -> u64 {
        self.shared.lock().delivered
    }

    /// Declares that every frame on this network belongs to group generation `generation`
    /// (a network made for one generation): [`foreign_generation_frames`](Self::foreign_generation_frames)
    /// counts deliveries whose header says otherwise.
    pub fn expect_generation(&self, generation: u64) {
        self.shared.lock().generation = Some(generation);
    }

    /// Frames delivered that carried a generation other than the expected one.
    pub fn foreign_generation_frames(&self) -> u64 {
        self.shared.lock().foreign_generation
    }
}

/// Marks `a` and `b` as lost to each other (each side reported once).
fn report_lost(state: &mut State, a: usize, b: usize) {
    for (x, y) in [(a, b), (b, a)] {
        if state.lost.insert((x, y)) {
            if let Some(Some(tx)) = state.inboxes.get(x) {
                let _ = tx.send(TransportEvent::PeerLost(y));
            }
        }
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What happens to the frame at the front of a link when its delivery instant comes.
enum Fate {
    Deliver,
    Hold,
    Drop,
}

impl Shared {
    fn fate(&self, state: &State, from: usize, to: usize, written: Instant) -> Fate {
        match self.config.wire {
            WireModel::Stream => {
                let dead = state.crashed[from] || state.crashed[to] || state.lost.contains(&(to, from)) || state.aborted[from] || state.aborted[to];
                if dead {
                    Fate::Drop
                } else if state.cut.contains(&(from, to)) || state.stuck[to] {
                    // Held, not dropped: a reliable transport retransmits across a short
                    // partition; only when the peer is reported lost (or crashes) is what is
                    // queued dropped.
                    Fate::Hold
                } else {
                    Fate::Deliver
                }
            }
            WireModel::Shm { .. } => {
                let gone = state.aborted[from] || state.aborted[to] || state.lost.contains(&(to, from)) || state.lost.contains(&(from, to));
                let torn = state.crashed_at[from].is_some_and(|died| written > died);
                if gone || torn {
                    Fate::Drop
                } else if state.crashed[to] || state.stuck[to] || state.cut.contains(&(from, to)) {
                    // Nobody reads the ring: the bytes stay in it until the reader is back or
                    // the writer notices it is gone.
                    Fate::Hold
                } else {
                    Fate::Deliver
                }
            }
        }
    }
}

/// Delivers the frames of one directed link, in order, at their instants.
async fn deliver(shared: Arc<Shared>, link: usize) {
    let (from, to) = (link / shared.n, link % shared.n);
    loop {
        let next = shared.lock().queues[link].front().map(|(at, written, _)| (*at, *written));
        let Some((at, written)) = next else {
            shared.wake[link].notified().await;
            continue;
        };
        tokio::time::sleep_until(at).await;
        let fate = {
            let state = shared.lock();
            shared.fate(&state, from, to, written)
        };
        if let Fate::Hold = fate {
            shared.wake[link].notified().await;
            continue;
        }
        let mut state = shared.lock();
        let Some((_, _, frame)) = state.queues[link].pop_front() else { continue };
        state.in_flight[link] = state.in_flight[link].saturating_sub(frame.len());
        let waiting_senders = matches!(shared.config.wire, WireModel::Shm { .. });
        if let Fate::Drop = fate {
            drop(state);
            if waiting_senders {
                shared.space.notify_waiters();
            }
            continue;
        }
        state.trace.absorb_u64(at.duration_since(shared.epoch).as_nanos() as u64);
        state.trace.absorb_u64(link as u64);
        state.trace.absorb(&frame);
        state.delivered += 1;
        if let (Some(expected), Some(field)) = (state.generation, frame.get(GENERATION_FIELD)) {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(field);
            let generation = u64::from_le_bytes(bytes);
            if generation != expected {
                state.foreign_generation += 1;
                let op = frame.get(6).copied();
                tracing::warn!(from, to, generation, expected, op, len = frame.len(), "a frame of another generation was delivered");
            }
        }
        if let Some(Some(tx)) = state.inboxes.get(to) {
            let _ = tx.send(TransportEvent::Frame { from, bytes: frame });
        }
        drop(state);
        if waiting_senders {
            shared.space.notify_waiters();
        }
    }
}

impl SimTransport {
    /// Aborts this transport at once, without draining: waiting and later sends fail with
    /// `TransportClosed`, reading stops (`recv` ends), frames in flight from and to it are
    /// dropped, and every peer sees it lost now (its waiting sends to this rank fail).
    pub fn abort(&self) {
        SimNetwork { shared: Arc::clone(&self.shared) }.abort(self.rank);
    }

    /// Whether a frame of `len` bytes may be written into `link` now (shared memory: it fits in
    /// the ring, or streams through an empty ring whose reader reads).
    fn fits(&self, state: &State, link: usize, peer: usize, len: usize) -> bool {
        let WireModel::Shm { ring_bytes } = self.shared.config.wire else { return true };
        let used = state.in_flight[link];
        let reading = !state.crashed[peer] && !state.stuck[peer] && !state.cut.contains(&(self.rank, peer));
        used + len <= ring_bytes || (used == 0 && reading)
    }

    /// Queues `frame` on `link` with its delivery instant.
    fn enqueue(&self, state: &mut State, link: usize, frame: PooledBuf) {
        let model = state.links[link];
        let now = Instant::now();
        let mut transmit = if model.bandwidth_bytes_per_s > 0.0 { Duration::from_secs_f64(frame.len() as f64 / model.bandwidth_bytes_per_s) } else { Duration::ZERO };
        // Draws happen only for non-zero probabilities, so older traces replay unchanged.
        if model.duplicate > 0.0 && state.rng.random::<f64>() < model.duplicate {
            transmit *= 2;
        }
        let start = state.busy_until[link].max(now);
        state.busy_until[link] = start + transmit;
        let jitter_ns = model.jitter.as_nanos() as u64;
        let mut delay = model.latency + Duration::from_nanos(if jitter_ns > 0 { state.rng.random_range(0..=jitter_ns) } else { 0 });
        while model.loss > 0.0 && state.rng.random::<f64>() < model.loss {
            delay += model.retransmit_after;
        }
        if model.reorder > 0.0 && state.rng.random::<f64>() < model.reorder {
            delay += model.reorder_delay;
        }
        let at = (start + transmit + delay).max(state.last_delivery[link]);
        state.last_delivery[link] = at;
        state.in_flight[link] += frame.len();
        state.queues[link].push_back((at, start + transmit, frame));
    }
}

impl Transport for SimTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.n
    }

    fn send(&self, peer: usize, frame: PooledBuf) -> BoxFuture<'_, rtx_collectives::Result<()>> {
        Box::pin(async move {
            let n = self.shared.n;
            if peer >= n {
                return Err(rtx_collectives::Error::RankOutOfRange { rank: peer, size: n });
            }
            let link = self.rank * n + peer;
            loop {
                // Made before the check: `notify_waiters` reaches it from now on.
                let space = self.shared.space.notified();
                {
                    let mut state = self.shared.lock();
                    if state.aborted[self.rank] {
                        return Err(rtx_collectives::Error::TransportClosed);
                    }
                    if state.crashed[self.rank] || state.lost.contains(&(self.rank, peer)) {
                        return Err(rtx_collectives::Error::PeerLost { rank: peer, op: rtx_collectives::OpKind::Send });
                    }
                    if !state.stuck[self.rank] && self.fits(&state, link, peer, frame.len()) {
                        self.enqueue(&mut state, link, frame);
                        break;
                    }
                }
                // Stuck, or the ring is full: wait for space, a loss, a release or an abort.
                space.await;
            }
            self.shared.wake[link].notify_one();
            Ok(())
        })
    }

    fn recv(&self) -> BoxFuture<'_, Option<TransportEvent>> {
        Box::pin(async move {
            if self.shared.lock().crashed[self.rank] {
                return None;
            }
            self.inbox.lock().await.recv().await
        })
    }

    fn checks_integrity(&self) -> bool {
        true
    }

    fn abort(&self) {
        SimTransport::abort(self);
    }
}

/// Runs `body` to completion on a fresh single-thread runtime with paused (virtual) time: timers
/// fire in order as soon as every task is idle, so simulated seconds take microseconds.
pub fn run<F: Future>(body: F) -> std::io::Result<F::Output> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build()?;
    Ok(runtime.block_on(body))
}
