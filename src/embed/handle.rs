//! A running embedded job: the [`JobHandle`] a program steers it with (kill a worker, wait for a
//! step, wait for the end), and the driver behind it, an async loop on the job's own tokio
//! runtime (a thread of its own) that starts the supervisor and the placement's launcher, folds
//! the supervisor's events into the [`Report`] and carries out the handle's commands.
//!
//! Concurrency: the driver thread owns the supervisor, the launcher and the report; the handle
//! only sends [`Command`]s (answered on a channel of their own) and reads the [`Progress`] the
//! driver publishes under a mutex with a condition variable.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use rtx_supervisor::{protocol, serve_request, ElasticConfig, JobEvent, LaunchOptions, LaunchRequest, Launcher, NodeEnv, NodeLauncher, SupervisorError, SupervisorHandle, SupervisorOptions, WorkerOptions, WorkerOutcome};
use tokio::sync::mpsc;

use super::child::CHILD_JOIN_ENV;
use super::error::EmbedError;
use super::in_process::{InProcessWire, ThreadLauncher};
use super::report::Report;
use super::task::{error_chain, EmbeddedTask, JobDescription, TaskJob};
use super::Placement;

/// How long workers may take to end on their own once the job is over.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// Launch requests (spawn, kill) queued for the launcher.
const LAUNCH_QUEUE: usize = 64;

/// Called with every supervisor event, on the driver thread.
pub(crate) type Observer = Box<dyn FnMut(&JobEvent) + Send>;

/// A running embedded job; see [`JobBuilder::start`](super::JobBuilder::start).
pub struct JobHandle {
    shared: Arc<Shared>,
    commands: mpsc::UnboundedSender<Command>,
    driver: std::thread::JoinHandle<Result<Report, EmbedError>>,
    placement: &'static str,
}

/// What the driver publishes for the handle.
#[derive(Clone, Copy, Debug, Default)]
struct Progress {
    committed: Option<u64>,
    ended: bool,
}

#[derive(Default)]
struct Shared {
    progress: Mutex<Progress>,
    changed: Condvar,
}

/// Commands from the handle to the driver.
enum Command {
    Kill { rank: usize, reply: std::sync::mpsc::Sender<Result<u32, EmbedError>> },
}

/// Everything the driver needs, from the builder.
pub(crate) struct Setup<T> {
    pub(crate) task: Arc<T>,
    pub(crate) placement: Placement,
    pub(crate) description: JobDescription,
    pub(crate) elastic: ElasticConfig,
    pub(crate) run_dir: Option<PathBuf>,
    pub(crate) child_args: Option<Vec<String>>,
    pub(crate) observer: Option<Observer>,
}

impl JobHandle {
    /// Starts the driver thread for `setup`.
    pub(crate) fn start<T: EmbeddedTask>(setup: Setup<T>) -> Result<JobHandle, EmbedError> {
        let shared = Arc::new(Shared::default());
        let (commands, commands_rx) = mpsc::unbounded_channel();
        let placement = setup.placement.name();
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().thread_name("rtx-embed").build().map_err(|source| EmbedError::Io { what: "start the job's tokio runtime", source })?;
        let driver_shared = Arc::clone(&shared);
        let driver = std::thread::Builder::new()
            .name("rtx-embed-driver".into())
            .spawn(move || {
                let result = runtime.block_on(drive(setup, commands_rx, Arc::clone(&driver_shared)));
                driver_shared.publish(|p| p.ended = true);
                // Worker compute threads of killed in-process workers may still be leaving.
                runtime.shutdown_timeout(SHUTDOWN_GRACE);
                result
            })
            .map_err(|source| EmbedError::Io { what: "start the job's driver thread", source })?;
        Ok(JobHandle { shared, commands, driver, placement })
    }

    /// Kills the worker at `rank` of the current generation, as a crash: an in-process worker's
    /// collectives are cut and its node task aborted, a worker process gets SIGKILL. Returns its
    /// pid (synthetic for an in-process worker). The supervisor then re-forms the group with the
    /// survivors (and a replacement, with
    /// [`replace_lost_workers`](super::JobBuilder::replace_lost_workers)).
    pub fn kill_worker(&self, rank: usize) -> Result<u32, EmbedError> {
        if matches!(self.placement, "remote") {
            return Err(EmbedError::Unsupported { what: "killing a worker", placement: self.placement });
        }
        let (reply, answer) = std::sync::mpsc::channel();
        self.commands.send(Command::Kill { rank, reply }).map_err(|_| EmbedError::NotRunning)?;
        answer.recv().map_err(|_| EmbedError::NotRunning)?
    }

