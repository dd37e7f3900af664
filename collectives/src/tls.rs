//! [`TlsTransport`]: collective frames over TCP with mutual TLS 1.3, one writer and one reader OS
//! thread per connection, for bulk tensors between processes and machines at the speed the cores
//! allow.
//!
//! Why beside QUIC: measured on a 16-core host (BENCHMARKS.md, issue 20), QUIC moves a 64 MiB
//! all_reduce at half of Gloo's TCP: per byte and rank quinn adds two user-space copies and
//! per-packet work (a packet of at most 64 KiB on loopback, 8,952 bytes on a datacenter link, each
//! sealed, opened and acknowledged on its own) to the two AES-GCM passes, and all of it runs on the
//! task that drives the connection. Here the kernel's TCP segments and acknowledges (64 KiB
//! segments with GSO/GRO whatever the MTU), records are 16 KiB, and each direction of a connection
//! is a thread of its own: the sending operation seals its frame straight from its memory into
//! records (no copy first) and the writer writes them; the reader reads into pooled buffers, opens
//! the records in place and hands their plaintext to the endpoint as pieces of those buffers
//! ([`EventSink::chunked_frame`]) without copying. A payload the receiver reads once (a ring's
//! frames: [`crate::frame::FLAG_COPIED`]) is not opened by the reader but handed on sealed, and the
//! operation opens it where it is used ([`sealed`]): straight into the output for an all-gather
//! step, or one record at a time into cache to be combined. And a ring's Forward step combines a
//! received piece with its own data as it sends it on ([`Transport::send_filled`]): each outgoing
//! record's plaintext is computed in place in the record buffer and sealed there
//! ([`record::Sealer::seal_filled`]), so a reduce-scatter byte is opened, combined and sealed
//! while one 16 KiB record is in cache, with no intermediate buffer. An operation waiting for a
//! small frame reads its connection itself rather than wait for the reader thread to wake it
//! ([`Transport::poll_incoming`], see [`LinkReads`]). QUIC stays the transport of the control
//! plane and where one connection must not stall another's packets.
//!
//! Security is the QUIC transport's: rustls runs a TLS 1.3 handshake with the cluster CA on both
//! sides ([`crate::server_tls_config`], [`crate::client_tls_config`]); the dialer checks that the
//! acceptor's certificate names the rank it dialed, the acceptor that the dialer's names the rank
//! its hello claims. The records after the handshake are sealed and opened by this crate with the
//! traffic keys rustls derived ([`record`]), key updates included.
//!
//! Links: the lower rank dials the higher (like QUIC), [`TlsOptions::stripes`] TCP connections per
//! pair (a small frame on connection `(sequence + chunk) % stripes`, where its receiver looks for
//! it; a large one on the round-robin turn's or another with a free sealer: [`Link::claim`]).
//! Each connection starts with a hello record (rank, stripe, count) that the acceptor echoes; a
//! link is installed when all of its stripes are up.
//! Failure: a connection that breaks (reset, a record that does not authenticate, a frame header
//! past the payload cap) takes its link down; the peer is reported lost once every frame its
//! readers had was delivered. Dropping the transport lets queued frames reach the peers (writers
//! finish, then half-close) while readers discard what still arrives; [`Transport::abort`] shuts
//! every socket at once. A killed peer's kernel closes its sockets, so its loss shows at once; a
//! stopped (SIGSTOP) peer's kernel still acknowledges and answers keep-alives, so a transport
//! cannot see it: the operation timeout and the supervisor's heartbeats do (then `abort`), as the
//! elastic tests check for both.

mod handshake;
mod record;
mod sealed;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::net::{SocketAddr, TcpStream as StdTcpStream};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Duration;

use rustls::pki_types::ServerName;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

use crate::error::{Error, Result};
use crate::frame::{decode_header, header_payload_len, header_place, place, OpKind, HEADER_LEN};
use crate::linking::{self, PendingLinks, StripeId};
use crate::pool::{BufferPool, PooledBuf};
use crate::quic::{certificate_names_rank, client_tls_config_with, rank_name, server_tls_config_with, Cipher, NodeIdentity, CHUNKED_FRAME_MIN_BYTES, MAX_STRIPES};
use crate::stand_back::PollingOperations;
use crate::sync::{lock, try_lock};
use crate::transport::{AwaitedFrame, BoxFuture, ChunkedBytes, EventSink, FillPayload, SealedPayload, Transport, TransportEvent};
use handshake::Established;
use record::{record_len, FillFailed, Opened, Opener, RecordBuf, RecordError, SealedRecord, Sealer, MAX_RECORD, RECORD_HEADER_LEN};
use sealed::{SealedPiece, SealedRecords, StreamPosition, EAGER_BODY_MAX};

/// ALPN of the TLS transport's connections.
pub const TLS_ALPN: &[u8] = b"rtx-collectives-tls/1";
/// Events buffered for a pulling receiver.
pub const TLS_INBOX_FRAMES: usize = 256;
/// Records sealed under one key before a key update, by default (2^22 records of 16 KiB: 64 GiB);
/// the suite's confidentiality limit caps it too (see [`record`]).
pub const DEFAULT_KEY_UPDATE_RECORDS: u64 = 1 << 22;

/// [`Transport::preferred_chunk_bytes`] of TLS: 1 MiB frames. Against the default 512 KiB they
/// gave +2-5% busbw at 16 and 64 MiB on the 16-core host (2 and 4 ranks, 2 cores each) and +3-19%
/// on the 2-core VM (BENCHMARKS.md, 2026-12-06 evening): half the frames, so half the per-frame
/// work (headers, wake-ups, slots), with 64 records each still far from a socket buffer's size.
pub const TLS_CHUNK_BYTES: usize = 1 << 20;
const HELLO_MAGIC: [u8; 4] = *b"RTXT";
const HELLO_LEN: usize = 12;
/// Frames queued per connection before a send waits.
const SEND_QUEUE_FRAMES: usize = 16;
/// Record buffers a connection keeps for reuse once written (one per queued frame, and one being
/// sealed).
const SPARE_RECORD_BUFS: usize = SEND_QUEUE_FRAMES + 1;
/// Larger record buffers are not kept for reuse (a frame that large is rare: the ring's frames are
/// `chunk_bytes`, 512 KiB by default).
const SPARE_RECORD_BUF_MAX_BYTES: usize = 4 << 20;
/// A reader's buffer: what one `recv` may bring.
const READ_BUF_BYTES: usize = 256 << 10;
const _: () = assert!(READ_BUF_BYTES >= 2 * MAX_RECORD);
/// How often a blocked reader looks whether its transport is closing.
const READ_TICK: Duration = Duration::from_millis(250);
/// Largest payload an operation waits for by reading its connection itself (see [`LinkReads`]);
/// a larger frame is read by the reader threads while the operation sleeps. The ring's frames at
/// 16 MiB and more are [`TLS_CHUNK_BYTES`], above it; a 1 MiB all_reduce's (512 KiB between 2
/// ranks) are polled, which took it from ~670 to ~400 us on the 2-vCPU VM but from ~434 to ~450
/// us on the 16-core host (4 ranks there: ~850 to ~683 us); 4 and 64 KiB gained on both.
const POLL_MAX_PAYLOAD: usize = 512 << 10;
/// Largest group whose mid-size all_reduce runs the direct exchange over TLS
/// ([`Transport::preferred_direct_all_reduce_ranks`]).
const DIRECT_ALL_REDUCE_RANKS: usize = 8;

const OPEN: u8 = 0;
const CLOSING: u8 = 1;
const ABORTED: u8 = 2;

/// Timeouts and limits of a [`TlsTransport`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsOptions {
    /// How long [`TlsTransport::connect`] waits for every link (and one handshake may take).
    pub connect_timeout: Duration,
    /// Unacknowledged data older than this breaks the connection (`TCP_USER_TIMEOUT`), and a
    /// silent peer is probed by keep-alives within it; also how long a dropped transport's
    /// readers wait for the peers to finish.
    pub idle_timeout: Duration,
    /// Keep-alive probe interval (below `idle_timeout`).
    pub keep_alive: Duration,
    /// Frames declaring a larger payload break the connection; match [`crate::CommConfig`].
    pub max_payload_bytes: usize,
    /// TCP connections per peer pair (1 to [`MAX_STRIPES`]); the dialing (lower) rank's value
    /// decides. Each has its own writer and reader thread.
    pub stripes: usize,
    /// Records sealed under one key before this end updates it.
    pub key_update_records: u64,
    /// The AEAD offered in the handshakes ([`Cipher::Auto`]: by this CPU; the dialer's order
    /// decides).
    pub cipher: Cipher,
}

