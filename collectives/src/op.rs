//! One running operation on one rank: its identity on the wire (op kind, generation, sequence) and
//! the per-link chunk counters, with the send and receive steps the algorithms are built from.
//!
//! Chunk numbering: every frame on a sender→receiver link within one operation takes the next chunk
//! index of that link. Algorithms send and receive on each link in the same logical order on both
//! ends, so both sides agree on the numbers without sending them out of band.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::sync::Arc;

use rtx_kernels::DType;

use crate::channel::ChannelState;
use crate::communicator::Communicator;
use crate::element::{combine_bytes, combine_into_bytes, combine_parts_to, combine_to_bytes, copy_parts, round_parts, Accumulator, Element, WireElement};
use crate::error::{Error, Result};
use crate::frame::{encode_header, encode_header_copied, encode_header_only_checksum, encode_header_parts, Frame, FrameHeader, OpKind, Outgoing, HEADER_LEN};
use crate::group::{Key, Lane, Slot};
use crate::ReduceOp;
use crate::transport::AwaitedFrame;

pub(crate) struct OpCtx<'a> {
    comm: &'a Communicator,
    pub(crate) op: OpKind,
    lane: Lane,
    generation: u64,
    seq: u64,
    sent: BTreeMap<usize, u32>,
    received: BTreeMap<usize, u32>,
    /// Per link: receives registered ahead of time, in chunk order, and how many more the
    /// algorithm announced (see [`announce`](Self::announce)).
    posted: BTreeMap<usize, Posted>,
    /// A lost member this rank found its collective blocked on; told to the group on drop
    /// (see [`relay_loss`](Self::relay_loss)).
    relay: Option<usize>,
    /// While set (see [`set_view`](Self::set_view)), the ranks the send and receive steps take
    /// are indices into this list of group ranks.
    view: Option<Vec<usize>>,
    /// The channel count every frame of this operation names (see [`with_channels`](Self::with_channels)).
    channels: u8,
    /// For one channel of a split operation: what its channels share (a sibling's failure).
    siblings: Option<Arc<ChannelState>>,
}

#[derive(Default)]
struct Posted {
    slots: VecDeque<(Key, Slot)>,
    /// Chunk number of the next receive to post.
    next_chunk: u32,
    /// Receives announced and not posted yet.
    remaining: usize,
}

/// Receives a ring step keeps posted ahead on its incoming link, beyond its ring window
/// ([`crate::CommConfig::ring_window`]). A frame that arrives while its receive is posted is handed
/// over as is, which for the shared-memory transport means read in place; one that arrives earlier
/// is parked, and a lent payload copied out first.
const POST_AHEAD_EXTRA: usize = 2;
/// Most received frames with a lent payload (shared-memory ring slots) an operation holds while
/// it waits to forward them; past that, [`OpCtx::hold`] copies them out. Bounds the slots of a
/// transport's ring an operation pins, whatever its ring window.
const LENT_HELD_MAX: usize = 2;

impl<'a> OpCtx<'a> {
    pub(crate) fn new(comm: &'a Communicator, op: OpKind, generation: u64, seq: u64) -> Self {
        let lane = if op == OpKind::Send { Lane::PointToPoint } else { Lane::Collective };
        OpCtx {
            comm,
            op,
            lane,
            generation,
            seq,
            sent: BTreeMap::new(),
            received: BTreeMap::new(),
            posted: BTreeMap::new(),
            relay: None,
            view: None,
            channels: 0,
            siblings: None,
        }
    }

    /// This operation as one channel of a collective split into `channels` rings (see
    /// `channel.rs`): its frames name the count, and frames naming another count fail the
    /// receive with [`Error::ChannelMismatch`]; if it is dropped unfinished after a sibling
    /// channel failed for a lost member, it tells the group like a channel that saw the loss
    /// itself (see [`relay_loss`](Self::relay_loss)).
    pub(crate) fn with_channels(mut self, channels: u8, siblings: Arc<ChannelState>) -> Self {
        debug_assert!(channels >= 2, "an operation run as one ring writes 0");
        self.channels = channels;
        self.siblings = Some(siblings);
        self
    }

