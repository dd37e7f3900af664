//! Deterministic simulation for rustytorch: the **real** supervisor, node agents, workers,
//! collectives and data-parallel trainer of an elastic job, in one process, on one single-thread
//! tokio runtime with paused (virtual) time, with faults drawn from one master seed, so a failure
//! found once replays from its seed.
//!
//! Start from [`run_seed`] (one seed of a [`Scenario`], returning an [`Outcome`] with its trace
//! hash and the first broken invariant, if any) and [`swarm`] (many seeds across OS threads, each
//! with its own runtime). The pieces underneath:
//! - [`SimNetwork`] / [`SimTransport`]: a seeded in-memory network implementing the collectives
//!   `Transport` and carrying production frames; per directed link latency with jitter,
//!   bandwidth, loss (as retransmission delay), duplication (as lost bandwidth) and reordering
//!   (as a delivery gap) below the ordered reliable transport, one-way and symmetric partitions,
//!   crashes; links are streams (QUIC) or shared-memory rings as before the transport could be
//!   aborted (sends wait for ring space, crashes are noticed after the liveness timeout, a dying
//!   writer's frame is torn); ranks can be stalled (compute stuck in a collective) and transports
//!   aborted (`Transport::abort`).
//!   [`ClusterWire`] makes one per generation and maps node slots to ranks.
//! - [`ControlNet`]: the supervisor↔node control links, production `rtx_actors::Link` envelopes
//!   over in-memory streams with seeded latency, isolation (hangs) and idle timeouts.
//! - [`FedScenario`] / [`run_fed_seed`] / [`fed_swarm`]: federated scenarios, the real federation
//!   coordinator and client hosts over the control network with host crashes, partitions and slow
//!   links, checked round by round against the in-process federation.
//! - [`SimJob`]: a small MLP on real Fashion-MNIST images, and the [`Ledger`] of what was trained.
//! - [`MeshSimJob`]: a byte-level GPT on the real State of the Union corpus, trained as a
//!   `(dp, pp, tp)` mesh (a scenario's `[mesh]` table) with tensor-parallel stages and sharded
//!   checkpoints.
//!
//! - [`Baton`]: the compute driver of model-parallel members: one baton handed between the
//!   runtime thread and the compute threads, so exactly one runs at a time and virtual time stands
//!   still while a compute thread works.
//! - [`SimCheckpoints`]: the cluster's in-memory checkpoint storage (production encoding), which
//!   a `checkpoint_fail` fault makes fail.
//!
//! Everything plugs into the runtime through traits the lower crates define (`Transport`,
//! `GenerationWire`, `ControlDialer`, `LinkListener::channel`, the supervisor's launch channel,
//! `Exec::Task`), never through `cfg` branches.

mod baton;
mod checkpoints;
mod cluster;
mod control;
mod error;
mod federation;
mod job;
mod mesh_job;
mod network;
mod scenario;
mod swarm;
mod trace;
mod wire;

pub use baton::Baton;
pub use checkpoints::SimCheckpoints;
pub use cluster::{run_seed, Outcome, RunOptions, Violation};
pub use control::{ControlConfig, ControlNet, SlotDialer};
pub use error::{Result, SimError};
pub use federation::{fed_swarm, run_fed_seed, FedFault, FedFaultKind, FedNetwork, FedOutcome, FedRandom, FedScenario, FedShape, FedSwarmReport};
pub use job::{Dataset, JobShape, Ledger, SimJob, Trained};
pub use mesh_job::{MeshJobShape, MeshSimJob};
pub use network::{run, LinkModel, SimConfig, SimNetwork, SimTransport, WireModel};
pub use scenario::{ElasticShape, Fault, FaultKind, NetShape, RandomFaults, Scenario, Trigger};
pub use swarm::{swarm, SwarmReport};
pub use trace::TraceHash;
pub use wire::{ClusterWire, SlotWire};
