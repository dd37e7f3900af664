//! CI swarm: 200 seeds of the default elastic-DP scenario (4 workers, random crashes with
//! restarts, collectives partitions, a hang, a straggler, a failed checkpoint write), each run
//! twice: every invariant holds on every seed, and every seed's second run has the same trace
//! hash. Failing seeds are printed with the command that replays them. `RTX_SIM_SEEDS=A..B` picks
//! other seeds. Then 100 seeds of the exact-recovery variant (min_workers = workers: the world
//! never shrinks), where every seed's final parameters must equal the fault-free run's.
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
