//! Collective algorithms over an [`OpCtx`]: ring reduce-scatter, all-gather and all-reduce
//! (pipelined in pieces, round-major, see `Schedule::ring`), recursive doubling all-reduce,
//! binomial-tree broadcast and reduce, and a pipelined chain broadcast.
//!
//! Determinism: every algorithm reduces in an order fixed by rank numbers alone. In the ring, the
//! segment owned by rank `c` is accumulated as `((v[c+1] + v[c+2]) + ...) + v[c]` and then copied to
//! everyone. In recursive doubling and the trees, two blocks of ranks are combined as
//! `combine(lower block, higher block)` on both partners. So results are bit-identical on every rank
//! and do not depend on timing; different algorithms (chosen by size) may differ in the last bits.

use std::collections::VecDeque;
use std::ops::Range;

use crate::element::{Accumulator, Element, WireElement};
use crate::error::Result;
use crate::frame::Frame;
use crate::op::{pieces, segment_range, OpCtx};
use crate::pool::{BufferPool, PooledBuf};
use crate::ReduceOp;

// How far a ring sends ahead of its receives is `CommConfig::ring_window` (`OpCtx::ring_window`):
// it bounds what waits in a receiver's mailbox to a few pieces, so received frames are still in
// cache when they are combined and pool buffers are reused instead of piling up. Two suits memory
// transports (measured 1, 2, 4 and 8 with 2 and 4 ranks on 2 cores: 1 was slower, 2-8 within
// noise); QUIC, whose frames spend long in other tasks, asks for more (`Transport::preferred_ring_window`).

/// The local data of a ring reduce-scatter. Segments other than the owned one are only read, in
/// the caller's element type `T`: straight from the caller's buffer when `T` is its own
/// accumulator, else widened piece by piece into one pooled scratch piece (widening is exact, so
/// this gives the same bits as widening the whole buffer first, without its copy). The owned
/// segment, in the accumulator type, starts as the local values and ends as the reduced result.
pub(crate) struct RsBuffers<'a, T: Element> {
    left: &'a [T],
    own: &'a mut [T::Acc],
    right: &'a [T],
    own_range: Range<usize>,
    pool: &'a BufferPool,
    scratch: Option<PooledBuf>,
    /// Used instead of `scratch` if a pooled buffer is not aligned for `T::Acc` (no allocator we
    /// use does that for buffers of a page or more).
    scratch_unpooled: Vec<T::Acc>,
}

impl<'a, A: Accumulator> RsBuffers<'a, A> {
    /// Reduces `buf` in place: afterwards `buf[own]` holds the result; the rest is unchanged.
    pub(crate) fn in_place(buf: &'a mut [A], own: Range<usize>, pool: &'a BufferPool) -> Self {
        let (left, rest) = buf.split_at_mut(own.start);
        let (own_slice, right) = rest.split_at_mut(own.len());
        RsBuffers { left, own: own_slice, right, own_range: own, pool, scratch: None, scratch_unpooled: Vec::new() }
    }

    /// Reads `input` and writes the owned segment's result to `output` (which starts as a copy
    /// of the owned segment of `input`: the only copy made).
    pub(crate) fn separate(input: &'a [A], output: &'a mut [A], own: Range<usize>, pool: &'a BufferPool) -> Self {
        output.copy_from_slice(&input[own.clone()]);
        RsBuffers::new(input, output, own, pool)
    }
}

impl<'a, T: Element> RsBuffers<'a, T> {
    /// Reads the segments of `input` other than `own_range`; `own` holds the owned segment's
    /// local values in the accumulator type and ends as the result.
    pub(crate) fn new(input: &'a [T], own: &'a mut [T::Acc], own_range: Range<usize>, pool: &'a BufferPool) -> Self {
        assert_eq!(own.len(), own_range.len(), "reduce-scatter: owned segment length");
        assert!(own_range.end <= input.len(), "reduce-scatter: owned segment inside the input");
        RsBuffers { left: &input[..own_range.start], own, right: &input[own_range.end..], own_range, pool, scratch: None, scratch_unpooled: Vec::new() }
    }
}

