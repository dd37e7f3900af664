//! Neural-network modules: the [`Module`] trait (hierarchical, PyTorch-compatible parameter
//! names) and layers from [`Linear`] up to a GPT decoder ([`Gpt`]) and a ViT encoder ([`Vit`]).
//!
//! Parameters are plain [`Tensor`] fields marked `requires_grad`. A module exposes them through
//! [`Module::visit_params`] in a fixed, documented order under dotted names that match what the
//! equivalent PyTorch module's `state_dict()` calls them (`blocks.3.attn.qkv.weight`, Linear
//! weights `[out, in]`), so a checkpoint written by [`crate::checkpoint`] loads into PyTorch
//! unchanged. [`Module::visit_params_mut`] lets [`crate::optim::ParamBuckets`] swap each
//! parameter for a view into a flat bucket. Non-trainable state (buffers, such as the EMA
//! target encoder of [`IJepa`]) is visited by [`Module::visit_buffers`]: checkpoints and elastic
//! state sync carry it, optimizers never see it. [`Module::load_state_dict`] fills any module
//! from named tensors (a PyTorch `state_dict`) and reports missing, unexpected and mismatched
//! names, as PyTorch's method of the same name.
//!
//! `forward` is an inherent method of each module because the signatures differ. Modules with
//! dropout take the caller's [`Generator`](crate::Generator) in `forward`; in evaluation mode
//! ([`Module::set_training`]`(false)`) or with `p = 0` the generator is never touched.
//!
//! Initialisation follows PyTorch for the plain layers (Linear: U(−1/√in, 1/√in) for weight and
//! bias; Embedding: N(0, 1); norms: ones and zeros) and GPT-2 for [`Gpt`] and [`Vit`] (normal
//! std 0.02, zero biases, residual projections scaled by 1/√(2·n_layers)). Every random
//! draw comes from the caller's generator in visit order, so a seed fixes the model.

mod attention;
mod dropout;
mod embedding;
mod gpt;
mod linear;
mod norm;
mod state_dict;
mod transformer;
mod vit;
pub mod jepa;

pub use attention::MultiHeadAttention;
pub use dropout::Dropout;
pub use embedding::Embedding;
pub use gpt::{head_chunk_rows, Gpt, GptConfig};
pub use linear::{Activation, Linear, Mlp};
pub use norm::{LayerNorm, RmsNorm};
pub use state_dict::{StateDictReport, StateMismatch};
pub use transformer::{BlockConfig, FeedForward, TransformerBlock};
pub use vit::{patchify, patchify_3d, PatchEmbed, Pooling, Vit, VitConfig};
pub use jepa::{collapse_std, sincos_2d, sincos_3d, IJepa, IJepaConfig, JepaLoss, JepaMasks, JepaOutput, JepaPredictor, MaskConfig};

use crate::error::Result;
use crate::tensor::{Tensor, TensorId};
use std::collections::BTreeSet;

