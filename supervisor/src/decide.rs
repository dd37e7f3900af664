//! The supervisor's decisions as a pure core: [`SupervisorCore::handle`] takes the state, one
//! [`Input`] and the time it happened, and leaves the [`Command`]s the decision asks for in its
//! outbox ([`SupervisorCore::take_commands`]); it does no I/O, never awaits, never reads a clock and
//! draws no randomness. Membership, generation forming (placement, re-partition), recovery sources,
//! commits, failure classes and budgets, timeouts and the finish check all live here. The async
//! shell ([`crate::supervisor`]) owns the links, the certificate authority, the event channel and
//! the launcher: it turns link traffic into inputs and carries the commands out, in order. The
//! simulator drives the shell (so the same core) on virtual time, and unit tests drive the core
//! directly (`decide/tests.rs`).
//!
//! Phases: `Waiting` (too few workers; after `rendezvous_timeout` the job fails) → `Preparing`
//! (each member got `Prepare` for the new generation and answers `Ready`) → `Running` (steps are
//! committed when every member reported them) → `Finishing` → `Done`. The module doc of
//! [`crate::supervisor`] describes failure classes, recovery points and the suspect verdict.

use std::collections::BTreeMap;

use tokio::time::Instant;

use crate::config::{DpSharding, FailureClass, OnFailure, PlantedBug};
use crate::error::{Result, SupervisorError};
use crate::placement;
use crate::plan;
use crate::protocol::{MemberStatus, MeshHeld, MeshStart, ShardSource, StateSource, StatusReport, ToSupervisor, ToWorker, Zero1Held};
use crate::recovery::{plan_recovery, Holding, Recovery};
use crate::supervisor::{CollectivesLayout, JobEvent, LaunchRequest, SupervisorOptions, MAX_STALLED_REFORMS};

/// What happened, as the core sees it.
#[derive(Debug)]
pub enum Input {
    /// A message from joined member `node` (its token proven at join).
    Message { node: u64, msg: ToSupervisor },
    /// Member `node`'s control link ended.
    LinkLost { node: u64, reason: String },
    /// A worker process ended (from the launcher).
    ProcessExited { pid: u32, status: String },
    /// Periodic checks (heartbeats, timeouts).
    Tick,
}

/// What a decision asks the shell to do, in order.
#[derive(Debug, PartialEq)]
pub enum Command {
    /// Send `msg` to member `node`'s agent.
    Tell { node: u64, msg: ToWorker },
    /// Send `Prepare` for `generation` to `node` with the identity of `rank` of `world` (the shell
    /// issues the certificate: the core holds no keys).
    Prepare { node: u64, generation: u64, rank: u32, world: u32 },
    /// Publish a job event.
    Emit(JobEvent),
    /// Ask the launcher.
    Launch(LaunchRequest),
    /// Close member `node`'s control link.
    Close { node: u64, reason: String },
}

/// A member as the core knows it: what it said, not how to reach it.
#[derive(Debug)]
struct Member {
    name: String,
    host: String,
    pid: u32,
    last_heard: Instant,
    completed: Option<u64>,
    leaving: bool,
    finished: Option<FinalReport>,
    /// Its control link ended.
    gone: bool,
}

/// A worker's report after `Finish`.
#[derive(Debug)]
struct FinalReport {
    checksum: u64,
    eval: Vec<(String, f64)>,
    /// Seconds in training steps, on the control path, and of the whole step loop.
    timing: [f64; 3],
}

/// One member's report of one step: loss, samples, parameter checksum (verification steps).
type StepReport = (f64, u64, Option<u64>);

#[derive(Debug)]
enum Phase {
    Waiting { since: Instant },
    Preparing { generation: u64, members: Vec<u64>, ready: BTreeMap<u64, (String, Holding, Option<MeshHeld>)>, acknowledged: Vec<u64>, since: Instant, extended: bool, interrupted: Option<Interrupted> },
    Running { generation: u64, members: Vec<u64>, reports: BTreeMap<u64, BTreeMap<u64, StepReport>>, failed_since: Option<Instant> },
    Finishing { members: Vec<u64>, since: Instant },
    Done,
}

/// The running generation a new one interrupted, with the step reports it had not committed: a
/// member's `StepDone` sent before it saw `Prepare` still arrives (before its `Ready`, on the same
/// link), and a step every member of that generation reported is committed then, so a new
/// generation that resumes after it leaves no committed step out.
#[derive(Debug)]
struct Interrupted {
    generation: u64,
    members: Vec<u64>,
    reports: BTreeMap<u64, BTreeMap<u64, StepReport>>,
}

/// The supervisor's state and decisions (see the module doc).
pub struct SupervisorCore {
    options: SupervisorOptions,
    /// Random name of this run (shared-memory ring names), from the shell's seed.
    run_id: String,
    /// Whether a launcher can start and kill worker processes.
    has_launcher: bool,
    members: BTreeMap<u64, Member>,
    phase: Phase,
    generation: u64,
    started: bool,
    committed: Option<u64>,
    failures: BTreeMap<FailureClass, u32>,
    exited: BTreeMap<u32, String>,
    commit_times: Vec<(Instant, u64, u64)>,
    /// Re-formations of the same members after failed steps with nobody lost, while the
    /// committed step stayed `.0`; and the last failed step's reason.
    stalled: (Option<u64>, u32),
    last_step_failure: Option<String>,
    /// The newest good checkpoint: (step, location).
    checkpoint: Option<(u64, String)>,
    /// `(pp, tp)` of the newest generation (`[parallel]`'s until a re-partition changes it).
    shape: (usize, usize),
    /// Replacement workers asked of the launcher and not yet joined: a group or mesh that lost
    /// members and would be refilled by them waits for them rather than shrink or re-partition.
    awaited: usize,
    /// The members of the newest generation, in rank order: survivors keep their mesh slots
    /// across a wait for workers.
    last_members: Vec<u64>,
    outbox: Vec<Command>,
}

