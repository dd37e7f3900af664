//! Shared-memory transport between processes on one machine.
//!
//! Each ordered pair of ranks `(src, dst)` has one single-producer single-consumer byte ring in a
//! memory-mapped file `<dir>/rtx-<job>-<src>-<dst>.ring` (`dir` defaults to `/dev/shm`). Frames are
//! written into the ring as a byte stream, back to back; the reader takes the 64-byte header,
//! validates it (including the payload cap) before reading the payload into a pooled buffer, and
//! hands the frame to the endpoint, which checks the checksum. Frames larger than the ring stream
//! through it.
//!
//! Ring layout: a 4 KiB control page (magic, capacity, then `head`, `tail`, the writer's heartbeat
//! and closed flag, and the reader's closed flag, each on its own cache line) followed by
//! `ring_bytes` of data. `head` is written only by the reader and `tail` only by the writer; both
//! count bytes since creation, so `tail - head` is the fill. A side publishes data or space with a
//! release store and observes the other's with an acquire load. The writer creates the file under a
//! temporary name and renames it once initialised, so a reader never maps a half-made ring.
//!
//! Liveness: every rank bumps the heartbeat of its outgoing rings every
//! [`ShmOptions::heartbeat`]. A reader that sees the writer's closed flag, or no heartbeat change
//! for [`ShmOptions::liveness_timeout`], reports [`TransportEvent::PeerLost`], and writers to that
//! peer fail. Waiting is polling: a few hundred yields, then 1 ms sleeps (tokio's timer
//! resolution); a futex or eventfd wake-up is the next step if latency matters.
//!
//! The reader removes a ring's file name as soon as it has mapped it (the writer removes it on drop
//! if no reader came), so crashed runs leave no files behind once connected. The job name must
//! still be unique per run: a ring left by a run that crashed while connecting could be mapped by an
//! early reader of a new run with the same name.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;

use crate::communicator::DEFAULT_MAX_PAYLOAD_BYTES;
use crate::error::{Error, Result};
use crate::frame::{decode_header, OpKind, HEADER_LEN};
use crate::pool::{BufferPool, PooledBuf};
use crate::transport::{BoxFuture, Transport, TransportEvent};

/// Most received frames waiting for the dispatcher before readers stop draining rings.
pub const SHM_INBOX_FRAMES: usize = 256;

const RING_MAGIC: u64 = u64::from_le_bytes(*b"RTXSHM01");
const CONTROL_BYTES: usize = 4096;
const OFF_MAGIC: usize = 0;
const OFF_CAPACITY: usize = 8;
const OFF_HEAD: usize = 64;
const OFF_TAIL: usize = 128;
const OFF_WRITER_BEAT: usize = 192;
const OFF_WRITER_CLOSED: usize = 256;
const OFF_READER_CLOSED: usize = 320;
/// Yields before falling back to 1 ms sleeps. More spinning measured slower on 2 cores: the
/// spinning reader takes the CPU its producer needs.
const SPIN_ROUNDS: u32 = 256;
const OPEN_RETRY: Duration = Duration::from_millis(5);
const _: () = assert!(OFF_READER_CLOSED + 8 <= CONTROL_BYTES);

/// Where and how rings are made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmOptions {
    /// Directory of the ring files (a tmpfs such as `/dev/shm`).
    pub dir: PathBuf,
    /// Job name, unique per run; part of every ring's file name.
    pub job: String,
    /// Data bytes per ring; a power of two.
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
    tasks: Vec<tokio::task::AbortHandle>,
}

struct ShmShared {
    rank: usize,
    world: usize,
    options: ShmOptions,
    outgoing: BTreeMap<usize, (Arc<Ring>, tokio::sync::Mutex<()>)>,
    incoming: BTreeMap<usize, Arc<Ring>>,
    lost: Mutex<BTreeSet<usize>>,
    events: mpsc::Sender<TransportEvent>,
    pool: BufferPool,
}

/// One mapped ring; see the module doc for the protocol.
struct Ring {
    /// Keeps the mapping `base` points into alive.
    _map: memmap2::MmapMut,
    base: *mut u8,
    capacity: usize,
    path: PathBuf,
    owned: bool,
}

