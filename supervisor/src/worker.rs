//! The worker side of an elastic job: a node agent and its worker.
//!
//! - The **node agent** (async, on the process's tokio runtime) owns the link to the supervisor:
//!   it joins with the token proof, sends heartbeats, receives commands, and on `Prepare` or
//!   `Evict` aborts the current generation at once (moves its communicator to the new generation
//!   and closes its transport, so a collective blocked on a dead peer returns instead of waiting
//!   for its timeout). It catches SIGTERM (preemption): the worker then finishes its step and
//!   leaves gracefully. When the supervisor is lost, the agent aborts everything and the process
//!   exits with [`SupervisorError::SupervisorLost`]: no orphan keeps training alone.
//! - The **worker** (a dedicated thread: forward and backward are CPU-bound) owns the model
//!   replica and optimizer. Per generation it binds a collectives endpoint with the rank
//!   certificate it was given (QUIC, or TLS over TCP with `[elastic] data_transport = "tls"`),
//!   answers `Ready` with the last step it completed, and on `Start` takes the newest state from
//!   the source rank (parameters and optimizer state, broadcast), builds the generation's engine
//!   ([`DataParallel`] in `dp.rs`, ZeRO-3 in `fsdp.rs`, the mesh in `mesh.rs`) and trains it
//!   through the one step loop of `steps.rs`, which drives any [`rtx_pipelines::Engine`] and
//!   reports each step. A step that fails (a peer died) leaves the parameters at the last
//!   completed step: in plain data parallelism every collective precedes the optimizer update, so
//!   a failed step changes nothing.
//! - The worker's **data shard** ([`DataShard`]) prefetches the next batch. Batches are indexed
//!   by global step, so a new world size reassigns samples without skipping or repeating any.
//!
//! Where a node meets the world is a [`NodeEnv`]: [`NodeEnv::process`] is a real process (QUIC to
//! the supervisor, QUIC, TLS-over-TCP or shared-memory collectives, the worker on its own OS
//! thread, SIGTERM).
//! An embedder such as the deterministic simulator hands in its own control dialer
//! ([`ControlDialer`]), collectives wire ([`GenerationWire`]) and [`Exec::Task`]: the worker then
//! runs as part of the node's task (compute inline), its data shard and DP engine without threads,
//! so the whole node lives on the caller's runtime and dies with its task. The worker is one async
//! function either way; only where it is polled differs. All time is `tokio::time`.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rtx_actors::{DataShard, Inbound, Link, LinkOptions, RemoteRef};
use rtx_collectives::{BoxFuture, CommConfig, Communicator, Endpoint, NodeIdentity, MAX_CHANNELS, MAX_STRIPES, QuicOptions, QuicTransport, RoutedTransport, ShmOptions, ShmTransport, TlsOptions, TlsTransport, Transport, WORLD_GROUP_ID};
use tokio::sync::mpsc::{Receiver, Sender};
use tracing::Instrument;
use rtx_pipelines::{ComputeDriver, DataParallel, DpConfig, Sharding};

mod dp;
mod fsdp;
mod mesh;
mod steps;
use rtx_tensor::{Module, Optimizer, Tensor};

use crate::config::{DataTransport, DpSharding, ZeroCopies};
use crate::checkpoint::{self, CheckpointStore, CheckpointWriter, FileStore, WriteMode};
use crate::error::{Result, SupervisorError};
use crate::job::TrainJob;
use crate::state;
use crate::protocol::{self, JoinReply, StateSource, ToSupervisor, ToWorker, EXPORTER_LABEL, SUPERVISOR};
use crate::zero1::{self, BuddyCopies};

/// How a worker process joins and behaves.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    /// The supervisor's control address.
    pub join: SocketAddr,
    /// The cluster token.
    pub token: String,
    /// This worker's name (host and process, for status).
    pub name: String,
    /// The address collectives endpoints bind to (port chosen per generation).
    pub bind_ip: IpAddr,
    /// Control-link tuning.
    pub link: LinkOptions,
    /// Collectives transport tuning.
    pub quic: QuicOptions,
}

/// What the job description handed over at join says, for building the job.
#[derive(Clone, Debug)]
pub struct JobSpec {
    /// This worker's node id.
    pub node: u64,
    /// The job description (TOML text).
    pub job: String,
    /// A checkpoint to resume from.
    pub resume: Option<PathBuf>,
    /// The supervisor's output folder (checkpoints go to `<it>/checkpoints`, see
    /// [`checkpoint_folder`]); `None` when the supervisor has none.
    pub run_dir: Option<PathBuf>,
}

/// How a worker ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkerOutcome {
    /// Training completed.
    Finished,
    /// The supervisor removed this worker (after a hang, or as the answer to a graceful leave).
    Evicted(String),
}

impl WorkerOptions {
    /// Options for joining `join` with `token`, everything else default (loopback binding).
    pub fn new(join: SocketAddr, token: String, name: String) -> Self {
        WorkerOptions { join, token, name, bind_ip: IpAddr::V4(Ipv4Addr::LOCALHOST), link: LinkOptions::default(), quic: QuicOptions::default() }
    }
}

/// Commands queued from the agent to its worker (the supervisor sends a handful per generation).
const COMMAND_QUEUE: usize = 64;
/// How long a gracefully leaving worker waits for the supervisor's acknowledgement.
const LEAVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Dials the supervisor's control link (an embedder's replacement for QUIC).
pub trait ControlDialer: Send + Sync + 'static {
    /// A new link to the supervisor and the receiver of what arrives on it.
    fn dial(&self) -> BoxFuture<'_, Result<(Link, Receiver<Inbound>)>>;
}

/// The collectives transport of each generation (an embedder's replacement for QUIC and shm).
pub trait GenerationWire: Send + Sync + 'static {
    /// Prepares this node's endpoint as `rank` of `world` in `generation`; returns the address
    /// it reports in `Ready`.
    fn bind(&self, node: u64, generation: u64, rank: usize, world: usize) -> Result<String>;
    /// Connects to every member once `Start` named their addresses (in rank order).
    fn connect(&self, node: u64, generation: u64, rank: usize, addrs: &[String]) -> BoxFuture<'_, Result<Arc<dyn Transport>>>;
}

/// Where a worker's compute runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exec {
    /// A dedicated OS thread (forward and backward are CPU-bound), with the DP engine's
    /// communication thread and a prefetching data shard: production.
    Thread,
    /// Inline in the node's task on the caller's runtime, no threads at all: the simulator.
    Task,
}

/// Environment variable naming the machine a worker process reports at join, instead of
/// `hostname/boot id`: the supervisor gives members that report the same machine shared-memory
/// rings among themselves. Set it where that default is wrong: containers or network namespaces
/// that share one kernel but must not share memory (each its own value), or one machine whose
/// workers report different host names.
pub const HOST_ID_ENV: &str = "RTX_HOST_ID";

