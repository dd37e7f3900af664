//! [`DataParallel`]: one rank of DDP-style data parallelism, optionally with ZeRO-1 optimizer
//! sharding, gradients reduced bucket by bucket while backward is still running.
//!
//! # A step
//!
//! 1. The gradient buckets are zeroed; the caller's closure runs forward and returns the loss.
//! 2. `Tensor::backward_with` reports each parameter the moment its gradient is complete; a
//!    [`BucketTracker`] counts the parameters still pending per bucket. Buckets are handed to the
//!    communication thread strictly in index order (bucket `i` once it and every bucket before it is
//!    complete). Buckets are laid out in reverse parameter order, the order backward finishes them,
//!    so in practice each goes as soon as it is complete.
//! 3. The communication thread (one per rank, see [`crate::reducer`]) averages each bucket's flat
//!    gradient with `all_reduce`, or under ZeRO-1 `reduce_scatter`s it so this rank keeps only the
//!    average of its own segment, while backward computes the rest.
//! 4. After backward, buckets whose parameters were never used by the loss (so never reported) are
//!    handed over too; their gradients are the zeros of step 1. Then the compute thread waits for one
//!    report per bucket.
//! 5. The optimizer steps. Under ZeRO-1 this rank's [`ParamShard`] (the ZeRO-1 role, see
//!    [`crate::param_shard`]) applies the step: it owns the rank's segment of every bucket and the
//!    optimizer state for those segments only; the reduce-scatter wrote the averaged gradient
//!    straight into its gradient segments. The updated parameter segments are copied into the
//!    buckets and every bucket's parameters are `all_gather`ed so all replicas are identical.
//!    With [`DpConfig::grad_clip`] the averaged gradient is clipped by its norm over the whole
//!    model first: replicated, as `rtx_tensor::optim::clip_grad_norm` over every parameter;
//!    under ZeRO-1/2, where a rank holds only its segments, each rank's share of the squared norm
//!    is gathered in one small collective and every rank scales its segments by the same factor
//!    ([`crate::clip`]).
//!
//! # Who owns a bucket buffer when
//!
//! | phase | bucket gradient storage | bucket parameter storage | ZeRO-1 shard gradient segment | ZeRO-1 shard parameter segment |
//! |---|---|---|---|---|
//! | forward; backward until the bucket is complete | compute (backward accumulates) | compute (reads) | idle | idle |
//! | submitted, until its report is received | **communication thread** (`Vec` taken out, storage empty) | compute (reads) | **communication thread** | idle |
//! | after its report | compute (averaged, or stale under ZeRO-1) | compute (optimizer writes; ZeRO-1: segment copied in) | shard (optimizer reads) | shard (optimizer writes) |
//! | ZeRO-1 all-gather, until its report | idle | **communication thread** | idle | idle |
//!
//! A bucket passes to the communication thread only through `Reducer::submit` (once per phase per
//! step) and comes back only with its report; the compute thread does not touch that storage in
//! between, so nobody observes the empty placeholder. The communication thread takes the `Vec` with
//! `std::mem::replace` under the storage's write lock and releases the lock before awaiting.
//!
//! # ZeRO-2
//!
//! [`Sharding::Zero2`] runs ZeRO-1's collectives and optimizer (the same [`ParamShard`]), and
//! changes where gradients live. Between steps every bucket's gradient storage is empty and the
//! parameters' gradient slots are unbound, so backward accumulates each parameter's gradient into
//! a tensor of its own. When a bucket is complete (the moment it is handed over), its flat gradient
//! is allocated, its parameters' gradients are copied in and dropped, and the reduce-scatter,
//! once this rank's averaged segment is written into the shard, drops the flat buffer
//! (`BucketOp::ReduceScatter { release: true }`). A full gradient therefore exists only from the
//! moment backward finishes a parameter until its bucket's reduce-scatter ends; a rank keeps
//! `1/n` of the gradients across steps. The cost is one copy of each gradient, and the bits are
//! ZeRO-1's: the copies are exact and every leaf accumulates its contributions in the same order.
//!
//! # Determinism
//!
//! Collectives are issued in bucket-index order on every rank, one at a time, and reduced in the
//! communicator's fixed order, so results depend only on the inputs, never on when a bucket became
//! ready. Every rank ends a step with the same parameter bits: plain data parallelism gives all
//! ranks the same averaged gradient bits (the communicator guarantees it) and the optimizer is
//! deterministic; ZeRO-1 copies the owners' bits everywhere. Construction broadcasts group rank 0's
//! parameters, as DDP does, so replicas start identical even from different initialisations.
//!
//! # Parameters on a device
//!
//! When the model's parameters live on a CUDA device (or [`DpConfig::host_staging`] asks for it
//! on the host), they stay in the module and the buckets are a host **mirror** of them
//! ([`crate::staging`]): after backward, bucket by bucket in index order, the gradients are copied
//! into the mirror and all-reduced by the same communication thread over the same host
//! communicator (QUIC or shared memory, so several workers can share one GPU), then copied back as
//! the parameters' gradients, and the optimizer steps on the device. Collectives, their order and
//! their bits are those of the bucket path, so replicas stay bit-identical; what is lost is the
//! overlap with backward (the copies wait for the device), which the all-reduce of bucket `i`
//! regains partly by running while bucket `i + 1` is copied.
//!
//! # ZeRO on staged parameters
//!
//! [`Sharding::Zero1`] and [`Sharding::Zero2`] work on staged parameters too. Gradients are
//! downloaded into the mirror bucket by bucket as above, but each bucket's collective is the
//! ZeRO reduce-scatter into this rank's [`ParamShard`], whose slices, optimizer and optimizer
//! state live on the parameters' device ([`ParamShard::new_on`]; the module doc of
//! [`crate::param_shard`] records the decision): on a GPU a rank holds `1/n` of the optimizer
//! state and AdamW (f32 master weights for bf16 parameters) runs there. After the reports, the
//! averaged segments are clipped by the model's norm on the host ([`crate::clip`], the same
//! arithmetic as the host path), uploaded and stepped on the device; the updated segments come
//! back into the mirror's parameter buckets, which are all-gathered on the host, and the module's
//! parameters are updated in place from the mirror (`Staging::install_params`, one upload per
//! bucket). Under ZeRO-2 each parameter's gradient is released right after its bucket's download
//! and the mirror's flat gradient by its reduce-scatter, so between steps a rank keeps only the
//! gradient segments. On the CPU every copy is exact: the bits are the host-bucket engine's ZeRO-1
//! (`tests/dp_staging_zero.rs`). A sharded group of one runs its collectives (copies) like a
//! larger one, as the host path does.
//!
//! # Reduction on the device
//!
//! When every member has its own GPU, copying gradients to the host and back is waste:
//! [`DataParallel::with_device_reduce`] keeps them on the device. The bucket layout is the
//! mirror's (reverse visit order, one dtype per bucket, `bucket_bytes_max`; the mirror is built
//! for its layout only). After backward, one bucket at a time in index order, the bucket's
//! gradients are packed into one flat dense tensor on the parameters' device, as long as the
//! mirror's bucket (zeros for a parameter the loss did not use), averaged in place by the
//! engine's [`DeviceReduce`] (sum over the group divided by its size, one collective), and each
//! parameter gets its slice back as a fresh gradient on the device; then the optimizer steps
//! where the parameters are. The opening broadcast of rank 0's parameters goes through the same
//! reducer, bucket by bucket, after a small collective that checks every member's reducer
//! reports the same group size. Two reducers exist: `NcclReduce` (feature `nccl`, NCCL on the
//! device's one stream, so the collective is ordered with the packing and unpacking copies) and
//! [`crate::HostReduce`], the host communicator standing in on the CPU; the stand-in gives the
//! host-staging path's bits exactly (same buffer length and layout, the same `Avg` call), which
//! is how the logic is tested without a GPU.
//!
//! Decision (constraints, choice, consequences). *Constraints:* the worker runtime drives every
//! data-parallel rank as a [`DataParallel`] (its `Engine` implementation, checksums, checkpoints
//! and state hand-over name that type), and the device path differs from host staging only in
//! where a bucket is reduced. *Choice:* a constructor of [`DataParallel`], not a sibling engine:
//! the device reducer lives in the engine's `Reducer` (a third mode beside the communication
//! thread and the inline queue, taking no host jobs) and the step dispatches on it. *Pros:* one
//! type for the runtime, no second `Engine` implementation, and the accessors, tracing and error
//! handling (a failed collective is [`Error::Collective`] naming step and bucket, then
//! [`Error::Broken`]) are shared. *Cons:* no communication thread, so, as in inline mode, the
//! caller's tokio runtime must run [`DataParallel::step_async`] and drive the reducer's
//! communicator; and no overlap with backward (NCCL would run on the compute stream anyway;
//! overlapping needs a second stream and events, a later step). ZeRO-1/2 on this path need
//! device reduce-scatter and all-gather, not written yet, and are refused
//! ([`Error::ShardedDeviceReduce`]).
//!
//! # Failure
//!
//! A failed or timed-out collective fails the step on that rank; the other ranks' collectives fail
//! too (peer lost) or time out (the communicator's `op_timeout`, bounded again by
//! [`DpConfig::collective_timeout`]). Every bucket buffer is back in place when `step` returns.
//! After any failed step the engine answers [`Error::Broken`]: its communicator's sequence numbers
//! are out of step, and recovery (re-forming the group at a new generation, restoring state) is the
//! supervisor's job. A step that panics leaves the engine refusing further steps the same way.
//!
//! # Inline mode
//!
//! [`DataParallel::new_inline`] and [`DataParallel::step_async`] run the same step without a
//! communication thread: buckets are queued during backward and reduced, in the same order, when
//! the step awaits their reports, as tasks of the caller's runtime. The deterministic simulator
//! uses this; the results are the same bits.
//!
//! Teardown: dropping an engine stops its communication thread and (when `connect` formed the
//! endpoint) drops its transport, which peers see as a lost peer. A peer that has not yet consumed
//! the frames of the last collective then fails it, even though every frame had arrived (the
//! communicator checks for a lost peer before looking at frames already delivered). Ranks that
//! finish together should therefore meet out of band (a process join, a supervisor message)
//! before dropping their engines.

