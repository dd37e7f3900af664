//! Federated scenarios: the **real** federation coordinator ([`CoordinatorCore`]) and client hosts
//! ([`HostSession`]) of `rtx fed serve` / `rtx fed clients`, in one thread under virtual time,
//! linked by the simulated control network ([`ControlNet`]: production link envelopes, seeded
//! latency and jitter, partitions, idle timeouts, killed connections), with host crashes,
//! restarts, partitions and slow links at seeded moments.
//!
//! A host process that loses its coordinator restarts after `rejoin_after_s` and joins again with
//! a fresh federation state, as a process manager would restart `rtx fed clients`. A crashed host
//! stays down for its fault's `for_s` (or for good).
//!
//! Invariants, checked after every round and at the end:
//! - `twin-equal`: every round's global model equals, bit for bit, the in-process federation's
//!   (`Federation::run_round`, no network) with the `host_down` fault for every host that did not
//!   deliver that round; its counts (sampled, done, dropped, stragglers, rejected, empty) too.
//!   So a round's aggregate is exactly the sum of the updates that arrived from the hosts that
//!   delivered, none counted twice, none from a lost or late host.
//! - `exactly-once`: each round's counts add up to its sample.
//! - `round-deadline`: no round takes longer than the round timeout (virtual time).
//! - `quiet-host-kept`: a host that no fault touched during a round (nor just before it, while it
//!   could still be catching up) delivers that round.
//! - `liveness`: every host joins at the start and the federation finishes all its rounds
//!   within `max_virtual_s`.
//! - `unmask-exact` (secure rounds, `[federation.secagg]`, instead of `twin-equal`): the unmasked
//!   sum equals the sum in Z_2^32 of the included clients' encoded inputs, recomputed from their
//!   data; a round that could not be unmasked left the model unchanged. A secure round has four
//!   phases, each with the round timeout, so `round-deadline` allows four.
//!
//! The trace hash folds in every byte the control network carried (with its virtual time), the
//! faults and every round's model bits, so the same seed gives the same hash.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant as WallInstant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rtx_actors::LinkOptions;
use rtx_federated::config::{parse_slice, HostDown};
use rtx_federated::remote::{CoordinatorCore, CoordinatorOptions, HostOptions, HostSession, RemoteRound};
use rtx_federated::{FedConfig, FedData, Federation, LogReg, LogRegSgd, Plain, Population, RoundReport};
use rtx_supervisor::ControlDialer;
use serde::Deserialize;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::cluster::Violation;
use crate::control::{ControlConfig, ControlNet};
use crate::error::{Result, SimError};
use crate::swarm::run_seeds;
use crate::trace::TraceHash;

/// How many recent rounds and faults a violation report carries.
const RECENT: usize = 48;

/// A federated scenario: hosts, timing, network, faults and the federation's own config.
#[derive(Clone, Debug, PartialEq)]
pub struct FedScenario {
    /// The file's `[scenario]` table.
    pub shape: FedShape,
    /// The control network.
    pub network: FedNetwork,
    /// Faults drawn from the seed.
    pub random: FedRandom,
    /// Explicit faults.
    pub faults: Vec<FedFault>,
    /// The federation's config (as `rtx fed run` reads it).
    pub config: FedConfig,
    /// Its TOML text as written (sent to every host that joins).
    pub config_toml: String,
    /// Each host's population slice.
    pub slices: Vec<Range<u32>>,
}

/// The `[scenario]` table of a federated scenario.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FedShape {
    /// Must be `"federation"`.
    pub kind: String,
    /// Each client host's population slice, `"A..B"`; they tile `0..n_clients` in order.
    pub hosts: Vec<String>,
    /// How long a round waits for its hosts.
    pub round_timeout_s: f64,
    /// Virtual time a host spends on a round before its pieces leave.
    #[serde(default = "default_host_compute_ms")]
    pub host_compute_ms: u64,
    /// A host process that lost its coordinator restarts and joins again after this long.
    #[serde(default = "default_rejoin_after_s")]
    pub rejoin_after_s: f64,
    /// The federation must finish within this much virtual time.
    #[serde(default = "default_max_virtual_s")]
    pub max_virtual_s: f64,
}

/// The `[network]` table of a federated scenario.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FedNetwork {
    /// One-way latency.
    #[serde(default = "default_latency_ms")]
    pub latency_ms: f64,
    /// Extra latency drawn per chunk from `0..=jitter_ms`.
    #[serde(default)]
    pub jitter_ms: f64,
    /// A host cut off this long loses its connection (QUIC idle timeout).
    #[serde(default = "default_idle_timeout_s")]
    pub idle_timeout_s: f64,
}

