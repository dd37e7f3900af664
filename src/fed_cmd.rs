//! `rtx fed run CONFIG.toml`: a whole federation in this process (client hosts on threads), from a
//! [`FedConfig`]. Each round prints a progress line (clients done, dropped, accuracy, seconds),
//! appends one JSON line to `metrics.jsonl` (round, test_acc, test_loss, clients_done, dropped,
//! stragglers, rejected, seconds) and redraws `accuracy.png`.
//!
//! `rtx fed serve CONFIG.toml` runs the coordinator of the same federation over QUIC and
//! `rtx fed clients --join HOST:PORT --population-slice A..B` a client host process holding that
//! slice of the population (token from `$RTX_TOKEN`; `serve` writes a fresh one to `OUT/token`
//! when none is set). The rounds, metrics and plot are the same as `rtx fed run`'s, and with every
//! host answering so are the model's bits; a host killed mid-round costs only its clients' updates
//! for that round (see `rtx_federated::remote`).
//!
//! [`Run`] is the shared driver: `rtx bench fed` times the same rounds.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, Subcommand};
use rtx_federated::dp::ClientDp;
use rtx_federated::remote::{Coordinator, CoordinatorOptions, HostConnection, HostOptions};
use rtx_federated::{FedConfig, FedData, Federation, LogReg, LogRegSgd, Plain, Population, RoundReport, UpdateTransform};
use serde::{Deserialize, Serialize};

use crate::elastic::TOKEN_ENV;
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
    /// Coordinate a federation whose client hosts are other processes (`rtx fed clients`), over QUIC.
    Serve(FedServeArgs),
    /// Run a client host process holding a slice of the population, for `rtx fed serve`.
    Clients(FedClientsArgs),
}

/// Arguments of `rtx fed serve`.
#[derive(Args, Debug, Clone)]
pub struct FedServeArgs {
    /// The config (sent to every client host that joins), output and data folders (the test set),
    /// as for `rtx fed run`.
    #[command(flatten)]
    pub run: FedRunArgs,
    /// Address to listen on for client hosts.
    #[arg(long, default_value = "0.0.0.0:29500")]
    pub listen: std::net::SocketAddr,
    /// Client hosts to wait for before the first round (default: the config's round.hosts).
    #[arg(long)]
    pub hosts: Option<usize>,
    /// How long to wait for them, in seconds.
    #[arg(long, default_value_t = 300.0)]
    pub join_timeout_s: f64,
    /// How long a round waits for the hosts' updates, in seconds; a host later than this loses its
    /// clients' updates for the round.
    #[arg(long, default_value_t = 60.0)]
    pub round_timeout_s: f64,
}

/// Arguments of `rtx fed clients`.
#[derive(Args, Debug, Clone)]
pub struct FedClientsArgs {
    /// The coordinator's address (`rtx fed serve`), HOST:PORT.
    #[arg(long)]
    pub join: String,
    /// The clients this host holds, A..B (ids A to B - 1 of the population).
    #[arg(long, value_name = "A..B")]
    pub population_slice: String,
    /// The token (prefer $RTX_TOKEN: a command line is visible to other users).
    #[arg(long)]
    pub token: Option<String>,
    /// This host's name in the coordinator's logs (default: clients-A..B).
    #[arg(long)]
    pub name: Option<String>,
    /// Data folder (default: $RTX_DATA_DIR, else ./data).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Extra milliseconds each round takes on this host, emulating slower edge devices (for
    /// deadline and failure drills).
    #[arg(long, default_value_t = 0)]
    pub compute_delay_ms: u64,
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
        self.round_by(evaluate, |federation| Ok(federation.run_round()?))
    }

    /// Runs one round with `step` (in this process, or over client hosts), evaluating when
    /// `evaluate`; returns the report and the metrics record.
    pub fn round_by(
        &mut self,
        evaluate: bool,
        step: impl FnOnce(&mut Federation<'d, LogRegSgd<'d>, Box<dyn UpdateTransform>>) -> anyhow::Result<RoundReport>,
    ) -> anyhow::Result<(RoundReport, FedRecord)> {
        let start = Instant::now();
        let report = step(&mut self.federation)?;
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
        FedCommand::Serve(a) => serve(a, data_root, font),
        FedCommand::Clients(a) => clients(a, data_root),
    }
}

/// The data folder a `rtx fed` command reads.
pub fn data_dir(command: &FedCommand) -> Option<&Path> {
    match command {
        FedCommand::Run(a) => a.data_dir.as_deref(),
        FedCommand::Serve(a) => a.run.data_dir.as_deref(),
        FedCommand::Clients(a) => a.data_dir.as_deref(),
    }
}

