//! Elastic-job settings: how many workers, how failures are detected, and what to do about each
//! class of failure. Read from the `[elastic]` table of a job's TOML (all keys optional; unknown keys are an error).

use std::time::Duration;

use rtx_collectives::{MAX_CHANNELS, MAX_STRIPES};

use crate::error::{Result, SupervisorError};

/// The dimensions of a mesh job's model that bound how it can be cut: the re-partition rule needs
/// them to pick a smaller mesh ([`crate::plan::repartitioned_shape`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MeshModel {
    /// Blocks, heads, vocabulary and MLP width.
    pub dims: rtx_pipelines::ModelDims,
    /// Virtual stages per pipeline rank (interleaved schedules; 1 otherwise).
    pub chunks: usize,
}

/// Classes of failure, each with its own policy and budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum FailureClass {
    /// The worker process died (exit observed, or its connection ended abruptly).
    Crash,
    /// The worker stopped sending heartbeats but its connection is open (hung, or a straggler
    /// beyond the timeout).
    Hang,
    /// The connection was lost without a process exit being seen (network loss).
    NetworkLoss,
    /// The worker left gracefully (SIGTERM).
    Preemption,
}

/// What to do when a worker is lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnFailure {
    /// Continue with the survivors (as long as `min_workers` remain).
    Shrink,
    /// Start a replacement worker (launcher mode) and wait for it, the survivors paused, up to
    /// `prepare_timeout`: it joins at the lost rank (or the lost mesh slot) and receives that
    /// rank's state from the survivors; if it never comes, continue with the survivors as
    /// `Shrink` does.
    Replace,
}

/// Policy of one failure class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClassPolicy {
    pub on_failure: OnFailure,
    /// Failures of this class tolerated before the job fails.
    pub budget: u32,
}

/// How a data-parallel job keeps its optimizer state and gradients (`[elastic] sharding`, or
/// `[parallel] zero` through `rtx launch`).
///
/// ZeRO-1 and ZeRO-2 hold the same state between steps (each rank owns one segment of the
/// optimizer state, and its buddy a copy), so they share every recovery path; ZeRO-2 additionally
/// frees the full gradient once its segment is reduce-scattered. Their parameters are bit-equal.
/// ZeRO-3 (FSDP, a GPT only) shards the parameters too: a rank holds only its unit segments
/// between steps, exchanged with its buddy in the same way (`crate::zero3`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum DpSharding {
    /// Every rank holds the whole optimizer state and gradient.
    #[default]
    Replicated,
    /// Optimizer state sharded across the ranks (ZeRO stage 1).
    Zero1,
    /// Optimizer state and gradients sharded (ZeRO stage 2).
    Zero2,
    /// Parameters, gradients and optimizer state sharded (ZeRO stage 3, FSDP; a GPT only).
    Zero3,
}

impl DpSharding {
    /// Whether the optimizer state is split into per-rank segments (with buddy copies).
    pub fn shards_optimizer(self) -> bool {
        self != Self::Replicated
    }

    /// The name `[elastic] sharding` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Replicated => "replicated",
            Self::Zero1 => "zero1",
            Self::Zero2 => "zero2",
            Self::Zero3 => "zero3",
        }
    }
}

/// Where a ZeRO-1/2 job keeps the state of its newest committed step (`[elastic] zero_copies`).
///
/// No rank of a ZeRO-1/2 job holds the whole optimizer state, so something must stand in for the
/// segment of a lost rank. The choice is a trade-off between a cost paid at every step and steps
/// re-run after a failure (see `crate::zero1`'s module doc for the decision).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum ZeroCopies {
    /// After every step each rank encodes its segment state and exchanges it with its buddy
    /// before the step commits: a lost worker re-runs at most the step in flight, at the price of
    /// one segment-state exchange per step (and four segment states of memory per rank).
    #[default]
    Buddy,
    /// No per-step copies: a step commits right after its update, and a lost worker rolls the job
    /// back to the last snapshot (`snapshot_every`, and every checkpoint), whose steps since are
    /// re-run (bit-identically, at the same world size). What torchrun/DeepSpeed jobs do.
    Snapshot,
}