/// The `[random]` table: faults drawn from the seed, at moments in `0..window_s`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FedRandom {
    /// Host process crashes (each restarts after 0.5 s to three round timeouts).
    #[serde(default)]
    pub crashes: u32,
    /// Partitions of a host (0.2 s to twice the idle timeout: some outlive the connection).
    #[serde(default)]
    pub partitions: u32,
    /// Slow links (100 ms to two round timeouts of extra latency, for 1 s to three round timeouts).
    #[serde(default)]
    pub slow_links: u32,
    /// The faults happen in `0..window_s` of virtual time.
    #[serde(default)]
    pub window_s: f64,
}

/// What a fault does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FedFaultKind {
    /// The host's process dies (its connection closes at once); it restarts after `for_s`, or
    /// never without it.
    Crash,
    /// The host is cut off for `for_s` (bytes held; past the idle timeout the connection closes).
    Partition,
    /// The host's link gets `delay_ms` of extra latency for `for_s`.
    Slow,
}

/// One fault.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FedFault {
    /// What happens.
    pub kind: FedFaultKind,
    /// To which host (index into `hosts`).
    pub host: usize,
    /// When (virtual seconds from the start).
    pub at_s: f64,
    /// For how long (a crash without it stays down).
    #[serde(default)]
    pub for_s: Option<f64>,
    /// Extra latency of a slow link.
    #[serde(default)]
    pub delay_ms: f64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FedScenarioFile {
    scenario: FedShape,
    #[serde(default = "default_network")]
    network: FedNetwork,
    #[serde(default)]
    random: FedRandom,
    #[serde(default)]
    faults: Vec<FedFault>,
    federation: toml::Table,
}

fn default_host_compute_ms() -> u64 {
    200
}
fn default_rejoin_after_s() -> f64 {
    1.0
}
fn default_max_virtual_s() -> f64 {
    3600.0
}
fn default_latency_ms() -> f64 {
    2.0
}
fn default_idle_timeout_s() -> f64 {
    2.0
}
fn default_network() -> FedNetwork {
    FedNetwork { latency_ms: default_latency_ms(), jitter_ms: 0.0, idle_timeout_s: default_idle_timeout_s() }
}

impl FedScenario {
    /// Whether the TOML text is a federated scenario (`[scenario] kind = "federation"`).
    pub fn is_federated(text: &str) -> bool {
        let Ok(table) = text.parse::<toml::Table>() else { return false };
        table.get("scenario").and_then(|s| s.get("kind")).and_then(|k| k.as_str()) == Some("federation")
    }

    /// Reads a federated scenario file; a relative availability trace is found beside it.
    pub fn load(path: &Path) -> Result<FedScenario> {
        let text = std::fs::read_to_string(path).map_err(|e| SimError::Scenario(format!("cannot read {}: {e}", path.display())))?;
        FedScenario::parse(&text, path.parent().unwrap_or(Path::new(".")))
    }

