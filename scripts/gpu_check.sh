#!/usr/bin/env bash
# GPU check (CUDA machine, < 8 min, no network): the `gpu` kernel tests compiled, device
# copy bandwidth, and decode attention timings (ours, split-K, torch SDPA, flash-attn when
# installed) at Llama-3-8B head geometry. Table on stdout; everything as JSON in
#   $1, else $OUT/gpu_check.json, else ./gpu_check.json.
# Extra arguments go to `python -m harness.kernels.bench` (e.g. --skip-tests --budget-s 200).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
[[ -x "$py" ]] || py="$(command -v python3)"
out="${OUT:-.}/gpu_check.json"
if [[ $# -gt 0 && "$1" != --* ]]; then out="$1"; shift; fi
# conftest.py defaults TRITON_INTERPRET to 1 for CPU runs; here the kernels must compile.
export TRITON_INTERPRET=0
cd "$root"
exec timeout 470 "$py" -m harness.kernels.bench --out "$out" --root "$root" "$@"
