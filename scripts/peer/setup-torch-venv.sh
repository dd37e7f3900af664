#!/usr/bin/env bash
# Create a throwaway PyTorch virtualenv for peer benchmarks / correctness checks.
#
#   scripts/peer/setup-torch-venv.sh            # -> /tmp/rtx-torch-venv
#   RTX_TORCH_VENV=/some/dir scripts/peer/setup-torch-venv.sh
#
# Installs torch, safetensors and numpy from PyPI (the default wheel; it is
# large, ~3 GB with its CUDA dependencies, and takes a few minutes). Only the
# CPU path is used. Idempotent: if the venv already imports all three
# packages, it does nothing. Never run this in CI.
set -euo pipefail

VENV="${RTX_TORCH_VENV:-/tmp/rtx-torch-venv}"
PY="${PYTHON:-python3}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import torch, safetensors, numpy' 2>/dev/null; then
    echo "torch venv ready: $VENV ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
    exit 0
fi

if [ -n "${CI:-}" ]; then
    echo "refusing to install torch in CI" >&2
    exit 1
fi

echo "creating torch venv at $VENV (this downloads ~3 GB)..."
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --upgrade --quiet pip
"$VENV/bin/python" -m pip install --quiet torch safetensors numpy
"$VENV/bin/python" -c 'import torch, safetensors, numpy; print("torch", torch.__version__, "numpy", numpy.__version__)'
echo "torch venv ready: $VENV"
