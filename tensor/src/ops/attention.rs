//! Scaled dot-product attention, `softmax(q·kᵀ·scale, masked)·v`: two batched matmuls (the
//! first on a transposed view of k, which costs no copy) around one fused op that scales, masks
//! and softmaxes each score row in a single pass, with its own backward
//! `dx = scale · y ⊙ (dy − Σ dy ⊙ y)`. Without a user mask, when q, k and v are f32/f64 with the
//! same batch dims (multi-head attention), the fused kernel `rtx_kernels::attention` runs instead:
//! per head, blocked over queries, skipping the causally masked key blocks, with no `[.., Tq, Tk]`
//! score tensor between ops; the composed path stays the reference for masks and broadcasting.
//!
//! Mask convention (as the boolean `attn_mask` of `torch.nn.functional.scaled_dot_product_attention`):
//! a u32 mask broadcastable to `[.., Tq, Tk]` whose **non-zero entries attend** and whose zeros are
//! masked out. `causal` additionally masks key `j > i` for query `i` (top-left aligned, as
//! PyTorch's `is_causal`). Both combine into one mask built once per call at the mask's own
//! (unbroadcast) shape, `[Tq, Tk]` for a causal mask, and every batch of scores reads its block
//! through an index map instead of a broadcast copy. A query row with every key masked out
//! yields zeros and a zero gradient (as PyTorch's math backend since 2.5), never NaN.

use super::{check_float, check_same};
use crate::error::{Error, Result};
use crate::layout::{broadcast_shape, contiguous_strides};
use crate::ops::binary::compute_form;
use crate::ops::norm::{with_two_slices, Compute};
use crate::tensor::{Element, Tensor};
use rayon::prelude::*;
use rtx_kernels::attention::{self, AttentionSpec, Heads};
use rtx_kernels::threading::should_parallelize;
use rtx_kernels::{DType, Float};

impl Tensor {
    /// Attention of queries `q [.., Tq, D]` over keys `k [.., Tk, D]` and values `v [.., Tk, Dv]`
    /// (batch dims broadcast) giving `[.., Tq, Dv]`. `mask` is u32, non-zero = attend (see the
    /// module docs); `causal` masks keys after the query's position; `scale` defaults to
    /// `1/sqrt(D)`.
    pub fn scaled_dot_product_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>, causal: bool, scale: Option<f64>) -> Result<Tensor> {
        const OP: &str = "scaled_dot_product_attention";
        check_float(OP, q)?;
        check_same(OP, q, k)?;
        check_same(OP, q, v)?;
        for t in [q, k, v] {
            if t.rank() < 2 {
                return Err(Error::BadShape { op: OP, shape: t.shape().to_vec(), reason: "q, k and v need at least 2 dims ([.., T, D])".into() });
            }
        }
        let last_two = |t: &Tensor| (t.shape()[t.rank() - 2], t.shape()[t.rank() - 1]);
        let batch_of = |t: &Tensor| t.shape()[..t.rank() - 2].to_vec();
        let ((tq, d), (tk, dk), (tv, _)) = (last_two(q), last_two(k), last_two(v));
        if d != dk {
            return Err(Error::ShapeMismatch { op: OP, lhs: q.shape().to_vec(), rhs: k.shape().to_vec() });
        }
        if tk != tv {
            return Err(Error::ShapeMismatch { op: OP, lhs: k.shape().to_vec(), rhs: v.shape().to_vec() });
        }
        let qk_batch = broadcast_shape(OP, &batch_of(q), &batch_of(k)).map_err(|_| Error::ShapeMismatch { op: OP, lhs: q.shape().to_vec(), rhs: k.shape().to_vec() })?;
        broadcast_shape(OP, &qk_batch, &batch_of(v)).map_err(|_| Error::ShapeMismatch { op: OP, lhs: q.shape().to_vec(), rhs: v.shape().to_vec() })?;
        let mut scores_shape = qk_batch;
        scores_shape.extend_from_slice(&[tq, tk]);
        let scale = scale.unwrap_or_else(|| 1.0 / (d.max(1) as f64).sqrt());
        if !scale.is_finite() {
            return Err(Error::InvalidArgument { op: OP, reason: format!("scale {scale} is not finite") });
        }
        if mask.is_none() && matches!(q.dtype(), DType::F32 | DType::F64) && batch_of(q) == batch_of(k) && batch_of(q) == batch_of(v) {
            return if q.dtype() == DType::F64 { fused::<f64>(q, k, v, causal, scale) } else { fused::<f32>(q, k, v, causal, scale) };
        }
        let plan = mask_plan(OP, mask, causal, &scores_shape)?;

        let scores = q.matmul(&k.transpose(-2, -1)?)?;
        debug_assert_eq!(scores.shape(), scores_shape.as_slice());
        let probs = if q.dtype() == DType::F64 { masked_softmax::<f64>(&scores, plan, scale)? } else { masked_softmax::<f32>(&scores, plan, scale)? };
        probs.matmul(v)
    }
}

