#!/usr/bin/env bash
# Wheels the GPU check needs on the GPU machine (Python 3.12, torch/triton/pytest there, no
# network), downloaded here into git-ignored folders that travel with the working tree:
#   scripts/gpu_bundle.sh          gpu_wheels/: hydra-core, omegaconf, antlr4 4.9.3 (built
#                                  here: PyPI has only its sdist), PyYAML and packaging for
#                                  cp312, setuptools (for the editable install of kvbench
#                                  there, from the tree itself: never a stale copy)
#   scripts/gpu_bundle.sh --fa4    also gpu_wheels_fa4/{1,2}: flash-attn 4 and its deps
#                                  (~100 MB: its 92 MB cutlass library wheel is split in two
#                                  parts, one per call, reassembled there by gpu_fa4.sh)
# Prints every file's size; gpu_wheels/MANIFEST.txt lists them with their sha256.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
dest="${GPU_WHEELS:-$root/gpu_wheels}"
fa4=0
[[ "${1:-}" == --fa4 ]] && fa4=1
ver() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
# cp312 manylinux wheels, or pure-Python ones; never an sdist (nothing builds there).
download() {  # $1: folder, rest: requirements
  local to="$1"; shift
  "$py" -m pip download --no-deps --disable-pip-version-check -q --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 \
    --only-binary=:all: -d "$to" "$@"
}
sizes() {  # $1: folder
  local f
  for f in "$1"/*; do printf '  %8s KiB  %s\n' "$(( $(stat -c %s "$f") / 1024 ))" "${f##*/}"; done
  echo "  total: $(du -sh --apparent-size "$1" | cut -f1)"
}

rm -rf "$dest" && mkdir -p "$dest"
# The versions CI tests with (this .venv), so that the GPU runs the same config code.
download "$dest" "hydra-core==$(ver hydra-core)" "omegaconf==$(ver omegaconf)" \
  "PyYAML==$(ver PyYAML)" "packaging" "setuptools>=68"
"$py" -m pip wheel --no-deps --disable-pip-version-check -q -w "$dest" \
  "antlr4-python3-runtime==4.9.3"
(cd "$dest" && { echo "# kvbench GPU bundle, $(date -u +%FT%TZ), from $(git -C "$root" rev-parse --short HEAD 2>/dev/null)";
  sha256sum ./*.whl | awk '{print $2, $1}'; }) > "$dest/MANIFEST.txt"
echo "gpu_wheels ($dest):"; sizes "$dest"

if [[ $fa4 == 1 ]]; then
  fa="$root/gpu_wheels_fa4"
  rm -rf "$fa" && mkdir -p "$fa/1" "$fa/2" "$fa/dl"
  download "$fa/dl" "flash-attn-4==4.0.0b36" "nvidia-cutlass-dsl==4.8.1" \
    "nvidia-cutlass-dsl-libs-base==4.8.1" "nvidia-cutlass-dsl-libs-cu13==4.8.1" \
    "apache-tvm-ffi>=0.1.11,<0.2" "torch-c-dlpack-ext" "quack-kernels>=0.5.3" "einops"
  big="$(cd "$fa/dl" && ls nvidia_cutlass_dsl_libs_cu13-*.whl)"
  (cd "$fa/dl" && sha256sum "$big" > "$fa/1/$big.sha256" && cp "$fa/1/$big.sha256" "$fa/2/")
  # Two equal halves (~44 MiB each): call 1 also carries gpu_wheels/ (~2 MB), call 2 the
  # small wheels (~9 MB).
  split -n 2 -d "$fa/dl/$big" "$fa/dl/$big.part"
  mv "$fa/dl/$big.part00" "$fa/1/" && mv "$fa/dl/$big.part01" "$fa/2/"
  if compgen -G "$fa/dl/*.part*" > /dev/null; then
    echo "gpu_bundle: the split left more than two parts" >&2; exit 1
  fi
  rm "$fa/dl/$big" && mv "$fa/dl"/*.whl "$fa/2/" && rmdir "$fa/dl"
  echo "gpu_wheels_fa4/1 (first call, with gpu_check.sh):"; sizes "$fa/1"
  echo "gpu_wheels_fa4/2 (second call, gpu_fa4.sh):"; sizes "$fa/2"
fi
