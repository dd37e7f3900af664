//! The [`Transport`] trait: reliable, ordered, framed messages between ranks, plus connection events.
//!
//! A transport moves whole encoded frames (see [`crate::frame`]) between global ranks `0..world_size`.
//! Guarantees a transport must give: messages between one ordered pair of ranks arrive complete and
//! at most once; a peer that goes away is reported once with [`TransportEvent::PeerLost`], after
//! every frame it sent has been delivered; and `from` in a received frame is the authenticated
//! sender, not a claim read from the frame. Arrival order between frames is not a guarantee: the
//! endpoint matches each frame to its operation by (generation, lane, source, sequence, chunk),
//! never by position, so a transport may spread one peer's frames over several channels (QUIC
//! with `QuicOptions::stripes` > 1) that overtake each other.
//!
//! Exactly one task (the endpoint's dispatcher) calls [`Transport::recv`]; any task may call
//! [`Transport::send`]. The trait holds no QUIC or tokio-channel types so that the simulator can
//! implement it in memory. Methods return boxed futures so `Arc<dyn Transport>` works.
//!
//! The provided methods are fast paths a transport may take; their defaults keep the simple
//! contract above. [`Transport::send_parts`] takes a frame as its encoded header plus a borrowed
//! payload, so a transport that copies anyway (shared memory) writes the caller's bytes straight
//! into its ring instead of into an intermediate frame buffer; [`Transport::send_chunked`] takes a
//! payload as a received frame's pieces, so a ring passing a frame on unchanged sends quinn's own
//! received bytes back to quinn. [`Transport::attach`] lets a transport
//! push events into the endpoint from the thread or task that read them ([`EventSink`]) instead of
//! handing them to the dispatcher task through `recv`: one cross-thread wake-up less per frame, and
//! the way to lend a payload in place ([`EventSink::lent_frame`], [`LentBytes`]).
//! [`Transport::poll_incoming`] lets a waiting operation take arrived frames itself before it
//! sleeps. [`Transport::checks_integrity`] says the channel already guarantees unaltered bytes, so
//! payloads need no checksum. [`Transport::preferred_chunk_bytes`] and
//! [`Transport::preferred_ring_window`] are the frame size and send-ahead depth the transport moves
//! best, and [`Transport::preferred_channels`] the rings a large all-reduce is split into, for an
//! endpoint whose config leaves them unset.

use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;
use std::ptr::NonNull;
use std::sync::{Arc, Weak};

use crate::error::Result;
use crate::frame::HEADER_LEN;
use crate::pool::{BufferPool, PooledBuf};

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

