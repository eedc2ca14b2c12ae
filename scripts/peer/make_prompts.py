"""kvbench's side, step 1 of scripts/peer_kvpress.sh: the RULER prompts both sides run.

    python scripts/peer/make_prompts.py OUT.json [--lengths 1024 2048] [--samples 3]

Writes the prompts (token ids of SmolLM2's tokenizer, exactly ``length`` tokens each, the
questions asked at the end), their answers' metadata, the GGUF both sides load, and the
kept counts: kvpress keeps ``int(length * (1 - compression_ratio))`` tokens per layer and
head; kvbench is given the same count per sequence (``backend.budget``; per head on
average for pyramidkv and adakv). And duo_attention's heads as kvbench measures them on
the model (backends/duo_heads.py, its default settings), which kvpress's side gives its
DuoAttentionPress in place of the patterns it downloads (none exist for SmolLM2), so both
sides stream the same heads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from harness.backends.duo_attention import DuoAttentionBackend, DuoAttentionOptions
from harness.kv.policies.duo import DuoPolicy
from harness.model import LoadedModel, default_gguf_path, load_model
from harness.stack import model_layout
from harness.workloads import make_workload, workload_options


def duo_heads(loaded: LoadedModel) -> dict[str, object]:
    """kvbench's streaming heads (layers x KV heads, bool) and their sinks and recent
    tokens, measured on the model as a duo_attention run measures them."""
    be = DuoAttentionBackend(model_layout(loaded), torch.device("cpu"))
    be.calibrate(loaded.model, loaded.tokenizer)
    o, policy, lay = be.opts, be.policy, be.layout
    assert isinstance(o, DuoAttentionOptions) and isinstance(policy, DuoPolicy)
    mask = policy.streaming.reshape(lay.num_layers, lay.num_kv_heads)
    return {"streaming": mask.tolist(), "sink": o.sink_tokens, "recent": o.recent,
            "head_ratio": o.head_ratio}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.75],
                    help="compression ratios (kvpress's: share removed)")
    a = ap.parse_args()
    loaded = load_model("smollm2")
    opts = workload_options("ruler", {"lengths": a.lengths, "samples": a.samples, "seed": 0})
    wl = make_workload(opts, loaded.tokenizer)
    prompts = [{"id": r.request_id, "ids": list(r.prompt_ids), "max_tokens": r.params.max_tokens,
                **{k: v for k, v in r.meta.items() if isinstance(v, int | float | str)}}
               for r in wl.initial_requests()]
    kept = {str(ratio): {str(n): int(n * (1 - ratio)) for n in a.lengths} for ratio in a.ratios}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"gguf": str(default_gguf_path()), "lengths": a.lengths,
                                 "samples": a.samples, "ratios": a.ratios, "kept": kept,
                                 "duo": duo_heads(loaded), "prompts": prompts}) + "\n")
    print(f"{len(prompts)} prompts -> {a.out}")


if __name__ == "__main__":
    main()
