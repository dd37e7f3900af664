//! `rtx fed run CONFIG.toml`: a whole federation in this process (client hosts on threads), from a
//! [`FedConfig`]. Each round prints a progress line (clients done, dropped, accuracy, seconds),
//! appends one JSON line to `metrics.jsonl` (round, test_acc, test_loss, clients_done, dropped,
//! stragglers, rejected, seconds) and redraws `accuracy.png`.
//!
//! [`Run`] is the shared driver: `rtx bench fed` times the same rounds. `rtx fed serve` and
//! `rtx fed clients` (client hosts over QUIC) are not built yet; they will drive the same
//! [`Federation`] leaves from host processes.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use clap::{Args, Subcommand};
use rtx_federated::dp::ClientDp;
use rtx_federated::{FedConfig, FedData, Federation, LogReg, LogRegSgd, Plain, Population, RoundReport, UpdateTransform};
use serde::{Deserialize, Serialize};

use crate::progress::{Progress, Verbosity};

/// Arguments of `rtx fed`.
#[derive(Args, Debug, Clone)]
pub struct FedArgs {
    /// What to do.
    #[command(subcommand)]
    pub command: FedCommand,
}

/// The `rtx fed` subcommands.
#[derive(Subcommand, Debug, Clone)]
pub enum FedCommand {
    /// Run a whole federation in this process (client hosts on threads).
    Run(FedRunArgs),
}

/// Arguments of `rtx fed run`.
#[derive(Args, Debug, Clone)]
pub struct FedRunArgs {
    /// The federation config, e.g. configs/fed_flower_ref.toml.
    pub config: PathBuf,
    /// Output folder (default: the config's output.dir, else runs/fed).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Data folder (default: $RTX_DATA_DIR, else ./data).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Plain log lines, no progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

/// One line of the federation's `metrics.jsonl`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FedRecord {
    /// 1-based round (asynchronous mode: server step).
    pub round: u32,
    /// Test accuracy of the global model after the round (absent when not evaluated).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_acc: Option<f64>,
    /// Mean test cross-entropy after the round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_loss: Option<f64>,
    /// Clients whose update entered the aggregate.
    pub clients_done: u64,
    /// Clients that never answered (dropout, host down).
    pub dropped: u64,
    /// Clients cut at the deadline.
    pub stragglers: u64,
    /// Updates rejected (malformed or too stale).
    pub rejected: u64,
    /// Clients that answered without data.
    pub empty: u64,
    /// Client-level DP: epsilon at the config's delta after this many rounds (`[dp]` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epsilon: Option<f64>,
    /// Wall-clock seconds of the round and its evaluation (not deterministic).
    pub seconds: f64,
}

/// A federation of the reference workload family (logistic regression on the config's dataset),
/// ready to run round after round.
pub struct Run<'d> {
    /// The federation.
    pub federation: Federation<'d, LogRegSgd<'d>, Box<dyn UpdateTransform>>,
    /// The model shape, for evaluation.
    pub shape: LogReg,
    /// The data (test set for evaluation).
    pub data: &'d FedData,
    /// Epsilon after rounds 1, 2, ... under `[dp]` (empty without it).
    pub epsilons: Vec<f64>,
}

impl<'d> Run<'d> {
    /// Builds population, trainer and federation for `config` over `data`.
    pub fn new(config: &FedConfig, data: &'d FedData) -> anyhow::Result<Self> {
        let shape = LogReg { n_features: data.n_features(), n_classes: data.n_classes() };
        let population = Population::new(&config.population, config.seed, &data.train.labels)?;
        let l = &config.local;
        let trainer = LogRegSgd::new(shape, &data.train, l.lr, l.batch_size, l.epochs, config.strategy.mu, l.shuffle);
        let dp = config.dp_config()?;
        let epsilons = match &dp {
            Some(dp) => dp.epsilon_per_round(u64::from(config.round.rounds))?.into_iter().map(|e| e.epsilon).collect(),
            None => Vec::new(),
        };
        let transform: Box<dyn UpdateTransform> = match dp {
            Some(dp) => Box::new(ClientDp::new(dp, config.seed)),
            None => Box::new(Plain),
        };
        let federation = Federation::new(config.clone(), population, trainer, transform, vec![0.0; shape.n_params()])?;
        Ok(Run { federation, shape, data, epsilons })
    }