// SAFETY: `base` points into `map`, which lives as long as the `Ring`. All shared mutation goes
// through atomics in the control page or through the SPSC protocol on the data area (a byte range is
// written only by the writer before it publishes `tail`, and read only by the reader before it
// publishes `head`); each side is driven by one task at a time (writers hold the per-peer lock).
unsafe impl Send for Ring {}
// SAFETY: as above.
unsafe impl Sync for Ring {}

enum LinkEnd {
    Closed,
    Silent,
}

impl Default for ShmOptions {
    fn default() -> Self {
        let shm = Path::new("/dev/shm");
        ShmOptions {
            dir: if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() },
            job: "rtx".into(),
            ring_bytes: 8 << 20,
            connect_timeout: Duration::from_secs(30),
            heartbeat: Duration::from_millis(100),
            liveness_timeout: Duration::from_secs(3),
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
        }
    }
}

impl ShmTransport {
    /// Creates this rank's outgoing rings, waits for every peer's ring towards it, and starts the
    /// readers and the heartbeat.
    pub async fn connect(rank: usize, world_size: usize, options: ShmOptions) -> Result<ShmTransport> {
        if rank >= world_size {
            return Err(Error::RankOutOfRange { rank, size: world_size });
        }
        if !options.ring_bytes.is_power_of_two() || options.ring_bytes < HEADER_LEN {
            return Err(Error::InvalidConfig { reason: "ring_bytes must be a power of two of at least 64" });
        }
        if options.heartbeat >= options.liveness_timeout {
            return Err(Error::InvalidConfig { reason: "heartbeat must be below liveness_timeout" });
        }
        let peers: Vec<usize> = (0..world_size).filter(|&p| p != rank).collect();
        let mut outgoing = BTreeMap::new();
        for &peer in &peers {
            let ring = Ring::create(&ring_path(&options, rank, peer), options.ring_bytes)?;
            outgoing.insert(peer, (Arc::new(ring), tokio::sync::Mutex::new(())));
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
            incoming.insert(peer, Arc::new(ring));
        }
        let (events, inbox) = mpsc::channel(SHM_INBOX_FRAMES);
        let shared =
            Arc::new(ShmShared { rank, world: world_size, options, outgoing, incoming, lost: Mutex::new(BTreeSet::new()), events, pool: BufferPool::new() });
        let mut tasks = vec![tokio::spawn(heartbeat(Arc::clone(&shared))).abort_handle()];
        for &peer in &peers {
            tasks.push(tokio::spawn(read_frames(Arc::clone(&shared), peer)).abort_handle());
        }
        Ok(ShmTransport { shared, inbox: tokio::sync::Mutex::new(inbox), tasks })
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
        Box::pin(async move {
            let lost = Error::PeerLost { rank: peer, op: OpKind::Send };
            let Some((ring, lock)) = self.shared.outgoing.get(&peer) else {
                return Err(Error::RankOutOfRange { rank: peer, size: self.shared.world });
            };
            let _writer = lock.lock().await;
            let mut written = 0;
            let mut idle = 0u32;
            while written < frame.len() {
                if self.shared.is_lost(peer) || ring.flag(OFF_READER_CLOSED) {
                    return Err(lost);
                }
                let n = ring.write_some(&frame[written..]);
                written += n;
                idle = if n > 0 { 0 } else { wait(idle).await };
            }
            Ok(())
        })
    }

