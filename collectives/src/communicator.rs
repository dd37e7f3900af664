//! [`Communicator`]: a group of ranks at a generation, and the collective operations on it.
//!
//! Every member must call the same collectives in the same order with matching sizes; the op
//! sequence number in each frame catches ranks that disagree ([`Error::OpMismatch`]). Algorithms are
//! chosen from the buffer size in bytes and the [`CommConfig`] alone, so all ranks choose alike
//! (the config must be the same on every rank):
//!
//! | operation | `bytes <= small_message_bytes` | larger |
//! |---|---|---|
//! | `all_reduce` | recursive doubling | direct exchange up to two frames per rank where the transport asks for it, else ring reduce-scatter + all-gather, fused in one pipeline |
//! | `broadcast` | binomial tree | pipelined chain |
//! | `reduce` | binomial tree | ring reduce-scatter + gather to root |
//! | `reduce_scatter`, `all_gather` | ring | ring |
//! | `all_to_all` | pairwise exchange | pairwise exchange |
//! | `barrier` | dissemination | — |
//!
//! With a host map ([`CommConfig::host_of`]) under which the group spans several hosts and some
//! host holds several of its members, `all_reduce` is hierarchical instead: binomial-tree reduce
//! to each host's leader (its lowest group rank), all-reduce among the leaders (doubling or ring,
//! by the same size rule), then broadcast within each host (tree or chain); only leaders send
//! across hosts. A large f32/f64 buffer on hosts of equal size goes sharded instead: ring
//! reduce-scatter within each host, a ring all-reduce per local rank index across hosts (each rank
//! carries its share), ring all-gather within each host.
//! [`Communicator::all_reduce_algorithm`] says which algorithm a size gets.
//!
//! The direct exchange ([`AllReduceAlgorithm::Direct`]) is the two-shot all-reduce: every rank
//! sends each other rank that rank's segment, combines what it gets into its own, and sends the
//! result to everyone: the ring's bytes in two dependent steps instead of `2(n - 1)`. It serves
//! the sizes where a ring has nothing to pipeline (each rank's segment at most two frames, below
//! `2 * size * chunk_bytes`, where a ring also gets a single channel) in groups of at most
//! [`CommConfig::direct_all_reduce_ranks`] ranks. Decision (issue 20, BENCHMARKS.md 2026-12-07):
//! over TLS it took a 4 MiB all_reduce between 4 processes on the 16-core host from 0.68x to 0.88x
//! Gloo (1.27x, every round) and 1 and 2 MiB 1.54x and 1.35x on 2 cores; over shared memory,
//! whose hops cost little, it gained nothing, and at 16 and 64 MiB (rings in channels) it lost
//! 5-12%. A buffer of a narrower type than its accumulator (bf16) is widened whole and moves as
//! accumulator values both ways (the ring gathers in the buffer's own type): at most two frames
//! per rank, by the window.
//!
//! Large messages travel in frames of at most `chunk_bytes`, forwarded piece by piece so the ring
//! and the chain pipeline. The defaults come from `rtx bench collectives` (2 and 4 rank processes
//! on 2 cores, QUIC and shared memory; BENCHMARKS.md): [`DEFAULT_SMALL_MESSAGE_BYTES`] is the
//! all-reduce crossover, where recursive doubling stops beating the ring (at 256 KiB they tie or
//! doubling is ahead for every transport and world size; from 1 MiB the ring is 0-30% ahead, and
//! more with four ranks, where doubling moves twice the bytes). [`DEFAULT_CHUNK_BYTES`]: 512 KiB
//! frames keep a ring step's received frame, local piece and send buffer within a 1 MiB L2; against
//! 1 MiB frames they gave QUIC +0-10% busbw with 2 ranks and +10-15% with 4 (quiet machine), +20-25%
//! under load (BENCHMARKS.md, 2026-12-01). A transport may prefer its own frame size when the config
//! leaves it unset: shared memory takes a sixteenth of its ring (256 KiB for the default 4 MiB
//! ring), 1.4-1.9x faster than 512 KiB frames in 16 MiB rings (BENCHMARKS.md, 2026-12-01 evening).
//! QUIC keeps 512 KiB: on a host with cores to spare 2 MiB frames were 4-20% faster, but 14% slower
//! at 64 MiB on 2 cores (BENCHMARKS.md, issue 20, 2026-12-04), so set `chunk_bytes`
//! there. TLS over TCP takes 1 MiB (`TLS_CHUNK_BYTES`), ahead of 512 KiB on both shapes.
//!
//! Channels ([`CommConfig::channels`], default 1): a flat ring all-reduce large enough that every
//! ring still moves a full frame per rank ([`Communicator::all_reduce_channels`]) is split into
//! that many independent rings over contiguous parts of the buffer, each an operation of its own on
//! the wire (consecutive sequence numbers) and, on a multi-thread runtime, driven by its own thread,
//! so copying and combining run on several cores (issue 20: one operation's task did all of it,
//! serially with its waits). Constraints, choice and trade-offs are in `channel.rs`.
//! `reduce_scatter` and `all_gather` keep one ring: their output is each rank's whole segment,
//! which contiguous parts of the buffer would cut across (NCCL splits every segment instead).
//!
//! Cancelling an operation (dropping its future) leaves the group's sequence numbers out of step
//! with the peers; move the group to a new generation before using it again.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use tracing::Instrument;

use crate::algo::{self, PooledVec, RsBuffers};
use crate::channel::{self, ChannelState, DEFAULT_CHANNELS, MAX_CHANNELS};
use crate::element::{Accumulator, Element, WireElement};
use crate::endpoint::Endpoint;
use crate::error::{Error, Result};
use crate::frame::OpKind;
use crate::group::GroupState;
use crate::op::{segment_range, OpCtx};
use crate::ReduceOp;

