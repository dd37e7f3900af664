//! The model-parallel job of a simulated cluster: a small byte-level GPT on the real State of the
//! Union corpus (`bash scripts/fetch-data.sh`), trained as a `(dp, pp, tp)` mesh through the
//! production worker runtime, [`rtx_pipelines::pipeline::MeshEngine`], tensor-parallel stages and
//! sharded checkpoints. The simulator runs it when a scenario has a `[mesh]` table.
//!
//! Batches are indexed by global step: step `s` is `global_batch` windows of `context + 1` bytes
//! at offsets drawn from a generator seeded by `(data_seed, s)`; data-parallel replica `r` of `w`
//! takes the contiguous rows `segment_range(global_batch, w, r)`, so a world change never skips
//! or repeats a window. Every member builds the whole GPT from `data_seed` and keeps its part,
//! with the layers of each stage balanced by the planner's static cost (any `pp`, so a
//! re-partitioned mesh builds too).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use rtx_actors::BatchSource;
use rtx_pipelines::pipeline::{PipelineConfig, TokenBatch, TpGptStage};
use rtx_pipelines::schedule::ScheduleKind;
use rtx_pipelines::tp::TpOptions;
use rtx_pipelines::{adamw, ModelDims, ParamSlice};
use rtx_supervisor::plan::partition_layers;
use rtx_supervisor::{BoxedStage, MeshModel, MeshSpec, ModelLayout, StageRequest, TrainJob};
use rtx_tensor::data::TextCorpus;
use rtx_tensor::nn::{Gpt, GptConfig, Module};
use rtx_tensor::optim::{AdamW, AdamWConfig};
use rtx_tensor::{Generator, Optimizer, Tensor};

use crate::error::{Result, SimError};

/// The mesh and the GPT of a `[mesh]` scenario.
#[derive(Clone, Debug, PartialEq)]
pub struct MeshJobShape {
    /// Pipeline stages.
    pub pp: usize,
    /// Tensor-parallel ranks per stage.
    pub tp: usize,
    /// Micro-batches per step.
    pub microbatches: usize,
    /// The pipeline schedule.
    pub schedule: ScheduleKind,
    /// Transformer blocks.
    pub layers: usize,
    /// Width C.
    pub d_model: usize,
    /// Attention heads.
    pub heads: usize,
    /// Sequence length (bytes per window, and the position table).
    pub context: usize,
}

impl MeshJobShape {
    /// The GPT every member builds (bytes: 256 tokens; no dropout, so runs are comparable).
    pub fn gpt(&self) -> GptConfig {
        GptConfig { vocab_size: 256, context: self.context, d_model: self.d_model, n_layers: self.layers, n_heads: self.heads, dropout: 0.0, ..GptConfig::default() }
    }

    /// What the supervisor needs to re-partition the mesh.
    pub fn model(&self) -> MeshModel {
        let gpt = self.gpt();
        let chunks = match self.schedule {
            ScheduleKind::Interleaved { chunks } => chunks,
            _ => 1,
        };
        MeshModel { dims: ModelDims { layers: gpt.n_layers, heads: gpt.n_heads, vocab: gpt.vocab_size, mlp_hidden: gpt.d_model * gpt.mlp_ratio }, chunks }
    }

    fn planning_layout(&self) -> ModelLayout {
        let gpt = self.gpt();
        ModelLayout { layers: gpt.n_layers, d_model: gpt.d_model, heads: gpt.n_heads, vocab: gpt.vocab_size, context: gpt.context, mlp_hidden: gpt.d_model * gpt.mlp_ratio, tied: gpt.tie_embeddings }
    }
}

/// Corpora loaded so far, by data root.
type CorpusCache = Mutex<Vec<(PathBuf, Arc<Vec<u8>>)>>;

/// The corpus, loaded once per process and data root.
fn corpus(root: &Path) -> Result<Arc<Vec<u8>>> {
    static CACHE: OnceLock<CorpusCache> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(Vec::new()));
    let mut cache = cache.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((_, text)) = cache.iter().find(|(r, _)| r == root) {
        return Ok(Arc::clone(text));
    }
    let corpus = TextCorpus::load_dir(&root.join("sotu")).map_err(|e| SimError::Data(format!("{e} (fetch it with: bash scripts/fetch-data.sh)")))?;
    let text = Arc::new(corpus.bytes().to_vec());
    cache.push((root.to_path_buf(), Arc::clone(&text)));
    Ok(text)
}

/// The job every member of a simulated mesh trains.
pub struct MeshSimJob {
    mesh: MeshJobShape,
    global_batch: usize,
    total_steps: u64,
    data_seed: u64,
    lr: f64,
    text: Arc<Vec<u8>>,
    checkpoints: PathBuf,
}

