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
}