/// Where a federation's outputs go.
fn out_dir(config: &FedConfig, out: Option<&Path>) -> anyhow::Result<PathBuf> {
    let out = out.map(Path::to_path_buf).or_else(|| config.output.dir.clone()).unwrap_or_else(|| PathBuf::from("runs/fed"));
    std::fs::create_dir_all(&out).with_context(|| format!("create output folder {}", out.display()))?;
    Ok(out)
}

fn run_local(args: &FedRunArgs, data_root: &Path, font: Option<&Path>) -> anyhow::Result<()> {
    let config = FedConfig::from_file(&args.config)?;
    let out = out_dir(&config, args.out.as_deref())?;
    let data = FedData::load(data_root, config.population.dataset, config.seed)?;
    let mut run = Run::new(&config, &data)?;
    drive(&config, &out, args.no_progress, font, &format!("{} host(s) on threads", config.round.hosts), |evaluate| {
        let (_, record) = run.round(evaluate)?;
        Ok((record, String::new()))
    })
}

/// Under `[secagg]` with several hosts: warns when one host dying mid-round (its slice of the round
/// gone at once) would likely leave some client short of neighbours, which aborts the round, and
/// names a degree that would not (`rtx_federated::secagg::short_clients_after_loss`).
fn warn_if_secagg_fragile(config: &FedConfig, hosts: usize) -> anyhow::Result<()> {
    let Some(params) = config.secagg_params()? else { return Ok(()) };
    if hosts < 2 {
        return Ok(());
    }
    let k = config.round.clients_per_round;
    let lost = 1.0 / hosts as f64;
    let short = rtx_federated::secagg::short_clients_after_loss(params.degree, params.threshold, k, lost);
    if short >= 0.01 {
        let better = rtx_federated::secagg::degree_for_loss(k, lost, 0.01).map_or_else(|| "more hosts (no degree keeps it below 0.01 at this K)".to_string(), |d| format!("[secagg] degree = {d}, threshold = {}", d / 2 + 1));
        eprintln!(
            "warning: [secagg] degree {} / threshold {}: if one of {hosts} hosts dies mid-round, about {short:.2} surviving clients a round are left short of neighbours and that round cannot be unmasked; to ride out a host loss use {better}",
            params.degree, params.threshold
        );
    }
    Ok(())
}

/// `rtx fed serve`: the coordinator over QUIC.
fn serve(args: &FedServeArgs, data_root: &Path, font: Option<&Path>) -> anyhow::Result<()> {
    let config_toml = std::fs::read_to_string(&args.run.config).with_context(|| format!("read {}", args.run.config.display()))?;
    let config = FedConfig::from_file(&args.run.config)?;
    if config.async_mode.is_some() {
        anyhow::bail!(
            "{}: the asynchronous mode ([async]) runs only in one process (`rtx fed run`); client host processes take synchronous rounds (plain, DP or [secagg])",
            args.run.config.display()
        );
    }
    let out = out_dir(&config, args.run.out.as_deref())?;
    let data = FedData::load(data_root, config.population.dataset, config.seed)?;
    let mut run = Run::new(&config, &data)?;
    let token = match std::env::var(TOKEN_ENV) {
        Ok(token) if !token.is_empty() => token,
        _ => rtx_actors::auth::generate_token().map_err(|e| anyhow::anyhow!(e))?,
    };
    let token_file = out.join("token");
    crate::elastic::write_private(&token_file, &token)?;
    let options = CoordinatorOptions {
        listen: args.listen,
        token,
        round_timeout: Duration::from_secs_f64(args.round_timeout_s.max(0.001)),
        link: rtx_actors::LinkOptions::default(),
        planted_bug: false,
    };
    let mut coordinator = Coordinator::bind(options, config_toml, config.population.n_clients)?;
    let hosts = args.hosts.unwrap_or(config.round.hosts);
    eprintln!(
        "coordinator on {}: waiting for {hosts} client host(s); join with: {TOKEN_ENV}=$(cat {}) rtx fed clients --join <this host>:{} --population-slice A..B",
        coordinator.addr(),
        token_file.display(),
        coordinator.addr().port()
    );
    warn_if_secagg_fragile(&config, hosts)?;
    coordinator.wait_for_hosts(hosts, Duration::from_secs_f64(args.join_timeout_s))?;
    for (name, slice) in coordinator.hosts() {
        eprintln!("client host {name}: clients {}..{}", slice.start, slice.end);
    }
    let result = drive(&config, &out, args.run.no_progress, font, &format!("{hosts} client host process(es) over QUIC"), |evaluate| {
        let mut remote = None;
        let (_, record) = run.round_by(evaluate, |federation| {
            let round = coordinator.round(federation)?;
            let report = round.report.clone();
            remote = Some(round);
            Ok(report)
        })?;
        let hosts = remote.map_or_else(String::new, |r| {
            let mut text = format!(" | hosts: {} answered", r.hosts_done.len());
            if !r.hosts_lost.is_empty() {
                let lost: Vec<String> = r.hosts_lost.iter().map(|(name, why)| format!("{name} ({why})")).collect();
                text.push_str(&format!(", lost {}", lost.join(", ")));
            }
            if !r.hosts_late.is_empty() {
                text.push_str(&format!(", late {}", r.hosts_late.join(", ")));
            }
            text
        });
        Ok((record, hosts))
    });
    coordinator.finish();
    result
}

