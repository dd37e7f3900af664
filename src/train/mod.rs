//! The single-process trainer behind `rtx train`, usable from library code too.
//!
//! [`run_file`] / [`run`] do a whole run from a [`TrainConfig`]; [`Trainer`] exposes the steps
//! (build, [`Trainer::train_until`], [`Trainer::save_checkpoint`], [`Trainer::finish`]) for
//! programs and tests that drive the loop themselves.
//!
//! ```no_run
//! use rustytorch::config::TrainConfig;
//! use rustytorch::data::DataRoot;
//! use rustytorch::train::{self, TrainOptions};
//!
//! let config = TrainConfig::load("configs/fashion_mlp.toml".as_ref())?;
//! let report = train::run(&config, TrainOptions::new(DataRoot::new("data")))?;
//! println!("test accuracy {:?}", report.test.and_then(|t| t.accuracy));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Outputs (in the output folder)
//! - `metrics.jsonl`: see [`crate::metrics`].
//! - `loss.png`: training and validation loss against the step ([`crate::plot`]).
//! - `checkpoints/step-NNNNNNNN.safetensors`: model, optimizer state, step, dropout generator,
//!   data cursor and config ([`rtx_tensor::checkpoint`] format), every `train.checkpoint_every` steps and
//!   at the end; the newest `train.keep_checkpoints` are kept.
//! - `config.toml`: a copy of the config the run started with (written by [`run_file`]).
//!
//! # Determinism
//! Every random choice comes from `train.seed`: parameter init ([`Generator::new`]`(seed)`),
//! the train/validation split and the batch order (the data module's seeded streams), and dropout
//! (`Generator::with_stream(seed, 1)`); generation at the end uses stream 2. Nothing reads the
//! clock except throughput and `wall_s`, which never feed back into training. A checkpoint holds
//! everything the next step depends on, so `N` steps straight and `N/2 + resume + N/2` give
//! bit-identical parameters.

mod attentive;
mod ckpt;
mod device;
pub(crate) mod elastic_job;
mod jepa;
mod model;
mod optimizer;
mod readout;
mod task;

use std::path::{Path, PathBuf};
use std::time::Instant;

use rtx_tensor::data::{DataError, DataRoot, Gpt2Tokenizer};
use rtx_tensor::nn::Module;
use rtx_tensor::{Generator, Reduction, Tensor};

use crate::config::{ConfigError, ModelConfig, Tokenizer, TrainConfig};
use crate::metrics::{MetricRecord, MetricsError, MetricsWriter, ReadoutMetric};
use crate::plot::{self, PlotError};
use crate::progress::{human, Progress, Verbosity};

pub use ckpt::CHECKPOINT_DIR;
pub use device::{resolve_device, DeviceError, Placement};
pub use jepa::{JepaSetup, ProbeReport, ReadoutReport};
pub use model::Model;

use optimizer::Optimizer;
use task::{EvalSplit, TaskData};

/// Images per evaluation batch (evaluation has no gradient, so larger is cheaper).
const IMAGE_EVAL_BATCH: usize = 1000;
/// Dropout stream of the run's seed.
const DROPOUT_STREAM: u64 = 1;
/// Sampling stream of the run's seed.
const SAMPLE_STREAM: u64 = 2;

