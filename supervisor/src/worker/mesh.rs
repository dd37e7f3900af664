//! The worker's generation of a model-parallel job: the member takes its place `(dp, pp, tp)` in
//! the generation's mesh, builds its part of the model through the job's [`MeshSpec`], takes its
//! slot's state from where the supervisor said (its own copy, another member holding the same slot,
//! or the initial parameters), then trains with a [`MeshEngine`] on a compute thread of its own
//! (tensor-parallel layers communicate inside forward and backward, which must not run on a
//! runtime thread). Between generations the member keeps its slot's state as one flat vector
//! ([`MeshReplica`]): parameters in visit order, then the optimizer state in its order. The part
//! is rebuilt every generation, because its tensor-parallel layers hold the old generation's group.
//! The set-up above is this module's; the steps run in the worker's one step loop (`steps.rs`)
//! through `MeshSteps`, the mesh's adapter to the [`Engine`] contract (the step, its sharded save
//! and the verification checksum on the compute thread; reports and time accounting in the loop).
//!
//! Sharded checkpoints: every `checkpoint_every` steps, and after the last step of the run (or of
//! a `--steps` part of it), the whole mesh saves its state into `<checkpoint dir>/step-NNNNNNNN/`
//! (one shard per `(pp, tp)` slot, written by the slot's dp-rank-0 member, then `index.json`; see
//! [`rtx_pipelines::pipeline::MeshEngine::save_sharded`]) on the compute thread, after the step;
//! the member at `(0, 0, 0)` reports it to the supervisor. A member whose source is
//! [`ShardSource::Checkpoint`] (no surviving holder, or `rtx launch --resume`) loads its part of that
//! checkpoint, whatever mesh shape saved it.
//!
//! Re-partition: when the supervisor starts a mesh of another `(pp, tp)` than the job's (the world
//! no longer fills one replica, or it fills the job's mesh again), the member builds its part for
//! that shape (the job's [`MeshSpec::build`] re-balances the layers over its stages) and every
//! member's source is the newest sharded checkpoint, loaded at the new shape.

use std::path::PathBuf;
use std::sync::{Arc, PoisonError};

use rtx_actors::DataShard;
use rtx_collectives::{CommConfig, Communicator, Endpoint, WORLD_GROUP_ID};
use rtx_pipelines::pipeline::{load_shard, DynOptimizer, MeshEngine};
use rtx_pipelines::tp::TpGroup;
use rtx_pipelines::{ComputeDriver, Coord, DataShare, Duties, Engine, Mesh, MeshGroups, MeshShape, RuntimeDriver, StepReport};
use rtx_tensor::checkpoint::sharded::ShardedCheckpoint;
use rtx_tensor::checkpoint::CheckpointMeta;
use rtx_tensor::{DType, FloatSlice, Module, Optimizer, Tensor};
use tokio::sync::mpsc::Receiver;

use super::{connect_generation, connected_name, Bound, Generation, Replica, WorkerCtx};
use crate::checkpoint::sharded_path_for;
use crate::error::{Result, SupervisorError};
use crate::job::{BoxedStage, MeshSpec, StageRequest, TrainJob};
use crate::protocol::{MeshHeld, MeshStart, ShardSource, ToSupervisor, ToWorker};

/// The state of the mesh slot a member trained last.
pub(super) struct MeshReplica {
    slots: u32,
    tp: u32,
    slot: u32,
    step: u64,
    /// Parameters, then optimizer state, as f32.
    state: Vec<f32>,
}

impl MeshReplica {
    /// What the member tells the supervisor it holds.
    pub(super) fn held(&self) -> MeshHeld {
        MeshHeld { slots: self.slots, tp: self.tp, slot: self.slot, step: self.step }
    }

    /// A checksum of the state's bits (the final report).
    pub(super) fn checksum(&self) -> u64 {
        state_checksum(&self.state)
    }
}

/// FNV-1a over the bits of a slot's flat state (parameters, then optimizer state).
fn state_checksum(state: &[f32]) -> u64 {
    state.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| (h ^ u64::from(v.to_bits())).wrapping_mul(0x0100_0000_01b3))
}