    /// Parses a federated scenario; relative paths in it are taken from `dir`.
    pub fn parse(text: &str, dir: &Path) -> Result<FedScenario> {
        let bad = |what: String| SimError::Scenario(what);
        let file: FedScenarioFile = toml::from_str(text).map_err(|e| bad(format!("federated scenario: {e}")))?;
        let FedScenarioFile { scenario: shape, network, random, faults, mut federation } = file;
        if shape.kind != "federation" {
            return Err(bad(format!("scenario.kind is {:?}; a federated scenario says \"federation\"", shape.kind)));
        }
        // The text sent to hosts is the table as written, so the traffic (and the trace hash) does
        // not depend on where the checkout lives; the config everyone builds from has the
        // availability trace's path resolved beside the scenario file.
        let config_toml = toml::to_string(&federation).map_err(|e| bad(format!("federation: {e}")))?;
        if let Some(toml::Value::String(trace)) = federation.get_mut("faults").and_then(|f| f.get_mut("availability_trace")) {
            if Path::new(trace.as_str()).is_relative() {
                *trace = dir.join(trace.as_str()).to_string_lossy().into_owned();
            }
        }
        let resolved = toml::to_string(&federation).map_err(|e| bad(format!("federation: {e}")))?;
        let config = FedConfig::from_toml_str(&resolved).map_err(|e| bad(format!("federation: {e}")))?;
        if config.async_mode.is_some() || config.dp.is_some() {
            return Err(bad("federation: [async] does not run over client hosts (rtx fed serve refuses it too), and [dp] is not simulated yet".into()));
        }
        if !config.faults.host_down.is_empty() || config.round.hosts != 1 || !config.round.host_slices.is_empty() {
            return Err(bad("federation: hosts and their faults come from the scenario ([scenario] hosts, [[faults]]), not from round.hosts, round.host_slices or faults.host_down".into()));
        }
        let n = config.population.n_clients;
        let mut slices = Vec::new();
        let mut next = 0u64;
        for (i, text) in shape.hosts.iter().enumerate() {
            let slice = parse_slice(text, n).map_err(|why| bad(format!("scenario.hosts[{i}]: {why}")))?;
            if u64::from(slice.start) != next {
                return Err(bad(format!("scenario.hosts[{i}] = {text} must start at {next}: the slices tile 0..{n} in order")));
            }
            next = u64::from(slice.end);
            slices.push(slice);
        }
        if next != n || slices.is_empty() {
            return Err(bad(format!("scenario.hosts end at {next}, not at the population's {n} clients")));
        }
        let positive = |what: &str, v: f64| if v.is_finite() && v > 0.0 { Ok(()) } else { Err(bad(format!("{what} = {v} must be a positive number of seconds"))) };
        positive("scenario.round_timeout_s", shape.round_timeout_s)?;
        positive("scenario.rejoin_after_s", shape.rejoin_after_s)?;
        positive("scenario.max_virtual_s", shape.max_virtual_s)?;
        positive("network.idle_timeout_s", network.idle_timeout_s)?;
        if !(network.latency_ms >= 0.0 && network.jitter_ms >= 0.0) {
            return Err(bad("network.latency_ms and jitter_ms must be >= 0".into()));
        }
        if random.crashes + random.partitions + random.slow_links > 0 {
            positive("random.window_s", random.window_s)?;
        }
        for (i, f) in faults.iter().enumerate() {
            if f.host >= slices.len() {
                return Err(bad(format!("faults[{i}].host = {} but there are {} hosts", f.host, slices.len())));
            }
            if !(f.at_s.is_finite() && f.at_s >= 0.0) {
                return Err(bad(format!("faults[{i}].at_s must be >= 0")));
            }
            match (f.kind, f.for_s) {
                (FedFaultKind::Crash, None) => {}
                (_, Some(d)) => positive(&format!("faults[{i}].for_s"), d)?,
                (_, None) => return Err(bad(format!("faults[{i}]: a {:?} needs for_s", f.kind))),
            }
            if f.kind == FedFaultKind::Slow && !(f.delay_ms.is_finite() && f.delay_ms > 0.0) {
                return Err(bad(format!("faults[{i}]: a slow link needs delay_ms > 0")));
            }
        }
        Ok(FedScenario { shape, network, random, faults, config, config_toml, slices })
    }

    /// The explicit faults and those drawn from `seed`, by time.
    pub fn faults_for(&self, seed: u64) -> Vec<FedFault> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xFED0_5EED);
        let hosts = self.slices.len();
        let r = &self.random;
        let timeout = self.shape.round_timeout_s;
        let idle = self.network.idle_timeout_s;
        let mut faults = self.faults.clone();
        let mut draw = |kind: FedFaultKind, count: u32, for_s: Range<f64>, delay_ms: Range<f64>| {
            for _ in 0..count {
                let host = rng.random_range(0..hosts);
                let at_s = rng.random_range(0.0..r.window_s);
                let for_s = Some(rng.random_range(for_s.clone()));
                let delay_ms = if delay_ms.is_empty() { 0.0 } else { rng.random_range(delay_ms.clone()) };
                faults.push(FedFault { kind, host, at_s, for_s, delay_ms });
            }
        };
        draw(FedFaultKind::Crash, r.crashes, 0.5..(3.0 * timeout).max(0.6), 0.0..0.0);
        draw(FedFaultKind::Partition, r.partitions, 0.2..(2.0 * idle).max(0.3), 0.0..0.0);
        draw(FedFaultKind::Slow, r.slow_links, 1.0..(3.0 * timeout).max(1.1), 100.0..(2000.0 * timeout).max(101.0));
        faults.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
        faults
    }
}

