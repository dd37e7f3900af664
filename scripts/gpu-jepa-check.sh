#!/usr/bin/env bash
# I-JEPA on the GPU (issue 16), one go on a GPU machine with an already-built binary: the device op
# and model checks (`jepa_gpu ops`), the ViT-B/16 I-JEPA step (`jepa_gpu bench BATCH`) and the
# PyTorch peer of the same step, eager and torch.compile (`scripts/peer/ijepa_gpu_torch.py`), in
# that order in one run; full logs under LOG_DIR, a table of the RESULT lines last.
# Build on the CPU machine: cargo build --release -p rtx-tensor --features cuda --example jepa_gpu
# Usage: scripts/gpu-jepa-check.sh JEPA_GPU_BINARY [LOG_DIR] (BATCH=128 STEPS=20 by default)
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${1:?usage: gpu-jepa-check.sh JEPA_GPU_BINARY [LOG_DIR]}
logs=${2:-/tmp/rtx-gpu-jepa}
batch=${BATCH:-128}
steps=${STEPS:-20}
mkdir -p "$logs"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
status=0
"$bin" ops > "$logs/ops.log" 2>&1 || status=1
grep -E "FAIL|checks passed|jepa_gpu ops:" "$logs/ops.log"
RTX_BENCH_STEPS=$steps "$bin" bench "$batch" > "$logs/bench.log" 2>&1 || status=1
tail -n 4 "$logs/bench.log"
python3 scripts/peer/ijepa_gpu_torch.py both "$steps" "$batch" > "$logs/torch.log" 2>&1 || status=1
tail -n 6 "$logs/torch.log"
echo "| run | batch | images/s | step ms | MFU |"
echo "|---|---|---|---|---|"
grep -h "^RESULT" "$logs/bench.log" "$logs/torch.log" | sed -E 's/^RESULT ([^ ]+) batch=([0-9]+) img_s=([0-9]+) step_ms=([0-9.]+) mfu=([0-9.]+)/| \1 | \2 | \3 | \4 | \5 |/'
exit $status
