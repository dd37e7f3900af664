//! The `ClusterSupervisor`: admits workers, forms generations, detects failures and re-forms the
//! group, commits steps, and ends the job. It runs as one actor ([`rtx_actors::Actor`]) whose
//! mailbox is fed by the link listener, one forwarder per link, a ticker and the launcher;
//! the whole membership state machine lives in its handler, so there are no locks and every
//! decision is taken in one place, in message order. Members live in a `BTreeMap` by node id, so
//! iteration order (and everything sent) is deterministic.
//!
//! Phases: `Waiting` (too few workers; after `rendezvous_timeout` the job fails) →
//! `Preparing` (each member got `Prepare` for the new generation and answers `Ready`) →
//! `Running` (steps are committed when every member reported them) → `Finishing` → done.
//!
//! Failure detection and classes: a process exit seen by the launcher is a **crash**; a worker
//! silent for `heartbeat_timeout` while its connection is open is **hung** (evicted, and killed
//! when it is our child); a connection lost without an exit is a **network loss**; a `Leaving`
//! message is a **preemption**. Each class has a budget and a policy (shrink, or replace through
//! the launcher). A step failure reported by a worker with no member found lost within
//! `heartbeat_timeout` re-forms the same members under a new generation.
//!
//! Recovery point: the new generation starts from the newest durable state ([`crate::recovery`]):
//! the newest step any member holds whole (a step completes on a rank only when every rank's
//! gradients were combined, so that state is the job's), ZeRO-1 segment copies that cover a
//! layout, or the newest good checkpoint, whichever is newest; at most the step in flight is lost
//! while a holder survives, and losing every holder at once resumes from the newest checkpoint,
//! never from initial parameters.
//!
//! Stuck compute versus a dead process: the node agent acknowledges `Prepare` from its control
//! path at once (`Preparing`), and answers `Ready` when its compute thread has left the old
//! generation (the transport abort makes that milliseconds). A member that acknowledged but is not
//! ready by `prepare_timeout` has a live control path and a stuck compute path; when that is true
//! of half the members or more at once, the verdict is suspect (the cause is more likely shared:
//! the supervisor, the network, the filesystem) and it is logged and reported as such
//! ([`JobEvent::Suspect`]), and they get one more `prepare_timeout` before they are evicted.
//! Either way the recovery rule above keeps what is durable.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rtx_actors::{spawn, Actor, ActorHandle, ActorRef, Context, Exit, Inbound, Link, LinkListener, LinkOptions, RemoteRef};
use rtx_collectives::ClusterCa;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::config::{ElasticConfig, FailureClass, OnFailure, PlantedBug, Wire};
use crate::error::{Result, SupervisorError};
use crate::placement;
use crate::plan;
use crate::protocol::{self, JoinReply, MemberStatus, MeshHeld, MeshStart, StateSource, StatusReport, ToSupervisor, ToWorker, Zero1Held, AGENT, EXPORTER_LABEL};
use crate::recovery::{plan_recovery, Holding, Recovery};

/// How the supervisor is set up.
#[derive(Clone, Debug)]
pub struct SupervisorOptions {
    /// Control address to listen on.
    pub listen: SocketAddr,
    /// The cluster token workers must prove.
    pub token: String,
    /// The job description handed to workers (TOML).
    pub job: String,
    /// Steps in the run.
    pub total_steps: u64,
    /// Stop after this many steps instead (a later `--resume` continues the run).
    pub stop_at: Option<u64>,
    /// Elastic settings.
    pub elastic: ElasticConfig,
    /// A checkpoint every worker resumes from.
    pub resume: Option<PathBuf>,
    /// The step after the resumed checkpoint's.
    pub resume_next_step: u64,
    /// The job's output folder, handed to workers at join for their checkpoints.
    pub run_dir: Option<PathBuf>,
    /// Control-link tuning.
    pub link: LinkOptions,
}

/// Where a supervisor meets the world: its control listener and the seed of its random choices.
/// [`SupervisorHandle::start`] binds QUIC and seeds from the OS; the simulator hands in a
/// [`LinkListener::channel`] and a seed derived from its master seed.
pub struct SupervisorEnv {
    /// Accepts workers' control links.
    pub listener: LinkListener,
    /// Seeds every random choice of the supervisor (the run id that names shm rings).
    pub seed: u64,
}

