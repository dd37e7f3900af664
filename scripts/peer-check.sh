#!/usr/bin/env bash
# Peer correctness: one pre-norm transformer block, forward and backward, rustytorch vs PyTorch.
#
#   scripts/peer-check.sh [DIR]     # DIR defaults to target/peer-block
#
# 1. scripts/peer/peer_block.py writes the block's weights, an input x and a fixed loss weight
#    w_fixed (safetensors, PyTorch names and layouts);
# 2. examples/peer_block.rs loads them into rustytorch's nn::TransformerBlock, computes
#    y = block(x) and the gradients of sum(y * w_fixed), and writes them back;
# 3. peer_block.py computes the same in torch (float32) and fails unless every tensor's
#    max|a-b| / max|b| is <= 1e-5.
# Needs the throwaway torch venv (scripts/peer/setup-torch-venv.sh, created on first use). Not for CI.
set -euo pipefail
cd "$(dirname "$0")/.."

DIR="${1:-target/peer-block}"
VENV="${RTX_TORCH_VENV:-/tmp/rtx-torch-venv}"
PY="$VENV/bin/python"

RTX_TORCH_VENV="$VENV" scripts/peer/setup-torch-venv.sh >&2
mkdir -p "$DIR"
"$PY" scripts/peer/peer_block.py write "$DIR"
cargo run --release -p rtx-examples --example peer_block -- "$DIR"
"$PY" scripts/peer/peer_block.py compare "$DIR"
