//! Shared-memory transport between processes on one machine.
//!
//! Each ordered pair of ranks `(src, dst)` has one single-producer single-consumer byte ring in a
//! memory-mapped file `<dir>/rtx-<job>-<src>-<dst>.ring` (`dir` defaults to `/dev/shm`). Both copies
//! a frame costs are the unavoidable ones: the writer copies the payload straight from the
//! caller's tensor into the ring ([`Transport::send_parts`]), and the receiving operation combines
//! or copies it straight out of the ring into its tensor, because the ring slot is lent to it
//! ([`EventSink::lent_frame`]) until the frame is dropped.
//!
//! Stream format: frames start at 64-byte aligned stream offsets and take `round_up(64 + payload,
//! 64)` bytes (a slot). A slot of at most an eighth of the ring never wraps around the ring's end:
//! the writer first fills the rest of the ring with a pad record (`RTXPAD01`, its length). Larger
//! frames stream through the ring in pieces and are copied out as they arrive. The writer
//! publishes in steps of at most [`WRITE_STEP`] bytes so the reader can start before the writer is
//! done.
//!
//! Reading: whoever holds a ring's read lock takes the next frame: an operation waiting for a frame
//! ([`Transport::poll_incoming`], for a short spin), or else the ring's reader thread. While
//! operations poll, the reader threads stand back: they park off the futex (so writers see no
//! sleeper and make no wake-up calls) until an operation stops polling to sleep or to wait for ring
//! space ([`Transport::poll_ended`], which wakes them), or a short nap passes with no poll. On two
//! cores this halved the time spent in wake-ups and context switches. The header is
//! validated (including the payload cap) before anything is delivered. A complete slot is lent to
//! the endpoint when the ring space pinned behind lent slots stays within half the ring (see
//! `lend_max` for why the writer then always has room); otherwise the payload is copied into a
//! pooled buffer. The
//! ring's `head` (the space the writer may reuse) advances only over slots that were copied out or
//! given back, in stream order; the reader's own position runs ahead of it.
//!
//! Ring layout: a 4 KiB control page (magic, capacity, then `head`, `tail`, the writer's heartbeat
//! and closed flag, the reader's closed flag, two wake-up words, and the writer's and reader's
//! process ids for diagnostics, each on its own cache line) followed by `ring_bytes` of data. `head`
//! is written only by the reader and `tail` only by the writer; both count bytes since creation.
//! The writer creates the file under a temporary name and renames it once initialised (and
//! locked, see Liveness), so a reader never maps a half-made ring.
//!
//! Synchronisation ([`crate::shm_ring`], which loom model-checks): a side publishes data or space
//! with a release store and observes the other's with an acquire load; waiting is an event count
//! on a futex per direction. A side that finds the ring empty (reader) or full (writer) spins
//! briefly ([`SPIN_ROUNDS`]), then reads the wake-up sequence word, announces that it sleeps,
//! re-checks the ring and the closed flags, and sleeps in `FUTEX_WAIT` on that word. The other
//! side, after publishing, bumps the word and calls `FUTEX_WAKE` only if a sleeper is announced, so
//! a busy link makes no system calls. Futex words live in the shared file (not `FUTEX_PRIVATE`), so
//! the kernel matches waiters across processes. Reader threads block in the futex directly; a
//! writer is an async task, so its (rare) sleep for space runs on tokio's blocking pool, in naps of
//! at most [`WRITER_NAP`].
//!
//! Liveness: what detects what, and how fast.
//! - A peer that closes its transport (drop or [`Transport::abort`]) sets its closed flags and
//!   wakes both sides of every ring: its peers' readers report [`TransportEvent::PeerLost`] and
//!   their writers fail at once (microseconds).
//! - A peer process that dies (SIGKILL, crash, exit without dropping the transport) cannot set a
//!   flag, so each ring's writer holds an exclusive `flock` on the ring file for its life, taken
//!   before the file is published; the reader keeps its own descriptor of the file (the name is
//!   removed, the lock stays with the open file). The kernel drops the lock when the process's files
//!   are closed at exit, before it is even reaped, so a reader whose `flock(LOCK_SH | LOCK_NB)`
//!   succeeds knows the writer is gone: everything it published is final, complete frames are still
//!   delivered, and a frame it died in the middle of is dropped and the loss reported (never a
//!   partial frame). A reader probes only when it is about to sleep, which includes its wake-ups
//!   every [`ShmOptions::heartbeat`] (100 ms by default) and its naps while operations poll, and at
//!   most once per [`PROBE_INTERVAL`] (50 ms); a writer waiting for space probes the same peer's
//!   lock between its naps, as often. So a killed peer is reported within about one heartbeat
//!   period (measured: 50 ms with a 50 ms heartbeat, also when it died in the middle of a frame),
//!   and a send blocked on its full ring fails within about 50-70 ms, while a busy link makes no
//!   probe at all. Chosen over a pid check (pids are reused, and a zombie still has its
//!   pid) and over the heartbeat alone (a timeout long enough for a loaded machine is seconds): a
//!   lock is released exactly when the process dies, and the probe is one cheap system call.
//! - A peer process that is stopped (SIGSTOP, a debugger) or hung keeps its lock: only the
//!   heartbeat finds it. Every rank bumps the heartbeat of its outgoing rings every
//!   [`ShmOptions::heartbeat`]; a reader that sees no change for [`ShmOptions::liveness_timeout`]
//!   (3 s by default) reports the peer lost and writers to it then fail. A peer resumed within the
//!   timeout is not affected.
//! - This rank's [`Transport::abort`] (the worker calls it on every generation change) closes all
//!   of its rings as above, which wakes every sleeper, its own included: writers waiting for space
//!   fail with [`Error::TransportClosed`] (as does every later send), reader threads exit (also in
//!   the middle of a frame), `recv` ends, an attached endpoint is told the transport closed (which
//!   fails its waiting operations), and `poll_incoming` stops taking frames. It never blocks.
//!
//! A send cancelled in the middle of a frame closes the link (the stream cannot be
//! resynchronised), which the peer sees as the writer closing.
//!
//! The reader removes a ring's file name as soon as it has mapped it (the writer removes it on drop
//! if no reader came), so crashed runs leave no files behind once connected. The job name must
//! still be unique per run: a ring left by a run that crashed while connecting could be mapped by an
//! early reader of a new run with the same name.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fs::OpenOptions;
use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::communicator::DEFAULT_MAX_PAYLOAD_BYTES;
use crate::error::{Error, Result};
use crate::frame::{decode_header, OpKind, HEADER_LEN};
use crate::pool::{BufferPool, PooledBuf};
use crate::shm_ring::RingMemory;
use crate::stand_back::PollingOperations;
use crate::sync::{lock, try_lock};
use crate::transport::{AwaitedFrame, BoxFuture, EventSink, Lender, LentBytes, Transport, TransportEvent};

