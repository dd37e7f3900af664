#!/usr/bin/env bash
# Installs what the live-page browser test (tests/live_page.rs) needs, idempotently:
# Chromium from Debian's packages (no browser downloaded by a test tool) and playwright-core,
# pinned by scripts/browser/package-lock.json, into scripts/browser/node_modules.
# CI's scripts/test.sh calls it before `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null 2>&1; then
    sudo_cmd=()
    if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core
fi
if ! command -v node >/dev/null 2>&1; then
    echo "setup-browser: node (>= 18) and npm are needed: apt-get install -y nodejs npm" >&2
    exit 1
fi
if [ ! -f scripts/browser/node_modules/playwright-core/package.json ]; then
    # playwright-core never downloads a browser (only the `playwright` package does).
    (cd scripts/browser && npm ci --no-audit --no-fund --ignore-scripts)
fi
echo "setup-browser: $(chromium --version), playwright-core $(node -p "require('./scripts/browser/node_modules/playwright-core/package.json').version")"
