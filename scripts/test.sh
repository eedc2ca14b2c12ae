#!/usr/bin/env bash
# The test command: set up (first time only), lint, type-check, then the whole test suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
py="$root/.venv/bin/python"
"$py" -m ruff check .
"$py" -m mypy harness backends kernels hydra_plugins
# One worker per core (pytest-xdist), whole files per worker: module fixtures (the GPU
# check's dry run, the loaded models) run once. KVBENCH_TEST_WORKERS=0 runs serially.
"$py" -m pytest -q -n "${KVBENCH_TEST_WORKERS:-logical}" --dist loadfile "$@"
# The CPU smoke sweep, gated against the committed baseline (results/baselines/cpu-tiny.json):
# token counts, memory accounting, prefix hits, quality; never wall-clock.
bash "$root/scripts/ci_smoke.sh"
