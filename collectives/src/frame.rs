//! Wire frames: a fixed 64-byte little-endian header followed by the raw payload bytes.
//!
//! Layout (all integers little-endian):
//!
//! | bytes  | field          |
//! |--------|----------------|
//! | 0..4   | magic `RTXF`   |
//! | 4..6   | version (2)    |
//! | 6      | op kind (1-10, see [`OpKind::code`]) |
//! | 7      | dtype code (0 = none) |
//! | 8..16  | group id       |
//! | 16..24 | generation     |
//! | 24..32 | op sequence    |
//! | 32..36 | chunk index    |
//! | 36..40 | source rank    |
//! | 40..48 | payload length |
//! | 48..52 | crc32 of bytes 0..48, 52..64 and (unless flag 1 is set) the payload |
//! | 52     | flags: bit 0 = the checksum does not cover the payload; bit 1 = the receiver copies the payload whole into its output (see below); other bits zero |
//! | 53     | channels: how many rings the operation was split into, 0 for one (see below) |
//! | 54..64 | reserved, zero |
//!
//! The header is always checksummed. The payload is too unless the sending transport says its
//! channel already guarantees integrity ([`crate::Transport::checks_integrity`]): shared memory and
//! in-process channels are memory, and QUIC authenticates every packet with AES-GCM, so a corrupted
//! byte never reaches the decoder. There the payload checksum was pure cost: reading a large tensor
//! once more on each side (about a fifth of the CPU time of a shared-memory all-reduce).
//!
//! Channels (byte 53): a large all-reduce may run as several independent rings over parts of the
//! buffer, each with a sequence number of its own (`crate::CommConfig::channels`). Every frame of
//! such an operation names the channel count, so a rank whose count differs (a config mismatch)
//! fails with a typed error ([`Error::ChannelMismatch`]) instead of matching frames of another
//! shape. Operations on one ring write 0 there, so their frames are byte for byte those of a build
//! without channels (which read byte 53 as reserved, and so refuse channelled frames with
//! [`Error::ReservedNonZero`]); the version stays 2.
//!
//! Payloads read once (flag bit 1, [`FLAG_COPIED`]): the receiver reads the payload once, front
//! to back, into something else: a ring's all-gather steps copy it into the output, and over a
//! transport that fills payloads as it seals them ([`crate::Transport::fills_on_send`]) a ring's
//! reduce-scatter steps combine it into their own part or into the frame they send on. The flag
//! tells a transport that seals its stream (TLS) so before the payload arrives; it may then hand
//! the payload over still sealed ([`crate::SealedPayload`]) and the operation opens it into the
//! output, or record by record into cache as it combines ([`Frame::plain`]): one pass over those
//! bytes instead of an open in place and a second read. Every other reader ignores the flag; it is
//! set only where the checksum covers the header alone (transports that authenticate).
//!
//! Decision: DESIGN.md suggests an rkyv header. The header is eleven fixed-width scalars and never
//! grows variable-length fields, so a hand-written fixed layout gives the same zero-copy access with
//! explicit, per-field validation (every rejection is a typed [`Error`]), a byte layout that does not
//! depend on a crate version, and no proc-macro build cost on 2-core CI. rkyv stays the right tool for
//! variable-shaped control messages (actors), not for this header.
//!
//! Payloads are copied into the frame buffer with one `memcpy` (never encoded element by element);
//! frame buffers come from a [`BufferPool`] so the hot path does not touch fresh pages. Decoding never
//! panics: every malformed input maps to an error variant.

use std::fmt;
use std::ops::Range;

use rtx_kernels::DType;

use crate::error::{Error, Result};
use crate::pool::{BufferPool, PooledBuf};
use crate::transport::{ChunkedBytes, LentBytes, PlainCursor, SealedPayload};

/// Header length in bytes; the payload starts here.
pub const HEADER_LEN: usize = 64;
/// Magic number, `RTXF` read as a little-endian u32.
pub const MAGIC: u32 = u32::from_le_bytes(*b"RTXF");
/// Wire format version this build writes and accepts.
pub const VERSION: u16 = 2;
/// Flag bit: the checksum covers the header only.
pub const FLAG_HEADER_ONLY_CHECKSUM: u8 = 1;
/// Flag bit: the receiver reads the payload once, front to back (copies or combines it; a hint
/// that lets a sealing transport hand it over sealed; see the module doc).
pub const FLAG_COPIED: u8 = 2;

const CHECKSUM_RANGE: std::ops::Range<usize> = 48..52;
const FLAGS: usize = 52;
const KNOWN_FLAGS: u8 = FLAG_HEADER_ONLY_CHECKSUM | FLAG_COPIED;
const CHANNELS: usize = 53;
const RESERVED_RANGE: std::ops::Range<usize> = 54..64;
const _: () = assert!(RESERVED_RANGE.end == HEADER_LEN);
const _: () = assert!(CHECKSUM_RANGE.end == FLAGS && FLAGS + 1 == CHANNELS && CHANNELS + 1 == RESERVED_RANGE.start);
// Payload bytes are reinterpreted as host elements; the wire format is little-endian.
const _: () = assert!(cfg!(target_endian = "little"));

