//! The simulator's error type: a scenario that cannot be read or run, each naming what and why.
//! An invariant violation is not an error: it is a result ([`crate::Violation`]) to report and
//! replay.

/// Errors of the simulator.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A scenario file is missing, malformed or asks for something unsupported.
    #[error("scenario: {0}")]
    Scenario(String),
    /// The job's data could not be loaded.
    #[error("data: {0}")]
    Data(String),
    /// The simulation runtime could not be built.
    #[error("simulation runtime: {0}")]
    Runtime(#[from] std::io::Error),
    /// The real supervisor could not start.
    #[error(transparent)]
    Supervisor(#[from] rtx_supervisor::SupervisorError),
}

/// Result with [`SimError`].
pub type Result<T> = std::result::Result<T, SimError>;
