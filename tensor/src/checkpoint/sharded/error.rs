//! [`ShardedError`]: what can go wrong writing or reading a sharded checkpoint. Every variant
//! names the file involved (a shard file or the index) and, where one is involved, the tensor.

/// An error writing, validating or reading a sharded checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum ShardedError {
    /// The directory has no `index.json`: its writers did not all finish, so it is never loaded.
    #[error("sharded checkpoint {dir}: no index.json, so the checkpoint is incomplete and is not loaded")]
    MissingIndex {
        /// The checkpoint directory.
        dir: String,
    },
    /// The index does not parse or breaks the format's rules (a file outside the directory, a
    /// piece naming a file the index does not list, ...).
    #[error("{file}: invalid index: {reason}")]
    BadIndex {
        /// The index file.
        file: String,
        /// What is wrong.
        reason: String,
    },
    /// The index was written by another version of the format.
    #[error("{file}: index format {found} is not one this build reads ({supported})")]
    UnknownVersion {
        /// The index file.
        file: String,
        /// The format and version found.
        found: String,
        /// The format and version this build reads.
        supported: String,
    },
    /// A shard file the index lists is not there.
    #[error("{file}: shard file is missing (it holds {tensor})")]
    MissingShard {
        /// The shard file.
        file: String,
        /// A tensor it holds.
        tensor: String,
    },
    /// A shard file's length is not the one recorded: torn (truncated) or replaced.
    #[error("{file}: {actual} bytes, the index records {expected}: torn or replaced (it holds {tensor})")]
    SizeMismatch {
        /// The shard file.
        file: String,
        /// A tensor it holds.
        tensor: String,
        /// Bytes recorded.
        expected: u64,
        /// Bytes found.
        actual: u64,
    },
    /// A shard file's crc32 is not the one recorded: corrupt, or swapped with another shard.
    #[error("{file}: crc32 {actual:08x}, the index records {expected:08x}: corrupt or swapped (reading {tensor})")]
    ChecksumMismatch {
        /// The shard file.
        file: String,
        /// The tensor being read when it was found.
        tensor: String,
        /// The checksum recorded.
        expected: u32,
        /// The checksum of the file's bytes.
        actual: u32,
    },
    /// A shard file is not a valid safetensors file, or lacks a tensor the index places in it.
    #[error("{file}: bad shard: {reason} (tensor {tensor})")]
    BadShard {
        /// The shard file.
        file: String,
        /// The tensor concerned.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// Two descriptions of a tensor disagree on its shape (index vs shard file, two shards, or
    /// the checkpoint vs the caller's tensor).
    #[error("{file}: tensor {tensor} has shape {actual:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The file the disagreeing description comes from.
        file: String,
        /// The tensor.
        tensor: String,
        /// The shape expected.
        expected: Vec<usize>,
        /// The shape found.
        actual: Vec<usize>,
    },
    /// Two descriptions of a tensor disagree on its dtype.
    #[error("{file}: tensor {tensor} has dtype {actual}, expected {expected}")]
    DTypeMismatch {
        /// The file the disagreeing description comes from.
        file: String,
        /// The tensor.
        tensor: String,
        /// The dtype expected.
        expected: String,
        /// The dtype found.
        actual: String,
    },
    /// The pieces of a split tensor leave part of the split dim uncovered.
    #[error("{file}: tensor {tensor}: no piece covers rows {start}..{end} of dim {dim}")]
    Gap {
        /// The index (being written or read).
        file: String,
        /// The tensor.
        tensor: String,
        /// The split dim.
        dim: usize,
        /// First uncovered row (within one group when the split is grouped).
        start: usize,
        /// End of the uncovered rows.
        end: usize,
    },
    /// Two pieces of a split tensor cover the same rows.
    #[error("{file}: tensor {tensor}: pieces from {first} and {second} both cover rows {start}..{end} of dim {dim}")]
    Overlap {
        /// The index (being written or read).
        file: String,
        /// The tensor.
        tensor: String,
        /// The split dim.
        dim: usize,
        /// First row covered twice (within one group when the split is grouped).
        start: usize,
        /// End of the rows covered twice.
        end: usize,
        /// Shard file of the first piece.
        first: String,
        /// Shard file of the second piece.
        second: String,
    },
    /// A part (how a local tensor sits in the full one) is inconsistent: a dim beyond the rank,
    /// a range beyond the dim, groups that do not divide it, whole and split pieces mixed.
    #[error("{file}: tensor {tensor}: {reason}")]
    BadPart {
        /// The file the part comes from (shard, index, or the caller's request).
        file: String,
        /// The tensor.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// Two shards hold copies of the same piece with different contents.
    #[error("{file}: tensor {tensor}: replicas in {first} (crc32 {first_crc:08x}) and {second} (crc32 {second_crc:08x}) differ")]
    ReplicasDiffer {
        /// The index being written.
        file: String,
        /// The tensor.
        tensor: String,
        /// Shard file of the kept replica.
        first: String,
        /// Its checksum.
        first_crc: u32,
        /// Shard file of the other replica.
        second: String,
        /// Its checksum.
        second_crc: u32,
    },
    /// The checkpoint has no tensor of that name.
    #[error("{file}: no tensor {tensor} in the checkpoint")]
    UnknownTensor {
        /// The index.
        file: String,
        /// The name asked for.
        tensor: String,
    },
    /// A shard label that cannot form a file name, or two manifests with one label.
    #[error("shard label {label:?}: {reason}")]
    BadLabel {
        /// The label.
        label: String,
        /// What is wrong.
        reason: String,
    },
    /// An I/O error on a file.
    #[error("{file}: {source}")]
    Io {
        /// The file.
        file: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A tensor operation or single-file checkpoint write failed.
    #[error("{file}: tensor {tensor}: {source}")]
    Tensor {
        /// The file being read or written.
        file: String,
        /// The tensor.
        tensor: String,
        /// The cause.
        #[source]
        source: crate::Error,
    },
}

/// Result alias for sharded checkpoints.
pub type Result<T> = std::result::Result<T, ShardedError>;
