//! Embed an elastic job in your own program: a custom two-layer network on Fashion-MNIST, trained
//! data-parallel by workers that the program starts itself, one of them killed in the middle;
//! training goes on with the survivor, a replacement joins, and the loss keeps falling.
//!
//! ```text
//! bash scripts/fetch-data.sh --only fashion-mnist                       # once
//! cargo run --release -p rtx-examples --example embed_elastic               # worker threads
//! cargo run --release -p rtx-examples --example embed_elastic -- processes  # worker processes
//! ```
//!
//! The data folder is `$RTX_DATA_DIR`, else `./data`. `docs/embedding.md` explains the API.

use std::path::Path;

use rustytorch::data::{load_fashion_mnist, DataRoot, ImageDataset, Split, DATA_DIR_ENV};
use rustytorch::embed::{self, EmbeddedTask, Job, Placement, TaskError};
use rustytorch::nn::{join_name, Linear, Module};
use rustytorch::optim::{AdamW, AdamWConfig};
use rustytorch::supervisor::JobEvent;
use rustytorch::tensor::CrossEntropyOptions;
use rustytorch::{DType, Generator, Tensor};

/// The model: 784 → hidden (ReLU) → 10, written out as a user would.
pub struct TwoLayerNet {
    hidden: Linear,
    out: Linear,
}

impl TwoLayerNet {
    fn forward(&self, x: &Tensor) -> rustytorch::tensor::Result<Tensor> {
        self.out.forward(&self.hidden.forward(x)?.relu()?)
    }
}

impl Module for TwoLayerNet {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        self.hidden.visit_params(&join_name(prefix, "hidden"), f);
        self.out.visit_params(&join_name(prefix, "out"), f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        self.hidden.visit_params_mut(&join_name(prefix, "hidden"), f);
        self.out.visit_params_mut(&join_name(prefix, "out"), f);
    }
}

/// The task: Fashion-MNIST images in a seeded order, the first `n_train` for training and the
/// next 1,000 held out for the final accuracy.
pub struct FashionTask {
    images: ImageDataset,
    order: Vec<usize>,
    n_train: usize,
    mean: f32,
    std: f32,
    hidden: usize,
    global_batch: usize,
}

/// One rank's rows of a global batch.
pub struct Batch {
    x: Tensor,
    y: Tensor,
    rows: usize,
}

impl FashionTask {
    /// Loads the test split of Fashion-MNIST (10,000 images) from `root`.
    pub fn load(root: &DataRoot, hidden: usize, global_batch: usize) -> Result<FashionTask, TaskError> {
        let images = load_fashion_mnist(&root.fashion_mnist(), Split::Test).map_err(|e| format!("{e} (fetch it with: bash scripts/fetch-data.sh --only fashion-mnist)"))?;
        let (mean, std) = images.pixel_mean_std();
        // A seeded shuffle, the same in every worker.
        let mut order: Vec<usize> = (0..images.n).collect();
        let mut rng = Generator::new(7);
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let n_train = images.n.saturating_sub(1000);
        Ok(FashionTask { images, order, n_train, mean, std, hidden, global_batch })
    }

    fn rows(&self, indices: &[usize]) -> Result<(Tensor, Tensor), TaskError> {
        let b = self.images.batch(indices, self.mean, self.std);
        Ok((Tensor::from_vec(b.pixels, &[indices.len(), self.images.pixels_per_image()])?, Tensor::from_vec(b.labels, &[indices.len()])?))
    }
}

impl EmbeddedTask for FashionTask {
    type Model = TwoLayerNet;
    type Optim = AdamW;
    type Batch = Batch;

    fn build_model(&self, seed: u64) -> Result<TwoLayerNet, TaskError> {
        let mut rng = Generator::new(seed);
        let hidden = Linear::new(self.images.pixels_per_image(), self.hidden, true, DType::F32, &mut rng)?;
        let out = Linear::new(self.hidden, self.images.n_classes, true, DType::F32, &mut rng)?;
        Ok(TwoLayerNet { hidden, out })
    }

