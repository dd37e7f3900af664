//! A client's local work: the [`LocalTrainer`] trait (global model in, update and weight out) and
//! the reference workload, [`LogRegSgd`]: multinomial logistic regression `features -> classes`
//! (weights and bias, softmax cross-entropy averaged over the batch), plain minibatch SGD, pixels
//! scaled to `[0, 1]`, optional FedProx proximal term. It is exact `f32` and allocation-free after
//! the first client on a thread: all buffers live in a per-thread [`LogRegScratch`].
//!
//! Parameter layout (shared with [`LogReg::evaluate`] and the Flower peer): the weight matrix
//! `[classes][features]` row-major, then the `classes` biases.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use rtx_tensor::data::ImageDataset;

use crate::population::splitmix64;

/// What a client is asked to do in one round.
#[derive(Clone, Copy, Debug)]
pub struct ClientTask<'a> {
    /// The client's id in the population.
    pub client: u32,
    /// The round (or, in the asynchronous mode, the model version) it trains on.
    pub round: u32,
    /// The federation seed (local shuffles derive from it).
    pub seed: u64,
    /// The client's training images.
    pub indices: &'a [u32],
}

/// A client's local training: reads the global model, writes `update` (the local model minus the
/// global model) and returns the update's aggregation weight (its sample count). A malformed
/// result (wrong length, NaN) is possible from a faulty client and is rejected by the aggregator.
pub trait LocalTrainer: Sync {
    /// Per-thread buffers, reused from client to client.
    type Scratch: Send;
    /// Fresh buffers for one thread.
    fn scratch(&self) -> Self::Scratch;
    /// Number of model parameters.
    fn n_params(&self) -> usize;
    /// Trains one client from `global`, writing its update into `update`; returns its weight.
    fn train(&self, task: &ClientTask<'_>, global: &[f32], scratch: &mut Self::Scratch, update: &mut Vec<f32>) -> f32;
}

/// The shape of a logistic-regression model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogReg {
    /// Input features (pixels).
    pub n_features: usize,
    /// Output classes.
    pub n_classes: usize,
}

/// Test-set figures of a model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evaluation {
    /// Fraction of images whose arg-max class is the label.
    pub accuracy: f64,
    /// Mean softmax cross-entropy.
    pub loss: f64,
}

/// Minibatch SGD on [`LogReg`] over images of a shared training set.
#[derive(Debug)]
pub struct LogRegSgd<'d> {
    shape: LogReg,
    train: &'d ImageDataset,
    lr: f32,
    batch_size: usize,
    epochs: u32,
    mu: f32,
    shuffle: bool,
    /// `pixel / pixel_max` for every byte value, so scaling is a lookup with the exact quotient.
    scale: [f32; 256],
}

/// Per-thread buffers of [`LogRegSgd`].
#[derive(Debug)]
pub struct LogRegScratch {
    local: Vec<f32>,
    x: Vec<f32>,
    probs: Vec<f32>,
    grad_row: Vec<f32>,
    order: Vec<u32>,
}

impl LogReg {
    /// Parameters: `classes * features` weights plus `classes` biases.
    pub fn n_params(&self) -> usize {
        self.n_classes * self.n_features + self.n_classes
    }

    /// Accuracy and mean cross-entropy of `params` on every image of `data` (pixels scaled to
    /// `[0, 1]`), in parallel over fixed chunks summed in order.
    pub fn evaluate(&self, params: &[f32], data: &ImageDataset) -> Evaluation {
        assert_eq!(params.len(), self.n_params(), "parameter count");
        assert_eq!(data.pixels_per_image(), self.n_features, "features per image");
        let scale = scale_table(data.pixel_max);
        const CHUNK: usize = 500;
        let n_chunks = data.n.div_ceil(CHUNK);
        let partial: Vec<(u64, f64)> = (0..n_chunks)
            .into_par_iter()
            .map(|chunk| {
                let mut x = vec![0f32; self.n_features];
                let mut z = vec![0f32; self.n_classes];
                let (mut correct, mut loss) = (0u64, 0f64);
                for i in chunk * CHUNK..((chunk + 1) * CHUNK).min(data.n) {
                    for (xv, &p) in x.iter_mut().zip(data.image(i)) {
                        *xv = scale[p as usize];
                    }
                    self.logits(params, &x, &mut z);
                    let label = data.labels[i] as usize;
                    let (mut best, mut max) = (0, f32::NEG_INFINITY);
                    for (k, &v) in z.iter().enumerate() {
                        if v > max {
                            (best, max) = (k, v);
                        }
                    }
                    correct += u64::from(best == label);
                    let sum: f64 = z.iter().map(|&v| f64::from(v - max).exp()).sum();
                    loss += sum.ln() - f64::from(z[label] - max);
                }
                (correct, loss)
            })
            .collect();
        let (correct, loss) = partial.iter().fold((0u64, 0f64), |(c, l), &(pc, pl)| (c + pc, l + pl));
        Evaluation { accuracy: correct as f64 / data.n as f64, loss: loss / data.n as f64 }
    }

