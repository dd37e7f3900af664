//! The training task of `rtx launch` / `rtx worker` as an elastic job: the same config, data,
//! model and optimizer as `rtx train`, shaped as an `rtx_supervisor::TrainJob` so the worker
//! runtime can drive it on any number of ranks.
//!
//! Batches are indexed by global step: step `s` is batch `s mod B` of epoch `s div B` of the
//! seeded epoch order (images) or the windows drawn for `s` (text), and rank `r` of `w` takes the
//! contiguous part `r` of that global batch (the first `len mod w` parts one row longer). So the
//! global batch of a step never depends on the world size, and after a shrink or grow no sample
//! of an epoch is skipped or seen twice. Dropout draws from a generator seeded by
//! `(seed, step, rank)`.
//!
//! With `[train] device = "cuda"` the replica lives on the worker's GPU ([`Placement`]): the model
//! is built on the host from the seed (so every worker starts from the same values), moved to the
//! device in the configured precision, and trained with `rtx_tensor::cuda::MixedAdamW` (f32 master weights and
//! moments on the device; under `[elastic] sharding = "zero1"`/`"zero2"` each rank's AdamW holds
//! only its segments' state there, with weight decay chosen by the parameter's full shape). Batches are assembled on the host exactly as for the CPU and uploaded
//! in [`TrainJob::loss`]; evaluation runs on the device with mean losses weighted by their
//! targets. The optimizer state leaves the device in host tensors (`<param>.master`,
//! `exp_avg`, `exp_avg_sq`, `step`), which is what elastic state sync and checkpoints carry. A
//! fresh optimizer's master weights are the device parameters widened to f32 (the initial values
//! rounded to bf16 once), so every replica and every re-formation agree on them.
//!
//! An I-JEPA / V-JEPA job on the GPU is the same loop: the model moves with its EMA target encoder
//! (buffers) kept f32 on the device ([`move_to_device`]), each batch's pixels go up in the
//! parameters' dtype (the masks stay host index lists, uploaded by the ops that use them), the
//! optimizer is the same device AdamW (its weight-decay schedule included), and
//! `Model::after_step` runs the EMA update on the device in one launch. Buffers travel through
//! checkpoints and state sync as host f32 copies, exactly as on the CPU. The final evaluation
//! scores the validation latent loss on the device and runs the probes' encoder there; the probes
//! themselves train on host copies of its readouts (`super::jepa::probes`).
//!
//! A model-parallel job ([`TrainJob::mesh`]) on the GPU does the same per member: each builds the
//! full model on the host from the seed, keeps its `TpGptStage` slices, moves them to its device
//! in the configured precision and steps them with the device AdamW; the engine host-stages what
//! crosses stages and tensor-parallel ranks (see `rtx_pipelines::Placement`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;

use rtx_actors::BatchSource;
use std::sync::Arc;

use rtx_pipelines::pipeline::{PipelineConfig, TokenBatch, TpGptStage};
use rtx_pipelines::schedule::ScheduleKind;
use rtx_pipelines::tp::TpOptions;
use rtx_pipelines::{DpConfig, ParamSlice};
use rtx_supervisor::plan::{partition_layers, Schedule};
use rtx_supervisor::{BoxedStage, FsdpSpec, JobSpec, MeshSpec, StageRequest, TrainJob};
use rtx_tensor::checkpoint::sharded::ModelLayout;
use rtx_tensor::nn::Module;
use rtx_tensor::data::DataRoot;
use rtx_tensor::optim::{self, LrSchedule};
use rtx_tensor::{no_grad, Device, Generator, Reduction, Tensor};

use crate::config::{ModelConfig, TrainConfig};

use super::device::{resolve_device, Placement};
use super::jepa::{self, JepaSetup};
use super::model::Model;
use super::optimizer::{build_inner, build_inner_by, build_schedule};
use super::task::{Batch, EvalSplit, TaskData};
use super::{DROPOUT_STREAM, IMAGE_EVAL_BATCH};

