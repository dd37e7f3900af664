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
//!   replica and optimizer. Per generation it binds a QUIC collectives endpoint with the rank
//!   certificate it was given, answers `Ready` with the last step it completed, and on `Start`
//!   takes the newest state from the source rank (parameters and optimizer state, broadcast),
//!   builds the [`DataParallel`] engine and trains, reporting each step. A step that fails (a peer
//!   died) leaves the parameters at the last completed step: in plain data parallelism every
//!   collective precedes the optimizer update, so a failed step changes nothing.
//! - The worker's **data shard** ([`DataShard`]) prefetches the next batch. Batches are indexed
//!   by global step, so a new world size reassigns samples without skipping or repeating any.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rtx_actors::{DataShard, Link, LinkOptions, RemoteRef};
use rtx_collectives::{CommConfig, Communicator, Endpoint, NodeIdentity, QuicOptions, QuicTransport, ShmOptions, ShmTransport, Transport, WORLD_GROUP_ID};
use rtx_pipelines::{DataParallel, DpConfig, Sharding};
use rtx_tensor::{Module, Optimizer, Tensor};

use crate::checkpoint::{self, CheckpointWriter};
use crate::error::{Result, SupervisorError};
use crate::job::TrainJob;
use crate::state;
use crate::protocol::{self, JoinReply, ToSupervisor, ToWorker, EXPORTER_LABEL, SUPERVISOR};

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

/// The current generation's abort handle, shared by agent and worker.
#[derive(Default)]
struct AbortSlot(Mutex<Option<(Communicator, Option<Arc<QuicTransport>>)>>);

impl AbortSlot {
    fn set(&self, comm: Communicator, transport: Option<Arc<QuicTransport>>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some((comm, transport));
    }

    fn clear(&self) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take();
    }

    /// Fails the current generation's operations now.
    fn abort(&self, generation: u64) {
        if let Some((comm, transport)) = self.0.lock().unwrap_or_else(PoisonError::into_inner).as_ref() {
            if generation > comm.generation() {
                let _ = comm.set_generation(generation);
            }
            if let Some(transport) = transport {
                let transport = Arc::clone(transport);
                tokio::spawn(async move { transport.close(Duration::from_millis(50)).await });
            }
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
    let (link, mut inbound) = Link::dial(options.join, options.link.clone()).await?;
    let ekm = link.export_keying_material(EXPORTER_LABEL)?;
    let supervisor = link.remote::<ToSupervisor>(SUPERVISOR);
    let join = ToSupervisor::Join { name: options.name.clone(), pid: std::process::id(), host: machine_identity().unwrap_or_else(|| options.bind_ip.to_string()), proof: protocol::worker_proof(&options.token, &ekm) };
    let reply: JoinReply = supervisor.ask(&join, Duration::from_secs(30)).await?;
    let (node, job_text, heartbeat, resume, (verify_every, checkpoint_every, zero1, snapshot_every)) = match reply {
        JoinReply::Accepted { node, proof, job, heartbeat_ms, resume, verify_every, checkpoint_every, zero1, snapshot_every } => {
            if !protocol::verify_supervisor_proof(&options.token, &ekm, &proof) {
                link.close("supervisor not authentic");
                return Err(SupervisorError::NotAuthentic { addr: options.join.to_string() });
            }
            (node, job, Duration::from_millis(heartbeat_ms.max(10)), resume.map(PathBuf::from), (verify_every, checkpoint_every, zero1, snapshot_every))
        }
        JoinReply::Refused { reason } => return Err(SupervisorError::Refused { reason }),
    };
    tracing::info!(node, supervisor = %options.join, "joined");

    let shared = Arc::new(Shared { completed: Mutex::new(None), generation: Mutex::new(0), preempt: AtomicBool::new(false), abort: AbortSlot::default() });
    let heartbeats = tokio::spawn(heartbeat_loop(supervisor.clone(), node, heartbeat, Arc::clone(&shared)));

    let (cmd_tx, cmd_rx) = std::sync::mpsc::sync_channel::<ToWorker>(16);
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let ctx = WorkerCtx { node, supervisor: supervisor.clone(), shared: Arc::clone(&shared), runtime: tokio::runtime::Handle::current(), bind_ip: options.bind_ip, quic: options.quic.clone(), verify_every, checkpoint_every, zero1, snapshot_every, timing: Mutex::new((0.0, 0.0, 0.0)) };
    let spec = JobSpec { node, job: job_text, resume };
    std::thread::Builder::new()
        .name(format!("worker-{node}"))
        .spawn(move || {
            let result = make_job(&spec).map_err(SupervisorError::Job).and_then(|job| worker_main(ctx, Arc::new(job), spec.resume, cmd_rx));
            let _ = done_tx.send(result);
        })
        .map_err(|e| SupervisorError::Launch(format!("cannot start the worker thread: {e}")))?;

    let outcome = agent_loop(&link, &mut inbound, cmd_tx, done_rx, &shared).await;
    heartbeats.abort();
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

async fn agent_loop(
    link: &Link,
    inbound: &mut tokio::sync::mpsc::Receiver<rtx_actors::Inbound>,
    cmd_tx: SyncSender<ToWorker>,
    mut done: tokio::sync::oneshot::Receiver<Result<WorkerOutcome>>,
    shared: &Shared,
) -> Result<WorkerOutcome> {
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(|e| SupervisorError::Launch(format!("cannot watch SIGTERM: {e}")))?;
    let mut cmd_tx = Some(cmd_tx);
    loop {
        tokio::select! {
            result = &mut done => {
                return result.unwrap_or_else(|_| Err(SupervisorError::Job("the worker thread ended without a result".into())));
            }
            _ = sigterm.recv() => {
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
                    let _ = tokio::time::timeout(Duration::from_secs(10), &mut done).await;
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
                    }
                    ToWorker::Evict { .. } | ToWorker::Finish => shared.abort.abort(u64::MAX),
                    ToWorker::Start { .. } => {}
                }
                let Some(tx) = cmd_tx.as_ref() else { continue };
                // The worker takes commands between steps; a full queue means it is far behind.
                let tx = tx.clone();
                if tokio::task::spawn_blocking(move || tx.send(cmd)).await.map_or(true, |r| r.is_err()) {
                    cmd_tx = None;
                }
            }
        }
    }
}

