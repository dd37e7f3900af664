//! Collective algorithms over an [`OpCtx`]: ring reduce-scatter and all-gather (pipelined in pieces),
//! recursive doubling all-reduce, binomial-tree broadcast and reduce, and a pipelined chain
//! broadcast.
//!
//! Determinism: every algorithm reduces in an order fixed by rank numbers alone. In the ring, the
//! segment owned by rank `c` is accumulated as `((v[c+1] + v[c+2]) + ...) + v[c]` and then copied to
//! everyone. In recursive doubling and the trees, two blocks of ranks are combined as
//! `combine(lower block, higher block)` on both partners. So results are bit-identical on every rank
//! and do not depend on timing; different algorithms (chosen by size) may differ in the last bits.

use std::collections::VecDeque;
use std::ops::Range;

use crate::element::{combine_bytes, combine_into_bytes, Accumulator, WireElement};
use crate::error::Result;
use crate::frame::Frame;
use crate::op::{pieces, segment_range, OpCtx};
use crate::ReduceOp;

/// Most frames a ring step sends on its outgoing link ahead of the frames it has received on its
/// incoming one. Bounds what waits in a receiver's mailbox to a few pieces, so received frames are
/// still in cache when they are combined and pool buffers are reused instead of piling up (without
/// it, the first segment of a 256 MiB two-rank all-reduce, 128 MiB, would be parked at the peer).
/// Two pieces keep the link busy while a step combines; more measured no faster.
pub(crate) const RING_WINDOW: usize = 2;

/// The local data of a ring reduce-scatter: segments other than the owned one are only read; the
/// owned segment starts as the local values and ends as the reduced result.
pub(crate) struct RsBuffers<'a, A> {
    left: &'a [A],
    own: &'a mut [A],
    right: &'a [A],
    own_range: Range<usize>,
}

impl<'a, A> RsBuffers<'a, A> {
    /// Reduces `buf` in place: afterwards `buf[own]` holds the result; the rest is unchanged.
    pub(crate) fn in_place(buf: &'a mut [A], own: Range<usize>) -> Self {
        let (left, rest) = buf.split_at_mut(own.start);
        let (own_slice, right) = rest.split_at_mut(own.len());
        RsBuffers { left, own: own_slice, right, own_range: own }
    }

    /// Reads `input` and writes the owned segment's result to `output`.
    pub(crate) fn separate(input: &'a [A], output: &'a mut [A], own: Range<usize>) -> Self
    where
        A: Copy,
    {
        output.copy_from_slice(&input[own.clone()]);
        RsBuffers { left: &input[..own.start], own: output, right: &input[own.end..], own_range: own }
    }

    /// The local values of `r`, a range inside one segment.
    fn local(&self, r: Range<usize>) -> &[A] {
        let own = &self.own_range;
        if r.end <= own.start {
            &self.left[r]
        } else if r.start >= own.end {
            &self.right[r.start - own.end..r.end - own.end]
        } else {
            &self.own[r.start - own.start..r.end - own.start]
        }
    }
}

/// Pieces of `seg` as absolute ranges.
fn abs_pieces(seg: Range<usize>, piece: usize) -> impl Iterator<Item = Range<usize>> {
    pieces(seg.len(), piece).map(move |p| seg.start + p.start..seg.start + p.end)
}

