//! The `rtx` binary: parses the command line and hands off to the `rustytorch` library.
//!
//! Environment read here (and nowhere in the libraries): `RTX_DATA_DIR` (data folder),
//! `RTX_PLOT_FONT` (a TTF for plot text), `RUST_LOG` (tracing filter, default `warn`).

use std::io::IsTerminal as _;
use std::process::ExitCode;

use clap::Parser;
use rustytorch::cli::{Cli, Command};
use rustytorch::data::{DataRoot, DATA_DIR_ENV};
use rustytorch::progress::Verbosity;
use rustytorch::train::{self, TrainOptions};

/// Every op writes a fresh output buffer; mimalloc reuses freed blocks instead of returning pages
/// to the OS and faulting them back in (measured: glibc malloc costs ~64k page faults per GPT step).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // A simulation injects faults on purpose: their warnings are noise unless asked for.
    let default_filter = if matches!(cli.command, Command::Sim(_)) { "error" } else { "warn" };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    // Colour codes only for a terminal: a Slurm output file or a pipe gets plain text.
    let ansi = std::io::stderr().is_terminal();
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).init();

    let result = match cli.command {
        Command::Train(args) => {
            let data_root = DataRoot::resolve(args.data_dir.as_deref(), std::env::var_os(DATA_DIR_ENV).as_deref());
            let options = TrainOptions {
                data_root,
                out_dir: args.out,
                resume: args.resume,
                stop_at: args.steps,
                verbosity: if args.no_progress { Verbosity::Lines } else { Verbosity::Auto },
                font: std::env::var_os("RTX_PLOT_FONT").map(Into::into),
            };
            train::run_file(&args.config, options).map(|_| ()).map_err(anyhow::Error::from)
        }
        Command::Launch(args) => rustytorch::elastic::launch(args),
        Command::Supervisor(args) => rustytorch::elastic::supervise(args),
        Command::Worker(args) => rustytorch::elastic::worker(args),
        Command::Status(args) => rustytorch::elastic::status(args),
        Command::Plan(args) => rustytorch::plan_cmd::run(&args),
        Command::Sim(args) => {
            let data_root = DataRoot::resolve(args.data_dir.as_deref(), std::env::var_os(DATA_DIR_ENV).as_deref());
            rustytorch::sim::run(&args, data_root.path())
        }
        Command::Bench(args) => rustytorch::bench::run(args),
        Command::Fed(args) => {
            let data_root = DataRoot::resolve(rustytorch::fed_cmd::data_dir(&args.command), std::env::var_os(DATA_DIR_ENV).as_deref());
            let font: Option<std::path::PathBuf> = std::env::var_os("RTX_PLOT_FONT").map(Into::into);
            rustytorch::fed_cmd::run(&args, data_root.path(), font.as_deref())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
