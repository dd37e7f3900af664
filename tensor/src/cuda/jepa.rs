//! The device side of what a JEPA step needs beyond a transformer's ops: the latent regression
//! losses with their backward ([`latent_loss`]: the mean of `(pred − target)²`, which
//! `Tensor::mse` runs on the device, or of smooth L1), the collapse monitor ([`feature_std`]) and
//! the EMA of a target encoder in one launch ([`ema_update`]). The loss is an f32 scalar on the
//! device whatever the inputs' dtype; its backward reads the incoming gradient on the device.

use rtx_kernels::cuda::{EmaPair, LatentLoss};
use rtx_kernels::DType;

use super::ops::cast;
use super::{dense, device, device_of, tensor_from, DeviceData, GpuFloat};
use crate::error::{Error, Result};
use crate::tensor::Tensor;


/// A dense (offset 0, contiguous, whole storage) form of `x`, copying only a view.
fn densified(x: &Tensor) -> Result<Tensor> {
    let l = x.layout();
    if l.is_contiguous() && l.offset() == 0 && x.storage().len() == x.numel() {
        Ok(x.clone())
    } else {
        super::views::contiguous(x)
    }
}

/// The mean over all elements of `l(pred − target)` as an f32 scalar on the device, with the
/// gradient to both operands (`−dpred` for the target).
pub(crate) fn latent_loss(pred: &Tensor, target: &Tensor, kind: LatentLoss) -> Result<Tensor> {
    const OP: &str = "latent_loss";
    if pred.shape() != target.shape() {
        return Err(Error::ShapeMismatch { op: OP, lhs: pred.shape().to_vec(), rhs: target.shape().to_vec() });
    }
    if pred.device() != target.device() {
        return Err(Error::DeviceMismatch { op: OP, lhs: pred.device(), rhs: target.device() });
    }
    if pred.dtype() != target.dtype() {
        return Err(Error::DTypeMismatch { op: OP, lhs: pred.dtype(), rhs: target.dtype() });
    }
    dispatch!(OP, pred.dtype(), latent_loss_t(pred, target, kind))
}

fn latent_loss_t<T: GpuFloat>(pred: &Tensor, target: &Tensor, kind: LatentLoss) -> Result<Tensor> {
    const OP: &str = "latent_loss";
    let (ordinal, dev) = device_of(OP, pred)?;
    let (p, t) = (densified(pred)?, densified(target)?);
    let mut loss = dev.alloc::<f32>(1)?;
    dev.latent_loss(&*dense::<T>(OP, &p)?, &*dense::<T>(OP, &t)?, kind, &mut loss)?;
    let (want_pred, want_target) = (pred.is_requires_grad(), target.is_requires_grad());
    let (pd, td, shape) = (p.detach(), t.detach(), pred.shape().to_vec());
    let y = tensor_from(ordinal, DeviceData::F32(loss), &[]);
    Ok(Tensor::with_node(y.storage().clone(), y.layout().clone(), DType::F32, OP, &[pred, target], move |g: &Tensor, _: &Tensor| {
        let dev = device(ordinal)?;
        let g = if g.dtype() == DType::F32 { g.clone() } else { cast(g, DType::F32)? };
        let mut dp = dev.alloc::<T>(pd.numel())?;
        dev.latent_loss_backward(&*dense::<T>(OP, &pd)?, &*dense::<T>(OP, &td)?, &*dense::<f32>(OP, &g)?, kind, &mut dp)?;
        let dp = tensor_from(ordinal, T::wrap(dp), &shape);
        let dt = if want_target { Some(dp.mul_scalar(-1.0)?) } else { None };
        Ok(vec![want_pred.then_some(dp), dt])
    }))
}

/// The collapse monitor of `z [B, K, C]` on the device: the mean over features of the unbiased
/// standard deviation over the batch of each image's token-mean feature (what the host computes
/// as `z.mean([1]).var([0], unbiased).sqrt().mean_all()`); 0 when `B < 2`. Waits for the device.
pub(crate) fn feature_std(z: &Tensor) -> Result<f64> {
    const OP: &str = "feature_std";
    if z.rank() != 3 {
        return Err(Error::BadShape { op: OP, shape: z.shape().to_vec(), reason: "expected [B, K, C]".into() });
    }
    dispatch!(OP, z.dtype(), feature_std_t(z))
}

