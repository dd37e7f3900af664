//! The training job of a simulated cluster: a small MLP on a subset of the real Fashion-MNIST
//! data (`bash scripts/fetch-data.sh`), shaped as the supervisor's `TrainJob`, so the simulator
//! drives the production worker, DP engine and optimizer on real data.
//!
//! Batches are indexed by global step: step `s` is batch `s mod B` of epoch `s div B` of a
//! seeded epoch order (`rtx_tensor::data::Sampler`), and rank `r` of `w` takes the contiguous
//! part `segment_range(G, w, r)`, so a world change never skips or repeats a sample.
//!
//! The [`Ledger`] is the simulator's window into what the workers really trained: every `loss`
//! call records which samples the rank trained at which step and the checksum of the parameters
//! it started from (the replica state after the previous step), for the invariant checks.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use rtx_actors::BatchSource;
use rtx_pipelines::ParamSlice;
use rtx_supervisor::{parameter_checksum, TrainJob};
use rtx_tensor::data::{load_fashion_mnist, DataRoot, ImageDataset, Sampler, Split};
use rtx_tensor::nn::{Activation, Mlp};
use rtx_tensor::optim::{AdamW, AdamWConfig};
use rtx_tensor::{CrossEntropyOptions, DType, Generator, Tensor};

use crate::error::{Result, SimError};

/// What one rank trained at one step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trained {
    /// Dataset indices of its rows.
    pub samples: Vec<usize>,
    /// Checksum of the parameters the step started from.
    pub start_checksum: u64,
}

/// Everything the workers trained, by `(step, world, rank)` (the latest attempt wins), and for
/// every step the parameter states its attempts started from, with the nodes that started there.
/// A retry of a failed step starts from the same state on every node whose state survives (the
/// newest state wins each re-formation), so two start states held by surviving nodes mean the
/// step's samples were applied twice. A node that completed a step nobody else did and then died
/// takes its state with it; the checker leaves lost nodes out.
#[derive(Default)]
pub struct Ledger(Mutex<LedgerState>);

#[derive(Default)]
struct LedgerState {
    trained: BTreeMap<(u64, usize, usize), Trained>,
    starts: BTreeMap<u64, BTreeMap<u64, std::collections::BTreeSet<u64>>>,
    /// The initial parameters' checksum, and how many steps were started from them (the last
    /// one's step and node).
    initial: Option<u64>,
    from_initial: u64,
    last_from_initial: Option<(u64, u64)>,
}

/// The shape of the job.
#[derive(Clone, Debug, PartialEq)]
pub struct JobShape {
    /// Training images used (the first `n_train` of the test split).
    pub n_train: usize,
    /// Held-out images evaluated at the end (the next `n_eval`).
    pub n_eval: usize,
    /// Rows per global batch.
    pub global_batch: usize,
    /// Hidden width of the MLP.
    pub hidden: usize,
    /// Steps in the run.
    pub total_steps: u64,
    /// Seed of the initial parameters and the epoch orders.
    pub data_seed: u64,
    /// Learning rate (AdamW).
    pub lr: f64,
}

/// Fashion-MNIST, loaded once per process and shared read-only by every simulated node.
pub struct Dataset {
    images: ImageDataset,
    mean: f32,
    std: f32,
}

/// The job every simulated worker trains.
pub struct SimJob {
    /// The node (supervisor node id) this job runs on.
    node: u64,
    shape: JobShape,
    data: Arc<Dataset>,
    sampler: Sampler,
    epochs: EpochCache,
    ledger: Arc<Ledger>,
}

/// One rank's part of a global batch.
pub struct SimBatch {
    x: Tensor,
    y: Tensor,
    samples: Vec<usize>,
    rank: usize,
    world: usize,
}

