//! Embedding API: run your own model, data and loss as an elastic data-parallel job from inside
//! your program, on the same supervisor and worker runtime as `rtx launch`.
//!
//! Implement [`EmbeddedTask`] (build the model for a seed, the optimizer, rank `r`'s part of
//! global batch `step` for a world of `w`, the loss, optionally an evaluation), then
//! [`Job::builder`] it with a [`Placement`] and elastic options, and [`run`](JobBuilder::run) it
//! (or [`start`](JobBuilder::start) it and steer the [`JobHandle`]: kill a worker, wait for a
//! step). The result is a [`Report`] (loss per committed step, generations, lost workers, the
//! final evaluation) or a typed [`EmbedError`].
//!
//! Placements:
//! - [`Placement::InProcess`]: workers are threads of this program. Each is a real node agent
//!   joined to a supervisor on loopback QUIC, with its compute on its own thread and collectives
//!   over the in-process transport; a killed worker's collectives are cut and its agent aborted,
//!   which the supervisor sees as a crash.
//! - [`Placement::LocalProcesses`]: workers are processes of this program, started again with
//!   a marker in the environment (like Python multiprocessing's `spawn`); `main` must call
//!   [`run_worker_if_child`] first. Collectives go over shared memory (or QUIC), as for `rtx launch`.
//! - [`Placement::Remote`]: this program's worker threads join a supervisor elsewhere (an
//!   `rtx supervisor`, whose config's `[train] steps` must match), with production collectives.
//!
//! **Decision:** the builder drives the supervisor crate's own pieces (`SupervisorHandle`,
//! `run_node`, the process `Launcher`) through an adapter that makes the task a `TrainJob`, rather
//! than a trainer of its own, so an embedded job recovers exactly as a launched one does. What a
//! task cannot choose is what the runtime fixes: data parallelism over identical replicas, batches
//! as a pure function of `(step, rank, world)`.
//!
//! A worker killed in the middle, and the job finishing with the survivors:
//!
//! ```
//! use rustytorch::embed::{tasks::Regression, Job, Placement};
//!
//! let handle = Job::builder(Regression::new(8, 32)?)
//!     .placement(Placement::InProcess { workers: 2 })
//!     .steps(30)
//!     .start()?;
//! handle.wait_for_step(5);
//! handle.kill_worker(1)?;
//! let report = handle.wait()?;
//! assert_eq!(report.lost.len(), 1);
//! assert_eq!(report.generations.last().map(|g| g.world), Some(1));
//! assert!(report.last_losses_mean(5) < report.first_losses_mean(5));
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
//! ```

mod child;
mod error;
mod handle;
mod in_process;
mod report;
mod task;
pub mod tasks;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use rtx_supervisor::{ElasticConfig, JobEvent, OnFailure};

pub use child::{run_worker_if_child, CHILD_JOIN_ENV};
pub use error::{EmbedError, TaskError};
pub use handle::JobHandle;
pub use in_process::SYNTHETIC_PID_BASE;
pub use report::{GenerationInfo, LostWorker, Report, StepLoss};
pub use task::EmbeddedTask;

use handle::Setup;
use task::JobDescription;

/// Where the workers of an embedded job run.
#[derive(Clone, PartialEq, Eq)]
pub enum Placement {
    /// `workers` threads of this program, with a supervisor here.
    InProcess {
        /// Workers at the start.
        workers: usize,
    },
    /// `workers` processes of this program (re-executed; see [`run_worker_if_child`]), with a
    /// supervisor here.
    LocalProcesses {
        /// Workers at the start.
        workers: usize,
    },
    /// `workers` threads of this program joining the supervisor at `supervisor`.
    Remote {
        /// The supervisor's control address.
        supervisor: SocketAddr,
        /// The cluster token (`<out>/token` of `rtx supervisor`).
        token: String,
        /// Workers this program contributes.
        workers: usize,
    },
}

impl Placement {
    fn workers(&self) -> usize {
        match self {
            Placement::InProcess { workers } | Placement::LocalProcesses { workers } | Placement::Remote { workers, .. } => *workers,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Placement::InProcess { .. } => "in-process",
            Placement::LocalProcesses { .. } => "local-processes",
            Placement::Remote { .. } => "remote",
        }
    }
}

impl std::fmt::Debug for Placement {
    // The token stays out of logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Placement::InProcess { workers } => f.debug_struct("InProcess").field("workers", workers).finish(),
            Placement::LocalProcesses { workers } => f.debug_struct("LocalProcesses").field("workers", workers).finish(),
            Placement::Remote { supervisor, workers, .. } => f.debug_struct("Remote").field("supervisor", supervisor).field("token", &"<redacted>").field("workers", workers).finish(),
        }
    }
}

/// The entry point: [`Job::builder`].
#[derive(Debug)]
pub struct Job;

impl Job {
    /// A builder for an elastic job of `task` (defaults: two in-process workers, 100 steps,
    /// seed 0, at least one worker, lost workers not replaced, no checkpoints).
    pub fn builder<T: EmbeddedTask>(task: T) -> JobBuilder<T> {
        JobBuilder { task: Arc::new(task), placement: Placement::InProcess { workers: 2 }, steps: 100, seed: 0, min_workers: 1, max_workers: None, replace_lost: false, checkpoint_every: 0, run_dir: None, child_args: None, observer: None }
    }
}

