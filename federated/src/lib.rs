//! Federation as an actor topology (`rtx-federated`): a coordinator samples K edge clients per round
//! out of a population of N, sends the global model down an aggregator tree, collects weighted updates
//! back up it in a fixed order (so a round's result never depends on arrival order or thread count),
//! and applies a server optimizer. Client hosts keep millions of dormant clients as compact arrays; an
//! edge client exists as an actor only while it trains. This crate is a sibling root beside the elastic
//! data-parallel supervisor: it builds on `rtx-tensor` (models, data) and the transport crates below
//! it, and nothing below it imports it.

pub mod dp;
pub mod error;
pub mod secagg;

pub use error::{FedError, Result};