/// `rtx fed clients`: a client host process.
fn clients(args: &FedClientsArgs, data_root: &Path) -> anyhow::Result<()> {
    let token = match args.token.clone().or_else(|| std::env::var(TOKEN_ENV).ok()) {
        Some(token) if !token.is_empty() => token,
        _ => anyhow::bail!("no token: set {TOKEN_ENV} (or pass --token); `rtx fed serve` wrote it to OUT/token"),
    };
    let join = crate::elastic::resolve_addr(&args.join)?;
    let slice = rtx_federated::config::parse_slice(&args.population_slice, u64::from(u32::MAX))
        .map_err(|reason| anyhow::anyhow!("--population-slice {}: {reason}", args.population_slice))?;
    let name = args.name.clone().unwrap_or_else(|| format!("clients-{}..{}", slice.start, slice.end));
    let options = HostOptions {
        join,
        token,
        slice: slice.clone(),
        name: name.clone(),
        pid: std::process::id(),
        compute_delay: Duration::from_millis(args.compute_delay_ms),
        link: rtx_actors::LinkOptions::default(),
    };
    let (connection, config, _) = HostConnection::join(options)?;
    eprintln!("{name}: joined {join} as host {} with clients {}..{} of {}", connection.host, slice.start, slice.end, config.population.n_clients);
    let data = FedData::load(data_root, config.population.dataset, config.seed)?;
    let mut run = Run::new(&config, &data)?;
    let summary = connection.serve(&mut run.federation)?;
    eprintln!("{name}: federation finished after {} round(s), {} client(s) handled", summary.rounds, summary.clients);
    Ok(())
}

/// Runs `config.round.rounds` rounds with `round` (given whether to evaluate; returns the record
/// and extra text for the progress line), writing metrics.jsonl and accuracy.png under `out`.
fn drive(config: &FedConfig, out: &Path, no_progress: bool, font: Option<&Path>, hosts: &str, mut round: impl FnMut(bool) -> anyhow::Result<(FedRecord, String)>) -> anyhow::Result<()> {
    let rounds = config.round.rounds;
    let verbosity = if no_progress { Verbosity::Lines } else { Verbosity::Auto };
    let progress = Progress::new(verbosity, 0, u64::from(rounds));
    progress.line(&format!(
        "federation: N = {} clients, K = {} a round, {} rounds, {:?} on {:?} ({:?} split), {hosts}, fan-in {}",
        config.population.n_clients, config.round.clients_per_round, rounds, config.strategy.kind, config.population.dataset, config.population.partition, config.round.fan_in,
    ));
    let metrics_path = out.join("metrics.jsonl");
    let mut metrics = std::io::BufWriter::new(std::fs::File::create(&metrics_path).with_context(|| format!("create {}", metrics_path.display()))?);
    let mut records = Vec::new();
    for r in 0..rounds {
        let evaluate = (r + 1) % config.round.eval_every == 0 || r + 1 == rounds;
        let (record, extra) = round(evaluate)?;
        serde_json::to_writer(&mut metrics, &record)?;
        metrics.write_all(b"\n")?;
        metrics.flush()?;
        let acc = record.test_acc.map_or_else(|| "-".to_string(), |a| format!("{a:.4}"));
        let eps = record.epsilon.map_or_else(String::new, |e| format!(" | epsilon {e:.3}"));
        let text = format!(
            "round {}/{rounds}: clients done {} dropped {} stragglers {} rejected {} | test acc {acc}{eps} | {:.2} s{extra}",
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
