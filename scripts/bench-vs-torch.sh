#!/usr/bin/env bash
# rustytorch vs PyTorch on this machine, in one run: fp32 matmul (1024³, 4096×4096×1024) and one
# full training step (MLP 784-512-512-10 batch 128; GPT 4 layers d=256 4 heads T=128 batch 16).
#
#   scripts/bench-vs-torch.sh              # threads = RTX_NUM_THREADS, default all cores
#   ROUNDS=3 scripts/bench-vs-torch.sh     # alternate the two sides 3 times, median of rounds
#
# Needs the throwaway torch venv (scripts/peer/setup-torch-venv.sh, ~3 GB; created on first
# use). Not for CI. Prints a table of medians and the ratio rustytorch/torch (time; lower is
# better; the bar is <= 1.5 for a training step, the goal <= 1.0). Raw JSON lines are kept in
# target/bench/vs-torch.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."

export RTX_NUM_THREADS="${RTX_NUM_THREADS:-$(nproc)}"
ROUNDS="${ROUNDS:-1}"
VENV="${RTX_TORCH_VENV:-/tmp/rtx-torch-venv}"
PY="$VENV/bin/python"
OUT_DIR=target/bench
OUT="$OUT_DIR/vs-torch.jsonl"

RTX_TORCH_VENV="$VENV" scripts/peer/setup-torch-venv.sh >&2
cargo build --release --locked -p rustytorch --bin rtx >&2
RTX="${RTX_BENCH_BIN:-target/release/rtx}"
if ! "$RTX" bench --help >/dev/null 2>&1; then
    echo "error: '$RTX bench' is not available (is 'rtx bench' wired in src/main.rs?)" >&2
    exit 1
fi

mkdir -p "$OUT_DIR"
: > "$OUT"
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; threads: $RTX_NUM_THREADS; rounds: $ROUNDS" >&2
for round in $(seq "$ROUNDS"); do
    echo "round $round/$ROUNDS" >&2
    for args in "matmul" "step --model mlp" "step --model gpt"; do
        # shellcheck disable=SC2086
        "$RTX" bench $args | tee -a "$OUT" >&2
        # shellcheck disable=SC2086
        "$PY" scripts/peer/torch_bench.py $args | tee -a "$OUT" >&2
    done
done

"$PY" - "$OUT" <<'PYEOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def key(r):
    return (r["bench"], r.get("shape"), r.get("variant", "step"))
groups = {}
for r in rows:
    groups.setdefault(key(r), {}).setdefault(r["impl"], []).append(r["median_ms"])
print()
print("| benchmark | variant | rustytorch ms | torch ms | ratio rustytorch/torch |")
print("|---|---|---:|---:|---:|")
for (bench, shape, variant), by in groups.items():
    rtx, pt = by.get("rustytorch"), by.get("torch")
    if not rtx or not pt:
        continue
    a, b = statistics.median(rtx), statistics.median(pt)
    name = f"{bench} {shape}"
    if bench == "matmul":
        m, n, k = (int(x) for x in shape.split("x"))
        gf = lambda ms: 2 * m * n * k / (ms * 1e-3) / 1e9
        print(f"| {name} | {variant} | {a:.2f} ({gf(a):.0f} GFLOP/s) | {b:.2f} ({gf(b):.0f} GFLOP/s) | {a / b:.2f} |")
    else:
        print(f"| {name} | {variant} | {a:.2f} | {b:.2f} | {a / b:.2f} |")
PYEOF
