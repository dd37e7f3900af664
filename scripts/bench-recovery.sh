#!/usr/bin/env bash
# Recovery benchmark: `rtx launch --nproc 2` on the elastic test config, kill -9 of one worker
# mid-run, repeated KILLS times (default 5). Prints, per kill and as medians: kill -> failure
# detected (the supervisor's "lost" event) and kill -> next committed step. Bar: <= 2 s to the
# next committed step. With the torch venv (scripts/peer/setup-torch-venv.sh; TORCH_VENV, default
# /tmp/rtx-torch-venv), the same number of kills of a comparable torchrun elastic job
# (scripts/peer/torchrun_elastic.py: same MLP shape, batch, AdamW, gloo, checkpoint every 100 steps)
# runs in the same invocation and the ratio is printed. Usage: KILLS=5 scripts/bench-recovery.sh
# RTX_BIN names the binary to measure (default ./target/release/rtx, built unless SKIP_BUILD is
# set): an A/B of two builds runs the same script against each.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/fetch-data.sh >/dev/null
[ -n "${SKIP_BUILD:-}" ] || cargo build --release --locked --bin rtx >/dev/null
KILLS=${KILLS:-5}
RTX_BIN=${RTX_BIN:-./target/release/rtx}
TORCH_VENV=${TORCH_VENV:-/tmp/rtx-torch-venv}
python3 - "$KILLS" "$TORCH_VENV" "$RTX_BIN" <<'PY'
import json, os, signal, statistics, subprocess, sys, tempfile, time
kills = int(sys.argv[1])
venv = sys.argv[2]
rtx_bin = sys.argv[3]
cfg = open("tests/configs/elastic_fashion.toml").read().replace("steps = 600", "steps = 1500")
detect, commit, lost_steps = [], [], []
for i in range(kills):
    d = tempfile.mkdtemp()
    path = os.path.join(d, "c.toml"); open(path, "w").write(cfg)
    out = os.path.join(d, "run")
    p = subprocess.Popen([rtx_bin, "launch", "--nproc", "2", "--no-progress", "--out", out, path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ev = os.path.join(out, "events.jsonl")
    def events():
        # The supervisor may be half-way through writing the last line: read complete lines only.
        try: text = open(ev).read()
        except FileNotFoundError: return []
        return [json.loads(l) for l in text.split("\n")[:-1] if l.strip()]
    while not any(e["event"] == "committed" and e["step"] >= 300 + 37 * i for e in events()):
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
result = {"bench": "recovery", "kills": kills, "detect_median_ms": statistics.median(detect)*1000, "next_commit_median_ms": statistics.median(commit)*1000, "bar_ms": 2000, "max_steps_lost": max(lost_steps)}
if os.path.exists(os.path.join(venv, "bin", "torchrun")):
    torch_times, torch_lost = [], []
    for i in range(kills):
        d = tempfile.mkdtemp()
        env = dict(os.environ, OUT=d, STEPS="4000", CKPT_EVERY="100", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
        p = subprocess.Popen([f"{venv}/bin/torchrun", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{29600 + i}", "scripts/peer/torchrun_elastic.py"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        log = os.path.join(d, "steps.jsonl")
        def lines():
            try: return [json.loads(l) for l in open(log)]
            except FileNotFoundError: return []
        start = time.time()
        while not any(l["step"] >= 300 + 37 * i for l in lines()):
            time.sleep(0.01)
            if time.time() - start > 180: raise SystemExit("torchrun job did not reach the kill step")
        before = max(l["step"] for l in lines())
        t_kill = time.time(); os.kill(int(open(os.path.join(d, "pid-1")).read()), signal.SIGKILL)
        while not any(l["t"] > t_kill and l["restart"] > 0 for l in lines()):
            time.sleep(0.01)
            if time.time() - t_kill > 120: p.kill(); raise SystemExit("torchrun did not recover within 120 s")
        first = next(l for l in lines() if l["t"] > t_kill and l["restart"] > 0)
        torch_times.append(first["t"] - t_kill); torch_lost.append(before + 1 - first["step"])
        p.kill(); p.wait()
        print(f"torchrun kill {i+1}: next step after {torch_times[-1]*1000:.0f} ms (steps lost: {torch_lost[-1]})")
    result["torchrun_next_step_median_ms"] = statistics.median(torch_times) * 1000
    result["torchrun_max_steps_lost"] = max(torch_lost)
    result["ratio_torchrun_over_rtx"] = statistics.median(torch_times) / statistics.median(commit)
print(json.dumps(result))
PY
