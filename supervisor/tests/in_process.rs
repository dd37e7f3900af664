//! The supervisor and two workers in one process (each worker with its own node agent and link),
//! training softmax regression on the real Fashion-MNIST data over real QUIC on loopback: the job
//! finishes with bit-identical replicas, `rtx status`'s query answers, and a wrong token is
//! refused with a typed error; a checkpoint write that fails on the file system loses nothing.
//! Elastic ZeRO-1/2 with host staging (the GPU path's, on the CPU) commits the unstaged ZeRO-1
//! job's losses and parameters bit for bit, and recovers a lost worker from buddy segments.
//! With `zero_copies = "snapshot"` (no per-step buddy exchange) ZeRO-1/2 commit the same losses,
//! and a lost worker rolls the job back to its last snapshot and re-runs the steps since, bit for
//! bit.
//! With `[elastic] data_transport = "tls"` the workers' collectives cross processes over TCP with
//! mutual TLS 1.3 instead of QUIC, flat and routed, and commit the QUIC job's losses and
//! parameters bit for bit.
//! Needs `bash scripts/fetch-data.sh`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rtx_actors::BatchSource;
use rtx_pipelines::{DpConfig, ParamSlice};
use rtx_supervisor::checkpoint;
use rtx_supervisor::{query_status, run_node, run_worker, DataTransport, DpSharding, ElasticConfig, JobEvent, NodeEnv, SupervisorError, SupervisorHandle, SupervisorOptions, TrainJob, Wire, WorkerOptions, WorkerOutcome, ZeroCopies};
use rtx_tensor::data::{load_fashion_mnist, DataRoot, ImageDataset, Split};
use rtx_tensor::nn::Linear;
use rtx_tensor::optim::{AdamW, AdamWConfig};
use rtx_tensor::{CrossEntropyOptions, DType, Generator, Tensor};

const GLOBAL_BATCH: usize = 32;
const STEPS: u64 = 150;

struct Fashion {
    data: ImageDataset,
    mean: f32,
    std: f32,
    checkpoints: Option<PathBuf>,
    /// Every step from this one fails on every worker (a deterministic model error).
    fail_from: Option<u64>,
    /// Parameters stay in the module with a host mirror for the collectives (the path of a model
    /// on a GPU, `DpConfig::host_staging`).
    staged: bool,
    /// How many optimizers this worker's job built.
    optimizers_built: Arc<AtomicUsize>,
    /// Outputs of the linear model: 10 (the classes), or more for a gradient large enough that
    /// the collectives split its all-reduce (the extra logits only ever lose the cross-entropy).
    outputs: usize,
}