/// Most received frames waiting for a polling dispatcher before readers stop draining rings (only
/// when the endpoint polls instead of attaching).
pub const SHM_INBOX_FRAMES: usize = 256;
/// Default [`ShmOptions::ring_bytes`]. Measured (`rtx bench collectives`, 2 and 4 ranks): 4 MiB
/// rings with 256 KiB frames ([`Transport::preferred_chunk_bytes`] is a sixteenth of the ring) beat
/// 16 MiB rings with 512 KiB frames by 1.4-1.9x from 1 MiB up, because both directions' rings stay
/// in the last-level cache (BENCHMARKS.md).
pub const DEFAULT_RING_BYTES: usize = 4 << 20;
/// Most bytes a writer copies into a ring before publishing them, so the reader copies out while
/// the writer still copies in.
const WRITE_STEP: usize = 256 << 10;
/// Polls of an empty or full ring before a side goes to sleep on the futex (a few microseconds).
/// Longer spinning measured slower on 2 cores: the spinner takes the CPU the other side needs.
const SPIN_ROUNDS: u32 = 64;
/// Stream alignment of frames (and of payloads, which start 64 bytes into their slot).
const SLOT_ALIGN: usize = 64;
/// First 8 bytes of a pad record.
const PAD_MAGIC: u64 = u64::from_le_bytes(*b"RTXPAD01");

const RING_MAGIC: u64 = u64::from_le_bytes(*b"RTXSHM04");
const CONTROL_BYTES: usize = 4096;
const OFF_MAGIC: usize = 0;
const OFF_CAPACITY: usize = 8;
const OFF_HEAD: usize = 64;
const OFF_TAIL: usize = 128;
const OFF_WRITER_BEAT: usize = 192;
const OFF_WRITER_CLOSED: usize = 256;
const OFF_READER_CLOSED: usize = 320;
/// Data wake-up: sequence word (bumped by the writer) and the reader's "sleeping" word.
const OFF_DATA_SEQ: usize = 384;
const OFF_READER_SLEEPING: usize = 388;
/// Space wake-up: sequence word (bumped by the reader) and the writer's "sleeping" word.
const OFF_SPACE_SEQ: usize = 448;
const OFF_WRITER_SLEEPING: usize = 452;
/// Process ids of the writer and the reader (diagnostics only).
const OFF_WRITER_PID: usize = 512;
const OFF_READER_PID: usize = 576;
const OPEN_RETRY: Duration = Duration::from_millis(5);
/// Longest a sleeping writer waits before it re-checks the link (lost peer, closed reader).
const WRITER_NAP: Duration = Duration::from_millis(20);
/// Least time between two probes of one peer's lock (see the module doc, Liveness): the probe is a
/// system call, made only by a side about to sleep, and this bounds it further on a link that
/// sleeps often.
const PROBE_INTERVAL: Duration = Duration::from_millis(50);
/// Smallest ring: room for a header slot and a pad record.
const MIN_RING_BYTES: usize = 4096;
const _: () = assert!(OFF_READER_PID + 8 <= CONTROL_BYTES);
const _: () = assert!(HEADER_LEN == SLOT_ALIGN);

/// Where and how rings are made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmOptions {
    /// Directory of the ring files (a tmpfs such as `/dev/shm`).
    pub dir: PathBuf,
    /// Job name, unique per run; part of every ring's file name.
    pub job: String,
    /// Data bytes per ring; a power of two of at least 4096, equal on every rank. Frames up to an
    /// eighth of it are read in place; endpoints over this transport send frames of a sixteenth of
    /// it unless their config says otherwise ([`Transport::preferred_chunk_bytes`]).
    pub ring_bytes: usize,
    /// How long [`ShmTransport::connect`] waits for the peers' rings.
    pub connect_timeout: Duration,
    /// How often this rank proves it is alive.
    pub heartbeat: Duration,
    /// A peer whose heartbeat does not move for this long is reported lost.
    pub liveness_timeout: Duration,
    /// Frames declaring a larger payload end the link; match [`crate::CommConfig`].
    pub max_payload_bytes: usize,
}

/// A rank's rings to and from every other rank of the job.
pub struct ShmTransport {
    shared: Arc<ShmShared>,
    inbox: tokio::sync::Mutex<mpsc::Receiver<TransportEvent>>,
    /// The sender half for polled delivery, until the route is chosen.
    events: Mutex<Option<mpsc::Sender<TransportEvent>>>,
    heartbeat: tokio::task::AbortHandle,
}