/// Which operation a frame belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpKind {
    /// Point-to-point `send`/`recv`.
    Send,
    /// `all_reduce`.
    AllReduce,
    /// `reduce_scatter`.
    ReduceScatter,
    /// `all_gather`.
    AllGather,
    /// `broadcast`.
    Broadcast,
    /// `reduce` to one root.
    Reduce,
    /// `barrier`.
    Barrier,
    /// `all_to_all`.
    AllToAll,
    /// The exchange inside `split`.
    Split,
    /// Not an operation: a rank's notice that its collective `seq` failed because the member named
    /// in the chunk field is lost; no payload. Receivers fail their part of that collective too.
    Abort,
}

/// The decoded, validated fields of a frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// Group the frame belongs to.
    pub group: u64,
    /// Generation of the group the sender was at.
    pub generation: u64,
    /// Operation sequence number within the generation (per peer pair for `Send`).
    pub seq: u64,
    /// Operation kind.
    pub op: OpKind,
    /// Chunk index within the operation on this sender→receiver link.
    pub chunk: u32,
    /// Global rank of the sender.
    pub src: u32,
    /// Element type of the payload; `None` for header-only frames.
    pub dtype: Option<DType>,
    /// Payload length in bytes.
    pub payload_len: u64,
    /// How many channels (rings over parts of the buffer, each its own sequence number) the
    /// operation was split into; 0 for an operation run as one.
    pub channels: u8,
}

/// A received frame: its header and the buffer that holds header and payload.
#[derive(Debug)]
pub struct Frame {
    /// The validated header.
    pub header: FrameHeader,
    bytes: FrameBytes,
}

/// Where a received frame's bytes are.
#[derive(Debug)]
enum FrameBytes {
    /// Header and payload in one pooled buffer.
    Pooled(PooledBuf),
    /// The payload in place in the transport's memory.
    Lent(LentBytes),
    /// The payload as the transport's pieces; only [`Frame::payload_parts`] reads it (the
    /// operation's receive step turns it into `Pooled` for everything else).
    Chunked(ChunkedBytes),
    /// The payload still sealed by the transport: the operation's receive step opens it, into
    /// its output or into a pooled buffer ([`Frame::open_into`], [`Frame::opened`]).
    Sealed(Box<dyn SealedPayload>),
}

/// A received frame's bytes, taken to be sent on unchanged or after combining into them (see
/// [`Frame::into_outgoing`]).
pub(crate) enum Outgoing {
    /// Header and payload in one buffer: the new header is written over the old one.
    Pooled(PooledBuf),
    /// The payload in place in the transport's memory.
    Lent(LentBytes),
    /// The payload as the transport's pieces.
    Chunked(ChunkedBytes),
}

/// A received payload's plaintext front to back in pieces, however the frame holds it: its one
/// buffer, its transport's pieces, or its sealed records opened one at a time into the cursor's
/// scratch ([`Frame::plain`]). Read as runs of whole elements with
/// [`take_elements`](Self::take_elements).
pub(crate) struct PlainStream<'a> {
    src: usize,
    pieces: PlainPieces<'a>,
    /// Bytes of the current piece already taken.
    at: usize,
    /// Bytes of earlier pieces.
    taken: usize,
}