impl ZeroCopies {
    /// The name `[elastic] zero_copies` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Buddy => "buddy",
            Self::Snapshot => "snapshot",
        }
    }

    /// Whether each step's segment states are exchanged with the buddies.
    pub fn per_step(self) -> bool {
        self == Self::Buddy
    }
}

/// What carries the workers' collective frames between processes (`[elastic] data_transport`),
/// wherever the generation's layout ([`Wire`]) crosses a process boundary by network: between
/// every pair of a QUIC-layout generation, between the machines of a routed one. Shared memory
/// inside a machine is the same either way.
///
/// Why a choice: QUIC multiplexes streams and never lets one connection's loss stall another, but
/// quinn pays per packet on the task that drives the connection; TCP with mutual TLS 1.3
/// (`rtx_collectives::TlsTransport`) leaves segmentation and acknowledgement to the kernel and
/// seals records on one writer and one reader thread per connection, which measured faster on
/// 2-core hosts and between hosts with a 9000-byte MTU (BENCHMARKS.md). Both authenticate with
/// the cluster CA and the per-rank certificates of `Prepare`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum DataTransport {
    /// QUIC with mutual TLS (`rtx_collectives::QuicTransport`).
    #[default]
    Quic,
    /// TCP with mutual TLS 1.3, one writer and one reader thread per connection
    /// (`rtx_collectives::TlsTransport`).
    Tls,
}

impl DataTransport {
    /// The name `[elastic] data_transport` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Quic => "quic",
            Self::Tls => "tls",
        }
    }
}

/// Which transport the collectives of a generation use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wire {
    /// Shared memory when every member is on one machine, the network ([`DataTransport`])
    /// otherwise.
    Auto,
    /// Always the network between every pair (QUIC, or TLS over TCP with
    /// [`DataTransport::Tls`]).
    Quic,
    /// Always shared memory (every member must be on one machine).
    Shm,
    /// The workers bring their own collectives transport (a `GenerationWire`, e.g. the
    /// simulator's network): the supervisor issues no rank certificates and names no shm rings.
    Injected,
}

/// A deliberately wrong behaviour, for proving that the simulator's invariants catch bugs.
/// Test-only: never set in production, and not readable from a config file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PlantedBug {
    /// Correct behaviour.
    #[default]
    None,
    /// After a re-formation the group restarts at the newest completed step instead of the one
    /// after it: that step is trained (its samples counted, its buckets reduced) twice.
    ReplayLastStep,
    /// In a mesh, a member that should fetch its slot's state from a surviving holder starts from
    /// the initial parameters instead: that slot's holders disagree from then on.
    MeshSlotFromInitial,
}

