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

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, SocketAddr};
    use std::sync::atomic::AtomicBool;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use rtx_actors::{Inbound, Link, StreamConn};
    use rtx_collectives::QuicOptions;
    use rtx_pipelines::{DataShare, StepReport};
    use tokio::sync::mpsc;

    use super::*;
    use crate::config::DpSharding;
    use crate::worker::{AbortSlot, Exec, Shared};

    /// The batch of a step is its number, so the engine can check it got the right one.
    struct Numbers;

    impl BatchSource for Numbers {
        type Batch = u64;

        fn batch(&self, step: u64, _rank: usize, _world: usize) -> std::result::Result<u64, String> {
            Ok(step)
        }
    }

    /// An engine that records every call the loop makes, in order.
    struct Recorder {
        calls: Arc<Mutex<Vec<String>>>,
        fail_at: Option<u64>,
        completed: Option<u64>,
    }

    impl Recorder {
        fn note(&self, call: String) {
            self.calls.lock().expect("calls").push(call);
        }
    }

    impl Engine for Recorder {
        type Batch = u64;
        type Error = SupervisorError;
        type Note = ToSupervisor;

        fn name(&self) -> &'static str {
            "recorder"
        }

        fn data_share(&self) -> DataShare {
            DataShare { rank: 0, world: 1 }
        }

        fn restorable(&self) -> Option<u64> {
            self.completed
        }

        async fn step(&mut self, step: u64, batch: u64, duties: Duties) -> Result<StepReport> {
            assert_eq!(batch, step, "the batch of step {step}");
            self.note(format!("step {step} verify={} checkpoint={} last={}", duties.verify, duties.checkpoint, duties.last));
            if self.fail_at == Some(step) {
                return Err(SupervisorError::Job("planted failure".into()));
            }
            Ok(StepReport { loss: step as f64 / 10.0, samples: 4 })
        }

        async fn secure(&mut self, step: u64) -> Result<()> {
            self.note(format!("secure {step}"));
            Ok(())
        }

        async fn keep(&mut self, step: u64, _duties: Duties) -> Result<()> {
            self.note(format!("keep {step}"));
            self.completed = Some(step);
            Ok(())
        }

        fn checksum(&mut self) -> Result<Option<u64>> {
            self.note("checksum".into());
            Ok(Some(1000 + self.completed.unwrap_or(0)))
        }

        async fn checkpoint(&mut self, step: u64, duties: Duties) -> Result<Vec<ToSupervisor>> {
            self.note(format!("checkpoint {step}"));
            Ok(if duties.checkpoint { vec![ToSupervisor::Checkpointed { node: 7, step, path: format!("ckpt-{step}") }] } else { Vec::new() })
        }

        async fn finish_run(&mut self, total: u64) -> Result<Vec<ToSupervisor>> {
            self.note(format!("finish_run {total}"));
            Ok(Vec::new())
        }

        fn finish_generation(self) -> Result<()> {
            self.note("finish_generation".into());
            Ok(())
        }
    }

    /// Both ends of an in-memory control link share this connection.
    struct Loopback;

    impl StreamConn for Loopback {
        fn close(&self, _reason: &str) {}

        fn export_keying_material(&self, _label: &[u8]) -> [u8; 32] {
            [7; 32]
        }

        fn remote_address(&self) -> SocketAddr {
            SocketAddr::from((Ipv4Addr::LOCALHOST, 1))
        }
    }

    /// A worker context whose supervisor is the other end of an in-memory link, and that end.
    fn context(verify_every: u64, checkpoint_every: u64) -> (WorkerCtx, Link, mpsc::Receiver<Inbound>) {
        let (node_end, supervisor_end) = tokio::io::duplex(1 << 16);
        let (node_r, node_w) = tokio::io::split(node_end);
        let (sup_r, sup_w) = tokio::io::split(supervisor_end);
        let (node_link, _node_inbound) = Link::over_stream("supervisor".into(), Arc::new(Loopback), node_r, node_w);
        let (sup_link, sup_inbound) = Link::over_stream("node".into(), Arc::new(Loopback), sup_r, sup_w);
        let shared = Arc::new(Shared {
            completed: Mutex::new(None),
            generation: Mutex::new(3),
            preempt: AtomicBool::new(false),
            abort: AbortSlot::default(),
            stale_logged: AtomicBool::new(false),
        });
        let ctx = WorkerCtx {
            node: 7,
            supervisor: node_link.remote(crate::protocol::SUPERVISOR),
            shared,
            bind_ip: Ipv4Addr::LOCALHOST.into(),
            quic: QuicOptions::default(),
            wire: None,
            checkpoints: None,
            exec: Exec::Task,
            compute: None,
            verify_every,
            checkpoint_every,
            sharding: DpSharding::Replicated,
            snapshot_every: 1,
            zero_copies: crate::config::ZeroCopies::Buddy,
            data_transport: crate::config::DataTransport::Quic,
            channels: 1,
            connections: 1,
            timing: Mutex::new((0.0, 0.0, 0.0)),
        };
        // The context's remote keeps its own handle of the node's link.
        drop(node_link);
        (ctx, sup_link, sup_inbound)
    }

    fn generation(next_step: u64) -> Generation {
        Generation {
            generation: 3,
            rank: 0,
            world: 1,
            source: 0,
            segments: None,
            next_step,
            stop_step: u64::MAX,
            addrs: Vec::new(),
            shm_job: None,
            host_of: Vec::new(),
        }
    }

    /// What the supervisor end received, as short strings.
    async fn received(inbound: &mut mpsc::Receiver<Inbound>, n: usize) -> Vec<String> {
        let mut out = Vec::new();
        while out.len() < n {
            let msg = tokio::time::timeout(Duration::from_secs(10), inbound.recv()).await.expect("a report within 10 s").expect("link open");
            out.push(match msg.decode::<ToSupervisor>().expect("a ToSupervisor") {
                ToSupervisor::StepDone { step, loss, samples, checksum, generation, .. } => {
                    format!("done {step} gen={generation} loss={loss} samples={samples} checksum={checksum:?}")
                }
                ToSupervisor::StepFailed { step, reason, .. } => format!("failed {step}: {reason}"),
                ToSupervisor::Checkpointed { step, path, .. } => format!("checkpointed {step} {path}"),
                other => format!("{other:?}"),
            });
        }
        out
    }

    /// Goal: the loop makes the contract's calls in the documented order and reports what it
    /// must, when it must. Method: a recording engine over four steps with verification every
    /// second step and a checkpoint after every second; compare the calls and the reports the
    /// supervisor end received.
    #[tokio::test(flavor = "current_thread")]
    async fn the_loop_calls_the_engine_in_contract_order_and_reports_each_step() {
        let (ctx, _sup, mut inbound) = context(2, 2);
        let calls = Arc::new(Mutex::new(Vec::new()));
        let engine = Recorder { calls: Arc::clone(&calls), fail_at: None, completed: None };
        let mut shard = DataShard::inline(Arc::new(Numbers));
        let (_cmd_tx, mut cmds) = mpsc::channel(4);
        let outcome = tokio::time::timeout(Duration::from_secs(10), run(&ctx, &generation(0), 4, engine, &mut shard, &mut cmds)).await.expect("the loop ends");
        assert!(matches!(outcome, Ok(None)), "{outcome:?}");
        let expected = [
            "step 0 verify=true checkpoint=false last=false",
            "secure 0",
            "keep 0",
            "checksum",
            "checkpoint 0",
            "step 1 verify=false checkpoint=true last=false",
            "secure 1",
            "keep 1",
            "checkpoint 1",
            "step 2 verify=true checkpoint=false last=false",
            "secure 2",
            "keep 2",
            "checksum",
            "checkpoint 2",
            "step 3 verify=true checkpoint=true last=true",
            "secure 3",
            "keep 3",
            "checksum",
            "checkpoint 3",
            "finish_run 4",
            "finish_generation",
        ];
        assert_eq!(*calls.lock().expect("calls"), expected);
        assert_eq!(*ctx.shared.completed.lock().expect("completed"), Some(3));
        assert_eq!(
            received(&mut inbound, 6).await,
            [
                "done 0 gen=3 loss=0 samples=4 checksum=Some(1000)",
                "done 1 gen=3 loss=0.1 samples=4 checksum=None",
                "checkpointed 1 ckpt-1",
                "done 2 gen=3 loss=0.2 samples=4 checksum=Some(1002)",
                "done 3 gen=3 loss=0.3 samples=4 checksum=Some(1003)",
                "checkpointed 3 ckpt-3",
            ]
        );
    }

    /// Goal: a failed step is reported and the loop waits for the supervisor's decision, with
    /// nothing secured, kept or reported done for it, and the engine still hands its state back.
    /// Method: the recording engine fails step 1 of a generation that starts at step 0; the
    /// supervisor end answers the `StepFailed` with `Finish`.
    #[tokio::test(flavor = "current_thread")]
    async fn a_failed_step_is_reported_and_the_loop_waits_for_the_supervisor() {
        let (ctx, _sup, mut inbound) = context(1, 0);
        let calls = Arc::new(Mutex::new(Vec::new()));
        let engine = Recorder { calls: Arc::clone(&calls), fail_at: Some(1), completed: None };
        let mut shard = DataShard::inline(Arc::new(Numbers));
        let (cmd_tx, mut cmds) = mpsc::channel(4);
        let g = generation(0);
        let supervisor = async {
            let reports = received(&mut inbound, 2).await;
            cmd_tx.send(ToWorker::Finish).await.expect("the loop listens");
            reports
        };
        let (outcome, reports) = tokio::join!(tokio::time::timeout(Duration::from_secs(10), run(&ctx, &g, 5, engine, &mut shard, &mut cmds)), supervisor);
        assert!(matches!(outcome, Ok(Ok(Some(ToWorker::Finish)))), "{outcome:?}");
        assert_eq!(reports, ["done 0 gen=3 loss=0 samples=4 checksum=Some(1000)", "failed 1: training job: planted failure"]);
        assert_eq!(
            *calls.lock().expect("calls"),
            [
                "step 0 verify=true checkpoint=false last=false",
                "secure 0",
                "keep 0",
                "checksum",
                "checkpoint 0",
                "step 1 verify=true checkpoint=false last=false",
                "finish_generation"
            ]
        );
        assert_eq!(*ctx.shared.completed.lock().expect("completed"), Some(0));
    }
}