/// Errors of a training run.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The config is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The dataset is missing or malformed (the message names the fetch command).
    #[error(transparent)]
    Data(#[from] DataError),
    /// A tensor operation, or reading/writing a checkpoint, failed.
    #[error(transparent)]
    Tensor(#[from] rtx_tensor::Error),
    /// Writing or reading metrics failed.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    /// Drawing the loss curve failed.
    #[error(transparent)]
    Plot(#[from] PlotError),
    /// A file of the output folder could not be written or read.
    #[error("{what} {path}", path = .path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A checkpoint does not fit this run.
    #[error("cannot resume: {0}")]
    Resume(String),
    /// The output folder holds an earlier run and `--resume` was not given.
    #[error("output folder {path} already holds checkpoints of an earlier run; pass --resume to continue it, or choose another --out (or delete the folder)", path = .path.display())]
    OutputInUse {
        /// The output folder.
        path: PathBuf,
    },
    /// The loss became NaN or infinite.
    #[error("training diverged at step {step}: loss is {loss}; lower optim.lr or set optim.grad_clip")]
    Diverged {
        /// The step.
        step: u64,
        /// The loss value.
        loss: f64,
    },
    /// `[train] device` cannot be used here.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// `[train] device = "cuda"` was given to the single-process trainer.
    #[error("train.device = \"cuda\" trains under `rtx launch` (one worker process per GPU; `--nproc 1` for one); `rtx train` trains on the CPU")]
    CudaNeedsLaunch,
    /// A broken assumption inside the trainer.
    #[error("internal error: {0}")]
    Internal(String),
}

/// Result alias of the trainer.
pub type Result<T> = std::result::Result<T, TrainError>;

/// How to run a config: where data and outputs live, and how far to go.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    /// The data folder (see [`DataRoot::resolve`]).
    pub data_root: DataRoot,
    /// The output folder; `None` takes the config's (`[output] dir`, else `runs/<config name>`).
    pub out_dir: Option<PathBuf>,
    /// Continue from the newest checkpoint in the output folder (fresh start when there is none).
    pub resume: bool,
    /// Stop after this step instead of `train.steps` (the schedule is unchanged).
    pub stop_at: Option<u64>,
    /// Progress bar and log lines.
    pub verbosity: Verbosity,
    /// A TrueType font for plot text, tried before the usual system fonts.
    pub font: Option<PathBuf>,
}

impl TrainOptions {
    /// Options reading data from `data_root`, writing to the config's output folder, quiet.
    pub fn new(data_root: DataRoot) -> Self {
        Self { data_root, out_dir: None, resume: false, stop_at: None, verbosity: Verbosity::Quiet, font: None }
    }
}

/// The result of an evaluation pass.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvalResult {
    /// Mean cross-entropy per target (per image, or per text token in nats: per byte with the
    /// byte tokenizer).
    pub loss: f64,
    /// Classification accuracy, for image tasks.
    pub accuracy: Option<f64>,
    /// Targets evaluated (images, or text tokens).
    pub targets: usize,
}

/// What a finished run reports.
#[derive(Clone, Debug)]
pub struct TrainReport {
    /// Steps completed (the final step number).
    pub step: u64,
    /// The training loss of every step this process ran, in order.
    pub losses: Vec<f64>,
    /// Final evaluation on the validation split.
    pub val: EvalResult,
    /// Final evaluation on the test split, when the dataset has one.
    pub test: Option<EvalResult>,
    /// Final frozen-feature evaluation of an I-JEPA run (every train and test image).
    pub probes: Option<ProbeReport>,
    /// Unigram entropy of the corpus in nats per token (text tasks; per byte with the byte
    /// tokenizer).
    pub unigram_entropy_nats: Option<f64>,
    /// What one text token is (`"byte"`, or `"token"` for GPT-2's BPE): the unit of the text
    /// losses and entropy, `nats/<unit>`. `None` for images.
    pub text_unit: Option<&'static str>,
    /// Generated text (GPT).
    pub sample: Option<String>,
    /// Training throughput over this process's steps: images or tokens per second.
    pub throughput: f64,
    /// `"samples"` or `"tokens"`.
    pub throughput_unit: &'static str,
    /// Seconds this process spent in training steps (no evaluation or checkpoints).
    pub train_seconds: f64,
    /// Wall seconds of the whole run in this process.
    pub wall_seconds: f64,
    /// Parameter count.
    pub parameters: usize,
    /// The last checkpoint written.
    pub checkpoint: Option<PathBuf>,
    /// The output folder.
    pub out_dir: PathBuf,
}

/// Reads the config at `path` and runs it (see [`run`]); also copies the config into the output
/// folder as `config.toml`.
pub fn run_file(path: &Path, options: TrainOptions) -> Result<TrainReport> {
    let config = TrainConfig::load(path)?;
    let out_dir = options.out_dir.clone().unwrap_or_else(|| config.default_output_dir(Some(path)));
    std::fs::create_dir_all(&out_dir).map_err(|source| TrainError::Io { what: "cannot create output folder", path: out_dir.clone(), source })?;
    let copy = out_dir.join("config.toml");
    if !options.resume || !copy.exists() {
        std::fs::copy(path, &copy).map_err(|source| TrainError::Io { what: "cannot copy config to", path: copy.clone(), source })?;
    }
    run(&config, TrainOptions { out_dir: Some(out_dir), ..options })
}

