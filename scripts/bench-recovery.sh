#!/usr/bin/env bash
# Recovery benchmark: `rtx launch --nproc 2` on the elastic test config, kill -9 of one worker
# mid-run, repeated KILLS times (default 5). Prints, per kill and as medians: kill -> failure
# detected (the supervisor's "lost" event) and kill -> next committed step. Bar: <= 2 s to the
# next committed step. Usage: KILLS=5 scripts/bench-recovery.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/fetch-data.sh >/dev/null
[ -n "${SKIP_BUILD:-}" ] || cargo build --release --locked --bin rtx >/dev/null
KILLS=${KILLS:-5}
python3 - "$KILLS" <<'PY'
import json, os, signal, statistics, subprocess, sys, tempfile, time
kills = int(sys.argv[1])
cfg = open("tests/configs/elastic_fashion.toml").read().replace("steps = 600", "steps = 1500")
detect, commit, lost_steps = [], [], []
for i in range(kills):
    d = tempfile.mkdtemp()
    path = os.path.join(d, "c.toml"); open(path, "w").write(cfg)
    out = os.path.join(d, "run")
    p = subprocess.Popen(["./target/release/rtx", "launch", "--nproc", "2", "--no-progress", "--out", out, path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ev = os.path.join(out, "events.jsonl")
    def events():
        try: return [json.loads(l) for l in open(ev)]
        except FileNotFoundError: return []
    while not any(e["event"] == "committed" and e["step"] >= 300 for e in events()):
        time.sleep(0.01)
    pid = json.load(open(os.path.join(out, "cluster.json")))["pids"][1]
    before = max(e["step"] for e in events() if e["event"] == "committed")
    t_kill = time.time(); os.kill(pid, signal.SIGKILL)
    p.wait(timeout=300)
    es = events()
    lost = next(e for e in es if e["event"] == "lost")
    gen = [e for e in es if e["event"] == "generation"][-1]
    nxt = next(e for e in es if e["event"] == "committed" and e["unix_s"] > gen["unix_s"])
    detect.append(lost["unix_s"] - t_kill); commit.append(nxt["unix_s"] - t_kill)
    lost_steps.append(max(0, before + 1 - gen["next_step"]))
    print(f"kill {i+1}: detected after {detect[-1]*1000:.1f} ms, next committed step after {commit[-1]*1000:.1f} ms (steps lost: {lost_steps[-1]})")
print(json.dumps({"bench": "recovery", "kills": kills, "detect_median_ms": statistics.median(detect)*1000, "next_commit_median_ms": statistics.median(commit)*1000, "bar_ms": 2000, "max_steps_lost": max(lost_steps)}))
PY
