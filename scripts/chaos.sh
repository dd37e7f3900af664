#!/usr/bin/env bash
# Chaos harness for `rtx launch` (issue 19): kill -9 of random workers at seeded moments, SIGSTOP
# then SIGCONT, floods of garbage UDP datagrams at the supervisor and worker ports, `rtx status` /
# `rtx worker --join` with a wrong token; over a matrix of transports (quic, shm), failure policies
# (shrink, replace) and sharding (replicated, zero1), plus an undisturbed run for the reference
# accuracy. Checks: recovery times, steps re-run, no regression past the newest durable state,
# no orphan process, refusals, bit-identical replicas, final accuracy. The driver is
# scripts/chaos/chaos.py (Python standard library only); see BENCHMARKS.md ("Chaos").
#
# Usage: scripts/chaos.sh [--no-fetch] [--preset short|long|sample] [--workers N] [--kills K]
#          [--seeds 1,2,3] [--transports quic,shm] [--policies shrink,replace]
#          [--sharding replicated,zero1] [--steps N] [--out DIR] [...]   (--help for all)
# RTX_BIN=path/to/rtx uses a prebuilt binary (no cargo needed, e.g. on a GPU host); otherwise the
# release binary is built first (SKIP_BUILD=1 skips that). --no-fetch: do not run
# scripts/fetch-data.sh (it needs the network); the data must then be in ./data or $RTX_DATA_DIR.
# Exit status: 0 all checks (and, with the long preset, all bars) passed; 1 some failed (named at
# the end); 2 bad usage or missing binary/data.
set -euo pipefail
cd "$(dirname "$0")/.."
fetch=1
args=()
for a in "$@"; do
    if [ "$a" = "--no-fetch" ]; then fetch=0; else args+=("$a"); fi
done
if [ "$fetch" = 1 ]; then
    bash scripts/fetch-data.sh --only fashion-mnist >/dev/null
fi
if [ -z "${RTX_BIN:-}" ]; then
    [ -n "${SKIP_BUILD:-}" ] || cargo build --release --locked --bin rtx >/dev/null
    export RTX_BIN="$PWD/target/release/rtx"
fi
exec python3 scripts/chaos/chaos.py "${args[@]+"${args[@]}"}"
