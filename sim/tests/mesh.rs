//! 3D jobs in the simulator: the byte-level GPT as a `(dp, pp, tp)` mesh on the real worker
//! runtime, mesh engine and sharded checkpoints, its compute threads scheduled by the simulator's
//! baton so a seed replays exactly. `mesh_3d.toml`: (2, 2, 2) on 8 nodes, a tensor-parallel member
//! and a pipeline stage killed plus a random crash; replacements take their slots from surviving
//! holders, so every seed must end bit-identical to the fault-free run (`exact-recovery`) with
//! every slot's holders agreeing at every step. `mesh_repartition.toml`: (1, 2, 2) on 4 nodes
//! without replacements: a crash leaves too few members for the mesh, the supervisor re-partitions
//! over fewer stages from the sharded checkpoint, and the restarted node brings the mesh back.
//! Every seed runs twice to the same trace hash. `RTX_SIM_SEEDS=A..B` picks other seeds.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use rtx_sim::{swarm, Outcome, RunOptions, Scenario};

fn seeds(default: std::ops::Range<u64>) -> std::ops::Range<u64> {
    std::env::var("RTX_SIM_SEEDS").ok().and_then(|r| r.split_once("..").and_then(|(a, b)| Some(a.parse().ok()?..b.parse().ok()?))).unwrap_or(default)
}

fn data_root() -> PathBuf {
    std::env::var_os("RTX_DATA_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../data"))
}

/// Runs `file` on `seeds` twice; fails on a broken invariant or a rerun that differs.
fn twice(file: &str, seeds: std::ops::Range<u64>) -> Vec<Outcome> {
    let scenario = Scenario::load(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios").join(file)).unwrap();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let first = swarm(&scenario, seeds.clone(), threads, &data_root(), &RunOptions::default()).unwrap();
    let second = swarm(&scenario, seeds.clone(), threads, &data_root(), &RunOptions::default()).unwrap();
    let mut bad = Vec::new();
    for (a, b) in first.outcomes.iter().zip(&second.outcomes) {
        if let Some(v) = &a.violation {
            bad.push(format!("seed {}: {} — {}\n  recent: {:#?}\n  (replay: rtx sim --scenario sim/scenarios/{file} --seed {})", a.seed, v.invariant, v.detail, v.recent, a.seed));
        }
        if a != b {
            bad.push(format!("seed {}: two runs differ (trace {:016x} vs {:016x})", a.seed, a.trace, b.trace));
        }
    }
    let generations: u64 = first.outcomes.iter().map(|o| o.generations).sum();
    println!("{file}: {} seeds x2 on {threads} threads in {:.1} s; {generations} generations", first.outcomes.len(), first.wall.as_secs_f64());
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    first.outcomes
}

#[test]
fn a_3d_job_loses_a_tensor_member_and_a_stage_and_ends_as_the_fault_free_run() {
    let outcomes = twice("mesh_3d.toml", seeds(0..4));
    for o in &outcomes {
        assert!(o.exact_recovery_checked, "seed {}: exact recovery not checked (the world shrank?)", o.seed);
        assert_eq!(o.committed, 30, "seed {}", o.seed);
        // Two planned kills and a random crash: each re-forms the mesh.
        assert!(o.generations >= 3, "seed {}: only {} generations", o.seed, o.generations);
    }
}

#[test]
fn a_replacement_that_skips_its_slots_state_is_caught() {
    // Goal: the invariants are not vacuous. With the planted bug (a replacement starts its slot
    // from the initial parameters instead of the surviving holder's state) every seed must break
    // `replicas-identical` (the supervisor sees the slot's holders disagree at the next verified
    // step) — the checker cannot pass a mesh that lost a slot's training.
    let scenario = Scenario::load(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios/mesh_3d.toml")).unwrap();
    let options = RunOptions { planted_bug: rtx_supervisor::PlantedBug::MeshSlotFromInitial, ..RunOptions::default() };
    for seed in seeds(0..2) {
        let outcome = rtx_sim::run_seed(&scenario, seed, &data_root(), &options).unwrap();
        let violation = outcome.violation.unwrap_or_else(|| panic!("seed {seed}: the planted bug went unnoticed"));
        assert_eq!(violation.invariant, "replicas-identical", "seed {seed}: {}", violation.detail);
    }
}

#[test]
fn a_mesh_too_small_for_its_shape_re_partitions_at_random_moments_and_comes_back() {
    let outcomes = twice("mesh_repartition.toml", seeds(0..6));
    for o in &outcomes {
        assert_eq!(o.committed, 150, "seed {}", o.seed);
    }
    let generations: u64 = outcomes.iter().map(|o| o.generations).sum();
    assert!(generations >= 3 * outcomes.len() as u64, "only {generations} generations in {} seeds", outcomes.len());
    // Seeds whose mesh was re-partitioned and later changed back to its configured shape.
    let configured = (1, 2, 2);
    let round_trips = outcomes.iter().filter(|o| o.shapes.iter().position(|s| *s != configured).is_some_and(|first| o.shapes[first..].contains(&configured))).count();
    for o in &outcomes {
        println!("seed {}: shapes {:?}, {} faults, {:?} virtual", o.seed, o.shapes, o.faults, o.virtual_time);
    }
    assert!(round_trips * 2 >= outcomes.len(), "only {round_trips} of {} seeds re-partitioned and came back", outcomes.len());
}