/// Accumulator values in a buffer from the pool, where they would otherwise be a fresh
/// allocation (fresh pages cost ~3.5 µs each here): the owned segment of a reduction that widens
/// its elements.
pub(crate) struct PooledVec<A> {
    pooled: Option<PooledBuf>,
    /// Used instead if a pooled buffer is not aligned for `A` (no allocator we use does that).
    unpooled: Vec<A>,
}

impl<A: Accumulator> PooledVec<A> {
    /// The widened values of `src`.
    pub(crate) fn widened<T: Element<Acc = A>>(pool: &BufferPool, src: &[T]) -> Self {
        let bytes = src.len() * std::mem::size_of::<A>();
        let mut buf = pool.take(bytes);
        buf.resize(bytes, 0);
        let mut out = match bytemuck::try_cast_slice_mut::<u8, A>(&mut buf[..]) {
            Ok(_) => PooledVec { pooled: Some(buf), unpooled: Vec::new() },
            Err(_) => PooledVec { pooled: None, unpooled: vec![bytemuck::Zeroable::zeroed(); src.len()] },
        };
        for (dst, x) in out.as_mut_slice().iter_mut().zip(src) {
            *dst = x.to_acc();
        }
        debug_assert_eq!(out.as_slice().len(), src.len());
        out
    }

    pub(crate) fn as_slice(&self) -> &[A] {
        match &self.pooled {
            // Alignment was checked when the buffer was chosen; the Vec's memory does not move.
            Some(buf) => bytemuck::try_cast_slice(&buf[..]).unwrap_or(&[]),
            None => &self.unpooled,
        }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [A] {
        match &mut self.pooled {
            Some(buf) => bytemuck::try_cast_slice_mut(&mut buf[..]).unwrap_or(&mut []),
            None => &mut self.unpooled,
        }
    }
}

/// A buffer a ring schedule reads pieces from and writes received pieces into.
pub(crate) trait RingBuf<T> {
    /// The current values of `r`, a range inside one segment.
    fn read(&mut self, r: Range<usize>) -> &[T];
    /// Where received values of `r` go.
    fn write(&mut self, r: Range<usize>) -> &mut [T];
}

impl<T> RingBuf<T> for [T] {
    fn read(&mut self, r: Range<usize>) -> &[T] {
        &self[r]
    }
    fn write(&mut self, r: Range<usize>) -> &mut [T] {
        &mut self[r]
    }
}

impl<T: Element> RingBuf<T::Acc> for RsBuffers<'_, T> {
    fn read(&mut self, r: Range<usize>) -> &[T::Acc] {
        let own = &self.own_range;
        let local = if r.end <= own.start {
            &self.left[r]
        } else if r.start >= own.end {
            &self.right[r.start - own.end..r.end - own.end]
        } else {
            return &self.own[r.start - own.start..r.end - own.start];
        };
        if let Some(acc) = T::as_acc(local) {
            return acc;
        }
        let bytes = std::mem::size_of_val(local) / std::mem::size_of::<T>() * std::mem::size_of::<T::Acc>();
        if self.scratch.as_ref().is_some_and(|s| s.capacity() < bytes) {
            self.scratch = None;
        }
        let pool = self.pool;
        let scratch = self.scratch.get_or_insert_with(|| pool.take(bytes));
        scratch.clear();
        scratch.resize(bytes, 0);
        let widened = match bytemuck::try_cast_slice_mut::<u8, T::Acc>(&mut scratch[..]) {
            Ok(widened) => widened,
            Err(_) => {
                self.scratch_unpooled.clear();
                self.scratch_unpooled.resize(local.len(), bytemuck::Zeroable::zeroed());
                &mut self.scratch_unpooled[..]
            }
        };
        for (dst, src) in widened.iter_mut().zip(local) {
            *dst = src.to_acc();
        }
        widened
    }
    fn write(&mut self, r: Range<usize>) -> &mut [T::Acc] {
        // A reduce-scatter only ever writes its owned segment.
        debug_assert!(r.start >= self.own_range.start && r.end <= self.own_range.end, "reduce-scatter writes only its own segment");
        let start = self.own_range.start;
        &mut self.own[r.start - start..r.end - start]
    }
}

