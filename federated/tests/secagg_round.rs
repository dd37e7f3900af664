//! Secure aggregation inside federation rounds (`[secagg]`), on the digits fixture (logistic
//! regression 64 -> 10, 650 parameters): the secure round's unmasked sum is bit for bit the plain
//! fixed-point sum of the sampled clients and its model the plain round's within the quantisation
//! bound; dropouts at each protocol phase lose only those clients; too few survivors leave the model
//! unchanged with a typed outcome and later rounds still run; the model bits do not depend on threads
//! or hosts; `[dp]` composes; bad `[secagg]` values
//! and `[secagg]` with `[async]` are config errors naming the key.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use rtx_federated::dp::ClientDp;
use rtx_federated::round::encoding_for;
use rtx_federated::{
    ClientTask, FedConfig, FedData, FedError, Federation, LocalTrainer, LogReg, LogRegSgd, Plain, Population, RoundReport, SecAggAbort, UpdateTransform,
};
use rtx_tensor::data::{load_digits_csv, train_val_split};

/// The seed of a randomized test: `RTX_TEST_SEED` if set (to replay a failure), else `default`.
fn test_seed(default: u64) -> u64 {
    let seed = std::env::var("RTX_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(default);
    eprintln!("seed {seed} (replay with RTX_TEST_SEED={seed})");
    seed
}

fn digits() -> FedData {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tensor/tests/fixtures/digits.csv.gz");
    let all = load_digits_csv(&path).unwrap();
    let (train, test) = train_val_split(all.n, 0.2, 0).unwrap();
    FedData { train: all.subset(&train), test: all.subset(&test) }
}

fn config_text(seed: u64, n: u64, k: u64, rounds: u32, extra: &str) -> String {
    format!("seed = {seed}\n[population]\nn_clients = {n}\ndataset = \"digits\"\n[round]\nrounds = {rounds}\nclients_per_round = {k}\nfan_in = 4\n{extra}")
}

fn config(seed: u64, n: u64, k: u64, rounds: u32, extra: &str) -> FedConfig {
    FedConfig::from_toml_str(&config_text(seed, n, k, rounds, extra)).unwrap()
}

fn shape(data: &FedData) -> LogReg {
    LogReg { n_features: data.n_features(), n_classes: data.n_classes() }
}

fn trainer<'d>(config: &FedConfig, data: &'d FedData) -> LogRegSgd<'d> {
    let l = &config.local;
    LogRegSgd::new(shape(data), &data.train, l.lr, l.batch_size, l.epochs, config.strategy.mu, l.shuffle)
}

fn federation<'d, X: UpdateTransform>(config: &FedConfig, data: &'d FedData, transform: X) -> Federation<'d, LogRegSgd<'d>, X> {
    let pop = Population::new(&config.population, config.seed, &data.train.labels).unwrap();
    Federation::new(config.clone(), pop, trainer(config, data), transform, vec![0.0; shape(data).n_params()]).unwrap()
}