impl Default for TlsOptions {
    fn default() -> Self {
        TlsOptions {
            connect_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(10),
            keep_alive: Duration::from_secs(2),
            max_payload_bytes: crate::DEFAULT_MAX_PAYLOAD_BYTES,
            stripes: 1,
            key_update_records: DEFAULT_KEY_UPDATE_RECORDS,
            cipher: Cipher::Auto,
        }
    }
}

/// A rank's TCP listener and its TLS links to every other rank.
pub struct TlsTransport {
    shared: Arc<Shared>,
    inbox: tokio::sync::Mutex<mpsc::Receiver<TransportEvent>>,
    accept_task: tokio::task::AbortHandle,
}

struct Shared {
    rank: usize,
    world: usize,
    options: TlsOptions,
    local_addr: SocketAddr,
    client_config: Arc<rustls::ClientConfig>,
    server_config: Arc<rustls::ServerConfig>,
    links: Mutex<BTreeMap<usize, Link>>,
    pending: Mutex<PendingLinks<Connected>>,
    lost: Mutex<BTreeSet<usize>>,
    unlinked: Mutex<BTreeSet<usize>>,
    dial_errors: Mutex<BTreeMap<usize, String>>,
    links_changed: watch::Sender<()>,
    /// Where reader threads deliver, once the endpoint attached or polled.
    route: Mutex<Option<Route>>,
    route_set: Condvar,
    pull_events: Mutex<Option<mpsc::Sender<TransportEvent>>>,
    pool: BufferPool,
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
    /// `OPEN`, `CLOSING` (dropped or closed: writers finish, readers discard) or `ABORTED`.
    state: AtomicU8,
    next_serial: AtomicU64,
    /// Writer threads still running.
    writers: watch::Sender<usize>,
    /// Set by [`Transport::abort`]: a pulling receiver gets `None` from then on.
    aborted: watch::Sender<bool>,
    /// Frames delivered with their payload left sealed ([`sealed`]).
    left_sealed: AtomicU64,
    /// Frames the sending thread began writing and a writer thread finished ([`Claim::deliver`]).
    finished_by_writer: AtomicU64,
    /// Frames read and delivered by operations polling for them ([`LinkReads`]).
    read_by_operations: AtomicU64,
}

/// Where reader threads deliver events.
#[derive(Clone)]
enum Route {
    Push(Weak<dyn EventSink>),
    Pull(mpsc::Sender<TransportEvent>),
}

/// Every connection to one peer.
#[derive(Clone)]
struct Link {
    sockets: LinkSockets,
    stripes: Arc<Vec<Stripe>>,
    /// The round-robin turn of large frames.
    next: Arc<AtomicUsize>,
    reads: Arc<LinkReads>,
}

/// The receiving halves of a link's connections, for its reader threads and for operations
/// polling for their frames ([`Transport::poll_incoming`]).
///
/// Decision (issue 20): an operation about to wait for a small frame (at most
/// [`POLL_MAX_PAYLOAD`]) reads its connection itself, as over shared memory: it takes the
/// connection's read lock and reads what has arrived, in a short spin before it sleeps. That saves
/// the two wake-ups of the reader-thread path (the reader's, then the operation's), most of a small
/// all_reduce's time: 4 KiB between 2 ranks went from ~42 to ~7 us on the 2-vCPU VM. Small frames
/// are placed on connection `(sequence + chunk) % count` by the sender
/// ([`crate::frame::header_place`]), so the operation knows which connection its frame comes on.
/// While operations poll a link, its reader threads stand back ([`crate::stand_back`]) and leave
/// what arrives to them; an operation that stops polling to sleep ([`Transport::poll_ended`])
/// wakes them. Nothing depends on an operation reading: a reader thread
/// reads whatever no operation took within a nap, so frames are always delivered. Tried and
/// rejected for large frames: that the bytes would then be copied in by the core that opens them
/// did not make opening them cheaper (a 1 MiB frame's first records have left the cache by the
/// time its last arrives), and spinning while it trickles in cost 5-8% of busbw at 4 ranks on 2
/// cores.
struct LinkReads {
    inbound: Vec<Arc<Inbound>>,
    /// The operations polling this link's connections, and its reader threads.
    operations: PollingOperations,
}

/// One connection's receiving half.
struct Inbound {
    socket: Arc<StdTcpStream>,
    /// Whoever holds it reads: the reader thread, or a polling operation.
    side: Mutex<ReadSide>,
    /// Set once the reader thread went through what the handshake had read: operations may
    /// read from then on.
    ready: AtomicBool,
    /// Set when the stream ended (the reader thread then ends the connection).
    ended: AtomicBool,
}

/// Where one connection's receiving stands between reads: the read key, the bytes read and not
/// yet cut into whole records, and the plaintext stream's position.
struct ReadSide {
    opener: Opener,
    frames: FrameCutter,
    position: StreamPosition,
    /// Plaintext bytes of the payload being left sealed that have not arrived yet.
    sealed_left: usize,
    buf: PooledBuf,
    /// How the stream ended, once it did, for the reader thread.
    ended: Option<std::result::Result<(), String>>,
}

/// What one read came to.
enum Round {
    /// Bytes were read; this many frames were delivered.
    Delivered(usize),
    /// Nothing to read now.
    Nothing,
    /// The stream ended ([`ReadSide::ended`] says how).
    Ended,
}

/// A link's sockets, for its reader threads to shut down. They hold no queue sender: a writer ends
/// when the transport lets go of its queue, whatever the readers are doing.
#[derive(Clone)]
struct LinkSockets {
    serial: u64,
    sockets: Arc<Vec<Arc<StdTcpStream>>>,
    /// Opened once the link's `PeerUp` is delivered (at once when none is due): readers deliver
    /// no frame before it.
    up: Arc<Gate>,
}

/// A one-way gate between threads.
struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
}

impl Gate {
    fn new(open: bool) -> Self {
        Gate { open: Mutex::new(open), opened: Condvar::new() }
    }

    fn open(&self) {
        *lock(&self.open) = true;
        self.opened.notify_all();
    }

    /// Waits until the gate opens (`true`) or `shared` closes (`false`).
    fn wait(&self, shared: &Shared) -> bool {
        let mut open = lock(&self.open);
        while !*open {
            if shared.closing() {
                return false;
            }
            open = self.opened.wait_timeout(open, READ_TICK).unwrap_or_else(std::sync::PoisonError::into_inner).0;
        }
        true
    }
}

impl LinkSockets {
    fn shutdown(&self) {
        for socket in self.sockets.iter() {
            let _ = socket.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// One connection's sending half: frames are sealed by the task that sends them (so the cipher
/// runs on as many threads as there are sending operations) into record buffers, written by that
/// task when the connection's writer thread is idle and the socket has room, else queued for the
/// writer thread, which only writes them and hands the buffers back.
struct Stripe {
    queue: mpsc::Sender<RecordBuf>,
    /// Held from sealing a frame until its records are queued: records leave in sequence order.
    sealer: Mutex<Sealer>,
    /// Written record buffers, for the next frames.
    spare: Arc<Mutex<Vec<RecordBuf>>>,
    /// The connection, for a frame written by the thread that sealed it ([`Claim::deliver`]).
    socket: Arc<StdTcpStream>,
    /// Frames queued for the writer thread and not yet written whole: changed only under the
    /// sealer (up) and by the writer after a frame's last byte (down), so 0 under the sealer
    /// means the writer is idle and a frame written now keeps the records' order.
    unwritten: Arc<AtomicUsize>,
}

impl Stripe {
    /// The stripe's queue slot and sealer at once if both are free now, without waiting.
    fn try_claim(&self) -> Option<Claim<'_>> {
        let sealer = try_lock(&self.sealer)?;
        let permit = self.queue.try_reserve().ok()?;
        Some(Claim { permit, sealer, stripe: self, inline: false })
    }

    /// Frames sealed for this connection that its writer has not taken yet.
    fn backlog(&self) -> usize {
        self.queue.max_capacity() - self.queue.capacity()
    }

    /// The stripe's queue slot (waiting for the writer to take records if the queue is full),
    /// then its sealer.
    async fn claim(&self) -> std::result::Result<Claim<'_>, SendFailed> {
        let permit = self.queue.reserve().await.map_err(|_| SendFailed::Closed)?;
        Ok(Claim { permit, sealer: lock(&self.sealer), stripe: self, inline: false })
    }
}

/// A stripe claimed for one frame: a place in its writer's queue and its sealer, held from sealing
/// the frame until its records are queued, so records leave in sequence order.
struct Claim<'a> {
    permit: mpsc::Permit<'a, RecordBuf>,
    sealer: MutexGuard<'a, Sealer>,
    stripe: &'a Stripe,
    /// The frame may be written by the sealing thread ([`Claim::deliver`]): small frames only.
    inline: bool,
}

