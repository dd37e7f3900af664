//! The index (`index.json`): format and version, step, mesh, metadata, every shard file with its
//! length and crc32, and every tensor with its full shape, dtype and pieces. Also the rule both
//! the index writer and the reader enforce: the pieces of a tensor tile it exactly.

use super::error::{Result, ShardedError};
use super::part::{Part, Split};
use safetensors::Dtype;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The `format` value of an index.
pub const INDEX_FORMAT: &str = "rustytorch.sharded-checkpoint";

/// The index version this build writes and reads.
pub const INDEX_VERSION: u32 = 1;

/// The index file's name inside a checkpoint directory.
pub const INDEX_FILE: &str = "index.json";

/// A validated index, as written by [`super::write_index`] and read by
/// [`super::ShardedCheckpoint::open`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Index {
    /// Always [`INDEX_FORMAT`].
    pub format: String,
    /// [`INDEX_VERSION`].
    pub version: u32,
    /// The training step the checkpoint was taken after.
    pub step: u64,
    /// The mesh it was saved from, as `(axis, size)` in the writer's order (`[("pp", 2), ("tp", 2)]`).
    pub mesh: Vec<(String, usize)>,
    /// Free-form metadata (config hash, RNG state, ...).
    pub metadata: BTreeMap<String, String>,
    /// Every shard file, by file name (relative to the directory).
    pub files: BTreeMap<String, FileEntry>,
    /// Every tensor, by full name.
    pub tensors: BTreeMap<String, TensorEntry>,
}

/// A shard file's identity.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// The label it was written under.
    pub label: String,
    /// Its length in bytes.
    pub bytes: u64,
    /// crc32 (IEEE) of all its bytes.
    pub crc32: u32,
}

/// A tensor of the full model and where its pieces are.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Full shape.
    pub shape: Vec<usize>,
    /// Element type, in safetensors' naming (`F32`, `BF16`, ...).
    pub dtype: Dtype,
    /// The pieces: one [`Part::Whole`], or splits of one dim that tile it.
    pub pieces: Vec<Piece>,
}

/// One piece of a tensor: the part of it stored in a shard file (under the tensor's full name,
/// with the part's local shape).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    /// The shard file.
    pub file: String,
    /// Which part of the tensor it holds.
    pub part: Part,
}

impl Index {
    /// Checks the index's own consistency: the format and version, file names that stay in the
    /// directory, pieces that name listed files and tile their tensors (`origin` names the index
    /// in errors). Shard files are checked by the reader.
    pub fn validate(&self, origin: &str) -> Result<()> {
        if self.format != INDEX_FORMAT || self.version != INDEX_VERSION {
            return Err(ShardedError::UnknownVersion { file: origin.to_string(), found: format!("{} v{}", self.format, self.version), supported: supported() });
        }
        for name in self.files.keys() {
            check_file_name(origin, name)?;
        }
        for (name, entry) in &self.tensors {
            for piece in &entry.pieces {
                if !self.files.contains_key(&piece.file) {
                    return Err(ShardedError::BadIndex {
                        file: origin.to_string(),
                        reason: format!("tensor {name} has a piece in {}, which the index does not list", piece.file),
                    });
                }
            }
            check_tiling(origin, name, entry)?;
        }
        Ok(())
    }

    /// Parses an index, telling an unknown format or version apart from a malformed file.
    pub fn parse(bytes: &[u8], origin: &str) -> Result<Index> {
        let bad = |reason: String| ShardedError::BadIndex { file: origin.to_string(), reason };
        let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| bad(format!("not JSON: {e}")))?;
        let format = value.get("format").and_then(|f| f.as_str());
        let version = value.get("version").and_then(|v| v.as_u64());
        if format != Some(INDEX_FORMAT) || version != Some(u64::from(INDEX_VERSION)) {
            let found = format!("{} v{}", format.unwrap_or("(none)"), version.map_or("(none)".to_string(), |v| v.to_string()));
            return Err(ShardedError::UnknownVersion { file: origin.to_string(), found, supported: supported() });
        }
        let index: Index = serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
        index.validate(origin)?;
        Ok(index)
    }

    /// A tensor every piece of which lives in `file`, for naming in file-level errors.
    pub(super) fn tensor_in(&self, file: &str) -> String {
        self.tensors.iter().find(|(_, t)| t.pieces.iter().any(|p| p.file == file)).map_or_else(|| "no indexed tensor".to_string(), |(n, _)| n.clone())
    }
}

fn supported() -> String {
    format!("{INDEX_FORMAT} v{INDEX_VERSION}")
}

/// A shard file name must be a plain name inside the directory.
fn check_file_name(origin: &str, name: &str) -> Result<()> {
    let plain = !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\\', '\0']);
    if !plain {
        return Err(ShardedError::BadIndex { file: origin.to_string(), reason: format!("shard file name {name:?} is not a plain file name") });
    }
    Ok(())
}

/// Checks that the pieces of `entry` tile the tensor: one whole piece, or splits of one dim with
/// the same grouping whose ranges cover every row of a block exactly once. `origin` is the index
/// in errors.
pub(super) fn check_tiling(origin: &str, name: &str, entry: &TensorEntry) -> Result<()> {
    let part_error = |reason: String| ShardedError::BadPart { file: origin.to_string(), tensor: name.to_string(), reason };
    let first = entry.pieces.first().ok_or_else(|| part_error("no pieces".into()))?;
    entry.shape.iter().try_fold(1usize, |a, &b| a.checked_mul(b)).ok_or_else(|| part_error(format!("shape {:?} overflows", entry.shape)))?;
    let mut splits: Vec<(&Split, &str)> = Vec::with_capacity(entry.pieces.len());
    for piece in &entry.pieces {
        match &piece.part {
            Part::Whole if entry.pieces.len() == 1 => return Ok(()),
            Part::Whole => return Err(part_error(format!("{} holds it whole but it has {} pieces", piece.file, entry.pieces.len()))),
            Part::Split(s) => {
                s.check(&entry.shape).map_err(|e| part_error(format!("piece in {}: {e}", piece.file)))?;
                splits.push((s, piece.file.as_str()));
            }
        }
    }
    let (dim, groups) = match &first.part {
        Part::Split(s) => (s.dim, s.groups),
        Part::Whole => return Err(part_error("whole and split pieces mixed".into())),
    };
    if let Some((s, file)) = splits.iter().find(|(s, _)| s.dim != dim || s.groups != groups) {
        return Err(part_error(format!("piece in {file} splits dim {} in {} groups, the piece in {} dim {dim} in {groups}", s.dim, s.groups, first.file)));
    }
    splits.sort_by_key(|(s, file)| (s.start, s.len, *file));
    let block = splits.first().map_or(0, |(s, _)| s.block());
    let mut covered = 0usize;
    let mut last_file = "";
    for (s, file) in &splits {
        if s.start > covered {
            return Err(ShardedError::Gap { file: origin.to_string(), tensor: name.to_string(), dim, start: covered, end: s.start });
        }
        if s.start < covered {
            let end = covered.min(s.start + s.len);
            return Err(ShardedError::Overlap {
                file: origin.to_string(),
                tensor: name.to_string(),
                dim,
                start: s.start,
                end,
                first: last_file.to_string(),
                second: file.to_string(),
            });
        }
        covered = s.start + s.len;
        last_file = file;
    }
    if covered < block {
        return Err(ShardedError::Gap { file: origin.to_string(), tensor: name.to_string(), dim, start: covered, end: block });
    }
    Ok(())
}
