//! Megatron's conjugate communication ops as autograd ops, plus the vocab-parallel
//! cross-entropy.
//!
//! | op | forward | backward |
//! |---|---|---|
//! | [`copy_to_tp`] (f) | identity | all-reduce |
//! | [`reduce_from_tp`] (g) | all-reduce | identity |
//! | [`gather_from_tp`] | all-gather, last dim | own slice |
//! | [`scatter_to_tp`] | own slice, last dim | all-gather |
//! | [`gather_from_sequence`] | all-gather, dim 1 | reduce-scatter |
//! | [`reduce_scatter_to_sequence`] | reduce-scatter, dim 1 | all-gather |
//! | [`scatter_to_sequence`] | own slice, dim 1 | all-gather |
//! | [`gather_sequence_to_replicated`] | all-gather, dim 1 | own slice |
//!
//! The sequence ops serve sequence parallelism: between the tensor-parallel regions, activations
//! `[B, T, C]` are split along T (rank r holds positions `r·T/tp..`), so layer norms, dropout and
//! residual adds run on a part of the tokens each. Every op is the identity on a group of one.
//! A collective failing in a backward closure travels as [`to_tensor_error`];
//! [`crate::tp::backward`] returns it typed.
//!
//! Tensors are f32 on the host, or f32 / bf16 on a CUDA device. The group moves f32 host
//! vectors, so on a device every collective is host-staged: the operand is read to the host
//! (widened to f32), the collective runs over the host transport, and the result goes back to the
//! operand's device in its dtype ([`Placement`]). The vocab-parallel cross-entropy computes on
//! the host from the staged logits (its reductions are per row and tiny next to the GEMMs).

use rtx_tensor::{CrossEntropyOptions, DType, Device, FloatVec, Tensor};

use super::group::{to_tensor_error, TpHandle};
use super::shard::{check_f32, ShardSpec};
use crate::error::{Error, Result};
use crate::placement::Placement;

/// f: identity forward, all-reduce of the gradient backward. Put before a column-parallel
/// layer whose input is replicated, and on a replicated parameter whose uses differ per rank
/// (sequence parallelism) so its gradient is summed over the group.
pub fn copy_to_tp(x: &Tensor, group: &TpHandle) -> Result<Tensor> {
    check_staged("copy_to_tp", x)?;
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let (group, at) = (TpHandle::clone(group), Placement::of(x));
    Ok(Tensor::with_node(x.storage().clone(), x.layout().clone(), x.dtype(), "copy_to_tp", &[x], move |g: &Tensor, _: &Tensor| {
        let mut v = g.to_f32_vec()?;
        group.all_reduce_sum(&mut v).map_err(to_tensor_error)?;
        Ok(vec![Some(at.put(v, g.shape()).map_err(to_tensor_error)?)])
    }))
}

/// g: all-reduce forward, identity backward. Put after a row-parallel layer (partial sums).
pub fn reduce_from_tp(x: &Tensor, group: &TpHandle) -> Result<Tensor> {
    check_staged("reduce_from_tp", x)?;
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let mut v = x.to_f32_vec()?;
    group.all_reduce_sum(&mut v)?;
    staged_op(v, x.shape(), x, "reduce_from_tp", |g: &Tensor, _: &Tensor| Ok(vec![Some(g.clone())]))
}

/// All-gather along the last dimension (`[.., n] -> [.., n·tp]`, rank order); backward keeps
/// this rank's slice of the gradient.
pub fn gather_from_tp(x: &Tensor, group: &TpHandle) -> Result<Tensor> {
    let dim = last_dim("gather_from_tp", x)?;
    gather(x, dim, group, "gather_from_tp", false)
}

/// This rank's slice of the last dimension (`[.., n] -> [.., n/tp]`); backward all-gathers.
pub fn scatter_to_tp(x: &Tensor, group: &TpHandle) -> Result<Tensor> {
    let dim = last_dim("scatter_to_tp", x)?;
    scatter(x, dim, group, "scatter_to_tp")
}

/// Sequence parallelism, into a tensor-parallel region: all-gather `[B, T/tp, C] -> [B, T, C]`;
/// backward reduce-scatters the gradient (the region's consumers each saw all tokens and hold
/// partial gradients).
pub fn gather_from_sequence(x: &Tensor, group: &TpHandle) -> Result<Tensor> {
    check_rank3("gather_from_sequence", x)?;
    gather(x, 1, group, "gather_from_sequence", true)
}

/// Sequence parallelism, into replicated computation (pooling, a replicated head): all-gather
/// `[B, T/tp, C] -> [B, T, C]`; backward keeps this rank's positions of the (replicated)
/// gradient.
pub fn gather_sequence_to_replicated(x: &Tensor, group: &TpHandle) -> Result<Tensor> {
    check_rank3("gather_sequence_to_replicated", x)?;
    gather(x, 1, group, "gather_sequence_to_replicated", false)
}