/// Runs `config` to `train.steps` (or `options.stop_at`), then evaluates, plots and saves.
pub fn run(config: &TrainConfig, options: TrainOptions) -> Result<TrainReport> {
    let stop = options.stop_at.unwrap_or(config.train.steps);
    let mut trainer = Trainer::new(config.clone(), options)?;
    trainer.train_until(stop)?;
    trainer.finish()
}

/// A training run in progress.
pub struct Trainer {
    config: TrainConfig,
    options: TrainOptions,
    out_dir: PathBuf,
    data: TaskData,
    model: Model,
    optimizer: Optimizer,
    dropout_rng: Generator,
    step: u64,
    metrics: MetricsWriter,
    losses: Vec<f64>,
    interval: Interval,
    train_seconds: f64,
    train_items: u64,
    started: Instant,
    last_checkpoint: Option<(u64, PathBuf)>,
    plot_text: bool,
}

/// Accumulators between two log lines.
#[derive(Default)]
struct Interval {
    loss_sum: f64,
    steps: u64,
    seconds: f64,
    items: u64,
    last_grad_norm: Option<f64>,
    feature_std: Option<f64>,
}

impl Trainer {
    /// Loads the data, builds the model and optimizer, and (with `options.resume`) restores the
    /// newest checkpoint of the output folder.
    pub fn new(config: TrainConfig, options: TrainOptions) -> Result<Trainer> {
        let started = Instant::now();
        if config.train.device == crate::config::DeviceKind::Cuda {
            return Err(TrainError::CudaNeedsLaunch);
        }
        let out_dir = options.out_dir.clone().unwrap_or_else(|| config.default_output_dir(None));
        std::fs::create_dir_all(&out_dir).map_err(|source| TrainError::Io { what: "cannot create output folder", path: out_dir.clone(), source })?;
        let latest = ckpt::latest(&out_dir)?;
        if latest.is_some() && !options.resume {
            return Err(TrainError::OutputInUse { path: out_dir });
        }

        let context = match &config.model {
            ModelConfig::Gpt { context, .. } => Some(*context),
            ModelConfig::Mlp { .. } | ModelConfig::IJepa { .. } | ModelConfig::Vit { .. } => None,
        };
        let mut data = TaskData::load(&config, &options.data_root, context)?;
        let seed = config.train.seed;
        let mut init_rng = Generator::new(seed);
        let mut model = Model::for_config(&config, &data, &mut init_rng)?;
        model.module_mut().set_training(true);
        let mut optimizer = Optimizer::new(&config.optim, &config.schedule, model.module())?;
        let mut step = 0;
        let mut dropout_rng = Generator::with_stream(seed, DROPOUT_STREAM);
        let metrics_path = out_dir.join("metrics.jsonl");
        let metrics = match &latest {
            Some((_, path)) => {
                let state = restore(path, &config, &model, &mut optimizer, &mut data)?;
                step = state.step;
                dropout_rng = Generator::from_state(state.dropout_rng);
                MetricsWriter::resume(&metrics_path, step)?
            }
            None => MetricsWriter::create(&metrics_path)?,
        };
        Ok(Trainer {
            metrics,
            plot_text: plot::ensure_font(options.font.as_deref()),
            config,
            options,
            out_dir,
            data,
            model,
            optimizer,
            dropout_rng,
            step,
            losses: Vec::new(),
            interval: Interval::default(),
            train_seconds: 0.0,
            train_items: 0,
            started,
            last_checkpoint: latest,
        })
    }

