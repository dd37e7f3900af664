//! Learning-rate schedules: pure functions from the step (0-based, the number of optimizer
//! steps already taken) to a learning rate, so a resumed run recomputes its rate from the
//! checkpointed step alone.

/// A learning rate as a function of the step.
pub trait LrSchedule {
    /// The rate to use for the update that follows `step` completed ones.
    fn lr(&self, step: u64) -> f64;
}

/// The same rate at every step.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ConstantLr {
    /// The rate.
    pub lr: f64,
}

/// Linear warmup then cosine decay (nanoGPT's schedule):
/// - `step < warmup_steps`: `max_lr · (step + 1) / warmup_steps`;
/// - `warmup_steps ≤ step ≤ total_steps`: `min_lr + ½(1 + cos(π·r))·(max_lr − min_lr)` with
///   `r = (step − warmup_steps) / (total_steps − warmup_steps)`;
/// - `step > total_steps` (or after warmup when `total_steps ≤ warmup_steps`): `min_lr`.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct WarmupCosine {
    /// Peak rate, reached at the end of warmup.
    pub max_lr: f64,
    /// Floor rate at and after `total_steps`.
    pub min_lr: f64,
    /// Steps of linear warmup.
    pub warmup_steps: u64,
    /// Step at which the cosine reaches `min_lr`.
    pub total_steps: u64,
}

impl LrSchedule for ConstantLr {
    fn lr(&self, _step: u64) -> f64 {
        self.lr
    }
}

impl LrSchedule for WarmupCosine {
    fn lr(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.max_lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        if step > self.total_steps || self.total_steps <= self.warmup_steps {
            return self.min_lr;
        }
        let ratio = (step - self.warmup_steps) as f64 / (self.total_steps - self.warmup_steps) as f64;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
        self.min_lr + coeff * (self.max_lr - self.min_lr)
    }
}