impl Fashion {
    fn load() -> Fashion {
        let root = DataRoot::resolve(None, std::env::var_os("RTX_DATA_DIR").as_deref());
        let root = if root.fashion_mnist().exists() { root } else { DataRoot::new(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../data")) };
        let data = load_fashion_mnist(&root.fashion_mnist(), Split::Test).expect("Fashion-MNIST: run bash scripts/fetch-data.sh");
        let (mean, std) = data.pixel_mean_std();
        Fashion { data, mean, std, checkpoints: None, fail_from: None, staged: false, optimizers_built: Arc::default(), outputs: 10 }
    }

    fn rows(&self, indices: &[usize]) -> (Tensor, Tensor) {
        let b = self.data.batch(indices, self.mean, self.std);
        (Tensor::from_vec(b.pixels, &[indices.len(), 784]).expect("pixels"), Tensor::from_vec(b.labels, &[indices.len()]).expect("labels"))
    }
}

impl BatchSource for Fashion {
    type Batch = (Tensor, Tensor, usize);

    fn batch(&self, step: u64, rank: usize, world: usize) -> Result<Self::Batch, String> {
        let global: Vec<usize> = (0..GLOBAL_BATCH).map(|i| (step as usize * GLOBAL_BATCH + i * 7) % self.data.n).collect();
        let part = rtx_collectives::segment_range(GLOBAL_BATCH, world, rank);
        let (x, y) = self.rows(&global[part.clone()]);
        Ok((x, y, part.len()))
    }
}

impl TrainJob for Fashion {
    type Model = Linear;
    type Optim = AdamW;

    fn build_model(&self) -> Result<Linear, String> {
        Linear::new(784, self.outputs, true, DType::F32, &mut Generator::new(7)).map_err(|e| e.to_string())
    }

    fn build_optimizer(&self, slices: &[ParamSlice]) -> Result<AdamW, String> {
        self.optimizers_built.fetch_add(1, Ordering::SeqCst);
        let named = slices.iter().map(|s| (s.name.clone(), s.tensor.clone())).collect();
        AdamW::new(named, AdamWConfig { lr: 0.01, ..AdamWConfig::default() }).map_err(|e| e.to_string())
    }

    fn loss(&self, model: &mut Linear, batch: &Self::Batch, step: u64) -> rtx_tensor::Result<(Tensor, usize)> {
        if self.fail_from.is_some_and(|from| step >= from) {
            return Err(rtx_tensor::Error::InvalidArgument { op: "test loss", reason: format!("planted failure at step {step}") });
        }
        let logits = model.forward(&batch.0)?;
        Ok((logits.cross_entropy(&batch.1, CrossEntropyOptions::default())?, batch.2))
    }

    fn global_batch(&self) -> usize {
        GLOBAL_BATCH
    }

    fn total_steps(&self) -> u64 {
        STEPS
    }

    fn set_lr(&self, _optimizer: &mut AdamW, _step: u64) {}

    fn evaluate(&self, model: &mut Linear) -> Result<Vec<(String, f64)>, String> {
        let all: Vec<usize> = (0..self.data.n).collect();
        let (x, y) = self.rows(&all);
        let pred = model.forward(&x).and_then(|l| l.argmax(-1, false)).and_then(|p| p.to_u32_vec()).map_err(|e| e.to_string())?;
        let labels = y.to_u32_vec().map_err(|e| e.to_string())?;
        let correct = pred.iter().zip(&labels).filter(|(p, l)| p == l).count();
        Ok(vec![("acc".into(), correct as f64 / labels.len() as f64)])
    }

    fn checkpoint_dir(&self) -> Option<PathBuf> {
        self.checkpoints.clone()
    }

    fn dp_config(&self) -> DpConfig {
        DpConfig { host_staging: self.staged, ..DpConfig::default() }
    }
}

fn options(token: &str) -> SupervisorOptions {
    let elastic = ElasticConfig { start_workers: 2, max_workers: 2, ..ElasticConfig::default() };
    SupervisorOptions { listen: "127.0.0.1:0".parse().expect("addr"), token: token.into(), job: String::new(), total_steps: STEPS, stop_at: None, elastic, resume: None, resume_next_step: 0, run_dir: None, link: Default::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_in_process_workers_train_to_identical_replicas() -> anyhow::Result<()> {
    let mut supervisor = SupervisorHandle::start(options("secret"), None).await?;
    let addr = supervisor.addr;
    let workers: Vec<_> = (0..2).map(|i| tokio::spawn(run_worker(WorkerOptions::new(addr, "secret".into(), format!("worker-{i}")), |_spec| Ok(Fashion::load())))).collect();
    let mut committed = 0;
    let mut status_checked = false;
    let finished = loop {
        let event = tokio::time::timeout(Duration::from_secs(120), supervisor.events.recv()).await?.ok_or_else(|| anyhow::anyhow!("events ended"))?;
        match event {
            JobEvent::Committed { step, world, .. } => {
                assert_eq!(world, 2);
                committed = step + 1;
                if !status_checked && step >= 10 {
                    let report = query_status(addr, "secret", Default::default()).await?;
                    assert_eq!(report.members.len(), 2);
                    assert!(report.committed.is_some());
                    assert!(query_status(addr, "wrong", Default::default()).await.is_err(), "status needs the token");
                    status_checked = true;
                }
            }
            JobEvent::Finished { eval, replicas_identical, .. } => break (eval, replicas_identical),
            JobEvent::Failed { reason } => anyhow::bail!("job failed: {reason}"),
            JobEvent::Lost { reason, .. } => anyhow::bail!("a worker was lost: {reason}"),
            _ => {}
        }
    };
    assert_eq!(committed, STEPS);
    assert!(finished.1, "replicas must be bit-identical");
    let acc = finished.0.iter().find(|(k, _)| k == "acc").map(|(_, v)| *v).expect("acc");
    assert!(acc > 0.70, "softmax regression on Fashion-MNIST reached only {acc}");
    supervisor.join().await?;
    for w in workers {
        assert_eq!(w.await??, WorkerOutcome::Finished);
    }
    Ok(())
}

// Goal: four workers on two "machines" (two each, told apart by the host identity they report)
// train over the routed layout: shared-memory rings inside each machine, QUIC between them, the
// hierarchical all-reduce; the job finishes with bit-identical replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn workers_on_two_machines_train_over_shared_memory_inside_and_quic_between() -> anyhow::Result<()> {
    let mut options = options("secret");
    options.elastic.start_workers = 4;
    options.elastic.max_workers = 4;
    let mut supervisor = SupervisorHandle::start(options, None).await?;
    let addr = supervisor.addr;
    let workers: Vec<_> = (0..4)
        .map(|i| {
            let env = NodeEnv { host: Some(format!("machine-{}", i / 2)), ..NodeEnv::process() };
            tokio::spawn(run_node(WorkerOptions::new(addr, "secret".into(), format!("worker-{i}")), env, |_spec| Ok(Fashion::load())))
        })
        .collect();
    let mut transports = Vec::new();
    let finished = loop {
        let event = tokio::time::timeout(Duration::from_secs(120), supervisor.events.recv()).await?.ok_or_else(|| anyhow::anyhow!("events ended"))?;
        match event {
            JobEvent::Generation { transport, world, .. } => transports.push((world, transport)),
            JobEvent::Finished { replicas_identical, .. } => break replicas_identical,
            JobEvent::Failed { reason } => anyhow::bail!("job failed: {reason}"),
            JobEvent::Lost { reason, .. } => anyhow::bail!("a worker was lost: {reason}"),
            _ => {}
        }
    };
    assert_eq!(transports, vec![(4, "routed")], "one generation of 4 over the routed layout");
    assert!(finished, "replicas must be bit-identical");
    supervisor.join().await?;
    for w in workers {
        assert_eq!(w.await??, WorkerOutcome::Finished);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_that_fails_on_every_worker_fails_the_job_instead_of_retrying_forever() -> anyhow::Result<()> {
    // Goal: a step that fails the same way on every worker (no worker lost) is retried a bounded
    // number of times, then the job fails with the step's error. Method: a loss that errors from
    // step 5 on; short heartbeats so each retry takes a fraction of a second (but a timeout long
    // enough that a CPU-starved machine does not declare both workers hung: with nobody left the
    // job waits for workers instead, and the test saw no event for a minute).
    let mut opts = options("secret");
    opts.elastic.heartbeat_interval = Duration::from_millis(50);
    opts.elastic.heartbeat_timeout = Duration::from_millis(600);
    let mut supervisor = SupervisorHandle::start(opts, None).await?;
    let addr = supervisor.addr;
    let workers: Vec<_> = (0..2).map(|i| tokio::spawn(run_worker(WorkerOptions::new(addr, "secret".into(), format!("worker-{i}")), |_spec| Ok(Fashion { fail_from: Some(5), ..Fashion::load() })))).collect();
    let mut committed = 0;
    let reason = loop {
        let event = tokio::time::timeout(Duration::from_secs(60), supervisor.events.recv()).await?.ok_or_else(|| anyhow::anyhow!("events ended"))?;
        match event {
            JobEvent::Committed { step, .. } => committed = step + 1,
            JobEvent::Failed { reason } => break reason,
            JobEvent::Finished { .. } => anyhow::bail!("the job finished although every step from 5 fails"),
            _ => {}
        }
    };
    assert_eq!(committed, 5, "steps before the failing one commit");
    assert!(reason.contains(&format!("step 5 failed {} times in a row", rtx_supervisor::MAX_STALLED_REFORMS + 1)) && reason.contains("planted failure at step 5"), "{reason}");
    assert!(supervisor.join().await.is_err(), "the supervisor ends with the failure");
    for w in workers {
        let _ = tokio::time::timeout(Duration::from_secs(30), w).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_is_refused_with_a_typed_error() -> anyhow::Result<()> {
    let supervisor = SupervisorHandle::start(options("secret"), None).await?;
    let result = run_worker(WorkerOptions::new(supervisor.addr, "guess".into(), "intruder".into()), |_spec| Ok(Fashion::load())).await;
    match result {
        Err(SupervisorError::Refused { reason }) => assert!(reason.contains("wrong cluster token"), "{reason}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    Ok(())
}

// Goal: a checkpoint write that fails on a real file system loses nothing. Method: checkpoints
// every 50 steps into a fresh folder where the file of step 99 is blocked by a folder of that
// name (the atomic rename fails). The job must finish with identical replicas, report
// `CheckpointFailed` for step 99 and `Checkpointed` for 49 and 149, leave no temporary file,
// keep step 49's checkpoint loadable, and `latest` must name step 149's file (not the folder).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_checkpoint_write_keeps_the_last_good_one_and_training_goes_on() -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("rtx-ckpt-fail-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(checkpoint::path_for(&dir, 99))?;
    let mut opts = options("secret");
    opts.elastic.checkpoint_every = 50;
    let mut supervisor = SupervisorHandle::start(opts, None).await?;
    let addr = supervisor.addr;
    let workers: Vec<_> = (0..2)
        .map(|i| {
            let dir = dir.clone();
            tokio::spawn(run_worker(WorkerOptions::new(addr, "secret".into(), format!("worker-{i}")), move |_spec| Ok(Fashion { checkpoints: Some(dir), ..Fashion::load() })))
        })
        .collect();
    let (mut written, mut failed) = (Vec::new(), Vec::new());
    let identical = loop {
        let event = tokio::time::timeout(Duration::from_secs(120), supervisor.events.recv()).await?.ok_or_else(|| anyhow::anyhow!("events ended"))?;
        match event {
            JobEvent::Checkpointed { step, .. } => written.push(step),
            JobEvent::CheckpointFailed { step, reason } => {
                println!("checkpoint of step {step} failed: {reason}");
                failed.push(step);
            }
            JobEvent::Finished { replicas_identical, .. } => break replicas_identical,
            JobEvent::Failed { reason } => anyhow::bail!("job failed: {reason}"),
            _ => {}
        }
    };
    supervisor.join().await?;
    for w in workers {
        assert_eq!(w.await??, WorkerOutcome::Finished);
    }
    assert!(identical);
    assert_eq!(failed, [99]);
    assert_eq!(written, [49, 149]);
    let names: Vec<String> = std::fs::read_dir(&dir)?.map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned())).collect::<Result<_, _>>()?;
    assert!(!names.iter().any(|n| n.ends_with(".tmp")), "a temporary file was left: {names:?}");
    assert_eq!(checkpoint::latest(&dir), Some(checkpoint::path_for(&dir, 149)));
    let job = Fashion::load();
    let model = job.build_model().map_err(anyhow::Error::msg)?;
    let (state, step) = checkpoint::load(&checkpoint::path_for(&dir, 49), &model, |slices| job.build_optimizer(slices))?;
    assert_eq!(step, 49);
    assert!(!state.is_empty(), "the optimizer state is in the checkpoint");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

// Goal: losing every holder of the newest state at once resumes from the newest checkpoint, never
// from initial parameters (the run that lost its whole history: every survivor evicted, a fresh
// replacement alone, `next_step = 0`). Method: two workers checkpoint every 40 steps; once step 79's
// checkpoint is written and a few more steps are committed, both are killed (their tasks dropped:
// links gone), then a fresh worker joins. Its generation must start at 80 from that checkpoint,
// the fall back must be reported as suspect, and the job must finish with a trained model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_every_holder_resumes_from_the_newest_checkpoint_not_from_step_zero() -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("rtx-ckpt-holders-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut opts = options("secret");
    opts.elastic.checkpoint_every = 40;
    opts.elastic.max_workers = 3;
    let mut supervisor = SupervisorHandle::start(opts, None).await?;
    let addr = supervisor.addr;
    let spawn = |name: String, dir: PathBuf| tokio::spawn(run_worker(WorkerOptions::new(addr, "secret".into(), name), move |_spec| Ok(Fashion { checkpoints: Some(dir), ..Fashion::load() })));
    let first: Vec<_> = (0..2).map(|i| spawn(format!("worker-{i}"), dir.clone())).collect();
    let (mut checkpointed, mut committed) = (None, None);
    while !(checkpointed.is_some_and(|s| s >= 79) && committed.is_some_and(|c| c >= 85)) {
        match tokio::time::timeout(Duration::from_secs(120), supervisor.events.recv()).await?.ok_or_else(|| anyhow::anyhow!("events ended"))? {
            JobEvent::Checkpointed { step, .. } => checkpointed = Some(step),
            JobEvent::Committed { step, .. } => committed = Some(step),
            JobEvent::Failed { reason } => anyhow::bail!("job failed: {reason}"),
            _ => {}
        }
    }
    for w in &first {
        w.abort();
    }
    // Both losses are seen before the newcomer arrives. A checkpoint the dying workers still
    // finish (a loaded machine) is one more durable state: the supervisor uses the newest it heard
    // of, and so does this test.
    let mut lost = 0;
    while lost < 2 {
        match tokio::time::timeout(Duration::from_secs(60), supervisor.events.recv()).await?.ok_or_else(|| anyhow::anyhow!("events ended"))? {
            JobEvent::Lost { .. } => lost += 1,
            JobEvent::Checkpointed { step, .. } => checkpointed = Some(step),
            JobEvent::Committed { step, .. } => committed = Some(step),
            _ => {}
        }
    }
    let fresh = spawn("worker-fresh".into(), dir.clone());
    let (mut resumed_at, mut suspect, mut last) = (None, false, 0);
    let mut newest_checkpoint = checkpointed.unwrap_or_default();
    let (eval, identical) = loop {
        match tokio::time::timeout(Duration::from_secs(120), supervisor.events.recv()).await?.ok_or_else(|| anyhow::anyhow!("events ended"))? {
            JobEvent::Checkpointed { step, .. } if resumed_at.is_none() => newest_checkpoint = step,
            JobEvent::Generation { next_step, .. } if resumed_at.is_none() => resumed_at = Some(next_step),
            JobEvent::Suspect { reason } => {
                println!("suspect: {reason}");
                suspect = true;
            }
            JobEvent::Committed { step, .. } => last = step,
            JobEvent::Finished { eval, replicas_identical, .. } => break (eval, replicas_identical),
            JobEvent::Failed { reason } => anyhow::bail!("job failed: {reason}"),
            _ => {}
        }
    };
    assert_eq!(resumed_at, Some(newest_checkpoint + 1), "the lone newcomer must resume from the checkpoint of step {newest_checkpoint}");
    // (On a loaded machine the dying workers may still checkpoint their newest committed step:
    // then nothing is lost and nothing is suspect.)
    let regressed = committed.is_some_and(|c| newest_checkpoint < c);
    assert_eq!(suspect, regressed, "falling back past committed steps (newest committed {committed:?}, checkpoint {newest_checkpoint}) is reported, and only then");
    assert_eq!(last + 1, STEPS);
    assert!(identical);
    let acc = eval.iter().find(|(k, _)| k == "acc").map(|(_, v)| *v).unwrap_or_default();
    assert!(acc > 0.70, "accuracy {acc}");
    supervisor.join().await?;
    assert_eq!(fresh.await??, WorkerOutcome::Finished);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

// Goal: after a member is lost, the survivor that is the new generation's source keeps its
// optimizer where it is (on a GPU: no 1.5 GB state round trip through the host) and the replicas
// stay bit-identical with the one that loaded the broadcast state. Method: three workers whose
// parameters stay in the module (the GPU path's host staging, on the CPU); one is dropped at
// step 30; the two survivors finish. Each worker counts the optimizers its job built: one for the
// state template and one per generation it trained, less one for every generation it reused its
// own; the new source must have built only two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_source_keeps_its_optimizer_in_place_after_a_loss_and_replicas_stay_identical() -> anyhow::Result<()> {
    let mut opts = options("secret");
    opts.elastic.start_workers = 3;
    opts.elastic.max_workers = 3;
    let mut supervisor = SupervisorHandle::start(opts, None).await?;
    let addr = supervisor.addr;
    let counters: Vec<Arc<AtomicUsize>> = (0..3).map(|_| Arc::default()).collect();
    let workers: Vec<_> = (0..3)
        .map(|i| {
            let built = Arc::clone(&counters[i]);
            tokio::spawn(run_worker(WorkerOptions::new(addr, "secret".into(), format!("worker-{i}")), move |_spec| Ok(Fashion { staged: true, optimizers_built: built, ..Fashion::load() })))
        })
        .collect();
    let mut killed = false;
    let mut worlds = Vec::new();
    let (eval, identical) = loop {
        match tokio::time::timeout(Duration::from_secs(120), supervisor.events.recv()).await?.ok_or_else(|| anyhow::anyhow!("events ended"))? {
            JobEvent::Generation { world, .. } => worlds.push(world),
            JobEvent::Committed { step, .. } if step >= 30 && !killed => {
                workers[2].abort();
                killed = true;
            }
            JobEvent::Finished { eval, replicas_identical, .. } => break (eval, replicas_identical),
            JobEvent::Failed { reason } => anyhow::bail!("job failed: {reason}"),
            _ => {}
        }
    };
    assert!(identical, "replicas must be bit-identical after the reuse");
    assert_eq!(worlds.first(), Some(&3));
    assert_eq!(worlds.last(), Some(&2), "the survivors trained on: {worlds:?}");
    let acc = eval.iter().find(|(k, _)| k == "acc").map(|(_, v)| *v).unwrap_or_default();
    assert!(acc > 0.70, "accuracy {acc}");
    supervisor.join().await?;
    let mut survivors = Vec::new();
    for (i, w) in workers.into_iter().enumerate().take(2) {
        assert_eq!(w.await??, WorkerOutcome::Finished);
        survivors.push(counters[i].load(Ordering::SeqCst));
    }
    println!("optimizers built by the survivors: {survivors:?} over generations of {worlds:?}");
    assert_eq!(survivors.iter().min(), Some(&2), "the new source must reuse its optimizer: builds {survivors:?}");
    Ok(())
}

/// Runs the job under `sharding` with `workers` workers (`staged`: parameters stay in the module,
/// the path of a GPU model), aborting worker `workers - 1` once step `abort_at` is committed;
/// returns every committed step's (step, loss, world), the generations' worlds, whether the
/// replicas finished bit-identical, and the final checksum.
async fn zero_run(
    sharding: DpSharding,
    staged: bool,
    workers: usize,
    abort_at: Option<u64>,
) -> anyhow::Result<(Vec<(u64, u64, usize)>, Vec<usize>, bool, u64)> {
    let mut opts = options("secret");
    opts.elastic.start_workers = workers;
    opts.elastic.max_workers = workers;
    opts.elastic.sharding = sharding;
    let mut supervisor = SupervisorHandle::start(opts, None).await?;
    let addr = supervisor.addr;
    let handles: Vec<_> = (0..workers)
        .map(|i| {
            tokio::spawn(run_worker(WorkerOptions::new(addr, "secret".into(), format!("worker-{i}")), move |_spec| Ok(Fashion { staged, ..Fashion::load() })))
        })
        .collect();
    let (mut commits, mut worlds, mut aborted) = (Vec::new(), Vec::new(), false);
    let (identical, checksum) = loop {
        match tokio::time::timeout(Duration::from_secs(120), supervisor.events.recv()).await?.ok_or_else(|| anyhow::anyhow!("events ended"))? {
            JobEvent::Generation { world, .. } => worlds.push(world),
            JobEvent::Committed { step, loss, world, .. } => {
                commits.push((step, loss.to_bits(), world));
                if abort_at.is_some_and(|at| step >= at) && !aborted {
                    handles[workers - 1].abort();
                    aborted = true;
                }
            }
            JobEvent::Finished { replicas_identical, checksum, .. } => break (replicas_identical, checksum),
            JobEvent::Failed { reason } => anyhow::bail!("job failed: {reason}"),
            _ => {}
        }
    };
    supervisor.join().await?;
    for (i, w) in handles.into_iter().enumerate() {
        if abort_at.is_none() || i + 1 < workers {
            assert_eq!(w.await??, WorkerOutcome::Finished);
        }
    }
    Ok((commits, worlds, identical, checksum))
}

// Goal: an elastic ZeRO-1/2 job whose parameters stay in the module (host staging: the path a GPU
// job takes, `[train] device = "cuda"` with `[elastic] sharding = "zero1"`) trains exactly as the
// unstaged ZeRO-1 job: the same committed loss bits at every step and the same final parameters;
// and a staged ZeRO-1 job that loses one of three workers rebuilds the state from the buddy
// segment copies (exports of device shards are host data) and loses no step. Method: the real
// supervisor and workers over QUIC on loopback, Fashion-MNIST softmax regression.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_zero_jobs_match_the_unstaged_zero1_job_and_recover_from_buddies() -> anyhow::Result<()> {
    let (reference, _, identical, checksum) = zero_run(DpSharding::Zero1, false, 2, None).await?;
    assert!(identical);
    assert_eq!(reference.len() as u64, STEPS);
    for sharding in [DpSharding::Zero1, DpSharding::Zero2] {
        let (commits, _, staged_identical, staged_checksum) = zero_run(sharding, true, 2, None).await?;
        assert!(staged_identical, "{sharding:?}: replicas bit-identical");
        assert_eq!(commits, reference, "{sharding:?} staged: committed losses differ from unstaged zero1");
        assert_eq!(staged_checksum, checksum, "{sharding:?} staged: final parameters differ from unstaged zero1");
    }
    let (commits, worlds, identical, _) = zero_run(DpSharding::Zero1, true, 3, Some(30)).await?;
    assert!(identical, "replicas bit-identical after the recovery");
    assert_eq!(worlds.first(), Some(&3));
    assert_eq!(worlds.last(), Some(&2), "the survivors trained on: {worlds:?}");
    let mut steps: Vec<u64> = commits.iter().map(|c| c.0).collect();
    steps.dedup();
    assert_eq!(steps, (0..STEPS).collect::<Vec<_>>(), "every step committed once, in order: none lost, none re-run");
    Ok(())
}

/// Snapshot interval of [`copies_run`].
const SNAPSHOT_EVERY: u64 = 10;

/// What [`copies_run`] saw: every commit (step, loss bits, world, generation) in commit order,
/// every generation's (world, next step), the final checksum, whether the replicas finished
/// bit-identical, and the suspect events.
struct CopiesRun {
    commits: Vec<(u64, u64, usize, u64)>,
    generations: Vec<(usize, u64)>,
    checksum: u64,
    identical: bool,
    suspects: Vec<String>,
}

/// Three workers train under `sharding` with `[elastic] zero_copies = copies` and a snapshot every
/// [`SNAPSHOT_EVERY`] steps. With `lose_at`, worker 2 is dropped once step `lose_at` is committed,
/// and a fresh worker joins once the loss is seen: with `min_workers = 3` the job waits for it, so
/// every step trains at world 3 and a re-run step must commit the loss bits of its first run.
async fn copies_run(sharding: DpSharding, copies: ZeroCopies, lose_at: Option<u64>) -> anyhow::Result<CopiesRun> {
    let mut opts = options("secret");
    opts.elastic.start_workers = 3;
    opts.elastic.min_workers = 3;
    opts.elastic.max_workers = 3;
    opts.elastic.sharding = sharding;
    opts.elastic.zero_copies = copies;
    opts.elastic.snapshot_every = SNAPSHOT_EVERY;
    opts.elastic.validate()?;
    let mut supervisor = SupervisorHandle::start(opts, None).await?;
    let addr = supervisor.addr;
    let spawn = |name: String| tokio::spawn(run_worker(WorkerOptions::new(addr, "secret".into(), name), |_spec| Ok(Fashion::load())));
    let mut handles: Vec<_> = (0..3).map(|i| spawn(format!("worker-{i}"))).collect();
    let (mut commits, mut generations, mut suspects, mut dropped, mut replaced) = (Vec::new(), Vec::new(), Vec::new(), false, false);
    let (identical, checksum) = loop {
        match tokio::time::timeout(Duration::from_secs(120), supervisor.events.recv()).await?.ok_or_else(|| anyhow::anyhow!("events ended"))? {
            JobEvent::Generation { world, next_step, .. } => generations.push((world, next_step)),
            JobEvent::Committed { step, loss, world, generation, .. } => {
                commits.push((step, loss.to_bits(), world, generation));
                if lose_at.is_some_and(|at| step >= at) && !dropped {
                    handles[2].abort();
                    dropped = true;
                }
            }
            JobEvent::Lost { .. } if dropped && !replaced => {
                handles.push(spawn("worker-replacement".into()));
                replaced = true;
            }
            JobEvent::Suspect { reason } => suspects.push(reason),
            JobEvent::Finished { replicas_identical, checksum, .. } => break (replicas_identical, checksum),
            JobEvent::Failed { reason } => anyhow::bail!("job failed: {reason}"),
            _ => {}
        }
    };
    supervisor.join().await?;
    for (i, w) in handles.into_iter().enumerate() {
        if !(dropped && i == 2) {
            assert_eq!(w.await??, WorkerOutcome::Finished);
        }
    }
    Ok(CopiesRun { commits, generations, checksum, identical, suspects })
}

// Goal: `[elastic] zero_copies = "snapshot"` (no per-step exchange of segment states) changes
// nothing while nothing fails: ZeRO-1 and ZeRO-2 commit the buddy job's loss bits at every step
// and end at its parameters. When one worker of three is lost mid-run, the job rolls back to the
// last snapshot, re-runs exactly the steps since (as many as the snapshot interval implies) with
// the same loss bits as the uninterrupted run, reports no suspect fall back (the rollback is the
// configured trade-off), and ends bit-identical. Method: the real supervisor and workers over
// QUIC on loopback; a replacement keeps the world at 3, so the re-run steps see the same batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_zero_copies_commit_the_buddy_losses_and_a_loss_reruns_the_steps_since_the_snapshot_bit_for_bit() -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let reference = copies_run(DpSharding::Zero1, ZeroCopies::Buddy, None).await?;
    assert!(reference.identical);
    let steps = |r: &CopiesRun| r.commits.iter().map(|c| (c.0, c.1, c.2)).collect::<Vec<_>>();
    let expected = steps(&reference);
    assert_eq!(expected.iter().map(|c| c.0).collect::<Vec<_>>(), (0..STEPS).collect::<Vec<_>>());
    for sharding in [DpSharding::Zero1, DpSharding::Zero2] {
        let run = copies_run(sharding, ZeroCopies::Snapshot, None).await?;
        assert!(run.identical, "{sharding:?}: replicas bit-identical");
        assert_eq!(steps(&run), expected, "{sharding:?} with snapshot copies: committed losses differ from the buddy job's");
        assert_eq!(run.checksum, reference.checksum, "{sharding:?} with snapshot copies: final parameters differ");
        assert_eq!(run.generations, vec![(3, 0)]);
    }

    let lossy = copies_run(DpSharding::Zero1, ZeroCopies::Snapshot, Some(33)).await?;
    assert_eq!(lossy.generations.len(), 2, "one re-formation: {:?}", lossy.generations);
    assert!(lossy.generations.iter().all(|(world, _)| *world == 3), "{:?}", lossy.generations);
    let last_before = lossy.commits.iter().filter(|c| c.3 == 1).map(|c| c.0).max().expect("commits before the loss");
    let resumed_at = lossy.generations[1].1;
    let rerun = last_before + 1 - resumed_at;
    println!("snapshot copies: lost after committing step {last_before}, resumed at {resumed_at}: {rerun} steps re-run (snapshot_every {SNAPSHOT_EVERY})");
    assert_eq!(resumed_at, (last_before + 1) / SNAPSHOT_EVERY * SNAPSHOT_EVERY, "rolled back to the last snapshot, not further");
    assert_eq!(rerun, (last_before + 1) % SNAPSHOT_EVERY, "the steps since the last snapshot run again, and only they");
    let after: Vec<u64> = lossy.commits.iter().filter(|c| c.3 > 1).map(|c| c.0).collect();
    assert_eq!(after, (resumed_at..STEPS).collect::<Vec<_>>(), "after the rollback every step commits once, in order");
    for &(step, loss, world, generation) in &lossy.commits {
        assert_eq!((step, loss, world), expected[step as usize], "generation {generation}: step {step} committed other loss bits than the uninterrupted run");
    }
    assert!(lossy.identical, "replicas bit-identical after the rollback");
    assert_eq!(lossy.checksum, reference.checksum, "the rolled-back run ends at the uninterrupted run's parameters");
    assert!(lossy.suspects.is_empty(), "a planned rollback is not suspect: {:?}", lossy.suspects);

    // The same loss with buddy copies re-runs at most the step in flight (same bits too).
    let buddy = copies_run(DpSharding::Zero1, ZeroCopies::Buddy, Some(33)).await?;
    let last_before = buddy.commits.iter().filter(|c| c.3 == 1).map(|c| c.0).max().expect("commits before the loss");
    assert!(buddy.generations[1].1 > last_before, "buddy copies: nothing committed runs again ({:?}, last {last_before})", buddy.generations);
    for &(step, loss, world, _) in &buddy.commits {
        assert_eq!((step, loss, world), expected[step as usize], "buddy copies: step {step} after the loss");
    }
    assert_eq!(buddy.checksum, reference.checksum);
    println!("zero_copies test: {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// What a [`network_run`] job committed: its generations' (world, transport name), every step's
/// loss bits, the final checksum and whether the replicas finished bit-identical.
struct NetworkRun {
    generations: Vec<(usize, &'static str)>,
    losses: Vec<(u64, u64)>,
    checksum: u64,
    identical: bool,
}

/// Workers `i` on machine `machines[i]` train one job whose collectives take `layout` and cross
/// processes over `data`. Each worker joins only once the one before it was admitted: ranks
/// follow join order, and a routed job's sums depend on which machine each rank is on (its
/// hierarchical all-reduce adds inside a machine first), so two runs are comparable bit for bit
/// only with the same machine of every rank. Under TLS the workers' QUIC options are unusable
/// (zero stripes, which `QuicTransport::bind` refuses), so the job finishes only if every worker
/// bound TLS at `Prepare` as the supervisor told it to, not the QUIC endpoint it would bind by
/// default. `channels`: `[elastic] channels`; `outputs`: the model's ([`Fashion::outputs`]).
async fn network_run(layout: Wire, data: DataTransport, machines: &[&str], channels: usize, outputs: usize) -> anyhow::Result<NetworkRun> {
    let mut opts = options("secret");
    opts.elastic.start_workers = machines.len();
    opts.elastic.max_workers = machines.len();
    opts.elastic.transport = layout;
    opts.elastic.data_transport = data;
    opts.elastic.channels = channels;
    opts.elastic.validate()?;
    let mut supervisor = SupervisorHandle::start(opts, None).await?;
    let addr = supervisor.addr;
    let (mut workers, mut joined) = (Vec::new(), Vec::new());
    for (i, machine) in machines.iter().enumerate() {
        let mut worker = WorkerOptions::new(addr, "secret".into(), format!("worker-{i}"));
        if data == DataTransport::Tls {
            worker.quic.stripes = 0;
        }
        let env = NodeEnv { host: Some(machine.to_string()), ..NodeEnv::process() };
        workers.push(tokio::spawn(run_node(worker, env, move |_spec| Ok(Fashion { outputs, ..Fashion::load() }))));
        // No generation starts before the last worker joins (`start_workers`).
        match tokio::time::timeout(Duration::from_secs(30), supervisor.events.recv()).await?.ok_or_else(|| anyhow::anyhow!("events ended"))? {
            JobEvent::Joined { node, .. } => joined.push(node),
            other => anyhow::bail!("worker {i}: expected it to join, got {other:?}"),
        }
    }
    let (mut generations, mut losses) = (Vec::new(), Vec::new());
    let (identical, checksum) = loop {
        match tokio::time::timeout(Duration::from_secs(120), supervisor.events.recv()).await?.ok_or_else(|| anyhow::anyhow!("events ended"))? {
            JobEvent::Generation { world, transport, nodes, .. } => {
                anyhow::ensure!(nodes == joined, "ranks in join order: {nodes:?}, joined {joined:?}");
                generations.push((world, transport));
            }
            JobEvent::Committed { step, loss, .. } => losses.push((step, loss.to_bits())),
            JobEvent::Finished { replicas_identical, checksum, .. } => break (replicas_identical, checksum),
            JobEvent::Failed { reason } => anyhow::bail!("{data:?} job failed: {reason}"),
            JobEvent::Lost { reason, .. } => anyhow::bail!("{data:?} job lost a worker: {reason}"),
            _ => {}
        }
    };
    supervisor.join().await?;
    for w in workers {
        assert_eq!(w.await??, WorkerOutcome::Finished);
    }
    Ok(NetworkRun { generations, losses, checksum, identical })
}

// Goal: `[elastic] data_transport = "tls"` carries the workers' collectives between processes
// over TCP with mutual TLS 1.3 and changes nothing else: two workers on the network layout
// (`transport = "quic"`: the network between every pair, though both share this machine) and
// four on two "machines" (routed: shared memory inside each, the network between, hierarchical
// all-reduce) commit every step with the loss bits of the same job over QUIC and end at its
// parameters, bit-identical across replicas. Method: the real supervisor and workers, real TCP,
// UDP and shared memory on loopback; the TLS workers cannot bind QUIC (see `network_run`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_data_transport_trains_the_quic_jobs_replicas_bit_for_bit_flat_and_routed() -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let cases: [(Wire, &[&str], [&str; 2]); 2] = [(Wire::Quic, &["m", "m"], ["quic", "tls"]), (Wire::Auto, &["machine-0", "machine-0", "machine-1", "machine-1"], ["routed", "routed-tls"])];
    for (layout, machines, [quic_name, tls_name]) in cases {
        let world = machines.len();
        let quic = network_run(layout, DataTransport::Quic, machines, 1, 10).await?;
        let tls = network_run(layout, DataTransport::Tls, machines, 1, 10).await?;
        assert_eq!(quic.generations, vec![(world, quic_name)], "the QUIC job ran one generation over {quic_name}");
        assert_eq!(tls.generations, vec![(world, tls_name)], "the TLS job ran one generation over {tls_name}");
        assert_eq!(quic.losses.iter().map(|l| l.0).collect::<Vec<_>>(), (0..STEPS).collect::<Vec<_>>(), "every step committed once, in order");
        assert!(quic.identical && tls.identical, "{tls_name}: replicas bit-identical (quic {}, tls {})", quic.identical, tls.identical);
        assert_eq!(tls.losses, quic.losses, "{tls_name}: committed losses differ from the QUIC job's");
        assert_eq!(tls.checksum, quic.checksum, "{tls_name}: final parameters differ from the QUIC job's");
    }
    println!("data_transport test: {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

// Goal: `[elastic] channels = 2` reaches the workers (their endpoints split large all-reduces into
// two rings, their DP communication runtime has two threads) and the job trains as before: one
// generation on the network layout, every step committed once and in order, no worker lost, and
// replicas bit-identical at the end. Method: the real supervisor and three workers over QUIC on
// loopback (`transport = "quic"` forces the network between them on one machine, where the flat
// ring, the only all-reduce channels split, runs); the model has `WIDE_OUTPUTS` outputs, so its
// weight's bucket (3.2 MB) is split in two (each ring moves at least a full 512 KiB frame per
// rank). The same job with one ring shows the split happened: with three ranks, rings over other
// parts of the buffer add the three gradients in another order, so the last bits differ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_channels_train_with_identical_replicas_over_the_network_layout() -> anyhow::Result<()> {
    const WIDE_OUTPUTS: usize = 1024;
    let started = std::time::Instant::now();
    let machines = ["m", "m", "m"];
    let two = network_run(Wire::Quic, DataTransport::Quic, &machines, 2, WIDE_OUTPUTS).await?;
    let one = network_run(Wire::Quic, DataTransport::Quic, &machines, 1, WIDE_OUTPUTS).await?;
    for (channels, run) in [(2, &two), (1, &one)] {
        assert_eq!(run.generations, vec![(3, "quic")], "channels = {channels}: one generation over QUIC");
        assert_eq!(run.losses.iter().map(|l| l.0).collect::<Vec<_>>(), (0..STEPS).collect::<Vec<_>>(), "channels = {channels}: every step committed once, in order");
        assert!(run.losses.iter().all(|l| f64::from_bits(l.1).is_finite()), "channels = {channels}: finite losses");
        assert!(run.identical, "channels = {channels}: replicas bit-identical");
    }
    let differing = two.losses.iter().zip(&one.losses).filter(|(a, b)| a != b).count();
    println!("channels test: {:.1} s; losses differing from one ring's in {differing}/{STEPS} steps, checksums {:x} and {:x}", started.elapsed().as_secs_f64(), two.checksum, one.checksum);
    assert_ne!(two.checksum, one.checksum, "two channels end at one ring's bits: the split did not reach the collectives");
    Ok(())
}
