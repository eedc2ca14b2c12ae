#!/usr/bin/env bash
# The what-if's records held equal to another commit's (issue #51): the 13 runs of
# docs/whatif_scale.md (executor=roofline; the fast path on every backend it takes and the
# paths it leaves to stepping one by one), steps.csv, requests.csv and metrics.json but the
# wall-clock keys. Exit 0 when every record is equal.
#   scripts/records_equal.sh e82b94d [--only paged,swap] [--keep DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?give the commit to compare with, e.g. scripts/records_equal.sh e82b94d}
shift
exec .venv/bin/python scripts/records_equal.py "$rev" --matrix whatif "$@"
