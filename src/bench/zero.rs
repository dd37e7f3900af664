//! `rtx bench zero`: memory per rank of replicated data parallelism, ZeRO-1, ZeRO-2 and ZeRO-3
//! (FSDP) at several group sizes, next to the ZeRO paper's closed form adapted to f32
//! (`4Ψ + 4Ψ + 8Ψ` bytes, see `rtx_pipelines::memory`).
//!
//! Two parts. **Live**: the test model (the byte-level GPT of `pipelines/tests/zero_equivalence.rs`
//! at `--d-model`, trained on SOTU bytes from `--data`) runs `--steps` real steps in each engine
//! at each group size, ranks as threads over the in-process transport, and rank 0 reports what
//! its storages hold (`DataParallel::memory`, `FsdpGpt::memory`: parameters, gradients and
//! optimizer state resident between steps, and ZeRO-3's peaks of gathered parameters and full
//! gradients during the steps); each line also carries the layout estimate
//! (`rtx_pipelines::memory::engine_estimate`) and whether the two agree. **Counted**: the GPT-2
//! 124M shape (not built, not trained) through the same estimate, over its 25 MiB buckets (data
//! parallelism) or its units (ZeRO-3). Every line has the closed form beside it.

use std::path::PathBuf;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use rtx_collectives::{CommConfig, Endpoint, InProcessNetwork, Transport};
use rtx_pipelines::memory::{bucket_numels, closed_form, engine_estimate, gpt_param_numels, gpt_unit_numels};
use rtx_pipelines::{adamw, DataParallel, DpConfig, FsdpConfig, FsdpGpt, MemoryPerRank, Sharding, ZeroStage, DEFAULT_BUCKET_BYTES_MAX};
use rtx_tensor::data::TextCorpus;
use rtx_tensor::nn::{Gpt, GptConfig};
use rtx_tensor::optim::AdamWConfig;
use rtx_tensor::{Generator, Tensor};

use super::emit;

/// Arguments of `rtx bench zero`.
#[derive(clap::Args, Debug, Clone)]
pub struct ZeroArgs {
    /// Group sizes.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    pub ranks: Vec<usize>,
    /// Width of the live test model (byte vocabulary, 4 blocks, 4 heads, context 32).
    #[arg(long, default_value_t = 64)]
    pub d_model: usize,
    /// Real training steps each live engine runs before it is measured.
    #[arg(long, default_value_t = 2)]
    pub steps: u64,
    /// Directory of the SOTU text corpus.
    #[arg(long, default_value = "data/sotu")]
    pub data: PathBuf,
    /// Skip the live part (only the counted GPT-2 124M lines).
    #[arg(long)]
    pub counted_only: bool,
}

const CONTEXT: usize = 32;
const ROWS: usize = 8;

/// Runs the benchmark: live lines for the test model, then counted lines for GPT-2 124M.
pub(super) fn run(args: &ZeroArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        !args.ranks.is_empty() && args.ranks.iter().all(|&n| n >= 1 && ROWS.is_multiple_of(n)),
        "--ranks must each divide the {ROWS} rows of a batch, got {:?}",
        args.ranks
    );
    anyhow::ensure!(args.d_model >= 4 && args.d_model.is_multiple_of(4), "--d-model must be a positive multiple of the 4 heads, got {}", args.d_model);
    if !args.counted_only {
        let text = Arc::new(
            TextCorpus::load_dir(&args.data).map_err(|e| anyhow::anyhow!("{}: {e} (bash scripts/fetch-data.sh)", args.data.display()))?.bytes().to_vec(),
        );
        let config = GptConfig { vocab_size: 256, context: CONTEXT, d_model: args.d_model, n_layers: 4, n_heads: 4, ..GptConfig::default() };
        let psi: usize = gpt_param_numels(&config).iter().sum();
        for &n in &args.ranks {
            for stage in ZeroStage::ALL {
                let (measured, layout) = live(stage, config, n, args.steps, &text)?;
                let estimate = engine_estimate(stage, &layout, n, 0);
                line("live", &format!("byte GPT d_model {} 4 blocks ({psi} parameters)", args.d_model), psi, n, stage, Some(measured), estimate);
            }
        }
    }
    let gpt2 = GptConfig::default();
    let psi: usize = gpt_param_numels(&gpt2).iter().sum();
    for &n in &args.ranks {
        for stage in ZeroStage::ALL {
            let layout = match stage {
                ZeroStage::Zero3 => gpt_unit_numels(&gpt2),
                _ => bucket_numels(&gpt_param_numels(&gpt2), DEFAULT_BUCKET_BYTES_MAX),
            };
            line("counted", "GPT-2 124M shape (f32, AdamW)", psi, n, stage, None, engine_estimate(stage, &layout, n, 0));
        }
    }
    Ok(())
}

fn mb(bytes: usize) -> f64 {
    (bytes as f64 / 1e6 * 1000.0).round() / 1000.0
}

