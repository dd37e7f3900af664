//! Reading a sharded checkpoint: [`ShardedCheckpoint::open`] validates the index against the
//! shard files (memory-mapped); reads assemble any part of any tensor from the pieces that
//! overlap it, copying only the rows asked for. Also [`consolidate`].

use super::error::{Result, ShardedError};
use super::index::{Index, TensorEntry, INDEX_FILE};
use super::part::{Part, Split};
use super::region::{copy_rows, Geometry};
use super::{from_st_dtype, io_error};
use crate::checkpoint::{save_tensors, FORMAT};
use crate::storage::CpuData;
use crate::tensor::Tensor;
use rtx_kernels::DType;
use safetensors::SafeTensors;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Says which part of the full tensor a caller's local tensor is, given the full shape.
pub trait PartSpec {
    /// The part `name` is, for a full tensor of `full_shape`; an error message when the caller
    /// cannot hold it (a dim that does not divide).
    fn part(&self, name: &str, full_shape: &[usize]) -> std::result::Result<Part, String>;
}

impl<F: Fn(&str, &[usize]) -> std::result::Result<Part, String>> PartSpec for F {
    fn part(&self, name: &str, full_shape: &[usize]) -> std::result::Result<Part, String> {
        self(name, full_shape)
    }
}

/// An opened, validated sharded checkpoint.
#[derive(Debug)]
pub struct ShardedCheckpoint {
    dir: PathBuf,
    index_path: String,
    index: Index,
    files: BTreeMap<String, ShardFile>,
}

/// A tensor as a shard file's header describes it.
#[derive(Debug)]
struct Stored {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    /// Byte range in the file.
    range: (usize, usize),
}

/// One memory-mapped shard file.
#[derive(Debug)]
struct ShardFile {
    path: String,
    map: memmap2::Mmap,
    /// Its tensors by name: dtype, shape and byte range in the file.
    tensors: BTreeMap<String, Stored>,
    expected_crc: u32,
    /// The crc32 of the whole file, computed on first use.
    actual_crc: OnceLock<u32>,
}

impl ShardedCheckpoint {
    /// Opens the checkpoint in `dir`: parses and validates `index.json` (a missing one means the
    /// checkpoint is incomplete), then maps every shard file and checks its length, header, and
    /// that it holds every piece the index places in it with the right dtype and local shape.
    /// Contents are checksummed lazily, file by file, on first read ([`ShardedCheckpoint::verify`]
    /// checks all now).
    pub fn open(dir: &Path) -> Result<ShardedCheckpoint> {
        let _span = tracing::info_span!("sharded_open", dir = %dir.display()).entered();
        let index_path = dir.join(INDEX_FILE);
        let index_name = index_path.display().to_string();
        let bytes = match std::fs::read(&index_path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(ShardedError::MissingIndex { dir: dir.display().to_string() }),
            Err(e) => return Err(io_error(&index_path)(e)),
        };
        let index = Index::parse(&bytes, &index_name)?;
        let mut files = BTreeMap::new();
        for (name, entry) in &index.files {
            let tensor = index.tensor_in(name);
            files.insert(name.clone(), ShardFile::open(&dir.join(name), entry.bytes, entry.crc32, &tensor)?);
        }
        for (name, entry) in &index.tensors {
            for piece in &entry.pieces {
                let Some(file) = files.get(&piece.file) else {
                    return Err(ShardedError::BadIndex {
                        file: index_name,
                        reason: format!("tensor {name} has a piece in {}, which the index does not list", piece.file),
                    });
                };
                file.check_piece(name, entry, &piece.part)?;
            }
        }
        tracing::debug!(step = index.step, files = files.len(), tensors = index.tensors.len(), "sharded checkpoint opened");
        Ok(ShardedCheckpoint { dir: dir.to_path_buf(), index_path: index_name, index, files })
    }

    /// The validated index.
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// The step the checkpoint was taken after.
    pub fn step(&self) -> u64 {
        self.index.step
    }

    /// The mesh it was saved from.
    pub fn mesh(&self) -> &[(String, usize)] {
        &self.index.mesh
    }

