//! The per-step timeline export: `[train] trace_steps = N` under `rtx launch --nproc 2` writes
//! `<out>/trace-rank<r>.json` per rank in Chrome trace format, with forward, backward, each
//! bucket's all-reduce (on the communication thread), the wait for the gradients and the
//! optimizer of the first N steps, in an order that matches how a step runs.
//!
//! Needs the Fashion-MNIST data (`bash scripts/fetch-data.sh`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::Path;

use serde_json::Value;
use support::Launch;

const TRACED: u64 = 5;

#[test]
fn each_rank_writes_a_chrome_trace_of_its_first_steps() {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/configs/elastic_fashion.toml")).expect("test config");
    let text = text.replace("steps = 600", &format!("steps = 60\ntrace_steps = {TRACED}"));
    let dir = tempfile::tempdir().expect("tempdir").keep();
    let config = dir.join("trace.toml");
    std::fs::write(&config, text).expect("write config");
    let launch = Launch::start_in(Launch::fresh_out(), &config, 2, &[]);
    let out = launch.out.clone();
    launch.finish();
    for rank in 0..2u64 {
        let path = out.join(format!("trace-rank{rank}.json"));
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).expect("trace JSON");
        let events = doc["traceEvents"].as_array().expect("traceEvents");
        assert!(events.iter().any(|e| e["ph"] == "M" && e["args"]["name"] == format!("rank {rank}")), "process named after the rank");
        let spans: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
        assert!(spans.iter().all(|e| e["pid"] == rank && e["dur"].as_f64().is_some_and(|d| d >= 0.0)));
        let steps: std::collections::BTreeSet<u64> = spans.iter().filter_map(|e| e["args"]["step"].as_u64()).collect();
        assert_eq!(steps.len() as u64, TRACED, "only the first {TRACED} steps: {steps:?}");
        for step in steps {
            let of = |name: &str| -> (f64, f64) {
                let e = spans.iter().find(|e| e["args"]["step"] == step && e["name"] == name).unwrap_or_else(|| panic!("no {name} in step {step} of rank {rank}"));
                let ts = e["ts"].as_f64().expect("ts");
                (ts, ts + e["dur"].as_f64().expect("dur"))
            };
            let (forward, backward, wait, optimizer) = (of("forward"), of("backward"), of("gradient wait"), of("optimizer"));
            // Spans of one thread follow one another (1 µs of rounding allowed).
            assert!(forward.1 <= backward.0 + 1.0 && backward.1 <= wait.0 + 1.0 && wait.1 <= optimizer.0 + 1.0, "step {step}: {forward:?} {backward:?} {wait:?} {optimizer:?}");
            let buckets: Vec<&&Value> = spans.iter().filter(|e| e["args"]["step"] == step && e["cat"] == "collective").collect();
            assert!(!buckets.is_empty(), "step {step}: no bucket collective");
            for b in buckets {
                assert_eq!(b["tid"], 1, "collectives run on the communication thread");
                assert!(b["name"].as_str().is_some_and(|n| n.starts_with("all_reduce bucket ")), "{b}");
                let (ts, end) = (b["ts"].as_f64().expect("ts"), b["ts"].as_f64().expect("ts") + b["dur"].as_f64().expect("dur"));
                // A bucket is reduced after its gradients exist and before the optimizer uses them.
                assert!(ts + 1.0 >= backward.0 && end <= optimizer.0 + 1.0, "step {step}: bucket {ts}..{end} outside backward {backward:?} .. optimizer {optimizer:?}");
            }
        }
    }
}