/// [`state_checksum`] of [`flat_state`]`(part, optimizer)` without building the flat vector:
/// each parameter is hashed where it lies (a contiguous f32 tensor is read in place), the
/// optimizer's state tensors one by one (`Optimizer::state_tensors` is the only read access the
/// optimizers give), each element as the f32 that `flat_state` would hold.
fn slot_checksum<M: Module + ?Sized, O: Optimizer>(part: &M, optimizer: &O) -> Result<u64> {
    const PRIME: u64 = 0x0100_0000_01b3;
    let fold = |hash: u64, t: &Tensor| -> Result<u64> {
        Ok(match t.dtype() {
            // Integer tensors: what `to_f32_vec` makes of them.
            DType::U32 | DType::I64 => t.to_f32_vec()?.iter().fold(hash, |h, v| (h ^ u64::from(v.to_bits())).wrapping_mul(PRIME)),
            _ => t.with_float_slice(|values| match values {
                FloatSlice::F32(x) => x.iter().fold(hash, |h, v| (h ^ u64::from(v.to_bits())).wrapping_mul(PRIME)),
                FloatSlice::F64(x) => x.iter().fold(hash, |h, &v| (h ^ u64::from((v as f32).to_bits())).wrapping_mul(PRIME)),
            })?,
        })
    };
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for (_, p) in part.named_parameters() {
        hash = fold(hash, &p)?;
    }
    for (_, t) in optimizer.state_tensors()? {
        hash = fold(hash, &t)?;
    }
    Ok(hash)
}

type MeshStepEngine = MeshEngine<BoxedStage, DynOptimizer>;

/// Trains one mesh generation. Returns the command that interrupted it, or `None` at the last step.
#[allow(clippy::too_many_arguments)]
pub(super) async fn run_mesh_generation<J: TrainJob>(
    ctx: &WorkerCtx,
    job: &Arc<J>,
    spec: &MeshSpec<J::Batch>,
    g: &Generation,
    start: &MeshStart,
    bound: Bound,
    replica: &mut Replica<J::Model, J::Optim>,
    shard: &mut DataShard<J>,
    cmds: &mut Receiver<ToWorker>,
) -> Result<Option<ToWorker>> {
    replica.rank = Some(g.rank);
    let (wire, network) = ctx.shared.abort.unless_superseded(g.generation, connect_generation(ctx, g, bound)).await?;
    tracing::info!(transport = connected_name(network.as_ref(), ctx.wire.is_some(), !g.host_of.is_empty()), "collectives connected");
    let endpoint = Endpoint::new(Arc::clone(&wire), CommConfig::default())?;
    let comm = endpoint.group(WORLD_GROUP_ID, (0..g.world).collect(), g.generation)?;
    ctx.shared.abort.set(comm.clone(), Arc::clone(&wire));
    let result = train(ctx, job, spec, g, start, &endpoint, &comm, replica, shard, cmds).await;
    ctx.shared.abort.clear();
    drop(comm);
    drop(endpoint);
    if let Some(network) = network {
        network.close_later();
    }
    result
}

