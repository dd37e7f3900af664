//! `rtx-pipelines`: the parallel strategies of rustytorch as topologies — data parallelism
//! (DDP-style and ZeRO-1), tensor parallelism (Megatron-style), pipeline parallelism, and their
//! combination as a `(dp, pp, tp)` mesh.
//!
//! Data parallelism: [`DataParallel`], one per rank, owns a model whose parameters live in flat
//! buckets ([`rtx_tensor::optim::ParamBuckets`]), an optimizer and a communication thread holding
//! the rank's [`rtx_collectives::Communicator`]; [`DataParallel::step`] runs the caller's forward,
//! then backward while each completed gradient bucket is averaged across the group, then the
//! optimizer. [`Sharding::Zero1`] shards optimizer state and updates ZeRO-1 style, and
//! [`Sharding::Zero2`] keeps only this rank's segment of the gradients too, through the rank's
//! [`ParamShard`] (an [`rtx_actors::Actor`] with typed messages, export and import). ZeRO-3 /
//! FSDP (parameters sharded too, gathered per transformer block just ahead of use) is
//! [`FsdpGpt`]; [`memory`] counts each stage's bytes per rank. With one GPU per member,
//! [`DataParallel::with_device_reduce`] reduces the gradients where they are, through a
//! [`DeviceReduce`] (NCCL with the `nccl` feature, the host communicator standing in as
//! [`HostReduce`]).
//! Model parallelism: [`mesh`] (the mesh, coordinates, sub-communicators), [`schedule`] (GPipe,
//! 1F1B, interleaved, ZB-H1 as pure instruction lists, and a virtual-time simulator), [`tp`]
//! (tensor-parallel layers and the TP forms of the GPT and ViT) and [`pipeline`] (a member's
//! part of the model, `StageModule`, and `MeshEngine`, which runs one member's step of any schedule and
//! shape). [`Engine`] is the contract the worker runtime drives every one of them through, one
//! step at a time, without naming it. No engine picks batches, detects failures beyond what its
//! collectives report, or
//! recovers: a failed step is an error for the supervisor, which re-forms the group.

mod clip;
mod data_parallel;
mod device_reduce;
pub mod driver;
pub mod engine;
mod error;
mod fsdp;
pub mod memory;
pub mod mesh;
pub mod pipeline;
mod param_shard;
mod placement;
mod reducer;
pub mod schedule;
mod shard;
mod staging;
pub mod tp;
pub mod trace;

pub use data_parallel::{DataParallel, DpConfig, Sharding, StepStats, DEFAULT_BUCKET_BYTES_MAX, DEFAULT_COLLECTIVE_TIMEOUT, DEFAULT_QUEUE_DEPTH, MAX_COMM_THREADS};
pub use device_reduce::{DeviceReduce, HostReduce, ReduceFuture};
#[cfg(feature = "nccl")]
pub use device_reduce::NcclReduce;
pub use driver::{drive, ComputeDone, ComputeDriver, RuntimeDriver};
pub use engine::{DataShare, Duties, Engine, StepReport};
pub use error::{Error, Result};
pub use fsdp::{gpt_unit_of, FsdpConfig, FsdpGpt, FsdpStats};
pub use memory::{MemoryPerRank, ZeroStage};
pub use mesh::{check_model, Axis, Coord, Mesh, MeshError, MeshGroups, MeshShape, ModelDims};
pub use placement::Placement;
pub use param_shard::{ParamShard, ParamShardMsg, ShardState, PARAM_SHARD_MAILBOX};
pub use reducer::CommMonitor;
pub use schedule::{instructions, simulate, Costs, Instr, Op, ScheduleError, ScheduleKind, Timeline};
pub use shard::{adamw, named_slices, ParamSlice};
