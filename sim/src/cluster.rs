//! The scenario runner: one seed, one whole cluster, in one thread. It builds a single-thread
//! tokio runtime with paused (virtual) time, starts the real `ClusterSupervisor` over a
//! [`ControlNet`] listener and N real node agents and workers ([`rtx_supervisor::run_node`] in
//! [`Exec::Task`] mode: compute inline, DP engine and data shard without threads) over a
//! [`ClusterWire`], and acts as their node launcher: it starts nodes as tasks of a `LocalSet`,
//! kills them (abort the task, close its connections, crash its ranks) when the plan or the
//! supervisor says so, tells the supervisor about exits as a process launcher would, and restarts
//! them through the real join path.
//!
//! Every job event is checked as it arrives ([`Checker`]) and folded into the trace hash together
//! with the control and collectives traces, so the same seed must give the same hash.
//!
//! Invariants checked on every run:
//! - `stale-generation`: no collectives frame of another generation reaches a rank (each
//!   generation's network checks every frame header it delivers);
//! - `replicas-identical`: every rank of a committed step started it from the same parameter
//!   checksum, and the finished replicas are identical;
//! - `committed-monotone`: committed steps strictly increase, generations too;
//! - `samples-exactly-once`: each step's ranks trained exactly the global batch of that step
//!   (none skipped, none twice), including steps completed but not committed before a failure,
//!   and no step is trained again from a state that already holds it;
//! - `liveness`: the job finishes within `max_virtual` (it never fails while enough workers can
//!   come back, since every random fault heals or restarts);
//! - `exact-recovery`: when every committed step ran at full world, the final parameters equal a
//!   fault-free run's bit for bit;
//! - `checkpoint-intact`: a failed checkpoint write leaves the newest good checkpoint as it was
//!   (same bytes, still decodable) and training goes on; every stored checkpoint decodes and holds
//!   exactly the replicas' parameters of the committed step it names;
//! - `durable-progress` (no regression past durable state): every generation's `next_step` is at
//!   least `D + 1`, where `D` is the newest *durable* step when it forms: the larger of (a) the
//!   step of the newest good checkpoint — one the supervisor was told of (a `Checkpointed` event
//!   before the `Generation` event) and that the store still holds byte for byte — and (b) for
//!   each member of the new generation (a process: a restarted node is a new one), the newest step
//!   committed while that process was a member of the committing generation (a commit needs every
//!   member's report, and under replicated data parallelism a member's state never goes back, so
//!   that process holds at least that step; the simulator's jobs are replicated — under ZeRO-1 it
//!   would be the snapshot step each holder reports). A generation formed only of new processes
//!   with no checkpoint behind it may start anywhere at or after the checkpoint; one that starts at
//!   step 0 after steps were committed and a checkpoint exists also breaks (iii) below, named in
//!   the detail;
//! - `committed-monotone` also allows exactly the rollbacks `durable-progress` allows: a
//!   generation whose `next_step` is at or below the last committed step (its state came from a
//!   checkpoint or a surviving older replica, the newer states died) restarts the count there;
//!   any other step committed twice breaks it;
//! - `no-restart-from-scratch`: once a step was committed and a good checkpoint exists, no rank
//!   trains from the initial parameters (the ledger counts every step started from them).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use rtx_actors::LinkOptions;
use rtx_supervisor::{
    serve_request, ClassPolicy, ElasticConfig, Exec, JobEvent, NodeEnv, NodeLauncher, PlantedBug, SupervisorEnv, SupervisorHandle,
    SupervisorOptions, Wire, WorkerOptions,
};
use rtx_tensor::data::Sampler;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::checkpoints::SimCheckpoints;
use crate::control::{ControlConfig, ControlNet};
use crate::error::Result;
use crate::baton::Baton;
use crate::mesh_job::{MeshJobShape, MeshSimJob};
use crate::job::{build_model, global_samples, sampler_of, Dataset, EpochCache, Ledger, SimJob};
use crate::network::{LinkModel, SimConfig};
use crate::scenario::{Fault, FaultKind, Scenario, Trigger};
use crate::trace::TraceHash;
use crate::wire::{derive, ClusterWire};

/// Options of one run beyond the scenario.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunOptions {
    /// Test-only: a bug planted in the supervisor, to prove the invariants catch it.
    pub planted_bug: PlantedBug,
    /// Skip the explicit and random faults (the fault-free reference run).
    pub no_faults: bool,
    /// Test-only: the simulated checkpoint storage tears the newest good checkpoint when a write
    /// fails (a non-atomic store), to prove `checkpoint-intact` catches it.
    pub torn_checkpoints: bool,
}

/// What one run did.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// The seed.
    pub seed: u64,
    /// The trace hash: events, control and collectives traffic, committed steps, checksums.
    pub trace: u64,
    /// The first broken invariant, if any.
    pub violation: Option<Violation>,
    /// Steps committed (the last one + 1 when the job finished).
    pub committed: u64,
    /// The final parameter checksum (0 if the job did not finish).
    pub checksum: u64,
    /// Virtual time the run took.
    pub virtual_time: Duration,
    /// Generations formed.
    pub generations: u64,
    /// Faults fired.
    pub faults: usize,
    /// Invariant checks that passed.
    pub checks: u64,
    /// Whether the final parameters were compared with the fault-free run's (every step ran on
    /// all workers, so recovery had to be exact).
    pub exact_recovery_checked: bool,
    /// Job events seen.
    pub events: usize,
    /// Checkpoints written and checkpoint writes that failed.
    pub checkpoints: (u64, u64),
    /// Final evaluation (accuracy on held-out images).
    pub eval: Vec<(String, f64)>,
    /// The `(dp, pp, tp)` mesh of every generation, in order (`(world, 1, 1)` for data
    /// parallelism): where a mesh was re-partitioned and changed back.
    pub shapes: Vec<(usize, usize, usize)>,
}