/// Settings of an elastic job.
#[derive(Clone, Debug, PartialEq)]
pub struct ElasticConfig {
    /// Fewest workers that may train; below it the job waits for joiners, then fails.
    pub min_workers: usize,
    /// Most workers; later joiners are refused.
    pub max_workers: usize,
    /// Workers to wait for before the first step.
    pub start_workers: usize,
    /// How often workers send heartbeats.
    pub heartbeat_interval: Duration,
    /// A worker silent for this long is declared hung (and evicted).
    pub heartbeat_timeout: Duration,
    /// How long to wait for enough workers (start, or after losses) before failing.
    pub rendezvous_timeout: Duration,
    /// How long a `Prepare` round may take before the unresponsive members are dropped.
    pub prepare_timeout: Duration,
    /// How long the supervisor waits, once the last step is committed, for the members' final
    /// reports (the final evaluation: probes over a whole test split can take minutes) before it
    /// finishes the job without the late ones. A dead member is still caught at once by its
    /// heartbeats or lost link; this bounds only a live member whose evaluation is stuck.
    pub finish_timeout: Duration,
    /// Bound on any one collective operation's wait.
    pub collective_timeout: Duration,
    /// Parameter checksums are compared across replicas every this many steps (and at the end).
    pub verify_every: u64,
    /// Checkpoint every this many steps (0: never); written by rank 0 in the background.
    pub checkpoint_every: u64,
    /// Layout of the collectives: where shared memory replaces the network.
    pub transport: Wire,
    /// What crosses processes by network: QUIC ([`DataTransport::Quic`], the default) or TCP with
    /// mutual TLS 1.3 ([`DataTransport::Tls`]). `[elastic] data_transport = "quic" | "tls"`.
    pub data_transport: DataTransport,
    /// Independent rings (channels) each large all-reduce of a data-parallel generation is split
    /// into, 1 to [`MAX_CHANNELS`] (`[elastic] channels = N`, default 1): the workers' endpoints get
    /// `CommConfig::channels` and their DP communication runtime that many threads, so each ring
    /// has one. Pays off only on hosts with cores to spare (BENCHMARKS.md); the sums' last bits
    /// depend on N (never on the rank), so one job keeps one value.
    pub channels: usize,
    /// Connections per worker pair that carry the collectives' frames, 1 to [`MAX_STRIPES`]
    /// (`[elastic] connections = N`, default 1): `QuicOptions::stripes` or `TlsOptions::stripes`
    /// of every worker's data transport. Each connection is sealed and opened by its own thread
    /// (TLS) or quinn driver (QUIC), so on hosts with cores to spare a pair's traffic is no longer
    /// held to one core; measured best with `channels = 4` over TLS (BENCHMARKS.md). The sums do
    /// not depend on it.
    pub connections: usize,
    /// Test-only: a planted bug (see [`PlantedBug`]).
    pub planted_bug: PlantedBug,
    /// ZeRO-1 / ZeRO-2: optimizer state (and under ZeRO-2 gradients) sharded across the workers.
    /// Each rank's segment state is also held by its buddy (the next rank), so a lost worker costs
    /// at most the step in flight; when a rank and its buddy are lost together, recovery rolls
    /// back to the last snapshot (every `snapshot_every` steps, and at every checkpoint), which
    /// gathers the full state on every rank.
    pub sharding: DpSharding,
    /// Steps between ZeRO-1/2 snapshots.
    pub snapshot_every: u64,
    /// ZeRO-1/2: whether each step's segment states are exchanged with the buddies
    /// ([`ZeroCopies::Buddy`], the default: a loss re-runs at most the step in flight) or only the
    /// snapshots are kept ([`ZeroCopies::Snapshot`]: nothing paid per step, a loss re-runs the
    /// steps since the last snapshot). `[elastic] zero_copies = "buddy" | "snapshot"`.
    pub zero_copies: ZeroCopies,
    /// Pipeline stages and tensor-parallel ranks of a model-parallel job (1 and 1: data
    /// parallelism). The supervisor then forms generations of whole replicas of `pp · tp` members
    /// (see [`crate::placement`]).
    pub pp: usize,
    /// Tensor-parallel ranks per stage.
    pub tp: usize,
    /// Whether a mesh job whose live world no longer fills one replica of `pp · tp` is
    /// re-partitioned over the members it has (rule 2 of [`crate::plan`], from the newest sharded
    /// checkpoint) instead of waiting for workers (`[elastic] repartition`, default true). Needs
    /// [`Self::mesh_model`].
    pub repartition: bool,
    /// What the supervisor knows of a mesh job's model to re-partition it; `None`: the job is
    /// never re-partitioned (a generation waits for whole replicas).
    pub mesh_model: Option<MeshModel>,
    pub crash: ClassPolicy,
    pub hang: ClassPolicy,
    pub network_loss: ClassPolicy,
    pub preemption: ClassPolicy,
}

