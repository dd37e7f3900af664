//! The `ClusterSupervisor`: admits workers, forms generations, detects failures and re-forms the
//! group, commits steps, and ends the job. It runs as one actor ([`rtx_actors::Actor`]) whose
//! mailbox is fed by the link listener, one forwarder per link, a ticker and the launcher. The
//! actor is a shell: every decision is taken by the pure [`crate::decide::SupervisorCore`]
//! (`(state, input, now) -> commands`, no I/O, no awaits), in message order, and the shell carries
//! the commands out (tells, `Prepare` with a freshly issued certificate, events, launcher requests,
//! link closes) before it takes the next message. Members live in a `BTreeMap` by node id, so
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

use crate::config::{DataTransport, ElasticConfig, FailureClass, Wire};
use crate::decide::{Command, Input, SupervisorCore};
use crate::error::{Result, SupervisorError};
use crate::protocol::{self, JoinReply, StatusReport, ToSupervisor, ToWorker, AGENT, EXPORTER_LABEL};

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
    /// memory inside each machine and QUIC between machines, or `injected`; with
    /// `[elastic] data_transport = "tls"`, `tls` and `routed-tls` for the two network layouts).
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


/// The async shell around [`SupervisorCore`]: it owns the links, the certificate authority, the
/// event channel and the launcher, turns link traffic into the core's inputs and carries out its
/// commands in order.
struct ClusterSupervisor {
    core: SupervisorCore,
    /// Made on first use: an injected wire needs no certificates.
    ca: Option<ClusterCa>,
    events: mpsc::Sender<JobEvent>,
    launcher: Option<mpsc::Sender<LaunchRequest>>,
    /// Every control link by connection id (a joined member's node id is its connection id).
    connections: BTreeMap<u64, Link>,
    /// Joined members' agents.
    agents: BTreeMap<u64, RemoteRef<ToWorker>>,
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
        let run_id = format!("{:016x}", splitmix64(env.seed));
        let core = SupervisorCore::new(options, run_id, launcher.is_some(), Instant::now());
        let state = ClusterSupervisor { core, ca: None, events: events_tx, launcher, connections: BTreeMap::new(), agents: BTreeMap::new() };
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
        let now = Instant::now();
        let mut result = match msg {
            SupervisorMsg::Connected { conn, link } => {
                self.connections.insert(conn, link);
                Ok(())
            }
            SupervisorMsg::Inbound { conn, msg } => self.on_inbound(conn, msg, now).await,
            SupervisorMsg::LinkLost { conn, reason } => {
                self.connections.remove(&conn);
                self.core.handle(Input::LinkLost { node: conn, reason }, now)
            }
            SupervisorMsg::ProcessExited { pid, status } => self.core.handle(Input::ProcessExited { pid, status }, now),
            SupervisorMsg::Tick => self.core.handle(Input::Tick, now),
        };
        if result.is_ok() {
            result = self.carry_out().await;
        }
        match result {
            Ok(()) => {
                if self.core.is_done() {
                    ctx.stop();
                }
                Ok(())
            }
            Err(e) => {
                let reason = e.to_string();
                self.core.fail(&reason);
                let _ = self.carry_out().await;
                Err(rtx_actors::ActorError::Failed { name: "supervisor".into(), reason })
            }
        }
    }
}

impl ClusterSupervisor {
    /// Carries out the core's commands, in order.
    async fn carry_out(&mut self) -> Result<()> {
        for command in self.core.take_commands() {
            match command {
                Command::Tell { node, msg } => {
                    if let Some(agent) = self.agents.get(&node) {
                        let _ = agent.tell(&msg).await;
                    }
                }
                Command::Prepare { node, generation, rank, world } => {
                    let (ca, cert, key) = self.identity(rank as usize)?;
                    if let Some(agent) = self.agents.get(&node) {
                        let _ = agent.tell(&ToWorker::Prepare { generation, rank, world, ca, cert, key }).await;
                    }
                }
                Command::Emit(event) => {
                    let _ = self.events.send(event).await;
                }
                Command::Launch(request) => {
                    if let Some(launcher) = &self.launcher {
                        let _ = launcher.send(request).await;
                    }
                }
                Command::Close { node, reason } => {
                    self.agents.remove(&node);
                    if let Some(link) = self.connections.get(&node) {
                        link.close(&reason);
                    }
                }
            }
        }
        Ok(())
    }

    /// The CA certificate, and the certificate and key of `rank` (DER), for `Prepare`; empty on an
    /// injected wire.
    fn identity(&mut self, rank: usize) -> Result<(Vec<u8>, Vec<u8>, Vec<u8>)> {
        if self.core.options().elastic.transport == Wire::Injected {
            return Ok((Vec::new(), Vec::new(), Vec::new()));
        }
        let ca = match &mut self.ca {
            Some(ca) => ca,
            none => none.insert(ClusterCa::generate("rtx cluster CA")?),
        };
        let identity = ca.issue(rank)?;
        let (cert, key) = identity.to_der().ok_or_else(|| SupervisorError::JobFailed { reason: "issued identity is not DER".into() })?;
        Ok((ca.certificate().to_vec(), cert, key))
    }