struct ShmShared {
    rank: usize,
    world: usize,
    options: ShmOptions,
    outgoing: BTreeMap<usize, (Arc<Ring>, tokio::sync::Mutex<Writer>)>,
    incoming: BTreeMap<usize, Arc<Inbound>>,
    lost: Mutex<BTreeSet<usize>>,
    /// Peers whose loss was reported to the endpoint.
    reported: Mutex<BTreeSet<usize>>,
    /// Where frames go, once the endpoint attached or polled.
    route: OnceLock<Route>,
    pool: BufferPool,
    /// Set when the transport is dropped or aborted; reader threads exit.
    stop: AtomicBool,
    /// Set by [`Transport::abort`]: sends fail with `TransportClosed`, `recv` ends.
    aborted: AtomicBool,
    /// Wakes a `recv` waiting when the transport is aborted.
    abort_notify: tokio::sync::Notify,
    /// Operations taking frames themselves (`poll_incoming`) and the reader threads, which stand
    /// back meanwhile (off the futex, so writers make no wake-up calls for them). An operation
    /// stops polling to sleep or to wait for ring space.
    operations: PollingOperations,
    /// The reader threads (each also registers with `operations`, to be woken): they end when
    /// their link ends or the transport stops.
    readers: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

/// The sending side of one ring, held (behind the per-peer lock) while a frame is written.
struct Writer {
    /// When the writer, waiting for space, may probe the peer's lock again.
    next_probe: Instant,
}

/// Where frames are delivered.
#[derive(Clone)]
enum Route {
    Push(Weak<dyn EventSink>),
    Pull(mpsc::Sender<TransportEvent>),
}

/// One mapped ring; see the module doc for the protocol.
struct Ring {
    /// Keeps the mapping `base` points into alive.
    _map: memmap2::MmapMut,
    base: *mut u8,
    capacity: usize,
    path: PathBuf,
    owned: bool,
    /// The ring file, open for the life of the ring: the writer holds `LOCK_EX` on it, the reader
    /// probes that lock (see the module doc, Liveness).
    file: std::fs::File,
}

// SAFETY: `base` points into `map`, which lives as long as the `Ring`. All shared mutation goes
// through atomics in the control page or through the SPSC protocol on the data area (a byte range is
// written only by the writer before it publishes `tail`, and read only by the reader, or a borrower
// of a lent slot, before `head` passes it); each side is driven by one thread or task at a time
// (writers hold the per-peer lock, readers the ring's read lock).
unsafe impl Send for Ring {}
// SAFETY: as above.
unsafe impl Sync for Ring {}

/// The receiving end of one ring: its read position and the slots not yet given back.
struct Inbound {
    peer: usize,
    ring: Arc<Ring>,
    /// Held by whoever takes a frame (the reader thread, or an operation polling).
    read: Mutex<()>,
    /// Stream offset of the next unread byte; changed only under `read`.
    rpos: AtomicU64,
    consumed: Mutex<Consumed>,
}

/// Read slots between `head` and `rpos`, in stream order.
#[derive(Default)]
struct Consumed {
    /// (start, end, given back) of each slot or piece taken.
    pending: VecDeque<(u64, u64, bool)>,
    /// Bytes lent out and not given back.
    lent: usize,
}

/// A frame taken from a ring.
enum Taken {
    Lent { header: [u8; HEADER_LEN], payload: LentBytes },
    Copied(PooledBuf),
}

/// Why a reader stops reading a ring.
#[derive(Clone, Copy, Debug)]
enum LinkEnd {
    /// The writer closed the ring (or sent something unreadable).
    Closed,
    /// The writer's heartbeat stopped for the liveness timeout (a stopped or hung process).
    Silent,
    /// The writer's process exited (its lock on the ring file is gone).
    Exited,
    /// This rank stopped reading (transport dropped or aborted, or the link ended already).
    Stopped,
}

impl Default for ShmOptions {
    fn default() -> Self {
        let shm = Path::new("/dev/shm");
        ShmOptions {
            dir: if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() },
            job: "rtx".into(),
            ring_bytes: DEFAULT_RING_BYTES,
            connect_timeout: Duration::from_secs(30),
            heartbeat: Duration::from_millis(100),
            liveness_timeout: Duration::from_secs(3),
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
        }
    }
}

impl ShmTransport {
    /// Creates this rank's outgoing rings, waits for every peer's ring towards it, and starts the
    /// heartbeat. Reader threads start when an endpoint attaches (or first polls).
    pub async fn connect(rank: usize, world_size: usize, options: ShmOptions) -> Result<ShmTransport> {
        if rank >= world_size {
            return Err(Error::RankOutOfRange { rank, size: world_size });
        }
        if !options.ring_bytes.is_power_of_two() || options.ring_bytes < MIN_RING_BYTES {
            return Err(Error::InvalidConfig { reason: "ring_bytes must be a power of two of at least 4096" });
        }
        if options.heartbeat >= options.liveness_timeout {
            return Err(Error::InvalidConfig { reason: "heartbeat must be below liveness_timeout" });
        }
        let peers: Vec<usize> = (0..world_size).filter(|&p| p != rank).collect();
        let mut outgoing = BTreeMap::new();
        for &peer in &peers {
            let ring = Ring::create(&ring_path(&options, rank, peer), options.ring_bytes)?;
            outgoing.insert(peer, (Arc::new(ring), tokio::sync::Mutex::new(Writer { next_probe: Instant::now() })));
        }
        let mut incoming = BTreeMap::new();
        let deadline = tokio::time::Instant::now() + options.connect_timeout;
        for &peer in &peers {
            let path = ring_path(&options, peer, rank);
            let ring = loop {
                if let Some(ring) = Ring::open(&path, options.ring_bytes)? {
                    break ring;
                }
                if tokio::time::Instant::now() >= deadline {
                    return Err(Error::Connect {
                        peer,
                        timeout_ms: u64::try_from(options.connect_timeout.as_millis()).unwrap_or(u64::MAX),
                        reason: format!("no ring at {}", path.display()),
                    });
                }
                tokio::time::sleep(OPEN_RETRY).await;
            };
            let inbound = Inbound { peer, ring: Arc::new(ring), read: Mutex::new(()), rpos: AtomicU64::new(0), consumed: Mutex::new(Consumed::default()) };
            incoming.insert(peer, Arc::new(inbound));
        }
        let (events, inbox) = mpsc::channel(SHM_INBOX_FRAMES);
        let shared = Arc::new(ShmShared {
            rank,
            world: world_size,
            options,
            outgoing,
            incoming,
            lost: Mutex::new(BTreeSet::new()),
            reported: Mutex::new(BTreeSet::new()),
            route: OnceLock::new(),
            pool: BufferPool::new(),
            stop: AtomicBool::new(false),
            aborted: AtomicBool::new(false),
            abort_notify: tokio::sync::Notify::new(),
            operations: PollingOperations::default(),
            readers: Mutex::new(Vec::new()),
        });
        let heartbeat = tokio::spawn(heartbeat(Arc::clone(&shared))).abort_handle();
        Ok(ShmTransport { shared, inbox: tokio::sync::Mutex::new(inbox), events: Mutex::new(Some(events)), heartbeat })
    }

    /// Sets where frames go and starts one reader thread per incoming ring (called once, by
    /// whoever takes the polled-delivery sender first).
    fn start_readers(&self, route: Route) {
        if self.shared.route.set(route.clone()).is_err() {
            return;
        }
        if self.shared.aborted.load(Ordering::SeqCst) {
            // Aborted before anyone attached: nothing will be read (`abort` may have found no route
            // to tell; telling twice is harmless).
            self.shared.close_route();
            return;
        }
        for (&peer, inbound) in &self.shared.incoming {
            let (shared, inbound, route) = (Arc::clone(&self.shared), Arc::clone(inbound), route.clone());
            let spawned =
                std::thread::Builder::new().name(format!("rtx-shm-{}<-{peer}", self.shared.rank)).spawn(move || read_frames(&shared, &inbound, &route));
            match spawned {
                Ok(handle) => lock(&self.shared.readers).push(handle),
                Err(e) => {
                    tracing::error!(rank = self.shared.rank, peer, error = %e, "could not start a shared-memory reader thread");
                    lock(&self.shared.lost).insert(peer);
                }
            }
        }
    }
}

