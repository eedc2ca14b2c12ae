#!/usr/bin/env bash
# The GPU check, in one call (< 7.5 min on one H200, no network):
#   scripts/gpu_check.sh [OUT_DIR] [--dry-run] [--no-install] [--only a,b] [--skip a,b]
#                        [--total-s S] [--budget NAME=S]
# Writes everything to OUT_DIR (default: $OUT, else ./gpu_check): summary.md (the tables),
# status.json (each section: ok / failed / timeout / skipped), <section>.json and .log,
# install.log. Sections, each in its own process with its own budget (one failing or hanging
# does not stop the rest): env, kernel-correctness, kernel-bandwidth, engine-<shape> (x2),
# roofline-h200, gpu-tests, benchmarks, flash-attn; and, in a call of its own,
# `--only compression` (every compression method at Llama-3.1-8B's shape under one KV budget,
# 4k and 32k contexts, and their kernels' bandwidth; < 7 min). See harness/gpucheck and
# results/gpu/README.md.
#
# Python: $PYTHON if set; else .venv/bin/python when it has the deps (CI runners); else a
# venv at $KVBENCH_GPU_VENV (/tmp/kvbench-gpu-venv, --system-site-packages: the machine's
# torch, triton, pytest...) with the bundled wheels (scripts/gpu_bundle.sh, carried in
# gpu_wheels/) installed offline and kvbench installed editable from this tree.
# --dry-run: the same sections on the CPU at tiny sizes (Triton interpreted); the tests
# run it (tests/e2e/test_gpu_check.py).
set -uo pipefail  # no -e: a failing step is recorded and the check goes on
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$PWD/gpu_check}"
if [[ $# -gt 0 && "$1" != --* ]]; then out="$1"; shift; fi
mkdir -p "$out" && out="$(cd "$out" && pwd)"
dry=0 install=1
for a in "$@"; do
  case "$a" in --dry-run) dry=1 ;; --no-install) install=0 ;; esac
done
args=()
for a in "$@"; do [[ "$a" == --no-install ]] || args+=("$a"); done
wheels="${GPU_WHEELS:-$root/gpu_wheels}"
venv="${KVBENCH_GPU_VENV:-/tmp/kvbench-gpu-venv}"
log="$out/install.log"
: > "$log"

# The deps import, and kvbench resolves to this tree (a venv left by an earlier call may
# point at another copy).
has_deps() { KVBENCH_ROOT="$root" "$1" -c "import os, hydra, omegaconf, torch
import importlib.util as u
for m in ('harness.kernels', 'harness.backends'):
    s = u.find_spec(m)
    assert s and s.origin.startswith(os.environ['KVBENCH_ROOT'] + '/'), f'{m} not from here'" \
  >> "$log" 2>&1; }

install_into() {  # $1: python; wheels offline, then kvbench editable (no build isolation)
  local py="$1"
  echo "== installing into $py from $wheels" >> "$log"
  PIP_BREAK_SYSTEM_PACKAGES=1 "$py" -m pip install --no-index --find-links "$wheels" \
    --disable-pip-version-check -q hydra-core omegaconf antlr4-python3-runtime \
    "setuptools>=68" >> "$log" 2>&1 || return 1
  PIP_BREAK_SYSTEM_PACKAGES=1 "$py" -m pip install --no-index --no-deps \
    --no-build-isolation --disable-pip-version-check -q -e "$root" >> "$log" 2>&1
}

# --system-site-packages gives the packages of the base interpreter's *installation*; where
# python3 is itself a venv (the H200 image's /opt/torch/.venv holds torch), those are not
# its packages: a .pth file in the new venv adds them after its own (so the bundled
# hydra wins and torch, triton, pytest come from the image).
see_base_packages() {  # $1: base python, $2: the new venv's python
  local own
  own="$("$2" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")" || return 1
  "$1" -c "import site; print('\n'.join(site.getsitepackages()))" \
    > "$own/_kvbench_base_site.pth" || return 1
  echo "== base packages seen through $own/_kvbench_base_site.pth:" >> "$log"
  cat "$own/_kvbench_base_site.pth" >> "$log"
}

t0=$SECONDS
if [[ -n "${PYTHON:-}" ]]; then
  py="$PYTHON"
elif [[ -x "$root/.venv/bin/python" ]] && has_deps "$root/.venv/bin/python"; then
  py="$root/.venv/bin/python"
elif [[ $dry == 1 || $install == 0 ]]; then
  py="$(command -v python3)"
elif [[ -x "$venv/bin/python" ]] && has_deps "$venv/bin/python"; then
  py="$venv/bin/python"  # a rerun on the same machine
else
  base="$(command -v python3 || command -v python)"
  if [[ ! -d "$wheels" ]]; then
    echo "gpu check: no $wheels: run scripts/gpu_bundle.sh here and carry gpu_wheels" | tee -a "$log"
  fi
  if "$base" -m venv --system-site-packages "$venv" >> "$log" 2>&1 \
      && see_base_packages "$base" "$venv/bin/python" && install_into "$venv/bin/python"; then
    py="$venv/bin/python"
  else
    echo "== venv failed; installing into $base itself" >> "$log"
    install_into "$base"
    py="$base"
  fi
fi
echo "== python: $py (install step $((SECONDS - t0)) s)" | tee -a "$log"
has_deps "$py" || echo "gpu check: $py lacks a dependency (see $log); going on" >&2

# flash-attn 4, first of two calls: park the bundle's first half where the second call
# (scripts/gpu_fa4.sh, within the machine's idle time) finds it.
if [[ $dry == 0 && -d "$root/gpu_wheels_fa4/1" ]]; then
  mkdir -p /tmp/kvbench-fa4 && cp -r "$root/gpu_wheels_fa4/1/." /tmp/kvbench-fa4/ \
    && echo "== flash-attn 4: first half parked in /tmp/kvbench-fa4" >> "$log"
fi
[[ -f "$wheels/MANIFEST.txt" ]] && cp "$wheels/MANIFEST.txt" "$out/bundle.txt"

cd "$root"
if [[ $dry == 1 ]]; then
  export TRITON_INTERPRET=1
  exec timeout 300 "$py" -m harness.gpucheck --out "$out" ${args[@]+"${args[@]}"}
fi
export TRITON_INTERPRET=0
# 7.5 minutes in all: the driver gets what the install left (an explicit --total-s, later
# on the line, wins); the timeout is the backstop.
left=$((448 - SECONDS))
timeout $((left + 10)) "$py" -m harness.gpucheck --out "$out" --total-s "$left" \
  ${args[@]+"${args[@]}"}
rc=$?
# The device tool brings back at most 8 files from $OUT: there, everything also goes into
# one archive, and summary.md / status.json stay beside it (the rest is removed).
if [[ -n "${OUT:-}" && "$out" == "$(cd "$OUT" 2>/dev/null && pwd)" ]]; then
  tar czf /tmp/gpu_check.tgz -C "$out" . && find "$out" -mindepth 1 -maxdepth 1 \
    ! -name summary.md ! -name status.json -exec rm -rf {} + \
    && mv /tmp/gpu_check.tgz "$out/gpu_check.tgz"
fi
exit $rc