impl Ledger {
    /// What `rank` of `world` trained at `step`, if it trained it.
    pub fn get(&self, step: u64, world: usize, rank: usize) -> Option<Trained> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).trained.get(&(step, world, rank)).cloned()
    }

    /// The first step that nodes not in `lost` started from two different parameter states:
    /// `(step, one checksum, another)`.
    pub fn retrained(&self, lost: &std::collections::BTreeSet<u64>) -> Option<(u64, u64, u64)> {
        let state = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        for (step, starts) in &state.starts {
            let live: Vec<u64> = starts.iter().filter(|(_, nodes)| nodes.iter().any(|n| !lost.contains(n))).map(|(sum, _)| *sum).collect();
            if live.len() > 1 {
                return Some((*step, live[0], live[1]));
            }
        }
        None
    }

    /// The parameter checksums that nodes not in `lost` started `step` from.
    pub fn start_states(&self, step: u64, lost: &std::collections::BTreeSet<u64>) -> Vec<u64> {
        let state = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        state.starts.get(&step).map(|starts| starts.iter().filter(|(_, nodes)| nodes.iter().any(|n| !lost.contains(n))).map(|(sum, _)| *sum).collect()).unwrap_or_default()
    }

    /// Names the initial parameters' checksum: steps started from it are counted.
    pub fn set_initial(&self, checksum: u64) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).initial = Some(checksum);
    }

    /// How many steps were started from the initial parameters.
    pub fn from_initial(&self) -> u64 {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).from_initial
    }

    /// The step and node of the last step started from the initial parameters.
    pub fn last_from_initial(&self) -> Option<(u64, u64)> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).last_from_initial
    }

    fn record(&self, step: u64, world: usize, rank: usize, node: u64, trained: Trained) {
        let mut state = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if state.initial == Some(trained.start_checksum) {
            state.from_initial += 1;
            state.last_from_initial = Some((step, node));
        }
        state.starts.entry(step).or_default().entry(trained.start_checksum).or_default().insert(node);
        state.trained.insert((step, world, rank), trained);
    }
}

impl Dataset {
    /// Loads Fashion-MNIST's test split from `root` (once per process and root).
    pub fn load(root: &Path) -> Result<Arc<Dataset>> {
        static CACHE: OnceLock<Mutex<BTreeMap<PathBuf, Arc<Dataset>>>> = OnceLock::new();
        let cache = CACHE.get_or_init(|| Mutex::new(BTreeMap::new()));
        let mut cache = cache.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(found) = cache.get(root) {
            return Ok(Arc::clone(found));
        }
        let dir = DataRoot::new(root.to_path_buf()).fashion_mnist();
        let images = load_fashion_mnist(&dir, Split::Test).map_err(|e| SimError::Data(format!("{e} (fetch it with: bash scripts/fetch-data.sh)")))?;
        let (mean, std) = images.pixel_mean_std();
        let data = Arc::new(Dataset { images, mean, std });
        cache.insert(root.to_path_buf(), Arc::clone(&data));
        Ok(data)
    }

    fn rows(&self, indices: &[usize]) -> rtx_tensor::Result<(Tensor, Tensor)> {
        let b = self.images.batch(indices, self.mean, self.std);
        Ok((Tensor::from_vec(b.pixels, &[indices.len(), 784])?, Tensor::from_vec(b.labels, &[indices.len()])?))
    }
}

impl SimJob {
    /// The job of node `node` over `data`, recording into `ledger`.
    pub fn new(node: u64, shape: JobShape, data: Arc<Dataset>, ledger: Arc<Ledger>) -> Result<SimJob> {
        if shape.n_train + shape.n_eval > data.images.n || shape.global_batch == 0 || shape.global_batch > shape.n_train {
            return Err(SimError::Scenario(format!(
                "job: {} training + {} eval images of {}, global batch {}",
                shape.n_train, shape.n_eval, data.images.n, shape.global_batch
            )));
        }
        let sampler = Sampler::new(shape.n_train, shape.global_batch, shape.data_seed, true).map_err(|e| SimError::Data(e.to_string()))?;
        Ok(SimJob { node, shape, data, sampler, epochs: EpochCache::default(), ledger })
    }

    /// The dataset indices of global batch `step`.
    pub fn global_batch_samples(&self, step: u64) -> Vec<usize> {
        global_samples(&self.sampler, &self.epochs, self.shape.global_batch, step)
    }
}