/// What one seed of a federated scenario did.
#[derive(Clone, Debug)]
pub struct FedOutcome {
    /// The seed.
    pub seed: u64,
    /// The trace hash: control traffic, faults, every round's model bits.
    pub trace: u64,
    /// The first broken invariant, if any.
    pub violation: Option<Violation>,
    /// Rounds finished.
    pub rounds: u32,
    /// Faults fired.
    pub faults: usize,
    /// Invariant checks that passed.
    pub checks: u64,
    /// Virtual time the federation took.
    pub virtual_time: Duration,
    /// Over all rounds: hosts that delivered, were lost mid-round, or were late.
    pub hosts_done: u64,
    /// See `hosts_done`.
    pub hosts_lost: u64,
    /// See `hosts_done`.
    pub hosts_late: u64,
    /// Joins accepted after the first (restarted or reconnected hosts).
    pub rejoins: u64,
    /// Over all rounds: clients whose update counted, and clients dropped.
    pub clients_done: u64,
    /// See `clients_done`.
    pub dropped: u64,
    /// Test accuracy of the final global model.
    pub accuracy: f64,
    /// Secure rounds (`[secagg]`) that could not be unmasked (the model stayed).
    pub secure_aborted: u64,
    /// Over the secure rounds: included clients whose self-masks were rebuilt from their
    /// neighbours' shares because they were gone before unmasking.
    pub secure_recovered: u64,
}

/// What a federated swarm found.
#[derive(Clone, Debug)]
pub struct FedSwarmReport {
    /// Every seed's outcome, by seed.
    pub outcomes: Vec<FedOutcome>,
    /// Wall time of the whole swarm.
    pub wall: Duration,
    /// Threads used.
    pub threads: usize,
}

/// Runs seed `seed` of `scenario` (data from `data_root`); `planted_bug` plants a known bug in
/// the coordinator (test-only, see `CoordinatorOptions::planted_bug`) for the invariants to catch.
pub fn run_fed_seed(scenario: &FedScenario, seed: u64, data_root: &Path, planted_bug: bool) -> Result<FedOutcome> {
    let data = fed_data(data_root, &scenario.config)?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build()?;
    let local = tokio::task::LocalSet::new();
    let (mut outcome, rounds, log) = local.block_on(&runtime, simulate(scenario, seed, data.clone(), planted_bug))?;
    // The twin models a missing host as `host_down` (its clients vanish before sharing keys); in
    // a secure round a host can vanish at any phase, so secure rounds are checked by
    // `unmask-exact` instead.
    if outcome.violation.is_none() && scenario.config.secagg.is_none() {
        outcome.violation = check_twin(scenario, &data, &rounds)?.map(|v| Violation { recent: log, ..v });
        if outcome.violation.is_none() {
            outcome.checks += u64::from(outcome.rounds);
        }
    }
    Ok(outcome)
}

/// Runs `seeds` of `scenario` on `threads` threads (`planted_bug`: see [`run_fed_seed`]).
pub fn fed_swarm(scenario: &FedScenario, seeds: Range<u64>, threads: usize, data_root: &Path, planted_bug: bool) -> Result<FedSwarmReport> {
    let started = WallInstant::now();
    let threads = threads.max(1);
    let mut outcomes = run_seeds(seeds, threads, |seed| run_fed_seed(scenario, seed, data_root, planted_bug))?;
    outcomes.sort_by_key(|o| o.seed);
    Ok(FedSwarmReport { outcomes, wall: started.elapsed(), threads })
}

/// Loaded federation data by (data folder, dataset and seed).
type DataCache = Mutex<Vec<(PathBuf, String, Arc<FedData>)>>;

/// The federation's data, loaded once per process and kind.
fn fed_data(root: &Path, config: &FedConfig) -> Result<Arc<FedData>> {
    static CACHE: OnceLock<DataCache> = OnceLock::new();
    let key = format!("{:?}/{}", config.population.dataset, config.seed);
    let cache = CACHE.get_or_init(|| Mutex::new(Vec::new()));
    let mut cache = cache.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((_, _, data)) = cache.iter().find(|(r, k, _)| r == root && *k == key) {
        return Ok(data.clone());
    }
    let data = Arc::new(FedData::load(root, config.population.dataset, config.seed).map_err(|e| SimError::Data(e.to_string()))?);
    cache.push((root.to_path_buf(), key, data.clone()));
    Ok(data)
}

