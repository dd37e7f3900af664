//! [`Embedding`]: a lookup table of `num_embeddings` rows of `dim` (parameter `weight`, as
//! `torch.nn.Embedding`).

use super::{join_name, param, Module};
use crate::error::{Error, Result};
use crate::rng::Generator;
use crate::tensor::Tensor;
use rtx_kernels::DType;

/// A table of learned vectors indexed by u32 ids.
#[derive(Clone, Debug)]
pub struct Embedding {
    /// `[num_embeddings, dim]`.
    pub weight: Tensor,
}

impl Embedding {
    /// A table with rows ~ N(0, std²) (`std = 1.0` is PyTorch's default; GPT-2 uses 0.02).
    pub fn new(num_embeddings: usize, dim: usize, std: f64, dtype: DType, rng: &mut Generator) -> Result<Embedding> {
        if num_embeddings == 0 || dim == 0 {
            return Err(Error::InvalidArgument { op: "Embedding", reason: format!("sizes must be positive, got {num_embeddings}x{dim}") });
        }
        Ok(Embedding { weight: param(Tensor::randn(&[num_embeddings, dim], 0.0, std, dtype, rng)?) })
    }

    /// A table from a given `[num_embeddings, dim]` tensor (marked as a parameter).
    pub fn from_tensor(weight: Tensor) -> Result<Embedding> {
        if weight.rank() != 2 {
            return Err(Error::BadShape { op: "Embedding", shape: weight.shape().to_vec(), reason: "weight must be [num_embeddings, dim]".into() });
        }
        Ok(Embedding { weight: param(weight) })
    }

    /// Number of rows.
    pub fn num_embeddings(&self) -> usize {
        self.weight.shape()[0]
    }

    /// Row width.
    pub fn dim(&self) -> usize {
        self.weight.shape()[1]
    }

    /// `ids [..] (u32) -> [.., dim]`.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        Tensor::embedding(&self.weight, ids)
    }
}

impl Module for Embedding {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        f(&join_name(prefix, "weight"), &self.weight);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        f(&join_name(prefix, "weight"), &mut self.weight);
    }
}
