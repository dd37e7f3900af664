//! One head of attention, forward and backward, blocked over queries: the products through
//! `gemm` (heads up to [`SMALL_HEAD`] wide go to [`super::small`] instead), the softmax of each
//! score row and the score gradient. Each head is compiled a second time for
//! AVX2+FMA ([`crate::simd`]) and writes its outputs at any offset and row stride, so a caller can
//! put them straight into an interleaved layout.

use super::small;
use super::tile::{Mat, SMALL_HEAD};
use super::{AttentionSpec, Heads, QUERY_BLOCK};
use crate::float::Float;
use crate::simd::dispatch;

/// Buffers a thread reuses from head to head.
pub(super) struct Scratch<T> {
    /// `Kᵀ` (forward) or `Vᵀ` (backward) of a small head, `[width, padded tk]`.
    pub(super) transposed: Vec<T>,
    /// The score gradient of one query block (the scores, in a small head's forward).
    pub(super) ds: Vec<T>,
    /// A small head's attention weights of one query block, padded rows.
    pub(super) pp: Vec<T>,
}

impl<T> Scratch<T> {
    pub(super) fn new() -> Self {
        Scratch { transposed: Vec::new(), ds: Vec::new(), pp: Vec::new() }
    }
}

/// Where one head's gradients go.
pub(super) enum Grads<'a, T> {
    /// Three dense buffers: dq `[tq, d]`, dk `[tk, d]`, dv `[tk, dv]`.
    Split(&'a mut [T], &'a mut [T], &'a mut [T]),
    /// One buffer holding all three at their offsets, rows `row_stride` apart (a packed
    /// `[T, 3, H, D]` gradient).
    Slab { data: &'a mut [T], dq: usize, dk: usize, dv: usize, row_stride: usize },
}

#[derive(Clone, Copy)]
pub(super) enum Part {
    Q,
    K,
    V,
}

impl<T> Grads<'_, T> {
    /// The buffer, offset and row stride of one gradient.
    pub(super) fn at(&mut self, part: Part, spec: &AttentionSpec) -> (&mut [T], usize, usize) {
        match self {
            Grads::Split(dq, dk, dv) => match part {
                Part::Q => (&mut **dq, 0, spec.d),
                Part::K => (&mut **dk, 0, spec.d),
                Part::V => (&mut **dv, 0, spec.dv),
            },
            Grads::Slab { data, dq, dk, dv, row_stride } => {
                let off = match part {
                    Part::Q => *dq,
                    Part::K => *dk,
                    Part::V => *dv,
                };
                (&mut **data, off, *row_stride)
            }
        }
    }
}

/// Forward of head `h`: its output rows to `out[out_off + i·out_rs ..][..dv]`, its attention
/// weights to `p` in rows `p_rs` apart (`[tq, tk]`, zero where masked, when `p_rs` is `tk`; see
/// [`super::probs_row_stride`]). Heads up to [`SMALL_HEAD`] wide take [`super::small`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn forward_body<T: Float>(spec: &AttentionSpec, q: Heads<'_, T>, k: Heads<'_, T>, v: Heads<'_, T>, h: usize, out: &mut [T], out_off: usize, out_rs: usize, p: &mut [T], p_rs: usize, scratch: &mut Scratch<T>) {
    if spec.d <= SMALL_HEAD && spec.dv <= SMALL_HEAD {
        return small::forward(spec, q, k, v, h, out, out_off, out_rs, p, p_rs, scratch);
    }
    let AttentionSpec { tq, tk, d, dv, .. } = *spec;
    let (qo, ko, vo) = (q.offsets[h], k.offsets[h], v.offsets[h]);
    let scale = T::from_f64_lossy(spec.scale);
    for i0 in (0..tq).step_by(QUERY_BLOCK) {
        let i1 = (i0 + QUERY_BLOCK).min(tq);
        let kl = spec.key_limit(i1);
        let rows = i1 - i0;
        // S = scale · Q[i0..i1] · K[..kl]ᵀ into the probs rows.
        let qb = Mat::new(q.data, qo + i0 * q.row_stride, q.row_stride, 1);
        gemm_serial(rows, kl, d, p, i0 * tk, tk, false, qb, Mat::new(k.data, ko, 1, k.row_stride), scale);
        for (r, row) in p[i0 * tk..i1 * tk].chunks_exact_mut(tk).enumerate() {
            softmax_prefix(row, spec.key_limit(i0 + r + 1));
        }
        // O[i0..i1] = P[i0..i1, ..kl] · V[..kl].
        if kl == 0 {
            for r in i0..i1 {
                out[out_off + r * out_rs..out_off + r * out_rs + dv].fill(T::zero());
            }
        } else {
            gemm_serial(rows, dv, kl, out, out_off + i0 * out_rs, out_rs, false, Mat::new(p, i0 * tk, tk, 1), Mat::new(v.data, vo, v.row_stride, 1), T::one());
        }
    }
}

