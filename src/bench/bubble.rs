//! `rtx bench bubble`: the pipeline bubble of GPipe, 1F1B, interleaved 1F1B (2 chunks) and
//! ZB-H1 at `p = 4` and `m = 8, 16, 32`, next to 1F1B's theory `(p-1)/(m+p-1)`.
//!
//! Two parts. First it **measures** one transformer block of the byte-level GPT (pre-norm,
//! causal attention, GELU MLP; default d_model 256, 4 heads, context 128, micro-batch 4, as
//! `rtx bench step --model gpt` and `configs/sotu_gpt.toml` use) on this machine with
//! `rtx_tensor`: the forward (graph recorded, as in training), and forward + backward from a
//! fixed output gradient; backward = the difference of the two medians. The backward is split
//! into weight gradient W = the four linears' `dW = dYᵀ·X` products timed bare through the
//! kernel, and input gradient B = backward − W (the rest: `dX` products, attention, norms, GELU,
//! bias reductions). Then it **simulates** each schedule with
//! [`rtx_pipelines::schedule::simulate`] in virtual time: `--layers` blocks split evenly over
//! the stages (over `2p` virtual stages when interleaved), so every stage costs the same, which
//! is the case the theory describes; embedding, head and loss are left out. Transfers cost
//! `--p2p-us` (0 by default). Each result line says `"time": "virtual"`: busy and idle seconds
//! come from the simulated timeline, not from processes running in parallel.

use super::emit;
use super::threads;
use super::timing::{measure, round3};
use rtx_kernels::matmul::{matmul, Operand};
use rtx_pipelines::schedule::{simulate, Costs, ScheduleKind, Timeline};
use rtx_tensor::nn::{BlockConfig, Module, TransformerBlock};
use rtx_tensor::{DType, GeluApprox, Generator, Tensor};

/// The model and pipeline shape `rtx bench bubble` and `rtx bench pipeline` share: a byte-level GPT
/// of pre-norm blocks cut into stages, and the micro-batch counts to run.
#[derive(clap::Args, Debug, Clone)]
pub struct PipelineShape {
    /// Model width.
    #[arg(long, default_value_t = 256)]
    pub d_model: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// Sequence length (tokens per sample).
    #[arg(long, default_value_t = 128)]
    pub context: usize,
    /// Samples per micro-batch.
    #[arg(long, default_value_t = 4)]
    pub micro_batch: usize,
    /// Transformer blocks; divisible by `2 * stages` (interleaving puts one chunk per half-stage).
    #[arg(long, default_value_t = 8)]
    pub layers: usize,
    /// Pipeline stages.
    #[arg(long, default_value_t = 4)]
    pub stages: usize,
    /// Micro-batches per step.
    #[arg(long, value_delimiter = ',', default_value = "8,16,32")]
    pub microbatches: Vec<usize>,
}

/// Arguments of `rtx bench bubble`.
#[derive(clap::Args, Debug, Clone)]
pub struct BubbleArgs {
    /// The model and pipeline shape.
    #[command(flatten)]
    pub shape: PipelineShape,
    /// Latency of one activation or gradient transfer between stages, microseconds.
    #[arg(long, default_value_t = 0.0)]
    pub p2p_us: f64,
    /// Untimed runs before timing.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Timed runs; medians are used.
    #[arg(long, default_value_t = 11)]
    pub repeats: usize,
}

/// Measured seconds of one block for one micro-batch.
#[derive(Clone, Copy, Debug, PartialEq)]
struct BlockCosts {
    forward: f64,
    backward_input: f64,
    backward_weight: f64,
}

/// Runs the benchmark: one `costs` line, then one line per (schedule, m).
pub(super) fn run(args: &BubbleArgs) -> anyhow::Result<()> {
    let p = args.shape.stages;
    anyhow::ensure!(p >= 1, "--stages must be at least 1");
    anyhow::ensure!(args.shape.layers > 0 && args.shape.layers.is_multiple_of(2 * p), "--layers {} must be a positive multiple of 2 x stages = {}", args.shape.layers, 2 * p);
    anyhow::ensure!(args.p2p_us.is_finite() && args.p2p_us >= 0.0, "--p2p-us must be a non-negative number, got {}", args.p2p_us);
    let block = measure_block(args)?;
    emit(serde_json::json!({
        "bench": "bubble",
        "line": "costs",
        "block": format!("pre-norm GPT block d_model {} heads {} context {} micro-batch {}", args.shape.d_model, args.shape.heads, args.shape.context, args.shape.micro_batch),
        "forward_ms": round3(block.forward * 1e3),
        "backward_input_ms": round3(block.backward_input * 1e3),
        "backward_weight_ms": round3(block.backward_weight * 1e3),
        "split": "W = bare dW=dY^T.X gemms of the 4 linears; B = measured backward - W",
        "layers": args.shape.layers,
        "stages": p,
        "repeats": args.repeats,
        "threads": threads(),
    }));
    for line in schedule_lines(block, args.shape.layers, p, &args.shape.microbatches, args.p2p_us * 1e-6)? {
        emit(line);
    }
    Ok(())
}

