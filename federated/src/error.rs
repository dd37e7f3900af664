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
    /// A secure-aggregation message arrived in a phase that does not accept it.
    #[error("secure aggregation: {message} arrived in phase {phase}, which does not accept it")]
    SecAggPhase {
        /// The phase the state machine was in.
        phase: &'static str,
        /// The message or call that was refused.
        message: &'static str,
    },
    /// A secure-aggregation message names a client that has no business in this round or phase.
    #[error("secure aggregation: unknown client {client} in {phase}: {reason}")]
    SecAggUnknownClient {
        /// The phase the message belongs to.
        phase: &'static str,
        /// The client id the message names.
        client: u64,
        /// Why the client is unknown here.
        reason: String,
    },
    /// A client sent the same message (or the same share) twice.
    #[error("secure aggregation: duplicate {what} from client {client} in {phase}")]
    SecAggDuplicate {
        /// The phase the message belongs to.
        phase: &'static str,
        /// The client that sent it.
        client: u64,
        /// What was duplicated.
        what: String,
    },
    /// A secure-aggregation message is malformed: wrong length, bad key, a share that fails to decrypt.
    #[error("secure aggregation: malformed message from client {client} in {phase}: {reason}")]
    SecAggMalformed {
        /// The phase the message belongs to.
        phase: &'static str,
        /// The client that sent it.
        client: u64,
        /// What was wrong.
        reason: String,
    },
    /// Too few of a client's neighbours survived to reconstruct its secret: the round cannot be
    /// unmasked, and no (wrong) sum is returned.
    #[error("secure aggregation: cannot recover the {secret} of client {client}: {have} shares arrived, threshold is {threshold}")]
    SecAggTooFewShares {
        /// The client whose secret is needed.
        client: u64,
        /// Which secret: the self-mask seed of a survivor or the mask key of a dropped client.
        secret: &'static str,
        /// Shares that arrived from surviving neighbours.
        have: usize,
        /// Shares needed.
        threshold: usize,
    },
    /// Fewer clients than the protocol needs took part in a phase.
    #[error("secure aggregation: {phase} has {have} clients, at least {need} are needed")]
    SecAggTooFewClients {
        /// The phase that ran short.
        phase: &'static str,
        /// Clients present.
        have: usize,
        /// Clients needed.
        need: usize,
    },
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
    /// The link between the coordinator and a client host failed, or a peer broke the protocol.
    #[error("federation link to {peer}: {reason}")]
    Link {
        /// The other side (address or host name).
        peer: String,
        /// What went wrong.
        reason: String,
    },
    /// The coordinator refused a client host's join (wrong token, slice taken or out of range).
    #[error("the coordinator at {peer} refused the join: {reason}")]
    JoinRefused {
        /// The coordinator's address.
        peer: String,
        /// Its reason.
        reason: String,
    },
}

impl FedError {
    /// A [`FedError::Link`] to `peer`.
    pub fn link(peer: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        FedError::Link { peer: peer.into(), reason: reason.to_string() }
    }

    /// A [`FedError::Config`] for key `field`.
    pub fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        FedError::Config { field: field.into(), reason: reason.into() }
    }
}
