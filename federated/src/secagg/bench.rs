//! Whole rounds over given float updates (`run_round`), used by the tests, and the module-level
//! overhead benchmark (`bench_overheads`, `cargo bench -p rtx-federated --bench secure`). Both go
//! through the in-process driver of `driver.rs` (clients in parallel with rayon, each from its own
//! ChaCha20 stream of one seed; messages to the server in client-id order), which the federation's
//! secure rounds use too. Timings use the wall clock, for measurement only.

use std::collections::BTreeSet;
use std::time::Instant;

use rand::seq::index::sample;
use rand::SeedableRng;
use rand_chacha::ChaCha20Rng;
use rand_distr::{Distribution, StandardNormal};
use rayon::prelude::*;

use super::server::SecAggOutcome;
use super::{QuantConfig, SecAggConfig};
use crate::dp::DpConfig;
use crate::error::{FedError, Result};

/// Which clients vanish, and when. A client listed in several sets drops at the first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dropouts {
    /// Advertised keys, then vanished before sending shares.
    pub before_sharing: BTreeSet<u64>,
    /// Sent shares, then vanished before sending its masked input.
    pub before_masked_input: BTreeSet<u64>,
    /// Sent its masked input, then vanished before answering the unmask request.
    pub before_unmask: BTreeSet<u64>,
}

/// Seconds spent per phase of a driven round, split into all clients' work (parallel wall time) and
/// the server's.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct PhaseSeconds {
    /// Clients: key generation, secret sharing and sealing.
    pub client_setup: f64,
    /// Server: keys, graph, rosters, share routing.
    pub server_setup: f64,
    /// Clients: opening shares, quantising, masking.
    pub client_masking: f64,
    /// Server: summing the masked inputs.
    pub server_sum: f64,
    /// Clients: answering the unmask request.
    pub client_unmask: f64,
    /// Server: reconstructing secrets and removing masks.
    pub server_unmask: f64,
}

/// Parameters of the overhead benchmark.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SecureBenchConfig {
    /// Clients per round `K`.
    pub clients: u64,
    /// Update length (7,850 = logistic regression 784 -> 10 with bias).
    pub vector_len: usize,
    /// Fraction of clients that drop after sharing keys in the dropout run.
    pub dropout_fraction: f64,
    /// Seed of updates, keys, graph and dropouts.
    pub seed: u64,
}

/// What the overhead benchmark measured, in seconds per round.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SecureBenchReport {
    /// The benchmark's parameters.
    pub config: SecureBenchConfig,
    /// Neighbours per client and threshold used.
    pub degree: usize,
    /// Shares needed per secret.
    pub threshold: usize,
    /// Fixed-point scale bits chosen for `clients` summands with clip 1.
    pub scale_bits: u32,
    /// Peer: quantising and summing the plain updates (what the server does without secure aggregation).
    pub plain_fixed_sum: f64,
    /// Secure aggregation with no dropouts, per phase.
    pub secagg_no_dropout: PhaseSeconds,
    /// Secure aggregation with `dropout_fraction` dropping after sharing keys, per phase.
    pub secagg_dropout: PhaseSeconds,
    /// Clients that dropped in the dropout run.
    pub dropped: usize,
    /// Peer: plain float sum and mean of the updates.
    pub plain_mean: f64,
    /// Client-level DP: clip every update, sum, add noise, divide by K.
    pub dp_mean: f64,
    /// Both secure-aggregation sums equalled the plain fixed-point sums of their included clients.
    pub exact: bool,
}

/// Runs one round of secure aggregation over `clients` (with `updates[i]` for `clients[i]`), dropping
/// clients as `dropouts` says. Client `c` draws from ChaCha20 stream `c` of `seed`.
pub fn run_round(config: &SecAggConfig, clients: &[u64], updates: &[Vec<f32>], dropouts: &Dropouts, seed: u64) -> Result<SecAggOutcome> {
    drive(config, clients, updates, dropouts, seed).map(|(outcome, _)| outcome)
}

