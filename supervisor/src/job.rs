//! What an elastic worker trains: the [`TrainJob`] trait. The supervisor crate knows nothing of
//! models or datasets; the `rtx` binary (or an embedding program) implements this trait and the
//! worker runtime drives it: builds the model and optimizer, asks for batches by
//! `(step, rank, world)` through a [`rtx_actors::DataShard`], and evaluates at the end.

use std::path::PathBuf;

use rtx_actors::BatchSource;
use rtx_pipelines::{DpConfig, ParamSlice};
use rtx_tensor::{Module, Optimizer, Tensor};

/// A training job as the worker runtime sees it. `batch` (from [`BatchSource`]) must be a pure
/// function of `(step, rank, world)` whose rank parts make up the same global batch whatever
/// the world size.
pub trait TrainJob: BatchSource {
    /// The model.
    type Model: Module + Send + 'static;
    /// The optimizer (it may clip gradients inside `step`).
    type Optim: Optimizer + Send + 'static;

    /// Builds the model; every worker must get the same initial parameters.
    fn build_model(&self) -> Result<Self::Model, String>;

    /// Builds the optimizer over the parameter slices this rank updates.
    fn build_optimizer(&self, slices: &[ParamSlice]) -> Result<Self::Optim, String>;

    /// The loss of this rank's part of a batch, as a mean over its rows, and the number of rows.
    fn loss(&self, model: &mut Self::Model, batch: &Self::Batch, step: u64) -> rtx_tensor::Result<(Tensor, usize)>;

    /// Rows in one global batch (all ranks together).
    fn global_batch(&self) -> usize;

    /// Steps in the whole run.
    fn total_steps(&self) -> u64;

    /// Sets the learning rate of `step` (a schedule).
    fn set_lr(&self, optimizer: &mut Self::Optim, step: u64);

    /// Evaluates the final model (called on rank 0 only): named metrics.
    fn evaluate(&self, model: &mut Self::Model) -> Result<Vec<(String, f64)>, String>;

    /// Data-parallel engine settings (bucket size, sharding).
    fn dp_config(&self) -> DpConfig {
        DpConfig::default()
    }

    /// Where periodic checkpoints go (`None`: nowhere).
    fn checkpoint_dir(&self) -> Option<PathBuf>;
}
