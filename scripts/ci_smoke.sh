#!/usr/bin/env bash
# The CI smoke gate: run the ci_smoke sweep (conf/experiment/ci_smoke.yaml: tiny model,
# CPU, paged/contiguous x multiturn/shared_prefix, ~10 s) into a temporary folder and gate
# it against the committed baseline results/baselines/cpu-tiny.json (harness/app/gate.py).
#
#   scripts/ci_smoke.sh                    # gate; exit 0 pass, 1 regression, 2 usage error
#   scripts/ci_smoke.sh --write-baseline   # refresh the baseline after an intended change
#
# The sweep is removed when the gate passes and kept (its path printed) when it does not.
# Extra arguments are Hydra overrides for the sweep (e.g. device=cuda on a GPU box, against
# a baseline of its own: KVBENCH_BASELINE=results/baselines/<name>.json).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$root/.venv/bin/python"
baseline="${KVBENCH_BASELINE:-$root/results/baselines/cpu-tiny.json}"
mode=gate
if [ "${1:-}" = "--write-baseline" ]; then
    mode=write
    shift
fi
[ -x "$py" ] || bash "$root/scripts/setup.sh"
cd "$root"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/kvbench-ci-smoke.XXXXXX")"
sweep="$tmp/sweep"
if ! "$py" -m harness -m +experiment=ci_smoke "hydra.sweep.dir=$sweep" "$@" \
        > "$tmp/sweep.log" 2>&1; then
    cat "$tmp/sweep.log" >&2
    echo "ci_smoke: the sweep itself failed (log above; kept in $tmp)" >&2
    exit 1
fi
rc=0
if [ "$mode" = write ]; then
    "$py" -m harness.gate --write-baseline "$baseline" "$sweep" || rc=$?
else
    "$py" -m harness.gate "$sweep" --baseline "$baseline" || rc=$?
fi
if [ "$rc" -eq 0 ]; then
    rm -rf "$tmp"
else
    echo "ci_smoke: sweep kept for inspection: $sweep (python -m harness.report $sweep)" >&2
    [ "$rc" -ne 1 ] || echo "ci_smoke: if the change is intended: scripts/ci_smoke.sh --write-baseline" >&2
fi
exit "$rc"