/// A training config with its data loaded, ready to be trained elastically.
pub(crate) struct ElasticJob {
    config: TrainConfig,
    data: TaskData,
    schedule: Box<dyn LrSchedule + Send + Sync>,
    epoch_order: Mutex<Option<(u64, Vec<usize>)>>,
    checkpoint_dir: Option<PathBuf>,
    placement: Placement,
    /// The masks and shapes of an I-JEPA job.
    jepa: Option<JepaSetup>,
}

/// One rank's part of a global batch.
pub(crate) struct RankBatch {
    batch: Batch,
    rank: usize,
}

/// The optimizer of an elastic job: the configured algorithm. Gradients are already averaged
/// across ranks, and clipped, when it runs: `optim.grad_clip` is the engine's
/// (`DpConfig::grad_clip`, by the whole model's norm under replication and ZeRO-1/2/3 alike),
/// because under ZeRO this optimizer steps only its rank's segments.
pub(crate) struct JobOptimizer {
    inner: Box<dyn optim::Optimizer + Send>,
}

impl ElasticJob {
    /// Builds the job from the description the supervisor handed over; data from `data_root`.
    /// `local_rank` is this process's index among the workers of its machine (it picks the GPU).
    pub(crate) fn new(spec_text: &str, data_root: &DataRoot, checkpoint_dir: Option<PathBuf>, local_rank: usize) -> Result<ElasticJob, String> {
        let config = TrainConfig::from_toml_str(spec_text).map_err(|e| e.to_string())?;
        let placement = resolve_device(&config, local_rank).map_err(|e| e.to_string())?;
        let context = match &config.model {
            ModelConfig::Gpt { context, .. } => Some(*context),
            ModelConfig::Mlp { .. } | ModelConfig::IJepa { .. } | ModelConfig::Vit { .. } => None,
        };
        let data = TaskData::load(&config, data_root, context).map_err(|e| e.to_string())?;
        let schedule = build_schedule(&config.optim, &config.schedule);
        let jepa = match (&config.model, data.image_size()) {
            (ModelConfig::IJepa { .. }, Some(image)) => Some(jepa::setup(&config, image).map_err(|e| e.to_string())?),
            _ => None,
        };
        Ok(ElasticJob { config, data, schedule, epoch_order: Mutex::new(None), checkpoint_dir, placement, jepa })
    }

    /// Builds the job of a worker process (`local_rank`: see [`ElasticJob::new`]).
    pub(crate) fn for_worker(spec: &JobSpec, data_root: &DataRoot, checkpoint_dir: Option<PathBuf>, local_rank: usize) -> Result<ElasticJob, String> {
        let job = ElasticJob::new(&spec.job, data_root, checkpoint_dir, local_rank)?;
        tracing::info!(placement = ?job.placement, local_rank, "replica placement");
        Ok(job)
    }

    /// `batch` on the replica's device (the same tensors on the host): token ids and labels as
    /// they are, pixels (I-JEPA's images and clips) in the parameters' dtype. I-JEPA masks stay
    /// host index lists; the model's ops upload the index tensors they build from them.
    fn on_device(&self, batch: &Batch) -> Result<Batch, String> {
        match self.placement {
            Placement::Cpu => Ok(Batch { inputs: batch.inputs.clone(), targets: batch.targets.clone(), rows: batch.rows, tokens: batch.tokens, masks: batch.masks.clone() }),
            Placement::Cuda { ordinal, dtype } => {
                let device = Device::Cuda(ordinal);
                let inputs = if batch.inputs.dtype().is_float() { batch.inputs.to_dtype(dtype) } else { Ok(batch.inputs.clone()) };
                let inputs = inputs.and_then(|t| t.to_device(device)).map_err(|e| e.to_string())?;
                let targets = batch.targets.to_device(device).map_err(|e| e.to_string())?;
                Ok(Batch { inputs, targets, rows: batch.rows, tokens: batch.tokens, masks: batch.masks.clone() })
            }
        }
    }

    /// What one step counts (`samples` or `tokens`) and how many per global batch.
    pub(crate) fn unit(config: &TrainConfig) -> (&'static str, u64) {
        match &config.model {
            ModelConfig::Gpt { context, .. } => ("tokens", (config.data.batch_size * context) as u64),
            ModelConfig::Mlp { .. } | ModelConfig::IJepa { .. } | ModelConfig::Vit { .. } => ("samples", config.data.batch_size as u64),
        }
    }

