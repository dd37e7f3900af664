//! [`MixedAdamW`]: AdamW for parameters on a CUDA device, with f32 master weights and moments
//! on the device and one fused kernel per parameter and step (`adamw_master`: the update runs on
//! the f32 master copy and writes the parameter rounded to its dtype, bf16 or f32); a model of
//! bf16 parameters updates in one launch for all of them (`adamw_master_multi`, same bits). This is
//! mixed precision as llm.c does it: the model computes in bf16, the optimizer keeps full
//! precision, so small updates are not lost to bf16 rounding.
//!
//! The update is the same as [`crate::optim::AdamW`] (decoupled weight decay, bias correction,
//! `eps` after the square root), evaluated in f32 on the device; checkpoints carry PyTorch's
//! names (`exp_avg`, `exp_avg_sq`, `step`) plus `master` (the f32 weights).

use half::bf16;
use rtx_kernels::cuda::{AdamW as AdamWStep, AdamWTensor, Buffer, DeviceElem};
use rtx_kernels::{DType, Device};

use super::{dense, device, device_of, tensor_from, DeviceData, GpuFloat};
use crate::error::{Error, Result};
use crate::optim::{AdamWConfig, Optimizer};
use crate::tensor::Tensor;

/// One parameter's device state.
struct Slot {
    name: String,
    param: Tensor,
    ordinal: usize,
    /// Whether the decay filter chose this parameter ([`Optimizer::set_weight_decay`] changes
    /// only these).
    decays: bool,
    weight_decay: f64,
    master: Buffer<f32>,
    exp_avg: Buffer<f32>,
    exp_avg_sq: Buffer<f32>,
    step: u32,
}

/// AdamW with f32 master weights for parameters on CUDA devices. See the module docs.
pub struct MixedAdamW {
    config: AdamWConfig,
    slots: Vec<Slot>,
}

impl std::fmt::Debug for MixedAdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MixedAdamW({} parameters, {:?})", self.slots.len(), self.config)
    }
}

impl MixedAdamW {
    /// Optimizes `params` (dense f32 or bf16 tensors on CUDA devices). The master weights start
    /// from `masters` when given (the f32 values the parameters were rounded from, in the same
    /// order and shapes, on the host or the device), else from the parameters themselves.
    /// Weight decay applies where `decay(name, param)` holds.
    pub fn new(params: Vec<(String, Tensor)>, masters: Option<&[Tensor]>, config: AdamWConfig, decay: impl Fn(&str, &Tensor) -> bool) -> Result<MixedAdamW> {
        const OP: &str = "MixedAdamW";
        if let Some(m) = masters {
            if m.len() != params.len() {
                return Err(Error::InvalidArgument { op: OP, reason: format!("{} master tensors for {} parameters", m.len(), params.len()) });
            }
        }
        let mut names = std::collections::BTreeSet::new();
        let mut slots = Vec::with_capacity(params.len());
        for (i, (name, param)) in params.into_iter().enumerate() {
            if !names.insert(name.clone()) {
                return Err(Error::InvalidArgument { op: OP, reason: format!("parameter name {name} appears twice") });
            }
            let (ordinal, dev) = device_of(OP, &param)?;
            let n = param.numel();
            let source = match masters {
                Some(m) => {
                    if m[i].shape() != param.shape() {
                        return Err(Error::ShapeMismatch { op: OP, lhs: param.shape().to_vec(), rhs: m[i].shape().to_vec() });
                    }
                    m[i].clone()
                }
                None => param.detach(),
            };
            let source = match source.device() {
                Device::Cpu => super::upload(&source.to_dtype(DType::F32)?, ordinal)?,
                _ => source,
            };
            let source = super::ops::cast(&source.detach(), DType::F32)?;
            let mut master = dev.alloc::<f32>(n)?;
            dev.copy_dtod(&*dense::<f32>(OP, &source)?, &mut master)?;
            let decays = decay(&name, &param);
            let weight_decay = if decays { config.weight_decay } else { 0.0 };
            slots.push(Slot { name, param, ordinal, decays, weight_decay, master, exp_avg: dev.zeros::<f32>(n)?, exp_avg_sq: dev.zeros::<f32>(n)?, step: 0 });
        }
        Ok(MixedAdamW { config, slots })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }
}