/// A federation of the reference workload (logistic regression) over `data`.
fn federation<'d>(config: &FedConfig, data: &'d FedData) -> rtx_federated::Result<Federation<'d, LogRegSgd<'d>, Plain>> {
    let shape = LogReg { n_features: data.n_features(), n_classes: data.n_classes() };
    let population = Population::new(&config.population, config.seed, &data.train.labels)?;
    let l = &config.local;
    let trainer = LogRegSgd::new(shape, &data.train, l.lr, l.batch_size, l.epochs, config.strategy.mu, l.shuffle);
    Federation::new(config.clone(), population, trainer, Plain, vec![0.0; shape.n_params()])
}

/// One round as the simulation saw it.
#[derive(Clone, Debug)]
struct RoundRecord {
    report: RoundReport,
    /// Hosts (by index) that delivered.
    done: Vec<usize>,
    model_hash: u64,
}

fn model_hash(model: &[f32]) -> u64 {
    let mut h = TraceHash::default();
    for v in model {
        h.absorb_u64(u64::from(v.to_bits()));
    }
    h.value()
}

/// Whether two configs are equal but for the availability trace's path.
fn same_but_trace(a: &FedConfig, b: &FedConfig) -> bool {
    let mut a = a.clone();
    a.faults.availability_trace.clone_from(&b.faults.availability_trace);
    a == *b
}

fn host_index(name: &str) -> Option<usize> {
    name.strip_prefix("host-")?.parse().ok()
}

/// The simulated world: the network, the hosts' processes and the log of what happened.
struct World {
    scenario: FedScenario,
    net: ControlNet,
    addr: SocketAddr,
    token: String,
    data: Arc<FedData>,
    link: LinkOptions,
    start: Instant,
    /// Each host's running process (None while crashed).
    processes: RefCell<Vec<Option<JoinHandle<()>>>>,
    /// Per host: the virtual-time windows in which a fault touched it.
    disturbed: RefCell<Vec<Vec<(Duration, Duration)>>>,
    log: RefCell<Vec<String>>,
    trace: RefCell<TraceHash>,
}

impl World {
    fn note(&self, line: String) {
        let t = self.start.elapsed().as_secs_f64();
        self.trace.borrow_mut().absorb(line.as_bytes());
        let mut log = self.log.borrow_mut();
        log.push(format!("{t:9.3} s  {line}"));
        let excess = log.len().saturating_sub(RECENT);
        log.drain(..excess);
    }

    /// Starts host `i`'s process (replacing a crashed one).
    fn spawn_host(self: &Rc<World>, i: usize) {
        let world = Rc::clone(self);
        let handle = tokio::task::spawn_local(async move { world.host_process(i).await });
        if let Some(old) = self.processes.borrow_mut()[i].replace(handle) {
            old.abort();
        }
    }

    /// Host `i`'s process: join, serve; after a lost coordinator, restart and join again.
    async fn host_process(self: Rc<World>, i: usize) {
        let slice = self.scenario.slices[i].clone();
        let compute = Duration::from_millis(self.scenario.shape.host_compute_ms);
        let rejoin = Duration::from_secs_f64(self.scenario.shape.rejoin_after_s);
        loop {
            let options = HostOptions { join: self.addr, token: self.token.clone(), slice: slice.clone(), name: format!("host-{i}"), pid: 1000 + i as u32, compute_delay: compute, link: self.link.clone() };
            let ended = match self.net.dialer(i).dial().await {
                Err(e) => format!("dial failed: {e}"),
                Ok((link, inbound)) => match HostSession::join_over(link, inbound, options).await {
                    Err(e) => format!("join failed: {e}"),
                    // The received text names the availability trace relative to the scenario
                    // file; the host builds from the scenario's resolved config, checked equal
                    // otherwise.
                    Ok((_, received, _)) if !same_but_trace(&received, &self.scenario.config) => format!("received a config that differs from the scenario's: {received:?}"),
                    Ok((session, _, _)) => match federation(&self.scenario.config, &self.data) {
                        Err(e) => format!("cannot build the federation: {e}"),
                        Ok(mut fed) => match session.serve(&mut fed).await {
                            Ok(_) => return,
                            Err(e) => format!("coordinator lost: {e}"),
                        },
                    },
                },
            };
            self.note(format!("host-{i}: {ended}; restarting in {:.1} s", rejoin.as_secs_f64()));
            tokio::time::sleep(rejoin).await;
        }
    }

