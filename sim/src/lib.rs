//! Deterministic simulation for rustytorch (first part of the simulator issue): a seeded,
//! in-memory network ([`SimNetwork`]) whose [`SimTransport`]s implement the collectives
//! `Transport` trait and carry the very frames production sends, under tokio's paused (virtual)
//! clock on a single-thread runtime ([`run`]). Every delivery is folded into a [`TraceHash`], so
//! two runs of one seed can be compared bit for bit and a failure replayed from its seed.
//!
//! What is modelled per directed link ([`LinkModel`]): latency with uniform jitter, bandwidth
//! (serialization delay), loss (a lost packet is retransmitted after a timeout, as QUIC would:
//! the transport stays reliable and ordered, so loss shows up as delay), and partitions
//! (symmetric or one-way) with healing: a partitioned link delivers nothing, and after
//! [`SimConfig::loss_detect`] of silence both ends see `PeerLost`, as an idle timeout would report
//! it; healing brings `PeerUp`. Duplicates and reordering below an ordered, reliable transport are
//! invisible to its user, so they are not modelled separately. A crashed rank
//! ([`SimNetwork::crash`]) stops sending and receiving at once.

mod network;
mod trace;

pub use network::{run, LinkModel, SimConfig, SimNetwork, SimTransport};
pub use trace::TraceHash;