/// The members of a data-parallel generation in rank order, from the previous generation's
/// (`previous`, in rank order) and the live members (by node id), at most `max`. A world at least
/// as large as the previous one keeps every survivor at its old rank and gives the lost ranks to
/// newcomers (a replacement takes its predecessor's rank, so a ZeRO survivor imports its own
/// segment and only the lost one travels); a smaller world keeps the survivors' order, packed.
/// Newcomers beyond the lost ranks come last.
fn data_parallel_ranks(previous: &[u64], live: &[u64], max: usize) -> Vec<u64> {
    let survivors: Vec<u64> = previous.iter().copied().filter(|n| live.contains(n)).collect();
    let newcomers: Vec<u64> = live.iter().copied().filter(|n| !previous.contains(n)).collect();
    let mut ranks = if survivors.len() + newcomers.len() >= previous.len() && max >= previous.len() {
        let mut fill = newcomers.into_iter();
        let mut ranks: Vec<u64> = previous.iter().filter_map(|n| if live.contains(n) { Some(*n) } else { fill.next() }).collect();
        ranks.extend(fill);
        ranks
    } else {
        let mut ranks = survivors;
        ranks.extend(newcomers);
        ranks
    };
    ranks.truncate(max);
    ranks
}

impl SupervisorCore {
    /// A core in `Waiting` at `now`.
    pub fn new(options: SupervisorOptions, run_id: String, has_launcher: bool, now: Instant) -> Self {
        let shape = (options.elastic.pp.max(1), options.elastic.tp.max(1));
        SupervisorCore {
            options,
            run_id,
            has_launcher,
            members: BTreeMap::new(),
            phase: Phase::Waiting { since: now },
            generation: 0,
            started: false,
            committed: None,
            failures: BTreeMap::new(),
            exited: BTreeMap::new(),
            commit_times: Vec::new(),
            stalled: (None, 0),
            last_step_failure: None,
            checkpoint: None,
            shape,
            awaited: 0,
            last_members: Vec::new(),
            outbox: Vec::new(),
        }
    }

    /// The options it runs with.
    pub fn options(&self) -> &SupervisorOptions {
        &self.options
    }

    /// The commands decided since the last call, in order.
    pub fn take_commands(&mut self) -> Vec<Command> {
        std::mem::take(&mut self.outbox)
    }

