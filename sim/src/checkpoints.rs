//! The simulated cluster's checkpoint storage: an in-memory [`CheckpointStore`] that rank 0's
//! worker writes through the real checkpoint path (`NodeEnv::checkpoints`, called inline), in
//! the production safetensors encoding, with a fault hook: a `checkpoint_fail` fault arms it and
//! the next write fails as a storage error would (the write breaks off; nothing of it becomes
//! visible). Like the file store, it keeps a checkpoint whole or not at all, and it keeps the
//! newest [`KEEP`] checkpoints.
//!
//! The checker reads it back: [`SimCheckpoints::read`] decodes a stored checkpoint and checks
//! that it holds the step it claims, every parameter of the model and optimizer state, and
//! returns the parameters' checksum to compare with the replicas' at that step.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Mutex, PoisonError};

use rtx_supervisor::checkpoint::CheckpointStore;
use rtx_supervisor::parameter_checksum;
use rtx_tensor::checkpoint::{decode_tensors, encode_tensors, OPTIM_PREFIX};
use rtx_tensor::{Module, Tensor};

use crate::job::{build_model, JobShape};

/// Checkpoints kept (older ones are dropped, like `keep_checkpoints`).
pub(crate) const KEEP: usize = 3;

/// In-memory checkpoint storage shared by every node of a simulated cluster.
#[derive(Default)]
pub struct SimCheckpoints(Mutex<StoreState>);

#[derive(Default)]
struct StoreState {
    /// Encoded checkpoints by step.
    stored: BTreeMap<u64, Vec<u8>>,
    /// Writes that will fail.
    armed: u32,
    /// Test-only: a failed write also truncates the newest stored checkpoint.
    torn: bool,
    written: u64,
    failed: u64,
}

impl SimCheckpoints {
    /// Test-only: from now on a failed write also truncates the newest stored checkpoint, as a
    /// store that writes in place would.
    pub fn plant_torn_writes(&self) {
        self.lock().torn = true;
    }

    /// Makes the next write fail.
    pub fn arm_failure(&self) {
        self.lock().armed += 1;
    }

    /// The newest stored checkpoint: its step and bytes.
    pub fn newest(&self) -> Option<(u64, Vec<u8>)> {
        self.lock().stored.last_key_value().map(|(s, b)| (*s, b.clone()))
    }

    /// The stored checkpoint of `step`.
    pub fn get(&self, step: u64) -> Option<Vec<u8>> {
        self.lock().stored.get(&step).cloned()
    }

    /// How many stored checkpoints are newer than `step`.
    pub fn newer_than(&self, step: u64) -> usize {
        self.lock().stored.range(step + 1..).count()
    }

    /// Every stored checkpoint, oldest first.
    pub fn all(&self) -> Vec<(u64, Vec<u8>)> {
        self.lock().stored.iter().map(|(s, b)| (*s, b.clone())).collect()
    }

    /// Writes that succeeded and that failed.
    pub fn counts(&self) -> (u64, u64) {
        let state = self.lock();
        (state.written, state.failed)
    }

    /// Decodes the checkpoint `bytes` of `step` for a job of `shape`: it must name that step, hold
    /// every model parameter with its shape and some optimizer state. Returns the parameters'
    /// checksum (as `parameter_checksum` computes it on a replica).
    pub fn read(shape: &JobShape, step: u64, bytes: &[u8]) -> Result<u64, String> {
        let origin = format!("sim://checkpoints/step-{step:08}");
        let (tensors, meta) = decode_tensors(bytes, Path::new(&origin)).map_err(|e| e.to_string())?;
        if meta.get("step").map(String::as_str) != Some(step.to_string().as_str()) {
            return Err(format!("{origin} names step {:?}", meta.get("step")));
        }
        let by_name: BTreeMap<&str, &Tensor> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        if !by_name.keys().any(|n| n.starts_with(OPTIM_PREFIX)) {
            return Err(format!("{origin} holds no optimizer state"));
        }
        let model = build_model(shape)?;
        for (name, p) in model.named_parameters() {
            let t = by_name.get(name.as_str()).ok_or_else(|| format!("{origin} lacks parameter {name}"))?;
            if t.shape() != p.shape() {
                return Err(format!("{origin}: {name} has shape {:?}, the model {:?}", t.shape(), p.shape()));
            }
            p.copy_from_(t).map_err(|e| e.to_string())?;
        }
        parameter_checksum(&model).map_err(|e| e.to_string())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, StoreState> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl CheckpointStore for SimCheckpoints {
    fn store(&self, step: u64, tensors: &[(String, Tensor)], metadata: &BTreeMap<String, String>) -> Result<String, String> {
        let bytes = encode_tensors(tensors, metadata).map_err(|e| e.to_string())?;
        let mut state = self.lock();
        if state.armed > 0 {
            state.armed -= 1;
            state.failed += 1;
            if state.torn {
                if let Some(mut newest) = state.stored.last_entry() {
                    let half = newest.get().len() / 2;
                    newest.get_mut().truncate(half);
                }
            }
            return Err(format!("simulated storage failure: the write of step {step} broke off after {} of {} bytes", bytes.len() / 2, bytes.len()));
        }
        state.written += 1;
        state.stored.insert(step, bytes);
        while state.stored.len() > KEEP {
            state.stored.pop_first();
        }
        Ok(format!("sim://checkpoints/step-{step:08}"))
    }

    fn load(&self, location: &str) -> Result<rtx_supervisor::checkpoint::StoredCheckpoint, String> {
        let step: u64 = location.strip_prefix("sim://checkpoints/step-").and_then(|s| s.parse().ok()).ok_or_else(|| format!("{location} is not a simulated checkpoint"))?;
        let bytes = self.get(step).ok_or_else(|| format!("{location}: the store no longer holds it"))?;
        decode_tensors(&bytes, Path::new(location)).map_err(|e| e.to_string())
    }
}