    /// Its free-form metadata.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.index.metadata
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.index.tensors.keys().map(String::as_str).collect()
    }

    /// The full shape of `name`.
    pub fn shape(&self, name: &str) -> Result<&[usize]> {
        Ok(&self.entry(name)?.shape)
    }

    /// The full tensor `name`, assembled from its pieces.
    pub fn full(&self, name: &str) -> Result<Tensor> {
        self.read(name, &Part::Whole)
    }

    /// Rows `start..start + len` of dim `dim` of `name`, read from the pieces that hold them.
    pub fn slice(&self, name: &str, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        let full_len = self.entry(name)?.shape.get(dim).copied().unwrap_or(0);
        self.read(name, &Part::Split(Split::range(dim, start, len, full_len)))
    }

    /// The part `part` of tensor `name` (any split, whatever the split it was saved with).
    pub fn read(&self, name: &str, part: &Part) -> Result<Tensor> {
        let entry = self.entry(name)?;
        part.check(&entry.shape).map_err(|reason| ShardedError::BadPart { file: self.index_path.clone(), tensor: name.to_string(), reason })?;
        let dtype = from_st_dtype(entry.dtype).ok_or_else(|| ShardedError::BadPart {
            file: self.index_path.clone(),
            tensor: name.to_string(),
            reason: format!("dtype {:?} is not supported", entry.dtype),
        })?;
        let stored_dim = entry.pieces.iter().find_map(|p| match p.part {
            Part::Split(s) => Some(s.dim),
            Part::Whole => None,
        });
        let local_shape = part.local_shape(&entry.shape);
        let mut data = zeros(dtype, local_shape.iter().product());
        match (part, stored_dim) {
            (Part::Whole, None) => {
                let piece = entry.pieces.first().ok_or_else(|| self.internal(name, "no pieces".into()))?;
                let src = self.piece_bytes(&piece.file, name)?;
                let dst = bytes_mut(&mut data);
                if src.len() != dst.len() {
                    return Err(self.internal(name, format!("piece in {} has {} bytes, expected {}", piece.file, src.len(), dst.len())));
                }
                dst.copy_from_slice(src);
            }
            (Part::Split(want), Some(dim)) if want.dim != dim => {
                // Saved split along another dim: assemble the whole tensor, then take the part.
                let full = self.read(name, &Part::Whole)?;
                let full_data = full.to_data().map_err(|source| ShardedError::Tensor { file: self.index_path.clone(), tensor: name.to_string(), source })?;
                let sg = self.geometry(name, &entry.shape, want.dim, dtype)?;
                let dg = self.geometry(name, &local_shape, want.dim, dtype)?;
                self.copy_runs(name, full_data.as_bytes(), sg, &whole_runs(entry, want.dim), bytes_mut(&mut data), dg, part, want.dim)?;
            }
            (_, _) => {
                let dim = match (part, stored_dim) {
                    (Part::Split(s), _) => s.dim,
                    (Part::Whole, Some(d)) => d,
                    (Part::Whole, None) => 0,
                };
                let dg = self.geometry(name, &local_shape, dim, dtype)?;
                for piece in &entry.pieces {
                    let runs = match piece.part {
                        Part::Split(s) => s.runs().collect(),
                        Part::Whole => whole_runs(entry, dim),
                    };
                    if !overlaps(&runs, part, entry, dim) {
                        continue;
                    }
                    let src = self.piece_bytes(&piece.file, name)?;
                    let sg = self.geometry(name, &piece.part.local_shape(&entry.shape), dim, dtype)?;
                    self.copy_runs(name, src, sg, &runs, bytes_mut(&mut data), dg, part, dim)?;
                }
            }
        }
        Tensor::from_data(data, &local_shape).map_err(|source| ShardedError::Tensor { file: self.index_path.clone(), tensor: name.to_string(), source })
    }

    /// For each `(name, local tensor)` of `like`, its part (per `spec`) read from the checkpoint,
    /// after checking that every name is present and every local tensor has the part's shape and
    /// the stored dtype. Names in the checkpoint that `like` lacks are ignored.
    pub fn read_like(&self, like: &[(String, Tensor)], spec: &dyn PartSpec) -> Result<Vec<(String, Tensor)>> {
        let mut plan = Vec::with_capacity(like.len());
        for (name, local) in like {
            let entry = self.entry(name)?;
            let part = spec.part(name, &entry.shape).map_err(|reason| ShardedError::BadPart { file: self.index_path.clone(), tensor: name.clone(), reason })?;
            part.check(&entry.shape).map_err(|reason| ShardedError::BadPart { file: self.index_path.clone(), tensor: name.clone(), reason })?;
            let expected = part.local_shape(&entry.shape);
            if local.shape() != expected.as_slice() {
                return Err(ShardedError::ShapeMismatch { file: self.index_path.clone(), tensor: name.clone(), expected, actual: local.shape().to_vec() });
            }
            let stored = from_st_dtype(entry.dtype);
            if stored != Some(local.dtype()) {
                return Err(ShardedError::DTypeMismatch {
                    file: self.index_path.clone(),
                    tensor: name.clone(),
                    expected: format!("{:?}", entry.dtype),
                    actual: local.dtype().to_string(),
                });
            }
            plan.push((name, part));
        }
        plan.into_iter().map(|(name, part)| Ok((name.clone(), self.read(name, &part)?))).collect()
    }

    /// Overwrites each `(name, local tensor)` of `named` in place with its part (per `spec`) of
    /// the checkpoint: everything is read and checked first, so on an error nothing is changed.
    /// Any target mesh loads this way: a tp rank passes its slices, a pipeline stage its
    /// layers, a single rank the whole model (`|_, _| Ok(Part::Whole)`).
    pub fn load_into(&self, named: &[(String, Tensor)], spec: &dyn PartSpec) -> Result<()> {
        let _span = tracing::info_span!("sharded_load", tensors = named.len(), step = self.index.step).entered();
        let read = self.read_like(named, spec)?;
        for ((name, local), (_, value)) in named.iter().zip(&read) {
            local.copy_from_(value).map_err(|source| ShardedError::Tensor { file: self.index_path.clone(), tensor: name.clone(), source })?;
        }
        Ok(())
    }

    /// Checks every shard file's crc32 now (reads every byte once).
    pub fn verify(&self) -> Result<()> {
        for name in self.files.keys() {
            self.checked_file(name, &self.index.tensor_in(name))?;
        }
        Ok(())
    }

    fn entry(&self, name: &str) -> Result<&TensorEntry> {
        self.index.tensors.get(name).ok_or_else(|| ShardedError::UnknownTensor { file: self.index_path.clone(), tensor: name.to_string() })
    }

    /// The file `name`, after checking its crc32 (once).
    fn checked_file(&self, name: &str, tensor: &str) -> Result<&ShardFile> {
        let file = self.files.get(name).ok_or_else(|| self.internal(tensor, format!("no shard file {name}")))?;
        let actual = *file.actual_crc.get_or_init(|| crc32fast::hash(&file.map));
        if actual != file.expected_crc {
            return Err(ShardedError::ChecksumMismatch { file: file.path.clone(), tensor: tensor.to_string(), expected: file.expected_crc, actual });
        }
        Ok(file)
    }

    /// The stored bytes of tensor `name` in shard file `file`.
    fn piece_bytes(&self, file: &str, name: &str) -> Result<&[u8]> {
        let shard = self.checked_file(file, name)?;
        let range = shard.tensors.get(name).map(|t| t.range);
        range.and_then(|(a, b)| shard.map.get(a..b)).ok_or_else(|| ShardedError::BadShard {
            file: shard.path.clone(),
            tensor: name.to_string(),
            reason: "tensor not in the file".into(),
        })
    }

    fn geometry(&self, name: &str, shape: &[usize], dim: usize, dtype: DType) -> Result<Geometry> {
        Geometry::new(shape, dim, dtype.size_in_bytes()).ok_or_else(|| self.internal(name, format!("shape {shape:?} has no dim {dim} or overflows")))
    }

    /// Copies, for every run of `part` along `dim`, the rows that the source runs `src_runs`
    /// (`(full row, local row, count)`) hold.
    #[allow(clippy::too_many_arguments)]
    fn copy_runs(
        &self,
        name: &str,
        src: &[u8],
        sg: Geometry,
        src_runs: &[(usize, usize, usize)],
        dst: &mut [u8],
        dg: Geometry,
        part: &Part,
        dim: usize,
    ) -> Result<()> {
        let entry = self.entry(name)?;
        for (want_full, want_local, want_len) in want_runs(part, entry, dim) {
            for &(have_full, have_local, have_len) in src_runs {
                let lo = want_full.max(have_full);
                let hi = (want_full + want_len).min(have_full + have_len);
                if lo >= hi {
                    continue;
                }
                if !copy_rows(src, sg, have_local + (lo - have_full), dst, dg, want_local + (lo - want_full), hi - lo) {
                    return Err(self.internal(name, format!("rows {lo}..{hi} of dim {dim} do not fit the stored piece")));
                }
            }
        }
        Ok(())
    }

    fn internal(&self, name: &str, reason: String) -> ShardedError {
        ShardedError::BadShard { file: self.index_path.clone(), tensor: name.to_string(), reason }
    }
}