impl Claim<'_> {
    /// Seals `parts` (one frame) into records and delivers them.
    fn send<'p>(mut self, parts: impl IntoIterator<Item = &'p [u8]>) -> std::result::Result<(), SendFailed> {
        let mut records = lock(&self.stripe.spare).pop().unwrap_or_default();
        self.sealer.seal_parts(parts, &mut records).map_err(SendFailed::Seal)?;
        self.deliver(records)
    }

    /// Hands a sealed frame to the connection, the sealer still held: a small frame
    /// ([`Claim::inline`]), when the writer thread is idle (nothing queued or being written), is
    /// written here at once, as far as the socket takes it without waiting, with no wake-up of
    /// the writer; what the socket does not take, a large frame, or any frame when the writer is
    /// busy, is queued for the writer thread.
    fn deliver(self, mut records: RecordBuf) -> std::result::Result<(), SendFailed> {
        let stripe = self.stripe;
        if self.inline && stripe.unwritten.load(Ordering::Acquire) == 0 {
            match write_without_waiting(&stripe.socket, records.as_slice()) {
                Ok(n) => records.mark_written(n),
                Err(_) => {
                    // The reader and the writer find the connection shut and end the link.
                    let _ = stripe.socket.shutdown(std::net::Shutdown::Both);
                    return Err(SendFailed::Closed);
                }
            }
            if records.as_slice().is_empty() {
                records.clear();
                let mut spare = lock(&stripe.spare);
                if spare.len() < SPARE_RECORD_BUFS && records.capacity() <= SPARE_RECORD_BUF_MAX_BYTES {
                    spare.push(records);
                }
                return Ok(());
            }
        }
        stripe.unwritten.fetch_add(1, Ordering::AcqRel);
        self.permit.send(records);
        Ok(())
    }

    /// Seals a frame whose payload `fill` writes into the records as they are sealed
    /// ([`Sealer::seal_filled`]) and queues it, whole or not at all: if `fill` fails, the records
    /// sealed for the frame are dropped and the sealer rewound to before it.
    fn send_filled(mut self, header: &[u8], len: usize, fill: &mut FillPayload<'_>) -> std::result::Result<(), SendFailed> {
        let mut records = lock(&self.stripe.spare).pop().unwrap_or_default();
        let mark = self.sealer.mark();
        let start = records.len();
        self.sealer.seal_parts([header], &mut records).map_err(SendFailed::Seal)?;
        match self.sealer.seal_filled(len, &mut records, &mut *fill) {
            Ok(()) => self.deliver(records),
            Err(FillFailed::Record(e)) => Err(SendFailed::Seal(e)),
            Err(FillFailed::Fill(error)) => {
                let broken = !self.sealer.rewind(mark);
                records.truncate(start);
                lock(&self.stripe.spare).push(records);
                Err(SendFailed::Fill { error, broken })
            }
        }
    }
}

/// Why a [`Claim`] sent nothing.
enum SendFailed {
    /// The writer is gone (the connection broke or the link was replaced).
    Closed,
    /// Keys could not be updated: records may have been sealed that never go out, so the
    /// connection's sequence is broken and the link must go.
    Seal(RecordError),
    /// The payload's producer failed ([`Claim::send_filled`]); the records sealed for it were
    /// taken back (`broken`: not possible past a key update, so the link must go).
    Fill { error: Error, broken: bool },
}

/// What a reader thread starts from beside its [`ReadSide`]: the peer's data rustls opened itself
/// during the handshake (the sealed records it read past the handshake are in the side's buffer).
struct ReaderStart {
    opened: Vec<u8>,
    /// This reader delivers the link's `PeerUp` (the peer came back) and opens the gate.
    announces_up: bool,
}

/// A connection whose handshake and hello exchange are done.
struct Connected {
    stream: TcpStream,
    established: Established,
}

impl Link {
    /// A stripe for a frame of `payload_len` bytes with placement `place`
    /// ([`crate::frame::header_place`]). A small frame (at most [`POLL_MAX_PAYLOAD`], which the
    /// receiving operation may read itself, see [`LinkReads`]) goes on stripe `place % count`,
    /// where the receiver looks for it, and is written by the sealing thread when the writer is
    /// idle ([`Claim::deliver`]). A large one takes the round-robin turn's stripe if its sealer
    /// is free now; else another whose sealer and queue are free and whose writer has no more
    /// frames queued than the turn's (so a frame does not wait behind another being sealed while
    /// a connection idles, and is not put behind a longer backlog to avoid that wait); else the
    /// turn's, waiting; and its writer thread writes it.
    ///
    /// Decision (issue 20, BENCHMARKS.md 2026-12-07): on the 16-core host both the fixed
    /// placement and the sealing thread's write cost large frames 2.5-3% each at 4 ranks (22
    /// alternated rounds): channels sharing a connection then wait for its sealer while another
    /// is free, and a sealer held through the write serialises them further; on 2 cores the
    /// write gained 8-17%, but the bar is on the host. Small frames are about latency, where
    /// both pay.
    async fn claim(&self, place: u64, payload_len: usize) -> std::result::Result<Claim<'_>, SendFailed> {
        let count = self.stripes.len();
        if payload_len <= POLL_MAX_PAYLOAD {
            let mut claim = self.stripes[stripe_of(place, count)].claim().await?;
            claim.inline = true;
            return Ok(claim);
        }
        let turn = self.next.fetch_add(1, Ordering::Relaxed) % count;
        let own = &self.stripes[turn];
        if let Some(claim) = own.try_claim() {
            return Ok(claim);
        }
        let limit = own.backlog();
        if let Some(claim) = (1..count).map(|i| &self.stripes[(turn + i) % count]).filter(|s| s.backlog() <= limit).find_map(Stripe::try_claim) {
            return Ok(claim);
        }
        own.claim().await
    }

    fn shutdown(&self) {
        self.sockets.shutdown();
    }
}

impl TlsTransport {
    /// Binds rank `identity.rank` of `world_size` to `listen` (TCP) and starts accepting peers.
    /// Call [`connect`](Self::connect) next, once every rank's address is known. Needs a tokio
    /// runtime.
    pub fn bind(identity: &NodeIdentity, world_size: usize, listen: SocketAddr, options: TlsOptions) -> Result<Self> {
        let rank = identity.rank;
        if rank >= world_size {
            return Err(Error::RankOutOfRange { rank, size: world_size });
        }
        if options.keep_alive >= options.idle_timeout {
            return Err(Error::InvalidConfig { reason: "keep_alive must be below idle_timeout" });
        }
        if options.stripes == 0 || options.stripes > MAX_STRIPES {
            return Err(Error::InvalidConfig { reason: "stripes must be 1 to 16 connections per peer pair" });
        }
        let mut server_config = server_tls_config_with(identity, options.cipher)?;
        server_config.alpn_protocols = vec![TLS_ALPN.to_vec()];
        server_config.enable_secret_extraction = true;
        server_config.send_tls13_tickets = 0;
        let mut client_config = client_tls_config_with(identity, options.cipher)?;
        client_config.alpn_protocols = vec![TLS_ALPN.to_vec()];
        client_config.enable_secret_extraction = true;
        let listener = std::net::TcpListener::bind(listen).map_err(|e| io("bind", e))?;
        listener.set_nonblocking(true).map_err(|e| io("bind", e))?;
        let local_addr = listener.local_addr().map_err(|e| io("local_addr", e))?;
        let listener = TcpListener::from_std(listener).map_err(|e| io("bind", e))?;
        let (events, inbox) = mpsc::channel(TLS_INBOX_FRAMES);
        let shared = Arc::new(Shared {
            rank,
            world: world_size,
            options,
            local_addr,
            client_config: Arc::new(client_config),
            server_config: Arc::new(server_config),
            links: Mutex::new(BTreeMap::new()),
            pending: Mutex::new(PendingLinks::default()),
            lost: Mutex::new(BTreeSet::new()),
            unlinked: Mutex::new(BTreeSet::new()),
            dial_errors: Mutex::new(BTreeMap::new()),
            links_changed: watch::channel(()).0,
            route: Mutex::new(None),
            route_set: Condvar::new(),
            pull_events: Mutex::new(Some(events)),
            pool: BufferPool::new(),
            tasks: Mutex::new(Vec::new()),
            state: AtomicU8::new(OPEN),
            next_serial: AtomicU64::new(0),
            writers: watch::channel(0).0,
            aborted: watch::channel(false).0,
            left_sealed: AtomicU64::new(0),
            finished_by_writer: AtomicU64::new(0),
            read_by_operations: AtomicU64::new(0),
        });
        let accept_task = tokio::spawn(accept_loop(Arc::clone(&shared), listener)).abort_handle();
        Ok(TlsTransport { shared, inbox: tokio::sync::Mutex::new(inbox), accept_task })
    }

