//! Periodic asynchronous checkpoints of an elastic job, in the tensor engine's format
//! (`rtx_tensor::checkpoint`: safetensors with `optim.`-prefixed optimizer state).
//!
//! Rank 0 snapshots parameters and optimizer state in memory (copies, so training goes on at
//! once) and hands them to a [`CheckpointStore`]; replicas are bit-identical, so one rank's
//! snapshot is the job's state. The data cursor is the step number itself (batches are indexed
//! by step), stored as `step`. A store keeps a checkpoint whole or not at all: a failed write
//! never damages the last good one, and training goes on (the supervisor hears
//! `CheckpointFailed`). Production stores files ([`FileStore`]: temporary file, fsync, rename)
//! from a background thread, at most one write in flight; an embedder (the simulator) injects
//! its own store through the node's `NodeEnv`, called inline.
//!
//! Checkpoints are host data whatever device trained them, and one model's checkpoints load on
//! either: when the optimizer keeps f32 master weights (`<param>.master`, a GPU run in bf16) the
//! parameters are stored as those masters, so a CPU run of the same model resumes at full
//! precision (it ignores the extra state); a GPU run resuming a checkpoint without masters (a
//! CPU run's) starts its masters from the stored parameters.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use rtx_actors::RemoteRef;
use rtx_pipelines::ParamSlice;
use rtx_tensor::checkpoint::sharded::ShardedCheckpoint;
use rtx_tensor::checkpoint::{load_tensors, save_tensors, NamedTensors, FORMAT, OPTIM_PREFIX};
use rtx_tensor::{Module, Optimizer, Tensor};

use crate::error::{Result, SupervisorError};
use crate::protocol::ToSupervisor;

/// A checkpoint as a store holds it: its tensors (parameters, then `optim.` state) and metadata.
pub type StoredCheckpoint = (Vec<(String, Tensor)>, BTreeMap<String, String>);

/// Where checkpoints go.
pub trait CheckpointStore: Send + Sync + 'static {
    /// Stores the checkpoint taken after `step`, whole or not at all (on an error the last good
    /// checkpoint must be intact); returns where it went, or why it failed.
    fn store(&self, step: u64, tensors: &[(String, Tensor)], metadata: &BTreeMap<String, String>) -> std::result::Result<String, String>;

    /// Reads back the checkpoint `store` returned `location` for: its tensors and metadata. The
    /// default reads a safetensors file at that path (what [`FileStore`] writes). The
    /// supervisor hands a location to a new generation when every holder of newer state is gone.
    fn load(&self, location: &str) -> std::result::Result<StoredCheckpoint, String> {
        load_tensors(Path::new(location)).map_err(|e| format!("cannot read checkpoint {location}: {e}"))
    }
}

/// Checkpoint files `step-NNNNNNNN.safetensors` in a folder, written atomically.
#[derive(Clone, Debug)]
pub struct FileStore {
    dir: PathBuf,
}

impl FileStore {
    /// A store writing into `dir` (created on the first write).
    pub fn new(dir: PathBuf) -> FileStore {
        FileStore { dir }
    }
}

impl CheckpointStore for FileStore {
    fn store(&self, step: u64, tensors: &[(String, Tensor)], metadata: &BTreeMap<String, String>) -> std::result::Result<String, String> {
        std::fs::create_dir_all(&self.dir).map_err(|e| format!("cannot create checkpoint folder {}: {e}", self.dir.display()))?;
        let path = path_for(&self.dir, step);
        save_tensors(&path, tensors, metadata).map_err(|e| e.to_string())?;
        Ok(path.display().to_string())
    }
}

/// How a [`CheckpointWriter`] calls its store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteMode {
    /// On a background thread, one write in flight (production: the step loop never waits
    /// for the disk).
    Background,
    /// Inline in the caller's task (the simulator: no threads).
    Inline,
}

/// Snapshots training state and writes it to a store, one checkpoint at a time.
pub struct CheckpointWriter {
    store: Option<Arc<dyn CheckpointStore>>,
    mode: WriteMode,
    in_flight: Option<JoinHandle<()>>,
}

/// The optimizer state field holding f32 master weights (`rtx_tensor::cuda::MixedAdamW`).
const MASTER_SUFFIX: &str = ".master";

/// The file of `step` in `dir`.
pub fn path_for(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("step-{step:08}.safetensors"))
}

/// The folder of the sharded checkpoint of `step` in `dir` (a mesh job's; see
/// `rtx_tensor::checkpoint::sharded`).
pub fn sharded_path_for(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("step-{step:08}"))
}

