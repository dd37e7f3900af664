//! Secure aggregation inside a synchronous round (`[secagg]`): the sampled clients train as in a
//! plain round (in parallel on the federation's pool, the transform's `on_client` first, so DP
//! clipping still applies), but each sends only a SecAgg+ masked input and the coordinator only
//! ever sees the sum. The protocol runs through `secagg::drive` (the same driver as the module's
//! tests and overhead benchmark): `SecAggClient` per client, one `SecAggServer`, messages in id order.
//!
//! Encoding ([`WeightedEncoding`]): client i with update `u_i` and weight `w_i` sends `n_params + 2`
//! words of Z_2^32: the fixed-point `(w_i / max_weight) u_i` (per-coordinate clip and scale of the
//! round's `QuantConfig`), then `w_i` in fixed point at `2^weight_bits` (exact for integer weights),
//! then 1 if `w_i > 0`. The unmasked sum decodes to `sum_i w_i u_i`, `sum_i w_i` and the number of
//! clients with data, so FedAvg's division by the total weight, the transform's `on_sum` (DP noise)
//! and the server optimizer run on sums only. Sums are modular, so neither arrival nor thread order
//! can change a bit; the overflow bound of every word holds for K clients by construction.
//!
//! Faults map onto protocol phases, deterministically (functions of seed, round and client):
//! - dropout or host down (`faults.dropout_rate`, `faults.host_down`): the client advertises its
//!   keys, then vanishes before sharing them; its neighbours mask without it. It does not train.
//! - straggler (virtual latency past `faults.deadline_ms`): the client shares its keys, then misses
//!   the masked-input deadline; the server rebuilds its mask key from its neighbours' shares and
//!   strips its pairwise masks. It does not train (its update would be lost anyway).
//! - `secagg.unmask_dropout_rate`: the client sent its masked input, then vanishes before the
//!   unmask request; its update stays in the sum as long as enough neighbours answer.
//! - a malformed update (wrong length, NaN/inf, a negative weight or one above `max_weight`) is
//!   withheld by its own client (counted `rejected`), which drops before its masked input.
//!
//! A client whose own protocol step fails (fewer than `threshold` neighbours left) drops too and is
//! counted `dropped`. When the server cannot unmask (too few shares, too few clients) the round
//! leaves the model unchanged and says why in [`SecureRound::aborted`]: never a panic, never a wrong
//! sum. Clients train at the masked-input phase, `MASKING_BATCH_CLIENTS` at a time, so no vector of
//! K updates exists and the server keeps one running sum; what grows with K is the protocol state
//! (each simulated client's keys and held shares, the server's share relay), O(K x degree).

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Fate, Federation, PartialSum, RoundReport};
use crate::config::{FedConfig, SecAggParams};
use crate::error::{FedError, Result};
use crate::local::{ClientTask, LocalTrainer};
use crate::population::{splitmix64, unit_hash, Population};
use crate::secagg::{drive, Dropouts, PhaseSeconds, QuantConfig, SecAggConfig, MASKING_BATCH_CLIENTS, SUM_MAGNITUDE_MAX};
use crate::strategy::UpdateTransform;

/// Salts of the per-round seeds: the clients' key streams, the neighbour graph, late dropouts.
const CLIENT_SALT: u64 = 0x005E_CA66_C11E;
const GRAPH_SALT: u64 = 0x005E_CA66_62A9;
const UNMASK_SALT: u64 = 0x005E_CA66_0A5C;

/// How a client's weighted update and weight become words of Z_2^32, and their sum back.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WeightedEncoding {
    /// Fixed point of the update coordinates (clip, scale, K clients).
    pub quant: QuantConfig,
    /// Weights are divided by this before they scale the update; a larger weight is refused.
    pub max_weight: f32,
    /// The weight word is `round(weight * 2^weight_bits)`.
    pub weight_bits: u32,
}