/// Options of an embedded job; see [`Job::builder`].
pub struct JobBuilder<T> {
    task: Arc<T>,
    placement: Placement,
    steps: u64,
    seed: u64,
    min_workers: usize,
    max_workers: Option<usize>,
    replace_lost: bool,
    checkpoint_every: u64,
    run_dir: Option<PathBuf>,
    child_args: Option<Vec<String>>,
    observer: Option<handle::Observer>,
}

impl<T: EmbeddedTask> JobBuilder<T> {
    /// Where the workers run.
    pub fn placement(mut self, placement: Placement) -> Self {
        self.placement = placement;
        self
    }

    /// Steps to train (global batches).
    pub fn steps(mut self, steps: u64) -> Self {
        self.steps = steps;
        self
    }

    /// Seed of the initial parameters (handed to [`EmbeddedTask::build_model`]).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Fewest workers that may train; below it the job waits for joiners, then fails.
    pub fn min_workers(mut self, min_workers: usize) -> Self {
        self.min_workers = min_workers;
        self
    }

    /// Most workers (default: the placement's); later joiners are refused.
    pub fn max_workers(mut self, max_workers: usize) -> Self {
        self.max_workers = Some(max_workers);
        self
    }

    /// Whether a lost worker is replaced by a new one that joins the running job (in-process
    /// and local-process placements); otherwise the job shrinks to the survivors.
    pub fn replace_lost_workers(mut self, replace: bool) -> Self {
        self.replace_lost = replace;
        self
    }

    /// Writes a checkpoint every `steps` steps (0: never) into `<run_dir>/checkpoints`.
    pub fn checkpoint_every(mut self, steps: u64) -> Self {
        self.checkpoint_every = steps;
        self
    }

    /// The job's folder: checkpoints, and worker-process logs (`logs/worker-<i>.log`).
    pub fn run_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.run_dir = Some(dir.into());
        self
    }

    /// The arguments worker processes are started with (default: this program's own).
    pub fn child_args(mut self, args: Vec<String>) -> Self {
        self.child_args = Some(args);
        self
    }

    /// Calls `observe` with every event of the supervisor (commits, generations, losses of
    /// workers), on the job's driver thread.
    pub fn on_event(mut self, observe: impl FnMut(&JobEvent) + Send + 'static) -> Self {
        self.observer = Some(Box::new(observe));
        self
    }

    /// Checks the options and the task (it builds the model and batch 0 once, here), then starts
    /// the job and returns its handle.
    pub fn start(self) -> Result<JobHandle, EmbedError> {
        let setup = self.setup()?;
        JobHandle::start(setup)
    }

    /// Runs the job to its end.
    ///
    /// ```
    /// use rustytorch::embed::{tasks::Regression, Job, Placement};
    ///
    /// let report = Job::builder(Regression::new(4, 16)?).placement(Placement::InProcess { workers: 2 }).steps(20).run()?;
    /// assert_eq!(report.losses.len(), 20);
    /// assert!(report.eval[0].1 < report.losses[0].loss);
    /// # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
    /// ```
    pub fn run(self) -> Result<Report, EmbedError> {
        self.start()?.wait()
    }

    fn setup(self) -> Result<Setup<T>, EmbedError> {
        let invalid = |option: &'static str, reason: String| Err(EmbedError::InvalidOption { option, reason });
        let workers = self.placement.workers();
        if workers == 0 {
            return invalid("placement", "at least one worker is needed".into());
        }
        if self.steps == 0 {
            return invalid("steps", "at least one step is needed".into());
        }
        let max_workers = self.max_workers.unwrap_or(workers);
        if max_workers < workers {
            return invalid("max_workers", format!("{max_workers} is below the placement's {workers} workers"));
        }
        if self.min_workers == 0 || self.min_workers > workers {
            return invalid("min_workers", format!("{} must lie in [1, {workers}] (the placement's workers)", self.min_workers));
        }
        let global_batch = self.task.global_batch();
        if global_batch < max_workers {
            return invalid("task", format!("its global batch of {global_batch} rows is below the {max_workers} workers the job may have: every worker needs a row"));
        }
        if self.replace_lost && matches!(self.placement, Placement::Remote { .. }) {
            return invalid("replace_lost_workers", "a remote supervisor's own launcher replaces workers, not this program".into());
        }
        // Fail here, once, rather than in every worker.
        self.task.build_model(self.seed).map_err(|source| EmbedError::Task { during: "building the model", source })?;
        self.task.batch(0, 0, workers).map_err(|source| EmbedError::Task { during: "making rank 0's part of batch 0", source })?;

        let mut elastic = ElasticConfig { min_workers: self.min_workers, max_workers, start_workers: workers, checkpoint_every: self.checkpoint_every, ..ElasticConfig::default() };
        if self.replace_lost {
            for policy in [&mut elastic.crash, &mut elastic.hang, &mut elastic.network_loss] {
                policy.on_failure = OnFailure::Replace;
            }
        }
        elastic.validate().map_err(EmbedError::runtime("checking the elastic options"))?;
        let description = JobDescription { steps: self.steps, seed: self.seed, global_batch: Some(global_batch) };
        Ok(Setup { task: self.task, placement: self.placement, description, elastic, run_dir: self.run_dir, child_args: self.child_args, observer: self.observer })
    }
}

impl<T> std::fmt::Debug for JobBuilder<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobBuilder").field("placement", &self.placement).field("steps", &self.steps).field("seed", &self.seed).field("min_workers", &self.min_workers).field("max_workers", &self.max_workers).field("replace_lost", &self.replace_lost).field("checkpoint_every", &self.checkpoint_every).field("run_dir", &self.run_dir).finish_non_exhaustive()
    }
}
