#!/usr/bin/env bash
# I-JEPA / V-JEPA training jobs on the GPU (`[train] device = "cuda"`, issue 16), on a GPU machine
# with an already-built binary (the GPU machine needs no Rust). Build on the CPU machine:
#   cargo build --release --features cuda --bin rtx
#   mkdir -p gpu-bin && cp "${CARGO_TARGET_DIR:-target}/release/rtx" gpu-bin/rtx && strip gpu-bin/rtx
# and carry data/fashion-mnist (`bash scripts/fetch-data.sh --only fashion-mnist`).
#
#   1. CPU vs GPU loss curves: a small I-JEPA (Fashion-MNIST, ViT 64 x 2 layers, one head of 64,
#      predictor 64 x 1, batch 64) for 30 steps from one seed under `rtx launch --nproc 1` on the
#      CPU (f32), the GPU in f32 and the GPU in bf16. Bars (the same as tests/ijepa.rs's `cuda`
#      test and `jepa_gpu ops`): step 1 (same parameters, batch and masks: only the summation
#      order differs in f32, bf16 rounding in bf16) within 1e-4 (f32) / 3e-2 (bf16) relative;
#      every step within 2% (f32); 10-step window means within 5% (bf16), because AdamW amplifies
#      tiny gradient differences in near-zero coordinates over steps. Then the GPU bf16 run's
#      step-30 checkpoint resumed on the CPU for 5 steps against the CPU run resumed on the CPU
#      (5-step means within 5%): the EMA buffers and master weights cross devices.
#   2. configs/ijepa_fashion_gpu.toml (bf16) for STEPS steps: images/s over the committed steps
#      after WARMUP, the startup time, the final validation loss, probe and k-NN accuracies of every
#      readout (probes on 10,000 / 10,000 images), replicas identical.
#   3. configs/vjepa_moving_fashion.toml on the GPU for VJEPA_STEPS steps (heads changed to one of
#      64 as the GPU needs; probes as configured, with the attentive probe): clips/s and the probes.
#
# Prints a short table last (status ok / CHECK / FAIL) and a RESULT json line; full logs and run
# folders under $OUT_DIR (default /tmp/rtx-gpu-jepa-train). Exit status 1 if a check FAILs.
# Usage: scripts/gpu-jepa-train-check.sh [RTX_BINARY]   (default gpu-bin/rtx)
# Env: STEPS (300), WARMUP (20), VJEPA_STEPS (100), OUT_DIR, RTX_DATA_DIR (./data),
#      PARTS (123: which parts to run), CPU_ONLY (1: every GPU job runs on the CPU instead, to try
#      the script itself on a machine without a GPU; its numbers mean nothing)
set -euo pipefail
cd "$(dirname "$0")/.."
RTX=${1:-gpu-bin/rtx}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RTX_DATA_DIR=${RTX_DATA_DIR:-$PWD/data}
OUT_DIR=${OUT_DIR:-/tmp/rtx-gpu-jepa-train}
mkdir -p "$OUT_DIR"
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not found"
[ "${CPU_ONLY:-0}" = 1 ] && echo "CPU_ONLY=1: every job runs on the CPU (a dry run of the script; the numbers are not GPU numbers)"
python3 - "$RTX" "$OUT_DIR" "${STEPS:-300}" "${WARMUP:-20}" "${VJEPA_STEPS:-100}" "${PARTS:-123}" "${CPU_ONLY:-0}" <<'PY'
import json, os, re, subprocess, sys, time
rtx, out_dir, steps, warmup, vjepa_steps, parts = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
cpu_only = sys.argv[7] == "1"
rows, result, failed = [], {}, False

def add(name, value, status):
    global failed
    failed |= status == "FAIL"
    rows.append((name, value, status))
    print("  ->", name, "|", value, "|", status, flush=True)

def run_dir(name, fresh=True):
    d = os.path.join(out_dir, name)
    if fresh:
        subprocess.run(["rm", "-rf", d], check=True)
    return d

def show_logs(out):
    print(open(out + ".log").read()[-3000:])
    logs = os.path.join(out, "logs")
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        print(f"--- {name}")
        print(open(os.path.join(logs, name)).read()[-3000:])

def launch(config, out, extra=(), timeout=1800):
    cmd = [rtx, "launch", "--nproc", "1", "--no-progress", "--out", out, *extra, config]
    print("$", " ".join(cmd), flush=True)
    began = time.time()
    with open(out + ".log", "a") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
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
    return began, time.time() - began

def events(out):
    return [json.loads(l) for l in open(os.path.join(out, "events.jsonl"))]

def committed(out, first=0):
    return [e for e in events(out) if e["event"] == "committed" and e["step"] >= first]

def summary(out):
    return json.load(open(os.path.join(out, "summary.json")))

