//! The worker's one step loop: every engine (data parallelism with ZeRO-0/1/2 in `dp.rs`,
//! ZeRO-3 in `fsdp.rs`, the mesh in `mesh.rs`) trains through it, behind the
//! [`rtx_pipelines::Engine`] contract, whose module doc lists the loop's duties and the engines'.
//!
//! The loop owns the runtime's side of a step: commands and preemption between steps, the batch
//! from the data shard, the `StepFailed` / `StepDone` reports and what the engine hands it to pass
//! on (checkpoint reports), the completed step the heartbeats carry, and the time accounting of
//! the final report. It never names an engine.

use std::sync::PoisonError;

use rtx_actors::{BatchSource, DataShard};
use rtx_pipelines::{Duties, Engine};
use tokio::sync::mpsc::Receiver;
use tokio::time::Instant;
use tracing::Instrument;

use super::{add_step_timing, between_steps, is_stale_generation, lost, Generation, WorkerCtx};
use crate::error::{Result, SupervisorError};
use crate::protocol::{ToSupervisor, ToWorker};

/// Trains `engine` from `g.next_step` to `total` (exclusive) on batches from `shard`. Returns the
/// command that interrupted the generation, or `None` when the last step is done; the engine has
/// handed its state over for the next generation either way.
pub(super) async fn run<S, E>(
    ctx: &WorkerCtx,
    g: &Generation,
    total: u64,
    mut engine: E,
    shard: &mut DataShard<S>,
    cmds: &mut Receiver<ToWorker>,
) -> Result<Option<ToWorker>>
where
    S: BatchSource,
    E: Engine<Batch = S::Batch, Error = SupervisorError, Note = ToSupervisor>,
{
    let span = tracing::info_span!("steps", engine = engine.name(), next_step = g.next_step, total);
    let outcome = steps(ctx, g, total, &mut engine, shard, cmds).instrument(span).await;
    // The state goes back to the replica whatever ended the loop; a failure to keep it wins.
    engine.finish_generation()?;
    outcome
}

async fn steps<S, E>(
    ctx: &WorkerCtx,
    g: &Generation,
    total: u64,
    engine: &mut E,
    shard: &mut DataShard<S>,
    cmds: &mut Receiver<ToWorker>,
) -> Result<Option<ToWorker>>
where
    S: BatchSource,
    E: Engine<Batch = S::Batch, Error = SupervisorError, Note = ToSupervisor>,
{
    let share = engine.data_share();
    debug_assert!(share.rank < share.world, "data share {share:?}");
    let mut step = g.next_step;
    // The loop time of a step runs from the end of the previous step (data wait included).
    let mut since_last_step: Option<Instant> = None;
    loop {
        if step >= total {
            // The end of the run (or of this part of it).
            for note in engine.finish_run(total).await? {
                ctx.supervisor.tell(&note).await?;
            }
            return Ok(None);
        }
        let control_started = Instant::now();
        if let Some(outcome) = between_steps(ctx, engine.restorable(), cmds).await {
            return outcome;
        }
        let mut control = control_started.elapsed();
        let batch = shard.get(step, share.rank, share.world)?;
        let duties = Duties::at(step, total, ctx.verify_every, ctx.checkpoint_every);
        let loop_started = Instant::now();
        let report = match engine.step(step, batch, duties).await {
            Ok(report) => report,
            Err(e) => {
                ctx.shared.log_failure(&format!("{} step failed", engine.name()), step, &e, is_stale_generation(&e));
                return failed(ctx, g, step, &e, cmds).await;
            }
        };
        let compute = loop_started.elapsed();
        if let Err(e) = engine.secure(step).await {
            tracing::warn!(step, error = %e, "securing the step failed (segment exchange)");
            return failed(ctx, g, step, &e, cmds).await;
        }
        *ctx.shared.completed.lock().unwrap_or_else(PoisonError::into_inner) = Some(step);
        if let Err(e) = engine.keep(step, duties).await {
            tracing::warn!(step, error = %e, "keeping the step restorable failed (snapshot)");
            return failed(ctx, g, step, &e, cmds).await;
        }
        let checksum = if duties.verify { engine.checksum()? } else { None };
        let report_started = Instant::now();
        ctx.supervisor
            .tell(&ToSupervisor::StepDone { node: ctx.node, generation: g.generation, step, loss: report.loss, samples: report.samples, checksum })
            .await?;
        control += report_started.elapsed();
        for note in engine.checkpoint(step, duties).await? {
            ctx.supervisor.tell(&note).await?;
        }
        step += 1;
        add_step_timing(ctx, compute, control, since_last_step.map_or(loop_started.elapsed(), |t| t.elapsed()));
        since_last_step = Some(Instant::now());
    }
}

/// Reports step `step` failed and waits for the supervisor's decision (a new generation, or
/// eviction).
async fn failed(ctx: &WorkerCtx, g: &Generation, step: u64, error: &SupervisorError, cmds: &mut Receiver<ToWorker>) -> Result<Option<ToWorker>> {
    let _ = ctx.supervisor.tell(&ToSupervisor::StepFailed { node: ctx.node, generation: g.generation, step, reason: error.to_string() }).await;
    cmds.recv().await.map(Some).ok_or_else(lost)
}
