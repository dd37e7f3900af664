//! The crate's error type: one enum whose variants name the failed operation and carry its facts
//! (step, bucket, collective), wrapping tensor and collective errors instead of stringifying them.

use std::ops::Range;
use std::time::Duration;

use rtx_kernels::{DType, Device};

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in a data-parallel engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Forward, backward, bucketing or the optimizer failed in `rtx-tensor`.
    #[error(transparent)]
    Tensor(#[from] rtx_tensor::Error),
    /// Forming the communicator failed (the `connect` closure returned an error).
    #[error("forming the communicator failed: {0}")]
    Connect(#[source] rtx_collectives::Error),
    /// A bucket's collective failed (peer lost, timeout, stale generation, mismatch).
    #[error("step {step}: {op} of bucket {bucket} failed: {source}")]
    Collective {
        /// The step (0-based count of steps started by this engine).
        step: u64,
        /// The bucket index.
        bucket: usize,
        /// `all_reduce`, `reduce_scatter` or `all_gather`.
        op: &'static str,
        /// What the communicator reported.
        #[source]
        source: rtx_collectives::Error,
    },
    /// A bucket's collective ran past [`crate::DpConfig::collective_timeout`] and was abandoned.
    #[error("step {step}: {op} of bucket {bucket} did not finish within {timeout:?}")]
    CollectiveTimeout {
        /// The step.
        step: u64,
        /// The bucket index.
        bucket: usize,
        /// The collective.
        op: &'static str,
        /// The configured bound.
        timeout: Duration,
    },
    /// An earlier step failed, so this rank's communicator is out of step with its peers; the group
    /// must be re-formed (a new engine on a communicator of a new generation).
    #[error("engine unusable since step {failed_step} failed; re-form the group")]
    Broken {
        /// The step that failed.
        failed_step: u64,
    },
    /// The communication thread or its runtime could not be started.
    #[error("could not start the communication thread: {0}")]
    CommThread(#[source] std::io::Error),
    /// The communication thread ended (it panicked or could not start).
    #[error("the communication thread of rank {rank} is gone")]
    ReducerGone {
        /// This engine's group rank (or `usize::MAX` before the group was formed).
        rank: usize,
    },
    /// A bucket holds a dtype collectives cannot reduce.
    #[error("bucket {bucket} has dtype {dtype}, which cannot be reduced")]
    UnsupportedDType {
        /// The bucket index.
        bucket: usize,
        /// Its dtype.
        dtype: DType,
    },
    /// The loss closure returned a tensor that is not a scalar.
    #[error("the loss must have one element, got shape {shape:?}")]
    NonScalarLoss {
        /// The shape returned.
        shape: Vec<usize>,
    },
    /// The optimizer built by the factory updates a tensor that is not one of the given slices.
    #[error("optimizer parameter {name} is not one of the parameter slices it was given")]
    ForeignOptimizerParam {
        /// The parameter's name in the optimizer.
        name: String,
    },
    /// A parameter shard was given a step that is not its next one (an old step replayed, or one
    /// skipped); nothing was applied.
    #[error("param shard expects step {expected}, got step {got}")]
    StaleStep {
        /// The shard's next step.
        expected: u64,
        /// The step given.
        got: u64,
    },
    /// A parameter shard was given the wrong number of segments (one per bucket is expected).
    #[error("param shard has {expected} segments, got {got}")]
    SegmentCount {
        /// The shard's number of segments (buckets).
        expected: usize,
        /// The number given.
        got: usize,
    },
    /// A segment given to a parameter shard does not have the owned length.
    #[error("param shard segment of bucket {bucket} has {expected} elements, got {got}")]
    SegmentLength {
        /// The bucket index.
        bucket: usize,
        /// The owned length.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// A segment given to a parameter shard does not have the bucket's dtype.
    #[error("param shard segment of bucket {bucket} is {expected}, got {got}")]
    SegmentDType {
        /// The bucket index.
        bucket: usize,
        /// The bucket's dtype.
        expected: DType,
        /// The dtype given.
        got: DType,
    },
    /// A shard state to import owns other elements of a bucket than this shard (another rank or
    /// group size).
    #[error("param shard owns elements {expected:?} of bucket {bucket}, the state holds {got:?}")]
    SegmentLayout {
        /// The bucket index.
        bucket: usize,
        /// This shard's range.
        expected: Range<usize>,
        /// The state's range.
        got: Range<usize>,
    },
    /// A shard state to import has optimizer state that does not fit this shard's optimizer.
    #[error("param shard optimizer state `{name}`: {reason}")]
    ShardStateMismatch {
        /// The state tensor's name.
        name: String,
        /// What is wrong (missing, extra, shape or dtype).
        reason: String,
    },
    /// A message to a spawned actor (a `ParamShard`) was not delivered or not answered.
    #[error(transparent)]
    Actor(#[from] rtx_actors::ActorError),
    /// A configuration value is out of range.
    #[error("invalid data-parallel configuration: {reason}")]
    InvalidConfig {
        /// What is wrong.
        reason: &'static str,
    },
    /// The model's parameters do not all live on one device.
    #[error("parameters on different devices: {first} on {first_device:?}, {other} on {other_device:?}; data parallelism needs every parameter of a replica on one device")]
    MixedDevices {
        /// The first parameter.
        first: String,
        /// Its device.
        first_device: Device,
        /// A parameter elsewhere.
        other: String,
        /// Its device.
        other_device: Device,
    },
    /// ZeRO-3 (FSDP) was asked for parameters on a device, or for the flat parameter segment of
    /// a shard whose slices live on a device: ZeRO-3 gathers host segments. (ZeRO-1/2 work on
    /// device parameters through host staging.)
    #[error("ZeRO-3 (FSDP) needs host parameters; they live on {device:?} (use ZeRO-1 or ZeRO-2)")]
    ShardedDevice {
        /// Where the parameters live.
        device: Device,
    },
    /// The device reduction path was asked for a sharded engine; it reduces whole replicated
    /// buckets only.
    #[error("device reduction supports replicated data parallelism only, not {sharding:?}")]
    ShardedDeviceReduce {
        /// The sharding asked for.
        sharding: crate::Sharding,
    },
    /// The device reducer works on another device than the model's parameters.
    #[error("the device reducer works on {reducer:?}, the parameters live on {params:?}")]
    ReducerDevice {
        /// Where the parameters live.
        params: Device,
        /// Where the reducer takes its flat tensors.
        reducer: Device,
    },
    /// The device reducer's group does not agree on its size: rank `rank` says `size`, group rank
    /// 0 says `root_size` (`None`: this rank's own claim is impossible, a rank not below the size),
    /// and `agreeing` of the group's members agree with rank 0.
    #[error("device reducer rank {rank} claims a group of {size}, rank 0 claims {root_size:?}; {agreeing:?} members agree with rank 0")]
    ReducerWorld {
        /// This rank, as the reducer reports it.
        rank: usize,
        /// The group size this rank's reducer reports.
        size: usize,
        /// The size group rank 0's reducer reports, when it could be asked.
        root_size: Option<usize>,
        /// How many members agree with rank 0, when they could be counted.
        agreeing: Option<usize>,
    },
    /// Staging a parameter's gradient through its host mirror failed a check.
    #[error("staging the gradient of {name}: {reason}")]
    Staging {
        /// The parameter.
        name: String,
        /// What did not fit.
        reason: String,
    },
    /// A pipeline or tensor-parallel group was driven from a tokio runtime thread; its blocking
    /// collectives must run on a compute thread of their own.
    #[error("{op} on the {role} group was called from a runtime thread; run the step on a compute thread")]
    BlockingOnRuntime {
        /// The collective.
        op: &'static str,
        /// The group (`pp`, `dp`, `tp`).
        role: &'static str,
    },
    /// A collective of a mesh group failed (peer lost, timeout, stale generation).
    #[error("{op} on the {role} group failed: {source}")]
    Group {
        /// The collective.
        op: &'static str,
        /// The group.
        role: &'static str,
        /// What the communicator reported.
        #[source]
        source: rtx_collectives::Error,
    },
    /// A tensor-parallel collective failed (peer lost, timeout, stale generation, mismatch); the
    /// group is unusable from now on.
    #[error("tensor-parallel {op} on rank {rank} of {size} failed: {source}")]
    TpCollective {
        /// The operation.
        op: &'static str,
        /// This rank in the tensor-parallel group.
        rank: usize,
        /// The group size.
        size: usize,
        /// What the communicator reported.
        #[source]
        source: rtx_collectives::Error,
    },
    /// The pipeline's schedule or messages are inconsistent (a message of the wrong size, kind or
    /// stage, or one waited for that no schedule sends).
    #[error("pipeline: {reason}")]
    Pipeline {
        /// What is wrong.
        reason: String,
    },
    /// Writing or reading a sharded checkpoint failed (the error names the file and tensor; boxed,
    /// it is the largest error of the crate).
    #[error(transparent)]
    Checkpoint(Box<rtx_tensor::checkpoint::sharded::ShardedError>),
    /// A collective sharded checkpoint was not completed: some member failed to write its part.
    #[error("sharded checkpoint of step {step} in {dir}: {failed} {what} failed, so the checkpoint has no index and is never loaded")]
    CheckpointIncomplete {
        /// The checkpoint directory.
        dir: String,
        /// The step it was to be taken after.
        step: u64,
        /// How many members failed.
        failed: usize,
        /// `shard writers` or `index writers`.
        what: &'static str,
    },
    /// A sharded checkpoint does not fit the model or optimizer loading it.
    #[error("sharded checkpoint of step {step}: {reason}")]
    CheckpointMismatch {
        /// The step it was taken after.
        step: u64,
        /// What does not fit.
        reason: String,
    },
    /// A mesh or schedule cannot be used.
    #[error(transparent)]
    Mesh(#[from] crate::mesh::MeshError),
    /// The schedule cannot be made.
    #[error(transparent)]
    Schedule(#[from] crate::schedule::ScheduleError),
    /// An earlier tensor-parallel collective failed, so this rank is out of step with its peers;
    /// re-form the group.
    #[error("tensor-parallel {op} refused on rank {rank}: an earlier collective of the group failed; re-form the group")]
    TpBroken {
        /// The operation refused.
        op: &'static str,
        /// This rank in the group.
        rank: usize,
    },
    /// A blocking tensor-parallel collective was called on a thread inside a tokio runtime (it
    /// must run on a compute thread).
    #[error("tensor-parallel {op} called on a tokio runtime thread; call it from a compute thread")]
    TpOnRuntimeThread {
        /// The operation.
        op: &'static str,
    },
    /// A tensor-parallel collective got buffers of inconsistent lengths.
    #[error("tensor-parallel {op}: buffer has {got} elements, expected {expected}")]
    TpBufferLength {
        /// The operation.
        op: &'static str,
        /// The length needed.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// A size that tensor parallelism splits is not a multiple of the group size.
    #[error("{what} {value} is not divisible by the tensor-parallel size {tp}")]
    TpIndivisible {
        /// What is split (`n_heads`, `vocab_size`, `mlp_hidden`, `sequence length`, ...).
        what: &'static str,
        /// Its size.
        value: usize,
        /// The number of parts.
        tp: usize,
    },
    /// A stage's layer range does not fit the model.
    #[error("stage layers {layers:?} do not fit a model of {n_layers} layers")]
    TpStagePart {
        /// The range asked for.
        layers: Range<usize>,
        /// The model's number of layers.
        n_layers: usize,
    },
    /// A stage was asked for a part of the model it does not hold.
    #[error("this stage (layers {layers:?}) does not hold the {what}")]
    TpMissingPart {
        /// `embedding`, `final norm` or `head`.
        what: &'static str,
        /// The stage's layers.
        layers: Range<usize>,
    },
    /// A full state could not be sliced into a tensor-parallel model.
    #[error("loading full parameter {name}: {reason}")]
    TpLoad {
        /// The parameter.
        name: String,
        /// What did not fit.
        reason: String,
    },
}

impl From<rtx_tensor::checkpoint::sharded::ShardedError> for Error {
    fn from(error: rtx_tensor::checkpoint::sharded::ShardedError) -> Error {
        Error::Checkpoint(Box::new(error))
    }
}
