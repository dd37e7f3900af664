#!/usr/bin/env bash
# The GPU path of tensor and pipeline parallelism under `rtx launch`, on a GPU machine, with an
# already-built binary (`cargo build --release --locked --features cuda --bin rtx`; the GPU
# machine needs no Rust). GPT-2 124M shape (configs/gpt2_gpu_tp2.toml, configs/gpt2_gpu_pp2.toml):
#
#   for each precision (f32 first, then bf16 while time is left):
#     1. the 1-process GPU baseline: configs/gpt2_gpu.toml (no [parallel]) with --nproc 1;
#     2. tp = 2 on 2 worker processes, 3. pp = 2 (1F1B, 4 micro-batches) on 2 worker processes;
#   STEPS steps each. On a machine with one GPU both workers share it (worker i takes
#   cuda:(i mod GPUs)); their collectives and activation/gradient transfers are host-staged.
#
# Prints a short table last (per-step loss agreement with the 1-process run of the same
# precision, median step time, tokens/s) and writes logs, events and run folders to $OUT_DIR.
# Usage: scripts/gpu-mesh-check.sh [RTX_BINARY] [CONFIG_DIR]
#   (defaults target/release/rtx, and the configs beside this script, else configs/)
# Env: STEPS (20), WARMUP (3: steps left out of the step time), OUT_DIR (default $OUT/mesh if OUT
#   is set, else /tmp/rtx-gpu-mesh), RTX_DATA_DIR (default ./data; a sotu.tar.gz beside the
#   script is unpacked when there is no data folder), BUDGET_S (420: no new run starts after it).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
RTX=${1:-target/release/rtx}
CONFIGS=${2:-}
if [ -z "$CONFIGS" ]; then
  if [ -f "$HERE/gpt2_gpu_tp2.toml" ]; then CONFIGS="$HERE"; else CONFIGS="$HERE/../configs"; fi
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -z "${RTX_DATA_DIR:-}" ]; then
  if [ -d "$HERE/data/sotu" ]; then
    export RTX_DATA_DIR="$HERE/data"
  elif [ -f "$HERE/sotu.tar.gz" ]; then
    mkdir -p /tmp/rtx-mesh-data && tar -xzf "$HERE/sotu.tar.gz" -C /tmp/rtx-mesh-data
    export RTX_DATA_DIR=/tmp/rtx-mesh-data
  else
    export RTX_DATA_DIR="$PWD/data"
  fi
fi
OUT_DIR=${OUT_DIR:-${OUT:+$OUT/mesh}}
OUT_DIR=${OUT_DIR:-/tmp/rtx-gpu-mesh}
mkdir -p "$OUT_DIR"
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not found"
python3 - "$RTX" "$CONFIGS" "$OUT_DIR" "${STEPS:-20}" "${WARMUP:-3}" "${BUDGET_S:-420}" <<'PY'
import json, os, statistics, subprocess, sys, time
rtx, configs, out_dir, steps, warmup, budget = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
t0 = time.time()
tokens_per_step = 16 * 1024
rows, results = [], {}

def events(out):
    try:
        return [json.loads(l) for l in open(os.path.join(out, "events.jsonl"))]
    except FileNotFoundError:
        return []

def committed(out):
    by_step = {}
    for e in events(out):
        if e["event"] == "committed":
            by_step[e["step"]] = e
    return [by_step[s] for s in sorted(by_step)]

def show_logs(out):
    print(open(out + ".log").read()[-2000:])
    logs = os.path.join(out, "logs")
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        print(f"--- {name}")
        print(open(os.path.join(logs, name)).read()[-2000:])

def variant(src, name, precision):
    text = open(src).read()
    for p in ('precision = "f32"', 'precision = "bf16"'):
        text = text.replace(p, f'precision = "{precision}"')
    assert f'precision = "{precision}"' in text, src
    path = os.path.join(out_dir, name + ".toml")
    open(path, "w").write(text)
    return path

def launch(name, config, nproc, timeout=170):
    out = os.path.join(out_dir, name)
    subprocess.run(["rm", "-rf", out], check=True)
    cmd = [rtx, "launch", "--nproc", str(nproc), "--no-progress", "--out", out, "--steps", str(steps), config]
    print("$", " ".join(cmd), flush=True)
    start = time.time()
    with open(out + ".log", "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = "timeout"
    wall = time.time() - start
    c = committed(out)
    if rc != 0:
        show_logs(out)
    losses = [e["loss"] for e in c]
    times = [b["unix_s"] - a["unix_s"] for a, b in zip(c, c[1:]) if a["step"] >= warmup]
    step_s = statistics.median(times) if times else float("nan")
    print(f"  {name}: exit {rc}, {len(c)} committed steps, wall {wall:.1f} s, median step {step_s * 1000:.1f} ms", flush=True)
    print("  losses:", " ".join(f"{l:.6f}" for l in losses), flush=True)
    return {"rc": rc, "losses": losses, "step_s": step_s, "wall_s": wall}

def agreement(run, base):
    n = min(len(run["losses"]), len(base["losses"]))
    if n == 0:
        return float("nan"), 0
    return max(abs(a - b) / abs(b) for a, b in zip(run["losses"][:n], base["losses"][:n])), n

for precision in ("f32", "bf16"):
    for kind, src, nproc in (("1proc", "gpt2_gpu.toml", 1), ("tp2", "gpt2_gpu_tp2.toml", 2), ("pp2", "gpt2_gpu_pp2.toml", 2)):
        name = f"{kind}-{precision}"
        if time.time() - t0 > budget:
            print(f"skipping {name}: {budget} s budget spent", flush=True)
            continue
        results[name] = launch(name, variant(os.path.join(configs, src), name, precision), nproc)
        base = results.get(f"1proc-{precision}")
        r = results[name]
        ok = r["rc"] == 0 and len(r["losses"]) == steps
        if kind == "1proc" or base is None:
            agree, status = "(reference)", "ok" if ok else "FAIL"
        else:
            rel, n = agreement(r, base)
            tol = 1e-3 if precision == "f32" else 3e-2
            agree = f"max rel {rel:.2e} over {n} steps"
            status = "ok" if ok and n == steps and rel < tol else "FAIL" if not ok else "CHECK"
        first_last = f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}" if r["losses"] else "-"
        rows.append((name, f"{nproc}", first_last, agree, f"{r['step_s'] * 1000:.1f}", f"{tokens_per_step / r['step_s']:,.0f}" if r["step_s"] == r["step_s"] else "-", status))

print()
head = ("run", "procs", f"loss step 1 -> {steps}", "loss vs 1-process (same precision)", "median ms/step", "tokens/s", "status")
widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
for r in [head] + rows:
    print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))
json.dump(results, open(os.path.join(out_dir, "results.json"), "w"), indent=1)
print("RESULT " + json.dumps({k: {"step_ms": round(v["step_s"] * 1000, 1), "steps": len(v["losses"]), "rc": v["rc"]} for k, v in results.items()}))
PY
