//! `rtx bench`: timings of rustytorch's CPU compute that `scripts/bench-vs-torch.sh` sets against
//! PyTorch on the same machine in the same run.
//!
//! Three benchmarks: `matmul` (fp32 GFLOP/s of [`rtx_tensor::Tensor::matmul`] and of the bare
//! kernel writing into a reused buffer) and `step --model mlp|gpt` (one full training step:
//! forward, cross-entropy, backward, AdamW step, zero_grad), and `ops --model mlp|gpt`, which
//! times each op of that step alone to show where the time goes. Each prints one JSON object per
//! line with the median (and min/max) of `--repeats` runs after `--warmup` runs. Threads follow
//! `RTX_NUM_THREADS` (default: all cores), as every kernel does. Shapes match
//! `scripts/peer/torch_bench.py` exactly; change both together. `actors` times actor calls in-process and across processes over QUIC. `collectives` measures the
//! collectives between processes (see its module; `scripts/bench-collectives.sh` adds Gloo).
//! `bubble` predicts the pipeline bubble in virtual time; `pipeline` measures it on real stages.
//! `zero` reports memory per rank of replicated DP and ZeRO-1/2/3 next to the ZeRO paper's figures.
//! `fed` times federated rounds of the reference workload against population and sample size.

mod actors;
mod bubble;
mod collectives;
mod fed;
mod jepa_step;
mod matmul;
mod ops;
mod pipeline;
mod step;
mod timing;
mod zero;

pub use actors::ActorsArgs;
pub use collectives::{BenchTransport, CollectiveOp, CollectivesArgs};
pub use fed::FedBenchArgs;
pub use matmul::MatmulArgs;
pub use ops::OpsArgs;
pub use step::{StepArgs, StepModel};
pub use timing::Stats;
pub use zero::ZeroArgs;

/// Arguments of `rtx bench`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Which benchmark to run.
    #[command(subcommand)]
    pub command: BenchCommand,
}

/// The benchmarks `rtx bench` knows.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum BenchCommand {
    /// fp32 matrix multiplication at 1024³ and 4096×4096×1024 (GFLOP/s).
    Matmul(MatmulArgs),
    /// One full training step (forward, cross-entropy, backward, AdamW, zero_grad).
    Step(StepArgs),
    /// Each op of a model's step alone at its shapes, forward and forward+backward.
    Ops(OpsArgs),
    /// all_reduce, reduce_scatter and all_gather between rank processes over QUIC and shared memory.
    Collectives(Box<CollectivesArgs>),
    /// Actor call round trip, in-process and across processes over QUIC.
    Actors(ActorsArgs),
    /// Pipeline bubble of GPipe, 1F1B, interleaved and ZB-H1 (virtual time, measured block costs).
    Bubble(bubble::BubbleArgs),
    /// Pipeline bubble measured on real stages (rank threads) next to theory and prediction.
    Pipeline(pipeline::PipelineArgs),
    /// Memory per rank of replicated DP, ZeRO-1, ZeRO-2 and ZeRO-3 next to the ZeRO paper's figures.
    Zero(ZeroArgs),
    /// Seconds per federated round (median) and peak RSS at population N, K clients a round.
    Fed(FedBenchArgs),
}

/// Runs one benchmark, printing JSON lines on stdout.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.command {
        BenchCommand::Matmul(a) => matmul::run(&a),
        BenchCommand::Step(a) => step::run(&a),
        BenchCommand::Ops(a) => ops::run(&a),
        BenchCommand::Collectives(a) => collectives::run(&a),
        BenchCommand::Actors(a) => actors::run(&a),
        BenchCommand::Bubble(a) => bubble::run(&a),
        BenchCommand::Pipeline(a) => pipeline::run(&a),
        BenchCommand::Zero(a) => zero::run(&a),
        BenchCommand::Fed(a) => fed::run(&a),
    }
}

/// The thread count kernels use in this process (sets up the shared pool on first call).
fn threads() -> usize {
    rtx_kernels::threading::num_threads()
}

/// Prints one result line.
#[allow(clippy::print_stdout)]
fn emit(value: serde_json::Value) {
    println!("{value}");
}