impl Default for ElasticConfig {
    fn default() -> Self {
        let shrink = ClassPolicy { on_failure: OnFailure::Shrink, budget: 100 };
        ElasticConfig {
            min_workers: 1,
            max_workers: 64,
            start_workers: 1,
            heartbeat_interval: Duration::from_millis(200),
            heartbeat_timeout: Duration::from_millis(1500),
            rendezvous_timeout: Duration::from_secs(120),
            prepare_timeout: Duration::from_secs(30),
            finish_timeout: Duration::from_secs(30 * 60),
            collective_timeout: Duration::from_secs(60),
            verify_every: 50,
            checkpoint_every: 0,
            transport: Wire::Auto,
            data_transport: DataTransport::Quic,
            channels: 1,
            connections: 1,
            planted_bug: PlantedBug::None,
            sharding: DpSharding::Replicated,
            snapshot_every: 25,
            zero_copies: ZeroCopies::Buddy,
            pp: 1,
            tp: 1,
            repartition: true,
            mesh_model: None,
            crash: shrink,
            hang: shrink,
            network_loss: shrink,
            preemption: shrink,
        }
    }
}

impl ElasticConfig {
    /// Members of one model replica (`pp · tp`; 1 under data parallelism).
    pub fn mesh_slots(&self) -> usize {
        self.pp.max(1) * self.tp.max(1)
    }

    /// The policy of a class.
    pub fn policy(&self, class: FailureClass) -> ClassPolicy {
        match class {
            FailureClass::Crash => self.crash,
            FailureClass::Hang => self.hang,
            FailureClass::NetworkLoss => self.network_loss,
            FailureClass::Preemption => self.preemption,
        }
    }