impl MixedAdamW {
    /// The step as one launch for all parameters ([`rtx_kernels::cuda::Device::adamw_master_multi`])
    /// when every parameter with a gradient is a bf16 tensor of whole 8-element words on one
    /// device with a bf16 gradient (a GPT's ~150 tensors, most of them small, would otherwise be
    /// ~150 launches); `false` (nothing done) otherwise.
    fn step_multi(&mut self) -> Result<bool> {
        const OP: &str = "MixedAdamW::step";
        let c = self.config;
        let mut work: Vec<(usize, Tensor)> = Vec::with_capacity(self.slots.len());
        for (i, slot) in self.slots.iter().enumerate() {
            let Some(grad) = slot.param.grad() else { continue };
            let eligible = slot.param.dtype() == DType::BF16 && grad.dtype() == DType::BF16 && slot.param.numel().is_multiple_of(8) && slot.ordinal == self.slots[0].ordinal;
            if !eligible {
                return Ok(false);
            }
            work.push((i, grad));
        }
        let Some(&(first, _)) = work.first() else { return Ok(false) };
        let dev = device(self.slots[first].ordinal)?;
        let grads = work.iter().map(|(_, g)| dense::<bf16>(OP, g)).collect::<Result<Vec<_>>>()?;
        // Handles of the parameters (the slots are borrowed mutably for their state below).
        let handles: Vec<Tensor> = work.iter().map(|&(i, _)| self.slots[i].param.clone()).collect();
        let mut params = Vec::with_capacity(work.len());
        for p in &handles {
            params.push(p.storage().write_cuda(OP)?);
        }
        let chosen: std::collections::BTreeSet<usize> = work.iter().map(|&(i, _)| i).collect();
        let mut tensors = Vec::with_capacity(work.len());
        let mut slots = self.slots.iter_mut().enumerate().filter(|(i, _)| chosen.contains(i)).map(|(_, s)| s);
        for (guard, grad) in params.iter_mut().zip(&grads) {
            let slot = slots.next().ok_or(Error::InvalidArgument { op: OP, reason: "fewer slots than gradients".into() })?;
            let dtype = guard.dtype();
            let param = <bf16 as GpuFloat>::buffer_mut(guard).ok_or(Error::DTypeMismatch { op: OP, lhs: dtype, rhs: DType::BF16 })?;
            slot.step += 1;
            let hp = AdamWStep { lr: c.lr as f32, beta1: c.beta1 as f32, beta2: c.beta2 as f32, eps: c.eps as f32, weight_decay: slot.weight_decay as f32, step: slot.step };
            tensors.push(AdamWTensor { master: &mut slot.master, param, grad, m: &mut slot.exp_avg, v: &mut slot.exp_avg_sq, hp });
        }
        dev.adamw_master_multi(&mut tensors)?;
        Ok(true)
    }
}

fn update<T: GpuFloat>(slot: &mut Slot, grad: &Tensor, hp: AdamWStep) -> Result<()> {
    const OP: &str = "MixedAdamW::step";
    let dev = device(slot.ordinal)?;
    let g = dense::<T>(OP, grad)?;
    let mut guard = slot.param.storage().write_cuda(OP)?;
    let dtype = guard.dtype();
    let p = T::buffer_mut(&mut guard).ok_or(Error::DTypeMismatch { op: OP, lhs: dtype, rhs: <T as DeviceElem>::DTYPE })?;
    Ok(dev.adamw_master(&mut slot.master, p, &g, &mut slot.exp_avg, &mut slot.exp_avg_sq, hp)?)
}

impl Optimizer for MixedAdamW {
    fn step(&mut self) -> Result<()> {
        if self.step_multi()? {
            return Ok(());
        }
        let c = self.config;
        for slot in &mut self.slots {
            let Some(grad) = slot.param.grad() else { continue };
            let grad = if grad.dtype() == slot.param.dtype() { grad } else { super::ops::cast(&grad, slot.param.dtype())? };
            slot.step += 1;
            let hp = AdamWStep { lr: c.lr as f32, beta1: c.beta1 as f32, beta2: c.beta2 as f32, eps: c.eps as f32, weight_decay: slot.weight_decay as f32, step: slot.step };
            match slot.param.dtype() {
                DType::F32 => update::<f32>(slot, &grad, hp)?,
                DType::BF16 => update::<bf16>(slot, &grad, hp)?,
                other => return Err(Error::UnsupportedDType { op: "MixedAdamW::step", dtype: other }),
            }
        }
        Ok(())
    }

    fn zero_grad(&self) -> Result<()> {
        for slot in &self.slots {
            slot.param.zero_grad()?;
        }
        Ok(())
    }

    fn lr(&self) -> f64 {
        self.config.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    /// As [`crate::optim::AdamW`]: the parameters the decay filter chose take `weight_decay` from
    /// the next step on (I-JEPA's cosine weight-decay schedule); the others keep none.
    fn set_weight_decay(&mut self, weight_decay: f64) -> bool {
        self.config.weight_decay = weight_decay;
        for slot in self.slots.iter_mut().filter(|s| s.decays) {
            slot.weight_decay = weight_decay;
        }
        true
    }

    fn kind(&self) -> &'static str {
        "adamw"
    }

    fn parameters(&self) -> Vec<(String, Tensor)> {
        self.slots.iter().map(|s| (s.name.clone(), s.param.clone())).collect()
    }