/// The newest complete sharded checkpoint in `dir` (a `step-*` folder with its index), if any.
/// A folder without `index.json` is a checkpoint whose writers did not all finish: skipped.
pub fn latest_sharded(dir: &Path) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir() && p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("step-")) && p.join(rtx_tensor::checkpoint::sharded::INDEX_FILE).is_file())
        .collect();
    found.sort();
    found.pop()
}

/// The newest checkpoint file in `dir`, if any.
pub fn latest(dir: &Path) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "safetensors") && p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("step-")))
        .collect();
    found.sort();
    found.pop()
}

/// The metadata of the checkpoint taken after `step` by `optimizer`.
pub fn metadata(step: u64, optimizer: &dyn Optimizer) -> BTreeMap<String, String> {
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), FORMAT.to_string());
    meta.insert("step".to_string(), step.to_string());
    meta.insert("rng".to_string(), "{}".to_string());
    meta.insert("user".to_string(), format!("{{\"elastic\":true,\"completed_step\":{step}}}"));
    meta.insert("optimizer".to_string(), format!("{{\"kind\":\"{}\",\"lr\":{}}}", optimizer.kind(), optimizer.lr()));
    meta
}

/// The message that tells the supervisor how the write of `step` went.
fn report(node: u64, step: u64, result: std::result::Result<String, String>) -> ToSupervisor {
    match result {
        Ok(path) => {
            tracing::info!(step, %path, "checkpoint written");
            ToSupervisor::Checkpointed { node, step, path }
        }
        Err(reason) => {
            tracing::error!(step, %reason, "checkpoint write failed; the previous one stays valid");
            ToSupervisor::CheckpointFailed { node, step, reason }
        }
    }
}

impl CheckpointWriter {
    /// A writer into `store` (`None`: checkpoints are off).
    pub fn new(store: Option<Arc<dyn CheckpointStore>>, mode: WriteMode) -> Self {
        CheckpointWriter { store, mode, in_flight: None }
    }

    /// Whether checkpoints are on.
    pub fn enabled(&self) -> bool {
        self.store.is_some()
    }

    /// Snapshots `model` and the full optimizer `state` (of `optimizer`'s kind) after `step` and
    /// stores them. A failed write is reported to the supervisor, not returned: training goes on
    /// from the last good checkpoint. In the background mode the writer thread reports; inline,
    /// the report is returned for the caller to send.
    pub fn write<M: Module, O: Optimizer>(&mut self, step: u64, model: &M, state: Vec<(String, Tensor)>, optimizer: &O, supervisor: RemoteRef<ToSupervisor>, node: u64) -> Result<Option<ToSupervisor>> {
        let Some(store) = self.store.clone() else { return Ok(None) };
        self.wait();
        let tensors = checkpoint_tensors(model, state)?;
        let meta = metadata(step, optimizer);
        match self.mode {
            WriteMode::Inline => return Ok(Some(report(node, step, store.store(step, &tensors, &meta)))),
            WriteMode::Background => {
                let handle = std::thread::Builder::new()
                    .name("checkpoint".into())
                    .spawn(move || {
                        let message = report(node, step, store.store(step, &tensors, &meta));
                        let _ = supervisor.blocking_tell(&message);
                    })
                    .map_err(|e| SupervisorError::Job(format!("cannot start the checkpoint thread: {e}")))?;
                self.in_flight = Some(handle);
            }
        }
        Ok(None)
    }

    /// Waits for the write in flight.
    pub fn wait(&mut self) {
        if let Some(handle) = self.in_flight.take() {
            let _ = handle.join();
        }
    }
}

