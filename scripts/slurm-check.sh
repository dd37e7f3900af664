#!/usr/bin/env bash
# Runs examples/slurm.sbatch on a real Slurm (Debian's slurm-wlm 22.05 + munge), on one machine
# posing as two nodes (two slurmd daemons, rtx1 and rtx2; 2 nodes x 2 tasks per job), through
# four scenarios, and prints a table:
#   normal      the job finishes COMPLETED with the expected accuracy and writes checkpoints
#   scancel     a running job is cancelled and no rtx process is left behind
#   kill-9      one worker task is killed with SIGKILL: the job goes on and ends COMPLETED
#   concurrent  two jobs whose first node is the same host run at once (ports from the job ids)
# Every job is a submission of the same config (each gets its own output folder).
#
# Idempotent: installs the packages only when missing, reuses (or restarts) its daemons, and
# keeps its state under $RTX_SLURM_STATE (default /tmp/rtx-slurm). Needs root (apt-get, munged,
# slurmd), adds "127.0.0.1 rtx1 rtx2" to /etc/hosts, and stops every daemon it started at the end.
# Builds `rtx` (debug profile, into $CARGO_TARGET_DIR or target/) unless RTX_BIN names one.
# Exit status 0 only when every scenario passed. Usage: bash scripts/slurm-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
STATE=${RTX_SLURM_STATE:-/tmp/rtx-slurm}
STEPS=${RTX_SLURM_STEPS:-1500}         # training steps per job (4 workers: 10-30 s on 2 cores)
MIN_ACC=${RTX_SLURM_MIN_ACC:-0.80}      # expected test accuracy (tests/elastic.rs asks the same)
JOB_TIMEOUT=${RTX_SLURM_JOB_TIMEOUT:-240}
NODES=(rtx1 rtx2)
NODE_PORTS=(17101 17102)
CTLD_PORT=17100
export SLURM_CONF=$STATE/slurm.conf

log() { echo "[slurm-check $(date -u +%H:%M:%S)] $*" >&2; }
die() { log "FAILED: $*"; exit 1; }
[ "$(id -u)" -eq 0 ] || die "run as root (installs packages, starts munged and slurmd)"

# --- packages --------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null || ! command -v sbatch >/dev/null; then
  log "installing slurm-wlm and munge from Debian"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurm-wlm munge >/dev/null \
    || { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurm-wlm munge >/dev/null; }
fi
command -v openssl >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends openssl >/dev/null
log "$(dpkg-query -W -f '${Package} ${Version}' slurm-wlm), $(munged --version 2>&1 | head -n1)"

# --- the rtx binary and the data ---------------------------------------------------------------
if [ -z "${RTX_BIN:-}" ]; then
  log "building rtx (debug profile)"
  cargo build --locked --bin rtx >&2
  RTX_BIN=${CARGO_TARGET_DIR:-$REPO/target}/debug/rtx
fi
RTX_BIN=$(realpath "$RTX_BIN")
[ -x "$RTX_BIN" ] || die "no rtx binary at $RTX_BIN"
export RTX_DATA_DIR=${RTX_DATA_DIR:-$REPO/data}
RTX_DATA_DIR=$(realpath "$RTX_DATA_DIR")
[ -d "$RTX_DATA_DIR/fashion-mnist" ] || bash scripts/fetch-data.sh >&2

