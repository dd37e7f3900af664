//! The coordinator's rounds, in one process: sample K of the online clients by seed, send the model
//! down an aggregator tree, train each sampled client on a worker thread (an edge client exists
//! only while it trains: a borrowed scratch buffer, no per-client object), and sum the weighted
//! updates back up the tree.
//!
//! Invariants:
//! - The tree is a function of K and the fan-in only: the sampled clients, sorted by id, are the
//!   leaves' positions; a leaf node sums up to `fan_in` consecutive positions in order, an inner
//!   node sums its children's partial sums in order. Arrival order, thread count and host count
//!   never enter the sum, so the same seed gives the same model bits for any of them.
//! - Memory per round is O(model x fan-in x depth x threads): a node holds at most `fan_in` partial
//!   sums of its children; no vector of K updates ever exists.
//! - A dropped client (dropout, host down, straggler past the deadline) loses only its update; a
//!   malformed update (wrong length, NaN/inf, bad weight) is rejected and counted; the round goes
//!   on, and a round where nothing arrives leaves the model unchanged.
//!
//! Hosts are contiguous population slices; in this in-process mode they decide which clients a
//! host failure takes down. Over QUIC (`crate::remote`, `rtx fed serve` / `rtx fed clients`) each
//! host process computes its [`Piece`]s of the same tree ([`Federation::host_pieces`]: whole nodes
//! inside its slice, single clients of leaves it shares with a neighbour) and the coordinator
//! finishes the tree in the same order ([`Federation::finish_round`]), so the bits do not depend
//! on the number of host processes either.
//!
//! With `[secagg]` a synchronous round runs secure aggregation instead of the plain tree: `secure.rs`.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use crate::availability::{drops_out, latency_ms, AvailabilityTrace};
use crate::config::FedConfig;
use crate::error::{FedError, Result};
use crate::fedbuff::AsyncState;
use crate::local::{ClientTask, LocalTrainer};
use crate::population::{splitmix64, Population};
use crate::strategy::{ServerOptimizer, UpdateTransform};

mod secure;
pub use secure::{encoding_for, SecAggAbort, SecureCounts, SecureHostRound, SecureRound, WeightedEncoding};

/// What one round (or asynchronous server step) did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoundReport {
    /// 0-based round.
    pub round: u32,
    /// Clients sampled (or, asynchronously, arrivals handled).
    pub sampled: u64,
    /// Clients whose update entered the aggregate.
    pub clients_done: u64,
    /// Clients that never answered (dropout or host down).
    pub dropped: u64,
    /// Clients cut at the deadline.
    pub stragglers: u64,
    /// Updates refused: malformed (wrong length, NaN/inf, bad weight) or, asynchronously, too stale.
    pub rejected: u64,
    /// Clients that answered without data (a partition may leave a client no images).
    pub empty: u64,
    /// Sum of the accepted updates' weights.
    pub total_weight: f64,
    /// Wall-clock seconds of the round (reporting only; no decision reads it).
    pub seconds: f64,
    /// Most model-sized partial sums alive at once during the round (the memory bound: at most
    /// about threads x depth x fan-in, independent of K).
    pub peak_partials: usize,
    /// Secure aggregation's part of the round (`[secagg]` only).
    pub secure: Option<SecureRound>,
}

/// A partial sum travelling up the tree: the weighted sum of the accepted updates under one node,
/// their total weight, what happened to the node's other clients, and who contributed (ascending).
#[derive(Clone, Debug, PartialEq)]
pub struct PartialSum {
    /// Sum of weight x update over the accepted clients, in the tree's order.
    pub sum: Vec<f32>,
    /// Sum of the accepted weights.
    pub weight: f64,
    /// Clients whose update is in `sum`.
    pub done: u64,
    /// Clients that never answered.
    pub dropped: u64,
    /// Clients cut at the deadline.
    pub stragglers: u64,
    /// Malformed updates refused.
    pub rejected: u64,
    /// Clients without data.
    pub empty: u64,
    /// The contributing clients, ascending.
    pub contributors: Vec<u32>,
}

