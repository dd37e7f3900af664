//! The federation's typed errors: bad configurations, client slices out of range, malformed updates,
//! missing data. Each says what was wrong and why, so a caller can report it without a panic.

/// Result alias for this crate.
pub type Result<T, E = FedError> = std::result::Result<T, E>;

/// What went wrong in a federation.
#[derive(Debug, thiserror::Error)]
pub enum FedError {
    /// A configuration value is out of its allowed range or inconsistent with another.
    #[error("invalid federation config: {field}: {reason}")]
    Config {
        /// The offending key, e.g. `round.clients_per_round`.
        field: String,
        /// Why it was refused.
        reason: String,
    },
    /// The data a federation trains on could not be read.
    #[error("federation data: {0}")]
    Data(#[from] rtx_tensor::data::DataError),
    /// A configuration file could not be read or parsed.
    #[error("federation config {path}: {reason}")]
    ConfigFile {
        /// The file.
        path: String,
        /// The IO or TOML error.
        reason: String,
    },
    /// An availability trace (on/off times per client) could not be read or has a bad line.
    #[error("availability trace {path}:{line}: {reason}")]
    Trace {
        /// The trace file.
        path: String,
        /// 1-based line number (0 when the file itself could not be read).
        line: usize,
        /// What was wrong.
        reason: String,
    },
    /// The dataset cannot hold the requested partition (too few images for the shards, labels out
    /// of range, ...).
    #[error("partition {what}: {reason}")]
    Partition {
        /// Which partition rule.
        what: String,
        /// Why it cannot be built.
        reason: String,
    },
}

impl FedError {
    /// A [`FedError::Config`] for key `field`.
    pub fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        FedError::Config { field: field.into(), reason: reason.into() }
    }
}
