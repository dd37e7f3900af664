#!/usr/bin/env bash
# The Python package's check, as CI runs it (scripts/test.sh, after `cargo test`): builds the
# extension with maturin in the dev profile into the workspace's target folder (the crates
# `cargo test` built are reused), installs the wheel into out/python-venv (made by
# scripts/setup-python.sh), runs the pytest suite (python/tests: a real two-worker job on
# Fashion-MNIST, checkpoints, tensors, the simulator), then the notebook-style example headless.
# Users install with `pip install ./python` instead (release build).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${RTX_PYTHON_VENV:-out/python-venv}
bash scripts/setup-python.sh
VENV=$(cd "$VENV" && pwd)
export PYO3_PYTHON="$VENV/bin/python"
wheels=out/python-wheels
rm -rf "$wheels"
"$VENV/bin/maturin" build --quiet --profile dev --manifest-path python/Cargo.toml --interpreter "$PYO3_PYTHON" --out "$wheels"
"$VENV/bin/pip" install --quiet --disable-pip-version-check --force-reinstall --no-deps "$wheels"/rustytorch-*.whl
export RTX_DATA_DIR="$PWD/data"
# From another folder, so `import rustytorch` is the installed wheel and not python/rustytorch.
(cd python/tests && "$VENV/bin/python" -m pytest -q -p no:cacheprovider .)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
MPLBACKEND=Agg RTX_EXAMPLE_STEPS=${RTX_EXAMPLE_STEPS:-60} RTX_EXAMPLE_OUT="$out" "$VENV/bin/python" examples/python/train_fashion.py
test -s "$out/run/loss_from_python.png"
echo "python-check: the package built, its tests and the example passed"
