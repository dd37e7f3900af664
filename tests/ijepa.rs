//! I-JEPA end to end: `rtx train` with `model.kind = "ijepa"` does not collapse (the feature
//! standard deviation stays above a floor at every log step) and its frozen features beat chance
//! in the probes; resume is bit-exact with the EMA target encoder (buffers) in the checkpoint;
//! under `rtx launch --nproc 2` a `kill -9` of one worker costs at most the step in flight and the
//! replicas (parameters and EMA buffers) end bit-identical.
//!
//! The trainer tests use the digits fixture (8×8 images, no download); the elastic test needs the
//! Fashion-MNIST data (`bash scripts/fetch-data.sh`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use rustytorch::config::TrainConfig;
use rustytorch::metrics::read_metrics;
use rustytorch::train::Trainer;
use serde_json::Value;
use support::{digits, signal, state_bits, train_options as options, Launch};

/// Collapse floor of the reference config: a healthy run stays around 0.2-0.5; every image
/// mapped to one vector gives 0.
const FEATURE_STD_FLOOR: f64 = 0.05;

const DIGITS_IJEPA: &str = r#"
[model]
kind = "ijepa"
patch_size = 2
d_model = 32
n_layers = 2
n_heads = 2

[jepa]
predictor_width = 16
predictor_depth = 1
predictor_heads = 2
n_targets = 2
probe_every = 20
probe_train_images = 800
probe_test_images = 300
probe_epochs = 10
probe_features = ["mean", "grid2", "mean-last4"]
final_weight_decay = 0.2

[data]
dataset = "digits"
val_fraction = 0.2
batch_size = 64

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
steps = 40
seed = 3
log_every = 5
eval_every = 20
"#;

#[test]
fn ijepa_does_not_collapse_and_its_probes_beat_chance() {
    let tmp = tempfile::tempdir().unwrap();
    let data = digits(tmp.path());
    let config = TrainConfig::from_toml_str(DIGITS_IJEPA).unwrap();
    let out = tmp.path().join("run");
    let mut trainer = Trainer::new(config, options(&data, out.clone(), false)).unwrap();
    let before: Vec<(String, Vec<u32>)> = state_bits(&trainer).into_iter().filter(|(n, _)| n.starts_with("target_encoder.")).collect();
    trainer.train_until(40).unwrap();
    let after: Vec<(String, Vec<u32>)> = state_bits(&trainer).into_iter().filter(|(n, _)| n.starts_with("target_encoder.")).collect();
    assert_ne!(before, after, "the EMA target encoder never moved");
    let report = trainer.finish().unwrap();
    let records = read_metrics(&out.join("metrics.jsonl")).unwrap();
    let stds: Vec<(u64, f64)> = records.iter().filter_map(|r| Some((r.step, r.feature_std?))).collect();
    assert_eq!(stds.len(), 8, "a feature std at every log step: {stds:?}");
    for (step, std) in &stds {
        assert!(*std > FEATURE_STD_FLOOR, "collapse: feature std {std} at step {step} (floor {FEATURE_STD_FLOOR})");
    }
    let losses: Vec<f64> = records.iter().filter_map(|r| r.loss).collect();
    assert!(losses.last().unwrap() < &(losses[0] * 0.8), "the latent loss did not fall: {losses:?}");
    // Periodic probes at step 20 and the final one (all 1,437 train / 360 validation images).
    let probes: Vec<_> = records.iter().filter(|r| r.probe_acc.is_some()).collect();
    assert_eq!(probes.len(), 2, "{probes:?}");
    // Every readout is probed from the same encoder and recorded by name, the first as the
    // headline (4x4 grid of width 32, 2 blocks: mean-last4 concatenates both).
    for r in &probes {
        assert_eq!(r.probe_readout.as_deref(), Some("mean"));
        let named: Vec<(&str, usize)> = r.probe_readouts.iter().map(|x| (x.readout.as_str(), x.dim)).collect();
        assert_eq!(named, [("mean", 32), ("grid2", 128), ("mean-last4", 64)]);
        assert_eq!((r.probe_readouts[0].probe_acc, r.probe_readouts[0].knn_acc), (r.probe_acc.unwrap(), r.knn_acc.unwrap()));
        assert!(r.probe_readouts.iter().all(|x| x.probe_acc > 0.25 && x.knn_acc > 0.2), "{:?}", r.probe_readouts);
    }
    let p = report.probes.expect("final probes");
    assert_eq!(p.readouts.len(), 3);
    assert!(p.probe_acc > 0.4 && p.knn_acc > 0.25, "10 classes (chance 0.1): linear probe {}, k-NN {}", p.probe_acc, p.knn_acc);
    assert!(p.pixel_probe_acc.expect("pixel baseline") > 0.8);
    assert!(out.join("loss.png").exists());
}