/// What a received frame is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Recv {
    /// A partial reduction: combine the local values into the frame and forward it.
    Forward,
    /// The last partial reduction of an owned piece: combine it into the buffer; it is final.
    Final,
    /// A reduced piece: copy it into the buffer and forward it from there.
    Gather,
    /// A reduced piece at the last step: copy it into the buffer.
    Last,
}

/// Where a sent frame's payload comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Send {
    /// The buffer's current values of the range (local values to be reduced).
    Buf,
    /// The buffer's values of a final piece (reduced, or this rank's own segment), starting the
    /// all-gather: the receiver copies it whole, so it goes as a copied frame
    /// ([`OpCtx::send_copied_frame`]).
    Final,
    /// The oldest combined frame waiting to be forwarded.
    Forward,
    /// A gathered piece: the frame it arrived in, passed on unchanged (no copy where the
    /// transport allows, see [`OpCtx::forward_frame`]), or the buffer's copy of it when the frame
    /// was not kept (a lent payload).
    Pass,
}

/// A received frame waiting to be sent on, in receive order.
enum Held {
    /// A frame to send (combined into, for a Forward step).
    Frame(Frame),
    /// A Forward step's frame as received, to be combined as it is sent
    /// ([`OpCtx::send_combined`]).
    Uncombined(Frame),
    /// A Gather step's frame as received, to be written into the buffer as it is passed on
    /// ([`OpCtx::send_passed`]).
    Unkept(Frame),
    /// A gathered piece whose frame was given back: send it from the buffer.
    Buf,
}

/// The frames of one ring operation, in link order: what each frame received from the previous
/// rank is for, and what each frame sent to the next rank carries and which receive it waits for.
#[derive(Debug, Default)]
struct Schedule {
    recvs: Vec<(Recv, Range<usize>)>,
    sends: Vec<(Send, Range<usize>, Option<usize>)>,
}

impl Schedule {
    /// The ring over a buffer of `len` elements in round-major order, as NCCL pipelines it: round
    /// `k` moves piece `k` of every segment through all the steps (the reduce-scatter steps, then
    /// the all-gather steps, whichever are asked for) before round `k + 1` starts. So each piece
    /// is forwarded right after it arrives, and a received frame is held for at most a step or two.
    /// Segments differ by at most one element, so some lack a last piece; both ends of a link skip
    /// the same ones.
    fn ring(len: usize, n: usize, rank: usize, piece: usize, reduce: bool, gather: bool) -> Schedule {
        let seg = |i: usize| segment_range(len, n, i % n);
        let piece_of = |s: Range<usize>, k: usize| piece_of(s, k, piece);
        let rounds = segment_range(len, n, 0).len().div_ceil(piece);
        let mut sched = Schedule::default();
        for k in 0..rounds {
            if reduce {
                if let Some(p) = piece_of(seg(rank + n - 1), k) {
                    sched.sends.push((Send::Buf, p, None));
                }
                for step in 0..n - 1 {
                    let Some(p) = piece_of(seg(rank + 2 * n - step - 2), k) else { continue };
                    let at = sched.recvs.len();
                    if step + 1 < n - 1 {
                        sched.recvs.push((Recv::Forward, p.clone()));
                        sched.sends.push((Send::Forward, p, Some(at)));
                    } else {
                        sched.recvs.push((Recv::Final, p.clone()));
                        if gather {
                            // The owned piece is final: it starts the all-gather.
                            sched.sends.push((Send::Final, p, Some(at)));
                        }
                    }
                }
            }
            if gather {
                if !reduce {
                    if let Some(p) = piece_of(seg(rank), k) {
                        sched.sends.push((Send::Final, p, None));
                    }
                }
                for step in 0..n - 1 {
                    let Some(p) = piece_of(seg(rank + 2 * n - step - 1), k) else { continue };
                    let at = sched.recvs.len();
                    if step + 1 < n - 1 {
                        sched.recvs.push((Recv::Gather, p.clone()));
                        sched.sends.push((Send::Pass, p, Some(at)));
                    } else {
                        sched.recvs.push((Recv::Last, p));
                    }
                }
            }
        }
        sched
    }
}

