//! The federation config (`rtx fed run CONFIG.toml`): population and data partition, rounds and
//! the aggregator tree, local training, the server strategy, the asynchronous (FedBuff) mode, the
//! fault model (deadline, dropouts, availability trace, host failures), client-level DP (`[dp]`) and
//! secure aggregation (`[secagg]`). [`FedConfig::validate`] refuses inconsistent values with a
//! [`FedError::Config`] that names the offending key.

use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{FedError, Result};

/// A whole federation: who, on what data, how many rounds, trained how, aggregated how.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FedConfig {
    /// Seed of every random choice (sampling, partitions, dropouts, latencies, local shuffles).
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// The population and its data.
    pub population: PopulationConfig,
    /// Rounds, sampling, the aggregator tree and the client hosts.
    pub round: RoundConfig,
    /// The clients' local training.
    #[serde(default)]
    pub local: LocalConfig,
    /// The server strategy.
    #[serde(default)]
    pub strategy: StrategyConfig,
    /// Asynchronous FedBuff-style mode; absent means synchronous rounds.
    #[serde(default, rename = "async")]
    pub async_mode: Option<AsyncConfig>,
    /// Stragglers, dropouts, availability and host failures.
    #[serde(default)]
    pub faults: FaultConfig,
    /// Where `rtx fed run` writes metrics.jsonl and accuracy.png.
    #[serde(default)]
    pub output: OutputConfig,
    /// Client-level differential privacy (DP-FedAvg); absent means none.
    #[serde(default)]
    pub dp: Option<DpSection>,
    /// Secure aggregation (SecAgg+) of synchronous rounds; absent means the coordinator sums plain
    /// updates.
    #[serde(default)]
    pub secagg: Option<SecAggSection>,
}

/// `[secagg]`: every synchronous round runs SecAgg+ over its sampled clients, so the coordinator
/// only learns the sum of their weighted updates and weights (see `round::secure`). Omitted keys
/// take the defaults below; [`FedConfig::secagg_params`] resolves them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecAggSection {
    /// Neighbours per client in the round's graph (even, >= 2); default `recommended_degree(K)`
    /// (the even number near 3 log2 K).
    #[serde(default)]
    pub degree: Option<usize>,
    /// Shares needed to rebuild a secret, `degree/2 < threshold <= degree`; default `degree/2 + 1`.
    #[serde(default)]
    pub threshold: Option<usize>,
    /// Bound of every coordinate of a client's update (scaled by `weight / max_weight`) before fixed
    /// point; default `dp.clip_norm` under `[dp]` (an L2 clip bounds every coordinate), else 1.0.
    #[serde(default)]
    pub clip: Option<f32>,
    /// Fixed-point scale `2^scale_bits`; default the finest for which K clients cannot overflow
    /// Z_2^32 (`QuantConfig::finest`).
    #[serde(default)]
    pub scale_bits: Option<u32>,
    /// Largest aggregation weight a client may send (a larger one is rejected); default 1 under
    /// `[dp]` (unit weights), else the population's largest client (its image count).
    #[serde(default)]
    pub max_weight: Option<f32>,
    /// Probability that a client that sent its masked input vanishes before answering the unmask
    /// request (its update stays in the sum while enough neighbours answer).
    #[serde(default)]
    pub unmask_dropout_rate: f64,
}

/// The resolved parameters of `[secagg]` (see [`FedConfig::secagg_params`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SecAggParams {
    /// Neighbours per client.
    pub degree: usize,
    /// Shares per secret.
    pub threshold: usize,
    /// Fixed point of the update coordinates, for K clients.
    pub quant: crate::secagg::QuantConfig,
    /// `max_weight` when the config sets it (else resolved from the population by the round).
    pub max_weight: Option<f32>,
    /// `unmask_dropout_rate`.
    pub unmask_dropout_rate: f64,
}

/// `[dp]`: client-level differential privacy of synchronous rounds (see [`crate::dp::ClientDp`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DpSection {
    /// L2 norm every client update is clipped to.
    pub clip_norm: f64,
    /// Noise standard deviation over the clip norm.
    pub noise_multiplier: f64,
    /// The delta epsilon is reported for.
    #[serde(default = "default_delta")]
    pub delta: f64,
}

fn default_delta() -> f64 {
    1e-5
}

