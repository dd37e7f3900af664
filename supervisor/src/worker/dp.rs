//! The data-parallel engine (replicated, ZeRO-1, ZeRO-2) behind the [`Engine`] contract: a thin
//! adapter over [`DataParallel`] that the step loop (`steps.rs`) drives. The generation's set-up
//! (the state sync from the source or from segment copies, building the engine) stays in the
//! parent module's `train`.
//!
//! Engine-specific duties: the job's loss scaled to the global batch and its after-step hook;
//! under ZeRO-1/2 the buddy exchange of this rank's segment state before a step is done
//! ([`Engine::secure`]; skipped with `[elastic] zero_copies = "snapshot"`, where a step commits
//! right after its update and a loss rolls back to the last snapshot) and the gathered snapshot
//! every `snapshot_every` steps ([`Engine::keep`]);
//! rank 0's single-file checkpoints through the [`CheckpointWriter`]; the step trace; and, after
//! the loop, the model and full optimizer state the replica keeps for the next generation, and
//! (a job on a GPU, [`TrainJob::device_memory`]) the device's allocator counters in the log.
//!
//! Under ZeRO-1/2 on a GPU the engine's shard lives on the device (`rtx_pipelines`
//! `ParamShard::new_on`); what this adapter exchanges and snapshots is host data either way: the
//! slices' values and `state_tensors()` leave the device when encoded or gathered.

use std::path::PathBuf;
use std::time::Duration;

use rtx_collectives::Communicator;
use rtx_pipelines::{DataParallel, DataShare, Duties, Engine, Sharding, StepReport};
use rtx_tensor::Optimizer;
use tokio::time::Instant;

use super::{full_state_now, parameter_checksum, Generation, Replica, WorkerCtx};
use crate::checkpoint::CheckpointWriter;
use crate::error::{Result, SupervisorError};
use crate::job::TrainJob;
use crate::protocol::ToSupervisor;
use crate::state;
use crate::zero1;

/// One data-parallel generation's engine and what its steps need from the worker.
pub(super) struct DpSteps<'a, J: TrainJob> {
    pub(super) ctx: &'a WorkerCtx,
    pub(super) job: &'a J,
    pub(super) g: &'a Generation,
    pub(super) comm: &'a Communicator,
    pub(super) replica: &'a mut Replica<J::Model, J::Optim>,
    pub(super) writer: &'a mut CheckpointWriter,
    pub(super) engine: DataParallel<J::Model, J::Optim>,
    /// The engine's sharding (replicated, ZeRO-1 or ZeRO-2).
    pub(super) sharding: Sharding,
    /// Segment layout and full-state template (ZeRO-1/2 exchanges and snapshots).
    pub(super) layout: zero1::Layout,
    pub(super) template: state::NamedTensors,
    /// Where the step trace goes, if the job asked for one.
    pub(super) trace_to: Option<(u64, PathBuf)>,
    /// Time spent exchanging segment states with the buddies, and the number of exchanges.
    pub(super) exchanged: (Duration, u32),
}

