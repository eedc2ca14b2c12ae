#!/usr/bin/env bash
# Run a long measurement from a frozen copy of a commit, so that editing the working tree
# while it runs cannot change the code its later jobs import (a sweep imports lazily in
# each job). Usage: scripts/snapshot_run.sh DIR [REV] -- python -m harness -m ...
# DIR receives the snapshot (backends/ and kernels/ placed under harness/, as the installed
# package maps them); the command runs inside DIR with PYTHONPATH=DIR, so results land in
# DIR/results. Uses this checkout's .venv.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:?usage: snapshot_run.sh DIR [REV] -- COMMAND...}"; shift
rev="HEAD"
if [ "${1:-}" != "--" ] && [ $# -gt 0 ]; then rev="$1"; shift; fi
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || { echo "snapshot_run.sh: no command after --" >&2; exit 2; }
if [ -e "$dir/harness" ]; then
    echo "snapshot_run.sh: $dir already holds a snapshot; reusing it (delete it to refresh)" >&2
else
    mkdir -p "$dir"
    git -C "$root" archive "$rev" | tar -x -C "$dir"
    mv "$dir/backends" "$dir/harness/backends"
    mv "$dir/kernels" "$dir/harness/kernels"
    git -C "$root" rev-parse "$rev" > "$dir/SNAPSHOT_REV"
fi
cd "$dir"
export PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$root/.venv/bin:$PATH"
exec "$@"
