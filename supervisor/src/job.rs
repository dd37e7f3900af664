//! What an elastic worker trains: the [`TrainJob`] trait. The supervisor crate knows nothing of
//! models or datasets; the `rtx` binary (or an embedding program) implements this trait and the
//! worker runtime drives it: builds the model and optimizer, asks for batches by
//! `(step, rank, world)` through a [`rtx_actors::DataShard`], and evaluates at the end.

use std::path::PathBuf;
use std::sync::Arc;

use rtx_actors::BatchSource;
use rtx_pipelines::pipeline::{PipelineConfig, StageModule, TokenBatch};
use rtx_pipelines::tp::TpHandle;
use rtx_pipelines::{Coord, DpConfig, MeshShape, ParamSlice};
use rtx_tensor::checkpoint::sharded::ModelLayout;
use rtx_tensor::nn::Gpt;
use rtx_tensor::{Generator, Module, Optimizer, Tensor};

/// A GPU's caching-allocator counters, in bytes (`rtx_kernels::cuda::MemoryStats`, which this
/// crate does not name: it builds without the `cuda` feature).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes in live buffers now.
    pub allocated: usize,
    /// Highest `allocated` seen by this process.
    pub peak_allocated: usize,
    /// Bytes held from the driver now (live plus cached).
    pub reserved: usize,
    /// Highest `reserved` seen by this process.
    pub peak_reserved: usize,
}

/// A training job as the worker runtime sees it. `batch` (from [`BatchSource`]) must be a pure
/// function of `(step, rank, world)` whose rank parts make up the same global batch whatever
/// the world size.
pub trait TrainJob: BatchSource {
    /// The model.
    type Model: Module + Send + 'static;
    /// The optimizer. It should not clip gradients inside `step`: under ZeRO it steps only this
    /// rank's segments, so it would clip by a segment's norm; [`TrainJob::dp_config`]'s
    /// `grad_clip` clips by the whole model's norm in every engine.
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

    /// Runs after the optimizer step `step` on every replica, before the step is reported done:
    /// updates of non-trainable state that follow the parameters (an EMA target encoder kept as
    /// buffers). It must be a deterministic function of the model, so replicas stay
    /// bit-identical. Nothing by default.
    fn after_step(&self, model: &mut Self::Model, step: u64) -> Result<(), String> {
        let _ = (model, step);
        Ok(())
    }

    /// Evaluates the final model (called on rank 0 only): named metrics.
    fn evaluate(&self, model: &mut Self::Model) -> Result<Vec<(String, f64)>, String>;

    /// The device allocator's counters of this worker's GPU, when the job trains on one (`None`
    /// by default: a host job). The data-parallel worker logs them at the end of each generation
    /// ("device memory"), so per-rank peaks of replicated and ZeRO runs can be compared.
    fn device_memory(&self) -> Option<DeviceMemory> {
        None
    }

    /// Data-parallel engine settings (bucket size, sharding, gradient clipping). Its
    /// `grad_clip` also clips the ZeRO-3 engine ([`rtx_pipelines::FsdpConfig::grad_clip`]).
    fn dp_config(&self) -> DpConfig {
        DpConfig::default()
    }

    /// Where periodic checkpoints go (`None`: nowhere).
    fn checkpoint_dir(&self) -> Option<PathBuf>;

    /// `Some((n, dir))`: record the timeline of each generation's first `n` data-parallel steps
    /// and write it to `dir/trace-rank<r>.json` (Chrome trace format) when the generation ends.
    fn trace(&self) -> Option<(u64, PathBuf)> {
        None
    }

    /// The model-parallel form of the job (`None`: data parallelism with [`TrainJob::Model`]).
    /// With it, the worker runtime trains the job as a `(dp, pp, tp)` mesh through
    /// [`rtx_pipelines::pipeline::MeshEngine`], building each member's part with [`MeshSpec::build`].
    fn mesh(&self) -> Option<MeshSpec<Self::Batch>> {
        None
    }

    /// The ZeRO-3 / FSDP form of the job (`None`: it has none). With `[elastic] sharding =
    /// "zero3"` the worker runtime trains the GPT this builds through [`rtx_pipelines::FsdpGpt`],
    /// with [`TrainJob::build_optimizer`] over each rank's unit segments.
    fn fsdp(&self) -> Option<FsdpSpec<Self::Batch>> {
        None
    }
}

/// The token ids and targets (`[B, T]`, u32) of one rank's batch, and its row count.
pub type BatchTokens<B> = dyn Fn(&B) -> Result<(Tensor, Tensor, usize), String> + Send + Sync;

/// The ZeRO-3 form of a GPT job: what the worker runtime needs to drive `FsdpGpt` without
/// naming the job's model type.
pub struct FsdpSpec<B> {
    /// Builds the whole GPT with the job's initial parameters (the same on every worker).
    pub build: Arc<dyn Fn() -> Result<Gpt, String> + Send + Sync>,
    /// One rank's batch as token ids and targets.
    pub tokens: Arc<BatchTokens<B>>,
    /// The dropout generator of `(step, rank)`.
    pub rng: Arc<dyn Fn(u64, usize) -> Generator + Send + Sync>,
}

impl<B> Clone for FsdpSpec<B> {
    fn clone(&self) -> Self {
        FsdpSpec { build: Arc::clone(&self.build), tokens: Arc::clone(&self.tokens), rng: Arc::clone(&self.rng) }
    }
}

/// A member's part of a model-parallel model, whatever its type.
pub type BoxedStage = Box<dyn StageModule<MicroBatch = TokenBatch>>;

/// What a member's part is built for.
pub struct StageRequest {
    /// The member's place in the mesh.
    pub coord: Coord,
    /// The mesh.
    pub shape: MeshShape,
    /// The member's tensor-parallel group (size 1 without tensor parallelism).
    pub tp: TpHandle,
}

/// Builds a member's part (its initial parameters: the same on every member that holds the slot)
/// and the optimizer over exactly that part's parameters.
pub type BuildStage = dyn Fn(&StageRequest) -> Result<(BoxedStage, Box<dyn Optimizer + Send>), String> + Send + Sync;

/// Cuts one replica's batch into `m` micro-batches.
pub type SplitBatch<B> = dyn Fn(&B, usize) -> Result<Vec<TokenBatch>, String> + Send + Sync;

/// The model-parallel form of a job: what the worker's mesh generation builds its part from
/// without naming the model (it then drives the part's `MeshEngine` through the
/// [`rtx_pipelines::Engine`] contract). Token models (the GPT) for now: micro-batches are
/// [`TokenBatch`]es.
pub struct MeshSpec<B> {
    /// Pipeline stages.
    pub pp: usize,
    /// Tensor-parallel ranks per stage.
    pub tp: usize,
    /// Schedule, micro-batches, clipping and dropout seed.
    pub pipeline: PipelineConfig,
    /// Builds a member's part and optimizer.
    pub build: Arc<BuildStage>,
    /// Cuts one replica's batch into its micro-batches.
    pub split: Arc<SplitBatch<B>>,
    /// The learning rate of a step.
    pub lr: Arc<dyn Fn(u64) -> f64 + Send + Sync>,
    /// How the full model's tensors are cut over `(pp, tp)`: the parts of sharded checkpoints.
    pub layout: ModelLayout,
}

impl<B> Clone for MeshSpec<B> {
    fn clone(&self) -> Self {
        MeshSpec { pp: self.pp, tp: self.tp, pipeline: self.pipeline, build: Arc::clone(&self.build), split: Arc::clone(&self.split), lr: Arc::clone(&self.lr), layout: self.layout.clone() }
    }
}
