#!/usr/bin/env bash
# ZeRO-1 / ZeRO-2 on GPU workers under `rtx launch`, on a GPU machine, with an already-built binary
# (`cargo build --release --locked --features cuda --bin rtx`; the GPU machine needs no Rust):
#
#   1. $CONFIG (default configs/gpt2_124m.toml: GPT-2 124M, bf16 parameters, f32 master AdamW on
#      the GPU) with --nproc 2 on ONE GPU (CUDA_VISIBLE_DEVICES=$GPU: both workers share it) for
#      STEPS steps, four times: replicated (the default), `[elastic] sharding = "zero1"`,
#      `"zero2"`, and "zero1" with `zero_copies = "snapshot"` (no per-step buddy exchange of the
#      segment states: a loss rolls back to the last snapshot instead). Per run: step time (steady state, committed steps after WARMUP), each rank's
#      peak device memory (the workers' "device memory" log line at the end of the generation:
#      the CUDA caching allocator's peak allocated and reserved MiB), the ZeRO shard's size (the
#      "zero1 buddy copies" line), and whether the replicas finished bit-identical.
#   2. The losses of every committed step, replicated vs zero1, zero1 vs zero2 and replicated vs
#      zero1 with snapshot copies: bit-identical
#      is expected (the same host collectives and the same per-element AdamW arithmetic on the
#      same values); a relative difference below 1e-3 is reported as CLOSE, anything more as CHECK.
#   3. kill -9 of one of the 2 zero1 workers at committed step KILL_AT of a KILL_STEPS-step run:
#      the survivor rebuilds the state from the buddy segment copies; steps lost must be 0 and the
#      job must finish on the survivor.
#
# Prints a table last and a RESULT json line; logs and run folders go to $OUT_DIR
# (default /tmp/rtx-gpu-zero).
# Usage: scripts/gpu-zero-check.sh [RTX_BINARY]   (default target/release/rtx)
# Env: CONFIG, STEPS (60), WARMUP (10), KILL_STEPS (150), KILL_AT (50), GPU (0), OUT_DIR,
#      RTX_DATA_DIR (./data), DEVICE (cuda; "cpu" rewrites the config for the host: a dry run of
#      this script's logic on a machine without a GPU, with a small CPU config as CONFIG),
#      TIMEOUT (seconds per run, 600)
set -euo pipefail
cd "$(dirname "$0")/.."
RTX=${1:-target/release/rtx}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RTX_DATA_DIR=${RTX_DATA_DIR:-$PWD/data}
export CUDA_VISIBLE_DEVICES=${GPU:-0}
OUT_DIR=${OUT_DIR:-/tmp/rtx-gpu-zero}
mkdir -p "$OUT_DIR"
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not found"
python3 - "$RTX" "$OUT_DIR" "${STEPS:-60}" "${WARMUP:-10}" "${KILL_STEPS:-150}" "${KILL_AT:-50}" "${CONFIG:-configs/gpt2_124m.toml}" "${DEVICE:-cuda}" "${TIMEOUT:-600}" <<'PY'
import json, os, re, signal, subprocess, sys, time
rtx, out_dir, steps, warmup, kill_steps, kill_at = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
config, device, timeout = sys.argv[7], sys.argv[8], int(sys.argv[9])
rows = []
ANSI = re.compile(r"\x1b\[[0-9;]*m")

def add(row):
    rows.append(row)
    print("  ->", " | ".join(row), flush=True)

def run_dir(name):
    d = os.path.join(out_dir, name)
    subprocess.run(["rm", "-rf", d], check=True)
    return d

def events(out):
    try:
        return [json.loads(l) for l in open(os.path.join(out, "events.jsonl"))]
    except FileNotFoundError:
        return []

def worker_logs(out):
    d = os.path.join(out, "logs")
    names = sorted(os.listdir(d)) if os.path.isdir(d) else []
    return [(n, ANSI.sub("", open(os.path.join(d, n), errors="replace").read())) for n in names]

def show_logs(out):
    print(open(out + ".log").read()[-1500:])
    for name, text in worker_logs(out):
        print(f"--- {name}")
        print(text[-1500:])