    fn global_rows(&self, step: u64) -> Result<Batch, String> {
        match &self.data {
            TaskData::Image(s) => {
                let per_epoch = s.sampler.batches_per_epoch().max(1) as u64;
                let (epoch, index) = (step / per_epoch, (step % per_epoch) as usize);
                let mut cache = self.epoch_order.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                if cache.as_ref().is_none_or(|(e, _)| *e != epoch) {
                    *cache = Some((epoch, s.sampler.epoch_plan(epoch).order().to_vec()));
                }
                let order = cache.as_ref().map(|(_, o)| o.as_slice()).unwrap_or_default();
                let start = index * self.config.data.batch_size;
                let end = (start + self.config.data.batch_size).min(order.len());
                // Images, or their clips of this epoch (V-JEPA): any rank regenerates the same rows.
                s.rows(&s.train, &order[start..end], super::task::ClipSplit::Train, epoch).map(|(b, _)| b).map_err(|e| e.to_string())
            }
            TaskData::Text(s) => {
                let b = s.train.batch(&s.sampler, step).map_err(|e| e.to_string())?;
                super::task::text_batch(b).map_err(|e| e.to_string())
            }
        }
    }
}

impl ElasticJob {
    /// The final evaluation of an I-JEPA job: the latent loss on the validation split (fixed
    /// masks) and the frozen-feature probes on the `[jepa]` periodic subsets (the linear probe,
    /// k-NN and the pixel baseline; readouts after the first as `probe_acc_<name>` /
    /// `knn_acc_<name>`).
    fn evaluate_jepa(&self, model: &mut rtx_tensor::nn::IJepa, setup: &JepaSetup) -> Result<Vec<(String, f64)>, String> {
        let j = jepa::jepa_config(&self.config).map_err(|e| e.to_string())?;
        let s = self.data.images().ok_or("I-JEPA needs image data")?;
        model.set_training(false);
        let mut scratch = Generator::new(0);
        let n = self.data.n_eval_batches(EvalSplit::Val, IMAGE_EVAL_BATCH);
        let n = self.config.train.eval_batches.map_or(n, |m| m.min(n));
        let val = no_grad(|| -> Result<(f64, usize), String> {
            let (mut sum, mut rows) = (0.0, 0usize);
            for i in 0..n {
                let Some(batch) = self.data.eval_batch(EvalSplit::Val, i, IMAGE_EVAL_BATCH).map_err(|e| e.to_string())? else { break };
                let masks = setup.masks_for_eval(i, batch.rows).map_err(|e| e.to_string())?;
                let batch = self.on_device(&batch)?;
                let out = model.loss(&setup.images(&batch.inputs).map_err(|e| e.to_string())?, &masks, &mut scratch).map_err(|e| e.to_string())?;
                sum += out.loss.item().map_err(|e| e.to_string())? * batch.rows as f64;
                rows += batch.rows;
            }
            Ok((sum, rows))
        });
        model.set_training(true);
        let (sum, rows) = val?;
        let test = s.test.as_ref().unwrap_or(&s.val);
        let attentive = match &self.config.model {
            ModelConfig::IJepa { video: Some(v), .. } if v.attentive_probe => Some(v.attentive_epochs),
            _ => None,
        };
        let report = jepa::probes(model, setup, j, s, test, Some((j.probe_train_images, j.probe_test_images)), j.pixel_baseline, attentive).map_err(|e| e.to_string())?;
        let mut metrics = vec![("val_loss".to_string(), sum / rows.max(1) as f64), ("probe_acc".into(), report.probe_acc), ("knn_acc".into(), report.knn_acc)];
        if let Some((p, k)) = report.readouts.first().and_then(|r| r.direction) {
            metrics.push(("direction_probe_acc".into(), p));
            metrics.push(("direction_knn_acc".into(), k));
        }
        if let Some((c, d)) = report.attentive {
            metrics.push(("attentive_probe_acc".into(), c));
            metrics.push(("attentive_direction_acc".into(), d));
        }
        for r in report.readouts.iter().skip(1) {
            metrics.push((format!("probe_acc_{}", r.readout.name()), r.probe_acc));
            metrics.push((format!("knn_acc_{}", r.readout.name()), r.knn_acc));
        }
        if let Some(p) = report.pixel_probe_acc {
            metrics.push(("pixel_probe_acc".into(), p));
        }
        Ok(metrics)
    }
}

