//! The model, batches and parameter bits shared by the data-parallel tests that compare two
//! engines bit for bit (`dp_device_reduce.rs`, `dp_staging_zero.rs`): an MLP with a parameter the
//! loss never uses (whose gradient must come out as zeros), initialised per rank (so the opening
//! broadcast has something to do), and batches fixed by (step, rank).
#![allow(dead_code, clippy::unwrap_used)]

use rtx_tensor::nn::{Activation, Mlp, Module};
use rtx_tensor::{CrossEntropyOptions, DType, Generator, Tensor};

/// Rows of each rank's batch.
pub(crate) const ROWS: usize = 4;
/// Seed of rank 0's initial parameters (rank `r` uses `MODEL_SEED + r`).
pub(crate) const MODEL_SEED: u64 = 11;
/// Seed of the batches (step `s` of rank `r` uses `BATCH_SEED + 10 s + r`).
pub(crate) const BATCH_SEED: u64 = 2000;

/// An MLP and a parameter the loss never uses.
pub(crate) struct WithUnused {
    pub(crate) mlp: Mlp,
    pub(crate) unused: Tensor,
}

impl Module for WithUnused {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        self.mlp.visit_params(&format!("{prefix}mlp."), f);
        f(&format!("{prefix}unused"), &self.unused);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        self.mlp.visit_params_mut(&format!("{prefix}mlp."), f);
        f(&format!("{prefix}unused"), &mut self.unused);
    }
}

/// Rank `rank`'s model in `dtype` (12 -> 16 -> 5, ReLU, and 7 unused values).
pub(crate) fn with_unused(rank: usize, dtype: DType) -> WithUnused {
    let mut g = Generator::new(MODEL_SEED + rank as u64);
    let mlp = Mlp::new(&[12, 16, 5], Activation::Relu, dtype, &mut g).unwrap();
    let unused = Tensor::randn(&[7], 0.0, 1.0, dtype, &mut g).unwrap().requires_grad(true);
    WithUnused { mlp, unused }
}

/// The cross-entropy of rank `rank`'s batch of step `step` (in the model's dtype).
pub(crate) fn loss(m: &mut WithUnused, step: u64, rank: usize) -> rtx_tensor::Result<Tensor> {
    let mut g = Generator::new(BATCH_SEED + step * 10 + rank as u64);
    let x = Tensor::randn(&[ROWS, 12], 0.0, 1.0, DType::F32, &mut g)?.to_dtype(m.unused.dtype())?;
    let y = Tensor::from_vec((0..ROWS).map(|i| ((i + rank + step as usize) % 5) as u32).collect::<Vec<u32>>(), &[ROWS])?;
    m.mlp.forward(&x)?.cross_entropy(&y, CrossEntropyOptions::default())
}

/// Every parameter's values as f32 bits, in visit order.
pub(crate) fn bits(m: &WithUnused) -> Vec<u32> {
    m.named_parameters().into_iter().flat_map(|(_, p)| p.to_f32_vec().unwrap()).map(f32::to_bits).collect()
}
