//! Command-line interface of the `rtx` binary (clap): `rtx train`, `rtx launch`, `rtx supervisor`,
//! `rtx worker`, `rtx status`, `rtx plan`, `rtx sim`, `rtx bench` and `rtx fed`.
//!
//! Parsing only; [`crate::train`] and [`crate::bench`] do the work, so the binary stays thin.
//!
//! The `///` comments of the argument structs are the `--help` text clap prints, not markdown:
//! `[elastic]` names a TOML table and `<out>` a placeholder, so rustdoc's link and HTML checks are
//! off for this module.

#![allow(rustdoc::broken_intra_doc_links, rustdoc::invalid_html_tags)]

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// rustytorch: train models from a TOML config, and benchmark the CPU compute.
#[derive(Parser, Debug)]
#[command(name = "rtx", version)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Train a model in this process, driven by a TOML config (see configs/*.toml).
    Train(TrainArgs),
    /// Train with N local worker processes under a supervisor (elastic data parallelism).
    Launch(LaunchArgs),
    /// Run the supervisor of a cluster job; workers join it with `rtx worker`.
    Supervisor(SupervisorArgs),
    /// Join a supervisor as a worker (token from $RTX_TOKEN; address from --join, torchrun or Slurm variables).
    Worker(WorkerArgs),
    /// Show a running job: members, generation, step, throughput.
    Status(StatusArgs),
    /// Print the plan of a config's [parallel] section on N ranks: mesh, layers, memory, bubble.
    Plan(PlanArgs),
    /// Simulate a whole elastic job (real supervisor and workers, faults) in virtual time, by seed.
    Sim(SimArgs),
    /// Time rustytorch's CPU compute (JSON lines on stdout).
    Bench(crate::bench::BenchArgs),
    /// Federated learning: `rtx fed run CONFIG.toml` runs a whole federation in this process;
    /// `rtx fed serve` + `rtx fed clients` run it with client host processes over QUIC.
    Fed(crate::fed_cmd::FedArgs),
}

/// Arguments of `rtx plan`.
#[derive(Args, Debug, Clone)]
pub struct PlanArgs {
    /// The config file, e.g. configs/sotu_gpt_3d.toml.
    pub config: PathBuf,
    /// Ranks in the world (the `--nproc` of `rtx launch`).
    #[arg(long)]
    pub world: usize,
    /// Machine-readable output (one JSON document).
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `rtx sim`.
#[derive(Args, Debug, Clone)]
pub struct SimArgs {
    /// The scenario file, e.g. sim/scenarios/elastic_dp.toml.
    #[arg(long)]
    pub scenario: PathBuf,
    /// Run this one seed (and print its trace hash).
    #[arg(long, conflicts_with = "seeds")]
    pub seed: Option<u64>,
    /// Run the seeds A..B (B excluded) as a swarm across cores.
    #[arg(long)]
    pub seeds: Option<String>,
    /// Threads of the swarm (default: available cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Data folder (default: $RTX_DATA_DIR, else ./data).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Test-only: plant a bug (elastic scenarios: a re-formed group retrains its newest step; mesh
    /// scenarios: a replacement starts its slot from the initial parameters;
    /// federated scenarios: a host that delivered and then went away loses its pieces) to see
    /// the invariants catch it.
    #[arg(long, hide = true)]
    pub planted_bug: bool,
}

/// Arguments of `rtx launch`.
#[derive(Args, Debug, Clone)]
pub struct LaunchArgs {
    /// The config file, e.g. configs/fashion_mlp.toml (its optional [elastic] table sets failure policy).
    pub config: PathBuf,
    /// Worker processes to start.
    #[arg(long, default_value_t = 2)]
    pub nproc: usize,
    /// Settings shared with `rtx supervisor`.
    #[command(flatten)]
    pub job: JobArgs,
}

/// The job settings of `rtx launch` and `rtx supervisor`.
#[derive(Args, Debug, Clone)]
pub struct JobArgs {
    /// Fewest workers that may train (default: [elastic] min_workers, else 1).
    #[arg(long)]
    pub min_workers: Option<usize>,
    /// Most workers (default: [elastic] max_workers, else the starting count).
    #[arg(long)]
    pub max_workers: Option<usize>,
    /// Continue from the newest checkpoint in the output folder.
    #[arg(long)]
    pub resume: bool,
    /// Stop after step N (with a checkpoint) instead of train.steps; `--resume` continues the run.
    #[arg(long, value_name = "N")]
    pub steps: Option<u64>,
    /// Data folder (default: $RTX_DATA_DIR, else ./data; checked here, each worker reads its own).
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Output folder (default: [output] dir of the config, else runs/<config name>).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Print log lines only, no progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Serve the live cluster page (and /api/state, /events, /metrics) on this address, e.g.
    /// 127.0.0.1:8080 (port 0: any free port; the address is printed and written to <out>/http.addr).
    #[arg(long, value_name = "ADDR")]
    pub http: Option<std::net::SocketAddr>,
}

/// Arguments of `rtx supervisor`.
#[derive(Args, Debug, Clone)]
pub struct SupervisorArgs {
    /// The config file.
    pub config: PathBuf,
    /// Control address to listen on (default: 0.0.0.0:$MASTER_PORT under torchrun/Slurm).
    #[arg(long)]
    pub listen: Option<std::net::SocketAddr>,
    /// Workers to wait for before the first step (default: $WORLD_SIZE / $SLURM_NTASKS, else 1).
    #[arg(long)]
    pub nproc: Option<usize>,
    /// Settings shared with `rtx launch`.
    #[command(flatten)]
    pub job: JobArgs,
}

/// Arguments of `rtx worker`.
#[derive(Args, Debug, Clone)]
pub struct WorkerArgs {
    /// The supervisor's address (default: $MASTER_ADDR:$MASTER_PORT, or the first Slurm node).
    #[arg(long)]
    pub join: Option<String>,
    /// The cluster token (prefer $RTX_TOKEN: a command line is visible to other users).
    #[arg(long)]
    pub token: Option<String>,
    /// Data folder (default: $RTX_DATA_DIR, else ./data).
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// QUIC connections per worker pair for the collectives (1-16; default: $RTX_QUIC_STRIPES, else
    /// 1). Between hosts with cores to spare, 2 lets the worker's two runtime threads both seal and
    /// open packets (see BENCHMARKS.md, "QUIC stripes").
    #[arg(long, value_name = "N")]
    pub quic_stripes: Option<usize>,
}

/// Arguments of `rtx status`.
#[derive(Args, Debug, Clone)]
pub struct StatusArgs {
    /// The supervisor's address.
    pub addr: String,
    /// The cluster token (default: $RTX_TOKEN).
    #[arg(long)]
    pub token: Option<String>,
}

/// Arguments of `rtx train`.
#[derive(Args, Debug, Clone)]
pub struct TrainArgs {
    /// The config file, e.g. configs/fashion_mlp.toml.
    pub config: PathBuf,
    /// Continue from the latest checkpoint in the output folder.
    #[arg(long)]
    pub resume: bool,
    /// Data folder filled by `bash scripts/fetch-data.sh` (default: $RTX_DATA_DIR, else ./data).
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Output folder for metrics.jsonl, loss.png and checkpoints (default: [output] dir of the
    /// config, else runs/<config name>).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Stop after step N instead of train.steps. The schedule still spans the configured run, so a
    /// later `--resume` continues the same run.
    #[arg(long, value_name = "N")]
    pub steps: Option<u64>,
    /// Print log lines only, no progress bar (the bar is also hidden when stdout is not a terminal).
    #[arg(long)]
    pub no_progress: bool,
}
