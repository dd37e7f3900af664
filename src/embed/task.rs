//! The user's side of an embedded job: the [`EmbeddedTask`] trait (model, optimizer, data, loss,
//! evaluation), the job description the supervisor hands to every worker, and [`TaskJob`], the
//! adapter that makes a task the supervisor crate's `TrainJob`, so embedded jobs run on the same
//! worker runtime as `rtx launch`.

use std::path::PathBuf;
use std::sync::Arc;

use rtx_actors::BatchSource;
use rtx_pipelines::ParamSlice;
use rtx_supervisor::{JobSpec, TrainJob};
use rtx_tensor::{Module, Optimizer, Tensor};

use super::error::{EmbedError, TaskError};

/// A training task an embedding program brings: its own model, optimizer, data and loss.
///
/// The elastic runtime calls it from every worker (threads or processes), so it must be
/// deterministic: [`build_model`](Self::build_model) gives every worker the same parameters
/// for a seed, and [`batch`](Self::batch) is a pure function of `(step, rank, world)` whose rank
/// parts make up the same global batch whatever the world size (cut global batch `step` with
/// [`rtx_collectives::segment_range`]). That is what lets the job lose a worker, re-form with
/// the survivors and go on without skipping or repeating a sample.
pub trait EmbeddedTask: Send + Sync + 'static {
    /// The model (any [`Module`]: its parameters are what the replicas keep identical).
    type Model: Module + Send + 'static;
    /// The optimizer (built over the parameters the worker runtime hands in).
    type Optim: Optimizer + Send + 'static;
    /// One rank's part of a global batch.
    type Batch: Send + 'static;

    /// Builds the model from `seed`; every call with the same seed must give the same
    /// parameters.
    fn build_model(&self, seed: u64) -> Result<Self::Model, TaskError>;

    /// Builds the optimizer over `parameters` (name, tensor), in the model's order.
    fn build_optimizer(&self, parameters: Vec<(String, Tensor)>) -> Result<Self::Optim, TaskError>;

    /// Rows in one global batch (all ranks together); at least the number of workers.
    fn global_batch(&self) -> usize;

    /// Rank `rank`'s part of global batch `step` when the world has `world` ranks.
    fn batch(&self, step: u64, rank: usize, world: usize) -> Result<Self::Batch, TaskError>;

    /// The loss of this rank's part of a batch, as a mean over its rows, and the number of rows
    /// (the runtime weights each rank's gradient by its rows).
    fn loss(&self, model: &mut Self::Model, batch: &Self::Batch) -> Result<(Tensor, usize), TaskError>;

    /// The learning rate of `step` (a schedule); `None` (the default) keeps the optimizer's.
    fn learning_rate(&self, step: u64) -> Option<f64> {
        let _ = step;
        None
    }

    /// Evaluates the final model (on rank 0 only): named metrics. None by default.
    fn evaluate(&self, model: &mut Self::Model) -> Result<Vec<(String, f64)>, TaskError> {
        let _ = model;
        Ok(Vec::new())
    }
}

/// What every worker of an embedded job must agree on, sent by the supervisor as the job text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct JobDescription {
    pub(crate) steps: u64,
    pub(crate) seed: u64,
    /// `None` when the supervisor's job text does not say (an `rtx supervisor` config).
    pub(crate) global_batch: Option<usize>,
}

impl JobDescription {
    /// The job text (TOML) of this description.
    pub(crate) fn to_toml(self) -> String {
        let batch = self.global_batch.map_or(String::new(), |g| format!("global_batch = {g}\n"));
        // The seed is a string: TOML integers are signed 64-bit.
        format!("# a rustytorch embedded job (rustytorch::embed)\n[embed]\nsteps = {}\nseed = \"{}\"\n{batch}", self.steps, self.seed)
    }

    /// Reads a job text: an `[embed]` table (a job started by `rustytorch::embed`), or an `rtx`
    /// config's `[train] steps` and `seed` (a job of `rtx supervisor` that embedded workers join;
    /// its model and data sections are not used). `seed` is the fallback seed.
    pub(crate) fn parse(text: &str, seed: u64) -> Result<JobDescription, EmbedError> {
        let mismatch = |reason: String| EmbedError::JobMismatch { reason };
        let table: toml::Table = text.parse().map_err(|e: toml::de::Error| mismatch(format!("the job text is not TOML: {}", e.message())))?;
        let (section, name) = match (table.get("embed").and_then(toml::Value::as_table), table.get("train").and_then(toml::Value::as_table)) {
            (Some(embed), _) => (embed, "embed"),
            (None, Some(train)) => (train, "train"),
            (None, None) => return Err(mismatch("it has neither an [embed] nor a [train] table".into())),
        };
        let count = |key: &str| -> Result<Option<u64>, EmbedError> {
            match section.get(key) {
                None => Ok(None),
                Some(toml::Value::Integer(i)) => u64::try_from(*i).map(Some).map_err(|_| mismatch(format!("{name}.{key} = {i} is negative"))),
                Some(toml::Value::String(s)) => s.parse().map(Some).map_err(|_| mismatch(format!("{name}.{key} = {s:?} is not a number"))),
                Some(other) => Err(mismatch(format!("{name}.{key} = {other} is not a number"))),
            }
        };
        let steps = count("steps")?.ok_or_else(|| mismatch(format!("{name}.steps is missing")))?;
        let seed = count("seed")?.unwrap_or(seed);
        let global_batch = if name == "embed" { count("global_batch")?.map(|g| g as usize) } else { None };
        Ok(JobDescription { steps, seed, global_batch })
    }

