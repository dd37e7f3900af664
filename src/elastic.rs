//! The distributed commands of `rtx`: `launch` (supervisor + N local worker processes, the
//! default way to train), `supervisor` and `worker` (for clusters: Slurm, Kubernetes, SSH, with
//! torchrun's and Slurm's variables understood), and `status`.
//!
//! `rtx launch` runs the supervisor in this process and starts the workers as child processes of
//! the same binary (`rtx worker`), each with `RTX_NUM_THREADS` = cores / N so they do not fight
//! over cores, output in `<out>/logs/worker-<i>.log`. It shows one progress bar for the job and
//! writes `metrics.jsonl` (one line per `log_every` committed steps, with world size and
//! generation), `events.jsonl` (every membership event, with seconds since launch), `cluster.json`
//! (the current generation's worker pids), `summary.json` and `loss.png` into the output folder.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use rtx_supervisor::checkpoint as elastic_checkpoint;
use rtx_supervisor::worker::checkpoint_folder as worker_checkpoint_folder;
use rtx_supervisor::{env as cluster_env, protocol, DpSharding, ElasticConfig, JobEvent, LaunchOptions, Launcher, SupervisorHandle, SupervisorOptions, WorkerOptions, WorkerOutcome};
use rtx_tensor::data::{DataRoot, DATA_DIR_ENV};
use serde_json::json;

use crate::cli::{JobArgs, LaunchArgs, StatusArgs, SupervisorArgs, WorkerArgs};
use crate::config::{ConfigError, TrainConfig};
use crate::live::{self, JobInfo, LiveFeed, LiveServer};
use crate::metrics::{MetricRecord, MetricsWriter};
use crate::progress::{human, Progress, Verbosity};
use crate::train::elastic_job::ElasticJob;

/// Environment variable carrying the cluster token to workers (never put on a command line).
pub const TOKEN_ENV: &str = "RTX_TOKEN";
/// Environment variable telling workers the run folder (checkpoints go to `<it>/checkpoints`).
pub const RUN_DIR_ENV: &str = "RTX_RUN_DIR";

/// How `rtx launch` starts a worker process: `program args... --join ADDR`.
#[derive(Clone, Debug)]
pub struct WorkerCommand {
    /// The executable (the `rtx` binary, or a Python interpreter).
    pub program: PathBuf,
    /// Arguments before `--join ADDR` (`worker` for `rtx`, `-m rustytorch._worker` for Python).
    pub args: Vec<String>,
}

impl WorkerCommand {
    /// This very binary, run as `rtx worker`.
    pub fn current_rtx() -> anyhow::Result<WorkerCommand> {
        let program = std::env::current_exe().context("cannot find the rtx binary to start workers")?;
        Ok(WorkerCommand { program, args: vec!["worker".into()] })
    }
}

/// Called with every job event of a launched job and the seconds since launch, after the event
/// is written to `events.jsonl` (the Python package's job handle folds them into its state).
pub type EventObserver = Box<dyn Fn(&JobEvent, f64) + Send + Sync>;

/// `rtx launch`: supervisor here, `nproc` workers as child processes.
pub fn launch(args: LaunchArgs) -> anyhow::Result<()> {
    launch_with(args, WorkerCommand::current_rtx()?, None)
}