impl Transport for ShmTransport {
    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn send(&self, peer: usize, frame: PooledBuf) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move { self.shared.write_frame(peer, &[&frame]).await })
    }

    fn checks_integrity(&self) -> bool {
        // Bytes move through memory shared by the two processes.
        true
    }

    fn recv(&self) -> BoxFuture<'_, Option<TransportEvent>> {
        Box::pin(async move {
            if let Some(events) = lock(&self.events).take() {
                self.start_readers(Route::Pull(events));
            }
            let mut inbox = self.inbox.lock().await;
            let aborted = self.shared.abort_notify.notified();
            tokio::pin!(aborted);
            aborted.as_mut().enable();
            if !self.shared.aborted.load(Ordering::SeqCst) {
                tokio::select! {
                    biased;
                    () = &mut aborted => {}
                    event = inbox.recv() => return event,
                }
            }
            // Aborted: reader threads blocked handing over a frame must not wait for us.
            inbox.close();
            None
        })
    }

    fn send_parts<'a>(&'a self, peer: usize, header: &'a [u8; HEADER_LEN], payload: &'a [u8], _pool: &'a BufferPool) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.shared.write_frame(peer, &[header, payload]).await })
    }

    fn poll_incoming(&self, _awaited: AwaitedFrame) -> Option<usize> {
        // Only with push delivery: a polled transport's frames must go through its channel.
        let route @ Route::Push(_) = self.shared.route.get()? else { return None };
        if self.shared.aborted.load(Ordering::Relaxed) {
            return None;
        }
        self.shared.operations.note_poll();
        let mut delivered = 0;
        for inbound in self.shared.incoming.values() {
            if inbound.available() < HEADER_LEN {
                continue;
            }
            // `None`: the reader thread is on it.
            let Some(_reading) = try_lock(&inbound.read) else { continue };
            loop {
                match take_frame(&self.shared, inbound, route, None) {
                    Ok(Some(taken)) => {
                        deliver_taken(route, inbound.peer, taken);
                        delivered += 1;
                    }
                    Ok(None) => break,
                    Err(end) => {
                        link_ended(&self.shared, inbound, route, &end);
                        break;
                    }
                }
            }
        }
        Some(delivered)
    }

    fn preferred_chunk_bytes(&self) -> Option<usize> {
        Some(self.shared.options.ring_bytes / 16)
    }

    fn poll_ended(&self, _awaited: AwaitedFrame) {
        self.shared.operations.stop();
    }

    fn attach(&self, sink: Weak<dyn EventSink>) -> bool {
        if lock(&self.events).take().is_none() {
            // Already being polled.
            return false;
        }
        self.start_readers(Route::Push(sink));
        true
    }

    /// Closes every ring of this rank at once (peers see the links end: their readers report
    /// `PeerLost` for this rank, their writers fail), wakes every sleeper on them (this rank's
    /// reader threads, which exit, and its writers waiting for space, which fail with
    /// `TransportClosed`, as does every later send), ends `recv`, and tells an attached endpoint
    /// that the transport is closed (which fails its waiting operations). Only atomic stores,
    /// futex wakes, unparks and short locks: it never blocks.
    fn abort(&self) {
        if self.shared.aborted.swap(true, Ordering::SeqCst) {
            return;
        }
        tracing::info!(rank = self.shared.rank, job = %self.shared.options.job, "shared-memory transport aborted");
        self.heartbeat.abort();
        self.shared.close_rings();
        self.shared.abort_notify.notify_waiters();
        if let Ok(mut inbox) = self.inbox.try_lock() {
            inbox.close();
        }
        self.shared.close_route();
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        self.heartbeat.abort();
        self.shared.close_rings();
    }
}

impl std::fmt::Debug for ShmTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmTransport")
            .field("rank", &self.shared.rank)
            .field("world_size", &self.shared.world)
            .field("job", &self.shared.options.job)
            .finish_non_exhaustive()
    }
}

/// Marks a link closed if a frame write is abandoned half-way (the future dropped).
struct TornFrame<'a> {
    shared: &'a ShmShared,
    ring: &'a Ring,
    peer: usize,
    armed: bool,
}

impl Drop for TornFrame<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        tracing::warn!(rank = self.shared.rank, peer = self.peer, "send cancelled mid-frame: closing the shared-memory link");
        lock(&self.shared.lost).insert(self.peer);
        self.ring.close_writer();
        if lock(&self.shared.reported).insert(self.peer) {
            match self.shared.route.get() {
                Some(Route::Push(sink)) => {
                    if let Some(sink) = sink.upgrade() {
                        sink.event(TransportEvent::PeerLost(self.peer));
                    }
                }
                Some(Route::Pull(events)) => {
                    let _ = events.try_send(TransportEvent::PeerLost(self.peer));
                }
                None => {}
            }
        }
    }
}

/// What the writer puts into the ring: bytes, or a gap it only skips over.
enum Put<'a> {
    Bytes(&'a [u8]),
    Skip(usize),
}

impl ShmShared {
    fn is_lost(&self, peer: usize) -> bool {
        lock(&self.lost).contains(&peer)
    }

    /// Stops the reader threads and closes every ring, waking every sleeper on either side
    /// (the transport is dropped or aborted).
    fn close_rings(&self) {
        self.stop.store(true, Ordering::SeqCst);
        for (ring, _) in self.outgoing.values() {
            ring.close_writer();
        }
        for inbound in self.incoming.values() {
            inbound.ring.close_reader();
        }
        self.operations.wake_readers();
    }

    /// Tells an attached endpoint that nothing more will be delivered (after an abort).
    fn close_route(&self) {
        if let Some(Route::Push(sink)) = self.route.get() {
            if let Some(sink) = sink.upgrade() {
                sink.closed();
            }
        }
    }

    /// Why sends to `peer` fail now, if they do.
    /// After an abort that is `TransportClosed`, whatever the peers did since (they close their
    /// ends when they see ours close).
    fn send_error(&self, peer: usize, ring: &Ring) -> Option<Error> {
        if self.aborted.load(Ordering::SeqCst) {
            return Some(Error::TransportClosed);
        }
        if self.is_lost(peer) || ring.reader_closed() || ring.writer_closed() {
            return Some(Error::PeerLost { rank: peer, op: OpKind::Send });
        }
        None
    }

    /// Writes the concatenation of `parts` (one frame) into the ring towards `peer`, in a slot
    /// that does not wrap if it fits in half the ring.
    async fn write_frame(&self, peer: usize, parts: &[&[u8]]) -> Result<()> {
        let Some((ring, lock)) = self.outgoing.get(&peer) else {
            return Err(Error::RankOutOfRange { rank: peer, size: self.world });
        };
        let mut writer = lock.lock().await;
        if let Some(error) = self.send_error(peer, ring) {
            return Err(error);
        }
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let slot = round_up(total, SLOT_ALIGN);
        let mut torn = TornFrame { shared: self, ring, peer, armed: true };
        let written = self.write_slot(peer, ring, &mut writer, parts, total, slot).await;
        // A failed write leaves the link closed already (by the peer, a lost peer or an abort);
        // only a cancelled one must close it.
        torn.armed = false;
        written
    }