    /// The bound address (useful after binding port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.local_addr
    }

    /// Dials every higher rank at `addrs[rank]` and waits until links to all ranks are up, or fails
    /// with [`Error::Connect`] after [`TlsOptions::connect_timeout`].
    pub async fn connect(&self, addrs: &[SocketAddr]) -> Result<()> {
        self.connect_except(addrs, &[]).await
    }

    /// [`connect`](Self::connect), leaving out the ranks in `others` (served by another transport,
    /// as the ranks of the same host are under a [`crate::RoutedTransport`]): they are neither
    /// dialed nor waited for, and sends to them fail with [`Error::PeerLost`].
    pub async fn connect_except(&self, addrs: &[SocketAddr], others: &[usize]) -> Result<()> {
        let shared = &self.shared;
        if addrs.len() != shared.world {
            return Err(Error::InvalidConfig { reason: "one address per rank is required" });
        }
        let of = shared.options.stripes;
        for (peer, addr) in linking::dial_targets(shared.rank, addrs, others, &shared.unlinked)? {
            for stripe in 0..of {
                let task = tokio::spawn(dial(Arc::clone(shared), peer, addr, StripeId { stripe, of })).abort_handle();
                lock(&shared.tasks).push(task);
            }
        }
        linking::wait_linked(&shared.links_changed, || shared.missing_peer(), shared.options.connect_timeout, &shared.dial_errors).await
    }

    /// Binds all `world_size` ranks in this process on `127.0.0.1` with certificates issued by `ca`
    /// and connects them: a whole TLS world over real loopback sockets, for tests and benchmarks.
    pub async fn loopback_world(ca: &crate::ClusterCa, world_size: usize, options: TlsOptions) -> Result<Vec<Arc<TlsTransport>>> {
        linking::loopback_world(
            ca,
            world_size,
            |identity, listen| TlsTransport::bind(identity, world_size, listen, options.clone()),
            |t: &TlsTransport| Ok(t.local_addr()),
            |transport: Arc<TlsTransport>, addrs| async move { transport.connect(&addrs).await },
        )
        .await
    }

    /// Ranks with a live link now, in rank order.
    pub fn connected_peers(&self) -> Vec<usize> {
        lock(&self.shared.links).keys().copied().collect()
    }

    /// TCP connections open now (all stripes of all live links).
    pub fn open_connections(&self) -> usize {
        lock(&self.shared.links).values().map(|l| l.stripes.len()).sum()
    }

    /// Frames received so far whose payload the reader left sealed, for the operation to open
    /// straight into its output (the sender flagged them as copied whole; see the module doc).
    pub fn payloads_left_sealed(&self) -> u64 {
        self.shared.left_sealed.load(Ordering::Relaxed)
    }

    /// Frames sent so far whose writing the sending thread began (its connection's writer thread
    /// was idle) and the writer thread finished, because the socket had no room for all of it.
    pub fn frames_finished_by_writer(&self) -> u64 {
        self.shared.finished_by_writer.load(Ordering::Relaxed)
    }

    /// Frames that operations waiting for them read from their connection themselves (see
    /// [`Transport::poll_incoming`]), rather than a reader thread.
    pub fn frames_read_by_operations(&self) -> u64 {
        self.shared.read_by_operations.load(Ordering::Relaxed)
    }

    /// Shuts down gracefully: every frame queued so far is written, then each connection is
    /// half-closed (the peers see the links end after reading everything); waits at most `timeout`
    /// for the writers. Sends after `close` fail.
    pub async fn close(&self, timeout: Duration) {
        self.shared.begin_close();
        let mut writers = self.shared.writers.subscribe();
        let _ = tokio::time::timeout(timeout, writers.wait_for(|&n| n == 0)).await;
    }
}

impl Transport for TlsTransport {
    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn send(&self, peer: usize, frame: PooledBuf) -> BoxFuture<'_, Result<()>> {
        // Header and payload as two parts, so the header ends with its record (a reader may then
        // leave a copied payload sealed, see `sealed`).
        Box::pin(async move {
            let (header, payload) = frame.split_at(HEADER_LEN.min(frame.len()));
            self.shared.queue(peer, header, [payload]).await
        })
    }

    fn send_parts<'a>(&'a self, peer: usize, header: &'a [u8; HEADER_LEN], payload: &'a [u8], _pool: &'a BufferPool) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.shared.queue(peer, &header[..], [payload]))
    }

    fn send_chunked<'a>(&'a self, peer: usize, header: &'a [u8; HEADER_LEN], payload: ChunkedBytes, _pool: &'a BufferPool) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.shared.queue(peer, &header[..], payload.chunks()).await })
    }

    fn send_filled<'a>(&'a self, peer: usize, header: &'a [u8; HEADER_LEN], len: usize, fill: &'a mut FillPayload<'a>, _pool: &'a BufferPool) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.shared.queue_filled(peer, header, len, fill))
    }

    fn fills_on_send(&self) -> bool {
        // Each record's plaintext is written in place and sealed there (`Sealer::seal_filled`).
        true
    }

    fn recv(&self) -> BoxFuture<'_, Option<TransportEvent>> {
        Box::pin(async move {
            if let Some(events) = lock(&self.shared.pull_events).take() {
                self.shared.set_route(Route::Pull(events));
            }
            let mut aborted = self.shared.aborted.subscribe();
            let mut inbox = self.inbox.lock().await;
            tokio::select! {
                event = inbox.recv() => event,
                _ = aborted.wait_for(|aborted| *aborted) => None,
            }
        })
    }

    fn checks_integrity(&self) -> bool {
        // Every record is authenticated (AES-GCM): altered bytes never open.
        true
    }

    fn preferred_ring_window(&self) -> Option<usize> {
        Some(crate::quic::QUIC_RING_WINDOW)
    }

    fn preferred_direct_all_reduce_ranks(&self) -> Option<usize> {
        // Every hop is a seal, a socket round and an open: the direct exchange's two steps beat
        // the ring's 2(n - 1) where the ring has nothing to pipeline (measured at 4 ranks; up to
        // 8 every rank still sends each peer frames of at least size / 8).
        Some(DIRECT_ALL_REDUCE_RANKS)
    }

    fn poll_incoming(&self, awaited: AwaitedFrame) -> Option<usize> {
        // A large frame is left to the reader threads (see `POLL_MAX_PAYLOAD`). And only with
        // push delivery: a pulled transport's frames go through its channel, which may block.
        if awaited.len > POLL_MAX_PAYLOAD {
            return None;
        }
        let route @ Route::Push(_) = lock(&self.shared.route).clone()? else { return None };
        if self.shared.state.load(Ordering::Acquire) != OPEN {
            return None;
        }
        let link = lock(&self.shared.links).get(&awaited.from).cloned()?;
        let reads = &link.reads;
        reads.operations.note_poll();
        let inbound = &reads.inbound[stripe_of(place(awaited.seq, awaited.chunk), reads.inbound.len())];
        if !inbound.ready.load(Ordering::Acquire) || inbound.ended.load(Ordering::Acquire) {
            return Some(0);
        }
        // `None`: its reader thread, or another operation, is reading it.
        let Some(mut side) = try_lock(&inbound.side) else { return Some(0) };
        let mut delivered = 0;
        loop {
            match self.shared.read_round(awaited.from, &mut side, &inbound.socket, &route, &link.sockets) {
                Round::Delivered(0) => {}
                Round::Delivered(n) => {
                    delivered += n;
                    break;
                }
                Round::Nothing => break,
                Round::Ended => {
                    // The reader thread ends the connection (woken by the shutdown when the
                    // stream broke; the peer's end wakes it by itself).
                    inbound.ended.store(true, Ordering::Release);
                    if matches!(side.ended, Some(Err(_))) {
                        link.sockets.shutdown();
                    }
                    reads.operations.wake_readers();
                    break;
                }
            }
        }
        self.shared.read_by_operations.fetch_add(delivered as u64, Ordering::Relaxed);
        if delivered == 0 {
            // Each round here is a system call, not a look at shared memory: let the peer's
            // threads run on this core (the spin yields only every 256 rounds).
            std::thread::yield_now();
        }
        Some(delivered)
    }

    fn poll_ended(&self, awaited: AwaitedFrame) {
        let link = lock(&self.shared.links).get(&awaited.from).cloned();
        if let Some(link) = link {
            link.reads.operations.stop();
        }
    }

    fn preferred_chunk_bytes(&self) -> Option<usize> {
        Some(TLS_CHUNK_BYTES)
    }

    fn attach(&self, sink: Weak<dyn EventSink>) -> bool {
        if lock(&self.shared.pull_events).take().is_none() {
            return false;
        }
        self.shared.set_route(Route::Push(sink.clone()));
        if self.shared.state.load(Ordering::Acquire) == ABORTED {
            if let Some(sink) = sink.upgrade() {
                sink.closed();
            }
        }
        true
    }

    fn abort(&self) {
        self.shared.state.store(ABORTED, Ordering::Release);
        let links = std::mem::take(&mut *lock(&self.shared.links));
        for link in links.values() {
            link.shutdown();
        }
        lock(&self.shared.pending).clear();
        self.shared.route_set.notify_all();
        // The links just taken down report no loss (they are no longer the current links), so the
        // endpoint is told the transport is gone: its operations, those waiting and those that
        // start later (a generation moved on while this one was starting), fail at once with
        // TransportClosed instead of waiting for frames until the operation timeout.
        self.shared.aborted.send_replace(true);
        let route = lock(&self.shared.route).clone();
        if let Some(Route::Push(sink)) = route {
            if let Some(sink) = sink.upgrade() {
                sink.closed();
            }
        }
    }
}

