#!/usr/bin/env bash
# buf breaking (FILE rules): the protos of HEAD against the newest accepted baseline, so a break
# made anywhere since is caught, not only one in the last commit. The baseline is the newest
# commit before HEAD that declares a deliberate break in its message ("BREAKING:" at the start
# of a line), else the first commit with protos. HEAD declaring "BREAKING:" skips the check.
set -euo pipefail
buf=${1:-buf}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if git log -1 --format=%B HEAD | grep -q '^BREAKING:'; then
  echo "buf breaking: HEAD declares a deliberate break, skipped"
  exit 0
fi
base=$(git log -1 --format=%H --grep='^BREAKING:' HEAD~1 -- 2>/dev/null || true)
if [ -z "$base" ]; then
  for commit in $(git log --reverse --format=%H HEAD -- protos buf.yaml); do
    if git cat-file -e "$commit:buf.yaml" 2>/dev/null && git cat-file -e "$commit:protos" 2>/dev/null; then
      base=$commit
      break
    fi
  done
fi
shallow=""
if [ -f "$(git rev-parse --git-dir)/shallow" ]; then
  shallow=" (a shallow clone: git fetch --unshallow for the whole history)"
fi
if [ -z "$base" ] || [ "$base" = "$(git rev-parse HEAD)" ]; then
  echo "buf breaking: no earlier commit with protos, nothing to compare$shallow"
  exit 0
fi
[ -z "$shallow" ] || echo "buf breaking: comparing against the oldest commit held$shallow"
"$buf" breaking --against ".git#ref=$base"
echo "buf breaking: no breaking change against $(git rev-parse --short "$base")" \
     "($(git log -1 --format=%s "$base" | cut -c1-60))"