use std::ops::Range;
use std::time::{Duration, Instant};

use rtx_collectives::Communicator;
use rtx_tensor::optim::ParamBuckets;
use rtx_tensor::{CpuData, Device, Module, Optimizer, Tensor};

use crate::device_reduce::DeviceReduce;
use crate::error::{Error, Result};
use crate::param_shard::{check_optimizer_params, ParamShard};
use crate::reducer::{block_on, BucketOp, CommMonitor, Failure, Job, Reducer, Report};
use crate::shard::{self, ParamSlice};
use crate::staging::{self, Staging};
use crate::trace::{StepTrace, COMM_TID, COMPUTE_TID};

/// Default: most bytes per gradient bucket (PyTorch DDP's 25 MiB).
pub const DEFAULT_BUCKET_BYTES_MAX: usize = 25 << 20;
/// Default: most bucket collectives queued for the communication thread before backward waits.
pub const DEFAULT_QUEUE_DEPTH: usize = 16;
/// Default: longest one bucket collective may run before the step fails.
pub const DEFAULT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(300);

/// How optimizer state is placed across the data-parallel group.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Sharding {
    /// Every rank holds all optimizer state and updates every parameter (DDP).
    #[default]
    Replicated,
    /// ZeRO stage 1: gradients are reduce-scattered, each rank keeps optimizer state for and
    /// updates only its segment of each bucket, then parameters are all-gathered.
    Zero1,
    /// ZeRO stage 2: as ZeRO-1, and a bucket's full gradient exists only from the moment backward
    /// completes it until its reduce-scatter ends; between steps a rank holds only its segment of
    /// the averaged gradient (see the module doc, "ZeRO-2").
    Zero2,
}

/// Configuration of a [`DataParallel`] engine; must be the same on every rank.
#[derive(Clone, Debug, PartialEq)]
pub struct DpConfig {
    /// Most bytes per bucket (a larger parameter gets a bucket of its own).
    pub bucket_bytes_max: usize,
    /// Optimizer state placement.
    pub sharding: Sharding,
    /// Most collectives waiting for the communication thread; backward blocks beyond it.
    pub queue_depth: usize,
    /// Bound on one bucket collective, on top of the communicator's per-frame `op_timeout`.
    pub collective_timeout: Duration,
    /// Keep host parameters in the module and stage gradients through host mirror buckets, the
    /// path parameters on a device always take (see the module doc); for host models this only
    /// costs copies, and lets CPU tests run the device path's logic.
    pub host_staging: bool,
    /// Clip the averaged gradient to this L2 norm over the whole model before the optimizer
    /// steps (`None`: no clipping). Under ZeRO-1/2 too: the norm is the model's, not a segment's
    /// (see the module doc). An optimizer that clips inside its own `step` would see only this
    /// rank's segments under ZeRO; clip here instead.
    pub grad_clip: Option<f64>,
    /// Worker threads of the communication thread's tokio runtime, 1 to [`MAX_COMM_THREADS`]
    /// (default 1: a current-thread runtime). More than 1 lets a communicator whose
    /// `CommConfig::channels` splits large all-reduces run each ring on its own thread; set it
    /// to the channel count. Only [`DataParallel::new`] (and FSDP's constructor) has such a
    /// thread; the inline and device paths ignore it.
    pub comm_threads: usize,
}

/// Most worker threads [`DpConfig::comm_threads`] may ask for: one per channel of the largest
/// channel count the collectives take (`rtx_collectives::MAX_CHANNELS`).
pub const MAX_COMM_THREADS: usize = rtx_collectives::MAX_CHANNELS;
// The validation message names the bound.
const _: () = assert!(MAX_COMM_THREADS == 16);

/// Refuses a communication-thread count outside 1 to [`MAX_COMM_THREADS`] (DP and FSDP configs).
pub(crate) fn validate_comm_threads(comm_threads: usize) -> Result<()> {
    if (1..=MAX_COMM_THREADS).contains(&comm_threads) {
        Ok(())
    } else {
        Err(Error::InvalidConfig { reason: "comm_threads must be from 1 to 16" })
    }
}