    fn state_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::with_capacity(self.slots.len() * 4);
        for s in &self.slots {
            let dev = device(s.ordinal)?;
            let shape = s.param.shape();
            for (field, buf) in [("master", &s.master), ("exp_avg", &s.exp_avg), ("exp_avg_sq", &s.exp_avg_sq)] {
                let mut copy = dev.alloc::<f32>(buf.len())?;
                dev.copy_dtod(buf, &mut copy)?;
                out.push((format!("{}.{field}", s.name), tensor_from(s.ordinal, DeviceData::F32(copy), shape).to_device(Device::Cpu)?));
            }
            out.push((format!("{}.step", s.name), Tensor::scalar(f64::from(s.step), DType::F64)));
        }
        Ok(out)
    }

    fn load_state(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        const OP: &str = "MixedAdamW::load_state";
        let expected = self.slots.len() * 4;
        if state.len() != expected {
            return Err(Error::InvalidArgument { op: OP, reason: format!("{} state tensors, expected {expected}", state.len()) });
        }
        let find = |name: &str| state.iter().find(|(n, _)| n == name).map(|(_, t)| t.clone()).ok_or(Error::InvalidArgument { op: OP, reason: format!("missing {name}") });
        for s in &mut self.slots {
            let dev = device(s.ordinal)?;
            for field in ["master", "exp_avg", "exp_avg_sq"] {
                let t = find(&format!("{}.{field}", s.name))?;
                if t.shape() != s.param.shape() {
                    return Err(Error::ShapeMismatch { op: OP, lhs: s.param.shape().to_vec(), rhs: t.shape().to_vec() });
                }
                let host = t.to_device(Device::Cpu)?.to_dtype(DType::F32)?.to_f32_vec()?;
                let dst = match field {
                    "master" => &mut s.master,
                    "exp_avg" => &mut s.exp_avg,
                    _ => &mut s.exp_avg_sq,
                };
                dev.copy_htod(&host, dst)?;
            }
            // The parameter is the master rounded to its dtype, as after a step.
            {
                let mut guard = s.param.storage().write_cuda(OP)?;
                match &mut *guard {
                    DeviceData::F32(p) => dev.copy_dtod(&s.master, p)?,
                    DeviceData::BF16(p) => dev.cast_f32_to_bf16(&s.master, p)?,
                    DeviceData::U32(_) => return Err(Error::UnsupportedDType { op: OP, dtype: DType::U32 }),
                }
            }
            let step = find(&format!("{}.step", s.name))?.item()?;
            s.step = u32::try_from(step as u64).map_err(|_| Error::InvalidArgument { op: OP, reason: format!("step {step} out of range") })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::AdamW;

    #[test]
    fn weight_decay_schedule_follows_host_adamw() {
        // Goal: `set_weight_decay` changes the decay of the filtered parameters only, as the host
        // AdamW does (I-JEPA's schedule; the default trait method would ignore it silently).
        // Method: a matrix and a bias, f32 on the device and on the host, three steps with the
        // decay changed before each; the parameters must agree to f32 rounding.
        if !rtx_kernels::cuda::Device::count().is_ok_and(|n| n > 0) {
            println!("skipped: no CUDA device");
            return;
        }
        let w = Tensor::from_vec((0..12).map(|i| i as f32 * 0.1 - 0.5).collect::<Vec<f32>>(), &[3, 4]).expect("w");
        let b = Tensor::from_vec(vec![0.3f32, -0.2, 0.1], &[3]).expect("b");
        let host: Vec<(String, Tensor)> = vec![("w".into(), w.clone().requires_grad(true)), ("b".into(), b.clone().requires_grad(true))];
        let dev: Vec<(String, Tensor)> = host.iter().map(|(n, t)| (n.clone(), t.detach().to_device(Device::Cuda(0)).expect("upload").requires_grad(true))).collect();
        let config = AdamWConfig { lr: 0.1, weight_decay: 0.04, ..AdamWConfig::default() };
        let mut host_opt = AdamW::with_decay_filter(host.clone(), config, AdamW::decay_matrices).expect("host adamw");
        let mut dev_opt = MixedAdamW::new(dev.clone(), None, config, AdamW::decay_matrices).expect("device adamw");
        for (step, wd) in [0.04, 0.2, 0.4].into_iter().enumerate() {
            assert!(host_opt.set_weight_decay(wd) && dev_opt.set_weight_decay(wd));
            for ((_, h), (_, d)) in host.iter().zip(&dev) {
                let g: Vec<f32> = (0..h.numel()).map(|i| ((i + step) % 5) as f32 * 0.01).collect();
                h.set_grad(Some(Tensor::from_vec(g.clone(), h.shape()).expect("g"))).expect("host grad");
                d.set_grad(Some(Tensor::from_vec(g, d.shape()).expect("g").to_device(Device::Cuda(0)).expect("upload"))).expect("device grad");
            }
            host_opt.step().expect("host step");
            dev_opt.step().expect("device step");
        }
        for ((name, h), (_, d)) in host.iter().zip(&dev) {
            let (h, d) = (h.to_f32_vec().expect("host"), d.to_f32_vec().expect("device"));
            assert!(h.iter().zip(&d).all(|(a, b)| (a - b).abs() <= 1e-5 * a.abs().max(1.0)), "{name}: host {h:?}, device {d:?}");
        }
    }
}