/// Piece `k` (of `piece` elements, the last one shorter) of `segment`, or `None` if the segment
/// has fewer pieces: segments differ by at most one element, so some lack a last piece, and both
/// ends of a link skip the same ones.
fn piece_of(segment: Range<usize>, k: usize, piece: usize) -> Option<Range<usize>> {
    let start = segment.start + k * piece;
    (start < segment.end).then(|| start..(start + piece).min(segment.end))
}

/// Runs a ring schedule: receives from the previous rank in link order, and sends to the next
/// rank each frame as soon as what it carries is ready, at most the ring window
/// ([`OpCtx::ring_window`]) frames ahead of the receives. Receives are posted ahead
/// ([`OpCtx::announce`]) so frames are usually taken in place. Frames received to be sent on (a
/// Forward step's, combined into, and a Gather step's, unchanged) are sent as they are, so a
/// transport that can send its own received bytes (QUIC) copies nothing for them.
async fn run_ring<A: Accumulator, B: RingBuf<A> + ?Sized>(
    ctx: &mut OpCtx<'_>,
    buf: &mut B,
    sched: &Schedule,
    op: ReduceOp,
    rank: usize,
    n: usize,
) -> Result<()> {
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    let window = ctx.ring_window();
    // Where the transport seals each record as the payload is written (TLS), a Forward step's
    // combine and a Gather step's copy into the buffer happen as the frame is sent on, record by
    // record in cache, and every frame is flagged so the receiver's transport may leave it sealed
    // until it is read.
    let fused = ctx.fills_on_send();
    let mut held: VecDeque<Held> = VecDeque::new();
    let mut sent = 0;
    ctx.announce(prev, sched.recvs.len());
    for done in 0..=sched.recvs.len() {
        while sent < sched.sends.len() && (sent < done + window || done == sched.recvs.len()) {
            let (source, range, after) = &sched.sends[sent];
            if after.is_some_and(|i| i >= done) {
                break;
            }
            match source {
                Send::Buf if !fused => ctx.send_frame(next, Some(A::DTYPE), bytemuck::cast_slice(buf.read(range.clone()))).await?,
                Send::Buf | Send::Final => ctx.send_copied_frame(next, Some(A::DTYPE), bytemuck::cast_slice(buf.read(range.clone()))).await?,
                Send::Forward | Send::Pass => match held.pop_front() {
                    Some(Held::Frame(frame)) => ctx.forward_frame(next, Some(A::DTYPE), frame).await?,
                    Some(Held::Uncombined(frame)) => ctx.send_combined(next, frame, op, buf.read(range.clone())).await?,
                    Some(Held::Unkept(frame)) => ctx.send_passed(next, frame, buf.write(range.clone())).await?,
                    Some(Held::Buf) => {
                        debug_assert_eq!(*source, Send::Pass, "a forward always keeps its frame");
                        ctx.send_copied_frame(next, Some(A::DTYPE), bytemuck::cast_slice(buf.read(range.clone()))).await?
                    }
                    None => debug_assert!(false, "a frame is sent on after it was received"),
                },
            }
            sent += 1;
        }
        let Some((kind, range)) = sched.recvs.get(done) else { break };
        match kind {
            Recv::Forward if fused => {
                let frame = ctx.recv_frame_maybe_sealed(prev, Some(A::DTYPE), std::mem::size_of::<A>() * range.len()).await?;
                held.push_back(Held::Uncombined(frame));
            }
            Recv::Forward => {
                let frame = ctx.recv_frame_parts(prev, Some(A::DTYPE), std::mem::size_of::<A>() * range.len()).await?;
                let frame = ctx.combine_forward(op, frame, buf.read(range.clone()));
                let lent_held = held.iter().filter(|h| matches!(h, Held::Frame(f) if f.is_lent())).count();
                held.push_back(Held::Frame(ctx.hold(frame, lent_held)));
            }
            Recv::Final => {
                let dst = buf.write(range.clone());
                ctx.recv_combine(prev, dst, op, true).await?;
                if op == ReduceOp::Avg {
                    for x in dst.iter_mut() {
                        *x = x.div_count(n);
                    }
                }
            }
            Recv::Gather if fused => {
                let frame = ctx.recv_frame_maybe_sealed(prev, Some(A::DTYPE), std::mem::size_of::<A>() * range.len()).await?;
                held.push_back(Held::Unkept(frame));
            }
            Recv::Gather => {
                // A lent payload goes back to the transport now, and a sealed one was opened
                // straight into the buffer: the buffer holds what to send on.
                let frame = ctx.recv_into(prev, buf.write(range.clone())).await?;
                held.push_back(match frame {
                    Some(frame) if !frame.is_lent() => Held::Frame(frame),
                    _ => Held::Buf,
                });
            }
            Recv::Last => ctx.recv_copy(prev, buf.write(range.clone())).await?,
        }
    }
    debug_assert_eq!(sent, sched.sends.len());
    debug_assert!(held.is_empty(), "every held frame was sent on");
    Ok(())
}