/// Default: buffers up to this many bytes use the latency-optimal algorithms (measured crossover,
/// see the module doc).
pub const DEFAULT_SMALL_MESSAGE_BYTES: usize = 256 << 10;
/// Default: most payload bytes per frame (pipelining granularity).
pub const DEFAULT_CHUNK_BYTES: usize = 512 << 10;
/// Default: frames a ring sends ahead of the frames it has received ([`CommConfig::ring_window`])
/// when the transport states no preference.
pub const DEFAULT_RING_WINDOW: usize = 2;
/// Most frames a ring may send ahead ([`CommConfig::ring_window`]).
pub const MAX_RING_WINDOW: usize = 64;
/// Default: the decoder refuses frames whose payload is larger than this.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 16 << 20;
/// Default: how long an operation waits for any one frame.
pub const DEFAULT_OP_TIMEOUT: Duration = Duration::from_secs(60);
/// Default: most frames parked per group (and orphans per endpoint).
pub const DEFAULT_MAX_STORED_FRAMES: usize = 1 << 16;

const _: () = assert!(DEFAULT_CHUNK_BYTES <= DEFAULT_MAX_PAYLOAD_BYTES);
const _: () = assert!(MAX_CHANNELS == 16, "the validation message names the bound");
const NO_COLOR: u32 = u32::MAX;

/// Tuning and limits of an endpoint and its communicators. Must be equal on every rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommConfig {
    /// How long an operation waits for any one frame before failing with [`Error::Timeout`].
    pub op_timeout: Duration,
    /// Buffers up to this many bytes use recursive doubling / trees; larger ones ring / chain.
    pub small_message_bytes: usize,
    /// Most payload bytes per frame; at least 8 (one f64). `None` (the default): the transport's
    /// preference ([`crate::Transport::preferred_chunk_bytes`]; shared memory: a sixteenth of its
    /// ring), else [`DEFAULT_CHUNK_BYTES`]. An [`crate::Endpoint`] resolves it when it is made, so
    /// its communicators' configs always hold `Some`.
    pub chunk_bytes: Option<usize>,
    /// Frames with a larger payload are refused by the decoder; at least `chunk_bytes`.
    pub max_payload_bytes: usize,
    /// Most frames a ring (all-reduce, reduce-scatter, all-gather) sends on its outgoing link
    /// ahead of the frames it has received on its incoming one, 1 to [`MAX_RING_WINDOW`]. `None`
    /// (the default): the transport's preference ([`crate::Transport::preferred_ring_window`];
    /// QUIC: 8), else [`DEFAULT_RING_WINDOW`]; resolved by the [`crate::Endpoint`] like
    /// `chunk_bytes`. Unlike the other fields it may differ between ranks: it only decides when a
    /// rank sends, never what.
    pub ring_window: Option<usize>,
    /// Most independent rings (channels) a large flat ring all-reduce is split into, each over a
    /// contiguous part of the buffer with its own sequence number and, on a multi-thread runtime,
    /// its own thread (see `channel.rs`), 1 to [`MAX_CHANNELS`]. `None` (the default): the
    /// transport's preference ([`crate::Transport::preferred_channels`]), else
    /// [`DEFAULT_CHANNELS`] (1); resolved by the [`crate::Endpoint`] like `chunk_bytes`. A buffer
    /// gets fewer channels when it is small ([`Communicator::all_reduce_channels`]). Must be equal
    /// on every rank: a rank that splits an operation differently fails it with
    /// [`Error::ChannelMismatch`] or the timeout.
    pub channels: Option<usize>,
    /// Most frames parked per group waiting for their operation.
    pub max_stored_frames: usize,
    /// The host each global rank runs on (any key; equal keys mean "same machine"), one entry per
    /// rank; empty (the default) means every rank is on a host of its own. When a group spans
    /// more than one host and some host has more than one of its members, `all_reduce` is
    /// hierarchical ([`AllReduceAlgorithm::Hierarchical`]); otherwise algorithms are flat.
    pub host_of: Vec<u32>,
    /// Largest group whose mid-size all_reduce (above `small_message_bytes`, below two frames per
    /// rank) runs the direct exchange ([`AllReduceAlgorithm::Direct`]) instead of the ring; 0 or 1
    /// turns it off. `None` (the default): the transport's preference
    /// ([`crate::Transport::preferred_direct_all_reduce_ranks`]; TLS: 8), else 0; resolved by the
    /// [`crate::Endpoint`] like `chunk_bytes`. Must be equal on every rank.
    pub direct_all_reduce_ranks: Option<usize>,
}

/// Which algorithm `all_reduce` runs for a buffer (see [`Communicator::all_reduce_algorithm`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AllReduceAlgorithm {
    /// Nothing moves: one rank, or an empty buffer.
    Local,
    /// Recursive doubling (small buffers).
    Doubling,
    /// Ring reduce-scatter + all-gather in one pipeline (large buffers).
    Ring,
    /// Direct (two-shot) exchange: segments to their owners, the owners' results to everyone
    /// (mid-size buffers on transports that ask for it, see [`CommConfig::direct_all_reduce_ranks`]).
    Direct,
    /// Reduce to one leader per host (binomial tree), all-reduce among the leaders (doubling or
    /// ring by size), broadcast within each host; for large f32/f64 buffers on hosts of equal
    /// size, reduce-scatter within hosts, one ring per local rank across hosts, all-gather within.
    Hierarchical,
}