/// How a node meets the world; see the module doc.
#[derive(Clone)]
pub struct NodeEnv {
    /// Dials the supervisor; `None`: QUIC to [`WorkerOptions::join`].
    pub control: Option<Arc<dyn ControlDialer>>,
    /// The collectives wire; `None`: QUIC, or shared memory when the supervisor says so.
    pub wire: Option<Arc<dyn GenerationWire>>,
    /// Where compute runs.
    pub exec: Exec,
    /// The process id reported at join.
    pub pid: u32,
    /// The host identity reported at join (co-location); `None`: this machine's.
    pub host: Option<String>,
    /// Whether SIGTERM means a graceful leave.
    pub watch_sigterm: bool,
    /// Where rank 0's checkpoints go; `None`: files in the job's checkpoint folder (if any).
    /// An injected store is called inline in [`Exec::Task`] mode, on a thread otherwise.
    pub checkpoints: Option<Arc<dyn CheckpointStore>>,
    /// How a model-parallel member's compute threads start and wait for communication; `None`:
    /// OS threads blocking on the worker's runtime ([`rtx_pipelines::RuntimeDriver`]). The
    /// simulator hands in its baton driver.
    pub compute: Option<Arc<dyn ComputeDriver>>,
}

impl NodeEnv {
    /// A real worker process. Its host identity is [`HOST_ID_ENV`] when set, else this machine's.
    pub fn process() -> NodeEnv {
        let host = std::env::var(HOST_ID_ENV).ok().filter(|h| !h.trim().is_empty());
        NodeEnv { control: None, wire: None, exec: Exec::Thread, pid: std::process::id(), host, watch_sigterm: true, checkpoints: None, compute: None }
    }
}

impl std::fmt::Debug for NodeEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeEnv").field("custom_control", &self.control.is_some()).field("custom_wire", &self.wire.is_some()).field("exec", &self.exec).field("pid", &self.pid).field("host", &self.host).field("custom_checkpoints", &self.checkpoints.is_some()).field("custom_compute", &self.compute.is_some()).finish()
    }
}

/// Aborts a task when dropped: a node's helper tasks die with the node.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The current generation's abort handle, shared by agent and worker: its communicator and the
/// transport under it, whatever the wire (QUIC, shared memory, an embedder's), and the newest
/// generation the agent was told about. A generation registered after the agent already moved
/// past it is aborted on registration (the `Prepare` overtook the `Start` on the compute path).
struct AbortSlot(Mutex<SlotState>, tokio::sync::watch::Sender<u64>);

impl Default for AbortSlot {
    fn default() -> Self {
        AbortSlot(Mutex::new(SlotState::default()), tokio::sync::watch::Sender::new(0))
    }
}

#[derive(Default)]
struct SlotState {
    current: Option<(Communicator, Arc<dyn Transport>)>,
    newest: u64,
}

impl SlotState {
    fn abort_current(&self) {
        if let Some((comm, transport)) = &self.current {
            if self.newest > comm.generation() {
                let _ = comm.set_generation(self.newest);
            }
            transport.abort();
        }
    }
}

impl AbortSlot {
    fn set(&self, comm: Communicator, transport: Arc<dyn Transport>) {
        let mut slot = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let stale = slot.newest > comm.generation();
        slot.current = Some((comm, transport));
        if stale {
            slot.abort_current();
        }
    }

    fn clear(&self) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).current.take();
    }

    /// Runs `work` for `generation` unless the agent moves past it first: then the work is
    /// dropped (a transport still connecting to a peer that died is abandoned, not waited for)
    /// and the answer is [`SupervisorError::Superseded`].
    async fn unless_superseded<T>(&self, generation: u64, work: impl Future<Output = Result<T>>) -> Result<T> {
        let mut newest = self.1.subscribe();
        let superseded = async {
            let newer = newest.wait_for(|&n| n > generation).await.map(|n| *n);
            match newer {
                Ok(n) => n,
                Err(_) => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            newer = superseded => Err(SupervisorError::Superseded { generation, newer }),
            result = work => result,
        }
    }

    /// Fails the current generation's operations now: receives through the generation bump,
    /// sends (a writer waiting for ring space or flow control of a dead or stopped peer) through
    /// the transport's abort. Never waits on the compute path.
    fn abort(&self, generation: u64) {
        let mut slot = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        slot.newest = slot.newest.max(generation);
        self.1.send_replace(slot.newest);
        if slot.current.as_ref().is_some_and(|(comm, _)| generation > comm.generation()) {
            slot.abort_current();
        }
    }
}

/// Where this worker's checkpoints go: `<run_dir>/checkpoints`, created here and probed with a
/// test write, so a folder this process cannot use is found at join rather than at the first
/// checkpoint. `origin` names where `run_dir` came from (for the message). When the folder is
/// unusable (another machine's folder without a shared filesystem, no permission, a full disk)
/// the worker warns once, loudly, with the reason, and trains without writing checkpoints; so it
/// does without a folder at all.
pub fn checkpoint_folder(run_dir: Option<&Path>, origin: &str) -> Option<PathBuf> {
    let Some(run_dir) = run_dir else {
        tracing::warn!(origin, "NO CHECKPOINTS will be written by this worker: it has no run folder (the supervisor handed none and RTX_RUN_DIR is not set)");
        return None;
    };
    let dir = run_dir.join("checkpoints");
    // Unique per call: workers that share a process (embedded, in-process) probe the same folder
    // at once, and one's remove must not find the other's file gone.
    static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let probe = dir.join(format!(".write-probe-{}-{}", std::process::id(), PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
    let usable = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&probe, b"probe")).and_then(|()| std::fs::remove_file(&probe));
    match usable {
        Ok(()) => {
            tracing::info!(folder = %dir.display(), origin, "checkpoints go to the run folder");
            Some(dir)
        }
        Err(error) => {
            tracing::warn!(folder = %dir.display(), origin, %error, "NO CHECKPOINTS will be written by this worker: it cannot write the run folder's checkpoint folder (no shared filesystem between the nodes? set RTX_RUN_DIR to a folder every node can write)");
            None
        }
    }
}

/// Joins the supervisor at `options.join`, builds the job with `make_job` from the description
/// the supervisor hands over, and trains until the job finishes or this worker is evicted.
pub async fn run_worker<J, F>(options: WorkerOptions, make_job: F) -> Result<WorkerOutcome>
where
    J: TrainJob,
    F: FnOnce(&JobSpec) -> std::result::Result<J, String> + Send + 'static,
{
    run_node(options, NodeEnv::process(), make_job).await
}

