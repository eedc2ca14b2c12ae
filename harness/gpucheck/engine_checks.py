"""Sections ``engine-<shape>``: the whole engine, through the public ``harness.runner.run``
on a composed config, once per backend, at one model shape.

Each backend first serves a warm-up workload (Triton compiles its kernels, flex its graph,
cuBLAS picks its GEMMs), then the measured one. The warm-up has the measured batch and
prompts and a few output tokens, so that it takes the same kernel variants (the split-K
decode and its combine kernel among them: a 2-request warm-up did not, and the first H200
run compiled them inside the measured run); ``slow_steps`` counts steps over twice their
kind's median, to show if one still does. Reported per backend: output and
total tokens/s over the run's wall time, the mean step, the median decode-only step (and
its ratio to reading the weights once at the measured copy bandwidth: 1 is a decode step
paced by its weights alone) and the median prefill step, the kernel actually used, whether
decode steps replayed CUDA graphs (``run.cuda_graphs``; the ``-eager`` rows turn them off),
and whether the run finished every request.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from omegaconf import DictConfig, open_dict

from harness.gpucheck.context import SectionContext, SectionTimeout, error_text, time_limit
from harness.gpucheck.profile import ENGINE_BACKENDS, EngineShape, Profile


def compose_run(overrides: list[str]) -> DictConfig:
    """Compose conf/config.yaml with ``overrides`` as ``python -m harness`` does; no
    results folder, no progress bar."""
    from harness.config import compose_config

    cfg = compose_config(overrides)
    with open_dict(cfg):
        cfg.out_dir = None
        cfg.progress = False
    return cfg


def run_overrides(profile: Profile, shape: EngineShape, backend: tuple[str, ...], *,
                  warmup: bool) -> list[str]:
    workload = profile.warmup_workload if warmup else profile.workload
    return [*shape.overrides, *backend, *workload, *profile.engine_common,
            f"cache.kv_budget={shape.kv_budget}"]


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _over_twice_median(xs: list[float]) -> int:
    m = _median(xs)
    return 0 if m is None else sum(x > 2 * m for x in xs)


def engine_row(metrics: dict[str, Any], steps: Sequence[Any]) -> dict[str, Any]:
    """The figures of one measured run (``steps``: the run's StepRow list)."""
    decode = [s.step_ms for s in steps if s.prefill_tokens == 0 and s.decode_tokens > 0]
    prefill = [s.step_ms for s in steps if s.prefill_tokens > 0]
    # Steps over twice their kind's median: what a kernel compiled inside the measured run
    # looks like (the first H200 run's Triton backends: mean step 40 ms, medians 23 / 29).
    slow = _over_twice_median(decode) + _over_twice_median(prefill)
    return {
        "kernel": metrics["run.kernel"], "model": metrics["run.model"],
        "cuda_graphs": metrics.get("run.cuda_graphs"),
        "device": metrics["run.device"],
        "output_tok_s": metrics["throughput.output_tokens_per_s"],
        "total_tok_s": metrics["throughput.total_tokens_per_s"],
        "step_ms_mean": metrics["engine.step_ms_mean"],
        "decode_step_ms_p50": _median(decode), "prefill_step_ms_p50": _median(prefill),
        "decode_batch_max": max((s.decode_tokens for s in steps), default=0),
        "step_ms_max": max((s.step_ms for s in steps), default=None), "slow_steps": slow,
        "steps": len(steps), "wall_s": metrics["engine.wall_s"],
        "finished": metrics["requests.finished"], "rejected": metrics["requests.rejected"],
        "preemptions": metrics["sched.preemptions_recompute"],
        "max_running": metrics["memory.max_running_seqs"],
        "token_capacity": metrics["memory.token_capacity"],
        "kv_read_bytes_per_token": metrics.get("attention.kv_read_bytes_per_token"),
        "overhead_pct": metrics["engine.overhead_pct"],
    }


def _release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def run_backend(profile: Profile, shape: EngineShape, label: str,
                backend: tuple[str, ...], seconds: float) -> dict[str, Any]:
    """Warm-up and measured run of one backend within ``seconds``; errors recorded."""
    from harness.runner import run

    row: dict[str, Any] = {"backend": label, "shape": shape.name}
    t0 = time.perf_counter()
    try:
        with time_limit(seconds):
            run(compose_run(run_overrides(profile, shape, backend, warmup=True)))
            _release(profile.device)
            result = run(compose_run(run_overrides(profile, shape, backend, warmup=False)))
        row.update(engine_row(result.metrics, result.steps), ok=True)
    except SectionTimeout as e:
        row.update(ok=False, error=f"timeout: {e}")
    except Exception as e:  # one backend failing is a result; the next one runs
        row.update(ok=False, error=error_text(e))
    row["seconds"] = round(time.perf_counter() - t0, 2)
    _release(profile.device)
    return row


def weight_bytes(overrides: list[str]) -> int | None:
    """Bytes of the weights of the model ``overrides`` choose, from its preset's shape
    (a tiny or random-weight preset; None for a model read from files)."""
    from harness.model import RANDOM_PRESETS, TINY_PRESETS

    model = compose_run(overrides).model
    c = {**TINY_PRESETS, **RANDOM_PRESETS}.get(model.source)
    if c is None:
        return None
    h, inter = c.hidden_size, c.intermediate_size
    layer = h * (c.q_size + 2 * c.kv_size) + c.q_size * h + 3 * h * inter + 2 * h
    if c.attention_bias:
        layer += c.q_size + 2 * c.kv_size
    params = c.vocab_size * h * (1 if c.tie_word_embeddings else 2) + c.num_layers * layer + h
    return params * torch.empty(0, dtype=getattr(torch, model.dtype)).element_size()


def weight_read_ms(ctx: SectionContext, nbytes: int | None) -> float | None:
    """Reading the weights once at the copy bandwidth the bandwidth section measured
    (None when either is unknown): the floor of a decode step."""
    path = ctx.out / "kernel-bandwidth.json"
    if nbytes is None or not path.exists():
        return None
    import json

    gbps = json.loads(path.read_text()).get("copy_gbps")
    return None if not gbps else nbytes / (gbps * 1e9) * 1e3


def engine_section(ctx: SectionContext, shape: EngineShape) -> dict[str, Any]:
    p = ctx.profile
    result: dict[str, Any] = {"shape": shape.name, "overrides": list(shape.overrides),
                              "workload": list(p.workload), "kv_budget": shape.kv_budget,
                              "rows": []}
    try:
        result["weight_bytes"] = weight_bytes([*shape.overrides, *p.engine_common])
    except Exception as e:  # a figure for the summary, not the section's verdict
        result["weight_bytes_error"] = error_text(e)
    floor = weight_read_ms(ctx, result.get("weight_bytes"))
    result["weight_read_ms"] = floor
    backends = [(label, b) for label, b in ENGINE_BACKENDS
                if shape.backends is None or label in shape.backends]
    for i, (label, backend) in enumerate(backends):
        left = ctx.left()
        if left < p.min_backend_s:
            result["rows"].append({"backend": label, "shape": shape.name, "ok": None,
                                   "error": "skipped: time budget"})
            continue
        # An even share of what is left, but a backend may use the time others did not.
        share = max(p.min_backend_s, left / (len(backends) - i))
        row = run_backend(p, shape, label, backend, min(left - 0.5, 2.5 * share))
        if floor and row.get("decode_step_ms_p50"):
            row["decode_over_weight_read"] = row["decode_step_ms_p50"] / floor
        result["rows"].append(row)
        ctx.save(result)
    return result