/// A group of ranks at a generation; cheap to clone (clones share the group).
#[derive(Clone, Debug)]
pub struct Communicator {
    endpoint: Endpoint,
    state: Arc<GroupState>,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            op_timeout: DEFAULT_OP_TIMEOUT,
            small_message_bytes: DEFAULT_SMALL_MESSAGE_BYTES,
            chunk_bytes: None,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            ring_window: None,
            channels: None,
            max_stored_frames: DEFAULT_MAX_STORED_FRAMES,
            host_of: Vec::new(),
            direct_all_reduce_ranks: None,
        }
    }
}

impl CommConfig {
    /// The frame payload limit in force: `chunk_bytes`, or [`DEFAULT_CHUNK_BYTES`] when unset.
    pub fn effective_chunk_bytes(&self) -> usize {
        self.chunk_bytes.unwrap_or(DEFAULT_CHUNK_BYTES)
    }

    /// Frames a ring sends ahead: `ring_window`, or [`DEFAULT_RING_WINDOW`] when unset.
    pub fn effective_ring_window(&self) -> usize {
        self.ring_window.unwrap_or(DEFAULT_RING_WINDOW)
    }

    /// Most channels a large all-reduce is split into: `channels`, or [`DEFAULT_CHANNELS`] when
    /// unset.
    pub fn effective_channels(&self) -> usize {
        self.channels.unwrap_or(DEFAULT_CHANNELS)
    }

    /// Checks the relationships between the fields.
    pub fn validate(&self) -> Result<()> {
        if self.op_timeout.is_zero() {
            return Err(Error::InvalidConfig { reason: "op_timeout must be positive" });
        }
        if self.effective_chunk_bytes() < 8 {
            return Err(Error::InvalidConfig { reason: "chunk_bytes must hold one f64" });
        }
        if self.effective_chunk_bytes() > self.max_payload_bytes {
            return Err(Error::InvalidConfig { reason: "chunk_bytes over max_payload_bytes" });
        }
        if !(1..=MAX_RING_WINDOW).contains(&self.effective_ring_window()) {
            return Err(Error::InvalidConfig { reason: "ring_window must be 1 to 64 frames" });
        }
        if !(1..=MAX_CHANNELS).contains(&self.effective_channels()) {
            return Err(Error::InvalidConfig { reason: "channels must be 1 to 16" });
        }
        if self.max_stored_frames == 0 {
            return Err(Error::InvalidConfig { reason: "max_stored_frames must be positive" });
        }
        Ok(())
    }

    /// Checks the fields that depend on the number of ranks.
    pub(crate) fn validate_for(&self, world_size: usize) -> Result<()> {
        self.validate()?;
        if !self.host_of.is_empty() && self.host_of.len() != world_size {
            return Err(Error::InvalidConfig { reason: "host_of must name one host per rank (or be empty)" });
        }
        Ok(())
    }
}

impl Communicator {
    pub(crate) fn new(endpoint: Endpoint, state: Arc<GroupState>) -> Self {
        Communicator { endpoint, state }
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.state.my_index
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.state.members.len()
    }

    /// Global ranks of the members, in group-rank order.
    pub fn members(&self) -> &[usize] {
        &self.state.members
    }

    /// The group id (shared by all members).
    pub fn group_id(&self) -> u64 {
        self.state.id
    }

    /// The current generation.
    pub fn generation(&self) -> u64 {
        self.state.generation()
    }

    /// The endpoint this group runs on.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// The configuration in force.
    pub fn config(&self) -> &CommConfig {
        &self.endpoint.shared().config
    }

    /// Frames dropped because they belonged to an older generation.
    pub fn stale_frames_dropped(&self) -> u64 {
        self.state.stale_dropped()
    }

    /// Frames dropped because the group's mailbox was full.
    pub fn overflow_frames_dropped(&self) -> u64 {
        self.state.overflow_dropped()
    }

    /// The element range rank `rank` owns in a buffer of `len` elements (for `reduce_scatter` and
    /// `all_gather`): the first `len % size` ranks get one element more.
    pub fn segment(&self, len: usize, rank: usize) -> Range<usize> {
        segment_range(len, self.size(), rank)
    }

    /// Moves the group to `generation` (which must be higher): operations of the old generation fail
    /// with [`Error::StaleGeneration`], and their frames are dropped and counted.
    pub fn set_generation(&self, generation: u64) -> Result<()> {
        tracing::info!(group = self.state.id, generation, "generation advanced");
        self.endpoint.shared().advance(&self.state, generation)
    }

