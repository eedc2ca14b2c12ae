"""The what-if's physics points (issue #52) as a markdown table, times modelled:

    .venv/bin/python scripts/whatif_physics_table.py

Each row is one what-if run chosen to sit on one mechanism: compute-bound FP8 GEMMs (Llama
8B / 70B at 128/128, TensorRT-LLM's profile), a compute-bound mixture of experts (Mixtral
8x7B at batch 512, 128/128), MLA prefill (DeepSeek-V3 fp8 on 8xH200, one 32k prompt), a
memory-bound reference (Llama 8B bf16, one request), and GPU memory (the KV tokens the auto
budget holds). Run it from a snapshot of another commit (scripts/snapshot_run.sh DIR REV --
python <this file>) for that commit's figures: docs/results/2026-12-05-whatif-physics.md
puts cb496fd's beside these.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

# Mixtral-8x7B's config.json (mistralai/Mixtral-8x7B-v0.1), the keys the reader uses.
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
           "intermediate_size": 14336, "max_position_embeddings": 32768,
           "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
           "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
           "tie_word_embeddings": False, "vocab_size": 32000}


def fixed(n: int, isl: int, osl: int) -> list[str]:
    """``n`` requests all at once of exactly ``isl`` prompt and ``osl`` output tokens."""
    return ["workload=random", f"workload.num_requests={n}", "workload.rate=0",
            "workload.distribution=uniform", f"workload.input_mean={isl}",
            "workload.input_std=0", f"workload.input_min={isl}", f"workload.input_max={isl}",
            f"workload.output_mean={osl}", "workload.output_std=0",
            f"workload.output_min={osl}", f"workload.output_max={osl}"]


def points(mixtral: str) -> list[tuple[str, list[str]]]:
    fp8 = ["roofline.weight_dtype=fp8", "roofline.compute_dtype=fp8", "backend=fp8"]
    trt = ["roofline.engine=trtllm", "roofline.gpu_memory_utilization=0.95",
           "roofline.memory_utilization_of=free"]
    return [
        ("Llama-3.1-8B fp8, 1xH100, 128/128 x 3000, trtllm",
         ["roofline.model=Llama-3.1-8B", "roofline.hardware=h100-sxm", *fp8, *trt,
          *fixed(3000, 128, 128)]),
        ("Llama-3.1-8B fp8, 1xH200, 128/128 x 3000, trtllm",
         ["roofline.model=Llama-3.1-8B", "roofline.hardware=h200", *fp8, *trt,
          *fixed(3000, 128, 128)]),
        ("Llama-3.1-70B fp8, 1xH200, 128/128 x 2000, trtllm",
         ["roofline.model=Llama-3.1-70B", "roofline.hardware=h200", *fp8, *trt,
          *fixed(2000, 128, 128)]),
        ("Mixtral-8x7B bf16, 2xH100, 128/128 x 512, vllm-0.6",
         [f"roofline.model={mixtral}", "roofline.hardware=h100-sxm", "roofline.tp=2",
          "scheduler.max_num_seqs=512", *fixed(512, 128, 128)]),
        ("DeepSeek-V3 fp8, 8xH200, one 32k prompt, vllm-0.6",
         ["roofline.model=DeepSeek-V3", "roofline.hardware=h200", "roofline.tp=8", *fp8,
          *fixed(1, 32768, 2)]),
        ("Llama-3.1-8B bf16, 1xH100, 1 request 128/512, vllm-0.6",
         ["roofline.model=Llama-3.1-8B", "roofline.hardware=h100-sxm",
          *fixed(1, 128, 512)]),
    ]


def run_point(overrides: list[str]) -> dict[str, Any]:
    from harness.config import compose_config
    from harness.runner import run

    base = ["executor=roofline", "cache.kv_budget=auto", "progress=false"]
    return run(compose_config([*base, *overrides])).metrics


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "config.json"
        cfg.write_text(json.dumps(MIXTRAL))
        print("| point | KV token capacity | max running | output tok/s | TTFT p50 ms | "
              "TPOT p50 ms |")
        print("|---|---|---|---|---|---|")
        for name, ov in points(str(cfg)):
            m = run_point(ov)
            cap = m.get("memory.token_capacity") or m.get("memory.num_slots")
            print(f"| {name} | {cap} | {m.get('memory.max_running_seqs')} | "
                  f"{m['throughput.output_tokens_per_s']:.0f} | "
                  f"{m['latency.ttft_ms.p50']:.1f} | {_fmt(m.get('latency.tpot_ms.p50'))} |",
                  flush=True)


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}"


if __name__ == "__main__":
    main()