/// A layer or model that owns named parameters.
///
/// Names are dotted paths built from `prefix` (empty at the root) and field names; the order of
/// visits is the module's declaration order and is part of its contract (optimizer state,
/// checkpoints and buckets are laid out by it).
pub trait Module {
    /// Calls `f(name, param)` for every parameter, in visit order, names prefixed by `prefix`.
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor));

    /// Like [`Module::visit_params`] with mutable access, so a parameter can be replaced (by a
    /// view into a flat bucket, or a loaded tensor). The replacement must keep the shape.
    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor));

    /// Calls `f(name, buffer)` for every buffer (non-trainable named state: an EMA copy, running
    /// statistics), in visit order. Buffers are saved in checkpoints beside the parameters and
    /// travel with them in elastic state sync, but no optimizer sees them. None by default.
    fn visit_buffers(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        let _ = (prefix, f);
    }

    /// Like [`Module::visit_buffers`] with mutable access (a loaded tensor may replace a buffer;
    /// the replacement must keep the shape).
    fn visit_buffers_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        let _ = (prefix, f);
    }

    /// Switches training mode (dropout on) or evaluation mode (dropout off), recursively.
    fn set_training(&mut self, training: bool) {
        let _ = training;
    }

    /// `(name, buffer)` pairs in visit order (deduplicated like [`Module::named_parameters`]).
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        let mut seen = BTreeSet::<TensorId>::new();
        let mut out = Vec::new();
        self.visit_buffers("", &mut |name, t| {
            if seen.insert(t.id()) {
                out.push((name.to_string(), t.clone()));
            }
        });
        out
    }

    /// Parameters then buffers, each in visit order: everything a replica's state is made of
    /// (what a checkpoint holds and an elastic re-formation broadcasts).
    fn named_state(&self) -> Vec<(String, Tensor)> {
        let mut all = self.named_parameters();
        all.extend(self.named_buffers());
        all
    }

    /// `(name, parameter)` pairs in visit order; a tensor reachable under two names is listed
    /// once, under the first (as PyTorch's `named_parameters`).
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut seen = BTreeSet::<TensorId>::new();
        let mut out = Vec::new();
        self.visit_params("", &mut |name, t| {
            if seen.insert(t.id()) {
                out.push((name.to_string(), t.clone()));
            }
        });
        out
    }

    /// The parameters in visit order (deduplicated).
    fn parameters(&self) -> Vec<Tensor> {
        self.named_parameters().into_iter().map(|(_, t)| t).collect()
    }

    /// Total number of parameter elements.
    fn num_parameters(&self) -> usize {
        self.named_parameters().iter().map(|(_, t)| t.numel()).sum()
    }

    /// Copies named tensors (a PyTorch `state_dict`, e.g. from
    /// [`crate::checkpoint::load_tensors`]) into the parameters and buffers of the same names, in
    /// place, and reports missing and unexpected names. With `strict`, any missing or unexpected
    /// name is an [`Error::StateDict`](crate::Error::StateDict) listing all of them; a shape
    /// mismatch is that error either way. Nothing is copied unless every check passes. See
    /// `nn/state_dict.rs` for the rules.
    fn load_state_dict(&self, state: &[(String, Tensor)], strict: bool) -> Result<StateDictReport> {
        state_dict::load_state_dict(self, state, strict)
    }

    /// Zeros every parameter's gradient in place (keeping bucket-bound gradient buffers).
    fn zero_grad(&self) -> Result<()> {
        let mut result = Ok(());
        self.visit_params("", &mut |_, t| {
            if result.is_ok() {
                result = t.zero_grad();
            }
        });
        result
    }
}

/// `prefix.name`, or `name` at the root.
pub fn join_name(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// Marks a freshly built tensor as a parameter.
pub(crate) fn param(t: Tensor) -> Tensor {
    t.requires_grad(true)
}

impl<M: Module> Module for Vec<M> {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        for (i, m) in self.iter().enumerate() {
            m.visit_params(&join_name(prefix, &i.to_string()), f);
        }
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        for (i, m) in self.iter_mut().enumerate() {
            m.visit_params_mut(&join_name(prefix, &i.to_string()), f);
        }
    }

    fn visit_buffers(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        for (i, m) in self.iter().enumerate() {
            m.visit_buffers(&join_name(prefix, &i.to_string()), f);
        }
    }

    fn visit_buffers_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        for (i, m) in self.iter_mut().enumerate() {
            m.visit_buffers_mut(&join_name(prefix, &i.to_string()), f);
        }
    }

    fn set_training(&mut self, training: bool) {
        self.iter_mut().for_each(|m| m.set_training(training));
    }
}

impl<M: Module + ?Sized> Module for Box<M> {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        (**self).visit_params(prefix, f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        (**self).visit_params_mut(prefix, f);
    }

    fn visit_buffers(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        (**self).visit_buffers(prefix, f);
    }

    fn visit_buffers_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        (**self).visit_buffers_mut(prefix, f);
    }

    fn set_training(&mut self, training: bool) {
        (**self).set_training(training);
    }
}

impl<M: Module> Module for Option<M> {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        if let Some(m) = self {
            m.visit_params(prefix, f);
        }
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        if let Some(m) = self {
            m.visit_params_mut(prefix, f);
        }
    }

    fn visit_buffers(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        if let Some(m) = self {
            m.visit_buffers(prefix, f);
        }
    }

    fn visit_buffers_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        if let Some(m) = self {
            m.visit_buffers_mut(prefix, f);
        }
    }

    fn set_training(&mut self, training: bool) {
        if let Some(m) = self {
            m.set_training(training);
        }
    }
}

/// Visits an optional parameter tensor under `prefix.name`.
pub(crate) fn visit_opt(prefix: &str, name: &str, t: &Option<Tensor>, f: &mut dyn FnMut(&str, &Tensor)) {
    if let Some(t) = t {
        f(&join_name(prefix, name), t);
    }
}

/// Visits an optional parameter tensor mutably under `prefix.name`.
pub(crate) fn visit_opt_mut(prefix: &str, name: &str, t: &mut Option<Tensor>, f: &mut dyn FnMut(&str, &mut Tensor)) {
    if let Some(t) = t {
        f(&join_name(prefix, name), t);
    }
}