/// Which images back the clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DatasetKind {
    /// Fashion-MNIST (60 000 train / 10 000 test images of 28x28).
    FashionMnist,
    /// scikit-learn digits (1797 images of 8x8; the test set is a seeded 20 % hold-out).
    Digits,
}

/// How training images are assigned to clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PartitionKind {
    /// The reference rule: client `c` gets images `splitmix64(seed + s*c + j) mod n_train`,
    /// `j = 0..s`, `s = samples_per_client` (computed on the fly, no storage).
    Reference,
    /// Dirichlet(alpha) label split: per class, proportions over clients drawn from Dir(alpha).
    Dirichlet,
    /// Shard split: images sorted by label, cut into `n_clients * shards_per_client` shards,
    /// dealt out at random.
    Shards,
}

/// The population.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PopulationConfig {
    /// N, the number of clients.
    pub n_clients: u64,
    /// The dataset.
    #[serde(default = "default_dataset")]
    pub dataset: DatasetKind,
    /// The partition rule.
    #[serde(default = "default_partition")]
    pub partition: PartitionKind,
    /// Images per client for the reference rule.
    #[serde(default = "default_samples_per_client")]
    pub samples_per_client: u32,
    /// Concentration of the Dirichlet split (> 0; small = skewed).
    #[serde(default = "default_alpha")]
    pub alpha: f64,
    /// Shards per client for the shard split.
    #[serde(default = "default_shards_per_client")]
    pub shards_per_client: u32,
}

/// Rounds, sampling and the tree.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoundConfig {
    /// Number of rounds (server steps in the asynchronous mode).
    pub rounds: u32,
    /// K, clients sampled per round (without replacement).
    pub clients_per_round: u64,
    /// Children per aggregator node of the tree (>= 2).
    #[serde(default = "default_fan_in")]
    pub fan_in: usize,
    /// Client hosts the population is split over (even contiguous slices unless `host_slices`).
    #[serde(default = "default_hosts")]
    pub hosts: usize,
    /// Explicit population slices `"A..B"` per host; they must tile `0..n_clients` in order.
    #[serde(default)]
    pub host_slices: Vec<String>,
    /// Worker threads training clients (0 = all cores).
    #[serde(default)]
    pub threads: usize,
    /// Evaluate on the test set every this many rounds (and after the last).
    #[serde(default = "default_eval_every")]
    pub eval_every: u32,
}

/// Local training of one client.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalConfig {
    /// Epochs over the client's images.
    #[serde(default = "default_epochs")]
    pub epochs: u32,
    /// SGD learning rate.
    #[serde(default = "default_lr")]
    pub lr: f32,
    /// Minibatch size.
    #[serde(default = "default_batch_size")]
    pub batch_size: usize,
    /// Shuffle the client's images each epoch (seeded); off keeps them in assignment order.
    #[serde(default)]
    pub shuffle: bool,
}

/// Server strategy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StrategyKind {
    /// FedAvg: the global model moves to the sample-weighted mean of the client models.
    Fedavg,
    /// FedProx: FedAvg with a proximal term `mu/2 |w - w_global|^2` in local training.
    Fedprox,
    /// FedAdam (Reddi et al.): Adam on the averaged pseudo-gradient.
    Fedadam,
    /// FedYogi (Reddi et al.).
    Fedyogi,
    /// FedAdagrad (Reddi et al.).
    Fedadagrad,
}

/// Strategy parameters (defaults follow Flower's strategies).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StrategyConfig {
    /// Which strategy.
    #[serde(default = "default_strategy")]
    pub kind: StrategyKind,
    /// FedProx proximal weight.
    #[serde(default)]
    pub mu: f32,
    /// Server learning rate of the adaptive optimizers.
    #[serde(default = "default_eta")]
    pub eta: f32,
    /// First-moment decay.
    #[serde(default = "default_beta1")]
    pub beta1: f32,
    /// Second-moment decay.
    #[serde(default = "default_beta2")]
    pub beta2: f32,
    /// Adaptivity (epsilon) of the adaptive optimizers.
    #[serde(default = "default_tau")]
    pub tau: f32,
}

/// How a stale update is down-weighted in the asynchronous mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StalenessWeighting {
    /// Every accepted update weighs the same.
    Constant,
    /// `1 / sqrt(1 + staleness)` (FedBuff).
    Polynomial,
}