/// Sequence parallelism, out of a tensor-parallel region: reduce-scatter the partial sums
/// `[B, T, C] -> [B, T/tp, C]`; backward all-gathers.
pub fn reduce_scatter_to_sequence(x: &Tensor, group: &TpHandle) -> Result<Tensor> {
    const OP: &str = "reduce_scatter_to_sequence";
    check_rank3(OP, x)?;
    check_staged(OP, x)?;
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let spec = split(x.shape(), 1, group.size(), "sequence length")?;
    let input = spec.to_rank_major(x)?;
    let local_shape = spec.local_shape(x.shape());
    let mut out = vec![0f32; input.len() / group.size()];
    group.reduce_scatter_sum(&input, &mut out)?;
    let (group, full_shape, at) = (TpHandle::clone(group), x.shape().to_vec(), Placement::of(x));
    staged_op(out, &local_shape, x, OP, move |g: &Tensor, _: &Tensor| {
        Ok(vec![Some(all_gather_natural(g, &spec, &full_shape, &group).and_then(|t| at.onto(t)).map_err(to_tensor_error)?)])
    })
}

/// Sequence parallelism: this rank's part of the positions, `[B, T, C] -> [B, T/tp, C]`;
/// backward all-gathers.
pub fn scatter_to_sequence(x: &Tensor, group: &TpHandle) -> Result<Tensor> {
    check_rank3("scatter_to_sequence", x)?;
    scatter(x, 1, group, "scatter_to_sequence")
}

/// Mean cross-entropy of vocabulary-parallel logits: `logits` `[N, V/tp]` holds this rank's
/// columns (vocabulary ids `rank·V/tp..`), `targets` `[N]` (u32, ids below `vocab_size`). The
/// row maximum, the sum of exponentials and the target logit are all-reduced (one max, one sum of
/// `2N` values), so no rank holds full-vocabulary logits. Backward: `(softmax_local −
/// onehot_local) · g / N`, no communication. Every rank returns the same loss.
pub fn vocab_parallel_cross_entropy(logits: &Tensor, targets: &Tensor, vocab_size: usize, group: &TpHandle) -> Result<Tensor> {
    const OP: &str = "vocab_parallel_cross_entropy";
    check_staged(OP, logits)?;
    let (tp, rank) = (group.size(), group.rank());
    if vocab_size % tp != 0 {
        return Err(Error::TpIndivisible { what: "vocab_size", value: vocab_size, tp });
    }
    let v_local = vocab_size / tp;
    if logits.rank() != 2 || logits.shape()[1] != v_local {
        return Err(Error::Tensor(rtx_tensor::Error::BadShape { op: OP, shape: logits.shape().to_vec(), reason: format!("expected [N, {v_local}] (vocab {vocab_size} over {tp} ranks)") }));
    }
    let n = logits.shape()[0];
    if targets.dtype() != DType::U32 || targets.shape() != [n] {
        return Err(Error::Tensor(rtx_tensor::Error::ShapeMismatch { op: OP, lhs: logits.shape().to_vec(), rhs: targets.shape().to_vec() }));
    }
    let t = targets.to_u32_vec()?;
    if let Some(&bad) = t.iter().find(|&&id| id as usize >= vocab_size) {
        return Err(Error::Tensor(rtx_tensor::Error::IndexOutOfRange { op: OP, index: bad as usize, size: vocab_size }));
    }
    if tp == 1 && logits.device() != Device::Cpu {
        // The whole vocabulary is here: the device's own cross-entropy, no staging.
        return Ok(logits.cross_entropy(targets, CrossEntropyOptions::default())?);
    }
    let start = rank * v_local;
    let local_target = |i: usize| (t[i] as usize).checked_sub(start).filter(|&j| j < v_local);
    let l = logits.to_f32_vec()?;
    let mut max: Vec<f32> = l.chunks(v_local.max(1)).map(|row| row.iter().copied().fold(f32::NEG_INFINITY, f32::max)).collect();
    max.resize(n, f32::NEG_INFINITY);
    group.all_reduce_max(&mut max)?;
    // One all-reduce for both sums: Σ exp(l − max) per row, then the target logit (on its owner).
    let mut sums = vec![0f32; 2 * n];
    for i in 0..n {
        let row = &l[i * v_local..(i + 1) * v_local];
        sums[i] = row.iter().map(|&x| f64::from(x - max[i]).exp()).sum::<f64>() as f32;
        sums[n + i] = local_target(i).map_or(0.0, |j| row[j] - max[i]);
    }
    group.all_reduce_sum(&mut sums)?;
    let total: f64 = (0..n).map(|i| f64::from(sums[i]).ln() - f64::from(sums[n + i])).sum();
    let loss = (total / n.max(1) as f64) as f32;
    let grad_targets: Vec<Option<usize>> = (0..n).map(local_target).collect();
    let shape = logits.shape().to_vec();
    let at = Placement::of(logits);
    // The loss is an f32 scalar where the logits live (as the device's own cross-entropy).
    let loss_at = Placement { device: at.device, dtype: DType::F32 };
    let backward = move |g: &Tensor, _: &Tensor| {
        let scale = g.item()? / n.max(1) as f64;
        let mut grad = Vec::with_capacity(l.len());
        for i in 0..n {
            let (m, inv_sum) = (max[i], 1.0 / f64::from(sums[i]));
            grad.extend(l[i * v_local..(i + 1) * v_local].iter().map(|&x| (f64::from(x - m).exp() * inv_sum * scale) as f32));
            if let Some(j) = grad_targets[i] {
                grad[i * v_local + j] -= scale as f32;
            }
        }
        Ok(vec![Some(at.put(grad, &shape).map_err(to_tensor_error)?)])
    };
    if loss_at.is_host_f32() {
        return Ok(Tensor::from_op(FloatVec::F32(vec![loss]), &[], DType::F32, OP, &[logits], backward)?);
    }
    let out = loss_at.put(vec![loss], &[])?;
    Ok(Tensor::with_node(out.storage().clone(), out.layout().clone(), DType::F32, OP, &[logits], backward))
}