/// A broken invariant: which one, what was seen, and the event where it broke.
#[derive(Clone, Debug, PartialEq)]
pub struct Violation {
    /// The invariant's name (see the module doc).
    pub invariant: &'static str,
    /// What was wrong.
    pub detail: String,
    /// Index of the job event where it was noticed.
    pub event_index: usize,
    /// Virtual time then.
    pub at: Duration,
    /// That event.
    pub event: String,
    /// The job events and faults before it (the last 48), each with its virtual time.
    pub recent: Vec<String>,
}

/// Job events and faults kept for a violation's report.
pub(crate) const RECENT: usize = 48;

/// Runs `scenario` with `seed` on a fresh single-thread runtime with virtual time; data from
/// `data_root`. `Err` only when the run could not be set up; broken invariants are in the outcome.
pub fn run_seed(scenario: &Scenario, seed: u64, data_root: &Path, options: &RunOptions) -> Result<Outcome> {
    let data = Dataset::load(data_root)?;
    let reference = if options.no_faults { None } else { Some(reference_checksum(scenario, data_root)?) };
    let mesh = match &scenario.mesh {
        Some(shape) => Some(MeshRun { shape: shape.clone(), data_root: data_root.to_path_buf(), folder: MeshFolder::claim(&scenario.name, seed, options.no_faults)? }),
        None => None,
    };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build()?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, simulate(scenario, seed, data, mesh, options, reference))
}

/// A mesh scenario's run: the job's shape, where its corpus is, and its checkpoint folder.
struct MeshRun {
    shape: MeshJobShape,
    data_root: std::path::PathBuf,
    folder: MeshFolder,
}

/// The sharded-checkpoint folder of one mesh run. Its path is a function of the scenario, the seed
/// and the mode only (it travels in control messages, which the trace hashes, so a replay must
/// see the same bytes); one run of this process holds it at a time (a swarm that runs a seed
/// twice waits), and it is emptied before and after the run. Two processes running the same
/// scenario and seed at once would share it: not supported.
struct MeshFolder {
    path: std::path::PathBuf,
}

fn claimed_folders() -> &'static (Mutex<std::collections::BTreeSet<std::path::PathBuf>>, std::sync::Condvar) {
    static CLAIMED: OnceLock<(Mutex<std::collections::BTreeSet<std::path::PathBuf>>, std::sync::Condvar)> = OnceLock::new();
    CLAIMED.get_or_init(Default::default)
}

impl MeshFolder {
    fn claim(scenario: &str, seed: u64, reference: bool) -> Result<MeshFolder> {
        let name: String = scenario.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
        let path = std::env::temp_dir().join("rtx-sim-mesh").join(format!("{name}-seed{seed}{}", if reference { "-reference" } else { "" }));
        let (lock, freed) = claimed_folders();
        let mut claimed = lock.lock().unwrap_or_else(PoisonError::into_inner);
        while claimed.contains(&path) {
            claimed = freed.wait(claimed).unwrap_or_else(PoisonError::into_inner);
        }
        claimed.insert(path.clone());
        drop(claimed);
        let folder = MeshFolder { path };
        let _ = std::fs::remove_dir_all(&folder.path);
        std::fs::create_dir_all(&folder.path).map_err(|e| crate::SimError::Scenario(format!("cannot create the mesh checkpoint folder {}: {e}", folder.path.display())))?;
        Ok(folder)
    }
}

impl Drop for MeshFolder {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
        let (lock, freed) = claimed_folders();
        lock.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.path);
        freed.notify_all();
    }
}

/// The final checksum of the fault-free run of `scenario` (computed once per process).
fn reference_checksum(scenario: &Scenario, data_root: &Path) -> Result<u64> {
    static CACHE: OnceLock<Mutex<Vec<(Scenario, u64)>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(Vec::new()));
    if let Some((_, sum)) = cache.lock().unwrap_or_else(PoisonError::into_inner).iter().find(|(s, _)| s == scenario) {
        return Ok(*sum);
    }
    let outcome = run_seed(scenario, 0, data_root, &RunOptions { no_faults: true, ..RunOptions::default() })?;
    if let Some(v) = &outcome.violation {
        return Err(crate::SimError::Scenario(format!("the fault-free reference run broke {}: {}", v.invariant, v.detail)));
    }
    cache.lock().unwrap_or_else(PoisonError::into_inner).push((scenario.clone(), outcome.checksum));
    Ok(outcome.checksum)
}

struct Slot {
    pid: u32,
    task: Option<JoinHandle<()>>,
}

struct Cluster {
    scenario: Scenario,
    control: ControlNet,
    wire: ClusterWire,
    data: Arc<Dataset>,
    /// A mesh scenario's job and checkpoint folder.
    mesh: Option<MeshRun>,
    ledger: Arc<Ledger>,
    checkpoints: Arc<SimCheckpoints>,
    addr: std::net::SocketAddr,
    /// The cluster token (`sim-<seed>`), proven by every joining node.
    token: String,
    slots: Vec<Slot>,
    next_pid: u32,
    exits: mpsc::UnboundedSender<(usize, u32, String)>,
    /// Pids whose exit the supervisor was told of.
    reported: std::collections::BTreeSet<u32>,
    /// Restarts and heals due, by virtual time.
    timers: BTreeMap<(Duration, u64), Action>,
    next_timer: u64,
    start: Instant,
}

