//! Scenarios: what a simulated cluster trains, how its network behaves, which elastic settings the
//! real supervisor gets, and which faults happen: the explicit `[[fault]]` list of the TOML file
//! plus a random plan drawn from the run's seed (`[random]`). A plan is plain data, computed
//! without IO or clocks, so the same seed always gives the same plan.
//!
//! Fault kinds: `crash` (the node's process dies; with `restart_after_ms` it comes back and
//! rejoins through the real join path), `pause` (the node hangs: every byte to and from it is
//! held for `for_ms`), `slow` (a straggler: `delay_ms` more latency on all its links), `partition`
//! (the collectives links between `node` and `peer` are cut for `for_ms`; with `one_way = true` only
//! the direction `node → peer`: both ends still detect the loss). A fault fires at
//! `at_ms` of virtual time or when step `at_step` is committed. `checkpoint_fail` makes the next
//! checkpoint write fail (whichever node writes it, so it takes no `node`); checkpoints are
//! written every `[elastic] checkpoint_every` steps into the cluster's in-memory store
//! ([`crate::SimCheckpoints`]). `stuck` (a member whose compute is stuck in a collective while its
//! node agent lives on: its collectives sends wait and nothing is read for it, in the generation
//! it is in, for `for_ms` or until its transport is aborted; its heartbeats and control messages
//! flow as ever). `join` (a new worker joins: it starts in `node`'s slot if that one is free, else
//! in the lowest free slot — a spare (`spares` slots exist beyond `workers`, idle at the start) or
//! a dead node's; nothing happens if every slot runs; the supervisor refuses it if the job already
//! has `workers` members). A node process started after time zero (restart, replacement, join)
//! takes `startup_ms` (top level, default 0) before it dials the supervisor.
//!
//! Besides `at_ms` and `at_step`, a fault may fire `after_ms` (default 0) after the `at_loss`-th
//! member loss the supervisor reports (1 = the first): the supervisor re-forms the group right
//! after a loss, so a `join` timed so lands while it is preparing the new generation.
//!
//! `[network] wire` picks the collectives link model ([`WireModel`]): `"stream"` (QUIC; default)
//! or `"shm"`, shared-memory rings of `ring_bytes` (default 16 KiB) per directed link as before
//! the transport could be aborted: sends wait for ring space, a crash is noticed only after
//! `loss_detect_ms` (the liveness timeout), the frame a dying node was writing is torn.
//! `[elastic] on_failure` is `"shrink"` (default) or `"replace"` (the supervisor asks the simulator,
//! its node launcher, for a replacement after each loss).
//!
//! The random plan (`[random]`) draws, from the seed: `crashes` (each restarted after 0.1-3 s),
//! `partitions` (50 ms-2 s, half one-way), `pauses` (a quarter to three heartbeat timeouts),
//! `slow` stragglers (0.5-5 ms), `checkpoint_failures` (at a random step), all in `window_ms`;
//! `stuck` members (in the window, for `stuck_ms`, default half to three prepare timeouts: long
//! enough that a worker that cannot be interrupted misses `Prepare`); and `joins`, each
//! `after_ms` 0-20 ms after a random one of the first `crashes + pauses + stuck` losses (1 if none
//! are drawn), into the window where the supervisor prepares the next generation.

use std::path::Path;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;

use rtx_supervisor::OnFailure;

use crate::error::{Result, SimError};
use crate::job::JobShape;
use crate::mesh_job::MeshJobShape;
use rtx_pipelines::schedule::ScheduleKind;
use crate::network::WireModel;
use crate::wire::derive;

