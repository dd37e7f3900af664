//! Whole federations in one process on real data (the digits fixture, and Fashion-MNIST for the
//! reference workload): bit-equal models for any host and thread count, dropouts, stragglers,
//! host failures, availability traces, malformed updates, every strategy and the FedBuff mode.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use rtx_federated::config::{AsyncConfig, HostDown, StalenessWeighting, StrategyKind};
use rtx_federated::dp::{ClientDp, DpConfig};
use rtx_federated::{ClientTask, FedConfig, FedData, Federation, LocalTrainer, LogReg, LogRegSgd, Plain, Population, RoundReport};
use rtx_tensor::data::{load_digits_csv, train_val_split, Split};

fn digits() -> FedData {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tensor/tests/fixtures/digits.csv.gz");
    let all = load_digits_csv(&path).unwrap();
    let (train, test) = train_val_split(all.n, 0.2, 0).unwrap();
    FedData { train: all.subset(&train), test: all.subset(&test) }
}

fn data_root() -> PathBuf {
    std::env::var_os("RTX_DATA_DIR").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../data"), PathBuf::from)
}

fn config(n: u64, k: u64, rounds: u32, extra: &str) -> FedConfig {
    let text =
        format!("seed = 7\n[population]\nn_clients = {n}\ndataset = \"digits\"\n[round]\nrounds = {rounds}\nclients_per_round = {k}\nfan_in = 4\n{extra}");
    FedConfig::from_toml_str(&text).unwrap()
}

fn shape(data: &FedData) -> LogReg {
    LogReg { n_features: data.n_features(), n_classes: data.n_classes() }
}

/// Runs every round of `config` on `data`; returns the reports and the final model.
fn run(config: &FedConfig, data: &FedData) -> (Vec<RoundReport>, Vec<f32>) {
    let shape = shape(data);
    let pop = Population::new(&config.population, config.seed, &data.train.labels).unwrap();
    let l = &config.local;
    let trainer = LogRegSgd::new(shape, &data.train, l.lr, l.batch_size, l.epochs, config.strategy.mu, l.shuffle);
    run_with(config, pop, trainer, shape)
}

fn run_with<T: LocalTrainer>(config: &FedConfig, pop: Population, trainer: T, shape: LogReg) -> (Vec<RoundReport>, Vec<f32>) {
    let mut fed = Federation::new(config.clone(), pop, trainer, Plain, vec![0.0; shape.n_params()]).unwrap();
    let reports = (0..config.round.rounds).map(|_| fed.run_round().unwrap()).collect();
    (reports, fed.model().to_vec())
}

