#!/usr/bin/env bash
# The main job: fetch the data (idempotent), build the release binary and train the
# Fashion-MNIST MLP with the default local setup. Extra arguments go to `rtx train`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/fetch-data.sh
cargo build --release --locked --bin rtx
# Each invocation is a new run in its own folder; pass --out DIR --resume to continue one.
out="runs/fashion_mlp-$(date +%Y%m%d-%H%M%S)"
./target/release/rtx train configs/fashion_mlp.toml --out "$out" "$@"
