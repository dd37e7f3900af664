//! Sharded checkpoints: a model held as shards (pipeline stages holding ranges of blocks,
//! tensor-parallel ranks holding slices of one dim of their parameters) saves one file per
//! shard plus an index, and loads into any other mesh shape, or into one rank.
//!
//! Layout of a checkpoint directory:
//!
//! ```text
//! step-00000120/
//!   shard-pp0-tp0.safetensors   one per member that holds a shard, written by that member,
//!   shard-pp0-tp1.safetensors   all in parallel (standard safetensors: PyTorch's
//!   shard-pp1-tp0.safetensors   safetensors.torch.load_file reads each); tensors under their
//!   shard-pp1-tp1.safetensors   full names (`blocks.3.attn.qkv.weight`) with local shapes
//!   index.json                  written last, by one member, once every shard is on disk
//! ```
//!
//! `index.json` (see [`Index`]) holds the format and version, the step, the mesh it was saved
//! from (`[["pp", 2], ["tp", 2]]`), free-form string metadata, every shard file with its length
//! and crc32, and every tensor with its full shape, dtype and pieces: one whole piece, or pieces
//! that split one dim ([`Split`]: `dim`, `start`, `len`, `full_len`, and `groups` for a packed
//! `[q; k; v]` weight whose heads are split). Identical replicas (LayerNorms held by every tp
//! rank, a tied embedding held by the first and last stage) appear once, from the shard with the
//! lowest label, after the index writer checked that their checksums agree. A directory without
//! `index.json` is an incomplete checkpoint and is refused.
//!
//! Writing: each member calls [`ShardWriter::write`] with its tensors and the [`Part`] of the full
//! tensor each one is ([`Cut`] computes both from a [`ModelLayout`] and a mesh coordinate); the
//! returned [`ShardManifest`]s go to one member, which calls [`write_index`]. Reading:
//! [`ShardedCheckpoint::open`] validates the index and every shard's length, header, shapes and
//! dtypes, and that each split tensor's pieces tile it with no gap and no overlap;
//! [`ShardedCheckpoint::full`], [`ShardedCheckpoint::slice`] and [`ShardedCheckpoint::load_into`]
//! copy only the rows asked for out of memory-mapped shard files. Each shard file's crc32 is
//! checked in full the first time anything is read from it, so a torn or swapped file is refused;
//! a reader that needs only some shards touches only those. [`consolidate`] writes one ordinary
//! safetensors file of full tensors, which [`crate::checkpoint::load`] reads when the metadata is
//! [`crate::checkpoint::file_metadata`]'s.
//!
//! Everything here is synchronous plain file I/O; errors are [`ShardedError`]s naming the file
//! and the tensor, never panics, whatever the files contain.

mod cut;
mod error;
mod index;
mod part;
mod reader;
mod region;
mod writer;

pub use cut::{even_stages, Cut, ModelLayout};
pub use error::{Result, ShardedError};
pub use index::{FileEntry, Index, Piece, TensorEntry, INDEX_FILE, INDEX_FORMAT, INDEX_VERSION};
pub use part::{Part, Split};
pub use reader::{consolidate, PartSpec, ShardedCheckpoint};
pub use writer::{write_index, IndexBuilder, ManifestEntry, ShardManifest, ShardWriter};

use rtx_kernels::DType;
use safetensors::Dtype;
use std::fs::File;
use std::io::Write;
use std::path::Path;

/// The `format` value in a shard file's `__metadata__`.
pub const SHARD_FORMAT: &str = "rustytorch.checkpoint.shard.v1";

/// The file name of the shard labelled `label`: `shard-<label>.safetensors`. Labels are
/// non-empty ASCII letters, digits, `-`, `_` and `.`, not starting with `.`.
pub fn shard_file_name(label: &str) -> Result<String> {
    let ok = !label.is_empty() && !label.starts_with('.') && label.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !ok {
        return Err(ShardedError::BadLabel { label: label.to_string(), reason: "use ASCII letters, digits, '-', '_' and '.' (not first)".into() });
    }
    Ok(format!("shard-{label}.safetensors"))
}

/// Maps an I/O error on `path` to [`ShardedError::Io`].
fn io_error(path: &Path) -> impl Fn(std::io::Error) -> ShardedError {
    let file = path.display().to_string();
    move |source| ShardedError::Io { file: file.clone(), source }
}

fn st_dtype(dtype: DType) -> Dtype {
    super::to_st_dtype(dtype)
}

fn from_st_dtype(dtype: Dtype) -> Option<DType> {
    super::from_st_dtype(dtype)
}

/// Writes `bytes` to `path` atomically: `<path>.tmp`, fsync, rename, fsync of the directory.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = super::tmp_path(path);
    let result = (|| {
        let mut file = File::create(&tmp).map_err(io_error(&tmp))?;
        file.write_all(bytes).map_err(io_error(&tmp))?;
        file.sync_all().map_err(io_error(&tmp))?;
        std::fs::rename(&tmp, path).map_err(io_error(path))?;
        crate::checkpoint::sync_parent_dir(path);
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
