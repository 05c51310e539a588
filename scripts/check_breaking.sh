#!/usr/bin/env bash
# buf breaking (FILE rules) against the previous commit of main, once protos exist there.
# A deliberate break must say so in its commit message ("BREAKING:"), which skips the check.
set -euo pipefail
buf=${1:-buf}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
base=$(git rev-parse -q --verify HEAD~1 2>/dev/null || true)
if [ -z "$base" ] || ! git cat-file -e "$base:buf.yaml" 2>/dev/null || ! git cat-file -e "$base:protos" 2>/dev/null; then
  echo "buf breaking: no protos in the previous commit, nothing to compare"
  exit 0
fi
if git log -1 --format=%B HEAD | grep -q '^BREAKING:'; then
  echo "buf breaking: HEAD declares a deliberate break, skipped"
  exit 0
fi
"$buf" breaking --against ".git#ref=$base"
echo "buf breaking: no breaking change against $(git rev-parse --short "$base")"