impl Drop for TlsTransport {
    /// Stops accepting and dialing at once; frames already queued still reach the peers (see
    /// [`close`](TlsTransport::close)), as closing a TCP socket does.
    fn drop(&mut self) {
        self.accept_task.abort();
        for task in lock(&self.shared.tasks).drain(..) {
            task.abort();
        }
        self.shared.begin_close();
    }
}

impl std::fmt::Debug for TlsTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsTransport")
            .field("rank", &self.shared.rank)
            .field("world_size", &self.shared.world)
            .field("connected_peers", &self.connected_peers())
            .finish_non_exhaustive()
    }
}

impl Shared {
    /// Seals the frame (`header`, then `payload`) and queues its records on its connection to
    /// `peer` ([`Link::claim`]). A frame is queued whole or not at all: cancelling this never
    /// tears one.
    async fn queue<'a>(&self, peer: usize, header: &'a [u8], payload: impl IntoIterator<Item = &'a [u8]>) -> Result<()> {
        let link = self.link_for(peer)?;
        let sent = link.claim(header_place(header), header_payload_len(header)).await.and_then(|claim| claim.send(std::iter::once(header).chain(payload)));
        self.sent(peer, &link, sent)
    }

    /// [`queue`](Self::queue) of a frame whose payload `fill` writes as it is sealed
    /// ([`Claim::send_filled`]).
    async fn queue_filled(&self, peer: usize, header: &[u8], len: usize, fill: &mut FillPayload<'_>) -> Result<()> {
        let link = self.link_for(peer)?;
        let sent = link.claim(header_place(header), len).await.and_then(|claim| claim.send_filled(header, len, fill));
        self.sent(peer, &link, sent)
    }

    /// The live link to `peer`, for a send.
    fn link_for(&self, peer: usize) -> Result<Link> {
        if peer >= self.world {
            return Err(Error::RankOutOfRange { rank: peer, size: self.world });
        }
        if self.state.load(Ordering::Acquire) == ABORTED {
            return Err(Error::TransportClosed);
        }
        lock(&self.links).get(&peer).cloned().ok_or(Error::PeerLost { rank: peer, op: OpKind::Send })
    }

    /// What a stripe's send came to, for the operation.
    fn sent(&self, peer: usize, link: &Link, sent: std::result::Result<(), SendFailed>) -> Result<()> {
        let lost = Error::PeerLost { rank: peer, op: OpKind::Send };
        match sent {
            Ok(()) => Ok(()),
            Err(SendFailed::Closed) => Err(lost),
            Err(SendFailed::Seal(e)) => {
                tracing::warn!(rank = self.rank, peer, error = %e, "tls sealing failed, closing the link");
                link.shutdown();
                Err(lost)
            }
            Err(SendFailed::Fill { error, broken }) => {
                if broken {
                    tracing::warn!(rank = self.rank, peer, %error, "a frame's payload failed past a key update, closing the link");
                    link.shutdown();
                }
                Err(error)
            }
        }
    }

    fn set_route(&self, route: Route) {
        *lock(&self.route) = Some(route);
        self.route_set.notify_all();
    }

    /// The delivery route, waiting for the endpoint to attach or poll; `None` once closing.
    fn wait_route(&self) -> Option<Route> {
        let mut route = lock(&self.route);
        loop {
            if self.state.load(Ordering::Acquire) != OPEN {
                return None;
            }
            if let Some(route) = route.as_ref() {
                return Some(route.clone());
            }
            route = self.route_set.wait_timeout(route, READ_TICK).unwrap_or_else(std::sync::PoisonError::into_inner).0;
        }
    }

    fn closing(&self) -> bool {
        self.state.load(Ordering::Acquire) != OPEN
    }

    /// Closing: the links' queues close (their writers finish what is queued, then half-close),
    /// readers discard from now on.
    fn begin_close(&self) {
        let _ = self.state.compare_exchange(OPEN, CLOSING, Ordering::AcqRel, Ordering::Acquire);
        lock(&self.links).clear();
        lock(&self.pending).clear();
        self.route_set.notify_all();
    }

    fn missing_peer(&self) -> Option<usize> {
        let (links, unlinked) = (lock(&self.links), lock(&self.unlinked));
        (0..self.world).find(|p| *p != self.rank && !links.contains_key(p) && !unlinked.contains(p))
    }

    /// Records one connected stripe of the link to `peer`; when all of its stripes are
    /// connected, installs the link and starts its threads.
    fn register(self: &Arc<Self>, peer: usize, id: StripeId, connected: Connected) -> Result<()> {
        if self.closing() {
            return Ok(());
        }
        // A stripe dialed again replaces the older connection, which is dropped (closed).
        let (_stale, complete) = lock(&self.pending).add(peer, id, connected);
        let Some(complete) = complete else {
            return Ok(());
        };
        let serial = self.next_serial.fetch_add(1, Ordering::Relaxed);
        let mut stripes = Vec::with_capacity(complete.len());
        let mut sockets = Vec::with_capacity(complete.len());
        let mut halves = Vec::with_capacity(complete.len());
        let mut inbound = Vec::with_capacity(complete.len());
        for Connected { stream, established } in complete {
            let stream = stream.into_std().map_err(|e| io("into_std", e))?;
            stream.set_nonblocking(false).map_err(|e| io("set_nonblocking", e))?;
            let socket = Arc::new(stream);
            let Established { sealer, opener, leftover, opened, .. } = established;
            let (tx, rx) = mpsc::channel(SEND_QUEUE_FRAMES);
            let spare = Arc::new(Mutex::new(Vec::new()));
            let unwritten = Arc::new(AtomicUsize::new(0));
            stripes.push(Stripe { queue: tx, sealer: Mutex::new(sealer), spare: Arc::clone(&spare), socket: Arc::clone(&socket), unwritten: Arc::clone(&unwritten) });
            sockets.push(Arc::clone(&socket));
            let mut buf = self.pool.take(READ_BUF_BYTES);
            buf.extend_from_slice(&leftover);
            let side = ReadSide {
                opener,
                frames: FrameCutter::new(self.options.max_payload_bytes),
                position: StreamPosition::new(self.options.max_payload_bytes),
                sealed_left: 0,
                buf,
                ended: None,
            };
            inbound.push(Arc::new(Inbound { socket, side: Mutex::new(side), ready: AtomicBool::new(false), ended: AtomicBool::new(false) }));
            halves.push((rx, spare, unwritten, opened));
        }
        // A peer that was lost and dialed again is reported up before any of its frames; from a
        // reader thread, like every other event, so that pull delivery may block.
        let came_back = lock(&self.lost).remove(&peer);
        let link_sockets = LinkSockets { serial, sockets: Arc::new(sockets), up: Arc::new(Gate::new(!came_back)) };
        let reads = Arc::new(LinkReads { inbound, operations: PollingOperations::default() });
        let link = Link { sockets: link_sockets.clone(), stripes: Arc::new(stripes), next: Arc::new(AtomicUsize::new(0)), reads: Arc::clone(&reads) };
        if let Some(old) = lock(&self.links).insert(peer, link.clone()) {
            old.shutdown();
        }
        let readers_left = Arc::new(AtomicUsize::new(halves.len()));
        for (stripe, (rx, spare, unwritten, opened)) in halves.into_iter().enumerate() {
            let start = ReaderStart { opened, announces_up: came_back && stripe == 0 };
            self.writers.send_modify(|n| *n += 1);
            let socket = Arc::clone(&reads.inbound[stripe].socket);
            let writer = {
                let shared = Arc::clone(self);
                move || shared.write_loop(peer, &socket, &spare, &unwritten, rx)
            };
            let reader = {
                let (shared, link, reads, readers_left) = (Arc::clone(self), link_sockets.clone(), Arc::clone(&reads), Arc::clone(&readers_left));
                move || shared.read_loop(peer, &reads, stripe, start, &link, &readers_left)
            };
            let spawned = std::thread::Builder::new().name(format!("rtx-tls-w{}-{peer}.{stripe}", self.rank)).spawn(writer).and_then(|_| {
                std::thread::Builder::new().name(format!("rtx-tls-r{}-{peer}.{stripe}", self.rank)).spawn(reader)
            });
            if let Err(e) = spawned {
                link.shutdown();
                return Err(io("spawn link thread", e));
            }
        }
        self.links_changed.send_replace(());
        tracing::debug!(rank = self.rank, peer, stripes = id.of, "tls link up");
        Ok(())
    }

    /// The writer thread of one connection: writes the queued records and hands their buffers
    /// back; when the queue closes, half-closes the connection.
    fn write_loop(&self, peer: usize, socket: &StdTcpStream, spare: &Mutex<Vec<RecordBuf>>, unwritten: &AtomicUsize, mut queue: mpsc::Receiver<RecordBuf>) {
        let mut broken = None;
        while let Some(mut records) = queue.blocking_recv() {
            if records.begun() {
                self.finished_by_writer.fetch_add(1, Ordering::Relaxed);
            }
            if let Err(e) = (&*socket).write_all(records.as_slice()) {
                broken = Some(e.to_string());
                break;
            }
            unwritten.fetch_sub(1, Ordering::AcqRel);
            records.clear();
            let mut spare = lock(spare);
            if spare.len() < SPARE_RECORD_BUFS && records.capacity() <= SPARE_RECORD_BUF_MAX_BYTES {
                spare.push(records);
            }
        }
        match broken {
            Some(reason) => {
                if !self.closing() {
                    tracing::info!(rank = self.rank, peer, %reason, "tls write failed, closing the link");
                }
                let _ = socket.shutdown(std::net::Shutdown::Both);
                queue.close();
                while queue.try_recv().is_ok() {}
            }
            None => {
                let _ = socket.shutdown(std::net::Shutdown::Write);
            }
        }
        self.writers.send_modify(|n| *n = n.saturating_sub(1));
    }

    /// The reader thread of one connection: reads records into pooled buffers, opens them in
    /// place, cuts the plaintext into frames and delivers them; when it ends, the last reader of
    /// the link takes the link down.
    fn read_loop(&self, peer: usize, reads: &LinkReads, stripe: usize, start: ReaderStart, link: &LinkSockets, readers_left: &AtomicUsize) {
        let inbound = &reads.inbound[stripe];
        let ended = match self.wait_route() {
            Some(route) if start.announces_up => {
                deliver(&route, TransportEvent::PeerUp(peer));
                link.up.open();
                self.read_records(peer, reads, inbound, start, &route, link)
            }
            Some(route) if link.up.wait(self) => self.read_records(peer, reads, inbound, start, &route, link),
            _ => Ok(()),
        };
        inbound.ended.store(true, Ordering::Release);
        if let Err(reason) = &ended {
            if !self.closing() {
                tracing::warn!(rank = self.rank, peer, %reason, "tls link broken");
            }
            link.shutdown();
        }
        if readers_left.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.link_down(peer, link);
        }
    }

    /// Reads the connection until it ends: reads under its lock without waiting
    /// ([`read_round`](Self::read_round)) while the socket keeps having data, and waits for it to
    /// be readable (poll(2), without the lock) only after a read found it empty; stands back
    /// while operations poll the link (see [`LinkReads`]).
    fn read_records(&self, peer: usize, reads: &LinkReads, inbound: &Inbound, start: ReaderStart, route: &Route, link: &LinkSockets) -> std::result::Result<(), String> {
        {
            let mut side = lock(&inbound.side);
            if !start.opened.is_empty() {
                let side = &mut *side;
                side.position.advance(&start.opened)?;
                side.frames.push(bytes::Bytes::from(start.opened), &self.pool, &mut |frame| self.deliver_frame(route, peer, frame))?;
                side.sealed_left = side.position.take_copied_payload().unwrap_or(0);
            }
            // Whole records the handshake read past its end.
            self.cut_records(peer, &mut side, route, link)?;
            if let Some(ended) = side.ended.take() {
                return ended;
            }
        }
        inbound.ready.store(true, Ordering::Release);
        let mut idle_ticks = 0u64;
        let linger_ticks = (self.options.idle_timeout.as_millis() / READ_TICK.as_millis()).max(1) as u64;
        let mut watch = reads.operations.join_as_reader();
        // Whether the last read found the socket empty: only then does the next one wait for it
        // to be readable first. In a stream the socket has usually filled again while the last
        // read's records were opened, and a poll(2) before every read was a system call each.
        let mut drained = true;
        loop {
            if inbound.ended.load(Ordering::Acquire) {
                // A polling operation found the end.
                return lock(&inbound.side).ended.take().unwrap_or(Ok(()));
            }
            if watch.operations_poll() && !self.closing() {
                // Operations read this link themselves: leave what arrives to them until they
                // stop (they wake this thread) or a nap passes with no poll.
                watch.nap();
                continue;
            }
            if drained {
                match wait_readable(&inbound.socket, READ_TICK) {
                    Ok(true) => {}
                    Ok(false) => {
                        // Idle: after the transport closed, wait for the peer's end only so long.
                        if self.closing() {
                            idle_ticks += 1;
                            if idle_ticks >= linger_ticks {
                                return Ok(());
                            }
                        }
                        continue;
                    }
                    Err(e) => return Err(e.to_string()),
                }
            }
            let mut side = lock(&inbound.side);
            match self.read_round(peer, &mut side, &inbound.socket, route, link) {
                Round::Delivered(_) => {
                    idle_ticks = 0;
                    drained = false;
                }
                Round::Nothing => drained = true,
                Round::Ended => return side.ended.take().unwrap_or(Ok(())),
            }
        }
    }

    /// Reads what the socket has now (without waiting) into the side's buffer and goes through
    /// its whole records ([`cut_records`](Self::cut_records)).
    fn read_round(&self, peer: usize, side: &mut ReadSide, socket: &StdTcpStream, route: &Route, link: &LinkSockets) -> Round {
        if side.ended.is_some() {
            return Round::Ended;
        }
        if side.buf.capacity() - side.buf.len() < MAX_RECORD {
            side.buf.reserve(MAX_RECORD);
        }
        let outcome = match recv_into_spare(socket, &mut side.buf) {
            Ok(0) if side.buf.is_empty() && side.frames.at_boundary() => Err(Ok(())),
            Ok(0) => Err(Err("connection ended in the middle of a record or frame".to_string())),
            Ok(_) => self.cut_records(peer, side, route, link).map_err(Err),
            // Nothing there now (reads never wait: `recv_into_spare`).
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted) => return Round::Nothing,
            Err(e) => Err(Err(e.to_string())),
        };
        match outcome {
            Ok(delivered) if side.ended.is_none() => Round::Delivered(delivered),
            Ok(_) => Round::Ended,
            Err(ended) => {
                side.ended = Some(ended);
                Round::Ended
            }
        }
    }

    /// Goes through the buffer's whole records in order: opened in place (their plaintext
    /// followed by the stream position), or, inside a payload the sender flagged as copied, left
    /// sealed ([`sealed`]); then the buffer is frozen and the cutter gets the plaintext and the
    /// sealed records as pieces of it, delivering the frames they complete. Returns how many;
    /// a close_notify sets how the stream ended.
    fn cut_records(&self, peer: usize, side: &mut ReadSide, route: &Route, link: &LinkSockets) -> std::result::Result<usize, String> {
        let ReadSide { opener, frames, position, sealed_left, buf, ended } = side;
        let mut delivered = 0;
        let mut deliver_frame = |frame: CutFrame| {
            delivered += 1;
            self.deliver_frame(route, peer, frame);
        };
        let mut pos = 0;
        let mut pieces = Vec::new();
        let mut peer_closed = false;
        while let Some(len) = record_len(&buf[pos..]).map_err(|e| e.to_string())? {
            if pos + len > buf.len() {
                break;
            }
            let record = pos..pos + len;
            pos += len;
            if *sealed_left > 0 && len - RECORD_HEADER_LEN > EAGER_BODY_MAX {
                *sealed_left = sealed_left.checked_sub(SealedRecord::data_len(&buf[record.clone()])).ok_or("a record runs past the end of a payload left sealed")?;
                pieces.push(ReadPiece::Sealed(record, opener.skip()));
                continue;
            }
            match opener.open(&mut buf[record.clone()]).map_err(|e| e.to_string())? {
                Opened::Data(range) if !range.is_empty() => {
                    let data = record.start + range.start..record.start + range.end;
                    if *sealed_left > 0 {
                        // A small record inside a payload left sealed (its tail).
                        *sealed_left = sealed_left.checked_sub(data.len()).ok_or("a record runs past the end of a payload left sealed")?;
                        pieces.push(ReadPiece::SealedPlain(data));
                    } else {
                        position.advance(&buf[data.clone()])?;
                        pieces.push(ReadPiece::Plain(data));
                        *sealed_left = position.take_copied_payload().unwrap_or(0);
                    }
                }
                Opened::Data(_) | Opened::KeyUpdated => {}
                Opened::Closed => peer_closed = true,
            }
            if peer_closed {
                break;
            }
        }
        if !pieces.is_empty() {
            // Hand this buffer's plaintext and sealed records on as pieces of it; the partial
            // record at its end moves to a fresh buffer.
            let mut next = self.pool.take(READ_BUF_BYTES);
            next.extend_from_slice(&buf[pos..]);
            buf.truncate(pos);
            let whole = bytes::Bytes::from_owner(std::mem::replace(buf, next));
            for piece in pieces {
                match piece {
                    ReadPiece::Plain(range) => frames.push(whole.slice(range), &self.pool, &mut deliver_frame)?,
                    ReadPiece::SealedPlain(range) => frames.push_sealed(SealedPiece::Plain(whole.slice(range)), link, &mut deliver_frame)?,
                    ReadPiece::Sealed(range, how) => frames.push_sealed(SealedPiece::Record(whole.slice(range), how), link, &mut deliver_frame)?,
                }
            }
        } else if pos > 0 {
            buf.drain(..pos);
        }
        if peer_closed {
            *ended = Some(frames.at_boundary().then_some(()).ok_or_else(|| "close_notify in the middle of a frame".to_string()));
        }
        Ok(delivered)
    }

    /// Hands a frame cut from a connection to the endpoint (unless the transport is closing).
    fn deliver_frame(&self, route: &Route, peer: usize, frame: CutFrame) {
        if matches!(frame, CutFrame::Sealed(..)) {
            self.left_sealed.fetch_add(1, Ordering::Relaxed);
        }
        if !self.closing() {
            deliver_cut(route, peer, frame, &self.pool);
        }
    }

    fn link_down(&self, peer: usize, link: &LinkSockets) {
        {
            let mut links = lock(&self.links);
            if links.get(&peer).is_some_and(|l| l.sockets.serial == link.serial) {
                links.remove(&peer);
            }
            if links.contains_key(&peer) {
                // A newer link (the peer dialed again) serves the peer: nothing was lost.
                return;
            }
        }
        if self.closing() {
            return;
        }
        if lock(&self.lost).insert(peer) {
            tracing::info!(rank = self.rank, peer, "tls link lost");
            if let Some(route) = lock(&self.route).clone() {
                deliver(&route, TransportEvent::PeerLost(peer));
            }
        }
    }
}