/// [`run_worker`] in a given [`NodeEnv`]. Dropping the future (aborting its task) ends the node:
/// in [`Exec::Task`] mode every task it owns goes with it.
pub async fn run_node<J, F>(options: WorkerOptions, env: NodeEnv, make_job: F) -> Result<WorkerOutcome>
where
    J: TrainJob,
    F: FnOnce(&JobSpec) -> std::result::Result<J, String> + Send + 'static,
{
    let (link, mut inbound) = match &env.control {
        Some(dialer) => dialer.dial().await?,
        None => Link::dial(options.join, options.link.clone()).await?,
    };
    let ekm = link.export_keying_material(EXPORTER_LABEL)?;
    let supervisor = link.remote::<ToSupervisor>(SUPERVISOR);
    let host = env.host.clone().or_else(machine_identity).unwrap_or_else(|| options.bind_ip.to_string());
    let join = ToSupervisor::Join { name: options.name.clone(), pid: env.pid, host, proof: protocol::worker_proof(&options.token, &ekm) };
    let reply: JoinReply = supervisor.ask(&join, Duration::from_secs(30)).await?;
    let (node, job_text, heartbeat, (resume, run_dir), (verify_every, checkpoint_every, sharding, snapshot_every, zero_copies, data_transport, channels, connections)) = match reply {
        JoinReply::Accepted { node, proof, job, heartbeat_ms, resume, verify_every, checkpoint_every, sharding, snapshot_every, zero_copies, data_transport, channels, connections, run_dir } => {
            if !protocol::verify_supervisor_proof(&options.token, &ekm, &proof) {
                link.close("supervisor not authentic");
                return Err(SupervisorError::NotAuthentic { addr: options.join.to_string() });
            }
            let channels = count_from_supervisor("channels", channels, MAX_CHANNELS)?;
            let connections = count_from_supervisor("connections", connections, MAX_STRIPES)?;
            (node, job, Duration::from_millis(heartbeat_ms.max(10)), (resume.map(PathBuf::from), run_dir.map(PathBuf::from)), (verify_every, checkpoint_every, sharding, snapshot_every, zero_copies, data_transport, channels, connections))
        }
        JoinReply::Refused { reason } => return Err(SupervisorError::Refused { reason }),
    };
    tracing::info!(node, supervisor = %options.join, "joined");

    let shared = Arc::new(Shared { completed: Mutex::new(None), generation: Mutex::new(0), preempt: AtomicBool::new(false), abort: AbortSlot::default(), stale_logged: AtomicBool::new(false) });
    let heartbeats = AbortOnDrop(tokio::spawn(heartbeat_loop(supervisor.clone(), node, heartbeat, Arc::clone(&shared))));

    let (cmd_tx, cmd_rx) = tokio::sync::mpsc::channel::<ToWorker>(COMMAND_QUEUE);
    let ctx = WorkerCtx { node, supervisor: supervisor.clone(), shared: Arc::clone(&shared), bind_ip: options.bind_ip, quic: options.quic.clone(), wire: env.wire.clone(), checkpoints: env.checkpoints.clone(), exec: env.exec, compute: env.compute.clone(), verify_every, checkpoint_every, sharding, snapshot_every, zero_copies, data_transport, channels, connections, timing: Mutex::new((0.0, 0.0, 0.0)) };
    let spec = JobSpec { node, job: job_text, resume, run_dir };
    let worker = async move {
        let job = make_job(&spec).map_err(SupervisorError::Job)?;
        worker_main(ctx, Arc::new(job), spec.resume, cmd_rx).await
    };
    let done: Pin<Box<dyn Future<Output = Result<WorkerOutcome>> + Send>> = match env.exec {
        Exec::Task => Box::pin(worker.instrument(tracing::info_span!("worker", node))),
        Exec::Thread => {
            let (done_tx, done_rx) = tokio::sync::oneshot::channel();
            let runtime = tokio::runtime::Handle::current();
            std::thread::Builder::new()
                .name(format!("worker-{node}"))
                .spawn(move || {
                    let _ = done_tx.send(runtime.block_on(worker));
                })
                .map_err(|e| SupervisorError::Launch(format!("cannot start the worker thread: {e}")))?;
            Box::pin(async move { done_rx.await.unwrap_or_else(|_| Err(SupervisorError::Job("the worker thread ended without a result".into()))) })
        }
    };

    let outcome = agent_loop(AgentCtx { link: &link, supervisor: &supervisor, node, shared: &shared, watch_sigterm: env.watch_sigterm }, &mut inbound, cmd_tx, done).await;
    drop(heartbeats);
    // Let the last reports leave before the connection closes.
    tokio::time::sleep(Duration::from_millis(20)).await;
    link.close("worker done");
    outcome
}

struct Shared {
    completed: Mutex<Option<u64>>,
    generation: Mutex<u64>,
    preempt: AtomicBool,
    abort: AbortSlot,
    /// Whether a stale-generation failure was logged at warn level already (see
    /// [`Shared::log_failure`]).
    stale_logged: AtomicBool,
}

impl Shared {
    /// Logs a failed step or generation (`what`). A failure that only says the supervisor moved
    /// to a newer generation (it aborted this one: every re-formation does that to every
    /// member's step in flight) is a warning the first time in this worker and a debug line
    /// after, so a long job's log is not one such line per member per re-formation; any other
    /// failure is always a warning.
    fn log_failure(&self, what: &str, step: u64, error: &dyn std::fmt::Display, stale: bool) {
        if stale && self.stale_logged.swap(true, Ordering::Relaxed) {
            tracing::debug!(step, %error, "{what}");
        } else {
            tracing::warn!(step, %error, "{what}");
        }
    }
}

/// Whether `error` only says that a newer generation replaced the one the operation belonged to.
fn is_stale_generation(error: &SupervisorError) -> bool {
    use rtx_collectives::Error as Comm;
    match error {
        SupervisorError::Superseded { .. } => true,
        SupervisorError::Collectives(Comm::StaleGeneration { .. }) => true,
        SupervisorError::DataParallel(e) => is_stale_engine_failure(e),
        _ => false,
    }
}

/// Whether an engine's failure is a collective of a replaced generation.
fn is_stale_engine_failure(error: &rtx_pipelines::Error) -> bool {
    use rtx_collectives::Error as Comm;
    matches!(error, rtx_pipelines::Error::Collective { source: Comm::StaleGeneration { .. }, .. } | rtx_pipelines::Error::Connect(Comm::StaleGeneration { .. }))
}

async fn heartbeat_loop(supervisor: RemoteRef<ToSupervisor>, node: u64, every: Duration, shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let completed = *shared.completed.lock().unwrap_or_else(PoisonError::into_inner);
        let generation = *shared.generation.lock().unwrap_or_else(PoisonError::into_inner);
        if supervisor.tell(&ToSupervisor::Heartbeat { node, generation, completed }).await.is_err() {
            return;
        }
    }
}

/// What the node agent's loop works with.
struct AgentCtx<'a> {
    link: &'a Link,
    supervisor: &'a RemoteRef<ToSupervisor>,
    node: u64,
    shared: &'a Shared,
    watch_sigterm: bool,
}

/// The node agent: the control path. It never waits on the compute path: commands are aborts
/// and acknowledgements here, and queued for the worker.
async fn agent_loop(agent: AgentCtx<'_>, inbound: &mut Receiver<Inbound>, cmd_tx: Sender<ToWorker>, mut done: Pin<Box<dyn Future<Output = Result<WorkerOutcome>> + Send>>) -> Result<WorkerOutcome> {
    let AgentCtx { link, supervisor, node, shared, watch_sigterm } = agent;
    let mut sigterm = if watch_sigterm { Some(tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(|e| SupervisorError::Launch(format!("cannot watch SIGTERM: {e}")))?) } else { None };
    let mut cmd_tx = Some(cmd_tx);
    loop {
        let terminated = async {
            match sigterm.as_mut() {
                Some(signal) => signal.recv().await,
                None => std::future::pending().await,
            }
        };
        // Biased: branch order must not come from tokio's random choice (determinism).
        tokio::select! {
            biased;
            result = &mut done => {
                return result;
            }
            _ = terminated => {
                tracing::info!("SIGTERM: leaving after the current step");
                shared.preempt.store(true, Ordering::SeqCst);
            }
            msg = inbound.recv() => {
                let Some(msg) = msg else {
                    // The supervisor is gone: stop everything, then report why.
                    let reason = link.closed_reason().unwrap_or_else(|| "link closed".into());
                    tracing::warn!(%reason, "lost the supervisor; shutting down");
                    shared.abort.abort(u64::MAX);
                    drop(cmd_tx.take());
                    let _ = tokio::time::timeout(LEAVE_TIMEOUT, &mut done).await;
                    return Err(SupervisorError::SupervisorLost { reason });
                };
                let cmd = match msg.decode::<ToWorker>() {
                    Ok(cmd) => cmd,
                    Err(e) => {
                        tracing::warn!(error = %e, "undecodable command from the supervisor; ignored");
                        continue;
                    }
                };
                match &cmd {
                    ToWorker::Prepare { generation, .. } | ToWorker::Pause { generation } => {
                        *shared.generation.lock().unwrap_or_else(PoisonError::into_inner) = *generation;
                        shared.abort.abort(*generation);
                        if matches!(cmd, ToWorker::Prepare { .. }) {
                            // The control path answers at once: alive, old generation aborted.
                            let _ = supervisor.tell(&ToSupervisor::Preparing { node, generation: *generation }).await;
                        }
                    }
                    ToWorker::Evict { .. } => shared.abort.abort(u64::MAX),
                    // Not aborted: `Finish` comes after the last step, or right after a `Start`
                    // whose next step is past the end, while the members still take the source's
                    // state by broadcast; aborting that left a late joiner with its initial
                    // parameters (found by the simulator's seed swarm).
                    ToWorker::Finish => {}
                    ToWorker::Start { .. } => {}
                }
                let Some(tx) = cmd_tx.as_ref() else { continue };
                // The worker takes commands between steps; a full queue means it is far behind.
                match tx.try_send(cmd) {
                    Ok(()) => {}
                    Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => cmd_tx = None,
                    Err(tokio::sync::mpsc::error::TrySendError::Full(_)) => {
                        return Err(SupervisorError::Job(format!("the worker is {COMMAND_QUEUE} commands behind its agent")));
                    }
                }
            }
        }
    }
}