enum PlainPieces<'a> {
    One { payload: &'a [u8], started: bool },
    Chunked { chunks: &'a ChunkedBytes, next: usize, current: &'a [u8] },
    Sealed(Box<dyn PlainCursor + 'a>),
}

impl PlainStream<'_> {
    fn piece(&self) -> &[u8] {
        match &self.pieces {
            PlainPieces::One { payload, started } => if *started { payload } else { &[] },
            PlainPieces::Chunked { current, .. } => current,
            PlainPieces::Sealed(cursor) => cursor.piece(),
        }
    }

    /// Moves to the next piece: `Ok(false)` past the last one.
    fn advance(&mut self) -> Result<bool> {
        self.taken += self.at;
        self.at = 0;
        let more = match &mut self.pieces {
            PlainPieces::One { started, .. } => !std::mem::replace(started, true),
            PlainPieces::Chunked { chunks, next, current } => match chunks.chunk(*next) {
                Some(chunk) => {
                    *next += 1;
                    *current = chunk;
                    true
                }
                None => false,
            },
            PlainPieces::Sealed(cursor) => cursor.advance().map_err(|reason| Error::Unauthentic { src: self.src, reason })?,
        };
        Ok(more)
    }

    /// Moves to the next piece; a payload shorter than what is taken is an error.
    fn advance_for(&mut self, wanted: usize) -> Result<()> {
        if self.advance()? {
            return Ok(());
        }
        Err(Error::PayloadLength { src: self.src, expected: self.taken + wanted, got: self.taken })
    }

    /// Takes the next `len` bytes into `dst[..len]`. Sealed records that fit whole are opened
    /// straight there rather than through the cursor's scratch, when `dst` has a byte of room past
    /// them (the record's content type lands there): so `dst[len]`, if there, may be overwritten.
    pub(crate) fn take_into(&mut self, dst: &mut [u8], len: usize) -> Result<()> {
        debug_assert!(len <= dst.len());
        let mut done = 0;
        while done < len {
            let rest = &self.piece()[self.at..];
            if !rest.is_empty() {
                let n = rest.len().min(len - done);
                dst[done..done + n].copy_from_slice(&rest[..n]);
                self.at += n;
                done += n;
                continue;
            }
            if let PlainPieces::Sealed(cursor) = &mut self.pieces {
                if let Some(n) = cursor.next_len().filter(|&n| n > 0 && done + n <= len && done + n < dst.len()) {
                    cursor.advance_into(&mut dst[done..]).map_err(|reason| Error::Unauthentic { src: self.src, reason })?;
                    self.taken += self.at + n;
                    self.at = 0;
                    done += n;
                    continue;
                }
            }
            self.advance_for(len - done)?;
        }
        Ok(())
    }

    /// Takes the next `count` elements of `size` bytes, calling `f(elements, bytes)` for runs
    /// of whole elements (element indices relative to this call); an element split across two
    /// pieces is put together in a small buffer and passed on its own.
    pub(crate) fn take_elements(&mut self, size: usize, count: usize, mut f: impl FnMut(Range<usize>, &[u8])) -> Result<()> {
        const CARRY: usize = 16;
        debug_assert!(size > 0 && size <= CARRY);
        let mut done = 0;
        while done < count {
            let rest = &self.piece()[self.at..];
            if rest.is_empty() {
                self.advance_for((count - done) * size)?;
                continue;
            }
            let whole = (rest.len() / size).min(count - done);
            if whole > 0 {
                f(done..done + whole, &rest[..whole * size]);
                done += whole;
                self.at += whole * size;
                continue;
            }
            let mut carry = [0u8; CARRY];
            let mut have = rest.len();
            carry[..have].copy_from_slice(rest);
            self.at += have;
            while have < size {
                self.advance_for((count - done) * size - have)?;
                let piece = self.piece();
                let take = (size - have).min(piece.len());
                carry[have..have + take].copy_from_slice(&piece[..take]);
                have += take;
                self.at = take;
            }
            f(done..done + 1, &carry[..size]);
            done += 1;
        }
        Ok(())
    }
}

/// The pieces of a frame's payload, in order (see [`Frame::payload_parts`]).
pub(crate) enum PayloadParts<'a> {
    One(Option<&'a [u8]>),
    Many(Box<dyn Iterator<Item = &'a [u8]> + 'a>),
}

impl<'a> Iterator for PayloadParts<'a> {
    type Item = &'a [u8];
    fn next(&mut self) -> Option<&'a [u8]> {
        match self {
            PayloadParts::One(part) => part.take(),
            PayloadParts::Many(parts) => parts.next(),
        }
    }
}

impl OpKind {
    /// The wire code.
    pub const fn code(self) -> u8 {
        match self {
            OpKind::Send => 1,
            OpKind::AllReduce => 2,
            OpKind::ReduceScatter => 3,
            OpKind::AllGather => 4,
            OpKind::Broadcast => 5,
            OpKind::Reduce => 6,
            OpKind::Barrier => 7,
            OpKind::AllToAll => 8,
            OpKind::Split => 9,
            OpKind::Abort => 10,
        }
    }

    /// The operation for a wire code.
    pub fn from_code(code: u8) -> Result<Self> {
        Ok(match code {
            1 => OpKind::Send,
            2 => OpKind::AllReduce,
            3 => OpKind::ReduceScatter,
            4 => OpKind::AllGather,
            5 => OpKind::Broadcast,
            6 => OpKind::Reduce,
            7 => OpKind::Barrier,
            8 => OpKind::AllToAll,
            9 => OpKind::Split,
            10 => OpKind::Abort,
            _ => return Err(Error::UnknownOpKind { code }),
        })
    }

    /// The name used in spans and error messages.
    pub const fn as_str(self) -> &'static str {
        match self {
            OpKind::Send => "send",
            OpKind::AllReduce => "all_reduce",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllGather => "all_gather",
            OpKind::Broadcast => "broadcast",
            OpKind::Reduce => "reduce",
            OpKind::Barrier => "barrier",
            OpKind::AllToAll => "all_to_all",
            OpKind::Split => "split",
            OpKind::Abort => "abort",
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Frame {
    /// The payload bytes. A frame decoded from pieces ([`decode_chunked`](Self::decode_chunked))
    /// must first be made contiguous with [`into_contiguous`](Self::into_contiguous); until then
    /// this is empty.
    pub fn payload(&self) -> &[u8] {
        match &self.bytes {
            FrameBytes::Pooled(buf) => &buf[HEADER_LEN..],
            FrameBytes::Lent(payload) => payload,
            FrameBytes::Chunked(_) | FrameBytes::Sealed(_) => {
                debug_assert!(false, "payload of a chunked or sealed frame: make it contiguous first");
                &[]
            }
        }
    }

    /// The payload bytes, writable (a ring step combines into a received frame and forwards it).
    /// As [`payload`](Self::payload), for contiguous frames.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        match &mut self.bytes {
            FrameBytes::Pooled(buf) => &mut buf[HEADER_LEN..],
            FrameBytes::Lent(payload) => payload,
            FrameBytes::Chunked(_) | FrameBytes::Sealed(_) => {
                debug_assert!(false, "payload of a chunked or sealed frame: make it contiguous first");
                &mut []
            }
        }
    }

