//! A (dp, pp, tp) = (2, 2, 2) mesh of 8 real worker processes on loopback (`rtx launch`): it
//! trains like one process, and it survives kill -9 of a tensor-parallel member and of a pipeline
//! stage with at most the in-flight step redone, ending bit-identical to the undisturbed run. The
//! time from each kill to the next committed step is printed next to a data-parallel job's figure
//! measured in the same run. A (1, 2, 2) mesh that loses a member with no replacement coming
//! re-partitions over the three it has, from its newest sharded checkpoint, and grows back to
//! (1, 2, 2) at the first checkpoint after a new worker joins, training like the undisturbed run.
//!
//! Needs the SOTU corpus (`bash scripts/fetch-data.sh`). The launches run one at a time.

mod support;

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use std::process::Stdio;

use support::{rtx, signal, Launch};

static SERIAL: Mutex<()> = Mutex::new(());

/// Pipeline stages and tensor-parallel ranks of `tests/configs/mesh_sotu.toml`.
const PP: usize = 2;
const TP: usize = 2;

/// The mesh test config with `steps` steps; `parallel = false` drops the `[parallel]` table (plain
/// data parallelism over the same model, data and optimizer).
fn config(steps: u64, parallel: bool) -> PathBuf {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/configs/mesh_sotu.toml")).expect("test config");
    let mut text = text.replace("steps = 150", &format!("steps = {steps}"));
    if !parallel {
        let start = text.find("[parallel]").expect("[parallel] table");
        let end = text[start..].find("\n\n").map_or(text.len(), |n| start + n + 2);
        text.replace_range(start..end, "");
    }
    let path = tempfile::tempdir().expect("tempdir").keep().join("mesh.toml");
    std::fs::write(&path, text).expect("write config");
    path
}

/// Committed losses by step (the last commit of a step wins; a step is committed once).
fn losses(events: &[Value]) -> Vec<(u64, f64)> {
    let mut by_step = std::collections::BTreeMap::new();
    for e in events.iter().filter(|e| e["event"] == "committed") {
        by_step.insert(e["step"].as_u64().expect("step"), e["loss"].as_f64().expect("loss"));
    }
    by_step.into_iter().collect()
}

fn checksum(events: &[Value]) -> Value {
    events.iter().rev().find(|e| e["event"] == "finished").map(|e| e["checksum"].clone()).expect("finished")
}

/// The pid at `rank` of the newest generation.
fn pid_of_rank(events: &[Value], rank: usize) -> u32 {
    let generation = events.iter().rev().find(|e| e["event"] == "generation").expect("a generation");
    generation["pids"][rank].as_u64().expect("pid") as u32
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_secs_f64()
}

/// What one kill cost: the committed step seen before it, the newest step committed when the
/// recovery generation started (the step in flight at the kill may still commit, if every member
/// had reported it), the generation's next step, and the time from the signal to the next
/// committed step.
#[derive(Debug)]
struct KillCost {
    committed_before: u64,
    committed_at_resume: u64,
    resumed_at: u64,
    kill_to_commit_s: f64,
}

/// Waits for step `at`, kill -9s the member at `rank`, and measures the recovery.
fn kill_rank(launch: &Launch, at: u64, rank: usize) -> KillCost {
    let events = launch.wait_for(&format!("step {at}"), Duration::from_secs(120), |e| Launch::committed(e).is_some_and(|s| s >= at));
    let generations = events.iter().filter(|e| e["event"] == "generation").count();
    let victim = pid_of_rank(&events, rank);
    let before = Launch::committed(&events).expect("committed");
    let killed_at = unix_now();
    signal(victim, "-9");
    let after = launch.wait_for("the next commit after the kill", Duration::from_secs(120), |e| {
        e.iter().filter(|e| e["event"] == "generation").count() > generations && e.iter().any(|e| e["event"] == "committed" && e["unix_s"].as_f64().is_some_and(|t| t > killed_at))
    });
    let next_commit = after.iter().find(|e| e["event"] == "committed" && e["unix_s"].as_f64().is_some_and(|t| t > killed_at)).expect("a commit after the kill");
    let lost: Vec<&Value> = after.iter().filter(|e| e["event"] == "lost" && e["pid"] == victim).collect();
    assert_eq!(lost.len(), 1, "the kill of {victim} is reported once: {lost:?}");
    assert_eq!(lost[0]["class"], "Crash");
    let recovery = after.iter().rposition(|e| e["event"] == "generation").expect("recovery generation");
    let resumed_at = after[recovery]["next_step"].as_u64().expect("next_step");
    let committed_at_resume = Launch::committed(&after[..recovery]).expect("committed");
    KillCost { committed_before: before, committed_at_resume, resumed_at, kill_to_commit_s: next_commit["unix_s"].as_f64().expect("unix_s") - killed_at }
}