impl BatchSource for ElasticJob {
    type Batch = RankBatch;

    fn batch(&self, step: u64, rank: usize, world: usize) -> Result<RankBatch, String> {
        let global = self.global_rows(step)?;
        let part = rtx_collectives::segment_range(global.rows, world, rank);
        let rows = part.len();
        let slice = |t: &Tensor| t.narrow(0, part.start, rows).and_then(|v| v.contiguous()).map_err(|e| e.to_string());
        let inputs = slice(&global.inputs)?;
        let targets = slice(&global.targets)?;
        let tokens = global.tokens.checked_div(global.rows).map_or(0, |per_row| per_row * rows);
        // I-JEPA masks are drawn for the global batch and cut like it: independent of the world.
        let masks = match &self.jepa {
            Some(setup) => Some(setup.masks_for_step(step, global.rows).and_then(|m| Ok(m.rows(part.start, rows)?)).map_err(|e| e.to_string())?),
            None => None,
        };
        Ok(RankBatch { batch: Batch { inputs, targets, rows, tokens, masks }, rank })
    }
}

impl TrainJob for ElasticJob {
    type Model = Model;
    type Optim = JobOptimizer;

    fn build_model(&self) -> Result<Model, String> {
        let mut init_rng = Generator::new(self.config.train.seed);
        let mut model = Model::for_config(&self.config, &self.data, &mut init_rng).map_err(|e| e.to_string())?;
        model.module_mut().set_training(true);
        if let Placement::Cuda { ordinal, dtype } = self.placement {
            move_to_device(&mut model, ordinal, dtype)?;
        }
        Ok(model)
    }

    fn build_optimizer(&self, slices: &[ParamSlice]) -> Result<JobOptimizer, String> {
        let named: Vec<(String, Tensor)> = slices.iter().map(|s| (s.name.clone(), s.tensor.clone())).collect();
        // Under ZeRO a slice is a 1-d piece of its parameter: AdamW's weight decay follows the
        // parameter's full shape (matrices and embeddings), as it does on whole parameters.
        let ranks: BTreeMap<String, usize> = slices.iter().map(|s| (s.name.clone(), s.param_shape.len())).collect();
        let decays = move |name: &str, _: &Tensor| ranks.get(name).is_some_and(|&rank| rank >= 2);
        let inner = match self.placement {
            Placement::Cpu => build_inner_by(&self.config.optim, named, decays).map_err(|e| e.to_string())?.0,
            Placement::Cuda { .. } => device_optimizer(&self.config, named, decays)?,
        };
        Ok(JobOptimizer { inner })
    }

    fn device_memory(&self) -> Option<rtx_supervisor::DeviceMemory> {
        device_memory(self.placement)
    }

    fn dp_config(&self) -> DpConfig {
        // Clipping by the model's norm is the engine's in every sharding (see `JobOptimizer`).
        DpConfig { grad_clip: self.config.optim.grad_clip, ..DpConfig::default() }
    }

