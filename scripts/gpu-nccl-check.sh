#!/usr/bin/env bash
# Runs the NCCL checks and bus-bandwidth sweep of rtx-collectives (collectives/examples/nccl_check.rs)
# on an already-built binary and, in the same run, PyTorch's NCCL collectives at the same sizes for
# comparison; prints the tables last. Full logs go to $LOG_DIR (default target/gpu-nccl-check, or
# $OUT when the device tool runs it).
#
# Build on a CPU machine (the GPU machine has no Rust toolchain):
#   cargo build --release -p rtx-collectives --features nccl --example nccl_check
#   mkdir -p gpu-bin-nccl && cp target/release/examples/nccl_check gpu-bin-nccl/
# then on the GPU machine, from the repository root:
#   scripts/gpu-nccl-check.sh [path/to/nccl_check] [nccl_check arguments...]
#   RTX_SEED=123 scripts/gpu-nccl-check.sh        # replay a seed
#   TORCH=0 scripts/gpu-nccl-check.sh             # skip the PyTorch side-by-side numbers
#
# The Rust binary checks every operation against a CPU reference (f32, bf16) on one GPU and, when
# several are visible, one rank per GPU; then sweeps 8 B..4 GiB. PyTorch (when `python3 -c 'import
# torch'` works) runs torch.distributed with the NCCL backend, one process per GPU (a world of 1 on
# a single GPU), env:// init on loopback.
set -uo pipefail
cd "$(dirname "$0")/.."

BIN="${1:-gpu-bin-nccl/nccl_check}"
shift || true
LOG_DIR="${LOG_DIR:-${OUT:-target/gpu-nccl-check}}"
TORCH="${TORCH:-1}"
mkdir -p "$LOG_DIR"
# NVLink multicast stays off on the lent hosts (../shared/GPU.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

if [ ! -x "$BIN" ]; then
    echo "gpu-nccl-check: no binary at $BIN (build it first, see the header of this script)" >&2
    exit 2
fi
{
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
    nvidia-smi topo -m
    ls -l /usr/lib/x86_64-linux-gnu/libnccl* 2>/dev/null
} > "$LOG_DIR/nvidia-smi.txt" 2>&1 || true

# Bounded, so a hang cannot eat the PyTorch comparison (RUST_CHECK_TIMEOUT seconds).
timeout "${RUST_CHECK_TIMEOUT:-240}" "$BIN" "$@" 2>&1 | tee "$LOG_DIR/nccl_check.log"
status=${PIPESTATUS[0]}

torch_status=skipped
if [ "$TORCH" = 1 ] && python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    PYTHONUNBUFFERED=1 python3 - > "$LOG_DIR/torch.log" 2>&1 <<'PY'
import os, torch, torch.distributed as dist, torch.multiprocessing as mp

SIZES = [8 << (2 * i) for i in range(15)] + [4 << 30]  # 8 B, 32 B, ... 2 GiB, 4 GiB

def timed(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(); dist.barrier(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record(); torch.cuda.synchronize()
    t = torch.tensor([s.elapsed_time(e) / iters], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank counts, as in nccl-tests
    return t.item()

def worker(rank, n):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531", RANK=str(rank), WORLD_SIZE=str(n))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", device_id=torch.device("cuda", rank))
    if rank == 0:
        print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, world {n}")
        print("| op | ranks | bytes | time (us) | algbw (GB/s) | busbw (GB/s) |")
        print("|---|---|---|---|---|---|")
    for size in SIZES:
        numel = size // 4
        if numel % n:
            continue
        iters = max(5, min(200, (1 << 30) // size))
        buf = torch.ones(numel, device="cuda")
        part = torch.ones(numel // n, device="cuda")
        for op, fn, factor in [
            ("all_reduce", lambda: dist.all_reduce(buf), 2 * (n - 1) / n),
            ("reduce_scatter", lambda: dist.reduce_scatter_tensor(part, buf), (n - 1) / n),
            ("all_gather", lambda: dist.all_gather_into_tensor(buf, part), (n - 1) / n),
        ]:
            ms = timed(fn, iters)
            if rank == 0:
                algbw = size / (ms * 1e-3) / 1e9
                human = f"{size >> 30} GiB" if size >= 1 << 30 else f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB" if size >= 1 << 10 else f"{size} B"
                print(f"| torch {op} | {n} | {human} | {ms * 1e3:.1f} | {algbw:.2f} | {algbw * factor:.2f} |")
        del buf, part
        torch.cuda.empty_cache()
    dist.destroy_process_group()

if __name__ == "__main__":
    n = torch.cuda.device_count()
    if n == 1:
        worker(0, 1)
    else:
        mp.spawn(worker, args=(n,), nprocs=n)
PY
    torch_status=$?
fi

if [ -s "$LOG_DIR/torch.log" ]; then
    echo
    echo "## PyTorch NCCL on the same GPUs (reference, exit $torch_status)"
    cat "$LOG_DIR/torch.log"
fi
echo
echo "nccl_check exit $status; logs in $LOG_DIR"
exit "$status"