/// What one step did.
#[derive(Clone, Debug, PartialEq)]
pub struct StepStats {
    /// The step's index (0 for the first step of this engine).
    pub step: u64,
    /// This rank's loss (before averaging; the caller can all-reduce it if needed).
    pub loss: f64,
    /// Number of buckets.
    pub n_buckets: usize,
    /// Buckets whose gradient collective began before backward had returned.
    pub overlapped_buckets: usize,
    /// Buckets handed over only after backward because some parameter in them was unused.
    pub flushed_buckets: usize,
    /// The averaged gradient's norm over the whole model before clipping, when
    /// [`DpConfig::grad_clip`] is set (the same on every rank).
    pub grad_norm: Option<f64>,
}

/// One rank of a data-parallel group: model, flat buckets, optimizer and communication thread.
pub struct DataParallel<M, O> {
    model: M,
    buckets: ParamBuckets,
    updater: Updater<O>,
    params_per_bucket: Vec<usize>,
    config: DpConfig,
    steps: u64,
    failed_step: Option<u64>,
    reducer: Reducer,
    /// The host mirror, when the parameters stay in the module (on a device).
    staging: Option<Staging>,
    /// The per-step timeline of the first steps, when asked for ([`DataParallel::trace_steps`]).
    trace: Option<StepTrace>,
}

/// Who runs the optimizer step: this engine over whole parameters, or this rank's ZeRO-1/2 shard.
enum Updater<O> {
    Replicated { optimizer: O, slices: Vec<ParamSlice> },
    Sharded(ParamShard<O>),
}

/// Counts pending parameters per bucket during one backward and says which buckets may be handed
/// over: strictly in index order, each once. Plain data, no IO.
#[derive(Clone, Debug)]
pub(crate) struct BucketTracker {
    pending: Vec<usize>,
    next: usize,
}

impl Default for DpConfig {
    fn default() -> Self {
        DpConfig {
            bucket_bytes_max: DEFAULT_BUCKET_BYTES_MAX,
            sharding: Sharding::Replicated,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            collective_timeout: DEFAULT_COLLECTIVE_TIMEOUT,
            host_staging: false,
            grad_clip: None,
            comm_threads: 1,
        }
    }
}

impl DpConfig {
    /// Checks the values.
    pub fn validate(&self) -> Result<()> {
        if self.bucket_bytes_max == 0 {
            return Err(Error::InvalidConfig { reason: "bucket_bytes_max must be positive" });
        }
        if self.queue_depth == 0 {
            return Err(Error::InvalidConfig { reason: "queue_depth must be positive" });
        }
        if self.collective_timeout.is_zero() {
            return Err(Error::InvalidConfig { reason: "collective_timeout must be positive" });
        }
        validate_comm_threads(self.comm_threads)?;
        crate::clip::validate(self.grad_clip)
    }
}

impl<M: Module, O: Optimizer> DataParallel<M, O> {
    /// Buckets `model`'s parameters, starts the communication thread and forms the communicator
    /// there with `connect`, broadcasts group rank 0's parameters, and builds the optimizer with
    /// `make_optimizer` over the [`ParamSlice`]s this rank updates (whole parameters, or its
    /// ZeRO-1 segments; [`crate::adamw`] is a ready factory).
    ///
    /// `connect` runs inside the communication thread's tokio runtime, so an
    /// `Endpoint::new(transport, config)?.world()` made there is driven by that thread. A
    /// communicator formed elsewhere works too (`move || Ok(comm)`) if the runtime that runs its
    /// endpoint keeps running. Collective: every rank of the group must construct its engine.
    pub fn new<C, F>(mut model: M, config: DpConfig, connect: C, make_optimizer: F) -> Result<Self>
    where
        C: FnOnce() -> rtx_collectives::Result<Communicator> + Send + 'static,
        F: FnOnce(&[ParamSlice]) -> rtx_tensor::Result<O>,
    {
        config.validate()?;
        let (buckets, staging) = Self::layout(&mut model, &config)?;
        let reducer = Reducer::spawn(connect, config.queue_depth, config.collective_timeout, config.comm_threads)?;
        block_on(Self::build(model, buckets, staging, config, reducer, make_optimizer))
    }

    /// Like [`new`](Self::new) without a communication thread: every collective runs on the
    /// calling task (see the module doc's "Inline mode"). Use [`step_async`](Self::step_async).
    pub async fn new_inline<F>(mut model: M, config: DpConfig, comm: Communicator, make_optimizer: F) -> Result<Self>
    where
        F: FnOnce(&[ParamSlice]) -> rtx_tensor::Result<O>,
    {
        config.validate()?;
        let (buckets, staging) = Self::layout(&mut model, &config)?;
        let reducer = Reducer::inline(comm, config.collective_timeout);
        Self::build(model, buckets, staging, config, reducer, make_optimizer).await
    }

    /// A replicated engine whose gradients are reduced where the parameters are: per bucket, the
    /// gradients are packed into one flat tensor on the parameters' device and averaged there by
    /// `reduce` (NCCL when every member has its own GPU; the host communicator standing in on the
    /// CPU), then handed back as the parameters' gradients. The opening broadcast of group rank
    /// 0's parameters goes through `reduce` too. See the module doc, "Reduction on the device".
    ///
    /// Like [`new_inline`](Self::new_inline) there is no communication thread: the collectives run
    /// on the task that awaits [`step_async`](Self::step_async), inside a tokio runtime (which
    /// must also drive `reduce`'s communicator). `config.host_staging` is ignored: the parameters
    /// stay in the module whatever their device. Refused with a typed error: ZeRO sharding
    /// ([`Error::ShardedDeviceReduce`]), parameters on several devices ([`Error::MixedDevices`]),
    /// a reducer on another device than the parameters ([`Error::ReducerDevice`]), and a group
    /// whose members' reducers disagree on its size ([`Error::ReducerWorld`], found by a small
    /// opening collective). Collective: every rank of the group must construct its engine.
    pub async fn with_device_reduce<R, F>(model: M, config: DpConfig, reduce: R, make_optimizer: F) -> Result<Self>
    where
        R: DeviceReduce + 'static,
        F: FnOnce(&[ParamSlice]) -> rtx_tensor::Result<O>,
    {
        config.validate()?;
        if config.sharding != Sharding::Replicated {
            return Err(Error::ShardedDeviceReduce { sharding: config.sharding });
        }
        let device = staging::placement(&model.named_parameters())?;
        if device != reduce.device() {
            return Err(Error::ReducerDevice { params: device, reducer: reduce.device() });
        }
        check_world(&reduce, config.collective_timeout).await?;
        let staging = Staging::new(&model, config.bucket_bytes_max)?;
        debug_assert_eq!(staging.device(), device, "staging: the mirror's device is the model's");
        let buckets = staging.buckets().clone();
        let reducer = Reducer::device(Box::new(reduce));
        Self::build(model, buckets, Some(staging), config, reducer, make_optimizer).await
    }