impl Tensor {
    /// Multi-head self-attention on a packed projection: `qkv` is `[B, T, 3·C]` holding, per
    /// position, the queries, keys and values of all `n_heads` heads (`C = n_heads · D`, the
    /// layout of one `[C → 3C]` linear layer); returns `[B, T, C]` with the heads side by side,
    /// ready for the output projection. The same as splitting `qkv` into `[B, H, T, D]` views,
    /// calling [`Tensor::scaled_dot_product_attention`] and merging the heads back, but one op:
    /// its gradient is written straight into `[B, T, 3·C]`, with no per-view zero-padded
    /// gradients to sum. f32/f64; other dtypes take the composed path.
    #[allow(clippy::manual_is_multiple_of, reason = "is_multiple_of needs Rust 1.87; the workspace says 1.85")]
    pub fn scaled_dot_product_attention_packed(qkv: &Tensor, n_heads: usize, causal: bool, scale: Option<f64>) -> Result<Tensor> {
        const OP: &str = "scaled_dot_product_attention_packed";
        check_float(OP, qkv)?;
        if qkv.rank() != 3 || n_heads == 0 || qkv.shape()[2] % (3 * n_heads) != 0 {
            return Err(Error::BadShape { op: OP, shape: qkv.shape().to_vec(), reason: format!("expected [B, T, 3·C] with C a multiple of {n_heads} heads") });
        }
        let (b, t, c) = (qkv.shape()[0], qkv.shape()[1], qkv.shape()[2] / 3);
        let d = c / n_heads;
        if let Some(device) = crate::backend::of(&[qkv]) {
            let scale = scale.unwrap_or_else(|| 1.0 / (d.max(1) as f64).sqrt());
            return device.attention_packed(qkv, n_heads, causal, scale);
        }
        if !matches!(qkv.dtype(), DType::F32 | DType::F64) {
            let split = qkv.reshape(&[b, t, 3, n_heads, d])?.permute(&[2, 0, 3, 1, 4])?;
            let part = |i: usize| split.narrow(0, i, 1)?.squeeze(0);
            let y = Tensor::scaled_dot_product_attention(&part(0)?, &part(1)?, &part(2)?, None, causal, scale)?;
            return y.transpose(1, 2)?.reshape(&[b, t, c]);
        }
        let scale = scale.unwrap_or_else(|| 1.0 / (d.max(1) as f64).sqrt());
        if !scale.is_finite() {
            return Err(Error::InvalidArgument { op: OP, reason: format!("scale {scale} is not finite") });
        }
        let qkv = qkv.contiguous()?;
        if qkv.dtype() == DType::F64 {
            packed::<f64>(&qkv, b, t, n_heads, d, causal, scale)
        } else {
            packed::<f32>(&qkv, b, t, n_heads, d, causal, scale)
        }
    }
}