/// A count the supervisor sent (`[elastic] channels` or `connections`): its config holds it in
/// 1..=`max`; a count from elsewhere is refused here rather than turned into one (0) or a late
/// transport or `CommConfig` error (above `max`).
fn count_from_supervisor(key: &str, count: u32, max: usize) -> Result<usize> {
    usize::try_from(count).ok().filter(|n| (1..=max).contains(n)).ok_or_else(|| SupervisorError::InvalidConfig { reason: format!("elastic.{key} from the supervisor must be from 1 to {max}, got {count}") })
}

/// What the worker thread needs from the process.
struct WorkerCtx {
    node: u64,
    supervisor: RemoteRef<ToSupervisor>,
    shared: Arc<Shared>,
    bind_ip: IpAddr,
    quic: QuicOptions,
    wire: Option<Arc<dyn GenerationWire>>,
    checkpoints: Option<Arc<dyn CheckpointStore>>,
    exec: Exec,
    compute: Option<Arc<dyn ComputeDriver>>,
    verify_every: u64,
    checkpoint_every: u64,
    /// ZeRO-1/2 optimizer sharding, and how often its state is gathered into a restorable snapshot.
    sharding: DpSharding,
    snapshot_every: u64,
    /// ZeRO-1/2: per-step buddy copies of the segment states, or the snapshots alone.
    zero_copies: ZeroCopies,
    /// What `Prepare` binds for the collectives between processes (the job's
    /// `[elastic] data_transport`); shared memory inside a machine either way.
    data_transport: DataTransport,
    /// Rings each large all-reduce of a DP generation is split into (`[elastic] channels`, 1 to
    /// 16), and the threads of the DP engine's communication runtime, one per ring.
    channels: usize,
    /// Connections per worker pair of the data transport (`[elastic] connections`, 1 to 16):
    /// `QuicOptions::stripes` / `TlsOptions::stripes`.
    connections: usize,
    /// Seconds inside training steps, on the control path of the step loop (command polling,
    /// step reports), and of the whole step loop.
    timing: Mutex<(f64, f64, f64)>,
}

/// Model and optimizer state carried from one generation to the next.
struct Replica<M, O> {
    model: Option<M>,
    /// The optimizer of the last generation when its parameters stay where they are (a model on
    /// a GPU): its state is `optimizer_state`'s on the device. A generation this worker is the
    /// source of reuses it in place instead of building one and loading the state back (1.5 GB
    /// of GPT-2 124M's AdamW state each way); any other generation drops it.
    kept_optimizer: Option<O>,
    /// The full-form template of the optimizer state (names, shapes, a fresh optimizer's values):
    /// the same for every generation of the job, so made once.
    template: Option<state::NamedTensors>,
    /// Under ZeRO-1, the parameters of the last snapshot (the restorable point); `None` when the
    /// model's own parameters are it.
    snapshot_params: Option<Vec<f32>>,
    /// This worker's rank in the last generation it trained in.
    rank: Option<usize>,
    optimizer_state: Option<Vec<(String, Tensor)>>,
    completed: Option<u64>,
    /// Under ZeRO-1, the segment states of the last two exchanged steps (this rank's and its
    /// buddy's): the state of a step no single rank holds whole.
    zero1: BuddyCopies,
    /// In a model-parallel job, the state of the mesh slot this member trained last.
    mesh: Option<mesh::MeshReplica>,
}

/// This generation's collectives endpoint between `Prepare` and `Start`.
enum Bound {
    Quic(Arc<QuicTransport>),
    Tls(Arc<TlsTransport>),
    Injected,
}

/// The network transport a generation connected, closed gracefully once the generation is over
/// (queued frames reach the peers before the links end) instead of dropped.
enum Network {
    Quic(Arc<QuicTransport>),
    Tls(Arc<TlsTransport>),
}

impl Network {
    /// Lets what is queued reach the peers, waiting at most `timeout`.
    async fn close(self, timeout: Duration) {
        match self {
            Network::Quic(quic) => quic.close(timeout).await,
            Network::Tls(tls) => tls.close(timeout).await,
        }
    }

    /// Closes it in the background: the next generation need not wait for the old links.
    fn close_later(self) {
        tokio::spawn(self.close(Duration::from_millis(100)));
    }
}

/// How a generation's collectives moved, for the "collectives connected" log (the names of
/// `JobEvent::Generation::transport`).
fn connected_name(network: Option<&Network>, injected: bool, routed: bool) -> &'static str {
    match (network, injected) {
        (Some(Network::Quic(_)), _) if routed => "routed",
        (Some(Network::Quic(_)), _) => "quic",
        (Some(Network::Tls(_)), _) if routed => "routed-tls",
        (Some(Network::Tls(_)), _) => "tls",
        (None, true) => "injected",
        (None, false) => "shm",
    }
}