    /// Host parameters move into buckets; parameters on a device (or with `host_staging`) stay
    /// and get a host mirror.
    fn layout(model: &mut M, config: &DpConfig) -> Result<(ParamBuckets, Option<Staging>)> {
        let device = staging::placement(&model.named_parameters())?;
        if device == Device::Cpu && !config.host_staging {
            return Ok((ParamBuckets::new(model, config.bucket_bytes_max)?, None));
        }
        let staging = Staging::new(model, config.bucket_bytes_max)?;
        debug_assert_eq!(staging.device(), device, "staging: the mirror's device is the model's");
        Ok((staging.buckets().clone(), Some(staging)))
    }

    async fn build<F>(model: M, buckets: ParamBuckets, staging: Option<Staging>, config: DpConfig, reducer: Reducer, make_optimizer: F) -> Result<Self>
    where
        F: FnOnce(&[ParamSlice]) -> rtx_tensor::Result<O>,
    {
        if let Some((bucket, b)) = buckets.buckets().iter().enumerate().find(|(_, b)| !b.dtype().is_float()) {
            return Err(Error::UnsupportedDType { bucket, dtype: b.dtype() });
        }
        let mut params_per_bucket = vec![0; buckets.buckets().len()];
        for entry in buckets.entries() {
            params_per_bucket[entry.bucket] += 1;
        }
        // Replicas start from rank 0's parameters, before any optimizer sees them.
        match (reducer.device_reduce(), &staging) {
            (Some(reduce), Some(staging)) => broadcast_in_place(reduce, staging, config.collective_timeout).await?,
            (Some(_), None) => return Err(Error::InvalidConfig { reason: "device reduction without a bucket layout" }),
            (None, _) => {
                let broadcasts = (0..buckets.buckets().len()).map(|bucket| Job {
                    step: 0,
                    bucket,
                    op: BucketOp::Broadcast { params: buckets.buckets()[bucket].param_storage().clone() },
                });
                run_jobs(&reducer, 0, broadcasts).await?;
                if let Some(staging) = &staging {
                    staging.install_params()?;
                }
            }
        }
        let updater = match config.sharding {
            Sharding::Replicated => {
                let slices = match &staging {
                    Some(staging) => staging.slices(),
                    None => shard::whole_slices(&buckets),
                };
                let optimizer = make_optimizer(&slices)?;
                check_optimizer_params(&optimizer, &slices)?;
                Updater::Replicated { optimizer, slices }
            }
            // After the broadcast: the shard copies this rank's segments of rank 0's parameters
            // (staged: from the mirror, onto the parameters' device).
            Sharding::Zero1 | Sharding::Zero2 => Updater::Sharded(match &staging {
                None => ParamShard::new(&buckets, reducer.rank(), reducer.size(), make_optimizer)?,
                Some(staging) => ParamShard::new_on(staging.device(), &buckets, reducer.rank(), reducer.size(), make_optimizer)?,
            }),
        };
        if config.sharding == Sharding::Zero2 {
            // ZeRO-2 keeps no full gradient between steps; backward makes fresh leaf gradients.
            release_grads(&buckets)?;
        }
        Ok(DataParallel { model, buckets, updater, params_per_bucket, config, steps: 0, failed_step: None, reducer, staging, trace: None })
    }

    /// Runs one training step: `forward(model)` returns the loss of this rank's batch (a mean over
    /// it, for gradients that average to the global batch's), then backward with bucketed
    /// gradient averaging overlapped, the optimizer, and under ZeRO-1 the parameter all-gather.
    /// Collective: every rank must call it. Blocks the calling thread for the whole step (compute
    /// and communication); from async code, run it with `spawn_blocking`.
    pub fn step(&mut self, forward: impl FnOnce(&mut M) -> rtx_tensor::Result<Tensor>) -> Result<StepStats> {
        block_on(self.step_async(forward))
    }

    /// [`step`](Self::step) as a future. With a communication thread it still blocks the calling
    /// thread while it waits for reports; an inline engine runs its collectives on this task.
    pub async fn step_async(&mut self, forward: impl FnOnce(&mut M) -> rtx_tensor::Result<Tensor>) -> Result<StepStats> {
        if let Some(failed_step) = self.failed_step {
            return Err(Error::Broken { failed_step });
        }
        let step = self.steps;
        let span = tracing::debug_span!("dp_step", step, rank = self.reducer.rank());
        self.steps += 1;
        // Marked failed until it succeeds, so a step that panicked (leaving reports of its
        // collectives unread) also leaves the engine refusing further steps.
        self.failed_step = Some(step);
        let result = tracing::Instrument::instrument(self.run_step(step, forward), span).await;
        match &result {
            Ok(_) => self.failed_step = None,
            // A stale generation is the supervisor's abort; the worker runtime reports it once.
            Err(error @ Error::Collective { source: rtx_collectives::Error::StaleGeneration { .. }, .. }) => {
                tracing::debug!(step, %error, "data-parallel step failed")
            }
            Err(error) => tracing::warn!(step, %error, "data-parallel step failed"),
        }
        result
    }

    /// Records the timeline of the next `steps` steps (forward, backward, each bucket's
    /// collective, the optimizer; for staged device parameters also each bucket's download and
    /// the upload, as host-side spans), read back with
    /// [`DataParallel::trace`].
    pub fn trace_steps(&mut self, steps: u64) {
        self.trace = Some(StepTrace::new(steps));
    }

    /// The recorded step timeline, if [`DataParallel::trace_steps`] asked for one.
    pub fn trace(&self) -> Option<&StepTrace> {
        self.trace.as_ref()
    }

    /// The model (its parameters are views into the buckets).
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The model, mutably (to switch training mode). Replacing a parameter tensor detaches it
    /// from its bucket and from data parallelism; write values in place instead.
    pub fn model_mut(&mut self) -> &mut M {
        &mut self.model
    }

    /// The flat buckets.
    pub fn buckets(&self) -> &ParamBuckets {
        &self.buckets
    }

    /// The optimizer (under ZeRO-1, the one this rank's [`ParamShard`] owns).
    pub fn optimizer(&self) -> &O {
        match &self.updater {
            Updater::Replicated { optimizer, .. } => optimizer,
            Updater::Sharded(shard) => shard.optimizer(),
        }
    }

    /// The optimizer, mutably (to set the learning rate; it must be the same on every rank).
    pub fn optimizer_mut(&mut self) -> &mut O {
        match &mut self.updater {
            Updater::Replicated { optimizer, .. } => optimizer,
            Updater::Sharded(shard) => shard.optimizer_mut(),
        }
    }

    /// Under ZeRO-1, this rank's parameter shard (its segments, optimizer and next step).
    pub fn param_shard(&self) -> Option<&ParamShard<O>> {
        match &self.updater {
            Updater::Replicated { .. } => None,
            Updater::Sharded(shard) => Some(shard),
        }
    }

    /// Counters of the communication thread.
    pub fn monitor(&self) -> CommMonitor {
        self.reducer.monitor().clone()
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.reducer.rank()
    }

    /// Number of ranks in the group.
    pub fn world_size(&self) -> usize {
        self.reducer.size()
    }