/// What became of one sampled client, as a client host reports it for a leaf it shares with
/// another host (the coordinator finishes that leaf's sum in position order).
#[derive(Clone, Debug, PartialEq)]
pub enum ClientOutcome {
    /// Trained: its update (after the transform's `on_client`) and weight.
    Trained { update: Vec<f32>, weight: f32 },
    /// Never answered (dropout).
    Dropped,
    /// Cut at the deadline.
    Straggler,
    /// Its update was malformed.
    Rejected,
    /// It had no data.
    Empty,
}

/// One piece of a round's aggregation tree, computed by a client host over sampled positions
/// `lo..hi` (see [`Federation::host_pieces`] and [`Federation::finish_round`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    /// The whole tree node over positions `lo..hi`: all of them are this host's.
    Node { lo: u32, hi: u32, partial: PartialSum },
    /// The client at position `pos`, in a leaf shared with another host.
    Client { pos: u32, outcome: ClientOutcome },
}

/// The training outcome of one client, its update left in the caller's buffer.
enum Trained {
    Weight(f32),
    Dropped,
    Straggler,
    Rejected,
    Empty,
}

/// What happened to one sampled client before training.
enum Fate {
    Train,
    Dropped,
    Straggler,
}

/// A whole federation in this process.
pub struct Federation<'d, T: LocalTrainer, X: UpdateTransform> {
    config: FedConfig,
    population: Population,
    host_slices: Vec<Range<u32>>,
    trainer: T,
    transform: X,
    optimizer: ServerOptimizer,
    model: Vec<f32>,
    trace: Option<AvailabilityTrace>,
    pool: rayon::ThreadPool,
    scratch: Mutex<Vec<(T::Scratch, Vec<f32>)>>,
    async_state: Option<AsyncState>,
    round: u32,
    partials_live: AtomicUsize,
    partials_peak: AtomicUsize,
    _data: std::marker::PhantomData<&'d ()>,
}