    /// Reduces `buf` element-wise across the group; every rank ends with the same bits.
    pub async fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let span = self.span(OpKind::AllReduce, std::mem::size_of_val(buf));
        async {
            let channels = self.all_reduce_channels(std::mem::size_of_val(buf));
            if channels > 1 {
                return self.channelled_all_reduce(buf, op, channels).await;
            }
            let mut ctx = self.begin(OpKind::AllReduce)?;
            let (rank, n) = (self.rank(), self.size());
            if n == 1 || buf.is_empty() {
                return Ok(());
            }
            let small = std::mem::size_of_val(buf) <= self.config().small_message_bytes;
            if let Some(hosts) = self.host_blocks() {
                return self.hierarchical_all_reduce(&mut ctx, buf, op, &hosts, small).await;
            }
            if small {
                if let Some(acc) = T::as_acc_mut(&mut *buf) {
                    return algo::doubling_all_reduce(&mut ctx, acc, op, rank, n).await;
                }
                // Small by definition: the whole buffer widened is a few hundred KiB at most.
                let mut work: Vec<T::Acc> = buf.iter().map(|x| x.to_acc()).collect();
                algo::doubling_all_reduce(&mut ctx, &mut work, op, rank, n).await?;
                round_into(buf, &work);
                return Ok(());
            }
            if self.all_reduce_algorithm(std::mem::size_of_val(buf)) == AllReduceAlgorithm::Direct {
                if let Some(acc) = T::as_acc_mut(&mut *buf) {
                    return algo::direct_all_reduce(&mut ctx, acc, op, rank, n).await;
                }
                // Mid-size by definition (two frames per rank at most): widened whole, as above.
                let mut work = PooledVec::widened(self.endpoint.pool(), buf);
                algo::direct_all_reduce(&mut ctx, work.as_mut_slice(), op, rank, n).await?;
                round_into(buf, work.as_slice());
                return Ok(());
            }
            self.ring_all_reduce(&mut ctx, buf, op).await
        }
        .instrument(span)
        .await
    }

    /// The flat ring all-reduce of `buf` as one operation (`ctx`).
    async fn ring_all_reduce<T: Element>(&self, ctx: &mut OpCtx<'_>, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let (rank, n) = (self.rank(), self.size());
        debug_assert!(n >= 2 && !buf.is_empty());
        if let Some(acc) = T::as_acc_mut(&mut *buf) {
            return algo::ring_all_reduce(ctx, acc, op, rank, n).await;
        }
        // Partial sums travel in the accumulator type; only the owned segment is widened (other
        // segments are widened piece by piece as they are sent), it is rounded once, and the
        // all-gather moves elements of the buffer's own type.
        let len = buf.len();
        let own = self.segment(len, rank);
        let pool = self.endpoint.pool();
        let mut own_acc = PooledVec::widened(pool, &buf[own.clone()]);
        algo::ring_reduce_scatter(ctx, RsBuffers::new(buf, own_acc.as_mut_slice(), own.clone(), pool), len, op, rank, n).await?;
        round_into(&mut buf[own], own_acc.as_slice());
        algo::ring_all_gather(ctx, buf, rank, n).await
    }

    /// The flat ring all-reduce of `buf` split into `channels` rings over contiguous parts
    /// ([`channel::part_range`]), each its own operation on the wire (consecutive sequence
    /// numbers) and, on a multi-thread runtime, its own thread (see `channel.rs`).
    async fn channelled_all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, channels: usize) -> Result<()> {
        debug_assert!((2..=MAX_CHANNELS).contains(&channels) && buf.len() >= channels);
        let state = Arc::new(ChannelState::default());
        let ctxs = self.begin_channels(OpKind::AllReduce, channels, &state)?;
        let len = buf.len();
        let mut parts = Vec::with_capacity(channels);
        let mut rest = buf;
        for c in 0..channels {
            let (part, tail) = rest.split_at_mut(channel::part_range(len, channels, c).len());
            parts.push(part);
            rest = tail;
        }
        debug_assert!(rest.is_empty(), "channel parts tile the buffer");
        let work: Vec<(OpCtx<'_>, &mut [T])> = ctxs.into_iter().zip(parts).collect();
        channel::run(&state, work, |mut ctx, part| async move { self.ring_all_reduce(&mut ctx, part, op).await }).await
    }

    /// How many channels [`all_reduce`](Self::all_reduce) splits a buffer of `bytes` bytes into:
    /// 1 unless it runs the flat ring ([`AllReduceAlgorithm::Ring`]); else the configured count
    /// ([`CommConfig::channels`]), reduced so that every channel's ring moves at least one full
    /// frame per rank (`bytes / (size * chunk_bytes)`), so small rings are never split. The same on
    /// every rank: it depends only on sizes and the config.
    pub fn all_reduce_channels(&self, bytes: usize) -> usize {
        if self.all_reduce_algorithm(bytes) != AllReduceAlgorithm::Ring {
            return 1;
        }
        let config = self.config();
        let per_channel_min = self.size().saturating_mul(config.effective_chunk_bytes()).max(1);
        config.effective_channels().min(bytes / per_channel_min).clamp(1, MAX_CHANNELS)
    }

    /// The algorithm [`all_reduce`](Self::all_reduce) runs on a buffer of `bytes` bytes (the same on
    /// every rank: it depends only on sizes and the config).
    pub fn all_reduce_algorithm(&self, bytes: usize) -> AllReduceAlgorithm {
        if self.size() == 1 || bytes == 0 {
            AllReduceAlgorithm::Local
        } else if self.host_blocks().is_some() {
            AllReduceAlgorithm::Hierarchical
        } else if bytes <= self.config().small_message_bytes {
            AllReduceAlgorithm::Doubling
        } else if self.size() <= self.config().direct_all_reduce_ranks.unwrap_or(0) && bytes < 2 * self.size() * self.config().effective_chunk_bytes() {
            AllReduceAlgorithm::Direct
        } else {
            AllReduceAlgorithm::Ring
        }
    }

    /// Reduces `input` across the group and leaves segment [`segment`](Self::segment)`(input.len(),
    /// rank)` of the result in `output`.
    pub async fn reduce_scatter<T: Element>(&self, input: &[T], output: &mut [T], op: ReduceOp) -> Result<()> {
        let span = self.span(OpKind::ReduceScatter, std::mem::size_of_val(input));
        async {
            let mut ctx = self.begin(OpKind::ReduceScatter)?;
            let (rank, n) = (self.rank(), self.size());
            let own = self.segment(input.len(), rank);
            if output.len() != own.len() {
                return Err(Error::BufferLength { op: OpKind::ReduceScatter, expected: own.len(), got: output.len() });
            }
            if n == 1 || input.is_empty() {
                output.copy_from_slice(input);
                return Ok(());
            }
            let len = input.len();
            let pool = self.endpoint.pool();
            if let (Some(input), Some(out)) = (T::as_acc(input), T::as_acc_mut(&mut *output)) {
                return algo::ring_reduce_scatter(&mut ctx, RsBuffers::separate(input, out, own, pool), len, op, rank, n).await;
            }
            // Only the owned segment is widened; the rest is read from `input` piece by piece.
            let mut own_acc = PooledVec::widened(pool, &input[own.clone()]);
            algo::ring_reduce_scatter(&mut ctx, RsBuffers::new(input, own_acc.as_mut_slice(), own, pool), len, op, rank, n).await?;
            round_into(output, own_acc.as_slice());
            Ok(())
        }
        .instrument(span)
        .await
    }

    /// [`reduce_scatter`](Self::reduce_scatter) without a separate output: afterwards segment
    /// [`segment`](Self::segment)`(buf.len(), rank)` of `buf` holds this rank's part of the result,
    /// bit for bit what `reduce_scatter` would have written to its output; the other segments are
    /// left unchanged. No copy of `buf` is made (bf16 widens only the owned segment).
    pub async fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let span = self.span(OpKind::ReduceScatter, std::mem::size_of_val(buf));
        async {
            let mut ctx = self.begin(OpKind::ReduceScatter)?;
            let (rank, n) = (self.rank(), self.size());
            if n == 1 || buf.is_empty() {
                return Ok(());
            }
            let len = buf.len();
            let own = self.segment(len, rank);
            let pool = self.endpoint.pool();
            if let Some(acc) = T::as_acc_mut(&mut *buf) {
                return algo::ring_reduce_scatter(&mut ctx, RsBuffers::in_place(acc, own, pool), len, op, rank, n).await;
            }
            let mut own_acc = PooledVec::widened(pool, &buf[own.clone()]);
            algo::ring_reduce_scatter(&mut ctx, RsBuffers::new(buf, own_acc.as_mut_slice(), own.clone(), pool), len, op, rank, n).await?;
            round_into(&mut buf[own], own_acc.as_slice());
            Ok(())
        }
        .instrument(span)
        .await
    }

    /// Concatenates every rank's `input` into `output`; rank `r`'s input must have
    /// [`segment`](Self::segment)`(output.len(), r).len()` elements.
    pub async fn all_gather<T: WireElement>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let span = self.span(OpKind::AllGather, std::mem::size_of_val(output));
        async {
            let ctx = self.begin(OpKind::AllGather)?;
            self.all_gather_in(ctx, input, output).await
        }
        .instrument(span)
        .await
    }

    /// [`all_gather`](Self::all_gather) without a separate input: segment
    /// [`segment`](Self::segment)`(buf.len(), rank)` of `buf` is this rank's input, and afterwards
    /// every segment holds its owner's input. Nothing is copied besides what arrives.
    pub async fn all_gather_in_place<T: WireElement>(&self, buf: &mut [T]) -> Result<()> {
        let span = self.span(OpKind::AllGather, std::mem::size_of_val(buf));
        async {
            let mut ctx = self.begin(OpKind::AllGather)?;
            let (rank, n) = (self.rank(), self.size());
            if n == 1 || buf.is_empty() {
                return Ok(());
            }
            algo::ring_all_gather(&mut ctx, buf, rank, n).await
        }
        .instrument(span)
        .await
    }

    /// Copies `buf` from group rank `root` to every rank.
    pub async fn broadcast<T: WireElement>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let span = self.span(OpKind::Broadcast, std::mem::size_of_val(buf));
        async {
            let mut ctx = self.begin(OpKind::Broadcast)?;
            let (rank, n) = (self.rank(), self.size());
            check_rank(root, n)?;
            if n == 1 || buf.is_empty() {
                return Ok(());
            }
            if std::mem::size_of_val(buf) <= self.config().small_message_bytes {
                algo::tree_broadcast(&mut ctx, buf, root, rank, n).await
            } else {
                algo::chain_broadcast(&mut ctx, buf, root, rank, n).await
            }
        }
        .instrument(span)
        .await
    }

    /// Reduces `buf` across the group into `buf` on group rank `root`; other ranks' buffers are left
    /// unchanged.
    pub async fn reduce<T: Element>(&self, buf: &mut [T], root: usize, op: ReduceOp) -> Result<()> {
        let span = self.span(OpKind::Reduce, std::mem::size_of_val(buf));
        async {
            let mut ctx = self.begin(OpKind::Reduce)?;
            let (rank, n) = (self.rank(), self.size());
            check_rank(root, n)?;
            if n == 1 || buf.is_empty() {
                return Ok(());
            }
            if std::mem::size_of_val(buf) <= self.config().small_message_bytes {
                let mut work: Vec<T::Acc> = buf.iter().map(|x| x.to_acc()).collect();
                algo::tree_reduce(&mut ctx, &mut work, op, root, rank, n).await?;
                if rank == root {
                    round_into(buf, &work);
                }
                return Ok(());
            }
            // Ring reduce-scatter reading `buf` where it is (only the owned segment is copied, as the
            // accumulator), then the root collects the reduced segments and rounds them in place.
            let len = buf.len();
            let own = self.segment(len, rank);
            let pool = self.endpoint.pool();
            let mut own_acc = PooledVec::widened(pool, &buf[own.clone()]);
            algo::ring_reduce_scatter(&mut ctx, RsBuffers::new(buf, own_acc.as_mut_slice(), own.clone(), pool), len, op, rank, n).await?;
            if rank == root {
                round_into(&mut buf[own], own_acc.as_slice());
                for i in (0..n).filter(|&i| i != root) {
                    let seg = self.segment(len, i);
                    ctx.recv_round_all(i, &mut buf[seg]).await?;
                }
            } else {
                ctx.send_all(root, own_acc.as_slice()).await?;
            }
            Ok(())
        }
        .instrument(span)
        .await
    }

    /// Returns once every rank of the group has entered the barrier.
    pub async fn barrier(&self) -> Result<()> {
        let span = self.span(OpKind::Barrier, 0);
        async {
            let mut ctx = self.begin(OpKind::Barrier)?;
            let (rank, n) = (self.rank(), self.size());
            let mut distance = 1;
            while distance < n {
                ctx.send_frame((rank + distance) % n, None, &[]).await?;
                ctx.recv_frame((rank + n - distance) % n, None, 0).await?;
                distance <<= 1;
            }
            Ok(())
        }
        .instrument(span)
        .await
    }

    /// Sends `buf` to group rank `dst`; returns once it is handed to the transport. Transfers
    /// between one pair of ranks are matched in call order.
    pub async fn send<T: WireElement>(&self, buf: &[T], dst: usize) -> Result<()> {
        let span = self.span(OpKind::Send, std::mem::size_of_val(buf));
        async {
            let mut ctx = self.begin_p2p(dst, true)?;
            if buf.is_empty() {
                return ctx.send_frame(dst, Some(T::DTYPE), &[]).await;
            }
            ctx.send_all(dst, buf).await
        }
        .instrument(span)
        .await
    }

    /// Receives into `buf` what group rank `src` sent with [`send`](Self::send); lengths must match.
    pub async fn recv<T: WireElement>(&self, buf: &mut [T], src: usize) -> Result<()> {
        let span = self.span(OpKind::Send, std::mem::size_of_val(buf));
        async {
            let mut ctx = self.begin_p2p(src, false)?;
            if buf.is_empty() {
                return ctx.recv_frame(src, Some(T::DTYPE), 0).await.map(drop);
            }
            ctx.recv_all(src, buf).await
        }
        .instrument(span)
        .await
    }

    /// Block `j` of `input` goes to rank `j`, arriving as block `r` of its `output` (`r` = sender).
    /// Lengths must be equal and divisible by the group size.
    pub async fn all_to_all<T: WireElement>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let span = self.span(OpKind::AllToAll, std::mem::size_of_val(input));
        async {
            let mut ctx = self.begin(OpKind::AllToAll)?;
            let (rank, n) = (self.rank(), self.size());
            if input.len() != output.len() {
                return Err(Error::BufferLength { op: OpKind::AllToAll, expected: input.len(), got: output.len() });
            }
            if input.len() % n != 0 {
                return Err(Error::NotDivisible { op: OpKind::AllToAll, len: input.len(), size: n });
            }
            let block = input.len() / n;
            let range = |i: usize| i * block..(i + 1) * block;
            output[range(rank)].copy_from_slice(&input[range(rank)]);
            if block == 0 {
                return Ok(());
            }
            for step in 1..n {
                let dst = (rank + step) % n;
                ctx.send_all(dst, &input[range(dst)]).await?;
            }
            for step in 1..n {
                let src = (rank + n - step) % n;
                ctx.recv_all(src, &mut output[range(src)]).await?;
            }
            Ok(())
        }
        .instrument(span)
        .await
    }

    /// Splits the group: ranks passing the same `Some(color)` form a new group, ordered by `(key,
    /// rank)`, at this group's generation; ranks passing `None` get `None`. Collective.
    pub async fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Communicator>> {
        let span = self.span(OpKind::Split, 0);
        async {
            if color == Some(NO_COLOR) {
                return Err(Error::InvalidGroup { group: self.state.id, reason: "split color u32::MAX is reserved" });
            }
            let ctx = self.begin(OpKind::Split)?;
            let generation = self.generation();
            let n = self.size();
            let mine = [color.unwrap_or(NO_COLOR), key];
            let mut all = vec![0u32; 2 * n];
            self.all_gather_in(ctx, &mine, &mut all).await?;
            let index = self.state.next_split();
            let Some(color) = color else { return Ok(None) };
            let mut chosen: Vec<(u32, usize)> = (0..n).filter(|&i| all[2 * i] == color).map(|i| (all[2 * i + 1], i)).collect();
            chosen.sort_unstable();
            let members = chosen.into_iter().map(|(_, i)| self.state.members[i]).collect();
            let id = child_group_id(self.state.id, index, color);
            self.endpoint.group(id, members, generation).map(Some)
        }
        .instrument(span)
        .await
    }

    pub(crate) fn state(&self) -> &GroupState {
        &self.state
    }

    /// The group's members by host, when hierarchical algorithms apply: for each host, in order of
    /// its lowest group rank, its members' group ranks ascending (the first is the host's leader).
    /// `None` when every member is on a host of its own, or all share one host.
    fn host_blocks(&self) -> Option<Vec<Vec<usize>>> {
        let host_of = &self.config().host_of;
        if host_of.is_empty() {
            return None;
        }
        let mut blocks: Vec<(u32, Vec<usize>)> = Vec::new();
        for (index, &global) in self.state.members.iter().enumerate() {
            // `Endpoint::new` checked one entry per rank.
            let host = *host_of.get(global)?;
            match blocks.iter_mut().find(|(h, _)| *h == host) {
                Some((_, block)) => block.push(index),
                None => blocks.push((host, vec![index])),
            }
        }
        let n_hosts = blocks.len();
        (n_hosts > 1 && n_hosts < self.size()).then(|| blocks.into_iter().map(|(_, block)| block).collect())
    }

    /// Hierarchical all-reduce: reduce to each host's leader (binomial tree among the host's
    /// ranks), all-reduce among the leaders (doubling or ring, by `small`), broadcast from each
    /// leader within its host (tree or chain). Averages are summed throughout and divided once
    /// by the group size on the leaders, so every rank gets the leader's bits. The order of
    /// every combination is fixed by group ranks, so results are bit-identical on every rank and
    /// independent of timing (they may differ from the flat algorithms' in the last bits).
    async fn hierarchical_all_reduce<T: Element>(&self, ctx: &mut OpCtx<'_>, buf: &mut [T], op: ReduceOp, hosts: &[Vec<usize>], small: bool) -> Result<()> {
        let rank = self.rank();
        // `host_blocks` puts every member in exactly one block.
        let Some(host_index) = hosts.iter().position(|h| h.contains(&rank)) else {
            return Err(Error::InvalidGroup { group: self.state.id, reason: "local rank in no host block" });
        };
        let local = &hosts[host_index];
        let local_rank = local.iter().position(|&r| r == rank).unwrap_or(0);
        // A large buffer on hosts of equal size: every rank carries a share across hosts.
        let equal_hosts = hosts.iter().all(|h| h.len() == local.len());
        if !small && equal_hosts && local.len() > 1 && buf.len() >= local.len() * hosts.len() {
            if let Some(acc) = T::as_acc_mut(&mut *buf) {
                return sharded_hierarchical_all_reduce(ctx, acc, op, hosts, host_index, local_rank, self.size()).await;
            }
        }
        let leaders: Vec<usize> = hosts.iter().map(|h| h[0]).collect();
        if let Some(acc) = T::as_acc_mut(&mut *buf) {
            hierarchical_reduce_phases(ctx, acc, op, local, local_rank, &leaders, host_index, self.size(), small).await?;
        } else {
            let mut work: Vec<T::Acc> = buf.iter().map(|x| x.to_acc()).collect();
            hierarchical_reduce_phases(ctx, &mut work, op, local, local_rank, &leaders, host_index, self.size(), small).await?;
            if local_rank == 0 {
                round_into(buf, &work);
            }
        }
        if local.len() > 1 {
            ctx.set_view(Some(local.clone()));
            if small {
                algo::tree_broadcast(ctx, buf, 0, local_rank, local.len()).await?;
            } else {
                algo::chain_broadcast(ctx, buf, 0, local_rank, local.len()).await?;
            }
            ctx.set_view(None);
        }
        Ok(())
    }

    async fn all_gather_in<T: WireElement>(&self, mut ctx: OpCtx<'_>, input: &[T], output: &mut [T]) -> Result<()> {
        let (rank, n) = (self.rank(), self.size());
        let own = self.segment(output.len(), rank);
        if input.len() != own.len() {
            return Err(Error::BufferLength { op: ctx.op, expected: own.len(), got: input.len() });
        }
        output[own].copy_from_slice(input);
        if n == 1 || output.is_empty() {
            return Ok(());
        }
        algo::ring_all_gather(&mut ctx, output, rank, n).await
    }

    fn begin(&self, op: OpKind) -> Result<OpCtx<'_>> {
        let (generation, seq) = self.state.begin_collective()?;
        let mut ctx = OpCtx::new(self, op, generation, seq);
        if let Some(rank) = self.state.lost_before(generation, seq) {
            // Peers that already started it may be blocked on this rank: tell them (on drop).
            ctx.relay_loss(rank);
            return Err(Error::PeerLost { rank, op });
        }
        Ok(ctx)
    }

    /// [`begin`](Self::begin) for an operation split into `channels` (at least 2): one context
    /// per channel, on consecutive sequence numbers, sharing `state`.
    fn begin_channels(&self, op: OpKind, channels: usize, state: &Arc<ChannelState>) -> Result<Vec<OpCtx<'_>>> {
        let count = u8::try_from(channels).map_err(|_| Error::InvalidConfig { reason: "channels must be 1 to 16" })?;
        let (generation, seq) = self.state.begin_collectives(u64::from(count))?;
        let mut ctxs: Vec<OpCtx<'_>> =
            (0..u64::from(count)).map(|c| OpCtx::new(self, op, generation, seq + c).with_channels(count, Arc::clone(state))).collect();
        if let Some(rank) = (0..u64::from(count)).find_map(|c| self.state.lost_before(generation, seq + c)) {
            // The whole operation fails: peers that started any of its channels may be blocked
            // on this rank, so each channel tells them (on drop).
            for ctx in &mut ctxs {
                ctx.relay_loss(rank);
            }
            return Err(Error::PeerLost { rank, op });
        }
        Ok(ctxs)
    }

    fn begin_p2p(&self, peer: usize, sending: bool) -> Result<OpCtx<'_>> {
        check_rank(peer, self.size())?;
        if peer == self.rank() {
            return Err(Error::SelfPeer { op: OpKind::Send, rank: peer });
        }
        let (generation, seq) = self.state.begin_p2p(self.state.members[peer], sending)?;
        Ok(OpCtx::new(self, OpKind::Send, generation, seq))
    }

    fn span(&self, op: OpKind, bytes: usize) -> tracing::Span {
        tracing::debug_span!("collective", op = op.as_str(), group = self.state.id, generation = self.state.generation(), rank = self.rank(), bytes)
    }
}