    /// The configuration.
    pub fn config(&self) -> &DpConfig {
        &self.config
    }

    /// Steps started so far (successful or not).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The step that failed and made the engine unusable, if any.
    pub fn failed_step(&self) -> Option<u64> {
        self.failed_step
    }

    /// What this rank's optimizer updates, in parameter order: whole parameters, or under ZeRO-1
    /// the parts of them in this rank's segments. After a step each slice's `.grad()` is the
    /// gradient averaged over the group (under ZeRO-1 only these parts are averaged locally).
    pub fn param_slices(&self) -> &[ParamSlice] {
        match &self.updater {
            Updater::Replicated { slices, .. } => slices,
            Updater::Sharded(shard) => shard.slices(),
        }
    }

    /// Bytes this rank holds now (call it between steps), counted from the live storages:
    /// buckets, the ZeRO-1/2 shard's segments and the optimizer state. `grads_peak_bytes` is
    /// every bucket's gradient (ZeRO-2: an upper bound; leaf gradients wait for their bucket).
    pub fn memory(&self) -> Result<crate::memory::MemoryPerRank> {
        let bytes = |s: &rtx_tensor::Storage, dtype: rtx_tensor::DType| s.len() * dtype.size_in_bytes();
        let (mut params_bytes, mut grads_bytes, mut grads_peak_bytes) = (0, 0, 0);
        for b in self.buckets.buckets() {
            params_bytes += bytes(b.param_storage(), b.dtype());
            grads_bytes += bytes(b.grad_storage(), b.dtype());
            grads_peak_bytes += b.size_bytes();
        }
        if let Updater::Sharded(shard) = &self.updater {
            let (shard_params, shard_grads) = shard.bytes();
            params_bytes += shard_params;
            grads_bytes += shard_grads;
        }
        let optimizer_bytes = crate::memory::optimizer_bytes(self.optimizer())?;
        Ok(crate::memory::MemoryPerRank { params_bytes, grads_bytes, optimizer_bytes, gathered_peak_bytes: 0, grads_peak_bytes })
    }

    /// Under ZeRO-1, the element range of each bucket this rank owns.
    pub fn owned_segments(&self) -> Option<Vec<Range<usize>>> {
        self.param_shard().map(ParamShard::segments)
    }

    /// Stops the communication thread and returns the model (still holding bucket views), the
    /// buckets and the optimizer.
    pub fn into_parts(self) -> (M, ParamBuckets, O) {
        let DataParallel { model, buckets, updater, reducer, .. } = self;
        drop(reducer);
        let optimizer = match updater {
            Updater::Replicated { optimizer, .. } => optimizer,
            Updater::Sharded(shard) => shard.into_optimizer(),
        };
        (model, buckets, optimizer)
    }

    /// Where the parameters live (the host, unless they stay on a device).
    pub fn device(&self) -> Device {
        self.staging.as_ref().map_or(Device::Cpu, Staging::device)
    }

    /// Whether the parameters stay in the module (a model on a device, or
    /// [`DpConfig::host_staging`]) rather than in the engine's buckets: then the optimizer updates
    /// the module's own tensors and outlives the engine unchanged.
    pub fn params_in_place(&self) -> bool {
        self.staging.is_some()
    }

    async fn run_step(&mut self, step: u64, forward: impl FnOnce(&mut M) -> rtx_tensor::Result<Tensor>) -> Result<StepStats> {
        if self.reducer.device_reduce().is_some() {
            return self.run_device_step(step, forward).await;
        }
        if self.staging.is_some() {
            return self.run_staged_step(step, forward).await;
        }
        let zero2 = self.config.sharding == Sharding::Zero2;
        let views = if zero2 {
            release_grads(&self.buckets)?;
            self.buckets.named_parameters().into_iter().map(|(_, v)| v).collect()
        } else {
            self.buckets.bind_grads()?;
            self.buckets.zero_grad()?;
            Vec::new()
        };
        let traced = self.trace.as_ref().is_some_and(StepTrace::recording);
        let forward_began = Instant::now();
        let loss = forward(&mut self.model)?;
        let backward_began = Instant::now();
        if loss.numel() != 1 {
            return Err(Error::NonScalarLoss { shape: loss.shape().to_vec() });
        }
        let loss_value = loss.item()?;
        let n_buckets = self.buckets.buckets().len();

        let mut tracker = BucketTracker::new(self.params_per_bucket.clone());
        let mut submitted = 0;
        let mut submit_error = None;
        let monitor = self.reducer.monitor().clone();
        monitor.set_backward_running(true);
        let backward = {
            let shard = match &self.updater {
                Updater::Replicated { .. } => None,
                Updater::Sharded(shard) => Some(shard),
            };
            let (buckets, reducer) = (&self.buckets, &self.reducer);
            let mut hand_over = |bucket: usize| {
                if zero2 && submit_error.is_none() {
                    if let Err(e) = materialise_grads(buckets, &views, bucket) {
                        submit_error = Some(e);
                    }
                }
                if submit_error.is_none() {
                    match reducer.submit(gradient_job(step, bucket, buckets, shard, zero2)) {
                        Ok(()) => submitted += 1,
                        Err(e) => submit_error = Some(e),
                    }
                }
            };
            let result = loss.backward_with(|leaf| {
                if let Some(bucket) = buckets.bucket_of(leaf) {
                    tracker.param_ready(bucket).for_each(&mut hand_over);
                }
            });
            monitor.set_backward_running(false);
            let handed_during_backward = tracker.handed_over();
            if result.is_ok() {
                tracker.flush().for_each(&mut hand_over);
            }
            result.map(|()| handed_during_backward)
        };
        let wait_began = Instant::now();
        // Every submitted bucket comes back before anything else is decided.
        let reports = wait_reports(&self.reducer, step, submitted, if traced { self.trace.as_mut() } else { None }).await;
        let optimizer_began = Instant::now();
        let handed_during_backward = backward?;
        if let Some(e) = submit_error {
            return Err(e);
        }
        let overlapped_buckets = reports?;
        debug_assert_eq!(submitted, n_buckets, "every bucket is reduced once per step");

        let grad_norm = match (&mut self.updater, self.config.grad_clip) {
            (_, None) => None,
            (Updater::Replicated { slices, .. }, Some(max)) => Some(clip_whole(slices, max)?),
            // The norm's collective is numbered one past the last bucket.
            (Updater::Sharded(shard), Some(max)) => Some(crate::clip::clip_segments(&self.reducer, step, n_buckets, shard, max).await?),
        };
        match &mut self.updater {
            Updater::Replicated { optimizer, .. } => optimizer.step()?,
            Updater::Sharded(shard) => {
                // The reduce-scatter left the averaged gradients in the shard's own segments.
                shard.apply_reduced(step)?;
                shard.write_into(&self.buckets)?;
                gather_params(&self.reducer, &self.buckets, shard.segments(), step).await?;
            }
        }
        if let Some(trace) = self.trace.as_mut().filter(|_| traced) {
            let ended = Instant::now();
            trace.record("forward", COMPUTE_TID, step, None, forward_began, backward_began);
            trace.record("backward", COMPUTE_TID, step, None, backward_began, wait_began);
            trace.record("gradient wait", COMPUTE_TID, step, None, wait_began, optimizer_began);
            trace.record("optimizer", COMPUTE_TID, step, None, optimizer_began, ended);
            trace.step_done();
        }
        Ok(StepStats { step, loss: loss_value, n_buckets, overlapped_buckets, flushed_buckets: n_buckets - handed_during_backward, grad_norm })
    }
}