/// Writes what the socket takes of `bytes` now, without waiting for room (and without SIGPIPE
/// where the peer is gone): the count written; an error only if the connection failed.
fn write_without_waiting(socket: &StdTcpStream, bytes: &[u8]) -> std::io::Result<usize> {
    let socket = socket2::SockRef::from(socket);
    let mut written = 0;
    while written < bytes.len() {
        match socket.send_with_flags(&bytes[written..], libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) {
            Ok(0) => break,
            Ok(n) => written += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(written)
}

/// Reads what the socket has now into `buf`'s spare capacity (at least [`MAX_RECORD`] of it),
/// without waiting (`WouldBlock` when it has nothing).
fn recv_into_spare(socket: &StdTcpStream, buf: &mut Vec<u8>) -> std::io::Result<usize> {
    let filled = buf.len();
    let n = socket2::SockRef::from(socket).recv_with_flags(buf.spare_capacity_mut(), libc::MSG_DONTWAIT)?;
    // SAFETY: `recv` initialized the first `n` bytes of the spare capacity.
    unsafe { buf.set_len(filled + n) };
    Ok(n)
}

/// The connection, of `count`, that carries frames with placement `place`
/// ([`crate::frame::header_place`]).
fn stripe_of(place: u64, count: usize) -> usize {
    // The remainder is below `count`, a usize.
    (place % count.max(1) as u64) as usize
}

/// Waits up to `timeout` for the socket to have something to read (data, its end, or an error):
/// `false` when the time passed first.
fn wait_readable(socket: &StdTcpStream, timeout: Duration) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    let mut poll = libc::pollfd { fd: socket.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    let millis = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: one valid pollfd, for the duration of the call.
    match unsafe { libc::poll(&mut poll, 1, millis) } {
        n if n > 0 => Ok(true),
        0 => Ok(false),
        _ => match std::io::Error::last_os_error() {
            e if e.kind() == std::io::ErrorKind::Interrupted => Ok(false),
            e => Err(e),
        },
    }
}

/// What one record of a read buffer gave, in order: resolved into pieces of the buffer once it
/// is frozen.
enum ReadPiece {
    /// Plaintext opened in place at this range.
    Plain(Range<usize>),
    /// Plaintext of a small record inside a payload left sealed.
    SealedPlain(Range<usize>),
    /// A whole record left sealed, and how to open it.
    Sealed(Range<usize>, SealedRecord),
}

/// A whole frame cut from a connection's plaintext.
enum CutFrame {
    /// Header and payload pieces (large payloads: pieces of the read buffers, never copied).
    Pieces([u8; HEADER_LEN], ChunkedBytes),
    /// Header and a payload left sealed (see [`sealed`]).
    Sealed([u8; HEADER_LEN], SealedRecords),
    /// Header and payload copied into one buffer (small frames).
    Whole(PooledBuf),
}

/// Cuts a connection's plaintext stream into frames.
struct FrameCutter {
    max_payload: usize,
    header: [u8; HEADER_LEN],
    header_have: usize,
    body: Option<Body>,
}

enum Body {
    Pieces { need: usize, pieces: ChunkedBytes },
    Whole { need: usize, buf: PooledBuf },
    Sealed { need: usize, records: SealedRecords },
}

impl FrameCutter {
    fn new(max_payload: usize) -> Self {
        FrameCutter { max_payload, header: [0; HEADER_LEN], header_have: 0, body: None }
    }

    fn at_boundary(&self) -> bool {
        self.header_have == 0 && self.body.is_none()
    }

    fn push(&mut self, mut piece: bytes::Bytes, pool: &BufferPool, emit: &mut impl FnMut(CutFrame)) -> std::result::Result<(), String> {
        while !piece.is_empty() {
            match &mut self.body {
                None => {
                    let take = (HEADER_LEN - self.header_have).min(piece.len());
                    self.header[self.header_have..self.header_have + take].copy_from_slice(&piece[..take]);
                    self.header_have += take;
                    piece = piece.slice(take..);
                    if self.header_have < HEADER_LEN {
                        continue;
                    }
                    // Bounded by the cap just checked, so it fits in usize.
                    let payload_len = decode_header(&self.header, self.max_payload).map_err(|e| format!("bad frame header: {e}"))?.payload_len as usize;
                    self.body = Some(if payload_len >= CHUNKED_FRAME_MIN_BYTES {
                        Body::Pieces { need: payload_len, pieces: ChunkedBytes::new() }
                    } else {
                        let mut buf = pool.take(HEADER_LEN + payload_len);
                        buf.extend_from_slice(&self.header);
                        Body::Whole { need: payload_len, buf }
                    });
                }
                Some(Body::Pieces { need, pieces }) => {
                    let take = (*need - pieces.len()).min(piece.len());
                    pieces.push(piece.split_to(take));
                }
                Some(Body::Whole { need, buf }) => {
                    let take = (HEADER_LEN + *need - buf.len()).min(piece.len());
                    buf.extend_from_slice(&piece[..take]);
                    piece = piece.slice(take..);
                }
                Some(Body::Sealed { .. }) => return Err("plaintext in the middle of a payload left sealed".into()),
            }
            self.emit_if_complete(emit);
        }
        Ok(())
    }

    /// Adds a piece of a payload left sealed; the first one turns the body just begun (a large
    /// payload, nothing of it seen yet) into a sealed one for `link`.
    fn push_sealed(&mut self, piece: SealedPiece, link: &LinkSockets, emit: &mut impl FnMut(CutFrame)) -> std::result::Result<(), String> {
        if let Some(Body::Pieces { need, pieces }) = &self.body {
            if pieces.is_empty() {
                self.body = Some(Body::Sealed { need: *need, records: SealedRecords::new(link.clone()) });
            }
        }
        let Some(Body::Sealed { need, records }) = &mut self.body else {
            return Err("a sealed record outside a payload left sealed".into());
        };
        if records.len() + piece.len() > *need {
            return Err("a record runs past the end of a payload left sealed".into());
        }
        records.push(piece);
        self.emit_if_complete(emit);
        Ok(())
    }

    fn emit_if_complete(&mut self, emit: &mut impl FnMut(CutFrame)) {
        let complete = match &self.body {
            Some(Body::Pieces { need, pieces }) => pieces.len() == *need,
            Some(Body::Whole { need, buf }) => buf.len() == HEADER_LEN + *need,
            Some(Body::Sealed { need, records }) => records.len() == *need,
            None => false,
        };
        if complete {
            self.header_have = 0;
            match self.body.take() {
                Some(Body::Pieces { pieces, .. }) => emit(CutFrame::Pieces(self.header, pieces)),
                Some(Body::Whole { buf, .. }) => emit(CutFrame::Whole(buf)),
                Some(Body::Sealed { records, .. }) => emit(CutFrame::Sealed(self.header, records)),
                None => {}
            }
        }
    }
}

/// Hands a frame to the endpoint (from a reader thread).
fn deliver_cut(route: &Route, from: usize, frame: CutFrame, pool: &BufferPool) {
    match (route, frame) {
        (Route::Push(sink), CutFrame::Pieces(header, pieces)) => {
            if let Some(sink) = sink.upgrade() {
                sink.chunked_frame(from, header, pieces);
            }
        }
        (route, CutFrame::Pieces(header, pieces)) => {
            let mut bytes = pool.take(HEADER_LEN + pieces.len());
            bytes.extend_from_slice(&header);
            for chunk in pieces.chunks() {
                bytes.extend_from_slice(chunk);
            }
            deliver(route, TransportEvent::Frame { from, bytes });
        }
        (route, CutFrame::Whole(bytes)) => deliver(route, TransportEvent::Frame { from, bytes }),
        (Route::Push(sink), CutFrame::Sealed(header, records)) => {
            if let Some(sink) = sink.upgrade() {
                sink.sealed_frame(from, header, Box::new(records));
            }
        }
        (route, CutFrame::Sealed(header, records)) => {
            let mut bytes = pool.take(HEADER_LEN + records.len());
            bytes.extend_from_slice(&header);
            bytes.resize(HEADER_LEN + records.len(), 0);
            // One that does not open has broken the link (its peer-lost event follows).
            if records.open_into(&mut bytes[HEADER_LEN..]).is_ok() {
                deliver(route, TransportEvent::Frame { from, bytes });
            }
        }
    }
}

/// Hands an event to the endpoint from a thread outside the runtime.
fn deliver(route: &Route, event: TransportEvent) {
    match route {
        Route::Push(sink) => {
            if let Some(sink) = sink.upgrade() {
                sink.event(event);
            }
        }
        Route::Pull(events) => {
            let _ = events.blocking_send(event);
        }
    }
}

async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!(rank = shared.rank, error = %e, "tls accept failed");
                tokio::time::sleep(linking::DIAL_RETRY).await;
                continue;
            }
        };
        let handler = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            let timeout = handler.options.connect_timeout;
            let outcome = match tokio::time::timeout(timeout, accept_one(&handler, stream)).await {
                Ok(outcome) => outcome,
                Err(_) => Err(format!("handshake not done within {} ms", millis(timeout))),
            };
            if let Err(reason) = outcome {
                tracing::warn!(rank = handler.rank, %reason, "refused incoming tls connection");
            }
        });
        let mut tasks = lock(&shared.tasks);
        tasks.retain(|t| !t.is_finished());
        tasks.push(task.abort_handle());
    }
}