dispatch! {
    pub(super) fn forward_head[T](spec: &AttentionSpec, q: Heads<'_, T>, k: Heads<'_, T>, v: Heads<'_, T>, h: usize, out: &mut [T], out_off: usize, out_rs: usize, p: &mut [T], p_rs: usize, scratch: &mut Scratch<T>) = forward_body where [T: Float];
}

/// Backward of head `h` from its attention weights `p` (rows `p_rs` apart, as the forward wrote
/// them) and output gradient `dout`. dK and dV accumulate over the query blocks: the caller
/// zeroes them (a whole buffer at once, not row by row).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn backward_body<T: Float>(spec: &AttentionSpec, q: Heads<'_, T>, k: Heads<'_, T>, v: Heads<'_, T>, h: usize, p: &[T], p_rs: usize, dout: Heads<'_, T>, grads: &mut Grads<'_, T>, scratch: &mut Scratch<T>) {
    let AttentionSpec { tq, tk, d, dv, .. } = *spec;
    if d <= SMALL_HEAD && dv <= SMALL_HEAD {
        return small::backward(spec, q, k, v, h, p, p_rs, dout, grads, scratch);
    }
    let (qo, ko, vo) = (q.offsets[h], k.offsets[h], v.offsets[h]);
    let (go, g_off, g_rs) = (dout.data, dout.offsets[h], dout.row_stride);
    let scale = T::from_f64_lossy(spec.scale);
    let ds = &mut scratch.ds;
    ds.resize(QUERY_BLOCK * tk, T::zero());
    for i0 in (0..tq).step_by(QUERY_BLOCK) {
        let i1 = (i0 + QUERY_BLOCK).min(tq);
        let kl = spec.key_limit(i1);
        let rows = i1 - i0;
        if kl == 0 {
            let (buf, off, rs) = grads.at(Part::Q, spec);
            for r in i0..i1 {
                buf[off + r * rs..off + r * rs + d].fill(T::zero());
            }
            continue;
        }
        let dout_b = Mat::new(go, g_off + i0 * g_rs, g_rs, 1);
        // dV[..kl] += P[i0..i1, ..kl]ᵀ · dO[i0..i1].
        let (buf, off, rs) = grads.at(Part::V, spec);
        gemm_serial(kl, dv, rows, buf, off, rs, true, Mat::new(p, i0 * tk, 1, tk), dout_b, T::one());
        // dP = dO[i0..i1] · V[..kl]ᵀ.
        gemm_serial(rows, kl, dv, ds, 0, tk, false, dout_b, Mat::new(v.data, vo, 1, v.row_stride), T::one());
        // dS = scale · P ⊙ (dP − Σⱼ P ⊙ dP), row by row.
        for (pr, sr) in p[i0 * tk..i1 * tk].chunks_exact(tk).zip(ds.chunks_exact_mut(tk)) {
            let (pr, sr) = (&pr[..kl], &mut sr[..kl]);
            let dot = dot_lanes(pr, sr);
            for (s, &pv) in sr.iter_mut().zip(pr) {
                *s = scale * pv * (*s - dot);
            }
        }
        // dQ[i0..i1] = dS · K[..kl].
        let (buf, off, rs) = grads.at(Part::Q, spec);
        gemm_serial(rows, d, kl, buf, off + i0 * rs, rs, false, Mat::new(ds, 0, tk, 1), Mat::new(k.data, ko, k.row_stride, 1), T::one());
        // dK[..kl] += dSᵀ · Q[i0..i1].
        let (buf, off, rs) = grads.at(Part::K, spec);
        gemm_serial(kl, d, rows, buf, off, rs, true, Mat::new(ds, 0, 1, tk), Mat::new(q.data, qo + i0 * q.row_stride, q.row_stride, 1), T::one());
    }
}

