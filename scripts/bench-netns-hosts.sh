#!/usr/bin/env bash
# QUIC across "hosts" for real (issue 20): HOSTS network namespaces (scripts/netns-hosts.sh: one
# bridge, 10.77.0.x, MTU 9000, optional netem DELAY / RATE), RANKS_PER_HOST rank processes in each,
# all_reduce measured three ways with the same ranks and sizes:
#   routed  shared memory inside a host, QUIC between hosts, hierarchical all_reduce (--hosts)
#   quic    QUIC between every pair (also inside a host), hierarchical all_reduce
#   routed-tls / tls  the same two with TLS over TCP (TlsTransport) in place of QUIC
#   gloo    PyTorch Gloo over TCP, every rank in its host's namespace (flat ring, as Gloo does)
# Rounds alternate rtx and Gloo; one table per round; raw JSON lines in $OUT.
#
#   sudo scripts/bench-netns-hosts.sh                                  # build, 4 hosts x 2 ranks, 3 rounds
#   sudo SKIP_BUILD=1 RTX_BENCH_BIN=gpu-bin/rtx PY=python3 scripts/bench-netns-hosts.sh
#   sudo DELAY=50us RATE=25gbit HOSTS=4 RANKS_PER_HOST=2 scripts/bench-netns-hosts.sh
#
# Needs root (CAP_NET_ADMIN, for the namespaces), iproute2, and python3 with torch for Gloo.
# Everything it makes is removed at the end (scripts/netns-hosts.sh down).
set -euo pipefail
cd "$(dirname "$0")/.."

HOSTS="${HOSTS:-4}"
RANKS_PER_HOST="${RANKS_PER_HOST:-2}"
SIZES="${SIZES:-16777216,67108864}"
ROUNDS="${ROUNDS:-3}"
REPEATS="${REPEATS:-5}"
THREADS="${THREADS:-2}"
STRIPES="${STRIPES:-1}"
TRANSPORTS="${TRANSPORTS:-routed,quic,routed-tls,tls}"
DATAGRAM="${DATAGRAM:-8952}"
PY="${PY:-python3}"
OUT="${OUT:-target/bench/netns-hosts}"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    cargo build --release --locked -p rustytorch --bin rtx >&2
fi
RTX="${RTX_BENCH_BIN:-${CARGO_TARGET_DIR:-target}/release/rtx}"
world=$((HOSTS * RANKS_PER_HOST))
addrs=$(seq -s, -f "10.77.0.%g" 1 "$HOSTS")
mkdir -p "$OUT"
trap 'bash scripts/netns-hosts.sh down "$HOSTS" >/dev/null 2>&1 || true' EXIT
bash scripts/netns-hosts.sh up "$HOSTS" >&2
bash scripts/netns-hosts.sh check "$HOSTS" >&2
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $HOSTS hosts x $RANKS_PER_HOST ranks; sizes $SIZES; $THREADS threads per rank; stripes $STRIPES; QUIC datagrams up to $DATAGRAM; netem delay ${DELAY:-none} rate ${RATE:-none}" >&2

for round in $(seq "$ROUNDS"); do
    log="$OUT/round$round.jsonl"
    "$RTX" bench collectives --transports quic --worlds 2 --ops all-reduce --sizes 4096 --repeats 1 --threads "$THREADS" 2>/dev/null \
        | grep '"reference"' > "$log" || true
    "$RTX" bench collectives --transports "$TRANSPORTS" --worlds "$world" --hosts "$HOSTS" --host-addrs "$addrs" --netns rtx-h \
        --quic-network-datagram "$DATAGRAM" --ops all-reduce --sizes "$SIZES" --repeats "$REPEATS" --threads "$THREADS" --stripes "$STRIPES" \
        --no-references 2>/dev/null | grep '^{' >> "$log"
    OMP_NUM_THREADS=1 "$PY" scripts/peer/gloo_bench.py --netns rtx-h --host-addrs "$addrs" --worlds "$world" --sizes "$SIZES" \
        --repeats "$REPEATS" 2>/dev/null >> "$log"
    echo "== round $round: $HOSTS hosts x $RANKS_PER_HOST ranks" >&2
    "$PY" scripts/peer/gloo_bench.py --table "$log" >&2 || true
done