/// Measures secure aggregation (0 and `dropout_fraction` dropouts) and client-level DP against their
/// plain peers at `K = config.clients`, updates of `config.vector_len` seeded normal values.
pub fn bench_overheads(config: &SecureBenchConfig) -> Result<SecureBenchReport> {
    let n = config.clients as usize;
    if n < 3 || config.vector_len == 0 || !(0.0..0.5).contains(&config.dropout_fraction) {
        return Err(FedError::Config {
            field: "bench.secure".to_string(),
            reason: format!("need >= 3 clients, a non-empty vector, dropouts in [0, 0.5); got {config:?}"),
        });
    }
    let clients: Vec<u64> = (0..config.clients).collect();
    let updates = synthetic_updates(&clients, config.vector_len, config.seed);
    let quant = QuantConfig::finest(1.0, config.clients)?;
    let secagg = SecAggConfig::recommended(0, config.vector_len, n, quant, config.seed)?;

    let start = Instant::now();
    let plain = plain_fixed_sum(&quant, updates.iter().map(Vec::as_slice), config.vector_len);
    let plain_fixed_sum_s = start.elapsed().as_secs_f64();

    let (outcome, secagg_no_dropout) = drive(&secagg, &clients, &updates, &Dropouts::default(), config.seed)?;
    let mut exact = outcome.sum_fixed == plain;

    let n_drop = (config.dropout_fraction * n as f64).round() as usize;
    let mut rng = ChaCha20Rng::seed_from_u64(config.seed ^ 0xD809);
    let dropouts = Dropouts { before_masked_input: sample(&mut rng, n, n_drop).into_iter().map(|i| i as u64).collect(), ..Dropouts::default() };
    let (outcome, secagg_dropout) = drive(&secagg, &clients, &updates, &dropouts, config.seed)?;
    let survivors = updates.iter().zip(&clients).filter(|(_, c)| !dropouts.before_masked_input.contains(c)).map(|(u, _)| u.as_slice());
    exact &= outcome.sum_fixed == plain_fixed_sum(&quant, survivors, config.vector_len);

    let start = Instant::now();
    let mut sum = vec![0f32; config.vector_len];
    for update in &updates {
        for (s, v) in sum.iter_mut().zip(update) {
            *s += v;
        }
    }
    let mean: Vec<f32> = sum.iter().map(|s| s / n as f32).collect();
    let plain_mean = start.elapsed().as_secs_f64();
    debug_assert_eq!(mean.len(), config.vector_len);

    let dp = DpConfig::new(1.0, 1.0, config.clients, config.clients * 10, 1e-6)?;
    let mut clipped_updates = updates;
    let start = Instant::now();
    let mut sum = vec![0f32; config.vector_len];
    for update in clipped_updates.iter_mut() {
        dp.clip(update)?;
        for (s, v) in sum.iter_mut().zip(update.iter()) {
            *s += v;
        }
    }
    let noised = dp.noised_mean(&sum, &mut ChaCha20Rng::seed_from_u64(config.seed ^ 0xD9))?;
    let dp_mean = start.elapsed().as_secs_f64();
    debug_assert_eq!(noised.len(), config.vector_len);

    Ok(SecureBenchReport {
        config: config.clone(),
        degree: secagg.degree,
        threshold: secagg.threshold,
        scale_bits: quant.scale_bits,
        plain_fixed_sum: plain_fixed_sum_s,
        secagg_no_dropout,
        secagg_dropout,
        dropped: n_drop,
        plain_mean,
        dp_mean,
        exact,
    })
}

/// The plain fixed-point sum of `updates` in Z_{2^32}: what secure aggregation must reproduce.
pub fn plain_fixed_sum<'a>(quant: &QuantConfig, updates: impl Iterator<Item = &'a [f32]>, vector_len: usize) -> Vec<u32> {
    let mut sum = vec![0u32; vector_len];
    for update in updates {
        for (s, &v) in sum.iter_mut().zip(update) {
            *s = s.wrapping_add(quant.quantize(v));
        }
    }
    sum
}

/// Drives one round with `updates[i]` as the input of `clients[i]`, quantised by the round's
/// `QuantConfig` (a wrong-length or non-finite update is withheld: that client drops).
fn drive(config: &SecAggConfig, clients: &[u64], updates: &[Vec<f32>], dropouts: &Dropouts, seed: u64) -> Result<(SecAggOutcome, PhaseSeconds)> {
    if clients.len() != updates.len() {
        return Err(FedError::Config { field: "secagg.updates".to_string(), reason: format!("{} clients but {} updates", clients.len(), updates.len()) });
    }
    let quant = config.quant;
    let input = |index: usize, _id: u64| {
        let update = &updates[index];
        (update.len() == config.vector_len && update.iter().all(|v| v.is_finite())).then(|| update.iter().map(|&v| quant.quantize(v)).collect())
    };
    super::driver::drive(config, clients, dropouts, seed, input).map(|driven| (driven.outcome, driven.seconds))
}

fn synthetic_updates(clients: &[u64], vector_len: usize, seed: u64) -> Vec<Vec<f32>> {
    clients
        .par_iter()
        .map(|&id| {
            let mut rng = ChaCha20Rng::seed_from_u64(seed ^ 0x5EED);
            rng.set_stream(id);
            // A typical one-epoch logistic-regression update: small, centred values.
            (0..vector_len).map(|_| 0.02 * <StandardNormal as Distribution<f32>>::sample(&StandardNormal, &mut rng)).collect::<Vec<f32>>()
        })
        .collect()
}
