#!/usr/bin/env bash
# rustytorch collectives vs PyTorch Gloo on this machine, in one run: `rtx bench collectives`
# (QUIC with TLS and shared memory; all_reduce, reduce_scatter, all_gather; memcpy, TCP and raw
# quinn references) and Gloo all_reduce over loopback TCP with the same world sizes and sizes.
#
#   scripts/bench-collectives.sh                       # worlds 2,4; 4 KiB .. 256 MiB
#   MAX_SIZE=64M WORLDS=2 scripts/bench-collectives.sh # trim
#   SIZES=4K,1M,16M,64M scripts/bench-collectives.sh   # explicit sizes (K, M, G suffixes)
#   GLOO=0 scripts/bench-collectives.sh                # rtx only (no torch venv needed)
#   ROUNDS=3 scripts/bench-collectives.sh              # alternate rtx and gloo 3 times
#   SKIP_BUILD=1 RTX_BENCH_BIN=/path/to/rtx scripts/bench-collectives.sh   # measure a given build
#   RTX_ARGS="--chunk-bytes 256K" scripts/bench-collectives.sh           # extra `rtx bench` flags
#
# Needs the throwaway torch venv for Gloo (scripts/peer/setup-torch-venv.sh, ~3 GB; created on
# first use). Not for CI. Raw JSON lines go to target/bench/collectives.jsonl (one file per
# round: collectives-<round>.jsonl); the table at the end compares all_reduce bus bandwidth.
set -euo pipefail
cd "$(dirname "$0")/.."

WORLDS="${WORLDS:-2,4}"
MAX_SIZE="${MAX_SIZE:-256M}"
SIZES="${SIZES:-}"
REPEATS="${REPEATS:-5}"
ROUNDS="${ROUNDS:-1}"
GLOO="${GLOO:-1}"
VENV="${RTX_TORCH_VENV:-/tmp/rtx-torch-venv}"
PY="$VENV/bin/python"
OUT_DIR=target/bench

SKIP_BUILD="${SKIP_BUILD:-0}"
RTX_ARGS="${RTX_ARGS:-}"

if [ "$SKIP_BUILD" != 1 ]; then
    cargo build --release --locked -p rustytorch --bin rtx >&2
fi
RTX="${RTX_BENCH_BIN:-${CARGO_TARGET_DIR:-target}/release/rtx}"
if [ "$GLOO" = 1 ]; then
    RTX_TORCH_VENV="$VENV" scripts/peer/setup-torch-venv.sh >&2
fi

# The same size list for both sides, in bytes.
to_bytes() {
    local s="$1" n="${1%[KkMmGg]}"
    case "$s" in
        *[Kk]) echo $((n << 10)) ;; *[Mm]) echo $((n << 20)) ;; *[Gg]) echo $((n << 30)) ;; *) echo "$s" ;;
    esac
}
if [ -z "$SIZES" ]; then
    max=$(to_bytes "$MAX_SIZE"); s=4096; list=""
    while [ "$s" -le "$max" ]; do list="$list,$s"; s=$((s * 4)); done
    SIZES="${list#,}"
else
    list=""
    for s in ${SIZES//,/ }; do list="$list,$(to_bytes "$s")"; done
    SIZES="${list#,}"
fi

mkdir -p "$OUT_DIR"
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; worlds $WORLDS; sizes $SIZES; rounds $ROUNDS" >&2
for round in $(seq "$ROUNDS"); do
    out="$OUT_DIR/collectives-$round.jsonl"
    : > "$out"
    echo "round $round/$ROUNDS: rtx" >&2
    # shellcheck disable=SC2086 # RTX_ARGS is a list of flags
    "$RTX" bench collectives --worlds "$WORLDS" --sizes "$SIZES" --repeats "$REPEATS" $RTX_ARGS | tee -a "$out" > /dev/null
    if [ "$GLOO" = 1 ]; then
        echo "round $round/$ROUNDS: gloo" >&2
        "$PY" scripts/peer/gloo_bench.py --worlds "$WORLDS" --sizes "$SIZES" --repeats "$REPEATS" | tee -a "$out" >&2
        "$PY" scripts/peer/gloo_bench.py --table "$out"
    fi
done
cp "$OUT_DIR/collectives-$ROUNDS.jsonl" "$OUT_DIR/collectives.jsonl"
