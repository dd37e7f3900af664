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

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};

use rand::SeedableRng;
use rand_chacha::ChaCha20Rng;
use rayon::prelude::*;

use super::{Fate, Federation, PartialSum, RoundReport};
use crate::config::{FedConfig, SecAggParams};
use crate::error::{FedError, Result};
use crate::local::{ClientTask, LocalTrainer};
use crate::population::{splitmix64, unit_hash, Population};
use crate::secagg::{
    drive, pair_by_client, AdvertiseKeys, Dropouts, ForwardedShares, MaskedInput, PhaseSeconds, QuantConfig, Roster, SecAggClient, SecAggConfig, SecAggOutcome, SecAggServer, ShareKeys,
    UnmaskRequest, UnmaskShares, MASKING_BATCH_CLIENTS, SUM_MAGNITUDE_MAX,
};
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
    /// The included clients' ids, sorted (what the sum must equal the inputs of).
    pub included_clients: Vec<u64>,
    /// The unmasked sum in Z_2^32 as the coordinator decoded it: the update words, the weight word
    /// and the count word (empty when aborted).
    pub sum_fixed: Vec<u32>,
    /// Why the sum could not be unmasked; the model was left unchanged.
    pub aborted: Option<SecAggAbort>,
    /// Wall seconds per protocol phase (client columns include local training; measurement only).
    pub seconds: PhaseSeconds,
}

/// What both ends of a secure round derive from the config and the round number.
struct SecureSetup {
    params: SecAggParams,
    config: SecAggConfig,
    encoding: WeightedEncoding,
    /// Client `id` draws its keys from ChaCha20 stream `id` of this seed.
    client_seed: u64,
}

/// Which phase each sampled client vanishes at, and the counts, from their fates.
#[derive(Default)]
struct Fates {
    dropouts: Dropouts,
    dropped: u64,
    stragglers: u64,
}

/// A client host's part of a secure round over the network (`rtx fed clients` under `[secagg]`):
/// the SecAgg+ client state of each of its sampled clients, driven phase by phase by the
/// coordinator's messages. Clients vanish at the same phases as in the in-process round (see the
/// module doc), so a round whose hosts all answer gives the in-process round's bits.
pub struct SecureHostRound {
    round: u32,
    setup: SecureSetup,
    /// Live clients: state and position in the host's client list.
    states: BTreeMap<u64, (SecAggClient, usize)>,
    clients: Vec<u32>,
    fates: Fates,
    masked_ok: BTreeSet<u64>,
    /// Clients that withheld a malformed update.
    pub rejected: u64,
}

impl SecureHostRound {
    /// The round.
    pub fn round(&self) -> u32 {
        self.round
    }

    /// Clients of this host that dropped before sharing and that straggled past the masked-input
    /// deadline, by their fates.
    pub fn counts(&self) -> (u64, u64) {
        (self.fates.dropped, self.fates.stragglers)
    }

    /// Phase 1: each live client seals shares of its secrets for its neighbours (clients whose
    /// step fails drop).
    pub fn share(&mut self, rosters: Vec<Roster>) -> Vec<ShareKeys> {
        let work = pair_by_client(&mut self.states, rosters, |m| m.client);
        let shares: Vec<ShareKeys> = work.into_iter().filter_map(|(state, roster)| state.0.share_keys(&roster).ok()).collect();
        let before = &self.fates.dropouts.before_masked_input;
        self.states.retain(|id, _| !before.contains(id));
        shares
    }

    /// Phase 3: the clients whose masked input went out answer the unmask requests addressed to
    /// them (those that vanish before unmasking do not).
    pub fn unmask(&mut self, requests: Vec<UnmaskRequest>) -> Vec<UnmaskShares> {
        let (ok, gone) = (&self.masked_ok, &self.fates.dropouts.before_unmask);
        self.states.retain(|id, _| ok.contains(id) && !gone.contains(id));
        let work = pair_by_client(&mut self.states, requests, |m| m.client);
        work.into_iter().filter_map(|(state, request)| state.0.unmask(&request).ok()).collect()
    }
}

