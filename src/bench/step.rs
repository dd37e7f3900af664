//! `rtx bench step`: one full training step — forward, cross-entropy, backward, AdamW step,
//! zero_grad — of an MLP 784-512-512-10 (ReLU, batch 128) or a GPT (4 layers, d=256, 4 heads,
//! T=128, batch 16, byte vocabulary 256, tied head), on a fixed random batch so only compute is
//! timed. `--phases` also reports the median of each phase separately.

use super::timing::{measure, round3, Stats};
use super::{emit, threads};
use rtx_tensor::nn::{Activation, Gpt, GptConfig, Mlp, Module};
use rtx_tensor::optim::{AdamW, AdamWConfig, Optimizer};
use rtx_tensor::{CrossEntropyOptions, DType, Generator, Tensor};
use std::time::Instant;

/// Which model to step.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepModel {
    /// MLP 784-512-512-10 (ReLU), batch 128.
    Mlp,
    /// GPT 4 layers, d=256, 4 heads, T=128, batch 16, byte vocab 256.
    Gpt,
    /// I-JEPA of `configs/ijepa_fashion.toml`'s shapes, batch 128 (see `jepa_step.rs`).
    Ijepa,
}

/// Arguments of `rtx bench step`.
#[derive(clap::Args, Debug, Clone)]
pub struct StepArgs {
    /// The model.
    #[arg(long, value_enum)]
    pub model: StepModel,
    /// Untimed steps before timing.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Timed steps; the median is reported.
    #[arg(long, default_value_t = 15)]
    pub repeats: usize,
    /// Also time forward, loss, backward, optimizer step and zero_grad separately.
    #[arg(long)]
    pub phases: bool,
    /// Turn off rtx-tensor's buffer pool (to measure what it saves).
    #[arg(long)]
    pub no_buffer_pool: bool,
}

// Shapes: keep equal to scripts/peer/torch_bench.py.
const MLP_SIZES: [usize; 4] = [784, 512, 512, 10];
const MLP_BATCH: usize = 128;
const GPT_LAYERS: usize = 4;
const GPT_D: usize = 256;
const GPT_HEADS: usize = 4;
const GPT_T: usize = 128;
const GPT_BATCH: usize = 16;
const GPT_VOCAB: usize = 256;

/// A model with its fixed batch: `logits` runs the forward pass.
struct Workload {
    params: Vec<(String, Tensor)>,
    shape: String,
    logits: Box<dyn FnMut() -> rtx_tensor::Result<Tensor>>,
    targets: Tensor,
}

fn mlp_workload(rng: &mut Generator) -> anyhow::Result<Workload> {
    let model = Mlp::new(&MLP_SIZES, Activation::Relu, DType::F32, rng)?;
    let x = Tensor::randn(&[MLP_BATCH, MLP_SIZES[0]], 0.0, 1.0, DType::F32, rng)?;
    let targets = random_ids(&[MLP_BATCH], MLP_SIZES[3], rng)?;
    let sizes: Vec<String> = MLP_SIZES.iter().map(|s| s.to_string()).collect();
    Ok(Workload {
        params: model.named_parameters(),
        shape: format!("mlp {} batch {MLP_BATCH}", sizes.join("-")),
        logits: Box::new(move || model.forward(&x)),
        targets,
    })
}

fn gpt_workload(rng: &mut Generator) -> anyhow::Result<Workload> {
    let config = GptConfig { vocab_size: GPT_VOCAB, context: GPT_T, d_model: GPT_D, n_layers: GPT_LAYERS, n_heads: GPT_HEADS, ..GptConfig::default() };
    let model = Gpt::new(config, rng)?;
    let ids = random_ids(&[GPT_BATCH, GPT_T], GPT_VOCAB, rng)?;
    let targets = random_ids(&[GPT_BATCH * GPT_T], GPT_VOCAB, rng)?;
    let mut dropout_rng = Generator::new(1);
    Ok(Workload {
        params: model.named_parameters(),
        shape: format!("gpt L{GPT_LAYERS} d{GPT_D} h{GPT_HEADS} T{GPT_T} batch {GPT_BATCH} vocab {GPT_VOCAB}"),
        logits: Box::new(move || model.forward(&ids, &mut dropout_rng)?.reshape(&[GPT_BATCH * GPT_T, GPT_VOCAB])),
        targets,
    })
}

fn random_ids(shape: &[usize], below: usize, rng: &mut Generator) -> anyhow::Result<Tensor> {
    let n: usize = shape.iter().product();
    let ids: Vec<u32> = (0..n).map(|_| rng.below(below as u64) as u32).collect();
    Ok(Tensor::from_vec(ids, shape)?)
}

pub(crate) fn run(args: &StepArgs) -> anyhow::Result<()> {
    let threads = threads();
    if args.no_buffer_pool {
        rtx_tensor::set_buffer_pool_limit_bytes(0);
    }
    let mut rng = Generator::new(0);
    let mut work = match args.model {
        StepModel::Mlp => mlp_workload(&mut rng)?,
        StepModel::Gpt => gpt_workload(&mut rng)?,
        StepModel::Ijepa => {
            anyhow::ensure!(!args.phases, "--phases is not broken down for the I-JEPA step");
            return super::jepa_step::run(args.warmup, args.repeats);
        }
    };
    let n_params: usize = work.params.iter().map(|(_, t)| t.numel()).sum();
    let mut opt = AdamW::new(work.params.clone(), AdamWConfig { lr: 1e-3, weight_decay: 0.01, ..AdamWConfig::default() })?;
    let targets = work.targets.clone();

    // Phase spans of the timed steps (ms), filled only with --phases.
    let mut spans: [Vec<f64>; 5] = Default::default();
    let record = args.phases;
    let mut step_once = |spans: &mut [Vec<f64>; 5], keep: bool| -> anyhow::Result<()> {
        let mut mark = Instant::now();
        let mut lap = |i: usize, spans: &mut [Vec<f64>; 5]| {
            if record && keep {
                spans[i].push(mark.elapsed().as_secs_f64() * 1e3);
            }
            mark = Instant::now();
        };
        let logits = (work.logits)()?;
        lap(0, spans);
        let loss = logits.cross_entropy(&targets, CrossEntropyOptions::default())?;
        lap(1, spans);
        loss.backward()?;
        lap(2, spans);
        opt.step()?;
        lap(3, spans);
        opt.zero_grad()?;
        lap(4, spans);
        anyhow::ensure!(loss.item()?.is_finite(), "loss is not finite");
        Ok(())
    };
    for _ in 0..args.warmup {
        step_once(&mut spans, false)?;
    }
    let stats = measure(0, args.repeats, || step_once(&mut spans, true))?;

    let mut obj = serde_json::Map::new();
    obj.insert("impl".into(), "rustytorch".into());
    obj.insert("bench".into(), "step".into());
    obj.insert("model".into(), format!("{:?}", args.model).to_lowercase().into());
    obj.insert("shape".into(), work.shape.clone().into());
    obj.insert("params".into(), n_params.into());
    obj.insert("threads".into(), threads.into());
    if args.no_buffer_pool {
        obj.insert("buffer_pool".into(), false.into());
    }
    stats.json_fields(&mut obj);
    if args.phases {
        let names = ["forward", "loss", "backward", "optimizer", "zero_grad"];
        let mut phases = serde_json::Map::new();
        for (name, samples) in names.iter().zip(spans) {
            phases.insert((*name).into(), round3(Stats::from_samples(samples).median_ms).into());
        }
        obj.insert("phases_median_ms".into(), phases.into());
    }
    emit(obj.into());
    Ok(())
}