    /// Runs one round, evaluating when `evaluate`; returns the report and the metrics record.
    pub fn round(&mut self, evaluate: bool) -> anyhow::Result<(RoundReport, FedRecord)> {
        let start = Instant::now();
        let report = self.federation.run_round()?;
        let eval = evaluate.then(|| self.shape.evaluate(self.federation.model(), &self.data.test));
        let record = FedRecord {
            round: report.round + 1,
            test_acc: eval.map(|e| e.accuracy),
            test_loss: eval.map(|e| e.loss),
            clients_done: report.clients_done,
            dropped: report.dropped,
            stragglers: report.stragglers,
            rejected: report.rejected,
            empty: report.empty,
            epsilon: self.epsilons.get(report.round as usize).copied(),
            seconds: start.elapsed().as_secs_f64(),
        };
        Ok((report, record))
    }
}

/// `rtx fed ...`.
pub fn run(args: &FedArgs, data_root: &Path, font: Option<&Path>) -> anyhow::Result<()> {
    match &args.command {
        FedCommand::Run(a) => run_local(a, data_root, font),
    }
}

fn run_local(args: &FedRunArgs, data_root: &Path, font: Option<&Path>) -> anyhow::Result<()> {
    let config = FedConfig::from_file(&args.config)?;
    let out = args.out.clone().or_else(|| config.output.dir.clone()).unwrap_or_else(|| PathBuf::from("runs/fed"));
    std::fs::create_dir_all(&out).with_context(|| format!("create output folder {}", out.display()))?;
    let data = FedData::load(data_root, config.population.dataset, config.seed)?;
    let mut run = Run::new(&config, &data)?;
    let rounds = config.round.rounds;
    let verbosity = if args.no_progress { Verbosity::Lines } else { Verbosity::Auto };
    let progress = Progress::new(verbosity, 0, u64::from(rounds));
    progress.line(&format!(
        "federation: N = {} clients, K = {} a round, {} rounds, {:?} on {:?} ({:?} split), {} host(s), fan-in {}",
        config.population.n_clients,
        config.round.clients_per_round,
        rounds,
        config.strategy.kind,
        config.population.dataset,
        config.population.partition,
        config.round.hosts,
        config.round.fan_in,
    ));
    let metrics_path = out.join("metrics.jsonl");
    let mut metrics = std::io::BufWriter::new(std::fs::File::create(&metrics_path).with_context(|| format!("create {}", metrics_path.display()))?);
    let mut records = Vec::new();
    for r in 0..rounds {
        let evaluate = (r + 1) % config.round.eval_every == 0 || r + 1 == rounds;
        let (_, record) = run.round(evaluate)?;
        serde_json::to_writer(&mut metrics, &record)?;
        metrics.write_all(b"\n")?;
        metrics.flush()?;
        let acc = record.test_acc.map_or_else(|| "-".to_string(), |a| format!("{a:.4}"));
        let eps = record.epsilon.map_or_else(String::new, |e| format!(" | epsilon {e:.3}"));
        let text = format!(
            "round {}/{rounds}: clients done {} dropped {} stragglers {} rejected {} | test acc {acc}{eps} | {:.2} s",
            record.round, record.clients_done, record.dropped, record.stragglers, record.rejected, record.seconds
        );
        progress.update_with(u64::from(record.round), &text);
        progress.line(&text);
        records.push(record);
    }
    progress.finish();
    let points: Vec<(f64, f64)> = records.iter().filter_map(|r| Some((f64::from(r.round), r.test_acc?))).collect();
    let png = out.join("accuracy.png");
    let with_text = crate::plot::ensure_font(font);
    crate::plot::plot_accuracy_curve(&points, &png, "federated test accuracy", with_text)?;
    println!("wrote {} and {}", metrics_path.display(), png.display());
    Ok(())
}
