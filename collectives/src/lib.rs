//! Collectives for rustytorch: moving tensors between ranks. Start from [`Endpoint`] (one per rank,
//! on a [`Transport`]) and the [`Communicator`] it forms for a group of ranks at a generation, which
//! runs `all_reduce`, `reduce_scatter`, `all_gather`, `broadcast`, `reduce`, `barrier`,
//! `send`/`recv`, `all_to_all` and `split` on f32, f64 and bf16 buffers. Frames ([`frame`]) are a
//! fixed little-endian header plus raw payload bytes. [`InProcessNetwork`] links ranks that are tokio
//! tasks of one process; [`QuicTransport`] (feature `quic`, on by default) links processes and machines
//! with mutual TLS against a [`ClusterCa`], and [`ShmTransport`] (feature `shm`) links processes on one
//! machine through shared-memory rings; the simulator implements [`Transport`] itself. This crate does not decide
//! membership or detect failures beyond connection loss and timeouts: the supervisor bumps
//! generations and re-forms groups.
//!
//! Speed (measured by `rtx bench collectives`, numbers in BENCHMARKS.md): large messages go round a
//! ring in pieces, round-major and windowed, with all-reduce's two phases fused; receives are
//! posted ahead so that shared memory hands each piece to the operation in place (it is read and
//! combined straight out of the ring, [`LentBytes`]), QUIC hands large payloads over as quinn's
//! decrypted pieces ([`ChunkedBytes`]), and shared memory writes each piece straight from the tensor; a
//! waiting operation first polls the transport itself for a few tens of microseconds
//! ([`Transport::poll_incoming`]) before it sleeps; transports push frames into the endpoint from
//! their reader thread or task ([`EventSink`]); and payloads are checksummed only where the channel
//! does not already guarantee integrity. QUIC on loopback uses 64 KB packets, large socket buffers
//! and AES-128-GCM. `reduce_scatter`, `reduce` and bf16 all-reduces read the caller's buffer where
//! it is (only the owned segment is copied, as accumulators); `reduce_scatter_in_place` and
//! `all_gather_in_place` need no second buffer at all. A large all-reduce may be split into several
//! independent rings driven by their own threads ([`CommConfig::channels`]). With a host map
//! ([`CommConfig::host_of`]), `all_reduce` goes hierarchical (within hosts, then across).
//!
//! Communicators are used through the [`Collective`] / [`CollectiveGroup`] traits by code that should
//! not care where buffers live: [`Communicator`] implements them over host slices, and
//! `NcclCommunicator` (feature `nccl`, which enables `rtx-kernels/cuda`) over device buffers, with
//! NCCL's unique id exchanged over a host communicator ([`exchange_unique_id`]).
//!
//! Failures: a lost peer fails only the receives that needed a frame from it that never came;
//! frames it delivered before leaving are still used, so a rank may leave as soon as its last
//! collective returns. The rank that notices a loss tells the rest of the group (an abort frame),
//! so nobody waits for the timeout.

mod algo;
mod channel;
mod collective;
mod communicator;
mod element;
mod endpoint;
mod error;
pub mod frame;
mod group;
mod in_process;
#[cfg(feature = "quic")]
mod linking;
mod nccl;
mod op;
mod pool;
#[cfg(feature = "quic")]
mod quic;
mod routed;
#[cfg(feature = "shm")]
mod shm;
#[cfg(feature = "shm")]
mod shm_ring;
#[cfg(any(feature = "quic", feature = "shm"))]
mod stand_back;
mod sync;
#[cfg(feature = "quic")]
mod tls;
mod transport;

pub use channel::{DEFAULT_CHANNELS, MAX_CHANNELS};
pub use collective::{Collective, CollectiveGroup};
pub use communicator::{
    AllReduceAlgorithm, CommConfig, Communicator, DEFAULT_CHUNK_BYTES, DEFAULT_MAX_PAYLOAD_BYTES, DEFAULT_MAX_STORED_FRAMES, DEFAULT_OP_TIMEOUT,
    DEFAULT_RING_WINDOW, DEFAULT_SMALL_MESSAGE_BYTES, MAX_RING_WINDOW,
};
pub use element::{Accumulator, Element, WireElement};
pub use endpoint::{Endpoint, WORLD_GROUP_ID};
pub use error::{Error, Result};
pub use frame::OpKind;
pub use in_process::{InProcessNetwork, InProcessTransport, IN_PROCESS_INBOX_FRAMES};
pub use nccl::{decode_id_message, encode_id_message, exchange_unique_id, NcclUniqueId, ID_MESSAGE_WORDS, NCCL_UNIQUE_ID_BYTES};
#[cfg(feature = "nccl")]
pub use nccl::{nccl_unique_id, probe_nccl, NcclCommunicator, NcclElement, NcclOptions, NCCL_MIN_VERSION};
pub use op::segment_range;
pub use pool::{BufferPool, PoolStats, PooledBuf, POOL_MAX_BYTES, POOL_MAX_CLASS_BYTES, POOL_MAX_PER_CLASS, POOL_MIN_CLASS_BYTES};
#[cfg(feature = "quic")]
pub use quic::{
    certificate_names_rank, client_tls_config, client_tls_config_with, cpu_has_aes, quic_stream_throughput, rank_name, server_tls_config, server_tls_config_with,
    tls_packet_cipher_throughput, Cipher, CipherThroughput, ClusterCa,
    ControlPath, NodeIdentity, QuicOptions, QuicTransport, ALPN, CONTROL_ALPN, DEFAULT_LOOPBACK_DATAGRAM_BYTES, DEFAULT_NETWORK_DATAGRAM_BYTES, MAX_STRIPES,
    QUIC_INBOX_FRAMES,
};
pub use routed::RoutedTransport;
pub use rtx_kernels::DType;
#[cfg(feature = "shm")]
pub use shm::{ShmOptions, ShmTransport, DEFAULT_RING_BYTES, SHM_INBOX_FRAMES};
#[cfg(feature = "quic")]
pub use tls::{set_tcp_liveness, TlsOptions, TlsTransport, DEFAULT_KEY_UPDATE_RECORDS, TLS_ALPN, TLS_CHUNK_BYTES, TLS_INBOX_FRAMES};
pub use transport::{AwaitedFrame, BoxFuture, BytesPiece, ChunkedBytes, EventSink, FillPayload, Lender, LentBytes, PlainCursor, SealedPayload, Transport, TransportEvent};

/// How `all_reduce`, `reduce_scatter` and `reduce` combine elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum, accumulated in f32 (f64 for f64).
    Sum,
    /// Sum divided by the group size, once, after the full sum.
    Avg,
    /// Maximum; NaN propagates.
    Max,
    /// Minimum; NaN propagates.
    Min,
}