    /// Notes that this collective failed because member `lost` (global rank) is gone, unless a
    /// peer already told the group so. When the operation ends, the other live members get an
    /// abort frame naming `lost`, which fails their part of it at once: without it, a rank blocked
    /// only on live peers (say, further round a ring) would wait for the timeout, because the
    /// lost rank's departure fails only receives of frames from that rank (see `group.rs`).
    pub(crate) fn relay_loss(&mut self, lost: usize) {
        if self.lane == Lane::Collective && !self.comm.state().is_aborted(self.generation, self.seq) {
            self.relay.get_or_insert(lost);
        }
    }

    /// Passes `result` through, noting a [`Error::PeerLost`] for [`relay_loss`](Self::relay_loss),
    /// and an [`Error::Unauthentic`] payload as the loss of its sender: the transport broke that
    /// link, and members waiting on others must fail fast too.
    fn watch<T>(&mut self, result: Result<T>) -> Result<T> {
        match &result {
            Err(Error::PeerLost { rank, .. }) => self.relay_loss(*rank),
            Err(Error::Unauthentic { src, .. }) => self.relay_loss(*src),
            _ => {}
        }
        result
    }

    /// Runs the next steps on a subset of the group: until the next call, a rank `i` given to
    /// the send and receive steps means group rank `members[i]` (`None`: the whole group). So an
    /// algorithm written for ranks `0..m` runs among `m` chosen members, e.g. the ranks of one host.
    /// Chunk numbers stay per link of the whole operation, so phases on different subsets share
    /// links safely as long as every rank runs the phases in the same order.
    pub(crate) fn set_view(&mut self, members: Option<Vec<usize>>) {
        debug_assert!(members.as_ref().is_none_or(|m| m.iter().all(|&r| r < self.comm.size())), "view: group ranks");
        debug_assert!(self.posted.values().all(|p| p.slots.is_empty() && p.remaining == 0), "view changes between phases only");
        self.view = members;
    }

    /// The group rank behind rank `i` of the current view.
    fn real(&self, i: usize) -> usize {
        match &self.view {
            Some(members) => members[i],
            None => i,
        }
    }

    /// Announces that `count` more frames will be received from group rank `from` in this
    /// operation, so receives can be posted ahead (see [`POST_AHEAD_EXTRA`]).
    pub(crate) fn announce(&mut self, from: usize, count: usize) {
        let from = self.real(from);
        let next = self.received.get(&from).copied().unwrap_or(0);
        let posted = self.posted.entry(from).or_default();
        debug_assert!(posted.slots.is_empty(), "announce before the receives it announces");
        posted.next_chunk = next;
        posted.remaining = count;
    }

    /// Posts receives on the link from `from` up to the ring window plus [`POST_AHEAD_EXTRA`] ahead.
    fn post_ahead(&mut self, from: usize) {
        let group = self.comm.state();
        let src = group.members[from];
        let (generation, lane, seq, op) = (self.generation, self.lane, self.seq, self.op);
        let Some(posted) = self.posted.get_mut(&from) else { return };
        let depth = self.comm.config().effective_ring_window() + POST_AHEAD_EXTRA;
        while posted.remaining > 0 && posted.slots.len() < depth {
            let key = (generation, lane, src, seq, posted.next_chunk);
            // On failure (a bump, a lost peer) stop posting; the receive itself reports it.
            let Ok(slot) = group.register(key, op) else { return };
            posted.slots.push_back((key, slot));
            posted.next_chunk += 1;
            posted.remaining -= 1;
        }
    }

    /// Elements per frame for element type `T`.
    pub(crate) fn piece_elems<T>(&self) -> usize {
        (self.comm.config().effective_chunk_bytes() / std::mem::size_of::<T>()).max(1)
    }

    /// Frames a ring sends ahead of those it has received ([`crate::CommConfig::ring_window`]).
    pub(crate) fn ring_window(&self) -> usize {
        self.comm.config().effective_ring_window()
    }

