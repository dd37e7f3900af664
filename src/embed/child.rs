//! The `LocalProcesses` placement's child side: [`run_worker_if_child`]. The launching program
//! starts its workers by re-executing itself (like Python multiprocessing's `spawn`) with
//! [`CHILD_JOIN_ENV`] set to the supervisor's address and the cluster token in `RTX_TOKEN`; the
//! program's `main` calls [`run_worker_if_child`] first, which in a child joins the supervisor,
//! trains as one worker and exits the process, and in the launching program returns at once.

use std::net::SocketAddr;
use std::sync::Arc;

use rtx_supervisor::{WorkerOptions, WorkerOutcome};

use super::error::{EmbedError, TaskError};
use super::task::{error_chain, EmbeddedTask, TaskJob};

/// Set in a worker process started by the `LocalProcesses` placement: the supervisor's control
/// address.
pub const CHILD_JOIN_ENV: &str = "RTX_EMBED_JOIN";

/// In a worker process started by [`Placement::LocalProcesses`](super::Placement::LocalProcesses):
/// builds the task with `make_task`, joins the supervisor, trains until the job ends, and exits
/// the process (status 0; a failure is returned as the error, so `main` exits non-zero).
/// Anywhere else it returns `Ok(())` at once without calling `make_task`.
///
/// Call it first in `main`, before anything the workers must not do (parse the command line for
/// the launcher, print, start the job):
///
/// ```no_run
/// # use rustytorch::embed::{self, EmbeddedTask};
/// # fn my_task() -> Result<impl EmbeddedTask, embed::TaskError> { Ok(embed::tasks::Regression::new(64, 3)?) }
/// fn main() -> Result<(), embed::EmbedError> {
///     embed::run_worker_if_child(my_task)?;
///     // Only the launching program gets here.
///     Ok(())
/// }
/// ```
pub fn run_worker_if_child<T, F>(make_task: F) -> Result<(), EmbedError>
where
    T: EmbeddedTask,
    F: FnOnce() -> Result<T, TaskError>,
{
    let Some(join) = std::env::var_os(CHILD_JOIN_ENV) else { return Ok(()) };
    let join_text = join.to_string_lossy().into_owned();
    let join: SocketAddr = join_text.parse().map_err(|e| EmbedError::ChildEnvironment { name: CHILD_JOIN_ENV, reason: format!("{join_text:?} is not a socket address: {e}") })?;
    let token = std::env::var(crate::elastic::TOKEN_ENV).ok().filter(|t| !t.is_empty()).ok_or(EmbedError::ChildEnvironment { name: "RTX_TOKEN", reason: "not set: a worker process needs the cluster token".into() })?;
    let index = std::env::var("RTX_WORKER_INDEX").unwrap_or_else(|_| std::process::id().to_string());
    let threads = rtx_supervisor::env::threads_from_env(|k| std::env::var(k).ok()).map_err(EmbedError::runtime("reading RTX_NUM_THREADS"))?;
    if let Some(threads) = threads {
        // Fails only when the pool was already built (then the kernels use that one).
        let _ = rayon::ThreadPoolBuilder::new().num_threads(threads).build_global();
    }
    let task = Arc::new(make_task().map_err(|source| EmbedError::Task { during: "building the task in a worker process", source })?);
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(|source| EmbedError::Io { what: "start a worker's tokio runtime", source })?;
    let options = WorkerOptions::new(join, token, format!("embedded-{index}"));
    let outcome = runtime.block_on(rtx_supervisor::run_worker(options, move |spec| TaskJob::for_worker(task, spec, None, 0).map_err(|e| error_chain(&e))));
    match outcome {
        Ok(WorkerOutcome::Finished) => std::process::exit(0),
        Ok(WorkerOutcome::Evicted(reason)) => {
            tracing::warn!(%reason, "this worker left the job");
            std::process::exit(0)
        }
        Err(source) => Err(EmbedError::Runtime { during: "running a worker process", source }),
    }
}