    /// Checks the relationships between the values.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(SupervisorError::InvalidConfig { reason });
        if self.min_workers == 0 {
            return bad("elastic.min_workers must be at least 1".into());
        }
        if self.min_workers > self.max_workers {
            return bad(format!("elastic.min_workers ({}) is above elastic.max_workers ({})", self.min_workers, self.max_workers));
        }
        if self.start_workers < self.min_workers || self.start_workers > self.max_workers {
            return bad(format!("the starting worker count {} must lie in [min_workers {}, max_workers {}]", self.start_workers, self.min_workers, self.max_workers));
        }
        if self.heartbeat_interval.is_zero() || self.heartbeat_timeout <= self.heartbeat_interval * 2 {
            return bad(format!("elastic.heartbeat_timeout ({:?}) must exceed twice elastic.heartbeat_interval ({:?})", self.heartbeat_timeout, self.heartbeat_interval));
        }
        if self.verify_every == 0 {
            return bad("elastic.verify_every must be at least 1".into());
        }
        if self.zero_copies == ZeroCopies::Snapshot && self.sharding == DpSharding::Zero3 {
            // ZeRO-3 takes no snapshots: its buddy copies are its only restorable point between
            // checkpoints.
            return bad("elastic.zero_copies = \"snapshot\" needs sharding \"zero1\" or \"zero2\" (ZeRO-3 keeps its state only in buddy copies)".into());
        }
        // `apply_toml` refuses these already; a config built in code is checked here.
        if !(1..=MAX_CHANNELS).contains(&self.channels) {
            return bad(format!("elastic.channels must be an integer from 1 to {MAX_CHANNELS}, got {}", self.channels));
        }
        if !(1..=MAX_STRIPES).contains(&self.connections) {
            return bad(format!("elastic.connections must be an integer from 1 to {MAX_STRIPES}, got {}", self.connections));
        }
        Ok(())
    }

    /// Applies the `[elastic]` table of a job TOML (unknown keys are an error).
    pub fn apply_toml(&mut self, table: &toml::Table) -> Result<()> {
        for (key, value) in table {
            let int = || value.as_integer().and_then(|i| u64::try_from(i).ok()).ok_or_else(|| SupervisorError::InvalidConfig { reason: format!("elastic.{key} must be a non-negative integer, got {value}") });
            let ms = || int().map(Duration::from_millis);
            match key.as_str() {
                "min_workers" => self.min_workers = int()? as usize,
                "max_workers" => self.max_workers = int()? as usize,
                "heartbeat_interval_ms" => self.heartbeat_interval = ms()?,
                "heartbeat_timeout_ms" => self.heartbeat_timeout = ms()?,
                "rendezvous_timeout_ms" => self.rendezvous_timeout = ms()?,
                "prepare_timeout_ms" => self.prepare_timeout = ms()?,
                "finish_timeout_ms" => self.finish_timeout = ms()?,
                "collective_timeout_ms" => self.collective_timeout = ms()?,
                "verify_every" => self.verify_every = int()?,
                "checkpoint_every" => self.checkpoint_every = int()?,
                "on_failure" => {
                    let on = match value.as_str() {
                        Some("shrink") => OnFailure::Shrink,
                        Some("replace") => OnFailure::Replace,
                        _ => return Err(SupervisorError::InvalidConfig { reason: format!("elastic.on_failure must be \"shrink\" or \"replace\", got {value}") }),
                    };
                    for p in [&mut self.crash, &mut self.hang, &mut self.network_loss] {
                        p.on_failure = on;
                    }
                }
                "transport" => {
                    self.transport = match value.as_str() {
                        Some("auto") => Wire::Auto,
                        Some("quic") => Wire::Quic,
                        Some("shm") => Wire::Shm,
                        // The layout and the network protocol are two keys; point a "tls" here at
                        // the other one instead of only listing the layouts.
                        Some("tls") => return Err(SupervisorError::InvalidConfig { reason: "elastic.transport chooses the layout (\"auto\", \"quic\" or \"shm\"); TLS over TCP between processes is elastic.data_transport = \"tls\"".into() }),
                        _ => return Err(SupervisorError::InvalidConfig { reason: format!("elastic.transport must be \"auto\", \"quic\" or \"shm\", got {value}") }),
                    };
                }
                "data_transport" => {
                    self.data_transport = match value.as_str() {
                        Some("quic") => DataTransport::Quic,
                        Some("tls") => DataTransport::Tls,
                        _ => return Err(SupervisorError::InvalidConfig { reason: format!("elastic.data_transport must be \"quic\" or \"tls\", got {value}") }),
                    };
                }
                // Counts are checked here, not in `validate`, so the message names the value as
                // written (a string or a float is refused too, not only a count out of range).
                "channels" => self.channels = count_in(key, value, MAX_CHANNELS)?,
                "connections" => self.connections = count_in(key, value, MAX_STRIPES)?,
                "sharding" => {
                    self.sharding = match value.as_str() {
                        Some("replicated") => DpSharding::Replicated,
                        Some("zero1") => DpSharding::Zero1,
                        Some("zero2") => DpSharding::Zero2,
                        Some("zero3") => DpSharding::Zero3,
                        _ => return Err(SupervisorError::InvalidConfig { reason: format!("elastic.sharding must be \"replicated\", \"zero1\", \"zero2\" or \"zero3\", got {value}") }),
                    };
                }
                "snapshot_every" => self.snapshot_every = int()?.max(1),
                "zero_copies" => {
                    self.zero_copies = match value.as_str() {
                        Some("buddy") => ZeroCopies::Buddy,
                        Some("snapshot") => ZeroCopies::Snapshot,
                        _ => return Err(SupervisorError::InvalidConfig { reason: format!("elastic.zero_copies must be \"buddy\" or \"snapshot\", got {value}") }),
                    };
                }
                "repartition" => self.repartition = value.as_bool().ok_or_else(|| SupervisorError::InvalidConfig { reason: format!("elastic.repartition must be true or false, got {value}") })?,
                "failure_budget" => {
                    let b = int()? as u32;
                    for p in [&mut self.crash, &mut self.hang, &mut self.network_loss, &mut self.preemption] {
                        p.budget = b;
                    }
                }
                other => return Err(SupervisorError::InvalidConfig { reason: format!("unknown key elastic.{other} (known: min_workers, max_workers, heartbeat_interval_ms, heartbeat_timeout_ms, rendezvous_timeout_ms, prepare_timeout_ms, finish_timeout_ms, collective_timeout_ms, verify_every, checkpoint_every, on_failure, failure_budget, transport, data_transport, channels, connections, sharding, snapshot_every, zero_copies, repartition)") }),
            }
        }
        Ok(())
    }
}