/// The frame an operation is about to wait for, as [`Transport::poll_incoming`] is told: the
/// transport rank it comes from, its operation sequence number and chunk index (those of its
/// header, see [`crate::frame`]), and its payload size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AwaitedFrame {
    /// Transport rank of the sender.
    pub from: usize,
    /// Operation sequence number.
    pub seq: u64,
    /// Chunk index within the operation on this link.
    pub chunk: u32,
    /// Payload bytes the frame brings.
    pub len: usize,
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

    /// Sends one frame given as its encoded `header` (checksum included) and its `payload`. The
    /// default copies both into a buffer from `pool` and calls [`send`](Self::send); transports
    /// that can copy from the caller's memory directly override it. Must be as atomic as `send`
    /// towards the receiver: a frame cut short by cancellation must not be delivered as a frame.
    fn send_parts<'a>(&'a self, peer: usize, header: &'a [u8; HEADER_LEN], payload: &'a [u8], pool: &'a BufferPool) -> BoxFuture<'a, Result<()>> {
        let mut frame = pool.take(HEADER_LEN + payload.len());
        frame.extend_from_slice(header);
        frame.extend_from_slice(payload);
        self.send(peer, frame)
    }

    /// Sends one frame given as its encoded `header` and a `payload` held in pieces (a received
    /// chunked frame a ring passes on unchanged). The default copies both into a buffer from `pool`
    /// and calls [`send`](Self::send); a transport that can send the pieces as they are (QUIC hands
    /// them to quinn without a copy) overrides it. As atomic towards the receiver as `send`.
    fn send_chunked<'a>(&'a self, peer: usize, header: &'a [u8; HEADER_LEN], payload: ChunkedBytes, pool: &'a BufferPool) -> BoxFuture<'a, Result<()>> {
        let mut frame = pool.take(HEADER_LEN + payload.len());
        frame.extend_from_slice(header);
        for chunk in payload.chunks() {
            frame.extend_from_slice(chunk);
        }
        self.send(peer, frame)
    }

    /// Sends one frame given as its encoded `header` and a payload of `len` bytes that `fill`
    /// writes as the frame goes out ([`FillPayload`]). If `fill` fails, nothing of the frame
    /// reaches the peer and its error is returned. The default fills a buffer from `pool` and
    /// calls [`send`](Self::send); a transport that seals records ([`crate::TlsTransport`]) has
    /// `fill` write each record's plaintext in place and seals it there while it is in cache, see
    /// [`fills_on_send`](Self::fills_on_send). As atomic towards the receiver as `send`.
    fn send_filled<'a>(&'a self, peer: usize, header: &'a [u8; HEADER_LEN], len: usize, fill: &'a mut FillPayload<'a>, pool: &'a BufferPool) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let mut frame = pool.take(HEADER_LEN + len);
            frame.extend_from_slice(header);
            frame.resize(HEADER_LEN + len, 0);
            fill(0..len, &mut frame[HEADER_LEN..])?;
            self.send(peer, frame).await
        })
    }

    /// Whether [`send_filled`](Self::send_filled) writes the payload straight into what goes on
    /// the wire (no intermediate buffer): a ring then combines a received piece into the frame
    /// that passes it on as it sends it, instead of into a buffer when it arrives. Default: no.
    fn fills_on_send(&self) -> bool {
        false
    }

    /// Whether this transport's channel already guarantees that bytes arrive unaltered (memory,
    /// or an authenticated cipher). Frames sent over such a transport carry a checksum of their
    /// header only (see [`crate::frame`]); the default, `false`, checksums payloads too.
    fn checks_integrity(&self) -> bool {
        false
    }

    /// Makes progress on incoming data from the calling thread, if this transport can do so
    /// cheaply: delivers (to the attached [`EventSink`]) the frames that have fully arrived, without
    /// blocking, and returns how many. `None` (the default) means "not supported".
    ///
    /// An operation about to wait for the frame `awaited` calls it in a short spin first: on a
    /// transport whose frames are otherwise read by another thread, that saves the wake-up of the
    /// reader thread and then of the waiting task (most of a small message's latency over shared
    /// memory), and the bytes are copied in by the core that uses them next (over TLS, where the
    /// operation then opens and combines them while they are in its cache). A transport that
    /// spreads one peer's frames over several connections reads the one `awaited` comes on.
    fn poll_incoming(&self, awaited: AwaitedFrame) -> Option<usize> {
        let _ = awaited;
        None
    }

    /// The frame payload size this transport moves best, if it has one: an [`crate::Endpoint`]
    /// whose [`crate::CommConfig::chunk_bytes`] is unset uses it. It must be the same on every
    /// rank, like the config. Shared memory asks for a sixteenth of its ring, so both directions'
    /// rings stay in cache; the default (`None`) means [`crate::DEFAULT_CHUNK_BYTES`].
    fn preferred_chunk_bytes(&self) -> Option<usize> {
        None
    }

    /// How many frames a ring should send ahead of the frames it has received, if this transport
    /// has a preference: an [`crate::Endpoint`] whose [`crate::CommConfig::ring_window`] is unset
    /// uses it. The default (`None`) means [`crate::DEFAULT_RING_WINDOW`]. A transport whose frames
    /// spend long in flight (QUIC: packetised, sealed and opened by other tasks) needs more of them
    /// on the way to keep its cores busy.
    fn preferred_ring_window(&self) -> Option<usize> {
        None
    }

    /// Into how many independent rings (channels, each driven by its own thread on a multi-thread
    /// runtime) a large ring all-reduce should be split, if this transport has a preference: an
    /// [`crate::Endpoint`] whose [`crate::CommConfig::channels`] is unset uses it. It must be the
    /// same on every rank, like the config. The default (`None`) means
    /// [`crate::DEFAULT_CHANNELS`] (one ring); no transport asks for more until measurements on
    /// hosts with cores to spare say so.
    fn preferred_channels(&self) -> Option<usize> {
        None
    }

    /// Up to how many ranks a mid-size all_reduce should run the direct exchange instead of the
    /// ring ([`crate::CommConfig::direct_all_reduce_ranks`]), if this transport has a preference:
    /// one whose every hop costs a frame's latency (a cipher pass, system calls, wake-ups) gains
    /// from two dependent steps instead of `2(n - 1)`. Must be the same on every rank. The default
    /// (`None`) means never.
    fn preferred_direct_all_reduce_ranks(&self) -> Option<usize> {
        None
    }

    /// The operation that was calling [`poll_incoming`](Self::poll_incoming) for `awaited` stops
    /// and sleeps until its frame is delivered: a transport whose reader threads stand back while
    /// operations poll (shared memory, TLS) must have them take over now. The default does nothing.
    fn poll_ended(&self, awaited: AwaitedFrame) {
        let _ = awaited;
    }

    /// Aborts the transport at once, without draining: every send that waits (for ring space or
    /// flow control) and every later send fails with [`crate::Error::TransportClosed`], reading
    /// stops, and peers see the link end. The worker calls it when the supervisor starts a new
    /// generation, so that no operation of the old one can stay blocked on a dead or stopped peer.
    /// Afterwards the endpoint must learn that nothing more comes, by `recv` returning `None` /
    /// [`EventSink::closed`], or by a `PeerLost` for every peer: an operation that starts after the
    /// abort (a generation superseded while it was starting goes on to its first collective) must
    /// fail at once, not wait for frames until its timeout. Must not block. The default does
    /// nothing: for a transport none of whose operations can block past a generation change and
    /// that is never aborted under a running worker (the group's generation bump already fails
    /// the receives waiting then).
    fn abort(&self) {}

    /// Offers push delivery: a transport that returns `true` hands every later event to `sink`
    /// (from whichever thread read it, in the order [`recv`](Self::recv) would have returned them,
    /// per peer) and calls [`EventSink::closed`] when it shuts down; the endpoint then does not call
    /// `recv`. Called at most once, before any event is delivered. The default (`false`) keeps the
    /// pull model.
    fn attach(&self, sink: Weak<dyn EventSink>) -> bool {
        let _ = sink;
        false
    }
}

