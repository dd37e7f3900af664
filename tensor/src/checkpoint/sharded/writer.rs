//! Writing a sharded checkpoint: each member writes its shard with [`ShardWriter::write`] (all
//! in parallel) and hands the returned [`ShardManifest`] to one member, which writes the index
//! last with [`IndexBuilder`] / [`write_index`] once every shard is on disk.

use super::error::{Result, ShardedError};
use super::index::{check_tiling, FileEntry, Index, Piece, TensorEntry, INDEX_FILE, INDEX_FORMAT, INDEX_VERSION};
use super::part::Part;
use super::{io_error, shard_file_name, st_dtype, write_atomically, SHARD_FORMAT};
use crate::checkpoint::save_tensors;
use crate::tensor::Tensor;
use safetensors::Dtype;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::Path;

/// What a shard writer reports: its file and, per tensor, the local shape, the part of the
/// full tensor it is, and a checksum of its contents. Serializable, so members can send it to
/// the one that writes the index.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardManifest {
    /// The label (`pp1-tp0`).
    pub label: String,
    /// The file name inside the directory (`shard-pp1-tp0.safetensors`).
    pub file: String,
    /// The file's length.
    pub bytes: u64,
    /// crc32 of the whole file.
    pub crc32: u32,
    /// The tensors, in the order given.
    pub tensors: Vec<ManifestEntry>,
}

/// One tensor of a shard.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ManifestEntry {
    /// Full name (`blocks.3.attn.qkv.weight`).
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Local shape (as stored).
    pub shape: Vec<usize>,
    /// Which part of the full tensor this is.
    pub part: Part,
    /// crc32 of the tensor's bytes, to check that replicas agree.
    pub crc32: u32,
}

impl ShardManifest {
    /// The manifest of the shard labelled `label` already written to `dir`, rebuilt from the file
    /// alone: its length and crc32, and per tensor the part its `__metadata__` records and the
    /// crc32 of its bytes. What [`ShardWriter::write`] returned to the member that wrote it, so an
    /// index writer that shares the directory (a common checkpoint folder) needs no manifest sent
    /// to it. Refuses a file that is not a shard of this format or of this label.
    pub fn read(dir: &Path, label: &str) -> Result<ShardManifest> {
        let file = shard_file_name(label)?;
        let path = dir.join(&file);
        let display = path.display().to_string();
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(ShardedError::MissingShard { file: display, tensor: "(any)".into() }),
            Err(e) => return Err(io_error(&path)(e)),
        };
        let bad = |tensor: &str, reason: String| ShardedError::BadShard { file: display.clone(), tensor: tensor.to_string(), reason };
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad("", format!("not a valid safetensors file: {e}")))?;
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| bad("", format!("not a valid safetensors file: {e}")))?;
        let metadata = header.metadata().clone().unwrap_or_default();
        if metadata.get("format").map(String::as_str) != Some(SHARD_FORMAT) {
            return Err(bad("", format!("metadata format is {:?}, not {SHARD_FORMAT}", metadata.get("format"))));
        }
        if metadata.get("label").map(String::as_str) != Some(label) {
            return Err(bad("", format!("metadata label is {:?}, not {label:?}", metadata.get("label"))));
        }
        let parts: BTreeMap<String, Part> =
            serde_json::from_str(metadata.get("parts").map_or("", String::as_str)).map_err(|e| bad("", format!("metadata parts: {e}")))?;
        let mut tensors = Vec::with_capacity(parts.len());
        for (name, part) in &parts {
            let view = st.tensor(name).map_err(|e| bad(name, format!("the metadata names it but the file lacks it: {e}")))?;
            tensors.push(ManifestEntry { name: name.clone(), dtype: view.dtype(), shape: view.shape().to_vec(), part: *part, crc32: crc32fast::hash(view.data()) });
        }
        if st.len() != parts.len() {
            return Err(bad("", format!("{} tensors but parts recorded for {}", st.len(), parts.len())));
        }
        Ok(ShardManifest { label: label.to_string(), file, bytes: bytes.len() as u64, crc32: crc32fast::hash(&bytes), tensors })
    }
}

/// Writes one member's shard file.
#[derive(Clone, Copy, Debug, Default)]
pub struct ShardWriter;