#[derive(Clone, Debug)]
enum Action {
    Restart(usize),
    Resume(usize),
    Heal(usize, usize),
    Unstall(usize),
    /// A fault due now (one triggered by a loss, `after` it).
    Apply(Fault),
}

async fn simulate(scenario: &Scenario, seed: u64, data: Arc<Dataset>, mesh: Option<MeshRun>, options: &RunOptions, reference: Option<u64>) -> Result<Outcome> {
    let start = Instant::now();
    let net = &scenario.net;
    let (control, listener) =
        ControlNet::new(ControlConfig { seed: derive(seed, 1), latency: net.control_latency, jitter: net.control_jitter, idle_timeout: net.idle_timeout });
    let link = LinkModel {
        latency: net.latency,
        jitter: net.jitter,
        bandwidth_bytes_per_s: net.bandwidth_bytes_per_s,
        loss: net.loss,
        retransmit_after: Duration::from_millis(1),
        duplicate: net.duplicate,
        reorder: net.reorder,
        reorder_delay: Duration::from_micros(200),
    };
    let wire = ClusterWire::new(derive(seed, 2), SimConfig { seed: 0, link, loss_detect: net.loss_detect, wire: net.wire });
    let e = &scenario.elastic;
    let policy = ClassPolicy { on_failure: e.on_failure, budget: e.failure_budget };
    let elastic = ElasticConfig {
        min_workers: scenario.min_workers,
        max_workers: scenario.workers,
        start_workers: scenario.workers,
        heartbeat_interval: e.heartbeat_interval,
        heartbeat_timeout: e.heartbeat_timeout,
        rendezvous_timeout: e.rendezvous_timeout,
        prepare_timeout: e.prepare_timeout,
        // The simulated members' final reports are immediate; the scenarios' traces were recorded
        // with the finishing wait bounded by the prepare timeout, and keep it.
        finish_timeout: e.prepare_timeout,
        verify_every: 1,
        checkpoint_every: e.checkpoint_every,
        transport: Wire::Injected,
        planted_bug: options.planted_bug,
        crash: policy,
        hang: policy,
        network_loss: policy,
        preemption: policy,
        pp: mesh.as_ref().map_or(1, |m| m.shape.pp),
        tp: mesh.as_ref().map_or(1, |m| m.shape.tp),
        mesh_model: mesh.as_ref().map(|m| m.shape.model()),
        ..ElasticConfig::default()
    };
    let link_options = LinkOptions { idle_timeout: net.idle_timeout, keep_alive: net.idle_timeout / 4, connect_timeout: Duration::from_secs(10) };
    let supervisor_options = SupervisorOptions {
        listen: std::net::SocketAddr::from(([10, 255, 0, 1], 29500)),
        token: format!("sim-{seed}"),
        job: scenario.name.clone(),
        total_steps: scenario.job.total_steps,
        stop_at: None,
        elastic,
        resume: None,
        resume_next_step: 0, run_dir: None,
        link: link_options,
    };
    let (launch_tx, mut launch_rx) = mpsc::channel(64);
    let mut supervisor = SupervisorHandle::start_with(supervisor_options, Some(launch_tx), SupervisorEnv { listener, seed: derive(seed, 3) }).await?;
    let addr = supervisor.addr;
    let (exits, mut exit_rx) = mpsc::unbounded_channel();
    let ledger = Arc::new(Ledger::default());
    let checkpoints = Arc::new(SimCheckpoints::default());
    if options.torn_checkpoints {
        checkpoints.plant_torn_writes();
    }
    let mut cluster = Cluster {
        scenario: scenario.clone(),
        control,
        wire,
        data,
        mesh,
        ledger: Arc::clone(&ledger),
        checkpoints: Arc::clone(&checkpoints),
        addr,
        token: format!("sim-{seed}"),
        slots: Vec::new(),
        next_pid: 1000,
        exits,
        reported: std::collections::BTreeSet::new(),
        timers: BTreeMap::new(),
        next_timer: 0,
        start,
    };
    for slot in 0..scenario.workers + scenario.spares {
        cluster.slots.push(Slot { pid: 0, task: None });
        if slot < scenario.workers {
            let _ = cluster.start_node(slot);
        }
    }
    let plan = if options.no_faults { Vec::new() } else { scenario.plan(seed) };
    let mut timed: Vec<Fault> = plan.iter().filter(|f| matches!(f.when, Trigger::At(_))).cloned().collect();
    timed.reverse();
    let mut by_step: Vec<Fault> = plan.iter().filter(|f| matches!(f.when, Trigger::Step(_))).cloned().collect();
    let mut by_loss: Vec<Fault> = plan.iter().filter(|f| matches!(f.when, Trigger::Loss { .. })).cloned().collect();
    let mut losses = 0u64;
    // A mesh job's batches are windows of text, not sampled images: no sampler to check against.
    let sampler = if scenario.mesh.is_some() { None } else { Some(sampler_of(&scenario.job)?) };
    let mut checker = Checker::new(scenario, sampler, ledger, Arc::clone(&checkpoints), reference)?;
    let mut fired = 0usize;
    let deadline = start + scenario.max_virtual;
    let mut eval = Vec::new();

    loop {
        let next_fault = timed.last().map(|f| match f.when {
            Trigger::At(t) => start + t,
            Trigger::Step(_) | Trigger::Loss { .. } => deadline,
        });
        let next_timer = cluster.timers.keys().next().map(|(t, _)| start + *t);
        let wake = [next_fault, next_timer].into_iter().flatten().min().unwrap_or(deadline).min(deadline);
        tokio::select! {
            biased;
            event = supervisor.events.recv() => {
                let Some(event) = event else {
                    checker.violate("liveness", "the supervisor stopped without finishing or failing".into(), "end of events".into(), start.elapsed());
                    break;
                };
                let t = start.elapsed();
                tracing::info!(virtual_time = ?t, ?event, "job event");
                let ended = matches!(event, JobEvent::Finished { .. } | JobEvent::Failed { .. });
                if let JobEvent::Finished { eval: e, .. } = &event {
                    eval = e.clone();
                }
                let committed = if let JobEvent::Committed { step, .. } = &event { Some(*step) } else { None };
                let lost = matches!(event, JobEvent::Lost { .. });
                checker.check(&event, t);
                if let Some(step) = committed {
                    let due: Vec<Fault> = by_step.iter().filter(|f| f.when <= Trigger::Step(step)).cloned().collect();
                    by_step.retain(|f| f.when > Trigger::Step(step));
                    for fault in due {
                        fired += 1;
                        checker.note(format!("fault {:?} on slot {}", fault.kind, fault.node), t);
                        cluster.apply(&fault);
                    }
                }
                if lost {
                    losses += 1;
                    for fault in by_loss.iter().filter(|f| matches!(f.when, Trigger::Loss { nth, .. } if nth == losses)) {
                        let Trigger::Loss { after, .. } = fault.when else { continue };
                        cluster.after(after, Action::Apply(fault.clone()));
                    }
                    by_loss.retain(|f| !matches!(f.when, Trigger::Loss { nth, .. } if nth <= losses));
                }
                if ended || checker.violation.is_some() {
                    break;
                }
            }
            request = launch_rx.recv() => {
                if let Some(request) = request {
                    serve_request(&mut cluster, request);
                }
            }
            exit = exit_rx.recv() => {
                if let Some((slot, pid, status)) = exit {
                    if cluster.reported.insert(pid) {
                        if cluster.slots[slot].pid == pid {
                            cluster.slots[slot].task = None;
                        }
                        tracing::info!(slot, pid, %status, "simulated node ended");
                        checker.note(format!("slot {slot} (pid {pid}) ended: {status}"), start.elapsed());
                        cluster.trace_note(&mut checker.trace, b"exit", slot as u64);
                        supervisor.process_exited(pid, status).await;
                    }
                }
            }
            () = tokio::time::sleep_until(wake) => {
                if Instant::now() >= deadline {
                    checker.violate("liveness", format!("not finished after {:?} of virtual time (last committed step {:?}, {} workers configured, min {})", scenario.max_virtual, checker.last_committed, scenario.workers, scenario.min_workers), "deadline".into(), start.elapsed());
                    break;
                }
                let now = start.elapsed();
                while let Some(fault) = timed.last().filter(|f| matches!(f.when, Trigger::At(t) if t <= now)).cloned() {
                    timed.pop();
                    fired += 1;
                    checker.note(format!("fault {:?} on slot {}", fault.kind, fault.node), now);
                    cluster.apply(&fault);
                }
                while let Some((&key, _)) = cluster.timers.iter().next().filter(|((t, _), _)| *t <= now) {
                    if let Some(action) = cluster.timers.remove(&key) {
                        if let Action::Apply(fault) = action {
                            fired += 1;
                            checker.note(format!("fault {:?} (after loss) on slot {}", fault.kind, fault.node), now);
                            cluster.apply(&fault);
                        } else {
                            cluster.timed(action);
                        }
                    }
                }
            }
        }
    }
    checker.check_stored_checkpoints(start.elapsed());
    checker.check_no_scratch("end".into(), start.elapsed());
    let foreign = cluster.wire.foreign_generation_frames();
    checker.checks += 1;
    if foreign > 0 {
        checker.violate("stale-generation", format!("{foreign} collectives frame(s) of another generation reached a rank"), "end".into(), start.elapsed());
    }
    for slot in &mut cluster.slots {
        if let Some(task) = slot.task.take() {
            task.abort();
        }
    }
    let virtual_time = start.elapsed();
    let mut trace = checker.trace;
    trace.absorb_u64(cluster.control.trace().value());
    trace.absorb_u64(cluster.wire.trace().value());
    drop(supervisor);
    Ok(Outcome {
        seed,
        trace: trace.value(),
        violation: checker.violation,
        committed: checker.last_committed.map_or(0, |s| s + 1),
        checksum: checker.final_checksum,
        virtual_time,
        generations: checker.last_generation,
        faults: fired,
        checks: checker.checks,
        exact_recovery_checked: checker.exact_checked,
        events: checker.events,
        checkpoints: checkpoints.counts(),
        eval,
        shapes: checker.shapes,
    })
}

