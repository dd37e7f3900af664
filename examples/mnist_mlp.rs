//! Train an MLP classifier with the rustytorch library from your own program: data, model,
//! optimizer and loop written out, no config file.
//!
//! ```text
//! bash scripts/fetch-data.sh --only fashion-mnist        # once
//! cargo run --release -p rtx-examples --example mnist_mlp              # Fashion-MNIST, 2 epochs
//! cargo run --release -p rtx-examples --example mnist_mlp -- digits    # the 8x8 digits set
//! ```
//!
//! The data folder is `$RTX_DATA_DIR`, else `./data`. The same run is
//! `rtx train configs/fashion_mlp.toml` with metrics, plots and checkpoints added.

use anyhow::Context;
use rustytorch::data::{load_digits_csv, load_fashion_mnist, train_val_split, DataRoot, ImageDataset, Sampler, Split, DATA_DIR_ENV};
use rustytorch::nn::{Activation, Mlp, Module};
use rustytorch::optim::{clip_grad_norm, AdamW, AdamWConfig, LrSchedule, Optimizer, WarmupCosine};
use rustytorch::tensor::{no_grad, CrossEntropyOptions};
use rustytorch::{DType, Generator, Tensor};

fn main() -> anyhow::Result<()> {
    let root = DataRoot::resolve(None, std::env::var_os(DATA_DIR_ENV).as_deref());
    let digits = std::env::args().nth(1).as_deref() == Some("digits");

    // Data: a seeded train/validation split of the training file, plus the test file if any.
    let (full, test) = if digits {
        (load_digits_csv(&root.digits_csv())?, None)
    } else {
        (load_fashion_mnist(&root.fashion_mnist(), Split::Train)?, Some(load_fashion_mnist(&root.fashion_mnist(), Split::Test)?))
    };
    let seed = 0;
    let (train_idx, val_idx) = train_val_split(full.n, 0.1, seed)?;
    let (train, val) = (full.subset(&train_idx), full.subset(&val_idx));
    let (mean, std) = train.pixel_mean_std();
    let (batch_size, epochs) = (128, if digits { 20 } else { 2 });
    let mut sampler = Sampler::new(train.n, batch_size, seed, false)?;
    let steps = (epochs * sampler.batches_per_epoch()) as u64;

    // Model and optimizer: every random draw comes from this seeded generator.
    let mut rng = Generator::new(seed);
    let features = train.pixels_per_image();
    let model = Mlp::new(&[features, 256, 256, full.n_classes], Activation::Relu, DType::F32, &mut rng)?;
    let mut opt = AdamW::with_decay_filter(model.named_parameters(), AdamWConfig { lr: 1e-3, weight_decay: 0.01, ..AdamWConfig::default() }, AdamW::decay_matrices)?;
    let schedule = WarmupCosine { max_lr: 1e-3, min_lr: 1e-5, warmup_steps: 50, total_steps: steps };
    println!("{} train / {} val images, {} parameters, {steps} steps", train.n, val.n, model.num_parameters());

    let start = std::time::Instant::now();
    for step in 0..steps {
        let batch = train.batch(&sampler.next_batch(), mean, std);
        let x = Tensor::from_vec(batch.pixels, &[batch.batch_size, features])?;
        let y = Tensor::from_vec(batch.labels, &[batch.batch_size])?;
        opt.zero_grad()?;
        let loss = model.forward(&x)?.cross_entropy(&y, CrossEntropyOptions::default())?;
        loss.backward()?;
        clip_grad_norm(&model.parameters(), 5.0)?;
        opt.set_lr(schedule.lr(step));
        opt.step()?;
        if (step + 1) % 200 == 0 || step + 1 == steps {
            println!("step {:>5}/{steps}  loss {:.4}  ({:.0} images/s)", step + 1, loss.item()?, ((step + 1) * batch_size as u64) as f64 / start.elapsed().as_secs_f64());
        }
    }

    println!("validation accuracy: {:.2}%", 100.0 * accuracy(&model, &val, mean, std)?);
    if let Some(test) = &test {
        println!("test accuracy: {:.2}%", 100.0 * accuracy(&model, test, mean, std)?);
    }
    Ok(())
}

/// Fraction of `set` the model classifies correctly (no gradients recorded).
fn accuracy(model: &Mlp, set: &ImageDataset, mean: f32, std: f32) -> anyhow::Result<f64> {
    no_grad(|| {
        let mut correct = 0usize;
        for chunk in (0..set.n).collect::<Vec<_>>().chunks(1000) {
            let batch = set.batch(chunk, mean, std);
            let x = Tensor::from_vec(batch.pixels, &[batch.batch_size, set.pixels_per_image()])?;
            let predicted = model.forward(&x)?.argmax(-1, false)?.to_u32_vec()?;
            correct += predicted.iter().zip(&batch.labels).filter(|(p, l)| p == l).count();
        }
        Ok::<f64, rustytorch::tensor::Error>(correct as f64 / set.n as f64)
    })
    .context("evaluating")
}
