//! The embedding API's error type: every way building, starting, steering or finishing an embedded
//! job can fail, each naming what and why, with the lower layer's error kept as the source.

use rtx_supervisor::SupervisorError;

/// An error of the user's [`EmbeddedTask`](super::EmbeddedTask) (model, data, loss): any error
/// type, boxed. Tensor errors convert with `?`.
pub type TaskError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Errors of the embedding API.
#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    /// A builder option is out of range (zero workers, zero steps, `min_workers` above the start).
    #[error("invalid option {option}: {reason}")]
    InvalidOption {
        /// The option, as the builder method names it.
        option: &'static str,
        /// Why it is refused.
        reason: String,
    },
    /// The task failed before the job started (checked once in the launching program).
    #[error("the embedded task failed while {during}")]
    Task {
        /// What the task was doing (`building the model`, `making batch 0`).
        during: &'static str,
        /// The task's own error.
        #[source]
        source: TaskError,
    },
    /// The elastic runtime (supervisor, worker, launcher) failed.
    #[error("elastic runtime: {during}")]
    Runtime {
        /// What the runtime was doing.
        during: &'static str,
        /// The runtime's error.
        #[source]
        source: SupervisorError,
    },
    /// An operating-system resource (a thread, a tokio runtime, the program's own path) is
    /// unavailable.
    #[error("cannot {what}")]
    Io {
        /// What could not be done.
        what: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The supervisor gave up on the job (too few workers, a budget spent, a step that keeps
    /// failing); `reason` is the supervisor's.
    #[error("the job failed: {reason}")]
    JobFailed {
        /// The supervisor's reason.
        reason: String,
    },
    /// The job ended with replicas whose parameters differ.
    #[error("replicas ended with different parameters")]
    ReplicasDiverged,
    /// [`JobHandle::kill_worker`](super::JobHandle::kill_worker) named a rank the current
    /// generation does not have.
    #[error("no worker at rank {rank}: the current generation has {world} worker(s)")]
    NoSuchRank {
        /// The rank asked for.
        rank: usize,
        /// The current world size (0 before the first generation).
        world: usize,
    },
    /// The placement cannot do what was asked (killing a worker of a remote supervisor).
    #[error("{what} is not possible with placement {placement}")]
    Unsupported {
        /// What was asked.
        what: &'static str,
        /// The placement's name.
        placement: &'static str,
    },
    /// The job description a worker received does not fit this program's task or options.
    #[error("the job description from the supervisor does not fit this program: {reason}")]
    JobMismatch {
        /// What does not fit.
        reason: String,
    },
    /// The environment marking a child worker process is malformed.
    #[error("environment variable {name}: {reason}")]
    ChildEnvironment {
        /// The variable.
        name: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The job is no longer running (it finished or failed), so it cannot be steered.
    #[error("the job is no longer running")]
    NotRunning,
    /// The thread driving the job ended without a result (it panicked).
    #[error("the job's driver thread ended without a result")]
    DriverLost,
}

impl EmbedError {
    pub(crate) fn runtime(during: &'static str) -> impl FnOnce(SupervisorError) -> EmbedError {
        move |source| EmbedError::Runtime { during, source }
    }
}
