//! Client-level DP: the RDP accountant against reference numbers from Google's dp-accounting, exact
//! clipping, seeded reproducible noise of the right scale, and typed errors for bad parameters.
#![allow(clippy::unwrap_used)]

use rand::SeedableRng;
use rand_chacha::ChaCha20Rng;
use rtx_federated::dp::{clip_update, rdp_poisson_gaussian, DpConfig, RdpAccountant};
use rtx_federated::FedError;

fn assert_rel(got: f64, want: f64, rel: f64, what: &str) {
    assert!((got - want).abs() <= rel * want.abs(), "{what}: got {got:e}, reference {want:e}");
}

#[test]
fn rdp_matches_dp_accounting_at_integer_and_fractional_orders() {
    // Goal: the log-space series reproduce the reference RDP values.
    // Source: dp-accounting 0.6.0 (PyPI), rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian,
    // printed by scripts/dp_reference.py on 2026-12-02.
    let reference = [
        (0.01, 1.1, 1.5, 9.858756968009191e-05),
        (0.01, 1.1, 2.0, 0.00012851008160516542),
        (0.01, 1.1, 2.5, 0.00016215219755506363),
        (0.01, 1.1, 10.5, 0.00096727134933067),
        (0.01, 1.1, 32.0, 8.469416433675926),
        (0.01, 1.1, 256.0, 101.1618942900286),
        (0.1, 0.8, 3.0, 0.09505853907615289),
        (0.1, 0.8, 7.3, 3.0356068149887188),
        (0.1, 0.8, 64.0, 47.66086593727589),
        (0.001, 4.0, 2.0, 6.449445683764463e-08),
        (0.001, 4.0, 1.2, 3.9081326442274325e-08),
        (0.001, 4.0, 1024.0, 25.0854922720648),
    ];
    for (q, z, order, want) in reference {
        assert_rel(rdp_poisson_gaussian(q, z, order), want, 1e-9, &format!("rdp q {q} z {z} order {order}"));
    }
    // Where the fractional series does not converge, dp-accounting excludes the order (infinity).
    assert_eq!(rdp_poisson_gaussian(0.1, 0.8, 1.5), f64::INFINITY);
    // Edge cases: no sampling costs nothing; full sampling is the plain Gaussian a / (2 z^2).
    assert_eq!(rdp_poisson_gaussian(0.0, 1.0, 8.0), 0.0);
    assert_eq!(rdp_poisson_gaussian(1.0, 2.0, 8.0), 1.0);
}

#[test]
fn epsilon_matches_dp_accounting() {
    // Goal: composition plus the Balle et al. 2020 conversion give the reference epsilon and order.
    // Source: dp-accounting 0.6.0 RdpAccountant (default orders) with
    // PoissonSampledDpEvent(q, GaussianDpEvent(z)) composed `steps` times, get_epsilon_and_optimal_order,
    // printed by scripts/dp_reference.py on 2026-12-02.
    let reference = [
        (0.01, 1.1, 100, 1e-5, 0.9560911044993916, 10.7),
        (0.1, 1.0, 50, 1e-6, 6.729892818589203, 3.8),
        (0.001, 0.7, 1000, 1e-5, 1.6531905373619535, 6.6),
        (0.01, 5.0, 1, 1e-5, 0.04488049434107447, 128.0),
    ];
    for (q, z, steps, delta, want_eps, want_order) in reference {
        let mut accountant = RdpAccountant::new();
        accountant.compose_poisson_gaussian(q, z, steps).unwrap();
        let (eps, order) = accountant.epsilon(delta).unwrap();
        assert_rel(eps, want_eps, 1e-9, &format!("epsilon q {q} z {z} steps {steps}"));
        assert!((order - want_order).abs() < 1e-9, "order {order} vs {want_order}");
    }
}

#[test]
fn epsilon_per_round_grows_and_matches_one_shot_composition() {
    // Goal: the per-round report is monotone and its last entry equals composing all rounds at once.
    let dp = DpConfig::new(1.0, 1.1, 100, 10_000, 1e-5).unwrap();
    let per_round = dp.epsilon_per_round(100).unwrap();
    assert_eq!(per_round.len(), 100);
    assert!(per_round.windows(2).all(|w| w[1].epsilon > w[0].epsilon));
    assert_rel(per_round[99].epsilon, 0.9560911044993916, 1e-9, "100 rounds at q = 0.01, z = 1.1");
    assert_eq!(per_round[0].round, 1);
}

#[test]
fn clipping_is_exact() {
    // Goal: an update above C is scaled onto the sphere of radius C, one below is untouched bit for bit.
    let mut update = vec![3.0f32, 4.0];
    let clipped = clip_update(&mut update, 1.0).unwrap();
    assert_eq!((clipped.norm, clipped.scale), (5.0, 0.2));
    assert_eq!(update, vec![0.6f32, 0.8]);
    let original: Vec<f32> = (0..7850).map(|i| ((i as f32) * 0.37).sin() * 1e-3).collect();
    let mut small = original.clone();
    let clipped = clip_update(&mut small, 1.0).unwrap();
    assert_eq!(clipped.scale, 1.0);
    assert_eq!(small, original);
    let mut big: Vec<f32> = original.iter().map(|v| v * 1e4).collect();
    clip_update(&mut big, 0.5).unwrap();
    let norm = big.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt();
    assert!((norm - 0.5).abs() < 1e-6, "norm after clipping {norm}");
    assert!(matches!(clip_update(&mut [1.0, f32::NAN], 1.0), Err(FedError::Config { .. })));
}

