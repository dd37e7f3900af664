#!/usr/bin/env bash
# Issue 15's real-process drill: `rtx fed serve configs/fed_hosts.toml` (N = 100,000, K = 10,000)
# with 4 `rtx fed clients` processes of 25,000 clients each on loopback QUIC; the last host is
# killed with SIGKILL in the middle of round KILL_ROUND (it is slowed by SLOW_MS a round so the
# kill lands mid-round); that round closes at the round timeout with the other hosts' updates and
# the next rounds proceed. Prints each round's record and a verdict.
#   RTX_BIN=target/release/rtx bash scripts/fed-hosts-check.sh
#   CONFIG=configs/fed_hosts_secagg.toml ROUND_TIMEOUT_S=300 bash scripts/fed-hosts-check.sh
#     (the same drill with secure aggregation across the hosts; each of its four phases gets the
#     round timeout, and on 2 cores a phase can take a minute)
# Environment: RTX_BIN (default target/release/rtx, built when missing), CONFIG, PORT (29600),
# KILL_ROUND (3), SLOW_MS (3000), ROUND_TIMEOUT_S (6), OUT (a temporary folder), DATASETS (the
# sets fetch-data.sh makes sure of: fashion-mnist).
set -euo pipefail
cd "$(dirname "$0")/.."
RTX_BIN="${RTX_BIN:-target/release/rtx}"
CONFIG="${CONFIG:-configs/fed_hosts.toml}"
PORT="${PORT:-29600}"
KILL_ROUND="${KILL_ROUND:-3}"
SLOW_MS="${SLOW_MS:-3000}"
ROUND_TIMEOUT_S="${ROUND_TIMEOUT_S:-6}"
OUT="${OUT:-$(mktemp -d)/fed_hosts}"
[ -x "$RTX_BIN" ] || cargo build --release -p rustytorch --bin rtx
bash scripts/fetch-data.sh --only "${DATASETS:-fashion-mnist}" >/dev/null
mkdir -p "$OUT"
export RTX_TOKEN
RTX_TOKEN="$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')"
pids=()
# Peak RSS of each host through GNU time when it is installed.
run_host() { if [ -x /usr/bin/time ]; then /usr/bin/time -f %M -o "$1" "${@:2}"; else shift; "$@"; fi; }
cleanup() { kill "${pids[@]}" 2>/dev/null || true; pkill -f -- "--join 127.0.0.1:$PORT" 2>/dev/null || true; }
trap cleanup EXIT
"$RTX_BIN" fed serve "$CONFIG" --listen "127.0.0.1:$PORT" --out "$OUT" --no-progress --round-timeout-s "$ROUND_TIMEOUT_S" > "$OUT/serve.out" 2> "$OUT/serve.err" &
serve=$!
sleep 1
n=$(awk -F' *= *' '/^n_clients/ {print $2; exit}' "$CONFIG")
quarter=$((n / 4))
for i in 0 1 2 3; do
  lo=$((i * quarter)); hi=$(( i == 3 ? n : (i + 1) * quarter ))
  delay=0; [ "$i" = 3 ] && delay="$SLOW_MS"
  run_host "$OUT/host$i.rss" "$RTX_BIN" fed clients --join "127.0.0.1:$PORT" --population-slice "$lo..$hi" --compute-delay-ms "$delay" > "$OUT/host$i.out" 2> "$OUT/host$i.err" &
  pids+=($!)
done
# Kill the slow host 1 s into round KILL_ROUND (it received the round when the previous one was recorded).
recorded() { if [ -f "$OUT/metrics.jsonl" ]; then wc -l < "$OUT/metrics.jsonl"; else echo 0; fi; }
while [ "$(recorded)" -lt "$((KILL_ROUND - 1))" ]; do
  kill -0 "$serve" 2>/dev/null || { cat "$OUT/serve.err"; echo "fed-hosts-check: the coordinator exited early"; exit 1; }
  sleep 0.1
done
sleep 1
pkill -9 -f -- "population-slice $((3 * quarter))..$n"
echo "fed-hosts-check: killed client host 3 ($((3 * quarter))..$n) with SIGKILL during round $KILL_ROUND"
wait "$serve"
echo "fed-hosts-check: coordinator finished"
cat "$OUT/serve.out"
for i in 0 1 2; do
  wait "${pids[$i]}"
  [ -s "$OUT/host$i.rss" ] && echo "host $i peak RSS: $(( $(tail -1 "$OUT/host$i.rss") / 1024 )) MiB"
done
python3 - "$OUT/metrics.jsonl" "$KILL_ROUND" <<'PY'
import json, sys
records = [json.loads(l) for l in open(sys.argv[1])]
kill = int(sys.argv[2])
ok = all(r["clients_done"] > 0 for r in records) and records[kill - 1]["dropped"] > 0 and all(r["dropped"] == 0 for r in records[: kill - 1])
for r in records:
    print(f"round {r['round']}: done {r['clients_done']:6d} dropped {r['dropped']:6d} test_acc {r.get('test_acc', float('nan')):.4f} {r['seconds']:.2f} s")
print("fed-hosts-check:", "PASS" if ok else "FAIL", f"({len(records)} rounds; host 3 killed in round {kill})")
sys.exit(0 if ok else 1)
PY
