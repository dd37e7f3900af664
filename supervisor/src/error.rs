//! The crate's error type: joining, membership, training and launching failures, each naming
//! what and why.

/// Errors of the supervisor, node agents and workers.
#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    /// The supervisor refused to admit this worker.
    #[error("the supervisor refused to admit this worker: {reason}")]
    Refused { reason: String },
    /// The supervisor could not prove it knows the cluster token (wrong address, wrong token, or someone in the middle).
    #[error("the peer at {addr} did not prove knowledge of the cluster token; not joining")]
    NotAuthentic { addr: String },
    /// The connection to the supervisor was lost.
    #[error("lost the supervisor: {reason}")]
    SupervisorLost { reason: String },
    /// The job cannot go on.
    #[error("job failed: {reason}")]
    JobFailed { reason: String },
    /// A configuration value is wrong.
    #[error("invalid configuration: {reason}")]
    InvalidConfig { reason: String },
    /// The supervisor started a newer generation while this one was still connecting or
    /// syncing: it was abandoned at once.
    #[error("generation {generation} was superseded by generation {newer} while it was starting")]
    Superseded { generation: u64, newer: u64 },
    /// The training job (model, data, loss) failed.
    #[error("training job: {0}")]
    Job(String),
    /// Launching or watching worker processes failed.
    #[error("launcher: {0}")]
    Launch(String),
    /// An actor or link error.
    #[error(transparent)]
    Actor(#[from] rtx_actors::ActorError),
    /// A collectives error.
    #[error(transparent)]
    Collectives(#[from] rtx_collectives::Error),
    /// A data-parallel engine error.
    #[error(transparent)]
    DataParallel(#[from] rtx_pipelines::Error),
    /// A tensor error.
    #[error(transparent)]
    Tensor(#[from] rtx_tensor::Error),
    /// An environment variable (torchrun, Slurm) is malformed.
    #[error("environment variable {name}={value:?}: {reason}")]
    Environment { name: String, value: String, reason: String },
}

/// Result with [`SupervisorError`].
pub type Result<T> = std::result::Result<T, SupervisorError>;
