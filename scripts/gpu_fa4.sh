#!/usr/bin/env bash
# flash-attn 4 on the GPU machine: the second of two consecutive calls (one call carries at
# most 64 MiB, the bundle is ~100 MB; files outside $OUT survive while the machine is warm):
#   call 1: scripts/gpu_check.sh          carry: gpu_wheels, gpu_wheels_fa4/1
#   call 2: scripts/gpu_fa4.sh [OUT_DIR]  carry: gpu_wheels_fa4/2   (within the idle time)
# Reassembles the cutlass library wheel from its two parts (sha256 checked), installs
# flash-attn 4 and its deps offline (--no-deps: the exact set bundled) into call 1's venv,
# and runs the check's env and flash-attn sections (kernels vs references, decode timings,
# the engine through the flash_attn seam). Bundle: scripts/gpu_bundle.sh --fa4.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$PWD/gpu_check_fa4}"
if [[ $# -gt 0 && "$1" != --* ]]; then out="$1"; shift; fi
mkdir -p "$out" && out="$(cd "$out" && pwd)"
park=/tmp/kvbench-fa4
venv="${KVBENCH_GPU_VENV:-/tmp/kvbench-gpu-venv}"
py="${PYTHON:-$venv/bin/python}"
log="$out/install.log"
: > "$log"
fail() { echo "gpu_fa4: $*" | tee -a "$log" >&2; exit 2; }

[[ -x "$py" ]] || fail "no $py: run scripts/gpu_check.sh first, on the same machine"
mkdir -p "$park"
[[ -d "$root/gpu_wheels_fa4/2" ]] && cp -r "$root/gpu_wheels_fa4/2/." "$park/"
cd "$park" || fail "cannot enter $park"
sums=(*.sha256)
[[ -f "${sums[0]}" ]] || fail "no parts in $park: carry gpu_wheels_fa4/1 in call 1, /2 here"
big="${sums[0]%.sha256}"
if [[ ! -f "$big" ]]; then
  [[ -f "$big.part00" ]] || fail "$big.part00 missing: the machine was not kept from call 1"
  [[ -f "$big.part01" ]] || fail "$big.part01 missing: carry gpu_wheels_fa4/2"
  cat "$big.part00" "$big.part01" > "$big"
fi
sha256sum -c "${sums[0]}" >> "$log" 2>&1 || { rm -f "$big"; fail "checksum of $big failed"; }
"$py" -m pip install --no-index --no-deps --disable-pip-version-check -q ./*.whl \
  >> "$log" 2>&1 || fail "pip install failed (see $log)"
echo "== flash-attn 4 installed into $py" | tee -a "$log"
cd "$root"
# kvbench from this tree (call 1's venv may point at another copy); setuptools is there.
"$py" -m pip install --no-index --no-deps --no-build-isolation --disable-pip-version-check \
  -q -e "$root" >> "$log" 2>&1 || fail "editable install of kvbench failed (see $log)"
export TRITON_INTERPRET=0
exec timeout 300 "$py" -m harness.gpucheck --out "$out" --only env,flash-attn \
  --budget flash-attn=240 --total-s 270 "$@"