/// Runs every round of `config`; returns the reports and the final model.
fn run<X: UpdateTransform>(config: &FedConfig, data: &FedData, transform: X) -> (Vec<RoundReport>, Vec<f32>) {
    let mut fed = federation(config, data, transform);
    let reports = (0..config.round.rounds).map(|_| fed.run_round().unwrap()).collect();
    (reports, fed.model().to_vec())
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// The largest error quantisation can put into one coordinate of the round's mean update: each
/// included client's coordinate is off by at most half a grid step, scaled back by `max_weight`,
/// over the total weight; plus 1e-6 for the plain round's own f32 summation.
fn quantisation_bound(report: &RoundReport, max_weight: f32) -> f32 {
    let secure = report.secure.as_ref().unwrap();
    let grid = 0.5 / (1u64 << secure.scale_bits) as f64;
    (grid * f64::from(max_weight) * secure.included as f64 / report.total_weight) as f32 + 1e-6
}

#[test]
fn a_secure_round_sums_exactly_what_the_plain_round_sums() {
    // Goal: (1) the unmasked sum equals, word for word, the plain fixed-point sum of the sampled
    // clients' encoded updates (trained here independently); (2) the secure model equals the plain
    // round's within the quantisation bound, after one round and (looser) after three.
    let seed = test_seed(5);
    let data = digits();
    let secure_cfg = config(seed, 200, 40, 3, "[secagg]\n");
    let plain_cfg = config(seed, 200, 40, 3, "");
    let mut fed = federation(&secure_cfg, &data, Plain);
    let sampled = fed.sample(0);
    let report = fed.run_round().unwrap();
    let secure = report.secure.clone().unwrap();
    assert_eq!(secure.aborted, None);
    assert_eq!((report.clients_done, report.dropped, report.stragglers, report.rejected), (40, 0, 0, 0), "{report:?}");
    assert_eq!((secure.degree, secure.threshold), (16, 9), "defaults: recommended degree for K = 40, t = k/2 + 1");
    assert_eq!(report.total_weight, 320.0, "40 clients x 8 images, exactly");

    // (1) The plain fixed-point sum, computed outside the protocol.
    let pop = Population::new(&secure_cfg.population, seed, &data.train.labels).unwrap();
    let encoding = encoding_for(&secure_cfg, &pop).unwrap().unwrap();
    assert_eq!(encoding.max_weight, 8.0);
    let local = trainer(&secure_cfg, &data);
    let zeros = vec![0.0; local.n_params()];
    let (mut scratch, mut update, mut indices, mut words) = (local.scratch(), Vec::new(), Vec::new(), Vec::new());
    let mut plain_fixed = vec![0u32; zeros.len() + 2];
    for &c in &sampled {
        pop.indices_into(c, &mut indices);
        let weight = local.train(&ClientTask { client: c, round: 0, seed, indices: &indices }, &zeros, &mut scratch, &mut update);
        encoding.encode(&update, weight, &mut words);
        for (s, w) in plain_fixed.iter_mut().zip(&words) {
            *s = s.wrapping_add(*w);
        }
    }
    assert_eq!(secure.sum_fixed, plain_fixed, "the unmasked sum is the plain fixed-point sum, bit for bit");

    // (2) The model against the plain round's.
    let mut plain = federation(&plain_cfg, &data, Plain);
    let plain_report = plain.run_round().unwrap();
    assert_eq!(plain_report.clients_done, 40);
    let bound = quantisation_bound(&report, encoding.max_weight);
    let diff = max_abs_diff(fed.model(), plain.model());
    eprintln!("round 1: max |secure - plain| = {diff:e}, bound {bound:e}");
    assert!(diff <= bound, "{diff} > {bound}");
    for _ in 1..3 {
        fed.run_round().unwrap();
        plain.run_round().unwrap();
    }
    let diff = max_abs_diff(fed.model(), plain.model());
    assert!(diff <= 1e-4, "after 3 rounds: {diff}");
    let acc = |m: &[f32]| shape(&data).evaluate(m, &data.test).accuracy;
    assert!((acc(fed.model()) - acc(plain.model())).abs() <= 0.01, "{} vs {}", acc(fed.model()), acc(plain.model()));
}

#[test]
fn the_secure_model_is_bit_equal_for_any_thread_and_host_count() {
    // Goal: the secure round keeps the federation's invariant: same seed, same model bits, whatever
    // the threads and hosts (modular sums; messages to the server in id order).
    let seed = test_seed(21);
    let data = digits();
    let extra = "[faults]\ndropout_rate = 0.05\n[secagg]\n";
    let (_, one) = run(&config(seed, 200, 40, 2, &format!("threads = 1\n{extra}")), &data, Plain);
    let (_, three) = run(&config(seed, 200, 40, 2, &format!("threads = 3\nhosts = 2\n{extra}")), &data, Plain);
    assert!(one.iter().zip(&three).all(|(a, b)| a.to_bits() == b.to_bits()), "1 thread vs 3 threads and 2 hosts");
}

#[test]
fn dropouts_at_every_phase_lose_only_those_clients() {
    // Goal: dropouts (vanish after advertising keys), stragglers (vanish after sharing them) and
    // late dropouts (vanish after their masked input) in the same rounds: each round completes, the
    // first two lose exactly their clients' updates (the same ones a plain round loses), the third
    // loses none, and the model equals the plain run's over the same survivors.
    let seed = test_seed(9);
    let data = digits();
    let faults = "[faults]\ndropout_rate = 0.08\ndeadline_ms = 200.0\n";
    let secure_cfg = config(seed, 300, 60, 2, &format!("{faults}[secagg]\ndegree = 40\nthreshold = 21\nunmask_dropout_rate = 0.08\n"));
    let plain_cfg = config(seed, 300, 60, 2, faults);
    let (secure_reports, secure_model) = run(&secure_cfg, &data, Plain);
    let (plain_reports, plain_model) = run(&plain_cfg, &data, Plain);
    let (mut dropped, mut stragglers, mut late) = (0, 0, 0);
    for (s, p) in secure_reports.iter().zip(&plain_reports) {
        let secure = s.secure.as_ref().unwrap();
        assert_eq!(secure.aborted, None, "{s:?}");
        assert_eq!((s.clients_done, s.dropped, s.stragglers, s.rejected), (p.clients_done, p.dropped, p.stragglers, p.rejected), "round {}", s.round);
        assert_eq!(secure.included, s.clients_done, "late dropouts stay in the sum");
        assert_eq!(s.total_weight, p.total_weight);
        dropped += s.dropped;
        stragglers += s.stragglers;
        late += secure.gone_before_unmask;
    }
    eprintln!("over 2 rounds: {dropped} dropped after keys, {stragglers} stragglers after shares, {late} gone before unmask");
    assert!(dropped > 0 && stragglers > 0 && late > 0, "every phase must see a dropout");
    let diff = max_abs_diff(&secure_model, &plain_model);
    assert!(diff <= 1e-5, "max |secure - plain| = {diff}");
}

#[test]
fn too_few_survivors_leave_the_model_unchanged_and_later_rounds_run() {
    // Goal: when the sum cannot be unmasked the round reports a typed abort, the model and the
    // participation record stay as they were, and the federation goes on. (1) 75% of the clients
    // vanish before unmasking in every round: too few self-mask seed shares, every round. (2) A host
    // holding 70% of the population is down in round 0 only: round 0 aborts, round 1 trains.
    let seed = test_seed(13);
    let data = digits();
    let cfg = config(seed, 200, 40, 2, "[secagg]\nunmask_dropout_rate = 0.75\n");
    let mut fed = federation(&cfg, &data, Plain);
    for round in 0..2 {
        let report = fed.run_round().unwrap();
        let secure = report.secure.as_ref().unwrap();
        assert!(matches!(secure.aborted, Some(SecAggAbort::TooFewShares { secret: "self-mask seed", .. })), "round {round}: {:?}", secure.aborted);
        assert_eq!((report.clients_done, report.total_weight), (0, 0.0));
        assert!(secure.sum_fixed.is_empty());
        assert!(fed.model().iter().all(|&w| w == 0.0), "the model is unchanged");
        assert!(fed.sample(round).iter().all(|&c| fed.population().last_round(c).is_none()));
    }

    let cfg = config(seed, 200, 40, 2, "hosts = 2\nhost_slices = [\"0..140\", \"140..200\"]\n[[faults.host_down]]\nhost = 0\nround = 0\n[secagg]\n");
    let mut fed = federation(&cfg, &data, Plain);
    let first = fed.run_round().unwrap();
    let abort = first.secure.as_ref().unwrap().aborted.clone();
    eprintln!("round 0 with host 0 down: {:?} ({} of 40 dropped)", abort, first.dropped);
    assert!(matches!(abort, Some(SecAggAbort::TooFewClients { .. } | SecAggAbort::TooFewShares { .. })), "{abort:?}");
    assert!(fed.model().iter().all(|&w| w == 0.0));
    let second = fed.run_round().unwrap();
    assert_eq!(second.secure.as_ref().unwrap().aborted, None);
    assert_eq!(second.clients_done, 40);
    assert!(fed.model().iter().any(|&w| w != 0.0), "round 1 moved the model");
}

#[test]
fn dp_and_secure_aggregation_compose() {
    // Goal: `[dp]` with `[secagg]`: clipping on the client before encoding, unit weights (default
    // max_weight 1), noise added to the unmasked sum, division by the fixed K; the model equals the
    // plain DP round's (same noise stream) within the quantisation bound, and epsilon is reported.
    let seed = test_seed(17);
    let data = digits();
    let dp = "[dp]\nclip_norm = 1.0\nnoise_multiplier = 0.5\n";
    let secure_cfg = config(seed, 200, 40, 3, &format!("{dp}[secagg]\n"));
    let plain_cfg = config(seed, 200, 40, 3, dp);
    let transform = |c: &FedConfig| ClientDp::new(c.dp_config().unwrap().unwrap(), c.seed);
    let (secure_reports, secure_model) = run(&secure_cfg, &data, transform(&secure_cfg));
    let (_, plain_model) = run(&plain_cfg, &data, transform(&plain_cfg));
    for r in &secure_reports {
        let secure = r.secure.as_ref().unwrap();
        assert_eq!(secure.aborted, None);
        assert_eq!(r.total_weight, 40.0, "DP divides by the fixed K");
        assert_eq!(secure.sum_fixed[secure.sum_fixed.len() - 2..], [40u32 << secure.weight_bits, 40], "40 unit weights, 40 clients with data");
    }
    let diff = max_abs_diff(&secure_model, &plain_model);
    assert!(diff <= 1e-4, "max |secure DP - plain DP| = {diff}");
    let eps: Vec<f64> = secure_cfg.dp_config().unwrap().unwrap().epsilon_per_round(3).unwrap().iter().map(|e| e.epsilon).collect();
    assert!(eps[0] > 0.0 && eps.windows(2).all(|w| w[1] > w[0]), "{eps:?}");
    let start = shape(&data).evaluate(&vec![0.0; shape(&data).n_params()], &data.test).accuracy;
    let end = shape(&data).evaluate(&secure_model, &data.test).accuracy;
    eprintln!("test accuracy {start} -> {end} after 3 DP + SecAgg rounds");
    assert!(end > start + 0.1, "DP + SecAgg still learns: {start} -> {end}");
}

#[test]
fn bad_secagg_configs_are_refused_naming_the_key() {
    let base = |extra: &str| config_text(1, 200, 40, 1, extra);
    let field_of = |text: String| match FedConfig::from_toml_str(&text) {
        Err(FedError::Config { field, reason }) => (field, reason),
        other => panic!("expected a config error for {text}, got {other:?}"),
    };
    let cases = [
        ("[secagg]\ndegree = 7\n", "secagg.degree"),
        ("[secagg]\ndegree = 0\n", "secagg.degree"),
        ("[secagg]\ndegree = 8\nthreshold = 4\n", "secagg.threshold"),
        ("[secagg]\ndegree = 8\nthreshold = 9\n", "secagg.threshold"),
        ("[secagg]\ndegree = 80\nthreshold = 41\n", "secagg.threshold"),
        ("[secagg]\nclip = 0.0\n", "secagg.clip"),
        ("[secagg]\nclip = -1.0\n", "secagg.clip"),
        ("[secagg]\nclip = 1e9\n", "secagg.clip"),
        ("[secagg]\nscale_bits = 31\n", "secagg.scale_bits"),
        ("[secagg]\nscale_bits = 30\n", "secagg.scale_bits"),
        ("[secagg]\nmax_weight = 0.0\n", "secagg.max_weight"),
        ("[secagg]\nmax_weight = 1e9\n", "secagg.max_weight"),
        ("[secagg]\nunmask_dropout_rate = 1.5\n", "secagg.unmask_dropout_rate"),
    ];
    for (extra, key) in cases {
        let (field, reason) = field_of(base(extra));
        assert_eq!(field, key, "{extra}: {reason}");
    }
    let (field, reason) = field_of(base("[secagg]\n[async]\nbuffer_size = 10\nmax_staleness = 2\nconcurrency = 20\n"));
    assert_eq!(field, "secagg");
    assert!(reason.contains("FedBuff") && reason.contains("out of scope"), "{reason}");
    let err = FedConfig::from_toml_str(&base("[secagg]\nneighbours = 8\n")).unwrap_err();
    assert!(matches!(err, FedError::ConfigFile { .. }), "unknown keys are refused: {err}");
    // Defaults resolve from K (and from [dp]).
    let params = FedConfig::from_toml_str(&base("[secagg]\n")).unwrap().secagg_params().unwrap().unwrap();
    assert_eq!((params.degree, params.threshold, params.quant.clip, params.quant.scale_bits), (16, 9, 1.0, 25));
    let params = FedConfig::from_toml_str(&base("[dp]\nclip_norm = 0.5\nnoise_multiplier = 1.0\n[secagg]\ndegree = 10\n")).unwrap();
    let params = params.secagg_params().unwrap().unwrap();
    assert_eq!((params.degree, params.threshold, params.quant.clip), (10, 6, 0.5));
}
