"""A GEMM profile of a loaded model on this machine: seconds per weight parameter at each
row count, for the decoder layers' weights and for the lm_head (Vidur's profiling tables,
for the op class a CPU roofline gets wrong); and what widening a 1-byte cache to float32
costs per element, which on a CPU without fp8 units is software for fp8 (~2.6 ns an
element here, 50x int8's), a compute cost no bandwidth figure shows.

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
    widen_s_per_elem: dict[str, float]  # profile_widen()

    def as_json(self) -> dict[str, object]:
        return {"dtype": self.dtype, "rows": self.rows,
                "layers_s_per_param": self.layers_s_per_param,
                "lm_head_s_per_param": self.lm_head_s_per_param}


def dtype_name(dtype: torch.dtype) -> str:
    """A compute dtype by the specs' names ("fp32", "bf16", "fp16")."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16",
            torch.float16: "fp16"}.get(dtype, str(dtype))


def kv_dtype_of(backend: object) -> str:
    """The widening profile's name for a backend's stored K/V dtype: "int8", "fp8", or ""
    (the compute dtype, or a format of the backend's own)."""
    dt = getattr(backend, "cache_dtype", None)
    return {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}.get(dt, "") \
        if isinstance(dt, torch.dtype) else ""


def profile_widen(repeats: int = 5, layers: int = 30, elems: int = 6400 * 192,
                  device: torch.device | str = "cpu") -> dict[str, float]:
    """Seconds per element of ``stored.float()`` for int8 and fp8, on ``layers`` distinct
    tensors of ``elems`` each (a decode batch's K of one layer; each repeat converts every
    layer's once, so they come from memory) holding values as the quantizer writes them
    (widening zeros takes a fast path)."""
    from harness.kernels.reference import quantize_ref

    out = {}
    for name, dt in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
        xs = [quantize_ref(torch.randn(elems // 64, 64, device=device), dt)[0]
              for _ in range(layers)]
        times = []
        for _ in range(repeats):
            _sync(xs[0])
            t = time.perf_counter()
            for x in xs:
                x.float()
            _sync(xs[0])
            times.append(time.perf_counter() - t)
        out[name] = statistics.median(times) / (layers * elems)
    return out


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


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:  # kernels run asynchronously: time them to their end
        torch.cuda.synchronize(t.device)


def _time(ws: list[torch.Tensor], m: int, repeats: int) -> float:
    xs = {w.shape[1]: torch.randn(m, w.shape[1], dtype=w.dtype, device=w.device) for w in ws}
    for w in ws[:2]:  # warm the kernels this row count selects
        F.linear(xs[w.shape[1]], w)
    times = []
    for _ in range(repeats):
        _sync(ws[0])
        t = time.perf_counter()
        for w in ws:
            F.linear(xs[w.shape[1]], w)
        _sync(ws[0])
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
    dtype = dtype_name(head.dtype)
    return GemmProfile(dtype, list(rows), lay, lm, peak, head.element_size() / lay[0],
                       profile_widen(repeats, device=head.device))