impl Cluster {
    fn start_node(&mut self, slot: usize) -> u32 {
        self.next_pid += 1;
        let pid = self.next_pid;
        let env = NodeEnv {
            control: Some(self.control.dialer(slot)),
            wire: Some(self.wire.slot(slot)),
            exec: Exec::Task,
            pid,
            host: Some(format!("sim-host-{slot}")),
            watch_sigterm: false,
            checkpoints: Some(Arc::clone(&self.checkpoints) as Arc<dyn rtx_supervisor::checkpoint::CheckpointStore>),
            compute: Some(Arc::new(Baton::new(tokio::runtime::Handle::current()))),
        };
        let options = WorkerOptions::new(self.addr, self.token.clone(), format!("slot-{slot}"));
        let (shape, data, ledger) = (self.scenario.job.clone(), Arc::clone(&self.data), Arc::clone(&self.ledger));
        let mesh = self.mesh.as_ref().map(|m| (m.shape.clone(), m.data_root.clone(), m.folder.path.clone()));
        let exits = self.exits.clone();
        let startup = if self.start.elapsed().is_zero() { Duration::ZERO } else { self.scenario.startup };
        let task = tokio::task::spawn_local(async move {
            if !startup.is_zero() {
                tokio::time::sleep(startup).await;
            }
            let result = match mesh {
                Some((mesh, root, folder)) => rtx_supervisor::run_node(options, env, move |_| MeshSimJob::new(mesh, &shape, &root, folder).map_err(|e| e.to_string())).await,
                None => rtx_supervisor::run_node(options, env, move |spec| SimJob::new(spec.node, shape, data, ledger).map_err(|e| e.to_string())).await,
            };
            let status = match result {
                Ok(outcome) => format!("exited: {outcome:?}"),
                Err(e) => format!("exited with error: {e}"),
            };
            let _ = exits.send((slot, pid, status));
        });
        self.slots[slot] = Slot { pid, task: Some(task) };
        pid
    }

