"""kvbench's side, step 1 of scripts/peer_kvpress.sh: the RULER prompts both sides run.

    python scripts/peer/make_prompts.py OUT.json [--lengths 1024 2048] [--samples 3]

Writes the prompts (token ids of SmolLM2's tokenizer, exactly ``length`` tokens each, the
questions asked at the end), their answers' metadata, the GGUF both sides load, and the
kept counts: kvpress keeps ``int(length * (1 - compression_ratio))`` tokens per layer and
head; kvbench is given the same count per sequence (``backend.budget``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness.model import default_gguf_path, load_model
from harness.workloads import make_workload, workload_options


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
                                 "prompts": prompts}) + "\n")
    print(f"{len(prompts)} prompts -> {a.out}")


if __name__ == "__main__":
    main()