/// FedBuff-style asynchronous mode: clients train on whatever model version they were handed;
/// the server applies an update whenever `buffer_size` updates have arrived.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AsyncConfig {
    /// Updates per server step.
    pub buffer_size: usize,
    /// Updates older than this many server steps are discarded.
    pub max_staleness: u32,
    /// Clients training at any time.
    pub concurrency: usize,
    /// Staleness weighting.
    #[serde(default = "default_staleness")]
    pub staleness: StalenessWeighting,
    /// Server learning rate applied to the buffered mean.
    #[serde(default = "default_server_lr")]
    pub server_lr: f32,
}

/// A host that is down for one round (all its clients' updates of that round are lost).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostDown {
    /// Host index.
    pub host: usize,
    /// Round (0-based).
    pub round: u32,
}

/// The fault model. Client latencies are virtual (seeded log-normal), so deadlines decide the
/// same stragglers on every machine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultConfig {
    /// A client that would answer later than this (virtual ms) is cut as a straggler.
    #[serde(default)]
    pub deadline_ms: Option<f64>,
    /// Median of a client's virtual round-trip time.
    #[serde(default = "default_latency_median_ms")]
    pub latency_median_ms: f64,
    /// Log-normal sigma of the round-trip time.
    #[serde(default = "default_latency_sigma")]
    pub latency_sigma: f64,
    /// Probability that a sampled client never answers.
    #[serde(default)]
    pub dropout_rate: f64,
    /// A file of `client on_s off_s` lines: a listed client is available only inside its intervals;
    /// round `r` happens at virtual time `r * round_interval_s`. Unlisted clients are always on.
    #[serde(default)]
    pub availability_trace: Option<PathBuf>,
    /// Virtual seconds between round starts (for the availability trace).
    #[serde(default = "default_round_interval_s")]
    pub round_interval_s: f64,
    /// Hosts that are down for a round.
    #[serde(default)]
    pub host_down: Vec<HostDown>,
}

/// Output files.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputConfig {
    /// Folder of metrics.jsonl and accuracy.png.
    #[serde(default)]
    pub dir: Option<PathBuf>,
}

impl Default for LocalConfig {
    fn default() -> Self {
        LocalConfig { epochs: default_epochs(), lr: default_lr(), batch_size: default_batch_size(), shuffle: false }
    }
}

impl Default for FaultConfig {
    fn default() -> Self {
        FaultConfig {
            deadline_ms: None,
            latency_median_ms: default_latency_median_ms(),
            latency_sigma: default_latency_sigma(),
            dropout_rate: 0.0,
            availability_trace: None,
            round_interval_s: default_round_interval_s(),
            host_down: Vec::new(),
        }
    }
}

impl Default for StrategyConfig {
    fn default() -> Self {
        StrategyConfig { kind: default_strategy(), mu: 0.0, eta: default_eta(), beta1: default_beta1(), beta2: default_beta2(), tau: default_tau() }
    }
}

impl FedConfig {
    /// Parses and validates a TOML document.
    pub fn from_toml_str(text: &str) -> Result<Self> {
        let config: FedConfig = toml::from_str(text).map_err(|e| FedError::ConfigFile { path: "<string>".into(), reason: e.to_string() })?;
        config.validate()?;
        Ok(config)
    }