# --- state, config, hosts --------------------------------------------------------------------
stop_daemons() {
  for f in "$STATE"/run/*.pid; do
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then kill "$pid" 2>/dev/null || true; fi
    rm -f "$f"
  done
  sleep 1
}
mkdir -p "$STATE"/{run,ctld,jobs,bin}
stop_daemons   # a previous run's daemons, if any
for n in "${NODES[@]}"; do mkdir -p "$STATE/spool-$n"; done
if ! grep -q "rtx-slurm-check" /etc/hosts; then
  echo "127.0.0.1 ${NODES[*]} # rtx-slurm-check" >> /etc/hosts
fi
# The jobs find rtx on PATH, as on a cluster.
ln -sf "$RTX_BIN" "$STATE/bin/rtx"
CPUS=4   # per node: two jobs of 2 tasks x 1 CPU fit at once (the machine may have fewer cores)
cat > "$STATE/slurm.conf" <<EOF
ClusterName=rtxcheck
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool-%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
MinJobAge=3600
InactiveLimit=0
SlurmdTimeout=60
NodeName=${NODES[0]} NodeHostname=localhost NodeAddr=127.0.0.1 Port=${NODE_PORTS[0]} CPUs=$CPUS RealMemory=1000 State=UNKNOWN
NodeName=${NODES[1]} NodeHostname=localhost NodeAddr=127.0.0.1 Port=${NODE_PORTS[1]} CPUs=$CPUS RealMemory=1000 State=UNKNOWN
PartitionName=check Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP
EOF

# --- daemons -----------------------------------------------------------------------------------
trap 'log "stopping the daemons"; stop_daemons' EXIT
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
[ -s /etc/munge/munge.key ] || { mungekey --create >/dev/null 2>&1 || /usr/sbin/create-munge-key -f; chown munge:munge /etc/munge/munge.key; }
# (Re)starts munged unless it answers. Called again before every scenario: once in CI a running
# munged's socket was gone mid-run (srun: "Failed to access /run/munge/munge.socket.2").
ensure_munge() {
  munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
  [ -s "$STATE/run/munged.pid" ] && { kill "$(cat "$STATE/run/munged.pid")" 2>/dev/null || true; sleep 0.5; }
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged --force || die "munged did not start"
  # Its pid file lives in munge's folder; copy the pid to where stop_daemons looks.
  for _ in $(seq 1 50); do [ -s /run/munge/munged.pid ] && break; sleep 0.1; done
  cp /run/munge/munged.pid "$STATE/run/munged.pid"
  munge -n | unmunge >/dev/null || die "munged does not answer"
}
ensure_munge
slurmctld -c -f "$SLURM_CONF" || die "slurmctld did not start (see $STATE/slurmctld.log)"
for n in "${NODES[@]}"; do slurmd -N "$n" -f "$SLURM_CONF" || die "slurmd -N $n did not start (see $STATE/slurmd-$n.log)"; done
for _ in $(seq 1 60); do
  idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle' || true)
  [ "$idle" -eq 2 ] && break
  sleep 1
done
[ "$idle" -eq 2 ] || die "the two nodes did not come up idle: $(sinfo -N 2>&1)"
log "cluster up: $(sinfo -h -N -o '%N/%t' | tr '\n' ' ')"

# --- helpers -----------------------------------------------------------------------------------
CONFIG=$STATE/jobs/check.toml
# The elastic test config (small MLP, fast failure detection), with checkpoints every 200 steps.
sed -e "s/^steps = 600/steps = $STEPS/" -e 's/^log_every = 50/log_every = 50\ncheckpoint_every = 200/' "$REPO/tests/configs/elastic_fashion.toml" > "$CONFIG"
grep -q '^checkpoint_every = 200' "$CONFIG" || die "could not write $CONFIG"

submit() {  # prints the job id
  (cd "$STATE/jobs" && PATH="$STATE/bin:$PATH" sbatch --parsable --cpus-per-task=1 --output="$STATE/jobs/slurm-%j.out" "$@" "$REPO/examples/slurm.sbatch" "$CONFIG")
}
job_field() { scontrol show job "$1" -o 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p" | head -n1; }
job_state() { job_field "$1" JobState; }
wait_done() {  # waits until job $1 leaves PENDING/RUNNING/COMPLETING
  local start=$SECONDS
  while true; do
    case "$(job_state "$1")" in
      PENDING|RUNNING|COMPLETING|CONFIGURING|"") ;;
      *) return 0 ;;
    esac
    [ $((SECONDS - start)) -lt "$JOB_TIMEOUT" ] || { log "job $1 still $(job_state "$1") after ${JOB_TIMEOUT}s; cancelling"; scancel "$1"; sleep 10; return 1; }
    sleep 1
  done
}
out_dir() { echo "$STATE/jobs/runs/slurm-$1"; }
committed() {  # newest committed step of job $1 (or -1)
  local f; f="$(out_dir "$1")/events.jsonl"
  [ -f "$f" ] || { echo -1; return; }
  python3 -c 'import json,sys
s=-1
for l in open(sys.argv[1]):
    try: e=json.loads(l)
    except ValueError: continue
    if e.get("event")=="committed": s=max(s,e["step"])
print(s)' "$f"
}
wait_step() {  # waits until job $1 committed step $2
  local start=$SECONDS
  while [ "$(committed "$1")" -lt "$2" ]; do
    # One reading of the state: a job just allocated is CONFIGURING for a moment (reading it
    # three times once saw CONFIGURING, then reported RUNNING as the failure).
    local state; state=$(job_state "$1")
    case "$state" in
      RUNNING|PENDING|CONFIGURING) ;;
      *) die "job $1 is $state before step $2 (see $STATE/jobs/slurm-$1.out)" ;;
    esac
    [ $((SECONDS - start)) -lt "$JOB_TIMEOUT" ] || die "job $1 did not reach step $2 in ${JOB_TIMEOUT}s"
    sleep 0.5
  done
}
accuracy() { python3 -c 'import json,sys
try: print("%.4f" % json.load(open(sys.argv[1]))["eval"]["test_acc"])
except Exception: print("-")' "$(out_dir "$1")/summary.json"; }
checkpoints() { find "$(out_dir "$1")/checkpoints" -name 'step-*.safetensors' 2>/dev/null | wc -l; }
leftovers() {  # rtx processes still running (any job)
  local n=0 p
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/exe" 2>/dev/null)" = "$RTX_BIN" ] && n=$((n + 1))
  done
  echo "$n"
}
wait_no_leftovers() {
  for _ in $(seq 1 30); do [ "$(leftovers)" -eq 0 ] && return 0; sleep 1; done
  return 1
}
ansi() { grep -c $'\e\[' "$STATE/jobs/slurm-$1.out" || true; }
stale() { grep -ci 'stale\|generation .* failed\|step failed' "$STATE/jobs/slurm-$1.out" || true; }

ROWS=()
FAILED=0
row() {  # scenario job expect_state extra_ok note
  local scenario=$1 job=$2 expect=$3 ok=$4 note=$5 state acc left
  state=$(job_state "$job"); acc=$(accuracy "$job"); left=$(leftovers)
  local verdict=PASS
  [ "$state" = "$expect" ] && [ "$ok" = yes ] && [ "$left" -eq 0 ] || verdict=FAIL
  if [ "$expect" = COMPLETED ]; then
    awk -v a="$acc" -v m="$MIN_ACC" 'BEGIN { exit !(a != "-" && a + 0 >= m) }' || verdict=FAIL
  fi
  [ "$verdict" = PASS ] || FAILED=1
  ROWS+=("$(printf '%-10s %6s %-10s %-6s %8s %5s %9s %5s %6s  %-4s %s' "$scenario" "$job" "$state" "$(job_field "$job" ExitCode)" "$acc" "$(checkpoints "$job")" "$left" "$(ansi "$job")" "$(stale "$job")" "$verdict" "$note")")
}

# --- scenarios -----------------------------------------------------------------------------------
log "scenario normal"
A=$(submit); wait_done "$A" || true; wait_no_leftovers || true
row normal "$A" COMPLETED "$([ "$(checkpoints "$A")" -ge 1 ] && echo yes || echo no)" "checkpoints written under Slurm"

log "scenario scancel"; ensure_munge
B=$(submit); wait_step "$B" 50; scancel "$B"; wait_done "$B" || true
if wait_no_leftovers; then gone=yes; else gone=no; fi
row scancel "$B" CANCELLED "$gone" "cancelled at step $(committed "$B")"

log "scenario kill-9"; ensure_munge
C=$(submit); wait_step "$C" 100
victim=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["pids"][1])' "$(out_dir "$C")/cluster.json")
kill -9 "$victim" || die "worker pid $victim of job $C is gone before the kill (job $(job_state "$C") at step $(committed "$C"))"
log "killed worker pid $victim at step $(committed "$C")"
wait_done "$C" || true; wait_no_leftovers || true
lost=$(grep -c '"event":"lost"' "$(out_dir "$C")/events.jsonl" || true)
row kill-9 "$C" COMPLETED "$([ "$lost" -eq 1 ] && [ -s "$(out_dir "$C")/loss.png" ] && echo yes || echo no)" "1 of 4 workers killed, $lost lost event(s), loss.png written"

log "scenario concurrent"; ensure_munge
D=$(submit); E=$(submit)
wait_done "$D" || true; wait_done "$E" || true; wait_no_leftovers || true
port() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["supervisor"].rsplit(":",1)[1])' "$(out_dir "$1")/cluster.json" 2>/dev/null || echo -; }
same_node="nodes $(job_field "$D" NodeList) and $(job_field "$E" NodeList)"
distinct=$([ "$(port "$D")" != "$(port "$E")" ] && [ "$(port "$D")" != - ] && echo yes || echo no)
row concurrent "$D" COMPLETED "$distinct" "port $(port "$D"); $same_node"
row concurrent "$E" COMPLETED "$distinct" "port $(port "$E")"

# --- report -----------------------------------------------------------------------------------
echo
echo "Slurm $(sbatch --version | cut -d' ' -f2) with munge, 2 nodes (slurmd x2 on one machine) x 2 tasks, $STEPS steps, $(nproc) cores, rtx $(basename "$(dirname "$RTX_BIN")") build"
printf '%-10s %6s %-10s %-6s %8s %5s %9s %5s %6s  %-4s %s\n' scenario job state exit test_acc ckpts leftovers ansi stale verdict note
for r in "${ROWS[@]}"; do echo "$r"; done
[ "$FAILED" -eq 0 ] || { log "some scenario failed; job outputs in $STATE/jobs"; exit 1; }
log "all scenarios passed"