    async fn write_slot(&self, peer: usize, ring: &Arc<Ring>, writer: &mut Writer, parts: &[&[u8]], total: usize, slot: usize) -> Result<()> {
        let pos = ring.tail() as usize & (ring.capacity - 1);
        if slot <= lend_max(ring.capacity) && pos + slot > ring.capacity {
            let pad = ring.capacity - pos;
            let mut record = [0u8; SLOT_ALIGN];
            record[..8].copy_from_slice(&PAD_MAGIC.to_le_bytes());
            record[8..16].copy_from_slice(&(pad as u64).to_le_bytes());
            self.put(peer, ring, writer, Put::Bytes(&record)).await?;
            self.put(peer, ring, writer, Put::Skip(pad - SLOT_ALIGN)).await?;
        }
        for part in parts {
            self.put(peer, ring, writer, Put::Bytes(part)).await?;
        }
        self.put(peer, ring, writer, Put::Skip(slot - total)).await
    }

    /// Puts `what` into the ring, publishing as it goes and waiting for space when it is full.
    /// While it waits it fails as soon as the link ends, the transport is aborted, or the peer's
    /// process is found gone (its lock probed at most every [`PROBE_INTERVAL`]).
    async fn put(&self, peer: usize, ring: &Arc<Ring>, writer: &mut Writer, what: Put<'_>) -> Result<()> {
        let len = match what {
            Put::Bytes(b) => b.len(),
            Put::Skip(n) => n,
        };
        let mut done = 0;
        while done < len {
            let step = (len - done).min(WRITE_STEP);
            let n = match what {
                Put::Bytes(b) => ring.write_some(Some(&b[done..done + step]), step),
                Put::Skip(_) => ring.write_some(None, step),
            };
            if n > 0 {
                done += n;
                ring.wake_reader();
                continue;
            }
            if let Some(error) = self.send_error(peer, ring) {
                return Err(error);
            }
            let now = Instant::now();
            if now >= writer.next_probe {
                writer.next_probe = now + PROBE_INTERVAL;
                if let Some(inbound) = self.incoming.get(&peer) {
                    if inbound.ring.writer_gone() {
                        tracing::info!(
                            rank = self.rank,
                            peer,
                            pid = inbound.ring.writer_pid(),
                            "shared-memory peer exited while this rank waits for ring space"
                        );
                        lock(&self.lost).insert(peer);
                        return Err(Error::PeerLost { rank: peer, op: OpKind::Send });
                    }
                }
            }
            // This operation stops polling while it waits: the readers must drain our rings.
            self.operations.stop();
            wait_for_space(ring).await;
        }
        Ok(())
    }
}

/// Waits until the ring has free space (or a nap passed, or the ring is closed): spins, then
/// sleeps on the space futex on tokio's blocking pool.
async fn wait_for_space(ring: &Arc<Ring>) {
    for _ in 0..SPIN_ROUNDS {
        if ring.free() > 0 {
            return;
        }
        std::hint::spin_loop();
    }
    tokio::task::yield_now().await;
    if ring.free() > 0 {
        return;
    }
    let ring = Arc::clone(ring);
    let slept = tokio::task::spawn_blocking(move || ring.sleep_for_space(WRITER_NAP)).await;
    if slept.is_err() {
        // No blocking pool (the runtime is shutting down): fall back to a timer nap.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

impl Ring {
    /// Creates and publishes this rank's ring at `path`, holding the writer's lock on it (see the
    /// module doc, Liveness) from before it is published until this process closes it or dies.
    fn create(path: &Path, capacity: usize) -> Result<Ring> {
        let staging = path.with_extension("staging");
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&staging).map_err(|e| io("create ring", e))?;
        if !try_flock(&file, libc::LOCK_EX) {
            return Err(Error::InvalidConfig { reason: "another process is creating a ring of this job name: job names must be unique per run" });
        }
        file.set_len((CONTROL_BYTES + capacity) as u64).map_err(|e| io("size ring", e))?;
        // SAFETY: the file was just created by us at a private staging name; other processes map
        // it only after the rename below, and then only through the SPSC protocol.
        let mut map = unsafe { memmap2::MmapMut::map_mut(&file) }.map_err(|e| io("map ring", e))?;
        let base = map.as_mut_ptr();
        let ring = Ring { _map: map, base, capacity, path: path.to_path_buf(), owned: true, file };
        ring.atomic(OFF_CAPACITY).store(capacity as u64, Ordering::Relaxed);
        ring.atomic(OFF_WRITER_PID).store(u64::from(std::process::id()), Ordering::Relaxed);
        ring.atomic(OFF_MAGIC).store(RING_MAGIC, Ordering::Release);
        std::fs::rename(&staging, path).map_err(|e| io("publish ring", e))?;
        Ok(ring)
    }

    /// Maps the ring at `path` if its writer has published it, keeping the file open to probe the
    /// writer's lock.
    fn open(path: &Path, capacity: usize) -> Result<Option<Ring>> {
        let file = match OpenOptions::new().read(true).write(true).open(path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io("open ring", e)),
        };
        let len = file.metadata().map_err(|e| io("stat ring", e))?.len();
        if len != (CONTROL_BYTES + capacity) as u64 {
            return Err(Error::InvalidConfig { reason: "peer ring has a different size: ring_bytes must match" });
        }
        // SAFETY: the ring is shared with exactly one writer process that follows the same SPSC
        // protocol; see the `Send`/`Sync` justification on `Ring`.
        let mut map = unsafe { memmap2::MmapMut::map_mut(&file) }.map_err(|e| io("map ring", e))?;
        let base = map.as_mut_ptr();
        let ring = Ring { _map: map, base, capacity, path: path.to_path_buf(), owned: false, file };
        if ring.atomic(OFF_MAGIC).load(Ordering::Acquire) != RING_MAGIC || ring.atomic(OFF_CAPACITY).load(Ordering::Relaxed) != capacity as u64 {
            return Err(Error::InvalidConfig { reason: "peer ring is not an initialised ring of this size" });
        }
        ring.atomic(OFF_READER_PID).store(u64::from(std::process::id()), Ordering::Relaxed);
        // Both ends have it mapped now; dropping the name means a crash of either leaves nothing
        // behind in the directory.
        let _ = std::fs::remove_file(path);
        Ok(Some(ring))
    }

    /// Reader side: whether the writer's process closed the ring file or died (its lock is gone),
    /// one non-blocking `flock` call. Once true it stays true: the ring is never locked again.
    fn writer_gone(&self) -> bool {
        try_flock(&self.file, libc::LOCK_SH)
    }

    /// The writer's process id, for diagnostics.
    fn writer_pid(&self) -> u64 {
        self.atomic(OFF_WRITER_PID).load(Ordering::Relaxed)
    }

    fn atomic(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset % 8 == 0 && offset + 8 <= CONTROL_BYTES);
        // SAFETY: `offset` is inside the page-aligned control page, 8-byte aligned, and the location
        // is only ever accessed atomically (by both processes).
        unsafe { &*self.base.add(offset).cast::<AtomicU64>() }
    }

    fn word(&self, offset: usize) -> &AtomicU32 {
        debug_assert!(offset % 4 == 0 && offset + 4 <= CONTROL_BYTES);
        // SAFETY: as for `atomic`; these 32-bit words are futex words, only accessed atomically and
        // by the kernel's futex calls.
        unsafe { &*self.base.add(offset).cast::<AtomicU32>() }
    }

    /// The data area at stream offset `pos` (for a slot that does not wrap).
    fn data_at(&self, pos: u64) -> NonNull<u8> {
        let start = (pos as usize) & (self.capacity - 1);
        // SAFETY: `start < capacity`, inside the mapping; the mapping base is never null.
        unsafe { NonNull::new_unchecked(self.base.add(CONTROL_BYTES + start)) }
    }
}