impl<'d, T: LocalTrainer, X: UpdateTransform> Federation<'d, T, X> {
    /// A federation of `population` training with `trainer`, starting from `initial` (the model).
    pub fn new(config: FedConfig, population: Population, trainer: T, transform: X, initial: Vec<f32>) -> Result<Self> {
        config.validate()?;
        if initial.len() != trainer.n_params() {
            return Err(FedError::config("model", format!("initial model has {} parameters, the trainer {}", initial.len(), trainer.n_params())));
        }
        if u64::from(population.n_clients()) != config.population.n_clients {
            return Err(FedError::config("population.n_clients", "population and config disagree"));
        }
        let trace = match &config.faults.availability_trace {
            Some(path) => Some(AvailabilityTrace::from_file(path, population.n_clients())?),
            None => None,
        };
        let threads = if config.round.threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { config.round.threads };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("fed-worker-{i}"))
            .build()
            .map_err(|e| FedError::config("round.threads", e.to_string()))?;
        let optimizer = ServerOptimizer::new(&config.strategy, initial.len());
        let host_slices = config.host_slices()?;
        encoding_for(&config, &population)?;
        let async_state = config.async_mode.as_ref().map(|a| AsyncState::new(a, &config, &initial));
        Ok(Federation {
            config,
            population,
            host_slices,
            trainer,
            transform,
            optimizer,
            model: initial,
            trace,
            pool,
            scratch: Mutex::new(Vec::new()),
            async_state,
            round: 0,
            partials_live: AtomicUsize::new(0),
            partials_peak: AtomicUsize::new(0),
            _data: std::marker::PhantomData,
        })
    }

    /// The global model.
    pub fn model(&self) -> &[f32] {
        &self.model
    }

    /// The population (dormant state).
    pub fn population(&self) -> &Population {
        &self.population
    }

    /// Rounds run so far.
    pub fn rounds_done(&self) -> u32 {
        self.round
    }

    /// Whether rounds run under secure aggregation (`[secagg]`, synchronous).
    pub fn is_secure(&self) -> bool {
        self.config.secagg.is_some() && self.async_state.is_none()
    }

    /// The host owning client `c`.
    pub fn host_of(&self, c: u32) -> usize {
        self.host_slices.partition_point(|s| s.end <= c)
    }

    /// Runs the next round (or asynchronous server step) and applies the server update.
    pub fn run_round(&mut self) -> Result<RoundReport> {
        let start = Instant::now();
        let mut report = if self.async_state.is_some() { self.run_async_step()? } else { self.run_sync_round()? };
        report.seconds = start.elapsed().as_secs_f64();
        self.round += 1;
        Ok(report)
    }

    /// The clients sampled in `round`, ascending: K of the online clients (all of them when fewer
    /// than K are online), without replacement, by seed.
    pub fn sample(&self, round: u32) -> Vec<u32> {
        let n = self.population.n_clients();
        let k = self.config.round.clients_per_round as usize;
        let mut rng = ChaCha8Rng::seed_from_u64(splitmix64(self.config.seed ^ splitmix64(0x5A3F_0000 + u64::from(round))));
        let mut chosen: Vec<u32> = match &self.trace {
            None => rand::seq::index::sample(&mut rng, n as usize, k.min(n as usize)).into_iter().map(|i| i as u32).collect(),
            Some(trace) => {
                let mut online = Vec::new();
                trace.online_into(n, f64::from(round) * self.config.faults.round_interval_s, &mut online);
                let k = k.min(online.len());
                rand::seq::index::sample(&mut rng, online.len(), k).into_iter().map(|i| online[i]).collect()
            }
        };
        chosen.sort_unstable();
        chosen
    }

    fn run_sync_round(&mut self) -> Result<RoundReport> {
        let round = self.round;
        let sampled = self.sample(round);
        if let Some(params) = self.config.secagg_params()? {
            return self.run_secure_round(round, sampled, params);
        }
        let k = sampled.len();
        let span = tree_span(k, self.config.round.fan_in);
        let partial = {
            let this = &*self;
            this.pool.install(|| this.reduce(&sampled, 0, k, span))
        };
        for &c in &partial.contributors {
            self.population.mark_participation(c, round);
        }
        let report = self.apply(round, partial, k as u64);
        Ok(report)
    }

    /// On a client host: computes this host's pieces of `round`'s aggregation tree from `model`.
    /// `sampled` is the round's whole sample (ascending; only the positions in `own` are read).
    /// A tree node wholly inside `own` comes back summed (on this host's pool, exactly as
    /// in-process); a leaf shared with another host comes back client by client, and the
    /// coordinator finishes it ([`Federation::finish_round`]). This is what keeps a round's bits
    /// independent of how the population is cut into hosts.
    pub fn host_pieces(&mut self, round: u32, model: &[f32], sampled: &[u32], own: Range<usize>) -> Result<Vec<Piece>> {
        self.refuse_secagg_over_hosts()?;
        if model.len() != self.model.len() {
            return Err(FedError::config("model", format!("the coordinator sent {} parameters, this host's model has {}", model.len(), self.model.len())));
        }
        if own.start > own.end || own.end > sampled.len() {
            return Err(FedError::config("round", format!("positions {own:?} are outside the round's {} sampled clients", sampled.len())));
        }
        self.model.copy_from_slice(model);
        self.round = round;
        let fan_in = self.config.round.fan_in;
        let mut jobs = Vec::new();
        plan_pieces(0, sampled.len(), tree_span(sampled.len(), fan_in), fan_in, &own, &mut jobs);
        let pieces: Vec<Piece> = {
            let this = &*self;
            this.pool.install(|| {
                jobs.into_par_iter()
                    .map(|job| match job {
                        Job::Node { lo, hi, span } => Piece::Node { lo: lo as u32, hi: hi as u32, partial: this.reduce(sampled, lo, hi, span) },
                        Job::Client(pos) => {
                            let (mut scratch, mut update) = this.take_scratch();
                            let mut indices = Vec::new();
                            let trained = this.train_client(sampled[pos], &this.model, round, true, &mut scratch, &mut update, &mut indices);
                            let outcome = match trained {
                                Trained::Weight(weight) => ClientOutcome::Trained { update: update.clone(), weight },
                                Trained::Dropped => ClientOutcome::Dropped,
                                Trained::Straggler => ClientOutcome::Straggler,
                                Trained::Rejected => ClientOutcome::Rejected,
                                Trained::Empty => ClientOutcome::Empty,
                            };
                            this.put_scratch(scratch, update);
                            Piece::Client { pos: pos as u32, outcome }
                        }
                    })
                    .collect()
            })
        };
        for piece in &pieces {
            match piece {
                Piece::Node { partial, .. } => partial.contributors.iter().for_each(|&c| self.population.mark_participation(c, round)),
                Piece::Client { pos, outcome: ClientOutcome::Trained { .. } } => self.population.mark_participation(sampled[*pos as usize], round),
                Piece::Client { .. } => {}
            }
        }
        self.partials_live.store(0, Ordering::Relaxed);
        self.partials_peak.store(0, Ordering::Relaxed);
        Ok(pieces)
    }

    /// At the coordinator: finishes the current round from the pieces its client hosts sent (see
    /// [`Federation::host_pieces`]) and applies the server update. Positions no piece covers count
    /// as dropped (their host died, timed out or does not exist): the round loses only those
    /// clients. A piece that does not fit the round (not a node of its tree, a position out of
    /// range, counts that do not add up, a wrong length, non-finite values, a second copy) is
    /// refused and its clients count as dropped; nothing is counted twice. With every piece in,
    /// the model's bits equal those of the in-process round.
    pub fn finish_round(&mut self, pieces: Vec<Piece>) -> Result<RoundReport> {
        self.refuse_secagg_over_hosts()?;
        let round = self.round;
        let sampled = self.sample(round);
        let k = sampled.len();
        let n = self.model.len();
        let fan_in = self.config.round.fan_in;
        let mut nodes = BTreeMap::new();
        let mut clients = BTreeMap::new();
        let mut refused = 0u64;
        for piece in pieces {
            let fits = piece_fits(&piece, &sampled, n);
            match piece {
                Piece::Node { lo, hi, partial } if fits && !nodes.contains_key(&(lo, hi)) => {
                    nodes.insert((lo, hi), partial);
                }
                Piece::Client { pos, outcome } if fits && !clients.contains_key(&pos) => {
                    clients.insert(pos, outcome);
                }
                _ => refused += 1,
            }
        }
        if refused > 0 {
            tracing::warn!(round, refused, "pieces refused: their clients count as dropped");
        }
        let partial = self.assemble(&sampled, 0, k, tree_span(k, fan_in), &mut nodes, &mut clients);
        for &c in &partial.contributors {
            self.population.mark_participation(c, round);
        }
        let report = self.apply(round, partial, k as u64);
        self.round += 1;
        Ok(report)
    }

    /// Plain pieces are for plain (or DP) synchronous rounds: under `[secagg]` hosts run the secure
    /// phases instead (`secure_host_start` and the rest), and the asynchronous mode runs only in
    /// one process.
    fn refuse_secagg_over_hosts(&self) -> Result<()> {
        if self.config.secagg.is_some() || self.async_state.is_some() {
            return Err(FedError::config(
                if self.config.secagg.is_some() { "secagg" } else { "async" },
                "plain round pieces are not made under [secagg] (its rounds run the secure phases) nor under [async] (one process only: rtx fed run)",
            ));
        }
        Ok(())
    }

    /// Rebuilds the sum of the node over positions `lo..hi` from the pieces: the host's sum when it
    /// sent the whole node, else the children's (or, in a leaf, the clients') in order.
    fn assemble(&self, sampled: &[u32], lo: usize, hi: usize, span: usize, nodes: &mut BTreeMap<(u32, u32), PartialSum>, clients: &mut BTreeMap<u32, ClientOutcome>) -> PartialSum {
        let n = self.model.len();
        if let Some(partial) = nodes.remove(&(lo as u32, hi as u32)) {
            return partial;
        }
        let fan_in = self.config.round.fan_in;
        if span <= fan_in {
            let mut partial = PartialSum::empty(n);
            for (pos, &c) in sampled.iter().enumerate().take(hi).skip(lo) {
                match clients.remove(&(pos as u32)) {
                    Some(ClientOutcome::Trained { update, weight }) => partial.add(c, Trained::Weight(weight), &update, 1.0),
                    Some(ClientOutcome::Dropped) | None => partial.add(c, Trained::Dropped, &[], 1.0),
                    Some(ClientOutcome::Straggler) => partial.add(c, Trained::Straggler, &[], 1.0),
                    Some(ClientOutcome::Rejected) => partial.add(c, Trained::Rejected, &[], 1.0),
                    Some(ClientOutcome::Empty) => partial.add(c, Trained::Empty, &[], 1.0),
                }
            }
            return partial;
        }
        let child = span / fan_in;
        let children: Vec<PartialSum> = (lo..hi).step_by(child).map(|a| self.assemble(sampled, a, (a + child).min(hi), child, nodes, clients)).collect();
        merge(children, n)
    }

    /// Applies a summed partial: transform hook, mean, server optimizer.
    fn apply(&mut self, round: u32, mut partial: PartialSum, sampled: u64) -> RoundReport {
        self.partials_live.store(0, Ordering::Relaxed);
        let mut total = partial.weight;
        self.transform.on_sum(round, &mut partial.sum, &mut total, &partial.contributors);
        if total > 0.0 && total.is_finite() {
            let inv = (1.0 / total) as f32;
            let scale = self.async_state.as_ref().map_or(1.0, |a| a.server_lr);
            partial.sum.iter_mut().for_each(|s| *s *= inv * scale);
            self.optimizer.apply(&mut self.model, &partial.sum);
        }
        RoundReport {
            round,
            sampled,
            clients_done: partial.done,
            dropped: partial.dropped,
            stragglers: partial.stragglers,
            rejected: partial.rejected,
            empty: partial.empty,
            total_weight: total,
            seconds: 0.0,
            peak_partials: self.partials_peak.swap(0, Ordering::Relaxed),
            secure: None,
        }
    }

    /// Sums positions `lo..hi` of `sampled` under a node whose subtree spans `span` positions.
    fn reduce(&self, sampled: &[u32], lo: usize, hi: usize, span: usize) -> PartialSum {
        let fan_in = self.config.round.fan_in;
        if span <= fan_in {
            return self.leaf(sampled, lo..hi, &self.model, self.round, true, |_| 1.0);
        }
        let child = span / fan_in;
        let children: Vec<PartialSum> =
            (lo..hi).step_by(child).collect::<Vec<_>>().into_par_iter().map(|a| self.reduce(sampled, a, (a + child).min(hi), child)).collect();
        self.partials_merged(children.len());
        merge(children, self.model.len())
    }

    /// A leaf aggregator: trains positions `range` of `clients` one after another on this thread
    /// from `model`, and sums their accepted updates (weight times `factor(position)`) in order.
    /// With `check_fate` each client's dropout / host failure / deadline is decided here (the
    /// asynchronous mode decides those when the client is launched).
    #[allow(clippy::too_many_arguments)]
    fn leaf(&self, clients: &[u32], range: Range<usize>, model: &[f32], round: u32, check_fate: bool, factor: impl Fn(usize) -> f32) -> PartialSum {
        let (mut scratch, mut update) = self.take_scratch();
        let mut partial = PartialSum::empty(model.len());
        let live = self.partials_live.fetch_add(1, Ordering::Relaxed) + 1;
        self.partials_peak.fetch_max(live, Ordering::Relaxed);
        let mut indices = Vec::new();
        for pos in range {
            let c = clients[pos];
            let trained = self.train_client(c, model, round, check_fate, &mut scratch, &mut update, &mut indices);
            partial.add(c, trained, &update, factor(pos));
        }
        self.put_scratch(scratch, update);
        partial
    }

    /// Trains client `c` (unless its fate says it never answers), leaving its update in `update`.
    #[allow(clippy::too_many_arguments)]
    fn train_client(&self, c: u32, model: &[f32], round: u32, check_fate: bool, scratch: &mut T::Scratch, update: &mut Vec<f32>, indices: &mut Vec<u32>) -> Trained {
        let fate = if check_fate { self.fate(round, c) } else { Fate::Train };
        match fate {
            Fate::Dropped => return Trained::Dropped,
            Fate::Straggler => return Trained::Straggler,
            Fate::Train => {}
        }
        self.population.indices_into(c, indices);
        let task = ClientTask { client: c, round, seed: self.config.seed, indices };
        let mut weight = self.trainer.train(&task, model, scratch, update);
        self.transform.on_client(round, c, update, &mut weight);
        if !valid_update(update, weight, model.len()) {
            tracing::debug!(client = c, round, len = update.len(), weight, "malformed update rejected");
            return Trained::Rejected;
        }
        if weight == 0.0 {
            return Trained::Empty; // a client without data contributes nothing
        }
        Trained::Weight(weight)
    }

    fn fate(&self, round: u32, c: u32) -> Fate {
        let f = &self.config.faults;
        let r = u64::from(round);
        let host = self.host_of(c);
        if f.host_down.iter().any(|d| d.host == host && d.round == round) || drops_out(self.config.seed, r, c, f.dropout_rate) {
            return Fate::Dropped;
        }
        if let Some(deadline) = f.deadline_ms {
            if latency_ms(self.config.seed, r, c, f.latency_median_ms, f.latency_sigma) > deadline {
                return Fate::Straggler;
            }
        }
        Fate::Train
    }

    /// Book-keeping of live partial sums: merging `n` leaves one.
    fn partials_merged(&self, n: usize) {
        self.partials_live.fetch_sub(n.saturating_sub(1), Ordering::Relaxed);
    }

    fn take_scratch(&self) -> (T::Scratch, Vec<f32>) {
        let pooled = self.scratch.lock().map(|mut pool| pool.pop()).unwrap_or(None);
        pooled.unwrap_or_else(|| (self.trainer.scratch(), Vec::with_capacity(self.model.len())))
    }

    fn put_scratch(&self, scratch: T::Scratch, update: Vec<f32>) {
        if let Ok(mut pool) = self.scratch.lock() {
            pool.push((scratch, update));
        }
    }

    /// One FedBuff server step (see [`crate::fedbuff`]).
    fn run_async_step(&mut self) -> Result<RoundReport> {
        let Some(mut state) = self.async_state.take() else {
            return Err(FedError::config("async", "not in asynchronous mode"));
        };
        let arrivals = state.collect_arrivals(&self.config, &self.population, self.trace.as_ref());
        let weights: Vec<f32> = arrivals.accepted.iter().map(|a| state.staleness_factor(a.version)).collect();
        let clients: Vec<u32> = arrivals.accepted.iter().map(|a| a.client).collect();
        let fan_in = self.config.round.fan_in;
        let partial = {
            let this = &*self;
            let state = &state;
            let accepted = &arrivals.accepted;
            this.pool.install(|| {
                let leaves: Vec<PartialSum> = (0..clients.len())
                    .step_by(fan_in)
                    .collect::<Vec<_>>()
                    .into_par_iter()
                    .map(|lo| {
                        // A leaf holds consecutive arrivals; they may have trained on different
                        // versions, so each sub-run of one version is trained from its model.
                        let hi = (lo + fan_in).min(clients.len());
                        let mut acc = PartialSum::empty(this.model.len());
                        let mut a = lo;
                        while a < hi {
                            let version = accepted[a].version;
                            let mut b = a + 1;
                            while b < hi && accepted[b].version == version {
                                b += 1;
                            }
                            let model = state.model_of(version);
                            let part = this.leaf(&clients, a..b, model, version, false, |p| weights[p]);
                            this.partials_merged(2);
                            acc = merge(vec![acc, part], this.model.len());
                            a = b;
                        }
                        acc
                    })
                    .collect();
                this.partials_merged(leaves.len());
                merge(leaves, this.model.len())
            })
        };
        let mut partial = partial;
        // The divisor is the accepted sample count (staleness only shrinks an update's pull).
        partial.dropped += arrivals.dropped;
        partial.stragglers += arrivals.stragglers;
        partial.rejected += arrivals.stale;
        for &c in &partial.contributors {
            self.population.mark_participation(c, self.round);
        }
        let round = self.round;
        self.async_state = Some(state);
        let report = self.apply(round, partial, arrivals.handled);
        if let Some(state) = self.async_state.as_mut() {
            state.publish(&self.model);
        }
        Ok(report)
    }
}

