//! The library trainer (`rustytorch::train`): resume is bit-exact and runs are deterministic.
//!
//! Data: the digits fixture committed at `tensor/tests/fixtures/digits.csv.gz` (copied into a
//! temporary data folder) and a small synthetic text corpus, so no download is needed; except the
//! GPT-2 tokenizer run of `configs/gpt2_bpe_tiny.toml`, which reads the real SOTU corpus
//! (`bash scripts/fetch-data.sh`) and writes its token cache there, as `rtx train` does.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::Path;

use rustytorch::config::TrainConfig;
use rustytorch::data::{tokenize_corpus_cached, DataRoot, Gpt2Tokenizer, TextCorpus, GPT2_EOT};
use rustytorch::train::{self, TrainError, TrainOptions, Trainer};
use support::train_options as options;

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
    let config = TrainConfig::from_toml_str(
        &DIGITS_MLP.replace("steps = 30\n", "steps = 4\n").replace("total_steps = 30", "total_steps = 4").replace("warmup_steps = 5", "warmup_steps = 1"),
    )
    .unwrap();
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

#[test]
fn gpt2_tokenizer_trains_the_tiny_config_on_sotu() {
    // Goal: `[data] tokenizer = "gpt2"` trains end to end through the CLI's entry
    // (`train::run_file`): the corpus is tokenized (or its cache read), the model predicts 50,257
    // tokens, so the first loss is ln(50257) = 10.82 nats/token at init, and it falls; the sample
    // is decoded text. Method: configs/gpt2_bpe_tiny.toml on the real SOTU corpus, stopped after 12
    // steps (`--steps 12`), with a 2-step warmup instead of 50 (so 12 steps reach the peak rate: the
    // loss falls ~0.4 nats) and a smaller validation tail so the final evaluation stays short.
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("configs/gpt2_bpe_tiny.toml")).unwrap();
    let text =
        text.replace("val_fraction = 0.02", "val_fraction = 0.002").replace("length = 100", "length = 20").replace("warmup_steps = 50", "warmup_steps = 2");
    let tmp = tempfile::tempdir().unwrap();
    let config_path = tmp.path().join("gpt2_bpe_tiny.toml");
    std::fs::write(&config_path, &text).unwrap();
    let data = DataRoot::new(root.join("data"));
    let options = TrainOptions { stop_at: Some(12), ..options(&data, tmp.path().join("out"), false) };
    let report = train::run_file(&config_path, options).unwrap();
    assert_eq!(report.losses.len(), 12);
    assert!(report.losses.iter().all(|l| l.is_finite()), "{:?}", report.losses);
    let ln_v = (50_257f64).ln();
    assert!((report.losses[0] - ln_v).abs() < 0.1, "first loss {} vs ln(50257) = {ln_v}", report.losses[0]);
    let last = report.losses[9..].iter().sum::<f64>() / 3.0;
    assert!(last < report.losses[0] - 0.2, "the loss did not fall: {:?}", report.losses);
    assert!(report.val.loss.is_finite() && report.val.loss < ln_v + 0.1, "{:?}", report.val);
    assert_eq!(report.text_unit, Some("token"));
    let h = report.unigram_entropy_nats.unwrap();
    assert!(h > 5.0 && h < ln_v, "unigram entropy {h} nats/token");
    // Tied 50,304-row token table (padded), 64-row positions, two blocks of C 64.
    assert_eq!(report.parameters, 50_304 * 64 + 64 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64);
    let sample = report.sample.unwrap();
    assert!(sample.starts_with("Fellow-Citizens of the Senate and House of Representatives:") && sample.len() > 60, "{sample}");
    assert!(data.sotu().join("gpt2-tokens.bin").exists());
    let summary = train::summary(&train::TrainReport { sample: None, ..report }).join("\n");
    assert!(summary.contains("nats/token") && !summary.contains("nats/byte"), "{summary}");
}

#[test]
fn a_damaged_or_stale_gpt2_token_cache_is_rebuilt_by_the_run() {
    // Goal: a run never trains on a cache made from other text or a damaged one: the trainer
    // rebuilds `<data>/sotu/gpt2-tokens.bin` from the corpus. Method: a synthetic corpus; garbage,
    // a truncated file and a cache of other text in place of the cache; each time the file after
    // `Trainer::new` is the one a fresh tokenization writes, and training steps.
    let tmp = tempfile::tempdir().unwrap();
    let data = data_dir(tmp.path(), true);
    let gpt = r#"
[model]
kind = "gpt"
gelu = "tanh"
n_layers = 1
d_model = 16
n_heads = 2
context = 16

[data]
dataset = "sotu"
tokenizer = "gpt2"
batch_size = 4

[optim]
kind = "adamw"
lr = 1e-3

[train]
steps = 2
"#;
    let config = TrainConfig::from_toml_str(gpt).unwrap();
    let cache = data.sotu().join("gpt2-tokens.bin");
    let corpus = TextCorpus::load_dir(&data.sotu()).unwrap();
    let reference = tmp.path().join("reference.bin");
    let expected_ids = tokenize_corpus_cached(&corpus, &reference).unwrap();
    let expected = std::fs::read(&reference).unwrap();
    // The ids are GPT-2's: each document encoded alone and followed by <|endoftext|>.
    let t = Gpt2Tokenizer::new().unwrap();
    let first_doc = std::fs::read_to_string(data.sotu().join("1790_a.txt")).unwrap();
    assert_eq!(expected_ids[..expected_ids.iter().position(|&i| i == GPT2_EOT).unwrap()], t.encode(&first_doc)[..]);
    let other = TextCorpus::from_documents([("x.txt", b"Hello world".to_vec())]);
    let stale = tmp.path().join("stale.bin");
    tokenize_corpus_cached(&other, &stale).unwrap();
    let damaged: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", b"not a token cache".to_vec()),
        ("truncated", expected[..expected.len() - 3].to_vec()),
        ("other text", std::fs::read(&stale).unwrap()),
    ];
    for (i, (what, bytes)) in damaged.into_iter().enumerate() {
        std::fs::write(&cache, &bytes).unwrap();
        let mut trainer = Trainer::new(config.clone(), options(&data, tmp.path().join(format!("out{i}")), false)).unwrap();
        assert_eq!(std::fs::read(&cache).unwrap(), expected, "{what}: the cache was not rebuilt");
        trainer.train_until(2).unwrap();
        assert_eq!(trainer.step(), 2);
    }
    let leftovers: Vec<_> =
        std::fs::read_dir(data.sotu()).unwrap().map(|e| e.unwrap().file_name()).filter(|n| n.to_string_lossy().contains("staging")).collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}
