#!/usr/bin/env bash
# GPU data parallelism under `rtx launch`, on a GPU machine, with an already-built binary
# (`cargo build --release --locked --features cuda --bin rtx`; the GPU machine needs no Rust):
#
#   1. quick: configs/gpt2_gpu_small.toml with 2 workers on the GPU (bf16), the same job on the CPU
#      (f32), loss of the last committed steps side by side; then a checkpoint written by the GPU
#      job is resumed by a CPU job of the same model (host-format checkpoints load on either).
#   2. tokens/s of $CONFIG (GPT-2 124M shape; default configs/gpt2_gpu.toml, the byte vocabulary;
#      configs/gpt2_124m.toml is the real one) with --nproc 1 and --nproc 2 for STEPS steps each
#      (steady state: committed steps after the first WARMUP), and the ratio. Workers beyond the
#      GPU count share GPUs (worker i takes cuda:(i mod GPUs)). With BARE set (a command printing
#      gpt_gpu's "bench step median X ms" line, e.g. "gpu-bin/gpt_gpu bench"), the bare step of the
#      same model runs first in the same call and --nproc 1 is reported against it.
#   3. kill -9 of one of 2 workers at committed step KILL_AT of a KILL_STEPS-step run: time from
#      the kill to the next committed step, and steps lost; the job must finish on the survivor.
#
# Prints a short table last; full logs and run folders go to $OUT_DIR (default /tmp/rtx-gpu-dp).
# Usage: scripts/gpu-dp-check.sh [RTX_BINARY]   (default target/release/rtx)
# Env: STEPS (60), WARMUP (10), KILL_STEPS (150), KILL_AT (50), OUT_DIR, RTX_DATA_DIR (./data),
#      CONFIG, BARE, SMALL (1: run part 1; 0: skip it)
set -euo pipefail
cd "$(dirname "$0")/.."
RTX=${1:-target/release/rtx}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RTX_DATA_DIR=${RTX_DATA_DIR:-$PWD/data}
OUT_DIR=${OUT_DIR:-/tmp/rtx-gpu-dp}
mkdir -p "$OUT_DIR"
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not found"
python3 - "$RTX" "$OUT_DIR" "${STEPS:-60}" "${WARMUP:-10}" "${KILL_STEPS:-150}" "${KILL_AT:-50}" "${CONFIG:-configs/gpt2_gpu.toml}" "${SMALL:-1}" "${BARE:-}" <<'PY'
import json, os, re, signal, subprocess, sys, time
rtx, out_dir, steps, warmup, kill_steps, kill_at = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
big, run_small, bare = sys.argv[7], sys.argv[8] != "0", sys.argv[9]
rows = []

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

def show_logs(out):
    print(open(out + ".log").read()[-1500:])
    for name in sorted(os.listdir(os.path.join(out, "logs"))) if os.path.isdir(os.path.join(out, "logs")) else []:
        print(f"--- {name}")
        print(open(os.path.join(out, "logs", name)).read()[-1500:])

def launch(config, nproc, out, extra=(), wait=True, timeout=150):
    cmd = [rtx, "launch", "--nproc", str(nproc), "--no-progress", "--out", out, *extra, config]
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

def tokens_per_s(out, per_step):
    c = committed(events(out))
    steady = [e for e in c if e["step"] >= warmup]
    if len(steady) < 2:
        raise SystemExit(f"{out}: too few committed steps")
    dt = steady[-1]["unix_s"] - steady[0]["unix_s"]
    return per_step * (len(steady) - 1) / dt, dt / (len(steady) - 1)

def last_losses(out, n=10):
    c = committed(events(out))
    return sum(e["loss"] for e in c[-n:]) / min(n, len(c))

def config_variant(src, name, replace):
    text = open(src).read()
    for a, b in replace:
        assert a in text, a
        text = text.replace(a, b)
    path = os.path.join(out_dir, name)
    open(path, "w").write(text)
    return path

# 1. quick checks on the small model
small = "configs/gpt2_gpu_small.toml"
if not run_small:
    print("part 1 (small model checks) skipped: SMALL=0", flush=True)
if run_small:
    gpu_out = run_dir("small-gpu")
    launch(small, 2, gpu_out, ["--steps", "60"], timeout=90)
    cpu_cfg = config_variant(small, "small-cpu.toml", [('device = "cuda"', 'device = "cpu"'), ('precision = "bf16"\n', '')])
    cpu_out = run_dir("small-cpu")
    launch(cpu_cfg, 2, cpu_out, ["--steps", "60"], timeout=90)
    g, c = last_losses(gpu_out), last_losses(cpu_out)
    add(("small GPT, 2 workers: GPU bf16 vs CPU f32, mean loss of steps 51-60", f"{g:.4f} vs {c:.4f} (rel diff {abs(g - c) / c:.3f})", "ok" if abs(g - c) / c < 0.05 else "CHECK"))
    add(("small GPT, 2 workers on the GPU: replicas bit-identical", str(summary(gpu_out)["replicas_identical"]), "ok" if summary(gpu_out)["replicas_identical"] else "FAIL"))
    # The GPU job's last checkpoint (after step 60), resumed by the CPU config for 10 more steps.
    ckpts = sorted(os.listdir(os.path.join(gpu_out, "checkpoints")))
    subprocess.run(["rm", "-rf", os.path.join(cpu_out)], check=True)
    os.makedirs(os.path.join(cpu_out, "checkpoints"))
    subprocess.run(["cp", os.path.join(gpu_out, "checkpoints", ckpts[-1]), os.path.join(cpu_out, "checkpoints")], check=True)
    launch(cpu_cfg, 1, cpu_out, ["--resume", "--steps", "70"], timeout=60)
    resumed = committed(events(cpu_out))
    gpu_last = committed(events(gpu_out))[-1]["loss"]
    add(("GPU checkpoint (step 60) resumed by a CPU job: loss of step 61 vs GPU step 60", f"{resumed[0]['loss']:.4f} (step {resumed[0]['step'] + 1}) vs {gpu_last:.4f}", "ok" if resumed and resumed[0]["step"] == 60 and abs(resumed[0]["loss"] - gpu_last) / gpu_last < 0.1 else "CHECK"))

