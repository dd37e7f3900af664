//! `rtx bench fed`: seconds per round (median) and peak RSS of the reference federated workload
//! (issue 15) at a given population N and clients per round K, or of any federation config.
//! Each round includes the test-set evaluation, as the Flower peer's rounds do
//! (`scripts/peer/flower_fed.py`, timed between its centralized evaluations);
//! `scripts/bench-fed.sh` runs both at the same N/K and prints the ratio.
//!
//! `--overheads` (issue 15: "secure aggregation and DP overheads at K = 10K: seconds per round with
//! and without each, in the same run") times the same rounds four times in one invocation, plain,
//! with `[dp]`, with `[secagg]` and with both (default N = 100,000, K = 10,000, 3 rounds each), and
//! prints median seconds per round (the round alone, evaluation excluded) and the ratio to plain.
//!
//! Peak RSS is the kernel's high-water mark (`VmHWM` of /proc/self/status), so it includes the
//! datasets (Fashion-MNIST as bytes: ~55 MB), the population's arrays and every round's buffers.

use std::path::PathBuf;

use rtx_federated::config::DpSection;
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
    /// Time the same rounds plain, with DP, with secure aggregation and with both (defaults
    /// N = 100,000, K = 10,000, 3 rounds; the config's `[dp]` / `[secagg]` when it has them, else
    /// clip 0.5, z = 1.0 and the `[secagg]` defaults) and print the overhead table.
    #[arg(long)]
    pub overheads: bool,
}

/// The reference workload of `configs/fed_flower_ref.toml` at N = K = 1000, 5 rounds.
const REFERENCE: &str = "seed = 42\n[population]\nn_clients = 1000\n[round]\nrounds = 5\nclients_per_round = 1000\n";

/// Runs the benchmark, printing one JSON line per round and a summary line.
pub(super) fn run(args: &FedBenchArgs) -> anyhow::Result<()> {
    let mut config = match &args.config {
        Some(path) => FedConfig::from_file(path)?,
        None => FedConfig::from_toml_str(REFERENCE)?,
    };
    if args.overheads {
        config.population.n_clients = args.population.unwrap_or(100_000);
        config.round.clients_per_round = args.clients_per_round.unwrap_or(10_000);
        config.round.rounds = args.rounds.unwrap_or(3);
    }
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
    if args.overheads {
        return overheads(&config, &data);
    }
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

/// One variant of the overhead table.
struct Variant {
    name: &'static str,
    median_s: f64,
    min_s: f64,
    max_s: f64,
    final_test_acc: Option<f64>,
}

/// `--overheads`: the same rounds plain, with `[dp]`, with `[secagg]`, with both.
fn overheads(base: &FedConfig, data: &rtx_federated::FedData) -> anyhow::Result<()> {
    let dp = base.dp.clone().unwrap_or(DpSection { clip_norm: 0.5, noise_multiplier: 1.0, delta: 1e-5 });
    let secagg = base.secagg.clone().unwrap_or_default();
    let threads = if base.round.threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { base.round.threads };
    let mut rows = Vec::new();
    for (name, with_dp, with_secagg) in [("plain", false, false), ("dp", true, false), ("secagg", false, true), ("dp+secagg", true, true)] {
        let mut config = base.clone();
        config.dp = with_dp.then(|| dp.clone());
        config.secagg = with_secagg.then(|| secagg.clone());
        config.validate()?;
        let mut run = Run::new(&config, data)?;
        let mut seconds = Vec::new();
        let mut last_acc = None;
        for r in 0..config.round.rounds {
            let (report, record) = run.round(r + 1 == config.round.rounds)?;
            let secure = report.secure.as_ref();
            println!(
                "{}",
                serde_json::json!({"bench": "fed-overheads", "variant": name, "round": record.round, "seconds": report.seconds,
                    "clients_done": report.clients_done, "dropped": report.dropped, "test_acc": record.test_acc, "epsilon": record.epsilon,
                    "secagg_degree": secure.map(|s| s.degree), "secagg_aborted": secure.and_then(|s| s.aborted.as_ref().map(ToString::to_string)),
                    "secagg_phase_seconds": secure.map(|s| s.seconds)})
            );
            seconds.push(report.seconds);
            last_acc = record.test_acc.or(last_acc);
        }
        let stats = super::Stats::from_samples(seconds.iter().map(|s| s * 1e3).collect());
        rows.push(Variant { name, median_s: stats.median_ms / 1e3, min_s: stats.min_ms / 1e3, max_s: stats.max_ms / 1e3, final_test_acc: last_acc });
    }
    let plain = rows.first().map_or(f64::NAN, |r| r.median_s);
    println!(
        "N = {}, K = {}, {} rounds per variant, {threads} threads; DP clip {} z {}; seconds per round exclude evaluation",
        base.population.n_clients, base.round.clients_per_round, base.round.rounds, dp.clip_norm, dp.noise_multiplier
    );
    println!("| variant | median s/round | min | max | ratio to plain | final test acc |");
    println!("|---|---:|---:|---:|---:|---:|");
    for r in &rows {
        let acc = r.final_test_acc.map_or_else(|| "-".to_string(), |a| format!("{a:.4}"));
        println!("| {} | {:.3} | {:.3} | {:.3} | {:.1}x | {acc} |", r.name, r.median_s, r.min_s, r.max_s, r.median_s / plain);
    }
    let summary: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| serde_json::json!({"variant": r.name, "median_s_per_round": r.median_s, "ratio_to_plain": r.median_s / plain, "final_test_acc": r.final_test_acc}))
        .collect();
    println!(
        "{}",
        serde_json::json!({"bench": "fed-overheads", "population": base.population.n_clients, "clients_per_round": base.round.clients_per_round,
            "rounds": base.round.rounds, "threads": threads, "variants": summary,
            "peak_rss_mib": peak_rss_bytes().map(|b| b as f64 / 1048576.0)})
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