fn bits(model: &[f32]) -> Vec<u32> {
    model.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn the_global_model_is_bit_equal_for_1_2_4_hosts_and_any_thread_count() {
    let data = digits();
    let base = "[local]\nepochs = 2\nbatch_size = 4\nshuffle = true\n[faults]\ndropout_rate = 0.1\n";
    let one = config(300, 90, 3, &format!("hosts = 1\nthreads = 1\n{base}"));
    let two = config(300, 90, 3, &format!("hosts = 2\nthreads = 2\n{base}"));
    let four = config(300, 90, 3, &format!("hosts = 4\nthreads = 3\nhost_slices = [\"0..10\", \"10..150\", \"150..299\", \"299..300\"]\n{base}"));
    let (r1, m1) = run(&one, &data);
    let (r2, m2) = run(&two, &data);
    let (r4, m4) = run(&four, &data);
    assert_eq!(bits(&m1), bits(&m2), "1 vs 2 hosts");
    assert_eq!(bits(&m1), bits(&m4), "1 vs 4 hosts");
    let counts = |r: &[RoundReport]| r.iter().map(|x| (x.clients_done, x.dropped)).collect::<Vec<_>>();
    assert_eq!(counts(&r1), counts(&r2));
    assert_eq!(counts(&r1), counts(&r4));
    assert!(r1.iter().all(|r| r.dropped > 0 && r.clients_done + r.dropped == 90), "{r1:?}");
    let mut other = one.clone();
    other.seed = 8;
    let (_, m_other) = run(&other, &data);
    assert_ne!(bits(&m1), bits(&m_other), "another seed samples other clients");
}

#[test]
fn federated_training_learns_digits_with_every_strategy() {
    let data = digits();
    let shape = shape(&data);
    let start = shape.evaluate(&vec![0.0; shape.n_params()], &data.test).accuracy;
    for (kind, extra) in [
        (StrategyKind::Fedavg, ""),
        (StrategyKind::Fedprox, "mu = 0.1\n"),
        (StrategyKind::Fedadam, "eta = 0.02\n"),
        (StrategyKind::Fedyogi, "eta = 0.02\n"),
        (StrategyKind::Fedadagrad, "eta = 0.05\n"),
    ] {
        let name = format!("{kind:?}").to_lowercase();
        let cfg = config(200, 50, 8, &format!("[local]\nepochs = 2\nbatch_size = 4\n[strategy]\nkind = \"{name}\"\n{extra}"));
        assert_eq!(cfg.strategy.kind, kind);
        let (_, model) = run(&cfg, &data);
        let acc = shape.evaluate(&model, &data.test).accuracy;
        assert!(acc > 0.7 && acc > start + 0.5, "{kind:?}: accuracy {start} -> {acc}");
    }
}

#[test]
fn stragglers_dropouts_and_a_dead_host_lose_updates_not_rounds() {
    let data = digits();
    // Deadline at the median latency: about half the sampled clients are cut every round.
    let cfg = config(400, 200, 3, "hosts = 2\n[faults]\ndeadline_ms = 100.0\nlatency_median_ms = 100.0\n[[faults.host_down]]\nhost = 1\nround = 1\n");
    let (reports, model) = run(&cfg, &data);
    for r in &reports {
        assert_eq!(r.clients_done + r.dropped + r.stragglers, 200, "{r:?}");
    }
    for r in [&reports[0], &reports[2]] {
        assert!((60..140).contains(&r.stragglers), "{r:?}");
    }
    // Round 1: every sampled client of host 1 (clients 200..400) is lost with its host.
    let fed = Federation::new(
        cfg.clone(),
        Population::new(&cfg.population, cfg.seed, &data.train.labels).unwrap(),
        LogRegSgd::new(shape(&data), &data.train, 0.1, 8, 1, 0.0, false),
        Plain,
        vec![0.0; shape(&data).n_params()],
    )
    .unwrap();
    let on_host1 = fed.sample(1).iter().filter(|&&c| c >= 200).count() as u64;
    assert!(on_host1 > 50 && reports[1].dropped == on_host1, "{on_host1} on host 1, {:?}", reports[1]);
    assert_eq!(reports[0].dropped, 0);
    assert!(shape(&data).evaluate(&model, &data.test).accuracy > 0.5);
}

#[test]
fn everyone_dropping_leaves_the_model_unchanged() {
    let data = digits();
    let (reports, model) = run(&config(50, 20, 2, "[faults]\ndropout_rate = 1.0\n"), &data);
    assert!(reports.iter().all(|r| r.dropped == 20 && r.clients_done == 0 && r.total_weight == 0.0));
    assert!(model.iter().all(|&v| v == 0.0));
}

#[test]
fn an_availability_trace_keeps_offline_clients_out() {
    let data = digits();
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.txt");
    // Clients 0..40 are online only in round 0 (t = 0); round r starts at r * 60 s.
    let lines: String = (0..40).map(|c| format!("{c} 0 30\n")).collect();
    std::fs::write(&trace, lines).unwrap();
    let cfg = config(50, 20, 2, &format!("[faults]\navailability_trace = {:?}\n", trace.display().to_string()));
    let shape = shape(&data);
    let pop = Population::new(&cfg.population, cfg.seed, &data.train.labels).unwrap();
    let mut fed = Federation::new(cfg.clone(), pop, LogRegSgd::new(shape, &data.train, 0.1, 8, 1, 0.0, false), Plain, vec![0.0; shape.n_params()]).unwrap();
    assert!(fed.sample(0).iter().any(|&c| c < 40), "round 0 may pick any client");
    assert_eq!(fed.sample(1), (40..50).collect::<Vec<u32>>(), "round 1: only the 10 online clients");
    fed.run_round().unwrap();
    let second = fed.run_round().unwrap();
    assert_eq!((second.sampled, second.clients_done), (10, 10));
    assert_eq!(fed.population().last_round(45), Some(1));
    // A broken trace is a typed error naming the file and line.
    std::fs::write(&trace, "1 0 10\n77 0 10\n").unwrap();
    let pop = Population::new(&cfg.population, cfg.seed, &data.train.labels).unwrap();
    let err = Federation::new(cfg, pop, LogRegSgd::new(shape, &data.train, 0.1, 8, 1, 0.0, false), Plain, vec![0.0; shape.n_params()]).err().unwrap();
    assert!(err.to_string().contains("trace.txt:2") && err.to_string().contains("out of range"), "{err}");
}

/// Real local training, but some clients send garbage: NaN, a wrong length, an infinite weight.
struct Faulty<'d>(LogRegSgd<'d>);