/// [`launch`] with the worker processes started as `workers` and every event also handed to
/// `observer`.
pub fn launch_with(args: LaunchArgs, workers: WorkerCommand, observer: Option<EventObserver>) -> anyhow::Result<()> {
    let job = JobFiles::prepare(&args.config, &args.job)?;
    let mut elastic = job.elastic(args.nproc, &args.job)?;
    if args.nproc == 0 {
        bail!("--nproc must be at least 1");
    }
    // `[parallel]` against the world, before any worker starts.
    job.config.mesh(args.nproc).with_context(|| format!("config {} with --nproc {}", args.config.display(), args.nproc))?;
    elastic.start_workers = args.nproc;
    elastic.validate()?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async move {
        let token = protocol::generate_token().map_err(|e| anyhow!(e))?;
        let (requests_tx, requests_rx) = tokio::sync::mpsc::channel(64);
        let options = job.supervisor_options("127.0.0.1:0".parse()?, token.clone(), elastic);
        let supervisor = SupervisorHandle::start(options, Some(requests_tx)).await?;
        write_private(&job.out_dir.join("token"), &token)?;
        let live = start_live(&job, &args.config, args.job.http, supervisor.addr).await?;
        let threads = (std::thread::available_parallelism().map_or(2, |n| n.get()) / args.nproc).max(1);
        let mut worker_args = workers.args;
        worker_args.extend(["--join".to_string(), supervisor.addr.to_string()]);
        let launch = LaunchOptions {
            program: workers.program,
            args: worker_args,
            env: vec![
                (TOKEN_ENV.into(), token),
                (DATA_DIR_ENV.into(), job.data_root.path().display().to_string()),
                (RUN_DIR_ENV.into(), job.out_dir.display().to_string()),
                ("RTX_NUM_THREADS".into(), threads.to_string()),
                ("RUST_LOG".into(), std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into())),
            ],
            log_dir: Some(job.out_dir.join("logs")),
            grace: Duration::from_secs(5),
        };
        let launcher = Launcher::start(launch, args.nproc, supervisor.actor(), requests_rx)?;
        let verbosity = if args.job.no_progress { Verbosity::Lines } else { Verbosity::Auto };
        let outcome = follow(supervisor, &job, verbosity, live.as_ref().map(LiveServer::feed), observer.as_ref()).await;
        launcher.shutdown().await;
        if let Some(live) = live {
            live.stop().await;
        }
        outcome
    })
}

/// `rtx supervisor`: the supervisor of a cluster job; workers join with `rtx worker`.
pub fn supervise(args: SupervisorArgs) -> anyhow::Result<()> {
    let job = JobFiles::prepare(&args.config, &args.job)?;
    let env = cluster_env::from_env(|k| std::env::var(k).ok())?;
    let listen = match (args.listen, &env) {
        (Some(addr), _) => addr,
        (None, Some(e)) => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), e.master_port),
        (None, None) => bail!("give --listen ADDR (or set MASTER_PORT / run under torchrun or Slurm)"),
    };
    let expected = args.nproc.or(env.as_ref().map(|e| e.world_size)).unwrap_or(1);
    job.config.mesh(expected).with_context(|| format!("config {} with {expected} workers", args.config.display()))?;
    let mut elastic = job.elastic(expected, &args.job)?;
    elastic.start_workers = expected;
    elastic.validate()?;
    let token = match std::env::var(TOKEN_ENV) {
        Ok(t) if !t.is_empty() => t,
        _ => protocol::generate_token().map_err(|e| anyhow!(e))?,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async move {
        let options = job.supervisor_options(listen, token.clone(), elastic);
        let port_hint = if args.listen.is_some() { "choose another --listen port" } else { "another job's supervisor on this node? set MASTER_PORT, or --listen" };
        let supervisor = SupervisorHandle::start(options, None).await.with_context(|| format!("cannot listen on {listen} ({port_hint})"))?;
        let live = start_live(&job, &args.config, args.job.http, supervisor.addr).await?;
        let token_file = job.out_dir.join("token");
        write_private(&token_file, &token)?;
        eprintln!("supervisor listening on {}; waiting for {expected} worker(s)", supervisor.addr);
        eprintln!("join with: {TOKEN_ENV}=$(cat {}) rtx worker --join <this host>:{}", token_file.display(), supervisor.addr.port());
        let outcome = follow(supervisor, &job, if args.job.no_progress { Verbosity::Lines } else { Verbosity::Auto }, live.as_ref().map(LiveServer::feed), None).await;
        if let Some(live) = live {
            live.stop().await;
        }
        outcome
    })
}

