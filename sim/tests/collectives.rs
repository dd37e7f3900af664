//! The real collectives over the simulated network, in virtual time: results match a reference,
//! a seed replays bit for bit (same trace hash), another seed changes the timing but not the
//! results, and crashes and partitions end in typed errors within the simulated timeout, never a
//! hang. Seeds are printed; replay one with `RTX_SIM_SEED=<seed>`.

use std::time::Duration;

use rtx_collectives::{CommConfig, Endpoint, ReduceOp, Transport};
use rtx_sim::{run, LinkModel, SimConfig, SimNetwork};

fn seed() -> u64 {
    std::env::var("RTX_SIM_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(42)
}

fn lossy() -> LinkModel {
    LinkModel { latency: Duration::from_micros(200), jitter: Duration::from_micros(300), bandwidth_bytes_per_s: 2e8, loss: 0.05, retransmit_after: Duration::from_millis(2), ..LinkModel::default() }
}

/// Runs `rounds` all-reduces of `len` elements on `n` ranks; returns every rank's results, the
/// trace hash, and the virtual time taken.
fn all_reduce_job(seed: u64, n: usize, len: usize, rounds: usize) -> (Vec<Vec<f32>>, u64, Duration) {
    all_reduce_on(lossy(), seed, n, len, rounds)
}

/// [`all_reduce_job`] over links of `link`.
fn all_reduce_on(link: LinkModel, seed: u64, n: usize, len: usize, rounds: usize) -> (Vec<Vec<f32>>, u64, Duration) {
    run(async move {
        let (net, transports) = SimNetwork::new(n, SimConfig { seed, link, ..SimConfig::default() });
        let start = tokio::time::Instant::now();
        let mut tasks = Vec::new();
        for t in transports {
            tasks.push(tokio::spawn(async move {
                let rank = t.rank();
                let endpoint = Endpoint::new(std::sync::Arc::new(t), CommConfig::default()).expect("endpoint");
                let comm = endpoint.world().expect("world");
                let mut buf: Vec<f32> = (0..len).map(|i| ((i * 31 + rank * 7) % 101) as f32 * 0.01).collect();
                for _ in 0..rounds {
                    comm.all_reduce(&mut buf, ReduceOp::Avg).await.expect("all_reduce");
                }
                buf
            }));
        }
        let mut results = Vec::new();
        for t in tasks {
            results.push(t.await.expect("rank task"));
        }
        (results, net.trace().value(), start.elapsed())
    })
    .expect("runtime")
}

#[test]
fn a_seed_replays_bit_for_bit_and_results_match_the_reference() {
    let seed = seed();
    println!("seed {seed} (replay: RTX_SIM_SEED={seed} cargo test -p rtx-sim --test collectives)");
    for (n, len) in [(2, 1), (3, 1000), (4, 300_001), (5, 17)] {
        let (a, hash_a, time_a) = all_reduce_job(seed, n, len, 3);
        let (b, hash_b, time_b) = all_reduce_job(seed, n, len, 3);
        assert_eq!(hash_a, hash_b, "n={n} len={len}: same seed, different trace");
        assert_eq!(time_a, time_b);
        assert_eq!(a, b);
        // Every rank holds the same bits, and the average equals the reference.
        for r in &a {
            assert_eq!(r, &a[0]);
        }
        for (i, v) in a[0].iter().enumerate() {
            let want: f32 = (0..n).map(|rank| ((i * 31 + rank * 7) % 101) as f32 * 0.01).sum::<f32>() / n as f32;
            assert!((v - want).abs() <= 1e-5 * want.abs().max(1.0), "n={n} element {i}: {v} vs {want}");
        }
        let (c, hash_c, _) = all_reduce_job(seed + 1, n, len, 3);
        assert_eq!(c, a, "the timing must not change the results");
        assert_ne!(hash_c, hash_a, "another seed should change the timing");
    }
}

#[test]
fn duplication_and_reordering_cost_time_but_never_change_results() {
    // Goal: duplicated and reordered packets show up as lost bandwidth and delivery gaps (the
    // transport above stays reliable and ordered): the results equal a clean network's, the same
    // seed replays the same trace, and the run takes longer in virtual time.
    let seed = seed();
    println!("seed {seed} (replay: RTX_SIM_SEED={seed} cargo test -p rtx-sim --test collectives)");
    let clean = LinkModel { loss: 0.0, ..lossy() };
    let messy = LinkModel { duplicate: 0.3, reorder: 0.3, ..clean };
    let (want, _, clean_time) = all_reduce_on(clean, seed, 4, 50_000, 3);
    let (got, hash_a, messy_time) = all_reduce_on(messy, seed, 4, 50_000, 3);
    let (again, hash_b, again_time) = all_reduce_on(messy, seed, 4, 50_000, 3);
    assert_eq!(got, want, "duplication or reordering changed a result");
    assert_eq!((hash_a, messy_time), (hash_b, again_time), "same seed, different trace");
    assert_eq!(again, got);
    assert!(messy_time > clean_time, "duplication and reordering should cost time: {messy_time:?} vs {clean_time:?}");
}

#[test]
fn crashes_and_partitions_fail_with_typed_errors_in_virtual_time() {
    let seed = seed();
    println!("seed {seed}");
    for fault in ["crash", "partition", "one-way"] {
        let errors = run(async move {
            let config = SimConfig { seed, link: lossy(), loss_detect: Duration::from_millis(300), ..SimConfig::default() };
            let (net, transports) = SimNetwork::new(3, config);
            let mut tasks = Vec::new();
            for t in transports {
                tasks.push(tokio::spawn(async move {
                    let endpoint = Endpoint::new(std::sync::Arc::new(t), CommConfig { op_timeout: Duration::from_secs(5), ..CommConfig::default() }).expect("endpoint");
                    let comm = endpoint.world().expect("world");
                    let mut buf = vec![1.0f32; 100_000];
                    let mut result = Ok(());
                    for _ in 0..50 {
                        result = comm.all_reduce(&mut buf, ReduceOp::Sum).await;
                        if result.is_err() {
                            break;
                        }
                    }
                    result.map_err(|e| e.to_string())
                }));
            }
            tokio::time::sleep(Duration::from_millis(3)).await;
            match fault {
                "crash" => net.crash(2),
                "partition" => net.partition(0, 2, true),
                _ => net.partition(2, 0, false),
            }
            let started = tokio::time::Instant::now();
            let mut errors = Vec::new();
            for (rank, t) in tasks.into_iter().enumerate() {
                if fault == "crash" && rank == 2 {
                    t.abort();
                    continue;
                }
                errors.push(t.await.expect("rank task").err());
            }
            assert!(started.elapsed() < Duration::from_secs(6), "{fault}: took {:?} of virtual time", started.elapsed());
            errors
        })
        .expect("runtime");
        for e in &errors {
            let e = e.as_ref().unwrap_or_else(|| panic!("{fault}: a rank finished 50 all-reduces despite the fault"));
            assert!(e.contains("lost") || e.contains("timed out") || e.contains("abort"), "{fault}: {e}");
        }
    }
}