impl LocalTrainer for Faulty<'_> {
    type Scratch = <LogRegSgd<'static> as LocalTrainer>::Scratch;
    fn scratch(&self) -> Self::Scratch {
        self.0.scratch()
    }
    fn n_params(&self) -> usize {
        self.0.n_params()
    }
    fn train(&self, task: &ClientTask<'_>, global: &[f32], scratch: &mut Self::Scratch, update: &mut Vec<f32>) -> f32 {
        let weight = self.0.train(task, global, scratch, update);
        match task.client % 10 {
            0 => update[3] = f32::NAN,
            1 => update.truncate(7),
            2 => return f32::INFINITY,
            3 => update.push(0.0),
            _ => {}
        }
        weight
    }
}

#[test]
fn malformed_updates_are_rejected_and_counted_and_the_round_goes_on() {
    let data = digits();
    let cfg = config(100, 100, 3, "[local]\nepochs = 5\nbatch_size = 4\n");
    let shape = shape(&data);
    let start = shape.evaluate(&vec![0.0; shape.n_params()], &data.test).accuracy;
    let pop = Population::new(&cfg.population, cfg.seed, &data.train.labels).unwrap();
    let faulty = Faulty(LogRegSgd::new(shape, &data.train, 0.1, 4, 5, 0.0, false));
    let (reports, model) = run_with(&cfg, pop, faulty, shape);
    for r in &reports {
        assert_eq!((r.rejected, r.clients_done), (40, 60), "{r:?}");
    }
    assert!(model.iter().all(|v| v.is_finite()));
    let acc = shape.evaluate(&model, &data.test).accuracy;
    assert!(acc > start + 0.3, "accuracy {start} -> {acc}");
}

#[test]
fn fedbuff_learns_rejects_stale_updates_and_replays_bit_for_bit() {
    let data = digits();
    let mut cfg = config(300, 10, 12, "threads = 1\n[faults]\ndropout_rate = 0.05\n");
    cfg.async_mode = Some(AsyncConfig { buffer_size: 10, max_staleness: 2, concurrency: 40, staleness: StalenessWeighting::Polynomial, server_lr: 1.0 });
    let (reports, model) = run(&cfg, &data);
    let accepted: u64 = reports.iter().map(|r| r.clients_done).sum();
    let stale: u64 = reports.iter().map(|r| r.rejected).sum();
    let dropped: u64 = reports.iter().map(|r| r.dropped).sum();
    assert_eq!(accepted, 120, "{reports:?}");
    assert!(stale > 0, "concurrency 40 over buffers of 10 with max staleness 2 must reject some: {reports:?}");
    assert!(dropped > 0, "{reports:?}");
    let acc = shape(&data).evaluate(&model, &data.test).accuracy;
    assert!(acc > 0.6, "fedbuff accuracy {acc}");
    let mut threaded = cfg.clone();
    threaded.round.threads = 3;
    let (again, model_again) = run(&threaded, &data);
    assert_eq!(bits(&model), bits(&model_again));
    assert_eq!(reports.iter().map(|r| r.rejected).collect::<Vec<_>>(), again.iter().map(|r| r.rejected).collect::<Vec<_>>());
}