/// `rtx worker`: joins a supervisor and trains until the job ends.
pub fn worker(args: WorkerArgs) -> anyhow::Result<()> {
    let env = cluster_env::from_env(|k| std::env::var(k).ok())?;
    let join_text = match (&args.join, &env) {
        (Some(j), _) => j.clone(),
        (None, Some(e)) => e.master(),
        (None, None) => bail!("give --join ADDR (or run under torchrun / Slurm, whose MASTER_ADDR or SLURM_NODELIST name the supervisor)"),
    };
    let join = join_text.to_socket_addrs().with_context(|| format!("cannot resolve the supervisor address {join_text}"))?.next().ok_or_else(|| anyhow!("{join_text} resolves to no address"))?;
    let token = match args.token.clone().or_else(|| std::env::var(TOKEN_ENV).ok()) {
        Some(t) if !t.is_empty() => t,
        _ => bail!("no cluster token: set {TOKEN_ENV} (or pass --token)"),
    };
    let data_root = DataRoot::resolve(args.data_dir.as_deref(), std::env::var_os(DATA_DIR_ENV).as_deref());
    // Checkpoints: RTX_RUN_DIR when set (an override), else the run folder the supervisor hands
    // over at join (shared with this machine on a cluster filesystem).
    let run_dir_override = std::env::var_os(RUN_DIR_ENV).filter(|d| !d.is_empty()).map(PathBuf::from);
    // Kernel threads: RTX_NUM_THREADS, else Slurm's CPUs per task; sized before any kernel runs.
    if let Some(threads) = cluster_env::threads_from_env(|k| std::env::var(k).ok())? {
        // Fails only when the pool was already built (then the kernels use that one).
        let _ = rayon::ThreadPoolBuilder::new().num_threads(threads).build_global();
    }
    let index = std::env::var("RTX_WORKER_INDEX").ok().or(env.as_ref().map(|e| e.rank.to_string())).unwrap_or_else(|| std::process::id().to_string());
    let mut options = WorkerOptions::new(join, token, format!("worker-{index}"));
    options.quic.stripes = match (args.quic_stripes, std::env::var("RTX_QUIC_STRIPES").ok()) {
        (Some(n), _) => n,
        (None, Some(text)) => text.trim().parse().with_context(|| format!("RTX_QUIC_STRIPES={text:?} is not a number of connections"))?,
        (None, None) => 1,
    };
    if options.quic.stripes == 0 || options.quic.stripes > rtx_collectives::MAX_STRIPES {
        bail!("--quic-stripes {} is out of range: 1 to {} QUIC connections per worker pair", options.quic.stripes, rtx_collectives::MAX_STRIPES);
    }
    if !join.ip().is_loopback() {
        options.bind_ip = local_ip_towards(join).unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    }
    // The process's index on this machine picks its GPU (`cuda:(index mod devices)`): `rtx launch`
    // numbers its workers, torchrun and Slurm give a local rank.
    let local_rank = std::env::var("RTX_WORKER_INDEX").ok().and_then(|i| i.parse::<usize>().ok()).or(env.as_ref().map(|e| e.local_rank)).unwrap_or(0);
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let outcome = runtime.block_on(rtx_supervisor::run_worker(options, move |spec| {
        let checkpoint_dir = match &run_dir_override {
            Some(dir) => worker_checkpoint_folder(Some(dir), RUN_DIR_ENV),
            None => worker_checkpoint_folder(spec.run_dir.as_deref(), "the supervisor"),
        };
        ElasticJob::for_worker(spec, &data_root, checkpoint_dir, local_rank)
    }));
    match outcome {
        Ok(WorkerOutcome::Finished) => Ok(()),
        Ok(WorkerOutcome::Evicted(reason)) => {
            eprintln!("worker left the job: {reason}");
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// `rtx status`: members, generation, step and throughput of a running job.
pub fn status(args: StatusArgs) -> anyhow::Result<()> {
    let addr = args.addr.to_socket_addrs()?.next().ok_or_else(|| anyhow!("{} resolves to no address", args.addr))?;
    let token = match args.token.clone().or_else(|| std::env::var(TOKEN_ENV).ok()) {
        Some(t) => t,
        None => bail!("no cluster token: set {TOKEN_ENV} (or pass --token)"),
    };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let report = runtime.block_on(rtx_supervisor::query_status(addr, &token, Default::default()))?;
    println!("phase {} | generation {} | committed step {} of {} | {:.1} steps/s, {} samples/s | failures {}", report.phase, report.generation, report.committed.map_or("-".into(), |s| (s + 1).to_string()), report.total_steps, report.steps_per_sec, human(report.samples_per_sec), report.failures);
    println!("{:>6} {:>5} {:>8} {:<14} {:<8} {:>10}", "node", "rank", "pid", "name", "role", "completed");
    for m in &report.members {
        println!("{:>6} {:>5} {:>8} {:<14} {:<8} {:>10}", m.node, m.rank.map_or("-".into(), |r| r.to_string()), m.pid, m.name, m.role, m.completed.map_or("-".into(), |s| (s + 1).to_string()));
    }
    Ok(())
}

/// The files and settings of one job.
struct JobFiles {
    text: String,
    config: TrainConfig,
    out_dir: PathBuf,
    data_root: DataRoot,
    resume: Option<(PathBuf, u64)>,
    stop_at: Option<u64>,
    started: Instant,
}

impl JobFiles {
    fn prepare(config_path: &Path, args: &JobArgs) -> anyhow::Result<JobFiles> {
        let (out, resume, data_dir) = (args.out.as_deref(), args.resume, args.data_dir.as_deref());
        let text = std::fs::read_to_string(config_path).with_context(|| format!("cannot read config {}", config_path.display()))?;
        let config = TrainConfig::from_toml_str(&text).with_context(|| format!("config {}", config_path.display()))?;
        let out_dir = out.map(Path::to_path_buf).unwrap_or_else(|| config.default_output_dir(Some(config_path)));
        let out_dir = std::path::absolute(&out_dir).unwrap_or(out_dir);
        let data_root = DataRoot::resolve(data_dir, std::env::var_os(DATA_DIR_ENV).as_deref());
        let data_root = DataRoot::new(std::path::absolute(data_root.path()).unwrap_or_else(|_| data_root.path().to_path_buf()));
        // Fail here, with the fetch command, rather than in every worker.
        // Also fails here, before any worker starts, when `device = "cuda"` cannot run.
        ElasticJob::new(&text, &data_root, None, 0).map_err(|e| anyhow!(e))?;
        std::fs::create_dir_all(&out_dir).with_context(|| format!("cannot create output folder {}", out_dir.display()))?;
        // A mesh job ([parallel] pp or tp above 1) writes sharded checkpoints (a folder per step),
        // which any mesh shape resumes from; a data-parallel job single files.
        let sharded = config.parallel.pp * config.parallel.tp > 1;
        let checkpoints = out_dir.join("checkpoints");
        // A data-parallel job resumes from the newer of the two (a sharded one read whole).
        let sharded_step = |path: &Path| -> anyhow::Result<u64> {
            Ok(rtx_tensor::checkpoint::sharded::ShardedCheckpoint::open(path).with_context(|| format!("cannot resume from {}", path.display()))?.step())
        };
        let newest_sharded = elastic_checkpoint::latest_sharded(&checkpoints).map(|p| sharded_step(&p).map(|s| (p, s))).transpose()?;
        let newest_file = if sharded { None } else { elastic_checkpoint::latest(&checkpoints).map(|p| rtx_tensor::checkpoint::read_meta(&p).map(|m| (p, m.step))).transpose()? };
        let checkpoint = match (newest_sharded, newest_file) {
            (Some(s), Some(f)) => Some(if s.1 > f.1 { s } else { f }),
            (s, f) => s.or(f),
        };
        let resume = match (resume, checkpoint) {
            (true, Some((path, step))) => Some((path, step + 1)),
            (true, None) => None,
            (false, _) if out_dir.join("metrics.jsonl").exists() => bail!("output folder {} holds an earlier run; pass --resume to continue it, or --out DIR for a fresh one", out_dir.display()),
            (false, _) => None,
        };
        Ok(JobFiles { text, config, out_dir, data_root, resume, stop_at: args.steps, started: Instant::now() })
    }

    fn elastic(&self, nproc: usize, args: &JobArgs) -> anyhow::Result<ElasticConfig> {
        let (min, max) = (args.min_workers, args.max_workers);
        let mut elastic = ElasticConfig { max_workers: nproc.max(1), start_workers: nproc.max(1), checkpoint_every: self.config.train.checkpoint_every, ..ElasticConfig::default() };
        if let Some(table) = &self.config.elastic {
            elastic.apply_toml(table)?;
        }
        if let Some(m) = min {
            elastic.min_workers = m;
        }
        if let Some(m) = max {
            elastic.max_workers = m;
        }
        elastic.max_workers = elastic.max_workers.max(nproc);
        // A model-parallel job forms generations of whole replicas of pp·tp members.
        (elastic.pp, elastic.tp) = (self.config.parallel.pp, self.config.parallel.tp);
        // What the supervisor needs to re-partition a mesh over fewer members (`[elastic]
        // repartition`, on by default).
        if elastic.pp * elastic.tp > 1 {
            elastic.mesh_model = self.config.model_layout().map(|layout| rtx_supervisor::MeshModel { dims: layout.dims(), chunks: self.config.parallel.chunks() });
        }
        // `[parallel] zero`: what `rtx plan` plans for every stage, the runtime runs for ZeRO-1,
        // ZeRO-2 and ZeRO-3 of a data-parallel job (the engines of `[elastic] sharding = "zero1"`,
        // "zero2", "zero3"); anything else is refused here rather than silently trained replicated.
        match (self.config.parallel.zero, elastic.pp * elastic.tp) {
            (0, _) => {}
            (1, 1) => elastic.sharding = DpSharding::Zero1,
            (2, 1) => elastic.sharding = DpSharding::Zero2,
            (3, 1) => elastic.sharding = DpSharding::Zero3,
            (z, _) => bail!("parallel.zero = {z} with pp = {} and tp = {}: the runtime shards optimizer state, gradients and parameters only for data-parallel jobs (pp = tp = 1) today; set parallel.zero = 0", elastic.pp, elastic.tp),
        }
        // `optim.grad_clip` clips by the whole model's gradient norm under every sharding: the
        // engines gather each rank's share of the squared norm (`rtx_pipelines` `clip.rs`).
        if elastic.sharding == DpSharding::Zero3 {
            let key = if self.config.parallel.zero == 3 { ("parallel.zero", "3") } else { ("elastic.sharding", "\"zero3\"") };
            zero3_refusal(&self.config).map_or(Ok(()), |allowed| Err(ConfigError::Invalid { origin: String::new(), key: key.0.into(), value: key.1.into(), allowed }))?;
        }
        // ZeRO-1/2 run on the GPU too: the shard's optimizer state lives on the device, gradients
        // and parameters are staged through host buffers (`rtx_pipelines` `data_parallel.rs`,
        // "ZeRO on staged parameters"). ZeRO-3 on the GPU is refused by `zero3_refusal` above.
        Ok(elastic)
    }

    fn supervisor_options(&self, listen: SocketAddr, token: String, elastic: ElasticConfig) -> SupervisorOptions {
        SupervisorOptions {
            listen,
            token,
            job: self.text.clone(),
            total_steps: self.config.train.steps,
            stop_at: self.stop_at,
            elastic,
            resume: self.resume.as_ref().map(|(p, _)| p.clone()),
            resume_next_step: self.resume.as_ref().map_or(0, |(_, s)| *s),
            run_dir: Some(self.out_dir.clone()),
            link: Default::default(),
        }
    }

    fn seconds(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }
}

/// `--http ADDR`: serves the live page of the job, its address printed and written to
/// `<out>/http.addr`.
async fn start_live(job: &JobFiles, config: &Path, addr: Option<SocketAddr>, supervisor: SocketAddr) -> anyhow::Result<Option<LiveServer>> {
    let Some(addr) = addr else { return Ok(None) };
    let (unit, per_step) = ElasticJob::unit(&job.config);
    let info = JobInfo {
        config: config.file_name().map_or_else(|| config.display().to_string(), |n| n.to_string_lossy().into_owned()),
        total_steps: job.stop_at.map_or(job.config.train.steps, |s| s.min(job.config.train.steps)),
        unit: unit.to_string(),
        per_step,
        supervisor: supervisor.to_string(),
        out_dir: job.out_dir.display().to_string(),
    };
    let server = LiveServer::start(addr, info).await?;
    live::write_addr(&job.out_dir, server.addr())?;
    eprintln!("live page on http://{}/", server.addr());
    Ok(Some(server))
}

/// Follows the job's events until it ends: progress bar, metrics, events, summary, plot, and
/// the live page when one is served.
async fn follow(mut supervisor: SupervisorHandle, job: &JobFiles, verbosity: Verbosity, live: Option<LiveFeed>, observer: Option<&EventObserver>) -> anyhow::Result<()> {
    let total = job.config.train.steps;
    let start_step = job.resume.as_ref().map_or(0, |(_, s)| *s);
    let total = job.stop_at.map_or(total, |s| s.min(total));
    let metrics_path = job.out_dir.join("metrics.jsonl");
    let mut metrics = if start_step > 0 && metrics_path.exists() { MetricsWriter::resume(&metrics_path, start_step)? } else { MetricsWriter::create(&metrics_path)? };
    let mut events = std::fs::OpenOptions::new().create(true).append(true).open(job.out_dir.join("events.jsonl"))?;
    let progress = Progress::new(verbosity, start_step, total);
    let (unit, per_step) = ElasticJob::unit(&job.config);
    let log_every = job.config.train.log_every.max(1);
    let (mut window_loss, mut window_steps, mut window_start) = (0.0, 0u64, Instant::now());
    // (evaluation, replicas identical, control overhead, share outside training steps)
    type Finished = (Vec<(String, f64)>, bool, f64, f64);
    let mut finished: Option<Finished> = None;
    let mut failed: Option<String> = None;
    let mut summary = json!({ "generations": [], "lost": [] });
    progress.line(&format!("job: {} steps, supervisor {}, output {}", total, supervisor.addr, job.out_dir.display()));
    while let Some(event) = supervisor.events.recv().await {
        let t = job.seconds();
        let mut line = event_json(&event, t);
        // Wall-clock time for outside tools (the recovery benchmark); no decision reads it.
        line["unix_s"] = json!(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64()));
        writeln!(events, "{line}")?;
        if let Some(feed) = &live {
            feed.record(&event, t);
        }
        if let Some(observer) = observer {
            observer(&event, t);
        }
        match &event {
            JobEvent::Committed { step, loss, world, generation, .. } => {
                let done = step + 1;
                window_loss += loss;
                window_steps += 1;
                let rate = per_step as f64 * window_steps as f64 / window_start.elapsed().as_secs_f64().max(1e-9);
                progress.update(done, *loss, rate, unit);
                if done % log_every == 0 || done == total {
                    let mean = window_loss / window_steps as f64;
                    let mut record = MetricRecord { step: done, loss: Some(mean), wall_s: Some(t), world: Some(*world), generation: Some(*generation), ..Default::default() };
                    if unit == "tokens" {
                        record.tokens_per_s = Some(rate);
                    } else {
                        record.samples_per_s = Some(rate);
                    }
                    metrics.write(&record)?;
                    progress.line(&format!("step {done:>6}/{total} | loss {mean:.4} | {world} workers, generation {generation} | {} {unit}/s | {t:.1}s", human(rate)));
                    (window_loss, window_steps, window_start) = (0.0, 0, Instant::now());
                }
            }
            JobEvent::Generation { generation, world, next_step, pids, .. } => {
                progress.line(&format!("generation {generation}: {world} worker(s) (pids {pids:?}), continuing at step {next_step}"));
                std::fs::write(job.out_dir.join("cluster.json"), json!({ "generation": generation, "world": world, "pids": pids, "next_step": next_step, "supervisor": supervisor.addr.to_string() }).to_string())?;
                if let Some(g) = summary["generations"].as_array_mut() {
                    g.push(json!({ "generation": generation, "world": world, "next_step": next_step, "t": t }));
                }
            }
            JobEvent::Lost { pid, class, reason, .. } => {
                progress.line(&format!("worker pid {pid} lost ({class:?}): {reason}"));
                if let Some(l) = summary["lost"].as_array_mut() {
                    l.push(json!({ "pid": pid, "class": format!("{class:?}"), "t": t }));
                }
            }
            JobEvent::Joined { name, pid, .. } => progress.line(&format!("{name} (pid {pid}) joined")),
            JobEvent::Refused { peer, reason } => progress.line(&format!("refused {peer}: {reason}")),
            JobEvent::Checkpointed { step, path } => progress.line(&format!("checkpoint after step {}: {path}", step + 1)),
            JobEvent::CheckpointFailed { step, reason } => progress.line(&format!("checkpoint after step {} FAILED (the previous one stays valid): {reason}", step + 1)),
            JobEvent::Finished { eval, replicas_identical, overhead, outside_steps, .. } => finished = Some((eval.clone(), *replicas_identical, *overhead, *outside_steps)),
            JobEvent::Failed { reason } => failed = Some(reason.clone()),
            JobEvent::Suspect { reason } => progress.line(&format!("suspect: {reason}")),
        }
    }
    progress.finish();
    let joined = supervisor.join().await;
    if let Some(reason) = failed {
        bail!("the job failed: {reason}");
    }
    joined?;
    let (eval, identical, overhead, outside) = finished.ok_or_else(|| anyhow!("the supervisor stopped without finishing the job"))?;
    let mut eval_text: Vec<String> = eval.iter().map(|(k, v)| format!("{k} {v:.4}")).collect();
    if !job.config.data.dataset.is_image() && !eval_text.is_empty() {
        // Text losses and the unigram entropy are per token of the configured tokenizer.
        eval_text.push(format!("in nats/{}", job.config.data.tokenizer.unit()));
    }
    progress.line(&format!("done in {:.1}s: {} | replicas bit-identical: {identical} | runtime control overhead {:.2}% of step time ({:.2}% outside training steps)", job.seconds(), eval_text.join(", "), overhead * 100.0, outside * 100.0));
    summary["eval"] = json!(eval.iter().cloned().collect::<std::collections::BTreeMap<String, f64>>());
    summary["replicas_identical"] = json!(identical);
    summary["seconds"] = json!(job.seconds());
    summary["runtime_overhead"] = json!(overhead);
    summary["outside_steps"] = json!(outside);
    summary["steps"] = json!(total);
    std::fs::write(job.out_dir.join("summary.json"), serde_json::to_string_pretty(&summary)?)?;
    let records = crate::metrics::read_metrics(metrics.path())?;
    let with_text = crate::plot::ensure_font(std::env::var_os("RTX_PLOT_FONT").map(PathBuf::from).as_deref());
    crate::plot::plot_loss_curve(&records, &job.out_dir.join("loss.png"), &format!("{} workers, elastic", job.config.data.dataset.name()), None, with_text)?;
    if !identical {
        bail!("replicas ended with different parameters");
    }
    Ok(())
}

/// One line of `events.jsonl`: the event's fields and `t`, the seconds since launch.
pub fn event_json(event: &JobEvent, t: f64) -> serde_json::Value {
    match event {
        JobEvent::Joined { node, name, pid, host } => json!({ "t": t, "event": "joined", "node": node, "name": name, "pid": pid, "host": host }),
        JobEvent::Refused { peer, reason } => json!({ "t": t, "event": "refused", "peer": peer, "reason": reason }),
        JobEvent::Lost { node, pid, class, reason } => json!({ "t": t, "event": "lost", "node": node, "pid": pid, "class": format!("{class:?}"), "reason": reason }),
        JobEvent::Generation { generation, world, next_step, source_node, nodes, pids, mesh: (dp, pp, tp), transport } => json!({ "t": t, "event": "generation", "generation": generation, "world": world, "next_step": next_step, "source_node": source_node, "nodes": nodes, "pids": pids, "mesh": { "dp": dp, "pp": pp, "tp": tp }, "transport": transport }),
        JobEvent::Committed { step, loss, samples, world, generation, .. } => json!({ "t": t, "event": "committed", "step": step, "loss": loss, "samples": samples, "world": world, "generation": generation }),
        JobEvent::Checkpointed { step, path } => json!({ "t": t, "event": "checkpointed", "step": step, "path": path }),
        JobEvent::CheckpointFailed { step, reason } => json!({ "t": t, "event": "checkpoint_failed", "step": step, "reason": reason }),
        JobEvent::Finished { eval, replicas_identical, checksum, overhead, outside_steps } => json!({ "t": t, "event": "finished", "eval": eval, "replicas_identical": replicas_identical, "checksum": format!("{checksum:016x}"), "runtime_overhead": overhead, "outside_steps": outside_steps }),
        JobEvent::Failed { reason } => json!({ "t": t, "event": "failed", "reason": reason }),
        JobEvent::Suspect { reason } => json!({ "t": t, "event": "suspect", "reason": reason }),
    }
}

/// Resolves HOST:PORT to its first socket address.
/// Why a job cannot train under ZeRO-3 (`FsdpGpt`), if it cannot: what the key allows instead.
fn zero3_refusal(config: &TrainConfig) -> Option<String> {
    if !matches!(config.model, crate::config::ModelConfig::Gpt { .. }) {
        return Some("ZeRO-3 (FSDP) cuts a GPT into units (its embedding edge and its transformer blocks) and only a GPT has that engine; this model trains with zero = 0, 1 or 2".into());
    }
    if config.train.device == crate::config::DeviceKind::Cuda {
        return Some("ZeRO-3 (FSDP) shards host buckets; with train.device = \"cuda\" train with zero = 0".into());
    }
    None
}

pub(crate) fn resolve_addr(text: &str) -> anyhow::Result<SocketAddr> {
    text.to_socket_addrs().with_context(|| format!("cannot resolve the address {text}"))?.next().ok_or_else(|| anyhow!("{text} resolves to no address"))
}

/// Writes `text` to `path`, readable by its owner only (tokens).
pub(crate) fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().create(true).write(true).truncate(true).mode(0o600).open(path).with_context(|| format!("cannot write {}", path.display()))?;
    f.write_all(text.as_bytes())?;
    Ok(())
}

/// The local address the OS would use to reach `peer` (no packet is sent).
fn local_ip_towards(peer: SocketAddr) -> Option<IpAddr> {
    let socket = std::net::UdpSocket::bind(if peer.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }).ok()?;
    socket.connect(peer).ok()?;
    socket.local_addr().ok().map(|a| a.ip())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: ZeRO-3 is refused, with the reason, for what FSDP cannot train as asked: a model
    /// that is not a GPT, a GPU replica; a plain CPU GPT passes, with gradient clipping too (the
    /// engine clips by the model's norm). Method: `zero3_refusal` over parsed configs.
    #[test]
    fn zero3_names_why_a_job_cannot_run_under_it() {
        let gpt = "[model]\nkind = \"gpt\"\nn_layers = 2\nd_model = 32\nn_heads = 4\ncontext = 32\n[data]\ndataset = \"sotu\"\nbatch_size = 12\n[optim]\nkind = \"adamw\"\nlr = 1e-3\n[train]\nsteps = 10\n";
        let parse = |text: &str| TrainConfig::from_toml_str(text).expect("config");
        assert_eq!(zero3_refusal(&parse(gpt)), None);
        assert_eq!(zero3_refusal(&parse(&gpt.replace("lr = 1e-3", "lr = 1e-3\ngrad_clip = 1.0"))), None, "clipping trains under ZeRO-3");
        let mlp = "[model]\nkind = \"mlp\"\nhidden = [8]\n[data]\ndataset = \"digits\"\nbatch_size = 8\n[optim]\nkind = \"sgd\"\nlr = 0.1\n[train]\nsteps = 2\n";
        let not_gpt = zero3_refusal(&parse(mlp)).expect("refused");
        assert!(not_gpt.contains("cuts a GPT into units"), "{not_gpt}");
    }
}