/// What the worker thread needs from the process.
struct WorkerCtx {
    node: u64,
    supervisor: RemoteRef<ToSupervisor>,
    shared: Arc<Shared>,
    runtime: tokio::runtime::Handle,
    bind_ip: IpAddr,
    quic: QuicOptions,
    verify_every: u64,
    checkpoint_every: u64,
    /// ZeRO-1 optimizer sharding, and how often its state is gathered into a restorable snapshot.
    zero1: bool,
    snapshot_every: u64,
    /// Seconds inside training steps, on the control path of the step loop (command polling,
    /// step reports), and of the whole step loop.
    timing: Mutex<(f64, f64, f64)>,
}

/// Model and optimizer state carried from one generation to the next.
struct Replica<M> {
    model: Option<M>,
    /// Under ZeRO-1, the parameters of the last snapshot (the restorable point); `None` when the
    /// model's own parameters are it.
    snapshot_params: Option<Vec<f32>>,
    /// This worker's rank in the last generation it trained in.
    rank: Option<usize>,
    optimizer_state: Option<Vec<(String, Tensor)>>,
    completed: Option<u64>,
}

fn worker_main<J: TrainJob>(ctx: WorkerCtx, job: Arc<J>, resume: Option<PathBuf>, cmds: Receiver<ToWorker>) -> Result<WorkerOutcome> {
    let mut replica = Replica { model: Some(job.build_model().map_err(SupervisorError::Job)?), snapshot_params: None, rank: None, optimizer_state: None, completed: None };
    if let Some(path) = &resume {
        let (state, step) = checkpoint::load(path, replica.model.as_ref().ok_or_else(internal)?, |slices| job.build_optimizer(slices))?;
        replica.optimizer_state = Some(state);
        replica.completed = Some(step);
        *ctx.shared.completed.lock().unwrap_or_else(PoisonError::into_inner) = Some(step);
        tracing::info!(step, path = %path.display(), "resumed from checkpoint");
    }
    let mut shard = DataShard::start(Arc::clone(&job))?;
    let mut writer = CheckpointWriter::default();
    let mut next: Option<ToWorker> = None;
    loop {
        let cmd = match next.take() {
            Some(cmd) => cmd,
            None => cmds.recv().map_err(|_| lost())?,
        };
        match cmd {
            ToWorker::Prepare { generation, rank, world, ca, cert, key } => {
                let _guard = ctx.runtime.enter();
                let identity = NodeIdentity::from_der(rank as usize, ca, cert, key);
                let transport = Arc::new(QuicTransport::bind(&identity, world as usize, SocketAddr::new(ctx.bind_ip, 0), ctx.quic.clone())?);
                let addr = transport.local_addr()?.to_string();
                ctx.supervisor.blocking_tell(&ToSupervisor::Ready { node: ctx.node, generation, addr, completed: replica.completed })?;
                let start = loop {
                    match cmds.recv().map_err(|_| lost())? {
                        ToWorker::Start { generation: g, addrs, source, next_step, stop_step, shm_job } if g == generation => break Some((addrs, source, next_step, stop_step, shm_job)),
                        ToWorker::Start { .. } => continue,
                        other => {
                            next = Some(other);
                            break None;
                        }
                    }
                };
                let Some((addrs, source, next_step, stop_step, shm_job)) = start else { continue };
                let generation_run = Generation { generation, rank: rank as usize, world: world as usize, source: source as usize, next_step, stop_step, addrs, shm_job };
                match run_generation(&ctx, &job, &generation_run, transport, &mut replica, &mut shard, &mut writer, &cmds) {
                    Ok(interrupt) => next = interrupt,
                    Err(e) => {
                        tracing::warn!(generation, error = %e, "generation failed; waiting for the supervisor");
                        let _ = ctx.supervisor.blocking_tell(&ToSupervisor::StepFailed { node: ctx.node, generation, step: replica.completed.map_or(0, |c| c + 1), reason: e.to_string() });
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
                let checksum = parameter_checksum(model)?;
                let eval = if replica.rank == Some(0) { job.evaluate(model).map_err(SupervisorError::Job)? } else { Vec::new() };
                let (compute_s, control_s, loop_s) = *ctx.timing.lock().unwrap_or_else(PoisonError::into_inner);
                ctx.supervisor.blocking_tell(&ToSupervisor::Finished { node: ctx.node, checksum, eval, compute_s, control_s, loop_s })?;
                return Ok(WorkerOutcome::Finished);
            }
            ToWorker::Evict { reason } => {
                writer.wait();
                return Ok(WorkerOutcome::Evicted(reason));
            }
        }
    }
}

struct Generation {
    generation: u64,
    rank: usize,
    world: usize,
    source: usize,
    next_step: u64,
    stop_step: u64,
    addrs: Vec<String>,
    shm_job: Option<String>,
}

/// Trains one generation. Returns the command that interrupted it, or `None` when the last step is done.
#[allow(clippy::too_many_arguments)]
fn run_generation<J: TrainJob>(
    ctx: &WorkerCtx,
    job: &Arc<J>,
    g: &Generation,
    transport: Arc<QuicTransport>,
    replica: &mut Replica<J::Model>,
    shard: &mut DataShard<J>,
    writer: &mut CheckpointWriter,
    cmds: &Receiver<ToWorker>,
) -> Result<Option<ToWorker>> {
    let span = tracing::info_span!("generation", generation = g.generation, rank = g.rank, world = g.world);
    let _span = span.enter();
    replica.rank = Some(g.rank);
    let (wire, quic): (Arc<dyn Transport>, Option<Arc<QuicTransport>>) = match &g.shm_job {
        // Every member on this machine: shared-memory rings instead of QUIC.
        Some(job_name) => {
            drop(transport);
            let options = ShmOptions { job: job_name.clone(), ..ShmOptions::default() };
            let shm = ctx.runtime.block_on(ShmTransport::connect(g.rank, g.world, options))?;
            (Arc::new(shm), None)
        }
        None => {
            let addrs: Vec<SocketAddr> = g.addrs.iter().map(|a| a.parse().map_err(|e| SupervisorError::JobFailed { reason: format!("bad peer address {a}: {e}") })).collect::<Result<_>>()?;
            ctx.runtime.block_on(transport.connect(&addrs))?;
            (Arc::clone(&transport) as Arc<dyn Transport>, Some(transport))
        }
    };
    tracing::info!(transport = if quic.is_some() { "quic" } else { "shm" }, "collectives connected");
    let endpoint = Endpoint::new(wire, CommConfig::default())?;
    let comm = endpoint.group(WORLD_GROUP_ID, (0..g.world).collect(), g.generation)?;
    ctx.shared.abort.set(comm.clone(), quic.clone());
    let result = train(ctx, job, g, &comm, replica, shard, writer, cmds);
    ctx.shared.abort.clear();
    drop(comm);
    drop(endpoint);
    if let Some(closing) = quic {
        ctx.runtime.spawn(async move { closing.close(Duration::from_millis(100)).await });
    }
    result
}

#[allow(clippy::too_many_arguments)]
fn train<J: TrainJob>(
    ctx: &WorkerCtx,
    job: &Arc<J>,
    g: &Generation,
    comm: &Communicator,
    replica: &mut Replica<J::Model>,
    shard: &mut DataShard<J>,
    writer: &mut CheckpointWriter,
    cmds: &Receiver<ToWorker>,
) -> Result<Option<ToWorker>> {
    let model = replica.model.take().ok_or_else(internal)?;
    // The newest restorable state, from the source rank: parameters and full optimizer state.
    let synced = state::full_template(&model, |slices| job.build_optimizer(slices)).and_then(|template| {
        state::broadcast_parameters(&ctx.runtime, comm, g.source, &model, replica.snapshot_params.as_deref())?;
        let full = state::broadcast_full_state(&ctx.runtime, comm, g.source, replica.optimizer_state.as_deref(), &template)?;
        Ok((template, full))
    });
    let (template, full) = match synced {
        Ok(v) => v,
        Err(e) => {
            replica.model = Some(model);
            return Err(e);
        }
    };
    let engine_comm = comm.clone();
    let sharding = if ctx.zero1 { Sharding::Zero1 } else { job.dp_config().sharding };
    let dp = DpConfig { collective_timeout: Duration::from_secs(60), sharding, ..job.dp_config() };
    let mut engine = DataParallel::new(model, dp, move || Ok(engine_comm), |slices| {
        let mut optimizer = job.build_optimizer(slices).map_err(|reason| rtx_tensor::Error::InvalidArgument { op: "build_optimizer", reason })?;
        let local = optimizer.state_tensors()?;
        let mine = state::slice_full_state(&full, &local, slices).map_err(|e| rtx_tensor::Error::InvalidArgument { op: "optimizer state", reason: e.to_string() })?;
        optimizer.load_state(&mine)?;
        Ok(optimizer)
    })?;
    tracing::info!(next_step = g.next_step, source = g.source, "generation started");

    let total = job.total_steps().min(g.stop_step);
    let global = job.global_batch().max(1) as f64;
    let mut step = g.next_step;
    // The loop time of a step runs from the end of the previous step (data wait included).
    let mut since_last_step: Option<std::time::Instant> = None;
    let outcome: Result<Option<ToWorker>> = loop {
        if step >= total {
            // The end of the run (or of this part of it): a final checkpoint to resume from.
            if g.rank == 0 && total > g.next_step {
                if let Some(dir) = job.checkpoint_dir() {
                    let already = ctx.checkpoint_every > 0 && total % ctx.checkpoint_every == 0;
                    if !already {
                        let full = full_state_now(ctx, replica, engine.optimizer())?;
                        writer.write(&dir, total - 1, engine.model(), full, engine.optimizer(), ctx.supervisor.clone(), ctx.node)?;
                    }
                }
            }
            break Ok(None);
        }
        let control_started = std::time::Instant::now();
        match cmds.try_recv() {
            Ok(cmd) => break Ok(Some(cmd)),
            Err(std::sync::mpsc::TryRecvError::Disconnected) => break Err(lost()),
            Err(std::sync::mpsc::TryRecvError::Empty) => {}
        }
        if ctx.shared.preempt.load(Ordering::SeqCst) {
            break leave(ctx, replica.completed, cmds);
        }
        let mut control = control_started.elapsed();
        let batch = match shard.get(step, g.rank, g.world) {
            Ok(batch) => batch,
            Err(e) => break Err(e.into()),
        };
        let loop_started = std::time::Instant::now();
        job.set_lr(engine.optimizer_mut(), step);
        let unscaled = std::cell::Cell::new(0.0);
        let rows_seen = std::cell::Cell::new(0usize);
        let result = engine.step(|model| {
            let (loss, rows) = job.loss(model, &batch, step)?;
            unscaled.set(loss.item()?);
            rows_seen.set(rows);
            // Each rank's mean, scaled so that the group's average is the global batch's mean.
            loss.mul_scalar(rows as f64 * g.world as f64 / global)
        });
        let compute = loop_started.elapsed();
        match result {
            Ok(_) => {
                *ctx.shared.completed.lock().unwrap_or_else(PoisonError::into_inner) = Some(step);
                // Under ZeRO-1 a rank holds only part of the optimizer state: the restorable point
                // is the last snapshot, which gathers the full state on every rank.
                let snapshot_due = (step + 1) % ctx.snapshot_every.max(1) == 0 || step + 1 == total || (ctx.checkpoint_every > 0 && (step + 1) % ctx.checkpoint_every == 0);
                if !ctx.zero1 {
                    replica.completed = Some(step);
                } else if snapshot_due {
                    let local = engine.optimizer().state_tensors()?;
                    match state::gather_full_state(&ctx.runtime, comm, &local, engine.param_slices(), &template) {
                        Ok(full) => {
                            replica.optimizer_state = Some(full);
                            replica.snapshot_params = Some(state::flat_parameters(engine.model())?);
                            replica.completed = Some(step);
                        }
                        Err(e) => {
                            tracing::warn!(step, error = %e, "snapshot failed");
                            let _ = ctx.supervisor.blocking_tell(&ToSupervisor::StepFailed { node: ctx.node, generation: g.generation, step, reason: e.to_string() });
                            break cmds.recv().map(Some).map_err(|_| lost());
                        }
                    }
                }
                let verify = step % ctx.verify_every.max(1) == 0 || step + 1 == total;
                let checksum = if verify { Some(parameter_checksum(engine.model())?) } else { None };
                let report_started = std::time::Instant::now();
                ctx.supervisor.blocking_tell(&ToSupervisor::StepDone { node: ctx.node, generation: g.generation, step, loss: unscaled.get(), samples: rows_seen.get() as u64, checksum })?;
                control += report_started.elapsed();
                if g.rank == 0 {
                    if let Some(dir) = job.checkpoint_dir() {
                        if ctx.checkpoint_every > 0 && (step + 1) % ctx.checkpoint_every == 0 {
                            let full = full_state_now(ctx, replica, engine.optimizer())?;
                            writer.write(&dir, step, engine.model(), full, engine.optimizer(), ctx.supervisor.clone(), ctx.node)?;
                        }
                    }
                }
                step += 1;
                let mut timing = ctx.timing.lock().unwrap_or_else(PoisonError::into_inner);
                timing.0 += compute.as_secs_f64();
                timing.1 += control.as_secs_f64();
                timing.2 += since_last_step.map_or(loop_started.elapsed(), |t| t.elapsed()).as_secs_f64();
                drop(timing);
                since_last_step = Some(std::time::Instant::now());
            }
            Err(e) => {
                tracing::warn!(step, error = %e, "step failed");
                let _ = ctx.supervisor.blocking_tell(&ToSupervisor::StepFailed { node: ctx.node, generation: g.generation, step, reason: e.to_string() });
                // Wait for the supervisor's decision (a new generation, or eviction).
                break cmds.recv().map(Some).map_err(|_| lost());
            }
        }
    };
    let (model, _buckets, optimizer) = engine.into_parts();
    if !ctx.zero1 {
        // Plain data parallelism: the optimizer holds the full state of the last completed step.
        replica.optimizer_state = Some(optimizer.state_tensors()?);
        replica.snapshot_params = None;
    }
    replica.model = Some(model);
    outcome
}

/// The full optimizer state at the current step: the optimizer's own (plain data parallelism),
/// or the snapshot just taken (ZeRO-1 snapshots at every checkpoint step).
fn full_state_now<M, O: Optimizer>(ctx: &WorkerCtx, replica: &Replica<M>, optimizer: &O) -> Result<state::NamedTensors> {
    if ctx.zero1 {
        replica.optimizer_state.clone().ok_or_else(|| SupervisorError::Job("no ZeRO-1 snapshot to checkpoint".into()))
    } else {
        Ok(optimizer.state_tensors()?)
    }
}

/// Graceful leave: tell the supervisor, wait for its acknowledgement (bounded).
fn leave(ctx: &WorkerCtx, completed: Option<u64>, cmds: &Receiver<ToWorker>) -> Result<Option<ToWorker>> {
    ctx.supervisor.blocking_tell(&ToSupervisor::Leaving { node: ctx.node, completed, reason: "SIGTERM (preemption)".into() })?;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match cmds.recv_timeout(left) {
            Ok(cmd @ (ToWorker::Evict { .. } | ToWorker::Finish)) => return Ok(Some(cmd)),
            Ok(_) => continue,
            Err(RecvTimeoutError::Timeout) => return Ok(Some(ToWorker::Evict { reason: "left after SIGTERM (no acknowledgement)".into() })),
            Err(RecvTimeoutError::Disconnected) => return Err(lost()),
        }
    }
}

/// FNV-1a over the bits of every parameter, in name order: equal on all replicas iff they are
/// bit-identical (up to hash collisions).
pub fn parameter_checksum<M: Module + ?Sized>(model: &M) -> Result<u64> {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for (name, p) in model.named_parameters() {
        for b in name.bytes() {
            hash = (hash ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
        for v in p.to_f32_vec()? {
            hash = (hash ^ u64::from(v.to_bits())).wrapping_mul(0x100_0000_01b3);
        }
    }
    Ok(hash)
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
