//! Scaled dot-product attention, `softmax(q·kᵀ·scale, masked)·v`: two batched matmuls (the
//! first on a transposed view of k, which costs no copy) around one fused op that scales, masks
//! and softmaxes each score row in a single pass, with its own backward
//! `dx = scale · y ⊙ (dy − Σ dy ⊙ y)`.
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
use crate::tensor::Tensor;
use rayon::prelude::*;
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
        let plan = mask_plan(OP, mask, causal, &scores_shape)?;

        let scores = q.matmul(&k.transpose(-2, -1)?)?;
        debug_assert_eq!(scores.shape(), scores_shape.as_slice());
        let probs = if q.dtype() == DType::F64 { masked_softmax::<f64>(&scores, plan, scale)? } else { masked_softmax::<f32>(&scores, plan, scale)? };
        probs.matmul(v)
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
            let mut out = vec![T::zero(); x.len()];
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
            let mut dx = vec![T::zero(); ys.len()];
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
