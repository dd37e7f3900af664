//! Actors for rustytorch: every moving part of a training job (node agent, worker, data shard)
//! is an actor that owns its state and talks only by messages.
//!
//! - [`actor`]: the core. [`spawn`] runs an [`Actor`] as a tokio task with a **bounded** mailbox,
//!   so a slow actor pushes back on its senders instead of growing a queue; [`ActorRef::ask`]
//!   is a request/reply; [`ActorHandle`] reports how the actor ended (stopped, failed, panicked)
//!   to whoever supervises it.
//! - [`registry`]: a node-scoped [`Registry`] of named actors. There is no process-global name
//!   table, so many nodes can live in one process (tests, the simulator).
//! - [`link`]: remote actor references. A [`Link`] is one QUIC connection between two nodes
//!   carrying length-prefixed envelopes whose bodies are rkyv-archived messages; [`RemoteRef`]
//!   sends (`tell`) or calls (`ask`) a named actor on the other side. [`Link::over_transport`]
//!   runs the same envelopes on a side stream of the collectives' QUIC transport to a peer rank,
//!   on its control connection (its own socket and thread by default), so control messages do not
//!   wait behind tensors.
//! - [`tls`]: the same links over TCP with mutual TLS 1.3 against the cluster CA
//!   ([`TlsLinkListener`], [`Link::dial_tls`]): the low-latency carrier for control calls between
//!   ranks, beside the QUIC transport that moves tensors.
//! - [`auth`]: channel-bound token proofs (HMAC over the link's TLS exporter) for joins.
//! - [`data_shard`]: the `DataShard` role: serves training batches, prefetching the next one.
//!
//! Why not ractor (DESIGN.md named it): its mailboxes are unbounded by design (ractor issue #84,
//! closed: "backpressure is not implemented"), its name registry and process groups are
//! process-global, and its supervision children live in a `HashMap`. Bounded mailboxes and
//! node-scoped names are requirements here, and the core that gives them is ~300 lines on tokio.

pub mod actor;
pub mod auth;
pub mod data_shard;
mod error;
pub mod link;
mod outgoing;
pub mod registry;
pub mod tls;
mod wire;

pub use actor::{spawn, Actor, ActorHandle, ActorRef, Context, Exit, Reply, DEFAULT_MAILBOX};
pub use data_shard::{BatchSource, DataShard};
pub use error::{ActorError, Result};
pub use link::{Accepted, Inbound, Link, LinkListener, LinkOptions, RemoteRef, StreamConn, ACTOR_CHANNEL};
pub use registry::Registry;
pub use tls::{TlsLinkListener, TLS_LINK_ALPN};
pub use wire::{decode, encode, MAX_ENVELOPE_BYTES};
