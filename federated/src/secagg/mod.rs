//! Secure aggregation, SecAgg+-style (Bonawitz et al. 2017; Bell et al. 2020): the server learns the
//! sum of the clients' updates and nothing else about any one of them.
//!
//! Each client quantises its update to Z_{2^32} (`QuantConfig`) and adds a self mask expanded from a
//! seed `b_i` and, for each neighbour `j` in a sparse random graph of degree `k = O(log n)`
//! (`neighbour_graph`), a pairwise mask expanded from the X25519 agreement `s_ij`, added when `j > i`
//! and subtracted when `j < i`, so pairwise masks cancel in the sum. Before masking, each client
//! Shamir-shares `b_i` and its mask secret key among its neighbours (threshold `t`), sealing each share
//! with ChaCha20-Poly1305 under a second X25519 agreement so the relaying server cannot read it. After
//! dropouts the server asks survivors for the `b_i` shares of clients whose input arrived and the key
//! shares of clients that dropped after sharing, and strips all remaining masks. Too few shares give
//! `FedError::SecAggTooFewShares`, never a wrong sum.
//!
//! The protocol is two pure state machines, `SecAggClient` and `SecAggServer`, exchanging the message
//! types of `messages`; the caller moves messages and decides when a phase closes, so a round in one
//! process, QUIC hosts and the simulator drive the same code. Everything random is seeded. Threat
//! model and parameters: SECURE.md.

mod bench;
mod client;
mod driver;
mod graph;
mod messages;
mod prg;
mod quant;
mod server;
mod shamir;

pub use bench::{bench_overheads, plain_fixed_sum, run_round, Dropouts, PhaseSeconds, SecureBenchConfig, SecureBenchReport};
pub use client::SecAggClient;
pub(crate) use driver::{drive, pair_by_client, MASKING_BATCH_CLIENTS};
pub use graph::{degree_for_loss, neighbour_graph, recommended_degree, short_clients_after_loss};
pub use messages::{
    AdvertiseKeys, EncryptedShare, ForwardedShares, MaskedInput, NeighbourKeys, Roster, ShareKeys, ShareReveal, UnmaskRequest, UnmaskShares,
    SHARE_CIPHERTEXT_LEN,
};
pub use quant::{QuantConfig, SUM_MAGNITUDE_MAX};
pub use server::{SecAggOutcome, SecAggServer};
pub use shamir::{CLIENT_ID_MAX, FIELD_PRIME};

use crate::error::{FedError, Result};

/// The parameters of one secure-aggregation round, shared by the server and every client.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SecAggConfig {
    /// The round number; every derived key is bound to it, so keys never repeat across rounds.
    pub round: u64,
    /// Length of the update vector.
    pub vector_len: usize,
    /// Neighbours per client `k` (even); all other clients when `k >= n - 1`.
    pub degree: usize,
    /// Shares needed to rebuild a secret `t`, with `k / 2 < t <= k`.
    pub threshold: usize,
    /// Fixed-point encoding and its overflow bound.
    pub quant: QuantConfig,
    /// Seed of the neighbour graph.
    pub graph_seed: u64,
}

impl SecAggConfig {
    /// Checks the parameters: a non-empty vector, an even degree >= 2 and a threshold above half the
    /// degree (so the shares held by a minority of a client's neighbours reveal nothing).
    pub fn new(round: u64, vector_len: usize, degree: usize, threshold: usize, quant: QuantConfig, graph_seed: u64) -> Result<Self> {
        let err = |field: &str, reason: String| Err(FedError::Config { field: field.to_string(), reason });
        if vector_len == 0 {
            return err("secagg.vector_len", "must be >= 1".to_string());
        }
        if degree < 2 || !degree.is_multiple_of(2) {
            return err("secagg.degree", format!("must be even and >= 2, got {degree}"));
        }
        if threshold > degree || 2 * threshold <= degree {
            return err("secagg.threshold", format!("must satisfy degree/2 < threshold <= degree ({degree}), got {threshold}"));
        }
        Ok(SecAggConfig { round, vector_len, degree, threshold, quant, graph_seed })
    }

    /// The recommended parameters for `n_clients`: `k = recommended_degree(n)`, `t = k / 2 + 1`.
    pub fn recommended(round: u64, vector_len: usize, n_clients: usize, quant: QuantConfig, graph_seed: u64) -> Result<Self> {
        let degree = recommended_degree(n_clients).max(2);
        let degree = degree + degree % 2;
        Self::new(round, vector_len, degree, degree / 2 + 1, quant, graph_seed)
    }
}