impl PartialSum {
    /// Nothing summed yet, for a model of `n` parameters.
    pub fn empty(n: usize) -> Self {
        PartialSum { sum: vec![0.0; n], weight: 0.0, done: 0, dropped: 0, stragglers: 0, rejected: 0, empty: 0, contributors: Vec::new() }
    }

    /// Adds client `c`'s outcome (its update in `update` when trained) with weight factor `factor`:
    /// the one place a leaf's sum grows, on a host and at the coordinator alike, so both give the
    /// same bits.
    fn add(&mut self, c: u32, trained: Trained, update: &[f32], factor: f32) {
        match trained {
            Trained::Dropped => self.dropped += 1,
            Trained::Straggler => self.stragglers += 1,
            Trained::Rejected => self.rejected += 1,
            Trained::Empty => self.empty += 1,
            Trained::Weight(weight) => {
                let w = weight * factor;
                for (s, &u) in self.sum.iter_mut().zip(update) {
                    *s += w * u;
                }
                self.weight += f64::from(weight);
                self.done += 1;
                self.contributors.push(c);
            }
        }
    }
}

/// Sums partials in their order into the first.
fn merge(children: Vec<PartialSum>, n: usize) -> PartialSum {
    let mut iter = children.into_iter();
    let mut acc = iter.next().unwrap_or_else(|| PartialSum::empty(n));
    for p in iter {
        for (a, &b) in acc.sum.iter_mut().zip(&p.sum) {
            *a += b;
        }
        acc.weight += p.weight;
        acc.done += p.done;
        acc.dropped += p.dropped;
        acc.stragglers += p.stragglers;
        acc.rejected += p.rejected;
        acc.empty += p.empty;
        acc.contributors.extend_from_slice(&p.contributors);
    }
    acc
}

