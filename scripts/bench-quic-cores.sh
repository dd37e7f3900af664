#!/usr/bin/env bash
# QUIC+TLS all_reduce against Gloo where both have cores to use (issue 20's must-show): for each world
# size n, every process of both sides is pinned to the same 2n cores (`taskset`), rtx ranks run
# tokio runtimes of 2 threads and QUIC links of 1, 2 and 4 stripes (connections per rank pair),
# each with the all_reduce split into CHANNELS rings (`--channels`: independent rings over parts of
# the buffer, one thread each; default 1), Gloo runs from the same python3 (torch) with the same
# sizes. Rounds alternate rtx and Gloo. Columns are `quic-s<stripes>` (one ring) and
# `quic-s<stripes>-c<channels>`, and `tls-s<stripes>` for the TLS-over-TCP transport with
# TLS_STRIPES connections per rank pair (default "1 2"; empty to leave it out), each with the
# all_reduce split into TLS_CHANNELS rings (default 1; columns `tls-s<stripes>-c<channels>`).
#
#   scripts/bench-quic-cores.sh                         # build, worlds 2,4, 16M and 64M, 3 rounds
#   SKIP_BUILD=1 RTX_BENCH_BIN=gpu-bin/rtx OLD_BIN=gpu-bin/rtx-old scripts/bench-quic-cores.sh
#   PY=/usr/bin/python3 STRIPES="1 2 4" WORLDS="2 4" ROUNDS=3 scripts/bench-quic-cores.sh
#   STRIPES="1 2" CHANNELS="1 2 4" scripts/bench-quic-cores.sh   # channels beside stripes
#   STRIPES=4 TLS_STRIPES="1 2" scripts/bench-quic-cores.sh        # QUIC's best beside TLS over TCP
#
# Needs python3 with torch for Gloo (the GPU host has it; elsewhere scripts/peer/setup-torch-venv.sh).
# Needs 2 x (largest world) cores. Prints one table per round; raw JSON lines in target/bench/quic-cores/.
set -euo pipefail
cd "$(dirname "$0")/.."

WORLDS="${WORLDS:-2 4}"
SIZES="${SIZES:-16777216,67108864}"
STRIPES="${STRIPES:-1 2 4}"
CHANNELS="${CHANNELS:-1}"
TLS_STRIPES="${TLS_STRIPES-1 2}"
TLS_CHANNELS="${TLS_CHANNELS:-1}"
ROUNDS="${ROUNDS:-3}"
REPEATS="${REPEATS:-5}"
PY="${PY:-python3}"
CORES_PER_RANK="${CORES_PER_RANK:-2}"
OUT="${OUT:-target/bench/quic-cores}"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    cargo build --release --locked -p rustytorch --bin rtx >&2
fi
RTX="${RTX_BENCH_BIN:-${CARGO_TARGET_DIR:-target}/release/rtx}"
OLD_BIN="${OLD_BIN:-}"
mkdir -p "$OUT"
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; worlds $WORLDS; sizes $SIZES; stripes $STRIPES; channels $CHANNELS; $CORES_PER_RANK cores per rank" >&2

for round in $(seq "$ROUNDS"); do
    for n in $WORLDS; do
        cpus="0-$((n * CORES_PER_RANK - 1))"
        log="$OUT/round$round-n$n.jsonl"
        : > "$log"
        # The cipher reference once per world (its `cores` is what the pinned set allows).
        taskset -c "$cpus" "$RTX" bench collectives --transports quic --worlds "$n" --ops all-reduce --sizes 4096 --repeats 1 --threads "$CORES_PER_RANK" 2>/dev/null \
            | grep '"reference"' >> "$log" || true
        if [ -n "$OLD_BIN" ]; then
            taskset -c "$cpus" "$OLD_BIN" bench collectives --transports quic --worlds "$n" --ops all-reduce --sizes "$SIZES" --repeats "$REPEATS" --threads "$CORES_PER_RANK" --no-references 2>/dev/null \
                | sed 's/"transport":"quic"/"transport":"quic-before"/' >> "$log"
        fi
        for s in $STRIPES; do
            for c in $CHANNELS; do
                label="quic-s$s"
                [ "$c" = 1 ] || label="quic-s$s-c$c"
                taskset -c "$cpus" "$RTX" bench collectives --transports quic --worlds "$n" --ops all-reduce --sizes "$SIZES" --repeats "$REPEATS" --threads "$CORES_PER_RANK" --stripes "$s" --channels "$c" --no-references 2>/dev/null \
                    | sed "s/\"transport\":\"quic\"/\"transport\":\"$label\"/" >> "$log"
            done
        done
        for s in $TLS_STRIPES; do
            for c in $TLS_CHANNELS; do
                label="tls-s$s"
                [ "$c" = 1 ] || label="tls-s$s-c$c"
                taskset -c "$cpus" "$RTX" bench collectives --transports tls --worlds "$n" --ops all-reduce --sizes "$SIZES" --repeats "$REPEATS" --threads "$CORES_PER_RANK" --stripes "$s" --channels "$c" --no-references 2>/dev/null \
                    | sed "s/\"transport\":\"tls\"/\"transport\":\"$label\"/" >> "$log"
            done
        done
        OMP_NUM_THREADS=1 taskset -c "$cpus" "$PY" scripts/peer/gloo_bench.py --worlds "$n" --sizes "$SIZES" --repeats "$REPEATS" >> "$log" 2>/dev/null
        echo "== round $round, $n processes on cores $cpus" >&2
        "$PY" scripts/peer/gloo_bench.py --table "$log" >&2 || true
    done
done
