//! Sharded checkpoints of a mesh: each `(pp, tp)` slot's state saved as one shard file of the
//! format in [`rtx_tensor::checkpoint::sharded`], and any member of any other mesh shape loading
//! its part of it.
//!
//! A shard holds the member's parameters under their full model names (`blocks.5.mlp.fc.weight`,
//! local shapes) and its optimizer state under the names of the single-file checkpoint
//! (`optim.<param>.exp_avg`, `optim.<param>.exp_avg_sq`, and the 0-d f64 `optim.<param>.step`), so
//! a tensor-parallel slice of a moment sits exactly where its parameter's slice does and a
//! consolidated checkpoint is the file [`rtx_tensor::checkpoint::load`] reads. Only the member of
//! data-parallel rank 0 writes a slot's shard (the replicas are equal); tensors the slots share
//! (layer norms over tp, the tied embedding on the first and last stage) are kept once by the
//! index writer after it checked that the copies agree bit for bit.
//!
//! [`MeshEngine::save_sharded`] is collective over the whole mesh: the writers write their shards
//! in parallel, every member learns through the mesh's groups whether all succeeded, then the
//! member at `(0, 0, 0)` rebuilds the manifests from the files ([`ShardManifest::read`]; the
//! directory is shared) and writes `index.json`, and every member learns whether that succeeded.
//! So the call returns `Ok` on every member exactly when the checkpoint is complete.
//! [`load_shard`] (and [`MeshEngine::load_sharded`]) reads a member's part at its own `(tp rank,
//! tp size)`: parameters and optimizer state are element-wise, so a slice cut at another tp size
//! is the same numbers, and training continues as if it had never stopped (up to the summation
//! order of the new shape).

use std::path::Path;

use rtx_tensor::checkpoint::sharded::{Cut, Index, IndexBuilder, ModelLayout, ShardManifest, ShardWriter, ShardedCheckpoint};
use rtx_tensor::checkpoint::{file_metadata, CheckpointMeta, OPTIM_PREFIX};
use rtx_tensor::nn::Module;
use rtx_tensor::{Optimizer, Tensor};

use crate::error::{Error, Result};
use crate::mesh::{Coord, MeshShape};
use crate::pipeline::engine::MeshEngine;
use crate::pipeline::stage::StageModule;

/// The label of the shard of slot `(pp, tp)`: `pp1-tp0` (file `shard-pp1-tp0.safetensors`).
pub fn shard_label(pp: usize, tp: usize) -> String {
    format!("pp{pp}-tp{tp}")
}

/// A member's state under the names a checkpoint uses: its parameters (full names, local shapes),
/// then its optimizer's state with the [`OPTIM_PREFIX`].
pub fn named_state<M: Module + ?Sized, O: Optimizer + ?Sized>(part: &M, optimizer: &O) -> Result<Vec<(String, Tensor)>> {
    let mut named = part.named_parameters();
    for (name, t) in optimizer.state_tensors()? {
        named.push((format!("{OPTIM_PREFIX}{name}"), t));
    }
    Ok(named)
}

/// Writes the shard of the member at `coord` (tp size `tp_size`) to `dir`: its [`named_state`],
/// each tensor with the part of the full tensor `layout` says it is.
pub fn write_shard<M: Module + ?Sized, O: Optimizer + ?Sized>(dir: &Path, coord: Coord, tp_size: usize, layout: &ModelLayout, part: &M, optimizer: &O) -> Result<ShardManifest> {
    let named = named_state(part, optimizer)?;
    let cut = Cut::new(layout, coord.tp, tp_size, 0..0, 0);
    let parts = cut.local_parts(&named)?;
    Ok(ShardWriter::write(dir, &shard_label(coord.pp, coord.tp), &parts)?)
}

/// Loads tp rank `tp_rank` of `tp_size`'s part of `ckpt` (saved at any mesh shape) into `part`
/// and `optimizer`: every parameter and every optimizer state tensor must be in the checkpoint
/// with the shape of this member's slice, and the optimizer of the kind saved. Everything is read
/// and checked before anything changes; the learning rate saved is restored too. Returns the step
/// the checkpoint was taken after.
pub fn load_shard<M: Module + ?Sized, O: Optimizer + ?Sized>(ckpt: &ShardedCheckpoint, layout: &ModelLayout, tp_rank: usize, tp_size: usize, part: &M, optimizer: &mut O) -> Result<u64> {
    let _span = tracing::info_span!("mesh_checkpoint_load", step = ckpt.step(), tp_rank, tp_size).entered();
    let cut = Cut::new(layout, tp_rank, tp_size, 0..0, 0);
    let mismatch = |reason: String| Error::CheckpointMismatch { step: ckpt.step(), reason };
    let info: serde_json::Value = match ckpt.metadata().get("optimizer") {
        Some(s) => serde_json::from_str(s).map_err(|e| mismatch(format!("metadata optimizer is not JSON: {e}")))?,
        None => return Err(mismatch("the checkpoint has no optimizer state".into())),
    };
    let kind = info.get("kind").and_then(|k| k.as_str()).unwrap_or("");
    if kind != optimizer.kind() {
        return Err(mismatch(format!("optimizer state is for {kind:?}, this member trains with {:?}", optimizer.kind())));
    }
    let lr = info.get("lr").and_then(serde_json::Value::as_f64).ok_or_else(|| mismatch("metadata optimizer has no lr".into()))?;
    let params = part.named_parameters();
    let values = ckpt.read_like(&params, &cut)?;
    let state: Vec<(String, Tensor)> = optimizer.state_tensors()?.into_iter().map(|(n, t)| (format!("{OPTIM_PREFIX}{n}"), t)).collect();
    let state = ckpt.read_like(&state, &cut)?;
    let state: Vec<(String, Tensor)> = state.into_iter().map(|(n, t)| (n.strip_prefix(OPTIM_PREFIX).map_or_else(|| n.clone(), str::to_string), t)).collect();
    for ((_, p), (_, v)) in params.iter().zip(&values) {
        p.copy_from_(v)?;
    }
    optimizer.load_state(&state)?;
    optimizer.set_lr(lr);
    Ok(ckpt.step())
}

