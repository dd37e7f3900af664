//! Checkpoint files of a run: `checkpoints/step-NNNNNNNN.safetensors` in the output folder,
//! written through [`rtx_tensor::checkpoint`] (model, optimizer state, step, generator states)
//! with the run's own data in the `user` metadata: `{"data_cursor": .., "config": ..}`.

use std::path::{Path, PathBuf};

use rtx_tensor::checkpoint::{self, CheckpointMeta};
use rtx_tensor::data::Cursor;
use rtx_tensor::GeneratorState;

use super::model::Model;
use super::optimizer::Optimizer;
use super::{Result, TrainError};

/// Sub-folder of the output folder holding checkpoints.
pub const CHECKPOINT_DIR: &str = "checkpoints";
const PREFIX: &str = "step-";
const SUFFIX: &str = ".safetensors";
/// Name of the dropout generator in the checkpoint's generator map.
const DROPOUT_RNG: &str = "dropout";

/// What the trainer keeps in a checkpoint besides tensors.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct RunState {
    /// Steps completed.
    pub(crate) step: u64,
    /// Position of the dropout generator.
    pub(crate) dropout_rng: GeneratorState,
    /// Image sampler position (`None` for text, where the step is the cursor).
    pub(crate) data_cursor: Option<Cursor>,
    /// The run's config, as JSON.
    pub(crate) config: serde_json::Value,
}

/// The checkpoint path of `step`.
pub(crate) fn path_for(out_dir: &Path, step: u64) -> PathBuf {
    out_dir.join(CHECKPOINT_DIR).join(format!("{PREFIX}{step:08}{SUFFIX}"))
}

/// Every checkpoint of `out_dir` as `(step, path)`, oldest first.
pub(crate) fn list(out_dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let dir = out_dir.join(CHECKPOINT_DIR);
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(TrainError::Io { what: "cannot list checkpoints in", path: dir, source }),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| TrainError::Io { what: "cannot list checkpoints in", path: dir.clone(), source })?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(step) = name.strip_prefix(PREFIX).and_then(|s| s.strip_suffix(SUFFIX)).and_then(|s| s.parse::<u64>().ok()) {
            found.push((step, entry.path()));
        }
    }
    found.sort();
    Ok(found)
}

/// The newest checkpoint of `out_dir`, if any.
pub(crate) fn latest(out_dir: &Path) -> Result<Option<(u64, PathBuf)>> {
    Ok(list(out_dir)?.pop())
}

/// Writes the checkpoint of `state.step`; returns its path.
pub(crate) fn save(out_dir: &Path, model: &Model, optimizer: &Optimizer, state: &RunState) -> Result<PathBuf> {
    let path = path_for(out_dir, state.step);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|source| TrainError::Io { what: "cannot create", path: dir.to_path_buf(), source })?;
    }
    let meta = CheckpointMeta {
        step: state.step,
        rngs: [(DROPOUT_RNG.to_string(), state.dropout_rng)].into_iter().collect(),
        user: serde_json::json!({ "data_cursor": state.data_cursor, "config": state.config }),
    };
    checkpoint::save(&path, model.module(), Some(optimizer.inner()), &meta)?;
    Ok(path)
}

/// Reads a checkpoint's run state without loading tensors.
pub(crate) fn read_state(path: &Path) -> Result<RunState> {
    state_from(path, checkpoint::read_meta(path)?)
}

/// Loads a checkpoint into `model` and `optimizer`; returns its run state.
pub(crate) fn load(path: &Path, model: &Model, optimizer: &mut Optimizer) -> Result<RunState> {
    let meta = checkpoint::load(path, model.module(), Some(optimizer.inner_mut()))?;
    state_from(path, meta)
}

fn state_from(path: &Path, meta: CheckpointMeta) -> Result<RunState> {
    let bad = |what: &str| TrainError::Resume(format!("checkpoint {} {what}", path.display()));
    let dropout_rng = *meta.rngs.get(DROPOUT_RNG).ok_or_else(|| bad("has no dropout generator state"))?;
    let data_cursor = match meta.user.get("data_cursor") {
        None | Some(serde_json::Value::Null) => None,
        Some(v) => Some(serde_json::from_value(v.clone()).map_err(|e| bad(&format!("has a malformed data cursor: {e}")))?),
    };
    let config = meta.user.get("config").cloned().ok_or_else(|| bad("has no run config (was it written by `rtx train`?)"))?;
    Ok(RunState { step: meta.step, dropout_rng, data_cursor, config })
}

/// Deletes all but the newest `keep` checkpoints.
pub(crate) fn prune(out_dir: &Path, keep: usize) -> Result<()> {
    let all = list(out_dir)?;
    let n = all.len().saturating_sub(keep);
    for (_, path) in &all[..n] {
        std::fs::remove_file(path).map_err(|source| TrainError::Io { what: "cannot delete old checkpoint", path: path.clone(), source })?;
    }
    Ok(())
}