#[test]
fn a_mesh_of_processes_trains_like_one_process() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (_, one) = Launch::start_in(Launch::fresh_out(), &config(50, false), 1, &[]).finish();
    let (_, mesh) = Launch::start_in(Launch::fresh_out(), &config(50, true), 8, &[]).finish();
    let (one, mesh) = (losses(&one), losses(&mesh));
    assert_eq!(one.len(), 50, "{one:?}");
    assert_eq!(one.iter().map(|l| l.0).collect::<Vec<_>>(), mesh.iter().map(|l| l.0).collect::<Vec<_>>());
    for ((step, a), (_, b)) in one.iter().zip(&mesh) {
        let rel = (a - b).abs() / a.abs();
        assert!(rel < 1e-5, "step {step}: one process {a}, (2,2,2) mesh {b}, relative difference {rel:e}");
    }
}

#[test]
fn killing_a_tensor_parallel_member_and_a_pipeline_stage_loses_at_most_the_step_in_flight() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (calm_summary, calm) = Launch::start_in(Launch::fresh_out(), &config(150, true), 8, &[]).finish();

    // Ranks are laid out tp fastest, then pp, then dp: rank 5 is (dp 1, pp 0, tp 1), a
    // tensor-parallel member; rank 2 is (dp 0, pp 1, tp 0), a pipeline stage.
    let tp_member = TP * PP + 1;
    let pp_stage = TP;
    assert_eq!((tp_member % TP, tp_member / TP % PP), (1, 0));
    assert_eq!((pp_stage % TP, pp_stage / TP % PP), (0, 1));
    let launch = Launch::start_in(Launch::fresh_out(), &config(150, true), 8, &[]);
    let tp_kill = kill_rank(&launch, 40, tp_member);
    let pp_kill = kill_rank(&launch, 90, pp_stage);
    let (hurt_summary, hurt) = launch.finish();

    // Data parallelism over the same model and world, killed the same way, in the same run.
    let dp = Launch::start_in(Launch::fresh_out(), &config(150, false), 8, &[]);
    let dp_kill = kill_rank(&dp, 40, tp_member);
    dp.finish();

    for (what, cost) in [("tp member", &tp_kill), ("pp stage", &pp_kill), ("dp worker", &dp_kill)] {
        println!("kill -9 of a {what}: committed step {} before the kill ({} when the recovery began), resumed at {}, {:.3} s from the kill to the next committed step", cost.committed_before, cost.committed_at_resume, cost.resumed_at, cost.kill_to_commit_s);
        // At most the step in flight is lost: it either committed (every member had reported
        // it) or is the one trained again.
        assert!(cost.committed_at_resume <= cost.committed_before + 1, "{what}: steps {}..={} committed after the kill", cost.committed_before + 1, cost.committed_at_resume);
        assert!(cost.resumed_at == cost.committed_at_resume + 1, "{what}: step {} was the newest committed when the recovery began, training resumed at {}", cost.committed_at_resume, cost.resumed_at);
    }
    println!("kill to next commit: mesh {:.3} s (tp member), {:.3} s (pp stage); data parallel {:.3} s", tp_kill.kill_to_commit_s, pp_kill.kill_to_commit_s, dp_kill.kill_to_commit_s);

    // Every step committed once, and the replacements took the lost slots: the world is whole.
    let (calm_losses, hurt_losses) = (losses(&calm), losses(&hurt));
    assert_eq!(hurt_losses.len(), 150);
    let committed_steps: Vec<u64> = hurt.iter().filter(|e| e["event"] == "committed").filter_map(|e| e["step"].as_u64()).collect();
    assert!(committed_steps.windows(2).all(|w| w[1] == w[0] + 1), "a committed step was run again or skipped: {committed_steps:?}");
    let shapes: Vec<&Value> = hurt.iter().filter(|e| e["event"] == "generation").map(|g| &g["mesh"]).collect();
    let whole = serde_json::json!({ "dp": 2, "pp": PP, "tp": TP });
    assert_eq!((shapes.first().copied(), shapes.last().copied()), (Some(&whole), Some(&whole)), "mesh shapes over the run: {shapes:?}");

    // The quality target is 2% of the undisturbed final loss; the state every member took back
    // came from a surviving holder of its slot, so the run is in fact bit-identical.
    let (calm_final, hurt_final) = (calm_losses[149].1, hurt_losses[149].1);
    assert!((hurt_final - calm_final).abs() / calm_final < 0.02, "final loss {hurt_final} vs undisturbed {calm_final}");
    assert_eq!(checksum(&hurt), checksum(&calm), "the disturbed run's parameters differ from the undisturbed run's");
    assert_eq!(hurt_summary["replicas_identical"], calm_summary["replicas_identical"]);
}