/// What happens in the job, for progress bars, metrics and tests.
#[derive(Clone, Debug, PartialEq)]
pub enum JobEvent {
    /// A worker was admitted; `host` is the machine identity it reported (`hostname/boot id`).
    Joined { node: u64, name: String, pid: u32, host: String },
    /// A worker with a wrong token (or none) was refused.
    Refused { peer: String, reason: String },
    /// A member was lost.
    Lost { node: u64, pid: u32, class: FailureClass, reason: String },
    /// A generation started; `nodes` and `pids` in rank order, `mesh` its `(dp, pp, tp)` shape
    /// (rank `r` at `tp = r % tp`, `pp = r / tp % pp`, `dp = r / (tp·pp)`; `(world, 1, 1)` for
    /// data parallelism). `transport`: how its collectives move (`quic`, `shm`, `routed` for shared
    /// memory inside each machine and QUIC between machines, or `injected`).
    Generation { generation: u64, world: usize, next_step: u64, source_node: u64, nodes: Vec<u64>, pids: Vec<u32>, mesh: (usize, usize, usize), transport: &'static str },
    /// Every member completed `step`; `checksum` is the replicas' parameter checksum after it,
    /// when every member verified this step (they agree, or the job fails).
    Committed { step: u64, loss: f64, samples: u64, world: usize, generation: u64, checksum: Option<u64> },
    /// A checkpoint was written.
    Checkpointed { step: u64, path: String },
    /// Writing the checkpoint of `step` failed (training goes on; the last good checkpoint is
    /// untouched).
    CheckpointFailed { step: u64, reason: String },
    /// The job completed. `overhead` is the share of the workers' step-loop time spent on the
    /// runtime's control path (command polling, step reports: its cost per step);
    /// `outside_steps` the share spent outside training steps altogether (also data waits,
    /// replica checksums, checkpoint snapshots).
    Finished { eval: Vec<(String, f64)>, replicas_identical: bool, checksum: u64, overhead: f64, outside_steps: f64 },
    /// The job failed.
    Failed { reason: String },
    /// Something the supervisor decided on evidence it distrusts (a mass hang verdict), or a
    /// fall back to older durable state because every holder of the newer state was lost.
    Suspect { reason: String },
}

/// Requests to the process launcher.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LaunchRequest {
    /// Start one more worker process.
    Spawn,
    /// Kill the process (SIGKILL).
    Kill { pid: u32 },
}

/// Messages of the supervisor actor.
pub enum SupervisorMsg {
    /// A new link (not yet joined).
    Connected { conn: u64, link: Link },
    /// A message arrived on link `conn`.
    Inbound { conn: u64, msg: Inbound },
    /// Link `conn` ended.
    LinkLost { conn: u64, reason: String },
    /// A worker process ended (from the launcher).
    ProcessExited { pid: u32, status: String },
    /// Periodic checks.
    Tick,
}

/// A running supervisor.
pub struct SupervisorHandle {
    /// The control address workers join.
    pub addr: SocketAddr,
    /// The job's events, in order.
    pub events: mpsc::Receiver<JobEvent>,
    actor: ActorRef<SupervisorMsg>,
    handle: ActorHandle,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    listener: Arc<LinkListener>,
}

struct Member {
    name: String,
    host: String,
    pid: u32,
    link: Link,
    agent: RemoteRef<ToWorker>,
    last_heard: Instant,
    completed: Option<u64>,
    leaving: bool,
    finished: Option<FinalReport>,
}

/// A worker's report after `Finish`.
struct FinalReport {
    checksum: u64,
    eval: Vec<(String, f64)>,
    /// Seconds in training steps, on the control path, and of the whole step loop.
    timing: [f64; 3],
}

/// One member's report of one step: loss, samples, parameter checksum (verification steps).
type StepReport = (f64, u64, Option<u64>);

enum Phase {
    Waiting { since: Instant },
    Preparing { generation: u64, members: Vec<u64>, ready: BTreeMap<u64, (String, Holding, Option<MeshHeld>)>, acknowledged: Vec<u64>, since: Instant, extended: bool },
    Running { generation: u64, members: Vec<u64>, reports: BTreeMap<u64, BTreeMap<u64, StepReport>>, failed_since: Option<Instant> },
    Finishing { members: Vec<u64>, since: Instant },
    Done,
}

struct ClusterSupervisor {
    options: SupervisorOptions,
    /// Made on first use: an injected wire needs no certificates.
    ca: Option<ClusterCa>,
    events: mpsc::Sender<JobEvent>,
    launcher: Option<mpsc::Sender<LaunchRequest>>,
    connections: BTreeMap<u64, Link>,
    members: BTreeMap<u64, Member>,
    phase: Phase,
    generation: u64,
    started: bool,
    committed: Option<u64>,
    failures: BTreeMap<FailureClass, u32>,
    exited: BTreeMap<u32, String>,
    commit_times: Vec<(Instant, u64, u64)>,
    /// Random name of this run (shared-memory ring names).
    run_id: String,
    /// Re-formations of the same members after failed steps with nobody lost, while the
    /// committed step stayed `.0`; and the last failed step's reason.
    stalled: (Option<u64>, u32),
    last_step_failure: Option<String>,
    /// The newest good checkpoint: (step, location).
    checkpoint: Option<(u64, String)>,
    /// `(pp, tp)` of the newest generation (`[parallel]`'s until a re-partition changes it).
    shape: (usize, usize),
    /// Replacement workers asked of the launcher and not yet joined: a mesh that lost members
    /// waits for them rather than re-partition.
    awaited: usize,
}

/// Most re-formations of the same members after a step failed with nobody lost, without any step
/// committed in between, before the job fails: a step that fails the same way every time (a
/// model or kernel error on every worker) would otherwise be retried forever.
pub const MAX_STALLED_REFORMS: u32 = 10;