impl WeightedEncoding {
    /// The encoding for `quant` (whose `max_clients` is K) and weights up to `max_weight`, with the
    /// finest weight scale at which K weights cannot overflow.
    pub fn new(quant: QuantConfig, max_weight: f32) -> Result<Self> {
        if !(max_weight.is_finite() && max_weight > 0.0) {
            return Err(FedError::config("secagg.max_weight", format!("{max_weight} must be finite and > 0")));
        }
        let fits = |bits: u32| {
            let level = (f64::from(max_weight) * (1u64 << bits) as f64).round() as u64;
            level.checked_mul(quant.max_clients).is_some_and(|bound| bound <= SUM_MAGNITUDE_MAX)
        };
        let weight_bits = (0..=30).rev().find(|&bits| fits(bits)).ok_or_else(|| {
            FedError::config("secagg.max_weight", format!("{} weights of up to {max_weight} overflow Z_2^32", quant.max_clients))
        })?;
        Ok(WeightedEncoding { quant, max_weight, weight_bits })
    }

    /// Words per client for a model of `n_params`: the update, the weight, the count.
    pub fn words(n_params: usize) -> usize {
        n_params + 2
    }

    /// Whether a client may send `(update, weight)`: the model's length, finite values, a finite
    /// weight in `[0, max_weight]`.
    pub fn admits(&self, update: &[f32], weight: f32, n_params: usize) -> bool {
        super::valid_update(update, weight, n_params) && weight <= self.max_weight
    }

    /// Encodes an admitted `(update, weight)` into `out` (cleared first).
    pub fn encode(&self, update: &[f32], weight: f32, out: &mut Vec<u32>) {
        out.clear();
        let ratio = weight / self.max_weight;
        out.extend(update.iter().map(|&u| self.quant.quantize(ratio * u)));
        out.push((f64::from(weight) * (1u64 << self.weight_bits) as f64).round() as i64 as u32);
        out.push(u32::from(weight > 0.0));
    }

    /// Decodes a sum of encoded inputs: writes `sum_i w_i u_i` into `sum` and returns
    /// `(sum_i w_i, clients with w_i > 0)`.
    pub fn decode(&self, words: &[u32], sum: &mut [f32]) -> Result<(f64, u64)> {
        let n = sum.len();
        let (Some(&weight), Some(&count)) = (words.get(n), words.get(n + 1)) else {
            return Err(FedError::config("secagg.vector_len", format!("a sum of {} words cannot hold {n} parameters, a weight and a count", words.len())));
        };
        let (scale, max_weight) = (self.quant.scale(), f64::from(self.max_weight));
        for (s, &w) in sum.iter_mut().zip(words) {
            *s = (f64::from(w as i32) / scale * max_weight) as f32;
        }
        Ok((f64::from(weight as i32) / (1u64 << self.weight_bits) as f64, u64::from(count)))
    }
}

/// The encoding `config`'s `[secagg]` uses over `population` (`max_weight` resolved: the config's,
/// else 1 under `[dp]`, else the largest client's image count), or `None` without `[secagg]`.
pub fn encoding_for(config: &FedConfig, population: &Population) -> Result<Option<WeightedEncoding>> {
    let Some(params) = config.secagg_params()? else {
        return Ok(None);
    };
    let max_weight = params.max_weight.unwrap_or_else(|| if config.dp.is_some() { 1.0 } else { population.max_samples().max(1) as f32 });
    WeightedEncoding::new(params.quant, max_weight).map(Some)
}

/// Why a secure round could not be unmasked (the model was left unchanged).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SecAggAbort {
    /// `FedError::SecAggTooFewShares`: some secret had fewer than `threshold` shares.
    TooFewShares {
        /// The client whose secret was needed.
        client: u64,
        /// The self-mask seed of a survivor or the mask key of a dropped client.
        secret: &'static str,
        /// Shares that arrived.
        have: usize,
        /// Shares needed.
        threshold: usize,
    },
    /// `FedError::SecAggTooFewClients`: a phase closed with too few clients.
    TooFewClients {
        /// The phase.
        phase: &'static str,
        /// Clients present.
        have: usize,
        /// Clients needed.
        need: usize,
    },
}

impl SecAggAbort {
    /// The abort an error stands for, or the error back when it is not a shortfall (a bug or a
    /// malformed message, which the round reports as an error).
    fn from_error(error: FedError) -> Result<Self> {
        match error {
            FedError::SecAggTooFewShares { client, secret, have, threshold } => Ok(SecAggAbort::TooFewShares { client, secret, have, threshold }),
            FedError::SecAggTooFewClients { phase, have, need } => Ok(SecAggAbort::TooFewClients { phase, have, need }),
            other => Err(other),
        }
    }
}