/// The ring protocol ([`crate::shm_ring`]) on the mapped file.
impl RingMemory for Ring {
    type W64 = AtomicU64;
    type W32 = AtomicU32;

    #[inline]
    fn capacity(&self) -> usize {
        self.capacity
    }
    #[inline]
    fn head_word(&self) -> &AtomicU64 {
        self.atomic(OFF_HEAD)
    }
    #[inline]
    fn tail_word(&self) -> &AtomicU64 {
        self.atomic(OFF_TAIL)
    }
    #[inline]
    fn writer_closed_word(&self) -> &AtomicU64 {
        self.atomic(OFF_WRITER_CLOSED)
    }
    #[inline]
    fn reader_closed_word(&self) -> &AtomicU64 {
        self.atomic(OFF_READER_CLOSED)
    }
    #[inline]
    fn data_seq(&self) -> &AtomicU32 {
        self.word(OFF_DATA_SEQ)
    }
    #[inline]
    fn reader_sleeping(&self) -> &AtomicU32 {
        self.word(OFF_READER_SLEEPING)
    }
    #[inline]
    fn space_seq(&self) -> &AtomicU32 {
        self.word(OFF_SPACE_SEQ)
    }
    #[inline]
    fn writer_sleeping(&self) -> &AtomicU32 {
        self.word(OFF_WRITER_SLEEPING)
    }
    #[inline]
    unsafe fn copy_in(&self, start: usize, src: &[u8]) {
        debug_assert!(start + src.len() <= self.capacity);
        // SAFETY: inside the data area (the caller keeps `start + len <= capacity`), and the bytes
        // are the writer's to write (the caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.base.add(CONTROL_BYTES + start), src.len()) }
    }
    #[inline]
    unsafe fn copy_out(&self, start: usize, dst: &mut [MaybeUninit<u8>]) {
        debug_assert!(start + dst.len() <= self.capacity);
        // SAFETY: inside the data area, published and not given back (the caller's contract);
        // `dst` has room for its length.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(CONTROL_BYTES + start), dst.as_mut_ptr().cast::<u8>(), dst.len()) }
    }
    #[inline]
    fn fence_seqcst(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
    }
    fn futex_wait(&self, word: &AtomicU32, expected: u32, timeout: Duration) {
        futex_wait(word, expected, timeout);
    }
    fn futex_wake(&self, word: &AtomicU32) {
        futex_wake(word);
    }
}

