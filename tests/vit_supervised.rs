//! The supervised ViT twin of the I-JEPA encoder (`model.kind = "vit"`): `rtx train` learns to
//! classify real images end to end (validation accuracy well above chance and the loss falling),
//! resume is bit-exact, it trains data-parallel under `rtx launch` through a kill -9, and wrong
//! configurations are refused with the key that is wrong.
//!
//! Uses the digits fixture (8×8 images, no download).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use rustytorch::config::{ModelConfig, TrainConfig};
use rustytorch::metrics::read_metrics;
use rustytorch::train::Trainer;
use serde_json::Value;
use support::{digits, signal, state_bits, train_options as options, Launch};

const DIGITS_VIT: &str = r#"
[model]
kind = "vit"
patch_size = 4
d_model = 32
n_layers = 2
n_heads = 2

[data]
dataset = "digits"
val_fraction = 0.2
batch_size = 64

[optim]
kind = "adamw"
lr = 5e-3
weight_decay = 0.04
betas = [0.9, 0.95]
grad_clip = 1.0

[schedule]
kind = "warmup-cosine"
warmup_steps = 5
min_lr = 1e-5

[train]
steps = 150
seed = 5
log_every = 10
eval_every = 50
"#;

#[test]
fn the_supervised_vit_learns_to_classify_digits() {
    let tmp = tempfile::tempdir().unwrap();
    let data = digits(tmp.path());
    let config = TrainConfig::from_toml_str(DIGITS_VIT).unwrap();
    assert_eq!(config.model, ModelConfig::Vit { patch_size: 4, d_model: 32, n_layers: 2, n_heads: 2 });
    let out = tmp.path().join("run");
    let mut trainer = Trainer::new(config, options(&data, out.clone(), false)).unwrap();
    // Encoder, final norm and head: the twin has the I-JEPA encoder's parameters plus a head.
    let names: Vec<String> = trainer.model().module().named_parameters().into_iter().map(|(n, _)| n).collect();
    assert!(names.iter().any(|n| n == "head.weight") && names.iter().any(|n| n == "pos_embed"), "{names:?}");
    trainer.train_until(150).unwrap();
    let report = trainer.finish().unwrap();
    let records = read_metrics(&out.join("metrics.jsonl")).unwrap();
    let losses: Vec<f64> = records.iter().filter_map(|r| r.loss).collect();
    assert!(losses.last().unwrap() < &(losses[0] * 0.5), "the loss did not fall: {losses:?}");
    let accuracy = report.val.accuracy.expect("a classifier reports its accuracy");
    // 10 classes (chance 0.1); 150 steps of this 2-block ViT on 2x2 patches of 4x4 pixels reach
    // 0.89 on the 359 validation images (seed 5).
    assert!(accuracy > 0.7, "validation accuracy {accuracy}");
    assert!(out.join("loss.png").exists());
}

#[test]
fn supervised_vit_resume_is_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let data = digits(tmp.path());
    let text = DIGITS_VIT.replace("steps = 150", "steps = 12").replace("eval_every = 50", "eval_every = 6\ncheckpoint_every = 6");
    let straight_out = tmp.path().join("straight");
    let mut straight = Trainer::new(TrainConfig::from_toml_str(&text).unwrap(), options(&data, straight_out, false)).unwrap();
    straight.train_until(12).unwrap();
    let resumed_out = tmp.path().join("resumed");
    let mut first = Trainer::new(TrainConfig::from_toml_str(&text).unwrap(), options(&data, resumed_out.clone(), false)).unwrap();
    first.train_until(6).unwrap();
    first.save_checkpoint().unwrap();
    drop(first);
    let mut resumed = Trainer::new(TrainConfig::from_toml_str(&text).unwrap(), options(&data, resumed_out, true)).unwrap();
    resumed.train_until(12).unwrap();
    assert_eq!(state_bits(&straight), state_bits(&resumed));
}

#[test]
fn wrong_supervised_vit_configs_name_the_key() {
    for (bad, key) in [
        (DIGITS_VIT.replace("patch_size = 4", "patch_size = 3"), "model.patch_size"),
        (DIGITS_VIT.replace("n_heads = 2", "n_heads = 3"), "model.n_heads"),
        (DIGITS_VIT.replace("d_model = 32", "d_model = 30"), "model.d_model"),
        (DIGITS_VIT.replace("n_layers = 2", "n_layers = 2\nhidden = [8]"), "model.hidden"),
        (DIGITS_VIT.replace("[data]", "[jepa]\nn_targets = 2\n\n[data]"), "jepa"),
        (DIGITS_VIT.replace("dataset = \"digits\"", "dataset = \"sotu\""), "data.dataset"),
    ] {
        let err = TrainConfig::from_toml_str(&bad).unwrap_err().to_string();
        assert!(err.contains(key), "expected an error naming {key}: {err}");
    }
    let err = TrainConfig::from_toml_str(&DIGITS_VIT.replace("dataset = \"digits\"", "dataset = \"sotu\"")).unwrap_err().to_string();
    assert!(err.contains("model.kind = \"vit\" trains on images"), "{err}");
}

// Goal: the supervised twin is an elastic job like the others: `rtx launch --nproc 2` trains it
// data-parallel, a kill -9 of one worker loses at most the step in flight, the replicas end
// bit-identical (checked by `finish`) and the final validation accuracy (digits has no test split) is that of a trained classifier.
#[test]
fn the_supervised_vit_trains_under_rtx_launch_and_survives_a_kill() {
    let dir = tempfile::tempdir().unwrap().keep();
    let data = digits(&dir);
    let config = dir.join("vit.toml");
    std::fs::write(&config, DIGITS_VIT.replace("steps = 150", "steps = 160")).unwrap();
    let data_dir = data.path().to_str().unwrap().to_string();
    let launch = Launch::start_in(dir.join("run"), &config, 2, &["--data-dir", &data_dir]);
    let events = launch.wait_for("step 40", Duration::from_secs(120), |e| Launch::committed(e).is_some_and(|s| s >= 40));
    let before = Launch::committed(&events).expect("committed");
    signal(launch.pids()[1], "-9");
    let (summary, events) = launch.finish();
    let lost: Vec<&Value> = events.iter().filter(|e| e["event"] == "lost").collect();
    assert_eq!(lost.len(), 1, "{lost:?}");
    let generations: Vec<&Value> = events.iter().filter(|e| e["event"] == "generation").collect();
    let next = generations.last().and_then(|g| g["next_step"].as_u64()).expect("next_step");
    assert!(next > before, "resumed at {next}, but step {before} was committed before the kill");
    let acc = summary["eval"]["val_acc"].as_f64().unwrap_or_else(|| panic!("no val_acc in {}", summary["eval"]));
    assert!(acc > 0.7, "validation accuracy {acc} after recovery (chance 0.1)");
}
