//! What the process-level tests share: starting `rtx launch`, reading its events, signalling
//! workers. Each test file includes it with `mod support;`.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rustytorch::data::DataRoot;
use rustytorch::train::{TrainOptions, Trainer};
use serde_json::Value;

/// The `rtx` binary, run from the repository root.
pub fn rtx() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_rtx"));
    c.current_dir(env!("CARGO_MANIFEST_DIR"));
    c
}

/// A running `rtx launch` and its output folder.
pub struct Launch {
    pub child: Child,
    pub out: PathBuf,
}

impl Launch {
    /// A fresh output folder under a kept temporary directory.
    pub fn fresh_out() -> PathBuf {
        tempfile::tempdir().expect("tempdir").keep().join("run")
    }

    pub fn start_in(out: PathBuf, config: &Path, nproc: usize, extra: &[&str]) -> Launch {
        let child = rtx()
            .args(["launch", "--nproc", &nproc.to_string(), "--no-progress", "--out"])
            .arg(&out)
            .arg(config)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start rtx launch");
        Launch { child, out }
    }

    pub fn events(&self) -> Vec<Value> {
        std::fs::read_to_string(self.out.join("events.jsonl")).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
    }

    pub fn wait_for(&self, what: &str, timeout: Duration, pred: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let start = Instant::now();
        loop {
            let events = self.events();
            if pred(&events) {
                return events;
            }
            assert!(start.elapsed() < timeout, "timed out waiting for {what}; events so far: {events:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn committed(events: &[Value]) -> Option<u64> {
        events.iter().filter(|e| e["event"] == "committed").filter_map(|e| e["step"].as_u64()).max()
    }

    pub fn pids(&self) -> Vec<u32> {
        let cluster: Value = serde_json::from_str(&std::fs::read_to_string(self.out.join("cluster.json")).expect("cluster.json")).expect("json");
        cluster["pids"].as_array().expect("pids").iter().map(|p| p.as_u64().expect("pid") as u32).collect()
    }

    pub fn finish(mut self) -> (Value, Vec<Value>) {
        let start = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                break status;
            }
            if start.elapsed() > Duration::from_secs(180) {
                let _ = self.child.kill();
                panic!("rtx launch did not finish");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let events = self.events();
        let out = self.out.clone();
        let output = self.child.wait_with_output().expect("output");
        let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        assert!(status.success(), "rtx launch failed: {text}");
        let summary: Value = serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).expect("summary.json")).expect("json");
        assert_eq!(summary["replicas_identical"], true, "{text}");
        (summary, events)
    }
}

/// Sends `sig` (as `kill` takes it) to `pid`.
pub fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill").args([sig, &pid.to_string()]).status().expect("kill").success();
    assert!(ok, "kill {sig} {pid}");
}

/// Whether `pid` runs (a zombie does not).
pub fn alive(pid: u32) -> bool {
    // A zombie is not alive for our purpose: check /proc state.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat.split_whitespace().nth(2).is_none_or(|s| s != "Z"),
        Err(_) => false,
    }
}

/// Established TCP connections of process `pid` (Linux): its socket descriptors matched by inode
/// against the kernel's TCP tables in state ESTABLISHED (`01`).
pub fn established_tcp(pid: u32) -> usize {
    let inodes: std::collections::BTreeSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| dir.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok()).filter_map(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']').map(str::to_string)).collect())
        .unwrap_or_default();
    ["tcp", "tcp6"]
        .iter()
        .flat_map(|t| std::fs::read_to_string(format!("/proc/{pid}/net/{t}")).unwrap_or_default().lines().skip(1).map(str::to_string).collect::<Vec<_>>())
        .filter(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            cols.get(3) == Some(&"01") && cols.get(9).is_some_and(|inode| inodes.contains(*inode))
        })
        .count()
}

/// A data root under `root` holding the bundled digits fixture (8x8 images, 10 classes).
pub fn digits(root: &Path) -> DataRoot {
    let data = DataRoot::new(root.join("data"));
    std::fs::create_dir_all(data.path().join("digits")).unwrap();
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("tensor/tests/fixtures/digits.csv.gz"), data.digits_csv()).unwrap();
    data
}

/// In-process training options writing to `out`, resuming from it when `resume`.
pub fn train_options(data: &DataRoot, out: PathBuf, resume: bool) -> TrainOptions {
    TrainOptions { out_dir: Some(out), resume, ..TrainOptions::new(data.clone()) }
}

/// Parameters and buffers (an EMA target encoder's included), as f32 bits, by name.
pub fn state_bits(trainer: &Trainer) -> Vec<(String, Vec<u32>)> {
    trainer.model().module().named_state().into_iter().map(|(n, t)| (n, t.to_f32_vec().unwrap().into_iter().map(f32::to_bits).collect())).collect()
}