/// Checks that `ckpt` holds exactly the parameters `names` (the full model's), so a checkpoint of
/// another model (more layers, another head) is refused before any member loads its part.
pub fn check_model_names(ckpt: &ShardedCheckpoint, names: &[String]) -> Result<()> {
    let saved: std::collections::BTreeSet<&str> = ckpt.names().into_iter().filter(|n| !n.starts_with(OPTIM_PREFIX)).collect();
    let wanted: std::collections::BTreeSet<&str> = names.iter().map(String::as_str).collect();
    if let Some(missing) = wanted.difference(&saved).next() {
        return Err(Error::CheckpointMismatch { step: ckpt.step(), reason: format!("the model's parameter {missing} is not in the checkpoint") });
    }
    if let Some(extra) = saved.difference(&wanted).next() {
        return Err(Error::CheckpointMismatch { step: ckpt.step(), reason: format!("the checkpoint's tensor {extra} is not a parameter of the model") });
    }
    Ok(())
}

impl<S: StageModule, O: Optimizer> MeshEngine<S, O> {
    /// Saves the mesh's state after step `step` as a sharded checkpoint in `dir` (see the module
    /// doc). Collective: every member of the mesh calls it, on its compute thread. Returns the
    /// index on the member that wrote it, `None` on the others; an error on every member when any
    /// shard or the index could not be written (then `dir` has no index and is never loaded).
    pub fn save_sharded(&self, dir: &Path, step: u64, layout: &ModelLayout, meta: &CheckpointMeta) -> Result<Option<Index>> {
        let coord = self.coord();
        let shape = self.shape();
        let _span = tracing::info_span!("mesh_checkpoint_save", step, %coord).entered();
        let written = if coord.dp == 0 { write_shard(dir, coord, shape.tp, layout, self.part(), self.optimizer()).map(|_| ()) } else { Ok(()) };
        let failed = self.count_over_mesh(written.is_err())?;
        let incomplete = |failed: usize, what: &'static str| Error::CheckpointIncomplete { dir: dir.display().to_string(), step, failed, what };
        match written {
            Err(e) => return Err(e),
            Ok(()) if failed > 0 => return Err(incomplete(failed, "shard writers")),
            Ok(()) => {}
        }
        let indexed = if coord == (Coord { dp: 0, pp: 0, tp: 0 }) { write_mesh_index(dir, step, shape, &meta_with_step(meta, step), self.optimizer()).map(Some) } else { Ok(None) };
        let failed = self.count_over_mesh(indexed.is_err())?;
        match indexed {
            Err(e) => Err(e),
            Ok(_) if failed > 0 => Err(incomplete(failed, "index writers")),
            Ok(index) => Ok(index),
        }
    }

    /// Loads this member's part of `ckpt` (saved at any mesh shape) into its part of the model and
    /// its optimizer (see [`load_shard`]); returns the step it was taken after. Not collective.
    pub fn load_sharded(&mut self, ckpt: &ShardedCheckpoint, layout: &ModelLayout) -> Result<u64> {
        let (tp_rank, tp_size) = (self.coord().tp, self.shape().tp);
        let (part, optimizer) = self.part_and_optimizer_mut();
        load_shard(ckpt, layout, tp_rank, tp_size, part, optimizer)
    }

    /// How many members of the whole mesh pass `failed = true`: a sum over the tp, then the pp,
    /// then the dp group, which covers every member once.
    fn count_over_mesh(&self, failed: bool) -> Result<usize> {
        let mut count = [f64::from(u8::from(failed))];
        let (dp, pp, tp) = self.groups();
        tp.all_reduce_sum(&mut count)?;
        pp.all_reduce_sum(&mut count)?;
        dp.all_reduce_sum(&mut count)?;
        Ok(count[0].round() as usize)
    }
}

/// `meta` with `step` as its step.
fn meta_with_step(meta: &CheckpointMeta, step: u64) -> CheckpointMeta {
    CheckpointMeta { step, ..meta.clone() }
}

/// Rebuilds every slot's manifest from the files in `dir` and writes the index.
fn write_mesh_index<O: Optimizer>(dir: &Path, step: u64, shape: MeshShape, meta: &CheckpointMeta, optimizer: &O) -> Result<Index> {
    let mut builder = IndexBuilder::new();
    for pp in 0..shape.pp {
        for tp in 0..shape.tp {
            builder.add(ShardManifest::read(dir, &shard_label(pp, tp))?);
        }
    }
    let metadata = file_metadata(meta, Some(optimizer as &dyn Optimizer))?;
    Ok(builder.write(dir, step, &[("dp", shape.dp), ("pp", shape.pp), ("tp", shape.tp)], &metadata)?)
}