/// The per-(schedule, m) result lines (`peak_live` counts (micro-batch, chunk) pairs, each
/// `1/chunks` of a stage's layers; `peak_held` also counts inputs kept for a deferred weight
/// gradient) for `layers` blocks of cost `block` over `p` stages.
fn schedule_lines(block: BlockCosts, layers: usize, p: usize, microbatches: &[usize], p2p_s: f64) -> anyhow::Result<Vec<serde_json::Value>> {
    let kinds = [ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved { chunks: 2 }, ScheduleKind::ZeroBubbleH1];
    let mut lines = Vec::new();
    for &m in microbatches {
        for kind in kinds {
            let virtual_stages = p * kind.chunks();
            let per = (layers / virtual_stages) as f64;
            let costs = Costs::uniform(virtual_stages, per * block.forward, per * block.backward_input, per * block.backward_weight, p2p_s);
            let timeline = simulate(kind, p, m, &costs)?;
            lines.push(line(kind, p, m, &timeline));
        }
    }
    Ok(lines)
}

fn line(kind: ScheduleKind, p: usize, m: usize, t: &Timeline) -> serde_json::Value {
    let secs = |xs: &[f64]| xs.iter().map(|x| (x * 1e6).round() / 1e6).collect::<Vec<f64>>();
    let fractions: Vec<f64> = (0..p).map(|s| round4(t.stage_bubble_fraction(s))).collect();
    serde_json::json!({
        "bench": "bubble",
        "time": "virtual: schedule simulated with the measured per-block costs",
        "schedule": kind.name(),
        "p": p,
        "m": m,
        "makespan_s": (t.makespan * 1e6).round() / 1e6,
        "busy_s": secs(&t.busy),
        "idle_s": secs(&t.idle),
        "stage_bubble": fractions,
        "bubble": round4(t.bubble_fraction()),
        "theory_1f1b": round4((p - 1) as f64 / (m + p - 1) as f64),
        "chunks": kind.chunks(),
        "peak_live": t.peak_live,
        "peak_held": t.peak_held,
    })
}

fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

/// Times one block's forward, forward + backward, and its linears' weight-gradient products.
fn measure_block(args: &BubbleArgs) -> anyhow::Result<BlockCosts> {
    let (b, t, c) = (args.shape.micro_batch, args.shape.context, args.shape.d_model);
    anyhow::ensure!(
        b > 0 && t > 0 && c > 0 && args.shape.heads > 0 && c.is_multiple_of(args.shape.heads),
        "block shape: batch {b}, context {t}, d_model {c} must be positive and divisible by heads {}",
        args.shape.heads
    );
    let mut rng = Generator::new(0);
    let config = BlockConfig {
        d_model: c,
        n_heads: args.shape.heads,
        mlp_hidden: 4 * c,
        causal: true,
        bias: true,
        dropout: 0.0,
        layer_norm_eps: 1e-5,
        init_std: 0.02,
        proj_init_std: 0.02 / (2.0 * args.shape.layers as f64).sqrt(),
        dtype: DType::F32,
        gelu: GeluApprox::Tanh,
    };
    let block = TransformerBlock::new(&config, &mut rng)?;
    let x = Tensor::randn(&[b, t, c], 0.0, 1.0, DType::F32, &mut rng)?.requires_grad(true);
    let dy = Tensor::randn(&[b, t, c], 0.0, 1.0, DType::F32, &mut rng)?;
    let forward = measure(args.warmup, args.repeats, || {
        block.forward(&x, None, &mut rng)?;
        Ok(())
    })?;
    let forward_backward = measure(args.warmup, args.repeats, || {
        let y = block.forward(&x, None, &mut rng)?;
        y.backward_from(dy.clone(), |_| {})?;
        block.zero_grad()?;
        x.zero_grad()?;
        Ok(())
    })?;
    // The four linears as (in, out): attn.qkv, attn.proj, mlp.fc, mlp.proj.
    let rows = b * t;
    let linears = [(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)];
    let mut weight_ms = 0.0;
    for (d_in, d_out) in linears {
        let xs = vec![0.5f32; rows * d_in];
        let dys = vec![0.125f32; rows * d_out];
        let mut dw = vec![0f32; d_out * d_in];
        let st = measure(args.warmup, args.repeats, || {
            let dy_t = Operand { offset: 0, row_stride: 1, col_stride: d_out };
            matmul(d_out, d_in, rows, &dys, dy_t, &xs, Operand::row_major(0, d_in), &mut dw, 0, false)?;
            Ok(())
        })?;
        weight_ms += st.median_ms;
    }
    let backward_ms = (forward_backward.median_ms - forward.median_ms).max(0.0);
    let weight_ms = weight_ms.min(backward_ms);
    Ok(BlockCosts { forward: forward.median_ms * 1e-3, backward_input: (backward_ms - weight_ms) * 1e-3, backward_weight: weight_ms * 1e-3 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_put_1f1b_on_its_theory_and_zb_h1_below_it() {
        // Goal: with the same cost on every stage, the 1F1B line's bubble is the theory column
        // and ZB-H1's is smaller; every schedule gets one line per m, all saying virtual time.
        let block = BlockCosts { forward: 1e-3, backward_input: 1e-3, backward_weight: 1e-3 };
        let lines = schedule_lines(block, 8, 4, &[8, 16], 0.0).unwrap();
        assert_eq!(lines.len(), 8);
        let get = |name: &str, m: usize| lines.iter().find(|l| l["schedule"] == name && l["m"] == m).unwrap().clone();
        for m in [8, 16] {
            let one = get("1f1b", m);
            assert_eq!(one["bubble"], one["theory_1f1b"]);
            assert!(get("zb-h1", m)["bubble"].as_f64().unwrap() < one["bubble"].as_f64().unwrap());
            assert!(get("interleaved-2", m)["bubble"].as_f64().unwrap() < one["bubble"].as_f64().unwrap());
            assert!(get("gpipe", m)["time"].as_str().unwrap().starts_with("virtual"));
        }
    }
}