impl ShardWriter {
    /// Writes `tensors` (full names, local tensors, and the part of the full tensor each is) to
    /// `dir/shard-<label>.safetensors` atomically (temporary file, fsync, rename), creating `dir`
    /// if needed, and returns the manifest for the index writer. The file is a standard
    /// safetensors file; its `__metadata__` records the format, the label and each tensor's part.
    pub fn write(dir: &Path, label: &str, tensors: &[(&str, &Tensor, Part)]) -> Result<ShardManifest> {
        let file = shard_file_name(label)?;
        let path = dir.join(&file);
        let _span = tracing::info_span!("shard_write", label, tensors = tensors.len()).entered();
        let mut seen = BTreeSet::new();
        let mut entries = Vec::with_capacity(tensors.len());
        let mut owned = Vec::with_capacity(tensors.len());
        for (name, tensor, part) in tensors {
            if !seen.insert(*name) {
                return Err(ShardedError::BadPart { file: file.clone(), tensor: name.to_string(), reason: "appears twice in the shard".into() });
            }
            let shape = tensor.shape().to_vec();
            let full = part.full_shape(&shape).and_then(|full| part.check(&full).map(|()| full));
            if let Err(reason) = full {
                return Err(ShardedError::BadPart { file: file.clone(), tensor: name.to_string(), reason });
            }
            let data = tensor.to_data().map_err(|source| ShardedError::Tensor { file: file.clone(), tensor: name.to_string(), source })?;
            let crc32 = crc32fast::hash(data.as_bytes());
            entries.push(ManifestEntry { name: name.to_string(), dtype: st_dtype(tensor.dtype()), shape, part: *part, crc32 });
            owned.push((name.to_string(), (*tensor).clone()));
        }
        std::fs::create_dir_all(dir).map_err(io_error(dir))?;
        let parts: BTreeMap<&str, &Part> = entries.iter().map(|e| (e.name.as_str(), &e.part)).collect();
        let parts = serde_json::to_string(&parts).map_err(|e| ShardedError::BadPart { file: file.clone(), tensor: String::new(), reason: e.to_string() })?;
        let metadata =
            BTreeMap::from([("format".to_string(), SHARD_FORMAT.to_string()), ("label".to_string(), label.to_string()), ("parts".to_string(), parts)]);
        save_tensors(&path, &owned, &metadata).map_err(|source| ShardedError::Tensor { file: file.clone(), tensor: String::new(), source })?;
        let (bytes, crc32) = file_checksum(&path)?;
        tracing::debug!(label, bytes, crc32, "shard written");
        Ok(ShardManifest { label: label.to_string(), file, bytes, crc32, tensors: entries })
    }
}

/// Collects shard manifests and writes the index.
#[derive(Clone, Debug, Default)]
pub struct IndexBuilder {
    manifests: Vec<ShardManifest>,
}

impl IndexBuilder {
    /// An empty builder.
    pub fn new() -> IndexBuilder {
        IndexBuilder::default()
    }

    /// Adds one shard's manifest.
    pub fn add(&mut self, manifest: ShardManifest) -> &mut IndexBuilder {
        self.manifests.push(manifest);
        self
    }