/// The hierarchical all-reduce of a large buffer on hosts that hold `l` ranks each (as NCCL runs
/// one ring per local rank): reduce-scatter within each host (local rank `i` ends with its host's
/// sum of segment `i`), all-reduce of segment `i` among the `i`-th ranks of every host (`l` rings
/// across hosts at once, each carrying `1/l` of the bytes, on links no other ring uses), then
/// all-gather within each host. The leader scheme sends every byte that crosses hosts through one
/// rank per host while the others wait; this one spreads that work, and its cipher and copies,
/// over all of them. Averages are summed and divided once by the group size `n`. Every combination
/// happens in an order fixed by group ranks, so every rank gets the same bits whatever the timing.
async fn sharded_hierarchical_all_reduce<A: Accumulator>(
    ctx: &mut OpCtx<'_>,
    work: &mut [A],
    op: ReduceOp,
    hosts: &[Vec<usize>],
    host_index: usize,
    local_rank: usize,
    n: usize,
) -> Result<()> {
    let inner = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
    let local = &hosts[host_index];
    let l = local.len();
    ctx.set_view(Some(local.clone()));
    algo::ring_reduce_scatter_in_place(ctx, work, inner, local_rank, l).await?;
    let own = segment_range(work.len(), l, local_rank);
    ctx.set_view(Some(hosts.iter().map(|h| h[local_rank]).collect()));
    algo::ring_all_reduce(ctx, &mut work[own.clone()], inner, host_index, hosts.len()).await?;
    if op == ReduceOp::Avg {
        for x in work[own].iter_mut() {
            *x = x.div_count(n);
        }
    }
    ctx.set_view(Some(local.clone()));
    algo::ring_all_gather(ctx, work, local_rank, l).await?;
    ctx.set_view(None);
    Ok(())
}

