//! CI swarm: 200 seeds of the default elastic-DP scenario (4 workers, random crashes with
//! restarts, collectives partitions, a hang, a straggler, a failed checkpoint write), each run
//! twice: every invariant holds on every seed, and every seed's second run has the same trace
//! hash. Failing seeds are printed with the command that replays them. `RTX_SIM_SEEDS=A..B` picks
//! other seeds. Then 100 seeds of the exact-recovery variant (min_workers = workers: the world
//! never shrinks), where every seed's final parameters must equal the fault-free run's. Then 200
//! seeds of the issue-19 faults at 64 nodes (`shm_chaos_64.toml`: shared-memory links as before
//! the transport could be aborted, crashes, members stuck in a collective, workers joining while
//! the supervisor prepares a generation, `on_failure = "replace"`), each run once, every invariant
//! (`durable-progress` and `no-restart-from-scratch` included) holding, and every tenth seed run
//! again to the same outcome.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use rtx_sim::{swarm, RunOptions, Scenario};

fn seeds(default: std::ops::Range<u64>) -> std::ops::Range<u64> {
    std::env::var("RTX_SIM_SEEDS").ok().and_then(|r| r.split_once("..").and_then(|(a, b)| Some(a.parse().ok()?..b.parse().ok()?))).unwrap_or(default)
}

#[test]
fn two_hundred_seeds_hold_every_invariant_and_replay() {
    let outcomes = swarm_twice("elastic_dp.toml", seeds(0..200));
    let failed_writes: u64 = outcomes.iter().map(|o| o.checkpoints.1).sum();
    assert!(failed_writes * 2 >= outcomes.len() as u64, "only {failed_writes} checkpoint writes failed in {} seeds", outcomes.len());
}

#[test]
fn a_hundred_seeds_that_never_shrink_recover_exactly() {
    let outcomes = swarm_twice("elastic_dp_exact.toml", seeds(0..100));
    let exact = outcomes.iter().filter(|o| o.exact_recovery_checked).count();
    assert_eq!(exact, outcomes.len(), "exact recovery was checked on only {exact} seeds");
}

#[test]
fn two_hundred_seeds_at_sixty_four_nodes_never_regress_past_durable_state() {
    let file = "shm_chaos_64.toml";
    let scenario = load(file);
    let all = seeds(0..200);
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let report = swarm(&scenario, all.clone(), threads, &data_root(), &RunOptions::default()).unwrap();
    let mut bad = failures(file, &report.outcomes);
    let sample: Vec<u64> = all.clone().step_by(10).collect();
    for seed in &sample {
        let again = rtx_sim::run_seed(&scenario, *seed, &data_root(), &RunOptions::default()).unwrap();
        let first = report.outcomes.iter().find(|o| o.seed == *seed).unwrap();
        if &again != first {
            bad.push(format!("seed {seed}: two runs differ (trace {:016x} vs {:016x})", first.trace, again.trace));
        }
    }
    let faults: usize = report.outcomes.iter().map(|o| o.faults).sum();
    let generations: u64 = report.outcomes.iter().map(|o| o.generations).sum();
    println!(
        "{file}: {} seeds on {threads} threads in {:.1} s ({:.1} seeds/s, virtual/wall {:.1}x), {} replayed; {faults} faults; {generations} generations",
        report.outcomes.len(),
        report.wall.as_secs_f64(),
        report.seeds_per_s(),
        report.virtual_to_wall(),
        sample.len()
    );
    assert_eq!(report.outcomes.len() as u64, all.end - all.start);
    assert!(faults >= 6 * report.outcomes.len(), "the plans fired only {faults} faults");
    // Crashes re-form the group: far more generations than seeds.
    assert!(generations >= 3 * report.outcomes.len() as u64, "only {generations} generations");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

fn data_root() -> PathBuf {
    std::env::var_os("RTX_DATA_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../data"))
}

fn load(file: &str) -> Scenario {
    Scenario::load(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios").join(file)).unwrap()
}

/// Every broken invariant, with the seed and the command that replays it.
fn failures(file: &str, outcomes: &[rtx_sim::Outcome]) -> Vec<String> {
    outcomes
        .iter()
        .filter_map(|o| o.violation.as_ref().map(|v| format!("seed {}: {} — {} (replay: rtx sim --scenario sim/scenarios/{file} --seed {})", o.seed, v.invariant, v.detail, o.seed)))
        .collect()
}

/// Runs `file`'s scenario on `seeds` twice; fails on any broken invariant or differing rerun.
fn swarm_twice(file: &str, seeds: std::ops::Range<u64>) -> Vec<rtx_sim::Outcome> {
    let root = std::env::var_os("RTX_DATA_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../data"));
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios").join(file);
    let scenario = Scenario::load(&path).unwrap();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let first = swarm(&scenario, seeds.clone(), threads, &root, &RunOptions::default()).unwrap();
    let second = swarm(&scenario, seeds.clone(), threads, &root, &RunOptions::default()).unwrap();
    let mut bad = Vec::new();
    for (a, b) in first.outcomes.iter().zip(&second.outcomes) {
        if let Some(v) = &a.violation {
            bad.push(format!("seed {}: {} — {} (replay: rtx sim --scenario sim/scenarios/{file} --seed {})", a.seed, v.invariant, v.detail, a.seed));
        }
        if a != b {
            bad.push(format!("seed {}: two runs differ (trace {:016x} vs {:016x})", a.seed, a.trace, b.trace));
        }
    }
    let faults: usize = first.outcomes.iter().map(|o| o.faults).sum();
    let exact = first.outcomes.iter().filter(|o| o.exact_recovery_checked).count();
    let (written, failed) = first.outcomes.iter().fold((0, 0), |(w, f), o| (w + o.checkpoints.0, f + o.checkpoints.1));
    println!(
        "{file}: {} seeds x2 on {threads} threads: {:.1} seeds/s, virtual/wall {:.1}x, {:.0} committed steps/s; {faults} faults; exact recovery checked on {exact} seeds; {written} checkpoints written, {failed} writes failed",
        first.outcomes.len(),
        first.seeds_per_s(),
        first.virtual_to_wall(),
        first.steps_per_wall_s()
    );
    assert_eq!(first.outcomes.len() as u64, seeds.end - seeds.start);
    assert!(faults >= 3 * first.outcomes.len(), "the plans fired only {faults} faults");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    first.outcomes
}