/// Ring reduce-scatter of a buffer of `len` elements: afterwards rank `r`'s owned segment
/// (`bufs.own`, segment `r`) holds the reduced values (divided by `n` for [`ReduceOp::Avg`]).
/// Each received piece is combined into the frame it came in and that frame is forwarded, so the
/// local buffer is never written outside the owned segment.
pub(crate) async fn ring_reduce_scatter<T: Element>(
    ctx: &mut OpCtx<'_>,
    mut bufs: RsBuffers<'_, T>,
    len: usize,
    op: ReduceOp,
    rank: usize,
    n: usize,
) -> Result<()> {
    debug_assert!(n >= 2 && rank < n);
    let sched = Schedule::ring(len, n, rank, ctx.piece_elems::<T::Acc>(), true, false);
    run_ring(ctx, &mut bufs, &sched, op, rank, n).await
}

/// Ring reduce-scatter in place: afterwards segment `rank` of `buf` holds the reduced values
/// (divided by `n` for [`ReduceOp::Avg`]); the other segments are left as they were (each received
/// piece is combined into its frame and forwarded, never written back).
pub(crate) async fn ring_reduce_scatter_in_place<A: Accumulator>(ctx: &mut OpCtx<'_>, buf: &mut [A], op: ReduceOp, rank: usize, n: usize) -> Result<()> {
    debug_assert!(n >= 2 && rank < n);
    let sched = Schedule::ring(buf.len(), n, rank, ctx.piece_elems::<A>(), true, false);
    run_ring(ctx, buf, &sched, op, rank, n).await
}

/// Ring all-reduce in place: reduce-scatter and all-gather in one round-major pipeline; each
/// owned piece is sent on as soon as its reduction is final (and averaged), while still in cache.
pub(crate) async fn ring_all_reduce<A: Accumulator>(ctx: &mut OpCtx<'_>, buf: &mut [A], op: ReduceOp, rank: usize, n: usize) -> Result<()> {
    debug_assert!(n >= 2 && rank < n);
    let sched = Schedule::ring(buf.len(), n, rank, ctx.piece_elems::<A>(), true, true);
    run_ring(ctx, buf, &sched, op, rank, n).await
}

/// Ring all-gather in place: segment `r` of `buf` is valid on rank `r` beforehand; afterwards every
/// segment is valid everywhere. Forwarded pieces are sent from `buf`, where they were just copied.
pub(crate) async fn ring_all_gather<T: WireElement>(ctx: &mut OpCtx<'_>, buf: &mut [T], rank: usize, n: usize) -> Result<()> {
    debug_assert!(n >= 2 && rank < n);
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    let sched = Schedule::ring(buf.len(), n, rank, ctx.piece_elems::<T>(), false, true);
    let window = ctx.ring_window();
    // As in `run_ring`: a sealing transport passes a gathered piece on as it keeps it.
    let fused = ctx.fills_on_send();
    let mut held: VecDeque<Held> = VecDeque::new();
    let mut sent = 0;
    ctx.announce(prev, sched.recvs.len());
    for done in 0..=sched.recvs.len() {
        while sent < sched.sends.len() && (sent < done + window || done == sched.recvs.len()) {
            let (source, range, after) = &sched.sends[sent];
            if after.is_some_and(|i| i >= done) {
                break;
            }
            match (source, if *source == Send::Pass { held.pop_front() } else { None }) {
                (Send::Pass, Some(Held::Frame(frame))) => ctx.forward_frame(next, Some(T::DTYPE), frame).await?,
                (Send::Pass, Some(Held::Unkept(frame))) => ctx.send_passed(next, frame, &mut buf[range.clone()]).await?,
                _ => ctx.send_copied_frame(next, Some(T::DTYPE), bytemuck::cast_slice(&buf[range.clone()])).await?,
            }
            sent += 1;
        }
        let Some((kind, range)) = sched.recvs.get(done) else { break };
        if fused && *kind == Recv::Gather {
            let frame = ctx.recv_frame_maybe_sealed(prev, Some(T::DTYPE), std::mem::size_of_val(&buf[range.clone()])).await?;
            held.push_back(Held::Unkept(frame));
            continue;
        }
        let frame = ctx.recv_into(prev, &mut buf[range.clone()]).await?;
        if *kind == Recv::Gather {
            // Passed on as received (see `run_ring`); a lent payload goes back now, a sealed one
            // was opened into the buffer.
            held.push_back(match frame {
                Some(frame) if !frame.is_lent() => Held::Frame(frame),
                _ => Held::Buf,
            });
        }
    }
    debug_assert!(held.is_empty(), "every held frame was sent on");
    Ok(())
}