/// The first two phases of the hierarchical all-reduce on accumulator values: afterwards the
/// host leaders' `work` holds the final result (averaged for [`ReduceOp::Avg`]); other ranks'
/// `work` holds partial values.
#[allow(clippy::too_many_arguments)]
async fn hierarchical_reduce_phases<A: Accumulator>(
    ctx: &mut OpCtx<'_>,
    work: &mut [A],
    op: ReduceOp,
    local: &[usize],
    local_rank: usize,
    leaders: &[usize],
    host_index: usize,
    n: usize,
    small: bool,
) -> Result<()> {
    let inner = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
    if local.len() > 1 {
        ctx.set_view(Some(local.to_vec()));
        algo::tree_reduce(ctx, work, inner, 0, local_rank, local.len()).await?;
    }
    if local_rank != 0 {
        ctx.set_view(None);
        return Ok(());
    }
    ctx.set_view(Some(leaders.to_vec()));
    if small {
        algo::doubling_all_reduce(ctx, work, inner, host_index, leaders.len()).await?;
    } else {
        algo::ring_all_reduce(ctx, work, inner, host_index, leaders.len()).await?;
    }
    ctx.set_view(None);
    if op == ReduceOp::Avg {
        for x in work.iter_mut() {
            *x = x.div_count(n);
        }
    }
    Ok(())
}