    /// Kills the node in `slot` as a process dies: every task it owns is aborted, its control
    /// connections close, its ranks crash; the exit reaches the supervisor like any exit.
    fn kill(&mut self, slot: usize, why: &str) {
        let Some(task) = self.slots[slot].task.take() else { return };
        task.abort();
        self.control.kill(slot);
        self.wire.crash(slot);
        let _ = self.exits.send((slot, self.slots[slot].pid, why.to_string()));
    }

    fn after(&mut self, delay: Duration, action: Action) {
        let at = self.start.elapsed() + delay;
        self.next_timer += 1;
        self.timers.insert((at, self.next_timer), action);
    }

    fn apply(&mut self, fault: &Fault) {
        tracing::info!(virtual_time = ?self.start.elapsed(), ?fault, "fault");
        let slot = fault.node;
        match &fault.kind {
            FaultKind::Crash { restart_after } => {
                self.kill(slot, "crashed by the fault plan");
                if let Some(delay) = restart_after {
                    self.after(*delay, Action::Restart(slot));
                }
            }
            FaultKind::Pause { duration } => {
                self.control.isolate(slot);
                for peer in 0..self.slots.len() {
                    if peer != slot {
                        self.wire.cut(slot, peer, true);
                    }
                }
                self.after(*duration, Action::Resume(slot));
            }
            FaultKind::Slow { delay } => {
                self.control.slow(slot, *delay);
                self.wire.slow(slot, *delay);
            }
            FaultKind::Partition { peer, duration, one_way } => {
                self.wire.cut(slot, *peer, !*one_way);
                self.after(*duration, Action::Heal(slot, *peer));
            }
            FaultKind::CheckpointFail => self.checkpoints.arm_failure(),
            FaultKind::Stuck { duration } => {
                // Stuck in whatever collective it is in; released when the fault ends (or at
                // once, by the worker aborting its transport).
                self.wire.stall(slot);
                self.after(*duration, Action::Unstall(slot));
            }
            FaultKind::Join => {
                let free = |s: &Slot| s.task.is_none();
                let target = if self.slots.get(slot).is_some_and(free) { Some(slot) } else { self.slots.iter().position(free) };
                match target {
                    Some(target) => {
                        let _ = self.start_node(target);
                    }
                    None => tracing::info!("join: every slot runs"),
                }
            }
        }
    }

    fn timed(&mut self, action: Action) {
        tracing::info!(virtual_time = ?self.start.elapsed(), ?action, "timer");
        match action {
            Action::Restart(slot) => {
                if self.slots[slot].task.is_none() {
                    let _ = self.start_node(slot);
                }
            }
            Action::Resume(slot) => {
                self.control.reconnect(slot);
                for peer in 0..self.slots.len() {
                    if peer != slot {
                        self.wire.heal(slot, peer);
                    }
                }
                // A hung node the supervisor killed meanwhile is restarted by its orchestrator.
                if self.slots[slot].task.is_none() {
                    let _ = self.start_node(slot);
                }
            }
            Action::Heal(a, b) => self.wire.heal(a, b),
            Action::Unstall(slot) => self.wire.unstall(slot),
            Action::Apply(fault) => self.apply(&fault),
        }
    }

    fn trace_note(&self, trace: &mut TraceHash, what: &[u8], v: u64) {
        trace.absorb(what);
        trace.absorb_u64(v);
        trace.absorb_u64(self.start.elapsed().as_nanos() as u64);
    }
}

/// The simulator is the job's node launcher: a replacement starts in the lowest free slot, a kill
/// is a crash.
impl NodeLauncher for Cluster {
    fn spawn_node(&mut self) -> rtx_supervisor::Result<u32> {
        let slot = self
            .slots
            .iter()
            .position(|s| s.task.is_none())
            .ok_or_else(|| rtx_supervisor::SupervisorError::Launch(format!("all {} simulated node slots are running", self.slots.len())))?;
        Ok(self.start_node(slot))
    }

    fn kill_node(&mut self, pid: u32) {
        if let Some(slot) = self.slots.iter().position(|s| s.pid == pid && s.task.is_some()) {
            self.kill(slot, "killed by the launcher (SIGKILL)");
        }
    }
}