    fn recv(&self) -> BoxFuture<'_, Option<TransportEvent>> {
        Box::pin(async move { self.inbox.lock().await.recv().await })
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        for (ring, _) in self.shared.outgoing.values() {
            ring.set_flag(OFF_WRITER_CLOSED);
        }
        for ring in self.shared.incoming.values() {
            ring.set_flag(OFF_READER_CLOSED);
        }
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

impl ShmShared {
    fn is_lost(&self, peer: usize) -> bool {
        lock(&self.lost).contains(&peer)
    }
}

impl Ring {
    fn create(path: &Path, capacity: usize) -> Result<Ring> {
        let staging = path.with_extension("staging");
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&staging).map_err(|e| io("create ring", e))?;
        file.set_len((CONTROL_BYTES + capacity) as u64).map_err(|e| io("size ring", e))?;
        // SAFETY: the file was just created by us at a private staging name; other processes map
        // it only after the rename below, and then only through the SPSC protocol.
        let mut map = unsafe { memmap2::MmapMut::map_mut(&file) }.map_err(|e| io("map ring", e))?;
        let base = map.as_mut_ptr();
        let ring = Ring { _map: map, base, capacity, path: path.to_path_buf(), owned: true };
        ring.atomic(OFF_CAPACITY).store(capacity as u64, Ordering::Relaxed);
        ring.atomic(OFF_MAGIC).store(RING_MAGIC, Ordering::Release);
        std::fs::rename(&staging, path).map_err(|e| io("publish ring", e))?;
        Ok(ring)
    }