def config_variant(src, name, replace):
    text = open(src).read()
    for a, b in replace:
        assert a in text, a
        text = text.replace(a, b, 1)
    if cpu_only:
        text = re.sub(r'(?m)^(device|precision) = "[a-z0-9]+"\n', "", text)
    path = os.path.join(out_dir, name)
    open(path, "w").write(text)
    return path

def per_second(out, per_step):
    c = [e for e in committed(out) if e["step"] >= warmup]
    if len(c) < 2:
        return float("nan"), float("nan")
    dt = c[-1]["unix_s"] - c[0]["unix_s"]
    return per_step * (len(c) - 1) / dt, dt / (len(c) - 1)

def rel(a, b):
    return abs(a - b) / abs(b)

def windows(a, b, n):
    mean = lambda v: sum(v) / len(v)
    return max(rel(mean(a[i:i + n]), mean(b[i:i + n])) for i in range(len(a) - n + 1))

def eval_line(s):
    ev = s.get("eval", {})
    keys = [k for k in ev if "acc" in k] + [k for k in ("val_loss",) if k in ev]
    return ", ".join(f"{k} {ev[k]:.4f}" for k in keys) or "no metrics (the evaluation outlasted elastic.finish_timeout?)"

def eval_status(s):
    return "ok" if s["replicas_identical"] and "probe_acc" in s.get("eval", {}) else "FAIL"

# 1. CPU vs GPU loss curves on a small I-JEPA
if "1" in parts:
    small = [("n_layers = 4", "n_layers = 2"), ("predictor_depth = 3", "predictor_depth = 1"), ("probe_train_images = 10000", "probe_train_images = 1000"),
             ("probe_test_images = 10000", "probe_test_images = 500"), ("probe_epochs = 20", "probe_epochs = 3"), ("batch_size = 128", "batch_size = 64"),
             ("warmup_steps = 200", "warmup_steps = 5"), ("steps = 3500", "steps = 40"), ("checkpoint_every = 1000", "checkpoint_every = 10")]
    cfg = {
        "cpu": config_variant("configs/ijepa_fashion_gpu.toml", "small-cpu.toml", small + [('device = "cuda"\n', ""), ('precision = "bf16"\n', "")]),
        "cuda-f32": config_variant("configs/ijepa_fashion_gpu.toml", "small-cuda-f32.toml", small + [('precision = "bf16"', 'precision = "f32"')]),
        "cuda-bf16": config_variant("configs/ijepa_fashion_gpu.toml", "small-cuda-bf16.toml", small),
    }
    loss, evals = {}, {}
    for name, path in cfg.items():
        out = run_dir(f"small-{name}")
        launch(path, out, ["--steps", "30"])
        loss[name] = [e["loss"] for e in committed(out)]
        evals[name] = summary(out)
        print(f"{name:<10} losses (every 5th): {[round(x, 4) for x in loss[name][::5]]}", flush=True)
    cpu = loss["cpu"]
    ok = all(len(v) == 30 for v in loss.values())
    add("small I-JEPA, 30 steps committed on each device", str({k: len(v) for k, v in loss.items()}), "ok" if ok else "FAIL")
    if ok:
        d1f, d1b = rel(loss["cuda-f32"][0], cpu[0]), rel(loss["cuda-bf16"][0], cpu[0])
        wf, wb = windows(loss["cuda-f32"], cpu, 1), windows(loss["cuda-bf16"], cpu, 10)
        add("  step 1: GPU f32 / bf16 vs CPU f32 (bars 1e-4 / 3e-2)", f"{d1f:.2e} / {d1b:.2e} ({loss['cuda-f32'][0]:.5f}, {loss['cuda-bf16'][0]:.5f} vs {cpu[0]:.5f})", "ok" if d1f < 1e-4 and d1b < 3e-2 else "FAIL")
        add("  GPU f32 vs CPU: worst step (bar 2e-2)", f"{wf:.2e}", "ok" if wf < 2e-2 else "FAIL")
        add("  GPU bf16 vs CPU: worst 10-step window (bar 5e-2)", f"{wb:.2e}", "ok" if wb < 5e-2 else "FAIL")
        add("  loss falls on the GPU (bf16 step 30 < 0.9 x step 1)", f"{loss['cuda-bf16'][-1]:.4f} vs {loss['cuda-bf16'][0]:.4f}", "ok" if loss["cuda-bf16"][-1] < 0.9 * loss["cuda-bf16"][0] else "CHECK")
        for name in ("cpu", "cuda-f32", "cuda-bf16"):
            add(f"  {name}: final eval (probes on host copies)", eval_line(evals[name]), eval_status(evals[name]))
        pf = abs(evals["cuda-f32"]["eval"].get("probe_acc", float("nan")) - evals["cpu"]["eval"].get("probe_acc", float("nan")))
        add("  probe_acc GPU f32 vs CPU (bar 0.05 absolute)", f"{pf:.4f}", "ok" if pf < 0.05 else "CHECK")
        result.update({"step1_rel_f32": d1f, "step1_rel_bf16": d1b, "worst_step_f32": wf, "worst_window_bf16": wb})
        # The GPU bf16 checkpoint at step 30 resumed on the CPU, against the CPU run resumed on the CPU.
        crossed = run_dir("small-bf16-then-cpu")
        os.makedirs(os.path.join(crossed, "checkpoints"))
        src = os.path.join(out_dir, "small-cuda-bf16", "checkpoints")
        newest = sorted(os.listdir(src))[-1]
        subprocess.run(["cp", "-r", os.path.join(src, newest), os.path.join(crossed, "checkpoints")], check=True)
        launch(cfg["cpu"], crossed, ["--resume", "--steps", "35"])
        launch(cfg["cpu"], run_dir("small-cpu", fresh=False), ["--resume", "--steps", "35"])
        a = [e["loss"] for e in committed(crossed, 30)]
        b = [e["loss"] for e in committed(run_dir("small-cpu", fresh=False), 30)][-5:]
        if len(a) == 5 and len(b) == 5:
            w = windows(a, b, 5)
            add(f"  GPU bf16 checkpoint ({newest}) resumed on the CPU: steps 31-35 mean vs CPU->CPU (bar 5e-2)", f"{sum(a) / 5:.4f} vs {sum(b) / 5:.4f} ({w:.2e})", "ok" if w < 5e-2 else "FAIL")
        else:
            add("  GPU bf16 checkpoint resumed on the CPU", f"steps committed: {len(a)} and {len(b)} of 5", "FAIL")