/// [`Tensor::scaled_dot_product_attention_packed`] on a contiguous f32/f64 `qkv`.
fn packed<T: Compute + Element>(qkv: &Tensor, b: usize, t: usize, h: usize, d: usize, causal: bool, scale: f64) -> Result<Tensor> {
    const OP: &str = "scaled_dot_product_attention_packed";
    let c = h * d;
    let spec = AttentionSpec { tq: t, tk: t, d, dv: d, causal, scale };
    let base = qkv.layout().offset();
    let len = b * t * 3 * c;
    // The kernel writes [B, T, H, D] (= [B, T, C]) and, in backward, [B, T, 3, H, D] directly.
    let mut out = crate::pool::take::<T>(b * t * c);
    let probs_len = attention::packed_probs_len(&spec, b, h);
    let mut probs = crate::pool::take::<T>(probs_len);
    {
        let data = qkv.storage().read()?;
        let x = T::slice(&data).ok_or(Error::UnsupportedDType { op: OP, dtype: qkv.dtype() })?;
        attention::attention_forward_packed(spec, &x[base..base + len], b, h, &mut out, &mut probs)?;
    }
    let probs = Tensor::from_vec(probs, &[probs_len])?;
    let dtype = qkv.dtype();
    let x = qkv.detach();
    Tensor::from_op(T::wrap(out), &[b, t, c], dtype, OP, &[qkv], move |g: &Tensor, _: &Tensor| {
        let g = compute_form(g)?;
        let mut dqkv = crate::pool::take::<T>(len);
        g.with_float_slice(|gs| -> Result<()> {
            let gs = T::pick(gs).ok_or(Error::DTypeMismatch { op: OP, lhs: dtype, rhs: g.dtype() })?;
            let data = x.storage().read()?;
            let sp = probs.storage().read()?;
            let (Some(xs), Some(ps)) = (T::slice(&data), T::slice(&sp)) else {
                return Err(Error::UnsupportedDType { op: OP, dtype });
            };
            attention::attention_backward_packed(spec, &xs[base..base + len], b, h, ps, gs, &mut dqkv)?;
            Ok(())
        })??;
        Ok(vec![Some(Tensor::from_data(T::wrap(dqkv).into_data(dtype), &[b, t, 3 * c])?)])
    })
}

/// The fused path (`rtx_kernels::attention`): no user mask, one dtype, equal batch dims. Rows
/// need unit column stride; an operand without it is made contiguous first.
fn fused<T: Compute + Element>(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool, scale: f64) -> Result<Tensor> {
    const OP: &str = "scaled_dot_product_attention";
    let unit_cols = |t: &Tensor| -> Result<Tensor> { if t.layout().strides()[t.rank() - 1] == 1 || t.shape()[t.rank() - 1] <= 1 { Ok(t.clone()) } else { t.contiguous() } };
    let (q, k, v) = (unit_cols(q)?, unit_cols(k)?, unit_cols(v)?);
    let rank = q.rank();
    let batch = q.shape()[..rank - 2].to_vec();
    let (tq, d) = (q.shape()[rank - 2], q.shape()[rank - 1]);
    let (tk, dv) = (k.shape()[rank - 2], v.shape()[rank - 1]);
    let spec = AttentionSpec { tq, tk, d, dv, causal, scale };
    let (qh, kh, vh) = (HeadLayout::of(&q), HeadLayout::of(&k), HeadLayout::of(&v));
    let n_heads = qh.offsets.len();
    let mut out = crate::pool::take::<T>(n_heads * tq * dv);
    let mut probs = crate::pool::take::<T>(n_heads * tq * tk);
    {
        let (dq, dk, dvd) = (q.storage().read()?, k.storage().read()?, v.storage().read()?);
        let (sq, sk, sv) = (T::slice(&dq), T::slice(&dk), T::slice(&dvd));
        let (Some(sq), Some(sk), Some(sv)) = (sq, sk, sv) else {
            return Err(Error::UnsupportedDType { op: OP, dtype: q.dtype() });
        };
        attention::attention_forward(spec, qh.heads(sq), kh.heads(sk), vh.heads(sv), &mut out, &mut probs)?;
    }
    let probs = Tensor::from_vec(probs, &[n_heads * tq * tk])?;
    let mut shape = batch;
    shape.extend_from_slice(&[tq, dv]);
    let dtype = q.dtype();
    let (qd, kd, vd) = (q.detach(), k.detach(), v.detach());
    Tensor::from_op(T::wrap(out), &shape, dtype, OP, &[&q, &k, &v], move |g: &Tensor, _: &Tensor| {
        let mut dq = crate::pool::take::<T>(n_heads * tq * d);
        let mut dk = crate::pool::take::<T>(n_heads * tk * d);
        let mut dvv = crate::pool::take::<T>(n_heads * tk * dv);
        let g = compute_form(g)?;
        g.with_float_slice(|gs| -> Result<()> {
            let gs = T::pick(gs).ok_or(Error::DTypeMismatch { op: OP, lhs: dtype, rhs: g.dtype() })?;
            let (sq, sk, sv, sp) = (qd.storage().read()?, kd.storage().read()?, vd.storage().read()?, probs.storage().read()?);
            let (Some(sq), Some(sk), Some(sv), Some(sp)) = (T::slice(&sq), T::slice(&sk), T::slice(&sv), T::slice(&sp)) else {
                return Err(Error::UnsupportedDType { op: OP, dtype });
            };
            let g_offsets: Vec<usize> = (0..n_heads).map(|h| h * tq * dv).collect();
            let gh = Heads { data: gs, offsets: &g_offsets, row_stride: dv };
            attention::attention_backward(spec, qh.heads(sq), kh.heads(sk), vh.heads(sv), sp, gh, &mut dq, &mut dk, &mut dvv)?;
            Ok(())
        })??;
        let grad = |v: Vec<T>, like: &Tensor| Tensor::from_data(T::wrap(v).into_data(dtype), like.shape());
        Ok(vec![Some(grad(dq, &qd)?), Some(grad(dk, &kd)?), Some(grad(dvv, &vd)?)])
    })
}

