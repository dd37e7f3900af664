//! The library trainer (`rustytorch::train`): resume is bit-exact and runs are deterministic.
//!
//! Data: the digits fixture committed at `tensor/tests/fixtures/digits.csv.gz` (copied into a
//! temporary data folder) and a small synthetic text corpus, so no download is needed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use rustytorch::config::TrainConfig;
use rustytorch::data::DataRoot;
use rustytorch::train::{self, TrainError, TrainOptions, Trainer};

const DIGITS_MLP: &str = r#"
[model]
kind = "mlp"
hidden = [24, 16]
activation = "gelu"

[data]
dataset = "digits"
val_fraction = 0.2
batch_size = 64

[optim]
kind = "adamw"
lr = 5e-3
weight_decay = 0.05
grad_clip = 1.0

[schedule]
kind = "warmup-cosine"
warmup_steps = 5
total_steps = 30
min_lr = 1e-4

[train]
steps = 30
seed = 7
log_every = 5
eval_every = 10
"#;

/// A data folder holding the digits fixture (and, with `text`, a small `sotu` corpus).
fn data_dir(root: &Path, text: bool) -> DataRoot {
    let data = DataRoot::new(root.join("data"));
    std::fs::create_dir_all(data.path().join("digits")).unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tensor/tests/fixtures/digits.csv.gz");
    std::fs::copy(&fixture, data.digits_csv()).unwrap();
    if text {
        std::fs::create_dir_all(data.sotu()).unwrap();
        for (i, name) in ["1790_a.txt", "1800_b.txt", "1810_c.txt"].iter().enumerate() {
            let body: String = (0..300).map(|k| format!("The union {} is strong in year {}. ", ["and", "of", "by"][(k + i) % 3], 1790 + k % 37)).collect();
            std::fs::write(data.sotu().join(name), body).unwrap();
        }
    }
    data
}

fn options(data: &DataRoot, out: PathBuf, resume: bool) -> TrainOptions {
    TrainOptions { out_dir: Some(out), resume, ..TrainOptions::new(data.clone()) }
}

/// Every parameter's f32 bits, by name.
fn param_bits(trainer: &Trainer) -> Vec<(String, Vec<u32>)> {
    trainer.named_parameters().into_iter().map(|(n, t)| (n, t.to_f32_vec().unwrap().into_iter().map(f32::to_bits).collect())).collect()
}

/// Trains `n` steps straight, and `n/2` + checkpoint + new process-like trainer + resume + `n/2`,
/// and compares the final parameters bit for bit.
fn check_resume_bit_exact(config_text: &str, text: bool, n: u64) {
    let tmp = tempfile::tempdir().unwrap();
    let data = data_dir(tmp.path(), text);
    let config = TrainConfig::from_toml_str(config_text).unwrap();

    let mut straight = Trainer::new(config.clone(), options(&data, tmp.path().join("straight"), false)).unwrap();
    straight.train_until(n).unwrap();
    let expected = param_bits(&straight);

    let out = tmp.path().join("split");
    let mut first = Trainer::new(config.clone(), options(&data, out.clone(), false)).unwrap();
    first.train_until(n / 2).unwrap();
    let ckpt = first.save_checkpoint().unwrap();
    assert!(ckpt.exists(), "{}", ckpt.display());
    let halfway = param_bits(&first);
    drop(first);

    let mut resumed = Trainer::new(config, options(&data, out, true)).unwrap();
    assert_eq!(resumed.step(), n / 2);
    assert_eq!(param_bits(&resumed), halfway, "checkpoint round trip changed parameters");
    resumed.train_until(n).unwrap();
    let got = param_bits(&resumed);
    assert_eq!(got.len(), expected.len());
    for ((name, a), (name_b, b)) in got.iter().zip(&expected) {
        assert_eq!(name, name_b);
        let diff = a.iter().zip(b).filter(|(x, y)| x != y).count();
        assert_eq!(diff, 0, "{name}: {diff} of {} elements differ after resume", a.len());
    }
}

#[test]
fn mlp_resume_is_bit_exact() {
    // Goal: a checkpoint holds everything the next step depends on (parameters, AdamW moments and
    // step counts, the data cursor in the middle of an epoch, the schedule position).
    // 30 steps of 64 over 1438 training images: the halfway point is mid-epoch.
    check_resume_bit_exact(DIGITS_MLP, false, 30);
}