impl std::fmt::Display for SecAggAbort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SecAggAbort::TooFewShares { client, secret, have, threshold } => {
                write!(f, "cannot recover the {secret} of client {client}: {have} shares arrived, threshold is {threshold}")
            }
            SecAggAbort::TooFewClients { phase, have, need } => write!(f, "{phase} has {have} clients, at least {need} are needed"),
        }
    }
}

/// What secure aggregation did in one round ([`RoundReport::secure`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SecureRound {
    /// Neighbours per client in the round's graph.
    pub degree: usize,
    /// Shares needed per secret.
    pub threshold: usize,
    /// Fixed-point scale bits of the update coordinates.
    pub scale_bits: u32,
    /// Fixed-point scale bits of the weight word.
    pub weight_bits: u32,
    /// Clients whose masked input is in the unmasked sum (with or without data).
    pub included: u64,
    /// Of those, clients that vanished before answering the unmask request.
    pub gone_before_unmask: u64,
    /// The unmasked sum in Z_2^32 as the coordinator decoded it: the update words, the weight word
    /// and the count word (empty when aborted).
    pub sum_fixed: Vec<u32>,
    /// Why the sum could not be unmasked; the model was left unchanged.
    pub aborted: Option<SecAggAbort>,
    /// Wall seconds per protocol phase (client columns include local training; measurement only).
    pub seconds: PhaseSeconds,
}