impl SupervisorHandle {
    /// Starts the supervisor on the current runtime. With `launcher`, it asks for replacement
    /// workers and kills hung children; feed it process exits with [`process_exited`](Self::process_exited).
    pub async fn start(options: SupervisorOptions, launcher: Option<mpsc::Sender<LaunchRequest>>) -> Result<SupervisorHandle> {
        options.elastic.validate()?;
        let listener = LinkListener::bind(options.listen, options.link.clone())?;
        let seed = protocol::generate_token().map_err(|reason| SupervisorError::JobFailed { reason })?.bytes().fold(0u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        SupervisorHandle::start_with(options, launcher, SupervisorEnv { listener, seed }).await
    }

    /// Starts the supervisor on the current runtime in `env` (see [`SupervisorEnv`]).
    pub async fn start_with(options: SupervisorOptions, launcher: Option<mpsc::Sender<LaunchRequest>>, env: SupervisorEnv) -> Result<SupervisorHandle> {
        options.elastic.validate()?;
        let listener = Arc::new(env.listener);
        let addr = listener.local_addr()?;
        let (events_tx, events) = mpsc::channel(4096);
        let tick = options.elastic.heartbeat_interval.min(Duration::from_millis(100));
        let shape = (options.elastic.pp.max(1), options.elastic.tp.max(1));
        let state = ClusterSupervisor {
            options,
            ca: None,
            events: events_tx,
            launcher,
            connections: BTreeMap::new(),
            members: BTreeMap::new(),
            phase: Phase::Waiting { since: Instant::now() },
            generation: 0,
            started: false,
            committed: None,
            failures: BTreeMap::new(),
            exited: BTreeMap::new(),
            commit_times: Vec::new(),
            run_id: format!("{:016x}", splitmix64(env.seed)),
            stalled: (None, 0),
            last_step_failure: None,
            checkpoint: None,
            shape,
            awaited: 0,
        };
        let (actor, handle) = spawn("supervisor", state, 4096);
        let mut tasks = Vec::new();
        let accept_actor = actor.clone();
        let accept_listener = Arc::clone(&listener);
        tasks.push(tokio::spawn(async move {
            let mut next_conn = 1u64;
            while let Some((link, mut inbound)) = accept_listener.accept().await {
                let conn = next_conn;
                next_conn += 1;
                if accept_actor.send(SupervisorMsg::Connected { conn, link: link.clone() }).await.is_err() {
                    return;
                }
                let forward = accept_actor.clone();
                tokio::spawn(async move {
                    while let Some(msg) = inbound.recv().await {
                        if forward.send(SupervisorMsg::Inbound { conn, msg }).await.is_err() {
                            return;
                        }
                    }
                    let reason = link.closed_reason().unwrap_or_else(|| "link closed".into());
                    let _ = forward.send(SupervisorMsg::LinkLost { conn, reason }).await;
                });
            }
        }));
        let tick_actor = actor.clone();
        tasks.push(tokio::spawn(async move {
            let mut interval = tokio::time::interval(tick);
            loop {
                interval.tick().await;
                if tick_actor.send(SupervisorMsg::Tick).await.is_err() {
                    return;
                }
            }
        }));
        Ok(SupervisorHandle { addr, events, actor, handle, tasks, listener })
    }

    /// Tells the supervisor that a worker process ended.
    pub async fn process_exited(&self, pid: u32, status: String) {
        let _ = self.actor.send(SupervisorMsg::ProcessExited { pid, status }).await;
    }

    /// A sender for process exits (for a launcher task).
    pub fn actor(&self) -> ActorRef<SupervisorMsg> {
        self.actor.clone()
    }

    /// Waits for the supervisor to end; `Ok` when the job finished.
    pub async fn join(self) -> Result<()> {
        let SupervisorHandle { actor, handle, tasks, listener, .. } = self;
        drop(actor);
        let exit = handle.join().await;
        for t in tasks {
            t.abort();
        }
        // Give the last messages (Finish, Evict) a moment to leave before closing.
        tokio::time::sleep(Duration::from_millis(50)).await;
        listener.close();
        match exit {
            Exit::Normal => Ok(()),
            Exit::Failed(reason) | Exit::Panicked(reason) => Err(SupervisorError::JobFailed { reason }),
        }
    }
}

impl Actor for ClusterSupervisor {
    type Msg = SupervisorMsg;

    async fn handle(&mut self, msg: SupervisorMsg, ctx: &mut Context<SupervisorMsg>) -> rtx_actors::Result<()> {
        let result = match msg {
            SupervisorMsg::Connected { conn, link } => {
                self.connections.insert(conn, link);
                Ok(())
            }
            SupervisorMsg::Inbound { conn, msg } => self.on_inbound(conn, msg).await,
            SupervisorMsg::LinkLost { conn, reason } => self.on_link_lost(conn, reason).await,
            SupervisorMsg::ProcessExited { pid, status } => self.on_exit(pid, status).await,
            SupervisorMsg::Tick => self.on_tick().await,
        };
        match result {
            Ok(()) => {
                if matches!(self.phase, Phase::Done) {
                    ctx.stop();
                }
                Ok(())
            }
            Err(e) => {
                let reason = e.to_string();
                tracing::error!(%reason, "job failed");
                self.emit(JobEvent::Failed { reason: reason.clone() }).await;
                for member in self.members.values() {
                    let _ = member.agent.tell(&ToWorker::Evict { reason: format!("job failed: {reason}") }).await;
                }
                Err(rtx_actors::ActorError::Failed { name: "supervisor".into(), reason })
            }
        }
    }
}

impl ClusterSupervisor {
    /// The step after which this run stops.
    fn end_step(&self) -> u64 {
        self.options.stop_at.map_or(self.options.total_steps, |s| s.min(self.options.total_steps))
    }

