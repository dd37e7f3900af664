//! Fused scaled dot-product attention for the CPU, forward and backward, one (batch, head) at a
//! time: `P = softmax(scale · Q·Kᵀ, masked)`, `O = P·V`.
//!
//! Each head's scores live in a `Tq × Tk` block (64 KiB at T = 128, so it stays in L2) that the
//! forward writes once and keeps for the backward, instead of a batched product, a separate
//! masked softmax over the whole `[.., Tq, Tk]` tensor and a second batched product. Queries go
//! in blocks of [`QUERY_BLOCK`] rows; with a causal mask a block only multiplies against the keys
//! its last row can see, so the masked upper triangle is mostly never computed. Heads run in
//! parallel on the shared pool, each with its own output rows, and every reduction has a fixed
//! order, so results do not depend on the thread count.
//!
//! Q, K and V are strided: head `h` of Q starts at `q.offsets[h]` and its rows are
//! `q.row_stride` apart, with unit column stride (a view of a packed `[B, T, 3, H, D]` projection
//! needs no copy). [`attention_forward`] and [`attention_backward`] write contiguous per-head
//! outputs; [`attention_forward_packed`] and [`attention_backward_packed`] take a packed
//! `[B, T, 3, H, D]` projection and write `[B, T, H, D]` and the `[B, T, 3, H, D]` gradient
//! straight in place (each batch row's heads on one thread), with no gather afterwards.
//!
//! The per-head math is in `head.rs`; heads up to `tile::SMALL_HEAD` wide multiply in register
//! tiles (`tile.rs`) instead of calling `gemm` a few times per head.

use crate::error::{check_len, product, Error, Result};
use crate::float::Float;
use crate::threading::should_parallelize;
use head::{backward_head, forward_head, Grads, Scratch};
use rayon::prelude::*;

mod head;
mod small;
mod tile;
#[cfg(test)]
mod tests;

pub use tile::SMALL_HEAD;

/// Query rows per block.
pub const QUERY_BLOCK: usize = 32;

/// One operand of attention: every head's rows inside one slice.
#[derive(Clone, Copy, Debug)]
pub struct Heads<'a, T> {
    /// The elements.
    pub data: &'a [T],
    /// Offset of row 0 of each head.
    pub offsets: &'a [usize],
    /// Distance between consecutive rows of a head (columns are adjacent).
    pub row_stride: usize,
}

/// Sizes and options of one attention call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionSpec {
    /// Query rows per head.
    pub tq: usize,
    /// Key (and value) rows per head.
    pub tk: usize,
    /// Width of queries and keys.
    pub d: usize,
    /// Width of values and outputs.
    pub dv: usize,
    /// Whether query `i` sees only keys `j <= i`.
    pub causal: bool,
    /// Factor on the scores (usually `1/sqrt(d)`).
    pub scale: f64,
}

impl AttentionSpec {
    /// Keys the rows `..row_end` can see at most.
    fn key_limit(&self, row_end: usize) -> usize {
        if self.causal {
            row_end.min(self.tk)
        } else {
            self.tk
        }
    }
}

/// Forward: writes `out` (`[heads, tq, dv]`, contiguous) and the attention weights `probs`
/// (`[heads, tq, tk]`, zero where masked), which [`attention_backward`] needs. A query row that
/// sees no key gets zeros.
pub fn attention_forward<T: Float>(spec: AttentionSpec, q: Heads<'_, T>, k: Heads<'_, T>, v: Heads<'_, T>, out: &mut [T], probs: &mut [T]) -> Result<()> {
    const OP: &str = "attention_forward";
    let n_heads = check_operands(OP, &spec, &q, &k, &v)?;
    let AttentionSpec { tq, tk, d, dv, .. } = spec;
    check_len(OP, "out", out, product(&[n_heads, tq, dv]))?;
    check_len(OP, "probs", probs, product(&[n_heads, tq, tk]))?;
    if n_heads == 0 || tq == 0 {
        return Ok(());
    }
    let head = |s: &mut Scratch<T>, (h, (o, p)): (usize, (&mut [T], &mut [T]))| forward_head(&spec, q, k, v, h, o, 0, dv, p, tk, s);
    let (out, probs) = (&mut out[..n_heads * tq * dv], &mut probs[..n_heads * tq * tk]);
    if n_heads > 1 && should_parallelize(n_heads * tq * tk * (d + dv)) {
        out.par_chunks_mut(tq * dv).zip(probs.par_chunks_mut(tq * tk)).enumerate().for_each_init(Scratch::new, head);
    } else {
        let mut s = Scratch::new();
        out.chunks_mut(tq * dv).zip(probs.chunks_mut(tq * tk)).enumerate().for_each(|x| head(&mut s, x));
    }
    Ok(())
}