/// A simulated run's setup; see the module doc.
#[derive(Clone, Debug, PartialEq)]
pub struct Scenario {
    /// The scenario's name.
    pub name: String,
    /// Node slots (each a worker process) started at time zero.
    pub workers: usize,
    /// Further node slots, idle at the start: replacements and `join` faults start there.
    pub spares: usize,
    /// How long a started node process takes before it dials the supervisor (0 at time zero).
    pub startup: Duration,
    /// Fewest workers that may train.
    pub min_workers: usize,
    /// Liveness bound: the job must finish within this much virtual time.
    pub max_virtual: Duration,
    /// The training job.
    pub job: JobShape,
    /// `Some`: the job is the byte-level GPT trained as this `(dp, pp, tp)` mesh
    /// ([`crate::MeshSimJob`]) instead of the data-parallel MLP; `[job]`'s image fields are unused.
    pub mesh: Option<MeshJobShape>,
    /// Network and timing.
    pub net: NetShape,
    /// Elastic settings handed to the supervisor.
    pub elastic: ElasticShape,
    /// Explicit faults.
    pub faults: Vec<Fault>,
    /// How many random faults of each kind the seed draws.
    pub random: RandomFaults,
}

/// Network timing.
#[derive(Clone, Debug, PartialEq)]
pub struct NetShape {
    /// Collectives link latency.
    pub latency: Duration,
    /// Collectives link jitter.
    pub jitter: Duration,
    /// Collectives bandwidth, bytes per second.
    pub bandwidth_bytes_per_s: f64,
    /// Collectives loss probability per frame (a retransmission delay).
    pub loss: f64,
    /// Collectives duplication probability per frame (lost bandwidth).
    pub duplicate: f64,
    /// Collectives reordering probability per frame (a delivery gap).
    pub reorder: f64,
    /// How long a silent collectives peer takes to be reported lost.
    pub loss_detect: Duration,
    /// Control link latency.
    pub control_latency: Duration,
    /// Control link jitter.
    pub control_jitter: Duration,
    /// A control link isolated this long closes (QUIC idle timeout).
    pub idle_timeout: Duration,
    /// The collectives link model.
    pub wire: WireModel,
}

/// The supervisor's elastic timing.
#[derive(Clone, Debug, PartialEq)]
pub struct ElasticShape {
    /// Heartbeat period.
    pub heartbeat_interval: Duration,
    /// Silence that makes a worker hung.
    pub heartbeat_timeout: Duration,
    /// How long the job waits for enough workers.
    pub rendezvous_timeout: Duration,
    /// How long members may take to answer `Prepare`.
    pub prepare_timeout: Duration,
    /// Failures of each class tolerated.
    pub failure_budget: u32,
    /// Rank 0 writes a checkpoint every this many steps (0: none).
    pub checkpoint_every: u64,
    /// Shrink, or ask the launcher for a replacement, after a loss.
    pub on_failure: OnFailure,
}

/// One fault.
#[derive(Clone, Debug, PartialEq)]
pub struct Fault {
    /// The node slot it hits.
    pub node: usize,
    /// When it fires.
    pub when: Trigger,
    /// What happens.
    pub kind: FaultKind,
}

/// When a fault fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Trigger {
    /// At this virtual time.
    At(Duration),
    /// When this step is committed.
    Step(u64),
    /// `after` the `nth` member loss (1-based) the supervisor reports.
    Loss { nth: u64, after: Duration },
}

/// What a fault does.
#[derive(Clone, Debug, PartialEq)]
pub enum FaultKind {
    /// The node's process dies; it restarts after the delay if one is given.
    Crash { restart_after: Option<Duration> },
    /// The node hangs for this long (all its traffic is held).
    Pause { duration: Duration },
    /// The node's links get this much more latency from now on.
    Slow { delay: Duration },
    /// The collectives links between the node and `peer` are cut for `duration` (with
    /// `one_way`, only the node → peer direction).
    Partition { peer: usize, duration: Duration, one_way: bool },
    /// The next checkpoint write fails (the fault's node is not used).
    CheckpointFail,
    /// The node's compute is stuck in a collective for `duration` (or until its transport is
    /// aborted); its node agent lives on.
    Stuck { duration: Duration },
    /// A new worker joins (in the node's slot if free, else the lowest free slot).
    Join,
}