    async fn emit(&self, event: JobEvent) {
        let _ = self.events.send(event).await;
    }

    fn live_members(&self) -> impl Iterator<Item = (&u64, &Member)> {
        self.members.iter().filter(|(_, m)| !m.leaving && m.finished.is_none())
    }

    async fn on_inbound(&mut self, conn: u64, msg: Inbound) -> Result<()> {
        let decoded = msg.decode::<ToSupervisor>();
        let m = match decoded {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(conn, error = %e, "undecodable message; closing that link");
                if let Some(link) = self.connections.get(&conn) {
                    link.close("undecodable message");
                }
                return Ok(());
            }
        };
        if let Some(member) = self.members.get_mut(&conn) {
            member.last_heard = Instant::now();
        }
        match m {
            ToSupervisor::Join { name, pid, host, proof } => self.on_join(conn, msg, name, pid, host, proof).await,
            ToSupervisor::Status { proof } => {
                let ok = self.connections.get(&conn).and_then(|l| l.export_keying_material(EXPORTER_LABEL).ok()).is_some_and(|ekm| protocol::verify_worker_proof(&self.options.token, &ekm, &proof));
                if ok {
                    let report = self.status();
                    let _ = msg.reply(&report).await;
                } else {
                    let _ = msg.reply_error("wrong cluster token").await;
                }
                Ok(())
            }
            _ if !self.members.contains_key(&conn) => {
                tracing::warn!(conn, "message from a peer that has not joined; closing its link");
                if let Some(link) = self.connections.get(&conn) {
                    link.close("not joined");
                }
                Ok(())
            }
            ToSupervisor::Heartbeat { .. } => Ok(()),
            ToSupervisor::Preparing { node, generation } => {
                if let Phase::Preparing { generation: g, members, acknowledged, .. } = &mut self.phase {
                    if *g == generation && members.contains(&node) && !acknowledged.contains(&node) {
                        acknowledged.push(node);
                    }
                }
                Ok(())
            }
            ToSupervisor::Ready { node, generation, addr, completed, zero1, mesh } => self.on_ready(node, generation, addr, completed, zero1, mesh).await,
            ToSupervisor::StepDone { node, generation, step, loss, samples, checksum } => self.on_step_done(node, generation, step, loss, samples, checksum).await,
            ToSupervisor::StepFailed { node, generation, step, reason } => {
                tracing::info!(node, generation, step, %reason, "step failed on a worker");
                self.last_step_failure = Some(reason);
                if let Phase::Running { generation: g, failed_since, .. } = &mut self.phase {
                    if *g == generation && failed_since.is_none() {
                        *failed_since = Some(Instant::now());
                    }
                }
                Ok(())
            }
            ToSupervisor::Leaving { node, completed, reason } => {
                if let Some(member) = self.members.get_mut(&node) {
                    member.leaving = true;
                    member.completed = completed.or(member.completed);
                    let _ = member.agent.tell(&ToWorker::Evict { reason: "leave acknowledged".into() }).await;
                    let pid = member.pid;
                    self.emit(JobEvent::Lost { node, pid, class: FailureClass::Preemption, reason }).await;
                    self.handle_failure(node, FailureClass::Preemption).await?;
                }
                Ok(())
            }
            ToSupervisor::Finished { node, checksum, eval, compute_s, control_s, loop_s } => {
                if let Some(member) = self.members.get_mut(&node) {
                    member.finished = Some(FinalReport { checksum, eval, timing: [compute_s, control_s, loop_s] });
                }
                self.check_finished().await
            }
            ToSupervisor::Checkpointed { step, path, .. } => {
                if self.checkpoint.as_ref().is_none_or(|(s, _)| step >= *s) {
                    self.checkpoint = Some((step, path.clone()));
                }
                self.emit(JobEvent::Checkpointed { step, path }).await;
                // A mesh waiting to change shape (back after a re-partition) does it from here.
                self.maybe_form().await
            }
            ToSupervisor::CheckpointFailed { step, reason, .. } => {
                self.emit(JobEvent::CheckpointFailed { step, reason }).await;
                Ok(())
            }
        }
    }