    /// The header of the next frame to group rank `to` (taking its chunk number), and `to`'s
    /// global rank.
    fn next_header(&mut self, to: usize, dtype: Option<DType>, payload_len: usize) -> (usize, FrameHeader) {
        let to = self.real(to);
        let group = self.comm.state();
        let peer = group.members[to];
        debug_assert_ne!(to, group.my_index, "no frames to self");
        let counter = self.sent.entry(to).or_insert(0);
        let chunk = *counter;
        *counter += 1;
        let header = FrameHeader {
            group: group.id,
            generation: self.generation,
            seq: self.seq,
            op: self.op,
            chunk,
            src: group.members[group.my_index] as u32,
            dtype,
            payload_len: payload_len as u64,
            channels: self.channels,
        };
        (peer, header)
    }

    /// Waits for `send` (a transport send to global rank `peer`) within the operation timeout.
    async fn finish_send(&mut self, peer: usize, send: crate::transport::BoxFuture<'_, Result<()>>) -> Result<()> {
        // A peer that is alive but never drains its link must not hang the sender either.
        let timeout = self.comm.config().op_timeout;
        let result = match tokio::time::timeout(timeout, send).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(Error::PeerLost { rank, .. })) => Err(Error::PeerLost { rank, op: self.op }),
            Ok(Err(other)) => Err(other),
            Err(_elapsed) => Err(Error::Timeout { op: self.op, waiting_for: peer, timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX) }),
        };
        self.watch(result)
    }

    /// Sends one frame with `payload` to group rank `to`.
    pub(crate) async fn send_frame(&mut self, to: usize, dtype: Option<DType>, payload: &[u8]) -> Result<()> {
        self.send_frame_as(to, dtype, payload, false).await
    }

    /// [`send_frame`](Self::send_frame) of a frame the receiver reads once, front to back (copies
    /// into its output or combines; [`crate::frame::FLAG_COPIED`], set where the transport
    /// authenticates: a sealing transport may then leave the payload sealed until the receiver
    /// opens it where it uses it).
    pub(crate) async fn send_copied_frame(&mut self, to: usize, dtype: Option<DType>, payload: &[u8]) -> Result<()> {
        self.send_frame_as(to, dtype, payload, true).await
    }

    async fn send_frame_as(&mut self, to: usize, dtype: Option<DType>, payload: &[u8], copied: bool) -> Result<()> {
        let (peer, header) = self.next_header(to, dtype, payload.len());
        let shared = self.comm.endpoint().shared();
        let header = match (shared.transport.checks_integrity(), copied) {
            (true, true) => encode_header_copied(&header, payload.len()),
            (true, false) => encode_header_only_checksum(&header, payload.len()),
            (false, _) => encode_header(&header, payload),
        };
        self.finish_send(peer, shared.transport.send_parts(peer, &header, payload, &shared.pool)).await
    }

    /// Sends `frame`'s payload (a received frame, perhaps combined into) to group rank `to` as
    /// the next frame of this operation, without copying it where the transport allows: a pooled
    /// buffer gets the new header written over the old one and goes to the transport as it is, a
    /// chunked payload goes as its pieces ([`crate::Transport::send_chunked`]); a lent one is
    /// copied by the transport from where it lies.
    pub(crate) async fn forward_frame(&mut self, to: usize, dtype: Option<DType>, frame: Frame) -> Result<()> {
        let payload_len = frame.payload_len();
        let (peer, header) = self.next_header(to, dtype, payload_len);
        let shared = self.comm.endpoint().shared();
        let integrity = shared.transport.checks_integrity();
        match frame.into_outgoing() {
            Outgoing::Pooled(mut buf) => {
                debug_assert_eq!(buf.len(), HEADER_LEN + payload_len, "a pooled frame is its header and payload");
                let encoded = if integrity { encode_header_only_checksum(&header, payload_len) } else { encode_header(&header, &buf[HEADER_LEN..]) };
                buf[..HEADER_LEN].copy_from_slice(&encoded);
                self.finish_send(peer, shared.transport.send(peer, buf)).await
            }
            Outgoing::Chunked(chunks) => {
                debug_assert_eq!(chunks.len(), payload_len);
                let encoded =
                    if integrity { encode_header_only_checksum(&header, payload_len) } else { encode_header_parts(&header, payload_len, chunks.chunks()) };
                let send = async move { shared.transport.send_chunked(peer, &encoded, chunks, &shared.pool).await };
                self.finish_send(peer, Box::pin(send)).await
            }
            Outgoing::Lent(payload) => {
                let encoded = if integrity { encode_header_only_checksum(&header, payload_len) } else { encode_header(&header, &payload) };
                let send = async move { shared.transport.send_parts(peer, &encoded, &payload, &shared.pool).await };
                self.finish_send(peer, Box::pin(send)).await
            }
        }
    }

    /// A ring's Forward step: `received` combined with `local` (`combine(received, local)` per
    /// element), in a frame to forward. A payload in pieces is combined into a fresh pooled
    /// buffer in one pass (no copy to join the pieces first); a contiguous one in place.
    pub(crate) fn combine_forward<A: Accumulator>(&self, op: ReduceOp, received: Frame, local: &[A]) -> Frame {
        debug_assert_eq!(received.payload_len(), std::mem::size_of_val(local), "forward: length checked on receipt");
        if !received.is_chunked() {
            let mut frame = received;
            combine_into_bytes(op, frame.payload_mut(), local);
            return frame;
        }
        let len = received.payload_len();
        let mut buf = self.comm.endpoint().shared().pool.take(HEADER_LEN + len);
        buf.resize(HEADER_LEN + len, 0);
        combine_parts_to(op, &mut buf[HEADER_LEN..], received.payload_parts(), local);
        Frame::from_pooled(received.header, buf)
    }

    /// Receives the next frame from group rank `from`, checking op, dtype and payload length; its
    /// payload is contiguous ([`Frame::payload`]).
    pub(crate) async fn recv_frame(&mut self, from: usize, dtype: Option<DType>, len_bytes: usize) -> Result<Frame> {
        let frame = self.recv_frame_parts(from, dtype, len_bytes).await?;
        if frame.is_chunked() {
            return Ok(frame.into_contiguous(&self.comm.endpoint().shared().pool));
        }
        Ok(frame)
    }

    /// [`recv_frame`](Self::recv_frame) for a step that reads the payload only through
    /// [`Frame::payload_parts`], so a payload that arrived in pieces is used as it is (a sealed
    /// one is opened into a pooled buffer first).
    pub(crate) async fn recv_frame_parts(&mut self, from: usize, dtype: Option<DType>, len_bytes: usize) -> Result<Frame> {
        let frame = self.recv_frame_maybe_sealed(from, dtype, len_bytes).await?;
        let opened = frame.opened(&self.comm.endpoint().shared().pool);
        self.watch(opened)
    }

    /// Receives the next frame from `from` into `dst` (its payload length): a sealed payload is
    /// opened straight into it (`Ok(None)`); any other payload is copied in and its frame
    /// returned, to be sent on as it is if the caller wants.
    pub(crate) async fn recv_into<T: WireElement>(&mut self, from: usize, dst: &mut [T]) -> Result<Option<Frame>> {
        let frame = self.recv_frame_maybe_sealed(from, Some(T::DTYPE), std::mem::size_of_val(dst)).await?;
        let opened = frame.open_into(bytemuck::cast_slice_mut(dst));
        if self.watch(opened)? {
            return Ok(None);
        }
        copy_parts(dst, frame.payload_parts());
        Ok(Some(frame))
    }

    /// The next frame from `from`, checked, its payload perhaps still sealed ([`Frame::is_sealed`]):
    /// for a step that reads it once through [`Frame::plain`] or opens it where it is wanted.
    pub(crate) async fn recv_frame_maybe_sealed(&mut self, from: usize, dtype: Option<DType>, len_bytes: usize) -> Result<Frame> {
        let from = self.real(from);
        let group = self.comm.state();
        let src = group.members[from];
        let counter = self.received.entry(from).or_insert(0);
        let chunk = *counter;
        *counter += 1;
        let key = (self.generation, self.lane, src, self.seq, chunk);
        self.post_ahead(from);
        let posted = self.posted.get_mut(&from).and_then(|p| if p.slots.front().is_some_and(|(k, _)| *k == key) { p.slots.pop_front() } else { None });
        let slot = match posted {
            Some((_, slot)) => slot,
            None => {
                let slot = group.register(key, self.op);
                self.watch(slot)?
            }
        };
        let transport = &self.comm.endpoint().shared().transport;
        let awaited = AwaitedFrame { from: src, seq: self.seq, chunk, len: len_bytes };
        let frame = group.wait_slot(key, slot, self.op, self.comm.config().op_timeout, || transport.poll_incoming(awaited), || transport.poll_ended(awaited)).await;
        let frame = self.watch(frame)?;
        let h = frame.header;
        if h.op != self.op {
            return Err(Error::OpMismatch { seq: self.seq, src, expected: self.op, got: h.op });
        }
        if h.channels != self.channels {
            return Err(Error::ChannelMismatch { seq: self.seq, src, expected: self.channels, got: h.channels });
        }
        if h.dtype != dtype {
            return Err(Error::DTypeMismatch { src, expected: dtype, got: h.dtype });
        }
        if frame.payload_len() != len_bytes {
            return Err(Error::PayloadLength { src, expected: len_bytes, got: frame.payload_len() });
        }
        Ok(frame)
    }

    /// Whether the transport writes a sent payload straight into what goes on the wire
    /// ([`crate::Transport::fills_on_send`]): a ring then combines a received piece as it sends it
    /// on ([`send_combined`](Self::send_combined)), and flags its frames so a sealing transport
    /// leaves their payloads sealed until then.
    pub(crate) fn fills_on_send(&self) -> bool {
        let shared = self.comm.endpoint().shared();
        shared.transport.fills_on_send() && shared.transport.checks_integrity()
    }

    /// Sends group rank `to` the next frame of this operation: `received`'s payload combined
    /// with `local` (`combine(received, local)` per element), computed record by record as the
    /// transport seals it ([`crate::Transport::send_filled`]), a sealed payload opened one record
    /// at a time into cache on the way. One pass over the received bytes, none over an
    /// intermediate buffer. Needs a transport that checks integrity (the header's checksum cannot
    /// cover a payload not computed yet); see [`fills_on_send`](Self::fills_on_send).
    pub(crate) async fn send_combined<A: Accumulator>(&mut self, to: usize, received: Frame, op: ReduceOp, local: &[A]) -> Result<()> {
        let len = received.payload_len();
        debug_assert_eq!(len, std::mem::size_of_val(local), "combine: length checked on receipt");
        let (peer, header) = self.next_header(to, Some(A::DTYPE), len);
        let encoded = encode_header_copied(&header, len);
        let size = std::mem::size_of::<A>();
        let mut plain = received.plain();
        let mut fill = |range: Range<usize>, out: &mut [u8]| -> Result<()> {
            debug_assert!(range.start % size == 0 && range.len() % size == 0, "fill ranges are whole elements");
            let local = &local[range.start / size..range.end / size];
            plain.take_elements(size, local.len(), |r, bytes| combine_to_bytes(op, &mut out[r.start * size..r.end * size], bytes, &local[r]))
        };
        let shared = self.comm.endpoint().shared();
        let send = shared.transport.send_filled(peer, &encoded, len, &mut fill, &shared.pool);
        self.finish_send(peer, send).await
    }

    /// Sends group rank `to` the next frame of this operation: `received`'s payload unchanged,
    /// written into `dst` as well (a gathered piece passed on), record by record as the transport
    /// seals it, a sealed payload opened one record at a time on the way. Each 16 KiB of the piece
    /// is opened, kept and sealed again while in cache, where opening it into `dst` and later
    /// sealing from there would read the whole piece back from farther away. Same conditions as
    /// [`send_combined`](Self::send_combined).
    pub(crate) async fn send_passed<T: WireElement>(&mut self, to: usize, received: Frame, dst: &mut [T]) -> Result<()> {
        let len = received.payload_len();
        debug_assert_eq!(len, std::mem::size_of_val(dst), "pass: length checked on receipt");
        let (peer, header) = self.next_header(to, Some(T::DTYPE), len);
        let encoded = encode_header_copied(&header, len);
        let mut plain = received.plain();
        let dst: &mut [u8] = bytemuck::cast_slice_mut(dst);
        let mut fill = |range: Range<usize>, out: &mut [u8]| -> Result<()> {
            // Opened straight into the output where the byte past the range (the next record's
            // place) may take the content type; the last record goes through the scratch.
            let room = (range.end + 1).min(dst.len());
            let kept = &mut dst[range.start..room];
            plain.take_into(kept, range.len())?;
            out.copy_from_slice(&kept[..range.len()]);
            Ok(())
        };
        let shared = self.comm.endpoint().shared();
        let send = shared.transport.send_filled(peer, &encoded, len, &mut fill, &shared.pool);
        self.finish_send(peer, send).await
    }

    /// A received frame to keep while `queued` others already wait: past [`LENT_HELD_MAX`] of them,
    /// a payload lent by the transport is copied out, so an operation never pins more than a few
    /// slots of a transport's ring (see the shared-memory transport).
    pub(crate) fn hold(&self, frame: Frame, queued: usize) -> Frame {
        if queued < LENT_HELD_MAX || !frame.is_lent() {
            return frame;
        }
        frame.into_owned(&self.comm.endpoint().shared().pool)
    }

    /// Sends `data` to `to` in pieces of at most `chunk_bytes`.
    pub(crate) async fn send_all<T: WireElement>(&mut self, to: usize, data: &[T]) -> Result<()> {
        for piece in pieces(data.len(), self.piece_elems::<T>()) {
            self.send_frame(to, Some(T::DTYPE), bytemuck::cast_slice(&data[piece])).await?;
        }
        Ok(())
    }

    /// Receives `dst.len()` elements from `from`, in the pieces `send_all` made, copying them in.
    pub(crate) async fn recv_all<T: WireElement>(&mut self, from: usize, dst: &mut [T]) -> Result<()> {
        for piece in pieces(dst.len(), self.piece_elems::<T>()) {
            self.recv_into(from, &mut dst[piece]).await?;
        }
        Ok(())
    }

    /// Receives `dst.len()` accumulator values of `T` from `from`, in the pieces `send_all` of
    /// accumulator values made, rounding them into `dst`.
    pub(crate) async fn recv_round_all<T: Element>(&mut self, from: usize, dst: &mut [T]) -> Result<()> {
        for piece in pieces(dst.len(), self.piece_elems::<T::Acc>()) {
            let bytes = piece.len() * std::mem::size_of::<T::Acc>();
            let frame = self.recv_frame_parts(from, Some(<T::Acc as WireElement>::DTYPE), bytes).await?;
            round_parts(&mut dst[piece], frame.payload_parts());
        }
        Ok(())
    }

    /// Receives `dst.len()` accumulator values from `from` and combines them into `dst`.
    pub(crate) async fn recv_combine_all<A: Accumulator>(&mut self, from: usize, dst: &mut [A], op: ReduceOp, received_first: bool) -> Result<()> {
        for piece in pieces(dst.len(), self.piece_elems::<A>()) {
            self.recv_combine(from, &mut dst[piece], op, received_first).await?;
        }
        Ok(())
    }

    /// Receives one piece of accumulator values from `from` and combines it into `dst`.
    pub(crate) async fn recv_combine<A: Accumulator>(&mut self, from: usize, dst: &mut [A], op: ReduceOp, received_first: bool) -> Result<()> {
        let bytes = std::mem::size_of_val(dst);
        let frame = self.recv_frame_maybe_sealed(from, Some(A::DTYPE), bytes).await?;
        // Read front to back: a sealed payload is opened a record at a time into cache and
        // combined from there, never whole into a buffer.
        let mut plain = frame.plain();
        let combined = plain.take_elements(std::mem::size_of::<A>(), dst.len(), |r, bytes| combine_bytes(op, &mut dst[r], bytes, received_first));
        self.watch(combined)
    }

    /// Receives one piece of elements from `from` and copies it into `dst` (a sealed payload is
    /// opened straight into it).
    pub(crate) async fn recv_copy<T: WireElement>(&mut self, from: usize, dst: &mut [T]) -> Result<()> {
        self.recv_into(from, dst).await.map(drop)
    }
}