/// The invariant checker of one run; see the module doc.
struct Checker {
    workers: usize,
    total_steps: u64,
    global_batch: usize,
    sampler: Option<Sampler>,
    epochs: EpochCache,
    ledger: Arc<Ledger>,
    checkpoints: Arc<SimCheckpoints>,
    job: crate::job::JobShape,
    /// The replicas' parameter checksum after each committed step.
    committed_sums: BTreeMap<u64, u64>,
    /// The newest checkpoint the supervisor heard of: its step and bytes.
    last_good: Option<(u64, Vec<u8>)>,
    reference: Option<u64>,
    trace: TraceHash,
    violation: Option<Violation>,
    last_committed: Option<u64>,
    /// `(next_step, world)` of every generation started, in order.
    generations: Vec<(u64, usize)>,
    last_generation: u64,
    full_world_throughout: bool,
    exact_checked: bool,
    /// Nodes the supervisor lost (their state died with them).
    lost: std::collections::BTreeSet<u64>,
    final_checksum: u64,
    checks: u64,
    events: usize,
    /// The processes (pids) of every generation formed.
    generation_pids: BTreeMap<u64, Vec<u32>>,
    /// Per live process: the newest step committed while it was a member of the committing
    /// generation (the state it holds at least).
    held: BTreeMap<u32, u64>,
    /// Trainings from the initial parameters the ledger counted when a step had been committed
    /// and a good checkpoint existed for the first time.
    scratch_baseline: Option<u64>,
    /// Generations that legitimately rolled back to durable state.
    rollbacks: u64,
    /// The last job events and faults, for a violation's report.
    recent: std::collections::VecDeque<String>,
    /// A mesh job: no ledger (the engine, not the job, runs forward), sharded checkpoints in files.
    mesh: bool,
    /// A mesh job's newest sharded checkpoint the supervisor heard of (and the checker opened).
    mesh_checkpoint: Option<u64>,
    /// The mesh shape of every generation.
    shapes: Vec<(usize, usize, usize)>,
}

impl Checker {
    fn new(scenario: &Scenario, sampler: Option<Sampler>, ledger: Arc<Ledger>, checkpoints: Arc<SimCheckpoints>, reference: Option<u64>) -> Result<Checker> {
        if scenario.mesh.is_none() {
            let initial = build_model(&scenario.job).map_err(crate::SimError::Scenario)?;
            ledger.set_initial(rtx_supervisor::parameter_checksum(&initial).map_err(|e| crate::SimError::Scenario(e.to_string()))?);
        }
        Ok(Checker {
            workers: scenario.workers,
            total_steps: scenario.job.total_steps,
            global_batch: scenario.job.global_batch,
            sampler,
            epochs: EpochCache::default(),
            ledger,
            checkpoints,
            job: scenario.job.clone(),
            committed_sums: BTreeMap::new(),
            last_good: None,
            reference,
            trace: TraceHash::default(),
            violation: None,
            last_committed: None,
            generations: Vec::new(),
            last_generation: 0,
            full_world_throughout: true,
            exact_checked: false,
            lost: std::collections::BTreeSet::new(),
            final_checksum: 0,
            checks: 0,
            events: 0,
            generation_pids: BTreeMap::new(),
            held: BTreeMap::new(),
            scratch_baseline: None,
            rollbacks: 0,
            recent: std::collections::VecDeque::new(),
            mesh: scenario.mesh.is_some(),
            mesh_checkpoint: None,
            shapes: Vec::new(),
        })
    }

    fn violate(&mut self, invariant: &'static str, detail: String, event: String, at: Duration) {
        if self.violation.is_none() {
            let recent = self.recent.iter().cloned().collect();
            self.violation = Some(Violation { invariant, detail, event_index: self.events, at, event, recent });
        }
    }

    /// Keeps a line (a job event, a fault, an exit) for a violation's report.
    fn note(&mut self, line: String, at: Duration) {
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(format!("t={:.3}s {line}", at.as_secs_f64()));
    }

    /// The newest good checkpoint's step: one the supervisor was told of and the store still
    /// holds byte for byte.
    fn good_checkpoint(&self) -> Option<u64> {
        if self.mesh {
            return self.mesh_checkpoint;
        }
        let (step, bytes) = self.last_good.as_ref()?;
        (self.checkpoints.get(*step).as_ref() == Some(bytes)).then_some(*step)
    }

    /// `durable-progress` and the rollbacks `committed-monotone` allows, for a generation of
    /// processes `pids` starting at `next_step`.
    fn check_generation(&mut self, generation: u64, next_step: u64, pids: &[u32]) -> std::result::Result<(), String> {
        self.checks += 1;
        let checkpoint = self.good_checkpoint();
        // In a mesh a member holds one slot, not the model: a slot without a surviving holder
        // falls back to the checkpoint, so only the checkpoint bounds a mesh generation.
        let holder = if self.mesh { None } else { pids.iter().filter_map(|p| self.held.get(p).map(|s| (*s, *p))).max() };
        let need = checkpoint.map(|c| c + 1).max(holder.map(|(s, _)| s + 1)).unwrap_or(0);
        if next_step < need {
            let mut why = Vec::new();
            if let Some(c) = checkpoint.filter(|c| next_step < c + 1) {
                why.push(format!("the newest good checkpoint holds step {c}"));
            }
            if let Some((s, pid)) = holder.filter(|(s, _)| next_step < s + 1) {
                why.push(format!("member pid {pid} was in the group when step {s} was committed and has not died since"));
            }
            let scratch = if next_step == 0 && self.last_committed.is_some() && checkpoint.is_some() {
                format!("; it would train from the initial parameters after {} committed step(s) (no-restart-from-scratch)", self.last_committed.map_or(0, |s| s + 1))
            } else {
                String::new()
            };
            return Err(format!("generation {generation} starts at step {next_step}, below the durable step {} + 1: {}{scratch}", need - 1, why.join("; ")));
        }
        if let Some(last) = self.last_committed.filter(|last| next_step <= *last) {
            // A legitimate rollback: the newer states died with their holders; the count
            // restarts at the durable state.
            self.rollbacks += 1;
            tracing::info!(generation, next_step, last, "rollback to durable state");
            self.last_committed = next_step.checked_sub(1);
            self.trace.absorb(b"rollback");
            self.trace.absorb_u64(next_step);
        }
        Ok(())
    }