    /// The payload length in bytes, however it is held.
    pub fn payload_len(&self) -> usize {
        match &self.bytes {
            FrameBytes::Pooled(buf) => buf.len() - HEADER_LEN,
            FrameBytes::Lent(payload) => payload.len(),
            FrameBytes::Chunked(chunks) => chunks.len(),
            FrameBytes::Sealed(sealed) => sealed.len(),
        }
    }

    /// The payload as a sequence of byte slices (one, unless the frame is chunked).
    pub(crate) fn payload_parts(&self) -> PayloadParts<'_> {
        match &self.bytes {
            FrameBytes::Pooled(buf) => PayloadParts::One(Some(&buf[HEADER_LEN..])),
            FrameBytes::Lent(payload) => PayloadParts::One(Some(payload)),
            FrameBytes::Chunked(chunks) => PayloadParts::Many(Box::new(chunks.chunks())),
            FrameBytes::Sealed(_) => {
                debug_assert!(false, "parts of a sealed frame: open it first");
                PayloadParts::One(None)
            }
        }
    }

    /// The payload's plaintext front to back ([`PlainStream`]): a sealed payload is opened a
    /// record at a time as it is read, never whole.
    pub(crate) fn plain(&self) -> PlainStream<'_> {
        let pieces = match &self.bytes {
            FrameBytes::Pooled(buf) => PlainPieces::One { payload: &buf[HEADER_LEN..], started: false },
            FrameBytes::Lent(payload) => PlainPieces::One { payload, started: false },
            FrameBytes::Chunked(chunks) => PlainPieces::Chunked { chunks, next: 0, current: &[] },
            FrameBytes::Sealed(sealed) => PlainPieces::Sealed(sealed.cursor()),
        };
        PlainStream { src: self.header.src as usize, pieces, at: 0, taken: 0 }
    }

    /// Whether the payload is still sealed by the transport.
    pub fn is_sealed(&self) -> bool {
        matches!(self.bytes, FrameBytes::Sealed(_))
    }

    /// Opens a sealed payload straight into `dst` (exactly [`payload_len`](Self::payload_len)
    /// bytes); `Ok(false)`, touching nothing, for a frame that is not sealed.
    pub fn open_into(&self, dst: &mut [u8]) -> Result<bool> {
        match &self.bytes {
            FrameBytes::Sealed(sealed) => {
                debug_assert_eq!(dst.len(), sealed.len(), "open: length checked on receipt");
                sealed.open_into(dst).map_err(|reason| Error::Unauthentic { src: self.header.src as usize, reason })?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// The same frame with a sealed payload opened into a buffer from `pool`; other frames are
    /// returned as they are.
    pub fn opened(self, pool: &BufferPool) -> Result<Frame> {
        if !self.is_sealed() {
            return Ok(self);
        }
        let len = self.payload_len();
        let mut buf = pool.take(HEADER_LEN + len);
        buf.extend_from_slice(&encode_header_only_checksum(&self.header, len));
        buf.resize(HEADER_LEN + len, 0);
        self.open_into(&mut buf[HEADER_LEN..])?;
        Ok(Frame { header: self.header, bytes: FrameBytes::Pooled(buf) })
    }

    /// Whether the payload is held in pieces.
    pub fn is_chunked(&self) -> bool {
        matches!(self.bytes, FrameBytes::Chunked(_))
    }

    /// The same frame with its payload in one buffer: a chunked payload is joined into a buffer
    /// from `pool`; other frames are returned as they are.
    pub fn into_contiguous(self, pool: &BufferPool) -> Frame {
        match self.bytes {
            FrameBytes::Chunked(chunks) => {
                let mut buf = pool.take(HEADER_LEN + chunks.len());
                buf.extend_from_slice(&encode_header_only_checksum(&self.header, chunks.len()));
                for chunk in chunks.chunks() {
                    buf.extend_from_slice(chunk);
                }
                Frame { header: self.header, bytes: FrameBytes::Pooled(buf) }
            }
            FrameBytes::Sealed(_) => {
                debug_assert!(false, "contiguous of a sealed frame: open it first");
                self
            }
            bytes => Frame { header: self.header, bytes },
        }
    }

    /// The frame's bytes, to send on (the header is encoded anew by the sender).
    pub(crate) fn into_outgoing(self) -> Outgoing {
        match self.bytes {
            FrameBytes::Pooled(buf) => Outgoing::Pooled(buf),
            FrameBytes::Lent(payload) => Outgoing::Lent(payload),
            FrameBytes::Chunked(chunks) => Outgoing::Chunked(chunks),
            FrameBytes::Sealed(_) => {
                debug_assert!(false, "sending on a sealed frame: open it first");
                Outgoing::Chunked(ChunkedBytes::new())
            }
        }
    }

    /// A frame made locally in `buf` (whose first [`HEADER_LEN`] bytes are room for a header) to
    /// be sent on like a received one; `header` describes it.
    pub(crate) fn from_pooled(header: FrameHeader, buf: PooledBuf) -> Frame {
        debug_assert!(buf.len() >= HEADER_LEN, "a pooled frame starts with room for its header");
        Frame { header, bytes: FrameBytes::Pooled(buf) }
    }

    /// Decodes and fully validates a frame whose payload is held in pieces.
    pub fn decode_chunked(header: &[u8; HEADER_LEN], payload: ChunkedBytes, max_payload: usize) -> Result<Frame> {
        let decoded = decode_header(header, max_payload)?;
        if decoded.payload_len != payload.len() as u64 {
            return Err(Error::PayloadLengthMismatch { declared: decoded.payload_len, actual: payload.len() });
        }
        let expected = read_u32(header, CHECKSUM_RANGE.start);
        let computed = if header[FLAGS] & FLAG_HEADER_ONLY_CHECKSUM != 0 { checksum(header, &[]) } else { checksum_parts(header, payload.chunks()) };
        if expected != computed {
            return Err(Error::ChecksumMismatch { expected, computed });
        }
        Ok(Frame { header: decoded, bytes: FrameBytes::Chunked(payload) })
    }

    /// Decodes and validates a frame whose payload is still sealed by the transport (which
    /// authenticates it when it is opened): the header's fields, its checksum (which must cover
    /// the header only) and the payload length.
    pub fn decode_sealed(header: &[u8; HEADER_LEN], payload: Box<dyn SealedPayload>, max_payload: usize) -> Result<Frame> {
        let decoded = decode_header(header, max_payload)?;
        if decoded.payload_len != payload.len() as u64 {
            return Err(Error::PayloadLengthMismatch { declared: decoded.payload_len, actual: payload.len() });
        }
        // The payload cannot be checksummed before it is opened: only a header-only checksum fits.
        let (expected, computed) = (read_u32(header, CHECKSUM_RANGE.start), checksum(header, &[]));
        if header[FLAGS] & FLAG_HEADER_ONLY_CHECKSUM == 0 || expected != computed {
            return Err(Error::ChecksumMismatch { expected, computed });
        }
        Ok(Frame { header: decoded, bytes: FrameBytes::Sealed(payload) })
    }

    /// Decodes and fully validates a frame held in `buf` (header fields, length, checksum).
    pub fn decode(buf: PooledBuf, max_payload: usize) -> Result<Frame> {
        let header = decode(&buf, max_payload)?;
        Ok(Frame { header, bytes: FrameBytes::Pooled(buf) })
    }

    /// Decodes and fully validates a frame whose payload a transport lends in place.
    pub fn decode_lent(header: &[u8; HEADER_LEN], payload: LentBytes, max_payload: usize) -> Result<Frame> {
        let decoded = decode_parts(header, &payload, max_payload)?;
        Ok(Frame { header: decoded, bytes: FrameBytes::Lent(payload) })
    }

    /// Whether the payload is lent by the transport (rather than held in a buffer of our own).
    pub fn is_lent(&self) -> bool {
        matches!(self.bytes, FrameBytes::Lent(_))
    }

    /// The same frame in a buffer from `pool`; a lent payload is copied out and given back.
    pub fn into_owned(self, pool: &BufferPool) -> Frame {
        match self.bytes {
            FrameBytes::Pooled(_) | FrameBytes::Chunked(_) | FrameBytes::Sealed(_) => self,
            FrameBytes::Lent(payload) => {
                let mut buf = pool.take(HEADER_LEN + payload.len());
                let header = encode_header_only_checksum(&self.header, payload.len());
                buf.extend_from_slice(&header);
                buf.extend_from_slice(&payload);
                Frame { header: self.header, bytes: FrameBytes::Pooled(buf) }
            }
        }
    }
}

/// Wire code of a dtype (0 is reserved for "no payload").
pub const fn dtype_code(dtype: Option<DType>) -> u8 {
    match dtype {
        None => 0,
        Some(DType::F32) => 1,
        Some(DType::F64) => 2,
        Some(DType::BF16) => 3,
        Some(DType::U32) => 4,
        Some(DType::I64) => 5,
    }
}

fn dtype_from_code(code: u8) -> Result<Option<DType>> {
    Ok(match code {
        0 => None,
        1 => Some(DType::F32),
        2 => Some(DType::F64),
        3 => Some(DType::BF16),
        4 => Some(DType::U32),
        5 => Some(DType::I64),
        _ => return Err(Error::UnknownDType { code }),
    })
}

/// Encodes a frame into a pooled buffer: header, then `payload` copied in one piece.
///
/// `header.payload_len` is overwritten with `payload.len()`.
pub fn encode(pool: &BufferPool, header: &FrameHeader, payload: &[u8]) -> PooledBuf {
    let total = HEADER_LEN + payload.len();
    let mut buf = pool.take(total);
    buf.extend_from_slice(&encode_header(header, payload));
    buf.extend_from_slice(payload);
    debug_assert_eq!(buf.len(), total);
    buf
}

/// The 64 header bytes of a frame carrying `payload`, checksum included; the frame is these bytes
/// followed by `payload` (see [`crate::Transport::send_parts`]).
///
/// `header.payload_len` is overwritten with `payload.len()`. The checksum reads `payload` once; for
/// payloads up to a few MiB that also brings them into cache for the copy that follows.
pub fn encode_header(header: &FrameHeader, payload: &[u8]) -> [u8; HEADER_LEN] {
    let mut out = [0u8; HEADER_LEN];
    write_header(&mut out, header, payload.len() as u64);
    let crc = checksum(&out, payload);
    out[CHECKSUM_RANGE].copy_from_slice(&crc.to_le_bytes());
    out
}

/// [`encode_header`] for a payload of `payload_len` bytes given as pieces, in order.
pub fn encode_header_parts<'a>(header: &FrameHeader, payload_len: usize, payload: impl Iterator<Item = &'a [u8]>) -> [u8; HEADER_LEN] {
    let mut out = [0u8; HEADER_LEN];
    write_header(&mut out, header, payload_len as u64);
    let crc = checksum_parts(&out, payload);
    out[CHECKSUM_RANGE].copy_from_slice(&crc.to_le_bytes());
    out
}

/// The 64 header bytes of a frame whose payload of `payload_len` bytes is not checksummed (flag
/// [`FLAG_HEADER_ONLY_CHECKSUM`]): for transports that guarantee integrity themselves. Does not
/// read the payload.
pub fn encode_header_only_checksum(header: &FrameHeader, payload_len: usize) -> [u8; HEADER_LEN] {
    encode_header_flagged(header, payload_len, FLAG_HEADER_ONLY_CHECKSUM)
}

/// [`encode_header_only_checksum`] with [`FLAG_COPIED`] set: the receiver reads this payload
/// once, front to back.
pub fn encode_header_copied(header: &FrameHeader, payload_len: usize) -> [u8; HEADER_LEN] {
    encode_header_flagged(header, payload_len, FLAG_HEADER_ONLY_CHECKSUM | FLAG_COPIED)
}

/// The header bytes with `flags`, checksummed over the header alone.
fn encode_header_flagged(header: &FrameHeader, payload_len: usize, flags: u8) -> [u8; HEADER_LEN] {
    let mut out = [0u8; HEADER_LEN];
    write_header(&mut out, header, payload_len as u64);
    out[FLAGS] = flags;
    let crc = checksum(&out, &[]);
    out[CHECKSUM_RANGE].copy_from_slice(&crc.to_le_bytes());
    out
}

/// Whether the encoded header `header` carries [`FLAG_COPIED`] (the payload is read once, front
/// to back, by the receiver). Reads the flag byte only: validate the header first.
pub fn says_copied(header: &[u8; HEADER_LEN]) -> bool {
    header[FLAGS] & FLAG_COPIED != 0
}

/// Where the encoded header at the start of `bytes` falls among its operation's frames: its op
/// sequence number plus its chunk index (wrapping), read without validation; 0 for fewer bytes
/// than that. A placement hint that sender and receiver derive alike (a transport spreading one
/// peer's frames over several connections puts a frame on connection `place % count`), never
/// something to trust.
pub fn header_place(bytes: &[u8]) -> u64 {
    match (bytes.get(24..32), bytes.get(32..36)) {
        (Some(seq), Some(chunk)) => place(u64::from_le_bytes(seq.try_into().unwrap_or_default()), u32::from_le_bytes(chunk.try_into().unwrap_or_default())),
        _ => 0,
    }
}

/// The placement of the frame with op sequence `seq` and chunk index `chunk` (see
/// [`header_place`]): what a receiver that knows which frame it waits for derives.
pub fn place(seq: u64, chunk: u32) -> u64 {
    seq.wrapping_add(u64::from(chunk))
}

/// The payload length the encoded header at the start of `bytes` declares, read without
/// validation; 0 for fewer bytes than that. A hint for a sending transport, as [`header_place`].
pub fn header_payload_len(bytes: &[u8]) -> usize {
    bytes.get(40..48).and_then(|b| b.try_into().ok()).map_or(0, |b| usize::try_from(u64::from_le_bytes(b)).unwrap_or(usize::MAX))
}

/// Validates the header part of `bytes` (magic, version, op, dtype, reserved bytes, length cap).
///
/// Does not look at the payload or the checksum; stream readers use it to learn how many payload
/// bytes follow before reading them.
pub fn decode_header(bytes: &[u8], max_payload: usize) -> Result<FrameHeader> {
    let header: &[u8; HEADER_LEN] = match bytes.get(..HEADER_LEN).and_then(|h| h.try_into().ok()) {
        Some(h) => h,
        None => return Err(Error::FrameTooShort { len: bytes.len(), min: HEADER_LEN }),
    };
    let magic = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    if magic != MAGIC {
        return Err(Error::BadMagic { got: magic });
    }
    let version = u16::from_le_bytes([header[4], header[5]]);
    if version != VERSION {
        return Err(Error::UnsupportedVersion { got: version, supported: VERSION });
    }
    let op = OpKind::from_code(header[6])?;
    let dtype = dtype_from_code(header[7])?;
    if header[RESERVED_RANGE].iter().any(|&b| b != 0) || header[FLAGS] & !KNOWN_FLAGS != 0 {
        return Err(Error::ReservedNonZero);
    }
    let payload_len = read_u64(header, 40);
    if payload_len > max_payload as u64 {
        return Err(Error::PayloadTooLarge { len: payload_len, cap: max_payload });
    }
    Ok(FrameHeader {
        group: read_u64(header, 8),
        generation: read_u64(header, 16),
        seq: read_u64(header, 24),
        chunk: read_u32(header, 32),
        src: read_u32(header, 36),
        op,
        dtype,
        payload_len,
        channels: header[CHANNELS],
    })
}

/// Validates a whole frame: header, payload length against the bytes present, and checksum.
pub fn decode(bytes: &[u8], max_payload: usize) -> Result<FrameHeader> {
    let header = decode_header(bytes, max_payload)?;
    decode_rest(header, &bytes[..HEADER_LEN], &bytes[HEADER_LEN..])
}

/// [`decode`] for a frame whose header and payload are in separate places.
pub fn decode_parts(header: &[u8; HEADER_LEN], payload: &[u8], max_payload: usize) -> Result<FrameHeader> {
    let decoded = decode_header(header, max_payload)?;
    decode_rest(decoded, header, payload)
}

fn decode_rest(decoded: FrameHeader, header: &[u8], payload: &[u8]) -> Result<FrameHeader> {
    if decoded.payload_len != payload.len() as u64 {
        return Err(Error::PayloadLengthMismatch { declared: decoded.payload_len, actual: payload.len() });
    }
    let expected = read_u32(header, CHECKSUM_RANGE.start);
    let covered = if header[FLAGS] & FLAG_HEADER_ONLY_CHECKSUM != 0 { &[][..] } else { payload };
    let computed = checksum(header, covered);
    if expected != computed {
        return Err(Error::ChecksumMismatch { expected, computed });
    }
    Ok(decoded)
}

fn write_header(out: &mut [u8], h: &FrameHeader, payload_len: u64) {
    debug_assert_eq!(out.len(), HEADER_LEN);
    out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    out[4..6].copy_from_slice(&VERSION.to_le_bytes());
    out[6] = h.op.code();
    out[7] = dtype_code(h.dtype);
    out[8..16].copy_from_slice(&h.group.to_le_bytes());
    out[16..24].copy_from_slice(&h.generation.to_le_bytes());
    out[24..32].copy_from_slice(&h.seq.to_le_bytes());
    out[32..36].copy_from_slice(&h.chunk.to_le_bytes());
    out[36..40].copy_from_slice(&h.src.to_le_bytes());
    out[40..48].copy_from_slice(&payload_len.to_le_bytes());
    out[CHECKSUM_RANGE].fill(0);
    out[FLAGS] = 0;
    out[CHANNELS] = h.channels;
    out[RESERVED_RANGE].fill(0);
}

fn checksum_parts<'a>(header: &[u8], payload: impl Iterator<Item = &'a [u8]>) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&header[..CHECKSUM_RANGE.start]);
    hasher.update(&header[FLAGS..HEADER_LEN]);
    for part in payload {
        hasher.update(part);
    }
    hasher.finalize()
}