    /// Whether the job is over.
    pub fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done)
    }

    /// Whether `node` is a member (joined and not removed).
    pub fn is_member(&self, node: u64) -> bool {
        self.members.contains_key(&node)
    }

    /// Decides a join of a worker whose token the shell verified: `Err(reason)` refuses it; on
    /// `Ok` the member is admitted (and a generation may form: see the outbox). The shell answers
    /// the join before it carries out the commands, so `Prepare` never overtakes the reply.
    /// The inner `Err` is the refusal's reason; the outer one fails the job.
    pub fn join(&mut self, node: u64, name: String, pid: u32, host: String, now: Instant) -> Result<std::result::Result<(), String>> {
        if matches!(self.phase, Phase::Finishing { .. } | Phase::Done) {
            return Ok(Err("the job is finishing".into()));
        }
        if self.live_members().count() >= self.options.elastic.max_workers {
            return Ok(Err(format!("the job already has max_workers = {} workers", self.options.elastic.max_workers)));
        }
        tracing::info!(node, %name, pid, %host, "worker joined");
        self.members.insert(node, Member { name: name.clone(), host: host.clone(), pid, last_heard: now, completed: None, leaving: false, finished: None, gone: false });
        self.awaited = self.awaited.saturating_sub(1);
        self.emit(JobEvent::Joined { node, name, pid, host });
        self.maybe_form(now)?;
        Ok(Ok(()))
    }

    /// Decides what `input` (at `now`) changes. An error fails the job: call [`Self::fail`].
    pub fn handle(&mut self, input: Input, now: Instant) -> Result<()> {
        match input {
            Input::Message { node, msg } => self.on_message(node, msg, now),
            Input::LinkLost { node, reason } => self.on_link_lost(node, reason, now),
            Input::ProcessExited { pid, status } => self.on_exit(pid, status, now),
            Input::Tick => self.on_tick(now),
        }
    }

    /// The job failed for `reason`: report it and evict every member.
    pub fn fail(&mut self, reason: &str) {
        tracing::error!(%reason, "job failed");
        self.emit(JobEvent::Failed { reason: reason.to_string() });
        let nodes: Vec<u64> = self.members.keys().copied().collect();
        for node in nodes {
            self.tell(node, ToWorker::Evict { reason: format!("job failed: {reason}") });
        }
    }

    /// The step after which this run stops.
    fn end_step(&self) -> u64 {
        self.options.stop_at.map_or(self.options.total_steps, |s| s.min(self.options.total_steps))
    }

    fn emit(&mut self, event: JobEvent) {
        self.outbox.push(Command::Emit(event));
    }

    fn tell(&mut self, node: u64, msg: ToWorker) {
        self.outbox.push(Command::Tell { node, msg });
    }

    fn live_members(&self) -> impl Iterator<Item = (&u64, &Member)> {
        self.members.iter().filter(|(_, m)| !m.leaving && m.finished.is_none())
    }

    fn on_message(&mut self, node: u64, msg: ToSupervisor, now: Instant) -> Result<()> {
        let Some(member) = self.members.get_mut(&node) else { return Ok(()) };
        member.last_heard = now;
        match msg {
            // Answered by the shell (they need the link).
            ToSupervisor::Join { .. } | ToSupervisor::Status { .. } | ToSupervisor::Heartbeat { .. } => Ok(()),
            ToSupervisor::Preparing { node, generation } => {
                if let Phase::Preparing { generation: g, members, acknowledged, .. } = &mut self.phase {
                    if *g == generation && members.contains(&node) && !acknowledged.contains(&node) {
                        acknowledged.push(node);
                    }
                }
                Ok(())
            }
            ToSupervisor::Ready { node, generation, addr, completed, zero1, mesh } => self.on_ready(node, generation, addr, completed, zero1, mesh, now),
            ToSupervisor::StepDone { node, generation, step, loss, samples, checksum } => self.on_step_done(node, generation, step, loss, samples, checksum, now),
            ToSupervisor::StepFailed { node, generation, step, reason } => {
                tracing::info!(node, generation, step, %reason, "step failed on a worker");
                self.last_step_failure = Some(reason);
                if let Phase::Running { generation: g, failed_since, .. } = &mut self.phase {
                    if *g == generation && failed_since.is_none() {
                        *failed_since = Some(now);
                    }
                }
                Ok(())
            }
            ToSupervisor::Leaving { node, completed, reason } => {
                let Some(member) = self.members.get_mut(&node) else { return Ok(()) };
                member.leaving = true;
                member.completed = completed.or(member.completed);
                let pid = member.pid;
                self.tell(node, ToWorker::Evict { reason: "leave acknowledged".into() });
                self.emit(JobEvent::Lost { node, pid, class: FailureClass::Preemption, reason });
                self.handle_failure(node, FailureClass::Preemption, now)
            }
            ToSupervisor::Finished { node, checksum, eval, compute_s, control_s, loop_s } => {
                if let Some(member) = self.members.get_mut(&node) {
                    member.finished = Some(FinalReport { checksum, eval, timing: [compute_s, control_s, loop_s] });
                }
                self.check_finished();
                Ok(())
            }
            ToSupervisor::Checkpointed { step, path, .. } => {
                if self.checkpoint.as_ref().is_none_or(|(s, _)| step >= *s) {
                    self.checkpoint = Some((step, path.clone()));
                }
                self.emit(JobEvent::Checkpointed { step, path });
                // A mesh waiting to change shape (back after a re-partition) does it from here.
                self.maybe_form(now)
            }
            ToSupervisor::CheckpointFailed { step, reason, .. } => {
                self.emit(JobEvent::CheckpointFailed { step, reason });
                Ok(())
            }
        }
    }

    /// Starts the first generation when enough workers are here, or grows a running job.
    fn maybe_form(&mut self, now: Instant) -> Result<()> {
        let live = self.live_members().count();
        match &self.phase {
            Phase::Waiting { .. } => {
                let needed = if self.started { self.options.elastic.min_workers } else { self.options.elastic.start_workers };
                if live >= needed {
                    self.reform(now)?;
                }
            }
            // A mesh grows by whole replicas only, and into another shape (back to `[parallel]`'s
            // after a re-partition) only from a sharded checkpoint of its newest state.
            Phase::Running { members, .. } if self.options.elastic.mesh_slots() > 1 => {
                let live: Vec<u64> = self.live_members().map(|(n, _)| *n).collect();
                let (candidates, shape) = self.mesh_candidates(members, &live);
                // The checkpoint must be of the newest committed step itself: one taken ahead of
                // its commit would leave that step never committed.
                let fresh = self.checkpoint.as_ref().is_some_and(|(step, _)| self.committed == Some(*step));
                if candidates.len() > members.len() && (shape == self.shape || fresh) {
                    tracing::info!(from = members.len(), to = candidates.len(), ?shape, "growing the mesh");
                    self.reform(now)?;
                }
            }
            Phase::Running { members, .. } if live.min(self.options.elastic.max_workers) > members.len() => {
                tracing::info!(from = members.len(), to = live.min(self.options.elastic.max_workers), "growing the group");
                self.reform(now)?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Forms a new generation from the live members (see [`data_parallel_ranks`] and, for a mesh,
    /// [`Self::mesh_candidates`]), or waits for workers.
    fn reform(&mut self, now: Instant) -> Result<()> {
        // After a wait for workers, the generation before it: its survivors keep their slots.
        let previous = self.last_members.clone();
        let live: Vec<u64> = self.live_members().map(|(n, _)| *n).collect();
        let (candidates, shape) = if self.options.elastic.mesh_slots() > 1 {
            // Whole model replicas only, survivors in their old slots (see `placement`); a world
            // too small for one replica re-partitioned (see `mesh_candidates`).
            self.mesh_candidates(&previous, &live)
        } else {
            let candidates = data_parallel_ranks(&previous, &live, self.options.elastic.max_workers);
            if self.awaits_refill(candidates.len(), previous.len()) {
                tracing::info!(live = candidates.len(), awaited = self.awaited, "waiting for replacements rather than shrinking the group");
                (Vec::new(), (1, 1))
            } else {
                (candidates, (1, 1))
            }
        };
        let needed = if self.started { self.options.elastic.min_workers } else { self.options.elastic.start_workers };
        if candidates.len() < needed.max(1) {
            // A wait that the replacements on their way will end is an expected pause (logged
            // where it is decided); a shortage they cannot make up is warned of either way.
            if self.awaited == 0 || live.len() + self.awaited < needed.max(1) {
                tracing::warn!(have = candidates.len(), awaited = self.awaited, needed, "too few workers; waiting for more");
            }
            self.phase = Phase::Waiting { since: now };
            // Members still alive must stop training the old generation.
            self.generation += 1;
            for node in live {
                self.tell(node, ToWorker::Pause { generation: self.generation });
            }
            return Ok(());
        }
        self.generation += 1;
        self.started = true;
        if shape != self.shape {
            tracing::warn!(from = ?self.shape, to = ?shape, world = candidates.len(), checkpoint = ?self.checkpoint, "re-partitioning the mesh: (pp, tp) changes; every member loads its part of the newest sharded checkpoint");
            self.shape = shape;
        }
        let generation = self.generation;
        let world = candidates.len() as u32;
        for (rank, node) in candidates.iter().enumerate() {
            self.outbox.push(Command::Prepare { node: *node, generation, rank: rank as u32, world });
        }
        // Live members left out of a mesh generation stand by: they stop the old generation and
        // wait for a later one with room for them.
        for node in live.into_iter().filter(|n| !candidates.contains(n)) {
            tracing::info!(node, generation, "standing by: the generation has no whole replica for this member");
            self.tell(node, ToWorker::Pause { generation });
        }
        tracing::info!(generation, world, "preparing generation");
        self.last_members.clone_from(&candidates);
        let interrupted = match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Running { generation, members, reports, .. } => Some(Interrupted { generation, members, reports }),
            Phase::Preparing { interrupted, .. } => interrupted,
            _ => None,
        };
        self.phase = Phase::Preparing { generation, members: candidates, ready: BTreeMap::new(), acknowledged: Vec::new(), since: now, extended: false, interrupted };
        Ok(())
    }

    /// Whether a data-parallel group down to `have` of the `previous` generation's members waits
    /// for its replacements (asked of the launcher under `on_failure = "replace"`, still on their
    /// way) rather than shrink: it does when they would refill it. A same-size generation takes
    /// the lost ranks' places whole (a ZeRO rank imports the lost rank's segments instead of the
    /// state being re-cut to the smaller world and again back), where shrinking at once and
    /// growing back when they join re-shards twice for the few seconds a replacement takes to
    /// start. `on_tick` stops the wait after `prepare_timeout` (`awaited` back to 0).
    fn awaits_refill(&self, have: usize, previous: usize) -> bool {
        self.awaited > 0 && have < previous && have + self.awaited >= previous
    }

    /// The members of a mesh generation in rank order, and its `(pp, tp)`. Whole replicas of
    /// `[parallel]`'s mesh when the live world fills one (see [`placement`]); else, with
    /// `[elastic] repartition` on, the smaller mesh of rule 2 of [`plan`] over the live members
    /// (`plan::repartitioned_shape`), whose members load their parts of the newest sharded
    /// checkpoint. No candidates (wait for workers) while a replacement is on its way that would
    /// refill the configured mesh, or when steps were committed and no checkpoint holds the state
    /// at any step (a re-partition would train again from the initial parameters).
    fn mesh_candidates(&self, previous: &[u64], live: &[u64]) -> (Vec<u64>, (usize, usize)) {
        let elastic = &self.options.elastic;
        let configured = (elastic.pp.max(1), elastic.tp.max(1));
        // Survivors keep their slots only within the shape they trained in.
        let at = |shape: (usize, usize)| placement::place(if shape == self.shape { previous } else { &[] }, live, shape.0 * shape.1, elastic.max_workers);
        let whole = at(configured);
        let Some(model) = elastic.mesh_model.filter(|_| elastic.repartition && whole.is_empty()) else { return (whole, configured) };
        if live.len() + self.awaited >= configured.0 * configured.1 {
            tracing::info!(live = live.len(), awaited = self.awaited, "waiting for replacements rather than re-partitioning the mesh");
            return (Vec::new(), configured);
        }
        let restorable = self.committed.is_none() || self.checkpoint.is_some();
        if !restorable {
            tracing::warn!(live = live.len(), committed = ?self.committed, "cannot re-partition the mesh: no sharded checkpoint holds its state (set checkpoint_every); waiting for workers");
            return (Vec::new(), configured);
        }
        let smaller = plan::repartitioned_shape(configured.1, live.len().min(elastic.max_workers), model.dims, model.chunks);
        let shape = (smaller.pp, smaller.tp);
        (at(shape), shape)
    }

    /// Whether a new generation starting at `next_step` after committed step `from` is the
    /// rollback that `[elastic] zero_copies = "snapshot"` plans for a ZeRO-1/2 job: to the first
    /// step after the newest snapshot boundary (a snapshot is taken after every step `s` with
    /// `(s + 1) % snapshot_every == 0`) or newer (a checkpoint's snapshot). Older than that is a
    /// loss of durable state, reported as suspect like any other.
    fn planned_rollback(&self, from: u64, next_step: u64) -> bool {
        let elastic = &self.options.elastic;
        if !elastic.sharding.shards_optimizer() || elastic.sharding == DpSharding::Zero3 || elastic.zero_copies.per_step() {
            return false;
        }
        let every = elastic.snapshot_every.max(1);
        next_step >= (from + 1) / every * every
    }

    #[allow(clippy::too_many_arguments)]
    fn on_ready(&mut self, node: u64, generation: u64, addr: String, completed: Option<u64>, zero1: Vec<Zero1Held>, mesh: Option<MeshHeld>, now: Instant) -> Result<()> {
        let Phase::Preparing { generation: g, members, ready, .. } = &mut self.phase else { return Ok(()) };
        if *g != generation || !members.contains(&node) {
            return Ok(());
        }
        ready.insert(node, (addr, Holding { completed, zero1 }, mesh));
        if let Some(m) = self.members.get_mut(&node) {
            m.completed = completed;
        }
        if ready.len() < members.len() {
            return Ok(());
        }
        let members = members.clone();
        let ready = std::mem::take(ready);
        let addrs: Vec<String> = members.iter().map(|n| ready.get(n).map(|(a, _, _)| a.clone()).unwrap_or_default()).collect();
        let holdings: Vec<Holding> = members.iter().map(|n| ready.get(n).map(|(_, h, _)| h.clone()).unwrap_or_default()).collect();
        let replay = self.options.elastic.planted_bug == PlantedBug::ReplayLastStep && generation > 1;
        let checkpoint = self.checkpoint.as_ref().map(|(s, l)| (*s, l.as_str()));
        let (mut recovery, mesh) = match self.shape.0 * self.shape.1 {
            1 => (plan_recovery(&holdings, checkpoint, self.options.resume_next_step, self.committed, replay), None),
            slots => {
                let held: Vec<Option<MeshHeld>> = members.iter().map(|n| ready.get(n).and_then(|(_, _, m)| *m)).collect();
                // The newest complete sharded checkpoint, else the one the job resumes from.
                let resumed = self.options.resume.as_ref().and_then(|p| Some((self.options.resume_next_step.checked_sub(1)?, p.to_str()?)));
                let (mut sources, step) = placement::shard_sources(&held, self.shape, checkpoint.or(resumed));
                if self.options.elastic.planted_bug == PlantedBug::MeshSlotFromInitial {
                    for source in &mut sources {
                        if matches!(source, ShardSource::Member { .. }) {
                            *source = ShardSource::Initial;
                        }
                    }
                }
                let next_step = step.map_or(self.options.resume_next_step, |s| s + 1);
                let regressed_from = self.committed.filter(|&c| c + 1 > next_step);
                let (pp, tp) = (self.shape.0 as u32, self.shape.1 as u32);
                let start = MeshStart { dp: (members.len() / slots) as u32, pp, tp, sources };
                (Recovery { source: StateSource::Initial, next_step, regressed_from }, Some(start))
            }
        };
        if mesh.is_some() && recovery.next_step < self.options.resume_next_step {
            recovery.next_step = self.options.resume_next_step;
        }
        if let Some(from) = recovery.regressed_from {
            let rerun = from + 1 - recovery.next_step.min(from + 1);
            if mesh.is_none() && self.planned_rollback(from, recovery.next_step) {
                // `zero_copies = "snapshot"`: no member keeps copies of the steps since the last
                // snapshot, so running them again is the configured trade-off, not lost state.
                tracing::info!(generation, from, next_step = recovery.next_step, rerun, source = ?recovery.source, "rolled back to the last ZeRO snapshot (zero_copies = \"snapshot\"): {rerun} committed steps run again");
            } else {
                let reason = format!("generation {generation}: every holder of committed step {from} is gone; resuming from {:?} at step {} ({rerun} committed steps run again)", recovery.source, recovery.next_step);
                tracing::warn!(generation, from, next_step = recovery.next_step, rerun, "{reason}");
                self.emit(JobEvent::Suspect { reason });
            }
        }
        let next_step = recovery.next_step;
        let source = recovery.source.sending_rank();
        let hosts: Vec<&str> = members.iter().map(|n| self.members.get(n).map_or("", |m| m.host.as_str())).collect();
        let layout = CollectivesLayout::choose(self.options.elastic.transport, &hosts);
        let shm_job = matches!(layout, CollectivesLayout::Shm | CollectivesLayout::Routed { .. }).then(|| format!("{}-g{generation}", self.run_id));
        let host_of = match &layout {
            CollectivesLayout::Routed { host_of } => host_of.clone(),
            _ => Vec::new(),
        };
        let stop_step = self.end_step();
        for node in &members {
            if self.members.contains_key(node) {
                let start = ToWorker::Start { generation, addrs: addrs.clone(), source: recovery.source.clone(), next_step, stop_step, shm_job: shm_job.clone(), mesh: mesh.clone(), host_of: host_of.clone() };
                self.tell(*node, start);
            }
        }
        let (nodes, pids): (Vec<u64>, Vec<u32>) = members.iter().filter_map(|n| self.members.get(n).map(|m| (*n, m.pid))).unzip();
        tracing::info!(generation, world = members.len(), next_step, source, from = ?recovery.source, "generation started");
        let (pp, tp) = self.shape;
        let shape = (members.len() / (pp * tp), pp, tp);
        let transport = layout.name(self.options.elastic.data_transport);
        self.emit(JobEvent::Generation { generation, world: members.len(), next_step, source_node: members.get(source).copied().unwrap_or_default(), nodes, pids, mesh: shape, transport });
        if next_step >= self.end_step() {
            self.finish(members, now);
            return Ok(());
        }
        self.phase = Phase::Running { generation, members, reports: BTreeMap::new(), failed_since: None };
        // A worker that joined while this generation was being prepared (a replacement arriving
        // right after the loss it replaces) was not in it: grow the group now.
        self.maybe_form(now)
    }

    #[allow(clippy::too_many_arguments)]
    fn on_step_done(&mut self, node: u64, generation: u64, step: u64, loss: f64, samples: u64, checksum: Option<u64>, now: Instant) -> Result<()> {
        if let Some(m) = self.members.get_mut(&node) {
            m.completed = Some(step);
        }
        let total = self.end_step();
        // The running generation's reports, or those of the one a new generation interrupted
        // (which commit but never finish the job: the new generation's start does).
        let (members, reports, running) = match &mut self.phase {
            Phase::Running { generation: g, members, reports, .. } if *g == generation && members.contains(&node) => (members, reports, true),
            Phase::Preparing { interrupted: Some(i), .. } if i.generation == generation && i.members.contains(&node) => (&mut i.members, &mut i.reports, false),
            _ => return Ok(()),
        };
        reports.entry(step).or_default().insert(node, (loss, samples, checksum));
        let mut commits = Vec::new();
        while let Some(entry) = reports.first_entry() {
            if entry.get().len() < members.len() {
                break;
            }
            let (step, by_node) = entry.remove_entry();
            commits.push((step, by_node));
        }
        let world = members.len();
        let members = members.clone();
        let slots = self.shape.0 * self.shape.1;
        for (step, by_node) in commits {
            let samples: u64 = by_node.values().map(|r| r.1).sum();
            let loss = by_node.values().map(|r| r.0 * r.1 as f64).sum::<f64>() / samples.max(1) as f64;
            let checksum = combined_checksum(&members, slots, |node| by_node.get(&node).and_then(|r| r.2))
                .map_err(|(slot, sums)| SupervisorError::JobFailed { reason: format!("replicas diverged at step {step}: parameter checksums {sums:x?} (slot {slot} of {slots})") })?;
            self.committed = Some(step);
            self.commit_times.push((now, step, samples));
            if self.commit_times.len() > 64 {
                self.commit_times.remove(0);
            }
            self.emit(JobEvent::Committed { step, loss, samples, world, generation, checksum });
            if running && step + 1 >= total {
                self.finish(members, now);
                return Ok(());
            }
        }
        // A re-partitioned mesh whose checkpoint arrived ahead of the commit of its step changes
        // back now.
        if self.shape != (self.options.elastic.pp.max(1), self.options.elastic.tp.max(1)) {
            self.maybe_form(now)?;
        }
        Ok(())
    }

    fn finish(&mut self, members: Vec<u64>, now: Instant) {
        for node in &members {
            if self.members.contains_key(node) {
                self.tell(*node, ToWorker::Finish);
            }
        }
        self.phase = Phase::Finishing { members, since: now };
        self.check_finished();
    }

    fn check_finished(&mut self) {
        let Phase::Finishing { members, .. } = &self.phase else { return };
        // By rank: in a mesh, rank r holds slot r mod (pp · tp), and only holders of one slot match.
        let ranked: Vec<(usize, &FinalReport)> = members.iter().enumerate().filter_map(|(r, n)| self.members.get(n).and_then(|m| m.finished.as_ref()).map(|f| (r, f))).collect();
        let reports: Vec<&FinalReport> = ranked.iter().map(|(_, f)| *f).collect();
        let gone = members.iter().filter(|n| self.members.get(n).is_none_or(|m| m.finished.is_none() && m.gone)).count();
        if reports.len() + gone < members.len() {
            return;
        }
        let slots = self.shape.0 * self.shape.1;
        let replicas_identical = ranked.iter().all(|(r, a)| ranked.iter().filter(|(q, _)| q % slots == r % slots).all(|(_, b)| a.checksum == b.checksum));
        // A mesh's checksum covers every slot (the first report of each, in slot order).
        let checksum = if slots > 1 {
            (0..slots).filter_map(|slot| ranked.iter().find(|(r, _)| r % slots == slot).map(|(_, f)| f.checksum)).fold(FNV_OFFSET, fold_checksum)
        } else {
            reports.first().map_or(0, |r| r.checksum)
        };
        let eval = reports.iter().find(|r| !r.eval.is_empty()).map(|r| r.eval.clone()).unwrap_or_default();
        let sums = reports.iter().fold([0.0; 3], |acc, r| [acc[0] + r.timing[0], acc[1] + r.timing[1], acc[2] + r.timing[2]]);
        let share = |part: f64| if sums[2] > 0.0 { part / sums[2] } else { 0.0 };
        self.emit(JobEvent::Finished { eval, replicas_identical, checksum, overhead: share(sums[1]), outside_steps: share(sums[2] - sums[0]) });
        self.phase = Phase::Done;
    }

    fn on_link_lost(&mut self, node: u64, reason: String, now: Instant) -> Result<()> {
        let Some(member) = self.members.get_mut(&node) else { return Ok(()) };
        member.gone = true;
        if member.finished.is_some() || member.leaving {
            self.check_finished();
            return Ok(());
        }
        let class = if self.exited.contains_key(&member.pid) { FailureClass::Crash } else { FailureClass::NetworkLoss };
        self.lose(node, class, format!("connection lost: {reason}"), now)
    }

    fn on_exit(&mut self, pid: u32, status: String, now: Instant) -> Result<()> {
        self.exited.insert(pid, status.clone());
        let found = self.members.iter().find(|(_, m)| m.pid == pid && m.finished.is_none() && !m.leaving).map(|(n, _)| *n);
        match found {
            Some(node) => self.lose(node, FailureClass::Crash, format!("process {pid} exited: {status}"), now),
            None => {
                if matches!(self.phase, Phase::Finishing { .. }) {
                    self.check_finished();
                }
                Ok(())
            }
        }
    }

    /// Removes a member for a failure of `class` and reacts.
    fn lose(&mut self, node: u64, class: FailureClass, reason: String, now: Instant) -> Result<()> {
        let Some(member) = self.members.remove(&node) else { return Ok(()) };
        tracing::warn!(node, pid = member.pid, ?class, %reason, "member lost");
        if class == FailureClass::Hang {
            self.tell(node, ToWorker::Evict { reason: format!("evicted: {reason}") });
            if self.has_launcher {
                self.outbox.push(Command::Launch(LaunchRequest::Kill { pid: member.pid }));
            }
        }
        self.outbox.push(Command::Close { node, reason: "removed from the job".into() });
        self.emit(JobEvent::Lost { node, pid: member.pid, class, reason });
        if matches!(self.phase, Phase::Finishing { .. }) {
            self.check_finished();
            return Ok(());
        }
        self.handle_failure(node, class, now)
    }

    fn handle_failure(&mut self, node: u64, class: FailureClass, now: Instant) -> Result<()> {
        let count = self.failures.entry(class).or_insert(0);
        *count += 1;
        let policy = self.options.elastic.policy(class);
        if *count > policy.budget {
            return Err(SupervisorError::JobFailed { reason: format!("{class:?} failures exceeded their budget of {}", policy.budget) });
        }
        if policy.on_failure == OnFailure::Replace && self.has_launcher {
            self.outbox.push(Command::Launch(LaunchRequest::Spawn));
            self.awaited += 1;
        }
        let involved = match &self.phase {
            Phase::Preparing { members, .. } | Phase::Running { members, .. } => members.contains(&node),
            _ => false,
        };
        if involved {
            self.reform(now)?;
        }
        Ok(())
    }

    fn on_tick(&mut self, now: Instant) -> Result<()> {
        let timeout = self.options.elastic.heartbeat_timeout;
        let silent: Vec<u64> = self.live_members().filter(|(_, m)| now.duration_since(m.last_heard) > timeout).map(|(n, _)| *n).collect();
        for node in silent {
            self.lose(node, FailureClass::Hang, format!("no heartbeat for {} ms", timeout.as_millis()), now)?;
        }
        match &self.phase {
            // Replacements that did not come within the prepare timeout: stop waiting for them
            // (a mesh re-partitions over the members it has).
            Phase::Waiting { since } if self.awaited > 0 && now.duration_since(*since) > self.options.elastic.prepare_timeout => {
                tracing::warn!(awaited = self.awaited, "replacement workers did not join in time; forming with the members there are");
                self.awaited = 0;
                return self.reform(now);
            }
            Phase::Waiting { since } if now.duration_since(*since) > self.options.elastic.rendezvous_timeout => {
                let have = self.live_members().count();
                return Err(SupervisorError::JobFailed { reason: format!("only {have} worker(s) after waiting {:?}; need {}", self.options.elastic.rendezvous_timeout, if self.started { self.options.elastic.min_workers } else { self.options.elastic.start_workers }) });
            }
            Phase::Preparing { members, ready, acknowledged, since, extended, .. } if now.duration_since(*since) > self.options.elastic.prepare_timeout => {
                let late: Vec<u64> = members.iter().copied().filter(|n| !ready.contains_key(n)).collect();
                // Late members whose control path is alive (they acknowledged, and are heard
                // from) have a compute thread stuck in the old generation, not a dead process.
                let alive: Vec<u64> = late.iter().copied().filter(|n| acknowledged.contains(n) && self.members.get(n).is_some_and(|m| now.duration_since(m.last_heard) <= timeout)).collect();
                let mass = late.len() > 1 && late.len() * 2 >= members.len();
                if mass {
                    let reason = format!("{} of {} members did not answer Prepare within {:?} ({} of them with a live control path): a mass hang verdict is suspect{}", late.len(), members.len(), self.options.elastic.prepare_timeout, alive.len(), if *extended { "; evicting them now, the newest durable state is kept" } else { "; waiting once more" });
                    tracing::warn!(late = late.len(), members = members.len(), alive = alive.len(), "{reason}");
                    let first = !*extended;
                    self.emit(JobEvent::Suspect { reason });
                    if first && !alive.is_empty() {
                        if let Phase::Preparing { since, extended, .. } = &mut self.phase {
                            *since = now;
                            *extended = true;
                        }
                        return Ok(());
                    }
                }
                for node in late {
                    let why = if alive.contains(&node) { "no answer to Prepare: compute stuck (its control path is alive)" } else { "no answer to Prepare" };
                    self.lose(node, FailureClass::Hang, why.into(), now)?;
                }
            }
            Phase::Running { failed_since: Some(t), .. } if now.duration_since(*t) > timeout => {
                tracing::warn!("a step failed and no member was found lost; re-forming the same members");
                let at = self.committed;
                self.stalled = if self.stalled.0 == at { (at, self.stalled.1 + 1) } else { (at, 1) };
                if self.stalled.1 > MAX_STALLED_REFORMS {
                    let next = at.map_or(0, |s| s + 1);
                    let why = self.last_step_failure.clone().unwrap_or_else(|| "no reason given".into());
                    return Err(SupervisorError::JobFailed { reason: format!("step {next} failed {} times in a row with no worker lost: {why}", self.stalled.1) });
                }
                self.reform(now)?;
            }
            Phase::Finishing { since, members } if now.duration_since(*since) > self.options.elastic.finish_timeout => {
                let late: Vec<u64> = members.iter().copied().filter(|n| self.members.get(n).is_some_and(|m| m.finished.is_none())).collect();
                tracing::warn!(late = late.len(), bound_ms = self.options.elastic.finish_timeout.as_millis() as u64, "members sent no final report within elastic.finish_timeout; finishing without them (their evaluation is lost)");
                for node in late {
                    self.members.remove(&node);
                }
                self.check_finished();
            }
            _ => {}
        }
        Ok(())
    }

    /// What `rtx status` shows.
    pub fn status(&self) -> StatusReport {
        let (phase, ranks): (&str, Vec<u64>) = match &self.phase {
            Phase::Waiting { .. } => ("waiting", Vec::new()),
            Phase::Preparing { members, .. } => ("preparing", members.clone()),
            Phase::Running { members, .. } => ("running", members.clone()),
            Phase::Finishing { members, .. } => ("finishing", members.clone()),
            Phase::Done => ("done", Vec::new()),
        };
        let members = self
            .members
            .iter()
            .map(|(node, m)| MemberStatus { node: *node, name: m.name.clone(), pid: m.pid, rank: ranks.iter().position(|n| n == node).map(|r| r as u32), role: "worker".into(), completed: m.completed })
            .collect();
        let (steps_per_sec, samples_per_sec) = match (self.commit_times.first(), self.commit_times.last()) {
            (Some(first), Some(last)) if last.0 > first.0 => {
                let secs = last.0.duration_since(first.0).as_secs_f64();
                let samples: u64 = self.commit_times.iter().skip(1).map(|c| c.2).sum();
                ((last.1 - first.1) as f64 / secs, samples as f64 / secs)
            }
            _ => (0.0, 0.0),
        };
        StatusReport { phase: phase.into(), generation: self.generation, committed: self.committed, total_steps: self.options.total_steps, members, steps_per_sec, samples_per_sec, failures: self.failures.values().map(|&c| u64::from(c)).sum() }
    }
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// Folds one slot's checksum into a mesh's (FNV-1a over the 8 bytes).
fn fold_checksum(hash: u64, value: u64) -> u64 {
    value.to_le_bytes().iter().fold(hash, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

/// The replicas' checksum of one step, from each member's (`members` in rank order; rank `r`
/// holds slot `r % slots`). Data parallelism (one slot): the replicas' common checksum. A mesh:
/// the slots' checksums folded in slot order. `None` when some member sent none; the slot and
/// its holders' checksums when two holders of one slot disagree.
fn combined_checksum(members: &[u64], slots: usize, of: impl Fn(u64) -> Option<u64>) -> std::result::Result<Option<u64>, (usize, Vec<u64>)> {
    let sums: Option<Vec<u64>> = members.iter().map(|node| of(*node)).collect();
    let Some(sums) = sums else { return Ok(None) };
    let slots = slots.max(1);
    let mut per_slot = Vec::with_capacity(slots);
    for slot in 0..slots {
        let held: Vec<u64> = sums.iter().enumerate().filter(|(rank, _)| rank % slots == slot).map(|(_, sum)| *sum).collect();
        if held.windows(2).any(|w| w[0] != w[1]) {
            return Err((slot, held));
        }
        per_slot.extend(held.first().copied());
    }
    Ok(match per_slot.as_slice() {
        [] => None,
        [one] if slots == 1 => Some(*one),
        all => Some(all.iter().copied().fold(FNV_OFFSET, fold_checksum)),
    })
}

#[cfg(test)]
mod tests;