/// A host-side span of a step: what, which bucket, began, ended.
type HostSpan = (&'static str, Option<usize>, Instant, Instant);

/// Forward and backward of a model whose parameters stay in place (the staged and the device
/// paths): clears the gradients, runs both and records them as host-side spans. Returns the
/// loss detached and not read back: a read between forward and backward would stall the host
/// until the forward ran, and the device until the host queued backward's first kernels, so it
/// is read once the step's work is queued.
fn forward_backward_in_place<M: Module>(
    staging: &Staging,
    model: &mut M,
    forward: impl FnOnce(&mut M) -> rtx_tensor::Result<Tensor>,
    spans: &mut Vec<HostSpan>,
) -> Result<Tensor> {
    let forward_began = Instant::now();
    staging.clear_grads()?;
    let loss = forward(model)?;
    if loss.numel() != 1 {
        return Err(Error::NonScalarLoss { shape: loss.shape().to_vec() });
    }
    let loss_value = loss.detach();
    let backward_began = Instant::now();
    loss.backward()?;
    drop(loss);
    spans.push(("forward", None, forward_began, backward_began));
    spans.push(("backward", None, backward_began, Instant::now()));
    Ok(loss_value)
}

/// Writes a step's host-side spans into `trace` (given when it records this step) and closes
/// the step there.
fn record_host_spans(trace: Option<&mut StepTrace>, step: u64, spans: Vec<HostSpan>) {
    if let Some(trace) = trace {
        for (name, bucket, began, ended) in spans {
            trace.record(name, COMPUTE_TID, step, bucket, began, ended);
        }
        trace.step_done();
    }
}

impl<M: Module, O: Optimizer> DataParallel<M, O> {
    /// A step of staged parameters (see the module doc, "Parameters on a device").
    async fn run_staged_step(&mut self, step: u64, forward: impl FnOnce(&mut M) -> rtx_tensor::Result<Tensor>) -> Result<StepStats> {
        let Some(staging) = self.staging.as_ref() else { return Err(Error::InvalidConfig { reason: "staged step without a host mirror" }) };
        let traced = self.trace.as_ref().is_some_and(StepTrace::recording);
        // (Host-side spans: on a device, forward and backward are the time to queue their
        // kernels; the first download waits for the device to finish them.)
        let mut spans: Vec<HostSpan> = Vec::new();
        let loss_value = forward_backward_in_place(staging, &mut self.model, forward, &mut spans)?;
        let n_buckets = self.buckets.buckets().len();
        if let (1, Updater::Replicated { optimizer, slices }) = (self.reducer.size(), &mut self.updater) {
            // A group of one: the gradients are their own average; nothing to copy or reduce.
            // (A sharded group of one runs the collectives below, copies at one rank, as the
            // bucket path's ZeRO does.)
            let grad_norm = self.config.grad_clip.map(|max| clip_whole(slices, max)).transpose()?;
            optimizer.step()?;
            return Ok(StepStats { step, loss: loss_value.item()?, n_buckets, overlapped_buckets: 0, flushed_buckets: 0, grad_norm });
        }
        let zero2 = self.config.sharding == Sharding::Zero2;
        // Bucket i is reduced by the communication thread while bucket i + 1 is copied. (The
        // shard is borrowed in this block only: the step's future holds no `&O` across an await,
        // so it is `Send` for any `Send` optimizer.)
        let (submitted, failure) = {
            let shard = match &self.updater {
                Updater::Replicated { .. } => None,
                Updater::Sharded(shard) => Some(shard),
            };
            let mut submitted = 0;
            let mut failure = None;
            for bucket in 0..n_buckets {
                let began = Instant::now();
                let handed = download_staged(staging, &self.buckets, bucket, zero2)
                    .and_then(|()| self.reducer.submit(gradient_job(step, bucket, &self.buckets, shard, zero2)));
                spans.push(("download", Some(bucket), began, Instant::now()));
                match handed {
                    Ok(()) => submitted += 1,
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            }
            (submitted, failure)
        };
        let wait_began = Instant::now();
        let reports = wait_reports(&self.reducer, step, submitted, if traced { self.trace.as_mut() } else { None }).await;
        if let Some(e) = failure {
            return Err(e);
        }
        reports?;
        let grad_norm = match &mut self.updater {
            Updater::Replicated { optimizer, slices } => {
                let upload_began = Instant::now();
                spans.push(("gradient wait", None, wait_began, upload_began));
                staging.upload_grads()?;
                let optimizer_began = Instant::now();
                spans.push(("upload", None, upload_began, optimizer_began));
                let grad_norm = self.config.grad_clip.map(|max| clip_whole(slices, max)).transpose()?;
                optimizer.step()?;
                spans.push(("optimizer", None, optimizer_began, Instant::now()));
                grad_norm
            }
            Updater::Sharded(shard) => {
                // The reduce-scatters left this rank's averaged segments in the shard's host
                // landing segments: clipped there (the host shard's arithmetic), uploaded by
                // the shard, stepped on the device, and the updated segments come back into the
                // mirror for the all-gather (see the module doc, "ZeRO on staged parameters").
                let optimizer_began = Instant::now();
                spans.push(("gradient wait", None, wait_began, optimizer_began));
                let grad_norm = match self.config.grad_clip {
                    None => None,
                    // The norm's collective is numbered one past the last bucket.
                    Some(max) => Some(crate::clip::clip_segments(&self.reducer, step, n_buckets, shard, max).await?),
                };
                shard.apply_reduced(step)?;
                shard.write_into(&self.buckets)?;
                let gather_began = Instant::now();
                spans.push(("optimizer", None, optimizer_began, gather_began));
                gather_params(&self.reducer, &self.buckets, shard.segments(), step).await?;
                let install_began = Instant::now();
                spans.push(("all_gather", None, gather_began, install_began));
                staging.install_params()?;
                spans.push(("install", None, install_began, Instant::now()));
                grad_norm
            }
        };
        // Read once the step's work is queued: the device has run it.
        let loss = loss_value.item()?;
        record_host_spans(self.trace.as_mut().filter(|_| traced), step, spans);
        Ok(StepStats { step, loss, n_buckets, overlapped_buckets: 0, flushed_buckets: 0, grad_norm })
    }
}

impl<M: Module, O: Optimizer> DataParallel<M, O> {
    /// A step of the device path (see the module doc, "Reduction on the device").
    async fn run_device_step(&mut self, step: u64, forward: impl FnOnce(&mut M) -> rtx_tensor::Result<Tensor>) -> Result<StepStats> {
        let (Some(staging), Some(reduce)) = (self.staging.as_ref(), self.reducer.device_reduce()) else {
            return Err(Error::InvalidConfig { reason: "device step without a bucket layout and a device reducer" });
        };
        let traced = self.trace.as_ref().is_some_and(StepTrace::recording);
        // Host-side spans, as on the staged path: on a device they time the queueing of work.
        let mut spans: Vec<HostSpan> = Vec::new();
        let loss_value = forward_backward_in_place(staging, &mut self.model, forward, &mut spans)?;
        let n_buckets = self.buckets.buckets().len();
        // A group of one: the gradients are their own average (as on the staged path).
        if reduce.size() > 1 {
            // One bucket at a time, in index order, on every rank.
            for bucket in 0..n_buckets {
                let began = Instant::now();
                let flat = staging.pack_grads(bucket)?;
                bounded_device(self.config.collective_timeout, step, bucket, "all_reduce", reduce.all_reduce_avg(&flat)).await?;
                staging.unpack_grads(bucket, &flat)?;
                spans.push(("all_reduce", Some(bucket), began, Instant::now()));
            }
        }
        let optimizer_began = Instant::now();
        let grad_norm = match &mut self.updater {
            Updater::Replicated { optimizer, slices } => {
                let grad_norm = self.config.grad_clip.map(|max| clip_whole(slices, max)).transpose()?;
                optimizer.step()?;
                grad_norm
            }
            Updater::Sharded(_) => return Err(Error::ShardedDeviceReduce { sharding: self.config.sharding }),
        };
        let loss = loss_value.item()?;
        spans.push(("optimizer", None, optimizer_began, Instant::now()));
        record_host_spans(self.trace.as_mut().filter(|_| traced), step, spans);
        Ok(StepStats { step, loss, n_buckets, overlapped_buckets: 0, flushed_buckets: 0, grad_norm })
    }
}

impl<M, O> std::fmt::Debug for DataParallel<M, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataParallel")
            .field("rank", &self.reducer.rank())
            .field("world_size", &self.reducer.size())
            .field("n_buckets", &self.buckets.buckets().len())
            .field("config", &self.config)
            .field("steps", &self.steps)
            .field("failed_step", &self.failed_step)
            .finish_non_exhaustive()
    }
}

