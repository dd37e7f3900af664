//! A ZeRO-3 / FSDP generation of a GPT job ([`crate::TrainJob::fsdp`]): the worker drives
//! [`FsdpGpt`] instead of the data-parallel engine, and keeps the job's state between steps only
//! as unit segments ([`crate::zero3`]) with buddy copies. The generation's set-up is here; its steps
//! run in the worker's one step loop (`steps.rs`) through `FsdpSteps`, ZeRO-3's adapter to the
//! [`Engine`] contract.
//!
//! # Where a generation's state comes from
//!
//! - **Segments** (`StateSource::Zero1Segments`, the supervisor's plan when the members' copies
//!   cover every old segment): at the old world size, new rank `r` imports old segment `r`,
//!   which it holds itself or receives point to point from its holder (the old rank's buddy when
//!   the old rank is gone); at another world size every old segment is broadcast by its holder
//!   and each rank cuts its new range out of them ([`zero3::Cutter`]). No rank rebuilds the
//!   whole state.
//! - **A whole state** (the first generation, a `--resume` checkpoint, a recovery checkpoint when
//!   a rank and its buddy were lost together): broadcast from the source rank as in plain data
//!   parallelism, then cut by the engine (each rank keeps its segments of the parameters and of
//!   the full optimizer state).
//!
//! # After every step
//!
//! [`FsdpGpt::step`] returns with the step's segments updated; only then is this rank's
//! [`zero3::UnitState`] encoded and exchanged with its buddy ([`BuddyCopies::exchange_step`]), and
//! the step reported done: a committed step is held twice, so a lost rank costs at most the step
//! in flight.
//!
//! # Checkpoints and the end
//!
//! Decision: a ZeRO-3 checkpoint is the **whole** state in the single-file form every job writes
//! (gathered by every rank at a checkpoint step; rank 0 writes it). Pros: one format for every
//! sharding and world size, so a ZeRO-3 run resumes at any world size, as ZeRO-0/1/2, or on one
//! process (`checkpoint::load`), with nothing new to read. Cons: a checkpoint step holds the
//! whole state on every rank for a moment (a replica's memory); a sharded format (one file per
//! rank's unit segments) would avoid it and is left for models that do not fit one rank. At the
//! end of the run the whole state is gathered once more, so every rank's model holds the final
//! parameters for the checksum and rank 0's evaluation.

use std::sync::{Arc, PoisonError};
use std::time::Duration;

use rtx_actors::DataShard;
use rtx_collectives::Communicator;
use rtx_pipelines::{gpt_unit_of, DataShare, Duties, Engine, FsdpConfig, FsdpGpt, StepReport};
use rtx_tensor::{Module, Optimizer, Tensor};
use tokio::sync::mpsc::Receiver;
use tokio::time::Instant;

use super::{internal, Exec, Generation, Replica, SegmentSource, WorkerCtx};
use crate::checkpoint::CheckpointWriter;
use crate::error::{Result, SupervisorError};
use crate::job::{FsdpSpec, TrainJob};
use crate::protocol::{ToSupervisor, ToWorker};
use crate::state::{self, NamedTensors};
use crate::zero1::BuddyCopies;
use crate::zero3::{self, UnitState};

