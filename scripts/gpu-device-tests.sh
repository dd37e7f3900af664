#!/usr/bin/env bash
# Runs the device-generic op tests (tensor/tests/device_ops.rs, written with
# `rtx_tensor::device_test!`) from a compiled test binary and prints one row per test with its
# result on each device, then totals.
#
# Usage:
#   scripts/gpu-device-tests.sh PATH_TO_TEST_BINARY [FILTER...]
#   scripts/gpu-device-tests.sh                      # builds the binary first (needs cargo)
#
# The GPU machine has no Rust toolchain: build the binary on the CPU machine (the `cuda` feature
# builds without a GPU or CUDA toolkit; cudarc loads CUDA at run time) with
#
#   cargo test --release -p rtx-tensor --features cuda --test device_ops --no-run
#
# which ends with a line `Executable tests/device_ops.rs (target/release/deps/device_ops-HASH)`
# (under $CARGO_TARGET_DIR instead of target/ when that is set); copy that file (optionally
# `strip -o gpu-bin/device_ops target/release/deps/device_ops-HASH`) to the GPU machine and run
# this script on it. FILTER arguments are passed to the binary (libtest name filters).
#
# The binary runs once with `--test-threads 1 --show-output`. Cells read:
#   ok           the test passed on that device
#   FAILED       it failed (its output is printed after the table)
#   skipped      no usable GPU (the test printed `skipped: no CUDA device`), or the binary was
#                built without `--features cuda` so it has no `::cuda` variant
#   unsupported  the op is not on that device yet and refused with a typed error (the test printed
#                `unsupported on DEVICE: OP`; see rtx_tensor::testing::supported_on)
#   missing      listed but never reported (the binary died): counts as a failure
# Exit status: 0 when nothing FAILED or went missing, 1 otherwise, 2 on usage errors.
set -euo pipefail

if [[ $# -ge 1 && ( "$1" == "-h" || "$1" == "--help" ) ]]; then
    sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi

if [[ $# -ge 1 ]]; then
    bin="$1"
    shift
else
    command -v cargo >/dev/null || { echo "no test binary given and no cargo here to build one (see --help)" >&2; exit 2; }
    cd "$(dirname "$0")/.."
    build_log="$(mktemp)"
    cargo test --release -p rtx-tensor --features cuda --test device_ops --no-run 2>&1 | tee "$build_log" >&2
    bin="$(sed -n 's/.*Executable tests\/device_ops.rs (\(.*\))$/\1/p' "$build_log" | tail -n 1)"
    rm -f "$build_log"
    [[ -n "$bin" ]] || { echo "could not find the test binary in cargo's output" >&2; exit 2; }
fi
[[ -x "$bin" ]] || { echo "not an executable test binary: $bin" >&2; exit 2; }

log="$(mktemp)"
list="$(mktemp)"
trap 'rm -f "$log" "$list"' EXIT

"$bin" --list "$@" 2>/dev/null | sed -n 's/: test$//p' >"$list"
[[ -s "$list" ]] || { echo "the binary lists no tests (filters: $*)" >&2; exit 2; }

set +e
"$bin" --test-threads 1 --show-output "$@" >"$log" 2>&1
status=$?
set -e

awk -v status="$status" '
    FNR == NR { listed[$0] = 1; split_name($0); next }
    function split_name(full,   base, dev) {
        base = full; dev = "other"
        if (full ~ /::cpu$/) { base = substr(full, 1, length(full) - 5); dev = "cpu" }
        else if (full ~ /::cuda$/) { base = substr(full, 1, length(full) - 6); dev = "cuda" }
        if (!(base in seen)) { seen[base] = 1; order[++n] = base }
        has[base, dev] = 1
        if (dev == "cuda") any_cuda = 1
        if (dev == "other") other = 1
        return base
    }
    # Result lines come first; the captured-output sections follow.
    /^(successes|failures):$/ { sections = 1 }
    !sections && /^test .* \.\.\. (ok|FAILED|ignored)/ {
        name = $2; res = $4
        result[name] = (res == "ok") ? "ok" : (res == "FAILED" ? "FAILED" : "ignored")
        next
    }
    /^---- .* stdout ----$/ { cur = $2; next }
    /^---- / { cur = ""; next }
    cur != "" && /^skipped: no CUDA device/ { skipped[cur] = 1 }
    cur != "" && /^unsupported on / { unsupported[cur] = 1 }
    function cell(base, dev,   full, r) {
        if (!has[base, dev]) return "skipped"
        full = base "::" dev
        if (!(full in result)) return "missing"
        r = result[full]
        if (r == "ok" && (full in skipped)) return "skipped"
        if (r == "ok" && (full in unsupported)) return "unsupported"
        return r
    }
    END {
        width = 4
        for (i = 1; i <= n; i++) if (length(order[i]) > width) width = length(order[i])
        printf "%-" width "s  %-11s  %-11s\n", "test", "cpu", "cuda"
        line = ""; for (i = 0; i < width + 26; i++) line = line "-"
        print line
        bad = 0
        for (i = 1; i <= n; i++) {
            b = order[i]
            if (has[b, "other"]) continue
            c = cell(b, "cpu"); g = cell(b, "cuda")
            count["cpu", c]++; count["cuda", g]++
            if (c == "FAILED" || c == "missing" || g == "FAILED" || g == "missing") bad = 1
            printf "%-" width "s  %-11s  %-11s\n", b, c, g
        }
        print line
        split("ok FAILED skipped unsupported missing ignored", kinds, " ")
        for (d = 1; d <= 2; d++) {
            dev = (d == 1) ? "cpu" : "cuda"
            s = ""
            for (k = 1; k <= 6; k++) if (count[dev, kinds[k]] > 0) s = s sprintf("%s%d %s", (s == "" ? "" : ", "), count[dev, kinds[k]], kinds[k])
            printf "%-4s: %s\n", dev, (s == "" ? "no tests" : s)
        }
        if (!any_cuda) print "(no ::cuda variants in this binary: it was built without --features cuda)"
        if (other) print "(tests not written with device_test! are not tabulated)"
        if (status != 0 && !bad) { print "the test binary exited with status " status; bad = 1 }
        exit bad
    }
' "$list" "$log" && ok=1 || ok=0

if [[ $ok -eq 0 ]]; then
    echo
    echo "== failures =="
    sed -n '/^failures:$/,/^test result:/p' "$log"
    exit 1
fi