    /// `z = W x + b`.
    fn logits(&self, params: &[f32], x: &[f32], z: &mut [f32]) {
        let (w, b) = params.split_at(self.n_classes * self.n_features);
        for (k, zk) in z.iter_mut().enumerate() {
            *zk = b[k] + dot(&w[k * self.n_features..(k + 1) * self.n_features], x);
        }
    }
}

impl<'d> LogRegSgd<'d> {
    /// SGD with learning rate `lr`, `batch_size`, `epochs`, proximal weight `mu` (0: plain
    /// FedAvg), optionally shuffling each epoch, over images of `train`.
    pub fn new(shape: LogReg, train: &'d ImageDataset, lr: f32, batch_size: usize, epochs: u32, mu: f32, shuffle: bool) -> Self {
        assert_eq!(train.pixels_per_image(), shape.n_features, "features per image");
        assert!(batch_size > 0 && epochs > 0, "batch size and epochs must be positive");
        LogRegSgd { shape, train, lr, batch_size, epochs, mu, shuffle, scale: scale_table(train.pixel_max) }
    }

    /// The model shape.
    pub fn shape(&self) -> LogReg {
        self.shape
    }
}

impl LocalTrainer for LogRegSgd<'_> {
    type Scratch = LogRegScratch;

    fn scratch(&self) -> LogRegScratch {
        let (d, c) = (self.shape.n_features, self.shape.n_classes);
        LogRegScratch {
            local: vec![0.0; self.shape.n_params()],
            x: vec![0.0; self.batch_size * d],
            probs: vec![0.0; self.batch_size * c],
            grad_row: vec![0.0; d],
            order: Vec::new(),
        }
    }

    fn n_params(&self) -> usize {
        self.shape.n_params()
    }

    fn train(&self, task: &ClientTask<'_>, global: &[f32], s: &mut LogRegScratch, update: &mut Vec<f32>) -> f32 {
        let (d, c) = (self.shape.n_features, self.shape.n_classes);
        let n_w = c * d;
        debug_assert_eq!(global.len(), self.shape.n_params());
        s.local.copy_from_slice(global);
        s.order.clear();
        s.order.extend_from_slice(task.indices);
        for epoch in 0..self.epochs {
            if self.shuffle {
                let key = splitmix64(task.seed ^ splitmix64(u64::from(task.round) << 32 | u64::from(epoch)));
                let mut rng = ChaCha8Rng::seed_from_u64(splitmix64(key ^ u64::from(task.client)));
                s.order.shuffle(&mut rng);
            }
            for batch in s.order.chunks(self.batch_size) {
                let bsz = batch.len();
                for (i, &img) in batch.iter().enumerate() {
                    for (xv, &p) in s.x[i * d..(i + 1) * d].iter_mut().zip(self.train.image(img as usize)) {
                        *xv = self.scale[p as usize];
                    }
                }
                // Forward and dL/dz = (softmax(z) - onehot(y)) / bsz, all on pre-step weights.
                let inv_b = bsz as f32;
                for (i, &img) in batch.iter().enumerate() {
                    let z = &mut s.probs[i * c..(i + 1) * c];
                    self.shape.logits(&s.local, &s.x[i * d..(i + 1) * d], z);
                    let max = z.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                    let mut sum = 0.0f32;
                    for v in z.iter_mut() {
                        *v = (*v - max).exp();
                        sum += *v;
                    }
                    for v in z.iter_mut() {
                        *v /= sum;
                    }
                    z[self.train.labels[img as usize] as usize] -= 1.0;
                    for v in z.iter_mut() {
                        *v /= inv_b;
                    }
                }
                if self.mu > 0.0 {
                    let step = self.lr * self.mu;
                    for (w, &g) in s.local.iter_mut().zip(global) {
                        *w -= step * (*w - g);
                    }
                }
                let (w, b) = s.local.split_at_mut(n_w);
                for k in 0..c {
                    s.grad_row.iter_mut().for_each(|g| *g = 0.0);
                    let mut grad_b = 0.0f32;
                    for i in 0..bsz {
                        let pk = s.probs[i * c + k];
                        grad_b += pk;
                        for (g, &xv) in s.grad_row.iter_mut().zip(&s.x[i * d..(i + 1) * d]) {
                            *g += pk * xv;
                        }
                    }
                    for (wv, &g) in w[k * d..(k + 1) * d].iter_mut().zip(&s.grad_row) {
                        *wv -= self.lr * g;
                    }
                    b[k] -= self.lr * grad_b;
                }
            }
        }
        update.resize(global.len(), 0.0);
        for ((u, &l), &g) in update.iter_mut().zip(&s.local).zip(global) {
            *u = l - g;
        }
        task.indices.len() as f32
    }
}