    /// Steps completed.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// `(name, parameter)` pairs of the model, in visit order.
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.model.module().named_parameters()
    }

    /// The output folder.
    pub fn out_dir(&self) -> &Path {
        &self.out_dir
    }

    /// Trains until `stop` steps are done (no-op when already there), logging, evaluating and
    /// checkpointing at the configured intervals.
    pub fn train_until(&mut self, stop: u64) -> Result<()> {
        let total = self.config.train.steps.max(stop);
        if self.step == 0 {
            self.line(&format!("data: {}", self.data.describe()));
            self.line(&format!("model: {} parameters; optimizer {}", self.model.module().num_parameters(), self.optimizer.describe()));
        } else {
            self.line(&format!("resumed at step {} from {}", self.step, self.last_checkpoint.as_ref().map_or(String::new(), |c| c.1.display().to_string())));
        }
        let progress = Progress::new(self.options.verbosity, self.step, total);
        let unit = self.unit();
        while self.step < stop {
            let loss = self.train_step()?;
            let step = self.step;
            let cfg = self.config.train.clone();
            progress.update(step, loss, self.interval_rate(), unit);
            if every(step, cfg.log_every) || step == stop {
                self.log_interval(&progress)?;
            }
            if every(step, cfg.eval_every) && step != stop {
                let max = self.config.train.eval_batches;
                let eval = self.evaluate(EvalSplit::Val, max)?;
                self.record_eval(&progress, eval, true)?;
            }
            if every(step, self.config.jepa.as_ref().map_or(0, |j| j.probe_every)) && step != stop {
                self.probe(&progress, false)?;
            }
            if every(step, cfg.checkpoint_every) {
                self.save_checkpoint()?;
            }
        }
        progress.finish();
        Ok(())
    }

    /// One optimizer step; returns its loss.
    fn train_step(&mut self) -> Result<f64> {
        let t0 = Instant::now();
        let mut batch = self.data.train_batch(self.step)?;
        if let Model::IJepa(_, setup) = &self.model {
            batch.masks = Some(setup.masks_for_step(self.step, batch.rows)?);
        }
        self.optimizer.zero_grad(self.model.module())?;
        let out = self.model.loss(&batch, &mut self.dropout_rng, Reduction::Mean, false)?;
        let loss = out.loss.item()?;
        if !loss.is_finite() {
            return Err(TrainError::Diverged { step: self.step + 1, loss });
        }
        out.loss.backward()?;
        let feature_std = out.feature_std;
        drop(out);
        if let Some(wd) = jepa::weight_decay_at(&self.config, self.step) {
            self.optimizer.set_weight_decay(wd);
        }
        let grad_norm = self.optimizer.step(self.model.module(), self.step)?;
        self.model.after_step(self.step)?;
        self.step += 1;
        let dt = t0.elapsed().as_secs_f64();
        let items = self.items(&batch) as u64;
        self.losses.push(loss);
        self.train_seconds += dt;
        self.train_items += items;
        let iv = &mut self.interval;
        iv.loss_sum += loss;
        iv.steps += 1;
        iv.seconds += dt;
        iv.items += items;
        iv.last_grad_norm = grad_norm;
        iv.feature_std = feature_std;
        Ok(loss)
    }

    fn items(&self, batch: &task::Batch) -> usize {
        match self.data {
            TaskData::Image(_) => batch.rows,
            TaskData::Text(_) => batch.tokens,
        }
    }

    fn unit(&self) -> &'static str {
        match self.data {
            TaskData::Image(_) => "samples",
            TaskData::Text(_) => "tokens",
        }
    }

    fn interval_rate(&self) -> f64 {
        if self.interval.seconds > 0.0 {
            self.interval.items as f64 / self.interval.seconds
        } else {
            0.0
        }
    }

    fn log_interval(&mut self, progress: &Progress) -> Result<()> {
        if self.interval.steps == 0 {
            return Ok(());
        }
        let loss = self.interval.loss_sum / self.interval.steps as f64;
        let rate = self.interval_rate();
        let lr = self.optimizer.last_lr();
        let total = self.config.train.steps;
        let feature_std = self.interval.feature_std;
        let mut record = MetricRecord { step: self.step, loss: Some(loss), lr: Some(lr), grad_norm: self.interval.last_grad_norm, feature_std, wall_s: Some(self.started.elapsed().as_secs_f64()), ..Default::default() };
        match self.data {
            TaskData::Image(_) => record.samples_per_s = Some(rate),
            TaskData::Text(_) => record.tokens_per_s = Some(rate),
        }
        self.metrics.write(&record)?;
        let std = feature_std.map_or(String::new(), |s| format!(" | feature std {s:.4}"));
        progress.line(&format!("step {:>6}/{total} | loss {loss:.4}{std} | lr {lr:.3e} | {} {}/s | {:.1}s", self.step, human(rate), self.unit(), self.started.elapsed().as_secs_f64()));
        self.interval = Interval::default();
        Ok(())
    }

    fn record_eval(&mut self, progress: &Progress, eval: EvalResult, write: bool) -> Result<()> {
        if write {
            self.metrics.write(&MetricRecord { step: self.step, val_loss: Some(eval.loss), val_acc: eval.accuracy, wall_s: Some(self.started.elapsed().as_secs_f64()), ..Default::default() })?;
        }
        let acc = eval.accuracy.map_or(String::new(), |a| format!(" | val acc {:.2}%", a * 100.0));
        progress.line(&format!("step {:>6} | val loss {:.4}{acc}", self.step, eval.loss));
        self.plot()?;
        Ok(())
    }

    /// Evaluates the model on a held-out split (at most `max_batches` batches), without
    /// gradients, in evaluation mode (no dropout); training state is untouched.
    fn evaluate(&mut self, split: EvalSplit, max_batches: Option<usize>) -> Result<EvalResult> {
        let n = self.data.n_eval_batches(split, IMAGE_EVAL_BATCH);
        let n = max_batches.map_or(n, |m| m.min(n));
        self.model.module_mut().set_training(false);
        // Evaluation mode never draws from a generator; a scratch one keeps that obvious.
        let mut scratch = Generator::new(0);
        // A classifier's accuracy; an I-JEPA run is scored by its probes instead.
        let classifies = matches!(self.data, TaskData::Image(_)) && !matches!(self.model, Model::IJepa(..));
        let result = rtx_tensor::no_grad(|| -> Result<EvalResult> {
            let (mut loss_sum, mut targets, mut correct, mut rows) = (0.0, 0usize, 0usize, 0usize);
            for i in 0..n {
                let Some(mut batch) = self.data.eval_batch(split, i, IMAGE_EVAL_BATCH)? else { break };
                if let Model::IJepa(_, setup) = &self.model {
                    batch.masks = Some(setup.masks_for_eval(i, batch.rows)?);
                }
                let out = self.model.loss(&batch, &mut scratch, Reduction::Sum, classifies)?;
                loss_sum += out.loss.item()?;
                targets += batch.targets.numel();
                rows += batch.rows;
                correct += out.correct.unwrap_or(0);
            }
            let accuracy = classifies.then(|| correct as f64 / rows.max(1) as f64);
            Ok(EvalResult { loss: loss_sum / targets.max(1) as f64, accuracy, targets })
        });
        self.model.module_mut().set_training(true);
        result
    }

    /// Writes a checkpoint of the current step (and prunes old ones); returns its path.
    pub fn save_checkpoint(&mut self) -> Result<PathBuf> {
        if let Some((step, path)) = &self.last_checkpoint {
            if *step == self.step {
                return Ok(path.clone());
            }
        }
        let meta = ckpt::RunState { step: self.step, dropout_rng: self.dropout_rng.state(), data_cursor: self.data.cursor(), config: serde_json::to_value(&self.config).map_err(|e| TrainError::Internal(e.to_string()))? };
        let path = ckpt::save(&self.out_dir, &self.model, &self.optimizer, &meta)?;
        ckpt::prune(&self.out_dir, self.config.train.keep_checkpoints)?;
        self.last_checkpoint = Some((self.step, path.clone()));
        Ok(path)
    }

    /// Redraws `loss.png` from `metrics.jsonl`.
    fn plot(&self) -> Result<()> {
        let records = crate::metrics::read_metrics(self.metrics.path())?;
        let title = match &self.config.model {
            ModelConfig::Mlp { .. } => format!("MLP on {}", self.config.data.dataset.name()),
            ModelConfig::Gpt { .. } => match self.config.data.tokenizer {
                Tokenizer::Bytes => format!("byte GPT on {} (nats/byte)", self.config.data.dataset.name()),
                Tokenizer::Gpt2 => format!("GPT-2 BPE GPT on {} (nats/token)", self.config.data.dataset.name()),
            },
            ModelConfig::IJepa { video: None, .. } => format!("I-JEPA ViT on {} (latent loss, probe accuracy)", self.config.data.dataset.name()),
            ModelConfig::IJepa { video: Some(_), .. } => format!("V-JEPA ViT on moving {} (latent loss, class probe accuracy)", self.config.data.dataset.name()),
            ModelConfig::Vit { .. } => format!("ViT classifier on {} (supervised)", self.config.data.dataset.name()),
        };
        let baseline = self.data.text().map(|t| (t.entropy_nats, "corpus unigram entropy"));
        plot::plot_loss_curve(&records, &self.out_dir.join("loss.png"), &title, baseline, self.plot_text)?;
        Ok(())
    }

    /// Final evaluation (whole validation split, test split, corpus entropy, a text sample),
    /// final checkpoint and plot; prints a summary unless quiet.
    pub fn finish(mut self) -> Result<TrainReport> {
        let progress = Progress::new(if self.options.verbosity == Verbosity::Quiet { Verbosity::Quiet } else { Verbosity::Lines }, self.step, self.step);
        // Resuming a finished run trains nothing; its final records are already in the file.
        let already_final = self.losses.is_empty() && crate::metrics::read_metrics(self.metrics.path())?.iter().any(|r| r.step == self.step && r.val_loss.is_some());
        let val = self.evaluate(EvalSplit::Val, None)?;
        self.record_eval(&progress, val, !already_final)?;
        let test = if self.data.has_test() {
            let test = self.evaluate(EvalSplit::Test, None)?;
            if !already_final {
                self.metrics.write(&MetricRecord { step: self.step, test_loss: Some(test.loss), test_acc: test.accuracy, wall_s: Some(self.started.elapsed().as_secs_f64()), ..Default::default() })?;
            }
            Some(test)
        } else {
            None
        };
        let probes = if self.config.jepa.is_some() && !already_final { Some(self.probe(&progress, true)?) } else { None };
        let entropy = self.data.text().map(|t| t.entropy_nats);
        let sample = self.sample()?;
        let checkpoint = self.save_checkpoint()?;
        self.plot()?;

        let throughput = if self.train_seconds > 0.0 { self.train_items as f64 / self.train_seconds } else { 0.0 };
        let report = TrainReport {
            step: self.step,
            losses: std::mem::take(&mut self.losses),
            val,
            test,
            probes,
            unigram_entropy_nats: entropy,
            text_unit: self.data.text().map(|t| t.tokenizer.unit()),
            sample,
            throughput,
            throughput_unit: self.unit(),
            train_seconds: self.train_seconds,
            wall_seconds: self.started.elapsed().as_secs_f64(),
            parameters: self.model.module().num_parameters(),
            checkpoint: Some(checkpoint),
            out_dir: self.out_dir.clone(),
        };
        for line in summary(&report) {
            progress.line(&line);
        }
        Ok(report)
    }

    /// Linear probe, k-NN and pixel baseline on frozen I-JEPA features (`full`: the final
    /// evaluation, every image of the train and test splits unless `[jepa] final_probe_*` limit
    /// them; else the periodic subsets, without the pixel baseline), written to the metrics.
    fn probe(&mut self, progress: &Progress, full: bool) -> Result<ProbeReport> {
        let j = jepa::jepa_config(&self.config)?.clone();
        let Model::IJepa(model, setup) = &mut self.model else { return Err(TrainError::Internal("probes need an I-JEPA model".into())) };
        let s = self.data.images().ok_or_else(|| TrainError::Internal("probes need image data".into()))?;
        // Without a test file (digits) the probes score the validation split.
        let test = s.test.as_ref().unwrap_or(&s.val);
        let limit = if full { Some((j.final_probe_train_images.unwrap_or(usize::MAX), j.final_probe_test_images.unwrap_or(usize::MAX))) } else { Some((j.probe_train_images, j.probe_test_images)) };
        let t0 = Instant::now();
        let attentive = match &self.config.model {
            ModelConfig::IJepa { video: Some(v), .. } if v.attentive_probe => Some(v.attentive_epochs),
            _ => None,
        };
        let report = jepa::probes(model, setup, &j, s, test, limit, full && j.pixel_baseline, attentive)?;
        let first_direction = report.readouts.first().and_then(|r| r.direction);
        self.metrics.write(&MetricRecord {
            step: self.step,
            probe_acc: Some(report.probe_acc),
            knn_acc: Some(report.knn_acc),
            pixel_probe_acc: report.pixel_probe_acc,
            probe_readout: Some(report.readout.name().to_string()),
            probe_readouts: report
                .readouts
                .iter()
                .map(|r| ReadoutMetric {
                    readout: r.readout.name().to_string(),
                    dim: r.dim,
                    probe_acc: r.probe_acc,
                    knn_acc: r.knn_acc,
                    direction_probe_acc: r.direction.map(|d| d.0),
                    direction_knn_acc: r.direction.map(|d| d.1),
                })
                .collect(),
            probe_train_images: Some(report.train_images),
            direction_probe_acc: first_direction.map(|d| d.0),
            direction_knn_acc: first_direction.map(|d| d.1),
            attentive_probe_acc: report.attentive.map(|a| a.0),
            attentive_direction_acc: report.attentive.map(|a| a.1),
            wall_s: Some(self.started.elapsed().as_secs_f64()),
            ..Default::default()
        })?;
        let pixels = report.pixel_probe_acc.map_or(String::new(), |p| format!(" | pixel probe {:.2}%", p * 100.0));
        let readouts: String = report.readouts.iter().map(|r| format!(" | {}", readout_line(r))).collect();
        let attentive = report.attentive.map_or(String::new(), |(c, d)| format!(" | attentive probe: class {:.2}%, direction {:.2}%", c * 100.0, d * 100.0));
        progress.line(&format!(
            "step {:>6}{readouts}{attentive}{pixels} ({} train / {} test images, {:.1}s)",
            self.step,
            report.train_images,
            report.test_images,
            t0.elapsed().as_secs_f64()
        ));
        self.plot()?;
        Ok(report)
    }

    /// Generates `[sample] length` tokens after the prompt (GPT only): bytes, or GPT-2 tokens
    /// (the prompt encoded and the whole sample decoded by the tokenizer).
    fn sample(&mut self) -> Result<Option<String>> {
        let Model::Gpt(gpt) = &mut self.model else { return Ok(None) };
        let s = &self.config.sample;
        let mut rng = Generator::with_stream(self.config.train.seed, SAMPLE_STREAM);
        let tokenizer = match self.config.data.tokenizer {
            Tokenizer::Bytes => None,
            Tokenizer::Gpt2 => Some(Gpt2Tokenizer::new()?),
        };
        let prompt: Vec<u32> = match &tokenizer {
            None => s.prompt.bytes().map(u32::from).collect(),
            Some(t) => t.encode(&s.prompt),
        };
        gpt.set_training(false);
        let out = rtx_tensor::no_grad(|| gpt.generate(&prompt, s.length, s.temperature, None, &mut rng));
        gpt.set_training(true);
        let bytes: Vec<u8> = match &tokenizer {
            None => s.prompt.bytes().chain(out?.into_iter().map(|b| b.min(255) as u8)).collect(),
            // The model never predicts a padding row, so every id decodes.
            Some(t) => t.decode_bytes(&[prompt, out?].concat())?,
        };
        Ok(Some(String::from_utf8_lossy(&bytes).into_owned()))
    }

    fn line(&self, text: &str) {
        if self.options.verbosity != Verbosity::Quiet {
            println!("{text}");
        }
    }
}