fn check_rank(rank: usize, size: usize) -> Result<()> {
    if rank >= size {
        return Err(Error::RankOutOfRange { rank, size });
    }
    Ok(())
}

fn round_into<T: Element>(dst: &mut [T], src: &[T::Acc]) {
    debug_assert_eq!(dst.len(), src.len());
    for (d, s) in dst.iter_mut().zip(src) {
        *d = T::from_acc(*s);
    }
}

/// A child group's id from its parent's id, the parent's split count and the color: the same on
/// every member, and distinct from siblings with overwhelming probability.
fn child_group_id(parent: u64, split_index: u64, color: u32) -> u64 {
    let id = splitmix64(parent ^ splitmix64(split_index.wrapping_mul(0x1_0000_0001) ^ u64::from(color)));
    if id == crate::endpoint::WORLD_GROUP_ID {
        1
    } else {
        id
    }
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The host communicator behind the [`Collective`](crate::Collective) traits: each method forwards
/// to the inherent method of the same name (no behaviour of its own).
impl crate::collective::CollectiveGroup for Communicator {
    fn rank(&self) -> usize {
        Communicator::rank(self)
    }

    fn size(&self) -> usize {
        Communicator::size(self)
    }

    fn generation(&self) -> u64 {
        Communicator::generation(self)
    }

    fn set_generation(&self, generation: u64) -> Result<()> {
        Communicator::set_generation(self, generation)
    }

    fn barrier(&self) -> impl std::future::Future<Output = Result<()>> + Send {
        Communicator::barrier(self)
    }
}

impl<T: Element> crate::collective::Collective<T> for Communicator {
    type Buf = [T];

    fn all_reduce(&self, buf: &mut [T], op: ReduceOp) -> impl std::future::Future<Output = Result<()>> + Send {
        Communicator::all_reduce(self, buf, op)
    }

    fn reduce_scatter(&self, input: &[T], output: &mut [T], op: ReduceOp) -> impl std::future::Future<Output = Result<()>> + Send {
        Communicator::reduce_scatter(self, input, output, op)
    }

    fn all_gather(&self, input: &[T], output: &mut [T]) -> impl std::future::Future<Output = Result<()>> + Send {
        Communicator::all_gather(self, input, output)
    }

    fn broadcast(&self, buf: &mut [T], root: usize) -> impl std::future::Future<Output = Result<()>> + Send {
        Communicator::broadcast(self, buf, root)
    }

    fn reduce(&self, buf: &mut [T], root: usize, op: ReduceOp) -> impl std::future::Future<Output = Result<()>> + Send {
        Communicator::reduce(self, buf, root, op)
    }

    fn send(&self, buf: &[T], dst: usize) -> impl std::future::Future<Output = Result<()>> + Send {
        Communicator::send(self, buf, dst)
    }

    fn recv(&self, buf: &mut [T], src: usize) -> impl std::future::Future<Output = Result<()>> + Send {
        Communicator::recv(self, buf, src)
    }
}
