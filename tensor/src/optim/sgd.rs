//! [`Sgd`]: stochastic gradient descent with momentum, dampening, Nesterov momentum and L2
//! weight decay, following `torch.optim.SGD`'s single-tensor path,
//!
//! every `x + a·y` a fused multiply-add, as in PyTorch's vectorised CPU kernels (results match
//! torch 2.11 on CPU bit for bit):
//!
//! ```text
//! d  ← g + λ·p                                   (when λ ≠ 0)
//! b  ← d on the first update, else b·μ + (1 − τ)·d   (when μ ≠ 0)
//! d  ← d + μ·b if nesterov, else b
//! p  ← p + (−lr)·d
//! ```

use super::{grad_for_update, has_hardware_fma, match_state, Optimizer, StateBuf, UPDATE_CHUNK};
use crate::error::{Error, Result};
use crate::tensor::{FloatSlice, Tensor};
use rayon::prelude::*;
use rtx_kernels::{DType, Float};

/// Hyperparameters of [`Sgd`] (defaults are PyTorch's, with `lr` 1e-3).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum μ (0 disables the buffer).
    pub momentum: f64,
    /// Dampening τ of the momentum update.
    pub dampening: f64,
    /// L2 penalty λ added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum (needs μ > 0 and τ = 0).
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig { lr: 1e-3, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false }
    }
}

/// SGD over a fixed list of named parameters.
#[derive(Debug)]
pub struct Sgd {
    config: SgdConfig,
    slots: Vec<Slot>,
}

#[derive(Debug)]
struct Slot {
    name: String,
    param: Tensor,
    weight_decay: f64,
    momentum_buffer: Option<StateBuf>,
    step: u64,
}

#[derive(Clone, Copy)]
struct Scalars<T> {
    weight_decay: T,
    has_decay: bool,
    momentum: T,
    one_minus_dampening: T,
    first: bool,
    nesterov: bool,
    neg_lr: T,
}

impl Sgd {
    /// SGD applying `config.weight_decay` to every parameter.
    pub fn new(params: Vec<(String, Tensor)>, config: SgdConfig) -> Result<Sgd> {
        Self::with_decay_filter(params, config, |_, _| true)
    }

    /// SGD applying weight decay only where `decay(name, param)` holds.
    pub fn with_decay_filter(params: Vec<(String, Tensor)>, config: SgdConfig, decay: impl Fn(&str, &Tensor) -> bool) -> Result<Sgd> {
        let c = config;
        let ok = c.lr >= 0.0 && c.lr.is_finite() && c.momentum >= 0.0 && c.momentum.is_finite() && c.weight_decay >= 0.0 && c.weight_decay.is_finite() && c.dampening.is_finite();
        if !ok {
            return Err(Error::InvalidArgument { op: "Sgd", reason: format!("invalid hyperparameters {c:?}") });
        }
        if c.nesterov && (c.momentum <= 0.0 || c.dampening != 0.0) {
            return Err(Error::InvalidArgument { op: "Sgd", reason: "Nesterov momentum requires a momentum and zero dampening".into() });
        }
        let mut names = std::collections::BTreeSet::new();
        let mut slots = Vec::with_capacity(params.len());
        for (name, param) in params {
            if !param.dtype().is_float() {
                return Err(Error::UnsupportedDType { op: "Sgd", dtype: param.dtype() });
            }
            if !param.is_contiguous() {
                return Err(Error::NotContiguous { op: "Sgd", shape: param.shape().to_vec(), strides: param.layout().strides().to_vec() });
            }
            if !names.insert(name.clone()) {
                return Err(Error::InvalidArgument { op: "Sgd", reason: format!("parameter name {name} appears twice") });
            }
            let weight_decay = if decay(&name, &param) { c.weight_decay } else { 0.0 };
            let momentum_buffer = (c.momentum != 0.0).then(|| StateBuf::zeros_for(&param));
            slots.push(Slot { name, param, weight_decay, momentum_buffer, step: 0 });
        }
        Ok(Sgd { config, slots })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &SgdConfig {
        &self.config
    }
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        let c = self.config;
        for slot in &mut self.slots {
            let Some(grad) = grad_for_update("Sgd", &slot.param)? else { continue };
            let s = Scalars {
                weight_decay: slot.weight_decay,
                has_decay: slot.weight_decay != 0.0,
                momentum: c.momentum,
                one_minus_dampening: 1.0 - c.dampening,
                first: slot.step == 0,
                nesterov: c.nesterov,
                neg_lr: -c.lr,
            };
            let param = &slot.param;
            grad.with_float_slice(|g| match (g, slot.momentum_buffer.as_mut()) {
                (FloatSlice::F32(g), Some(StateBuf::F32(b))) => param.update_f32_(|p| update(p, g, Some(b), s.cast())),
                (FloatSlice::F32(g), None) => param.update_f32_(|p| update(p, g, None, s.cast())),
                (FloatSlice::F64(g), Some(StateBuf::F64(b))) => param.update_(|_| {}, |p| update(p, g, Some(b), s.cast())),
                (FloatSlice::F64(g), None) => param.update_(|_| {}, |p| update(p, g, None, s.cast())),
                _ => Err(Error::DTypeMismatch { op: "Sgd", lhs: param.dtype(), rhs: grad.dtype() }),
            })??;
            slot.step += 1;
        }
        Ok(())
    }