#[test]
fn gpt_resume_with_dropout_is_bit_exact() {
    // Goal: the dropout generator's position and the text sampler (a function of the step) are
    // restored too. Method: a tiny GPT with dropout on a synthetic corpus, SGD with momentum.
    let gpt = r#"
[model]
kind = "gpt"
n_layers = 1
d_model = 16
n_heads = 2
context = 16
dropout = 0.2

[data]
dataset = "sotu"
batch_size = 4

[optim]
kind = "sgd"
lr = 0.05
momentum = 0.9

[train]
steps = 12
seed = 3
log_every = 4
"#;
    check_resume_bit_exact(gpt, true, 12);
}

#[test]
fn same_seed_gives_identical_losses() {
    // Goal: training takes randomness only from the seed. Method: two full runs with seed 7 give
    // identical per-step losses and final metrics; seed 8 gives different ones.
    let tmp = tempfile::tempdir().unwrap();
    let data = data_dir(tmp.path(), false);
    let run = |seed: u64, out: &str| {
        let config = TrainConfig::from_toml_str(&DIGITS_MLP.replace("seed = 7", &format!("seed = {seed}"))).unwrap();
        train::run(&config, options(&data, tmp.path().join(out), false)).unwrap()
    };
    let a = run(7, "a");
    let b = run(7, "b");
    let c = run(8, "c");
    assert_eq!(a.losses.len(), 30);
    assert_eq!(a.losses.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), b.losses.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
    assert_eq!(a.val, b.val);
    assert_ne!(a.losses, c.losses);
    // Learning happened: the last losses are well below the first.
    let (first, last) = (a.losses[0], a.losses[25..].iter().sum::<f64>() / 5.0);
    assert!(last < first * 0.7, "loss went from {first} to {last}");
    assert!(a.val.accuracy.unwrap() > 0.3, "{:?}", a.val);
    // The metrics files agree once wall time is removed.
    let strip = |out: &str| -> Vec<serde_json::Value> {
        std::fs::read_to_string(tmp.path().join(out).join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
                for k in ["wall_s", "samples_per_s", "tokens_per_s"] {
                    v.as_object_mut().unwrap().remove(k);
                }
                v
            })
            .collect()
    };
    assert_eq!(strip("a"), strip("b"));
}

#[test]
fn fresh_run_refuses_an_output_folder_with_checkpoints() {
    // Goal: nothing is overwritten by accident. Method: a second run without resume into the
    // same folder is refused with a message naming --resume.
    let tmp = tempfile::tempdir().unwrap();
    let data = data_dir(tmp.path(), false);
    let config = TrainConfig::from_toml_str(&DIGITS_MLP.replace("steps = 30\n", "steps = 4\n").replace("total_steps = 30", "total_steps = 4").replace("warmup_steps = 5", "warmup_steps = 1")).unwrap();
    let out = tmp.path().join("out");
    train::run(&config, options(&data, out.clone(), false)).unwrap();
    match train::run(&config, options(&data, out.clone(), false)) {
        Err(e @ TrainError::OutputInUse { .. }) => assert!(e.to_string().contains("--resume"), "{e}"),
        other => panic!("expected OutputInUse, got {:?}", other.map(|r| r.step)),
    }
    // Resuming a finished run is a no-op that reports the same step.
    let again = train::run(&config, options(&data, out.clone(), true)).unwrap();
    assert_eq!(again.step, 4);
    assert!(again.losses.is_empty());
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().filter(|l| l.contains("val_loss")).count(), 1, "final records written twice:\n{metrics}");
}

#[test]
fn resume_with_a_different_model_is_refused() {
    // Goal: a checkpoint never loads into a run it does not belong to.
    let tmp = tempfile::tempdir().unwrap();
    let data = data_dir(tmp.path(), false);
    let config = TrainConfig::from_toml_str(DIGITS_MLP).unwrap();
    let out = tmp.path().join("out");
    let mut t = Trainer::new(config, options(&data, out.clone(), false)).unwrap();
    t.train_until(2).unwrap();
    t.save_checkpoint().unwrap();
    drop(t);
    let other = TrainConfig::from_toml_str(&DIGITS_MLP.replace("hidden = [24, 16]", "hidden = [24]")).unwrap();
    let err = Trainer::new(other, options(&data, out, true)).err().expect("must refuse");
    assert!(err.to_string().contains("[model]"), "{err}");
}
