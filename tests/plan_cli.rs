//! `rtx plan` end to end: a good `[parallel]` config prints its mesh, ranks, stage costs, memory
//! and bubble (text and JSON); a bad one, or a mesh larger than the world, exits non-zero with a
//! message naming the numbers, and so does `rtx launch` before any worker starts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn rtx(args: &[&str], cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rtx")).args(args).current_dir(cwd).env_remove("RTX_DATA_DIR").output().expect("run rtx")
}

fn config_3d() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/sotu_gpt_3d.toml")
}

/// A data folder under `root` holding the digits fixture (a real dataset small enough for
/// configs that must fail before training).
fn digits_data(root: &Path) -> PathBuf {
    let data = root.join("data");
    std::fs::create_dir_all(data.join("digits")).unwrap();
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("tensor/tests/fixtures/digits.csv.gz"), data.join("digits/digits.csv.gz")).unwrap();
    data
}

fn text(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_good_config_prints_the_mesh_ranks_and_bubble() {
    // Goal: the 3D config on 8 ranks shows (2,2,2), each rank's coordinate, the stage costs and
    // the 1F1B bubble (p-1)/(m+p-1) = 1/5. Method: the text and the JSON output.
    let tmp = tempfile::tempdir().unwrap();
    let config = config_3d();
    let out = rtx(&["plan", config.to_str().unwrap(), "--world", "8"], tmp.path());
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("mesh (dp=2, pp=2, tp=2) over 8 ranks"), "{stdout}");
    assert!(stdout.contains("predicted bubble: 20.0%"), "{stdout}");
    assert!(stdout.contains("static estimate"), "{stdout}");
    assert!(stdout.contains("(dp=1, pp=1, tp=1)") && stdout.contains("embed(copy)"), "{stdout}");

    let out = rtx(&["plan", config.to_str().unwrap(), "--world", "8", "--json"], tmp.path());
    assert!(out.status.success(), "{:?}", text(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["mesh"], serde_json::json!({ "dp": 2, "pp": 2, "tp": 2 }));
    assert_eq!(v["stages"][0]["layers"], serde_json::json!([0, 2]));
    assert_eq!(v["stages"][1]["layers"], serde_json::json!([2, 4]));
    assert!((v["bubble"].as_f64().unwrap() - 0.2).abs() < 1e-12);
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 8);
    assert_eq!(ranks[5]["coord"], serde_json::json!({ "dp": 1, "pp": 0, "tp": 1 }));
    assert_eq!(ranks[3]["units"], serde_json::json!(["block2", "block3", "head"]));
    for r in ranks {
        let m = &r["memory_bytes"];
        let sum: u64 = ["params", "grads", "optimizer", "activations"].iter().map(|k| m[k].as_u64().unwrap()).sum();
        assert!(sum > 0 && sum == m["total"].as_u64().unwrap(), "{r}");
    }
}

#[test]
fn bad_meshes_exit_non_zero_naming_the_numbers() {
    // Goal: a world the mesh does not divide, a mesh larger than the world, and a tp that does not
    // divide the heads are errors that name the numbers. Method: run each and read stderr.
    let tmp = tempfile::tempdir().unwrap();
    let config = config_3d();
    let out = rtx(&["plan", config.to_str().unwrap(), "--world", "6"], tmp.path());
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.contains("1·2·2 = 4") && stderr.contains("does not divide 6"), "{stderr}");
    let out = rtx(&["plan", config.to_str().unwrap(), "--world", "2"], tmp.path());
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.contains("world has 2") && stderr.contains("larger than the world"), "{stderr}");

    let bad = tmp.path().join("bad.toml");
    std::fs::write(&bad, std::fs::read_to_string(&config).unwrap().replace("tp = 2", "tp = 3")).unwrap();
    let out = rtx(&["plan", bad.to_str().unwrap(), "--world", "6"], tmp.path());
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.contains("`parallel.tp` = 3") && stderr.contains("attention heads (4)"), "{stderr}");
}

#[test]
fn launch_refuses_a_mesh_larger_than_the_world_before_starting_workers() {
    // Goal: `rtx launch` checks `[parallel]` against --nproc before any worker starts. Method: a
    // digits MLP asking for dp = 4 on 2 processes; no worker log may appear.
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let data = digits_data(root);
    let config = root.join("mlp.toml");
    std::fs::write(&config, "[model]\nkind = \"mlp\"\nhidden = [8]\n[data]\ndataset = \"digits\"\nbatch_size = 8\n[optim]\nkind = \"sgd\"\nlr = 0.1\n[train]\nsteps = 2\n[parallel]\ndp = 4\n").unwrap();
    let out_dir = root.join("out");
    let out = rtx(
        &["launch", config.to_str().unwrap(), "--nproc", "2", "--data-dir", data.to_str().unwrap(), "--out", out_dir.to_str().unwrap(), "--no-progress"],
        root,
    );
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("4·1·1 = 4") && stderr.contains("world has 2") && stderr.contains("--nproc 2"), "{stderr}");
    assert!(!out_dir.join("logs").exists(), "a worker was started");
}

#[test]
fn launch_refuses_zero3_for_a_model_that_is_not_a_gpt() {
    // Goal: `[parallel] zero = 3` plans (`rtx plan`) for any model, but `rtx launch` runs ZeRO-3
    // (FSDP) for a GPT only and refuses anything else before a worker starts, naming the key and
    // why, rather than training the job replicated. Method: the digits MLP with zero = 3 on 2
    // processes.
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let data = digits_data(root);
    let config = root.join("mlp.toml");
    std::fs::write(&config, "[model]\nkind = \"mlp\"\nhidden = [8]\n[data]\ndataset = \"digits\"\nbatch_size = 8\n[optim]\nkind = \"sgd\"\nlr = 0.1\n[train]\nsteps = 2\n[parallel]\nzero = 3\n").unwrap();
    let plan = rtx(&["plan", config.to_str().unwrap(), "--world", "2"], root);
    let out_dir = root.join("out");
    let out = rtx(&["launch", config.to_str().unwrap(), "--nproc", "2", "--data-dir", data.to_str().unwrap(), "--out", out_dir.to_str().unwrap(), "--no-progress"], root);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("`parallel.zero` = 3") && stderr.contains("cuts a GPT into units"), "{stderr}");
    assert!(!out_dir.join("logs").exists(), "a worker was started");
    assert!(plan.status.success(), "rtx plan refused zero = 3: {:?}", text(&plan));
}