    async fn on_join(&mut self, conn: u64, msg: Inbound, name: String, pid: u32, host: String, proof: Vec<u8>) -> Result<()> {
        let Some(link) = self.connections.get(&conn).cloned() else { return Ok(()) };
        let ekm = link.export_keying_material(EXPORTER_LABEL)?;
        let refuse = |reason: &str| JoinReply::Refused { reason: reason.to_string() };
        let reply = if !protocol::verify_worker_proof(&self.options.token, &ekm, &proof) {
            Err(refuse("wrong cluster token"))
        } else if matches!(self.phase, Phase::Finishing { .. } | Phase::Done) {
            Err(refuse("the job is finishing"))
        } else if self.live_members().count() >= self.options.elastic.max_workers {
            Err(refuse(&format!("the job already has max_workers = {} workers", self.options.elastic.max_workers)))
        } else {
            Ok(())
        };
        if let Err(refused) = reply {
            let reason = match &refused {
                JoinReply::Refused { reason } => reason.clone(),
                JoinReply::Accepted { .. } => String::new(),
            };
            tracing::warn!(peer = %link.peer(), %name, %reason, "join refused");
            let _ = msg.reply(&refused).await;
            self.emit(JobEvent::Refused { peer: link.peer().to_string(), reason }).await;
            let closing = link.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(200)).await;
                closing.close("refused");
            });
            return Ok(());
        }
        let node = conn;
        let accepted = JoinReply::Accepted {
            node,
            proof: protocol::supervisor_proof(&self.options.token, &ekm),
            job: self.options.job.clone(),
            heartbeat_ms: self.options.elastic.heartbeat_interval.as_millis() as u64,
            resume: self.options.resume.as_ref().map(|p| p.display().to_string()),
            verify_every: self.options.elastic.verify_every,
            checkpoint_every: self.options.elastic.checkpoint_every,
            sharding: self.options.elastic.sharding,
            snapshot_every: self.options.elastic.snapshot_every,
            run_dir: self.options.run_dir.as_ref().map(|p| p.display().to_string()),
        };
        msg.reply(&accepted).await?;
        tracing::info!(node, %name, pid, %host, "worker joined");
        let agent = link.remote::<ToWorker>(AGENT);
        self.members.insert(node, Member { name: name.clone(), host: host.clone(), pid, link, agent, last_heard: Instant::now(), completed: None, leaving: false, finished: None });
        self.awaited = self.awaited.saturating_sub(1);
        self.emit(JobEvent::Joined { node, name, pid, host }).await;
        self.maybe_form().await
    }

    /// Starts the first generation when enough workers are here, or grows a running job.
    async fn maybe_form(&mut self) -> Result<()> {
        let live = self.live_members().count();
        match &self.phase {
            Phase::Waiting { .. } => {
                let needed = if self.started { self.options.elastic.min_workers } else { self.options.elastic.start_workers };
                if live >= needed {
                    self.reform().await?;
                }
            }
            // A mesh grows by whole replicas only, and into another shape (back to `[parallel]`'s
            // after a re-partition) only from a sharded checkpoint of its newest state.
            Phase::Running { members, .. } if self.options.elastic.mesh_slots() > 1 => {
                let live: Vec<u64> = self.live_members().map(|(n, _)| *n).collect();
                let (candidates, shape) = self.mesh_candidates(members, &live);
                let fresh = self.checkpoint.as_ref().is_some_and(|(step, _)| self.committed.is_none_or(|c| *step >= c));
                if candidates.len() > members.len() && (shape == self.shape || fresh) {
                    tracing::info!(from = members.len(), to = candidates.len(), ?shape, "growing the mesh");
                    self.reform().await?;
                }
            }
            Phase::Running { members, .. } if live.min(self.options.elastic.max_workers) > members.len() => {
                tracing::info!(from = members.len(), to = live.min(self.options.elastic.max_workers), "growing the group");
                self.reform().await?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Forms a new generation from the live members: current members first (in rank order),
    /// then newcomers (by node id).
    async fn reform(&mut self) -> Result<()> {
        let previous: Vec<u64> = match &self.phase {
            Phase::Preparing { members, .. } | Phase::Running { members, .. } => members.clone(),
            _ => Vec::new(),
        };
        let live: Vec<u64> = self.live_members().map(|(n, _)| *n).collect();
        let (candidates, shape) = if self.options.elastic.mesh_slots() > 1 {
            // Whole model replicas only, survivors in their old slots (see `placement`); a world
            // too small for one replica re-partitioned (see `mesh_candidates`).
            self.mesh_candidates(&previous, &live)
        } else {
            let mut candidates: Vec<u64> = previous.iter().copied().filter(|n| live.contains(n)).collect();
            candidates.extend(live.iter().copied().filter(|n| !previous.contains(n)));
            candidates.truncate(self.options.elastic.max_workers);
            (candidates, (1, 1))
        };
        let needed = if self.started { self.options.elastic.min_workers } else { self.options.elastic.start_workers };
        if candidates.len() < needed.max(1) {
            tracing::warn!(have = candidates.len(), needed, "too few workers; waiting for more");
            self.phase = Phase::Waiting { since: Instant::now() };
            // Members still alive must stop training the old generation.
            self.generation += 1;
            for node in &candidates {
                if let Some(m) = self.members.get(node) {
                    let _ = m.agent.tell(&ToWorker::Pause { generation: self.generation }).await;
                }
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
        let world = candidates.len();
        let injected = self.options.elastic.transport == Wire::Injected;
        if self.ca.is_none() && !injected {
            self.ca = Some(ClusterCa::generate("rtx cluster CA")?);
        }
        for (rank, node) in candidates.iter().enumerate() {
            let (ca, cert, key) = match &self.ca {
                Some(ca) if !injected => {
                    let identity = ca.issue(rank)?;
                    let (cert, key) = identity.to_der().ok_or_else(|| SupervisorError::JobFailed { reason: "issued identity is not DER".into() })?;
                    (ca.certificate().to_vec(), cert, key)
                }
                _ => (Vec::new(), Vec::new(), Vec::new()),
            };
            if let Some(m) = self.members.get(node) {
                let _ = m.agent.tell(&ToWorker::Prepare { generation, rank: rank as u32, world: world as u32, ca, cert, key }).await;
            }
        }
        // Live members left out of a mesh generation stand by: they stop the old generation and
        // wait for a later one with room for them.
        for node in live.iter().filter(|n| !candidates.contains(n)) {
            if let Some(m) = self.members.get(node) {
                tracing::info!(node, generation, "standing by: the generation has no whole replica for this member");
                let _ = m.agent.tell(&ToWorker::Pause { generation }).await;
            }
        }
        tracing::info!(generation, world, "preparing generation");
        self.phase = Phase::Preparing { generation, members: candidates, ready: BTreeMap::new(), acknowledged: Vec::new(), since: Instant::now(), extended: false };
        Ok(())
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

    async fn on_ready(&mut self, node: u64, generation: u64, addr: String, completed: Option<u64>, zero1: Vec<Zero1Held>, mesh: Option<MeshHeld>) -> Result<()> {
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
                let (sources, step) = placement::shard_sources(&held, self.shape, checkpoint.or(resumed));
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
            let reason = format!("generation {generation}: every holder of committed step {from} is gone; resuming from {:?} at step {}", recovery.source, recovery.next_step);
            tracing::warn!(generation, from, next_step = recovery.next_step, "{reason}");
            self.emit(JobEvent::Suspect { reason }).await;
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
        for node in &members {
            if let Some(m) = self.members.get(node) {
                let start = ToWorker::Start { generation, addrs: addrs.clone(), source: recovery.source.clone(), next_step, stop_step: self.end_step(), shm_job: shm_job.clone(), mesh: mesh.clone(), host_of: host_of.clone() };
                let _ = m.agent.tell(&start).await;
            }
        }
        let (nodes, pids): (Vec<u64>, Vec<u32>) = members.iter().filter_map(|n| self.members.get(n).map(|m| (*n, m.pid))).unzip();
        tracing::info!(generation, world = members.len(), next_step, source, from = ?recovery.source, "generation started");
        let (pp, tp) = self.shape;
        let shape = (members.len() / (pp * tp), pp, tp);
        let transport = layout.name();
        self.emit(JobEvent::Generation { generation, world: members.len(), next_step, source_node: members.get(source).copied().unwrap_or_default(), nodes, pids, mesh: shape, transport }).await;
        if next_step >= self.end_step() {
            return self.finish(members).await;
        }
        self.phase = Phase::Running { generation, members, reports: BTreeMap::new(), failed_since: None };
        // A worker that joined while this generation was being prepared (a replacement arriving
        // right after the loss it replaces) was not in it: grow the group now.
        self.maybe_form().await
    }

    async fn on_step_done(&mut self, node: u64, generation: u64, step: u64, loss: f64, samples: u64, checksum: Option<u64>) -> Result<()> {
        if let Some(m) = self.members.get_mut(&node) {
            m.completed = Some(step);
        }
        let total = self.end_step();
        let Phase::Running { generation: g, members, reports, .. } = &mut self.phase else { return Ok(()) };
        if *g != generation || !members.contains(&node) {
            return Ok(());
        }
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
        for (step, by_node) in commits {
            let samples: u64 = by_node.values().map(|r| r.1).sum();
            let loss = by_node.values().map(|r| r.0 * r.1 as f64).sum::<f64>() / samples.max(1) as f64;
            let sums: Vec<u64> = by_node.values().filter_map(|r| r.2).collect();
            if sums.len() == by_node.len() && sums.windows(2).any(|w| w[0] != w[1]) {
                return Err(SupervisorError::JobFailed { reason: format!("replicas diverged at step {step}: parameter checksums {sums:x?}") });
            }
            self.committed = Some(step);
            self.commit_times.push((Instant::now(), step, samples));
            if self.commit_times.len() > 64 {
                self.commit_times.remove(0);
            }
            let checksum = if sums.len() == by_node.len() { sums.first().copied() } else { None };
            self.emit(JobEvent::Committed { step, loss, samples, world, generation, checksum }).await;
            if step + 1 >= total {
                return self.finish(members).await;
            }
        }
        Ok(())
    }

    async fn finish(&mut self, members: Vec<u64>) -> Result<()> {
        for node in &members {
            if let Some(m) = self.members.get(node) {
                let _ = m.agent.tell(&ToWorker::Finish).await;
            }
        }
        self.phase = Phase::Finishing { members, since: Instant::now() };
        self.check_finished().await
    }

    async fn check_finished(&mut self) -> Result<()> {
        let Phase::Finishing { members, .. } = &self.phase else { return Ok(()) };
        // By rank: in a mesh, rank r holds slot r mod (pp · tp), and only holders of one slot match.
        let ranked: Vec<(usize, &FinalReport)> = members.iter().enumerate().filter_map(|(r, n)| self.members.get(n).and_then(|m| m.finished.as_ref()).map(|f| (r, f))).collect();
        let reports: Vec<&FinalReport> = ranked.iter().map(|(_, f)| *f).collect();
        let gone = members.iter().filter(|n| self.members.get(n).is_none_or(|m| m.finished.is_none() && m.link.closed_reason().is_some())).count();
        if reports.len() + gone < members.len() {
            return Ok(());
        }
        let slots = self.shape.0 * self.shape.1;
        let replicas_identical = ranked.iter().all(|(r, a)| ranked.iter().filter(|(q, _)| q % slots == r % slots).all(|(_, b)| a.checksum == b.checksum));
        let checksum = reports.first().map_or(0, |r| r.checksum);
        let eval = reports.iter().find(|r| !r.eval.is_empty()).map(|r| r.eval.clone()).unwrap_or_default();
        let sums = reports.iter().fold([0.0; 3], |acc, r| [acc[0] + r.timing[0], acc[1] + r.timing[1], acc[2] + r.timing[2]]);
        let share = |part: f64| if sums[2] > 0.0 { part / sums[2] } else { 0.0 };
        self.emit(JobEvent::Finished { eval, replicas_identical, checksum, overhead: share(sums[1]), outside_steps: share(sums[2] - sums[0]) }).await;
        self.phase = Phase::Done;
        Ok(())
    }

    async fn on_link_lost(&mut self, conn: u64, reason: String) -> Result<()> {
        self.connections.remove(&conn);
        let Some(member) = self.members.get(&conn) else { return Ok(()) };
        if member.finished.is_some() || member.leaving {
            return self.check_finished().await;
        }
        let class = if self.exited.contains_key(&member.pid) { FailureClass::Crash } else { FailureClass::NetworkLoss };
        self.lose(conn, class, format!("connection lost: {reason}")).await
    }

    async fn on_exit(&mut self, pid: u32, status: String) -> Result<()> {
        self.exited.insert(pid, status.clone());
        let found = self.members.iter().find(|(_, m)| m.pid == pid && m.finished.is_none() && !m.leaving).map(|(n, _)| *n);
        match found {
            Some(node) => self.lose(node, FailureClass::Crash, format!("process {pid} exited: {status}")).await,
            None => {
                if matches!(self.phase, Phase::Finishing { .. }) {
                    self.check_finished().await?;
                }
                Ok(())
            }
        }
    }

    /// Removes a member for a failure of `class` and reacts.
    async fn lose(&mut self, node: u64, class: FailureClass, reason: String) -> Result<()> {
        let Some(member) = self.members.remove(&node) else { return Ok(()) };
        tracing::warn!(node, pid = member.pid, ?class, %reason, "member lost");
        if class == FailureClass::Hang {
            let _ = member.agent.tell(&ToWorker::Evict { reason: format!("evicted: {reason}") }).await;
            if let Some(launcher) = &self.launcher {
                let _ = launcher.send(LaunchRequest::Kill { pid: member.pid }).await;
            }
        }
        member.link.close("removed from the job");
        self.emit(JobEvent::Lost { node, pid: member.pid, class, reason }).await;
        if matches!(self.phase, Phase::Finishing { .. }) {
            return self.check_finished().await;
        }
        self.handle_failure(node, class).await
    }

    async fn handle_failure(&mut self, node: u64, class: FailureClass) -> Result<()> {
        let count = self.failures.entry(class).or_insert(0);
        *count += 1;
        let policy = self.options.elastic.policy(class);
        if *count > policy.budget {
            return Err(SupervisorError::JobFailed { reason: format!("{class:?} failures exceeded their budget of {}", policy.budget) });
        }
        if policy.on_failure == OnFailure::Replace {
            if let Some(launcher) = &self.launcher {
                if launcher.send(LaunchRequest::Spawn).await.is_ok() {
                    self.awaited += 1;
                }
            }
        }
        let involved = match &self.phase {
            Phase::Preparing { members, .. } | Phase::Running { members, .. } => members.contains(&node),
            _ => false,
        };
        if involved {
            self.reform().await?;
        }
        Ok(())
    }

    async fn on_tick(&mut self) -> Result<()> {
        let now = Instant::now();
        let timeout = self.options.elastic.heartbeat_timeout;
        let silent: Vec<u64> = self.live_members().filter(|(_, m)| now.duration_since(m.last_heard) > timeout).map(|(n, _)| *n).collect();
        for node in silent {
            self.lose(node, FailureClass::Hang, format!("no heartbeat for {} ms", timeout.as_millis())).await?;
        }
        match &self.phase {
            // Replacements that did not come within the prepare timeout: stop waiting for them
            // (a mesh re-partitions over the members it has).
            Phase::Waiting { since } if self.awaited > 0 && now.duration_since(*since) > self.options.elastic.prepare_timeout => {
                tracing::warn!(awaited = self.awaited, "replacement workers did not join in time; forming with the members there are");
                self.awaited = 0;
                return self.reform().await;
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
                    self.emit(JobEvent::Suspect { reason }).await;
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
                    self.lose(node, FailureClass::Hang, why.into()).await?;
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
                self.reform().await?;
            }
            Phase::Finishing { since, .. } if now.duration_since(*since) > self.options.elastic.prepare_timeout => {
                let late: Vec<u64> = match &self.phase {
                    Phase::Finishing { members, .. } => members.iter().copied().filter(|n| self.members.get(n).is_some_and(|m| m.finished.is_none())).collect(),
                    _ => Vec::new(),
                };
                for node in late {
                    self.members.remove(&node);
                }
                self.check_finished().await?;
            }
            _ => {}
        }
        Ok(())
    }

    fn status(&self) -> StatusReport {
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

/// A 64-bit mix of `seed` (SplitMix64's finalizer): the run id from the supervisor's seed.
fn splitmix64(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49eb_133b_a133);
    z ^ (z >> 31)
}

/// Asks the supervisor at `addr` for its status, proving the token.
pub async fn query_status(addr: SocketAddr, token: &str, options: LinkOptions) -> Result<StatusReport> {
    let (link, _inbound) = Link::dial(addr, options).await?;
    let ekm = link.export_keying_material(EXPORTER_LABEL)?;
    let report = link.remote::<ToSupervisor>(protocol::SUPERVISOR).ask(&ToSupervisor::Status { proof: protocol::worker_proof(token, &ekm) }, Duration::from_secs(10)).await?;
    link.close("status done");
    Ok(report)
}

/// How a generation's collectives move, decided from the configured [`Wire`] and the machine
/// identity each member reported at join (in rank order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum CollectivesLayout {
    /// QUIC between every pair of members.
    Quic,
    /// Shared-memory rings between every pair (every member on one machine).
    Shm,
    /// Shared memory among the members of each machine, QUIC between machines; `host_of` is each
    /// rank's machine, numbered in order of first appearance.
    Routed { host_of: Vec<u32> },
    /// The workers' own wire.
    Injected,
}

impl CollectivesLayout {
    pub(crate) fn choose(wire: Wire, hosts: &[&str]) -> CollectivesLayout {
        let mut index: BTreeMap<&str, u32> = BTreeMap::new();
        let host_of: Vec<u32> = hosts
            .iter()
            .map(|h| {
                let next = index.len() as u32;
                *index.entry(h).or_insert(next)
            })
            .collect();
        let machines = index.len();
        let shared_machine = machines < hosts.len();
        match wire {
            Wire::Quic => CollectivesLayout::Quic,
            Wire::Injected => CollectivesLayout::Injected,
            Wire::Shm => CollectivesLayout::Shm,
            Wire::Auto if machines == 1 && hosts.len() > 1 => CollectivesLayout::Shm,
            Wire::Auto if machines > 1 && shared_machine => CollectivesLayout::Routed { host_of },
            Wire::Auto => CollectivesLayout::Quic,
        }
    }

    pub(crate) fn name(&self) -> &'static str {
        match self {
            CollectivesLayout::Quic => "quic",
            CollectivesLayout::Shm => "shm",
            CollectivesLayout::Routed { .. } => "routed",
            CollectivesLayout::Injected => "injected",
        }
    }
}

#[cfg(test)]
mod layout_tests {
    use super::*;

    #[test]
    fn collectives_layout_follows_the_members_machines() {
        let routed = |h: &[u32]| CollectivesLayout::Routed { host_of: h.to_vec() };
        assert_eq!(CollectivesLayout::choose(Wire::Auto, &["a", "a"]), CollectivesLayout::Shm);
        assert_eq!(CollectivesLayout::choose(Wire::Auto, &["a"]), CollectivesLayout::Quic);
        assert_eq!(CollectivesLayout::choose(Wire::Auto, &["a", "b", "c"]), CollectivesLayout::Quic);
        // Machines numbered in rank order of first appearance, whatever their names sort to.
        assert_eq!(CollectivesLayout::choose(Wire::Auto, &["z", "z", "b", "b"]), routed(&[0, 0, 1, 1]));
        assert_eq!(CollectivesLayout::choose(Wire::Auto, &["b", "z", "b", "y"]), routed(&[0, 1, 0, 2]));
        assert_eq!(CollectivesLayout::choose(Wire::Quic, &["a", "a", "b"]), CollectivesLayout::Quic);
        assert_eq!(CollectivesLayout::choose(Wire::Shm, &["a", "b"]), CollectivesLayout::Shm);
        assert_eq!(CollectivesLayout::choose(Wire::Injected, &["a", "a"]), CollectivesLayout::Injected);
    }
}