/// An update is accepted when it has the model's length, finite values and a finite,
/// non-negative weight.
pub fn valid_update(update: &[f32], weight: f32, n_params: usize) -> bool {
    // A non-short-circuit fold vectorizes (`all` does not); this check is on every update.
    update.len() == n_params && weight.is_finite() && weight >= 0.0 && update.iter().fold(true, |ok, u| ok & u.is_finite())
}

/// The span of the tree's root for `k` sampled clients: the smallest power of `fan_in` that is
/// at least `k` (a node of span `s` has children of span `s / fan_in`; a leaf has span `fan_in`).
fn tree_span(k: usize, fan_in: usize) -> usize {
    let mut span = fan_in;
    while span < k {
        span = span.saturating_mul(fan_in);
    }
    span
}

/// A unit of a client host's work: a whole tree node, or one client of a shared leaf.
enum Job {
    Node { lo: usize, hi: usize, span: usize },
    Client(usize),
}

/// The pieces of the node `lo..hi` (span `span`) that positions `own` hold, in tree order: the
/// node itself when `own` covers it, else its children's pieces, down to single clients in leaves.
fn plan_pieces(lo: usize, hi: usize, span: usize, fan_in: usize, own: &Range<usize>, jobs: &mut Vec<Job>) {
    if lo >= hi || own.start >= hi || own.end <= lo {
        return;
    }
    if own.start <= lo && hi <= own.end {
        jobs.push(Job::Node { lo, hi, span });
    } else if span <= fan_in {
        jobs.extend((lo.max(own.start)..hi.min(own.end)).map(Job::Client));
    } else {
        let child = span / fan_in;
        for a in (lo..hi).step_by(child) {
            plan_pieces(a, (a + child).min(hi), child, fan_in, own, jobs);
        }
    }
}

/// Whether a host's piece fits the round: inside the sample, consistent counts and contributors,
/// the model's length, finite values.
fn piece_fits(piece: &Piece, sampled: &[u32], n_params: usize) -> bool {
    match piece {
        Piece::Node { lo, hi, partial } => {
            let (lo, hi) = (*lo as usize, *hi as usize);
            let counted = partial.done + partial.dropped + partial.stragglers + partial.rejected + partial.empty;
            lo < hi
                && hi <= sampled.len()
                && counted == (hi - lo) as u64
                && partial.contributors.len() as u64 == partial.done
                && partial.contributors.windows(2).all(|w| w[0] < w[1])
                && partial.contributors.iter().all(|c| sampled[lo..hi].binary_search(c).is_ok())
                && partial.weight.is_finite()
                && partial.weight >= 0.0
                && valid_update(&partial.sum, 0.0, n_params)
        }
        Piece::Client { pos, outcome } => {
            (*pos as usize) < sampled.len()
                && match outcome {
                    ClientOutcome::Trained { update, weight } => *weight > 0.0 && valid_update(update, *weight, n_params),
                    _ => true,
                }
        }
    }
}