/// Backward: from the forward's `probs` and the output gradient `dout` (strided like the
/// inputs, `tq × dv` per head) writes `dq` (`[heads, tq, d]`), `dk` (`[heads, tk, d]`) and `dv_out`
/// (`[heads, tk, dv]`), all contiguous.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: Float>(
    spec: AttentionSpec,
    q: Heads<'_, T>,
    k: Heads<'_, T>,
    v: Heads<'_, T>,
    probs: &[T],
    dout: Heads<'_, T>,
    dq: &mut [T],
    dk: &mut [T],
    dv_out: &mut [T],
) -> Result<()> {
    const OP: &str = "attention_backward";
    let n_heads = check_operands(OP, &spec, &q, &k, &v)?;
    let AttentionSpec { tq, tk, d, dv, .. } = spec;
    check_len(OP, "probs", probs, product(&[n_heads, tq, tk]))?;
    check_dout(OP, &spec, n_heads, &dout)?;
    check_len(OP, "dq", dq, product(&[n_heads, tq, d]))?;
    check_len(OP, "dk", dk, product(&[n_heads, tk, d]))?;
    check_len(OP, "dv", dv_out, product(&[n_heads, tk, dv]))?;
    if n_heads == 0 {
        return Ok(());
    }
    if tq == 0 {
        dk[..n_heads * tk * d].fill(T::zero());
        dv_out[..n_heads * tk * dv].fill(T::zero());
        return Ok(());
    }
    #[allow(clippy::type_complexity)]
    let head = |s: &mut Scratch<T>, (h, (a, (b, c))): (usize, (&mut [T], (&mut [T], &mut [T])))| {
        b.fill(T::zero());
        c.fill(T::zero());
        backward_head(&spec, q, k, v, h, &probs[h * tq * tk..(h + 1) * tq * tk], tk, dout, &mut Grads::Split(a, b, c), s)
    };
    let dq = &mut dq[..n_heads * tq * d];
    let dk = &mut dk[..n_heads * tk * d];
    let dv_out = &mut dv_out[..n_heads * tk * dv];
    if n_heads > 1 && should_parallelize(n_heads * tq * tk * (d + dv)) {
        dq.par_chunks_mut(tq * d).zip(dk.par_chunks_mut(tk * d).zip(dv_out.par_chunks_mut(tk * dv))).enumerate().for_each_init(Scratch::new, head);
    } else {
        let mut s = Scratch::new();
        dq.chunks_mut(tq * d).zip(dk.chunks_mut(tk * d).zip(dv_out.chunks_mut(tk * dv))).enumerate().for_each(|x| head(&mut s, x));
    }
    Ok(())
}