async fn worker_main<J: TrainJob>(ctx: WorkerCtx, job: Arc<J>, resume: Option<PathBuf>, mut cmds: Receiver<ToWorker>) -> Result<WorkerOutcome> {
    let mut replica = Replica { model: Some(job.build_model().map_err(SupervisorError::Job)?), kept_optimizer: None, template: None, snapshot_params: None, rank: None, optimizer_state: None, completed: None, zero1: BuddyCopies::default(), mesh: None };
    let mesh_spec = job.mesh();
    // A mesh job resumes from a sharded checkpoint: each member loads its part when the
    // supervisor names it as the slot's source (`ShardSource::Checkpoint`).
    if let Some(path) = resume.as_ref().filter(|_| mesh_spec.is_none()) {
        let (state, step) = checkpoint::load(path, replica.model.as_ref().ok_or_else(internal)?, |slices| job.build_optimizer(slices))?;
        replica.optimizer_state = Some(state);
        replica.completed = Some(step);
        *ctx.shared.completed.lock().unwrap_or_else(PoisonError::into_inner) = Some(step);
        tracing::info!(step, path = %path.display(), "resumed from checkpoint");
    }
    let mut shard = match ctx.exec {
        Exec::Thread => DataShard::start(Arc::clone(&job))?,
        Exec::Task => DataShard::inline(Arc::clone(&job)),
    };
    let store = ctx.checkpoints.clone().or_else(|| job.checkpoint_dir().map(|dir| Arc::new(FileStore::new(dir)) as Arc<dyn CheckpointStore>));
    let mut writer = CheckpointWriter::new(store.clone(), if ctx.exec == Exec::Task { WriteMode::Inline } else { WriteMode::Background });
    let mut next: Option<ToWorker> = None;
    loop {
        let cmd = match next.take() {
            Some(cmd) => cmd,
            None => cmds.recv().await.ok_or_else(lost)?,
        };
        match cmd {
            ToWorker::Prepare { generation, rank, world, ca, cert, key } => {
                let (bound, addr) = match &ctx.wire {
                    Some(wire) => (Bound::Injected, wire.bind(ctx.node, generation, rank as usize, world as usize)?),
                    None => {
                        let identity = NodeIdentity::from_der(rank as usize, ca, cert, key);
                        let listen = SocketAddr::new(ctx.bind_ip, 0);
                        match ctx.data_transport {
                            DataTransport::Quic => {
                                let options = QuicOptions { stripes: ctx.connections, ..ctx.quic.clone() };
                                let transport = Arc::new(QuicTransport::bind(&identity, world as usize, listen, options)?);
                                let addr = transport.local_addr()?.to_string();
                                (Bound::Quic(transport), addr)
                            }
                            DataTransport::Tls => {
                                // The worker's QUIC tuning carries the timeouts and the payload cap
                                // over; key updates keep the TLS transport's default.
                                let options = TlsOptions { connect_timeout: ctx.quic.connect_timeout, idle_timeout: ctx.quic.idle_timeout, keep_alive: ctx.quic.keep_alive, max_payload_bytes: ctx.quic.max_payload_bytes, stripes: ctx.connections, ..TlsOptions::default() };
                                let transport = Arc::new(TlsTransport::bind(&identity, world as usize, listen, options)?);
                                let addr = transport.local_addr().to_string();
                                (Bound::Tls(transport), addr)
                            }
                        }
                    }
                };
                ctx.supervisor.tell(&ToSupervisor::Ready { node: ctx.node, generation, addr, completed: replica.completed, zero1: replica.zero1.held(), mesh: replica.mesh.as_ref().map(mesh::MeshReplica::held) }).await?;
                let start = loop {
                    match cmds.recv().await.ok_or_else(lost)? {
                        ToWorker::Start { generation: g, addrs, source, next_step, stop_step, shm_job, mesh, host_of } if g == generation => break Some((addrs, source, next_step, stop_step, shm_job, mesh, host_of)),
                        ToWorker::Start { .. } => continue,
                        other => {
                            next = Some(other);
                            break None;
                        }
                    }
                };
                let Some((addrs, source, next_step, stop_step, shm_job, mesh_start, host_of)) = start else { continue };
                if mesh_spec.is_some() != mesh_start.is_some() {
                    let reason = format!("the job is {} but the supervisor started a {} generation (its [elastic] pp/tp disagree with the job's [parallel])", if mesh_spec.is_some() { "model-parallel" } else { "data-parallel" }, if mesh_start.is_some() { "mesh" } else { "data-parallel" });
                    tracing::error!(generation, "{reason}");
                    let _ = ctx.supervisor.tell(&ToSupervisor::StepFailed { node: ctx.node, generation, step: next_step, reason }).await;
                    continue;
                }
                if let (Some(spec), Some(start)) = (&mesh_spec, mesh_start) {
                    let generation_run = Generation { generation, rank: rank as usize, world: world as usize, source: 0, segments: None, next_step, stop_step, addrs, shm_job, host_of };
                    let span = tracing::info_span!("mesh_generation", generation, rank, world);
                    match mesh::run_mesh_generation(&ctx, &job, spec, &generation_run, &start, bound, &mut replica, &mut shard, &mut cmds).instrument(span).await {
                        Ok(interrupt) => next = interrupt,
                        Err(e) => {
                            ctx.shared.log_failure(&format!("mesh generation {generation} failed; waiting for the supervisor"), replica.completed.map_or(0, |c| c + 1), &e, is_stale_generation(&e));
                            let _ = ctx.supervisor.tell(&ToSupervisor::StepFailed { node: ctx.node, generation, step: replica.completed.map_or(0, |c| c + 1), reason: e.to_string() }).await;
                        }
                    }
                    continue;
                }
                if let StateSource::Checkpoint { location, step } = &source {
                    // Every holder of newer state is gone: rank 0 takes the checkpoint and
                    // broadcasts it like a replica would.
                    if rank == 0 {
                        if let Err(e) = load_checkpoint_into(&ctx, store.as_deref(), job.as_ref(), &mut replica, location) {
                            tracing::error!(%location, error = %e, "cannot load the recovery checkpoint");
                            let _ = ctx.supervisor.tell(&ToSupervisor::StepFailed { node: ctx.node, generation, step: next_step, reason: e.to_string() }).await;
                            continue;
                        }
                        tracing::warn!(%location, step, "recovering from the newest checkpoint: no member holds newer state");
                    }
                }
                // Under ZeRO-1 segments every holder sends its own; the first one names the source.
                let source_rank = source.sending_rank();
                let segments = match source {
                    StateSource::Zero1Segments { step, world, holders } => Some(SegmentSource { step, world, holders }),
                    _ => None,
                };
                let generation_run = Generation { generation, rank: rank as usize, world: world as usize, source: source_rank, segments, next_step, stop_step, addrs, shm_job, host_of };
                let span = tracing::info_span!("generation", generation = generation_run.generation, rank = generation_run.rank, world = generation_run.world);
                match run_generation(&ctx, &job, &generation_run, bound, &mut replica, &mut shard, &mut writer, &mut cmds).instrument(span).await {
                    Ok(interrupt) => next = interrupt,
                    Err(e) => {
                        ctx.shared.log_failure(&format!("generation {generation} failed; waiting for the supervisor"), replica.completed.map_or(0, |c| c + 1), &e, is_stale_generation(&e));
                        let _ = ctx.supervisor.tell(&ToSupervisor::StepFailed { node: ctx.node, generation, step: replica.completed.map_or(0, |c| c + 1), reason: e.to_string() }).await;
                        if replica.model.is_none() {
                            return Err(e);
                        }
                    }
                }
            }
            ToWorker::Start { .. } | ToWorker::Pause { .. } => {}
            ToWorker::Finish => {
                writer.wait();
                let model = replica.model.as_mut().ok_or_else(internal)?;
                // A mesh member holds a part of the model: its checksum is of that part, and the
                // whole model is evaluated nowhere (no member holds it).
                let (checksum, eval) = match &replica.mesh {
                    Some(part) => (part.checksum(), Vec::new()),
                    None => {
                        let checksum = parameter_checksum(model)?;
                        (checksum, if replica.rank == Some(0) { job.evaluate(model).map_err(SupervisorError::Job)? } else { Vec::new() })
                    }
                };
                let (compute_s, control_s, loop_s) = *ctx.timing.lock().unwrap_or_else(PoisonError::into_inner);
                ctx.supervisor.tell(&ToSupervisor::Finished { node: ctx.node, checksum, eval, compute_s, control_s, loop_s }).await?;
                return Ok(WorkerOutcome::Finished);
            }
            ToWorker::Evict { reason } => {
                writer.wait();
                return Ok(WorkerOutcome::Evicted(reason));
            }
        }
    }
}

