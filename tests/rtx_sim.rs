//! `rtx sim` end to end on the default scenario (needs `bash scripts/fetch-data.sh`): one seed
//! prints its trace hash and the invariants held, and prints the same hash in a second process;
//! a swarm with the planted bug exits non-zero and prints a failing seed with its replay command,
//! and that command, run, fails the same way. The same for the federated scenario
//! (`fed_hosts.toml`) and its planted bug.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::{Command, Output};

fn rtx(args: &[&str]) -> Output {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    Command::new(env!("CARGO_BIN_EXE_rtx")).args(args).current_dir(&root).env("RTX_DATA_DIR", root.join("data")).output().expect("run rtx")
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

#[test]
fn a_seed_prints_its_trace_and_replays_in_another_process() {
    let a = rtx(&["sim", "--scenario", "sim/scenarios/elastic_dp.toml", "--seed", "3"]);
    let b = rtx(&["sim", "--scenario", "sim/scenarios/elastic_dp.toml", "--seed", "3"]);
    let (ta, tb) = (text(&a), text(&b));
    println!("{ta}");
    assert!(a.status.success(), "{ta}");
    assert!(ta.contains("seed 3: trace ") && ta.contains("invariants held"), "{ta}");
    let trace = |t: &str| t.split("trace ").nth(1).and_then(|r| r.split(';').next()).map(str::to_string);
    assert_eq!(trace(&ta), trace(&tb), "same seed, different trace across processes");
}

#[test]
fn the_swarm_reports_the_planted_bug_with_a_replay_command() {
    let out = rtx(&["sim", "--scenario", "sim/scenarios/elastic_dp.toml", "--seeds", "0..12", "--threads", "2", "--planted-bug"]);
    let t = text(&out);
    println!("{t}");
    assert!(!out.status.success(), "{t}");
    let replay = t.lines().find_map(|l| l.trim().strip_prefix("replay: rtx ")).expect("a replay command");
    let args: Vec<&str> = replay.split_whitespace().collect();
    assert!(args.contains(&"--planted-bug"), "{replay}");
    let again = rtx(&args);
    let t2 = text(&again);
    assert!(!again.status.success() && t2.contains("VIOLATION of"), "{t2}");
}

#[test]
fn a_federated_scenario_replays_across_processes_and_catches_its_planted_bug() {
    let scenario = "sim/scenarios/fed_hosts.toml";
    let a = rtx(&["sim", "--scenario", scenario, "--seed", "1"]);
    let b = rtx(&["sim", "--scenario", scenario, "--seed", "1"]);
    let (ta, tb) = (text(&a), text(&b));
    println!("{ta}");
    assert!(a.status.success() && ta.contains("invariants held: twin-equal"), "{ta}");
    let trace = |t: &str| t.split("trace ").nth(1).and_then(|r| r.split(';').next()).map(str::to_string);
    assert_eq!(trace(&ta), trace(&tb), "same seed, different trace across processes");
    let out = rtx(&["sim", "--scenario", scenario, "--seeds", "0..16", "--threads", "2", "--planted-bug"]);
    let t = text(&out);
    println!("{t}");
    assert!(!out.status.success() && t.contains("VIOLATION of twin-equal"), "{t}");
    let replay = t.lines().find_map(|l| l.trim().strip_prefix("replay: rtx ")).expect("a replay command");
    let again = rtx(&replay.split_whitespace().collect::<Vec<_>>());
    let t2 = text(&again);
    assert!(!again.status.success() && t2.contains("VIOLATION of twin-equal"), "{t2}");
}
