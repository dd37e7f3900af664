//! The live cluster page in a real browser: `rtx launch --nproc 2 --http 127.0.0.1:0` trains
//! Fashion-MNIST while Debian's headless Chromium (driven by playwright-core through
//! `scripts/browser/live_page.mjs`) watches the page; when the page lists two training workers,
//! the test kills one with `kill -9` and the browser waits for the recovery to appear. The JSON
//! API and `/metrics` of the same job are checked over plain HTTP.
//!
//! Needs `bash scripts/setup-browser.sh` (Chromium, node and playwright-core) and the
//! Fashion-MNIST data (`bash scripts/fetch-data.sh`). `RTX_UPDATE_SCREENSHOT=1` copies the
//! screenshot over `docs/live-page.png`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::{alive, signal, Launch};

const CHROMIUM: &str = "/usr/bin/chromium";

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Chromium and playwright-core, or a failure that says how to get them.
fn browser_or_fail() -> PathBuf {
    let chromium = std::env::var_os("RTX_CHROMIUM").map_or_else(|| PathBuf::from(CHROMIUM), PathBuf::from);
    let driver = repo().join("scripts/browser/node_modules/playwright-core/package.json");
    let node = Command::new("node").arg("--version").output().is_ok_and(|o| o.status.success());
    assert!(
        chromium.exists() && driver.exists() && node,
        "the live-page browser test needs Chromium ({}: {}), node ({}) and playwright-core ({}: {}); run `bash scripts/setup-browser.sh`",
        chromium.display(),
        if chromium.exists() { "found" } else { "missing" },
        if node { "found" } else { "missing" },
        driver.display(),
        if driver.exists() { "found" } else { "missing" },
    );
    chromium
}

fn config() -> PathBuf {
    let text = std::fs::read_to_string(repo().join("tests/configs/elastic_fashion.toml")).expect("test config");
    let dir = tempfile::tempdir().expect("tempdir").keep();
    let path = dir.join("live.toml");
    // Far more steps than the test watches: the browser starts at its own pace, and the test ends
    // the job by killing the supervisor (tests/elastic.rs covers jobs that finish).
    std::fs::write(&path, text.replace("steps = 600", "steps = 100000")).expect("write config");
    path
}

/// Waits for `<out>/http.addr`, which `--http` writes once the page is served.
fn page_addr(out: &Path) -> SocketAddr {
    let start = Instant::now();
    loop {
        if let Some(addr) = std::fs::read_to_string(out.join("http.addr")).ok().and_then(|t| t.trim().parse().ok()) {
            return addr;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "no {}/http.addr after 60 s", out.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One HTTP/1.1 GET: (status code, body).
fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).expect("connect to the live page");
    stream.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").expect("send");
    let mut text = String::new();
    stream.read_to_string(&mut text).expect("read response");
    let (head, body) = text.split_once("\r\n\r\n").expect("header end");
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).expect("status code");
    (status, body.to_string())
}