    /// Checks a worker's task against the description.
    pub(crate) fn check(&self, global_batch: usize, steps: Option<u64>) -> Result<(), EmbedError> {
        if let Some(expected) = self.global_batch.filter(|g| *g != global_batch) {
            return Err(EmbedError::JobMismatch { reason: format!("the supervisor's job has a global batch of {expected} rows, this program's task {global_batch}") });
        }
        if let Some(steps) = steps.filter(|s| *s != self.steps) {
            return Err(EmbedError::JobMismatch { reason: format!("the supervisor's job runs {} steps, this program asked for {steps}", self.steps) });
        }
        Ok(())
    }
}

/// An [`EmbeddedTask`] as the worker runtime's `TrainJob`.
pub(crate) struct TaskJob<T> {
    task: Arc<T>,
    description: JobDescription,
    checkpoint_dir: Option<PathBuf>,
}

impl<T: EmbeddedTask> TaskJob<T> {
    pub(crate) fn new(task: Arc<T>, description: JobDescription, checkpoint_dir: Option<PathBuf>) -> Self {
        TaskJob { task, description, checkpoint_dir }
    }

    /// The job of a worker that joined with `spec`; `steps` is what this program asked for (to
    /// check against the supervisor's), `seed` the fallback seed. Checkpoints go to
    /// `<run folder>/checkpoints`, as for `rtx worker`.
    pub(crate) fn for_worker(task: Arc<T>, spec: &JobSpec, steps: Option<u64>, seed: u64) -> Result<Self, EmbedError> {
        let description = JobDescription::parse(&spec.job, seed)?;
        description.check(task.global_batch(), steps)?;
        let checkpoint_dir = rtx_supervisor::worker::checkpoint_folder(spec.run_dir.as_deref(), "the supervisor");
        Ok(TaskJob::new(task, description, checkpoint_dir))
    }
}

/// The message of an error and its sources, joined (the worker runtime carries job errors as text).
pub(crate) fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

impl<T: EmbeddedTask> BatchSource for TaskJob<T> {
    type Batch = T::Batch;

    fn batch(&self, step: u64, rank: usize, world: usize) -> Result<T::Batch, String> {
        self.task.batch(step, rank, world).map_err(|e| format!("batch {step} for rank {rank} of {world}: {}", error_chain(&*e)))
    }
}

impl<T: EmbeddedTask> TrainJob for TaskJob<T> {
    type Model = T::Model;
    type Optim = T::Optim;

    fn build_model(&self) -> Result<T::Model, String> {
        self.task.build_model(self.description.seed).map_err(|e| format!("building the model: {}", error_chain(&*e)))
    }

    fn build_optimizer(&self, slices: &[ParamSlice]) -> Result<T::Optim, String> {
        let named = slices.iter().map(|s| (s.name.clone(), s.tensor.clone())).collect();
        self.task.build_optimizer(named).map_err(|e| format!("building the optimizer: {}", error_chain(&*e)))
    }

    fn loss(&self, model: &mut T::Model, batch: &T::Batch, _step: u64) -> rtx_tensor::Result<(Tensor, usize)> {
        self.task.loss(model, batch).map_err(|e| match e.downcast::<rtx_tensor::Error>() {
            Ok(tensor_error) => *tensor_error,
            Err(other) => rtx_tensor::Error::InvalidArgument { op: "embedded task loss", reason: error_chain(&*other) },
        })
    }

    fn global_batch(&self) -> usize {
        self.task.global_batch()
    }

    fn total_steps(&self) -> u64 {
        self.description.steps
    }

    fn set_lr(&self, optimizer: &mut T::Optim, step: u64) {
        if let Some(lr) = self.task.learning_rate(step) {
            optimizer.set_lr(lr);
        }
    }

    fn evaluate(&self, model: &mut T::Model) -> Result<Vec<(String, f64)>, String> {
        self.task.evaluate(model).map_err(|e| format!("evaluating: {}", error_chain(&*e)))
    }

    fn checkpoint_dir(&self) -> Option<PathBuf> {
        self.checkpoint_dir.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: the job text round-trips, and an rtx config's [train] section is read as a job.
    #[test]
    fn job_description_round_trips_and_reads_rtx_configs() {
        let d = JobDescription { steps: 30, seed: u64::MAX, global_batch: Some(64) };
        assert_eq!(JobDescription::parse(&d.to_toml(), 0).expect("parse"), d);
        let rtx = "[train]\nsteps = 12\nseed = 7\n[data]\ndataset = \"fashion-mnist\"\n";
        assert_eq!(JobDescription::parse(rtx, 0).expect("parse"), JobDescription { steps: 12, seed: 7, global_batch: None });
    }

    /// Goal: every malformed job text and every mismatch is a typed error naming the key.
    #[test]
    fn bad_job_texts_are_typed_errors() {
        for (text, needle) in [("not toml [", "not TOML"), ("[model]\nx = 1", "neither"), ("[embed]\nseed = 1", "embed.steps is missing"), ("[embed]\nsteps = -3", "negative"), ("[embed]\nsteps = true", "not a number")] {
            let e = JobDescription::parse(text, 0).expect_err(text);
            assert!(matches!(e, EmbedError::JobMismatch { .. }) && e.to_string().contains(needle), "{text}: {e}");
        }
        let d = JobDescription { steps: 30, seed: 1, global_batch: Some(64) };
        assert!(d.check(64, Some(30)).is_ok());
        assert!(d.check(32, None).expect_err("batch").to_string().contains("global batch of 64"));
        assert!(d.check(64, Some(31)).expect_err("steps").to_string().contains("runs 30 steps"));
    }
}