impl<T: LocalTrainer, X: UpdateTransform> Federation<'_, T, X> {
    /// A synchronous round under secure aggregation (see the module doc).
    pub(super) fn run_secure_round(&mut self, round: u32, sampled: Vec<u32>, params: SecAggParams) -> Result<RoundReport> {
        let encoding = encoding_for(&self.config, &self.population)?.ok_or_else(|| FedError::config("secagg", "absent"))?;
        let n_params = self.model.len();
        let k = sampled.len() as u64;
        let (seed, r) = (self.config.seed, u64::from(round));
        let graph_seed = splitmix64(seed ^ splitmix64(GRAPH_SALT ^ r));
        let config = SecAggConfig::new(r, WeightedEncoding::words(n_params), params.degree, params.threshold, params.quant, graph_seed)?;
        let mut dropouts = Dropouts::default();
        let (mut dropped, mut stragglers) = (0u64, 0u64);
        for &c in &sampled {
            match self.fate(round, c) {
                Fate::Dropped => {
                    dropped += 1;
                    dropouts.before_sharing.insert(u64::from(c));
                }
                Fate::Straggler => {
                    stragglers += 1;
                    dropouts.before_masked_input.insert(u64::from(c));
                }
                Fate::Train => {
                    if params.unmask_dropout_rate > 0.0 && unit_hash(&[seed, r, u64::from(c), UNMASK_SALT]) < params.unmask_dropout_rate {
                        dropouts.before_unmask.insert(u64::from(c));
                    }
                }
            }
        }
        let ids: Vec<u64> = sampled.iter().map(|&c| u64::from(c)).collect();
        let rejected = AtomicU64::new(0);
        let driven = {
            let this = &*self;
            let input = |index: usize, _id: u64| sampled.get(index).and_then(|&c| this.secure_input(round, c, &encoding, &rejected));
            this.pool.install(|| drive(&config, &ids, &dropouts, splitmix64(seed ^ splitmix64(CLIENT_SALT ^ r)), input))
        };
        let rejected = rejected.into_inner();
        let peak_partials = 1 + (k as usize).min(MASKING_BATCH_CLIENTS);
        let mut info = SecureRound {
            degree: params.degree,
            threshold: params.threshold,
            scale_bits: params.quant.scale_bits,
            weight_bits: encoding.weight_bits,
            ..SecureRound::default()
        };
        let driven = match driven {
            Ok(driven) => driven,
            Err(error) => {
                let abort = SecAggAbort::from_error(error)?;
                tracing::warn!(round, %abort, "secure aggregation could not unmask the round's sum; the model is unchanged");
                info.aborted = Some(abort);
                self.partials_peak.store(0, Ordering::Relaxed);
                return Ok(RoundReport {
                    round,
                    sampled: k,
                    dropped,
                    stragglers,
                    rejected,
                    peak_partials,
                    secure: Some(info),
                    ..RoundReport::default()
                });
            }
        };
        let outcome = driven.outcome;
        let mut sum = vec![0f32; n_params];
        let (total_weight, with_data) = encoding.decode(&outcome.sum_fixed, &mut sum)?;
        let included = outcome.included.len() as u64;
        let contributors: Vec<u32> = outcome.included.iter().filter_map(|&c| u32::try_from(c).ok()).collect();
        for &c in &contributors {
            self.population.mark_participation(c, round);
        }
        let partial = PartialSum {
            sum,
            weight: total_weight,
            done: with_data,
            dropped: k.saturating_sub(included + stragglers + rejected),
            stragglers,
            rejected,
            empty: included.saturating_sub(with_data),
            contributors,
        };
        let mut report = self.apply(round, partial, k);
        report.peak_partials = peak_partials;
        info.included = included;
        info.gone_before_unmask = outcome.included.iter().filter(|c| dropouts.before_unmask.contains(c)).count() as u64;
        info.sum_fixed = outcome.sum_fixed;
        info.seconds = driven.seconds;
        report.secure = Some(info);
        Ok(report)
    }

    /// Client `c`'s masked-input phase up to its input: trains, applies the transform, checks and
    /// encodes; `None` (counted in `rejected`) when the client refuses its own malformed update.
    fn secure_input(&self, round: u32, c: u32, encoding: &WeightedEncoding, rejected: &AtomicU64) -> Option<Vec<u32>> {
        let (mut scratch, mut update) = self.take_scratch();
        let mut indices = Vec::new();
        self.population.indices_into(c, &mut indices);
        let task = ClientTask { client: c, round, seed: self.config.seed, indices: &indices };
        let mut weight = self.trainer.train(&task, &self.model, &mut scratch, &mut update);
        self.transform.on_client(round, c, &mut update, &mut weight);
        let words = if encoding.admits(&update, weight, self.model.len()) {
            let mut words = Vec::with_capacity(WeightedEncoding::words(self.model.len()));
            encoding.encode(&update, weight, &mut words);
            Some(words)
        } else {
            rejected.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(client = c, round, len = update.len(), weight, "malformed update withheld by its client");
            None
        };
        self.put_scratch(scratch, update);
        words
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_weights_sum_exactly_and_updates_to_the_grid() {
        // Goal: K encoded inputs decode to the weighted sum within the grid and to the exact total
        // weight and count; a weight above max_weight or a NaN is not admitted.
        let quant = QuantConfig::finest(1.0, 3).unwrap();
        let enc = WeightedEncoding::new(quant, 8.0).unwrap();
        assert!(3 * (8u64 << enc.weight_bits) <= SUM_MAGNITUDE_MAX && 3 * (8u64 << (enc.weight_bits + 1)) > SUM_MAGNITUDE_MAX);
        let inputs = [(vec![0.25f32, -0.5, 0.125], 8.0f32), (vec![0.1, 0.2, -0.3], 3.0), (vec![0.7, 0.0, 0.0], 0.0)];
        let mut total = vec![0u32; WeightedEncoding::words(3)];
        let mut words = Vec::new();
        for (u, w) in &inputs {
            assert!(enc.admits(u, *w, 3));
            enc.encode(u, *w, &mut words);
            for (t, x) in total.iter_mut().zip(&words) {
                *t = t.wrapping_add(*x);
            }
        }
        let mut sum = vec![0f32; 3];
        let (weight, count) = enc.decode(&total, &mut sum).unwrap();
        assert_eq!((weight, count), (11.0, 2));
        let expected = [8.0 * 0.25 + 3.0 * 0.1, 8.0 * -0.5 + 3.0 * 0.2, 8.0 * 0.125 + 3.0 * -0.3];
        let tolerance = 3.0 * 0.5 / quant.scale() as f32 * 8.0 + 1e-6;
        for (s, e) in sum.iter().zip(expected) {
            assert!((s - e).abs() <= tolerance, "{sum:?} vs {expected:?}");
        }
        assert!(!enc.admits(&[0.0; 3], 8.5, 3));
        assert!(!enc.admits(&[f32::NAN, 0.0, 0.0], 1.0, 3));
        assert!(enc.decode(&total[..3], &mut sum).is_err());
        assert!(WeightedEncoding::new(quant, 0.0).is_err());
    }
}