#[test]
fn the_page_shows_two_workers_then_the_recovery_after_a_kill() {
    let chromium = browser_or_fail();
    let launch = Launch::start_in(Launch::fresh_out(), &config(), 2, &["--http", "127.0.0.1:0"]);
    let addr = page_addr(&launch.out);
    let shot = launch.out.join("live-page.png");
    let mut browser = Command::new("node")
        .arg(repo().join("scripts/browser/live_page.mjs"))
        .arg(format!("http://{addr}/"))
        .arg(&shot)
        .env("RTX_CHROMIUM", &chromium)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start node");
    let mut answers = browser.stdin.take().expect("stdin");
    let mut said = BufReader::new(browser.stdout.take().expect("stdout")).lines();
    let mut next = |expect: &str| -> Value {
        let line = said.next().unwrap_or_else(|| panic!("the browser script ended before {expect}")).expect("read");
        let message: Value = serde_json::from_str(&line).unwrap_or_else(|_| panic!("not JSON from the browser script: {line}"));
        assert_eq!(message["stage"], expect, "browser script: {message}");
        message
    };

    let seen = next("two-workers");
    let mut pids = launch.pids();
    let mut shown: Vec<u32> = seen["pids"].as_array().expect("pids").iter().map(|p| p.as_u64().expect("pid") as u32).collect();
    pids.sort();
    shown.sort();
    assert_eq!(shown, pids, "the page lists the pids of cluster.json");
    let victim = launch.pids()[1];
    signal(victim, "-9");
    writeln!(answers, "killed").expect("answer the browser script");
    let recovered = next("recovered");
    assert_eq!(recovered["lost_pids"], serde_json::json!([victim]), "{recovered}");
    assert!(recovered["recovery"].as_str().is_some_and(|t| t.contains("recovered: generation") && t.contains("1 worker")), "{recovered}");
    assert!(recovered["loss_points"].as_u64().is_some_and(|n| n >= 10), "{recovered}");
    assert!(browser.wait().expect("node").success(), "the browser script failed");
    let png = std::fs::read(&shot).expect("screenshot");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000, "{} is not a page screenshot", shot.display());
    if std::env::var_os("RTX_UPDATE_SCREENSHOT").is_some() {
        std::fs::copy(&shot, repo().join("docs/live-page.png")).expect("copy the screenshot to docs/");
    }

    // The same job through the JSON API and Prometheus text, while it still runs.
    let (status, body) = get(addr, "/api/state");
    assert_eq!(status, 200, "{body}");
    let state: Value = serde_json::from_str(&body).expect("state JSON");
    assert_eq!(state["summary"]["counters"]["lost"], 1, "{state}");
    assert_eq!(state["summary"]["counters"]["recoveries"], 1, "{state}");
    let lost: Vec<&Value> = state["members"].as_array().expect("members").iter().filter(|m| m["state"] == "lost").collect();
    assert_eq!(lost.len(), 1);
    assert_eq!(lost[0]["pid"], victim);
    let training = state["members"].as_array().expect("members").iter().find(|m| m["state"] == "training").expect("a survivor");
    assert_eq!(training["coordinate"], serde_json::json!({ "dp": 0, "pp": 0, "tp": 0 }), "{training}");
    let (status, body) = get(addr, "/metrics");
    assert_eq!(status, 200);
    for line in ["rtx_lost_total 1", "rtx_recoveries_total 1", "rtx_world 1", "# TYPE rtx_step gauge"] {
        assert!(body.lines().any(|l| l == line), "no `{line}` in /metrics:\n{body}");
    }
    let (status, body) = get(addr, "/api/events?after=0");
    assert_eq!(status, 200);
    let events: Vec<Value> = serde_json::from_str(&body).expect("events JSON");
    let kinds: Vec<&str> = events.iter().filter_map(|e| e["kind"].as_str()).collect();
    assert!(kinds.contains(&"lost") && kinds.contains(&"recovery"), "{kinds:?}");
    let last = events.last().and_then(|e| e["seq"].as_u64()).expect("seq");
    assert_eq!(get(addr, &format!("/api/events?after={last}")).1, "[]");
    let (status, body) = get(addr, "/api/events?after=soon");
    assert_eq!(status, 400, "a bad query is refused: {body}");
    let (status, page) = get(addr, "/");
    assert_eq!(status, 200);
    assert!(page.contains("new EventSource(\"events\")") && !page.contains("http://") && !page.contains("https://"), "the page is self-contained");

    let survivors = launch.pids();
    let mut launch = launch;
    assert!(launch.child.try_wait().expect("poll").is_none(), "the job ended early");
    assert_eq!(launch.events().iter().filter(|e| e["event"] == "lost").count(), 1);
    launch.child.kill().expect("end the job");
    let _ = launch.child.wait();
    let start = Instant::now();
    while survivors.iter().any(|&p| alive(p)) {
        assert!(start.elapsed() < Duration::from_secs(20), "workers {survivors:?} outlived their supervisor");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_taken_http_address_fails_the_launch_naming_it() {
    // Goal: `--http` on a port in use stops `rtx launch` with an error naming the address,
    // before any worker trains.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let out = Launch::fresh_out();
    let output = support::rtx().args(["launch", "--nproc", "1", "--no-progress", "--http", &addr, "--out"]).arg(&out).arg(config()).output().expect("run rtx launch");
    let text = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{text}");
    assert!(text.contains(&format!("cannot serve the live page on {addr}")), "{text}");
    assert!(!out.join("metrics.jsonl").exists() || std::fs::read_to_string(out.join("metrics.jsonl")).unwrap_or_default().is_empty());
}
