//! `rtx bench fed`: seconds per round (median) and peak RSS of the reference federated workload
//! (issue 15) at a given population N and clients per round K, or of any federation config.
//! Each round includes the test-set evaluation, as the Flower peer's rounds do
//! (`scripts/peer/flower_fed.py`, timed between its centralized evaluations);
//! `scripts/bench-fed.sh` runs both at the same N/K and prints the ratio.
//!
//! Peak RSS is the kernel's high-water mark (`VmHWM` of /proc/self/status), so it includes the
//! datasets (Fashion-MNIST as bytes: ~55 MB), the population's arrays and every round's buffers.

use std::path::PathBuf;

use rtx_federated::FedConfig;
use rtx_tensor::data::{DataRoot, DATA_DIR_ENV};

use crate::fed_cmd::Run;

/// Arguments of `rtx bench fed`.
#[derive(clap::Args, Debug, Clone)]
pub struct FedBenchArgs {
    /// A federation config to time instead of the reference workload (N/K/rounds flags override it).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// N, the population.
    #[arg(long)]
    pub population: Option<u64>,
    /// K, clients per round.
    #[arg(long)]
    pub clients_per_round: Option<u64>,
    /// Rounds to time.
    #[arg(long)]
    pub rounds: Option<u32>,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Aggregator fan-in.
    #[arg(long)]
    pub fan_in: Option<usize>,
    /// Data folder (default: $RTX_DATA_DIR, else ./data).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
}

/// The reference workload of `configs/fed_flower_ref.toml` at N = K = 1000, 5 rounds.
const REFERENCE: &str = "seed = 42\n[population]\nn_clients = 1000\n[round]\nrounds = 5\nclients_per_round = 1000\n";

/// Runs the benchmark, printing one JSON line per round and a summary line.
pub(super) fn run(args: &FedBenchArgs) -> anyhow::Result<()> {
    let mut config = match &args.config {
        Some(path) => FedConfig::from_file(path)?,
        None => FedConfig::from_toml_str(REFERENCE)?,
    };
    if let Some(n) = args.population {
        config.population.n_clients = n;
    }
    if let Some(k) = args.clients_per_round {
        config.round.clients_per_round = k;
    }
    if let Some(r) = args.rounds {
        config.round.rounds = r;
    }
    if let Some(t) = args.threads {
        config.round.threads = t;
    }
    if let Some(f) = args.fan_in {
        config.round.fan_in = f;
    }
    config.validate()?;
    let root = DataRoot::resolve(args.data_dir.as_deref(), std::env::var_os(DATA_DIR_ENV).as_deref());
    let data = rtx_federated::FedData::load(root.path(), config.population.dataset, config.seed)?;
    let setup = std::time::Instant::now();
    let mut run = Run::new(&config, &data)?;
    let setup_s = setup.elapsed().as_secs_f64();
    let mut seconds = Vec::new();
    let mut last_acc = None;
    for _ in 0..config.round.rounds {
        let (_, record) = run.round(true)?;
        println!(
            "{}",
            serde_json::json!({"bench": "fed", "peer": "rustytorch", "round": record.round, "test_acc": record.test_acc, "clients_done": record.clients_done, "seconds": record.seconds})
        );
        seconds.push(record.seconds);
        last_acc = record.test_acc;
    }
    let stats = super::Stats::from_samples(seconds.iter().map(|s| s * 1e3).collect());
    let threads = if config.round.threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { config.round.threads };
    println!(
        "{}",
        serde_json::json!({
            "bench": "fed", "peer": "rustytorch", "population": config.population.n_clients,
            "clients_per_round": config.round.clients_per_round, "rounds": config.round.rounds,
            "threads": threads, "fan_in": config.round.fan_in,
            "median_s_per_round": stats.median_ms / 1e3, "min_s_per_round": stats.min_ms / 1e3, "max_s_per_round": stats.max_ms / 1e3,
            "setup_s": setup_s, "final_test_acc": last_acc,
            "population_state_mib": run.federation.population().state_bytes() as f64 / 1048576.0,
            "peak_rss_mib": peak_rss_bytes().map(|b| b as f64 / 1048576.0),
        })
    );
    Ok(())
}

/// `VmHWM` of this process in bytes (Linux), the peak resident set size.
pub(super) fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
