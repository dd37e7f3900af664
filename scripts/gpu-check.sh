#!/usr/bin/env bash
# Runs every GPU check and benchmark of the project in one go, on an already-built binary, and
# prints a short table last. Full logs go to $LOG_DIR (default target/gpu-check, or $OUT when the
# device tool runs it).
#
# Build on a CPU machine (the GPU machine has no Rust toolchain):
#   cargo build --release -p rtx-kernels --features cuda --example gpu_check
#   mkdir -p gpu-bin && cp target/release/examples/gpu_check gpu-bin/
# then on the GPU machine, from the repository root:
#   scripts/gpu-check.sh [path/to/gpu_check]      # default gpu-bin/gpu_check
#   RTX_SEED=123 scripts/gpu-check.sh             # replay a seed
#   TORCH=0 scripts/gpu-check.sh                  # skip the PyTorch side-by-side numbers
#   ONLY=gpt scripts/gpu-check.sh                 # only the GPU tensor checks and the GPT-2 bench
#
# NCCL (rtx-collectives --features nccl): also build
#   cargo build --release -p rtx-collectives --features nccl --example nccl_check && cp target/release/examples/nccl_check gpu-bin/
# GPU tensors and training (rtx-tensor --features cuda): also build
#   cargo build --release -p rtx-tensor --features cuda --example gpt_gpu && cp target/release/examples/gpt_gpu gpu-bin/
# and the run adds `gpt_gpu all` (op checks, CPU-vs-GPU loss curves, the GPT-2 124M step) and
# PyTorch's eager and torch.compile step on the same shape (scripts/peer/gpt2_gpu_torch.py);
# it needs data/sotu (the device tool's `carry`).
#
# With PyTorch installed (python3 -c 'import torch'), the same run also times torch's bf16/TF32
# matmul and scaled_dot_product_attention at the shapes gpu_check uses, as a reference.
set -uo pipefail
cd "$(dirname "$0")/.."

BIN="${1:-gpu-bin/gpu_check}"
GPT_BIN="${GPT_BIN:-gpu-bin/gpt_gpu}"
ONLY="${ONLY:-all}"
LOG_DIR="${LOG_DIR:-${OUT:-target/gpu-check}}"
TORCH="${TORCH:-1}"
mkdir -p "$LOG_DIR"
# NVLink multicast stays off on the lent hosts (../shared/GPU.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

if [ "$ONLY" != gpt ] && [ ! -x "$BIN" ]; then
    echo "gpu-check: no binary at $BIN (build it first, see the header of this script)" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$LOG_DIR/nvidia-smi.txt" 2>&1 || true

torch_status=skipped
if [ "$TORCH" = 1 ] && python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    PYTHONUNBUFFERED=1 python3 - > "$LOG_DIR/torch.log" 2>&1 <<'PY'
import torch, torch.nn.functional as F
def timed(f, iters):
    f(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters): f()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / iters
n = 4096
for dt, name in [(torch.bfloat16, "bf16"), (torch.float32, "tf32")]:
    torch.backends.cuda.matmul.allow_tf32 = dt == torch.float32
    a, b = torch.randn(n, n, device="cuda", dtype=dt), torch.randn(n, n, device="cuda", dtype=dt)
    ms = timed(lambda: a @ b, 50)
    print(f"torch gemm {name} 4096^3: {2*n**3/ms/1e9:.0f} TFLOP/s ({ms:.3f} ms)")
for bh, t, d in [(16 * 12, 1024, 64), (4 * 12, 4096, 64)]:
    for dt in [torch.bfloat16, torch.float32]:
        q, k, v = (torch.randn(1, bh, t, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
        fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), 5)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True); g = torch.randn_like(o)
        both = timed(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), g), 5)
        flops = 4 * bh * t * t * d / 2
        print(f"torch sdpa {str(dt)[6:]} {bh}xT{t}xd{d} causal: fwd {fwd:.2f} ms ({flops/fwd/1e9:.1f} TFLOP/s), bwd {both-fwd:.2f} ms")
PY
    torch_status=$?
fi

status=0
if [ "$ONLY" != gpt ]; then
    "$BIN" 2>&1 | tee "$LOG_DIR/gpu_check.log"
    status=${PIPESTATUS[0]}
fi
nccl_status=skipped
NCCL_BIN="${NCCL_BIN:-gpu-bin/nccl_check}"
if [ "$ONLY" != gpt ] && [ -x "$NCCL_BIN" ]; then
    LOG_DIR="$LOG_DIR/nccl" scripts/gpu-nccl-check.sh "$NCCL_BIN"
    nccl_status=$?
    [ "$nccl_status" = 0 ] || status=$nccl_status
fi
gpt_status=skipped
if [ -x "$GPT_BIN" ]; then
    RTX_DATA="${RTX_DATA:-data}" "$GPT_BIN" "${GPT_MODE:-all}" 2>&1 | tee "$LOG_DIR/gpt_gpu.log"
    gpt_status=${PIPESTATUS[0]}
    [ "$gpt_status" = 0 ] || status=$gpt_status
    if [ "$TORCH" = 1 ] && python3 -c 'import torch' 2>/dev/null && grep -q '^RESULT rustytorch' "$LOG_DIR/gpt_gpu.log"; then
        PYTHONUNBUFFERED=1 python3 scripts/peer/gpt2_gpu_torch.py "${RTX_DATA:-data}" both 2>&1 | tee "$LOG_DIR/gpt2_torch.log"
        python3 - "$LOG_DIR/gpt_gpu.log" "$LOG_DIR/gpt2_torch.log" <<'PY'
import re, sys
res = {}
for path in sys.argv[1:]:
    for line in open(path):
        m = re.match(r"RESULT (\S+) tok_s=(\d+)", line)
        if m:
            res[m.group(1)] = float(m.group(2))
ours = res.get("rustytorch")
print("\n## GPT-2 124M shape, B=16 T=1024, same GPU, same run")
for name, v in res.items():
    ratio = f"{ours / v:.2f}x" if ours and name != "rustytorch" else ""
    print(f"{name:<16} {v:>10.0f} tokens/s  {('rustytorch / ' + name + ' = ' + ratio) if ratio else ''}")
PY
    fi
fi
if [ -s "$LOG_DIR/torch.log" ]; then
    echo
    echo "## PyTorch on the same GPU (reference, exit $torch_status)"
    cat "$LOG_DIR/torch.log"
fi
echo
echo "gpu checks exit $status (nccl_check: $nccl_status, gpt_gpu: $gpt_status); logs in $LOG_DIR"
exit "$status"