/// Self-attention over a packed projection: `qkv` holds `[B, T, 3, H, D]` (per position the
/// queries, keys and values of `heads` heads; `spec.tq == spec.tk == T`, `spec.d == spec.dv == D`).
/// Writes `out` as `[B, T, H, D]` (the heads side by side, ready for the output projection) and
/// the attention weights, which only [`attention_backward_packed`] reads, to `probs`
/// ([`packed_probs_len`] elements: `[B, H, T, probs_row_stride]`). Results equal
/// [`attention_forward`]'s on the same heads.
pub fn attention_forward_packed<T: Float>(spec: AttentionSpec, qkv: &[T], batch: usize, heads: usize, out: &mut [T], probs: &mut [T]) -> Result<()> {
    const OP: &str = "attention_forward_packed";
    let (t, d) = check_packed(OP, &spec)?;
    let c = heads * d;
    check_len(OP, "qkv", qkv, product(&[batch, t, 3, c]))?;
    check_len(OP, "out", out, product(&[batch, t, c]))?;
    let p_rs = probs_row_stride(&spec);
    check_len(OP, "probs", probs, packed_probs_len(&spec, batch, heads))?;
    if batch == 0 || heads == 0 || t == 0 || d == 0 {
        return Ok(());
    }
    let (oq, ok, ov) = (packed_offsets(batch, heads, t, d, 0), packed_offsets(batch, heads, t, d, 1), packed_offsets(batch, heads, t, d, 2));
    let part = |o| Heads { data: qkv, offsets: o, row_stride: 3 * c };
    let (q, k, v) = (part(&oq), part(&ok), part(&ov));
    let row = |s: &mut Scratch<T>, (bi, (o, p)): (usize, (&mut [T], &mut [T]))| {
        for (hi, ph) in p.chunks_exact_mut(t * p_rs).enumerate() {
            forward_head(&spec, q, k, v, bi * heads + hi, o, hi * d, c, ph, p_rs, s);
        }
    };
    let (out, probs) = (&mut out[..batch * t * c], &mut probs[..batch * heads * t * p_rs]);
    if batch > 1 && should_parallelize(batch * heads * t * t * 2 * d) {
        out.par_chunks_mut(t * c).zip(probs.par_chunks_mut(heads * t * p_rs)).enumerate().for_each_init(Scratch::new, row);
    } else {
        let mut s = Scratch::new();
        out.chunks_mut(t * c).zip(probs.chunks_mut(heads * t * p_rs)).enumerate().for_each(|x| row(&mut s, x));
    }
    Ok(())
}

/// Backward of [`attention_forward_packed`]: from its `probs` and the output gradient `dout`
/// (`[B, T, H, D]`) writes the gradient of the packed projection, `dqkv` (`[B, T, 3, H, D]`).
pub fn attention_backward_packed<T: Float>(spec: AttentionSpec, qkv: &[T], batch: usize, heads: usize, probs: &[T], dout: &[T], dqkv: &mut [T]) -> Result<()> {
    const OP: &str = "attention_backward_packed";
    let (t, d) = check_packed(OP, &spec)?;
    let c = heads * d;
    check_len(OP, "qkv", qkv, product(&[batch, t, 3, c]))?;
    let p_rs = probs_row_stride(&spec);
    check_len(OP, "probs", probs, packed_probs_len(&spec, batch, heads))?;
    check_len(OP, "dout", dout, product(&[batch, t, c]))?;
    check_len(OP, "dqkv", dqkv, product(&[batch, t, 3, c]))?;
    if batch == 0 || heads == 0 || t == 0 || d == 0 {
        dqkv[..product(&[batch, t, 3, c])].fill(T::zero());
        return Ok(());
    }
    let (oq, ok, ov) = (packed_offsets(batch, heads, t, d, 0), packed_offsets(batch, heads, t, d, 1), packed_offsets(batch, heads, t, d, 2));
    let og: Vec<usize> = (0..batch * heads).map(|i| (i / heads) * t * c + (i % heads) * d).collect();
    let part = |o| Heads { data: qkv, offsets: o, row_stride: 3 * c };
    let (q, k, v) = (part(&oq), part(&ok), part(&ov));
    let g = Heads { data: dout, offsets: &og, row_stride: c };
    let row = |s: &mut Scratch<T>, (bi, slab): (usize, &mut [T])| {
        // dK and dV accumulate; dQ is written over.
        slab.fill(T::zero());
        for hi in 0..heads {
            let h = bi * heads + hi;
            let mut grads = Grads::Slab { data: &mut *slab, dq: hi * d, dk: c + hi * d, dv: 2 * c + hi * d, row_stride: 3 * c };
            backward_head(&spec, q, k, v, h, &probs[h * t * p_rs..(h + 1) * t * p_rs], p_rs, g, &mut grads, s);
        }
    };
    let dqkv = &mut dqkv[..batch * t * 3 * c];
    if batch > 1 && should_parallelize(batch * heads * t * t * 2 * d) {
        dqkv.par_chunks_mut(t * 3 * c).enumerate().for_each_init(Scratch::new, row);
    } else {
        let mut s = Scratch::new();
        dqkv.chunks_mut(t * 3 * c).enumerate().for_each(|x| row(&mut s, x));
    }
    Ok(())
}

