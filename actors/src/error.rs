//! The crate's error type: what went wrong with an actor, a mailbox or a link, and which one.

/// Errors of actors and links.
#[derive(Debug, thiserror::Error)]
pub enum ActorError {
    /// The actor has stopped (its mailbox is closed).
    #[error("actor `{name}` has stopped")]
    Stopped { name: String },
    /// A non-blocking send found the mailbox full.
    #[error("mailbox of actor `{name}` is full ({capacity} messages)")]
    MailboxFull { name: String, capacity: usize },
    /// The actor dropped a request without replying.
    #[error("actor `{name}` dropped the request without replying")]
    NoReply { name: String },
    /// A handler failed; the actor stops with this error.
    #[error("actor `{name}` failed: {reason}")]
    Failed { name: String, reason: String },
    /// A message could not be encoded or decoded.
    #[error("message codec: {0}")]
    Codec(String),
    /// An envelope broke the wire format (length over the cap, unknown kind, truncated).
    #[error("malformed envelope from {peer}: {reason}")]
    Malformed { peer: String, reason: String },
    /// The link to a peer is closed or was lost.
    #[error("link to {peer} closed: {reason}")]
    LinkClosed { peer: String, reason: String },
    /// A call did not get its reply in time.
    #[error("call to `{to}` on {peer} timed out after {after_ms} ms")]
    Timeout { peer: String, to: String, after_ms: u64 },
    /// The remote side answered a call with an error.
    #[error("remote `{to}` on {peer} answered with an error: {reason}")]
    Remote { peer: String, to: String, reason: String },
    /// Connecting or TLS setup failed.
    #[error("connect to {peer}: {reason}")]
    Connect { peer: String, reason: String },
    /// No actor under this name in the registry (or not of the asked message type).
    #[error("no actor named `{name}` with that message type in this node's registry")]
    NotRegistered { name: String },
}

/// Result with [`ActorError`].
pub type Result<T> = std::result::Result<T, ActorError>;
