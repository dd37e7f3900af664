//! The process launcher: starts worker processes on this machine, tells the supervisor when
//! one exits (the fastest crash detection there is), kills hung ones on request, and starts
//! replacements. When its request channel closes it gives the children a grace period to exit
//! on their own, then kills the rest: a finished or failed launch leaves no orphan processes.
//!
//! [`NodeLauncher`] is what any launcher does for the supervisor: start a node, kill one. The
//! process launcher implements it with child processes; the simulator with node tasks on its
//! runtime (a crash aborts every task of the node, a restart runs the real join path). Either
//! way the supervisor talks to it only through [`LaunchRequest`]s ([`serve_request`]) and
//! hears of exits as `SupervisorMsg::ProcessExited`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use rtx_actors::ActorRef;
use tokio::sync::{mpsc, oneshot};

use crate::error::{Result, SupervisorError};
use crate::supervisor::{LaunchRequest, SupervisorMsg};

/// Starts and kills the nodes of a job on the supervisor's behalf (see the module doc).
pub trait NodeLauncher {
    /// Starts one more node; returns its pid (a real one, or the simulator's).
    fn spawn_node(&mut self) -> Result<u32>;
    /// Kills node `pid` at once (SIGKILL, or aborting its tasks); its exit is reported to the
    /// supervisor like any other.
    fn kill_node(&mut self, pid: u32);
}

/// Carries out one of the supervisor's requests on `launcher`.
pub fn serve_request<L: NodeLauncher + ?Sized>(launcher: &mut L, request: LaunchRequest) {
    match request {
        LaunchRequest::Spawn => {
            if let Err(e) = launcher.spawn_node() {
                tracing::error!(error = %e, "cannot start a replacement worker");
            }
        }
        LaunchRequest::Kill { pid } => launcher.kill_node(pid),
    }
}

/// How to start one worker process.
#[derive(Clone, Debug)]
pub struct LaunchOptions {
    /// The program (usually the `rtx` binary itself).
    pub program: PathBuf,
    /// Its arguments (e.g. `worker --join ADDR`).
    pub args: Vec<String>,
    /// Extra environment (e.g. the token).
    pub env: Vec<(String, String)>,
    /// Where each worker's output goes (`worker-<i>.log`); `None` inherits this process's.
    pub log_dir: Option<PathBuf>,
    /// How long children may take to exit on their own at the end.
    pub grace: Duration,
}

/// A running launcher.
pub struct Launcher {
    task: tokio::task::JoinHandle<()>,
    pids: tokio::sync::watch::Receiver<Vec<u32>>,
}

impl Launcher {
    /// Starts `initial` workers now and serves `requests` (from the supervisor) until every
    /// sender is dropped; exits are sent to `supervisor`.
    pub fn start(options: LaunchOptions, initial: usize, supervisor: ActorRef<SupervisorMsg>, mut rx: mpsc::Receiver<LaunchRequest>) -> Result<Launcher> {
        if let Some(dir) = &options.log_dir {
            std::fs::create_dir_all(dir).map_err(|e| SupervisorError::Launch(format!("cannot create log folder {}: {e}", dir.display())))?;
        }
        let (pids_tx, pids) = tokio::sync::watch::channel(Vec::new());
        let mut state = LauncherState { options, next_index: 0, children: BTreeMap::new(), supervisor, pids: pids_tx };
        for _ in 0..initial {
            state.spawn_node()?;
        }
        let task = tokio::spawn(async move {
            while let Some(request) = rx.recv().await {
                serve_request(&mut state, request);
            }
            state.shutdown().await;
        });
        Ok(Launcher { task, pids })
    }

    /// Pids of the children still running.
    pub fn pids(&self) -> Vec<u32> {
        self.pids.borrow().clone()
    }

    /// Waits until the supervisor is gone (its request sender dropped), then the grace period
    /// for children to exit, and kills the rest.
    pub async fn shutdown(self) {
        let _ = self.task.await;
    }
}

struct LauncherState {
    options: LaunchOptions,
    next_index: usize,
    children: BTreeMap<u32, (oneshot::Sender<()>, tokio::task::JoinHandle<()>)>,
    supervisor: ActorRef<SupervisorMsg>,
    pids: tokio::sync::watch::Sender<Vec<u32>>,
}

impl NodeLauncher for LauncherState {
    fn spawn_node(&mut self) -> Result<u32> {
        let index = self.next_index;
        self.next_index += 1;
        let mut command = tokio::process::Command::new(&self.options.program);
        command.args(&self.options.args).envs(self.options.env.iter().cloned()).env("RTX_WORKER_INDEX", index.to_string()).stdin(Stdio::null()).kill_on_drop(true);
        if let Some(dir) = &self.options.log_dir {
            let path = dir.join(format!("worker-{index}.log"));
            let file = std::fs::File::create(&path).map_err(|e| SupervisorError::Launch(format!("cannot create {}: {e}", path.display())))?;
            let err = file.try_clone().map_err(|e| SupervisorError::Launch(e.to_string()))?;
            command.stdout(file).stderr(err);
        }
        let mut child = command.spawn().map_err(|e| SupervisorError::Launch(format!("cannot start {}: {e}", self.options.program.display())))?;
        let pid = child.id().ok_or_else(|| SupervisorError::Launch("a started worker has no pid".into()))?;
        tracing::info!(pid, index, "worker process started");
        let (kill_tx, kill_rx) = oneshot::channel::<()>();
        let supervisor = self.supervisor.clone();
        let watcher = tokio::spawn(async move {
            let status = tokio::select! {
                status = child.wait() => status,
                _ = kill_rx => {
                    let _ = child.start_kill();
                    child.wait().await
                }
            };
            let status = match status {
                Ok(s) => describe(s),
                Err(e) => format!("wait failed: {e}"),
            };
            tracing::info!(pid, %status, "worker process ended");
            let _ = supervisor.send(SupervisorMsg::ProcessExited { pid, status }).await;
        });
        self.children.insert(pid, (kill_tx, watcher));
        self.publish();
        Ok(pid)
    }

    fn kill_node(&mut self, pid: u32) {
        if let Some((kill, watcher)) = self.children.remove(&pid) {
            let _ = kill.send(());
            // Keep the watcher running until the process is reaped.
            tokio::spawn(async move {
                let _ = watcher.await;
            });
        }
        self.publish();
    }
}

impl LauncherState {
    fn publish(&mut self) {
        self.children.retain(|_, (_, watcher)| !watcher.is_finished());
        let _ = self.pids.send(self.children.keys().copied().collect());
    }

    async fn shutdown(&mut self) {
        let deadline = tokio::time::Instant::now() + self.options.grace;
        while tokio::time::Instant::now() < deadline {
            self.publish();
            if self.children.is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for (pid, (kill, watcher)) in std::mem::take(&mut self.children) {
            tracing::warn!(pid, "worker still running after the grace period; killing it");
            let _ = kill.send(());
            let _ = watcher.await;
        }
        self.publish();
    }
}

fn describe(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        _ => "ended".into(),
    }
}