#[allow(clippy::too_many_arguments)]
async fn train<J: TrainJob>(
    ctx: &WorkerCtx,
    job: &Arc<J>,
    spec: &MeshSpec<J::Batch>,
    g: &Generation,
    start: &MeshStart,
    endpoint: &Endpoint,
    comm: &Communicator,
    replica: &mut Replica<J::Model, J::Optim>,
    shard: &mut DataShard<J>,
    cmds: &mut Receiver<ToWorker>,
) -> Result<Option<ToWorker>> {
    let shape = MeshShape { dp: start.dp as usize, pp: start.pp as usize, tp: start.tp as usize };
    if (shape.pp, shape.tp) != (spec.pp, spec.tp) {
        // A re-partition: the world no longer fills the job's mesh; the part is built for this
        // shape (layers re-balanced over its stages) and loaded from the sharded checkpoint.
        tracing::warn!(%shape, job_pp = spec.pp, job_tp = spec.tp, "training a re-partitioned mesh");
    }
    let mesh = Mesh::new(shape, g.world).map_err(rtx_pipelines::Error::from)?;
    let groups = MeshGroups::new(endpoint, mesh, g.generation).map_err(rtx_pipelines::Error::from)?;
    let coord = groups.coord;
    let (slots, slot) = ((shape.pp * shape.tp) as u32, (coord.pp * shape.tp + coord.tp) as u32);
    let driver: Arc<dyn ComputeDriver> = match &ctx.compute {
        Some(driver) => Arc::clone(driver),
        None => Arc::new(RuntimeDriver::new(tokio::runtime::Handle::current())),
    };
    let tp = TpGroup::with_driver(groups.tp.clone(), Arc::clone(&driver)).into_handle();
    let (part, optimizer) = (spec.build)(&StageRequest { coord, shape, tp }).map_err(SupervisorError::Job)?;
    let mut optimizer = DynOptimizer(optimizer);

    // Serve the members that take their slot from this one, then take this member's own.
    let me = g.rank as u32;
    for (rank, source) in start.sources.iter().enumerate() {
        if *source == (ShardSource::Member { rank: me }) && rank != g.rank {
            let held = replica.mesh.as_ref().ok_or_else(|| SupervisorError::Job(format!("named the source of rank {rank}'s slot, but this member holds no slot state")))?;
            comm.send(&held.state, rank).await?;
        }
    }
    let source = start.sources.get(g.rank).cloned().ok_or_else(|| SupervisorError::Job(format!("no shard source for rank {}", g.rank)))?;
    match &source {
        ShardSource::Local => {
            let held = replica.mesh.as_ref().filter(|h| h.slots == slots && h.tp == shape.tp as u32 && h.slot == slot).ok_or_else(|| SupervisorError::Job(format!("told to keep slot {slot}, which this member does not hold")))?;
            install(&part, &mut optimizer, &held.state)?;
        }
        ShardSource::Member { rank } => {
            let mut state = vec![0f32; flat_state(&part, &optimizer)?.len()];
            comm.recv(&mut state, *rank as usize).await?;
            install(&part, &mut optimizer, &state)?;
        }
        ShardSource::Initial => {}
        ShardSource::Checkpoint { location, step } => {
            let ckpt = ShardedCheckpoint::open(std::path::Path::new(location)).map_err(rtx_pipelines::Error::from)?;
            let loaded = load_shard(&ckpt, &spec.layout, coord.tp, shape.tp, &part, &mut optimizer)?;
            if loaded != *step {
                return Err(SupervisorError::Job(format!("the sharded checkpoint {location} is of step {loaded}, the supervisor named step {step}")));
            }
            tracing::info!(%location, step, saved_mesh = ?ckpt.mesh(), %coord, "slot state loaded from the sharded checkpoint");
        }
    }
    // Nobody trains until every member holds its slot's state.
    comm.barrier().await?;
    replica.mesh = None;
    replica.completed = g.next_step.checked_sub(1);
    *ctx.shared.completed.lock().unwrap_or_else(PoisonError::into_inner) = replica.completed;
    tracing::info!(%coord, next_step = g.next_step, ?source, "mesh generation started");

    let engine: MeshStepEngine = MeshEngine::with_driver(part, optimizer, &groups, Arc::clone(&driver), spec.pipeline)?;
    let total = job.total_steps().min(g.stop_step);
    let steps: MeshSteps<'_, J> = MeshSteps { ctx, spec, replica, engine: Some(engine), driver, coord, shape, slots, slot, global: job.global_batch().max(1) as f64, checkpoint_dir: job.checkpoint_dir(), saved: None, checksum: None };
    super::steps::run(ctx, g, total, steps, shard, cmds).await
}

