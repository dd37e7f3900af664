//! `rtx launch --resume` across mesh shapes, with real worker processes on loopback: a
//! `[parallel] pp = 2, tp = 2` GPT job on 4 processes stops after step 8 with a sharded checkpoint
//! (one shard per slot plus `index.json`); the same run resumed on 1 process (plain data
//! parallelism, reading the checkpoint whole) and at `pp = 4` on 4 processes (each member reading
//! its part) commits the same losses as the uninterrupted `pp = 2, tp = 2` run, within 1e-5
//! relative. `pipelines/tests/mesh_resume.rs` checks the same in-process, parameters and
//! optimizer state included.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::{Path, PathBuf};

use serde_json::Value;
use support::Launch;

/// Steps before the stop; the run has 16.
const STOP: u64 = 8;

/// tests/configs/resume_gpt_3d.toml with `[parallel]` set to `pp`, `tp` (written next to `out`).
fn config(pp: usize, tp: usize, out: &Path) -> PathBuf {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/configs/resume_gpt_3d.toml");
    let text = std::fs::read_to_string(base).unwrap();
    // 1F1B wants at least as many micro-batches as stages.
    let text = text.replace("pp = 2\ntp = 2\nmicrobatches = 2\n", &format!("pp = {pp}\ntp = {tp}\nmicrobatches = {}\n", pp.max(2)));
    assert!(text.contains(&format!("pp = {pp}\ntp = {tp}\n")));
    let path = out.with_file_name(format!("resume_gpt_pp{pp}_tp{tp}.toml"));
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, text).unwrap();
    path
}

/// `(step, loss)` of every committed step, in step order (the last commit of a step wins).
fn losses(events: &[Value]) -> Vec<(u64, f64)> {
    let mut by_step = std::collections::BTreeMap::new();
    for e in events.iter().filter(|e| e["event"] == "committed") {
        by_step.insert(e["step"].as_u64().unwrap(), e["loss"].as_f64().unwrap());
    }
    by_step.into_iter().collect()
}

fn assert_close(what: &str, reference: &[(u64, f64)], got: &[(u64, f64)]) {
    assert_eq!(reference.iter().map(|(s, _)| *s).collect::<Vec<_>>(), got.iter().map(|(s, _)| *s).collect::<Vec<_>>(), "{what}: steps");
    let worst = reference.iter().zip(got).map(|((_, a), (_, b))| (a - b).abs() / a.abs()).fold(0f64, f64::max);
    eprintln!("{what}: {} losses, worst relative difference {worst:.2e}", got.len());
    assert!(worst <= 1e-5, "{what}: {reference:?} vs {got:?}");
}

#[test]
fn a_pp2_tp2_run_resumes_on_one_process_and_at_pp4() {
    let root = Launch::fresh_out();
    let (straight_cfg, one_cfg, pp4_cfg) = (config(2, 2, &root), config(1, 1, &root), config(4, 1, &root));
    let (_, straight) = Launch::start_in(root.join("straight"), &straight_cfg, 4, &[]).finish();
    let reference: Vec<(u64, f64)> = losses(&straight).into_iter().filter(|(s, _)| *s >= STOP).collect();
    assert_eq!(reference.len(), 8, "the uninterrupted run commits steps 8..16");

    // Stop after step 8 (steps 0..=7): the final sharded checkpoint is of step 7.
    let stopped = root.join("stopped");
    let (_, first) = Launch::start_in(stopped.clone(), &straight_cfg, 4, &["--steps", &STOP.to_string()]).finish();
    assert!(first.iter().any(|e| e["event"] == "checkpointed" && e["step"] == STOP - 1), "a checkpoint after step {STOP}: {first:?}");
    let ckpt = stopped.join("checkpoints").join(format!("step-{:08}", STOP - 1));
    for label in ["pp0-tp0", "pp0-tp1", "pp1-tp0", "pp1-tp1"] {
        assert!(ckpt.join(format!("shard-{label}.safetensors")).is_file(), "shard {label} in {}", ckpt.display());
    }
    assert!(ckpt.join("index.json").is_file());

    // Resume the same run at two other shapes (copies of the stopped run's folder).
    for (name, cfg, nproc) in [("one process", &one_cfg, 1), ("pp = 4", &pp4_cfg, 4)] {
        let out = root.join(name.replace([' ', '='], ""));
        copy_dir(&stopped, &out);
        let (_, resumed) = Launch::start_in(out, cfg, nproc, &["--resume"]).finish();
        // The resumed launch appends to the stopped run's events.
        let generation = resumed.iter().rev().find(|e| e["event"] == "generation").expect("generation");
        assert_eq!(generation["next_step"], STOP, "{name}: resumed after the checkpoint");
        let after: Vec<(u64, f64)> = losses(&resumed).into_iter().filter(|(s, _)| *s >= STOP).collect();
        assert_close(&format!("pp=2,tp=2 -> {name}"), &reference, &after);
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}