/// Distance between rows of the attention weights the packed entry points keep: the keys padded
/// to a multiple of 8 for heads up to [`SMALL_HEAD`] wide (the register-tile path computes them
/// in place there), else `tk`.
pub fn probs_row_stride(spec: &AttentionSpec) -> usize {
    if spec.d <= SMALL_HEAD && spec.dv <= SMALL_HEAD {
        small::padded(spec.tk)
    } else {
        spec.tk
    }
}

/// Elements of the `probs` buffer of [`attention_forward_packed`] and
/// [`attention_backward_packed`]: `batch · heads · tq` rows of [`probs_row_stride`].
pub fn packed_probs_len(spec: &AttentionSpec, batch: usize, heads: usize) -> usize {
    product(&[batch, heads, spec.tq, probs_row_stride(spec)])
}

/// `(T, D)` of a packed call, whose spec must be square self-attention with equal widths.
fn check_packed(op: &'static str, spec: &AttentionSpec) -> Result<(usize, usize)> {
    if spec.tq != spec.tk || spec.d != spec.dv {
        return Err(Error::InvalidArgument { op, arg: "spec", reason: "packed self-attention needs tq == tk and d == dv" });
    }
    Ok((spec.tq, spec.d))
}

/// Where head `(b, h)` of part `s` (0 = q, 1 = k, 2 = v) of a packed `[B, T, 3, H, D]`
/// projection starts.
fn packed_offsets(batch: usize, heads: usize, t: usize, d: usize, s: usize) -> Vec<usize> {
    let c = heads * d;
    (0..batch * heads).map(|i| (i / heads) * t * 3 * c + s * c + (i % heads) * d).collect()
}

/// Checks that `dout` has a head per head and that every head's rows lie inside its slice.
fn check_dout<T>(op: &'static str, spec: &AttentionSpec, n_heads: usize, dout: &Heads<'_, T>) -> Result<()> {
    if dout.offsets.len() != n_heads {
        return Err(Error::BufferTooSmall { op, buffer: "dout offsets", needed: n_heads, actual: dout.offsets.len() });
    }
    if spec.tq > 0 && spec.dv > 0 {
        let needed = dout.offsets.iter().map(|&o| o.saturating_add((spec.tq - 1).saturating_mul(dout.row_stride)).saturating_add(spec.dv)).max().unwrap_or(0);
        check_len(op, "dout", dout.data, needed)?;
    }
    Ok(())
}

/// Validates head counts and that every head's rows lie inside its slice; returns the number
/// of heads.
fn check_operands<T>(op: &'static str, spec: &AttentionSpec, q: &Heads<'_, T>, k: &Heads<'_, T>, v: &Heads<'_, T>) -> Result<usize> {
    let n_heads = q.offsets.len();
    for (name, heads) in [("k offsets", k), ("v offsets", v)] {
        if heads.offsets.len() != n_heads {
            return Err(Error::BufferTooSmall { op, buffer: name, needed: n_heads, actual: heads.offsets.len() });
        }
    }
    for (name, heads, rows, cols) in [("q", q, spec.tq, spec.d), ("k", k, spec.tk, spec.d), ("v", v, spec.tk, spec.dv)] {
        if rows == 0 || cols == 0 {
            continue;
        }
        let span = (rows - 1).saturating_mul(heads.row_stride).saturating_add(cols);
        let needed = heads.offsets.iter().map(|&o| o.saturating_add(span)).max().unwrap_or(0);
        check_len(op, name, heads.data, needed)?;
    }
    Ok(n_heads)
}