/// Whether `step` is a positive multiple of `interval` (never when `interval` is 0).
#[allow(clippy::manual_is_multiple_of, reason = "is_multiple_of needs Rust 1.87; the workspace says 1.85")]
fn every(step: u64, interval: u64) -> bool {
    interval > 0 && step % interval == 0
}

/// Loads the checkpoint at `path` into the model, optimizer and data sampler, after checking
/// that it was written by a run with the same model, data, optimizer, schedule and seed.
fn restore(path: &Path, config: &TrainConfig, model: &Model, optimizer: &mut Optimizer, data: &mut TaskData) -> Result<ckpt::RunState> {
    // Check that the checkpoint belongs to this run before touching any tensor.
    let saved = ckpt::read_state(path)?.config;
    let now = serde_json::to_value(config).map_err(|e| TrainError::Internal(e.to_string()))?;
    for section in ["model", "data", "optim", "schedule", "jepa"] {
        if saved.get(section) != now.get(section) {
            return Err(TrainError::Resume(format!(
                "checkpoint {} was written with a different [{section}] section ({} then, {} now); resume with the original config or use another --out",
                path.display(),
                saved.get(section).map_or("none".into(), |v| v.to_string()),
                now.get(section).map_or("none".into(), |v| v.to_string())
            )));
        }
    }
    let seed = |c: &serde_json::Value| c.get("train").and_then(|t| t.get("seed")).cloned();
    if seed(&saved) != seed(&now) {
        return Err(TrainError::Resume(format!("checkpoint {} was written with another train.seed", path.display())));
    }
    let state = ckpt::load(path, model, optimizer)?;
    data.restore(state.data_cursor)?;
    Ok(state)
}

