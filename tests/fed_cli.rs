//! `rtx fed run` end to end on the digits fixture: metrics.jsonl with one record per round and an
//! accuracy PNG; bad configs (K > N, negative alpha, a host slice out of range) exit non-zero with
//! a message naming the key; `rtx bench fed` prints seconds per round and peak RSS.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const FED: &str = r#"
seed = 3
[population]
n_clients = 400
dataset = "digits"
partition = "dirichlet"
alpha = 0.5
[round]
rounds = 4
clients_per_round = 100
fan_in = 8
hosts = 2
[local]
epochs = 3
batch_size = 4
shuffle = true
[faults]
dropout_rate = 0.1
"#;

struct Setup {
    _tmp: tempfile::TempDir,
    root: PathBuf,
}

fn setup() -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    std::fs::create_dir_all(root.join("data/digits")).unwrap();
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("tensor/tests/fixtures/digits.csv.gz"), root.join("data/digits/digits.csv.gz")).unwrap();
    Setup { _tmp: tmp, root }
}

fn rtx(args: &[&str], cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rtx")).args(args).current_dir(cwd).env_remove("RTX_DATA_DIR").output().expect("run rtx")
}

#[test]
fn fed_run_writes_one_metrics_record_per_round_and_an_accuracy_curve() {
    let s = setup();
    std::fs::write(s.root.join("fed.toml"), FED).unwrap();
    let out = rtx(&["fed", "run", "fed.toml", "--out", "run", "--no-progress"], &s.root);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "stdout: {stdout}\nstderr: {}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("round 4/4"), "{stdout}");
    let text = std::fs::read_to_string(s.root.join("run/metrics.jsonl")).unwrap();
    let records: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(records.len(), 4);
    for (i, r) in records.iter().enumerate() {
        assert_eq!(r["round"], i as u64 + 1);
        for key in ["test_acc", "test_loss", "clients_done", "dropped", "rejected", "seconds"] {
            assert!(r.get(key).is_some(), "record {i} lacks {key}: {r}");
        }
        let answered = ["clients_done", "dropped", "empty"].map(|k| r[k].as_u64().unwrap());
        assert_eq!(answered.iter().sum::<u64>(), 100, "{r}");
    }
    let acc = records[3]["test_acc"].as_f64().unwrap();
    assert!(acc > 0.6, "digits accuracy after 4 rounds: {acc}");
    let png = std::fs::read(s.root.join("run/accuracy.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    // Same seed, same run: the accuracies replay exactly.
    let again = rtx(&["fed", "run", "fed.toml", "--out", "run2", "--no-progress"], &s.root);
    assert!(again.status.success());
    let acc_of = |p: &str| -> Vec<String> {
        std::fs::read_to_string(s.root.join(p))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["test_acc"].to_string())
            .collect()
    };
    assert_eq!(acc_of("run/metrics.jsonl"), acc_of("run2/metrics.jsonl"));
}

#[test]
fn fed_run_refuses_bad_configs_naming_the_key() {
    let s = setup();
    for (edit, key) in [
        (FED.replace("clients_per_round = 100", "clients_per_round = 401"), "round.clients_per_round"),
        (FED.replace("alpha = 0.5", "alpha = -1.0"), "population.alpha"),
        (FED.replace("hosts = 2", "hosts = 2\nhost_slices = [\"0..200\", \"200..500\"]"), "round.host_slices[1]"),
    ] {
        std::fs::write(s.root.join("bad.toml"), &edit).unwrap();
        let out = rtx(&["fed", "run", "bad.toml", "--out", "bad", "--no-progress"], &s.root);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{key}: must fail");
        assert!(stderr.contains(key), "{key}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    std::fs::write(s.root.join("bad.toml"), format!("{FED}[dp]\nclip_norm = -1.0\nnoise_multiplier = 1.0\n")).unwrap();
    let out = rtx(&["fed", "run", "bad.toml", "--out", "bad", "--no-progress"], &s.root);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("dp.clip_norm"), "{}", String::from_utf8_lossy(&out.stderr));
    let missing = rtx(&["fed", "run", "nope.toml"], &s.root);
    assert!(!missing.status.success() && String::from_utf8_lossy(&missing.stderr).contains("nope.toml"));
}

#[test]
fn bench_fed_prints_seconds_per_round_and_peak_rss() {
    let s = setup();
    std::fs::write(s.root.join("fed.toml"), FED).unwrap();
    let out = rtx(&["bench", "fed", "--config", "fed.toml", "--population", "1000", "--clients-per-round", "200", "--rounds", "2"], &s.root);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let last: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!((last["population"].as_u64(), last["clients_per_round"].as_u64()), (Some(1000), Some(200)));
    assert!(last["median_s_per_round"].as_f64().unwrap() > 0.0, "{last}");
    assert!(last["peak_rss_mib"].as_f64().unwrap() > 1.0, "{last}");
}

#[test]
fn fed_run_with_dp_reports_a_growing_epsilon_and_still_learns() {
    // Goal: `[dp]` turns on DP-FedAvg inside `rtx fed run` (clip, seeded noise, fixed K) and every
    // round's record carries epsilon at the config's delta, growing round by round.
    let s = setup();
    std::fs::write(s.root.join("dp.toml"), format!("{FED}[dp]\nclip_norm = 1.0\nnoise_multiplier = 0.5\n")).unwrap();
    let out = rtx(&["fed", "run", "dp.toml", "--out", "dp", "--no-progress"], &s.root);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "stdout: {stdout}\nstderr: {}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("epsilon"), "{stdout}");
    let records: Vec<serde_json::Value> = std::fs::read_to_string(s.root.join("dp/metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let eps: Vec<f64> = records.iter().map(|r| r["epsilon"].as_f64().expect("epsilon")).collect();
    assert!(eps.windows(2).all(|w| w[1] > w[0]) && eps[0] > 0.0, "{eps:?}");
    let acc = records[3]["test_acc"].as_f64().unwrap();
    assert!(acc > 0.3, "digits accuracy after 4 DP rounds: {acc}");
}

/// A federation over real processes: `rtx fed serve` and three `rtx fed clients` processes on
/// loopback QUIC. The third host is slow (2 s a round) and is killed with SIGKILL in the middle of
/// round 2: that round closes at its timeout with the other hosts' updates, the next rounds
/// proceed without it, and the coordinator finishes with every round's record.
/// Runs `config` with `rtx fed serve` and three `rtx fed clients` processes over slices of 400
/// clients (the third slow), kills the slow one with SIGKILL once round 1 is recorded, and returns
/// the metrics records, the coordinator's stdout and its stderr (after checking every process but
/// the killed one succeeded).
fn serve_with_a_kill_9(config: &str) -> (Vec<serde_json::Value>, String, String) {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;

    let s = setup();
    std::fs::write(s.root.join("fed.toml"), config).unwrap();
    let token = "fed-cli-test-token";
    let mut serve = Command::new(env!("CARGO_BIN_EXE_rtx"))
        .args(["fed", "serve", "fed.toml", "--listen", "127.0.0.1:0", "--out", "run", "--no-progress", "--round-timeout-s", "4", "--join-timeout-s", "60"])
        .current_dir(&s.root)
        .env_remove("RTX_DATA_DIR")
        .env("RTX_TOKEN", token)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The coordinator prints its address first; the rest of its stderr is kept for the failure message.
    let mut stderr = BufReader::new(serve.stderr.take().unwrap());
    let mut line = String::new();
    let addr = loop {
        line.clear();
        assert!(stderr.read_line(&mut line).unwrap() > 0, "rtx fed serve exited before listening");
        if let Some(rest) = line.strip_prefix("coordinator on ") {
            break rest.split(':').take(2).collect::<Vec<_>>().join(":");
        }
    };
    let serve_log = std::thread::spawn(move || {
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut stderr, &mut rest).unwrap();
        rest
    });
    let host = |slice: &str, delay_ms: &str| {
        Command::new(env!("CARGO_BIN_EXE_rtx"))
            .args(["fed", "clients", "--join", &addr, "--population-slice", slice, "--compute-delay-ms", delay_ms])
            .current_dir(&s.root)
            .env_remove("RTX_DATA_DIR")
            .env("RTX_TOKEN", token)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut fast = [host("0..150", "0"), host("150..300", "0")];
    let mut slow = host("300..400", "2000");
    // Kill the slow host once round 1 is recorded, while it sits in round 2.
    let metrics = s.root.join("run/metrics.jsonl");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) < 1 {
        assert!(std::time::Instant::now() < deadline, "round 1 never finished");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    slow.kill().unwrap(); // SIGKILL
    slow.wait().unwrap();

    let status = serve.wait().unwrap();
    let mut stdout = String::new();
    std::io::Read::read_to_string(serve.stdout.as_mut().unwrap(), &mut stdout).unwrap();
    let log = serve_log.join().unwrap();
    assert!(status.success(), "rtx fed serve failed\nstdout: {stdout}\nstderr: {log}");
    for host in &mut fast {
        assert!(host.wait().unwrap().success(), "a surviving client host failed");
    }
    let records: Vec<serde_json::Value> = std::fs::read_to_string(&metrics).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    (records, stdout, log)
}

fn done(r: &serde_json::Value) -> u64 {
    r["clients_done"].as_u64().unwrap()
}

fn dropped(r: &serde_json::Value) -> u64 {
    r["dropped"].as_u64().unwrap()
}

#[test]
fn fed_serve_with_client_host_processes_survives_a_kill_9_mid_round() {
    let config = "seed = 5\n[population]\nn_clients = 400\ndataset = \"digits\"\n[round]\nrounds = 4\nclients_per_round = 120\nfan_in = 8\nhosts = 3\n[local]\nepochs = 1\nbatch_size = 4\n";
    let (records, stdout, _) = serve_with_a_kill_9(config);
    assert_eq!(records.len(), 4, "{stdout}");
    assert_eq!(dropped(&records[0]), 0, "round 1 had every host: {stdout}");
    for r in &records[1..] {
        assert!(done(r) > 0, "the surviving hosts' updates count: {r}");
        assert!(dropped(r) > 0, "the killed host's clients are dropped: {r}");
    }
    assert!(stdout.contains("round 2/4") && (stdout.contains("late clients-300..400") || stdout.contains("lost clients-300..400")), "{stdout}");
    assert!(records[3]["test_acc"].as_f64().unwrap() > 0.5, "the federation still learns: {}", records[3]);
}

#[test]
fn fed_serve_with_secagg_runs_secure_rounds_over_host_processes_through_a_kill_9() {
    // Goal: `[secagg]` over real client host processes: the coordinator only sees masked inputs
    // and the sum; killing a host mid-round loses its clients, the others' sum still unmasks and
    // the federation learns.
    let config = "seed = 5\n[population]\nn_clients = 400\ndataset = \"digits\"\n[round]\nrounds = 4\nclients_per_round = 120\nfan_in = 8\nhosts = 3\n[local]\nepochs = 1\nbatch_size = 4\n[secagg]\ndegree = 16\nthreshold = 9\n";
    let (records, stdout, log) = serve_with_a_kill_9(config);
    assert_eq!(records.len(), 4, "{stdout}");
    assert_eq!((done(&records[0]), dropped(&records[0])), (120, 0), "round 1 had every host: {stdout}");
    // Degree 16 over 3 hosts is fragile to a host loss, and the coordinator says so up front.
    assert!(log.contains("left short of neighbours"), "{log}");
    for r in &records[1..] {
        assert_eq!(done(r) + dropped(r), 120, "every client is done or dropped: {r}");
    }
    for r in &records[2..] {
        assert!(done(r) > 0 && dropped(r) > 0, "after the kill, the survivors' sum unmasks without the killed host's clients: {r}");
    }
    assert!(records[3]["test_acc"].as_f64().unwrap() > 0.5, "the federation still learns: {}", records[3]);
}

#[test]
fn fed_run_with_secagg_and_dp_runs_secure_rounds_and_reports_epsilon() {
    // Goal: a config with `[secagg]` (and `[dp]`) runs end to end through `rtx fed run`: every
    // round's record carries epsilon, the rounds aggregate under SecAgg+, and the model learns.
    let s = setup();
    std::fs::write(s.root.join("secure.toml"), format!("{FED}[dp]\nclip_norm = 1.0\nnoise_multiplier = 0.5\n[secagg]\n")).unwrap();
    let out = rtx(&["fed", "run", "secure.toml", "--out", "secure", "--no-progress"], &s.root);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "stdout: {stdout}\nstderr: {}", String::from_utf8_lossy(&out.stderr));
    let records: Vec<serde_json::Value> =
        std::fs::read_to_string(s.root.join("secure/metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(records.len(), 4);
    assert!(records.iter().all(|r| r["epsilon"].as_f64().is_some_and(|e| e > 0.0) && r["clients_done"].as_u64().is_some_and(|c| c > 50)), "{records:?}");
    let acc = records[3]["test_acc"].as_f64().unwrap();
    assert!(acc > 0.3, "digits accuracy after 4 DP + SecAgg rounds: {acc}");
    let with_async = format!("{FED}[secagg]\n[async]\nbuffer_size = 10\nmax_staleness = 2\nconcurrency = 20\n");
    std::fs::write(s.root.join("async.toml"), with_async).unwrap();
    let out = rtx(&["fed", "run", "async.toml", "--out", "async"], &s.root);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("secagg") && stderr.contains("out of scope"), "{stderr}");
}
