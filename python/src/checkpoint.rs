//! `load_checkpoint(path)`: the tensors of a checkpoint (a safetensors file, as `rtx train` and
//! `rtx launch` write, or a sharded checkpoint folder with its `index.json`) as [`PyTensor`]s with
//! each tensor's dtype in the file, and `latest_checkpoint(run_dir)`, the newest one of a run.
//!
//! Decoding is `rtx-tensor`'s (`checkpoint::load_tensors_with_dtypes`, `sharded::ShardedCheckpoint`):
//! a file dtype the storage lacks (F16, I32, BOOL, ...) loads widened, exactly, and the Python
//! side narrows the numpy array back to the file dtype.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use pyo3::prelude::*;
use rustytorch::checkpoint::sharded::ShardedCheckpoint;
use rustytorch::checkpoint::{load_tensors_with_dtypes, FileDType};
use rustytorch::supervisor::checkpoint::{latest, latest_sharded};

use crate::errors::{message, CheckpointError};
use crate::tensor::{dtype_name, PyTensor};

/// One tensor of a checkpoint: name, tensor, numpy name of its dtype in the file.
type Entry = (String, PyTensor, &'static str);

/// Reads every tensor (in name order) and the string metadata of the checkpoint at `path`.
#[pyfunction]
pub(crate) fn load_checkpoint(py: Python<'_>, path: PathBuf) -> PyResult<(Vec<Entry>, BTreeMap<String, String>)> {
    py.detach(|| read(&path)).map_err(CheckpointError::new_err)
}

/// The newest checkpoint under `<run_dir>/checkpoints` (a file, or a complete sharded folder,
/// whichever has the higher step), or `None`.
#[pyfunction]
pub(crate) fn latest_checkpoint(run_dir: PathBuf) -> Option<PathBuf> {
    let dir = run_dir.join("checkpoints");
    let step_of = |p: &Path| -> Option<u64> {
        if p.is_dir() {
            ShardedCheckpoint::open(p).ok().map(|c| c.step())
        } else {
            rustytorch::checkpoint::read_meta(p).ok().map(|m| m.step)
        }
    };
    [latest(&dir), latest_sharded(&dir)].into_iter().flatten().filter_map(|p| step_of(&p).map(|s| (s, p))).max_by_key(|(s, _)| *s).map(|(_, p)| p)
}

fn read(path: &Path) -> Result<(Vec<Entry>, BTreeMap<String, String>), String> {
    if !path.exists() {
        return Err(format!("no checkpoint at {}", path.display()));
    }
    if path.is_dir() {
        let sharded = ShardedCheckpoint::open(path).map_err(|e| message(&e))?;
        let mut entries = Vec::new();
        for name in sharded.names() {
            let tensor = sharded.full(name).map_err(|e| message(&e))?;
            let dtype = dtype_name(tensor.dtype());
            entries.push((name.to_string(), PyTensor { tensor }, dtype));
        }
        return Ok((entries, sharded.metadata().clone()));
    }
    let typed = load_tensors_with_dtypes(path).map_err(|e| message(&e))?;
    let mut entries = Vec::with_capacity(typed.tensors.len());
    for (name, tensor) in typed.tensors {
        let dtype = typed.file_dtypes.get(&name).map_or_else(|| dtype_name(tensor.dtype()), |d| file_dtype_name(*d));
        entries.push((name, PyTensor { tensor }, dtype));
    }
    Ok((entries, typed.metadata))
}

/// The numpy name of a safetensors dtype.
fn file_dtype_name(dtype: FileDType) -> &'static str {
    match dtype {
        FileDType::Bool => "bool",
        FileDType::U8 => "uint8",
        FileDType::I8 => "int8",
        FileDType::I16 => "int16",
        FileDType::U16 => "uint16",
        FileDType::F16 => "float16",
        FileDType::BF16 => "bfloat16",
        FileDType::I32 => "int32",
        FileDType::U32 => "uint32",
        FileDType::F32 => "float32",
        FileDType::F64 => "float64",
        FileDType::I64 => "int64",
        FileDType::U64 => "uint64",
    }
}