    /// Fires `faults` at their times.
    async fn drive_faults(self: Rc<World>, faults: Vec<FedFault>) {
        for fault in faults {
            let at = self.start + Duration::from_secs_f64(fault.at_s);
            tokio::time::sleep_until(at).await;
            let i = fault.host;
            let dur = fault.for_s.map(Duration::from_secs_f64);
            // How long the fault can still matter: its span, a restart, and rounds queued behind it.
            let timeout = Duration::from_secs_f64(self.scenario.shape.round_timeout_s);
            let tail = Duration::from_secs_f64(self.scenario.shape.rejoin_after_s + self.scenario.network.idle_timeout_s) + 2 * timeout;
            let from = at.duration_since(self.start);
            let until = dur.map_or(Duration::MAX, |d| from + d + tail);
            self.disturbed.borrow_mut()[i].push((from, until));
            match fault.kind {
                FedFaultKind::Crash => {
                    self.note(format!("fault: host-{i} crashes{}", dur.map(|d| format!(", restarts after {:.2} s", d.as_secs_f64())).unwrap_or_default()));
                    if let Some(process) = self.processes.borrow_mut()[i].take() {
                        process.abort();
                    }
                    self.net.kill(i);
                    if let Some(d) = dur {
                        let world = Rc::clone(&self);
                        tokio::task::spawn_local(async move {
                            tokio::time::sleep(d).await;
                            world.note(format!("host-{i} restarts"));
                            world.spawn_host(i);
                        });
                    }
                }
                FedFaultKind::Partition => {
                    let d = dur.unwrap_or_default();
                    self.note(format!("fault: host-{i} cut off for {:.2} s", d.as_secs_f64()));
                    self.net.isolate(i);
                    let world = Rc::clone(&self);
                    tokio::task::spawn_local(async move {
                        tokio::time::sleep(d).await;
                        world.note(format!("host-{i} reachable again"));
                        world.net.reconnect(i);
                    });
                }
                FedFaultKind::Slow => {
                    let d = dur.unwrap_or_default();
                    self.note(format!("fault: host-{i}'s link +{:.0} ms for {:.2} s", fault.delay_ms, d.as_secs_f64()));
                    self.net.slow(i, Duration::from_secs_f64(fault.delay_ms / 1000.0));
                    let world = Rc::clone(&self);
                    tokio::task::spawn_local(async move {
                        tokio::time::sleep(d).await;
                        world.note(format!("host-{i}'s link back to normal"));
                        world.net.slow(i, Duration::ZERO);
                    });
                }
            }
        }
    }

    /// Whether a fault touched host `i` during `span`.
    fn was_disturbed(&self, i: usize, span: (Duration, Duration)) -> bool {
        self.disturbed.borrow()[i].iter().any(|&(from, until)| from <= span.1 && span.0 <= until)
    }

    fn violation(&self, invariant: &'static str, round: u32, detail: String) -> Violation {
        Violation { invariant, detail, event_index: round as usize, at: self.start.elapsed(), event: format!("round {round}"), recent: self.log.borrow().clone() }
    }
}

