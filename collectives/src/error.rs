//! The crate's error type: one enum whose variants carry the facts of the failure (ranks, generations,
//! lengths), so a caller can act on them without parsing messages.

use rtx_kernels::DType;

use crate::frame::OpKind;

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in transports, framing and collectives.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operation of an older generation met a group that has moved on (or was aborted by a bump).
    #[error("stale generation: group is at generation {expected}, operation belongs to generation {got}")]
    StaleGeneration {
        /// The group's current generation.
        expected: u64,
        /// The generation the operation was started under.
        got: u64,
    },
    /// `set_generation` or a re-form asked for a generation that does not move forward.
    #[error("generation must increase: current {current}, requested {requested}")]
    GenerationNotIncreasing {
        /// The group's current generation.
        current: u64,
        /// The generation that was asked for.
        requested: u64,
    },
    /// A peer of the group was lost (connection closed, process gone) while or before the operation ran.
    #[error("peer rank {rank} lost during {op}")]
    PeerLost {
        /// Global (transport) rank of the lost peer.
        rank: usize,
        /// The operation that noticed the loss.
        op: OpKind,
    },
    /// A peer sent nothing (or took nothing) for longer than the configured operation timeout.
    #[error("{op} timed out after {timeout_ms} ms waiting for rank {waiting_for}")]
    Timeout {
        /// The operation that timed out.
        op: OpKind,
        /// Global rank whose frame never came, or that never drained what was sent to it.
        waiting_for: usize,
        /// The configured timeout.
        timeout_ms: u64,
    },
    /// The local transport has shut down; nothing more can be sent or received.
    #[error("transport closed")]
    TransportClosed,
    /// A rank argument is outside the group or transport.
    #[error("rank {rank} out of range for {size} ranks")]
    RankOutOfRange {
        /// The offending rank.
        rank: usize,
        /// The number of ranks.
        size: usize,
    },
    /// A point-to-point transfer named the local rank as its peer.
    #[error("{op} to or from self (rank {rank})")]
    SelfPeer {
        /// The operation.
        op: OpKind,
        /// The local group rank.
        rank: usize,
    },
    /// A buffer has the wrong number of elements for the operation.
    #[error("{op}: buffer has {got} elements, expected {expected}")]
    BufferLength {
        /// The operation.
        op: OpKind,
        /// Required element count.
        expected: usize,
        /// Element count given.
        got: usize,
    },
    /// A buffer's length must be a multiple of the group size.
    #[error("{op}: buffer of {len} elements is not divisible by {size} ranks")]
    NotDivisible {
        /// The operation.
        op: OpKind,
        /// Element count given.
        len: usize,
        /// Group size.
        size: usize,
    },
    /// The group's member list is empty, unsorted-duplicated or does not contain the local rank.
    #[error("invalid group {group}: {reason}")]
    InvalidGroup {
        /// The group id.
        group: u64,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A configuration value is out of range.
    #[error("invalid configuration: {reason}")]
    InvalidConfig {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A frame arrived for the expected slot but belongs to a different operation: ranks called
    /// collectives in different orders.
    #[error("operation mismatch at sequence {seq} from rank {src}: expected {expected}, got {got}")]
    OpMismatch {
        /// Operation sequence number.
        seq: u64,
        /// Global rank that sent the frame.
        src: usize,
        /// The local operation.
        expected: OpKind,
        /// The operation named in the frame.
        got: OpKind,
    },
    /// A frame arrived for the expected slot from an operation split into a different number of
    /// channels (rings over parts of the buffer): [`crate::CommConfig::channels`] differs between
    /// ranks. Counts are as on the wire: 0 for an operation run as one ring.
    #[error("channel count mismatch at sequence {seq} from rank {src}: expected {expected}, got {got}")]
    ChannelMismatch {
        /// Operation sequence number.
        seq: u64,
        /// Global rank that sent the frame.
        src: usize,
        /// The local operation's channel count.
        expected: u8,
        /// The channel count named in the frame.
        got: u8,
    },
    /// A frame carries a different element type than the local operation uses.
    #[error("dtype mismatch from rank {src}: expected {expected:?}, got {got:?}")]
    DTypeMismatch {
        /// Global rank that sent the frame.
        src: usize,
        /// The dtype the local operation expects (`None` for a header-only frame).
        expected: Option<DType>,
        /// The dtype in the frame (`None` for a header-only frame).
        got: Option<DType>,
    },
    /// A frame's payload does not have the length the operation expects (ranks disagree on sizes).
    #[error("payload from rank {src} has {got} bytes, expected {expected}")]
    PayloadLength {
        /// Global rank that sent the frame.
        src: usize,
        /// Expected byte count.
        expected: usize,
        /// Byte count received.
        got: usize,
    },
    /// A payload handed over sealed ([`crate::SealedPayload`]) did not authenticate or was not
    /// what the frame header declared; the transport broke the link it came on.
    #[error("payload from rank {src} does not open: {reason}")]
    Unauthentic {
        /// Global rank of the sender.
        src: usize,
        /// What was wrong.
        reason: String,
    },
    /// TLS material or configuration was refused (bad certificate, key, CA, or provider setup).
    #[error("tls setup failed: {reason}")]
    Tls {
        /// What rustls, rcgen or quinn reported.
        reason: String,
    },
    /// A socket-level operation failed.
    #[error("{op} failed: {reason}")]
    Io {
        /// What was being done (`bind`, `local_addr`, ...).
        op: &'static str,
        /// The operating system's message.
        reason: String,
    },
    /// Links to some peers were not up within the connect timeout.
    #[error("could not connect to rank {peer} within {timeout_ms} ms: {reason}")]
    Connect {
        /// The first peer (global rank) that is still missing.
        peer: usize,
        /// The configured connect timeout.
        timeout_ms: u64,
        /// The last error seen for that peer.
        reason: String,
    },
    /// Decoding: fewer bytes than a header.
    #[error("frame too short: {len} bytes, header needs {min}")]
    FrameTooShort {
        /// Bytes available.
        len: usize,
        /// Header length.
        min: usize,
    },
    /// Decoding: the magic number is wrong.
    #[error("bad frame magic {got:#010x}")]
    BadMagic {
        /// The magic read.
        got: u32,
    },
    /// Decoding: unknown wire format version.
    #[error("unsupported frame version {got}, this build speaks {supported}")]
    UnsupportedVersion {
        /// The version read.
        got: u16,
        /// The version this build writes.
        supported: u16,
    },
    /// Decoding: the op kind byte names no operation.
    #[error("unknown op kind {code}")]
    UnknownOpKind {
        /// The byte read.
        code: u8,
    },
    /// Decoding: the dtype byte names no element type.
    #[error("unknown dtype code {code}")]
    UnknownDType {
        /// The byte read.
        code: u8,
    },
    /// Decoding: reserved header bytes, or flag bits this version does not know, are not zero.
    #[error("reserved header bytes or unknown flag bits are not zero")]
    ReservedNonZero,
    /// Decoding: the declared payload is over the configured cap.
    #[error("payload of {len} bytes over the cap of {cap}")]
    PayloadTooLarge {
        /// Declared payload length.
        len: u64,
        /// Configured cap.
        cap: usize,
    },
    /// Decoding: the declared payload length differs from the bytes present.
    #[error("frame declares {declared} payload bytes but carries {actual}")]
    PayloadLengthMismatch {
        /// Length in the header.
        declared: u64,
        /// Bytes present after the header.
        actual: usize,
    },
    /// The NCCL library (`libnccl.so`) could not be loaded on this machine.
    #[error("NCCL library not found (libnccl.so): install NCCL or build without the nccl feature")]
    NcclNotFound,
    /// The NCCL library found is older than the one this build binds.
    #[error("NCCL version {found} found, this build needs at least {required}")]
    NcclVersion {
        /// `ncclGetVersion` of the loaded library (e.g. 22803 for 2.28.3).
        found: i32,
        /// The lowest version this build accepts.
        required: i32,
    },
    /// A CUDA call made on behalf of a device communicator failed (context binding, events, device
    /// memory). The CUDA error is kept as text because this enum is `Clone + Eq` and the CUDA error
    /// types are neither.
    #[error("{op}: CUDA call failed: {reason}")]
    Cuda {
        /// What was being done.
        op: &'static str,
        /// The CUDA backend's message.
        reason: String,
    },
    /// An NCCL call returned an error (the NCCL communicator is aborted afterwards).
    #[error("{op}: NCCL error {code} ({name}): {detail}")]
    Nccl {
        /// The NCCL call or operation.
        op: &'static str,
        /// The `ncclResult_t` code.
        code: u32,
        /// The code's name (`remote error`, `system error`, ...).
        name: &'static str,
        /// NCCL's last-error text for the communicator, when it has one.
        detail: String,
    },
    /// An NCCL unique id (or the control-plane message carrying it) is malformed.
    #[error("malformed NCCL unique id message: {reason} ({len} units)")]
    InvalidNcclId {
        /// What is wrong with it.
        reason: &'static str,
        /// Length of what was received (bytes for a raw id, 32-bit words for a message).
        len: usize,
    },
    /// Group rank 0 could not create an NCCL unique id, so no rank can create the communicator.
    #[error("group rank 0 could not create an NCCL unique id: {reason}")]
    NcclIdUnavailable {
        /// Why (as rank 0 reported it).
        reason: &'static str,
    },
    /// A device collective (or NCCL communicator setup) did not finish within the timeout; the
    /// NCCL communicator was aborted.
    #[error("{op} on the device did not complete within {timeout_ms} ms (a peer may be dead or stuck); NCCL communicator aborted")]
    DeviceTimeout {
        /// The operation (`all_reduce`, `init`, ...).
        op: &'static str,
        /// The configured timeout.
        timeout_ms: u64,
    },
    /// The NCCL communicator was aborted earlier (after a timeout, an NCCL error or a lost peer);
    /// build a new one.
    #[error("{op}: the NCCL communicator of generation {generation} was aborted earlier: {reason}")]
    CommAborted {
        /// The operation that was refused.
        op: &'static str,
        /// The generation the communicator was created at.
        generation: u64,
        /// Why it was aborted.
        reason: String,
    },
    /// Decoding: checksum over header and payload does not match.
    #[error("checksum mismatch: header says {expected:#010x}, computed {computed:#010x}")]
    ChecksumMismatch {
        /// Checksum in the header.
        expected: u32,
        /// Checksum computed over the received bytes.
        computed: u32,
    },
}