/// The receiving side of push delivery (see [`Transport::attach`]); the endpoint implements it.
///
/// Methods never block for long (they take short locks, wake waiting operations, and at most copy
/// one frame), so a transport may call them from its reader threads or tasks.
pub trait EventSink: Send + Sync + 'static {
    /// One event, as [`Transport::recv`] would have returned it.
    fn event(&self, event: TransportEvent);
    /// One frame from `from` whose payload stays in the transport's memory: the operation waiting
    /// for it reads (and may combine into) the payload in place, and dropping it gives the memory
    /// back. The endpoint copies it out instead when no operation is waiting for it yet, so lent
    /// memory is never parked. The default copies it into an unpooled buffer and calls
    /// [`event`](Self::event).
    fn lent_frame(&self, from: usize, header: [u8; HEADER_LEN], payload: LentBytes) {
        let mut bytes = Vec::with_capacity(HEADER_LEN + payload.len());
        bytes.extend_from_slice(&header);
        bytes.extend_from_slice(&payload);
        drop(payload);
        self.event(TransportEvent::Frame { from, bytes: PooledBuf::unpooled(bytes) });
    }
    /// One frame from `from` whose payload arrived in pieces that the transport hands over as
    /// they are (a QUIC stream's decrypted packets), so it is never copied into one buffer: the
    /// operation waiting for it copies or combines straight from the pieces. The default joins
    /// the pieces into an unpooled buffer and calls [`event`](Self::event).
    fn chunked_frame(&self, from: usize, header: [u8; HEADER_LEN], payload: ChunkedBytes) {
        let mut bytes = Vec::with_capacity(HEADER_LEN + payload.len());
        bytes.extend_from_slice(&header);
        for chunk in payload.chunks() {
            bytes.extend_from_slice(chunk);
        }
        self.event(TransportEvent::Frame { from, bytes: PooledBuf::unpooled(bytes) });
    }
    /// One frame from `from` whose payload the transport hands over still sealed (see
    /// [`SealedPayload`]): the operation that copies it whole into its output opens it straight
    /// there, one pass over the bytes instead of an open and a copy. The default opens it into an
    /// unpooled buffer and calls [`event`](Self::event); a payload that does not open is dropped
    /// (the transport has broken the link, and its peer-lost event follows).
    fn sealed_frame(&self, from: usize, header: [u8; HEADER_LEN], payload: Box<dyn SealedPayload>) {
        let mut bytes = vec![0; HEADER_LEN + payload.len()];
        bytes[..HEADER_LEN].copy_from_slice(&header);
        if payload.open_into(&mut bytes[HEADER_LEN..]).is_ok() {
            self.event(TransportEvent::Frame { from, bytes: PooledBuf::unpooled(bytes) });
        }
    }
    /// The transport is shut down for good (what `recv` returning `None` means).
    fn closed(&self);
}