    fn loss(&self, model: &mut Model, batch: &RankBatch, step: u64) -> rtx_tensor::Result<(Tensor, usize)> {
        let seed = self.config.train.seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (batch.rank as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
        let mut rng = Generator::with_stream(seed, DROPOUT_STREAM);
        let local = self.on_device(&batch.batch).map_err(|reason| rtx_tensor::Error::InvalidArgument { op: "loss", reason })?;
        let out = model.loss(&local, &mut rng, Reduction::Mean, false).map_err(|e| rtx_tensor::Error::InvalidArgument { op: "loss", reason: e.to_string() })?;
        Ok((out.loss, batch.batch.rows))
    }

    fn global_batch(&self) -> usize {
        self.config.data.batch_size
    }

    fn total_steps(&self) -> u64 {
        self.config.train.steps
    }

    fn set_lr(&self, optimizer: &mut JobOptimizer, step: u64) {
        optimizer.inner.set_lr(self.schedule.lr(step));
        if let Some(wd) = jepa::weight_decay_at(&self.config, step) {
            optimizer.inner.set_weight_decay(wd);
        }
    }

    fn after_step(&self, model: &mut Model, step: u64) -> Result<(), String> {
        model.after_step(step).map_err(|e| e.to_string())
    }

    fn evaluate(&self, model: &mut Model) -> Result<Vec<(String, f64)>, String> {
        if let Model::IJepa(m, setup) = model {
            return self.evaluate_jepa(m, setup);
        }
        let mut metrics = Vec::new();
        model.module_mut().set_training(false);
        let mut scratch = Generator::new(0);
        let is_image = matches!(self.data, TaskData::Image(_));
        let splits: &[(EvalSplit, &str)] = if self.data.has_test() { &[(EvalSplit::Val, "val"), (EvalSplit::Test, "test")] } else { &[(EvalSplit::Val, "val")] };
        for (split, name) in splits {
            let n = self.data.n_eval_batches(*split, IMAGE_EVAL_BATCH);
            let n = self.config.train.eval_batches.map_or(n, |m| m.min(n));
            let result = no_grad(|| -> Result<(f64, usize, usize, usize), String> {
                let (mut loss_sum, mut targets, mut correct, mut rows) = (0.0, 0usize, 0usize, 0usize);
                for i in 0..n {
                    let Some(batch) = self.data.eval_batch(*split, i, IMAGE_EVAL_BATCH).map_err(|e| e.to_string())? else { break };
                    let loss = if self.placement == Placement::Cpu {
                        let out = model.loss(&batch, &mut scratch, Reduction::Sum, is_image).map_err(|e| e.to_string())?;
                        correct += out.correct.unwrap_or(0);
                        out.loss.item().map_err(|e| e.to_string())?
                    } else {
                        // The device computes mean losses (a GPT: I-JEPA evaluates in
                        // `evaluate_jepa`; no accuracy): weight by targets.
                        let out = model.loss(&self.on_device(&batch)?, &mut scratch, Reduction::Mean, false).map_err(|e| e.to_string())?;
                        out.loss.item().map_err(|e| e.to_string())? * batch.targets.numel() as f64
                    };
                    loss_sum += loss;
                    targets += batch.targets.numel();
                    rows += batch.rows;
                }
                Ok((loss_sum, targets, correct, rows))
            })?;
            metrics.push((format!("{name}_loss"), result.0 / result.1.max(1) as f64));
            if is_image {
                metrics.push((format!("{name}_acc"), result.2 as f64 / result.3.max(1) as f64));
            }
        }
        if let Some(text) = self.data.text() {
            metrics.push(("unigram_entropy".into(), text.entropy_nats));
        }
        model.module_mut().set_training(true);
        Ok(metrics)
    }

    fn mesh(&self) -> Option<MeshSpec<RankBatch>> {
        if self.jepa.is_some() {
            return None;
        }
        let p = &self.config.parallel;
        // `[parallel]` was checked at parse time: pp and tp above 1 only for a GPT.
        if p.pp * p.tp <= 1 {
            return None;
        }
        let schedule = match p.schedule {
            Schedule::GPipe => ScheduleKind::GPipe,
            Schedule::OneFOneB => ScheduleKind::OneFOneB,
            Schedule::Interleaved => ScheduleKind::Interleaved { chunks: p.chunks() },
            Schedule::ZbH1 => ScheduleKind::ZeroBubbleH1,
        };
        let (model, n_classes, pad, seed, config, placement) = (self.config.model.clone(), self.data.n_classes(), self.data.vocab_pad_multiple(), self.config.train.seed, self.config.clone(), self.placement);
        let (chunks, stage_layers, layout) = (p.chunks(), p.stage_layers.clone(), self.config.model_layout());
        if stage_layers.is_none() && layout.is_none() {
            return None;
        }
        // The layers of each virtual stage at `pp` stages: `[parallel] stage_layers` at its own
        // `pp`, else balanced by cost (a re-partitioned mesh has another `pp`). Config validation
        // made the configured split valid; should a partition still fail, every member's build
        // reports it (training the job replicated instead would hide it).
        let layers_at = move |pp: usize| -> Result<Vec<std::ops::Range<usize>>, String> {
            let virtual_stages = pp * chunks;
            match (&stage_layers, &layout) {
                (Some(counts), _) if counts.len() == virtual_stages => Ok(counts.iter().scan(0, |start, n| {
                    *start += n;
                    Some(*start - n..*start)
                }).collect()),
                (_, Some(layout)) => partition_layers(&layout.static_costs(), virtual_stages).map_err(|e| format!("partitioning the layers over {virtual_stages} virtual stages: {e}")),
                (_, None) => Err(format!("[parallel] stage_layers names {} virtual stages and the model's layout is unknown, so it cannot be cut into {virtual_stages}", stage_layers.as_ref().map_or(0, Vec::len))),
            }
        };
        let build = move |request: &StageRequest| -> Result<(BoxedStage, Box<dyn optim::Optimizer + Send>), String> {
            let Model::Gpt(gpt) = Model::build(&model, None, n_classes, pad, &mut Generator::new(seed)).map_err(|e| e.to_string())? else {
                return Err("pipeline and tensor parallelism train a GPT".into());
            };
            let layers = layers_at(request.shape.pp)?;
            let mut part = TpGptStage::from_full(&gpt, request.tp.clone(), TpOptions::default(), &layers, request.coord.pp, request.shape.pp).map_err(|e| e.to_string())?;
            // Clipping is the engine's (over the whole mesh), not the optimizer's. On a GPU the
            // part's slices move there and AdamW keeps f32 master weights there, as in DP.
            let optimizer = match placement {
                Placement::Cpu => build_inner(&config.optim, part.named_parameters()).map_err(|e| e.to_string())?.0,
                Placement::Cuda { ordinal, dtype } => {
                    move_module_to_device(&mut part, ordinal, dtype)?;
                    device_optimizer(&config, part.named_parameters(), optim::AdamW::decay_matrices)?
                }
            };
            Ok((Box::new(part), optimizer))
        };
        let schedule_lr = build_schedule(&self.config.optim, &self.config.schedule);
        Some(MeshSpec {
            pp: p.pp,
            tp: p.tp,
            pipeline: PipelineConfig { schedule, microbatches: p.microbatches, grad_clip: self.config.optim.grad_clip, seed },
            build: Arc::new(build),
            split: Arc::new(|batch: &RankBatch, parts| TokenBatch { ids: batch.batch.inputs.clone(), targets: batch.batch.targets.clone() }.split(parts).map_err(|e| e.to_string())),
            lr: Arc::new(move |step| schedule_lr.lr(step)),
            // `Model::build` leaves `tie_embeddings` at `GptConfig`'s default, the only field the
            // layout reads.
            layout: ModelLayout::gpt(&rtx_tensor::nn::GptConfig::default()),
        })
    }

    fn fsdp(&self) -> Option<FsdpSpec<RankBatch>> {
        // ZeRO-3 cuts a GPT into units (its edge and its blocks); `rtx launch` refuses it for any
        // other model before a worker starts (`JobFiles::elastic`).
        if !matches!(self.config.model, ModelConfig::Gpt { .. }) || self.jepa.is_some() {
            return None;
        }
        let (model, n_classes, pad, seed) = (self.config.model.clone(), self.data.n_classes(), self.data.vocab_pad_multiple(), self.config.train.seed);
        let build = move || -> Result<rtx_tensor::nn::Gpt, String> {
            match Model::build(&model, None, n_classes, pad, &mut Generator::new(seed)).map_err(|e| e.to_string())? {
                Model::Gpt(mut gpt) => {
                    gpt.set_training(true);
                    Ok(*gpt)
                }
                _ => Err("ZeRO-3 (FSDP) trains a GPT".into()),
            }
        };
        Some(FsdpSpec {
            build: Arc::new(build),
            tokens: Arc::new(|batch: &RankBatch| Ok((batch.batch.inputs.clone(), batch.batch.targets.clone(), batch.batch.rows))),
            // The generator `loss` draws dropout masks from, per (step, rank).
            rng: Arc::new(move |step, rank| Generator::with_stream(seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (rank as u64).wrapping_mul(0xD1B5_4A32_D192_ED03), DROPOUT_STREAM)),
        })
    }

    fn checkpoint_dir(&self) -> Option<PathBuf> {
        self.checkpoint_dir.clone()
    }

    fn trace(&self) -> Option<(u64, PathBuf)> {
        // The run folder is the checkpoint folder's parent (`<out>/checkpoints`).
        let run_dir = self.checkpoint_dir.as_deref()?.parent()?.to_path_buf();
        (self.config.train.trace_steps > 0).then_some((self.config.train.trace_steps, run_dir))
    }
}

/// Moves `model` to CUDA device `ordinal`: its parameters in `dtype`, its buffers (an I-JEPA's
/// EMA target encoder) in f32 whatever `dtype` is. **Decision:** the EMA state stays f32 under a
/// bf16 model, as `tensor/examples/jepa_gpu.rs` checks it: a bf16 target loses the `(1 - m)·Δ`
/// steps below bf16's resolution (the update stalls near m = 0.996); the loss casts a bf16 copy
/// for the target's forward. Checkpoints and state sync copy buffers to the host as f32 and back
/// ([`rtx_supervisor`]'s `named_state` paths), so a CPU run and a GPU run resume each other's EMA.
fn move_to_device(model: &mut Model, ordinal: usize, dtype: rtx_tensor::DType) -> Result<(), String> {
    move_module_to_device(model.module_mut(), ordinal, dtype)?;
    move_buffers_to_device(model.module_mut(), ordinal)
}

/// Moves `module`'s parameters (a whole model or a mesh member's part) to CUDA device `ordinal`
/// in `dtype`.
#[cfg(feature = "cuda")]
fn move_module_to_device(module: &mut dyn Module, ordinal: usize, dtype: rtx_tensor::DType) -> Result<(), String> {
    rtx_tensor::cuda::move_module(module, ordinal, dtype).map(|_masters| ()).map_err(|e| format!("moving the model to cuda:{ordinal}: {e}"))
}

#[cfg(not(feature = "cuda"))]
fn move_module_to_device(_module: &mut dyn Module, _ordinal: usize, _dtype: rtx_tensor::DType) -> Result<(), String> {
    Err(super::DeviceError::NotCompiled.to_string())
}

/// Moves `module`'s buffers to CUDA device `ordinal`, in f32 (see [`move_to_device`]).
#[cfg(feature = "cuda")]
fn move_buffers_to_device(module: &mut dyn Module, ordinal: usize) -> Result<(), String> {
    rtx_tensor::cuda::move_buffers(module, ordinal, rtx_tensor::DType::F32).map_err(|e| format!("moving the model's buffers to cuda:{ordinal}: {e}"))
}

#[cfg(not(feature = "cuda"))]
fn move_buffers_to_device(_module: &mut dyn Module, _ordinal: usize) -> Result<(), String> {
    Err(super::DeviceError::NotCompiled.to_string())
}

/// AdamW with f32 master weights on the device, over `named` device parameters, with weight
/// decay where `decay` says (matrices and embeddings, as on the CPU; under ZeRO a slice is 1-d, so
/// the caller decides by the parameter's full shape).
#[cfg(feature = "cuda")]
fn device_optimizer(config: &TrainConfig, named: Vec<(String, Tensor)>, decay: impl Fn(&str, &Tensor) -> bool) -> Result<Box<dyn optim::Optimizer + Send>, String> {
    let crate::config::OptimKind::AdamW { betas, eps } = config.optim.kind else {
        return Err("train.device = \"cuda\" trains with optim.kind = \"adamw\"".into());
    };
    let cfg = optim::AdamWConfig { lr: config.optim.lr, beta1: betas.0, beta2: betas.1, eps, weight_decay: config.optim.weight_decay };
    let adamw = rtx_tensor::cuda::MixedAdamW::new(named, None, cfg, decay).map_err(|e| e.to_string())?;
    Ok(Box::new(adamw))
}

/// The allocator counters of the job's GPU (`None` on the CPU, or if the device cannot be
/// reached: the counters are a report, never a reason to fail).
#[cfg(feature = "cuda")]
fn device_memory(placement: Placement) -> Option<rtx_supervisor::DeviceMemory> {
    let Placement::Cuda { ordinal, .. } = placement else { return None };
    let stats = rtx_tensor::cuda::device(ordinal).ok()?.memory_stats();
    Some(rtx_supervisor::DeviceMemory { allocated: stats.allocated, peak_allocated: stats.peak_allocated, reserved: stats.reserved, peak_reserved: stats.peak_reserved })
}

#[cfg(not(feature = "cuda"))]
fn device_memory(_placement: Placement) -> Option<rtx_supervisor::DeviceMemory> {
    None
}

#[cfg(not(feature = "cuda"))]
fn device_optimizer(_config: &TrainConfig, _named: Vec<(String, Tensor)>, _decay: impl Fn(&str, &Tensor) -> bool) -> Result<Box<dyn optim::Optimizer + Send>, String> {
    Err(super::DeviceError::NotCompiled.to_string())
}

impl optim::Optimizer for JobOptimizer {
    fn step(&mut self) -> rtx_tensor::Result<()> {
        self.inner.step()
    }

