#!/usr/bin/env bash
# Data-parallel scaling and runtime overhead of `rtx launch`: the Fashion-MNIST MLP of
# configs/fashion_mlp.toml for STEPS steps (default 400) with 1 and with 2 worker processes on this
# machine, ROUNDS times each (default 3). Prints samples/s per run, the median scaling 1 -> 2, and
# the runtime's control overhead (share of the workers' step-loop time spent polling commands and
# reporting steps; bar <= 1%), and the share spent outside training steps altogether (also data
# waits, replica checksums).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/fetch-data.sh >/dev/null
[ -n "${SKIP_BUILD:-}" ] || cargo build --release --locked --bin rtx >/dev/null
STEPS=${STEPS:-400} ROUNDS=${ROUNDS:-3}
python3 - "$STEPS" "$ROUNDS" <<'PY'
import json, os, statistics, subprocess, sys, tempfile
steps, rounds = int(sys.argv[1]), int(sys.argv[2])
cfg = open("configs/fashion_mlp.toml").read().replace("steps = 3000", f"steps = {steps}").replace("checkpoint_every = 1000", "checkpoint_every = 0")
rates = {1: [], 2: []}; overheads = {1: [], 2: []}
for r in range(rounds):
    for n in (1, 2):
        d = tempfile.mkdtemp(); path = os.path.join(d, "c.toml"); open(path, "w").write(cfg)
        out = os.path.join(d, "run")
        subprocess.run(["./target/release/rtx", "launch", "--nproc", str(n), "--no-progress", "--out", out, path], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        es = [json.loads(l) for l in open(os.path.join(out, "events.jsonl"))]
        c = [e for e in es if e["event"] == "committed"]
        # Steady state: from the 50th committed step to the last.
        first, last = c[50], c[-1]
        samples = sum(e["samples"] for e in c[51:])
        rate = samples / (last["unix_s"] - first["unix_s"])
        summ = json.load(open(os.path.join(out, "summary.json")))
        oh, outside = summ["runtime_overhead"], summ["outside_steps"]
        rates[n].append(rate); overheads[n].append(oh)
        print(f"round {r+1}, {n} worker(s): {rate:,.0f} samples/s, runtime control overhead {oh*100:.3f}% (outside training steps {outside*100:.2f}%)")
m1, m2 = statistics.median(rates[1]), statistics.median(rates[2])
print(json.dumps({"bench": "elastic-dp", "steps": steps, "samples_per_s_1": m1, "samples_per_s_2": m2, "scaling_1_to_2": m2 / m1, "overhead_1": statistics.median(overheads[1]), "overhead_2": statistics.median(overheads[2]), "overhead_bar": 0.01}))
PY