/// Runs the federation under faults; returns the outcome (without the twin check), its rounds
/// and the last lines of its log.
async fn simulate(scenario: &FedScenario, seed: u64, data: Arc<FedData>, planted_bug: bool) -> Result<(FedOutcome, Vec<RoundRecord>, Vec<String>)> {
    let net_config = ControlConfig {
        seed,
        latency: Duration::from_secs_f64(scenario.network.latency_ms / 1000.0),
        jitter: Duration::from_secs_f64(scenario.network.jitter_ms / 1000.0),
        idle_timeout: Duration::from_secs_f64(scenario.network.idle_timeout_s),
    };
    let (net, listener) = ControlNet::new(net_config);
    let addr = listener.local_addr().map_err(|e| SimError::Scenario(format!("simulated listener: {e}")))?;
    let link = LinkOptions { idle_timeout: Duration::from_secs_f64(scenario.network.idle_timeout_s), keep_alive: Duration::from_millis(500), connect_timeout: Duration::from_secs(5) };
    let round_timeout = Duration::from_secs_f64(scenario.shape.round_timeout_s);
    let token = format!("sim-{seed}");
    let options = CoordinatorOptions { listen: addr, token: token.clone(), round_timeout, link: link.clone(), planted_bug };
    let mut core = CoordinatorCore::start(Arc::new(listener), options, scenario.config_toml.clone(), scenario.config.population.n_clients);
    let hosts = scenario.slices.len();
    let world = Rc::new(World {
        scenario: scenario.clone(),
        net: net.clone(),
        addr,
        token,
        data: data.clone(),
        link,
        start: Instant::now(),
        processes: RefCell::new((0..hosts).map(|_| None).collect()),
        disturbed: RefCell::new(vec![Vec::new(); hosts]),
        log: RefCell::new(Vec::new()),
        trace: RefCell::new(TraceHash::default()),
    });
    for i in 0..hosts {
        world.spawn_host(i);
    }
    let faults = scenario.faults_for(seed);
    let fault_count = faults.len();
    let max_virtual = Duration::from_secs_f64(scenario.shape.max_virtual_s);
    let mut outcome = FedOutcome {
        seed,
        trace: 0,
        violation: None,
        rounds: 0,
        faults: fault_count,
        checks: 0,
        virtual_time: Duration::ZERO,
        hosts_done: 0,
        hosts_lost: 0,
        hosts_late: 0,
        rejoins: 0,
        clients_done: 0,
        dropped: 0,
        accuracy: 0.0,
        secure_aborted: 0,
        secure_recovered: 0,
    };
    let mut rounds = Vec::new();
    let mut fed = federation(&scenario.config, &data).map_err(|e| SimError::Scenario(format!("federation: {e}")))?;
    let secure = fed.is_secure();
    if let Err(e) = core.wait_for_hosts(hosts, Duration::from_secs(30)).await {
        outcome.violation = Some(world.violation("liveness", 0, format!("the hosts did not all join at the start: {e}")));
    } else {
        let driver = tokio::task::spawn_local(Rc::clone(&world).drive_faults(faults));
        for round in 0..scenario.config.round.rounds {
            let from = world.start.elapsed();
            if from > max_virtual {
                outcome.violation = Some(world.violation("liveness", round, format!("{} of {} rounds done after {:.1} virtual s", round, scenario.config.round.rounds, from.as_secs_f64())));
                break;
            }
            let before = secure.then(|| fed.model().to_vec());
            let remote: RemoteRound = core.round(&mut fed).await.map_err(|e| SimError::Scenario(format!("round {round}: {e}")))?;
            let until = world.start.elapsed();
            let r = &remote.report;
            let done: Vec<usize> = remote.hosts_done.iter().filter_map(|n| host_index(n)).collect();
            let hash = model_hash(fed.model());
            world.trace.borrow_mut().absorb_u64(hash);
            world.note(format!(
                "round {round}: {} sampled, {} done, {} dropped; hosts done {:?}, lost {:?}, late {:?}; {} pieces refused",
                r.sampled,
                r.clients_done,
                r.dropped,
                remote.hosts_done,
                remote.hosts_lost.iter().map(|(n, _)| n).collect::<Vec<_>>(),
                remote.hosts_late,
                remote.pieces_refused
            ));
            outcome.hosts_done += remote.hosts_done.len() as u64;
            outcome.hosts_lost += remote.hosts_lost.len() as u64;
            outcome.hosts_late += remote.hosts_late.len() as u64;
            outcome.clients_done += r.clients_done;
            outcome.dropped += r.dropped;
            outcome.rounds += 1;
            rounds.push(RoundRecord { report: r.clone(), done, model_hash: hash });
            let check = check_round(&world, round, &remote, (from, until), round_timeout * if secure { 4 } else { 1 })
                .or_else(|| before.and_then(|before| check_unmask(&world, round, &fed, &before, &remote)));
            if let Some(v) = check {
                outcome.violation = Some(v);
                break;
            }
            outcome.checks += if secure { 4 } else { 3 };
            if let Some(info) = &remote.report.secure {
                outcome.secure_aborted += u64::from(info.aborted.is_some());
                outcome.secure_recovered += info.gone_before_unmask;
            }
        }
        driver.abort();
        outcome.rejoins = u64::from(core.joins()).saturating_sub(hosts as u64);
    }
    outcome.virtual_time = world.start.elapsed();
    if outcome.violation.is_none() && outcome.virtual_time > max_virtual {
        outcome.violation = Some(world.violation("liveness", outcome.rounds, format!("the federation took {:.1} virtual s (at most {})", outcome.virtual_time.as_secs_f64(), scenario.shape.max_virtual_s)));
    }
    if outcome.violation.is_none() {
        outcome.checks += 1;
    }
    core.finish().await;
    for process in world.processes.borrow_mut().iter_mut() {
        if let Some(p) = process.take() {
            p.abort();
        }
    }
    let shape = LogReg { n_features: data.n_features(), n_classes: data.n_classes() };
    outcome.accuracy = shape.evaluate(fed.model(), &data.test).accuracy;
    let mut trace = *world.trace.borrow();
    trace.absorb_u64(net.trace().value());
    outcome.trace = trace.value();
    let log = world.log.borrow().clone();
    Ok((outcome, rounds, log))
}

