#!/usr/bin/env bash
# The main job: set up (first time only), then `python -m harness` with any Hydra overrides.
#   scripts/run.sh                                   # default: backend=paged workload=multiturn
#   scripts/run.sh backend=contiguous workload=multiturn cache.kv_budget=8MiB
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
exec "$root/.venv/bin/python" -m harness "$@"