/// `x [.., C]` with row `i` multiplied by `mask[i]` (one factor per row of the leading
/// dimensions); backward masks the gradient alike. On the host a plain broadcast multiply; on a
/// device (which has no multiply kernel) host-staged: the rows are read, masked and put back.
pub(crate) fn mask_rows(x: &Tensor, mask: Vec<f32>) -> Result<Tensor> {
    const OP: &str = "mask_rows";
    let width = x.shape().last().copied().unwrap_or(1).max(1);
    if mask.len() * width != x.numel() {
        return Err(Error::Tensor(rtx_tensor::Error::BadShape { op: OP, shape: x.shape().to_vec(), reason: format!("{} mask values for rows of {width}", mask.len()) }));
    }
    if x.device() == Device::Cpu {
        let mut mask_shape = x.shape().to_vec();
        if let Some(last) = mask_shape.last_mut() {
            *last = 1;
        }
        return Ok(x.mul(&Tensor::from_vec(mask, &mask_shape)?)?);
    }
    check_staged(OP, x)?;
    let apply = move |mut v: Vec<f32>, mask: &[f32]| {
        for (row, &m) in v.chunks_mut(width).zip(mask) {
            if m != 1.0 {
                row.iter_mut().for_each(|e| *e *= m);
            }
        }
        v
    };
    let masked = apply(x.to_f32_vec()?, &mask);
    let at = Placement::of(x);
    staged_op(masked, x.shape(), x, OP, move |g: &Tensor, _: &Tensor| Ok(vec![Some(at.put(apply(g.to_f32_vec()?, &mask), g.shape()).map_err(to_tensor_error)?)]))
}

/// An op's output computed on the host (`values` of `shape`), placed where `like` lives with the
/// backward node `backward`: on the host in f32 exactly `Tensor::from_op`.
fn staged_op(values: Vec<f32>, shape: &[usize], like: &Tensor, op: &'static str, backward: impl rtx_tensor::BackwardFn + 'static) -> Result<Tensor> {
    let at = Placement::of(like);
    if at.is_host_f32() {
        return Ok(Tensor::from_op(FloatVec::F32(values), shape, DType::F32, op, &[like], backward)?);
    }
    let out = at.put(values, shape)?;
    Ok(Tensor::with_node(out.storage().clone(), out.layout().clone(), at.dtype, op, &[like], backward))
}

/// Refuses tensors the staged collectives cannot carry: f32 anywhere, or bf16 on a device
/// (widened to f32 for the transfer, rounded back after it).
fn check_staged(op: &'static str, t: &Tensor) -> Result<()> {
    if t.dtype() == DType::BF16 && t.device() != Device::Cpu {
        return Ok(());
    }
    check_f32(op, t)
}

fn gather(x: &Tensor, dim: usize, group: &TpHandle, op: &'static str, reduce_scatter_backward: bool) -> Result<Tensor> {
    check_staged(op, x)?;
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let spec = ShardSpec::new(dim, group.size());
    let full_shape = spec.full_shape(x.shape());
    let at = Placement::of(x);
    let out = at.onto(all_gather_natural(x, &spec, &full_shape, group)?)?;
    let (group, local_shape) = (TpHandle::clone(group), x.shape().to_vec());
    Ok(Tensor::with_node(out.storage().clone(), out.layout().clone(), at.dtype, op, &[x], move |g: &Tensor, _: &Tensor| {
        let local = if reduce_scatter_backward {
            let input = spec.to_rank_major(g).map_err(to_tensor_error)?;
            let mut part = vec![0f32; input.len() / group.size()];
            group.reduce_scatter_sum(&input, &mut part).map_err(to_tensor_error)?;
            at.put(part, &local_shape).map_err(to_tensor_error)?
        } else {
            spec.slice(g, group.rank()).and_then(|t| at.onto(t)).map_err(to_tensor_error)?
        };
        Ok(vec![Some(local)])
    }))
}