/// Random faults per seed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RandomFaults {
    /// Crashes, each followed by a restart.
    pub crashes: usize,
    /// Collectives partitions between two nodes (symmetric or, half of them, one-way), each healed.
    pub partitions: usize,
    /// Hangs.
    pub pauses: usize,
    /// Stragglers.
    pub slow: usize,
    /// Failed checkpoint writes, each armed when a random step is committed.
    pub checkpoint_failures: usize,
    /// Members stuck in a collective.
    pub stuck: usize,
    /// How long a stuck member stays stuck (drawn from this range).
    pub stuck_for: (Duration, Duration),
    /// Workers joining while the supervisor re-forms the group.
    pub joins: usize,
    /// Faults fire in this window of virtual time.
    pub window: (Duration, Duration),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    name: String,
    workers: usize,
    #[serde(default)]
    spares: usize,
    #[serde(default)]
    startup_ms: u64,
    min_workers: usize,
    max_virtual_s: f64,
    job: FileJob,
    #[serde(default)]
    mesh: Option<FileMesh>,
    #[serde(default)]
    network: FileNet,
    #[serde(default)]
    elastic: FileElastic,
    #[serde(default)]
    random: FileRandom,
    #[serde(default)]
    fault: Vec<FileFault>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileJob {
    #[serde(default)]
    n_train: usize,
    #[serde(default)]
    n_eval: usize,
    global_batch: usize,
    #[serde(default)]
    hidden: usize,
    total_steps: u64,
    data_seed: u64,
    lr: f64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileMesh {
    pp: usize,
    tp: usize,
    microbatches: usize,
    /// `gpipe`, `1f1b`, `interleaved` (with `chunks`) or `zb-h1`.
    schedule: String,
    #[serde(default)]
    chunks: Option<usize>,
    layers: usize,
    d_model: usize,
    heads: usize,
    context: usize,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileNet {
    latency_us: u64,
    jitter_us: u64,
    bandwidth_mb_s: f64,
    loss: f64,
    duplicate: f64,
    reorder: f64,
    loss_detect_ms: u64,
    control_latency_us: u64,
    control_jitter_us: u64,
    idle_timeout_ms: u64,
    wire: String,
    ring_bytes: usize,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileElastic {
    heartbeat_interval_ms: u64,
    heartbeat_timeout_ms: u64,
    rendezvous_timeout_ms: u64,
    prepare_timeout_ms: u64,
    failure_budget: u32,
    checkpoint_every: u64,
    on_failure: String,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
struct FileRandom {
    crashes: usize,
    partitions: usize,
    pauses: usize,
    slow: usize,
    checkpoint_failures: usize,
    stuck: usize,
    stuck_ms: Option<[u64; 2]>,
    joins: usize,
    window_ms: Option<[u64; 2]>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileFault {
    kind: String,
    node: Option<usize>,
    at_ms: Option<u64>,
    at_step: Option<u64>,
    at_loss: Option<u64>,
    after_ms: Option<u64>,
    restart_after_ms: Option<u64>,
    for_ms: Option<u64>,
    delay_ms: Option<u64>,
    peer: Option<usize>,
    one_way: Option<bool>,
}

impl Default for FileNet {
    fn default() -> Self {
        FileNet {
            latency_us: 100,
            jitter_us: 50,
            bandwidth_mb_s: 1000.0,
            loss: 0.0,
            duplicate: 0.0,
            reorder: 0.0,
            loss_detect_ms: 500,
            control_latency_us: 200,
            control_jitter_us: 100,
            idle_timeout_ms: 5000,
            wire: "stream".into(),
            ring_bytes: 16 << 10,
        }
    }
}

impl Default for FileElastic {
    fn default() -> Self {
        FileElastic { heartbeat_interval_ms: 100, heartbeat_timeout_ms: 1000, rendezvous_timeout_ms: 30_000, prepare_timeout_ms: 5000, failure_budget: 1000, checkpoint_every: 0, on_failure: "shrink".into() }
    }
}

impl Scenario {
    /// Reads a scenario file.
    pub fn load(path: &Path) -> Result<Scenario> {
        let text = std::fs::read_to_string(path).map_err(|e| SimError::Scenario(format!("cannot read {}: {e}", path.display())))?;
        Scenario::parse(&text)
    }

    /// Parses a scenario from TOML text.
    pub fn parse(text: &str) -> Result<Scenario> {
        let file: File = toml::from_str(text).map_err(|e| SimError::Scenario(e.to_string()))?;
        let ms = Duration::from_millis;
        let us = Duration::from_micros;
        let mut faults = Vec::new();
        for f in &file.fault {
            let when = match (f.at_ms, f.at_step, f.at_loss) {
                (Some(t), None, None) => Trigger::At(ms(t)),
                (None, Some(s), None) => Trigger::Step(s),
                (None, None, Some(nth)) if nth > 0 => Trigger::Loss { nth, after: ms(f.after_ms.unwrap_or(0)) },
                _ => return Err(SimError::Scenario(format!("fault {:?} needs exactly one of at_ms, at_step and at_loss (counted from 1)", f.kind))),
            };
            if f.after_ms.is_some() && f.at_loss.is_none() {
                return Err(SimError::Scenario(format!("fault {:?}: after_ms goes with at_loss", f.kind)));
            }
            let node = match (f.kind.as_str(), f.node) {
                ("checkpoint_fail", None) => 0,
                ("join", None) => usize::MAX,
                ("checkpoint_fail", Some(_)) => return Err(SimError::Scenario("fault \"checkpoint_fail\" takes no node (it fails the next checkpoint write, whoever writes it)".into())),
                (_, Some(node)) => node,
                (kind, None) => return Err(SimError::Scenario(format!("fault {kind:?} needs node"))),
            };
            let need = |v: Option<u64>, key: &str| v.ok_or_else(|| SimError::Scenario(format!("fault {:?} needs {key}", f.kind)));
            let kind = match f.kind.as_str() {
                "crash" => FaultKind::Crash { restart_after: f.restart_after_ms.map(ms) },
                "pause" => FaultKind::Pause { duration: ms(need(f.for_ms, "for_ms")?) },
                "slow" => FaultKind::Slow { delay: ms(need(f.delay_ms, "delay_ms")?) },
                "partition" => FaultKind::Partition {
                    peer: f.peer.ok_or_else(|| SimError::Scenario("fault \"partition\" needs peer".into()))?,
                    duration: ms(need(f.for_ms, "for_ms")?),
                    one_way: f.one_way.unwrap_or(false),
                },
                "checkpoint_fail" => FaultKind::CheckpointFail,
                "stuck" => FaultKind::Stuck { duration: ms(need(f.for_ms, "for_ms")?) },
                "join" => FaultKind::Join,
                other => return Err(SimError::Scenario(format!("unknown fault kind {other:?} (known: crash, pause, slow, partition, checkpoint_fail, stuck, join)"))),
            };
            faults.push(Fault { node, when, kind });
        }
        let window = file.random.window_ms.unwrap_or([200, 5000]);
        let wire = match file.network.wire.as_str() {
            "stream" => WireModel::Stream,
            "shm" => WireModel::Shm { ring_bytes: file.network.ring_bytes },
            other => return Err(SimError::Scenario(format!("network.wire must be \"stream\" or \"shm\", got {other:?}"))),
        };
        let on_failure = match file.elastic.on_failure.as_str() {
            "shrink" => OnFailure::Shrink,
            "replace" => OnFailure::Replace,
            other => return Err(SimError::Scenario(format!("elastic.on_failure must be \"shrink\" or \"replace\", got {other:?}"))),
        };
        let mesh = match file.mesh {
            None => None,
            Some(m) => {
                let schedule = match (m.schedule.as_str(), m.chunks) {
                    ("gpipe", None) => ScheduleKind::GPipe,
                    ("1f1b", None) => ScheduleKind::OneFOneB,
                    ("zb-h1", None) => ScheduleKind::ZeroBubbleH1,
                    ("interleaved", Some(chunks)) => ScheduleKind::Interleaved { chunks },
                    (other, chunks) => return Err(SimError::Scenario(format!("mesh.schedule must be \"gpipe\", \"1f1b\", \"zb-h1\" or \"interleaved\" (with mesh.chunks, only there), got {other:?} with chunks {chunks:?}"))),
                };
                Some(MeshJobShape { pp: m.pp, tp: m.tp, microbatches: m.microbatches, schedule, layers: m.layers, d_model: m.d_model, heads: m.heads, context: m.context })
            }
        };
        let prepare = file.elastic.prepare_timeout_ms;
        let stuck_ms = file.random.stuck_ms.unwrap_or([prepare / 2, prepare * 3]);
        let scenario = Scenario {
            name: file.name,
            workers: file.workers,
            spares: file.spares,
            startup: ms(file.startup_ms),
            min_workers: file.min_workers,
            max_virtual: Duration::from_secs_f64(file.max_virtual_s),
            job: JobShape {
                n_train: file.job.n_train,
                n_eval: file.job.n_eval,
                global_batch: file.job.global_batch,
                hidden: file.job.hidden,
                total_steps: file.job.total_steps,
                data_seed: file.job.data_seed,
                lr: file.job.lr,
            },
            mesh,
            net: NetShape {
                latency: us(file.network.latency_us),
                jitter: us(file.network.jitter_us),
                bandwidth_bytes_per_s: file.network.bandwidth_mb_s * 1e6,
                loss: file.network.loss,
                duplicate: file.network.duplicate,
                reorder: file.network.reorder,
                loss_detect: ms(file.network.loss_detect_ms),
                control_latency: us(file.network.control_latency_us),
                control_jitter: us(file.network.control_jitter_us),
                idle_timeout: ms(file.network.idle_timeout_ms),
                wire,
            },
            elastic: ElasticShape {
                heartbeat_interval: ms(file.elastic.heartbeat_interval_ms),
                heartbeat_timeout: ms(file.elastic.heartbeat_timeout_ms),
                rendezvous_timeout: ms(file.elastic.rendezvous_timeout_ms),
                prepare_timeout: ms(file.elastic.prepare_timeout_ms),
                failure_budget: file.elastic.failure_budget,
                checkpoint_every: file.elastic.checkpoint_every,
                on_failure,
            },
            faults,
            random: RandomFaults {
                crashes: file.random.crashes,
                partitions: file.random.partitions,
                pauses: file.random.pauses,
                slow: file.random.slow,
                checkpoint_failures: file.random.checkpoint_failures,
                stuck: file.random.stuck,
                stuck_for: (ms(stuck_ms[0]), ms(stuck_ms[1])),
                joins: file.random.joins,
                window: (ms(window[0]), ms(window[1])),
            },
        };
        scenario.validate()?;
        Ok(scenario)
    }

    fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(SimError::Scenario(reason));
        if self.workers == 0 || self.min_workers == 0 || self.min_workers > self.workers {
            return bad(format!("need 1 <= min_workers ({}) <= workers ({})", self.min_workers, self.workers));
        }
        match &self.mesh {
            None if self.job.n_train == 0 || self.job.hidden == 0 => return bad("job.n_train and job.hidden must be positive (the data-parallel MLP job)".into()),
            Some(m) => {
                let slots = m.pp * m.tp;
                if slots == 0 || self.workers % slots != 0 || self.min_workers == 0 {
                    return bad(format!("mesh: workers ({}) must be a positive multiple of pp · tp = {} · {}", self.workers, m.pp, m.tp));
                }
                if self.random.checkpoint_failures > 0 || self.faults.iter().any(|f| f.kind == FaultKind::CheckpointFail) {
                    return bad("mesh scenarios write sharded checkpoints to files; checkpoint_fail faults act on the simulated store only".into());
                }
            }
            None => {}
        }
        if self.random.window.0 >= self.random.window.1 {
            return bad("random.window_ms must be increasing".into());
        }
        if self.random.stuck > 0 && self.random.stuck_for.0 >= self.random.stuck_for.1 {
            return bad("random.stuck_ms must be increasing".into());
        }
        if let WireModel::Shm { ring_bytes: 0 } = self.net.wire {
            return bad("network.ring_bytes must be positive".into());
        }
        if self.random.partitions > 0 && self.workers < 2 {
            return bad("random partitions need two workers".into());
        }
        let fails_checkpoints = self.random.checkpoint_failures > 0 || self.faults.iter().any(|f| f.kind == FaultKind::CheckpointFail);
        if fails_checkpoints && self.elastic.checkpoint_every == 0 {
            return bad("checkpoint_fail faults need [elastic] checkpoint_every > 0 (the job writes no checkpoints)".into());
        }
        for f in &self.faults {
            let peer_ok = match f.kind {
                FaultKind::Partition { peer, .. } => peer < self.workers && peer != f.node,
                _ => true,
            };
            let slots = self.workers + self.spares;
            if f.kind == FaultKind::Join {
                if f.node != usize::MAX && f.node >= slots {
                    return bad(format!("fault {f:?} names a slot outside 0..{slots}"));
                }
                continue;
            }
            if f.node >= slots || !peer_ok {
                return bad(format!("fault {f:?} names a node outside 0..{slots}"));
            }
        }
        Ok(())
    }

    /// The faults of the run of `seed`: the explicit ones, then the random ones, ordered by trigger.
    pub fn plan(&self, seed: u64) -> Vec<Fault> {
        let mut rng = ChaCha8Rng::seed_from_u64(derive(seed, 0x706c_616e));
        let (lo, hi) = (self.random.window.0.as_millis() as u64, self.random.window.1.as_millis() as u64);
        let mut plan = self.faults.clone();
        let at = |rng: &mut ChaCha8Rng| Trigger::At(Duration::from_millis(rng.random_range(lo..hi)));
        for _ in 0..self.random.crashes {
            let when = at(&mut rng);
            let node = rng.random_range(0..self.workers);
            plan.push(Fault { node, when, kind: FaultKind::Crash { restart_after: Some(Duration::from_millis(rng.random_range(100..3000))) } });
        }
        for _ in 0..self.random.partitions {
            let when = at(&mut rng);
            let node = rng.random_range(0..self.workers);
            let peer = (node + rng.random_range(1..self.workers)) % self.workers;
            let duration = Duration::from_millis(rng.random_range(50..2000));
            let one_way = rng.random_bool(0.5);
            plan.push(Fault { node, when, kind: FaultKind::Partition { peer, duration, one_way } });
        }
        for _ in 0..self.random.pauses {
            let when = at(&mut rng);
            let node = rng.random_range(0..self.workers);
            let timeout = self.elastic.heartbeat_timeout.as_millis() as u64;
            plan.push(Fault { node, when, kind: FaultKind::Pause { duration: Duration::from_millis(rng.random_range(timeout / 4..timeout * 3)) } });
        }
        for _ in 0..self.random.slow {
            let when = at(&mut rng);
            let node = rng.random_range(0..self.workers);
            plan.push(Fault { node, when, kind: FaultKind::Slow { delay: Duration::from_micros(rng.random_range(500..5000)) } });
        }
        for _ in 0..self.random.checkpoint_failures {
            let step = rng.random_range(0..self.job.total_steps.max(1));
            plan.push(Fault { node: 0, when: Trigger::Step(step), kind: FaultKind::CheckpointFail });
        }
        // Drawn after the older kinds, so scenarios without them keep their plans.
        for _ in 0..self.random.stuck {
            let when = at(&mut rng);
            let node = rng.random_range(0..self.workers);
            let (a, b) = (self.random.stuck_for.0.as_millis() as u64, self.random.stuck_for.1.as_millis() as u64);
            plan.push(Fault { node, when, kind: FaultKind::Stuck { duration: Duration::from_millis(rng.random_range(a..b)) } });
        }
        let losses = (self.random.crashes + self.random.pauses + self.random.stuck).max(1) as u64;
        for _ in 0..self.random.joins {
            let nth = rng.random_range(1..=losses);
            let after = Duration::from_millis(rng.random_range(0..=20));
            plan.push(Fault { node: usize::MAX, when: Trigger::Loss { nth, after }, kind: FaultKind::Join });
        }
        // Stable: equal triggers keep their drawing order.
        plan.sort_by_key(|f| f.when);
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"
name = "t"
workers = 3
min_workers = 1
max_virtual_s = 60
[job]
n_train = 64
n_eval = 16
global_batch = 8
hidden = 4
total_steps = 5
data_seed = 1
lr = 0.01
[random]
crashes = 2
partitions = 1
[[fault]]
kind = "crash"
node = 2
at_step = 3
restart_after_ms = 100
"#;

    // Goal: a plan is a pure function of the seed; different seeds differ.
    #[test]
    fn plans_replay_by_seed() {
        let s = Scenario::parse(TEXT).unwrap();
        assert_eq!(s.plan(9), s.plan(9));
        assert_ne!(s.plan(9), s.plan(10));
        assert_eq!(s.plan(9).len(), 4);
        assert!(s.plan(9).iter().any(|f| f.when == Trigger::Step(3)));
    }

    // Goal: the issue-19 keys parse: shared-memory links, replace, spares, stuck and join
    // faults (a join may fire after a loss), and the random plan draws stuck members and joins
    // (joins after one of the first losses).
    #[test]
    fn shm_stuck_and_join_faults_parse_and_are_drawn() {
        let text = TEXT.replace("[random]", "[network]\nwire = \"shm\"\nring_bytes = 4096\n[elastic]\non_failure = \"replace\"\n[random]\nstuck = 3\njoins = 2")
            + "[[fault]]\nkind = \"stuck\"\nnode = 1\nat_ms = 20\nfor_ms = 900\n[[fault]]\nkind = \"join\"\nat_loss = 2\nafter_ms = 3\n";
        let s = Scenario::parse(&text.replace("workers = 3", "workers = 3\nspares = 1")).unwrap();
        assert_eq!(s.net.wire, WireModel::Shm { ring_bytes: 4096 });
        assert_eq!((s.elastic.on_failure, s.spares), (OnFailure::Replace, 1));
        assert!(s.faults.iter().any(|f| f.kind == FaultKind::Stuck { duration: Duration::from_millis(900) } && f.node == 1));
        assert!(s.faults.iter().any(|f| f.kind == FaultKind::Join && f.when == Trigger::Loss { nth: 2, after: Duration::from_millis(3) }));
        let plan = s.plan(4);
        assert_eq!(plan.iter().filter(|f| matches!(f.kind, FaultKind::Stuck { .. })).count(), 4);
        let joins: Vec<&Fault> = plan.iter().filter(|f| f.kind == FaultKind::Join).collect();
        assert_eq!(joins.len(), 3);
        // Random joins come after one of the first crashes + pauses + stuck = 5 losses.
        assert!(joins.iter().all(|f| matches!(f.when, Trigger::Loss { nth, after } if (1..=5).contains(&nth) && after <= Duration::from_millis(20))));
        let e = Scenario::parse(&text.replace("wire = \"shm\"", "wire = \"tcp\"")).unwrap_err();
        assert!(e.to_string().contains("network.wire"), "{e}");
        let e = Scenario::parse(&text.replace("after_ms = 3", "after_ms = 3\nat_ms = 5")).unwrap_err();
        assert!(e.to_string().contains("exactly one"), "{e}");
    }

    // Goal: bad files are refused with a reason.
    #[test]
    fn refuses_bad_faults() {
        let e = Scenario::parse(&TEXT.replace("node = 2", "node = 7")).unwrap_err();
        assert!(e.to_string().contains("outside"), "{e}");
        let e = Scenario::parse(&TEXT.replace("kind = \"crash\"", "kind = \"checkpoint_fail\"")).unwrap_err();
        assert!(e.to_string().contains("takes no node"), "{e}");
        let no_node = TEXT.replace("kind = \"crash\"\nnode = 2", "kind = \"checkpoint_fail\"");
        let e = Scenario::parse(&no_node).unwrap_err();
        assert!(e.to_string().contains("checkpoint_every"), "{e}");
        let s = Scenario::parse(&no_node.replace("[random]", "[elastic]\ncheckpoint_every = 2\n[random]")).unwrap();
        assert!(s.faults.iter().any(|f| f.kind == FaultKind::CheckpointFail && f.when == Trigger::Step(3)));
    }
}