/// What a checkpoint of `model` with the full optimizer `state` holds, in host memory: every
/// parameter (as its f32 master weights when `state` has them, else as it is), then the state
/// under [`OPTIM_PREFIX`].
pub fn checkpoint_tensors<M: Module>(model: &M, state: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>> {
    let masters: BTreeMap<String, Tensor> = state.iter().filter_map(|(n, t)| n.strip_suffix(MASTER_SUFFIX).map(|p| (p.to_string(), t.clone()))).collect();
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    for (name, p) in model.named_parameters() {
        let stored = match masters.get(&name) {
            Some(master) if master.shape() == p.shape() => Tensor::from_vec(master.to_f32_vec()?, p.shape())?,
            _ => Tensor::from_vec(p.to_f32_vec()?, p.shape())?.to_dtype(p.dtype())?,
        };
        tensors.push((name, stored));
    }
    // Buffers (an EMA target encoder) as they are: no optimizer holds masters of them.
    for (name, b) in model.named_buffers() {
        tensors.push((name, Tensor::from_vec(b.to_f32_vec()?, b.shape())?.to_dtype(b.dtype())?));
    }
    for (name, t) in state {
        tensors.push((format!("{OPTIM_PREFIX}{name}"), t));
    }
    Ok(tensors)
}

/// Loads a checkpoint into `model`; returns the optimizer state (for an optimizer built by
/// `build_optimizer` over whole parameters) and the step it was taken after. `path` is a
/// single-file checkpoint, or the folder of a sharded one (a mesh job's, of any shape), read whole.
pub fn load<M: Module, O: Optimizer>(path: &Path, model: &M, build_optimizer: impl FnOnce(&[ParamSlice]) -> std::result::Result<O, String>) -> Result<(Vec<(String, Tensor)>, u64)> {
    let (tensors, meta) = if path.is_dir() { load_sharded_whole(path)? } else { load_tensors(path)? };
    install(path, &tensors, &meta, model, build_optimizer)
}

/// Every tensor of the sharded checkpoint in `dir`, whole, and its metadata (with its step).
fn load_sharded_whole(dir: &Path) -> rtx_pipelines::Result<(NamedTensors, BTreeMap<String, String>)> {
    let ckpt = ShardedCheckpoint::open(dir)?;
    let tensors = ckpt.names().into_iter().map(|name| Ok((name.to_string(), ckpt.full(name)?))).collect::<rtx_pipelines::Result<NamedTensors>>()?;
    let mut meta = ckpt.metadata().clone();
    meta.insert("step".to_string(), ckpt.step().to_string());
    Ok((tensors, meta))
}

/// [`load`] from a store's `location` (see [`CheckpointStore::load`]).
pub fn load_from<M: Module, O: Optimizer>(store: &dyn CheckpointStore, location: &str, model: &M, build_optimizer: impl FnOnce(&[ParamSlice]) -> std::result::Result<O, String>) -> Result<(Vec<(String, Tensor)>, u64)> {
    let (tensors, meta) = store.load(location).map_err(SupervisorError::Job)?;
    install(Path::new(location), &tensors, &meta, model, build_optimizer)
}

/// Installs checkpoint `tensors` (read from `path`) into `model`; returns the optimizer state
/// and the step.
fn install<M: Module, O: Optimizer>(path: &Path, tensors: &[(String, Tensor)], meta: &BTreeMap<String, String>, model: &M, build_optimizer: impl FnOnce(&[ParamSlice]) -> std::result::Result<O, String>) -> Result<(Vec<(String, Tensor)>, u64)> {
    let step: u64 = meta.get("step").and_then(|s| s.parse().ok()).ok_or_else(|| SupervisorError::Job(format!("checkpoint {} has no step", path.display())))?;
    let by_name: BTreeMap<&str, &Tensor> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let params = model.named_state();
    for (name, p) in &params {
        let t = by_name.get(name.as_str()).ok_or_else(|| SupervisorError::Job(format!("checkpoint {} lacks parameter or buffer {name}", path.display())))?;
        if t.shape() != p.shape() {
            return Err(SupervisorError::Job(format!("checkpoint {}: parameter {name} has shape {:?}, the model {:?}", path.display(), t.shape(), p.shape())));
        }
        p.copy_from_(t)?;
    }
    let template = crate::state::full_template(model, build_optimizer)?;
    Ok((optimizer_state(path, &by_name, template)?, step))
}

/// The optimizer state shaped like `template`, read from a checkpoint's tensors `by_name`
/// (master weights missing there start from the stored parameters).
fn optimizer_state(path: &Path, by_name: &BTreeMap<&str, &Tensor>, template: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>> {
    let mut state = Vec::new();
    for (name, want) in template {
        let full = format!("{OPTIM_PREFIX}{name}");
        // Master weights missing (a checkpoint of a run without them): the stored parameter.
        let fallback = name.strip_suffix(MASTER_SUFFIX).and_then(|param| by_name.get(param));
        let t = by_name.get(full.as_str()).or(fallback).ok_or_else(|| SupervisorError::Job(format!("checkpoint {} lacks optimizer state {full}", path.display())))?;
        if t.shape() != want.shape() {
            return Err(SupervisorError::Job(format!("checkpoint {}: {full} has shape {:?}, expected {:?}", path.display(), t.shape(), want.shape())));
        }
        state.push((name, (*t).clone()));
    }
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtx_tensor::nn::{Activation, Mlp};
    use rtx_tensor::optim::{AdamW, AdamWConfig};
    use rtx_tensor::{DType, Generator};

    /// A fresh folder for this test under the system's temporary folder.
    fn scratch_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("rtx-checkpoint-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir
    }

    fn mlp(seed: u64) -> Mlp {
        Mlp::new(&[3, 4, 2], Activation::Relu, DType::F32, &mut Generator::new(seed)).expect("mlp")
    }

    fn adamw(slices: &[ParamSlice]) -> std::result::Result<AdamW, String> {
        AdamW::new(slices.iter().map(|s| (s.name.clone(), s.tensor.clone())).collect(), AdamWConfig::default()).map_err(|e| e.to_string())
    }

    /// The full state of a fresh AdamW over `model`, plus `<param>.master` = `master_of(param)`
    /// (what a GPU run's optimizer carries).
    fn state_with_masters(model: &Mlp, master_of: impl Fn(&Tensor) -> Tensor) -> Vec<(String, Tensor)> {
        let mut state = crate::state::full_template(model, adamw).expect("template");
        for (name, p) in model.named_parameters() {
            state.push((format!("{name}.master"), master_of(&p)));
        }
        state
    }

    #[test]
    fn master_weights_become_the_stored_parameters_and_a_cpu_model_loads_them() {
        // Goal: a checkpoint of a run whose optimizer keeps f32 master weights stores them as the
        // parameters, and a CPU model with a plain AdamW loads it (ignoring the extra state).
        // Method: masters = parameters + 0.5; write, then load into a differently initialised model.
        let model = mlp(1);
        let state = state_with_masters(&model, |p| p.add_scalar(0.5).expect("add"));
        let tensors = checkpoint_tensors(&model, state).expect("tensors");
        for (name, p) in model.named_parameters() {
            let stored = &tensors.iter().find(|(n, _)| *n == name).expect("stored").1;
            let want: Vec<f32> = p.to_f32_vec().expect("p").iter().map(|v| v + 0.5).collect();
            assert_eq!(stored.to_f32_vec().expect("stored"), want, "{name}");
        }
        let dir = scratch_dir("masters");
        let path = path_for(&dir, 4);
        save_tensors(&path, &tensors, &metadata(4, &adamw(&[]).expect("optimizer"))).expect("save");
        let cpu = mlp(2);
        let (state, step) = load(&path, &cpu, adamw).expect("a CPU model loads a checkpoint with masters");
        assert_eq!(step, 4);
        assert!(state.iter().all(|(n, _)| !n.ends_with(".master")), "the CPU optimizer's state has no masters");
        for (name, p) in cpu.named_parameters() {
            let stored = &tensors.iter().find(|(n, _)| *n == name).expect("stored").1;
            assert_eq!(p.to_f32_vec().expect("p"), stored.to_f32_vec().expect("stored"), "{name}");
        }
    }

    #[test]
    fn missing_master_weights_start_from_the_stored_parameters() {
        // Goal: an optimizer that wants master weights resumes a checkpoint written without them
        // (a CPU run's) from the stored parameters; any other missing state is an error.
        // Method: a template asking for masters, against a checkpoint of a plain AdamW.
        let model = mlp(3);
        let plain = crate::state::full_template(&model, adamw).expect("template");
        let tensors = checkpoint_tensors(&model, plain).expect("tensors");
        let dir = scratch_dir("no-masters");
        let path = path_for(&dir, 9);
        save_tensors(&path, &tensors, &metadata(9, &adamw(&[]).expect("optimizer"))).expect("save");
        let by_name: BTreeMap<&str, &Tensor> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let template = state_with_masters(&model, |p| p.zeros_like());
        let state = optimizer_state(&path, &by_name, template).expect("masters fall back to the parameters");
        for (name, p) in model.named_parameters() {
            let master = &state.iter().find(|(n, _)| *n == format!("{name}.master")).expect("master").1;
            assert_eq!(master.to_f32_vec().expect("master"), p.to_f32_vec().expect("p"), "{name}");
        }
        let mut missing = state_with_masters(&model, |p| p.zeros_like());
        missing.push(("0.weight.other".into(), Tensor::scalar(0.0, DType::F64)));
        let e = optimizer_state(&path, &by_name, missing).expect_err("unknown state is missing");
        assert!(e.to_string().contains("lacks optimizer state optim.0.weight.other"), "{e}");
    }
}