async fn accept_one(shared: &Arc<Shared>, mut stream: TcpStream) -> std::result::Result<(), String> {
    configure(&stream, &shared.options)?;
    let mut established = handshake::server(&mut stream, Arc::clone(&shared.server_config), shared.options.key_update_records).await?;
    let Established { opener, opened, leftover, .. } = &mut established;
    let hello_bytes = handshake::read_exact_opened(&mut stream, opener, opened, leftover, HELLO_LEN).await?;
    let (peer, id) = read_hello(&hello_bytes)?;
    if peer >= shared.world || peer >= shared.rank {
        return Err(format!("hello names rank {peer}, which does not dial rank {}", shared.rank));
    }
    if !id.is_possible() {
        return Err(format!("hello names an impossible stripe {id:?}"));
    }
    if !certificate_names_rank(&established.peer_certs, peer) {
        return Err(format!("client certificate does not name rank {peer}, which its hello claims"));
    }
    handshake::write_sealed(&mut stream, &mut established.sealer, &hello(shared.rank, id)).await?;
    shared.register(peer, id, Connected { stream, established }).map_err(|e| e.to_string())
}

async fn dial(shared: Arc<Shared>, peer: usize, addr: SocketAddr, id: StripeId) {
    let timeout = shared.options.connect_timeout;
    let attempt = || async {
        match tokio::time::timeout(timeout, dial_once(&shared, peer, addr, id)).await {
            Ok(outcome) => outcome,
            Err(_) => Err(format!("handshake not done within {} ms", millis(timeout))),
        }
    };
    linking::dial_until_up(shared.rank, peer, &shared.dial_errors, attempt).await;
}

