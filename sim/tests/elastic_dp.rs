//! The real supervisor, node agents, workers, collectives and DP trainer of an elastic job under
//! virtual time (`rtx_sim::run_seed`), training an MLP on real Fashion-MNIST images (needs
//! `bash scripts/fetch-data.sh`): a fault-free run finishes with identical replicas, a seed with
//! crashes, partitions and a straggler replays bit for bit, an explicit crash and restart recovers
//! exactly (final parameters equal the fault-free run's), and a bug planted in the supervisor is
//! found by a small swarm and replays from the reported seed. Seeds are printed; replay one with
//! `RTX_SIM_SEED=<seed>` or `rtx sim --scenario sim/scenarios/elastic_dp.toml --seed <seed>`.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use rtx_sim::{run_seed, swarm, RunOptions, Scenario};
use rtx_supervisor::PlantedBug;

fn data_root() -> PathBuf {
    std::env::var_os("RTX_DATA_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../data"))
}

fn scenario() -> Scenario {
    Scenario::load(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios/elastic_dp.toml")).unwrap()
}

fn seeds() -> Vec<u64> {
    match std::env::var("RTX_SIM_SEED").ok().and_then(|s| s.parse().ok()) {
        Some(seed) => vec![seed],
        None => vec![1, 2, 3],
    }
}

// Goal: the whole runtime trains to the end in virtual time with no fault. Method: one run
// without faults; every invariant holds, all steps commit, the model learned something.
#[test]
fn fault_free_run_finishes_with_identical_replicas() {
    let s = scenario();
    let outcome = run_seed(&s, 0, &data_root(), &RunOptions { no_faults: true, ..RunOptions::default() }).unwrap();
    println!("{outcome:?}");
    assert_eq!(outcome.violation, None);
    assert_eq!(outcome.committed, s.job.total_steps);
    assert_eq!(outcome.generations, 1);
    let acc = outcome.eval.iter().find(|(k, _)| k == "acc").map(|(_, v)| *v).unwrap();
    assert!(acc > 0.5, "accuracy {acc}");
}

// Goal: determinism. Method: each seed twice (random crashes, partitions, a straggler); the
// outcomes (trace hash, checksums, committed steps, virtual time) are equal, and different seeds
// give different traces.
#[test]
fn a_seed_replays_bit_for_bit() {
    let s = scenario();
    let mut traces = Vec::new();
    for seed in seeds() {
        println!("seed {seed} (replay: RTX_SIM_SEED={seed} cargo test -p rtx-sim --test elastic_dp)");
        let a = run_seed(&s, seed, &data_root(), &RunOptions::default()).unwrap();
        let b = run_seed(&s, seed, &data_root(), &RunOptions::default()).unwrap();
        println!("{a:?}");
        assert_eq!(a, b, "seed {seed}: two runs differ");
        assert_eq!(a.violation, None, "seed {seed}");
        assert!(a.faults >= 3, "seed {seed}: the plan fired {} faults", a.faults);
        traces.push(a.trace);
    }
    traces.dedup();
    assert_eq!(traces.len(), seeds().len(), "different seeds, same trace");
}

fn explicit(min_workers: usize, faults: &str) -> Scenario {
    let text = std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios/elastic_dp.toml")).unwrap();
    let text = text
        .replace("crashes = 2", "crashes = 0")
        .replace("partitions = 1", "partitions = 0")
        .replace("slow = 1", "slow = 0")
        .replace("pauses = 1", "pauses = 0")
        .replace("checkpoint_failures = 1", "checkpoint_failures = 0")
        .replace("min_workers = 2", &format!("min_workers = {min_workers}"));
    Scenario::parse(&format!("{text}\n{faults}")).unwrap()
}

// Goal: a crash and restart recovers, shrinking then growing. Method: crash node 2 after step 10
// is committed and restart it 50 ms later; all steps commit through three generations.
#[test]
fn crash_and_restart_recovers() {
    let s = explicit(2, "[[fault]]\nkind = \"crash\"\nnode = 2\nat_step = 10\nrestart_after_ms = 50\n");
    let outcome = run_seed(&s, 5, &data_root(), &RunOptions::default()).unwrap();
    println!("{outcome:?}");
    assert_eq!(outcome.violation, None);
    assert_eq!(outcome.committed, s.job.total_steps);
    assert!(outcome.generations >= 3, "crash then regrow: {} generations", outcome.generations);
}

// Goal: exact recovery. Method: with min_workers = 4 a crash makes the job wait for the restarted
// node instead of shrinking, so every step runs on four replicas and the state comes back from a
// surviving one: the final parameters must equal the fault-free run's bit for bit (the checker
// compares them; asserted here too). A hang (pause) and a partition on top take other paths.
#[test]
fn exact_recovery_after_crash_hang_and_partition() {
    let faults = "[[fault]]\nkind = \"crash\"\nnode = 1\nat_step = 5\nrestart_after_ms = 300\n\n[[fault]]\nkind = \"partition\"\nnode = 0\npeer = 3\nat_step = 15\nfor_ms = 700\n\n[[fault]]\nkind = \"pause\"\nnode = 2\nat_step = 25\nfor_ms = 1500\n";
    let s = explicit(4, faults);
    let reference = run_seed(&s, 0, &data_root(), &RunOptions { no_faults: true, ..RunOptions::default() }).unwrap();
    let outcome = run_seed(&s, 11, &data_root(), &RunOptions::default()).unwrap();
    println!("{outcome:?}");
    assert_eq!(outcome.violation, None);
    assert_eq!(outcome.faults, 3);
    assert!(outcome.generations >= 4, "{} generations", outcome.generations);
    assert!(outcome.exact_recovery_checked);
    assert_eq!(outcome.checksum, reference.checksum, "recovered parameters differ from the fault-free run's");
}

// Goal: the checker can fail. Method: plant a bug in the supervisor (after a re-formation it
// restarts at the newest completed step, training it twice); a swarm of at most 16 seeds finds
// it, and the reported seed replays to the same violation.
#[test]
fn swarm_finds_the_planted_bug_and_its_seed_replays() {
    let s = scenario();
    let options = RunOptions { planted_bug: PlantedBug::ReplayLastStep, ..RunOptions::default() };
    let report = swarm(&s, 0..16, 2, &data_root(), &options).unwrap();
    let found = report.failing().next().cloned().unwrap_or_else(|| panic!("16 seeds did not find the planted bug: {:?}", report.outcomes));
    let violation = found.violation.clone().unwrap();
    println!("found by seed {}: {violation:?}", found.seed);
    assert!(matches!(violation.invariant, "committed-monotone" | "samples-exactly-once" | "durable-progress"), "{violation:?}");
    let replay = run_seed(&s, found.seed, &data_root(), &options).unwrap();
    assert_eq!(replay, found, "the reported seed replays");
    // Without the bug, that seed passes.
    let fixed = run_seed(&s, found.seed, &data_root(), &RunOptions::default()).unwrap();
    assert_eq!(fixed.violation, None);
}

// Goal: a failed checkpoint write loses nothing. Method: checkpoints every 10 steps; the writes
// after steps 10 and 30 are made to fail (armed when steps 3 and 25 commit), and node 1 crashes
// after step 12 so a failure meets a re-formation. The job must finish; the checker verifies
// after each failure that the last good checkpoint is byte-for-byte what it was, and at the end
// that every stored checkpoint decodes and holds the replicas' parameters of its step.
#[test]
fn failed_checkpoint_writes_keep_the_last_good_one() {
    let faults = "[[fault]]\nkind = \"checkpoint_fail\"\nat_step = 3\n\n[[fault]]\nkind = \"checkpoint_fail\"\nat_step = 25\n\n[[fault]]\nkind = \"crash\"\nnode = 1\nat_step = 12\nrestart_after_ms = 200\n";
    let s = explicit(2, faults);
    let outcome = run_seed(&s, 3, &data_root(), &RunOptions::default()).unwrap();
    println!("{outcome:?}");
    assert_eq!(outcome.violation, None);
    assert_eq!(outcome.committed, s.job.total_steps);
    let (written, failed) = outcome.checkpoints;
    assert_eq!(failed, 2, "both armed writes must fail");
    // Steps 9, 19, 29, 39 are due; two fail; a crash may repeat one.
    assert!(written >= 2, "{written} checkpoints written");
}

// Goal: a one-way partition (frames from node 0 to node 2 vanish, the other direction still
// flows) is detected by both ends and recovered from like a symmetric one. Method: cut 0 -> 2
// after step 8 for 800 ms; the job must finish with every invariant held, through a re-formation.
#[test]
fn one_way_partition_recovers() {
    let s = explicit(2, "[[fault]]\nkind = \"partition\"\nnode = 0\npeer = 2\none_way = true\nat_step = 8\nfor_ms = 800\n");
    let outcome = run_seed(&s, 21, &data_root(), &RunOptions::default()).unwrap();
    println!("{outcome:?}");
    assert_eq!(outcome.violation, None);
    assert_eq!(outcome.committed, s.job.total_steps);
    assert!(outcome.generations >= 2, "the cut must force a re-formation: {} generations", outcome.generations);
}

// Goal: the `checkpoint-intact` invariant can fail. Method: the same faults as above with a
// planted non-atomic store (a failed write truncates the newest good checkpoint): the run must
// report `checkpoint-intact` at the second failed write (the first has no good checkpoint yet).
#[test]
fn a_store_that_tears_the_last_good_checkpoint_is_caught() {
    let faults = "[[fault]]\nkind = \"checkpoint_fail\"\nat_step = 3\n\n[[fault]]\nkind = \"checkpoint_fail\"\nat_step = 25\n";
    let s = explicit(2, faults);
    let outcome = run_seed(&s, 3, &data_root(), &RunOptions { torn_checkpoints: true, ..RunOptions::default() }).unwrap();
    println!("{outcome:?}");
    let violation = outcome.violation.expect("the torn checkpoint must be caught");
    assert_eq!(violation.invariant, "checkpoint-intact", "{violation:?}");
    assert!(violation.detail.contains("changed") || violation.detail.contains("decode"), "{violation:?}");
}