fn scatter(x: &Tensor, dim: usize, group: &TpHandle, op: &'static str) -> Result<Tensor> {
    check_staged(op, x)?;
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let what = if dim == 1 { "sequence length" } else { "last dimension" };
    let spec = split(x.shape(), dim, group.size(), what)?;
    let at = Placement::of(x);
    let part = at.onto(spec.slice(x, group.rank())?)?;
    let (group, full_shape) = (TpHandle::clone(group), x.shape().to_vec());
    Ok(Tensor::with_node(part.storage().clone(), part.layout().clone(), at.dtype, op, &[x], move |g: &Tensor, _: &Tensor| {
        Ok(vec![Some(all_gather_natural(g, &spec, &full_shape, &group).and_then(|t| at.onto(t)).map_err(to_tensor_error)?)])
    }))
}

/// All-gathers every rank's part `local` into the full tensor of shape `full_shape`.
fn all_gather_natural(local: &Tensor, spec: &ShardSpec, full_shape: &[usize], group: &TpHandle) -> Result<Tensor> {
    let input = local.to_f32_vec()?;
    let mut gathered = vec![0f32; input.len() * group.size()];
    group.all_gather(&input, &mut gathered)?;
    spec.from_rank_major(gathered, full_shape)
}

fn split(shape: &[usize], dim: usize, parts: usize, what: &'static str) -> Result<ShardSpec> {
    let spec = ShardSpec::new(dim, parts);
    spec.check_full(what, shape)?;
    Ok(spec)
}

fn last_dim(op: &'static str, x: &Tensor) -> Result<usize> {
    if x.rank() == 0 {
        return Err(Error::Tensor(rtx_tensor::Error::BadShape { op, shape: Vec::new(), reason: "needs at least one dimension".into() }));
    }
    Ok(x.rank() - 1)
}

fn check_rank3(op: &'static str, x: &Tensor) -> Result<()> {
    if x.rank() != 3 {
        return Err(Error::Tensor(rtx_tensor::Error::BadShape { op, shape: x.shape().to_vec(), reason: "expected [B, T, C]".into() }));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tp::TpGroup;

    #[test]
    fn mask_rows_zeroes_rows_forward_and_backward() {
        // Goal: the embedding's mask keeps rows with factor 1 and zeroes the others, and its
        // backward masks the gradient alike. Method: distinct values [2, 3, 2], mask [1, 0, 1, 0, 0, 1].
        let x = Tensor::from_vec((1..=12).map(|v| v as f32).collect::<Vec<_>>(), &[3, 2, 2]).unwrap().requires_grad(true);
        let y = mask_rows(&x, vec![1.0, 0.0, 1.0, 0.0, 0.0, 1.0]).unwrap();
        assert_eq!(y.to_f32_vec().unwrap(), [1., 2., 0., 0., 5., 6., 0., 0., 0., 0., 11., 12.]);
        y.sum_all().unwrap().backward().unwrap();
        assert_eq!(x.grad().unwrap().to_f32_vec().unwrap(), [1., 1., 0., 0., 1., 1., 0., 0., 0., 0., 1., 1.]);
        let err = mask_rows(&x, vec![1.0; 5]).unwrap_err();
        assert!(err.to_string().contains("5 mask values"), "{err}");
    }

    #[test]
    fn host_bf16_is_refused_by_the_staged_ops() {
        // Goal: bf16 travels through the collectives only from a device (widened and rounded
        // back); on the host it is a typed error naming the op and dtype, as before.
        let group = TpGroup::solo().into_handle();
        let logits = Tensor::from_vec(vec![0.5f32; 8], &[2, 4]).unwrap().to_dtype(DType::BF16).unwrap();
        let targets = Tensor::from_vec(vec![1u32, 3], &[2]).unwrap();
        let err = vocab_parallel_cross_entropy(&logits, &targets, 4, &group).unwrap_err();
        assert!(matches!(err, Error::Tensor(rtx_tensor::Error::UnsupportedDType { op: "vocab_parallel_cross_entropy", dtype: DType::BF16 })), "{err}");
        assert!(matches!(reduce_from_tp(&logits, &group), Err(Error::Tensor(rtx_tensor::Error::UnsupportedDType { op: "reduce_from_tp", .. }))));
    }
}
