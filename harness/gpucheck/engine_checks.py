"""Sections ``engine-<shape>``: the whole engine, through the public ``harness.runner.run``
on a composed config, once per backend, at one model shape.

Each backend first serves a warm-up workload (Triton compiles its kernels, flex its graph,
cuBLAS picks its GEMMs), then the measured one. The warm-up has the measured batch and
prompts and a few output tokens, so that it takes the same kernel variants (the split-K
decode and its combine kernel among them: a 2-request warm-up did not, and the first H200
run compiled them inside the measured run); ``slow_steps`` counts steps over twice their
kind's median, to show if one still does. Reported per backend: output and
total tokens/s over the run's wall time, the mean step, the median decode-only step and the
median prefill step, the kernel actually used, and whether the run finished every request.
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


def engine_section(ctx: SectionContext, shape: EngineShape) -> dict[str, Any]:
    p = ctx.profile
    result: dict[str, Any] = {"shape": shape.name, "overrides": list(shape.overrides),
                              "workload": list(p.workload), "kv_budget": shape.kv_budget,
                              "rows": []}
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
        result["rows"].append(run_backend(p, shape, label, backend,
                                          min(left - 0.5, 2.5 * share)))
        ctx.save(result)
    return result