    /// Reads, parses and validates a TOML file. A relative `availability_trace` is taken relative
    /// to the config file's folder when it does not exist relative to the working directory.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| FedError::ConfigFile { path: path.display().to_string(), reason: e.to_string() })?;
        let mut config: FedConfig = toml::from_str(&text).map_err(|e| FedError::ConfigFile { path: path.display().to_string(), reason: e.to_string() })?;
        if let (Some(trace), Some(dir)) = (&config.faults.availability_trace, path.parent()) {
            if trace.is_relative() && !trace.exists() && dir.join(trace).exists() {
                config.faults.availability_trace = Some(dir.join(trace));
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks every value and every relation between values; the error names the key.
    pub fn validate(&self) -> Result<()> {
        let p = &self.population;
        let r = &self.round;
        if p.n_clients == 0 {
            return Err(FedError::config("population.n_clients", "must be at least 1"));
        }
        if p.n_clients > u64::from(u32::MAX) {
            return Err(FedError::config("population.n_clients", format!("{} exceeds 2^32 - 1 clients", p.n_clients)));
        }
        if p.samples_per_client == 0 {
            return Err(FedError::config("population.samples_per_client", "must be at least 1"));
        }
        if !(p.alpha.is_finite() && p.alpha > 0.0) {
            return Err(FedError::config("population.alpha", format!("{} is not a positive finite concentration", p.alpha)));
        }
        if p.shards_per_client == 0 {
            return Err(FedError::config("population.shards_per_client", "must be at least 1"));
        }
        if r.rounds == 0 {
            return Err(FedError::config("round.rounds", "must be at least 1"));
        }
        if r.clients_per_round == 0 {
            return Err(FedError::config("round.clients_per_round", "must be at least 1"));
        }
        if r.clients_per_round > p.n_clients {
            return Err(FedError::config("round.clients_per_round", format!("K = {} exceeds the population N = {}", r.clients_per_round, p.n_clients)));
        }
        if r.fan_in < 2 {
            return Err(FedError::config("round.fan_in", format!("{} must be at least 2", r.fan_in)));
        }
        if r.hosts == 0 {
            return Err(FedError::config("round.hosts", "must be at least 1"));
        }
        if r.eval_every == 0 {
            return Err(FedError::config("round.eval_every", "must be at least 1"));
        }
        self.host_slices()?;
        let l = &self.local;
        if l.epochs == 0 {
            return Err(FedError::config("local.epochs", "must be at least 1"));
        }
        if !(l.lr.is_finite() && l.lr > 0.0) {
            return Err(FedError::config("local.lr", format!("{} is not a positive finite rate", l.lr)));
        }
        if l.batch_size == 0 {
            return Err(FedError::config("local.batch_size", "must be at least 1"));
        }
        let s = &self.strategy;
        if !(s.mu.is_finite() && s.mu >= 0.0) {
            return Err(FedError::config("strategy.mu", format!("{} must be finite and >= 0", s.mu)));
        }
        if !(s.eta.is_finite() && s.eta > 0.0) {
            return Err(FedError::config("strategy.eta", format!("{} must be finite and > 0", s.eta)));
        }
        for (key, beta) in [("strategy.beta1", s.beta1), ("strategy.beta2", s.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(FedError::config(key, format!("{beta} must lie in [0, 1)")));
            }
        }
        if !(s.tau.is_finite() && s.tau > 0.0) {
            return Err(FedError::config("strategy.tau", format!("{} must be finite and > 0", s.tau)));
        }
        if let Some(a) = &self.async_mode {
            if a.buffer_size == 0 {
                return Err(FedError::config("async.buffer_size", "must be at least 1"));
            }
            if a.concurrency == 0 || a.concurrency as u64 > p.n_clients {
                return Err(FedError::config("async.concurrency", format!("{} must lie in 1..={} (the population)", a.concurrency, p.n_clients)));
            }
            if !(a.server_lr.is_finite() && a.server_lr > 0.0) {
                return Err(FedError::config("async.server_lr", format!("{} must be finite and > 0", a.server_lr)));
            }
        }
        let f = &self.faults;
        if let Some(d) = f.deadline_ms {
            if !(d.is_finite() && d > 0.0) {
                return Err(FedError::config("faults.deadline_ms", format!("{d} must be finite and > 0")));
            }
        }
        if !(f.latency_median_ms.is_finite() && f.latency_median_ms > 0.0) {
            return Err(FedError::config("faults.latency_median_ms", format!("{} must be finite and > 0", f.latency_median_ms)));
        }
        if !(f.latency_sigma.is_finite() && f.latency_sigma >= 0.0) {
            return Err(FedError::config("faults.latency_sigma", format!("{} must be finite and >= 0", f.latency_sigma)));
        }
        if !(0.0..=1.0).contains(&f.dropout_rate) {
            return Err(FedError::config("faults.dropout_rate", format!("{} must lie in [0, 1]", f.dropout_rate)));
        }
        if !(f.round_interval_s.is_finite() && f.round_interval_s >= 0.0) {
            return Err(FedError::config("faults.round_interval_s", format!("{} must be finite and >= 0", f.round_interval_s)));
        }
        for (i, down) in f.host_down.iter().enumerate() {
            if down.host >= r.hosts {
                return Err(FedError::config(format!("faults.host_down[{i}].host"), format!("host {} does not exist ({} hosts)", down.host, r.hosts)));
            }
        }
        if self.dp.is_some() && self.async_mode.is_some() {
            return Err(FedError::config("dp", "client-level DP is accounted for sampled synchronous rounds; remove [async] or [dp]"));
        }
        self.dp_config()?;
        if self.secagg.is_some() && self.async_mode.is_some() {
            return Err(FedError::config(
                "secagg",
                "secure aggregation runs inside synchronous rounds; FedBuff (asynchronous) with SecAgg is out of scope: remove [async] or [secagg]",
            ));
        }
        self.secagg_params()?;
        Ok(())
    }

    /// The parameters of `[secagg]` with every default resolved, checked: an even degree >= 2,
    /// `degree/2 < threshold <= degree`, at least `threshold + 1` clients per round, a positive
    /// clip, a scale at which K clients cannot overflow Z_2^32, a positive `max_weight` whose
    /// K-fold sum fits too, and a dropout rate in [0, 1].
    pub fn secagg_params(&self) -> Result<Option<SecAggParams>> {
        let Some(s) = &self.secagg else {
            return Ok(None);
        };
        let k = self.round.clients_per_round;
        let degree = match s.degree {
            Some(d) if d < 2 || !d.is_multiple_of(2) => return Err(FedError::config("secagg.degree", format!("{d} must be even and >= 2"))),
            Some(d) => d,
            None => {
                let d = crate::secagg::recommended_degree(usize::try_from(k).unwrap_or(usize::MAX)).max(2);
                d + d % 2
            }
        };
        let threshold = s.threshold.unwrap_or(degree / 2 + 1);
        if threshold > degree || 2 * threshold <= degree {
            return Err(FedError::config("secagg.threshold", format!("{threshold} must satisfy degree/2 < threshold <= degree = {degree}")));
        }
        if k < threshold as u64 + 1 {
            return Err(FedError::config(
                "secagg.threshold",
                format!("threshold {threshold} needs at least {} clients per round (each must hold {threshold} neighbours' shares), K = {k}", threshold + 1),
            ));
        }
        let clip = s.clip.unwrap_or_else(|| self.dp.as_ref().map_or(1.0, |d| d.clip_norm as f32));
        if !(clip.is_finite() && clip > 0.0) {
            return Err(FedError::config("secagg.clip", format!("{clip} must be finite and > 0")));
        }
        let quant = match s.scale_bits {
            Some(bits) => crate::secagg::QuantConfig::new(clip, bits, k)?,
            None => crate::secagg::QuantConfig::finest(clip, k)
                .map_err(|_| FedError::config("secagg.clip", format!("K = {k} clients with clip {clip} overflow Z_2^32 even at scale 1")))?,
        };
        if let Some(w) = s.max_weight {
            if !(w.is_finite() && w > 0.0) {
                return Err(FedError::config("secagg.max_weight", format!("{w} must be finite and > 0")));
            }
            if f64::from(w) * k as f64 > crate::secagg::SUM_MAGNITUDE_MAX as f64 {
                return Err(FedError::config("secagg.max_weight", format!("K = {k} weights of up to {w} overflow Z_2^32")));
            }
        }
        if !(0.0..=1.0).contains(&s.unmask_dropout_rate) {
            return Err(FedError::config("secagg.unmask_dropout_rate", format!("{} must lie in [0, 1]", s.unmask_dropout_rate)));
        }
        Ok(Some(SecAggParams { degree, threshold, quant, max_weight: s.max_weight, unmask_dropout_rate: s.unmask_dropout_rate }))
    }

    /// The DP parameters of `[dp]` (K and N from the round and population), checked.
    pub fn dp_config(&self) -> Result<Option<crate::dp::DpConfig>> {
        self.dp
            .as_ref()
            .map(|d| crate::dp::DpConfig::new(d.clip_norm, d.noise_multiplier, self.round.clients_per_round, self.population.n_clients, d.delta))
            .transpose()
    }

    /// The population slice of each host: `host_slices` when given (checked to tile `0..N` in
    /// order), else `hosts` even contiguous slices.
    pub fn host_slices(&self) -> Result<Vec<Range<u32>>> {
        let n = self.population.n_clients;
        let r = &self.round;
        if r.host_slices.is_empty() {
            let hosts = r.hosts as u64;
            if hosts > n {
                return Err(FedError::config("round.hosts", format!("{hosts} hosts for {n} clients leaves a host empty")));
            }
            return Ok((0..hosts).map(|h| (h * n / hosts) as u32..((h + 1) * n / hosts) as u32).collect());
        }
        if r.host_slices.len() != r.hosts {
            return Err(FedError::config("round.host_slices", format!("{} slices for {} hosts", r.host_slices.len(), r.hosts)));
        }
        let mut next = 0u64;
        let mut slices = Vec::with_capacity(r.host_slices.len());
        for (i, text) in r.host_slices.iter().enumerate() {
            let key = format!("round.host_slices[{i}]");
            let slice = parse_slice(text, n).map_err(|reason| FedError::config(key.clone(), reason))?;
            if u64::from(slice.start) != next {
                return Err(FedError::config(key, format!("{text} must start at {next} (slices tile 0..{n} in order)")));
            }
            next = u64::from(slice.end);
            slices.push(slice);
        }
        if next != n {
            return Err(FedError::config("round.host_slices", format!("slices end at {next}, not at N = {n}")));
        }
        Ok(slices)
    }
}

/// Parses a population slice `"A..B"` (B excluded) and checks `A < B <= n`; the error string says
/// why (used by the config and by `rtx fed clients --population-slice`).
pub fn parse_slice(text: &str, n: u64) -> std::result::Result<Range<u32>, String> {
    let (a, b) = text.split_once("..").ok_or_else(|| format!("{text:?} is not of the form A..B"))?;
    let a: u64 = a.trim().parse().map_err(|_| format!("{text:?}: start {a:?} is not a client index"))?;
    let b: u64 = b.trim().parse().map_err(|_| format!("{text:?}: end {b:?} is not a client index"))?;
    if a >= b {
        return Err(format!("{text:?} is empty (start >= end)"));
    }
    if b > n {
        return Err(format!("{text:?} is out of range: the population has {n} clients"));
    }
    Ok(a as u32..b as u32)
}

fn default_seed() -> u64 {
    42
}
fn default_dataset() -> DatasetKind {
    DatasetKind::FashionMnist
}
fn default_partition() -> PartitionKind {
    PartitionKind::Reference
}
fn default_samples_per_client() -> u32 {
    8
}
fn default_alpha() -> f64 {
    0.5
}
fn default_shards_per_client() -> u32 {
    2
}
fn default_fan_in() -> usize {
    32
}
fn default_hosts() -> usize {
    1
}
fn default_eval_every() -> u32 {
    1
}
fn default_epochs() -> u32 {
    1
}
fn default_lr() -> f32 {
    0.1
}
fn default_batch_size() -> usize {
    8
}
fn default_strategy() -> StrategyKind {
    StrategyKind::Fedavg
}
fn default_eta() -> f32 {
    0.1
}
fn default_beta1() -> f32 {
    0.9
}
fn default_beta2() -> f32 {
    0.99
}
fn default_tau() -> f32 {
    1e-9
}
fn default_staleness() -> StalenessWeighting {
    StalenessWeighting::Polynomial
}
fn default_server_lr() -> f32 {
    1.0
}
fn default_latency_median_ms() -> f64 {
    100.0
}
fn default_latency_sigma() -> f64 {
    0.5
}
fn default_round_interval_s() -> f64 {
    60.0
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "[population]\nn_clients = 100\n[round]\nrounds = 2\nclients_per_round = 10\n";

    fn with(extra: &str) -> String {
        format!("{BASE}{extra}")
    }

    fn field_of(err: FedError) -> String {
        match err {
            FedError::Config { field, .. } => field,
            other => panic!("expected a config error, got {other}"),
        }
    }

    #[test]
    fn a_minimal_config_gets_the_reference_defaults() {
        let c = FedConfig::from_toml_str(BASE).unwrap();
        assert_eq!(c.seed, 42);
        assert_eq!(c.population.partition, PartitionKind::Reference);
        assert_eq!(c.population.samples_per_client, 8);
        assert_eq!((c.local.lr, c.local.batch_size, c.local.epochs), (0.1, 8, 1));
        assert_eq!(c.strategy.kind, StrategyKind::Fedavg);
        assert_eq!(c.host_slices().unwrap(), vec![0..100]);
    }

    #[test]
    fn k_above_n_is_refused_naming_the_key() {
        let text = "[population]\nn_clients = 10\n[round]\nrounds = 1\nclients_per_round = 11\n";
        let err = FedConfig::from_toml_str(text).unwrap_err();
        assert!(err.to_string().contains("exceeds the population"), "{err}");
        assert_eq!(field_of(err), "round.clients_per_round");
    }

    #[test]
    fn a_dp_section_is_checked_against_k_and_n() {
        let c = FedConfig::from_toml_str(&with("[dp]\nclip_norm = 1.0\nnoise_multiplier = 0.8\n")).unwrap();
        let dp = c.dp_config().unwrap().unwrap();
        assert_eq!((dp.expected_clients, dp.population, dp.delta), (10, 100, 1e-5));
        assert_eq!(field_of(FedConfig::from_toml_str(&with("[dp]\nclip_norm = 0.0\nnoise_multiplier = 0.8\n")).unwrap_err()), "dp.clip_norm");
        assert_eq!(field_of(FedConfig::from_toml_str(&with("[dp]\nclip_norm = 1.0\nnoise_multiplier = -1.0\n")).unwrap_err()), "dp.noise_multiplier");
        assert_eq!(field_of(FedConfig::from_toml_str(&with("[dp]\nclip_norm = 1.0\nnoise_multiplier = 1.0\ndelta = 2.0\n")).unwrap_err()), "dp.delta");
        let both = with("[dp]\nclip_norm = 1.0\nnoise_multiplier = 1.0\n[async]\nconcurrency = 4\nbuffer_size = 2\nmax_staleness = 3\n");
        assert_eq!(field_of(FedConfig::from_toml_str(&both).unwrap_err()), "dp");
    }

    #[test]
    fn negative_alpha_is_refused_naming_the_key() {
        let text = "[population]\nn_clients = 10\npartition = \"dirichlet\"\nalpha = -0.5\n[round]\nrounds = 1\nclients_per_round = 5\n";
        assert_eq!(field_of(FedConfig::from_toml_str(text).unwrap_err()), "population.alpha");
    }

    #[test]
    fn bad_host_slices_are_refused_naming_the_slice() {
        // host_slices belongs to [round]; BASE ends inside [round].
        let out_of_range = with("hosts = 2\nhost_slices = [\"0..50\", \"50..101\"]\n");
        let err = FedConfig::from_toml_str(&out_of_range).unwrap_err();
        assert!(err.to_string().contains("out of range"), "{err}");
        assert_eq!(field_of(err), "round.host_slices[1]");
        let gap = with("hosts = 2\nhost_slices = [\"0..40\", \"50..100\"]\n");
        assert_eq!(field_of(FedConfig::from_toml_str(&gap).unwrap_err()), "round.host_slices[1]");
        let garbage = with("hosts = 1\nhost_slices = [\"ten..20\"]\n");
        assert_eq!(field_of(FedConfig::from_toml_str(&garbage).unwrap_err()), "round.host_slices[0]");
        let ok = with("hosts = 2\nhost_slices = [\"0..30\", \"30..100\"]\n");
        assert_eq!(FedConfig::from_toml_str(&ok).unwrap().host_slices().unwrap(), vec![0..30, 30..100]);
    }

    #[test]
    fn other_bad_values_name_their_keys() {
        let cases = [
            (with("fan_in = 1\n"), "round.fan_in"),
            (with("[local]\nlr = -1.0\n"), "local.lr"),
            (with("[local]\nbatch_size = 0\n"), "local.batch_size"),
            (with("[strategy]\nbeta2 = 1.5\n"), "strategy.beta2"),
            (with("[faults]\ndropout_rate = 2.0\n"), "faults.dropout_rate"),
            (with("[faults]\ndeadline_ms = 0.0\n"), "faults.deadline_ms"),
            (with("[async]\nbuffer_size = 0\nmax_staleness = 1\nconcurrency = 5\n"), "async.buffer_size"),
            (with("hosts = 2\n[[faults.host_down]]\nhost = 2\nround = 0\n"), "faults.host_down[0].host"),
        ];
        for (text, key) in cases {
            assert_eq!(field_of(FedConfig::from_toml_str(&text).unwrap_err()), key, "{text}");
        }
    }

    #[test]
    fn unknown_keys_and_unreadable_files_are_errors() {
        let err = FedConfig::from_toml_str(&with("fanin = 3\n")).unwrap_err();
        assert!(matches!(err, FedError::ConfigFile { .. }), "{err}");
        let err = FedConfig::from_file(Path::new("/nonexistent/fed.toml")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/fed.toml"), "{err}");
    }
}