/// Where each `[T, D]` block of a tensor starts and how far apart its rows are.
struct HeadLayout {
    offsets: Vec<usize>,
    row_stride: usize,
}

impl HeadLayout {
    fn of(t: &Tensor) -> HeadLayout {
        let l = t.layout();
        let rank = l.rank();
        let batch = &l.shape()[..rank - 2];
        let n: usize = batch.iter().product();
        let offsets = (0..n)
            .map(|mut idx| {
                let mut off = l.offset();
                for dim in (0..batch.len()).rev() {
                    off += (idx % batch[dim]) * l.strides()[dim];
                    idx /= batch[dim];
                }
                off
            })
            .collect();
        HeadLayout { offsets, row_stride: l.strides()[rank - 2] }
    }

    fn heads<'a, T>(&'a self, data: &'a [T]) -> Heads<'a, T> {
        Heads { data, offsets: &self.offsets, row_stride: self.row_stride }
    }
}

/// Which scores one attention call masks out.
struct MaskPlan {
    /// Rows of `Tk` flags, `true` = masked out, at the mask's own shape `[M.., Tq, Tk]`.
    drop: Vec<bool>,
    /// For each `[Tq, Tk]` block of the scores (row-major over their batch dims), the index of
    /// the mask block it reads (the broadcast of `M..` to the scores' batch dims).
    block_of: Vec<usize>,
    tq: usize,
    tk: usize,
}

impl MaskPlan {
    /// The mask row of scores row `r`.
    fn row(&self, r: usize) -> &[bool] {
        let m = self.block_of[r / self.tq] * self.tq + r % self.tq;
        &self.drop[m * self.tk..(m + 1) * self.tk]
    }
}

/// Combines the user mask (non-zero = attend) and the causal mask into one drop mask at the
/// smallest shape that covers both; `None` when nothing is masked.
fn mask_plan(op: &'static str, mask: Option<&Tensor>, causal: bool, scores_shape: &[usize]) -> Result<Option<MaskPlan>> {
    let rank = scores_shape.len();
    let (tq, tk) = (scores_shape[rank - 2], scores_shape[rank - 1]);
    let (shape, keep) = match mask {
        None if !causal => return Ok(None),
        None => (vec![tq, tk], None),
        Some(m) => {
            if m.dtype() != DType::U32 {
                return Err(Error::DTypeMismatch { op, lhs: m.dtype(), rhs: DType::U32 });
            }
            let mismatch = || Error::ShapeMismatch { op, lhs: scores_shape.to_vec(), rhs: m.shape().to_vec() };
            let shape = broadcast_shape(op, m.shape(), &[tq, tk]).map_err(|_| mismatch())?;
            if broadcast_shape(op, scores_shape, &shape).map_err(|_| mismatch())? != scores_shape {
                return Err(mismatch());
            }
            let keep = m.broadcast_to(&shape)?.to_u32_vec()?;
            (shape, Some(keep))
        }
    };
    let numel: usize = shape.iter().product();
    let drop: Vec<bool> = (0..numel)
        .map(|e| {
            let (i, j) = ((e / tk) % tq, e % tk);
            keep.as_ref().is_some_and(|kv| kv[e] == 0) || (causal && j > i)
        })
        .collect();
    let block_of = block_map(&scores_shape[..rank - 2], &shape[..shape.len() - 2]);
    Ok(Some(MaskPlan { drop, block_of, tq, tk }))
}

