"""The batch limits ``trtllm-bench throughput`` derives from a dataset, when the user gives
none: its ``max_batch_size`` and ``max_num_tokens``, as the TensorRT-LLM profile's
``scheduler.max_num_seqs`` / ``max_num_batched_tokens`` (harness.roofline.engines's
``"trtllm-bench"`` rule, resolved by harness.roofline_tools.validate for each published point).

What TensorRT-LLM does (tensorrt_llm/bench/build/tuning.py ``calc_engine_setting`` and
``finetune_setting``, tensorrt_llm/bench/benchmark/utils/general.py ``get_settings``; read
2026-12-02 in NVIDIA/TensorRT-LLM, tuning.py @04cba88, general.py @0171265):

- KV requests that fit: ``R = f x (tp x device GiB - weights GiB) / (kv bytes per token x
  (ISL + OSL))``, ``f`` = ``kv_cache_free_gpu_mem_fraction``, KV heads counted as
  ``max(tp, kv_heads)`` per layer (each rank holds at least one);
- ``max_batch_size``: ``raw = min(R, 4096)``; below 256 rounded up to 32 (at least 64),
  below 1024 to 128, else to 256;
- ``max_num_tokens``: ``raw x (1 + ISL / OSL)`` capped at 32768, rounded up to 256 (at
  least 2048) below 4096, to 512 below 8192, else to 1024; with chunked prefill off (its
  default) at least ``max ISL + max_batch_size``, so that the longest prompt and a full
  batch of decodes fit one step.

Without these limits the simulated engine admitted one 20,000-token prompt per step only
when nothing else ran (a budget of the prompt alone), and 2048 sequences where
trtllm-bench runs ~100: the v0.19 long-prompt rows came out 83-95% low.
"""

from __future__ import annotations

import math

from harness.roofline.arch import ArchSpec

GiB = 2**30
# finetune_setting's rounding: (below this value, round up to a multiple of this step).
_BATCH_STEPS = ((256, 32), (1024, 128), (math.inf, 256))
_TOKEN_STEPS = ((4096, 256), (8192, 512), (math.inf, 1024))


def _round_up(raw: float, steps: tuple[tuple[float, int], ...], floor: int) -> int:
    """``raw`` rounded up to the step of the first tier it lies below, at least ``floor``."""
    step = next(st for below, st in steps if raw < below)
    return max(floor, step * math.ceil(raw / step))


def batch_limits(arch: ArchSpec, mem_bytes: int, tp: int, weight_bytes_per_param: float,
                 kv_bytes_per_elem: float, isl: int, osl: int, max_isl: int,
                 kv_fraction: float, chunked_prefill: bool = False) -> tuple[int, int]:
    """``(max_batch_size, max_num_tokens)`` as trtllm-bench picks them (module docstring)
    for ``arch`` on ``tp`` devices of ``mem_bytes`` each, a dataset of mean ISL/OSL
    ``isl``/``osl`` whose longest prompt is ``max_isl``."""
    if isl <= 0 or osl <= 0:
        raise ValueError(f"trtllm-bench's limits need positive ISL and OSL, got {isl}/{osl}")
    kv_heads = max(tp, arch.num_kv_heads)
    per_token = 2 * arch.num_layers * kv_heads * arch.head_dim * kv_bytes_per_elem / GiB
    engine = arch.total_params() * weight_bytes_per_param / GiB
    cache = (mem_bytes / GiB * tp - engine) * kv_fraction
    requests = cache / (per_token * (isl + osl))
    if requests < 1:
        raise ValueError(f"{arch.name} on {tp} device(s): no request of {isl + osl} tokens "
                         "fits trtllm-bench's KV estimate")
    raw_bs = min(requests, 4096.0)
    raw_tokens = min(raw_bs * (1 + isl / osl), 32768.0)
    max_bs = _round_up(raw_bs, _BATCH_STEPS, floor=64)
    max_tokens = _round_up(raw_tokens, _TOKEN_STEPS, floor=2048)
    if not chunked_prefill:
        max_tokens = max(max_tokens, max_isl + max_bs)
    return max_bs, max_tokens