    fn zero_grad(&self) -> rtx_tensor::Result<()> {
        self.inner.zero_grad()
    }

    fn lr(&self) -> f64 {
        self.inner.lr()
    }

    fn set_lr(&mut self, lr: f64) {
        self.inner.set_lr(lr)
    }

    fn set_weight_decay(&mut self, weight_decay: f64) -> bool {
        self.inner.set_weight_decay(weight_decay)
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn parameters(&self) -> Vec<(String, Tensor)> {
        self.inner.parameters()
    }

    fn state_tensors(&self) -> rtx_tensor::Result<Vec<(String, Tensor)>> {
        self.inner.state_tensors()
    }

    fn load_state(&mut self, state: &[(String, Tensor)]) -> rtx_tensor::Result<()> {
        self.inner.load_state(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An I-JEPA on the GPU: one head of 64 channels in the encoder and the predictor.
    const IJEPA_CUDA: &str = r#"
[model]
kind = "ijepa"
patch_size = 2
d_model = 64
n_layers = 1
n_heads = 1
[jepa]
predictor_width = 64
predictor_heads = 1
[data]
dataset = "digits"
batch_size = 8
[optim]
kind = "adamw"
lr = 1e-3
[train]
steps = 2
device = "cuda"
"#;

    #[test]
    fn an_ijepa_job_on_a_missing_gpu_fails_with_the_device_error_before_reading_data() {
        // Goal: the worker's job of an I-JEPA config with `device = "cuda"` goes through the
        // device check first: without CUDA (build or device) it is the typed device error's
        // message, not a panic and not the missing data. Method: build the job over an empty data
        // folder on this machine (a GPU machine with a CUDA build gets past the check: skipped).
        let empty = std::env::temp_dir().join(format!("rtx-ijepa-cuda-nodata-{}", std::process::id()));
        let config = TrainConfig::from_toml_str(IJEPA_CUDA).expect("valid");
        if resolve_device(&config, 0).is_ok() {
            println!("skipped: a usable CUDA device (scripts/gpu-jepa-train-check.sh covers this machine)");
            return;
        }
        let Err(e) = ElasticJob::new(IJEPA_CUDA, &DataRoot::new(&empty), None, 0) else { panic!("an I-JEPA job on a missing GPU was built") };
        assert!(e.contains("train.device = \"cuda\""), "{e}");
        assert!(e.contains("--features cuda") || e.contains("no CUDA device is usable"), "{e}");
        assert!(!e.contains("fetch-data"), "the device is checked before the data: {e}");
    }
}
