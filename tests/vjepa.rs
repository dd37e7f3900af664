//! V-JEPA end to end on moving Fashion-MNIST clips: `rtx train` with `model.kind = "vjepa"` trains
//! without collapse and its frozen features beat chance for both labels (the item's class and its
//! motion direction) in the linear probe, k-NN and the attentive probe; resume is bit-exact (EMA
//! buffers and the clip epochs carried by the checkpoint); a bad `[video]` is named; under
//! `rtx launch --nproc 2` a `kill -9` of one worker costs at most the step in flight and the
//! replicas (parameters and EMA buffers) end bit-identical.
//!
//! Needs the Fashion-MNIST data (`bash scripts/fetch-data.sh`). The clips are small (40x40 canvas,
//! 4 frames, 2x10x10 tubelets: 32 tokens) so the suite stays quick on 2 cores.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use rustytorch::config::TrainConfig;
use rustytorch::data::DataRoot;
use rustytorch::metrics::read_metrics;
use rustytorch::train::{TrainOptions, Trainer};
use serde_json::Value;
use support::{signal, state_bits, Launch};

/// Collapse floor: every clip mapped to one vector gives 0.
const FEATURE_STD_FLOOR: f64 = 0.05;

const MOVING_VJEPA: &str = r#"
[model]
kind = "vjepa"
patch_size = 10
d_model = 32
n_layers = 2
n_heads = 2

[video]
canvas = 40
frames = 4
tubelet = 2
directions = 4
speed = [3.0, 4.0]
attentive_epochs = 2

[jepa]
predictor_width = 16
predictor_depth = 1
predictor_heads = 2
n_targets = 2
min_keep = 2
probe_every = 60
probe_train_images = 1000
probe_test_images = 500
final_probe_train_images = 1000
final_probe_test_images = 500
probe_epochs = 5
probe_features = ["mean", "tokens"]
pixel_baseline = false

[data]
dataset = "fashion-mnist"
val_fraction = 0.1
batch_size = 32

[optim]
kind = "adamw"
lr = 2e-3
weight_decay = 0.04
betas = [0.9, 0.95]
grad_clip = 1.0

[schedule]
kind = "warmup-cosine"
warmup_steps = 5
min_lr = 1e-5

[train]
steps = 120
seed = 5
log_every = 10
eval_every = 60
eval_batches = 1
"#;

fn data() -> DataRoot {
    DataRoot::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("data"))
}

fn options(out: PathBuf, resume: bool) -> TrainOptions {
    TrainOptions { out_dir: Some(out), resume, ..TrainOptions::new(data()) }
}

#[test]
fn vjepa_probes_beat_chance_for_class_and_direction() {
    // Goal: a short V-JEPA run keeps its features spread, its latent loss falls, and the final
    // probes beat chance (class 10%, direction 25%) by a wide margin for every probe kind.
    // Method: train.seed 5 (fixed; change it in MOVING_VJEPA to replay another), probes on the
    // first 1,000 train / 500 test clips.
    let tmp = tempfile::tempdir().unwrap();
    let config = TrainConfig::from_toml_str(MOVING_VJEPA).unwrap();
    println!("seed {}", config.train.seed);
    let out = tmp.path().join("run");
    let mut trainer = Trainer::new(config, options(out.clone(), false)).unwrap();
    trainer.train_until(120).unwrap();
    let report = trainer.finish().unwrap();
    let records = read_metrics(&out.join("metrics.jsonl")).unwrap();
    let stds: Vec<(u64, f64)> = records.iter().filter_map(|r| Some((r.step, r.feature_std?))).collect();
    assert_eq!(stds.len(), 12, "{stds:?}");
    assert!(stds.iter().all(|(_, s)| *s > FEATURE_STD_FLOOR), "collapse: {stds:?}");
    let losses: Vec<f64> = records.iter().filter_map(|r| r.loss).collect();
    assert!(losses.last().unwrap() < &(losses[0] * 0.8), "the latent loss did not fall: {losses:?}");
    // The periodic probe at step 40 and the final one, each with both labels and the attentive probe.
    let probes: Vec<_> = records.iter().filter(|r| r.probe_acc.is_some()).collect();
    assert_eq!(probes.len(), 2, "{probes:?}");
    for r in &probes {
        assert!(
            r.direction_probe_acc.is_some() && r.direction_knn_acc.is_some() && r.attentive_probe_acc.is_some() && r.attentive_direction_acc.is_some(),
            "{r:?}"
        );
        let named: Vec<(&str, usize)> = r.probe_readouts.iter().map(|x| (x.readout.as_str(), x.dim)).collect();
        // 2 slots x 4x4 tokens of width 32.
        assert_eq!(named, [("mean", 32), ("tokens", 32 * 32)]);
    }
    let p = report.probes.expect("final probes");
    let mean = &p.readouts[0];
    let (dir_probe, dir_knn) = mean.direction.expect("direction accuracies");
    let (att_class, att_dir) = p.attentive.expect("attentive probe");
    println!(
        "class: linear {:.3} k-NN {:.3} attentive {att_class:.3}; direction: linear {dir_probe:.3} k-NN {dir_knn:.3} attentive {att_dir:.3}; tokens {:?} {:?}",
        p.probe_acc,
        p.knn_acc,
        (p.readouts[1].probe_acc, p.readouts[1].knn_acc),
        p.readouts[1].direction
    );
    // Seed 5 measured: class 32 / 36 / 41%; direction (mean) 31 / 39%, tokens 99.6%, attentive 84%.
    assert!(p.probe_acc > 0.25 && p.knn_acc > 0.25 && att_class > 0.3, "class (chance 0.1): linear {}, k-NN {}, attentive {att_class}", p.probe_acc, p.knn_acc);
    let (tok_probe, _) = p.readouts[1].direction.expect("tokens direction");
    assert!(
        tok_probe > 0.8 && att_dir > 0.6 && dir_knn.max(dir_probe) > 0.33,
        "direction (chance 0.25): mean linear {dir_probe}, k-NN {dir_knn}, tokens linear {tok_probe}, attentive {att_dir}"
    );
    assert!(out.join("loss.png").exists());
}

