"""Timing that works on both sides: triton's do_bench (median, CUDA events) on CUDA, a
median of wall-clock repetitions on the CPU (the dry run: the numbers mean nothing there,
the code path is what is checked)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup_ms: int,
            rep_ms: int) -> float:
    """Median milliseconds of one call of ``fn`` (which has run once already)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    times = []
    for _ in range(max(1, rep_ms // 50)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_gbps(nbytes: int, device: torch.device, *, warmup_ms: int, rep_ms: int) -> float:
    """Device-to-device copy bandwidth: (read + write bytes) / time, in GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup_ms=warmup_ms, rep_ms=rep_ms)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def time_bandwidth(row: dict[str, Any], fn: Callable[[], object], device: torch.device,
                   nbytes: int, copy: float | None, *, warmup_ms: int, rep_ms: int,
                   error: Callable[[BaseException], str]) -> dict[str, Any]:
    """``row`` with ``fn``'s time (one call first, to compile) and the bandwidth of the
    ``nbytes`` it must read: ms, GB/s and its % of a device copy's ``copy`` GB/s; a
    failure sets ``row["error"]`` (``error``'s text of it) instead. Returns ``row``."""
    try:
        fn()
        ms = time_ms(fn, device, warmup_ms=warmup_ms, rep_ms=rep_ms)
        gbps = nbytes / (ms * 1e-3) / 1e9
        row.update(ms=ms, gbps=gbps, pct_of_copy=100 * gbps / copy if copy else None)
    except Exception as e:
        row["error"] = error(e)
    return row
