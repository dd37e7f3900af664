#!/usr/bin/env bash
# The main job: fetch the data (idempotent), build the release binary and train the
# Fashion-MNIST MLP with the default local cluster: a supervisor and 2 worker processes
# (`rtx launch --nproc 2`, elastic data parallelism over QUIC). Extra arguments go to `rtx launch`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/fetch-data.sh
cargo build --release --locked --bin rtx
# Each invocation is a new run in its own folder; pass --out DIR --resume to continue one.
out="runs/fashion_mlp-$(date +%Y%m%d-%H%M%S)"
"${CARGO_TARGET_DIR:-target}/release/rtx" launch --nproc 2 configs/fashion_mlp.toml --out "$out" "$@"