impl<T: LocalTrainer, X: UpdateTransform> Federation<'_, T, X> {
    fn secure_setup(&self, round: u32, params: SecAggParams) -> Result<SecureSetup> {
        let encoding = encoding_for(&self.config, &self.population)?.ok_or_else(|| FedError::config("secagg", "absent"))?;
        let (seed, r) = (self.config.seed, u64::from(round));
        let graph_seed = splitmix64(seed ^ splitmix64(GRAPH_SALT ^ r));
        let config = SecAggConfig::new(r, WeightedEncoding::words(self.model.len()), params.degree, params.threshold, params.quant, graph_seed)?;
        Ok(SecureSetup { params, config, encoding, client_seed: splitmix64(seed ^ splitmix64(CLIENT_SALT ^ r)) })
    }

    fn fates(&self, round: u32, clients: &[u32], params: &SecAggParams) -> Fates {
        let (seed, r) = (self.config.seed, u64::from(round));
        let mut fates = Fates::default();
        for &c in clients {
            match self.fate(round, c) {
                Fate::Dropped => {
                    fates.dropped += 1;
                    fates.dropouts.before_sharing.insert(u64::from(c));
                }
                Fate::Straggler => {
                    fates.stragglers += 1;
                    fates.dropouts.before_masked_input.insert(u64::from(c));
                }
                Fate::Train => {
                    if params.unmask_dropout_rate > 0.0 && unit_hash(&[seed, r, u64::from(c), UNMASK_SALT]) < params.unmask_dropout_rate {
                        fates.dropouts.before_unmask.insert(u64::from(c));
                    }
                }
            }
        }
        fates
    }

    /// A synchronous round under secure aggregation (see the module doc).
    pub(super) fn run_secure_round(&mut self, round: u32, sampled: Vec<u32>, params: SecAggParams) -> Result<RoundReport> {
        let setup = self.secure_setup(round, params)?;
        let fates = self.fates(round, &sampled, &setup.params);
        let ids: Vec<u64> = sampled.iter().map(|&c| u64::from(c)).collect();
        let rejected = AtomicU64::new(0);
        let driven = {
            let this = &*self;
            let input = |index: usize, _id: u64| sampled.get(index).and_then(|&c| this.secure_input(round, c, &this.model, &setup.encoding, &rejected));
            this.pool.install(|| drive(&setup.config, &ids, &fates.dropouts, setup.client_seed, input))
        };
        let (outcome, seconds) = match driven {
            Ok(driven) => (Ok(driven.outcome), driven.seconds),
            Err(error) => (Err(error), PhaseSeconds::default()),
        };
        let gone = |included: &[u64]| included.iter().filter(|c| fates.dropouts.before_unmask.contains(c)).count() as u64;
        let counts = SecureCounts { k: sampled.len() as u64, dropped: fates.dropped, stragglers: fates.stragglers, rejected: rejected.into_inner() };
        let mut report = self.apply_secure(round, &setup, outcome, counts, gone)?;
        if let Some(info) = report.secure.as_mut() {
            info.seconds = seconds;
        }
        Ok(report)
    }

    /// On a client host: starts this host's part of secure round `round` for its sampled
    /// `clients` (ascending), returning the state and every client's advertised keys (clients
    /// fated to drop advertise, then vanish, as in process).
    pub fn secure_host_start(&self, round: u32, clients: &[u32]) -> Result<(SecureHostRound, Vec<AdvertiseKeys>)> {
        let params = self.config.secagg_params()?.ok_or_else(|| FedError::config("secagg", "the coordinator runs a secure round but this host's config has no [secagg]"))?;
        let setup = self.secure_setup(round, params)?;
        let fates = self.fates(round, clients, &setup.params);
        let mut states = BTreeMap::new();
        let mut adverts = Vec::with_capacity(clients.len());
        for (index, &c) in clients.iter().enumerate() {
            let mut rng = ChaCha20Rng::seed_from_u64(setup.client_seed);
            rng.set_stream(u64::from(c));
            let mut client = SecAggClient::new(u64::from(c), &setup.config, rng)?;
            adverts.push(client.advertise()?);
            if !fates.dropouts.before_sharing.contains(&u64::from(c)) {
                states.insert(u64::from(c), (client, index));
            }
        }
        Ok((SecureHostRound { round, setup, states, clients: clients.to_vec(), fates, masked_ok: BTreeSet::new(), rejected: 0 }, adverts))
    }

    /// On a client host, phase 2: the live clients addressed by `forwarded` train on `model`,
    /// encode and mask their updates (in parallel on this host's pool); the caller passes a
    /// bounded batch at a time (`MASKING_BATCH_CLIENTS`), so no vector of this host's updates
    /// exists.
    pub fn secure_host_mask(&self, host: &mut SecureHostRound, model: &[f32], forwarded: Vec<ForwardedShares>) -> Result<Vec<MaskedInput>> {
        if model.len() != self.model.len() {
            return Err(FedError::config("model", format!("the coordinator sent {} parameters, this host's model has {}", model.len(), self.model.len())));
        }
        let rejected = AtomicU64::new(0);
        let (round, clients, encoding) = (host.round, &host.clients, &host.setup.encoding);
        let work = pair_by_client(&mut host.states, forwarded, |m| m.client);
        let masked: Vec<MaskedInput> = self.pool.install(|| {
            work.into_par_iter()
                .filter_map(|(state, fwd)| {
                    let words = clients.get(state.1).and_then(|&c| self.secure_input(round, c, model, encoding, &rejected))?;
                    state.0.masked_input_words(&fwd, words).ok()
                })
                .collect()
        });
        host.masked_ok.extend(masked.iter().map(|m| m.client));
        host.rejected += rejected.into_inner();
        Ok(masked)
    }

    /// At the coordinator: the secure-aggregation server for the current round.
    pub fn secure_server(&self) -> Result<SecAggServer> {
        let params = self.config.secagg_params()?.ok_or_else(|| FedError::config("secagg", "absent"))?;
        Ok(SecAggServer::new(&self.secure_setup(self.round, params)?.config))
    }

    /// At the coordinator: finishes the current secure round from the server's outcome (or the
    /// shortfall that stopped it) and the hosts' counts; `gone_before_unmask` counts included
    /// clients that did not answer the unmask request.
    pub fn finish_secure_round(&mut self, outcome: Result<SecAggOutcome>, counts: SecureCounts, gone_before_unmask: u64) -> Result<RoundReport> {
        let params = self.config.secagg_params()?.ok_or_else(|| FedError::config("secagg", "absent"))?;
        let round = self.round;
        let setup = self.secure_setup(round, params)?;
        let report = self.apply_secure(round, &setup, outcome, counts, |_| gone_before_unmask)?;
        self.round += 1;
        Ok(report)
    }

    /// The sum in Z_2^32 of `clients`' encoded inputs in secure round `round` at `model`: what an
    /// unmasked sum over exactly those clients must equal. For checks (the simulator's
    /// `unmask-exact`, tests); a client without an input of its own (it would withhold a
    /// malformed update) is an error.
    pub fn secure_plain_sum(&self, round: u32, clients: &[u64], model: &[f32]) -> Result<Vec<u32>> {
        let encoding = encoding_for(&self.config, &self.population)?.ok_or_else(|| FedError::config("secagg", "absent"))?;
        let mut sum = vec![0u32; WeightedEncoding::words(model.len())];
        for &c in clients {
            let words = u32::try_from(c)
                .ok()
                .and_then(|c| self.secure_input(round, c, model, &encoding, &AtomicU64::new(0)))
                .ok_or_else(|| FedError::config("secagg", format!("client {c} has no input of its own in round {round}")))?;
            for (s, w) in sum.iter_mut().zip(words) {
                *s = s.wrapping_add(w);
            }
        }
        Ok(sum)
    }

    /// Applies a secure round's outcome: the decoded sum through the server optimizer, or, when the
    /// server could not unmask, an unchanged model and the reason.
    fn apply_secure(&mut self, round: u32, setup: &SecureSetup, outcome: Result<SecAggOutcome>, counts: SecureCounts, gone_before_unmask: impl Fn(&[u64]) -> u64) -> Result<RoundReport> {
        let SecureCounts { k, dropped, stragglers, rejected } = counts;
        let n_params = self.model.len();
        let peak_partials = 1 + (k as usize).min(MASKING_BATCH_CLIENTS);
        let mut info = SecureRound {
            degree: setup.params.degree,
            threshold: setup.params.threshold,
            scale_bits: setup.params.quant.scale_bits,
            weight_bits: setup.encoding.weight_bits,
            ..SecureRound::default()
        };
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(error) => {
                let abort = SecAggAbort::from_error(error)?;
                tracing::warn!(round, %abort, "secure aggregation could not unmask the round's sum; the model is unchanged");
                info.aborted = Some(abort);
                self.partials_peak.store(0, Ordering::Relaxed);
                // Every update is lost: the clients that were not stragglers or rejected count as dropped.
                let dropped = k.saturating_sub(stragglers + rejected).max(dropped);
                return Ok(RoundReport { round, sampled: k, dropped, stragglers, rejected, peak_partials, secure: Some(info), ..RoundReport::default() });
            }
        };
        let mut sum = vec![0f32; n_params];
        let (total_weight, with_data) = setup.encoding.decode(&outcome.sum_fixed, &mut sum)?;
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
        info.gone_before_unmask = gone_before_unmask(&outcome.included);
        info.sum_fixed = outcome.sum_fixed;
        info.included_clients = outcome.included;
        report.secure = Some(info);
        Ok(report)
    }

    /// Client `c`'s masked-input phase up to its input: trains on `model`, applies the transform,
    /// checks and encodes; `None` (counted in `rejected`) when the client refuses its own
    /// malformed update.
    fn secure_input(&self, round: u32, c: u32, model: &[f32], encoding: &WeightedEncoding, rejected: &AtomicU64) -> Option<Vec<u32>> {
        let (mut scratch, mut update) = self.take_scratch();
        let mut indices = Vec::new();
        self.population.indices_into(c, &mut indices);
        let task = ClientTask { client: c, round, seed: self.config.seed, indices: &indices };
        let mut weight = self.trainer.train(&task, model, &mut scratch, &mut update);
        self.transform.on_client(round, c, &mut update, &mut weight);
        let words = if encoding.admits(&update, weight, model.len()) {
            let mut words = Vec::with_capacity(WeightedEncoding::words(model.len()));
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

/// A secure round's client counts as the coordinator learns them from its hosts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SecureCounts {
    /// Clients sampled.
    pub k: u64,
    /// Dropped before sharing (by fate).
    pub dropped: u64,
    /// Straggled past the masked-input deadline (by fate).
    pub stragglers: u64,
    /// Withheld a malformed update.
    pub rejected: u64,
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