impl MeshSimJob {
    /// The job over the corpus under `data_root`, writing sharded checkpoints into `checkpoints`.
    pub fn new(mesh: MeshJobShape, shape: &crate::job::JobShape, data_root: &Path, checkpoints: PathBuf) -> Result<MeshSimJob> {
        let text = corpus(data_root)?;
        if text.len() <= mesh.context + 1 || shape.global_batch == 0 {
            return Err(SimError::Scenario(format!("mesh job: a corpus of {} bytes, windows of {} and a global batch of {}", text.len(), mesh.context + 1, shape.global_batch)));
        }
        Ok(MeshSimJob { mesh, global_batch: shape.global_batch, total_steps: shape.total_steps, data_seed: shape.data_seed, lr: shape.lr, text, checkpoints })
    }

    fn adamw(&self) -> AdamWConfig {
        // eps 1e-6 as the mesh equivalence tests use: comparable runs stay comparable.
        AdamWConfig { lr: self.lr, beta1: 0.9, beta2: 0.95, eps: 1e-6, weight_decay: 0.0 }
    }

    /// The token windows of rows `rows` of global batch `step`.
    fn windows(&self, step: u64, rows: std::ops::Range<usize>) -> std::result::Result<TokenBatch, String> {
        let t = self.mesh.context;
        let mut g = Generator::new(self.data_seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ step);
        let offsets: Vec<usize> = (0..self.global_batch).map(|_| g.below((self.text.len() - t - 1) as u64) as usize).collect();
        let (mut ids, mut targets) = (Vec::new(), Vec::new());
        for &at in &offsets[rows.clone()] {
            ids.extend(self.text[at..at + t].iter().map(|&b| u32::from(b)));
            targets.extend(self.text[at + 1..at + t + 1].iter().map(|&b| u32::from(b)));
        }
        let n = rows.len();
        Ok(TokenBatch { ids: Tensor::from_vec(ids, &[n, t]).map_err(|e| e.to_string())?, targets: Tensor::from_vec(targets, &[n, t]).map_err(|e| e.to_string())? })
    }
}

impl BatchSource for MeshSimJob {
    type Batch = TokenBatch;

    fn batch(&self, step: u64, rank: usize, world: usize) -> std::result::Result<TokenBatch, String> {
        self.windows(step, rtx_collectives::segment_range(self.global_batch, world, rank))
    }
}

impl TrainJob for MeshSimJob {
    type Model = Gpt;
    type Optim = AdamW;

    fn build_model(&self) -> std::result::Result<Gpt, String> {
        Gpt::new(self.mesh.gpt(), &mut Generator::new(self.data_seed)).map_err(|e| e.to_string())
    }

    fn build_optimizer(&self, slices: &[ParamSlice]) -> std::result::Result<AdamW, String> {
        adamw(self.adamw(), |_, _| true)(slices).map_err(|e| e.to_string())
    }

    fn loss(&self, model: &mut Gpt, batch: &TokenBatch, _step: u64) -> rtx_tensor::Result<(Tensor, usize)> {
        Ok((model.loss(&batch.ids, &batch.targets, &mut Generator::new(0))?, batch.rows()))
    }

    fn global_batch(&self) -> usize {
        self.global_batch
    }

    fn total_steps(&self) -> u64 {
        self.total_steps
    }

    fn set_lr(&self, _optimizer: &mut AdamW, _step: u64) {}

    fn evaluate(&self, _model: &mut Gpt) -> std::result::Result<Vec<(String, f64)>, String> {
        Ok(Vec::new())
    }

    fn checkpoint_dir(&self) -> Option<PathBuf> {
        Some(self.checkpoints.clone())
    }

    fn mesh(&self) -> Option<MeshSpec<TokenBatch>> {
        let (mesh, seed, adamw, lr) = (self.mesh.clone(), self.data_seed, self.adamw(), self.lr);
        let chunks = mesh.model().chunks;
        let costs = mesh.planning_layout().static_costs();
        let build = move |request: &StageRequest| -> std::result::Result<(BoxedStage, Box<dyn Optimizer + Send>), String> {
            let gpt = Gpt::new(mesh.gpt(), &mut Generator::new(seed)).map_err(|e| e.to_string())?;
            let layers = partition_layers(&costs, request.shape.pp * chunks).map_err(|e| e.to_string())?;
            let part = TpGptStage::from_full(&gpt, request.tp.clone(), TpOptions::default(), &layers, request.coord.pp, request.shape.pp).map_err(|e| e.to_string())?;
            let optimizer = AdamW::new(part.named_parameters(), adamw).map_err(|e| e.to_string())?;
            Ok((Box::new(part), Box::new(optimizer)))
        };
        Some(MeshSpec {
            pp: self.mesh.pp,
            tp: self.mesh.tp,
            pipeline: PipelineConfig { schedule: self.mesh.schedule, microbatches: self.mesh.microbatches, grad_clip: Some(1.0), seed: self.data_seed },
            build: Arc::new(build),
            split: Arc::new(|batch: &TokenBatch, parts| batch.split(parts).map_err(|e| e.to_string())),
            lr: Arc::new(move |_| lr),
            layout: rtx_tensor::checkpoint::sharded::ModelLayout::gpt(&self.mesh.gpt()),
        })
    }
}
