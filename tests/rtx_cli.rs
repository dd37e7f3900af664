//! The `rtx` binary end to end: `rtx train` on a tiny digits config writes metrics, a loss curve
//! and checkpoints, resumes, and answers bad configs and missing data with a non-zero exit and a
//! message that says what to do.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const TINY: &str = r#"
[model]
kind = "mlp"
hidden = [32]

[data]
dataset = "digits"
val_fraction = 0.2
batch_size = 32

[optim]
kind = "adamw"
lr = 3e-3

[schedule]
warmup_steps = 4
min_lr = 1e-4

[train]
steps = 40
seed = 1
log_every = 10
eval_every = 20
checkpoint_every = 10
keep_checkpoints = 2
"#;

struct Setup {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    data: PathBuf,
}

fn setup() -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    let data = root.join("data");
    std::fs::create_dir_all(data.join("digits")).unwrap();
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("tensor/tests/fixtures/digits.csv.gz"), data.join("digits/digits.csv.gz")).unwrap();
    Setup { _tmp: tmp, root, data }
}

fn write_config(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn rtx(args: &[&str], cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rtx")).args(args).current_dir(cwd).env_remove("RTX_DATA_DIR").output().expect("run rtx")
}

fn text(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn checkpoints(out: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(out.join("checkpoints")).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

#[test]
fn train_writes_metrics_plot_and_checkpoints_then_resumes() {
    // Goal: one command gives every promised output. Method: train 20 of 40 steps (--steps),
    // check the files, then --resume to 40 and check the metrics continue without duplicates.
    let s = setup();
    let config = write_config(&s.root, "tiny.toml", TINY);
    let out = s.root.join("out");
    let args = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["train", config.to_str().unwrap(), "--data-dir", s.data.to_str().unwrap(), "--out", out.to_str().unwrap()].iter().map(|x| x.to_string()).collect();
        v.extend(extra.iter().map(|x| x.to_string()));
        v
    };
    let first = rtx(&args(&["--steps", "20"]).iter().map(String::as_str).collect::<Vec<_>>(), &s.root);
    let (stdout, stderr) = text(&first);
    assert!(first.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("step     10/40"), "periodic log lines without a TTY:\n{stdout}");
    assert!(stdout.contains("validation: loss"), "{stdout}");
    assert!(out.join("config.toml").exists());
    let png = std::fs::read(out.join("loss.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(checkpoints(&out), ["step-00000010.safetensors", "step-00000020.safetensors"]);

    let records = read_jsonl(&out.join("metrics.jsonl"));
    let train_steps: Vec<u64> = records.iter().filter(|r| r.get("loss").is_some()).map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(train_steps, [10, 20]);
    let first_log = records.iter().find(|r| r.get("loss").is_some()).unwrap();
    for key in ["lr", "samples_per_s", "wall_s"] {
        assert!(first_log.get(key).is_some(), "{key} missing in {first_log}");
    }
    assert!(records.iter().any(|r| r.get("val_acc").is_some() && r["step"] == 20));

    // Without --resume the folder is refused; with it the run continues to step 40.
    let refused = rtx(&args(&[]).iter().map(String::as_str).collect::<Vec<_>>(), &s.root);
    assert!(!refused.status.success());
    assert!(text(&refused).1.contains("--resume"), "{}", text(&refused).1);

    let resumed = rtx(&args(&["--resume"]).iter().map(String::as_str).collect::<Vec<_>>(), &s.root);
    let (stdout, stderr) = text(&resumed);
    assert!(resumed.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("resumed at step 20"), "{stdout}");
    let records = read_jsonl(&out.join("metrics.jsonl"));
    let train_steps: Vec<u64> = records.iter().filter(|r| r.get("loss").is_some()).map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(train_steps, [10, 20, 30, 40]);
    // keep_checkpoints = 2 keeps the newest two.
    assert_eq!(checkpoints(&out), ["step-00000030.safetensors", "step-00000040.safetensors"]);
}

#[test]
fn bad_configs_fail_with_the_key_and_what_it_allows() {
    // Goal: a config mistake is answered by a message naming the key, not a panic or a
    // generic error. Method: several broken configs, each checked for exit code and message.
    let s = setup();
    let cases: &[(&str, String, &[&str])] = &[
        ("unknown key", TINY.replace("hidden = [32]", "hiden = [32]"), &["unknown field `hiden`", "`hidden`", "line"]),
        ("bad kind", TINY.replace("kind = \"mlp\"", "kind = \"cnn\""), &["unknown variant `cnn`", "`mlp`", "`gpt`"]),
        ("bad dataset", TINY.replace("\"digits\"", "\"cifar10\""), &["unknown variant `cifar10`", "`fashion-mnist`", "`sotu`"]),
        ("negative lr", TINY.replace("lr = 3e-3", "lr = -0.1"), &["`optim.lr` = -0.1", "> 0"]),
        ("wrong type", TINY.replace("steps = 40", "steps = \"forty\""), &["steps = \"forty\"", "expected u64"]),
        ("missing section", TINY.replace("[optim]\nkind = \"adamw\"\nlr = 3e-3\n", ""), &["missing field `optim`"]),
    ];
    for (what, body, needles) in cases {
        let config = write_config(&s.root, "bad.toml", body);
        let out = rtx(&["train", config.to_str().unwrap(), "--data-dir", s.data.to_str().unwrap(), "--out", s.root.join("o").to_str().unwrap()], &s.root);
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(1), "{what}: {stderr}");
        assert!(stderr.contains("bad.toml"), "{what}: message should name the file: {stderr}");
        for needle in *needles {
            assert!(stderr.contains(needle), "{what}: expected {needle:?} in:\n{stderr}");
        }
        assert!(!stderr.contains("panicked"), "{what}: {stderr}");
    }
    let missing = rtx(&["train", "no/such/config.toml"], &s.root);
    assert!(!missing.status.success());
    assert!(text(&missing).1.contains("cannot read config no/such/config.toml"), "{}", text(&missing).1);
}

#[test]
fn missing_data_names_the_fetch_command() {
    // Goal: missing data says exactly which command fetches it. Method: point --data-dir at an
    // empty folder for each dataset kind.
    let s = setup();
    let empty = s.root.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let gpt = "[model]\nkind = \"gpt\"\nn_layers = 1\nd_model = 8\nn_heads = 2\ncontext = 8\n[data]\ndataset = \"sotu\"\nbatch_size = 2\n[optim]\nkind = \"sgd\"\nlr = 0.1\n[train]\nsteps = 1\n";
    for (name, body, set) in [("digits", TINY.to_string(), "digits"), ("fashion", TINY.replace("\"digits\"", "\"fashion-mnist\""), "fashion-mnist"), ("sotu", gpt.to_string(), "sotu")] {
        let config = write_config(&s.root, &format!("{name}.toml"), &body);
        let out = rtx(&["train", config.to_str().unwrap(), "--data-dir", empty.to_str().unwrap(), "--out", s.root.join(name).to_str().unwrap()], &s.root);
        let (_, stderr) = text(&out);
        assert!(!out.status.success(), "{name}");
        assert!(stderr.contains("bash scripts/fetch-data.sh"), "{name}: {stderr}");
        assert!(stderr.contains(&format!("--only {set}")), "{name}: {stderr}");
    }
}

#[test]
fn cuda_without_a_gpu_fails_before_any_worker_starts() {
    // Goal: `[train] device = "cuda"` on a machine (or build) without CUDA is a non-zero exit with
    // a message saying what is missing, before any data is read or worker started; `rtx train`
    // points at `rtx launch`. Method: a GPU config and an empty data folder on this CPU machine.
    let s = setup();
    let empty = s.root.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let gpt = "[model]\nkind = \"gpt\"\nn_layers = 1\nd_model = 64\nn_heads = 1\ncontext = 8\n[data]\ndataset = \"sotu\"\nbatch_size = 2\n[optim]\nkind = \"adamw\"\nlr = 0.001\n[train]\nsteps = 1\ndevice = \"cuda\"\n";
    // I-JEPA goes through the same check (one head of 64 in the encoder and the predictor).
    let ijepa = "[model]\nkind = \"ijepa\"\npatch_size = 2\nd_model = 64\nn_layers = 1\nn_heads = 1\n[jepa]\npredictor_width = 64\npredictor_heads = 1\n[data]\ndataset = \"digits\"\nbatch_size = 4\n[optim]\nkind = \"adamw\"\nlr = 0.001\n[train]\nsteps = 1\ndevice = \"cuda\"\n";
    for (name, gpu) in [("gpt", gpt), ("ijepa", ijepa)] {
        let config = write_config(&s.root, &format!("gpu-{name}.toml"), gpu);
        let out_dir = s.root.join(format!("gpu-run-{name}"));
        let out = rtx(&["launch", "--nproc", "2", "--no-progress", config.to_str().unwrap(), "--data-dir", empty.to_str().unwrap(), "--out", out_dir.to_str().unwrap()], &s.root);
        let (_, stderr) = text(&out);
        if stderr.contains("job:") {
            // A machine with a GPU and a CUDA build: nothing to check here (scripts/gpu-dp-check.sh,
            // scripts/gpu-jepa-train-check.sh).
            return;
        }
        assert!(!out.status.success(), "{name}: {stderr}");
        assert!(stderr.contains("train.device = \"cuda\""), "{name}: {stderr}");
        assert!(stderr.contains("--features cuda") || stderr.contains("no CUDA device is usable"), "{name}: {stderr}");
        assert!(!stderr.contains("fetch-data"), "{name}: the device is checked before the data: {stderr}");
        assert!(!stderr.contains("panicked"), "{name}: {stderr}");
        assert!(!out_dir.join("logs").exists(), "{name}: no worker was started");
        let out = rtx(&["train", config.to_str().unwrap(), "--data-dir", empty.to_str().unwrap(), "--out", s.root.join(format!("gpu-train-{name}")).to_str().unwrap()], &s.root);
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(1), "{name}: {stderr}");
        assert!(stderr.contains("rtx launch"), "{name}: {stderr}");
    }
}

fn read_jsonl(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

// Goal: a QUIC stripe count outside 1..=16, by flag or environment, is refused with a message naming
// the value before the worker dials anyone.
#[test]
fn worker_refuses_impossible_quic_stripes() {
    let dir = tempfile::tempdir().unwrap();
    let out = rtx(&["worker", "--join", "127.0.0.1:9", "--token", "t", "--quic-stripes", "0"], dir.path());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--quic-stripes 0 is out of range"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_rtx")).args(["worker", "--join", "127.0.0.1:9", "--token", "t"]).env("RTX_QUIC_STRIPES", "many").current_dir(dir.path()).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("RTX_QUIC_STRIPES=\"many\""), "{err}");
}

#[test]
fn bench_collectives_refuses_a_host_layout_that_does_not_fit() {
    // Goal: a host map the ranks cannot fill, or host addresses that do not match it, are named
    // before any rank process starts (no rank silently falls back to 127.0.0.1).
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&[&str], &str); 2] = [
        (&["--hosts", "2", "--host-addrs", "127.0.0.1"], "--host-addrs names 1 addresses for --hosts 2"),
        (&["--hosts", "5"], "--hosts must be between 1 and the smallest world size"),
    ];
    for (extra, expected) in cases {
        let mut args = vec!["bench", "collectives", "--transports", "routed", "--worlds", "4", "--no-references"];
        args.extend_from_slice(extra);
        let out = rtx(&args, dir.path());
        assert!(!out.status.success(), "{extra:?} must be refused");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expected), "{extra:?}: {err}");
    }
}