#[test]
fn the_reference_workload_matches_flowers_accuracies() {
    let root = data_root();
    let data = FedData::load(&root, rtx_federated::config::DatasetKind::FashionMnist, 42).unwrap();
    assert_eq!((data.train.n, data.test.n), (60_000, 10_000), "{:?}", Split::Train);
    let cfg = FedConfig::from_file(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../configs/fed_flower_ref.toml")).unwrap();
    let (_, shape) = (0, shape(&data));
    let pop = Population::new(&cfg.population, cfg.seed, &data.train.labels).unwrap();
    let l = &cfg.local;
    let trainer = LogRegSgd::new(shape, &data.train, l.lr, l.batch_size, l.epochs, 0.0, l.shuffle);
    let mut fed = Federation::new(cfg.clone(), pop, trainer, Plain, vec![0.0; shape.n_params()]).unwrap();
    // Flower 1.42, same workload (issue 15).
    let flower = [0.3432, 0.6259, 0.6439, 0.6486, 0.6516];
    for (round, want) in flower.iter().enumerate() {
        let report = fed.run_round().unwrap();
        assert_eq!(report.clients_done, 1000);
        let acc = shape.evaluate(fed.model(), &data.test).accuracy;
        assert!((acc - want).abs() <= 0.005, "round {}: {acc} vs Flower {want}", round + 1);
    }
    let _ = HostDown { host: 0, round: 0 };
}

#[test]
fn a_round_holds_o_of_fan_in_partial_sums_not_o_of_k() {
    let data = digits();
    for threads in [1, 2, 4] {
        let cfg = config(4000, 4000, 1, &format!("threads = {threads}\n"));
        let (reports, _) = run(&cfg, &data);
        let depth = 6; // 4^6 = 4096 >= K
        let bound = threads * depth * 4;
        let peak = reports[0].peak_partials;
        assert!(peak >= 1 && peak <= bound, "threads {threads}: {peak} partial sums alive, bound {bound} (K/fan_in = 1000)");
        println!("threads {threads}: peak {peak} partial sums (bound {bound})");
    }
}

#[test]
fn client_level_dp_in_the_round_clips_noises_and_replays_by_seed() {
    // Goal: DP-FedAvg runs inside a round (the `UpdateTransform` hook): clipped, unweighted
    // updates, Gaussian noise on the sum, division by the fixed K; the noise is seeded, so a run
    // replays bit for bit on other host/thread counts, and moderate noise still learns.
    // Method: digits, 200 clients, 50 a round, 8 rounds; z = 0 with a huge clip norm equals plain
    // FedAvg (every client holds the same number of images, so weights cancel); z = 0.5 learns and
    // replays; a tiny clip norm stalls learning (clipping is real).
    let data = digits();
    let shape = shape(&data);
    let base = "[local]\nepochs = 2\nbatch_size = 4\n";
    let run_dp = |cfg: &FedConfig, dp: DpConfig| {
        let pop = Population::new(&cfg.population, cfg.seed, &data.train.labels).unwrap();
        let l = &cfg.local;
        let trainer = LogRegSgd::new(shape, &data.train, l.lr, l.batch_size, l.epochs, cfg.strategy.mu, l.shuffle);
        let mut fed = Federation::new(cfg.clone(), pop, trainer, ClientDp::new(dp, cfg.seed), vec![0.0; shape.n_params()]).unwrap();
        for _ in 0..cfg.round.rounds {
            fed.run_round().unwrap();
        }
        fed.model().to_vec()
    };
    let cfg = config(200, 50, 8, &format!("threads = 1\n{base}"));
    let (_, plain) = run(&cfg, &data);
    let no_noise = run_dp(&cfg, DpConfig::new(1e9, 0.0, 50, 200, 1e-5).unwrap());
    let diff = plain.iter().zip(&no_noise).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(diff < 1e-5, "z = 0, no clipping: DP-FedAvg differs from FedAvg by {diff}");

    let dp = DpConfig::new(1.0, 0.5, 50, 200, 1e-5).unwrap();
    let noised = run_dp(&cfg, dp);
    let again = run_dp(&config(200, 50, 8, &format!("hosts = 2\nthreads = 2\n{base}")), dp);
    assert_eq!(bits(&noised), bits(&again), "the noised model depends on hosts or threads");
    assert_ne!(bits(&noised), bits(&no_noise));
    let start = shape.evaluate(&vec![0.0; shape.n_params()], &data.test).accuracy;
    let acc = shape.evaluate(&noised, &data.test).accuracy;
    assert!(acc > start + 0.3, "z = 0.5, C = 1: accuracy {start} -> {acc}");
    let eps = dp.epsilon_per_round(8).unwrap();
    assert!(eps.windows(2).all(|w| w[1].epsilon > w[0].epsilon) && eps[7].epsilon.is_finite(), "{eps:?}");

    let clipped = run_dp(&cfg, DpConfig::new(1e-4, 0.0, 50, 200, 1e-5).unwrap());
    let moved = clipped.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
    assert!(moved <= 8.0 * 1e-4 * 1.0001, "8 rounds of updates clipped to 1e-4 moved the model by {moved}");
}
