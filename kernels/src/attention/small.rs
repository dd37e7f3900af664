//! One head no wider than [`super::SMALL_HEAD`], forward and backward, all in register tiles
//! ([`super::tile`]), with every score row padded to a multiple of 8 keys: the transposed keys
//! (values, in backward) get zero columns up to the padded width, masked and padded scores are
//! −∞ before the softmax (so they come out 0), and the softmax, the score gradient and the
//! `Q·Kᵀ` / `dO·Vᵀ` tiles then run on whole 8-lane vectors, with no scalar tails (a predictor
//! head of 29 tokens otherwise spends as long on its 5-key tails as on the 24 keys before them).
//! The weights kept for the backward are `[tq, tk]` for the dense entry points, as on the `gemm`
//! path; the packed ones keep them in the padded rows the forward computed them in.

use super::head::{dot_lanes, max_lanes, Grads, Part, Scratch};
use super::tile::{self, Mat};
use super::{AttentionSpec, Heads, QUERY_BLOCK};
use crate::float::Float;

/// Lanes a padded score row is a multiple of.
const LANES: usize = 8;

/// The row stride of a small head's kept attention weights when the caller lets them be padded
/// ([`super::probs_row_stride`]).
pub(super) fn padded(tk: usize) -> usize {
    tk.next_multiple_of(LANES)
}

/// Forward of head `h` (see [`super::head`]'s `forward_head`); the weights go to `p` in rows
/// `p_rs` apart: with `p_rs` the padded width the scores are computed there in place, else in
/// scratch and copied.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn forward<T: Float>(spec: &AttentionSpec, q: Heads<'_, T>, k: Heads<'_, T>, v: Heads<'_, T>, h: usize, out: &mut [T], out_off: usize, out_rs: usize, p: &mut [T], p_rs: usize, scratch: &mut Scratch<T>) {
    let AttentionSpec { tq, tk, d, dv, .. } = *spec;
    let (qo, ko, vo) = (q.offsets[h], k.offsets[h], v.offsets[h]);
    let tkp = padded(tk);
    let scale = T::from_f64_lossy(spec.scale);
    let Scratch { transposed: kt, ds: s, .. } = scratch;
    transpose_padded(k.data, ko, k.row_stride, tk, d, tkp, kt);
    let direct = p_rs == tkp;
    if !direct {
        at_least(s, QUERY_BLOCK * tkp);
    }
    for i0 in (0..tq).step_by(QUERY_BLOCK) {
        let i1 = (i0 + QUERY_BLOCK).min(tq);
        let kl = spec.key_limit(i1);
        let (rows, cols) = (i1 - i0, kl.next_multiple_of(LANES));
        let sb = if direct { &mut p[i0 * tkp..i1 * tkp] } else { &mut s[..rows * tkp] };
        // S = scale · Q[i0..i1] · Kᵀ[.., ..cols], padded rows of tkp.
        tile::matmul(rows, cols, d, sb, 0, tkp, false, Mat::new(q.data, qo + i0 * q.row_stride, q.row_stride, 1), Mat::new(kt, 0, tkp, 1), scale);
        softmax_padded(sb, tkp, cols, |r| spec.key_limit(i0 + r + 1));
        // O[i0..i1] = P[.., ..kl] · V[..kl].
        if kl == 0 {
            for r in i0..i1 {
                out[out_off + r * out_rs..out_off + r * out_rs + dv].fill(T::zero());
            }
        } else {
            tile::matmul(rows, dv, kl, out, out_off + i0 * out_rs, out_rs, false, Mat::new(sb, 0, tkp, 1), Mat::new(v.data, vo, v.row_stride, 1), T::one());
        }
        if !direct {
            for (r, row) in s.chunks_exact(tkp).take(rows).enumerate() {
                let kept = &mut p[(i0 + r) * p_rs..(i0 + r) * p_rs + tk];
                let n = cols.min(tk);
                kept[..n].copy_from_slice(&row[..n]);
                kept[n..].fill(T::zero());
            }
        }
    }
}