    fn zero_grad(&self) -> Result<()> {
        self.slots.iter().try_for_each(|s| s.param.zero_grad())
    }

    fn lr(&self) -> f64 {
        self.config.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    fn kind(&self) -> &'static str {
        "sgd"
    }

    fn parameters(&self) -> Vec<(String, Tensor)> {
        self.slots.iter().map(|s| (s.name.clone(), s.param.clone())).collect()
    }

    /// With momentum: `<name>.momentum_buffer` and `<name>.step` per parameter (the buffer is
    /// all zeros and unused until the first update, where PyTorch has `None`). Without
    /// momentum SGD has no state.
    fn state_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for s in &self.slots {
            if let Some(b) = &s.momentum_buffer {
                out.push((format!("{}.momentum_buffer", s.name), b.to_tensor(s.param.shape())?));
                out.push((format!("{}.step", s.name), Tensor::scalar(s.step as f64, DType::F64)));
            }
        }
        Ok(out)
    }

    fn load_state(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        let expected = self.state_tensors()?;
        let given = match_state(&expected, state)?;
        let mut loaded = Vec::new();
        let mut k = 0;
        for s in &self.slots {
            if let Some(b) = &s.momentum_buffer {
                let step = given[k + 1].item()?;
                if !(step >= 0.0 && step.fract() == 0.0) {
                    return Err(Error::InvalidArgument { op: "load_state", reason: format!("{}.step is {step}, not a count", s.name) });
                }
                let mut buf = b.clone();
                buf.load(&expected[k].0, given[k])?;
                loaded.push(Some((buf, step as u64)));
                k += 2;
            } else {
                loaded.push(None);
            }
        }
        for (s, l) in self.slots.iter_mut().zip(loaded) {
            if let Some((buf, step)) = l {
                s.momentum_buffer = Some(buf);
                s.step = step;
            }
        }
        Ok(())
    }
}

impl Scalars<f64> {
    fn cast<T: Float>(self) -> Scalars<T> {
        let c = T::from_f64_lossy;
        Scalars {
            weight_decay: c(self.weight_decay),
            has_decay: self.has_decay,
            momentum: c(self.momentum),
            one_minus_dampening: c(self.one_minus_dampening),
            first: self.first,
            nesterov: self.nesterov,
            neg_lr: c(self.neg_lr),
        }
    }
}

fn update<T: Float>(p: &mut [T], g: &[T], buf: Option<&mut Vec<T>>, s: Scalars<T>) {
    match buf {
        Some(b) => p.par_chunks_mut(UPDATE_CHUNK).zip(g.par_chunks(UPDATE_CHUNK)).zip(b.par_chunks_mut(UPDATE_CHUNK)).for_each(|((p, g), b)| dispatch(p, g, Some(b), s)),
        None => p.par_chunks_mut(UPDATE_CHUNK).zip(g.par_chunks(UPDATE_CHUNK)).for_each(|(p, g)| dispatch(p, g, None, s)),
    }
}

fn dispatch<T: Float>(p: &mut [T], g: &[T], buf: Option<&mut [T]>, s: Scalars<T>) {
    #[cfg(target_arch = "x86_64")]
    if has_hardware_fma() {
        // SAFETY: the CPU has FMA (checked just above), the only requirement of calling a
        // `target_feature(enable = "fma")` function.
        unsafe { update_chunk_fma(p, g, buf, s) };
        return;
    }
    update_chunk(p, g, buf, s);
}

/// [`update_chunk`] compiled with FMA instructions.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn update_chunk_fma<T: Float>(p: &mut [T], g: &[T], buf: Option<&mut [T]>, s: Scalars<T>) {
    update_chunk(p, g, buf, s);
}

/// One chunk. PyTorch's `add(x, alpha=a)` is a fused multiply-add in its vectorised CPU kernel,
/// so every `+ a·x` here is a `mul_add`; results match torch 2.11 on CPU bit for bit.
#[inline(always)]
fn update_chunk<T: Float>(p: &mut [T], g: &[T], mut buf: Option<&mut [T]>, s: Scalars<T>) {
    for i in 0..p.len() {
        let mut d = g[i];
        if s.has_decay {
            d = p[i].mul_add(s.weight_decay, d);
        }
        if let Some(b) = buf.as_deref_mut() {
            b[i] = if s.first { d } else { d.mul_add(s.one_minus_dampening, b[i] * s.momentum) };
            d = if s.nesterov { b[i].mul_add(s.momentum, d) } else { b[i] };
        }
        p[i] = d.mul_add(s.neg_lr, p[i]);
    }
}