    /// Blocks until step `step` (0-based) is committed (`true`) or the job ended first (`false`).
    pub fn wait_for_step(&self, step: u64) -> bool {
        let mut progress = self.shared.progress.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if progress.committed.is_some_and(|c| c >= step) {
                return true;
            }
            if progress.ended {
                return false;
            }
            progress = self.shared.changed.wait(progress).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// The newest committed step (0-based), if any.
    pub fn committed(&self) -> Option<u64> {
        self.shared.progress.lock().unwrap_or_else(PoisonError::into_inner).committed
    }

    /// Waits for the job to end and returns its report.
    pub fn wait(self) -> Result<Report, EmbedError> {
        drop(self.commands);
        self.driver.join().map_err(|_| EmbedError::DriverLost)?
    }
}

impl Shared {
    fn publish(&self, change: impl FnOnce(&mut Progress)) {
        change(&mut self.progress.lock().unwrap_or_else(PoisonError::into_inner));
        self.changed.notify_all();
    }
}

async fn drive<T: EmbeddedTask>(setup: Setup<T>, commands: mpsc::UnboundedReceiver<Command>, shared: Arc<Shared>) -> Result<Report, EmbedError> {
    match setup.placement.clone() {
        Placement::Remote { supervisor, token, workers } => drive_remote(setup, supervisor, token, workers, commands).await,
        Placement::InProcess { workers } | Placement::LocalProcesses { workers } => drive_local(setup, workers, commands, shared).await,
    }
}

/// `InProcess` and `LocalProcesses`: the supervisor runs here, on loopback QUIC.
async fn drive_local<T: EmbeddedTask>(setup: Setup<T>, workers: usize, mut commands: mpsc::UnboundedReceiver<Command>, shared: Arc<Shared>) -> Result<Report, EmbedError> {
    let Setup { task, placement, description, mut elastic, run_dir, child_args, mut observer } = setup;
    let token = protocol::generate_token().map_err(|reason| EmbedError::Runtime { during: "generating the cluster token", source: SupervisorError::Launch(reason) })?;
    if matches!(placement, Placement::InProcess { .. }) {
        elastic.transport = rtx_supervisor::Wire::Injected;
    }
    let (requests_tx, requests_rx) = mpsc::channel(LAUNCH_QUEUE);
    let options = SupervisorOptions {
        listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
        token: token.clone(),
        job: description.to_toml(),
        total_steps: description.steps,
        stop_at: None,
        elastic,
        resume: None,
        resume_next_step: 0,
        run_dir: run_dir.clone(),
        link: Default::default(),
    };
    let mut supervisor = SupervisorHandle::start(options, Some(requests_tx.clone())).await.map_err(EmbedError::runtime("starting the supervisor"))?;
    let launcher = match placement {
        Placement::InProcess { .. } => start_threads(task, description.seed, &supervisor, token, workers, requests_rx)?,
        _ => start_processes(&supervisor, token, workers, run_dir, child_args, requests_rx)?,
    };

    let mut report = Report::default();
    let mut pids: Vec<u32> = Vec::new();
    let mut failed: Option<String> = None;
    loop {
        tokio::select! {
            biased;
            event = supervisor.events.recv() => {
                let Some(event) = event else { break };
                if let Some(observe) = observer.as_mut() {
                    observe(&event);
                }
                report.record(&event);
                match &event {
                    JobEvent::Committed { step, .. } => shared.publish(|p| p.committed = Some(*step)),
                    JobEvent::Generation { pids: members, .. } => pids = members.clone(),
                    JobEvent::Failed { reason } => failed = Some(reason.clone()),
                    _ => {}
                }
            }
            Some(command) = commands.recv() => match command {
                Command::Kill { rank, reply } => {
                    let result = match pids.get(rank) {
                        Some(&pid) => requests_tx.send(LaunchRequest::Kill { pid }).await.map(|()| pid).map_err(|_| EmbedError::NotRunning),
                        None => Err(EmbedError::NoSuchRank { rank, world: pids.len() }),
                    };
                    let _ = reply.send(result);
                }
            },
        }
    }
    shared.publish(|p| p.ended = true);
    let joined = supervisor.join().await;
    drop(requests_tx);
    let _ = launcher.await;
    if let Some(reason) = failed {
        return Err(EmbedError::JobFailed { reason });
    }
    joined.map_err(EmbedError::runtime("running the supervisor"))?;
    if report.checksum.is_none() {
        return Err(EmbedError::JobFailed { reason: "the supervisor stopped without finishing the job".into() });
    }
    report.workers_finished = report.generations.last().map_or(0, |g| g.world);
    Ok(report)
}

/// Starts `workers` in-process workers and serves the supervisor's launch requests with them.
fn start_threads<T: EmbeddedTask>(task: Arc<T>, seed: u64, supervisor: &SupervisorHandle, token: String, workers: usize, mut requests: mpsc::Receiver<LaunchRequest>) -> Result<tokio::task::JoinHandle<()>, EmbedError> {
    let mut launcher = ThreadLauncher {
        task,
        seed,
        join: supervisor.addr,
        token,
        wire: Arc::new(InProcessWire::default()),
        supervisor: supervisor.actor(),
        runtime: tokio::runtime::Handle::current(),
        next_index: 0,
        nodes: Arc::default(),
        running: Default::default(),
    };
    for _ in 0..workers {
        launcher.spawn_node().map_err(EmbedError::runtime("starting an in-process worker"))?;
    }
    Ok(tokio::spawn(async move {
        while let Some(request) = requests.recv().await {
            serve_request(&mut launcher, request);
        }
        launcher.shutdown(SHUTDOWN_GRACE).await;
    }))
}

/// Starts `workers` child processes of this program (see [`super::run_worker_if_child`]).
fn start_processes(supervisor: &SupervisorHandle, token: String, workers: usize, run_dir: Option<PathBuf>, child_args: Option<Vec<String>>, requests: mpsc::Receiver<LaunchRequest>) -> Result<tokio::task::JoinHandle<()>, EmbedError> {
    let program = std::env::current_exe().map_err(|source| EmbedError::Io { what: "find this program's path to start worker processes", source })?;
    let threads = (std::thread::available_parallelism().map_or(2, |n| n.get()) / workers.max(1)).max(1);
    let launch = LaunchOptions {
        program,
        args: child_args.unwrap_or_else(|| std::env::args().skip(1).collect()),
        env: vec![(CHILD_JOIN_ENV.into(), supervisor.addr.to_string()), (crate::elastic::TOKEN_ENV.into(), token), ("RTX_NUM_THREADS".into(), threads.to_string())],
        log_dir: run_dir.map(|d| d.join("logs")),
        grace: SHUTDOWN_GRACE,
    };
    let launcher = Launcher::start(launch, workers, supervisor.actor(), requests).map_err(EmbedError::runtime("starting worker processes"))?;
    Ok(tokio::spawn(launcher.shutdown()))
}

/// `Remote`: `workers` in-process workers join a supervisor elsewhere, with the production
/// collectives (QUIC with the rank certificates it issues, or shared memory).
async fn drive_remote<T: EmbeddedTask>(setup: Setup<T>, addr: SocketAddr, token: String, workers: usize, mut commands: mpsc::UnboundedReceiver<Command>) -> Result<Report, EmbedError> {
    let Setup { task, description, .. } = setup;
    let refuse = tokio::spawn(async move {
        while let Some(Command::Kill { reply, .. }) = commands.recv().await {
            let _ = reply.send(Err(EmbedError::Unsupported { what: "killing a worker", placement: "remote" }));
        }
    });
    let mut nodes = Vec::with_capacity(workers);
    for index in 0..workers {
        let mut options = WorkerOptions::new(addr, token.clone(), format!("embedded-{}-{index}", std::process::id()));
        if !addr.ip().is_loopback() {
            options.bind_ip = local_ip_towards(addr).unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        }
        let env = NodeEnv { watch_sigterm: false, ..NodeEnv::process() };
        let (task, steps, seed) = (Arc::clone(&task), description.steps, description.seed);
        let make_job = move |spec: &rtx_supervisor::JobSpec| TaskJob::for_worker(task, spec, Some(steps), seed).map_err(|e| error_chain(&e));
        nodes.push(tokio::spawn(rtx_supervisor::run_node(options, env, make_job)));
    }
    let mut report = Report::default();
    let mut first_error = None;
    for node in nodes {
        match node.await {
            Ok(Ok(WorkerOutcome::Finished)) => report.workers_finished += 1,
            Ok(Ok(WorkerOutcome::Evicted(reason))) => tracing::warn!(%reason, "an embedded worker was evicted by the remote supervisor"),
            Ok(Err(source)) => first_error = first_error.or(Some(EmbedError::Runtime { during: "running a worker joined to the remote supervisor", source })),
            Err(_) => first_error = first_error.or(Some(EmbedError::DriverLost)),
        }
    }
    refuse.abort();
    match first_error {
        Some(e) if report.workers_finished == 0 => Err(e),
        _ => Ok(report),
    }
}

/// The local address the OS would use to reach `peer` (no packet is sent).
fn local_ip_towards(peer: SocketAddr) -> Option<IpAddr> {
    let socket = std::net::UdpSocket::bind(if peer.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }).ok()?;
    socket.connect(peer).ok()?;
    socket.local_addr().ok().map(|a| a.ip())
}