/// Ring reduce-scatter of a buffer of `len` elements: afterwards rank `r`'s owned segment
/// (`bufs.own`, segment `r`) holds the reduced values (divided by `n` for [`ReduceOp::Avg`]).
///
/// Each received piece is combined into the frame it came in and that frame is forwarded, so the
/// local buffer is never written outside the owned segment. Sends run at most [`RING_WINDOW`]
/// frames ahead of receives; the order of frames on each link is fixed (first segment, then every
/// forwarded piece in step order), so interleaving does not change what either side expects.
pub(crate) async fn ring_reduce_scatter<A: Accumulator>(ctx: &mut OpCtx<'_>, bufs: RsBuffers<'_, A>, len: usize, op: ReduceOp, rank: usize, n: usize) -> Result<()> {
    debug_assert!(n >= 2 && rank < n);
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    let piece = ctx.piece_elems::<A>();
    let seg = |i: usize| segment_range(len, n, i);
    let first: Vec<Range<usize>> = abs_pieces(seg((rank + n - 1) % n), piece).collect();
    // (forwarded?, range) of every received piece, in link order.
    let recvs: Vec<(bool, Range<usize>)> =
        (0..n - 1).flat_map(|step| abs_pieces(seg((rank + 2 * n - step - 2) % n), piece).map(move |r| (step + 1 < n - 1, r))).collect();
    let total_sends = first.len() + recvs.iter().filter(|(forward, _)| *forward).count();
    let mut forwards: VecDeque<Frame> = VecDeque::new();
    let mut sent = 0;
    let own_start = bufs.own_range.start;
    for (done, (forward, range)) in recvs.iter().enumerate() {
        while sent < total_sends && sent < done + RING_WINDOW {
            if let Some(r) = first.get(sent) {
                ctx.send_frame(next, Some(A::DTYPE), bytemuck::cast_slice(bufs.local(r.clone()))).await?;
            } else if let Some(frame) = forwards.pop_front() {
                ctx.send_frame(next, Some(A::DTYPE), frame.payload()).await?;
            } else {
                break;
            }
            sent += 1;
        }
        let mut frame = ctx.recv_frame(prev, Some(A::DTYPE), std::mem::size_of::<A>() * range.len()).await?;
        if *forward {
            combine_into_bytes(op, frame.payload_mut(), bufs.local(range.clone()));
            forwards.push_back(ctx.hold(frame, forwards.len()));
        } else {
            combine_bytes(op, &mut bufs.own[range.start - own_start..range.end - own_start], frame.payload(), true);
        }
    }
    while sent < total_sends {
        if let Some(r) = first.get(sent) {
            ctx.send_frame(next, Some(A::DTYPE), bytemuck::cast_slice(bufs.local(r.clone()))).await?;
        } else if let Some(frame) = forwards.pop_front() {
            ctx.send_frame(next, Some(A::DTYPE), frame.payload()).await?;
        }
        sent += 1;
    }
    if op == ReduceOp::Avg {
        for x in bufs.own.iter_mut() {
            *x = x.div_count(n);
        }
    }
    Ok(())
}

/// Ring all-gather in place: segment `r` of `buf` is valid on rank `r` beforehand; afterwards every
/// segment is valid everywhere. Windowed like [`ring_reduce_scatter`]; forwarded pieces are sent
/// from `buf`, where they were just copied.
pub(crate) async fn ring_all_gather<T: WireElement>(ctx: &mut OpCtx<'_>, buf: &mut [T], rank: usize, n: usize) -> Result<()> {
    debug_assert!(n >= 2 && rank < n);
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    let piece = ctx.piece_elems::<T>();
    let len = buf.len();
    let seg = |i: usize| segment_range(len, n, i);
    let first: Vec<Range<usize>> = abs_pieces(seg(rank), piece).collect();
    let recvs: Vec<(bool, Range<usize>)> =
        (0..n - 1).flat_map(|step| abs_pieces(seg((rank + 2 * n - step - 1) % n), piece).map(move |r| (step + 1 < n - 1, r))).collect();
    let total_sends = first.len() + recvs.iter().filter(|(forward, _)| *forward).count();
    // Send `sent` is ready once the receive it forwards (if any) is done.
    let ready = |sent: usize, done: usize| sent < first.len() || sent - first.len() < done;
    let range_of = |sent: usize| first.get(sent).cloned().unwrap_or_else(|| recvs[sent - first.len()].1.clone());
    let mut sent = 0;
    for (done, (_, range)) in recvs.iter().enumerate() {
        while sent < total_sends && sent < done + RING_WINDOW && ready(sent, done) {
            ctx.send_frame(next, Some(T::DTYPE), bytemuck::cast_slice(&buf[range_of(sent)])).await?;
            sent += 1;
        }
        ctx.recv_copy(prev, &mut buf[range.clone()]).await?;
    }
    while sent < total_sends {
        ctx.send_frame(next, Some(T::DTYPE), bytemuck::cast_slice(&buf[range_of(sent)])).await?;
        sent += 1;
    }
    Ok(())
}