/// The per-round invariants: exactly-once, round-deadline, quiet-host-kept.
fn check_round(world: &World, round: u32, remote: &RemoteRound, span: (Duration, Duration), timeout: Duration) -> Option<Violation> {
    let r = &remote.report;
    let counted = r.clients_done + r.dropped + r.stragglers + r.rejected + r.empty;
    if counted != r.sampled {
        return Some(world.violation("exactly-once", round, format!("{counted} clients accounted for, {} sampled: {r:?}", r.sampled)));
    }
    // The round closes at its timeout; a millisecond covers the last message's delivery.
    if span.1 - span.0 > timeout + Duration::from_millis(1) {
        return Some(world.violation("round-deadline", round, format!("the round took {:.3} s, the timeout is {:.3} s", (span.1 - span.0).as_secs_f64(), timeout.as_secs_f64())));
    }
    let missing = remote.hosts_lost.iter().map(|(n, _)| n).chain(&remote.hosts_late);
    for name in missing {
        let Some(i) = host_index(name) else { continue };
        if !world.was_disturbed(i, span) {
            return Some(world.violation("quiet-host-kept", round, format!("{name} was not touched by any fault yet did not deliver round {round}")));
        }
    }
    None
}

/// The `unmask-exact` invariant of a secure round: the unmasked sum is exactly the sum, in
/// Z_2^32, of the included clients' encoded inputs at the round's starting model (recomputed here
/// from the clients' data); a round that could not be unmasked left the model as it was.
fn check_unmask(world: &World, round: u32, fed: &Federation<'_, LogRegSgd<'_>, Plain>, before: &[f32], remote: &RemoteRound) -> Option<Violation> {
    let Some(info) = &remote.report.secure else {
        return Some(world.violation("unmask-exact", round, "a secure round reported no secure-aggregation outcome".into()));
    };
    if let Some(abort) = &info.aborted {
        return (fed.model() != before).then(|| world.violation("unmask-exact", round, format!("the round aborted ({abort}) yet the model moved")));
    }
    let expected = match fed.secure_plain_sum(round, &info.included_clients, before) {
        Ok(expected) => expected,
        Err(e) => return Some(world.violation("unmask-exact", round, format!("the included clients' inputs cannot be recomputed: {e}"))),
    };
    (expected != info.sum_fixed).then(|| {
        let differ = expected.iter().zip(&info.sum_fixed).filter(|(a, b)| a != b).count();
        world.violation("unmask-exact", round, format!("the unmasked sum differs from the sum of the {} included clients' inputs in {differ} words", info.included_clients.len()))
    })
}

/// The `twin-equal` invariant: the in-process federation, with `host_down` for every host that did
/// not deliver a round, must give the same model bits and counts after every round.
fn check_twin(scenario: &FedScenario, data: &FedData, rounds: &[RoundRecord]) -> Result<Option<Violation>> {
    let mut config = scenario.config.clone();
    let hosts = scenario.slices.len();
    config.round.hosts = hosts;
    config.round.host_slices = scenario.slices.iter().map(|s| format!("{}..{}", s.start, s.end)).collect();
    config.round.rounds = rounds.len() as u32;
    for (r, record) in rounds.iter().enumerate() {
        for host in (0..hosts).filter(|h| !record.done.contains(h)) {
            config.faults.host_down.push(HostDown { host, round: r as u32 });
        }
    }
    let mut twin = federation(&config, data).map_err(|e| SimError::Scenario(format!("the in-process twin: {e}")))?;
    for (r, record) in rounds.iter().enumerate() {
        let report = twin.run_round().map_err(|e| SimError::Scenario(format!("the in-process twin, round {r}: {e}")))?;
        let counts = |x: &RoundReport| (x.sampled, x.clients_done, x.dropped, x.stragglers, x.rejected, x.empty);
        let hash = model_hash(twin.model());
        if hash != record.model_hash || counts(&report) != counts(&record.report) {
            let detail = format!(
                "round {r}: model {:016x} (counts {:?}) over the network, {:016x} (counts {:?}) in process with hosts {:?} delivering",
                record.model_hash,
                counts(&record.report),
                hash,
                counts(&report),
                record.done
            );
            return Ok(Some(Violation { invariant: "twin-equal", detail, event_index: r, at: Duration::ZERO, event: format!("round {r}"), recent: Vec::new() }));
        }
    }
    Ok(None)
}
