#!/usr/bin/env bash
# kvbench's methods side by side with NVIDIA's kvpress on the same RULER prompts.
#
#   scripts/peer_kvpress.sh [OUT_DIR] [--lengths 1024 2048] [--samples 3] [--ratios 0.75] \
#       [--methods pyramidkv adakv duo_attention]
#
# 1. builds kvpress in its own venv (.venv-kvpress: kvpress 0.5.5 pins transformers < 5.3,
#    kvbench runs 5.x; once installed it runs offline), torch from the same local wheel;
# 2. writes the prompts (kvbench's RULER niah_single_1/2 at each length, 5 depths x
#    --samples; kvbench's tokenizer) and kvpress's kept counts (scripts/peer/make_prompts.py);
# 3. runs kvpress's presses on them, the whole prompt compressed in one prefill, with
#    kvpress's own per-head selection and with kvbench's per-sequence one (pyramidkv, adakv,
#    duo_attention: per head only, duo with kvbench's measured heads), and records the
#    fixture of layer inputs and scores (scripts/peer/kvpress_side.py);
# 4. runs kvbench's backends at the same kept counts through its engine and writes
#    OUT_DIR/table.md and results.json (scripts/peer/compare.py).
# --methods: only these (and the uncompressed reference, always run); default: every one.
# Default OUT_DIR: results/peer_kvpress/<date>. Not part of CI (the install is large);
# tests/backends/test_peer_kvpress.py checks the committed fixture (tests/fixtures/kvpress_scores.pt).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
case "${1:-}" in
    -h|--help)  # (issue #55: --help built a 1.4 GB venv and ran mkdir -p --help)
        sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        exit 0 ;;
    -*)  # an option where the output folder goes: it is the first argument
        if [ "${1:-}" != "--lengths" ] && [ "${1:-}" != "--samples" ] \
                && [ "${1:-}" != "--ratios" ] && [ "${1:-}" != "--methods" ]; then
            echo "peer_kvpress.sh: unknown option $1 (usage: scripts/peer_kvpress.sh" \
                "[OUT_DIR] [--lengths ...] [--samples N] [--ratios ...] [--methods ...];" \
                "--help)" >&2
            exit 2
        fi
        set -- "results/peer_kvpress/$(date +%Y%m%d)" "$@" ;;
esac
out="${1:-results/peer_kvpress/$(date +%Y%m%d)}"
[ $# -gt 0 ] && shift
py="$root/.venv/bin/python"
[ -x "$py" ] || bash "$root/scripts/setup.sh"
kp="$root/.venv-kvpress/bin/python"
if [ ! -x "$kp" ] || ! "$kp" -c "import kvpress, gguf" 2>/dev/null; then
    python3 -m venv "$root/.venv-kvpress"
    "$kp" -m pip install -q "${KVBENCH_TORCH_SPEC:-torch==2.13.0}" "kvpress==0.5.5" \
        "transformers>=4.56,<5.3" "gguf>=0.10"
fi
# --methods ... (up to the next option) goes to both sides; the rest to make_prompts.py.
prompt_args=() methods=() in_methods=0
for a in "$@"; do
    case "$a" in
        --methods) in_methods=1; continue ;;
        --*) in_methods=0 ;;
    esac
    if [ "$in_methods" = 1 ]; then methods+=("$a"); else prompt_args+=("$a"); fi
done
kvpress_methods=() compare_methods=()
if [ ${#methods[@]} -gt 0 ]; then
    kvpress_methods=(--methods "${methods[@]}")  # kvpress's side runs "none" anyway
    compare_methods=(--methods none "${methods[@]}")
fi
mkdir -p "$out"
export TQDM_DISABLE=1 TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1
"$py" scripts/peer/make_prompts.py "$out/prompts.json" "${prompt_args[@]}"
"$kp" scripts/peer/kvpress_side.py "$out/prompts.json" "$out/kvpress.json" \
    --fixture "$out/kvpress_scores.pt" "${kvpress_methods[@]}"
"$py" scripts/peer/compare.py "$out" "${compare_methods[@]}"
echo "peer_kvpress: $out/table.md (fixture: $out/kvpress_scores.pt; copy it to"
echo "  tests/fixtures/kvpress_scores.pt to refresh the CI check)"