/// Loads the checkpoint at `location` of `store` (a file path without one) into `replica`
/// (parameters, full optimizer state, step), for a generation that recovers from it.
fn load_checkpoint_into<J: TrainJob>(ctx: &WorkerCtx, store: Option<&dyn CheckpointStore>, job: &J, replica: &mut Replica<J::Model, J::Optim>, location: &str) -> Result<()> {
    let model = replica.model.as_ref().ok_or_else(internal)?;
    let build = |slices: &[rtx_pipelines::ParamSlice]| job.build_optimizer(slices);
    let (state, step) = match store {
        Some(store) => checkpoint::load_from(store, location, model, build)?,
        None => checkpoint::load(std::path::Path::new(location), model, build)?,
    };
    replica.optimizer_state = Some(state);
    replica.kept_optimizer = None;
    replica.snapshot_params = None;
    replica.completed = Some(step);
    *ctx.shared.completed.lock().unwrap_or_else(PoisonError::into_inner) = Some(step);
    Ok(())
}

/// `StateSource::Zero1Segments`: the state of `step`, from the segments of the layout of `world`
/// ranks, old segment `i` sent by new rank `holders[i]`.
struct SegmentSource {
    step: u64,
    world: u32,
    holders: Vec<u32>,
}

struct Generation {
    generation: u64,
    rank: usize,
    world: usize,
    source: usize,
    /// Under ZeRO-1, when the state is rebuilt from the members' segment copies instead of taken
    /// from `source`.
    segments: Option<SegmentSource>,
    next_step: u64,
    stop_step: u64,
    addrs: Vec<String>,
    shm_job: Option<String>,
    /// Each rank's machine when the generation is routed (see `ToWorker::Start`); empty otherwise.
    host_of: Vec<u32>,
}

/// Trains one generation. Returns the command that interrupted it, or `None` when the last step is done.
#[allow(clippy::too_many_arguments)]
async fn run_generation<J: TrainJob>(
    ctx: &WorkerCtx,
    job: &Arc<J>,
    g: &Generation,
    bound: Bound,
    replica: &mut Replica<J::Model, J::Optim>,
    shard: &mut DataShard<J>,
    writer: &mut CheckpointWriter,
    cmds: &mut Receiver<ToWorker>,
) -> Result<Option<ToWorker>> {
    replica.rank = Some(g.rank);
    let (wire, network) = ctx.shared.abort.unless_superseded(g.generation, connect_generation(ctx, g, bound)).await?;
    let transport = connected_name(network.as_ref(), ctx.wire.is_some(), !g.host_of.is_empty());
    tracing::info!(transport, "collectives connected");
    // A routed generation's host map makes `all_reduce` hierarchical: only machine leaders cross machines.
    // `[elastic] channels`: one ring stays `None`, the path jobs without the key always took.
    let channels = (ctx.channels > 1).then_some(ctx.channels);
    let endpoint = Endpoint::new(Arc::clone(&wire), CommConfig { host_of: g.host_of.clone(), channels, ..CommConfig::default() })?;
    let comm = endpoint.group(WORLD_GROUP_ID, (0..g.world).collect(), g.generation)?;
    ctx.shared.abort.set(comm.clone(), Arc::clone(&wire));
    let result = if ctx.sharding == DpSharding::Zero3 { fsdp::train(ctx, job, g, &comm, replica, shard, writer, cmds).await } else { train(ctx, job, g, &comm, replica, shard, writer, cmds).await };
    ctx.shared.abort.clear();
    drop(comm);
    drop(endpoint);
    if let Some(network) = network {
        network.close_later();
    }
    result
}

/// Connects this generation's collectives transport: the injected wire, shared-memory rings
/// (every member on this machine), or the QUIC or TLS endpoint bound at `Prepare` (alone, or
/// between machines under shared memory inside each). Returns the network transport too, for
/// closing it gracefully once the generation is over.
async fn connect_generation(ctx: &WorkerCtx, g: &Generation, bound: Bound) -> Result<(Arc<dyn Transport>, Option<Network>)> {
    Ok(match (bound, &g.shm_job, &ctx.wire) {
        (Bound::Injected, _, Some(wire)) => (wire.connect(ctx.node, g.generation, g.rank, &g.addrs).await?, None),
        (Bound::Injected, _, None) => return Err(SupervisorError::Job("internal: an injected endpoint without its wire".into())),
        // Several machines, some with several members: shared memory inside each, QUIC between.
        (Bound::Quic(transport), Some(job_name), _) if !g.host_of.is_empty() => {
            let options = ShmOptions { job: job_name.clone(), ..ShmOptions::default() };
            let routed = RoutedTransport::connect_over_quic(Arc::clone(&transport), &peer_addrs(g)?, &g.host_of, options).await?;
            (Arc::new(routed), Some(Network::Quic(transport)))
        }
        // Every member on this machine: shared-memory rings instead of QUIC.
        (Bound::Quic(transport), Some(job_name), _) => {
            drop(transport);
            let options = ShmOptions { job: job_name.clone(), ..ShmOptions::default() };
            let shm = ShmTransport::connect(g.rank, g.world, options).await?;
            (Arc::new(shm), None)
        }
        (Bound::Quic(transport), None, _) => {
            transport.connect(&peer_addrs(g)?).await?;
            (Arc::clone(&transport) as Arc<dyn Transport>, Some(Network::Quic(transport)))
        }
        // The same three with TLS over TCP between processes.
        (Bound::Tls(transport), Some(job_name), _) if !g.host_of.is_empty() => {
            let options = ShmOptions { job: job_name.clone(), ..ShmOptions::default() };
            let routed = RoutedTransport::connect_over_tls(Arc::clone(&transport), &peer_addrs(g)?, &g.host_of, options).await?;
            (Arc::new(routed), Some(Network::Tls(transport)))
        }
        (Bound::Tls(transport), Some(job_name), _) => {
            drop(transport);
            let options = ShmOptions { job: job_name.clone(), ..ShmOptions::default() };
            let shm = ShmTransport::connect(g.rank, g.world, options).await?;
            (Arc::new(shm), None)
        }
        (Bound::Tls(transport), None, _) => {
            transport.connect(&peer_addrs(g)?).await?;
            (Arc::clone(&transport) as Arc<dyn Transport>, Some(Network::Tls(transport)))
        }
    })
}

/// The generation's member addresses, parsed.
fn peer_addrs(g: &Generation) -> Result<Vec<SocketAddr>> {
    g.addrs.iter().map(|a| a.parse().map_err(|e| SupervisorError::JobFailed { reason: format!("bad peer address {a}: {e}") })).collect()
}