impl ShardFile {
    /// Maps `path`, checks its length against `bytes` and parses its safetensors header.
    fn open(path: &Path, bytes: u64, crc32: u32, tensor: &str) -> Result<ShardFile> {
        let display = path.display().to_string();
        let file = match std::fs::File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(ShardedError::MissingShard { file: display, tensor: tensor.to_string() }),
            Err(e) => return Err(io_error(path)(e)),
        };
        let actual = file.metadata().map_err(io_error(path))?.len();
        if actual != bytes {
            return Err(ShardedError::SizeMismatch { file: display, tensor: tensor.to_string(), expected: bytes, actual });
        }
        // SAFETY: the map is read-only and shard files are never modified in place (writers go
        // through a temporary file and a rename). Another process truncating the file while it
        // is mapped would fault this reader; that is outside the format's contract.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_error(path))?;
        let (header_len, metadata) = SafeTensors::read_metadata(&map).map_err(|e| ShardedError::BadShard {
            file: display.clone(),
            tensor: tensor.to_string(),
            reason: format!("not a valid safetensors file: {e}"),
        })?;
        let data_start = 8 + header_len;
        let mut tensors = BTreeMap::new();
        for (name, info) in metadata.tensors() {
            let (a, b) = info.data_offsets;
            tensors.insert(name, Stored { dtype: info.dtype, shape: info.shape.clone(), range: (data_start + a, data_start + b) });
        }
        Ok(ShardFile { path: display, map, tensors, expected_crc: crc32, actual_crc: OnceLock::new() })
    }

    /// Checks that the file holds tensor `name`'s part `part` with the index's dtype and the
    /// part's local shape.
    fn check_piece(&self, name: &str, entry: &TensorEntry, part: &Part) -> Result<()> {
        let bad = |reason: String| ShardedError::BadShard { file: self.path.clone(), tensor: name.to_string(), reason };
        let info = self.tensors.get(name).ok_or_else(|| bad("the index places a piece here but the file lacks the tensor".into()))?;
        if info.dtype != entry.dtype {
            return Err(ShardedError::DTypeMismatch {
                file: self.path.clone(),
                tensor: name.to_string(),
                expected: format!("{:?}", entry.dtype),
                actual: format!("{:?}", info.dtype),
            });
        }
        let expected = part.local_shape(&entry.shape);
        if info.shape != expected {
            return Err(ShardedError::ShapeMismatch { file: self.path.clone(), tensor: name.to_string(), expected, actual: info.shape.clone() });
        }
        Ok(())
    }
}