/// Takes `lock` (`LOCK_EX` or `LOCK_SH`) on `file` without blocking; whether it was granted.
/// Interrupted calls are retried; other errors count as not granted (the writer looks alive).
fn try_flock(file: &std::fs::File, lock: libc::c_int) -> bool {
    use std::os::fd::AsRawFd;
    loop {
        // SAFETY: the descriptor is open for the duration of the call (`file` borrows it).
        let rc = unsafe { libc::flock(file.as_raw_fd(), lock | libc::LOCK_NB) };
        if rc == 0 {
            return true;
        }
        if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return false;
        }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        if self.owned {
            // Usually the reader removed the name already; this covers a reader that never came.
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl Inbound {
    fn rpos(&self) -> u64 {
        self.rpos.load(Ordering::Acquire)
    }

    /// Published bytes not read yet.
    fn available(&self) -> usize {
        self.ring.tail().wrapping_sub(self.rpos()) as usize
    }

    /// Marks `len` bytes at the read position read (under the read lock); a copied range is given
    /// back at once, a lent one when its [`LentBytes`] is dropped. Returns the range's end, which
    /// is the lending token.
    fn consume(&self, len: usize, lent: bool) -> u64 {
        let start = self.rpos();
        let end = start + len as u64;
        self.rpos.store(end, Ordering::Release);
        let mut consumed = lock(&self.consumed);
        consumed.pending.push_back((start, end, !lent));
        if lent {
            consumed.lent += len;
        } else {
            self.advance_head(&mut consumed);
        }
        end
    }

    /// Moves `head` over the given-back ranges at the front and tells the writer.
    fn advance_head(&self, consumed: &mut MutexGuard<'_, Consumed>) {
        let mut head = None;
        while let Some(&(_, end, true)) = consumed.pending.front() {
            head = Some(end);
            consumed.pending.pop_front();
        }
        if let Some(head) = head {
            self.ring.give_back(head);
        }
    }

    /// Bytes between `head` and the end of the next `slot` bytes: what the writer cannot reuse
    /// if that slot is lent now.
    fn pinned_after(&self, slot: usize) -> usize {
        let head = self.ring.head();
        (self.rpos() + slot as u64).wrapping_sub(head) as usize
    }
}

impl Lender for Inbound {
    fn release(&self, token: u64) {
        let mut consumed = lock(&self.consumed);
        let Some(entry) = consumed.pending.iter_mut().find(|(_, end, _)| *end == token) else {
            debug_assert!(false, "released a slot that was not lent");
            return;
        };
        entry.2 = true;
        let len = (entry.1 - entry.0) as usize;
        consumed.lent -= len;
        self.advance_head(&mut consumed);
    }
}

async fn heartbeat(shared: Arc<ShmShared>) {
    let mut interval = tokio::time::interval(shared.options.heartbeat);
    loop {
        interval.tick().await;
        for (ring, _) in shared.outgoing.values() {
            ring.atomic(OFF_WRITER_BEAT).fetch_add(1, Ordering::Release);
        }
    }
}

/// A reader thread: frames from its ring to `route` until the link ends or the transport stops.
/// It holds the read lock only while it takes a frame, so a polling operation can take frames in
/// between.
fn read_frames(shared: &ShmShared, inbound: &Arc<Inbound>, route: &Route) {
    let mut watch = Liveness::new(&inbound.ring, shared.options.liveness_timeout);
    let mut stand_back = shared.operations.join_as_reader();
    let end = loop {
        if stand_back.operations_poll() {
            // An operation takes frames itself: stand back until it stops (it wakes this thread)
            // or a nap passes without a poll, watching the writer's liveness meanwhile.
            if shared.stop.load(Ordering::Relaxed) {
                break LinkEnd::Stopped;
            }
            stand_back.nap();
            if watch.check(&inbound.ring).is_none() {
                continue;
            }
            // The writer is gone: deliver the frames it completed (below), then report the loss.
        }
        if let Err(end) = wait_for_data(shared, inbound, &mut watch, Some(stand_back.polls_seen())) {
            break end;
        }
        let _reading = lock(&inbound.read);
        if inbound.available() == 0 {
            // A polling operation took it.
            continue;
        }
        match take_frame(shared, inbound, route, Some(&mut watch)) {
            Ok(Some(taken)) => {
                if !deliver_taken(route, inbound.peer, taken) {
                    return;
                }
            }
            Ok(None) => {}
            Err(end) => break end,
        }
    };
    link_ended(shared, inbound, route, &end);
}

/// Hands a taken frame to the endpoint; `false` once nobody receives any more.
fn deliver_taken(route: &Route, from: usize, taken: Taken) -> bool {
    match (taken, route) {
        (Taken::Lent { header, payload }, Route::Push(sink)) => match sink.upgrade() {
            Some(sink) => {
                sink.lent_frame(from, header, payload);
                true
            }
            None => false,
        },
        (Taken::Copied(bytes), route) => deliver(route, TransportEvent::Frame { from, bytes }),
        // `take_frame` lends only on a push route.
        (Taken::Lent { .. }, Route::Pull(_)) => false,
    }
}

/// Reports the end of the link from the inbound ring's peer (once) and tells its writer.
fn link_ended(shared: &ShmShared, inbound: &Inbound, route: &Route, end: &LinkEnd) {
    let why = match end {
        LinkEnd::Stopped => return,
        LinkEnd::Silent => "heartbeat stopped",
        LinkEnd::Exited => "process exited",
        LinkEnd::Closed => "closed",
    };
    let peer = inbound.peer;
    inbound.ring.close_reader();
    lock(&shared.lost).insert(peer);
    if lock(&shared.reported).insert(peer) {
        tracing::info!(rank = shared.rank, peer, pid = inbound.ring.writer_pid(), why, "shared-memory peer lost");
        deliver(route, TransportEvent::PeerLost(peer));
    }
}

/// Takes the next frame at the read position; the caller holds the read lock. With `watch` (the
/// reader thread) it blocks until the frame is there; without (a polling operation) it takes only
/// a slot that is complete and lendable, and returns `None` otherwise. Pad records are skipped.
fn take_frame(shared: &ShmShared, inbound: &Arc<Inbound>, route: &Route, mut watch: Option<&mut Liveness>) -> std::result::Result<Option<Taken>, LinkEnd> {
    let ring = &inbound.ring;
    loop {
        if inbound.available() < HEADER_LEN {
            match watch.as_deref_mut() {
                Some(watch) => wait_until(shared, inbound, HEADER_LEN, watch, None)?,
                None => return Ok(None),
            }
        }
        let mut header = [MaybeUninit::<u8>::uninit(); HEADER_LEN];
        ring.read_at(inbound.rpos(), &mut header);
        // SAFETY: `read_at` initialised every byte.
        let header: [u8; HEADER_LEN] = unsafe { std::mem::transmute::<[MaybeUninit<u8>; HEADER_LEN], [u8; HEADER_LEN]>(header) };
        if header[..8] == PAD_MAGIC.to_le_bytes() {
            let pad = u64::from_le_bytes([header[8], header[9], header[10], header[11], header[12], header[13], header[14], header[15]]) as usize;
            let pos = inbound.rpos() as usize & (ring.capacity - 1);
            if pad < SLOT_ALIGN || pos + pad != ring.capacity {
                tracing::warn!(rank = shared.rank, peer = inbound.peer, pad, pos, "bad pad record in ring, dropping link");
                return Err(LinkEnd::Closed);
            }
            if inbound.available() < pad {
                match watch.as_deref_mut() {
                    Some(watch) => wait_until(shared, inbound, pad, watch, None)?,
                    None => return Ok(None),
                }
            }
            inbound.consume(pad, false);
            continue;
        }
        let payload_len = match decode_header(&header, shared.options.max_payload_bytes) {
            // Bounded by the cap just checked, so it fits in usize.
            Ok(h) => h.payload_len as usize,
            Err(error) => {
                tracing::warn!(rank = shared.rank, peer = inbound.peer, %error, "bad frame header in ring, dropping link");
                return Err(LinkEnd::Closed);
            }
        };
        let slot = round_up(HEADER_LEN + payload_len, SLOT_ALIGN);
        let lendable = matches!(route, Route::Push(_)) && slot <= lend_max(ring.capacity) && inbound.pinned_after(slot) <= ring.capacity / 2;
        if lendable {
            if inbound.available() < slot {
                match watch.as_deref_mut() {
                    Some(watch) => wait_until(shared, inbound, slot, watch, None)?,
                    None => return Ok(None),
                }
            }
            let payload_at = ring.data_at(inbound.rpos() + HEADER_LEN as u64);
            let token = inbound.consume(slot, true);
            let lender: Arc<dyn Lender> = Arc::clone(inbound) as Arc<dyn Lender>;
            // SAFETY: the slot does not wrap (the writer pads before slots up to half the ring),
            // is published, and stays reserved (head does not pass it) until this `LentBytes` is
            // dropped and calls `release(token)`; `lender` keeps the mapping alive.
            let payload = unsafe { LentBytes::new(payload_at, payload_len, lender, token) };
            return Ok(Some(Taken::Lent { header, payload }));
        }
        // Copy it out as it arrives; only the reader thread waits for that.
        let Some(watch) = watch.as_deref_mut() else { return Ok(None) };
        inbound.consume(HEADER_LEN, false);
        let mut buf = shared.pool.take(HEADER_LEN + payload_len);
        buf.extend_from_slice(&header);
        let mut filled = 0;
        while filled < payload_len {
            let n = inbound.available().min(payload_len - filled);
            if n == 0 {
                wait_until(shared, inbound, 1, watch, None)?;
                continue;
            }
            ring.read_at(inbound.rpos(), &mut buf.spare_capacity_mut()[filled..filled + n]);
            inbound.consume(n, false);
            filled += n;
        }
        // SAFETY: the loop initialised the `payload_len` bytes after the header.
        unsafe { buf.set_len(HEADER_LEN + payload_len) };
        let gap = slot - HEADER_LEN - payload_len;
        if gap > 0 {
            wait_until(shared, inbound, gap, watch, None)?;
            inbound.consume(gap, false);
        }
        return Ok(Some(Taken::Copied(buf)));
    }
}

/// Hands `event` to the endpoint; `false` once nobody receives any more.
fn deliver(route: &Route, event: TransportEvent) -> bool {
    match route {
        Route::Push(sink) => match sink.upgrade() {
            Some(sink) => {
                sink.event(event);
                true
            }
            None => false,
        },
        Route::Pull(events) => events.blocking_send(event).is_ok(),
    }
}

/// What a reader knows of its writer's liveness: the heartbeat as last seen, when it may probe
/// the writer's lock again, and the verdict once the writer is gone (final: a link never comes
/// back).
struct Liveness {
    beat: u64,
    seen: Instant,
    timeout: Duration,
    next_probe: Instant,
    gone: Option<LinkEnd>,
}

impl Liveness {
    fn new(ring: &Ring, timeout: Duration) -> Self {
        let now = Instant::now();
        Liveness { beat: ring.atomic(OFF_WRITER_BEAT).load(Ordering::Acquire), seen: now, timeout, next_probe: now, gone: None }
    }

    /// The verdict so far, without looking again.
    fn gone(&self) -> Option<LinkEnd> {
        self.gone
    }

    /// Looks again (called only by a reader about to sleep or standing back): whether the
    /// writer's process exited (its lock, probed at most every [`PROBE_INTERVAL`]) or its
    /// heartbeat has not moved for the timeout. Once gone, `tail` is final.
    fn check(&mut self, ring: &Ring) -> Option<LinkEnd> {
        if self.gone.is_some() {
            return self.gone;
        }
        let now = Instant::now();
        if now >= self.next_probe {
            self.next_probe = now + PROBE_INTERVAL;
            if ring.writer_gone() {
                self.gone = Some(LinkEnd::Exited);
                return self.gone;
            }
        }
        let beat = ring.atomic(OFF_WRITER_BEAT).load(Ordering::Acquire);
        if beat != self.beat {
            self.beat = beat;
            self.seen = now;
        } else if now.duration_since(self.seen) > self.timeout {
            self.gone = Some(LinkEnd::Silent);
        }
        self.gone
    }
}

/// Waits (without the read lock) until the ring has unread data, or (with `polls_seen`) until an
/// operation polls: the reader thread then stands back (see `read_frames`).
fn wait_for_data(shared: &ShmShared, inbound: &Inbound, watch: &mut Liveness, polls_seen: Option<u64>) -> std::result::Result<(), LinkEnd> {
    wait_until(shared, inbound, 1, watch, polls_seen)
}

/// Waits until at least `want` unread bytes are published: spins briefly, then sleeps on the
/// futex, waking at the heartbeat period to check liveness. Returns early, with nothing new, when
/// `polls_seen` is given and `poll_incoming` was called since. Fails once the writer is gone or
/// closed with fewer bytes published (a frame it died in the middle of is never completed), or
/// this rank stops reading.
fn wait_until(shared: &ShmShared, inbound: &Inbound, want: usize, watch: &mut Liveness, polls_seen: Option<u64>) -> std::result::Result<(), LinkEnd> {
    let ring = &inbound.ring;
    let mut idle = 0u32;
    loop {
        if inbound.available() >= want {
            return Ok(());
        }
        if let Some(end) = watch.gone() {
            // The writer's `tail` was final when the verdict was made.
            return Err(end);
        }
        if polls_seen.is_some_and(|seen| shared.operations.polls() != seen) {
            return Ok(());
        }
        if shared.stop.load(Ordering::Relaxed) || ring.reader_closed() {
            return Err(LinkEnd::Stopped);
        }
        if ring.writer_closed() {
            // Everything written before the flag is visible now.
            return if inbound.available() >= want { Ok(()) } else { Err(LinkEnd::Closed) };
        }
        if idle < SPIN_ROUNDS {
            idle += 1;
            std::hint::spin_loop();
            continue;
        }
        if watch.check(ring).is_some() {
            // Look at what it published once more (above), then fail.
            continue;
        }
        // Sleep while nothing new is published past what is there now.
        ring.sleep_for_data(ring.tail(), shared.options.heartbeat);
    }
}

/// Largest slot that is written without wrapping and may be lent: an eighth of the ring.
///
/// Why it cannot deadlock: a slot is lent only while the bytes pinned behind the oldest lent slot
/// stay within half the ring, and an operation holds at most three lent frames of one ring while it
/// waits for the next (the ring algorithms copy a forwarded frame out if more wait in their queue),
/// so the writer always has room for the next slot and a pad record: 1/2 + 3/8 + 1/8 of the ring.
fn lend_max(capacity: usize) -> usize {
    capacity / 8
}

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

/// Sleeps while `*word == expected`, at most `timeout`, across processes (non-private futex).
#[cfg(target_os = "linux")]
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        // Below 10^9, so it fits a c_long on every target.
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned 32-bit word for the duration of the call (it lives in a
    // mapping the caller keeps alive); FUTEX_WAIT only reads it. Errors (EAGAIN when the value
    // changed, EINTR, ETIMEDOUT) all mean "look again", which every caller does.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expected, &ts as *const libc::timespec, std::ptr::null::<u32>(), 0u32);
    }
}

/// Wakes every sleeper on `word`.
#[cfg(target_os = "linux")]
fn futex_wake(word: &AtomicU32) {
    // SAFETY: as for `futex_wait`; FUTEX_WAKE does not access memory through the pointer beyond
    // identifying the futex.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX, std::ptr::null::<libc::timespec>(), std::ptr::null::<u32>(), 0u32);
    }
}

#[cfg(not(target_os = "linux"))]
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    // No futex: poll at a fine period instead.
    if word.load(Ordering::SeqCst) == expected {
        std::thread::sleep(timeout.min(Duration::from_micros(50)));
    }
}

#[cfg(not(target_os = "linux"))]
fn futex_wake(_word: &AtomicU32) {}

fn ring_path(options: &ShmOptions, src: usize, dst: usize) -> PathBuf {
    options.dir.join(format!("rtx-{}-{src}-{dst}.ring", options.job))
}

fn io(op: &'static str, e: std::io::Error) -> Error {
    Error::Io { op, reason: e.to_string() }
}

#[cfg(test)]
mod tests;