/// Bytes held as a list of pieces owned by whoever produced them (see
/// [`EventSink::chunked_frame`]); read-only.
#[derive(Default)]
pub struct ChunkedBytes {
    chunks: Vec<Box<dyn AsRef<[u8]> + Send + Sync>>,
    len: usize,
}

impl ChunkedBytes {
    /// No bytes yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `chunk`.
    pub fn push(&mut self, chunk: impl AsRef<[u8]> + Send + Sync + 'static) {
        self.len += chunk.as_ref().len();
        self.chunks.push(Box::new(chunk));
    }

    /// Total length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Piece `i`, in order.
    pub(crate) fn chunk(&self, i: usize) -> Option<&[u8]> {
        self.chunks.get(i).map(|c| (**c).as_ref())
    }

    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The pieces, in order.
    pub fn chunks(&self) -> impl Iterator<Item = &[u8]> {
        self.chunks.iter().map(|c| (**c).as_ref())
    }

    /// The pieces, in order, as owned values (to hand them on without a copy).
    pub fn into_pieces(self) -> impl Iterator<Item = BytesPiece> {
        self.chunks.into_iter().map(BytesPiece)
    }
}

/// One piece of a [`ChunkedBytes`], owned (see [`ChunkedBytes::into_pieces`]).
pub struct BytesPiece(Box<dyn AsRef<[u8]> + Send + Sync>);

impl AsRef<[u8]> for BytesPiece {
    fn as_ref(&self) -> &[u8] {
        (*self.0).as_ref()
    }
}

impl std::fmt::Debug for BytesPiece {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BytesPiece").field("len", &self.as_ref().len()).finish()
    }
}

impl std::fmt::Debug for ChunkedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkedBytes").field("len", &self.len).field("chunks", &self.chunks.len()).finish()
    }
}

