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