# 2. tokens/s, GPT-2 124M shape
per_step = 16 * 1024
rates = {}
bare_ms = None
if bare:
    print("$", bare, flush=True)
    text = subprocess.run(bare, shell=True, check=True, capture_output=True, text=True).stdout
    print(text[-1500:])
    m = re.search(r"bench step median ([0-9.]+) ms", text)
    if not m:
        raise SystemExit("BARE printed no 'bench step median' line")
    bare_ms = float(m.group(1))
    add(("bare step of the same model (gpt_gpu, median)", f"{per_step / bare_ms * 1000:,.0f} tokens/s, {bare_ms:.2f} ms/step", "report"))
for nproc in (1, 2):
    out = run_dir(f"gpt2-nproc{nproc}")
    launch(big, nproc, out, ["--steps", str(steps)])
    rate, step_s = tokens_per_s(out, per_step)
    rates[nproc] = rate
    s = summary(out)
    add((f"GPT-2 124M, --nproc {nproc} (steps {warmup + 1}-{steps})", f"{rate:,.0f} tokens/s, {step_s * 1000:.1f} ms/step, val_loss {s['eval'].get('val_loss', float('nan')):.4f}", "ok" if s["replicas_identical"] else "FAIL"))
add(("tokens/s, 2 workers / 1 worker", f"{rates[2] / rates[1]:.2f}x", "report"))
if bare_ms is not None:
    share = rates[1] / (per_step / bare_ms * 1000)
    add(("--nproc 1 / bare step", f"{share:.3f}x (bar >= 0.95)", "ok" if share >= 0.95 else "BELOW"))

# 3. kill -9 of one of two workers mid-run
out = run_dir("gpt2-kill")
p = launch(big, 2, out, ["--steps", str(kill_steps)], wait=False)
start = time.time()
while not any(e["step"] >= kill_at for e in committed(events(out))):
    if p.poll() is not None or time.time() - start > 150:
        p.kill()
        show_logs(out)
        raise SystemExit(f"the kill run did not reach step {kill_at}; logs in {out}")
    time.sleep(0.005)
pid = json.load(open(os.path.join(out, "cluster.json")))["pids"][1]
before = max(e["step"] for e in committed(events(out)))
t_kill = time.time()
os.kill(pid, signal.SIGKILL)
try:
    rc = p.wait(timeout=150)
except subprocess.TimeoutExpired:
    p.kill()
    show_logs(out)
    raise SystemExit(f"the kill run did not finish within 150 s after the kill; logs in {out}")
es = events(out)
lost = next(e for e in es if e["event"] == "lost")
gen = [e for e in es if e["event"] == "generation"][-1]
nxt = next(e for e in es if e["event"] == "committed" and e["unix_s"] > gen["unix_s"])
final = committed(es)[-1]
steps_lost = max(0, before + 1 - gen["next_step"])
ok = rc == 0 and final["step"] + 1 == kill_steps and gen["world"] == 1
add((f"kill -9 of 1 of 2 GPU workers at step {before + 1}: failure detected", f"{(lost['unix_s'] - t_kill) * 1000:.0f} ms", "ok"))
add(("  kill -> next committed step (1 worker, state synced on the GPU)", f"{(nxt['unix_s'] - t_kill) * 1000:.0f} ms (step {nxt['step'] + 1})", "ok" if ok else "FAIL"))
add(("  steps lost; job finished on the survivor", f"{steps_lost}; finished at step {final['step'] + 1}/{kill_steps}, exit {rc}", "ok" if ok and steps_lost == 0 else "CHECK"))

print()
print(f"{'check':<80} {'result':<60} status")
for name, value, status in rows:
    print(f"{name:<80} {value:<60} {status}")
print("RESULT " + json.dumps({"tokens_per_s_nproc1": round(rates[1]), "tokens_per_s_nproc2": round(rates[2]), "ratio": round(rates[2] / rates[1], 3), "kill_to_next_commit_ms": round((nxt["unix_s"] - t_kill) * 1000), "detect_ms": round((lost["unix_s"] - t_kill) * 1000), "steps_lost": steps_lost}))
PY