    /// The index of the manifests added: pieces that several shards hold identically (replicas)
    /// appear once, from the shard with the lowest label, after checking that their checksums
    /// agree; every tensor's pieces must tile it and its shards agree on dtype and full shape.
    pub fn build(&self, step: u64, mesh: &[(&str, usize)], metadata: &BTreeMap<String, String>) -> Result<Index> {
        let origin = INDEX_FILE;
        let mut manifests: Vec<&ShardManifest> = self.manifests.iter().collect();
        manifests.sort_by(|a, b| a.label.cmp(&b.label));
        let mut files = BTreeMap::new();
        for m in &manifests {
            if m.file != shard_file_name(&m.label)? {
                return Err(ShardedError::BadLabel { label: m.label.clone(), reason: format!("manifest names file {}", m.file) });
            }
            if files.insert(m.file.clone(), FileEntry { label: m.label.clone(), bytes: m.bytes, crc32: m.crc32 }).is_some() {
                return Err(ShardedError::BadLabel { label: m.label.clone(), reason: "two manifests have this label".into() });
            }
        }
        // Per tensor: dtype and full shape from the first shard that holds it, then its distinct
        // pieces (a replica of a piece already seen must have the same checksum).
        let mut tensors: BTreeMap<String, (TensorEntry, Vec<u32>)> = BTreeMap::new();
        for m in &manifests {
            for e in &m.tensors {
                let bad_part = |reason: String| ShardedError::BadPart { file: m.file.clone(), tensor: e.name.clone(), reason };
                let full = e.part.full_shape(&e.shape).map_err(bad_part)?;
                e.part.check(&full).map_err(bad_part)?;
                let (entry, crcs) =
                    tensors.entry(e.name.clone()).or_insert_with(|| (TensorEntry { shape: full.clone(), dtype: e.dtype, pieces: Vec::new() }, Vec::new()));
                if entry.shape != full {
                    return Err(ShardedError::ShapeMismatch { file: m.file.clone(), tensor: e.name.clone(), expected: entry.shape.clone(), actual: full });
                }
                if entry.dtype != e.dtype {
                    return Err(ShardedError::DTypeMismatch {
                        file: m.file.clone(),
                        tensor: e.name.clone(),
                        expected: format!("{:?}", entry.dtype),
                        actual: format!("{:?}", e.dtype),
                    });
                }
                match entry.pieces.iter().position(|p| p.part == e.part) {
                    Some(i) => {
                        let (first, first_crc) = (entry.pieces.get(i).map_or("", |p| p.file.as_str()), crcs.get(i).copied().unwrap_or_default());
                        if first_crc != e.crc32 {
                            return Err(ShardedError::ReplicasDiffer {
                                file: origin.into(),
                                tensor: e.name.clone(),
                                first: first.into(),
                                first_crc,
                                second: m.file.clone(),
                                second_crc: e.crc32,
                            });
                        }
                    }
                    None => {
                        entry.pieces.push(Piece { file: m.file.clone(), part: e.part });
                        crcs.push(e.crc32);
                    }
                }
            }
        }
        let tensors: BTreeMap<String, TensorEntry> = tensors.into_iter().map(|(n, (e, _))| (n, e)).collect();
        for (name, entry) in &tensors {
            check_tiling(origin, name, entry)?;
        }
        let mesh = mesh.iter().map(|(axis, size)| (axis.to_string(), *size)).collect();
        let index = Index { format: INDEX_FORMAT.into(), version: INDEX_VERSION, step, mesh, metadata: metadata.clone(), files, tensors };
        index.validate(origin)?;
        Ok(index)
    }

    /// Builds the index (see [`IndexBuilder::build`]), checks that every shard file is in `dir`
    /// with its recorded length, and writes `dir/index.json` atomically. Call it only after every
    /// shard writer has returned: the index is what makes the checkpoint complete.
    pub fn write(&self, dir: &Path, step: u64, mesh: &[(&str, usize)], metadata: &BTreeMap<String, String>) -> Result<Index> {
        let _span = tracing::info_span!("index_write", step, shards = self.manifests.len()).entered();
        let index = self.build(step, mesh, metadata)?;
        for (file, entry) in &index.files {
            let path = dir.join(file);
            let actual = match std::fs::metadata(&path) {
                Ok(m) => m.len(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(ShardedError::MissingShard { file: path.display().to_string(), tensor: index.tensor_in(file) })
                }
                Err(e) => return Err(io_error(&path)(e)),
            };
            if actual != entry.bytes {
                return Err(ShardedError::SizeMismatch { file: path.display().to_string(), tensor: index.tensor_in(file), expected: entry.bytes, actual });
            }
        }
        let json = serde_json::to_vec_pretty(&index).map_err(|e| ShardedError::BadIndex { file: INDEX_FILE.into(), reason: e.to_string() })?;
        write_atomically(&dir.join(INDEX_FILE), &json)?;
        tracing::info!(step, files = index.files.len(), tensors = index.tensors.len(), "sharded checkpoint index written");
        Ok(index)
    }
}

/// Writes the index of a checkpoint whose shards `manifests` describe (see [`IndexBuilder::write`]).
pub fn write_index(dir: &Path, step: u64, mesh: &[(&str, usize)], manifests: &[ShardManifest], metadata: &BTreeMap<String, String>) -> Result<Index> {
    let mut builder = IndexBuilder::new();
    for m in manifests {
        builder.add(m.clone());
    }
    builder.write(dir, step, mesh, metadata)
}

/// Length and crc32 of a file, read in chunks.
pub(super) fn file_checksum(path: &Path) -> Result<(u64, u32)> {
    let mut file = std::fs::File::open(path).map_err(io_error(path))?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(io_error(path))?;
        if n == 0 {
            break;
        }
        hasher.update(buf.get(..n).unwrap_or_default());
        bytes += n as u64;
    }
    Ok((bytes, hasher.finalize()))
}