dispatch! {
    pub(super) fn backward_head[T](spec: &AttentionSpec, q: Heads<'_, T>, k: Heads<'_, T>, v: Heads<'_, T>, h: usize, p: &[T], p_rs: usize, dout: Heads<'_, T>, grads: &mut Grads<'_, T>, scratch: &mut Scratch<T>) = backward_body where [T: Float];
}

/// In place on one score row: softmax over the first `seen` entries, zeros after them; all
/// zeros when `seen` is 0. The maximum and the sum run in eight fixed lanes; `exp` is
/// [`Float::fast_exp`].
#[inline(always)]
fn softmax_prefix<T: Float>(row: &mut [T], seen: usize) {
    let (live, dead) = row.split_at_mut(seen);
    dead.fill(T::zero());
    if live.is_empty() {
        return;
    }
    let max = max_lanes(live);
    let max = if max.is_finite() { max } else { T::zero() };
    for x in live.iter_mut() {
        *x = (*x - max).fast_exp();
    }
    let inv = T::one() / crate::reduce::sum(live);
    for x in live.iter_mut() {
        *x = *x * inv;
    }
}

/// The largest element (−∞ for none; NaNs are skipped, and the row's exps then carry them).
#[inline(always)]
pub(super) fn max_lanes<T: Float>(a: &[T]) -> T {
    let mut lanes = [T::neg_infinity(); 8];
    let chunks = a.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            lanes[l] = if c[l] > lanes[l] { c[l] } else { lanes[l] };
        }
    }
    let mut m = lanes.iter().fold(T::neg_infinity(), |m, &x| if x > m { x } else { m });
    for &x in rest {
        m = if x > m { x } else { m };
    }
    m
}

/// Σ a ⊙ b in eight fixed lanes (vectorizes; the order is fixed, so it is deterministic).
#[inline(always)]
pub(super) fn dot_lanes<T: Float>(a: &[T], b: &[T]) -> T {
    debug_assert_eq!(a.len(), b.len());
    let mut lanes = [T::zero(); 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            lanes[l] = lanes[l] + x[l] * y[l];
        }
    }
    let mut s = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for (&x, &y) in ra.iter().zip(rb) {
        s = s + x * y;
    }
    s
}

/// `dst[dst_off + i·dst_rs + j] (=|+=) beta · Σ_p lhs(i, p) · rhs(p, j)` through `gemm`, on
/// this thread. Panics (a bug in this module) when an operand reaches past its slice.
#[allow(clippy::too_many_arguments)]
fn gemm_serial<T: Float>(m: usize, n: usize, k: usize, dst: &mut [T], dst_off: usize, dst_rs: usize, accumulate: bool, lhs: Mat<'_, T>, rhs: Mat<'_, T>, beta: T) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(dst.len() >= dst_off + (m - 1) * dst_rs + n, "attention gemm: dst too short");
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                dst[dst_off + r * dst_rs..dst_off + r * dst_rs + n].fill(T::zero());
            }
        }
        return;
    }
    assert!(lhs.fits(m, k) && rhs.fits(k, n), "attention gemm: operand too short");
    // SAFETY: the asserts above bound every index gemm touches in the three slices, and `dst`
    // is borrowed mutably so it aliases neither operand.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr().add(dst_off),
            1,
            dst_rs as isize,
            accumulate,
            lhs.data.as_ptr().add(lhs.offset),
            lhs.col_stride as isize,
            lhs.row_stride as isize,
            rhs.data.as_ptr().add(rhs.offset),
            rhs.col_stride as isize,
            rhs.row_stride as isize,
            T::one(),
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}