/// Backward of head `h` (see [`super::head`]'s `backward_head`) from weights in rows `p_rs`
/// apart, as [`forward`] wrote them; dK and dV are zero on entry.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn backward<T: Float>(spec: &AttentionSpec, q: Heads<'_, T>, k: Heads<'_, T>, v: Heads<'_, T>, h: usize, p: &[T], p_rs: usize, dout: Heads<'_, T>, grads: &mut Grads<'_, T>, scratch: &mut Scratch<T>) {
    let AttentionSpec { tq, tk, d, dv, .. } = *spec;
    let (qo, ko, vo) = (q.offsets[h], k.offsets[h], v.offsets[h]);
    let (go, g_off, g_rs) = (dout.data, dout.offsets[h], dout.row_stride);
    let tkp = padded(tk);
    let scale = T::from_f64_lossy(spec.scale);
    let Scratch { transposed: vt, ds, pp } = scratch;
    transpose_padded(v.data, vo, v.row_stride, tk, dv, tkp, vt);
    let direct = p_rs == tkp;
    at_least(ds, QUERY_BLOCK * tkp);
    if !direct {
        at_least(pp, QUERY_BLOCK * tkp);
    }
    for i0 in (0..tq).step_by(QUERY_BLOCK) {
        let i1 = (i0 + QUERY_BLOCK).min(tq);
        let kl = spec.key_limit(i1);
        let (rows, cols) = (i1 - i0, kl.next_multiple_of(LANES));
        if kl == 0 {
            let (buf, off, rs) = grads.at(Part::Q, spec);
            for r in i0..i1 {
                buf[off + r * rs..off + r * rs + d].fill(T::zero());
            }
            continue;
        }
        // The block's weights in padded rows, zero from kl to cols.
        let pb: &[T] = if direct {
            &p[i0 * tkp..i1 * tkp]
        } else {
            for (r, row) in pp.chunks_exact_mut(tkp).take(rows).enumerate() {
                let n = cols.min(tk);
                row[..n].copy_from_slice(&p[(i0 + r) * p_rs..(i0 + r) * p_rs + n]);
                row[n..cols].fill(T::zero());
            }
            &pp[..rows * tkp]
        };
        let dout_b = Mat::new(go, g_off + i0 * g_rs, g_rs, 1);
        // dV[..kl] += P[.., ..kl]ᵀ · dO[i0..i1].
        let (buf, off, rs) = grads.at(Part::V, spec);
        tile::matmul(kl, dv, rows, buf, off, rs, true, Mat::new(pb, 0, 1, tkp), dout_b, T::one());
        // dP = dO[i0..i1] · Vᵀ[.., ..cols].
        tile::matmul(rows, cols, dv, ds, 0, tkp, false, dout_b, Mat::new(vt, 0, tkp, 1), T::one());
        // dS = scale · P ⊙ (dP − Σⱼ P ⊙ dP): zero wherever P is.
        for (pr, sr) in pb.chunks_exact(tkp).zip(ds.chunks_exact_mut(tkp)).take(rows) {
            let (pr, sr) = (&pr[..cols], &mut sr[..cols]);
            let dot = dot_lanes(pr, sr);
            for (s, &pv) in sr.iter_mut().zip(pr) {
                *s = scale * pv * (*s - dot);
            }
        }
        // dQ[i0..i1] = dS[.., ..kl] · K[..kl].
        let (buf, off, rs) = grads.at(Part::Q, spec);
        tile::matmul(rows, d, kl, buf, off + i0 * rs, rs, false, Mat::new(ds, 0, tkp, 1), Mat::new(k.data, ko, k.row_stride, 1), T::one());
        // dK[..kl] += dS[.., ..kl]ᵀ · Q[i0..i1].
        let (buf, off, rs) = grads.at(Part::K, spec);
        tile::matmul(kl, d, rows, buf, off, rs, true, Mat::new(ds, 0, 1, tkp), Mat::new(q.data, qo + i0 * q.row_stride, q.row_stride, 1), T::one());
    }
}

/// Grows `buf` to at least `len` elements (scratch whose every read element is written first).
#[inline(always)]
fn at_least<T: Float>(buf: &mut Vec<T>, len: usize) {
    if buf.len() < len {
        buf.resize(len, T::zero());
    }
}

/// Softmax in place of each padded row (`tkp` apart) of a block of scores, over its first
/// `seen(r)` entries, zeros after them up to `cols` (a multiple of [`LANES`]); all zeros when
/// `seen` is 0. Max and sum in eight fixed lanes, `exp` is [`Float::fast_exp`], and the −∞
/// written past `seen` comes out as exact zeros. The exps run as one loop over the whole block
/// (many independent vectors, where a row alone is a few long dependency chains); entries
/// past `cols` hold whatever was there and are not to be read.
#[inline(always)]
fn softmax_padded<T: Float>(s: &mut [T], tkp: usize, cols: usize, seen: impl Fn(usize) -> usize) {
    for (r, row) in s.chunks_exact_mut(tkp).enumerate() {
        let row = &mut row[..cols];
        let seen = seen(r).min(cols);
        row[seen..].fill(T::neg_infinity());
        let max = max_lanes(row);
        let max = if max.is_finite() { max } else { T::zero() };
        row.iter_mut().for_each(|x| *x = *x - max);
    }
    s.iter_mut().for_each(|x| *x = x.fast_exp());
    for (r, row) in s.chunks_exact_mut(tkp).enumerate() {
        let row = &mut row[..cols];
        if seen(r) == 0 {
            row.fill(T::zero());
            continue;
        }
        let inv = T::one() / crate::reduce::sum(row);
        row.iter_mut().for_each(|x| *x = *x * inv);
    }
}

/// `out[c·cols_p + j] = src[off + j·rs + c]` for `j < rows`, `c < width`, and zero for
/// `rows ≤ j < cols_p` (a head's `[rows, width]` block, transposed, rows padded to `cols_p`).
#[inline(always)]
fn transpose_padded<T: Float>(src: &[T], off: usize, rs: usize, rows: usize, width: usize, cols_p: usize, out: &mut Vec<T>) {
    // The padding columns are never written, so a buffer of the same shape keeps its zeros.
    if out.len() != width * cols_p {
        out.clear();
        out.resize(width * cols_p, T::zero());
    }
    for j in 0..rows {
        let row = &src[off + j * rs..off + j * rs + width];
        for (c, &x) in row.iter().enumerate() {
            out[c * cols_p + j] = x;
        }
    }
}