    /// `no-restart-from-scratch`: no training from the initial parameters once a step was
    /// committed and a good checkpoint exists.
    fn check_no_scratch(&mut self, event: String, at: Duration) {
        if self.mesh {
            return;
        }
        let from_initial = self.ledger.from_initial();
        match self.scratch_baseline {
            None => {
                if self.last_committed.is_some() && self.good_checkpoint().is_some() {
                    self.scratch_baseline = Some(from_initial);
                }
            }
            Some(base) => {
                self.checks += 1;
                if from_initial > base {
                    let (step, node) = self.ledger.last_from_initial().unwrap_or_default();
                    self.violate("no-restart-from-scratch", format!("node {node} trained step {step} from the initial parameters after steps were committed and a checkpoint was written"), event, at);
                }
            }
        }
    }

    fn check(&mut self, event: &JobEvent, at: Duration) {
        self.events += 1;
        let text = format!("{event:?}");
        self.trace.absorb_u64(at.as_nanos() as u64);
        self.trace.absorb(text.as_bytes());
        self.note(text.clone(), at);
        self.check_no_scratch(text.clone(), at);
        let fail = |this: &mut Checker, invariant: &'static str, detail: String| this.violate(invariant, detail, text.clone(), at);
        match event {
            JobEvent::Generation { generation, world, next_step, pids, mesh, .. } => {
                self.checks += 1;
                self.shapes.push(*mesh);
                if *generation <= self.last_generation {
                    fail(self, "committed-monotone", format!("generation {generation} after {}", self.last_generation));
                }
                self.last_generation = *generation;
                self.generations.push((*next_step, *world));
                self.generation_pids.insert(*generation, pids.clone());
                if let Err(detail) = self.check_generation(*generation, *next_step, pids) {
                    fail(self, "durable-progress", detail);
                }
            }
            JobEvent::Committed { step, samples, world, checksum, generation, .. } => {
                if let Some(sum) = checksum {
                    self.committed_sums.insert(*step, *sum);
                }
                for pid in self.generation_pids.get(generation).cloned().unwrap_or_default() {
                    let held = self.held.entry(pid).or_insert(*step);
                    *held = (*held).max(*step);
                }
                self.checks += 1;
                if let Some((again, first, later)) = self.ledger.retrained(&self.lost).filter(|_| !self.mesh) {
                    fail(self, "samples-exactly-once", format!("step {again} was trained again from another state (parameter checksum {later:016x}, first {first:016x}): its samples are counted twice"));
                    return;
                }
                self.checks += 1;
                if let Some(last) = self.last_committed {
                    if *step <= last {
                        fail(self, "committed-monotone", format!("step {step} committed after step {last}: its samples are counted twice"));
                        return;
                    }
                }
                self.checks += 1;
                if *samples != self.global_batch as u64 {
                    fail(self, "samples-exactly-once", format!("step {step} counted {samples} samples, the global batch is {}", self.global_batch));
                    return;
                }
                // Steps completed but not committed before a failure (a member died before
                // reporting) were trained by the last earlier generation that started at or
                // before them; the committed one by this event's.
                let first = self.last_committed.map_or(0, |s| s + 1);
                let earlier = self.generations[..self.generations.len().saturating_sub(1)].to_vec();
                for s in first..=*step {
                    let w = if s == *step { *world } else { earlier.iter().rev().find(|(next, _)| *next <= s).map_or(self.workers, |(_, w)| *w) };
                    if w != self.workers {
                        self.full_world_throughout = false;
                    }
                    if self.mesh {
                        continue;
                    }
                    if let Err(detail) = self.check_step(s, w) {
                        fail(self, if detail.starts_with("replica") { "replicas-identical" } else { "samples-exactly-once" }, detail);
                        return;
                    }
                }
                self.last_committed = Some(*step);
                self.trace.absorb(b"committed");
                self.trace.absorb_u64(*step);
            }
            JobEvent::Finished { replicas_identical, checksum, .. } => {
                self.checks += 1;
                if let Some((again, first, later)) = self.ledger.retrained(&self.lost).filter(|_| !self.mesh) {
                    fail(self, "samples-exactly-once", format!("step {again} was trained again from another state (parameter checksum {later:016x}, first {first:016x}): its samples are counted twice"));
                    return;
                }
                // Steps completed but never committed (their reports were lost with a member):
                // trained by the last generation that started at or before them.
                let first = self.last_committed.map_or(0, |s| s + 1);
                let generations = self.generations.clone();
                for s in first..self.total_steps {
                    let w = generations.iter().rev().find(|(next, _)| *next <= s).map_or(self.workers, |(_, w)| *w);
                    if w != self.workers {
                        self.full_world_throughout = false;
                    }
                    if self.mesh {
                        continue;
                    }
                    if let Err(detail) = self.check_step(s, w) {
                        fail(self, if detail.starts_with("replica") { "replicas-identical" } else { "samples-exactly-once" }, detail);
                        return;
                    }
                }
                self.final_checksum = *checksum;
                self.trace.absorb_u64(*checksum);
                if !replicas_identical {
                    fail(self, "replicas-identical", "the finished replicas' checksums differ".into());
                    return;
                }
                if let (Some(reference), true) = (self.reference, self.full_world_throughout) {
                    self.checks += 1;
                    self.exact_checked = true;
                    if *checksum != reference {
                        fail(
                            self,
                            "exact-recovery",
                            format!(
                                "every step ran on all {} workers, yet the final checksum {checksum:016x} differs from the fault-free run's {reference:016x}",
                                self.workers
                            ),
                        );
                    }
                }
            }
            JobEvent::Failed { reason } => {
                // The supervisor fails the job when two holders of one state differ at a verified step.
                let invariant = if reason.contains("replicas diverged") { "replicas-identical" } else { "liveness" };
                fail(self, invariant, format!("the job failed: {reason}"));
            }
            JobEvent::Lost { node, pid, .. } => {
                self.lost.insert(*node);
                // Its state is gone (killed, or evicted and killed).
                self.held.remove(pid);
            }
            JobEvent::Checkpointed { step, path } if self.mesh => {
                // A sharded checkpoint: complete (its index written last) and of the step named.
                self.checks += 1;
                match rtx_tensor::checkpoint::sharded::ShardedCheckpoint::open(Path::new(path)) {
                    Ok(ckpt) if ckpt.step() == *step => self.mesh_checkpoint = self.mesh_checkpoint.max(Some(*step)),
                    Ok(ckpt) => fail(self, "checkpoint-intact", format!("the sharded checkpoint reported for step {step} at {path} is of step {}", ckpt.step())),
                    Err(e) => fail(self, "checkpoint-intact", format!("the sharded checkpoint reported for step {step} at {path} does not open: {e}")),
                }
            }
            JobEvent::Checkpointed { step, .. } => {
                // Reports can arrive late (a node's held control bytes): a checkpoint the store
                // no longer holds must have been superseded by newer ones.
                self.checks += 1;
                match (self.checkpoints.get(*step), self.checkpoints.newest()) {
                    (Some(bytes), _) => {
                        if self.last_good.as_ref().is_none_or(|(good, _)| good <= step) {
                            self.last_good = Some((*step, bytes));
                        }
                    }
                    (None, Some((newest, _))) if newest > *step => {}
                    (None, newest) => fail(self, "checkpoint-intact", format!("the supervisor heard of the checkpoint of step {step}, the store does not hold it (newest {:?})", newest.map(|(s, _)| s))),
                }
            }
            JobEvent::CheckpointFailed { step, .. } => {
                // The last good checkpoint the supervisor heard of is still there, byte for byte,
                // and decodes (unless newer checkpoints have replaced it since).
                self.checks += 1;
                if let Some((good, before)) = self.last_good.clone() {
                    let intact = match self.checkpoints.get(good) {
                        Some(now) if now == before => SimCheckpoints::read(&self.job, good, &now).map(|_| ()).map_err(|e| format!("the last good checkpoint (step {good}) no longer decodes: {e}")),
                        _ if self.checkpoints.newer_than(good) > 0 => Ok(()),
                        Some(_) => Err(format!("the last good checkpoint (step {good}) changed")),
                        None => Err(format!("the last good checkpoint (step {good}) is gone")),
                    };
                    if let Err(detail) = intact {
                        fail(self, "checkpoint-intact", format!("after the failed write of step {step}: {detail}"));
                    }
                }
            }
            JobEvent::Joined { .. } | JobEvent::Refused { .. } | JobEvent::Suspect { .. } => {}
        }
    }

