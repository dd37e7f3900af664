//! `rtx-pipelines`: parallel strategies of rustytorch as topologies. Today: data parallelism.
//!
//! Start from [`DataParallel`]: one per rank, it owns a model whose parameters live in flat
//! buckets ([`rtx_tensor::optim::ParamBuckets`]), an optimizer and a communication thread holding
//! the rank's [`rtx_collectives::Communicator`]. [`DataParallel::step`] runs the caller's forward,
//! then backward while each completed gradient bucket is averaged across the group, then the
//! optimizer. [`Sharding::Zero1`] shards optimizer state and updates ZeRO-1 style, and
//! [`Sharding::Zero2`] keeps only this rank's segment of the gradients too, through the
//! rank's [`ParamShard`] (the ZeRO-1 role: owns its segments of the parameters and their optimizer
//! state; an [`rtx_actors::Actor`] with typed messages, export and import). The engine does
//! not pick batches, detect failures beyond what its collectives report, or recover: a failed step
//! leaves it [`Error::Broken`] for the supervisor to replace. Tensor, pipeline and federated
//! parallelism and the trainers are not written yet. Tensor parallelism (Megatron-style layers,
//! the TP form of the GPT) is in [`tp`]. ZeRO-3 / FSDP (parameters sharded too, gathered per
//! transformer block just ahead of use) is [`FsdpGpt`].

mod data_parallel;
mod error;
mod fsdp;
pub mod memory;
pub mod mesh;
pub mod pipeline;
mod param_shard;
mod reducer;
pub mod schedule;
mod shard;
mod staging;
pub mod tp;

pub use data_parallel::{DataParallel, DpConfig, Sharding, StepStats, DEFAULT_BUCKET_BYTES_MAX, DEFAULT_COLLECTIVE_TIMEOUT, DEFAULT_QUEUE_DEPTH};
pub use error::{Error, Result};
pub use fsdp::{gpt_unit_of, FsdpConfig, FsdpGpt, FsdpStats};
pub use memory::{MemoryPerRank, ZeroStage};
pub use mesh::{check_model, Axis, Coord, Mesh, MeshError, MeshGroups, MeshShape, ModelDims};
pub use param_shard::{ParamShard, ParamShardMsg, ShardState, PARAM_SHARD_MAILBOX};
pub use reducer::CommMonitor;
pub use schedule::{instructions, simulate, Costs, Instr, Op, ScheduleError, ScheduleKind, Timeline};
pub use shard::{adamw, named_slices, ParamSlice};