fn feature_std_t<T: GpuFloat>(z: &Tensor) -> Result<f64> {
    const OP: &str = "feature_std";
    let (ordinal, dev) = device_of(OP, z)?;
    let z = densified(&z.detach())?;
    let (b, k, c) = (z.shape()[0], z.shape()[1], z.shape()[2]);
    let mut out = dev.alloc::<f32>(1)?;
    dev.feature_std(&*dense::<T>(OP, &z)?, b, k, c, &mut out)?;
    tensor_from(ordinal, DeviceData::F32(out), &[]).item()
}

/// `target = m·target + (1 − m)·source` for every pair, in one launch: the targets f32 device
/// tensors (the EMA state), the sources f32 or bf16 on the same device, all dense. `one_minus_m`
/// is passed as the host computes it (`(1 − m)` in f64 rounded to f32), so an f32 EMA here equals
/// the host's bit for bit. Outside autograd.
pub(crate) fn ema_update(targets: &[Tensor], sources: &[Tensor], m: f32, one_minus_m: f32) -> Result<()> {
    const OP: &str = "ema_update";
    let (Some(first_t), Some(first_s)) = (targets.first(), sources.first()) else { return Ok(()) };
    if targets.len() != sources.len() {
        return Err(Error::InvalidArgument { op: OP, reason: format!("{} targets, {} sources", targets.len(), sources.len()) });
    }
    let (_, dev) = device_of(OP, first_t)?;
    for (t, s) in targets.iter().zip(sources) {
        if t.shape() != s.shape() {
            return Err(Error::ShapeMismatch { op: OP, lhs: t.shape().to_vec(), rhs: s.shape().to_vec() });
        }
        if t.device() != first_t.device() || s.device() != first_t.device() {
            return Err(Error::DeviceMismatch { op: OP, lhs: first_t.device(), rhs: if t.device() != first_t.device() { t.device() } else { s.device() } });
        }
        if t.dtype() != DType::F32 || s.dtype() != first_s.dtype() {
            return Err(Error::InvalidArgument { op: OP, reason: format!("targets must be f32 and sources of one dtype (got a {:?} target, a {:?} source)", t.dtype(), s.dtype()) });
        }
        let l = t.layout();
        if !l.is_contiguous() || l.offset() != 0 || t.storage().len() != t.numel() {
            return Err(Error::NotContiguous { op: OP, shape: t.shape().to_vec(), strides: l.strides().to_vec() });
        }
    }
    let sources: Vec<Tensor> = sources.iter().map(|s| densified(&s.detach())).collect::<Result<_>>()?;
    let mut guards = Vec::with_capacity(targets.len());
    for t in targets {
        guards.push(t.storage().write_cuda(OP)?);
    }
    let reads: Vec<_> = sources.iter().map(|s| s.storage().read_cuda(OP)).collect::<Result<_>>()?;
    match first_s.dtype() {
        DType::F32 => {
            let mut pairs = Vec::with_capacity(guards.len());
            for (g, r) in guards.iter_mut().zip(&reads) {
                match (&mut **g, &**r) {
                    (DeviceData::F32(t), DeviceData::F32(s)) => pairs.push(EmaPair { target: t, source: s }),
                    (t, s) => return Err(Error::DTypeMismatch { op: OP, lhs: t.dtype(), rhs: s.dtype() }),
                }
            }
            dev.ema_multi(&mut pairs, m, one_minus_m)?;
        }
        DType::BF16 => {
            let mut pairs = Vec::with_capacity(guards.len());
            for (g, r) in guards.iter_mut().zip(&reads) {
                match (&mut **g, &**r) {
                    (DeviceData::F32(t), DeviceData::BF16(s)) => pairs.push(EmaPair { target: t, source: s }),
                    (t, s) => return Err(Error::DTypeMismatch { op: OP, lhs: t.dtype(), rhs: s.dtype() }),
                }
            }
            dev.ema_multi(&mut pairs, m, one_minus_m)?;
        }
        other => return Err(Error::UnsupportedDType { op: OP, dtype: other }),
    }
    Ok(())
}