impl BucketTracker {
    /// A tracker for buckets holding `pending[i]` parameters each.
    pub(crate) fn new(pending: Vec<usize>) -> Self {
        BucketTracker { pending, next: 0 }
    }

    /// One parameter of `bucket` is complete; returns the buckets that may be handed over now.
    pub(crate) fn param_ready(&mut self, bucket: usize) -> Range<usize> {
        debug_assert!(self.pending[bucket] > 0, "tracker: a parameter is reported once");
        self.pending[bucket] = self.pending[bucket].saturating_sub(1);
        let start = self.next;
        while self.next < self.pending.len() && self.pending[self.next] == 0 {
            self.next += 1;
        }
        start..self.next
    }

    /// How many buckets have been handed over.
    pub(crate) fn handed_over(&self) -> usize {
        self.next
    }

    /// Backward is over: every bucket not handed over yet (some of its parameters were unused).
    pub(crate) fn flush(&mut self) -> Range<usize> {
        let start = self.next;
        self.next = self.pending.len();
        start..self.next
    }
}

/// Receives `n` reports (all of them, even after a failure, so every buffer is back) and returns
/// how many began during backward, or the first failure.
pub(crate) async fn wait_reports(reducer: &Reducer, step: u64, n: usize, mut trace: Option<&mut StepTrace>) -> Result<usize> {
    let mut first_failure = None;
    let mut during_backward = 0;
    for _ in 0..n {
        let Report { step: report_step, bucket, op, outcome, during_backward: during, ran } = reducer.next_report().await?;
        if let (Some(trace), Some((began, ended))) = (trace.as_deref_mut(), ran) {
            trace.record(op, COMM_TID, step, Some(bucket), began, ended);
        }
        debug_assert_eq!(report_step, step, "reports arrive in submission order");
        during_backward += usize::from(during);
        if let (Err(failure), None) = (outcome, &first_failure) {
            first_failure = Some(match failure {
                Failure::Comm(source) => Error::Collective { step, bucket, op, source },
                Failure::TimedOut(timeout) => Error::CollectiveTimeout { step, bucket, op, timeout },
                Failure::Unsupported(dtype) => Error::UnsupportedDType { bucket, dtype },
                Failure::Skipped => Error::Broken { failed_step: step },
            });
        }
    }
    match first_failure {
        Some(e) => Err(e),
        None => Ok(during_backward),
    }
}

/// ZeRO-1/2: all-gathers every bucket's parameters from the owners' updated segments (which
/// `ParamShard::write_into` copied into this rank's buckets), so every replica ends the step with
/// the same bits. The same collectives for host buckets and for a staged mirror.
/// `segments` is the shard's [`ParamShard::segments`], taken before the await so that the future
/// holds no reference to the shard (whose optimizer need not be `Sync`).
async fn gather_params(reducer: &Reducer, buckets: &ParamBuckets, segments: Vec<Range<usize>>, step: u64) -> Result<()> {
    let storages = buckets.buckets();
    let gathers = segments.into_iter().enumerate().map(|(bucket, own)| Job {
        step,
        bucket,
        op: BucketOp::AllGather { params: storages[bucket].param_storage().clone(), own },
    });
    run_jobs(reducer, step, gathers).await
}

/// Submits `jobs` and waits for all their reports (stopping early only if the thread is gone).
pub(crate) async fn run_jobs(reducer: &Reducer, step: u64, jobs: impl Iterator<Item = Job>) -> Result<()> {
    let mut submitted = 0;
    let mut submit_error = None;
    for job in jobs {
        match reducer.submit(job) {
            Ok(()) => submitted += 1,
            Err(e) => {
                submit_error = Some(e);
                break;
            }
        }
    }
    wait_reports(reducer, step, submitted, None).await?;
    submit_error.map_or(Ok(()), Err)
}

/// Clips the averaged gradients of whole parameters (a replicated engine) by their norm, as
/// `rtx_tensor::optim::clip_grad_norm` over the optimizer's parameters; returns the norm.
fn clip_whole(slices: &[ParamSlice], max_norm: f64) -> Result<f64> {
    let params: Vec<Tensor> = slices.iter().map(|s| s.tensor.clone()).collect();
    Ok(rtx_tensor::optim::clip_grad_norm(&params, max_norm)?)
}

/// The gradient collective of `bucket`: an all-reduce, or under ZeRO-1 a reduce-scatter into the
/// shard's gradient segment.
fn gradient_job<O: Optimizer>(step: u64, bucket: usize, buckets: &ParamBuckets, shard: Option<&ParamShard<O>>, release: bool) -> Job {
    let grads = buckets.buckets()[bucket].grad_storage().clone();
    let op = match shard {
        None => BucketOp::AllReduce { grads },
        Some(shard) => BucketOp::ReduceScatter { grads, shard: shard.grad_storage(bucket).clone(), release },
    };
    Job { step, bucket, op }
}

