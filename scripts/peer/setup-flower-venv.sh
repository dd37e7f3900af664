#!/usr/bin/env bash
# Create a throwaway Flower virtualenv for the federation peer benchmark (issue 15).
#
#   scripts/peer/setup-flower-venv.sh            # -> /work/venv-flower
#   RTX_FLOWER_VENV=/some/dir scripts/peer/setup-flower-venv.sh
#
# Installs flwr[simulation] (pinned: the issue's reference accuracies were measured with Flower
# 1.42) and numpy from PyPI. Idempotent: if the venv already imports flwr and numpy, it does
# nothing. Never run this in CI.
set -euo pipefail

VENV="${RTX_FLOWER_VENV:-/work/venv-flower}"
PY="${PYTHON:-python3}"
FLWR_VERSION="${FLWR_VERSION:-1.42.0}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import flwr, numpy, ray' 2>/dev/null; then
    echo "flower venv ready: $VENV ($("$VENV/bin/python" -c 'import flwr; print("flwr", flwr.__version__)'))"
    exit 0
fi

if [ -n "${CI:-}" ]; then
    echo "refusing to install flower in CI" >&2
    exit 1
fi

echo "creating flower venv at $VENV ..."
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --upgrade --quiet pip
"$VENV/bin/python" -m pip install --quiet "flwr[simulation]==$FLWR_VERSION" numpy
"$VENV/bin/python" -c 'import flwr, numpy, ray; print("flwr", flwr.__version__, "numpy", numpy.__version__, "ray", ray.__version__)'
echo "flower venv ready: $VENV"
