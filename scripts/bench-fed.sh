#!/usr/bin/env bash
# rustytorch vs Flower (simulation engine) on the reference federated workload of issue 15, in one
# run on this machine: seconds per round (median) and peak RSS at each N/K, and the ratio.
#
#   scripts/bench-fed.sh                         # N/K = 10K/1K, 100K/1K, 100K/10K (+ rustytorch 1M/100K)
#   SIZES="10000:1000" ROUNDS=3 scripts/bench-fed.sh
#   FLOWER=0 scripts/bench-fed.sh                # rustytorch only
#
# Needs the throwaway Flower venv (scripts/peer/setup-flower-venv.sh, created on first use).
# Not for CI. Raw JSON lines go to target/bench/fed.jsonl; a table goes to stdout.
set -euo pipefail
cd "$(dirname "$0")/.."

SIZES="${SIZES:-10000:1000 100000:1000 100000:10000}"
BIG="${BIG:-1000000:100000}"
ROUNDS="${ROUNDS:-3}"
FLOWER="${FLOWER:-1}"
VENV="${RTX_FLOWER_VENV:-/work/venv-flower}"
OUT_DIR=target/bench
OUT="$OUT_DIR/fed.jsonl"

cargo build --release -p rustytorch --bin rtx >&2
RTX="${RTX_BENCH_BIN:-${CARGO_TARGET_DIR:-target}/release/rtx}"
if [ "$FLOWER" = 1 ]; then RTX_FLOWER_VENV="$VENV" scripts/peer/setup-flower-venv.sh >&2; fi
mkdir -p "$OUT_DIR"
: > "$OUT"
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; date: $(date -u +%FT%TZ); rounds: $ROUNDS" >&2

summary() { tail -n 1 | tee -a "$OUT"; }
field() { python3 -c "import json,sys; print(json.loads(sys.argv[1]).get(sys.argv[2]))" "$1" "$2"; }

printf '%-10s %-8s %14s %14s %12s %12s %8s\n' N K rtx_s/round flower_s/round rtx_MiB flower_MiB speedup
for size in $SIZES $BIG; do
    n="${size%%:*}"; k="${size##*:}"
    rtx_line=$("$RTX" bench fed --population "$n" --clients-per-round "$k" --rounds "$ROUNDS" | summary)
    rtx_s=$(field "$rtx_line" median_s_per_round); rtx_mib=$(field "$rtx_line" peak_rss_mib)
    fl_s=-; fl_mib=-; ratio=-
    if [ "$FLOWER" = 1 ] && [ "$size" != "$BIG" ]; then
        fl_line=$("$VENV/bin/python" scripts/peer/flower_fed.py --population "$n" --clients-per-round "$k" --rounds "$ROUNDS" 2>/dev/null | summary)
        fl_s=$(field "$fl_line" median_s_per_round); fl_mib=$(field "$fl_line" peak_rss_tree_mib)
        ratio=$(python3 -c "print(f'{$fl_s / $rtx_s:.0f}x')")
    fi
    printf '%-10s %-8s %14.3f %14s %12s %12s %8s\n' "$n" "$k" "$rtx_s" "$fl_s" "$rtx_mib" "$fl_mib" "$ratio"
done