/// For every block index over `batch` (row-major), the block index over `mask_batch` that
/// broadcasting maps it to (`mask_batch` right-aligned, size-1 dims repeated).
fn block_map(batch: &[usize], mask_batch: &[usize]) -> Vec<usize> {
    debug_assert!(mask_batch.len() <= batch.len());
    let n: usize = batch.iter().product();
    let lead = batch.len() - mask_batch.len();
    let strides = contiguous_strides(mask_batch);
    (0..n)
        .map(|mut idx| {
            let mut block = 0;
            for d in (0..batch.len()).rev() {
                let c = idx % batch[d];
                idx /= batch[d];
                if d >= lead && mask_batch[d - lead] != 1 {
                    block += c * strides[d - lead];
                }
            }
            block
        })
        .collect()
}

/// `softmax(scale · scores)` over the last dim with the plan's entries at −∞ and fully masked
/// rows set to zero, recording its backward.
fn masked_softmax<T: Compute>(scores: &Tensor, plan: Option<MaskPlan>, scale: f64) -> Result<Tensor> {
    const OP: &str = "scaled_dot_product_attention";
    let tk = scores.shape()[scores.rank() - 1];
    let sc = T::from_f64_lossy(scale);
    let values = scores.with_float_slice(|s| {
        T::pick(s).map(|x| {
            let mut out = crate::pool::take::<T>(x.len());
            let plan = plan.as_ref();
            for_rows(tk, &mut out, |r, dst| masked_softmax_row(&x[r * tk..(r + 1) * tk], plan.map(|p| p.row(r)), sc, dst));
            out
        })
    })?;
    let values = values.ok_or(Error::UnsupportedDType { op: OP, dtype: scores.dtype() })?;
    let dtype = scores.dtype();
    Tensor::from_op(T::wrap(values), scores.shape(), dtype, OP, &[scores], move |g: &Tensor, y: &Tensor| {
        let y = compute_form(y)?;
        let dx = with_two_slices::<T, _>(OP, &y, g, |ys, gs| {
            let mut dx = crate::pool::take::<T>(ys.len());
            for_rows(tk, &mut dx, |r, dst| {
                let (yr, gr) = (&ys[r * tk..(r + 1) * tk], &gs[r * tk..(r + 1) * tk]);
                let dot = yr.iter().zip(gr).fold(T::zero(), |a, (&p, &q)| a + p * q);
                for ((o, &p), &q) in dst.iter_mut().zip(yr).zip(gr) {
                    *o = sc * p * (q - dot);
                }
            });
            dx
        })?;
        Ok(vec![Some(Tensor::from_data(T::wrap(dx).into_data(dtype), y.shape())?)])
    })
}

/// Runs `f(row_index, row)` over the rows of `n` of `dst`, on the pool when large (rows are
/// independent, so the split never changes results).
fn for_rows<T: Float>(n: usize, dst: &mut [T], f: impl Fn(usize, &mut [T]) + Sync + Send) {
    if n == 0 {
        return;
    }
    if should_parallelize(dst.len()) {
        dst.par_chunks_mut(n).enumerate().for_each(|(r, row)| f(r, row));
    } else {
        dst.chunks_mut(n).enumerate().for_each(|(r, row)| f(r, row));
    }
}

