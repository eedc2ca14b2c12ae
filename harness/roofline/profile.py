"""A GEMM profile of a loaded model on this machine: seconds per weight parameter at each
row count, for the decoder layers' weights and for the lm_head (Vidur's profiling tables,
for the one op class a CPU roofline gets wrong).

The model's own weight tensors are multiplied (so the profile streams the real bytes from
memory, not one cached matrix), each row count ``repeats`` times, the median kept. What it
also gives: the highest FLOP/s any row count reached (the spec's fp32 peak: a lower bound
of the core's) and the weight-streaming bandwidth at one row (a GEMV is a read of the
weights).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Every count to 16 (a CPU GEMM's cost steps with its 4-row tiles), then a geometric grid.
ROWS = (*range(1, 17), 20, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048)


@dataclass
class GemmProfile:
    dtype: str
    rows: list[int]
    layers_s_per_param: list[float]
    lm_head_s_per_param: list[float]
    peak_flops: float  # best FLOP/s over the row counts (layers' weights)
    mem_bw: float  # weight bytes / seconds at one row (layers' weights)

    def as_json(self) -> dict[str, object]:
        return {"dtype": self.dtype, "rows": self.rows,
                "layers_s_per_param": self.layers_s_per_param,
                "lm_head_s_per_param": self.lm_head_s_per_param}


def weights_of(model: torch.nn.Module) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The decoder layers' 2-D weights (in order) and the lm_head (the embedding when
    tied): what the forward multiplies."""
    layers: list[torch.Tensor] = [p for n, p in model.named_parameters()
                                  if p.ndim == 2 and n.startswith("layers.")]
    head = getattr(model, "lm_head", None)
    if head is None:
        head = getattr(model, "embed", None)
    if not layers or not isinstance(head, torch.Tensor):
        raise ValueError("profile: the model has no decoder-layer weights or no lm_head")
    return layers, head


def _time(ws: list[torch.Tensor], m: int, repeats: int) -> float:
    xs = {w.shape[1]: torch.randn(m, w.shape[1], dtype=w.dtype) for w in ws}
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for w in ws:
            F.linear(xs[w.shape[1]], w)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.no_grad()
def profile_gemms(model: torch.nn.Module, repeats: int = 3,
                  rows: tuple[int, ...] = ROWS) -> GemmProfile:
    """Time the model's GEMMs at each row count in ``rows`` (median of ``repeats``)."""
    layers, head = weights_of(model)
    n_layers = sum(w.numel() for w in layers)
    lay, lm = [], []
    for m in rows:
        lay.append(_time(layers, m, repeats) / n_layers)
        lm.append(_time([head], m, repeats) / head.numel())
    peak = max(2.0 * m / t for m, t in zip(rows, lay))
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16",
             torch.float16: "fp16"}.get(head.dtype, str(head.dtype))
    return GemmProfile(dtype, list(rows), lay, lm, peak, head.element_size() / lay[0])