def launch(cfg, nproc, out, extra=(), wait=True):
    cmd = [rtx, "launch", "--nproc", str(nproc), "--no-progress", "--out", out, *extra, cfg]
    print("$", " ".join(cmd), flush=True)
    log = open(out + ".log", "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    if wait:
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            show_logs(out)
            raise SystemExit(f"rtx launch did not finish within {timeout} s; logs in {out}")
        if rc != 0:
            show_logs(out)
            raise SystemExit(f"rtx launch failed ({rc}); logs in {out}")
    return p

def committed(es):
    return [e for e in es if e["event"] == "committed"]

def summary(out):
    return json.load(open(os.path.join(out, "summary.json")))

def step_ms(out):
    steady = [e for e in committed(events(out)) if e["step"] >= warmup]
    if len(steady) < 2:
        raise SystemExit(f"{out}: too few committed steps after step {warmup}")
    return (steady[-1]["unix_s"] - steady[0]["unix_s"]) / (len(steady) - 1) * 1000

def fields(line):
    return {k: v.strip('"') for k, v in re.findall(r'(\w+)=("[^"]*"|\S+)', line)}

def device_memory(out):
    """Per rank, the last "device memory" line's fields (the end of its last generation)."""
    found = {}
    for _, text in worker_logs(out):
        for line in text.splitlines():
            if "device memory" in line:
                f = fields(line)
                if "rank" in f:
                    found[int(f["rank"])] = f
    return found

def shard_line(out):
    for _, text in worker_logs(out):
        for line in text.splitlines():
            if "zero1 buddy copies" in line:
                return fields(line)
    return None

def variant(name, sharding, copies=None):
    text = open(config).read()
    if device == "cpu":
        text = text.replace('device = "cuda"', 'device = "cpu"').replace('precision = "bf16"\n', "")
    if sharding is not None:
        keys = f'sharding = "{sharding}"' + (f'\nzero_copies = "{copies}"' if copies else "")
        if "[elastic]" in text:
            text = text.replace("[elastic]", f"[elastic]\n{keys}", 1)
        else:
            text += f"\n[elastic]\n{keys}\n"
    path = os.path.join(out_dir, name + ".toml")
    open(path, "w").write(text)
    return path

def losses(out):
    return [(e["step"], e["loss"]) for e in committed(events(out))]

def compare(a, b, what):
    la, lb = dict(losses(a)), dict(losses(b))
    common = sorted(set(la) & set(lb))
    if not common:
        add((what, "no common committed steps", "FAIL"))
        return None
    same = all(la[s] == lb[s] for s in common)
    worst = max(abs(la[s] - lb[s]) / max(abs(la[s]), 1e-12) for s in common)
    last = common[-1]
    status = "ok" if same else ("CLOSE" if worst < 1e-3 else "CHECK")
    add((what, f"final (step {last + 1}) {la[last]:.6f} vs {lb[last]:.6f}; {'bit-identical' if same else f'max rel diff {worst:.2e}'} over {len(common)} steps", status))
    return same

# 1. replicated, zero1, zero2, zero1 without per-step buddy copies, on one GPU, two workers
outs, ms = {}, {}
for sharding, copies in ((None, None), ("zero1", None), ("zero2", None), ("zero1", "snapshot")):
    name = (sharding or "replicated") + (f"-{copies}" if copies else "")
    out = run_dir(f"gpt2-{name}")
    launch(variant(name, sharding, copies), 2, out, ["--steps", str(steps)])
    outs[name], ms[name] = out, step_ms(out)
    s = summary(out)
    add((f"{name}, 2 workers on one {device} device: step time (steps {warmup + 1}-{steps})", f"{ms[name]:.1f} ms/step", "ok" if s["replicas_identical"] else "FAIL (replicas differ)"))
    mem = device_memory(out)
    for rank in sorted(mem):
        f = mem[rank]
        add((f"  rank {rank} peak device memory", f"allocated {f.get('peak_allocated_mib', '?')} MiB, reserved {f.get('peak_reserved_mib', '?')} MiB", "report"))
    if not mem:
        add(("  peak device memory", "no 'device memory' line in the worker logs (a CPU job logs none)", "report" if device == "cpu" else "CHECK"))
    shard = shard_line(out) if sharding else None
    if shard:
        mib = lambda k: f"{int(shard.get(k, 0)) / 2**20:.1f} MiB"
        add(("  ZeRO shard (params + optimizer state) vs a replica's, per rank", f"{mib('shard_bytes')} vs {mib('replica_bytes')}", "report"))

# 2. losses
compare(outs["replicated"], outs["zero1"], "losses: replicated vs zero1")
compare(outs["zero1"], outs["zero2"], "losses: zero1 vs zero2")
compare(outs["replicated"], outs["zero1-snapshot"], "losses: replicated vs zero1 with zero_copies = snapshot")
for name in ("zero1", "zero2", "zero1-snapshot"):
    add((f"step time {name} / replicated", f"{ms[name] / ms['replicated']:.3f}x", "report"))
mem_r = device_memory(outs["replicated"])
for name in ("zero1", "zero1-snapshot"):
    mem_z = device_memory(outs[name])
    if mem_r and mem_z:
        peak = lambda m: max(float(f.get("peak_allocated_mib", "nan")) for f in m.values())
        add((f"peak allocated, {name} / replicated (highest rank)", f"{peak(mem_z):.0f} / {peak(mem_r):.0f} MiB = {peak(mem_z) / peak(mem_r):.3f}x", "ok" if peak(mem_z) < peak(mem_r) else "CHECK"))

# 3. kill -9 of one of two zero1 workers mid-run
out = run_dir("gpt2-zero1-kill")
p = launch(variant("zero1", "zero1"), 2, out, ["--steps", str(kill_steps)], wait=False)
start = time.time()
while not any(e["step"] >= kill_at for e in committed(events(out))):
    if p.poll() is not None or time.time() - start > timeout:
        p.kill()
        show_logs(out)
        raise SystemExit(f"the kill run did not reach step {kill_at}; logs in {out}")
    time.sleep(0.005)
pid = json.load(open(os.path.join(out, "cluster.json")))["pids"][1]
before = max(e["step"] for e in committed(events(out)))
t_kill = time.time()
os.kill(pid, signal.SIGKILL)
try:
    rc = p.wait(timeout=timeout)
except subprocess.TimeoutExpired:
    p.kill()
    show_logs(out)
    raise SystemExit(f"the kill run did not finish within {timeout} s after the kill; logs in {out}")
es = events(out)
gen = [e for e in es if e["event"] == "generation"][-1]
nxt = next((e for e in es if e["event"] == "committed" and e["unix_s"] > gen["unix_s"]), None)
final = committed(es)[-1]
steps_lost = max(0, before + 1 - gen["next_step"])
ok = rc == 0 and final["step"] + 1 == kill_steps and gen["world"] == 1 and nxt is not None
from_segments = any("from_segments=true" in t for _, t in worker_logs(out))
add((f"zero1 kill -9 of 1 of 2 workers at step {before + 1}: kill -> next committed step", f"{(nxt['unix_s'] - t_kill) * 1000:.0f} ms" if nxt else "none", "ok" if ok else "FAIL"))
add(("  state rebuilt from buddy segment copies", str(from_segments), "ok" if from_segments else "CHECK"))
add(("  steps lost; job finished on the survivor", f"{steps_lost}; finished at step {final['step'] + 1}/{kill_steps}, exit {rc}", "ok" if ok and steps_lost == 0 else "FAIL"))

print()
print(f"{'check':<72} {'result':<70} status")
for name, value, status in rows:
    print(f"{name:<72} {value:<70} {status}")
peaks = {name: {r: f.get("peak_allocated_mib") for r, f in device_memory(o).items()} for name, o in outs.items()}
print("RESULT " + json.dumps({"step_ms": {k: round(v, 1) for k, v in ms.items()}, "peak_allocated_mib": peaks, "steps_lost": steps_lost, "kill_to_next_commit_ms": round((nxt["unix_s"] - t_kill) * 1000) if nxt else None}))
PY
