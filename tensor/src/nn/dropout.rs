//! [`Dropout`]: zeroes elements with probability `p` in training mode and scales the rest by
//! `1/(1−p)`; the identity in evaluation mode.

use super::Module;
use crate::error::{Error, Result};
use crate::rng::Generator;
use crate::tensor::Tensor;

/// Inverted dropout with its own training flag (on at construction).
#[derive(Clone, Debug)]
pub struct Dropout {
    p: f64,
    training: bool,
}

impl Dropout {
    /// Dropout with probability `p` in `[0, 1)`.
    pub fn new(p: f64) -> Result<Dropout> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::InvalidArgument { op: "Dropout", reason: format!("probability {p} outside [0, 1)") });
        }
        Ok(Dropout { p, training: true })
    }

    /// The drop probability.
    pub fn p(&self) -> f64 {
        self.p
    }

    /// Whether the layer is in training mode.
    pub fn is_training(&self) -> bool {
        self.training
    }

    /// Applies the mask; draws from `rng` only in training mode with `p > 0`.
    pub fn forward(&self, x: &Tensor, rng: &mut Generator) -> Result<Tensor> {
        if !self.training || self.p == 0.0 {
            return Ok(x.clone());
        }
        x.dropout(self.p, true, rng)
    }
}

impl Module for Dropout {
    fn visit_params(&self, _prefix: &str, _f: &mut dyn FnMut(&str, &Tensor)) {}

    fn visit_params_mut(&mut self, _prefix: &str, _f: &mut dyn FnMut(&str, &mut Tensor)) {}

    fn set_training(&mut self, training: bool) {
        self.training = training;
    }
}
