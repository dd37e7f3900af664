//! Optimizers, learning-rate schedules, gradient clipping and flat parameter buckets.
//!
//! - [`Optimizer`]: the trait a training loop drives (`zero_grad`, backward, `step`), with
//!   `state_tensors` / `load_state` for checkpoints. [`Sgd`] and [`AdamW`] follow
//!   `torch.optim.SGD` and `torch.optim.AdamW` (single-tensor path) operation for operation.
//! - [`LrSchedule`]: [`ConstantLr`] and [`WarmupCosine`], pure functions of the step.
//! - [`clip_grad_norm`]: global L2 norm clipping as `torch.nn.utils.clip_grad_norm_`; its parts
//!   ([`sum_squares`], [`clip_coefficient`]) for gradients split over processes.
//! - [`ParamBuckets`]: moves a module's parameters and gradients into a few flat buffers so a
//!   data-parallel layer can all-reduce whole buckets in place.
//!
//! Updates run in place through [`Tensor::update_f32_`]/[`Tensor::update_`] and are never
//! recorded by autograd. Optimizer state lives in plain vectors owned by the optimizer (f32 for
//! f32 and bf16 parameters, f64 for f64 ones) and is laid out in parameter order; an optimizer
//! must be built after [`ParamBuckets::new`] so it holds the bucket views.

mod adamw;
mod buckets;
mod schedule;
mod sgd;

pub use adamw::{AdamW, AdamWConfig};
pub use buckets::{Bucket, BucketEntry, ParamBuckets};
pub use schedule::{ConstantLr, LrSchedule, WarmupCosine};
pub use sgd::{Sgd, SgdConfig};

use crate::error::{Error, Result};
use crate::tensor::{FloatSlice, Tensor};
use rayon::prelude::*;
use rtx_kernels::DType;

/// A parameter optimizer.
pub trait Optimizer {
    /// Applies one update to every parameter that has a gradient (parameters without one are
    /// skipped and their state is left as is, as PyTorch does).
    fn step(&mut self) -> Result<()>;

    /// Zeros every parameter's gradient in place (bucket-bound gradient views stay bound).
    fn zero_grad(&self) -> Result<()>;

    /// The current base learning rate.
    fn lr(&self) -> f64;

    /// Sets the base learning rate (a schedule calls this before each step).
    fn set_lr(&mut self, lr: f64);

    /// Sets the weight decay of every parameter that decays (a weight-decay schedule calls this
    /// before each step). Returns `false`, changing nothing, when the optimizer has no schedulable
    /// weight decay (the default).
    fn set_weight_decay(&mut self, weight_decay: f64) -> bool {
        let _ = weight_decay;
        false
    }

    /// A short name of the algorithm (`"sgd"`, `"adamw"`), recorded in checkpoints.
    fn kind(&self) -> &'static str;

    /// The `(name, parameter)` pairs this optimizer updates, in order.
    fn parameters(&self) -> Vec<(String, Tensor)>;

    /// The state as named tensors (copies): `<param name>.<field>` with PyTorch's field names
    /// (`exp_avg`, `exp_avg_sq`, `momentum_buffer`) and `<param name>.step` (a 0-d f64 count of
    /// updates applied to that parameter), in parameter order. The set of names and shapes
    /// depends only on the configuration and the parameters, never on how far training went.
    fn state_tensors(&self) -> Result<Vec<(String, Tensor)>>;

    /// Restores state written by [`Optimizer::state_tensors`]; every expected name must be
    /// present with the same shape and dtype, and no other name may appear.
    fn load_state(&mut self, state: &[(String, Tensor)]) -> Result<()>;
}

/// Clips gradients by their global L2 norm, as `torch.nn.utils.clip_grad_norm_`: the total norm
/// over every gradient of `params` is computed in f64 in a fixed order (parameters in order,
/// fixed 64Ki-element chunks summed in order, [`sum_squares`]), and when
/// `max_norm / (total + 1e-6) < 1` every gradient is scaled by that factor in place
/// ([`clip_coefficient`]). Returns the total norm before clipping.
/// Parameters without a gradient are skipped. A non-finite total is returned without scaling
/// anything (PyTorch would scale by NaN or 0); the caller decides whether to skip the step.
///
/// A caller whose gradients are split over several processes (ZeRO) sums each part's
/// [`sum_squares`], takes the root and scales each part by [`clip_coefficient`]: the same
/// formula, with the sum taken in another order.
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> Result<f64> {
    check_max_norm(max_norm)?;
    let grads: Vec<Tensor> = params.iter().filter_map(|p| p.grad()).collect();
    let total = sum_squares(&grads)?.sqrt();
    if let Some(coef) = clip_coefficient(total, max_norm) {
        for g in &grads {
            g.scale_(coef)?;
        }
    }
    Ok(total)
}

/// Refuses a clipping bound that is not positive and finite (what [`clip_grad_norm`] accepts).
pub fn check_max_norm(max_norm: f64) -> Result<()> {
    if max_norm.is_nan() || max_norm <= 0.0 || max_norm.is_infinite() {
        return Err(Error::InvalidArgument { op: "clip_grad_norm", reason: format!("max_norm must be positive and finite, got {max_norm}") });
    }
    Ok(())
}

/// The factor [`clip_grad_norm`] scales gradients by when their norm is `total_norm`:
/// `max_norm / (total_norm + 1e-6)` when that is below 1 and the norm is finite, else `None`
/// (nothing is scaled).
pub fn clip_coefficient(total_norm: f64, max_norm: f64) -> Option<f64> {
    let coef = max_norm / (total_norm + 1e-6);
    (total_norm.is_finite() && coef < 1.0).then_some(coef)
}

