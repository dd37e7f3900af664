//! `launch(...)`: an elastic data-parallel job (`rtx launch`) run on a background thread with its
//! own tokio runtime, and [`JobHandle`], which Python polls for the job's state and events and
//! waits on.
//!
//! Protocol: the launch thread is the only writer. It folds every supervisor event into
//! [`Progress`] (the live page's [`LiveState`], and the event as its `events.jsonl` line) through
//! `elastic::launch_with`'s observer, and stores the outcome once, when `launch_with` returns,
//! then notifies the condition variable. Python threads only read, under the same mutexes.
//! Workers are started as `<python> -m rustytorch._worker --join ADDR` (the interpreter that
//! imported the package), so the wheel needs no `rtx` binary.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use pyo3::prelude::*;
use rustytorch::cli::{JobArgs, LaunchArgs};
use rustytorch::config::TrainConfig;
use rustytorch::elastic::{event_json, launch_with, WorkerCommand};
use rustytorch::live::{JobInfo, LiveState};

use crate::errors::{message, ConfigError, JobError};

/// Events kept for `events()` (the oldest are dropped past it).
pub(crate) const EVENTS_MAX: usize = 100_000;
/// How long `wait` sleeps between checks for Ctrl-C.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// A launched job.
#[pyclass(module = "rustytorch._rustytorch", frozen)]
pub struct JobHandle {
    shared: Arc<Shared>,
    out_dir: PathBuf,
}

/// What the launch thread writes and Python reads.
struct Shared {
    progress: Mutex<Progress>,
    /// `None` while the job runs; then `Ok` or the error text.
    outcome: Mutex<Option<Result<(), String>>>,
    finished: Condvar,
}

struct Progress {
    state: LiveState,
    events: VecDeque<serde_json::Value>,
}

/// Starts `config` on `nproc` worker processes (`worker_program worker_args... --join ADDR`).
/// The config is read and checked here (a `ConfigError` now); the job's own failures come from
/// `JobHandle.wait`.
#[pyfunction]
#[pyo3(signature = (config, nproc, worker_program, worker_args, out = None, steps = None, data_dir = None, resume = false, min_workers = None, max_workers = None, http = None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch(
    config: PathBuf,
    nproc: i64,
    worker_program: PathBuf,
    worker_args: Vec<String>,
    out: Option<PathBuf>,
    steps: Option<u64>,
    data_dir: Option<PathBuf>,
    resume: bool,
    min_workers: Option<usize>,
    max_workers: Option<usize>,
    http: Option<String>,
) -> PyResult<JobHandle> {
    let nproc = usize::try_from(nproc).ok().filter(|&n| n >= 1).ok_or_else(|| ConfigError::new_err(format!("nproc must be at least 1 worker process, got {nproc}")))?;
    let text = std::fs::read_to_string(&config).map_err(|e| ConfigError::new_err(format!("cannot read config {}: {e}", config.display())))?;
    let parsed = TrainConfig::from_toml_str(&text).map_err(|e| ConfigError::new_err(format!("config {}: {}", config.display(), message(&e))))?;
    let http = http.map(|a| a.parse().map_err(|e| ConfigError::new_err(format!("http address {a:?}: {e}")))).transpose()?;
    let out_dir = out.clone().unwrap_or_else(|| parsed.default_output_dir(Some(config.as_path())));
    let out_dir = std::path::absolute(&out_dir).unwrap_or(out_dir);
    let info = JobInfo {
        config: config.file_name().map_or_else(|| config.display().to_string(), |n| n.to_string_lossy().into_owned()),
        total_steps: steps.map_or(parsed.train.steps, |s| s.min(parsed.train.steps)),
        unit: "samples".into(),
        per_step: parsed.data.batch_size as u64,
        supervisor: String::new(),
        out_dir: out_dir.display().to_string(),
    };
    let shared = Arc::new(Shared { progress: Mutex::new(Progress { state: LiveState::new(info), events: VecDeque::new() }), outcome: Mutex::new(None), finished: Condvar::new() });
    let args = LaunchArgs {
        config,
        nproc,
        job: JobArgs { min_workers, max_workers, resume, steps, data_dir, out: Some(out_dir.clone()), no_progress: true, http },
    };
    let workers = WorkerCommand { program: worker_program, args: worker_args };
    let writer = shared.clone();
    let observer = Box::new(move |event: &rustytorch::supervisor::JobEvent, t: f64| {
        let mut progress = lock(&writer.progress);
        progress.state.apply(event, t);
        if progress.events.len() == EVENTS_MAX {
            progress.events.pop_front();
        }
        progress.events.push_back(event_json(event, t));
    });
    let finisher = shared.clone();
    std::thread::Builder::new()
        .name("rustytorch-launch".into())
        .spawn(move || {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| launch_with(args, workers, Some(observer))));
            let outcome = match result {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(format!("{e:#}")),
                Err(_) => Err("the launch thread panicked (see stderr)".to_string()),
            };
            *lock(&finisher.outcome) = Some(outcome);
            finisher.finished.notify_all();
        })
        .map_err(|e| JobError::new_err(format!("cannot start the launch thread: {e}")))?;
    Ok(JobHandle { shared, out_dir })
}

#[pymethods]
impl JobHandle {
    /// The output folder (metrics.jsonl, events.jsonl, summary.json, loss.png, checkpoints/).
    #[getter]
    fn out_dir(&self) -> PathBuf {
        self.out_dir.clone()
    }

    /// The live page's state as JSON: `info`, `summary` (phase, step, world, generation, loss,
    /// counters, eval, failure), `members`, `generations`, `loss`, `timeline`.
    fn _status_json(&self) -> PyResult<String> {
        let snapshot = lock(&self.shared.progress).state.snapshot();
        serde_json::to_string(&snapshot).map_err(|e| JobError::new_err(e.to_string()))
    }

    /// The events so far (as `events.jsonl` writes them) as a JSON array.
    fn _events_json(&self) -> String {
        let progress = lock(&self.shared.progress);
        serde_json::Value::Array(progress.events.iter().cloned().collect()).to_string()
    }

    /// Whether the job has ended (finished or failed).
    fn done(&self) -> bool {
        lock(&self.shared.outcome).is_some()
    }

    /// Blocks, without the GIL, until the job ends or `timeout_s` passes; returns whether it
    /// ended. A failed job raises `JobError` with the Rust message. Ctrl-C interrupts the wait
    /// (the job goes on).
    #[pyo3(signature = (timeout_s = None))]
    fn _wait(&self, py: Python<'_>, timeout_s: Option<f64>) -> PyResult<bool> {
        let deadline = timeout_s.map(|s| std::time::Instant::now() + Duration::from_secs_f64(s.max(0.0)));
        loop {
            let outcome = py.detach(|| {
                let guard = lock(&self.shared.outcome);
                let (guard, _) = self.shared.finished.wait_timeout_while(guard, WAIT_SLICE, |o| o.is_none()).unwrap_or_else(PoisonError::into_inner);
                guard.clone()
            });
            match outcome {
                Some(Ok(())) => return Ok(true),
                Some(Err(text)) => return Err(JobError::new_err(text)),
                None => {}
            }
            py.check_signals()?;
            if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                return Ok(false);
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
