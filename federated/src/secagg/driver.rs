//! One secure-aggregation round driven in this process: every client's state machine and the
//! server's, the clients' steps of a phase in parallel on the current rayon pool (client `id` draws
//! from ChaCha20 stream `id` of one seed), their messages handed to the server in client-id order, so
//! the outcome does not depend on the thread count. The caller supplies each client's encoded input
//! lazily, at the masked-input phase, one bounded batch of clients at a time: no vector of K inputs
//! ever exists, and the server keeps one running sum. `run_round` (tests, the overhead benchmark) and
//! the federation's secure rounds (`round::secure`) both go through [`drive`].
//!
//! A client whose own step fails (too few neighbours left to mask with, say) or whose input the
//! caller withholds drops at that phase, as it would in a real round. Server-side failures (too few
//! clients, too few shares) are returned as the server's typed errors. Timings use the wall clock,
//! for measurement only: nothing in the protocol reads it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use rand::SeedableRng;
use rand_chacha::ChaCha20Rng;
use rayon::prelude::*;

use super::bench::{Dropouts, PhaseSeconds};
use super::client::SecAggClient;
use super::server::{SecAggOutcome, SecAggServer};
use super::SecAggConfig;
use crate::error::{FedError, Result};

/// Clients per parallel batch of the masking phase: bounds the inputs and masked inputs held at once.
pub(crate) const MASKING_BATCH_CLIENTS: usize = 512;

/// What a driven round produced.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Driven {
    /// The unmasked sum and who is in it.
    pub(crate) outcome: SecAggOutcome,
    /// Wall seconds per phase.
    pub(crate) seconds: PhaseSeconds,
}

/// Runs one round over `clients` (distinct ids), dropping clients as `dropouts` says. At the
/// masked-input phase `input(index, id)` is called (in parallel, at most `MASKING_BATCH_CLIENTS`
/// clients at a time) for each client `clients[index]` still in the round; it returns the client's
/// input as `config.vector_len` fixed-point words, or `None` to withhold it (the client then drops
/// before sending its masked input).
pub(crate) fn drive<F>(config: &SecAggConfig, clients: &[u64], dropouts: &Dropouts, seed: u64, input: F) -> Result<Driven>
where
    F: Fn(usize, u64) -> Option<Vec<u32>> + Sync,
{
    let mut seconds = PhaseSeconds::default();
    let mut server = SecAggServer::new(config);

    let start = Instant::now();
    let mut states: BTreeMap<u64, (SecAggClient, usize)> = BTreeMap::new();
    let built: Vec<(SecAggClient, usize)> = clients
        .par_iter()
        .enumerate()
        .map(|(index, &id)| {
            let mut rng = ChaCha20Rng::seed_from_u64(seed);
            rng.set_stream(id);
            SecAggClient::new(id, config, rng).map(|c| (c, index))
        })
        .collect::<Result<_>>()?;
    let mut adverts = Vec::with_capacity(built.len());
    for (mut client, index) in built {
        adverts.push(client.advertise()?);
        if states.insert(client.id(), (client, index)).is_some() {
            return Err(FedError::Config { field: "secagg.clients".to_string(), reason: "client ids repeat".to_string() });
        }
    }
    adverts.sort_by_key(|a| a.client);
    seconds.client_setup += start.elapsed().as_secs_f64();

    let start = Instant::now();
    for advert in adverts {
        server.receive_keys(advert)?;
    }
    let rosters = server.close_keys()?;
    seconds.server_setup += start.elapsed().as_secs_f64();

    let start = Instant::now();
    states.retain(|id, _| !dropouts.before_sharing.contains(id));
    let work = pair_by_client(&mut states, rosters, |m| m.client);
    let shares: Vec<_> = work.into_par_iter().filter_map(|(state, roster)| state.0.share_keys(&roster).ok()).collect();
    seconds.client_setup += start.elapsed().as_secs_f64();

    let start = Instant::now();
    for msg in shares {
        server.receive_shares(msg)?;
    }
    let forwarded = server.close_shares()?;
    seconds.server_setup += start.elapsed().as_secs_f64();

    states.retain(|id, _| !dropouts.before_masked_input.contains(id));
    let mut work = pair_by_client(&mut states, forwarded, |m| m.client);
    let mut masked_ok = BTreeSet::new();
    while !work.is_empty() {
        let rest = work.split_off(work.len().min(MASKING_BATCH_CLIENTS));
        let start = Instant::now();
        let batch: Vec<_> = work
            .into_par_iter()
            .filter_map(|(state, fwd)| input(state.1, state.0.id()).and_then(|words| state.0.masked_input_words(&fwd, words).ok()))
            .collect();
        seconds.client_masking += start.elapsed().as_secs_f64();
        let start = Instant::now();
        for msg in batch {
            masked_ok.insert(msg.client);
            server.receive_masked(msg)?;
        }
        seconds.server_sum += start.elapsed().as_secs_f64();
        work = rest;
    }

    let start = Instant::now();
    let requests = server.close_masked()?;
    seconds.server_unmask += start.elapsed().as_secs_f64();
    let start = Instant::now();
    states.retain(|id, _| masked_ok.contains(id) && !dropouts.before_unmask.contains(id));
    let work = pair_by_client(&mut states, requests, |m| m.client);
    let answers: Vec<_> = work.into_par_iter().filter_map(|(state, request)| state.0.unmask(&request).ok()).collect();
    seconds.client_unmask += start.elapsed().as_secs_f64();

    let start = Instant::now();
    for msg in answers {
        server.receive_unmask(msg)?;
    }
    let outcome = server.finish()?;
    seconds.server_unmask += start.elapsed().as_secs_f64();
    Ok(Driven { outcome, seconds })
}

/// Pairs each message with the live client state it is addressed to (by `client_of`), in message
/// order; messages for clients no longer live are dropped.
pub(crate) fn pair_by_client<M>(states: &mut BTreeMap<u64, (SecAggClient, usize)>, messages: Vec<M>, client_of: impl Fn(&M) -> u64) -> Vec<(&mut (SecAggClient, usize), M)> {
    let mut by_id: BTreeMap<u64, &mut (SecAggClient, usize)> = states.iter_mut().map(|(id, s)| (*id, s)).collect();
    messages.into_iter().filter_map(|m| by_id.remove(&client_of(&m)).map(|state| (state, m))).collect()
}