#[test]
fn noise_is_seeded_reproducible_and_of_scale_z_c_over_k() {
    // Goal: the same seed gives the same noised mean, another seed another one, and the noise on the
    // mean has standard deviation z C / K. Method: 100,000 coordinates of a zero sum; the sample
    // standard deviation must be within 2% of 2.0 * 0.5 / 10 = 0.1.
    let seed = std::env::var("RTX_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(17u64);
    eprintln!("seed {seed} (replay with RTX_TEST_SEED={seed})");
    let dp = DpConfig::new(0.5, 2.0, 10, 1000, 1e-5).unwrap();
    let sum = vec![0.0f32; 100_000];
    let a = dp.noised_mean(&sum, &mut ChaCha20Rng::seed_from_u64(seed)).unwrap();
    let b = dp.noised_mean(&sum, &mut ChaCha20Rng::seed_from_u64(seed)).unwrap();
    let c = dp.noised_mean(&sum, &mut ChaCha20Rng::seed_from_u64(seed + 1)).unwrap();
    assert_eq!(a, b);
    assert_ne!(a, c);
    let n = a.len() as f64;
    let mean = a.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let std = (a.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
    assert!((std - 0.1).abs() < 0.002, "noise std {std}");
    assert!(mean.abs() < 0.002, "noise mean {mean}");
    // Without noise the mean is the sum over K exactly.
    let quiet = DpConfig::new(0.5, 0.0, 4, 1000, 1e-5).unwrap();
    assert_eq!(quiet.noised_mean(&[4.0, -2.0], &mut ChaCha20Rng::seed_from_u64(seed)).unwrap(), vec![1.0, -0.5]);
}

#[test]
fn bad_parameters_get_typed_errors() {
    // Goal: each out-of-range parameter is refused, naming its field.
    let field = |r: Result<DpConfig, FedError>| match r {
        Err(FedError::Config { field, .. }) => field,
        other => panic!("expected a config error, got {other:?}"),
    };
    assert_eq!(field(DpConfig::new(0.0, 1.0, 10, 100, 1e-5)), "dp.clip_norm");
    assert_eq!(field(DpConfig::new(1.0, -1.0, 10, 100, 1e-5)), "dp.noise_multiplier");
    assert_eq!(field(DpConfig::new(1.0, 1.0, 101, 100, 1e-5)), "dp.expected_clients");
    assert_eq!(field(DpConfig::new(1.0, 1.0, 10, 100, 1.0)), "dp.delta");
    assert!(RdpAccountant::new().compose_poisson_gaussian(1.5, 1.0, 1).is_err());
    assert!(RdpAccountant::new().epsilon(0.0).is_err());
    assert!(RdpAccountant::with_orders(vec![1.0]).is_err());
}

#[test]
fn dp_composes_with_secure_aggregation() {
    // Goal: the DP-FedAvg round over secure aggregation: clients clip to C (so every coordinate is in
    // [-C, C] and quantisation clips nothing), the server unmasks the sum and noises it. Without noise
    // the result is the clipped mean up to the fixed-point grid; with noise it is reproducible by seed.
    use rtx_federated::secagg::{run_round, Dropouts, QuantConfig, SecAggConfig};
    let seed = 99u64;
    let (n, len) = (24u64, 50usize);
    let dp = DpConfig::new(1.0, 0.8, n, 10 * n, 1e-5).unwrap();
    let clients: Vec<u64> = (0..n).collect();
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    let mut updates: Vec<Vec<f32>> = (0..n).map(|_| (0..len).map(|_| rand::Rng::random_range(&mut rng, -2.0f32..2.0)).collect()).collect();
    for u in updates.iter_mut() {
        assert!(dp.clip(u).unwrap().scale < 1.0);
    }
    let quant = QuantConfig::finest(dp.clip_norm as f32, n).unwrap();
    let cfg = SecAggConfig::recommended(1, len, n as usize, quant, seed).unwrap();
    let outcome = run_round(&cfg, &clients, &updates, &Dropouts::default(), seed).unwrap();
    let quiet = DpConfig { noise_multiplier: 0.0, ..dp };
    let mean = quiet.noised_mean(&outcome.sum, &mut ChaCha20Rng::seed_from_u64(seed)).unwrap();
    for (k, m) in mean.iter().enumerate() {
        let exact: f32 = updates.iter().map(|u| u[k]).sum::<f32>() / n as f32;
        assert!((m - exact).abs() <= 0.5 / quant.scale() as f32 + 1e-6, "coordinate {k}: {m} vs {exact}");
    }
    let noised = dp.noised_mean(&outcome.sum, &mut ChaCha20Rng::seed_from_u64(seed)).unwrap();
    assert_eq!(noised, dp.noised_mean(&outcome.sum, &mut ChaCha20Rng::seed_from_u64(seed)).unwrap());
    assert_ne!(noised, mean);
}