#[test]
fn ijepa_resume_is_bit_exact_with_the_ema_buffers() {
    let tmp = tempfile::tempdir().unwrap();
    let data = digits(tmp.path());
    let text = DIGITS_IJEPA.replace("steps = 40", "steps = 10");
    let config = TrainConfig::from_toml_str(&text).unwrap();
    let mut straight = Trainer::new(config.clone(), options(&data, tmp.path().join("straight"), false)).unwrap();
    straight.train_until(10).unwrap();
    let expected = state_bits(&straight);
    let out = tmp.path().join("split");
    let mut first = Trainer::new(config.clone(), options(&data, out.clone(), false)).unwrap();
    first.train_until(5).unwrap();
    first.save_checkpoint().unwrap();
    let halfway = state_bits(&first);
    drop(first);
    let mut resumed = Trainer::new(config, options(&data, out, true)).unwrap();
    assert_eq!(state_bits(&resumed), halfway, "the checkpoint round trip changed parameters or buffers");
    resumed.train_until(10).unwrap();
    assert_eq!(state_bits(&resumed), expected, "5 + resume + 5 steps differ from 10 straight");
}

#[test]
fn a_bad_jepa_config_is_named() {
    let bad = DIGITS_IJEPA.replace("n_targets = 2", "n_targets = 0");
    let err = TrainConfig::from_toml_str(&bad).unwrap_err().to_string();
    assert!(err.contains("n_targets"), "{err}");
    let bad = DIGITS_IJEPA.replace("patch_size = 2", "patch_size = 3");
    let err = TrainConfig::from_toml_str(&bad).unwrap_err().to_string();
    assert!(err.contains("model.patch_size"), "{err}");
    let bad = DIGITS_IJEPA.replace("kind = \"ijepa\"", "kind = \"mlp\"\nhidden = [8]");
    let err = TrainConfig::from_toml_str(&bad).unwrap_err().to_string();
    assert!(err.contains("not used when model.kind = \"mlp\""), "{err}");
}

const FASHION_IJEPA: &str = r#"
[model]
kind = "ijepa"
patch_size = 7
d_model = 16
n_layers = 1
n_heads = 2

[jepa]
predictor_width = 8
predictor_depth = 1
predictor_heads = 2
probe_train_images = 1000
probe_test_images = 500
probe_epochs = 3
pixel_baseline = false

[data]
dataset = "fashion-mnist"
batch_size = 32

[optim]
kind = "adamw"
lr = 2e-3
weight_decay = 0.04

[train]
steps = 400
seed = 0
log_every = 50
eval_batches = 1

[elastic]
heartbeat_interval_ms = 100
heartbeat_timeout_ms = 1000
verify_every = 10
"#;

#[test]
fn ijepa_under_launch_survives_a_killed_worker_with_identical_replicas() {
    let dir = tempfile::tempdir().expect("tempdir").keep();
    let config = dir.join("ijepa.toml");
    std::fs::write(&config, FASHION_IJEPA).unwrap();
    let launch = Launch::start_in(dir.join("run"), &config, 2, &[]);
    let events = launch.wait_for("step 100", Duration::from_secs(120), |e| Launch::committed(e).is_some_and(|s| s >= 100));
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
    let knn = summary["eval"]["knn_acc"].as_f64().expect("knn_acc");
    assert!(knn > 0.3, "k-NN accuracy {knn} after recovery (chance 0.1)");
    assert!(summary["eval"]["probe_acc"].as_f64().is_some());
}

/// The GPU job path against the CPU's (feature `cuda`; prints `skipped: ...` and passes where no
/// device is usable). The model has one head of 64 channels in the encoder and the predictor (the
/// GPU's attention head sizes) and keeps the CPU test's settings otherwise (grad clipping, the
/// weight-decay schedule, the mean-last4 readout all run on the device path).
#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use rustytorch::data::DataRoot;
    use std::path::Path;

    const DIGITS_IJEPA_GPU: &str = r#"
[model]
kind = "ijepa"
patch_size = 2
d_model = 64
n_layers = 2
n_heads = 1