impl Drop for OpCtx<'_> {
    fn drop(&mut self) {
        // Receives posted but never waited for (the operation failed or was cancelled): withdraw
        // them, and give back any frame they already hold.
        let group = self.comm.state();
        for posted in self.posted.values() {
            for (key, _) in &posted.slots {
                group.cancel(key);
            }
        }
        let relay = self.relay.or_else(|| {
            // Cancelled because a sibling channel failed: peers blocked on this channel's frames
            // learn of the loss from here, as they would have from the sibling's relay.
            let lost = self.siblings.as_ref()?.lost()?;
            (self.lane == Lane::Collective && !group.is_aborted(self.generation, self.seq)).then_some(lost)
        });
        if let Some(lost) = relay {
            self.send_aborts(lost);
        } else if self.lane == Lane::Collective {
            if let Some((lost, from)) = group.abort_of(self.generation, self.seq) {
                self.tell_the_lost(lost, from);
            }
        }
    }
}

impl OpCtx<'_> {
    /// Sends every other live member an abort frame for this collective naming `lost`, from
    /// background tasks (this runs on drop), each bounded by the operation timeout.
    fn send_aborts(&self, lost: usize) {
        let group = self.comm.state();
        let me = group.members[group.my_index];
        let gone = self.comm.endpoint().shared().lost_ranks();
        let to: Vec<usize> = group.members.iter().copied().filter(|&p| p != me && p != lost && !gone.contains(&p)).collect();
        self.send_abort_frames(lost, &to);
    }

    /// This collective was aborted by `from`'s frame naming `lost`, which `from` could not tell
    /// (it does not send aborts to the member it lost). Where `lost` is alive and linked to this
    /// rank (their link broke between two live ranks: a record that did not authenticate, a reset
    /// connection), it may be waiting on a member that has stopped sending, for the whole timeout:
    /// tell it, naming `from` (the member it is cut off from). At most one frame per rank and
    /// collective; the receiver's own abort is not passed on again (it names a member it has lost).
    fn tell_the_lost(&self, lost: usize, from: usize) {
        let group = self.comm.state();
        let me = group.members[group.my_index];
        if lost == me || lost == from || self.comm.endpoint().shared().lost_ranks().contains(&lost) {
            return;
        }
        self.send_abort_frames(from, &[lost]);
    }

    /// Sends each of `to` an abort frame for this collective naming `lost`, from background tasks
    /// (this runs on drop), each bounded by the operation timeout.
    fn send_abort_frames(&self, lost: usize, to: &[usize]) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let group = self.comm.state();
        let endpoint = self.comm.endpoint();
        let me = group.members[group.my_index];
        let header = FrameHeader {
            group: group.id,
            generation: self.generation,
            seq: self.seq,
            op: OpKind::Abort,
            chunk: lost as u32,
            src: me as u32,
            dtype: None,
            payload_len: 0,
            channels: 0,
        };
        let header = encode_header(&header, &[]);
        let timeout = self.comm.config().op_timeout;
        tracing::debug!(group = group.id, seq = self.seq, lost, "telling the group a collective failed");
        for &peer in to {
            let endpoint = endpoint.clone();
            runtime.spawn(async move {
                let shared = endpoint.shared();
                // Best effort: a peer that cannot be told fails by its own loss notice or timeout.
                let _ = tokio::time::timeout(timeout, shared.transport.send_parts(peer, &header, &[], &shared.pool)).await;
            });
        }
    }
}

