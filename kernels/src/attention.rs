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
//! needs no copy). Outputs are contiguous.

use crate::error::{check_len, product, Error, Result};
use crate::float::Float;
use crate::simd::dispatch;
use crate::threading::should_parallelize;
use rayon::prelude::*;

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
    let scale = T::from_f64_lossy(spec.scale);
    let head = |h: usize, o: &mut [T], p: &mut [T]| {
        let (qo, ko, vo) = (q.offsets[h], k.offsets[h], v.offsets[h]);
        for i0 in (0..tq).step_by(QUERY_BLOCK) {
            let i1 = (i0 + QUERY_BLOCK).min(tq);
            let kl = spec.key_limit(i1);
            let rows = i1 - i0;
            // S = scale · Q[i0..i1] · K[..kl]ᵀ into the probs rows.
            gemm_serial(rows, kl, d, &mut p[i0 * tk..], tk, false, q.data, qo + i0 * q.row_stride, q.row_stride, 1, k.data, ko, 1, k.row_stride, scale);
            softmax_rows(&spec, i0, &mut p[i0 * tk..i1 * tk]);
            // O[i0..i1] = P[i0..i1, ..kl] · V[..kl].
            if kl == 0 {
                o[i0 * dv..i1 * dv].fill(T::zero());
            } else {
                gemm_serial(rows, dv, kl, &mut o[i0 * dv..], dv, false, p, i0 * tk, tk, 1, v.data, vo, v.row_stride, 1, T::one());
            }
        }
    };
    let work = n_heads * tq * tk * (d + dv);
    if n_heads > 1 && should_parallelize(work) {
        out.par_chunks_mut(tq * dv).zip(probs.par_chunks_mut(tq * tk)).take(n_heads).enumerate().for_each(|(h, (o, p))| head(h, o, p));
    } else {
        out.chunks_mut(tq * dv).zip(probs.chunks_mut(tq * tk)).take(n_heads).enumerate().for_each(|(h, (o, p))| head(h, o, p));
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
    if dout.offsets.len() != n_heads {
        return Err(Error::BufferTooSmall { op: OP, buffer: "dout offsets", needed: n_heads, actual: dout.offsets.len() });
    }
    if tq > 0 && dv > 0 {
        let needed = dout.offsets.iter().map(|&o| o.saturating_add((tq - 1).saturating_mul(dout.row_stride)).saturating_add(dv)).max().unwrap_or(0);
        check_len(OP, "dout", dout.data, needed)?;
    }
    check_len(OP, "dq", dq, product(&[n_heads, tq, d]))?;
    check_len(OP, "dk", dk, product(&[n_heads, tk, d]))?;
    check_len(OP, "dv", dv_out, product(&[n_heads, tk, dv]))?;
    if n_heads == 0 {
        return Ok(());
    }
    dk[..n_heads * tk * d].fill(T::zero());
    dv_out[..n_heads * tk * dv].fill(T::zero());
    if tq == 0 {
        return Ok(());
    }
    let scale = T::from_f64_lossy(spec.scale);
    let head = |h: usize, dq: &mut [T], dk: &mut [T], dvh: &mut [T], ds: &mut Vec<T>| {
        let (qo, ko, vo) = (q.offsets[h], k.offsets[h], v.offsets[h]);
        let p = &probs[h * tq * tk..(h + 1) * tq * tk];
        let (go, g_off, g_rs) = (dout.data, dout.offsets[h], dout.row_stride);
        ds.resize(QUERY_BLOCK * tk, T::zero());
        for i0 in (0..tq).step_by(QUERY_BLOCK) {
            let i1 = (i0 + QUERY_BLOCK).min(tq);
            let kl = spec.key_limit(i1);
            let rows = i1 - i0;
            if kl == 0 {
                dq[i0 * d..i1 * d].fill(T::zero());
                continue;
            }
            // dV[..kl] += P[i0..i1, ..kl]ᵀ · dO[i0..i1].
            gemm_serial(kl, dv, rows, dvh, dv, true, p, i0 * tk, 1, tk, go, g_off + i0 * g_rs, g_rs, 1, T::one());
            // dP = dO[i0..i1] · V[..kl]ᵀ.
            gemm_serial(rows, kl, dv, ds, tk, false, go, g_off + i0 * g_rs, g_rs, 1, v.data, vo, 1, v.row_stride, T::one());
            // dS = scale · P ⊙ (dP − Σⱼ P ⊙ dP), row by row.
            score_grad_rows(&p[i0 * tk..i1 * tk], tk, kl, scale, &mut ds[..rows * tk]);
            // dQ[i0..i1] = dS · K[..kl].
            gemm_serial(rows, d, kl, &mut dq[i0 * d..], d, false, ds, 0, tk, 1, k.data, ko, k.row_stride, 1, T::one());
            // dK[..kl] += dSᵀ · Q[i0..i1].
            gemm_serial(kl, d, rows, dk, d, true, ds, 0, 1, tk, q.data, qo + i0 * q.row_stride, q.row_stride, 1, T::one());
        }
    };
    let work = n_heads * tq * tk * (d + dv);
    let dq = &mut dq[..n_heads * tq * d];
    let dk = &mut dk[..n_heads * tk * d];
    let dv_out = &mut dv_out[..n_heads * tk * dv];
    if n_heads > 1 && should_parallelize(work) {
        dq.par_chunks_mut(tq * d)
            .zip(dk.par_chunks_mut(tk * d).zip(dv_out.par_chunks_mut(tk * dv)))
            .enumerate()
            .for_each_init(Vec::new, |ds, (h, (a, (b, c)))| head(h, a, b, c, ds));
    } else {
        let mut ds = Vec::new();
        for (h, (a, (b, c))) in dq.chunks_mut(tq * d).zip(dk.chunks_mut(tk * d).zip(dv_out.chunks_mut(tk * dv))).enumerate() {
            head(h, a, b, c, &mut ds);
        }
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

/// Softmax of the score rows `i0..` held in `p` (whole rows of `tk`), each over the keys it
/// sees ([`softmax_prefix`]).
#[inline(always)]
fn softmax_rows_body<T: Float>(spec: &AttentionSpec, i0: usize, p: &mut [T]) {
    for (r, row) in p.chunks_exact_mut(spec.tk).enumerate() {
        softmax_prefix(row, spec.key_limit(i0 + r + 1));
    }
}

dispatch! {
    fn softmax_rows[T](spec: &AttentionSpec, i0: usize, p: &mut [T]) = softmax_rows_body where [T: Float];
}

/// `dS = scale · P ⊙ (dP − Σⱼ P ⊙ dP)` in place on the first `kl` columns of each row of `ds`
/// (rows of `tk`, as `p`).
#[inline(always)]
fn score_grad_rows_body<T: Float>(p: &[T], tk: usize, kl: usize, scale: T, ds: &mut [T]) {
    for (pr, sr) in p.chunks_exact(tk).zip(ds.chunks_exact_mut(tk)) {
        let (pr, sr) = (&pr[..kl], &mut sr[..kl]);
        let dot = dot_lanes(pr, sr);
        for (s, &pv) in sr.iter_mut().zip(pr) {
            *s = scale * pv * (*s - dot);
        }
    }
}

dispatch! {
    fn score_grad_rows[T](p: &[T], tk: usize, kl: usize, scale: T, ds: &mut [T]) = score_grad_rows_body where [T: Float];
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
    let sum = dot_lanes_sum(live);
    let inv = T::one() / sum;
    for x in live.iter_mut() {
        *x = *x * inv;
    }
}

/// The largest element (−∞ for none; NaNs are skipped unless all are NaN, which gives −∞ too,
/// and the row's exps then carry the NaN).
#[inline(always)]
fn max_lanes<T: Float>(a: &[T]) -> T {
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
fn dot_lanes<T: Float>(a: &[T], b: &[T]) -> T {
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

/// Σ a in eight fixed lanes.
#[inline(always)]
fn dot_lanes_sum<T: Float>(a: &[T]) -> T {
    crate::reduce::sum(a)
}

/// `dst[m×n] (row stride dst_rs) (=|+=) beta · lhs[m×k] · rhs[k×n]`, on this thread.
///
/// `lhs` is read at `lhs_off + i·lhs_rs + p·lhs_cs`, `rhs` at `rhs_off + p·rhs_rs + j·rhs_cs`.
/// Panics (a bug in this module) when an operand reaches past its slice.
#[allow(clippy::too_many_arguments)]
fn gemm_serial<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [T],
    dst_rs: usize,
    accumulate: bool,
    lhs: &[T],
    lhs_off: usize,
    lhs_rs: usize,
    lhs_cs: usize,
    rhs: &[T],
    rhs_off: usize,
    rhs_rs: usize,
    rhs_cs: usize,
    beta: T,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(dst.len() >= (m - 1) * dst_rs + n, "attention gemm: dst too short");
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                dst[r * dst_rs..r * dst_rs + n].fill(T::zero());
            }
        }
        return;
    }
    assert!(lhs.len() > lhs_off + (m - 1) * lhs_rs + (k - 1) * lhs_cs, "attention gemm: lhs too short");
    assert!(rhs.len() > rhs_off + (k - 1) * rhs_rs + (n - 1) * rhs_cs, "attention gemm: rhs too short");
    // SAFETY: the asserts above bound every index gemm touches in the three slices, and `dst`
    // is borrowed mutably so it aliases neither operand.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            lhs.as_ptr().add(lhs_off),
            lhs_cs as isize,
            lhs_rs as isize,
            rhs.as_ptr().add(rhs_off),
            rhs_cs as isize,
            rhs_rs as isize,
            T::one(),
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Reference attention of one head in f64, straight from the definition.
    fn reference(spec: AttentionSpec, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let AttentionSpec { tq, tk, d, dv, causal, scale } = spec;
        let mut out = vec![0.0; tq * dv];
        let mut probs = vec![0.0; tq * tk];
        for i in 0..tq {
            let seen = if causal { (i + 1).min(tk) } else { tk };
            if seen == 0 {
                continue;
            }
            let s: Vec<f64> = (0..seen).map(|j| scale * (0..d).map(|c| q[i * d + c] * k[j * d + c]).sum::<f64>()).collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
            for j in 0..seen {
                let p = (s[j] - m).exp() / z;
                probs[i * tk + j] = p;
                for c in 0..dv {
                    out[i * dv + c] += p * v[j * dv + c];
                }
            }
        }
        (out, probs)
    }

    fn rand_vec(n: usize, seed: &mut u64) -> Vec<f64> {
        (0..n)
            .map(|_| {
                *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((*seed >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn forward_matches_reference_and_backward_matches_finite_differences() {
        let mut seed = 7u64;
        for &(tq, tk, d, dv, causal) in &[(5, 7, 3, 2, false), (7, 5, 3, 4, true), (37, 37, 8, 5, true), (33, 70, 4, 3, false), (1, 1, 1, 1, true)] {
            let spec = AttentionSpec { tq, tk, d, dv, causal, scale: 0.7 };
            let n_heads = 2;
            let (q, k, v) = (rand_vec(n_heads * tq * d, &mut seed), rand_vec(n_heads * tk * d, &mut seed), rand_vec(n_heads * tk * dv, &mut seed));
            let (q, k, v) = (q.as_slice(), k.as_slice(), v.as_slice());
            let (oq, ok, ov): (Vec<usize>, Vec<usize>, Vec<usize>) =
                ((0..n_heads).map(|h| h * tq * d).collect(), (0..n_heads).map(|h| h * tk * d).collect(), (0..n_heads).map(|h| h * tk * dv).collect());
            let qv = Heads { data: q, offsets: &oq, row_stride: d };
            let kv = Heads { data: k, offsets: &ok, row_stride: d };
            let vv = Heads { data: v, offsets: &ov, row_stride: dv };
            let mut out = vec![0.0; n_heads * tq * dv];
            let mut probs = vec![0.0; n_heads * tq * tk];
            attention_forward(spec, qv, kv, vv, &mut out, &mut probs).unwrap();
            for h in 0..n_heads {
                let (ro, rp) = reference(spec, &q[h * tq * d..(h + 1) * tq * d], &k[h * tk * d..(h + 1) * tk * d], &v[h * tk * dv..(h + 1) * tk * dv]);
                for (a, b) in out[h * tq * dv..(h + 1) * tq * dv].iter().zip(&ro) {
                    assert!((a - b).abs() < 1e-12, "out {a} vs {b} at {spec:?}");
                }
                for (a, b) in probs[h * tq * tk..(h + 1) * tq * tk].iter().zip(&rp) {
                    assert!((a - b).abs() < 1e-12, "probs {a} vs {b} at {spec:?}");
                }
            }
            // Backward against central differences of L = Σ out ⊙ w.
            let w = rand_vec(n_heads * tq * dv, &mut seed);
            let (mut dq, mut dk, mut dvv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
            let ow: Vec<usize> = (0..n_heads).map(|h| h * tq * dv).collect();
            let wv = Heads { data: w.as_slice(), offsets: &ow, row_stride: dv };
            attention_backward(spec, qv, kv, vv, &probs, wv, &mut dq, &mut dk, &mut dvv).unwrap();
            let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
                let mut total = 0.0;
                for h in 0..n_heads {
                    let (ro, _) = reference(spec, &q[h * tq * d..(h + 1) * tq * d], &k[h * tk * d..(h + 1) * tk * d], &v[h * tk * dv..(h + 1) * tk * dv]);
                    total += ro.iter().zip(&w[h * tq * dv..(h + 1) * tq * dv]).map(|(a, b)| a * b).sum::<f64>();
                }
                total
            };
            let eps = 1e-6;
            for (which, grad) in [(0, &dq), (1, &dk), (2, &dvv)] {
                let base: Vec<f64> = [q, k, v][which].to_vec();
                for idx in (0..base.len()).step_by(3) {
                    let mut plus = base.clone();
                    let mut minus = base.clone();
                    plus[idx] += eps;
                    minus[idx] -= eps;
                    let pick = |x: &[f64]| -> f64 {
                        match which {
                            0 => loss(x, k, v),
                            1 => loss(q, x, v),
                            _ => loss(q, k, x),
                        }
                    };
                    let num = (pick(&plus) - pick(&minus)) / (2.0 * eps);
                    assert!((num - grad[idx]).abs() < 1e-6, "grad {which}[{idx}]: numeric {num} vs {} at {spec:?}", grad[idx]);
                }
            }
        }
    }

    #[test]
    fn strided_heads_and_threads_do_not_change_results() {
        // Q, K, V interleaved as in a packed [T, 3, H, D] projection.
        let (t, h, d) = (40usize, 3usize, 4usize);
        let mut seed = 3u64;
        let packed: Vec<f32> = rand_vec(t * 3 * h * d, &mut seed).into_iter().map(|x| x as f32).collect();
        let rs = 3 * h * d;
        let offs = |which: usize| (0..h).map(|hh| which * h * d + hh * d).collect::<Vec<_>>();
        let (oq, ok, ov) = (offs(0), offs(1), offs(2));
        let spec = AttentionSpec { tq: t, tk: t, d, dv: d, causal: true, scale: 0.5 };
        let mk = |o: &[usize]| -> Vec<f32> {
            (0..h).flat_map(|hh| (0..t).flat_map(move |r| (0..d).map(move |c| (hh, r, c)))).map(|(hh, r, c)| packed[o[hh] + r * rs + c]).collect()
        };
        let (cq, ck, cv) = (mk(&oq), mk(&ok), mk(&ov));
        let dense: Vec<usize> = (0..h).map(|hh| hh * t * d).collect();
        let run = |qd: &[f32], qo: &[usize], kd: &[f32], ko: &[usize], vd: &[f32], vo: &[usize], stride: usize| {
            let mut out = vec![0f32; h * t * d];
            let mut probs = vec![0f32; h * t * t];
            attention_forward(
                spec,
                Heads { data: qd, offsets: qo, row_stride: stride },
                Heads { data: kd, offsets: ko, row_stride: stride },
                Heads { data: vd, offsets: vo, row_stride: stride },
                &mut out,
                &mut probs,
            )
            .unwrap();
            out
        };
        let a = run(&packed, &oq, &packed, &ok, &packed, &ov, rs);
        let b = run(&cq, &dense, &ck, &dense, &cv, &dense, d);
        assert_eq!(a, b);
    }

    #[test]
    fn wrong_lengths_are_typed_errors() {
        // Two heads of 3 rows × 2 columns, dense.
        let (tq, tk, d, n) = (3usize, 3usize, 2usize, 2usize);
        let spec = AttentionSpec { tq, tk, d, dv: d, causal: false, scale: 1.0 };
        let data = &vec![0.5f64; n * tq * d][..];
        let offs = &[0, tq * d][..];
        fn heads<'a>(data: &'a [f64], offsets: &'a [usize]) -> Heads<'a, f64> {
            Heads { data, offsets, row_stride: 2 }
        }
        let short = |op, buffer, needed, actual| Err(Error::BufferTooSmall { op, buffer, needed, actual });
        let (mut out, mut probs) = (vec![0.0; n * tq * d], vec![0.0; n * tq * tk]);
        let op = "attention_forward";
        assert_eq!(attention_forward(spec, heads(data, offs), heads(data, offs), heads(data, offs), &mut out[..11], &mut probs), short(op, "out", 12, 11));
        assert_eq!(attention_forward(spec, heads(data, offs), heads(data, offs), heads(data, offs), &mut out, &mut probs[..17]), short(op, "probs", 18, 17));
        assert_eq!(attention_forward(spec, heads(&data[..11], offs), heads(data, offs), heads(data, offs), &mut out, &mut probs), short(op, "q", 12, 11));
        assert_eq!(attention_forward(spec, heads(data, offs), heads(data, &offs[..1]), heads(data, offs), &mut out, &mut probs), short(op, "k offsets", 2, 1));
        assert_eq!(attention_forward(spec, heads(data, offs), heads(data, offs), heads(data, &[0, 7]), &mut out, &mut probs), short(op, "v", 13, 12));
        let huge = Heads { data, offsets: offs, row_stride: usize::MAX };
        assert_eq!(attention_forward(spec, heads(data, offs), huge, heads(data, offs), &mut out, &mut probs), short(op, "k", usize::MAX, 12));
        attention_forward(spec, heads(data, offs), heads(data, offs), heads(data, offs), &mut out, &mut probs).unwrap();
        let op = "attention_backward";
        let (mut dq, mut dk, mut dv) = (vec![0.0; 12], vec![0.0; 12], vec![0.0; 12]);
        let back = |probs: &[f64], dout: Heads<'_, f64>, dq: &mut [f64], dk: &mut [f64], dv: &mut [f64]| attention_backward(spec, heads(data, offs), heads(data, offs), heads(data, offs), probs, dout, dq, dk, dv);
        assert_eq!(back(&probs[..5], heads(data, offs), &mut dq, &mut dk, &mut dv), short(op, "probs", 18, 5));
        assert_eq!(back(&probs, heads(data, &offs[..1]), &mut dq, &mut dk, &mut dv), short(op, "dout offsets", 2, 1));
        assert_eq!(back(&probs, heads(&data[..10], offs), &mut dq, &mut dk, &mut dv), short(op, "dout", 12, 10));
        assert_eq!(back(&probs, heads(data, offs), &mut dq[..1], &mut dk, &mut dv), short(op, "dq", 12, 1));
        assert_eq!(back(&probs, heads(data, offs), &mut dq, &mut dk[..2], &mut dv), short(op, "dk", 12, 2));
        assert_eq!(back(&probs, heads(data, offs), &mut dq, &mut dk, &mut dv[..3]), short(op, "dv", 12, 3));
        assert_eq!(back(&probs, heads(data, offs), &mut dq, &mut dk, &mut dv), Ok(()));
    }
}
