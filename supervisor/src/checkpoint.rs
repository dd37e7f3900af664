//! Periodic asynchronous checkpoints of an elastic job, in the tensor engine's format
//! (`rtx_tensor::checkpoint`: safetensors with `optim.`-prefixed optimizer state, written
//! atomically: a crash during a write never damages the last good file).
//!
//! Rank 0 snapshots parameters and optimizer state in memory (copies, so training goes on at
//! once) and a background thread writes the file; at most one write is in flight (the next
//! snapshot waits for it). Replicas are bit-identical, so one rank's snapshot is the job's state.
//! The data cursor is the step number itself (batches are indexed by step), stored as `step`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use rtx_actors::RemoteRef;
use rtx_pipelines::ParamSlice;
use rtx_tensor::checkpoint::{load_tensors, save_tensors, FORMAT, OPTIM_PREFIX};
use rtx_tensor::{Module, Optimizer, Tensor};

use crate::error::{Result, SupervisorError};
use crate::protocol::ToSupervisor;

/// Writes one checkpoint at a time in the background.
#[derive(Default)]
pub struct CheckpointWriter {
    in_flight: Option<JoinHandle<()>>,
}

/// The file of `step` in `dir`.
pub fn path_for(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("step-{step:08}.safetensors"))
}

/// The newest checkpoint in `dir`, if any.
pub fn latest(dir: &Path) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir).ok()?.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "safetensors") && p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("step-"))).collect();
    found.sort();
    found.pop()
}

impl CheckpointWriter {
    /// Snapshots `model` and the full optimizer `state` (of `optimizer`'s kind) after `step` and
    /// writes them in the background; reports the written path to the supervisor.
    #[allow(clippy::too_many_arguments)]
    pub fn write<M: Module, O: Optimizer>(&mut self, dir: &Path, step: u64, model: &M, state: Vec<(String, Tensor)>, optimizer: &O, supervisor: RemoteRef<ToSupervisor>, node: u64) -> Result<()> {
        self.wait();
        let mut tensors: Vec<(String, Tensor)> = Vec::new();
        for (name, p) in model.named_parameters() {
            tensors.push((name, Tensor::from_vec(p.to_f32_vec()?, p.shape())?.to_dtype(p.dtype())?));
        }
        for (name, t) in state {
            tensors.push((format!("{OPTIM_PREFIX}{name}"), t));
        }
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), FORMAT.to_string());
        meta.insert("step".to_string(), step.to_string());
        meta.insert("rng".to_string(), "{}".to_string());
        meta.insert("user".to_string(), format!("{{\"elastic\":true,\"completed_step\":{step}}}"));
        meta.insert("optimizer".to_string(), format!("{{\"kind\":\"{}\",\"lr\":{}}}", optimizer.kind(), optimizer.lr()));
        std::fs::create_dir_all(dir).map_err(|e| SupervisorError::Job(format!("cannot create checkpoint folder {}: {e}", dir.display())))?;
        let path = path_for(dir, step);
        let handle = std::thread::Builder::new()
            .name("checkpoint".into())
            .spawn(move || match save_tensors(&path, &tensors, &meta) {
                Ok(()) => {
                    tracing::info!(step, path = %path.display(), "checkpoint written");
                    let _ = supervisor.blocking_tell(&ToSupervisor::Checkpointed { node, step, path: path.display().to_string() });
                }
                Err(e) => tracing::error!(step, error = %e, "checkpoint write failed; the previous one stays valid"),
            })
            .map_err(|e| SupervisorError::Job(format!("cannot start the checkpoint thread: {e}")))?;
        self.in_flight = Some(handle);
        Ok(())
    }

    /// Waits for the write in flight.
    pub fn wait(&mut self) {
        if let Some(handle) = self.in_flight.take() {
            let _ = handle.join();
        }
    }
}

/// Loads a checkpoint into `model`; returns the optimizer state (for an optimizer built by
/// `build_optimizer` over whole parameters) and the step it was taken after.
pub fn load<M: Module, O: Optimizer>(path: &Path, model: &M, build_optimizer: impl FnOnce(&[ParamSlice]) -> std::result::Result<O, String>) -> Result<(Vec<(String, Tensor)>, u64)> {
    let (tensors, meta) = load_tensors(path)?;
    let step: u64 = meta.get("step").and_then(|s| s.parse().ok()).ok_or_else(|| SupervisorError::Job(format!("checkpoint {} has no step", path.display())))?;
    let by_name: BTreeMap<&str, &Tensor> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let params = model.named_parameters();
    for (name, p) in &params {
        let t = by_name.get(name.as_str()).ok_or_else(|| SupervisorError::Job(format!("checkpoint {} lacks parameter {name}", path.display())))?;
        if t.shape() != p.shape() {
            return Err(SupervisorError::Job(format!("checkpoint {}: parameter {name} has shape {:?}, the model {:?}", path.display(), t.shape(), p.shape())));
        }
        p.copy_from_(t)?;
    }
    let template = crate::state::full_template(model, build_optimizer)?;
    let mut state = Vec::new();
    for (name, want) in template {
        let full = format!("{OPTIM_PREFIX}{name}");
        let t = by_name.get(full.as_str()).ok_or_else(|| SupervisorError::Job(format!("checkpoint {} lacks optimizer state {full}", path.display())))?;
        if t.shape() != want.shape() {
            return Err(SupervisorError::Job(format!("checkpoint {}: {full} has shape {:?}, expected {:?}", path.display(), t.shape(), want.shape())));
        }
        state.push((name, (*t).clone()));
    }
    Ok((state, step))
}