/// One row: `dst = softmax(scale · src)` with `drop`ped entries excluded; zeros when every
/// entry is dropped.
fn masked_softmax_row<T: Float>(src: &[T], drop: Option<&[bool]>, scale: T, dst: &mut [T]) {
    debug_assert_eq!(src.len(), dst.len());
    let mut max = T::neg_infinity();
    for (j, (o, &x)) in dst.iter_mut().zip(src).enumerate() {
        *o = if drop.is_some_and(|d| d[j]) { T::neg_infinity() } else { x * scale };
        if *o > max {
            max = *o;
        }
    }
    if max == T::neg_infinity() {
        dst.fill(T::zero());
        return;
    }
    let mut sum = T::zero();
    for o in dst.iter_mut() {
        *o = (*o - max).exp();
        sum = sum + *o;
    }
    let inv = T::one() / sum;
    for o in dst.iter_mut() {
        *o = *o * inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Generator;

    /// Reference attention computed element by element in f64.
    #[allow(clippy::too_many_arguments)]
    fn naive(q: &[f64], k: &[f64], v: &[f64], tq: usize, tk: usize, d: usize, dv: usize, allowed: impl Fn(usize, usize) -> bool) -> Vec<f64> {
        let mut out = vec![0.0; tq * dv];
        for i in 0..tq {
            let s: Vec<f64> = (0..tk).map(|j| if allowed(i, j) { (0..d).map(|c| q[i * d + c] * k[j * d + c]).sum::<f64>() / (d as f64).sqrt() } else { f64::NEG_INFINITY }).collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            if m == f64::NEG_INFINITY {
                continue;
            }
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for (j, w) in e.iter().enumerate() {
                for c in 0..dv {
                    out[i * dv + c] += w / z * v[j * dv + c];
                }
            }
        }
        out
    }

    #[test]
    fn matches_naive_attention_with_causal_and_padding_masks() {
        let mut g = Generator::new(11);
        let (tq, tk, d, dv) = (3, 4, 2, 3);
        let q = Tensor::randn(&[tq, d], 0.0, 1.0, DType::F64, &mut g).unwrap();
        let k = Tensor::randn(&[tk, d], 0.0, 1.0, DType::F64, &mut g).unwrap();
        let v = Tensor::randn(&[tk, dv], 0.0, 1.0, DType::F64, &mut g).unwrap();
        let (qv, kv, vv) = (q.to_f64_vec().unwrap(), k.to_f64_vec().unwrap(), v.to_f64_vec().unwrap());
        let close = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-12);

        let plain = Tensor::scaled_dot_product_attention(&q, &k, &v, None, false, None).unwrap();
        assert!(close(&plain.to_f64_vec().unwrap(), &naive(&qv, &kv, &vv, tq, tk, d, dv, |_, _| true)));
        let causal = Tensor::scaled_dot_product_attention(&q, &k, &v, None, true, None).unwrap();
        assert!(close(&causal.to_f64_vec().unwrap(), &naive(&qv, &kv, &vv, tq, tk, d, dv, |i, j| j <= i)));
        // Key padding mask [Tk]: the last key is padding; row 0 of a causal call still sees key 0.
        let pad = Tensor::from_vec(vec![1u32, 1, 1, 0], &[tk]).unwrap();
        let both = Tensor::scaled_dot_product_attention(&q, &k, &v, Some(&pad), true, None).unwrap();
        assert!(close(&both.to_f64_vec().unwrap(), &naive(&qv, &kv, &vv, tq, tk, d, dv, |i, j| j <= i && j < 3)));
    }

    /// Output and q/k/v gradients of `Σ sdpa(q, k, v) ⊙ w`, through the fused path (no mask) or
    /// the composed one (an all-ones mask).
    fn sdpa_and_grads(q: &Tensor, k: &Tensor, v: &Tensor, w: &Tensor, causal: bool, composed: bool) -> Vec<Vec<f64>> {
        let (q, k, v) = (q.detach().requires_grad(true), k.detach().requires_grad(true), v.detach().requires_grad(true));
        let rank = q.rank();
        let ones = Tensor::ones(&[q.shape()[rank - 2], k.shape()[rank - 2]], DType::F32).ne(&Tensor::zeros(&[], DType::F32)).unwrap();
        let out = Tensor::scaled_dot_product_attention(&q, &k, &v, composed.then_some(&ones), causal, None).unwrap();
        out.mul(w).unwrap().sum_all().unwrap().backward().unwrap();
        vec![out.to_f64_vec().unwrap(), q.grad().unwrap().to_f64_vec().unwrap(), k.grad().unwrap().to_f64_vec().unwrap(), v.grad().unwrap().to_f64_vec().unwrap()]
    }

    #[test]
    fn fused_path_matches_composed_path_forward_and_backward() {
        let mut g = Generator::new(21);
        for dtype in [DType::F64, DType::F32] {
            let tol = if dtype == DType::F64 { 1e-12 } else { 2e-5 };
            for &(tq, tk, d, dv) in &[(37usize, 45usize, 5usize, 7usize), (45, 37, 3, 2), (64, 64, 16, 16), (1, 3, 1, 1), (33, 33, 8, 8)] {
                for causal in [false, true] {
                    let q = Tensor::randn(&[2, 3, tq, d], 0.0, 1.0, dtype, &mut g).unwrap();
                    let k = Tensor::randn(&[2, 3, tk, d], 0.0, 1.0, dtype, &mut g).unwrap();
                    let v = Tensor::randn(&[2, 3, tk, dv], 0.0, 1.0, dtype, &mut g).unwrap();
                    let w = Tensor::randn(&[2, 3, tq, dv], 0.0, 1.0, dtype, &mut g).unwrap();
                    let fused = sdpa_and_grads(&q, &k, &v, &w, causal, false);
                    let composed = sdpa_and_grads(&q, &k, &v, &w, causal, true);
                    for (what, (a, b)) in ["out", "dq", "dk", "dv"].iter().zip(fused.iter().zip(&composed)) {
                        assert_eq!(a.len(), b.len());
                        let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs() / (1.0 + y.abs())).fold(0.0, f64::max);
                        assert!(worst < tol, "{what} {dtype} {tq}x{tk}x{d}x{dv} causal {causal}: {worst}");
                    }
                }
            }
        }
    }

    #[test]
    fn packed_attention_matches_split_views_forward_and_backward() {
        let mut g = Generator::new(22);
        for dtype in [DType::F64, DType::F32] {
            let tol = if dtype == DType::F64 { 1e-12 } else { 2e-5 };
            for &(b, t, h, d) in &[(2usize, 37usize, 3usize, 5usize), (1, 64, 4, 16), (3, 1, 1, 1), (2, 33, 2, 8)] {
                for causal in [false, true] {
                    let x = Tensor::randn(&[b, t, 3 * h * d], 0.0, 1.0, dtype, &mut g).unwrap();
                    let w = Tensor::randn(&[b, t, h * d], 0.0, 1.0, dtype, &mut g).unwrap();
                    let run = |packed: bool| -> Vec<Vec<f64>> {
                        let x = x.detach().requires_grad(true);
                        let y = if packed {
                            Tensor::scaled_dot_product_attention_packed(&x, h, causal, None).unwrap()
                        } else {
                            let s = x.reshape(&[b, t, 3, h, d]).unwrap().permute(&[2, 0, 3, 1, 4]).unwrap();
                            let part = |i: usize| s.narrow(0, i, 1).unwrap().squeeze(0).unwrap();
                            let ones = Tensor::ones(&[t, t], DType::F32).ne(&Tensor::zeros(&[], DType::F32)).unwrap();
                            // The all-ones mask forces the composed (unfused) reference path.
                            let a = Tensor::scaled_dot_product_attention(&part(0), &part(1), &part(2), Some(&ones), causal, None).unwrap();
                            a.transpose(1, 2).unwrap().reshape(&[b, t, h * d]).unwrap()
                        };
                        y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
                        vec![y.to_f64_vec().unwrap(), x.grad().unwrap().to_f64_vec().unwrap()]
                    };
                    let (p, r) = (run(true), run(false));
                    for (what, (a, e)) in ["out", "dqkv"].iter().zip(p.iter().zip(&r)) {
                        assert_eq!(a.len(), e.len());
                        let worst = a.iter().zip(e).map(|(x, y)| (x - y).abs() / (1.0 + y.abs())).fold(0.0, f64::max);
                        assert!(worst < tol, "{what} {dtype} b{b} t{t} h{h} d{d} causal {causal}: {worst}");
                    }
                }
            }
        }
    }

    #[test]
    fn fully_masked_rows_give_zeros_not_nan() {
        let mut g = Generator::new(12);
        let q = Tensor::randn(&[2, 2], 0.0, 1.0, DType::F64, &mut g).unwrap().requires_grad(true);
        let k = Tensor::randn(&[3, 2], 0.0, 1.0, DType::F64, &mut g).unwrap();
        let v = Tensor::randn(&[3, 2], 0.0, 1.0, DType::F64, &mut g).unwrap();
        let mask = Tensor::from_vec(vec![0u32, 0, 0, 1, 1, 0], &[2, 3]).unwrap();
        let out = Tensor::scaled_dot_product_attention(&q, &k, &v, Some(&mask), false, None).unwrap();
        let vals = out.to_f64_vec().unwrap();
        assert_eq!(&vals[..2], &[0.0, 0.0]);
        assert!(vals.iter().all(|x| x.is_finite()));
        out.sum_all().unwrap().backward().unwrap();
        assert!(q.grad().unwrap().to_f64_vec().unwrap().iter().all(|x| x.is_finite()));
    }
}
