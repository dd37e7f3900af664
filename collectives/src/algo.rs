//! Collective algorithms over an [`OpCtx`]: ring reduce-scatter and all-gather (pipelined in pieces),
//! recursive doubling all-reduce, binomial-tree broadcast and reduce, and a pipelined chain
//! broadcast.
//!
//! Determinism: every algorithm reduces in an order fixed by rank numbers alone. In the ring, the
//! segment owned by rank `c` is accumulated as `((v[c+1] + v[c+2]) + ...) + v[c]` and then copied to
//! everyone. In recursive doubling and the trees, two blocks of ranks are combined as
//! `combine(lower block, higher block)` on both partners. So results are bit-identical on every rank
//! and do not depend on timing; different algorithms (chosen by size) may differ in the last bits.

use crate::element::{Accumulator, WireElement};
use crate::error::Result;
use crate::op::{pieces, segment_range, OpCtx};
use crate::ReduceOp;

/// Ring reduce-scatter in place: afterwards rank `r` holds the reduced segment `r` of `buf`
/// (divided by `n` for [`ReduceOp::Avg`]); other segments hold partial sums.
pub(crate) async fn ring_reduce_scatter<A: Accumulator>(ctx: &mut OpCtx<'_>, buf: &mut [A], op: ReduceOp, rank: usize, n: usize) -> Result<()> {
    debug_assert!(n >= 2 && rank < n);
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    let piece = ctx.piece_elems::<A>();
    let len = buf.len();
    let seg = |i: usize| segment_range(len, n, i);
    let first = seg((rank + n - 1) % n);
    for p in pieces(first.len(), piece) {
        let range = first.start + p.start..first.start + p.end;
        ctx.send_frame(next, Some(A::DTYPE), bytemuck::cast_slice(&buf[range])).await?;
    }
    for step in 0..n - 1 {
        let recv = seg((rank + 2 * n - step - 2) % n);
        for p in pieces(recv.len(), piece) {
            let range = recv.start + p.start..recv.start + p.end;
            ctx.recv_combine(prev, &mut buf[range.clone()], op, true).await?;
            if step + 1 < n - 1 {
                ctx.send_frame(next, Some(A::DTYPE), bytemuck::cast_slice(&buf[range])).await?;
            }
        }
    }
    if op == ReduceOp::Avg {
        for x in &mut buf[seg(rank)] {
            *x = x.div_count(n);
        }
    }
    Ok(())
}

/// Ring all-gather in place: segment `r` of `buf` is valid on rank `r` beforehand; afterwards every
/// segment is valid everywhere.
pub(crate) async fn ring_all_gather<T: WireElement>(ctx: &mut OpCtx<'_>, buf: &mut [T], rank: usize, n: usize) -> Result<()> {
    debug_assert!(n >= 2 && rank < n);
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    let piece = ctx.piece_elems::<T>();
    let len = buf.len();
    let seg = |i: usize| segment_range(len, n, i);
    let own = seg(rank);
    for p in pieces(own.len(), piece) {
        let range = own.start + p.start..own.start + p.end;
        ctx.send_frame(next, Some(T::DTYPE), bytemuck::cast_slice(&buf[range])).await?;
    }
    for step in 0..n - 1 {
        let recv = seg((rank + 2 * n - step - 1) % n);
        for p in pieces(recv.len(), piece) {
            let range = recv.start + p.start..recv.start + p.end;
            ctx.recv_copy(prev, &mut buf[range.clone()]).await?;
            if step + 1 < n - 1 {
                ctx.send_frame(next, Some(T::DTYPE), bytemuck::cast_slice(&buf[range])).await?;
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