    fn build_optimizer(&self, parameters: Vec<(String, Tensor)>) -> Result<AdamW, TaskError> {
        Ok(AdamW::new(parameters, AdamWConfig { lr: 2e-3, ..AdamWConfig::default() })?)
    }

    fn global_batch(&self) -> usize {
        self.global_batch
    }

    fn batch(&self, step: u64, rank: usize, world: usize) -> Result<Batch, TaskError> {
        // Global batch `step` is a fixed window of the training order; rank `r` of `w` takes its
        // contiguous part, so any world size trains the same rows at the same step.
        let part = rustytorch::collectives::segment_range(self.global_batch, world, rank);
        let start = step as usize * self.global_batch;
        let indices: Vec<usize> = part.map(|i| self.order[(start + i) % self.n_train]).collect();
        let (x, y) = self.rows(&indices)?;
        Ok(Batch { x, y, rows: indices.len() })
    }

    fn loss(&self, model: &mut TwoLayerNet, batch: &Batch) -> Result<(Tensor, usize), TaskError> {
        Ok((model.forward(&batch.x)?.cross_entropy(&batch.y, CrossEntropyOptions::default())?, batch.rows))
    }

    fn evaluate(&self, model: &mut TwoLayerNet) -> Result<Vec<(String, f64)>, TaskError> {
        let held_out = &self.order[self.n_train..];
        let (x, y) = self.rows(held_out)?;
        let predicted = model.forward(&x)?.argmax(-1, false)?.to_u32_vec()?;
        let labels = y.to_u32_vec()?;
        let correct = predicted.iter().zip(&labels).filter(|(p, l)| p == l).count();
        Ok(vec![("accuracy".into(), correct as f64 / labels.len().max(1) as f64)])
    }
}

/// The data folder: `$RTX_DATA_DIR`, else `./data`.
pub fn data_root() -> DataRoot {
    DataRoot::resolve(None::<&Path>, std::env::var_os(DATA_DIR_ENV).as_deref())
}

fn main() -> anyhow::Result<()> {
    // In a worker process (the `processes` placement) this trains as one worker and exits.
    embed::run_worker_if_child(|| FashionTask::load(&data_root(), 128, 128))?;

    let processes = std::env::args().nth(1).as_deref() == Some("processes");
    let placement = if processes { Placement::LocalProcesses { workers: 2 } } else { Placement::InProcess { workers: 2 } };
    let steps = 300;
    let task = FashionTask::load(&data_root(), 128, 128).map_err(|e| anyhow::anyhow!(e))?;
    println!("training a 784-128-10 network on Fashion-MNIST for {steps} steps, placement {placement:?}");
    let handle = Job::builder(task)
        .placement(placement)
        .steps(steps)
        .replace_lost_workers(true)
        .on_event(|event| match event {
            JobEvent::Committed { step, loss, world, .. } if (step + 1) % 25 == 0 => println!("step {:>4}  loss {loss:.4}  ({world} workers)", step + 1),
            JobEvent::Generation { generation, world, next_step, .. } => println!("generation {generation}: {world} worker(s), from step {next_step}"),
            JobEvent::Lost { pid, class, .. } => println!("lost worker {pid} ({class:?})"),
            _ => {}
        })
        .start()?;

    handle.wait_for_step(steps / 3);
    let pid = handle.kill_worker(1)?;
    println!("killed the worker at rank 1 (pid {pid})");
    let report = handle.wait()?;

    let (first, last) = (report.first_losses_mean(20).unwrap_or(f64::NAN), report.last_losses_mean(20).unwrap_or(f64::NAN));
    println!("loss {first:.4} (first 20 steps) -> {last:.4} (last 20), {} generations, {} worker(s) lost, evaluation {:?}", report.generations.len(), report.lost.len(), report.eval);
    anyhow::ensure!(last < first, "the loss did not fall");
    Ok(())
}