/// The `[elastic]` count `key` as written: an integer from 1 to `max`, or an error naming the key,
/// the range and the value.
fn count_in(key: &str, value: &toml::Value, max: usize) -> Result<usize> {
    match value.as_integer().and_then(|i| usize::try_from(i).ok()) {
        Some(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(SupervisorError::InvalidConfig { reason: format!("elastic.{key} must be an integer from 1 to {max}, got {value}") }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_bad_values_are_named() {
        ElasticConfig::default().validate().unwrap();
        let mut c = ElasticConfig::default();
        c.apply_toml(&toml::from_str("min_workers = 2\nmax_workers = 4\non_failure = \"replace\"").unwrap()).unwrap();
        assert_eq!((c.min_workers, c.max_workers, c.crash.on_failure), (2, 4, OnFailure::Replace));
        let err = c.apply_toml(&toml::from_str("min_worker = 2").unwrap()).unwrap_err().to_string();
        assert!(err.contains("unknown key elastic.min_worker"), "{err}");
        let err = c.apply_toml(&toml::from_str("min_workers = -1").unwrap()).unwrap_err().to_string();
        assert!(err.contains("non-negative integer"), "{err}");
        assert!(c.repartition);
        c.apply_toml(&toml::from_str("repartition = false").unwrap()).unwrap();
        assert!(!c.repartition);
        let err = c.apply_toml(&toml::from_str("repartition = 1").unwrap()).unwrap_err().to_string();
        assert!(err.contains("elastic.repartition must be true or false"), "{err}");
        c.min_workers = 5;
        assert!(c.validate().unwrap_err().to_string().contains("above elastic.max_workers"));
    }

    #[test]
    fn zero_copies_parses_both_values_and_names_a_bad_one() {
        let mut c = ElasticConfig::default();
        assert_eq!(c.zero_copies, ZeroCopies::Buddy, "the default keeps the per-step buddy copies");
        c.apply_toml(&toml::from_str("sharding = \"zero1\"\nzero_copies = \"snapshot\"").unwrap()).unwrap();
        assert_eq!((c.sharding, c.zero_copies), (DpSharding::Zero1, ZeroCopies::Snapshot));
        c.validate().unwrap();
        c.apply_toml(&toml::from_str("zero_copies = \"buddy\"").unwrap()).unwrap();
        assert_eq!(c.zero_copies, ZeroCopies::Buddy);
        for bad in ["zero_copies = \"buddies\"", "zero_copies = 2"] {
            match c.apply_toml(&toml::from_str(bad).unwrap()) {
                Err(SupervisorError::InvalidConfig { reason }) => {
                    assert!(reason.contains("elastic.zero_copies must be \"buddy\" or \"snapshot\""), "{reason}");
                    let value = bad.split(" = ").nth(1).unwrap();
                    assert!(reason.ends_with(&format!("got {value}")), "the bad value is named: {reason}");
                }
                other => panic!("{bad}: expected InvalidConfig, got {other:?}"),
            }
        }
        assert_eq!(c.zero_copies, ZeroCopies::Buddy, "a bad value changes nothing");
        // ZeRO-3 has no snapshot to fall back on.
        c.apply_toml(&toml::from_str("sharding = \"zero3\"\nzero_copies = \"snapshot\"").unwrap()).unwrap();
        assert!(matches!(c.validate(), Err(SupervisorError::InvalidConfig { reason }) if reason.contains("zero_copies = \"snapshot\" needs sharding")));
    }

    #[test]
    fn data_transport_parses_both_values_and_names_a_bad_one() {
        let mut c = ElasticConfig::default();
        assert_eq!(c.data_transport, DataTransport::Quic, "QUIC stays the default");
        c.apply_toml(&toml::from_str("data_transport = \"tls\"").unwrap()).unwrap();
        assert_eq!((c.data_transport, c.data_transport.name()), (DataTransport::Tls, "tls"));
        assert_eq!(c.transport, Wire::Auto, "the layout is a key of its own");
        c.validate().unwrap();
        c.apply_toml(&toml::from_str("data_transport = \"quic\"").unwrap()).unwrap();
        assert_eq!((c.data_transport, c.data_transport.name()), (DataTransport::Quic, "quic"));
        for bad in ["data_transport = \"udp\"", "data_transport = \"TLS\"", "data_transport = 1"] {
            match c.apply_toml(&toml::from_str(bad).unwrap()) {
                Err(SupervisorError::InvalidConfig { reason }) => {
                    assert!(reason.contains("elastic.data_transport must be \"quic\" or \"tls\""), "the key is named: {reason}");
                    let value = bad.split(" = ").nth(1).unwrap();
                    assert!(reason.ends_with(&format!("got {value}")), "the bad value is named: {reason}");
                }
                other => panic!("{bad}: expected InvalidConfig, got {other:?}"),
            }
        }
        assert_eq!(c.data_transport, DataTransport::Quic, "a bad value changes nothing");
        // The layout key keeps its own values: "tls" is no layout.
        let err = c.apply_toml(&toml::from_str("transport = \"tls\"").unwrap()).unwrap_err().to_string();
        assert!(err.contains("elastic.data_transport = \"tls\""), "points at the right key: {err}");
    }

    #[test]
    fn channels_and_connections_take_1_to_16_and_a_bad_value_is_named() {
        type Field = fn(&mut ElasticConfig) -> &mut usize;
        let keys: [(&str, Field); 2] = [("channels", |c| &mut c.channels), ("connections", |c| &mut c.connections)];
        for (key, field) in keys {
            let mut c = ElasticConfig::default();
            assert_eq!(*field(&mut c), 1, "{key}: one stays the default");
            c.apply_toml(&toml::from_str(&format!("{key} = 4")).unwrap()).unwrap();
            assert_eq!(*field(&mut c), 4);
            c.validate().unwrap();
            c.apply_toml(&toml::from_str(&format!("{key} = 16")).unwrap()).unwrap();
            assert_eq!(*field(&mut c), 16);
            for value in ["0", "17", "\"4\"", "-1", "2.0"] {
                match c.apply_toml(&toml::from_str(&format!("{key} = {value}")).unwrap()) {
                    Err(SupervisorError::InvalidConfig { reason }) => {
                        assert!(reason.contains(&format!("elastic.{key} must be an integer from 1 to 16")), "the key and range are named: {reason}");
                        assert!(reason.ends_with(&format!("got {value}")), "the bad value is named: {reason}");
                    }
                    other => panic!("{key} = {value}: expected InvalidConfig, got {other:?}"),
                }
            }
            assert_eq!(*field(&mut c), 16, "{key}: a bad value changes nothing");
            for bad in [0, 17] {
                let mut built = ElasticConfig::default();
                *field(&mut built) = bad;
                let err = built.validate().unwrap_err().to_string();
                assert!(err.contains(&format!("elastic.{key} must be an integer from 1 to 16, got {bad}")), "{err}");
            }
            let err = c.apply_toml(&toml::from_str(&format!("{} = 2", &key[..key.len() - 1])).unwrap()).unwrap_err().to_string();
            assert!(err.contains(&format!("unknown key elastic.{} (", &key[..key.len() - 1])) && err.contains(&format!(", {key},")), "the known keys list it: {err}");
        }
    }
}