/// `v / pixel_max` for every byte value.
fn scale_table(pixel_max: u8) -> [f32; 256] {
    let mut table = [0f32; 256];
    for (v, t) in table.iter_mut().enumerate() {
        *t = v as f32 / f32::from(pixel_max.max(1));
    }
    table
}

/// Dot product with eight independent accumulators (vectorizes; fixed order, so deterministic).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Four 2x2 images, two classes: class 1 has bright pixels on the left.
    fn tiny() -> ImageDataset {
        let images = vec![255, 0, 255, 0, 0, 255, 0, 255, 200, 10, 220, 0, 5, 240, 0, 250];
        ImageDataset::new(images, vec![1, 0, 1, 0], 2, 2, 255).unwrap()
    }

    #[test]
    fn one_sgd_step_from_zero_matches_the_closed_form() {
        let data = tiny();
        let shape = LogReg { n_features: 4, n_classes: 2 };
        let trainer = LogRegSgd::new(shape, &data, 0.5, 2, 1, 0.0, false);
        let global = vec![0f32; shape.n_params()];
        let mut update = Vec::new();
        let weight = trainer.train(&ClientTask { client: 0, round: 0, seed: 1, indices: &[0, 1] }, &global, &mut trainer.scratch(), &mut update);
        assert_eq!(weight, 2.0);
        // From zero weights p = (0.5, 0.5); dz = (p - onehot) / 2. Image 0 (label 1) is
        // (1, 0, 1, 0), image 1 (label 0) is (0, 1, 0, 1).
        // grad W[0] = 0.25 * x0 - 0.25 * x1; update = -lr * grad.
        let expected_w0 = [-0.125f32, 0.125, -0.125, 0.125];
        assert_eq!(&update[0..4], &expected_w0);
        assert_eq!(&update[4..8], &[0.125f32, -0.125, 0.125, -0.125]);
        assert_eq!(&update[8..10], &[0.0f32, 0.0]);
    }

    #[test]
    fn training_lowers_the_loss_and_the_proximal_term_shrinks_the_update() {
        let data = tiny();
        let shape = LogReg { n_features: 4, n_classes: 2 };
        let mut params = vec![0f32; shape.n_params()];
        let before = shape.evaluate(&params, &data).loss;
        let plain = LogRegSgd::new(shape, &data, 0.5, 2, 5, 0.0, true);
        let mut update = Vec::new();
        let task = ClientTask { client: 3, round: 0, seed: 9, indices: &[0, 1, 2, 3] };
        plain.train(&task, &params, &mut plain.scratch(), &mut update);
        let plain_norm: f32 = update.iter().map(|u| u * u).sum();
        params.iter_mut().zip(&update).for_each(|(p, u)| *p += u);
        let after = shape.evaluate(&params, &data);
        assert!(after.loss < before && after.accuracy == 1.0, "{before} -> {after:?}");
        let prox = LogRegSgd::new(shape, &data, 0.5, 2, 5, 1.0, true);
        let zero = vec![0f32; shape.n_params()];
        prox.train(&task, &zero, &mut prox.scratch(), &mut update);
        let prox_norm: f32 = update.iter().map(|u| u * u).sum();
        assert!(prox_norm < plain_norm, "prox {prox_norm} vs plain {plain_norm}");
    }

    #[test]
    fn dot_matches_a_plain_sum_on_small_integers() {
        let a: Vec<f32> = (0..21).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..21).map(|i| (i % 3) as f32).collect();
        let plain: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert_eq!(dot(&a, &b), plain);
    }
}
