#!/usr/bin/env bash
# The whole test suite, exactly as CI runs it (.ci/run calls this file).
# Fetches the real datasets first (idempotent) so data-reading tests use real files,
# then runs every test of every crate, and each benchmark once so benches cannot rot.
set -euo pipefail
cd "$(dirname "$0")/.."
export RUST_BACKTRACE=1
# No incremental caches: CI builds from a clean clone once, and the caches doubled the target folder
# (15 of 28 GB), which ran a CI machine's disk out (os error 28) while building the CUDA feature set.
export CARGO_INCREMENTAL=0
bash scripts/fetch-data.sh
# Debian's Chromium and playwright-core for the live page's browser test (idempotent).
bash scripts/setup-browser.sh
# Python 3 with venv and out/python-venv (maturin, numpy, pytest, matplotlib) for the Python package;
# before `cargo test`, whose build of python/ runs PyO3's build script with this interpreter.
bash scripts/setup-python.sh
export PYO3_PYTHON="$PWD/out/python-venv/bin/python"
cargo test --workspace --all-targets --locked
# Doc-tests (--all-targets leaves them out): the embedding API's runnable examples (src/embed/).
cargo test -p rustytorch --doc --locked
# The Python package (python/): maturin builds it in the dev profile into the same target folder
# (reusing what `cargo test` built), then pytest and the notebook-style example, headless.
bash scripts/python-check.sh
# A real Slurm 22.05 (Debian's slurm-wlm + munge, two slurmd on this machine) runs examples/slurm.sbatch:
# normal finish, scancel, kill -9 of a worker task, two concurrent jobs. It runs the rtx that `cargo test`
# just built (building it again with the binary's own feature set took 5.5 min of CI time).
RTX_BIN="${CARGO_TARGET_DIR:-target}/debug/rtx" bash scripts/slurm-check.sh
# examples/k8s.yaml against the Kubernetes schemas, offline (kubernetes-validate from PyPI).
bash scripts/k8s-validate.sh
# The CUDA backend and NCCL keep compiling (cudarc loads CUDA at run time: no GPU or toolkit needed),
# and their host-side logic runs (the device-dependent tests return early without a GPU;
# scripts/gpu-check.sh runs them on one). One package set and one feature set for every step, so
# cargo builds the feature-enabled crates once instead of once per step.
gpu_crates=(-p rtx-kernels -p rtx-tensor -p rtx-collectives)
gpu_features=rtx-kernels/cuda,rtx-tensor/cuda,rtx-collectives/nccl
cargo test "${gpu_crates[@]}" --features "$gpu_features" --all-targets --locked --no-run
# The device data-parallel path (DataParallel::with_device_reduce over NCCL) and its GPU check compile.
cargo test "${gpu_crates[@]}" -p rtx-pipelines --features "$gpu_features,rtx-pipelines/nccl" --all-targets --locked --no-run
cargo test "${gpu_crates[@]}" --features "$gpu_features" --locked --lib cuda::
cargo test "${gpu_crates[@]}" --features "$gpu_features" --locked --test nccl_device --test nccl_id