/// Ring all-reduce in place: a ring reduce-scatter and a ring all-gather run as one pipeline.
///
/// Frames on each link keep the order of the two separate phases (reduce-scatter, then
/// all-gather), so results are bit-identical to [`ring_reduce_scatter`] followed by
/// [`ring_all_gather`]; but each piece of the owned segment is sent on as soon as its reduction is
/// final (and averaged, for [`ReduceOp::Avg`]), while it is still in cache, and the all-gather
/// starts without waiting for the whole reduce-scatter. Sends stay within [`RING_WINDOW`] of
/// receives as in the phases alone.
pub(crate) async fn ring_all_reduce<A: Accumulator>(ctx: &mut OpCtx<'_>, buf: &mut [A], op: ReduceOp, rank: usize, n: usize) -> Result<()> {
    debug_assert!(n >= 2 && rank < n);
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    let piece = ctx.piece_elems::<A>();
    let len = buf.len();
    let seg = |i: usize| segment_range(len, n, i);
    // What each frame from `prev` is, in link order.
    #[derive(Clone, Copy, PartialEq)]
    enum Recv {
        /// Reduce-scatter piece to combine and forward.
        Forward,
        /// Reduce-scatter piece of the owned segment: combined into place, final.
        Final,
        /// All-gather piece to copy in and forward.
        Gather,
        /// All-gather piece of the last step: copied in only.
        Last,
    }
    let mut recvs: Vec<(Recv, Range<usize>)> = Vec::new();
    for step in 0..n - 1 {
        let kind = if step + 1 < n - 1 { Recv::Forward } else { Recv::Final };
        recvs.extend(abs_pieces(seg((rank + 2 * n - step - 2) % n), piece).map(|r| (kind, r)));
    }
    for step in 0..n - 1 {
        let kind = if step + 1 < n - 1 { Recv::Gather } else { Recv::Last };
        recvs.extend(abs_pieces(seg((rank + 2 * n - step - 1) % n), piece).map(|r| (kind, r)));
    }
    // Every frame to `next`, in link order: (range sent from `buf`, or a combined frame; the receive
    // it waits for).
    let mut sends: Vec<(Option<Range<usize>>, Option<usize>)> = abs_pieces(seg((rank + n - 1) % n), piece).map(|r| (Some(r), None)).collect();
    for (i, (kind, range)) in recvs.iter().enumerate() {
        match kind {
            Recv::Forward => sends.push((None, Some(i))),
            Recv::Final | Recv::Gather => sends.push((Some(range.clone()), Some(i))),
            Recv::Last => {}
        }
    }
    let mut forwards: VecDeque<Frame> = VecDeque::new();
    let mut sent = 0;
    for done in 0..=recvs.len() {
        while sent < sends.len() && (sent < done + RING_WINDOW || done == recvs.len()) {
            let (range, after) = &sends[sent];
            if after.is_some_and(|i| i >= done) {
                break;
            }
            match range {
                Some(r) => ctx.send_frame(next, Some(A::DTYPE), bytemuck::cast_slice(&buf[r.clone()])).await?,
                None => {
                    let frame = forwards.pop_front();
                    debug_assert!(frame.is_some(), "a forward is sent after its frame was combined");
                    if let Some(frame) = frame {
                        ctx.send_frame(next, Some(A::DTYPE), frame.payload()).await?;
                    }
                }
            }
            sent += 1;
        }
        let Some((kind, range)) = recvs.get(done) else { break };
        match kind {
            Recv::Forward => {
                let mut frame = ctx.recv_frame(prev, Some(A::DTYPE), std::mem::size_of::<A>() * range.len()).await?;
                combine_into_bytes(op, frame.payload_mut(), &buf[range.clone()]);
                forwards.push_back(ctx.hold(frame, forwards.len()));
            }
            Recv::Final => {
                ctx.recv_combine(prev, &mut buf[range.clone()], op, true).await?;
                if op == ReduceOp::Avg {
                    for x in &mut buf[range.clone()] {
                        *x = x.div_count(n);
                    }
                }
            }
            Recv::Gather | Recv::Last => ctx.recv_copy(prev, &mut buf[range.clone()]).await?,
        }
    }
    debug_assert_eq!(sent, sends.len());
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
            ctx.send_frame(next, Some(T::DTYPE), bytemuck::cast_slice(&buf[p])).await?;
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
