#!/usr/bin/env bash
# Installs what the Python package's check (scripts/python-check.sh) needs, idempotently:
# Debian's python3 with venv (python3-venv), then a virtual environment in out/python-venv
# (gitignored) with maturin, numpy, pytest and matplotlib from PyPI, pinned below.
# CI's scripts/test.sh calls it before `cargo test` (PyO3's build script asks an interpreter for
# its version when the workspace builds python/) and exports PYO3_PYTHON to the venv's python,
# so `cargo test` and maturin configure PyO3 alike and share the built crates.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${RTX_PYTHON_VENV:-out/python-venv}
PINS=(maturin==1.16.0 numpy==2.4.6 pytest==9.2.0 matplotlib==3.11.2)
if ! /usr/bin/python3 -c 'import venv, ensurepip' 2>/dev/null; then
    sudo_cmd=()
    if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends python3 python3-venv
fi
stamp="$VENV/.pins"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "${PINS[*]}" ]; then
    /usr/bin/python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "${PINS[@]}"
    echo "${PINS[*]}" > "$stamp"
fi
echo "setup-python: $("$VENV/bin/python" --version), maturin $("$VENV/bin/maturin" --version | cut -d' ' -f2)"