#[test]
fn vjepa_resume_is_bit_exact() {
    // Goal: 5 steps + checkpoint + resume + 5 steps equals 10 straight, with the EMA buffers and
    // the clips of each step (drawn by epoch from the restored sampler cursor).
    let tmp = tempfile::tempdir().unwrap();
    let config = TrainConfig::from_toml_str(&MOVING_VJEPA.replace("steps = 120", "steps = 10")).unwrap();
    let mut straight = Trainer::new(config.clone(), options(tmp.path().join("straight"), false)).unwrap();
    straight.train_until(10).unwrap();
    let expected = state_bits(&straight);
    let out = tmp.path().join("split");
    let mut first = Trainer::new(config.clone(), options(out.clone(), false)).unwrap();
    first.train_until(5).unwrap();
    first.save_checkpoint().unwrap();
    drop(first);
    let mut resumed = Trainer::new(config, options(out, true)).unwrap();
    resumed.train_until(10).unwrap();
    assert_eq!(state_bits(&resumed), expected, "5 + resume + 5 steps differ from 10 straight");
}

#[test]
fn a_bad_video_config_is_named() {
    let cases = [
        (MOVING_VJEPA.replace("kind = \"vjepa\"", "kind = \"ijepa\""), "video"),
        (MOVING_VJEPA.replace("canvas = 40", "canvas = 30"), "video.canvas"),
        (MOVING_VJEPA.replace("frames = 4", "frames = 5"), "video.frames"),
        (MOVING_VJEPA.replace("patch_size = 10", "patch_size = 7"), "model.patch_size"),
        (MOVING_VJEPA.replace("d_model = 32", "d_model = 36"), "model.d_model"),
        (MOVING_VJEPA.replace("probe_features = [\"mean\", \"tokens\"]", "probe_features = [\"grid2\"]"), "jepa.probe_features"),
        (MOVING_VJEPA.replace("directions = 4", "directions = 4\nfps = 3"), "fps"),
    ];
    for (text, key) in cases {
        let err = TrainConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(err.contains(key), "expected an error naming {key}: {err}");
    }
}

#[test]
fn vjepa_under_launch_survives_a_killed_worker_with_identical_replicas() {
    // Goal: elastic DP of a V-JEPA job: one `kill -9` costs at most the step in flight, the
    // replicas (parameters and EMA buffers) end bit-identical, and the final probes still beat
    // chance. Method: as tests/ijepa.rs, kill worker 1 once step 100 is committed.
    let dir = tempfile::tempdir().expect("tempdir").keep();
    let config = dir.join("vjepa.toml");
    let text = MOVING_VJEPA.replace("steps = 120", "steps = 300").replace("probe_every = 60", "probe_every = 0").replace("eval_every = 60", "eval_every = 0")
        + "\n[elastic]\nheartbeat_interval_ms = 100\nheartbeat_timeout_ms = 1000\nverify_every = 10\n";
    std::fs::write(&config, text).unwrap();
    let launch = Launch::start_in(dir.join("run"), &config, 2, &[]);
    let events = launch.wait_for("step 100", Duration::from_secs(180), |e| Launch::committed(e).is_some_and(|s| s >= 100));
    let victim = launch.pids()[1];
    let before = Launch::committed(&events).expect("committed");
    signal(victim, "-9");
    // `finish` checks that the replicas ended bit-identical (the checksum covers the buffers).
    let (summary, events) = launch.finish();
    let lost: Vec<&Value> = events.iter().filter(|e| e["event"] == "lost").collect();
    assert_eq!(lost.len(), 1, "{lost:?}");
    let generations: Vec<&Value> = events.iter().filter(|e| e["event"] == "generation").collect();
    assert_eq!(generations.len(), 2, "{generations:?}");
    let next = generations[1]["next_step"].as_u64().expect("next_step");
    assert!(next > before, "resumed at {next}, but step {before} was committed before the kill");
    let eval = &summary["eval"];
    for key in ["probe_acc", "knn_acc", "direction_probe_acc", "direction_knn_acc", "attentive_probe_acc", "attentive_direction_acc"] {
        assert!(eval[key].as_f64().is_some(), "{key} missing: {eval}");
    }
    let (class, direction) = (eval["probe_acc"].as_f64().unwrap(), eval["attentive_direction_acc"].as_f64().unwrap());
    assert!(class > 0.25 && direction > 0.5, "after recovery: class {class} (chance 0.1), attentive direction {direction} (chance 0.25)");
}