/// Writes the full tensors of the checkpoint in `dir` to one ordinary safetensors file `out`
/// (atomically), with the index's metadata plus `format` and `step` where it lacks them; what
/// `safetensors.torch.load_file` and [`crate::checkpoint::load_tensors`] read (and
/// [`crate::checkpoint::load`] when the metadata came from [`crate::checkpoint::file_metadata`]).
pub fn consolidate(dir: &Path, out: &Path) -> Result<()> {
    let ckpt = ShardedCheckpoint::open(dir)?;
    let _span = tracing::info_span!("consolidate", dir = %dir.display(), out = %out.display()).entered();
    let tensors = ckpt.names().into_iter().map(|n| Ok((n.to_string(), ckpt.full(n)?))).collect::<Result<Vec<_>>>()?;
    let mut metadata = ckpt.metadata().clone();
    metadata.entry("format".to_string()).or_insert_with(|| FORMAT.to_string());
    metadata.entry("step".to_string()).or_insert_with(|| ckpt.step().to_string());
    save_tensors(out, &tensors, &metadata).map_err(|source| ShardedError::Tensor { file: out.display().to_string(), tensor: String::new(), source })
}

/// The single run of a whole tensor along `dim`.
fn whole_runs(entry: &TensorEntry, dim: usize) -> Vec<(usize, usize, usize)> {
    vec![(0, 0, entry.shape.get(dim).copied().unwrap_or(1))]
}

/// The runs `part` wants along `dim`.
fn want_runs(part: &Part, entry: &TensorEntry, dim: usize) -> Vec<(usize, usize, usize)> {
    match part {
        Part::Split(s) => s.runs().collect(),
        Part::Whole => whole_runs(entry, dim),
    }
}

/// Whether any of `runs` meets a run `part` wants.
fn overlaps(runs: &[(usize, usize, usize)], part: &Part, entry: &TensorEntry, dim: usize) -> bool {
    let want = want_runs(part, entry, dim);
    runs.iter().any(|&(a, _, n)| want.iter().any(|&(b, _, m)| a.max(b) < (a + n).min(b + m)))
}

fn zeros(dtype: DType, numel: usize) -> CpuData {
    match dtype {
        DType::F32 => CpuData::F32(vec![0.0; numel].into()),
        DType::F64 => CpuData::F64(vec![0.0; numel].into()),
        DType::BF16 => CpuData::BF16(vec![half::bf16::ZERO; numel].into()),
        DType::U32 => CpuData::U32(vec![0; numel].into()),
        DType::I64 => CpuData::I64(vec![0; numel].into()),
    }
}

fn bytes_mut(data: &mut CpuData) -> &mut [u8] {
    match data {
        CpuData::F32(v) => bytemuck::cast_slice_mut(v),
        CpuData::F64(v) => bytemuck::cast_slice_mut(v),
        CpuData::BF16(v) => bytemuck::cast_slice_mut(v),
        CpuData::U32(v) => bytemuck::cast_slice_mut(v),
        CpuData::I64(v) => bytemuck::cast_slice_mut(v),
    }
}