fn fields(m: &MemoryPerRank) -> serde_json::Value {
    serde_json::json!({
        "params_mb": mb(m.params_bytes),
        "grads_mb": mb(m.grads_bytes),
        "optimizer_mb": mb(m.optimizer_bytes),
        "resident_mb": mb(m.resident_bytes()),
        "gathered_peak_mb": mb(m.gathered_peak_bytes),
        "grads_peak_mb": mb(m.grads_peak_bytes),
    })
}

fn line(part: &str, model: &str, psi: usize, n: usize, stage: ZeroStage, measured: Option<MemoryPerRank>, estimate: MemoryPerRank) {
    let closed = closed_form(stage, psi, n);
    let replicated = closed_form(ZeroStage::Replicated, psi, n).resident_bytes();
    let mut value = serde_json::json!({
        "bench": "zero",
        "part": part,
        "model": model,
        "ranks": n,
        "engine": stage.name(),
        "estimate": fields(&estimate),
        "closed_form": fields(&closed),
        "closed_form_vs_replicated": ((closed.resident_bytes() as f64 / replicated as f64) * 1000.0).round() / 1000.0,
    });
    if let Some(m) = measured {
        value["measured"] = fields(&m);
        value["measured_matches_estimate"] = serde_json::json!(m == estimate);
    }
    emit(value);
}

/// Runs `stage` at `n` ranks for `steps` real steps; rank 0's measured memory and the layout
/// (bucket or unit element counts) the estimate needs.
fn live(stage: ZeroStage, config: GptConfig, n: usize, steps: u64, text: &Arc<Vec<u8>>) -> anyhow::Result<(MemoryPerRank, Vec<usize>)> {
    let opt = AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-6, weight_decay: 0.1 };
    let decay = |_: &str, shape: &[usize]| shape.len() >= 2;
    let (_net, transports) = InProcessNetwork::new(n);
    let done = Arc::new(Barrier::new(n));
    let threads: Vec<_> = transports
        .into_iter()
        .enumerate()
        .map(|(rank, transport)| {
            let (text, done) = (Arc::clone(text), Arc::clone(&done));
            std::thread::spawn(move || -> anyhow::Result<(MemoryPerRank, Vec<usize>)> {
                let connect = move || {
                    let comm = CommConfig { op_timeout: Duration::from_secs(60), ..CommConfig::default() };
                    Endpoint::new(Arc::new(transport) as Arc<dyn Transport>, comm)?.world()
                };
                let gpt = Gpt::new(config, &mut Generator::new(11))?;
                let result = match stage {
                    ZeroStage::Zero3 => {
                        let mut engine = FsdpGpt::new(gpt, FsdpConfig::default(), connect, adamw(opt, decay))?;
                        for step in 0..steps {
                            let (ids, targets) = batch(&text, step, rank, n)?;
                            engine.step(&ids, &targets, &mut Generator::new(0))?;
                        }
                        (engine.memory()?, engine.unit_numels())
                    }
                    _ => {
                        let sharding = match stage {
                            ZeroStage::Zero1 => Sharding::Zero1,
                            ZeroStage::Zero2 => Sharding::Zero2,
                            _ => Sharding::Replicated,
                        };
                        let dp_config = DpConfig { bucket_bytes_max: 64 << 10, sharding, ..DpConfig::default() };
                        let mut dp = DataParallel::new(gpt, dp_config, connect, adamw(opt, decay))?;
                        for step in 0..steps {
                            let (ids, targets) = batch(&text, step, rank, n)?;
                            dp.step(|m| m.loss(&ids, &targets, &mut Generator::new(0)))?;
                        }
                        (dp.memory()?, dp.buckets().buckets().iter().map(|b| b.numel()).collect())
                    }
                };
                done.wait();
                Ok(result)
            })
        })
        .collect();
    let mut results = Vec::new();
    for t in threads {
        results.push(t.join().map_err(|_| anyhow::anyhow!("a rank thread panicked"))??);
    }
    results.into_iter().next().ok_or_else(|| anyhow::anyhow!("no ranks"))
}

/// Rank `rank`'s rows of step `step`'s batch: `ROWS` windows of SOTU bytes at seeded offsets.
fn batch(text: &[u8], step: u64, rank: usize, n: usize) -> anyhow::Result<(Tensor, Tensor)> {
    let mut g = Generator::new(1_000 + step);
    let rows = ROWS / n;
    let (mut ids, mut targets) = (Vec::new(), Vec::new());
    for row in 0..ROWS {
        let at = g.below((text.len() - CONTEXT - 1) as u64) as usize;
        if row / rows == rank {
            ids.extend(text[at..at + CONTEXT].iter().map(|&b| u32::from(b)));
            targets.extend(text[at + 1..at + CONTEXT + 1].iter().map(|&b| u32::from(b)));
        }
    }
    Ok((Tensor::from_vec(ids, &[rows, CONTEXT])?, Tensor::from_vec(targets, &[rows, CONTEXT])?))
}