/// One mesh generation's engine behind the [`Engine`] contract: the member's [`MeshEngine`],
/// moved to a compute thread for each step and back, and what its steps need from the worker.
struct MeshSteps<'a, J: TrainJob> {
    ctx: &'a WorkerCtx,
    spec: &'a MeshSpec<J::Batch>,
    replica: &'a mut Replica<J::Model, J::Optim>,
    /// `None` only when a compute thread ended without handing the engine back.
    engine: Option<MeshStepEngine>,
    driver: Arc<dyn ComputeDriver>,
    coord: Coord,
    shape: MeshShape,
    slots: u32,
    slot: u32,
    global: f64,
    checkpoint_dir: Option<PathBuf>,
    /// The sharded checkpoint the last step wrote on its compute thread (folder, and whether this
    /// member wrote the index), for [`Engine::checkpoint`] to report.
    saved: Option<rtx_pipelines::Result<(PathBuf, bool)>>,
    /// The slot's checksum the last step took on its compute thread (verification steps).
    checksum: Option<Result<u64>>,
}

impl<J: TrainJob> Engine for MeshSteps<'_, J> {
    type Batch = J::Batch;
    type Error = SupervisorError;
    type Note = ToSupervisor;

    fn name(&self) -> &'static str {
        "mesh"
    }

    fn data_share(&self) -> DataShare {
        // Every member of a replica trains on the replica's share of the global batch.
        DataShare { rank: self.coord.dp, world: self.shape.dp }
    }

    fn restorable(&self) -> Option<u64> {
        self.replica.completed
    }

    async fn step(&mut self, step: u64, batch: J::Batch, duties: Duties) -> Result<StepReport> {
        let micro = (self.spec.split)(&batch, self.spec.pipeline.microbatches).map_err(SupervisorError::Job)?;
        let rows: usize = micro.iter().map(|m| m.rows()).sum();
        let scales: Vec<f64> = micro.iter().map(|m| m.rows() as f64 / self.global).collect();
        let mut engine = self.engine.take().ok_or_else(|| SupervisorError::Job("the mesh engine was lost with an earlier step's compute thread".into()))?;
        engine.optimizer_mut().set_lr((self.spec.lr)(step));
        // A sharded checkpoint after this step: every `checkpoint_every` steps and after the last.
        let save_dir = self.checkpoint_dir.as_ref().filter(|_| duties.checkpoint || duties.last).map(|dir| sharded_path_for(dir, step));
        let layout = self.spec.layout.clone();
        // The slot's checksum on verification steps: the supervisor compares it across the
        // slot's data-parallel replicas.
        let verify = duties.verify;
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let compute = self.driver.spawn(
            format!("rtx-mesh-step-{step}"),
            Box::new(move || {
                let result = engine.step(step, &micro, &scales);
                // Only after a step every member completed; a failed save leaves the step done.
                let saved = match (&result, &save_dir) {
                    (Ok(_), Some(dir)) => Some(engine.save_sharded(dir, step, &layout, &CheckpointMeta { step, ..CheckpointMeta::default() }).map(|index| (dir.clone(), index.is_some()))),
                    _ => None,
                };
                let checksum = match &result {
                    Ok(_) if verify => Some(slot_checksum(engine.part(), engine.optimizer())),
                    _ => None,
                };
                let _ = done_tx.send((engine, result, saved, checksum));
            }),
        );
        compute.await?;
        let (returned, result, saved, checksum) = done_rx.try_recv().map_err(|_| SupervisorError::Job("the compute thread of a mesh step ended without an answer".into()))?;
        self.engine = Some(returned);
        self.saved = saved;
        self.checksum = checksum;
        let out = result?;
        // The replica's first member counts its samples, so the supervisor's sum is the global batch.
        let samples = if self.coord.pp == 0 && self.coord.tp == 0 { rows as u64 } else { 0 };
        Ok(StepReport { loss: out.loss, samples })
    }

    async fn secure(&mut self, _step: u64) -> Result<()> {
        // Every collective precedes the optimizer: a completed step is held by the slot's holders.
        Ok(())
    }

    async fn keep(&mut self, step: u64, _duties: Duties) -> Result<()> {
        self.replica.completed = Some(step);
        Ok(())
    }

    fn checksum(&mut self) -> Result<Option<u64>> {
        self.checksum.take().transpose()
    }

    async fn checkpoint(&mut self, step: u64, _duties: Duties) -> Result<Vec<ToSupervisor>> {
        Ok(match self.saved.take() {
            // The member that wrote the index reports the complete checkpoint.
            Some(Ok((dir, true))) => {
                tracing::info!(step, dir = %dir.display(), "sharded checkpoint written");
                vec![ToSupervisor::Checkpointed { node: self.ctx.node, step, path: dir.display().to_string() }]
            }
            Some(Err(e)) if self.coord == (Coord { dp: 0, pp: 0, tp: 0 }) => {
                tracing::error!(step, error = %e, "sharded checkpoint failed; the previous one stays valid");
                vec![ToSupervisor::CheckpointFailed { node: self.ctx.node, step, reason: e.to_string() }]
            }
            _ => Vec::new(),
        })
    }

    async fn finish_run(&mut self, _total: u64) -> Result<Vec<ToSupervisor>> {
        // The last step's sharded checkpoint was written with it.
        Ok(Vec::new())
    }

    fn finish_generation(self) -> Result<()> {
        // The engine's optimizer steps last, so a failed step left the state of the last completed one.
        let Some(engine) = self.engine else { return Ok(()) };
        let (part, optimizer) = engine.into_parts();
        self.replica.mesh = match self.replica.completed {
            Some(step) => Some(MeshReplica { slots: self.slots, tp: self.shape.tp as u32, slot: self.slot, step, state: flat_state(&part, &optimizer)? }),
            None => None,
        };
        Ok(())
    }
}