impl<J: TrainJob> Engine for DpSteps<'_, J> {
    type Batch = J::Batch;
    type Error = SupervisorError;
    type Note = ToSupervisor;

    fn name(&self) -> &'static str {
        self.ctx.sharding.name()
    }

    fn data_share(&self) -> DataShare {
        DataShare { rank: self.g.rank, world: self.g.world }
    }

    fn restorable(&self) -> Option<u64> {
        self.replica.completed
    }

    async fn step(&mut self, step: u64, batch: J::Batch, _duties: Duties) -> Result<StepReport> {
        let (job, world) = (self.job, self.g.world);
        let global = job.global_batch().max(1) as f64;
        job.set_lr(self.engine.optimizer_mut(), step);
        let (mut unscaled_loss, mut rows_seen) = (None, 0usize);
        let (unscaled_out, rows_out) = (&mut unscaled_loss, &mut rows_seen);
        let result = self
            .engine
            .step_async(move |model| {
                let batch = batch;
                let (loss, rows) = job.loss(model, &batch, step)?;
                // Read after the step: a read here would wait for the forward (on a GPU, the
                // device would then idle while backward's first kernels are queued).
                *unscaled_out = Some(loss.detach());
                *rows_out = rows;
                // Each rank's mean, scaled so that the group's average is the global batch's mean.
                loss.mul_scalar(rows as f64 * world as f64 / global)
            })
            .await;
        let unscaled = result.and_then(|_| match &unscaled_loss {
            Some(loss) => Ok(loss.item()?),
            None => Err(rtx_pipelines::Error::from(rtx_tensor::Error::InvalidArgument { op: "step", reason: "the step ran no forward".into() })),
        })?;
        // Non-trainable state follows the updated parameters on every replica (an EMA target).
        job.after_step(self.engine.model_mut(), step)
            .map_err(|reason| rtx_pipelines::Error::from(rtx_tensor::Error::InvalidArgument { op: "after_step", reason }))?;
        Ok(StepReport { loss: unscaled, samples: rows_seen as u64 })
    }

    async fn secure(&mut self, step: u64) -> Result<()> {
        // Replicated: every rank holds the whole state. ZeRO-1/2 with `zero_copies = "snapshot"`:
        // nothing is paid per step; the last snapshot (`keep`) is the restorable point, and a lost
        // rank costs the steps since.
        if !self.ctx.sharding.shards_optimizer() || !self.ctx.zero_copies.per_step() {
            return Ok(());
        }
        // A rank holds only its segment of the optimizer state: the step is restorable (and
        // reported done) once its segment state is also held by its buddy.
        let started = Instant::now();
        self.replica.zero1.drop_previous();
        // (Encoded before the await: no borrow of the engine lives across it.)
        let mut own = self.replica.zero1.spare();
        let local = self.engine.optimizer().state_tensors()?;
        self.layout.encode_into(&mut own, step, self.engine.param_slices(), &local)?;
        self.replica.zero1.exchange_step(self.comm, self.g.generation, step, own).await?;
        self.exchanged.0 += started.elapsed();
        self.exchanged.1 += 1;
        Ok(())
    }

    async fn keep(&mut self, step: u64, duties: Duties) -> Result<()> {
        if !self.ctx.sharding.shards_optimizer() {
            self.replica.completed = Some(step);
            return Ok(());
        }
        // Under ZeRO-1 the restorable point without the buddies (a rank lost with its buddy) is
        // the last snapshot, which gathers the full state on every rank.
        let snapshot_due = (step + 1) % self.ctx.snapshot_every.max(1) == 0 || duties.last || duties.checkpoint;
        if snapshot_due {
            let local = self.engine.optimizer().state_tensors()?;
            let full = state::gather_full_state(self.comm, &local, self.engine.param_slices(), &self.template).await?;
            self.replica.optimizer_state = Some(full);
            self.replica.snapshot_params = Some(state::flat_parameters(self.engine.model())?);
            self.replica.completed = Some(step);
        }
        Ok(())
    }

    fn checksum(&mut self) -> Result<Option<u64>> {
        Ok(Some(parameter_checksum(self.engine.model())?))
    }

    async fn checkpoint(&mut self, step: u64, duties: Duties) -> Result<Vec<ToSupervisor>> {
        if self.g.rank != 0 || !self.writer.enabled() || !duties.checkpoint {
            return Ok(Vec::new());
        }
        let full = full_state_now(self.ctx, self.replica, self.engine.optimizer())?;
        let report = self.writer.write(step, self.engine.model(), full, self.engine.optimizer(), self.ctx.supervisor.clone(), self.ctx.node)?;
        Ok(report.into_iter().collect())
    }

    async fn finish_run(&mut self, total: u64) -> Result<Vec<ToSupervisor>> {
        // The end of the run (or of this part of it): a final checkpoint to resume from.
        let already = self.ctx.checkpoint_every > 0 && total % self.ctx.checkpoint_every == 0;
        if self.g.rank != 0 || total <= self.g.next_step || !self.writer.enabled() || already {
            return Ok(Vec::new());
        }
        let full = full_state_now(self.ctx, self.replica, self.engine.optimizer())?;
        let report = self.writer.write(total - 1, self.engine.model(), full, self.engine.optimizer(), self.ctx.supervisor.clone(), self.ctx.node)?;
        Ok(report.into_iter().collect())
    }

    fn finish_generation(self) -> Result<()> {
        let DpSteps { ctx, job, g, replica, engine, sharding, trace_to, exchanged, .. } = self;
        if exchanged.1 > 0 {
            tracing::info!(exchanges = exchanged.1, mean_ms = exchanged.0.as_secs_f64() * 1e3 / f64::from(exchanged.1), "zero1 buddy exchanges");
        }
        if let Some(m) = job.device_memory() {
            let mib = |bytes: usize| (bytes as f64 / f64::from(1u32 << 20) * 10.0).round() / 10.0;
            tracing::info!(
                rank = g.rank,
                world = g.world,
                sharding = ctx.sharding.name(),
                allocated_mib = mib(m.allocated),
                peak_allocated_mib = mib(m.peak_allocated),
                reserved_mib = mib(m.reserved),
                peak_reserved_mib = mib(m.peak_reserved),
                "device memory"
            );
        }
        if let (Some((_, dir)), Some(trace)) = (&trace_to, engine.trace().filter(|t| !t.events().is_empty())) {
            // A measurement for people: failing to write it costs the file, not the job.
            let path = dir.join(format!("trace-rank{}.json", g.rank));
            match std::fs::write(&path, trace.to_chrome_json(g.rank).to_string()) {
                Ok(()) => tracing::info!(path = %path.display(), events = trace.events().len(), "step trace written"),
                Err(e) => tracing::warn!(path = %path.display(), error = %e, "cannot write the step trace"),
            }
        }
        let keep_optimizer = engine.params_in_place() && sharding == Sharding::Replicated;
        let (model, _buckets, optimizer) = engine.into_parts();
        // The replica keeps its model whatever happens next.
        replica.model = Some(model);
        if !ctx.sharding.shards_optimizer() {
            // Plain data parallelism: the optimizer holds the full state of the last completed step.
            replica.optimizer_state = Some(optimizer.state_tensors()?);
            replica.snapshot_params = None;
            if keep_optimizer {
                replica.kept_optimizer = Some(optimizer);
            }
        }
        debug_assert!(
            replica.completed.is_none_or(|c| c + 1 >= g.next_step),
            "completed {:?} before the generation's start {}",
            replica.completed,
            g.next_step
        );
        Ok(())
    }
}