    /// Maps the ring at `path` if its writer has published it.
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
        let ring = Ring { _map: map, base, capacity, path: path.to_path_buf(), owned: false };
        if ring.atomic(OFF_MAGIC).load(Ordering::Acquire) != RING_MAGIC || ring.atomic(OFF_CAPACITY).load(Ordering::Relaxed) != capacity as u64 {
            return Err(Error::InvalidConfig { reason: "peer ring is not an initialised ring of this size" });
        }
        // Both ends have it mapped now; dropping the name means a crash of either leaves nothing
        // behind in the directory.
        let _ = std::fs::remove_file(path);
        Ok(Some(ring))
    }

    fn atomic(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset % 8 == 0 && offset + 8 <= CONTROL_BYTES);
        // SAFETY: `offset` is inside the page-aligned control page, 8-byte aligned, and the location
        // is only ever accessed atomically (by both processes).
        unsafe { &*self.base.add(offset).cast::<AtomicU64>() }
    }

    fn flag(&self, offset: usize) -> bool {
        self.atomic(offset).load(Ordering::Acquire) != 0
    }

    fn set_flag(&self, offset: usize) {
        self.atomic(offset).store(1, Ordering::Release);
    }

    /// Writer side: copies as much of `src` as fits; returns the byte count.
    fn write_some(&self, src: &[u8]) -> usize {
        let tail = self.atomic(OFF_TAIL).load(Ordering::Relaxed);
        let head = self.atomic(OFF_HEAD).load(Ordering::Acquire);
        let used = tail.wrapping_sub(head) as usize;
        debug_assert!(used <= self.capacity, "ring: fill within capacity");
        let n = src.len().min(self.capacity - used);
        if n == 0 {
            return 0;
        }
        let start = (tail as usize) & (self.capacity - 1);
        let first = n.min(self.capacity - start);
        // SAFETY: bytes `tail..tail + n` (mod capacity) are free: the reader has published `head`
        // past them and reads nothing beyond `tail` until we publish it below.
        unsafe {
            let data = self.base.add(CONTROL_BYTES);
            std::ptr::copy_nonoverlapping(src.as_ptr(), data.add(start), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), data, n - first);
        }
        self.atomic(OFF_TAIL).store(tail + n as u64, Ordering::Release);
        n
    }

    /// Reader side: copies up to `dst.len()` available bytes; returns the byte count.
    fn read_some(&self, dst: &mut [u8]) -> usize {
        let head = self.atomic(OFF_HEAD).load(Ordering::Relaxed);
        let tail = self.atomic(OFF_TAIL).load(Ordering::Acquire);
        let available = tail.wrapping_sub(head) as usize;
        debug_assert!(available <= self.capacity, "ring: fill within capacity");
        let n = dst.len().min(available);
        if n == 0 {
            return 0;
        }
        let start = (head as usize) & (self.capacity - 1);
        let first = n.min(self.capacity - start);
        // SAFETY: bytes `head..head + n` (mod capacity) were published by the writer's release
        // store of `tail`, and it does not overwrite them until we publish `head` below.
        unsafe {
            let data = self.base.add(CONTROL_BYTES);
            std::ptr::copy_nonoverlapping(data.add(start), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(data, dst.as_mut_ptr().add(first), n - first);
        }
        self.atomic(OFF_HEAD).store(head + n as u64, Ordering::Release);
        n
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

async fn heartbeat(shared: Arc<ShmShared>) {
    let mut interval = tokio::time::interval(shared.options.heartbeat);
    loop {
        interval.tick().await;
        for (ring, _) in shared.outgoing.values() {
            ring.atomic(OFF_WRITER_BEAT).fetch_add(1, Ordering::Release);
        }
    }
}

async fn read_frames(shared: Arc<ShmShared>, peer: usize) {
    let Some(ring) = shared.incoming.get(&peer) else {
        return;
    };
    let mut header = [0u8; HEADER_LEN];
    let end = loop {
        if let Err(end) = read_exact(&shared, ring, &mut header).await {
            break end;
        }
        let payload_len = match decode_header(&header, shared.options.max_payload_bytes) {
            // Bounded by the cap just checked, so it fits in usize.
            Ok(h) => h.payload_len as usize,
            Err(error) => {
                tracing::warn!(rank = shared.rank, peer, %error, "bad frame header in ring, dropping link");
                break LinkEnd::Closed;
            }
        };
        let mut buf = shared.pool.take(HEADER_LEN + payload_len);
        buf.extend_from_slice(&header);
        buf.resize(HEADER_LEN + payload_len, 0);
        if let Err(end) = read_exact(&shared, ring, &mut buf[HEADER_LEN..]).await {
            break end;
        }
        if shared.events.send(TransportEvent::Frame { from: peer, bytes: buf }).await.is_err() {
            return;
        }
    };
    let why = match end {
        LinkEnd::Closed => "closed",
        LinkEnd::Silent => "heartbeat stopped",
    };
    tracing::info!(rank = shared.rank, peer, why, "shared-memory peer lost");
    ring.set_flag(OFF_READER_CLOSED);
    lock(&shared.lost).insert(peer);
    let _ = shared.events.send(TransportEvent::PeerLost(peer)).await;
}

async fn read_exact(shared: &ShmShared, ring: &Ring, dst: &mut [u8]) -> std::result::Result<(), LinkEnd> {
    let mut filled = 0;
    let mut idle = 0u32;
    let mut beat = ring.atomic(OFF_WRITER_BEAT).load(Ordering::Acquire);
    let mut beat_seen = tokio::time::Instant::now();
    while filled < dst.len() {
        let n = ring.read_some(&mut dst[filled..]);
        filled += n;
        if n > 0 {
            idle = 0;
            continue;
        }
        if ring.flag(OFF_WRITER_CLOSED) {
            // Everything written before the flag is visible now; take it before giving up.
            let n = ring.read_some(&mut dst[filled..]);
            filled += n;
            if n == 0 {
                return Err(LinkEnd::Closed);
            }
            continue;
        }
        let now_beat = ring.atomic(OFF_WRITER_BEAT).load(Ordering::Acquire);
        if now_beat != beat {
            beat = now_beat;
            beat_seen = tokio::time::Instant::now();
        } else if beat_seen.elapsed() > shared.options.liveness_timeout {
            return Err(LinkEnd::Silent);
        }
        idle = wait(idle).await;
    }
    Ok(())
}

/// Backs off while a ring is empty or full: yields a little first, then sleeps a timer tick at a
/// time.
async fn wait(idle: u32) -> u32 {
    if idle < SPIN_ROUNDS {
        tokio::task::yield_now().await;
    } else {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    idle.saturating_add(1)
}

fn ring_path(options: &ShmOptions, src: usize, dst: usize) -> PathBuf {
    options.dir.join(format!("rtx-{}-{src}-{dst}.ring", options.job))
}

fn io(op: &'static str, e: std::io::Error) -> Error {
    Error::Io { op, reason: e.to_string() }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // One set insertion or lookup per critical section; a panic cannot leave it half-done.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
