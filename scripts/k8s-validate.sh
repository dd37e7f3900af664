#!/usr/bin/env bash
# Validates examples/k8s.yaml offline against the Kubernetes OpenAPI schemas, with
# kubernetes-validate from PyPI (it ships the JSON schemas of every Kubernetes minor version inside
# the package: no cluster, no network at validation time). Strict mode: an unknown field is an
# error, not ignored. Checked against the oldest and newest versions we claim (K8S_VERSIONS).
# Also checks that the validator can fail: a copy with a misspelt field must be rejected.
# Idempotent: the virtual environment lives in out/k8s-venv (gitignored) and is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${RTX_K8S_VENV:-out/k8s-venv}
VALIDATOR_VERSION=1.37.0
K8S_VERSIONS=${K8S_VERSIONS:-"1.28.0 1.37.0"}
FILE=${1:-examples/k8s.yaml}
if ! "$VENV/bin/kubernetes-validate" --version 2>/dev/null | grep -q "$VALIDATOR_VERSION"; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "kubernetes-validate==$VALIDATOR_VERSION"
fi
for v in $K8S_VERSIONS; do
  "$VENV/bin/kubernetes-validate" --strict -k "$v" "$FILE"
done
# The validator must reject a broken manifest (otherwise a pass proves nothing).
broken=$(mktemp --suffix=.yaml)
trap 'rm -f "$broken"' EXIT
sed 's/terminationGracePeriodSeconds/terminationGracePeriodSecs/' "$FILE" > "$broken"
if "$VENV/bin/kubernetes-validate" --strict --quiet "$broken" >/dev/null 2>&1; then
  echo "kubernetes-validate accepted a misspelt field: the check is not working" >&2
  exit 1
fi
echo "$FILE: valid for Kubernetes $K8S_VERSIONS (strict); a misspelt copy is rejected"
