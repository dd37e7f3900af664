#!/usr/bin/env bash
# rustytorch vs PyTorch on this machine, in one run: fp32 matmul (1024³, 4096×4096×1024) and one
# full training step (MLP 784-512-512-10 batch 128; GPT 4 layers d=256 4 heads T=128 batch 16).
#
#   scripts/bench-vs-torch.sh              # threads = RTX_NUM_THREADS, default all cores
#   ROUNDS=3 scripts/bench-vs-torch.sh     # alternate the two sides 3 times, median of rounds
#   OPS=0 scripts/bench-vs-torch.sh        # skip the per-op breakdown (rtx bench ops)
#
# Needs the throwaway torch venv (scripts/peer/setup-torch-venv.sh, ~3 GB; created on first
# use). Not for CI. Prints a table of medians and the ratio rustytorch/torch (time; lower is
# better; the bar is <= 1.5 for a training step, the goal <= 1.0). Raw JSON lines are kept in
# target/bench/vs-torch.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."

export RTX_NUM_THREADS="${RTX_NUM_THREADS:-$(nproc)}"
ROUNDS="${ROUNDS:-1}"
OPS="${OPS:-1}"
VENV="${RTX_TORCH_VENV:-/tmp/rtx-torch-venv}"
PY="$VENV/bin/python"
OUT_DIR=target/bench
OUT="$OUT_DIR/vs-torch.jsonl"

RTX_TORCH_VENV="$VENV" scripts/peer/setup-torch-venv.sh >&2
cargo build --release -p rustytorch --bin rtx >&2
RTX="${RTX_BENCH_BIN:-${CARGO_TARGET_DIR:-target}/release/rtx}"
if ! "$RTX" bench --help >/dev/null 2>&1; then
    echo "error: '$RTX bench' is not available (is 'rtx bench' wired in src/main.rs?)" >&2
    exit 1
fi

mkdir -p "$OUT_DIR"
: > "$OUT"
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; threads: $RTX_NUM_THREADS; rounds: $ROUNDS" >&2
for round in $(seq "$ROUNDS"); do
    echo "round $round/$ROUNDS" >&2
    benches=("matmul" "step --model mlp" "step --model gpt")
    if [ "$OPS" = 1 ]; then benches+=("ops --model mlp" "ops --model gpt"); fi
    for args in "${benches[@]}"; do
        # shellcheck disable=SC2086
        "$RTX" bench $args | tee -a "$OUT" >&2
        # shellcheck disable=SC2086
        "$PY" scripts/peer/torch_bench.py $args | tee -a "$OUT" >&2
    done
done

"$PY" scripts/peer/bench_table.py "$OUT"
