#!/usr/bin/env bash
# Compile-checks every CUDA kernel module with NVRTC on a machine without a GPU: installs NVRTC
# 13.0 from PyPI into a cache folder once (NVRTC_DIR, default ~/.cache/rtx-nvrtc), builds the
# `nvrtc_check` example and runs it against that library. Exit status non-zero on a compile error
# (the compiler's log is printed). Usage: scripts/nvrtc-check.sh [ARCH, default 90]
set -euo pipefail
cd "$(dirname "$0")/.."
NVRTC_DIR=${NVRTC_DIR:-$HOME/.cache/rtx-nvrtc}
lib="$NVRTC_DIR/nvidia/cu13/lib"
if [ ! -e "$lib/libnvrtc.so.13" ]; then
    python3 -m pip install --quiet --target "$NVRTC_DIR" "nvidia-cuda-nvrtc==13.0.*"
fi
cargo build --release -q -p rtx-kernels --features cuda --example nvrtc_check
target=${CARGO_TARGET_DIR:-target}
LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" RTX_NVRTC_ARCH="${1:-90}" "$target/release/examples/nvrtc_check"