/// Sets up one data-parallel generation (replicated, ZeRO-1 or ZeRO-2): the state sync from the
/// source or from segment copies, the [`DataParallel`] engine; then trains it through the step
/// loop ([`steps::run`]) behind its adapter ([`dp::DpSteps`]).
#[allow(clippy::too_many_arguments)]
async fn train<J: TrainJob>(
    ctx: &WorkerCtx,
    job: &Arc<J>,
    g: &Generation,
    comm: &Communicator,
    replica: &mut Replica<J::Model, J::Optim>,
    shard: &mut DataShard<J>,
    writer: &mut CheckpointWriter,
    cmds: &mut Receiver<ToWorker>,
) -> Result<Option<ToWorker>> {
    let model = replica.model.take().ok_or_else(internal)?;
    // The newest restorable state, from the source rank: parameters and full optimizer state.
    // (No borrow of the model lives across an await: the worker future must be `Send`.)
    let template = match replica.template.clone() {
        Some(template) => Ok(template),
        None => state::full_template(&model, |slices| job.build_optimizer(slices)),
    };
    let layout = template.as_ref().ok().map(|t| zero1::Layout::new(&model, t)).transpose();
    // Parameters and buffers (an EMA target encoder): the replica's whole state.
    let params = model.named_state();
    let (snapshot_params, optimizer_state, copies) = (replica.snapshot_params.as_deref(), replica.optimizer_state.as_deref(), &replica.zero1);
    let synced = async {
        let template = template?;
        let layout = layout?.ok_or_else(internal)?;
        let (flat, full) = match &g.segments {
            // Under ZeRO-1, from the segment copies of a step no member holds whole.
            Some(s) => zero1::rebuild_from_segments(comm, copies, &layout, &template, s.step, s.world, &s.holders).await?,
            None => {
                let flat = state::broadcast_parameters(comm, g.source, &params, snapshot_params).await?;
                (flat, state::broadcast_full_state(comm, g.source, optimizer_state, &template).await?)
            }
        };
        // Nobody moves on until every member holds the state: a generation formed at the last
        // step has nothing to train, so its members finish at once, and a source that exited
        // with its broadcast still in flight left a member at an older state (found by the
        // simulator's swarm once partitions could be one-way).
        comm.barrier().await?;
        // Only now does the replica take the source's parameters: a sync that failed halfway
        // must leave them matching the step this worker reports (installing them at once left a
        // worker at the source's step while it reported its own; found by the swarm too).
        state::install_parameters(&params, &flat)?;
        Ok::<_, SupervisorError>((template, full, layout))
    }
    .await;
    drop(params);
    let (template, full, layout) = match synced {
        Ok(v) => v,
        Err(e) => {
            replica.model = Some(model);
            return Err(e);
        }
    };
    // The replica now holds the source's state, the state after step `next_step - 1`: record it, so
    // that a re-formation before this generation completes a step reports the step this state
    // really is (reporting this worker's own older step made the group train a step twice; found
    // by the simulator's seed swarm).
    let synced_params = state::flat_parameters(&model)?;
    // Every member holds the whole state now: older segment copies are of no more use.
    replica.zero1.clear();
    replica.completed = g.next_step.checked_sub(1);
    replica.optimizer_state = Some(full.clone());
    replica.template = Some(template.clone());
    replica.snapshot_params = if ctx.sharding.shards_optimizer() { Some(synced_params.clone()) } else { None };
    *ctx.shared.completed.lock().unwrap_or_else(PoisonError::into_inner) = replica.completed;
    let engine_comm = comm.clone();
    let sharding = match ctx.sharding {
        DpSharding::Replicated => job.dp_config().sharding,
        DpSharding::Zero1 => Sharding::Zero1,
        DpSharding::Zero2 => Sharding::Zero2,
        // `run_generation` hands ZeRO-3 generations to `fsdp::train`.
        DpSharding::Zero3 => return Err(SupervisorError::Job("internal: a ZeRO-3 generation in the data-parallel engine".into())),
    };
    // A thread of the communication runtime per channel, so the rings run side by side.
    let dp = DpConfig { collective_timeout: Duration::from_secs(60), sharding, comm_threads: ctx.channels, ..job.dp_config() };
    // This worker's own optimizer holds exactly the state just broadcast when it was the source
    // (and nothing replaced the state since): reuse it where it is.
    let own = replica.kept_optimizer.take().filter(|_| g.source == g.rank && g.segments.is_none() && sharding == Sharding::Replicated);
    let make_optimizer = |slices: &[rtx_pipelines::ParamSlice]| {
        if let Some(optimizer) = own.filter(|o| updates_exactly(o, slices)) {
            tracing::info!(tensors = slices.len(), "optimizer kept in place");
            return Ok(optimizer);
        }
        let mut optimizer = job.build_optimizer(slices).map_err(|reason| rtx_tensor::Error::InvalidArgument { op: "build_optimizer", reason })?;
        let local = optimizer.state_tensors()?;
        let mine = state::slice_full_state(&full, &local, slices).map_err(|e| rtx_tensor::Error::InvalidArgument { op: "optimizer state", reason: e.to_string() })?;
        optimizer.load_state(&mine)?;
        Ok(optimizer)
    };
    let built = match ctx.exec {
        Exec::Thread => DataParallel::new(model, dp, move || Ok(engine_comm), make_optimizer),
        Exec::Task => DataParallel::new_inline(model, dp, engine_comm, make_optimizer).await,
    };
    let mut engine = match built {
        Ok(engine) => engine,
        Err(e) => {
            // The engine took the model with it (its constructor's broadcast was aborted by a
            // re-formation): rebuild the replica from the synced parameters, so this worker can
            // take part in the next generation instead of exiting.
            replica.model = Some(rebuild_model(job.as_ref(), &synced_params)?);
            return Err(e.into());
        }
    };
    tracing::info!(next_step = g.next_step, source = g.source, from_segments = g.segments.is_some(), "generation started");
    let trace_to = job.trace();
    if let Some((steps, _)) = &trace_to {
        engine.trace_steps(*steps);
    }
    if ctx.sharding.shards_optimizer() {
        log_zero1_memory(&engine, &layout, &template, g.world, ctx.sharding, ctx.zero_copies)?;
    }
    let total = job.total_steps().min(g.stop_step);
    let engine = dp::DpSteps { ctx, job: job.as_ref(), g, comm, replica, writer, engine, sharding, layout, template, trace_to, exchanged: (Duration::ZERO, 0) };
    steps::run(ctx, g, total, engine, shard, cmds).await
}

/// Logs what the buddy copies cost per rank, next to the ZeRO-1/2 shard itself and a replica.
fn log_zero1_memory<M: Module, O: Optimizer>(engine: &DataParallel<M, O>, layout: &zero1::Layout, template: &[(String, Tensor)], world: usize, sharding: DpSharding, copies: ZeroCopies) -> Result<()> {
    let local = engine.optimizer().state_tensors()?;
    let (shard_bytes, replica_bytes) = zero1::shard_and_replica_bytes(engine.param_slices(), &local, layout.param_count(), template);
    // Own and buddy segment states of two steps (see `zero1`; alone, no buddy's); the snapshot
    // fallback keeps the whole state besides (a replica's worth). With `zero_copies = "snapshot"`
    // only the snapshot is kept.
    let copies_bytes = if !copies.per_step() { 0 } else if world == 1 { 2 } else { 4 } * shard_bytes;
    tracing::info!(
        sharding = sharding.name(),
        zero_copies = copies.name(),
        world,
        shard_bytes,
        copies_bytes,
        replica_bytes,
        snapshot_bytes = replica_bytes,
        copies_per_replica = copies_bytes as f64 / replica_bytes.max(1) as f64,
        "zero1 buddy copies: memory per rank"
    );
    Ok(())
}