/// Direct (two-shot) all-reduce in place: each rank sends every other rank that rank's segment
/// of its buffer and combines the `n - 1` pieces it gets into its own segment (the reduce-scatter
/// in one step), then sends its reduced segment to every other rank (the all-gather in one step).
/// The same bytes per rank as the ring, but two dependent steps instead of `2(n - 1)`, and all
/// `n - 1` links busy at once. Round-major like the ring: round `k` reduces piece `k` of the own
/// segment, sends it to everyone and copies in piece `k` of everyone's, while piece `k + 1` of
/// the reduce-scatter is already on its way. Every rank combines in the same order (its own
/// values, then rank `rank - 1`'s, `rank - 2`'s, ...) and the others copy the owner's result, so
/// all end with the same bits. On each link the frames go reduce-scatter piece 0, then for every
/// round `k` all-gather piece `k` and reduce-scatter piece `k + 1`; both ends skip the same
/// missing last pieces (segments differ by at most one element).
pub(crate) async fn direct_all_reduce<A: Accumulator>(ctx: &mut OpCtx<'_>, buf: &mut [A], op: ReduceOp, rank: usize, n: usize) -> Result<()> {
    debug_assert!(n >= 2 && rank < n);
    let len = buf.len();
    let piece = ctx.piece_elems::<A>();
    let seg = |r: usize| segment_range(len, n, r);
    let piece_of = |r: usize, k: usize| piece_of(seg(r), k, piece);
    let rounds = seg(0).len().div_ceil(piece);
    let peers = |toward_higher: bool| (1..n).map(move |k| if toward_higher { (rank + k) % n } else { (rank + n - k) % n });
    for from in peers(false) {
        ctx.announce(from, seg(rank).len().div_ceil(piece) + seg(from).len().div_ceil(piece));
    }
    for to in peers(true) {
        if let Some(p) = piece_of(to, 0) {
            ctx.send_copied_frame(to, Some(A::DTYPE), bytemuck::cast_slice(&buf[p])).await?;
        }
    }
    for k in 0..rounds {
        if let Some(own) = piece_of(rank, k) {
            for from in peers(false) {
                ctx.recv_combine(from, &mut buf[own.clone()], op, false).await?;
            }
            if op == ReduceOp::Avg {
                for x in buf[own.clone()].iter_mut() {
                    *x = x.div_count(n);
                }
            }
            for to in peers(true) {
                ctx.send_copied_frame(to, Some(A::DTYPE), bytemuck::cast_slice(&buf[own.clone()])).await?;
            }
        }
        for to in peers(true) {
            if let Some(p) = piece_of(to, k + 1) {
                ctx.send_copied_frame(to, Some(A::DTYPE), bytemuck::cast_slice(&buf[p])).await?;
            }
        }
        for from in peers(false) {
            if let Some(p) = piece_of(from, k) {
                ctx.recv_copy(from, &mut buf[p]).await?;
            }
        }
    }
    Ok(())
}

