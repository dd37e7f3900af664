#!/usr/bin/env bash
# The whole test suite, exactly as CI runs it (.ci/run calls this file).
# Fetches the real datasets first (idempotent) so data-reading tests use real files,
# then runs every test of every crate, and each benchmark once so benches cannot rot.
set -euo pipefail
cd "$(dirname "$0")/.."
export RUST_BACKTRACE=1
bash scripts/fetch-data.sh
cargo test --workspace --all-targets --locked
# The CUDA backend must keep compiling (cudarc loads CUDA at run time: no GPU or toolkit needed).
cargo build -p rtx-kernels --features cuda --all-targets --locked
# GPU tensors and NCCL compile too, and their host-side logic runs (no GPU needed: the
# device-dependent tests return early without one; scripts/gpu-check.sh runs them on a GPU).
cargo test -p rtx-tensor --features cuda --locked --lib cuda::
cargo build -p rtx-tensor --features cuda --all-targets --locked
cargo build -p rtx-collectives --features nccl --all-targets --locked
cargo test -p rtx-collectives --features nccl --locked --test nccl_device --test nccl_id