/// A frame payload that its transport received but has not opened yet (TLS records whose frame
/// header said the receiver copies the payload whole: [`crate::frame::FLAG_COPIED`]). Opening
/// authenticates and decrypts it into memory the caller chooses, so the bytes are written once,
/// where they are wanted.
pub trait SealedPayload: Send + Sync + 'static {
    /// Plaintext length in bytes.
    fn len(&self) -> usize;
    /// Whether the plaintext is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Authenticates and decrypts the payload into `dst` (exactly [`len`](Self::len) bytes). On
    /// failure `dst` holds no meaningful bytes, and the transport has broken the link the payload
    /// came on (its stream can no longer be trusted), so the peer fails too.
    fn open_into(&self, dst: &mut [u8]) -> std::result::Result<(), String>;

    /// The payload opened piece by piece, front to back, each piece into scratch memory of the
    /// cursor's own (one record at a time, in cache while it is used); the same failure
    /// behaviour as [`open_into`](Self::open_into).
    fn cursor(&self) -> Box<dyn PlainCursor + '_>;
}

/// A payload's plaintext read front to back in pieces ([`SealedPayload::cursor`]).
pub trait PlainCursor: Send {
    /// Moves to the next piece: `Ok(false)` past the last one.
    fn advance(&mut self) -> std::result::Result<bool, String>;
    /// The current piece (empty before the first [`advance`](Self::advance)).
    fn piece(&self) -> &[u8];
    /// The length of the next piece if it can be opened straight into a caller's buffer
    /// ([`advance_into`](Self::advance_into)); `None` if it cannot (or there is none).
    fn next_len(&self) -> Option<usize> {
        None
    }
    /// Moves past the next piece, opening it into `dst[..n]` where `n` is
    /// [`next_len`](Self::next_len); `dst` must be at least one byte longer, and that byte is
    /// overwritten. The current piece is empty afterwards.
    fn advance_into(&mut self, dst: &mut [u8]) -> std::result::Result<(), String> {
        Err(format!("this cursor cannot open into {} bytes of the caller's", dst.len()))
    }
}

/// Writes payload bytes `range` into the given slice (consecutive ranges covering the payload,
/// in order, each starting at 0 or a multiple of 16 KiB, so at whole elements): how
/// [`Transport::send_filled`] asks for a payload as it sends it.
pub type FillPayload<'a> = dyn FnMut(std::ops::Range<usize>, &mut [u8]) -> Result<()> + Send + 'a;

impl std::fmt::Debug for dyn SealedPayload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SealedPayload").field("len", &self.len()).finish()
    }
}

/// Takes back memory lent with a [`LentBytes`].
pub trait Lender: Send + Sync + 'static {
    /// The borrower is done with the bytes lent under `token`.
    fn release(&self, token: u64);
}

/// Bytes a transport lends out of its own memory (a shared-memory ring slot) instead of copying
/// them: readable and writable by the holder, given back to the [`Lender`] on drop.
pub struct LentBytes {
    ptr: NonNull<u8>,
    len: usize,
    lender: Arc<dyn Lender>,
    token: u64,
}

// SAFETY: a `LentBytes` is the only handle to its bytes until it is dropped (the contract of
// `LentBytes::new`), so moving or sharing it across threads is like moving or sharing a `Vec<u8>`.
unsafe impl Send for LentBytes {}
// SAFETY: as above; `&LentBytes` only gives `&[u8]`.
unsafe impl Sync for LentBytes {}

impl LentBytes {
    /// Lends `len` bytes at `ptr`; `lender.release(token)` runs when the value is dropped.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must be valid for reads and writes, and not accessed by anyone else, from
    /// now until `lender.release(token)` is called; `lender` must keep the memory alive that long.
    pub unsafe fn new(ptr: NonNull<u8>, len: usize, lender: Arc<dyn Lender>, token: u64) -> LentBytes {
        LentBytes { ptr, len, lender, token }
    }
}

impl Deref for LentBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: valid and exclusively ours until drop (see `new`).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for LentBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: valid and exclusively ours until drop (see `new`).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for LentBytes {
    fn drop(&mut self) {
        self.lender.release(self.token);
    }
}

impl std::fmt::Debug for LentBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LentBytes").field("len", &self.len).field("token", &self.token).finish_non_exhaustive()
    }
}