/// Recursive doubling all-reduce for any `n`: with `p` the largest power of two `<= n` and
/// `rem = n - p`, ranks `2i` fold into `2i + 1` for `i < rem`, the `p` remaining ranks exchange whole
/// buffers `log2 p` times, and the folded ranks get the result back.
pub(crate) async fn doubling_all_reduce<A: Accumulator>(ctx: &mut OpCtx<'_>, buf: &mut [A], op: ReduceOp, rank: usize, n: usize) -> Result<()> {
    debug_assert!(n >= 2 && rank < n);
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let rem = n - p;
    let folded = rank < 2 * rem;
    if folded && rank % 2 == 0 {
        ctx.send_all(rank + 1, buf).await?;
        return ctx.recv_all(rank + 1, buf).await;
    }
    let new_rank = if folded { rank / 2 } else { rank - rem };
    if folded {
        ctx.recv_combine_all(rank - 1, buf, op, true).await?;
    }
    let real = |nr: usize| if nr < rem { 2 * nr + 1 } else { nr + rem };
    let mut mask = 1;
    while mask < p {
        let partner_new = new_rank ^ mask;
        let partner = real(partner_new);
        ctx.send_all(partner, buf).await?;
        ctx.recv_combine_all(partner, buf, op, partner_new < new_rank).await?;
        mask <<= 1;
    }
    if op == ReduceOp::Avg {
        for x in buf.iter_mut() {
            *x = x.div_count(n);
        }
    }
    if folded {
        ctx.send_all(rank - 1, buf).await?;
    }
    Ok(())
}

/// Binomial-tree broadcast from `root`, whole buffer per edge.
pub(crate) async fn tree_broadcast<T: WireElement>(ctx: &mut OpCtx<'_>, buf: &mut [T], root: usize, rank: usize, n: usize) -> Result<()> {
    let vrank = (rank + n - root) % n;
    let real = |v: usize| (v + root) % n;
    let mut mask = 1;
    while mask < n {
        if vrank & mask != 0 {
            ctx.recv_all(real(vrank - mask), buf).await?;
            break;
        }
        mask <<= 1;
    }
    mask >>= 1;
    while mask > 0 {
        if vrank + mask < n {
            ctx.send_all(real(vrank + mask), buf).await?;
        }
        mask >>= 1;
    }
    Ok(())
}

/// Pipelined chain broadcast from `root` along virtual ranks `0 → 1 → ... → n-1`: each piece is
/// forwarded as soon as it arrives, so large buffers take about one buffer time plus `n` pieces.
pub(crate) async fn chain_broadcast<T: WireElement>(ctx: &mut OpCtx<'_>, buf: &mut [T], root: usize, rank: usize, n: usize) -> Result<()> {
    let vrank = (rank + n - root) % n;
    let next = (vrank + 1 < n).then(|| (rank + 1) % n);
    let prev = (vrank > 0).then(|| (rank + n - 1) % n);
    for p in pieces(buf.len(), ctx.piece_elems::<T>()) {
        if let Some(prev) = prev {
            ctx.recv_copy(prev, &mut buf[p.clone()]).await?;
        }
        if let Some(next) = next {
            // The next rank copies it whole (`recv_copy`).
            ctx.send_copied_frame(next, Some(T::DTYPE), bytemuck::cast_slice(&buf[p])).await?;
        }
    }
    Ok(())
}

/// Binomial-tree reduce of `work` towards `root`; on `root`, `work` ends as the result (averaged for
/// [`ReduceOp::Avg`]). Returns whether this rank is the root.
pub(crate) async fn tree_reduce<A: Accumulator>(ctx: &mut OpCtx<'_>, work: &mut [A], op: ReduceOp, root: usize, rank: usize, n: usize) -> Result<()> {
    let vrank = (rank + n - root) % n;
    let real = |v: usize| (v + root) % n;
    let mut mask = 1;
    while mask < n {
        if vrank & mask != 0 {
            return ctx.send_all(real(vrank - mask), work).await;
        }
        if vrank + mask < n {
            ctx.recv_combine_all(real(vrank + mask), work, op, false).await?;
        }
        mask <<= 1;
    }
    debug_assert_eq!(vrank, 0);
    if op == ReduceOp::Avg {
        for x in work.iter_mut() {
            *x = x.div_count(n);
        }
    }
    Ok(())
}