/// Trains one ZeRO-3 generation (see the module doc). Returns the command that interrupted it,
/// or `None` when the last step is done.
#[allow(clippy::too_many_arguments)]
pub(super) async fn train<J: TrainJob>(
    ctx: &WorkerCtx,
    job: &Arc<J>,
    g: &Generation,
    comm: &Communicator,
    replica: &mut Replica<J::Model, J::Optim>,
    shard: &mut DataShard<J>,
    writer: &mut CheckpointWriter,
    cmds: &mut Receiver<ToWorker>,
) -> Result<Option<ToWorker>> {
    if ctx.exec == Exec::Task {
        return Err(SupervisorError::Job("ZeRO-3 runs FsdpGpt's communication thread, which the inline mode (the simulator's Exec::Task) does not have".into()));
    }
    let spec = job.fsdp().ok_or_else(|| SupervisorError::Job("sharding = \"zero3\" trains a GPT through FSDP, and this job has no FSDP form (it is not a GPT)".into()))?;
    // The full-form optimizer state of a fresh optimizer: a replica's worth (8Ψ bytes for AdamW),
    // so made when needed (a whole-state start, a gather) and not kept between steps, unlike the
    // data-parallel path's cached template.
    let template = state::full_template(replica_model(&replica.model)?, |slices| job.build_optimizer(slices))?;
    let optimizer_full_bytes: usize = template.iter().map(|(_, t)| t.numel() * t.dtype().size_in_bytes()).sum();
    replica.template = None;
    let gpt = (spec.build)().map_err(SupervisorError::Job)?;
    // The job's clipping bound is the engine's: by the model's norm over every rank's segments.
    let config = FsdpConfig { collective_timeout: Duration::from_secs(60), grad_clip: job.dp_config().grad_clip, comm_threads: ctx.channels, ..FsdpConfig::default() };
    let engine_comm = comm.clone();
    let engine = match &g.segments {
        Some(s) => {
            drop(template);
            let mut engine = FsdpGpt::new(gpt, config, move || Ok(engine_comm), |slices: &[rtx_pipelines::ParamSlice]| job.build_optimizer(slices).map_err(|reason| rtx_tensor::Error::InvalidArgument { op: "build_optimizer", reason }))?;
            let mine = recover_unit_state(comm, &replica.zero1, s, &engine.unit_numels(), g.world, g.rank).await?;
            if mine.step != s.step {
                return Err(SupervisorError::Job(format!("recovered a ZeRO-3 state of step {} where step {} was planned", mine.step, s.step)));
            }
            let local = engine.optimizer().state_tensors()?;
            let state = mine.into_shard(engine.param_shard().slices(), &local, gpt_unit_of)?;
            engine.import_shard(state)?;
            engine
        }
        None => {
            let full = sync_whole_state(ctx, g, comm, replica, &template).await?;
            drop(template);
            let params = replica.model.as_ref().ok_or_else(internal)?.named_parameters();
            install_by_name(&gpt.named_parameters(), &params)?;
            let make_optimizer = |slices: &[rtx_pipelines::ParamSlice]| {
                let mut optimizer = job.build_optimizer(slices).map_err(|reason| rtx_tensor::Error::InvalidArgument { op: "build_optimizer", reason })?;
                let local = optimizer.state_tensors()?;
                let mine = state::slice_full_state(&full, &local, slices).map_err(|e| rtx_tensor::Error::InvalidArgument { op: "optimizer state", reason: e.to_string() })?;
                optimizer.load_state(&mine)?;
                Ok(optimizer)
            };
            FsdpGpt::new(gpt, config, move || Ok(engine_comm), make_optimizer)?
        }
    };
    tracing::info!(next_step = g.next_step, source = g.source, from_segments = g.segments.is_some(), sharding = "zero3", "generation started");

    let total = job.total_steps().min(g.stop_step);
    let steps = FsdpSteps { ctx, job: job.as_ref(), spec, g, comm, replica, writer, engine, optimizer_full_bytes, memory_logged: false, exchanged: (Duration::ZERO, 0) };
    super::steps::run(ctx, g, total, steps, shard, cmds).await
}

/// One ZeRO-3 generation's engine behind the [`Engine`] contract: [`FsdpGpt`] and what its steps
/// need from the worker (see the module doc for what is specific to ZeRO-3).
struct FsdpSteps<'a, J: TrainJob> {
    ctx: &'a WorkerCtx,
    job: &'a J,
    spec: FsdpSpec<J::Batch>,
    g: &'a Generation,
    comm: &'a Communicator,
    replica: &'a mut Replica<J::Model, J::Optim>,
    writer: &'a mut CheckpointWriter,
    engine: FsdpGpt<J::Optim>,
    /// The full-form optimizer state's bytes (the memory log's comparison).
    optimizer_full_bytes: usize,
    memory_logged: bool,
    /// Time spent exchanging segment states with the buddies, and the number of exchanges.
    exchanged: (Duration, u32),
}

