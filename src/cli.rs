//! Command-line interface of the `rtx` binary (clap): `rtx train` and `rtx bench`.
//!
//! Parsing only; [`crate::train`] and [`crate::bench`] do the work, so the binary stays thin.

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
    /// Time rustytorch's CPU compute (JSON lines on stdout).
    Bench(crate::bench::BenchArgs),
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
