"""The GPU check's GEMM profile (part of section ``kernel-bandwidth``): bf16 and FP8 weight
GEMMs of Llama-3.1-8B's shapes timed on the device, at decode to prefill row counts.

The what-if prices a GEMM by its dtype's share of the peak (harness.roofline.hardware
``eff_gemm`` / ``eff_gemm_dtype``); on Hopper those shares come from published tables
(Vidur's bf16 profiles, FBGEMM's and DeepGEMM's FP8 ones). This measures them on the lent
card: ``python -m harness.roofline_tools.kernel_fit --gpu-check DIR`` reads the rows back
and prints the shares they give (nothing is written into a spec by itself).

FP8 is per-tensor (one fp32 scale each for activations and weights, ``torch._scaled_mm``):
the layout of Llama-class FP8 checkpoints. Where the device or torch has no FP8 GEMM (the
CPU dry run, say), the FP8 rows carry the error instead of a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from harness.gpucheck.timing import time_ms

# Llama-3.1-8B's decoder-layer GEMMs as (N, K): fused QKV, O, fused gate+up, down.
LLAMA8B = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
GPU_ROWS = (1, 64, 256, 1024, 4096, 8192)
DRY_SHAPES = ((48, 32), (32, 64))
DRY_ROWS = (1, 16)


def _bf16(m: int, n: int, k: int, dev: torch.device) -> Callable[[], object]:
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    return lambda: F.linear(x, w)


def _fp8(m: int, n: int, k: int, dev: torch.device) -> Callable[[], object]:
    f8 = torch.float8_e4m3fn
    x = torch.randn(m, k, device=dev).to(f8)
    w = torch.randn(n, k, device=dev).to(f8)  # row-major [N, K]: w.t() is column-major
    one = torch.ones((), device=dev, dtype=torch.float32)
    return lambda: torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one,
                                    out_dtype=torch.bfloat16)


def gemm_profile(device: torch.device, gpu: bool, warmup_ms: int, rep_ms: int,
                 left: Callable[[], float]) -> list[dict[str, Any]]:
    """One row per (dtype, M, N, K): milliseconds and TFLOP/s, or the error; stops
    starting new shapes when ``left()`` (seconds) falls below 2."""
    shapes = LLAMA8B if gpu else DRY_SHAPES
    rows_m = GPU_ROWS if gpu else DRY_ROWS
    out: list[dict[str, Any]] = []
    for dtype, make in (("bf16", _bf16), ("fp8", _fp8)):
        for n, k in shapes:
            for m in rows_m:
                row: dict[str, Any] = {"dtype": dtype, "m": m, "n": n, "k": k, "ms": None}
                if left() < 2:
                    row["error"] = "skipped: time budget"
                    out.append(row)
                    continue
                try:
                    fn = make(m, n, k, device)
                    fn()
                    ms = time_ms(fn, device, warmup_ms=warmup_ms, rep_ms=rep_ms)
                    row.update(ms=ms, tflops=2.0 * m * n * k / (ms * 1e-3) / 1e12)
                except Exception as e:  # no FP8 GEMM on this device / torch
                    row["error"] = f"{type(e).__name__}: {e}"[:200]
                out.append(row)
    return out
