//! The run's optimizer, learning-rate schedule and gradient clipping, built from
//! `[optim]` and `[schedule]`.
//!
//! The learning rate of step `s` (0-based, the step about to be taken) is a pure function of `s`,
//! so resuming needs only the step number and the optimizer's own state tensors.

use rtx_tensor::nn::Module;
use rtx_tensor::optim::{self, AdamW, AdamWConfig, LrSchedule, Sgd, SgdConfig};
use rtx_tensor::Tensor;

use crate::config::{OptimConfig, OptimKind, ScheduleConfig};

use super::Result;

/// The optimizer of a run with its schedule and clipping.
pub(crate) struct Optimizer {
    inner: Box<dyn optim::Optimizer>,
    schedule: Box<dyn LrSchedule>,
    grad_clip: Option<f64>,
    params: Vec<Tensor>,
    last_lr: f64,
    description: String,
}

impl Optimizer {
    /// Builds the optimizer over `model`'s parameters.
    pub(crate) fn new(config: &OptimConfig, schedule: &ScheduleConfig, model: &dyn Module) -> Result<Optimizer> {
        let named = model.named_parameters();
        let params: Vec<Tensor> = named.iter().map(|(_, t)| t.clone()).collect();
        let (inner, description) = build_inner(config, named)?;
        let schedule_kind = build_schedule(config, schedule);
        let mut description = description;
        if schedule.cosine {
            description.push_str(&format!(", warmup {} then cosine to {} at step {}", schedule.warmup_steps, schedule.min_lr, schedule.total_steps));
        } else if schedule.warmup_steps > 0 {
            description.push_str(&format!(", warmup {} then constant", schedule.warmup_steps));
        }
        if let Some(c) = config.grad_clip {
            description.push_str(&format!(", grad clip {c}"));
        }
        Ok(Optimizer { inner, schedule: schedule_kind, grad_clip: config.grad_clip, params, last_lr: config.lr, description })
    }

    /// Zeros the gradients.
    pub(crate) fn zero_grad(&self, model: &dyn Module) -> Result<()> {
        model.zero_grad()?;
        Ok(self.inner.zero_grad()?)
    }

    /// Clips (when configured), sets the learning rate of step `step` and updates. Returns the
    /// gradient norm before clipping when clipping is on.
    pub(crate) fn step(&mut self, _model: &dyn Module, step: u64) -> Result<Option<f64>> {
        let norm = match self.grad_clip {
            Some(max) => Some(optim::clip_grad_norm(&self.params, max)?),
            None => None,
        };
        let lr = self.schedule.lr(step);
        self.inner.set_lr(lr);
        self.last_lr = lr;
        self.inner.step()?;
        Ok(norm)
    }

    /// Sets the weight decay of the decayed parameters (a weight-decay schedule).
    pub(crate) fn set_weight_decay(&mut self, weight_decay: f64) {
        self.inner.set_weight_decay(weight_decay);
    }

    /// The learning rate of the last step.
    pub(crate) fn last_lr(&self) -> f64 {
        self.last_lr
    }

    /// A one-line description for the log.
    pub(crate) fn describe(&self) -> &str {
        &self.description
    }

    /// The optimizer itself (for checkpoints).
    pub(crate) fn inner(&self) -> &dyn optim::Optimizer {
        self.inner.as_ref()
    }

    /// Mutable access (for restoring checkpoints).
    pub(crate) fn inner_mut(&mut self) -> &mut dyn optim::Optimizer {
        self.inner.as_mut()
    }
}

/// The configured algorithm over `named` parameters, and a one-line description.
pub(crate) fn build_inner(config: &OptimConfig, named: Vec<(String, Tensor)>) -> Result<(Box<dyn optim::Optimizer + Send>, String)> {
    build_inner_by(config, named, AdamW::decay_matrices)
}

/// [`build_inner`] where AdamW decays the parameters `decays(name, tensor)` picks (for tensors
/// that are slices of parameters, whose own shape does not say what the parameter is).
pub(crate) fn build_inner_by(config: &OptimConfig, named: Vec<(String, Tensor)>, decays: impl Fn(&str, &Tensor) -> bool) -> Result<(Box<dyn optim::Optimizer + Send>, String)> {
    Ok(match config.kind {
        OptimKind::Sgd { momentum } => {
            let cfg = SgdConfig { lr: config.lr, momentum, weight_decay: config.weight_decay, ..SgdConfig::default() };
            (Box::new(Sgd::new(named, cfg)?), format!("sgd lr {} momentum {momentum} weight_decay {}", config.lr, config.weight_decay))
        }
        OptimKind::AdamW { betas, eps } => {
            let cfg = AdamWConfig { lr: config.lr, beta1: betas.0, beta2: betas.1, eps, weight_decay: config.weight_decay };
            // Decay weights and embeddings only, not biases or norm scales (nanoGPT's rule).
            (Box::new(AdamW::with_decay_filter(named, cfg, decays)?), format!("adamw lr {} betas ({}, {}) weight_decay {} (matrices only)", config.lr, betas.0, betas.1, config.weight_decay))
        }
    })
}

/// The configured learning-rate schedule.
pub(crate) fn build_schedule(config: &OptimConfig, schedule: &ScheduleConfig) -> Box<dyn LrSchedule + Send + Sync> {
    if schedule.cosine || schedule.warmup_steps > 0 {
        // Without cosine the floor equals the peak: warmup, then constant.
        let min_lr = if schedule.cosine { schedule.min_lr } else { config.lr };
        Box::new(optim::WarmupCosine { max_lr: config.lr, min_lr, warmup_steps: schedule.warmup_steps, total_steps: schedule.total_steps })
    } else {
        Box::new(optim::ConstantLr { lr: config.lr })
    }
}