/// One readout's accuracies for the log: class, and the direction when the run has clips.
fn readout_line(r: &ReadoutReport) -> String {
    let direction = r.direction.map_or(String::new(), |(p, k)| format!("; direction: linear probe {:.2}%, k-NN {:.2}%", p * 100.0, k * 100.0));
    format!("{} ({} dims): linear probe {:.2}%, k-NN {:.2}%{direction}", r.readout.name(), r.dim, r.probe_acc * 100.0, r.knn_acc * 100.0)
}

/// The summary lines printed at the end of a run.
pub fn summary(r: &TrainReport) -> Vec<String> {
    let mut lines = vec![format!(
        "done: {} steps, {} parameters, {:.1}s training ({:.1}s wall), {} {}/s",
        r.step,
        r.parameters,
        r.train_seconds,
        r.wall_seconds,
        human(r.throughput),
        r.throughput_unit
    )];
    match r.val.accuracy {
        Some(acc) => lines.push(format!("validation: loss {:.4}, accuracy {:.2}% ({} images)", r.val.loss, acc * 100.0, r.val.targets)),
        None if r.probes.is_some() => lines.push(format!("validation latent loss: {:.4} ({} images)", r.val.loss, r.val.targets)),
        None => {
            let unit = r.text_unit.unwrap_or("byte");
            lines.push(format!("validation loss: {:.4} nats/{unit} ({} {unit}s)", r.val.loss, r.val.targets));
        }
    }
    if let Some(t) = &r.test {
        match t.accuracy {
            Some(acc) => lines.push(format!("test accuracy: {:.2}% (loss {:.4}, {} images)", acc * 100.0, t.loss, t.targets)),
            None => lines.push(format!("test loss: {:.4} ({} images)", t.loss, t.targets)),
        }
    }
    if let Some(p) = &r.probes {
        let pixels = p.pixel_probe_acc.map_or(String::new(), |a| format!("; linear probe on raw pixels {:.2}%", a * 100.0));
        let readouts: Vec<String> = p.readouts.iter().map(readout_line).collect();
        let attentive = p.attentive.map_or(String::new(), |(c, d)| format!("; attentive probe: class {:.2}%, direction {:.2}%", c * 100.0, d * 100.0));
        lines.push(format!("frozen features ({} train / {} test images): {}{attentive}{pixels}", p.train_images, p.test_images, readouts.join("; ")));
    }
    if let Some(h) = r.unigram_entropy_nats {
        let unit = r.text_unit.unwrap_or("byte");
        lines.push(format!("corpus unigram entropy: {h:.4} nats/{unit}; validation loss is {:.4} below it ({:.1}%)", h - r.val.loss, 100.0 * (h - r.val.loss) / h));
    }
    if let Some(s) = &r.sample {
        lines.push("sample:".into());
        lines.push(s.clone());
    }
    lines.push(format!("outputs: {}", r.out_dir.display()));
    lines
}
