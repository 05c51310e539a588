#!/usr/bin/env bash
# Fails when libs/proto/src differs from what scripts/gen_protos.sh generates from protos/
# (gridrl/v1/enums.py, the one hand-written module there, aside).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"$root/scripts/gen_protos.sh" "$tmp" >/dev/null
if ! diff -r -x __pycache__ -x enums.py "$tmp/gridrl/v1" "$root/libs/proto/src/gridrl/v1"; then
  echo "generated code is stale: run 'make protos' and commit the result" >&2
  exit 1
fi
echo "generated code is fresh"