impl<J: TrainJob> Engine for FsdpSteps<'_, J> {
    type Batch = J::Batch;
    type Error = SupervisorError;
    type Note = ToSupervisor;

    fn name(&self) -> &'static str {
        "zero3"
    }

    fn data_share(&self) -> DataShare {
        DataShare { rank: self.g.rank, world: self.g.world }
    }

    fn restorable(&self) -> Option<u64> {
        self.replica.completed
    }

    async fn step(&mut self, step: u64, batch: J::Batch, _duties: Duties) -> Result<StepReport> {
        let (ids, targets, rows) = (self.spec.tokens)(&batch).map_err(SupervisorError::Job)?;
        self.job.set_lr(self.engine.optimizer_mut(), step);
        let mut rng = (self.spec.rng)(step, self.g.rank);
        // Blocking: this is the worker's own thread (Exec::Thread), and the collectives run on
        // the engine's communication thread.
        let stats = self.engine.step(&ids, &targets, &mut rng)?;
        Ok(StepReport { loss: stats.loss, samples: rows as u64 })
    }

    async fn secure(&mut self, step: u64) -> Result<()> {
        // The step is restorable (and reported done) once this rank's segments are held by its
        // buddy too.
        let started = Instant::now();
        self.replica.zero1.drop_previous();
        let shard = self.engine.param_shard();
        let own = zero3::encode(&UnitState::from_shard(step, &shard.export()?, shard.slices(), gpt_unit_of)?);
        self.replica.zero1.exchange_step(self.comm, self.g.generation, step, own).await?;
        self.exchanged.0 += started.elapsed();
        self.exchanged.1 += 1;
        Ok(())
    }

    async fn keep(&mut self, _step: u64, _duties: Duties) -> Result<()> {
        // The buddy copies are the restorable point; only the first step's memory is logged here.
        if !self.memory_logged {
            log_memory(&self.engine, self.optimizer_full_bytes, self.g.world, &self.replica.zero1)?;
            self.memory_logged = true;
        }
        Ok(())
    }

    fn checksum(&mut self) -> Result<Option<u64>> {
        // No rank holds a replica's parameters between steps: nothing to compare.
        Ok(None)
    }

    async fn checkpoint(&mut self, step: u64, duties: Duties) -> Result<Vec<ToSupervisor>> {
        // Every rank takes part in the gather (a rank-independent condition); rank 0 writes. The
        // last step's checkpoint is `finish_run`'s.
        if !duties.checkpoint || duties.last {
            return Ok(Vec::new());
        }
        let template = state::full_template(replica_model(&self.replica.model)?, |slices| self.job.build_optimizer(slices))?;
        let (params, full) = gather_whole_state(&mut self.engine, self.comm, &template).await?;
        drop(template);
        if self.g.rank != 0 || !self.writer.enabled() {
            return Ok(Vec::new());
        }
        // The replica's own model keeps the state it reports; the checkpoint gets a copy.
        let written = self.job.build_model().map_err(SupervisorError::Job)?;
        install_by_name(&written.named_parameters(), &params)?;
        Ok(self.writer.write(step, &written, full, self.engine.optimizer(), self.ctx.supervisor.clone(), self.ctx.node)?.into_iter().collect())
    }

    async fn finish_run(&mut self, total: u64) -> Result<Vec<ToSupervisor>> {
        // Every rank gathers the final state: its model then holds the run's parameters (the
        // replicas' checksum, rank 0's evaluation), and rank 0 checkpoints it.
        let template = state::full_template(replica_model(&self.replica.model)?, |slices| self.job.build_optimizer(slices))?;
        let (params, full) = gather_whole_state(&mut self.engine, self.comm, &template).await?;
        drop(template);
        install_by_name(&self.replica.model.as_ref().ok_or_else(internal)?.named_parameters(), &params)?;
        self.replica.optimizer_state = Some(full);
        self.replica.snapshot_params = None;
        self.replica.completed = total.checked_sub(1);
        *self.ctx.shared.completed.lock().unwrap_or_else(PoisonError::into_inner) = self.replica.completed;
        let already = self.ctx.checkpoint_every > 0 && total % self.ctx.checkpoint_every == 0;
        if self.g.rank != 0 || total <= self.g.next_step || !self.writer.enabled() || already {
            return Ok(Vec::new());
        }
        let model = self.replica.model.as_ref().ok_or_else(internal)?;
        let full = self.replica.optimizer_state.clone().ok_or_else(internal)?;
        Ok(self.writer.write(total - 1, model, full, self.engine.optimizer(), self.ctx.supervisor.clone(), self.ctx.node)?.into_iter().collect())
    }

    fn finish_generation(self) -> Result<()> {
        if self.exchanged.1 > 0 {
            tracing::info!(exchanges = self.exchanged.1, mean_ms = self.exchanged.0.as_secs_f64() * 1e3 / f64::from(self.exchanged.1), "zero3 buddy exchanges");
        }
        Ok(())
    }
}