/// Σ x² over every element of `tensors`, in f64: each tensor in fixed 64Ki-element chunks
/// combined in chunk order, tensors added in order starting from 0 (independent of the thread
/// count). [`clip_grad_norm`]'s squared norm.
pub fn sum_squares(tensors: &[Tensor]) -> Result<f64> {
    let mut total_sq = 0.0f64;
    for t in tensors {
        total_sq += tensor_sum_squares(t)?;
    }
    Ok(total_sq)
}

const NORM_CHUNK: usize = 1 << 16;

/// Σ x² in f64 over fixed chunks, combined in chunk order (independent of thread count).
fn tensor_sum_squares(t: &Tensor) -> Result<f64> {
    t.with_float_slice(|s| {
        let partials: Vec<f64> = match s {
            FloatSlice::F32(x) => x.par_chunks(NORM_CHUNK).map(|c| c.iter().map(|&v| f64::from(v) * f64::from(v)).sum()).collect(),
            FloatSlice::F64(x) => x.par_chunks(NORM_CHUNK).map(|c| c.iter().map(|&v| v * v).sum()).collect(),
        };
        partials.iter().sum()
    })
}

/// Optimizer state for one parameter field, in the parameter's compute type.
#[derive(Clone, Debug)]
pub(crate) enum StateBuf {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

impl StateBuf {
    /// Zeros matching a parameter: f64 for f64 parameters, f32 otherwise.
    pub(crate) fn zeros_for(param: &Tensor) -> StateBuf {
        if param.dtype() == DType::F64 {
            StateBuf::F64(vec![0.0; param.numel()])
        } else {
            StateBuf::F32(vec![0.0; param.numel()])
        }
    }

    pub(crate) fn dtype(&self) -> DType {
        match self {
            StateBuf::F32(_) => DType::F32,
            StateBuf::F64(_) => DType::F64,
        }
    }

    /// A tensor copy in `shape`.
    pub(crate) fn to_tensor(&self, shape: &[usize]) -> Result<Tensor> {
        match self {
            StateBuf::F32(v) => Tensor::from_slice(v, shape),
            StateBuf::F64(v) => Tensor::from_slice(v, shape),
        }
    }

    /// Overwrites from a tensor of the same dtype and element count.
    pub(crate) fn load(&mut self, name: &str, t: &Tensor) -> Result<()> {
        let expected_len = match self {
            StateBuf::F32(v) => v.len(),
            StateBuf::F64(v) => v.len(),
        };
        if t.dtype() != self.dtype() || t.numel() != expected_len {
            return Err(Error::InvalidArgument { op: "load_state", reason: format!("{name}: expected {} elements of {}, got {:?} {}", expected_len, self.dtype(), t.shape(), t.dtype()) });
        }
        match self {
            StateBuf::F32(v) => *v = t.to_f32_vec()?,
            StateBuf::F64(v) => *v = t.to_f64_vec()?,
        }
        Ok(())
    }
}

/// Checks a loaded state list against the expected one (names, shapes, dtypes), returning the
/// tensors in expected order.
pub(crate) fn match_state<'a>(expected: &[(String, Tensor)], given: &'a [(String, Tensor)]) -> Result<Vec<&'a Tensor>> {
    let by_name: std::collections::BTreeMap<&str, &Tensor> = given.iter().map(|(n, t)| (n.as_str(), t)).collect();
    if by_name.len() != given.len() {
        return Err(Error::InvalidArgument { op: "load_state", reason: "duplicate state names".into() });
    }
    let mut out = Vec::with_capacity(expected.len());
    for (name, want) in expected {
        let got = by_name.get(name.as_str()).ok_or_else(|| Error::InvalidArgument { op: "load_state", reason: format!("missing optimizer state {name}") })?;
        if got.shape() != want.shape() || got.dtype() != want.dtype() {
            return Err(Error::InvalidArgument { op: "load_state", reason: format!("{name}: expected {:?} {}, got {:?} {}", want.shape(), want.dtype(), got.shape(), got.dtype()) });
        }
        out.push(*got);
    }
    if given.len() != expected.len() {
        let known: std::collections::BTreeSet<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
        if let Some((extra, _)) = given.iter().find(|(n, _)| !known.contains(n.as_str())) {
            return Err(Error::InvalidArgument { op: "load_state", reason: format!("unexpected optimizer state {extra}") });
        }
    }
    Ok(out)
}

/// A parameter's gradient in the parameter's dtype, refusing one that shares the parameter's
/// storage (its read lock would deadlock the in-place update).
pub(crate) fn grad_for_update(op: &'static str, param: &Tensor) -> Result<Option<Tensor>> {
    let Some(g) = param.grad() else { return Ok(None) };
    if g.storage().same(param.storage()) {
        return Err(Error::InvalidArgument { op, reason: "gradient shares the parameter's storage".into() });
    }
    if g.shape() != param.shape() {
        return Err(Error::ShapeMismatch { op, lhs: param.shape().to_vec(), rhs: g.shape().to_vec() });
    }
    if g.dtype() != param.dtype() {
        return Ok(Some(g.to_dtype(param.dtype())?.detach()));
    }
    Ok(Some(g))
}

/// Elements per parallel chunk of an optimizer kernel (elementwise: results do not depend on
/// the split).
pub(crate) const UPDATE_CHUNK: usize = 1 << 15;

/// Whether the CPU has fused multiply-add instructions. Kernels use `mul_add` either way (a
/// true fused multiply-add: without the instruction it is libm's `fma`, slower but
/// bit-identical), so results never depend on the machine; this only picks the fast build.
pub(crate) fn has_hardware_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}