[jepa]
predictor_width = 64
predictor_depth = 1
predictor_heads = 1
n_targets = 2
probe_train_images = 800
probe_test_images = 300
probe_epochs = 5
probe_features = ["mean", "mean-last4"]
final_weight_decay = 0.2

[data]
dataset = "digits"
val_fraction = 0.2
batch_size = 64

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
steps = 40
seed = 3
log_every = 5
eval_batches = 2
DEVICE
"#;

    /// `rtx launch --nproc 1` of `text` (DEVICE replaced by `device`) into `dir/name`, with
    /// `extra` flags: the summary and the committed `(step, loss)` pairs.
    fn launch(dir: &Path, name: &str, device: &str, data: &DataRoot, extra: &[&str]) -> (Value, Vec<(u64, f64)>) {
        let config = dir.join(format!("{name}.toml"));
        std::fs::write(&config, DIGITS_IJEPA_GPU.replace("DEVICE", device)).unwrap();
        let data_dir = data.path().to_str().unwrap().to_string();
        let mut args = vec!["--data-dir", data_dir.as_str()];
        args.extend_from_slice(extra);
        let (summary, events) = Launch::start_in(dir.join(name), &config, 1, &args).finish();
        let losses = events.iter().filter(|e| e["event"] == "committed").map(|e| (e["step"].as_u64().unwrap(), e["loss"].as_f64().unwrap())).collect();
        (summary, losses)
    }

    /// The checkpoints of run `from` copied into a fresh run folder `to` (for `--resume`).
    fn copy_checkpoints(dir: &Path, from: &str, to: &str) {
        let (src, dst) = (dir.join(from).join("checkpoints"), dir.join(to).join("checkpoints"));
        std::fs::create_dir_all(&dst).unwrap();
        for entry in std::fs::read_dir(&src).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, dst.join(path.file_name().unwrap())).unwrap();
        }
    }

    /// Worst relative difference between the means of every `window` consecutive losses.
    fn worst_window(a: &[(u64, f64)], b: &[(u64, f64)], window: usize) -> f64 {
        assert_eq!(a.iter().map(|x| x.0).collect::<Vec<_>>(), b.iter().map(|x| x.0).collect::<Vec<_>>(), "the runs committed different steps");
        let mean = |v: &[(u64, f64)]| v.iter().map(|x| x.1).sum::<f64>() / v.len() as f64;
        a.windows(window).zip(b.windows(window)).map(|(x, y)| (mean(x) - mean(y)).abs() / mean(y).abs()).fold(0.0, f64::max)
    }

    #[test]
    fn ijepa_on_cuda_follows_the_cpu_and_their_checkpoints_cross_over() {
        // Goal: `device = "cuda"` trains the same I-JEPA as the CPU under `rtx launch` (EMA target
        // on the device, device AdamW with the weight-decay schedule, clipping, probes from device
        // features), and a checkpoint of either device resumes on the other (parameters, f32
        // master weights and the EMA buffers). Method: 30 steps from one seed on the CPU (f32),
        // the GPU in f32 and the GPU in bf16; then each of a CPU and a GPU checkpoint at step 30
        // resumed 5 steps on the other device, against the CPU run resumed on the CPU.
        // Tolerances: one step from the same parameters, batch and masks differs only by
        // summation order in f32 (the 1e-4 bar of `jepa_gpu ops`' single-step loss) and by bf16
        // rounding in bf16 (its 3e-2 bar); over 30 steps AdamW amplifies those differences in
        // near-zero gradient coordinates, so the curves are compared as `jepa_gpu ops` compares
        // its 40-step bf16 curve: 10-step window means within 5% (f32: every step within 2%).
        let gpu_config = TrainConfig::from_toml_str(&DIGITS_IJEPA_GPU.replace("DEVICE", "device = \"cuda\"")).unwrap();
        if let Err(e) = rustytorch::train::resolve_device(&gpu_config, 0) {
            println!("skipped: {e}");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let data = digits(tmp.path());
        let dir = tmp.path();
        let (cpu_summary, cpu) = launch(dir, "cpu", "", &data, &["--steps", "30"]);
        let (f32_summary, gpu_f32) = launch(dir, "cuda-f32", "device = \"cuda\"\nprecision = \"f32\"", &data, &["--steps", "30"]);
        let (bf16_summary, gpu_bf16) = launch(dir, "cuda-bf16", "device = \"cuda\"", &data, &["--steps", "30"]);
        assert_eq!(cpu.len(), 30, "{cpu:?}");
        println!("cpu f32:   {:?}", cpu.iter().step_by(5).map(|x| format!("{:.4}", x.1)).collect::<Vec<_>>());
        println!("cuda f32:  {:?}", gpu_f32.iter().step_by(5).map(|x| format!("{:.4}", x.1)).collect::<Vec<_>>());
        println!("cuda bf16: {:?}", gpu_bf16.iter().step_by(5).map(|x| format!("{:.4}", x.1)).collect::<Vec<_>>());
        let first = |v: &[(u64, f64)]| (v[0].1 - cpu[0].1).abs() / cpu[0].1;
        assert!(first(&gpu_f32) < 1e-4, "step 1, cuda f32 vs cpu: {} vs {}", gpu_f32[0].1, cpu[0].1);
        assert!(first(&gpu_bf16) < 3e-2, "step 1, cuda bf16 vs cpu: {} vs {}", gpu_bf16[0].1, cpu[0].1);
        assert!(worst_window(&gpu_f32, &cpu, 1) < 2e-2, "cuda f32 vs cpu, worst step: {}", worst_window(&gpu_f32, &cpu, 1));
        assert!(worst_window(&gpu_bf16, &cpu, 10) < 5e-2, "cuda bf16 vs cpu, worst 10-step window: {}", worst_window(&gpu_bf16, &cpu, 10));
        assert!(cpu.last().unwrap().1 < cpu[0].1 * 0.9, "the latent loss did not fall: {cpu:?}");
        // The probes score device features with the host's code: the same accuracy up to the
        // features' rounding (f32), above chance (0.1) in bf16.
        let acc = |s: &Value, key: &str| s["eval"][key].as_f64().unwrap_or_else(|| panic!("no {key} in {s}"));
        for key in ["probe_acc", "knn_acc", "probe_acc_mean-last4", "val_loss"] {
            println!("{key}: cpu {:.4}, cuda f32 {:.4}, cuda bf16 {:.4}", acc(&cpu_summary, key), acc(&f32_summary, key), acc(&bf16_summary, key));
        }
        assert!((acc(&f32_summary, "probe_acc") - acc(&cpu_summary, "probe_acc")).abs() < 0.05);
        assert!((acc(&f32_summary, "val_loss") - acc(&cpu_summary, "val_loss")).abs() / acc(&cpu_summary, "val_loss") < 2e-2);
        assert!(acc(&bf16_summary, "probe_acc") > 0.2 && acc(&bf16_summary, "knn_acc") > 0.2, "{bf16_summary}");
        // Checkpoints at step 30 resumed for 5 steps: CPU -> CPU (reference), GPU bf16 -> CPU, CPU -> GPU bf16.
        // (Copied before the CPU run resumes: its folder then holds step 35's checkpoint too.)
        copy_checkpoints(dir, "cuda-bf16", "bf16-then-cpu");
        copy_checkpoints(dir, "cpu", "cpu-then-bf16");
        let (_, cpu_cpu) = launch(dir, "cpu", "", &data, &["--resume", "--steps", "35"]);
        let (_, gpu_cpu) = launch(dir, "bf16-then-cpu", "", &data, &["--resume", "--steps", "35"]);
        let (_, cpu_gpu) = launch(dir, "cpu-then-bf16", "device = \"cuda\"", &data, &["--resume", "--steps", "35"]);
        let tail = |v: Vec<(u64, f64)>| v.into_iter().filter(|x| x.0 >= 30).collect::<Vec<_>>();
        let (cpu_cpu, gpu_cpu, cpu_gpu) = (tail(cpu_cpu), tail(gpu_cpu), tail(cpu_gpu));
        assert_eq!(cpu_cpu.iter().map(|x| x.0).collect::<Vec<_>>(), (30..35).collect::<Vec<_>>(), "{cpu_cpu:?}");
        println!("resumed at 31: cpu->cpu {cpu_cpu:?}, bf16->cpu {gpu_cpu:?}, cpu->bf16 {cpu_gpu:?}");
        assert!(worst_window(&gpu_cpu, &cpu_cpu, 5) < 5e-2, "a GPU checkpoint resumed on the CPU: {gpu_cpu:?} vs {cpu_cpu:?}");
        assert!(worst_window(&cpu_gpu, &cpu_cpu, 5) < 5e-2, "a CPU checkpoint resumed on the GPU: {cpu_gpu:?} vs {cpu_cpu:?}");
    }
}