/// The mesh test config with `steps` steps at (dp, pp, tp) = (1, 2, 2), a sharded checkpoint every
/// `checkpoint_every` steps, no replacement for a lost member, and collectives over `transport`.
fn shrinking_config(steps: u64, checkpoint_every: u64, transport: &str) -> PathBuf {
    let path = config(steps, true);
    let text = std::fs::read_to_string(&path)
        .expect("config")
        .replace("on_failure = \"replace\"", &format!("on_failure = \"shrink\"\ntransport = \"{transport}\""))
        .replace("log_every = 10", &format!("log_every = 10\ncheckpoint_every = {checkpoint_every}"));
    std::fs::write(&path, text).expect("write config");
    path
}

#[test]
fn a_mesh_too_small_for_its_shape_re_partitions_from_its_checkpoint_and_grows_back() {
    re_partition_and_grow_back("shm");
}

#[test]
fn a_mesh_re_partitions_and_grows_back_over_quic() {
    re_partition_and_grow_back("quic");
}

/// (1,2,2) on 4 processes over `transport`; kill -9 of rank 1 after the checkpoint of step 19 →
/// (1,3,1) from that checkpoint → a worker joins → (1,2,2) from a later checkpoint; every committed
/// loss within 1e-5 of the undisturbed run.
fn re_partition_and_grow_back(transport: &str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let steps = 80;
    let (_, calm) = Launch::start_in(Launch::fresh_out(), &shrinking_config(steps, 10, transport), PP * TP, &[]).finish();
    assert!(calm.iter().filter(|e| e["event"] == "generation").all(|g| g["transport"] == transport), "the runs train over {transport}");

    let launch = Launch::start_in(Launch::fresh_out(), &shrinking_config(steps, 10, transport), PP * TP, &["--max-workers", "4"]);
    // Kill a member after the checkpoint of step 19: three are left, too few for (1,2,2).
    let events = launch.wait_for("step 24", Duration::from_secs(120), |e| Launch::committed(e).is_some_and(|s| s >= 24));
    signal(pid_of_rank(&events, 1), "-9");
    let three = serde_json::json!({ "dp": 1, "pp": 3, "tp": 1 });
    let events = launch.wait_for("a (1,3,1) generation training", Duration::from_secs(120), |e| {
        let last = e.iter().rposition(|g| g["event"] == "generation" && g["mesh"] == three);
        last.is_some_and(|at| e[at..].iter().any(|c| c["event"] == "committed"))
    });
    let repartitioned = events.iter().rev().find(|g| g["event"] == "generation").expect("generation").clone();
    assert_eq!(repartitioned["world"], 3, "{repartitioned}");
    let checkpoint_steps: Vec<u64> = events.iter().filter(|e| e["event"] == "checkpointed").filter_map(|e| e["step"].as_u64()).collect();
    let newest = *checkpoint_steps.iter().max().expect("a checkpoint before the kill");
    assert_eq!(repartitioned["next_step"].as_u64(), Some(newest + 1), "the re-partitioned mesh resumes after the newest checkpoint {checkpoint_steps:?}");

    // A new worker joins; the mesh returns to (1,2,2) at the next checkpoint.
    let at = Launch::committed(&events).expect("committed");
    launch.wait_for("two more commits", Duration::from_secs(120), |e| Launch::committed(e).is_some_and(|s| s >= at + 2));
    let cluster: Value = serde_json::from_str(&std::fs::read_to_string(launch.out.join("cluster.json")).expect("cluster")).expect("json");
    let addr = cluster["supervisor"].as_str().expect("addr").to_string();
    let token = std::fs::read_to_string(launch.out.join("token")).expect("token");
    let mut joiner = rtx().args(["worker", "--join", &addr]).env("RTX_TOKEN", token.trim()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("joiner");
    let whole = serde_json::json!({ "dp": 1, "pp": PP, "tp": TP });
    let (summary, hurt) = launch.finish();
    let _ = joiner.wait();
    let shapes: Vec<(Value, u64)> = hurt.iter().filter(|e| e["event"] == "generation").map(|g| (g["mesh"].clone(), g["next_step"].as_u64().expect("next_step"))).collect();
    println!("generations (mesh, next step): {shapes:?}");
    assert_eq!(shapes.iter().map(|s| &s.0).collect::<Vec<_>>(), vec![&whole, &three, &whole], "mesh shapes over the run");
    let grown_at = shapes[2].1;
    assert!(hurt.iter().any(|e| e["event"] == "checkpointed" && e["step"].as_u64() == Some(grown_at - 1)), "the mesh grew back from the checkpoint of step {}", grown_at - 1);

    // Training after each re-plan equals the undisturbed run: every step's committed loss (the
    // last commit of a step redone after the re-partition) within 1e-5 relative.
    let (calm, hurt_losses) = (losses(&calm), losses(&hurt));
    assert_eq!(hurt_losses.len(), steps as usize);
    for ((step, a), (_, b)) in calm.iter().zip(&hurt_losses) {
        let rel = (a - b).abs() / a.abs();
        assert!(rel < 1e-5, "step {step}: undisturbed {a}, re-partitioned run {b}, relative difference {rel:e}");
    }
    assert_eq!(summary["replicas_identical"], true);
}
