//! A federation over real processes: a coordinator (`rtx fed serve`) and client host processes
//! (`rtx fed clients --join HOST:PORT --population-slice A..B`) linked by QUIC, with the same
//! channel-bound token proof as the data-parallel runtime's join.
//!
//! Each host holds a contiguous slice of the population and, each round, computes its pieces of
//! the round's aggregation tree ([`crate::Federation::host_pieces`]); the coordinator finishes the
//! tree in the same fixed order ([`crate::Federation::finish_round`]). With every piece in, the
//! global model's bits equal the in-process run's for any number of hosts; a host that dies or
//! misses the round timeout loses only its clients' updates for that round, exactly as the
//! in-process `host_down` fault does.

pub mod coordinator;
pub mod host;
pub mod protocol;

pub use coordinator::{Coordinator, CoordinatorCore, CoordinatorOptions, RemoteRound};
pub use host::{HostConnection, HostOptions, HostSession, HostSummary};
