//! The `InProcess` placement: workers are node agents on the job's tokio runtime, each with its
//! compute on its own OS thread (the production `Exec::Thread`), joined to the supervisor over
//! loopback QUIC, with collectives over the in-process transport of `rtx-collectives`
//! ([`InProcessWire`], one network per generation).
//!
//! [`ThreadLauncher`] is the placement's `NodeLauncher`: it starts workers (at the start, and when
//! the supervisor asks for a replacement) and kills them. A kill is a crash as the supervisor
//! sees a process die: the worker's rank is cut off in every generation's network (its peers'
//! collectives fail at once), its node task (control link, heartbeats) is aborted, and its exit is
//! reported to the supervisor. Each worker reports a synthetic pid (`SYNTHETIC_PID_BASE` + its
//! index), because all of them share this process's.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use rtx_actors::ActorRef;
use rtx_collectives::{BoxFuture, InProcessNetwork, InProcessTransport, Transport};
use rtx_supervisor::{run_node, Exec, GenerationWire, JobSpec, NodeEnv, NodeLauncher, SupervisorError, SupervisorMsg, WorkerOptions, WorkerOutcome};

use super::task::{error_chain, EmbeddedTask, TaskJob};

/// The first synthetic pid of in-process workers: above Linux's largest pid (2^22), so it never
/// names a real process.
pub const SYNTHETIC_PID_BASE: u32 = 1 << 30;

/// Generations of networks kept: the current one and the one before (a member still leaving it).
const GENERATIONS_KEPT: u64 = 2;

/// The collectives wire of in-process workers: one [`InProcessNetwork`] per generation, made by
/// its first member to bind.
#[derive(Default)]
pub(crate) struct InProcessWire {
    generations: Mutex<BTreeMap<u64, WireGeneration>>,
}

struct WireGeneration {
    network: InProcessNetwork,
    transports: Vec<Option<InProcessTransport>>,
    /// Node → rank in this generation.
    ranks: BTreeMap<u64, usize>,
}

impl InProcessWire {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, WireGeneration>> {
        self.generations.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Node `node` died: its rank is cut off in every generation it is in.
    pub(crate) fn crash(&self, node: u64) {
        for generation in self.lock().values() {
            if let Some(rank) = generation.ranks.get(&node) {
                generation.network.disconnect(*rank);
            }
        }
    }
}

impl GenerationWire for InProcessWire {
    fn bind(&self, node: u64, generation: u64, rank: usize, world: usize) -> rtx_supervisor::Result<String> {
        let mut generations = self.lock();
        generations.retain(|g, _| g + GENERATIONS_KEPT > generation);
        let entry = generations.entry(generation).or_insert_with(|| {
            let (network, transports) = InProcessNetwork::new(world);
            WireGeneration { network, transports: transports.into_iter().map(Some).collect(), ranks: BTreeMap::new() }
        });
        if entry.transports.len() != world || rank >= world {
            return Err(SupervisorError::InvalidConfig { reason: format!("generation {generation}: rank {rank} of {world} does not fit its in-process network of {} ranks", entry.transports.len()) });
        }
        entry.ranks.insert(node, rank);
        Ok(format!("in-process/{generation}/{rank}"))
    }

    fn connect(&self, _node: u64, generation: u64, rank: usize, _addrs: &[String]) -> BoxFuture<'_, rtx_supervisor::Result<Arc<dyn Transport>>> {
        let taken = self.lock().get_mut(&generation).and_then(|g| g.transports.get_mut(rank)).and_then(Option::take);
        Box::pin(async move {
            let transport = taken.ok_or_else(|| SupervisorError::JobFailed { reason: format!("generation {generation}: rank {rank} has no in-process endpoint (not bound, or connected twice)") })?;
            Ok(Arc::new(transport) as Arc<dyn Transport>)
        })
    }
}

/// Starts and kills in-process workers for the supervisor (see the module doc).
pub(crate) struct ThreadLauncher<T> {
    pub(crate) task: Arc<T>,
    pub(crate) seed: u64,
    pub(crate) join: std::net::SocketAddr,
    pub(crate) token: String,
    pub(crate) wire: Arc<InProcessWire>,
    pub(crate) supervisor: ActorRef<SupervisorMsg>,
    pub(crate) runtime: tokio::runtime::Handle,
    pub(crate) next_index: u32,
    /// Synthetic pid → node id (known once the worker joined).
    pub(crate) nodes: Arc<Mutex<BTreeMap<u32, u64>>>,
    pub(crate) running: BTreeMap<u32, tokio::task::JoinHandle<()>>,
}

impl<T: EmbeddedTask> ThreadLauncher<T> {
    /// Waits for the workers to end on their own (they do once the job finished), at most
    /// `grace`, then aborts the rest.
    pub(crate) async fn shutdown(&mut self, grace: std::time::Duration) {
        let deadline = tokio::time::Instant::now() + grace;
        for (pid, handle) in std::mem::take(&mut self.running) {
            let abort = handle.abort_handle();
            if tokio::time::timeout_at(deadline, handle).await.is_err() {
                tracing::warn!(pid, "in-process worker still running after the grace period; aborting it");
                abort.abort();
            }
        }
    }
}

impl<T: EmbeddedTask> NodeLauncher for ThreadLauncher<T> {
    fn spawn_node(&mut self) -> rtx_supervisor::Result<u32> {
        let index = self.next_index;
        self.next_index += 1;
        let pid = SYNTHETIC_PID_BASE + index;
        let options = WorkerOptions::new(self.join, self.token.clone(), format!("embedded-{index}"));
        let env = NodeEnv { control: None, wire: Some(Arc::clone(&self.wire) as Arc<dyn GenerationWire>), exec: Exec::Thread, pid, host: None, watch_sigterm: false, checkpoints: None, compute: None };
        let (task, seed, nodes) = (Arc::clone(&self.task), self.seed, Arc::clone(&self.nodes));
        let make_job = move |spec: &JobSpec| {
            nodes.lock().unwrap_or_else(PoisonError::into_inner).insert(pid, spec.node);
            TaskJob::for_worker(task, spec, None, seed).map_err(|e| error_chain(&e))
        };
        let supervisor = self.supervisor.clone();
        let handle = self.runtime.spawn(async move {
            let status = match run_node(options, env, make_job).await {
                Ok(WorkerOutcome::Finished) => "finished".to_string(),
                Ok(WorkerOutcome::Evicted(reason)) => format!("evicted: {reason}"),
                Err(e) => {
                    tracing::warn!(pid, error = %e, "in-process worker failed");
                    format!("failed: {e}")
                }
            };
            let _ = supervisor.send(SupervisorMsg::ProcessExited { pid, status }).await;
        });
        tracing::info!(pid, index, "in-process worker started");
        self.running.insert(pid, handle);
        Ok(pid)
    }

    fn kill_node(&mut self, pid: u32) {
        let Some(handle) = self.running.remove(&pid) else { return };
        if let Some(node) = self.nodes.lock().unwrap_or_else(PoisonError::into_inner).get(&pid) {
            self.wire.crash(*node);
        }
        handle.abort();
        tracing::info!(pid, "in-process worker killed");
        let supervisor = self.supervisor.clone();
        self.runtime.spawn(async move {
            let _ = supervisor.send(SupervisorMsg::ProcessExited { pid, status: "killed".into() }).await;
        });
    }
}
