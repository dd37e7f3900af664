//! Temporary runner for `rtx bench` until main.rs wires it (delete then).
use clap::Parser;
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: rustytorch::bench::BenchArgs,
}
fn main() -> anyhow::Result<()> {
    rustytorch::bench::run(Cli::parse().args)
}