async fn dial_once(shared: &Arc<Shared>, peer: usize, addr: SocketAddr, id: StripeId) -> std::result::Result<(), String> {
    let mut stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    configure(&stream, &shared.options)?;
    let name = ServerName::try_from(rank_name(peer)).map_err(|e| e.to_string())?;
    let mut established = handshake::client(&mut stream, Arc::clone(&shared.client_config), name, shared.options.key_update_records).await?;
    handshake::write_sealed(&mut stream, &mut established.sealer, &hello(shared.rank, id)).await?;
    let Established { opener, opened, leftover, .. } = &mut established;
    let echo = handshake::read_exact_opened(&mut stream, opener, opened, leftover, HELLO_LEN).await?;
    let (claimed, echoed) = read_hello(&echo)?;
    if claimed != peer || echoed != id {
        return Err(format!("rank {peer} answered as rank {claimed}, stripe {echoed:?} for {id:?}"));
    }
    shared.register(peer, id, Connected { stream, established }).map_err(|e| e.to_string())
}

/// `TCP_NODELAY` (frames are written whole) and the liveness settings of the options.
fn configure(stream: &TcpStream, options: &TlsOptions) -> std::result::Result<(), String> {
    stream.set_nodelay(true).map_err(|e| format!("TCP_NODELAY: {e}"))?;
    set_tcp_liveness(socket2::SockRef::from(stream), options.keep_alive, options.idle_timeout)
}

/// Keep-alive probes every `keep_alive` (at least 1 s) and `TCP_USER_TIMEOUT` of `idle_timeout`:
/// a peer that vanishes (its host gone, no reset ever sent) fails the connection within about
/// `idle_timeout`, whether data is waiting to be acknowledged or the link is idle. Shared with the
/// actors' TLS links.
pub fn set_tcp_liveness(socket: socket2::SockRef<'_>, keep_alive: Duration, idle_timeout: Duration) -> std::result::Result<(), String> {
    let probe = keep_alive.max(Duration::from_secs(1));
    let retries = u32::try_from(idle_timeout.as_millis() / probe.as_millis().max(1)).unwrap_or(u32::MAX).max(1);
    let keepalive = socket2::TcpKeepalive::new().with_time(probe).with_interval(probe).with_retries(retries);
    socket.set_tcp_keepalive(&keepalive).map_err(|e| format!("keep-alive: {e}"))?;
    #[cfg(target_os = "linux")]
    socket.set_tcp_user_timeout(Some(idle_timeout)).map_err(|e| format!("TCP_USER_TIMEOUT: {e}"))?;
    Ok(())
}

fn hello(rank: usize, id: StripeId) -> [u8; HELLO_LEN] {
    linking::hello_head(HELLO_MAGIC, rank, id)
}

fn read_hello(bytes: &[u8]) -> std::result::Result<(usize, StripeId), String> {
    if bytes.len() != HELLO_LEN {
        return Err("bad hello".into());
    }
    linking::read_hello_head(HELLO_MAGIC, bytes)
}

fn io(op: &'static str, e: std::io::Error) -> Error {
    Error::Io { op, reason: e.to_string() }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