/// The whole state of the generation's source (parameters into the replica's model, and the full
/// optimizer state), as plain data parallelism syncs it; recorded in `replica` as the state of
/// step `next_step - 1`, which this member then holds whole.
async fn sync_whole_state<M: Module, O>(ctx: &WorkerCtx, g: &Generation, comm: &Communicator, replica: &mut Replica<M, O>, template: &[(String, Tensor)]) -> Result<NamedTensors> {
    let params = replica.model.as_ref().ok_or_else(internal)?.named_state();
    let (snapshot_params, optimizer_state) = (replica.snapshot_params.as_deref(), replica.optimizer_state.as_deref());
    let flat = state::broadcast_parameters(comm, g.source, &params, snapshot_params).await?;
    let full = state::broadcast_full_state(comm, g.source, optimizer_state, template).await?;
    // Nobody moves on until every member holds the state (see `train` in the parent module).
    comm.barrier().await?;
    state::install_parameters(&params, &flat)?;
    replica.zero1.clear();
    replica.completed = g.next_step.checked_sub(1);
    // The state of step `next_step - 1` is kept whole (a restorable point this member reports);
    // before the first step it is a fresh optimizer's, which the template gives back, so nothing
    // is kept.
    replica.optimizer_state = if replica.completed.is_some() { Some(full.clone()) } else { None };
    // The model holds the parameters of that state: the FSDP engine trains a copy.
    replica.snapshot_params = None;
    *ctx.shared.completed.lock().unwrap_or_else(PoisonError::into_inner) = replica.completed;
    Ok(full)
}

/// This rank's unit state as of `s.step`, for rank `rank` of `world` over units of
/// `unit_numels` elements, from the old segments' holders (see the module doc).
async fn recover_unit_state(comm: &Communicator, copies: &BuddyCopies, s: &SegmentSource, unit_numels: &[usize], world: usize, rank: usize) -> Result<UnitState> {
    if s.holders.len() != s.world as usize {
        return Err(SupervisorError::Job(format!("{} holders for a layout of {} segments", s.holders.len(), s.world)));
    }
    let held = |segment: usize| -> Result<&[u32]> {
        copies.segment(s.world, s.step, segment as u32).ok_or_else(|| SupervisorError::Job(format!("asked to send ZeRO-3 segment {segment} of {} as of step {}, which this member does not hold", s.world, s.step)))
    };
    if s.world as usize == world {
        // Old segment `rank` is this rank's new one: its own copy, or sent by its holder.
        let holder = s.holders[rank] as usize;
        let sends = async {
            for (segment, &h) in s.holders.iter().enumerate() {
                if h as usize == comm.rank() && segment != rank {
                    let blob = held(segment)?;
                    comm.send(&[blob.len() as u32, (blob.len() as u64 >> 32) as u32], segment).await?;
                    comm.send(blob, segment).await?;
                }
            }
            Ok::<_, SupervisorError>(())
        };
        let receive = async {
            if holder == rank {
                return Ok(held(rank)?.to_vec());
            }
            let mut len = [0u32; 2];
            comm.recv(&mut len, holder).await?;
            let len = usize::try_from(u64::from(len[0]) | (u64::from(len[1]) << 32)).map_err(|_| SupervisorError::Job("a segment longer than this machine's memory".into()))?;
            let mut blob = vec![0u32; len];
            comm.recv(&mut blob, holder).await?;
            Ok::<_, SupervisorError>(blob)
        };
        let (sent, received) = tokio::join!(sends, receive);
        sent?;
        let state = zero3::decode(&received?)?;
        let expected: Vec<std::ops::Range<usize>> = unit_numels.iter().map(|&n| rtx_collectives::segment_range(n, world, rank)).collect();
        if state.ranges != expected {
            return Err(SupervisorError::Job(format!("old segment {rank} holds ranges {:?}, rank {rank} of {world} owns {expected:?}", state.ranges)));
        }
        tracing::info!(step = s.step, holder, "zero3 segment state taken from its holder");
        return Ok(state);
    }
    // Another world size: every old segment goes to everyone, each keeps its new range's part.
    let mut cutter = zero3::Cutter::new(unit_numels, world, rank)?;
    for (segment, &holder) in s.holders.iter().enumerate() {
        let holder = holder as usize;
        let mine = holder == comm.rank();
        let mut buf = if mine { held(segment)?.to_vec() } else { Vec::new() };
        if comm.size() > 1 {
            let mut len = [buf.len() as u32, (buf.len() as u64 >> 32) as u32];
            comm.broadcast(&mut len, holder).await?;
            if !mine {
                let n = usize::try_from(u64::from(len[0]) | (u64::from(len[1]) << 32)).map_err(|_| SupervisorError::Job("a segment longer than this machine's memory".into()))?;
                buf = vec![0u32; n];
            }
            comm.broadcast(&mut buf, holder).await?;
        }
        cutter.place(&zero3::decode(&buf)?)?;
    }
    tracing::info!(step = s.step, old_world = s.world, world, "zero3 segments re-sharded");
    cutter.finish()
}