/// The dataset indices of global batch `step` under `sampler`; `cache` keeps the last epoch's
/// order (a full permutation per batch was a visible cost).
pub(crate) fn global_samples(sampler: &Sampler, cache: &EpochCache, global_batch: usize, step: u64) -> Vec<usize> {
    let per_epoch = sampler.batches_per_epoch().max(1) as u64;
    let (epoch, index) = (step / per_epoch, (step % per_epoch) as usize);
    let mut cached = cache.0.lock().unwrap_or_else(PoisonError::into_inner);
    if cached.as_ref().is_none_or(|(e, _)| *e != epoch) {
        *cached = Some((epoch, sampler.epoch_plan(epoch).order().to_vec()));
    }
    let order = cached.as_ref().map(|(_, o)| o.as_slice()).unwrap_or_default();
    let start = index * global_batch;
    order.get(start..start + global_batch).map(<[usize]>::to_vec).unwrap_or_default()
}

/// The epoch order last used by [`global_samples`].
#[derive(Default)]
pub(crate) struct EpochCache(Mutex<Option<(u64, Vec<usize>)>>);

/// The initial model of a job shape.
pub(crate) fn build_model(shape: &JobShape) -> std::result::Result<Mlp, String> {
    Mlp::new(&[784, shape.hidden, 10], Activation::Relu, DType::F32, &mut Generator::new(shape.data_seed)).map_err(|e| e.to_string())
}

/// The sampler of a job shape (for checking batches outside the job).
pub(crate) fn sampler_of(shape: &JobShape) -> Result<Sampler> {
    Sampler::new(shape.n_train, shape.global_batch, shape.data_seed, true).map_err(|e| SimError::Data(e.to_string()))
}

impl BatchSource for SimJob {
    type Batch = SimBatch;

    fn batch(&self, step: u64, rank: usize, world: usize) -> std::result::Result<SimBatch, String> {
        let global = self.global_batch_samples(step);
        let part = rtx_collectives::segment_range(global.len(), world, rank);
        let samples = global[part].to_vec();
        let (x, y) = self.data.rows(&samples).map_err(|e| e.to_string())?;
        Ok(SimBatch { x, y, samples, rank, world })
    }
}

impl TrainJob for SimJob {
    type Model = Mlp;
    type Optim = AdamW;

    fn build_model(&self) -> std::result::Result<Mlp, String> {
        build_model(&self.shape)
    }

    fn build_optimizer(&self, slices: &[ParamSlice]) -> std::result::Result<AdamW, String> {
        let named = slices.iter().map(|s| (s.name.clone(), s.tensor.clone())).collect();
        AdamW::new(named, AdamWConfig { lr: self.shape.lr, ..AdamWConfig::default() }).map_err(|e| e.to_string())
    }

    fn loss(&self, model: &mut Mlp, batch: &SimBatch, step: u64) -> rtx_tensor::Result<(Tensor, usize)> {
        let start_checksum = parameter_checksum(model).map_err(|e| rtx_tensor::Error::InvalidArgument { op: "checksum", reason: e.to_string() })?;
        self.ledger.record(step, batch.world, batch.rank, self.node, Trained { samples: batch.samples.clone(), start_checksum });
        let logits = model.forward(&batch.x)?;
        Ok((logits.cross_entropy(&batch.y, CrossEntropyOptions::default())?, batch.samples.len()))
    }

    fn global_batch(&self) -> usize {
        self.shape.global_batch
    }

    fn total_steps(&self) -> u64 {
        self.shape.total_steps
    }

    fn set_lr(&self, _optimizer: &mut AdamW, _step: u64) {}

    fn evaluate(&self, model: &mut Mlp) -> std::result::Result<Vec<(String, f64)>, String> {
        let indices: Vec<usize> = (self.shape.n_train..self.shape.n_train + self.shape.n_eval).collect();
        let (x, y) = self.data.rows(&indices).map_err(|e| e.to_string())?;
        let pred = model.forward(&x).and_then(|l| l.argmax(-1, false)).and_then(|p| p.to_u32_vec()).map_err(|e| e.to_string())?;
        let labels = y.to_u32_vec().map_err(|e| e.to_string())?;
        let correct = pred.iter().zip(&labels).filter(|(p, l)| p == l).count();
        Ok(vec![("acc".into(), correct as f64 / labels.len().max(1) as f64)])
    }

    fn checkpoint_dir(&self) -> Option<PathBuf> {
        None
    }
}