/// A fresh model holding `flat` (every parameter, then every buffer, in `named_state` order).
fn rebuild_model<J: TrainJob>(job: &J, flat: &[f32]) -> Result<J::Model> {
    let model = job.build_model().map_err(SupervisorError::Job)?;
    let mut offset = 0;
    for (name, p) in model.named_state() {
        let n = p.numel();
        let values = flat.get(offset..offset + n).ok_or_else(|| SupervisorError::Job(format!("rebuilding {name}: {} synced values for more parameters", flat.len())))?;
        p.copy_from_(&Tensor::from_vec(values.to_vec(), p.shape())?)?;
        offset += n;
    }
    if offset != flat.len() {
        return Err(SupervisorError::Job(format!("rebuilding the model: {} synced values for {offset} parameters", flat.len())));
    }
    Ok(model)
}

/// The full optimizer state at the current step: the optimizer's own (plain data parallelism),
/// or the snapshot just taken (ZeRO-1 snapshots at every checkpoint step).
fn full_state_now<M, O: Optimizer>(ctx: &WorkerCtx, replica: &Replica<M, O>, optimizer: &O) -> Result<state::NamedTensors> {
    if ctx.sharding.shards_optimizer() {
        replica.optimizer_state.clone().ok_or_else(|| SupervisorError::Job("no ZeRO-1 snapshot to checkpoint".into()))
    } else {
        Ok(optimizer.state_tensors()?)
    }
}

/// Graceful leave: tell the supervisor, wait for its acknowledgement (bounded).
/// Between two steps of any engine: a command from the supervisor, a lost control link, or a
/// preemption notice (then the supervisor is told, see [`leave`]) ends the step loop with this
/// outcome; `None`: train on. `completed` is the member's newest completed step.
async fn between_steps(ctx: &WorkerCtx, completed: Option<u64>, cmds: &mut Receiver<ToWorker>) -> Option<Result<Option<ToWorker>>> {
    match cmds.try_recv() {
        Ok(cmd) => return Some(Ok(Some(cmd))),
        Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => return Some(Err(lost())),
        Err(tokio::sync::mpsc::error::TryRecvError::Empty) => {}
    }
    if ctx.shared.preempt.load(Ordering::SeqCst) {
        return Some(leave(ctx, completed, cmds).await);
    }
    None
}

/// Adds one step's compute, control and whole-loop seconds to the worker's totals (the final
/// report's overhead shares).
fn add_step_timing(ctx: &WorkerCtx, compute: Duration, control: Duration, loop_time: Duration) {
    let mut timing = ctx.timing.lock().unwrap_or_else(PoisonError::into_inner);
    timing.0 += compute.as_secs_f64();
    timing.1 += control.as_secs_f64();
    timing.2 += loop_time.as_secs_f64();
}

async fn leave(ctx: &WorkerCtx, completed: Option<u64>, cmds: &mut Receiver<ToWorker>) -> Result<Option<ToWorker>> {
    ctx.supervisor.tell(&ToSupervisor::Leaving { node: ctx.node, completed, reason: "SIGTERM (preemption)".into() }).await?;
    let acknowledged = async {
        loop {
            match cmds.recv().await {
                Some(cmd @ (ToWorker::Evict { .. } | ToWorker::Finish)) => return Ok(Some(cmd)),
                Some(_) => continue,
                None => return Err(lost()),
            }
        }
    };
    match tokio::time::timeout(LEAVE_TIMEOUT, acknowledged).await {
        Ok(answer) => answer,
        Err(_) => Ok(Some(ToWorker::Evict { reason: "left after SIGTERM (no acknowledgement)".into() })),
    }
}

/// FNV-1a over every parameter's and buffer's name and [`Tensor::bits_checksum`] (the raw bits
/// of its elements as stored), in visit order: equal on all replicas iff they are bit-identical
/// (up to hash collisions). A parameter on a GPU is hashed there: checking a GPT-2 124M replica
/// cost ~175 ms per verified step when its 248 MB went to the host first.
pub fn parameter_checksum<M: Module + ?Sized>(model: &M) -> Result<u64> {
    const PRIME: u64 = 0x100_0000_01b3;
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let (names, tensors): (Vec<String>, Vec<Tensor>) = model.named_state().into_iter().unzip();
    // Hashed where the tensors live (on a GPU, 8 bytes per chunk come back, with one wait).
    let digests = rtx_tensor::bits_checksums(&tensors)?;
    for (name, digest) in names.iter().zip(digests) {
        for b in name.bytes() {
            hash = (hash ^ u64::from(b)).wrapping_mul(PRIME);
        }
        hash = (hash ^ digest).wrapping_mul(PRIME);
    }
    Ok(hash)
}

/// Whether `optimizer` updates exactly `slices`: the same tensors (not copies), whole, in order.
fn updates_exactly<O: Optimizer>(optimizer: &O, slices: &[rtx_pipelines::ParamSlice]) -> bool {
    let params = optimizer.parameters();
    params.len() == slices.len() && params.iter().zip(slices).all(|((_, p), s)| s.is_whole() && p.id() == s.tensor.id())
}

fn lost() -> SupervisorError {
    SupervisorError::SupervisorLost { reason: "the node agent stopped".into() }
}

fn internal() -> SupervisorError {
    SupervisorError::Job("internal: the model is missing".into())
}

/// This machine's identity for co-location: host name and boot id (distinct machines, and
/// containers with their own kernel, differ).
fn machine_identity() -> Option<String> {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    Some(format!("{}/{}", host.trim(), boot.trim()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Workers sharing a process probe the run folder at once and every one of them finds it
    /// usable (a probe file per process let one worker's cleanup fail the other's probe, and that
    /// worker, rank 0 now and then, wrote no checkpoints at all).
    #[test]
    fn workers_of_one_process_probe_the_run_folder_at_once() {
        let dir = tempfile::tempdir().expect("temp dir");
        for _ in 0..20 {
            let found: Vec<Option<PathBuf>> = std::thread::scope(|s| {
                let probes: Vec<_> = (0..8).map(|_| s.spawn(|| checkpoint_folder(Some(dir.path()), "test"))).collect();
                probes.into_iter().map(|p| p.join().expect("probe thread")).collect()
            });
            assert!(found.iter().all(|f| f.as_deref() == Some(dir.path().join("checkpoints").as_path())), "{found:?}");
        }
    }

    /// A re-formation's abort (stale generation, superseded) is told apart from real failures,
    /// so only its repeats are demoted to debug lines.
    #[test]
    fn stale_generation_failures_are_told_apart_from_real_ones() {
        let stale = rtx_collectives::Error::StaleGeneration { expected: 3, got: 2 };
        assert!(is_stale_generation(&SupervisorError::Superseded { generation: 2, newer: 3 }));
        assert!(is_stale_generation(&SupervisorError::Collectives(rtx_collectives::Error::StaleGeneration { expected: 3, got: 2 })));
        let engine = rtx_pipelines::Error::Collective { step: 7, bucket: 0, op: "all_reduce", source: stale };
        assert!(is_stale_engine_failure(&engine));
        assert!(is_stale_generation(&SupervisorError::DataParallel(engine)));
        assert!(!is_stale_engine_failure(&rtx_pipelines::Error::Broken { failed_step: 7 }));
        assert!(!is_stale_generation(&SupervisorError::Job("out of memory".into())));
        assert!(!is_stale_generation(&SupervisorError::SupervisorLost { reason: "closed".into() }));
    }
}