/// Every parameter gathered whole, and the full optimizer state (collective: every rank).
async fn gather_whole_state<O: Optimizer + Send>(engine: &mut FsdpGpt<O>, comm: &Communicator, template: &[(String, Tensor)]) -> Result<(Vec<(String, Tensor)>, NamedTensors)> {
    let params = engine.gather_parameters()?;
    let local = engine.optimizer().state_tensors()?;
    let slices = engine.param_shard().slices().to_vec();
    let full = state::gather_full_state(comm, &local, &slices, template).await?;
    Ok((params, full))
}

/// The replica's model (the job's own model object, kept next to the engine).
fn replica_model<M>(model: &Option<M>) -> Result<&M> {
    model.as_ref().ok_or_else(internal)
}

/// Copies `from`'s values into the parameters `into` by name (a GPT has no buffers); every
/// tensor of `into` must be matched, with the same element count.
fn install_by_name(into: &[(String, Tensor)], from: &[(String, Tensor)]) -> Result<()> {
    let by_name: std::collections::BTreeMap<&str, &Tensor> = from.iter().map(|(n, t)| (n.as_str(), t)).collect();
    for (name, t) in into {
        let src = by_name.get(name.as_str()).ok_or_else(|| SupervisorError::Job(format!("ZeRO-3: no gathered value for {name}")))?;
        if src.numel() != t.numel() {
            return Err(SupervisorError::Job(format!("ZeRO-3: {name} has {} elements, its gathered value {}", t.numel(), src.numel())));
        }
        t.copy_from_(&src.reshape(t.shape())?)?;
    }
    Ok(())
}

/// Logs what a rank holds between steps under ZeRO-3 next to a replica of plain data
/// parallelism (parameters, gradients and the full optimizer state), and the step's peaks.
fn log_memory<O: Optimizer>(engine: &FsdpGpt<O>, optimizer_full: usize, world: usize, copies: &BuddyCopies) -> Result<()> {
    let memory = engine.memory()?;
    let param_count: usize = engine.unit_numels().iter().sum();
    let replicated_bytes = 2 * 4 * param_count + optimizer_full;
    let resident_bytes = memory.params_bytes + memory.grads_bytes + memory.optimizer_bytes;
    tracing::info!(
        sharding = "zero3",
        world,
        resident_bytes,
        params_bytes = memory.params_bytes,
        grads_bytes = memory.grads_bytes,
        optimizer_bytes = memory.optimizer_bytes,
        gathered_peak_bytes = memory.gathered_peak_bytes,
        grads_peak_bytes = memory.grads_peak_bytes,
        copies_bytes = copies.bytes(),
        replicated_bytes,
        resident_per_replicated = resident_bytes as f64 / replicated_bytes.max(1) as f64,
        "zero3 memory per rank"
    );
    Ok(())
}