/// A part's parameters (visit order) then its optimizer's state, as one f32 vector.
fn flat_state<M: Module + ?Sized, O: Optimizer>(part: &M, optimizer: &O) -> Result<Vec<f32>> {
    let mut flat = Vec::new();
    for (_, p) in part.named_parameters() {
        flat.extend(p.to_f32_vec()?);
    }
    for (_, t) in optimizer.state_tensors()? {
        flat.extend(t.to_f32_vec()?);
    }
    Ok(flat)
}

/// Installs a vector made by [`flat_state`] into a part of the same shape.
fn install<M: Module + ?Sized, O: Optimizer>(part: &M, optimizer: &mut O, flat: &[f32]) -> Result<()> {
    let mut offset = 0;
    let mut take = |n: usize, what: &str| -> Result<Vec<f32>> {
        let values = flat.get(offset..offset + n).ok_or_else(|| SupervisorError::Job(format!("slot state too short at {what}: {} values", flat.len())))?;
        offset += n;
        Ok(values.to_vec())
    };
    for (name, p) in part.named_parameters() {
        p.copy_from_(&Tensor::from_vec(take(p.numel(), &name)?, p.shape())?)?;
    }
    let mut state = Vec::new();
    for (name, t) in optimizer.state_tensors()? {
        let values = Tensor::from_vec(take(t.numel(), &name)?, t.shape())?.to_dtype(t.dtype())?;
        state.push((name, values));
    }
    optimizer.load_state(&state)?;
    if offset != flat.len() {
        return Err(SupervisorError::Job(format!("slot state has {} values, the part and optimizer {offset}", flat.len())));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtx_tensor::nn::{Activation, Mlp};
    use rtx_tensor::optim::{AdamW, AdamWConfig};
    use rtx_tensor::Generator;

    /// The verification checksum hashed in place equals the checksum of the flat slot state it
    /// replaced (parameters, AdamW moments and its f64 step counters), before and after a step.
    #[test]
    fn the_slot_checksum_in_place_equals_the_flat_states() {
        let part = Mlp::new(&[5, 7, 3], Activation::Relu, rtx_tensor::DType::F32, &mut Generator::new(3)).expect("mlp");
        let mut optimizer = AdamW::new(part.named_parameters(), AdamWConfig::default()).expect("adamw");
        let before = state_checksum(&flat_state(&part, &optimizer).expect("flat"));
        assert_eq!(slot_checksum(&part, &optimizer).expect("checksum"), before);
        for (_, p) in part.named_parameters() {
            p.set_grad(Some(p.mul_scalar(0.5).expect("grad").detach())).expect("grad");
        }
        optimizer.step().expect("step");
        let after = state_checksum(&flat_state(&part, &optimizer).expect("flat"));
        assert_ne!(after, before);
        assert_eq!(slot_checksum(&part, &optimizer).expect("checksum"), after);
    }
}