fn checksum(header: &[u8], payload: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&header[..CHECKSUM_RANGE.start]);
    hasher.update(&header[FLAGS..HEADER_LEN]);
    hasher.update(payload);
    hasher.finalize()
}

fn read_u64(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}

fn read_u32(b: &[u8], at: usize) -> u32 {
    let mut v = [0u8; 4];
    v.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(v)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    #[test]
    fn a_headers_place_and_length_read_without_validation() {
        let pool = BufferPool::new();
        let h = FrameHeader { group: 1, generation: 2, seq: u64::MAX, op: OpKind::AllReduce, chunk: 3, src: 0, dtype: None, payload_len: 0, channels: 0 };
        let frame = encode(&pool, &h, &[]);
        assert_eq!(header_place(&frame), 2, "wraps");
        assert_eq!(header_place(&frame[..35]), 0, "too short to say");
        let h = FrameHeader { payload_len: 5, ..h };
        assert_eq!(header_payload_len(&encode(&pool, &h, &[7; 5])), 5);
        assert_eq!(header_payload_len(&[0; 47]), 0, "too short to say");
    }

    use super::*;

    fn sample() -> FrameHeader {
        FrameHeader { group: 7, generation: 3, seq: 42, op: OpKind::AllReduce, chunk: 5, src: 2, dtype: Some(DType::F32), payload_len: 0, channels: 0 }
    }

    /// Ways to cut a 148-byte payload into pieces: none, single bytes, empty pieces, every byte.
    fn payload_cuts() -> [Vec<usize>; 5] {
        [vec![], vec![1], vec![3, 4, 5], vec![0, 0, 7, 7, 70, 147], (1..148).collect()]
    }

    /// A frame whose payload `bytes` arrived in pieces cut at `cuts`.
    fn cut_frame(bytes: &[u8], cuts: &[usize]) -> Frame {
        let header = encode_header_only_checksum(&sample(), bytes.len());
        let mut chunked = ChunkedBytes::new();
        let mut at = 0;
        for &c in cuts.iter().chain([&bytes.len()]) {
            chunked.push(bytes[at..c].to_vec());
            at = c;
        }
        Frame::decode_chunked(&header, chunked, 1 << 20).unwrap()
    }

    // Goal: a payload read through `PlainStream` (whole, or in pieces cut at any byte: elements
    // split across pieces, empty pieces) yields exactly its elements in order, in runs that
    // cover them once, and a payload shorter than what is taken is a typed error, not a panic.
    #[test]
    fn plain_stream_takes_elements_across_any_cuts() {
        let values: Vec<f32> = (0..37).map(|i| i as f32 * 1.25 - 7.0).collect();
        let bytes: Vec<u8> = bytemuck::cast_slice(&values).to_vec();
        for cuts in payload_cuts() {
            let frame = cut_frame(&bytes, &cuts);
            let mut plain = frame.plain();
            let mut seen = vec![f32::NAN; 37];
            // Taken in calls of uneven sizes, as a sealer's records ask for them.
            let mut base = 0;
            for count in [5, 0, 13, 19] {
                plain
                    .take_elements(4, count, |r, b| {
                        assert_eq!(b.len(), 4 * r.len());
                        for (i, e) in r.zip(b.chunks_exact(4)) {
                            assert!(seen[base + i].is_nan(), "element {} taken twice", base + i);
                            seen[base + i] = f32::from_le_bytes(e.try_into().unwrap());
                        }
                    })
                    .unwrap();
                base += count;
            }
            assert_eq!(seen, values, "cuts {cuts:?}");
            let err = plain.take_elements(4, 1, |_, _| {}).unwrap_err();
            assert!(matches!(err, Error::PayloadLength { src: 2, expected: 152, got: 148 }), "{err:?}");
        }
    }

    // Goal: take_into copies the payload across any cuts into the caller's buffer, touching
    // nothing past `len` but the one byte of slack it was given.
    #[test]
    fn plain_stream_takes_bytes_into_a_buffer_across_any_cuts() {
        let bytes: Vec<u8> = (0..148u32).map(|i| (i * 7 + 3) as u8).collect();
        for cuts in payload_cuts() {
            let frame = cut_frame(&bytes, &cuts);
            let mut plain = frame.plain();
            let mut out = [0xEEu8; 149];
            let mut base = 0;
            for len in [20, 0, 64, 64] {
                plain.take_into(&mut out[base..(base + len + 1).min(149)], len).unwrap();
                base += len;
            }
            assert_eq!(&out[..148], &bytes[..], "cuts {cuts:?}");
            assert_eq!(out[148], 0xEE, "nothing past the payload is written from a plain frame");
            let err = plain.take_into(&mut [0u8; 4], 4).unwrap_err();
            assert!(matches!(err, Error::PayloadLength { src: 2, expected: 152, got: 148 }), "{err:?}");
        }
    }

    // Goal: encode then decode gives back every header field and the payload bytes.
    #[test]
    fn round_trip() {
        let pool = BufferPool::new();
        let payload: Vec<u8> = (0..100u8).collect();
        let buf = encode(&pool, &sample(), &payload);
        let frame = Frame::decode(buf, 1 << 20).unwrap();
        assert_eq!(frame.header, FrameHeader { payload_len: 100, ..sample() });
        assert_eq!(frame.payload(), &payload[..]);
    }

    // Goal: the channel count travels in byte 53, and an operation on one ring (0) leaves the
    // header as a build without channels wrote it (byte 53 zero, the same checksum).
    #[test]
    fn channels_byte() {
        let split = FrameHeader { channels: 4, ..sample() };
        let bytes = encode_header(&split, &[]);
        assert_eq!(bytes[CHANNELS], 4);
        assert_eq!(decode(&bytes, 1 << 20).unwrap(), split);
        let one = encode_header(&sample(), &[]);
        assert_eq!(one[CHANNELS], 0);
        assert_ne!(one, bytes);
        let mut forged = one;
        forged[CHANNELS] = 4;
        assert!(matches!(decode(&forged, 1 << 20), Err(Error::ChecksumMismatch { .. })), "the checksum covers the byte");
    }

    // Goal: a flipped payload bit is caught by the checksum.
    #[test]
    fn payload_corruption_detected() {
        let pool = BufferPool::new();
        let mut buf = encode(&pool, &sample(), &[1, 2, 3, 4]);
        buf[HEADER_LEN + 1] ^= 0x10;
        assert!(matches!(decode(&buf, 1 << 20), Err(Error::ChecksumMismatch { .. })));
    }
}
