//! Federation as an actor topology (`rtx-federated`): a coordinator samples K edge clients per round
//! out of a population of N, sends the global model down an aggregator tree, collects weighted updates
//! back up it in a fixed order (so a round's result never depends on arrival order or thread count),
//! and applies a server optimizer. Client hosts keep millions of dormant clients as compact arrays; an
//! edge client exists as an actor only while it trains. This crate is a sibling root beside the elastic
//! data-parallel supervisor: it builds on `rtx-tensor` (models, data) and the transport crates below
//! it, and nothing below it imports it.
//!
//! Start from [`FedConfig`] (the TOML config), [`Population`] (who holds which images),
//! [`LogRegSgd`] (the reference local workload, behind the [`LocalTrainer`] trait) and
//! [`Federation`] (rounds, or FedBuff steps with `[async]`). Client-level DP plugs in through
//! [`UpdateTransform`] ([`Plain`] is the identity); secure aggregation (`[secagg]`) runs its
//! multi-phase protocol inside the synchronous round ([`SecureRound`]). [`remote`] runs the same
//! rounds with client hosts in other processes over QUIC.

pub mod availability;
pub mod config;
pub mod dp;
pub mod error;
pub mod fedbuff;
pub mod local;
pub mod population;
pub mod remote;
pub mod round;
pub mod secagg;
pub mod strategy;

pub use config::FedConfig;
pub use error::{FedError, Result};
pub use local::{ClientTask, Evaluation, LocalTrainer, LogReg, LogRegSgd};
pub use population::{splitmix64, FedData, Population};
pub use round::{ClientOutcome, Federation, PartialSum, Piece, RoundReport, SecAggAbort, SecureCounts, SecureHostRound, SecureRound, WeightedEncoding};
pub use strategy::{Plain, ServerOptimizer, UpdateTransform};