/// ZeRO-2: empties every bucket's gradient storage and unbinds the parameters' gradient slots, so
/// backward accumulates each parameter's gradient into a fresh tensor of its own.
fn release_grads(buckets: &ParamBuckets) -> Result<()> {
    for (_, view) in buckets.named_parameters() {
        view.set_grad(None)?;
    }
    for bucket in buckets.buckets() {
        let mut data = bucket.grad_storage().write()?;
        *data = CpuData::zeros(bucket.dtype(), 0);
    }
    Ok(())
}

/// The staged path's download of bucket `bucket`'s gradients into the mirror. Under ZeRO-2 the
/// mirror's flat gradient is allocated first (the reduce-scatter of the last step freed it) and
/// the parameters' own gradients are released right after, so a full gradient of a bucket
/// exists on the device only until its download, and on the host only until its reduce-scatter.
fn download_staged(staging: &Staging, buckets: &ParamBuckets, bucket: usize, zero2: bool) -> Result<()> {
    if zero2 {
        let b = &buckets.buckets()[bucket];
        let mut data = b.grad_storage().write()?;
        debug_assert!(data.is_empty(), "zero2: a bucket's gradient is materialised once per step");
        *data = CpuData::zeros(b.dtype(), b.numel());
    }
    staging.download_bucket(bucket)?;
    if zero2 {
        staging.release_grads(bucket)?;
    }
    Ok(())
}

/// ZeRO-2: bucket `bucket` is complete; allocates its flat gradient, copies its parameters'
/// gradients in (zeros for a parameter the loss did not use) and drops theirs. The reduce-scatter
/// frees the flat buffer again once this rank's segment is averaged.
fn materialise_grads(buckets: &ParamBuckets, views: &[Tensor], bucket: usize) -> Result<()> {
    let b = &buckets.buckets()[bucket];
    let mut flat = CpuData::zeros(b.dtype(), b.numel());
    for &idx in b.entries() {
        let entry = &buckets.entries()[idx];
        let view = &views[idx];
        if let Some(grad) = view.grad() {
            let values = grad.to_dtype(b.dtype())?.to_data()?;
            debug_assert_eq!(values.len(), entry.numel, "zero2: a gradient has its parameter's size");
            flat.write_at(entry.offset, &values)?;
        }
        view.set_grad(None)?;
    }
    let mut data = b.grad_storage().write()?;
    debug_assert!(data.is_empty(), "zero2: a bucket's gradient is materialised once per step");
    *data = flat;
    Ok(())
}

/// Runs one device-reducer collective of bucket `bucket` within `timeout`; a failure names the
/// step and bucket as a host bucket collective's would.
async fn bounded_device(timeout: Duration, step: u64, bucket: usize, op: &'static str, collective: crate::device_reduce::ReduceFuture<'_>) -> Result<()> {
    match tokio::time::timeout(timeout, collective).await {
        Err(_) => Err(Error::CollectiveTimeout { step, bucket, op, timeout }),
        Ok(Err(Error::Group { op, source, .. })) => Err(Error::Collective { step, bucket, op, source }),
        Ok(result) => result,
    }
}

/// The device path's opening broadcast: bucket by bucket in index order, group rank 0's
/// parameter values into every rank's module, in place.
async fn broadcast_in_place(reduce: &dyn DeviceReduce, staging: &Staging, timeout: Duration) -> Result<()> {
    for bucket in 0..staging.buckets().buckets().len() {
        let flat = staging.pack_params(bucket)?;
        bounded_device(timeout, 0, bucket, "broadcast", reduce.broadcast(&flat, 0)).await?;
        staging.install_flat_params(bucket, &flat)?;
    }
    Ok(())
}

/// Checks, collectively, that every member's reducer reports the same group size: rank 0's size
/// is broadcast, then the members agreeing with it are counted by averaging a flag (1 or 0; the
/// average is exactly 1 only when all agree), so every rank reaches the same verdict. A rank not
/// below its own size is refused at once.
async fn check_world(reduce: &dyn DeviceReduce, timeout: Duration) -> Result<()> {
    let (rank, size) = (reduce.rank(), reduce.size());
    if rank >= size {
        return Err(Error::ReducerWorld { rank, size, root_size: None, agreeing: None });
    }
    // f32 holds every size below 2^24 exactly.
    debug_assert!(size < 1 << 24, "check_world: group sizes are f32-exact");
    let root = Tensor::from_vec(vec![size as f32], &[1])?.to_device(reduce.device())?;
    bounded_device(timeout, 0, 0, "broadcast", reduce.broadcast(&root, 0)).await?;
    let root_size = root.to_f32_vec()?[0] as usize;
    let flag = Tensor::from_vec(vec![f32::from(u8::from(root_size == size))], &[1])?.to_device(reduce.device())?;
    bounded_device(timeout, 0, 0, "all_reduce", reduce.all_reduce_avg(&flag)).await?;
    let agreed = flag.to_f32_vec()?[0];
    if agreed != 1.0 || root_size != size {
        let agreeing = (agreed * root_size as f32).round() as usize;
        return Err(Error::ReducerWorld { rank, size, root_size: Some(root_size), agreeing: Some(agreeing) });
    }
    Ok(())
}

const _: () = assert!(DEFAULT_QUEUE_DEPTH > 0 && DEFAULT_BUCKET_BYTES_MAX > 0);

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: a communication-thread count outside 1-16 is a typed error naming the range, in the DP
    // and the FSDP config alike; the bounds themselves are taken.
    #[test]
    fn comm_threads_outside_1_to_16_are_refused() {
        for bad in [0, MAX_COMM_THREADS + 1] {
            let dp = DpConfig { comm_threads: bad, ..DpConfig::default() }.validate();
            let fsdp = crate::FsdpConfig { comm_threads: bad, ..crate::FsdpConfig::default() }.validate();
            for err in [dp, fsdp] {
                assert!(matches!(err, Err(Error::InvalidConfig { reason }) if reason.contains("from 1 to 16")), "{bad}");
            }
        }
        for good in [1, MAX_COMM_THREADS] {
            assert!(DpConfig { comm_threads: good, ..DpConfig::default() }.validate().is_ok());
            assert!(crate::FsdpConfig { comm_threads: good, ..crate::FsdpConfig::default() }.validate().is_ok());
        }
    }

    // Goal: buckets go out in index order, each once, as soon as they and all before them are
    // complete. Method: feed readiness out of order.
    #[test]
    fn tracker_hands_over_in_order() {
        let mut t = BucketTracker::new(vec![2, 1, 1]);
        assert_eq!(t.param_ready(1), 0..0);
        assert_eq!(t.param_ready(0), 0..0);
        assert_eq!(t.param_ready(0), 0..2);
        assert_eq!(t.param_ready(2), 2..3);
        assert_eq!(t.flush(), 3..3);
    }

    // Goal: buckets with unused parameters are flushed after backward, in order.
    #[test]
    fn tracker_flushes_incomplete_buckets() {
        let mut t = BucketTracker::new(vec![1, 2, 1]);
        assert_eq!(t.param_ready(0), 0..1);
        assert_eq!(t.param_ready(2), 1..1);
        assert_eq!(t.flush(), 1..3);
    }
}