# 2. configs/ijepa_fashion_gpu.toml for STEPS steps
if "2" in parts:
    out = run_dir("ijepa-fashion-gpu")
    began, wall = launch(config_variant("configs/ijepa_fashion_gpu.toml", "ijepa-fashion-gpu.toml", []), out, ["--steps", str(steps)])
    c = committed(out)
    rate, step_s = per_second(out, 128)
    startup = c[0]["unix_s"] - began if c else float("nan")
    s = summary(out)
    add(f"ijepa_fashion_gpu (bf16), {steps} steps: images/s over steps {warmup + 1}-{steps}", f"{rate:,.0f} images/s, {step_s * 1000:.2f} ms/step; first step committed {startup:.1f} s after launch; wall {wall:.0f} s", "report")
    add(f"  loss step 1 -> {steps}", f"{c[0]['loss']:.4f} -> {c[-1]['loss']:.4f}" if c else "none", "ok" if c and c[-1]["loss"] < c[0]["loss"] else "CHECK")
    add("  final eval", eval_line(s), eval_status(s))
    result.update({"ijepa_images_per_s": round(rate), "ijepa_step_ms": round(step_s * 1000, 3), "ijepa_probe_acc": s["eval"].get("probe_acc"), "ijepa_knn_acc": s["eval"].get("knn_acc")})

# 3. V-JEPA on the GPU, briefly
if "3" in parts:
    vcfg = config_variant("configs/vjepa_moving_fashion.toml", "vjepa-gpu.toml", [("n_heads = 4", "n_heads = 1"), ("predictor_width = 48", "predictor_width = 64"),
                          ("predictor_heads = 4", "predictor_heads = 1"), ("checkpoint_every = 500", "checkpoint_every = 500\ndevice = \"cuda\"\nprecision = \"bf16\"")])
    out = run_dir("vjepa-gpu")
    began, wall = launch(vcfg, out, ["--steps", str(vjepa_steps)])
    c = committed(out)
    rate, step_s = per_second(out, 64)
    s = summary(out)
    add(f"vjepa_moving_fashion on the GPU (bf16, 1 head of 64), {vjepa_steps} steps", f"{rate:,.0f} clips/s, {step_s * 1000:.2f} ms/step; loss {c[0]['loss']:.4f} -> {c[-1]['loss']:.4f}; wall {wall:.0f} s" if c else "no step", "ok" if c else "FAIL")
    add("  final eval", eval_line(s), eval_status(s))
    result.update({"vjepa_clips_per_s": round(rate), "vjepa_probe_acc": s["eval"].get("probe_acc"), "vjepa_direction_probe_acc": s["eval"].get("direction_probe_acc")})

print()
print(f"{'check':<95} {'result':<90} status")
for name, value, status in rows:
    print(f"{name:<95} {value:<90} {status}")
print("RESULT " + json.dumps(result))
sys.exit(1 if failed else 0)
PY