    /// Every stored checkpoint decodes and holds the replicas' parameters after the step it
    /// names: the checksum of its commit, or (a step completed but never committed, its reports
    /// lost with a member) the state the next step started from, or the final parameters.
    fn check_stored_checkpoints(&mut self, at: Duration) {
        if self.violation.is_some() || self.final_checksum == 0 {
            return;
        }
        for (step, bytes) in self.checkpoints.all() {
            self.checks += 1;
            let after = self.committed_sums.get(&step).copied().or_else(|| {
                if step + 1 == self.total_steps {
                    return Some(self.final_checksum);
                }
                match self.ledger.start_states(step + 1, &self.lost)[..] {
                    [sum] => Some(sum),
                    _ => None,
                }
            });
            let detail = match (SimCheckpoints::read(&self.job, step, &bytes), after.as_ref()) {
                (Err(e), _) => format!("stored checkpoint of step {step} is unreadable: {e}"),
                (Ok(sum), Some(&want)) if sum == want => continue,
                (Ok(sum), Some(&want)) => format!("stored checkpoint of step {step} holds parameters {sum:016x}, the replicas had {want:016x} after that step"),
                (Ok(_), None) => format!("a checkpoint of step {step} is stored, but the replicas' state after that step is unknown"),
            };
            self.violate("checkpoint-intact", detail, "end".into(), at);
            return;
        }
    }

    /// Step `step` trained by `world` ranks: together exactly the global batch, from one state.
    fn check_step(&mut self, step: u64, world: usize) -> std::result::Result<(), String> {
        self.checks += 2;
        let Some(sampler) = &self.sampler else { return Ok(()) };
        let want = global_samples(sampler, &self.epochs, self.global_batch, step);
        let mut got = Vec::new();
        let mut start_sums = Vec::new();
        for rank in 0..world {
            let trained = self.ledger.get(step, world, rank).ok_or_else(|| format!("step {step}: rank {rank} of {world} never trained it"))?;
            got.extend(trained.samples);
            start_sums.push(trained.start_checksum);
        }
        if got != want {
            return Err(format!("step {step}: the ranks trained samples {got:?}, the global batch is {want:?}"));
        }
        if start_sums.windows(2).any(|w| w[0] != w[1]) {
            return Err(format!("replicas differ at the start of step {step}: parameter checksums {start_sums:x?}"));
        }
        Ok(())
    }
}
