//! Supervision for rustytorch: the elastic runtime that keeps training going when workers die.
//!
//! A job is a [`ClusterSupervisor`](supervisor) plus one node agent and worker per process
//! ([`worker::run_worker`]), started on this machine by the [`launch::Launcher`] (`rtx launch`) or
//! by a cluster's own launcher (`rtx supervisor` / `rtx worker`, with torchrun and Slurm
//! variables, [`env`](mod@env)). Workers join over an [`rtx_actors::Link`] by proving the cluster token
//! ([`protocol`]), receive rank certificates from the cluster CA, and train the [`TrainJob`] with
//! the data-parallel engine of `rtx-pipelines` over mutually authenticated QUIC collectives.
//! The supervisor detects crashes, hangs, network loss and preemption ([`FailureClass`]), and
//! re-forms the group under a new generation from the newest surviving state (never from less
//! than the newest durable state: [`recovery`]; for meshes of data, pipeline and tensor
//! parallelism, [`plan`] decides each member's coordinate, shards and their sources), shrinking,
//! replacing or growing as the [`ElasticConfig`] says. Rank 0 writes periodic checkpoints in the
//! background ([`checkpoint`]).
//!
//! Everything a node or the supervisor needs from the outside world is handed in, so the same
//! code runs in the deterministic simulator (`rtx-sim`): a [`NodeEnv`] ([`run_node`]: control
//! dialer, collectives wire, [`Exec`] mode), a [`SupervisorEnv`] (listener, seed) and a
//! [`NodeLauncher`].

pub mod checkpoint;
mod config;
pub mod decide;
pub mod env;
mod error;
mod job;
pub mod launch;
pub mod placement;
pub mod plan;
pub mod protocol;
pub mod recovery;
pub mod state;
pub mod supervisor;
pub mod worker;
pub mod zero1;
pub mod zero3;

pub use config::{ClassPolicy, DataTransport, DpSharding, ElasticConfig, FailureClass, MeshModel, OnFailure, PlantedBug, Wire, ZeroCopies};
pub use error::{Result, SupervisorError};
pub use job::{BatchTokens, BoxedStage, BuildStage, DeviceMemory, FsdpSpec, MeshSpec, SplitBatch, StageRequest, TrainJob};
pub use plan::{CheckpointInfo, LayerCosts, MemberHolding, MemoryEstimate, ModelLayout, ParallelConfig, Plan, PlanError, PlanInput, RankAssignment, Schedule, ShardId, ShardNeed, Source, Unit};
pub use launch::{serve_request, LaunchOptions, Launcher, NodeLauncher};
pub use supervisor::{query_status, JobEvent, LaunchRequest, SupervisorEnv, SupervisorHandle, SupervisorMsg, SupervisorOptions, MAX_STALLED_REFORMS};
pub use worker::{parameter_checksum, run_node, run_worker, ControlDialer, Exec, GenerationWire, JobSpec, NodeEnv, HOST_ID_ENV, WorkerOptions, WorkerOutcome};