    async fn emit(&self, event: JobEvent) {
        let _ = self.events.send(event).await;
    }

    async fn on_inbound(&mut self, conn: u64, msg: Inbound, now: Instant) -> Result<()> {
        let m = match msg.decode::<ToSupervisor>() {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(conn, error = %e, "undecodable message; closing that link");
                if let Some(link) = self.connections.get(&conn) {
                    link.close("undecodable message");
                }
                return Ok(());
            }
        };
        match m {
            ToSupervisor::Join { name, pid, host, proof } => self.on_join(conn, msg, name, pid, host, proof, now).await,
            ToSupervisor::Status { proof } => {
                let ok = self.connections.get(&conn).and_then(|l| l.export_keying_material(EXPORTER_LABEL).ok()).is_some_and(|ekm| protocol::verify_worker_proof(&self.core.options().token, &ekm, &proof));
                if ok {
                    let _ = msg.reply(&self.core.status()).await;
                } else {
                    let _ = msg.reply_error("wrong cluster token").await;
                }
                Ok(())
            }
            _ if !self.core.is_member(conn) => {
                tracing::warn!(conn, "message from a peer that has not joined; closing its link");
                if let Some(link) = self.connections.get(&conn) {
                    link.close("not joined");
                }
                Ok(())
            }
            other => self.core.handle(Input::Message { node: conn, msg: other }, now),
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn on_join(&mut self, conn: u64, msg: Inbound, name: String, pid: u32, host: String, proof: Vec<u8>, now: Instant) -> Result<()> {
        let Some(link) = self.connections.get(&conn).cloned() else { return Ok(()) };
        let ekm = link.export_keying_material(EXPORTER_LABEL)?;
        let options = self.core.options().clone();
        let admitted = if protocol::verify_worker_proof(&options.token, &ekm, &proof) {
            // Admitted before the reply is sent; the commands it decides leave after the reply.
            self.agents.insert(conn, link.remote::<ToWorker>(AGENT));
            self.core.join(conn, name.clone(), pid, host, now)
        } else {
            Ok(Err("wrong cluster token".to_string()))
        };
        match admitted {
            Ok(Err(reason)) => {
                self.agents.remove(&conn);
                tracing::warn!(peer = %link.peer(), %name, %reason, "join refused");
                let _ = msg.reply(&JoinReply::Refused { reason: reason.clone() }).await;
                self.emit(JobEvent::Refused { peer: link.peer().to_string(), reason }).await;
                let closing = link.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    closing.close("refused");
                });
                Ok(())
            }
            decided => {
                let accepted = JoinReply::Accepted {
                    node: conn,
                    proof: protocol::supervisor_proof(&options.token, &ekm),
                    job: options.job.clone(),
                    heartbeat_ms: options.elastic.heartbeat_interval.as_millis() as u64,
                    resume: options.resume.as_ref().map(|p| p.display().to_string()),
                    verify_every: options.elastic.verify_every,
                    checkpoint_every: options.elastic.checkpoint_every,
                    sharding: options.elastic.sharding,
                    snapshot_every: options.elastic.snapshot_every,
                    zero_copies: options.elastic.zero_copies,
                    data_transport: options.elastic.data_transport,
                    // `ElasticConfig::validate` (run at start) holds it within 1..=16, so it fits.
                    channels: u32::try_from(options.elastic.channels).unwrap_or(1),
                    connections: u32::try_from(options.elastic.connections).unwrap_or(1),
                    run_dir: options.run_dir.as_ref().map(|p| p.display().to_string()),
                };
                msg.reply(&accepted).await?;
                decided.map(|_| ())
            }
        }
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

    /// The layout's name in `JobEvent::Generation`, with what crosses processes: the QUIC names
    /// stay what they were before TLS was a choice ("routed", not "routed-quic"), so existing
    /// event readers see no change.
    pub(crate) fn name(&self, data: DataTransport) -> &'static str {
        match (self, data) {
            (CollectivesLayout::Quic, DataTransport::Quic) => "quic",
            (CollectivesLayout::Quic, DataTransport::Tls) => "tls",
            (CollectivesLayout::Shm, _) => "shm",
            (CollectivesLayout::Routed { .. }, DataTransport::Quic) => "routed",
            (CollectivesLayout::Routed { .. }, DataTransport::Tls) => "routed-tls",
            (CollectivesLayout::Injected, _) => "injected",
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

    #[test]
    fn layout_names_tell_what_crosses_processes() {
        let names = |data| [CollectivesLayout::Quic, CollectivesLayout::Shm, CollectivesLayout::Routed { host_of: vec![0, 0, 1] }, CollectivesLayout::Injected].map(|l| l.name(data));
        assert_eq!(names(DataTransport::Quic), ["quic", "shm", "routed", "injected"]);
        assert_eq!(names(DataTransport::Tls), ["tls", "shm", "routed-tls", "injected"]);
    }
}