/// Splits `0..len` into consecutive ranges of at most `piece` elements (none for `len == 0`).
pub(crate) fn pieces(len: usize, piece: usize) -> impl Iterator<Item = Range<usize>> {
    debug_assert!(piece > 0);
    (0..len).step_by(piece.max(1)).map(move |start| start..(start + piece).min(len))
}

/// The range of element indices rank `i` of `n` owns in a buffer of `len` elements: the first
/// `len % n` ranks get one element more.
pub fn segment_range(len: usize, n: usize, i: usize) -> Range<usize> {
    assert!(n > 0 && i < n, "segment_range: rank inside the group");
    let base = len / n;
    let extra = len % n;
    let start = i * base + i.min(extra);
    let size = base + usize::from(i < extra);
    start..start + size
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    // Goal: segments tile the buffer exactly, in order, for awkward sizes.
    #[test]
    fn segments_tile() {
        for len in [0usize, 1, 2, 7, 13, 100] {
            for n in 1..=8 {
                let mut next = 0;
                for i in 0..n {
                    let r = segment_range(len, n, i);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    // Goal: pieces cover the range with the given maximum size.
    #[test]
    fn pieces_cover() {
        let p: Vec<_> = pieces(10, 4).collect();
        assert_eq!(p, vec![0..4, 4..8, 8..10]);
        assert_eq!(pieces(0, 4).count(), 0);
    }
}
