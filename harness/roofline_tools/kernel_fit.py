"""Fit a GPU spec's kernel constants to Vidur's profiled kernel times.

    python -m harness.roofline_tools.kernel_fit [--gpu h100|a100] [--fp8] [--moe] [--b200]

The tables (harness/roofline_tools/data/vidur, from microsoft/vidur) time each decoder layer's
GEMMs and other kernels per tensor-parallel rank at 1..8192 tokens, and NCCL all-reduces
by size. Three models come out of them, each a few constants of ``HardwareSpec``:

- **GEMM** (per weight matrix of P parameters per rank, T tokens, bf16):
  ``t = (c^p + m^p)^(1/p) + t0`` with ``c = 2 P T / (peak eff_gemm)`` and
  ``m = 2 P / (bw eff_bw)``: a roofline whose corner is rounded (``p``: a GEMM near the
  ridge is neither purely compute- nor memory-bound, where max(c, m) is 10-45% too fast),
  plus a fixed cost per GEMM kernel (``t0``: why small matrices, at TP8, stream their
  weights at a lower share of the bandwidth). Fitted on every (model, tp, tokens) row by
  least squares on log time.
- **Non-GEMM work** (two RMSNorms, RoPE, SiLU-and-mul, residual adds, per layer):
  ``t = k t_k + T B_tok / (bw eff_elem)``, ``k`` kernels of ``t_k`` each and
  ``B_tok`` bytes moved per token (module :func:`nongemm_bytes_per_token`).
- **All-reduce** (``tp`` ranks, ``n`` bytes): ``t = lat(tp) + 2 (tp - 1) / tp n / bw_bus``,
  ``lat`` the median of messages up to 1 MiB (they take the same time whatever their size),
  ``bw_bus`` from messages of 8-64 MiB.
- **FP8 GEMMs on Hopper** (``--fp8``), two kinds, as the scales are laid out:
  per-tensor / per-row scales (Llama-class FP8 checkpoints; TensorRT-LLM's and vLLM's
  FP8 GEMMs): the bf16 share times FP8's speed over bf16's measured on one H100 in one
  run (harness/roofline_tools/data/fbgemm: FBGEMM's row-wise kernels, median 1.92x) over
  the peaks' ratio; block-wise scales (DeepSeek-V3's 128x128 format): the same GEMM model
  on fp8 bytes (weights and activations 1 B, bf16 output) at the fp8 peak, the bf16 fit's
  bandwidth share, corner and kernel cost kept, its share of the fp8 peak fitted to
  DeepSeek's published H800 table (harness/roofline_tools/data/deepgemm: the CUTLASS 3.6
  baseline's times; H800 = H100 SXM's compute and HBM3), checked against FBGEMM's
  block-wise ratio. Vidur profiles no fp8.
- **The B200's GEMMs** (``--b200``): published B200 kernel tables
  (harness/roofline_tools/data/vllm_b200: vLLM's GEMM benchmarks at Llama-3.1-8B's
  layer shapes, 1-16384 tokens, torch bf16 / CUTLASS fp8 / CUTLASS NVFP4; FlashInfer's
  and SGLang's CUTLASS NVFP4 at 1-18144 tokens) fitted by the same rules at the b200
  spec's datasheet peaks: the bf16 rows give the GEMM model's four constants, the fp8
  and fp4 rows each the share of their peak (fp4: the current kernels' rows; vLLM's
  untuned one apart, reported). No B200 table
  times the non-GEMM kernels or the all-reduce: those stay the H100's (a prior).
- **MoE expert GEMMs on Hopper and the A100** (``--moe``): published fused-MoE kernel
  tables (harness/roofline_tools/data/moe: vLLM's and SGLang's Triton ``fused_experts``
  at 1-4096 tokens on Mixtral-, Qwen3-, Moonlight- and DeepSeek-R1-shaped layers) and DeepGEMM's
  grouped GEMMs (data/deepgemm/grouped_gemm_h800.csv, the CUTLASS baseline), by kernel
  kind (bf16, per-tensor fp8, block-wise fp8): ``t = t0 + roof / f(m)``, ``roof`` the
  expert GEMMs' roofline at the card's datasheet peaks (each expert over its binomial
  token count, harness.roofline.steptime.moe_roof_s), ``t0`` the fused kernel's floor
  per layer, ``f`` the share reached per bucket of the mean tokens per busy expert
  ``m``. Grouped kernels at small ``m`` reach far less than a dense GEMM's share of the
  compute peak (0.5 at 256+ tokens an expert in bf16, where dense GEMMs reach 0.7).
"""

from __future__ import annotations

import argparse
import csv
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harness.roofline.arch import nongemm_bytes
from harness.roofline.config import WEIGHT_BYTES
from harness.roofline.hardware import A100_KERNELS, H100_KERNELS, get_hardware
from harness.roofline.steptime import expert_load, mean_busy_tokens, moe_roof_s, moe_share

DATA = Path(__file__).resolve().parent / "data" / "vidur"
FP8_TABLE = DATA.parent / "deepgemm" / "fp8_gemm_h800.csv"
FP8_RATIOS = DATA.parent / "fbgemm" / "fp8_vs_bf16_h100.csv"
PEAK_FP8_H100 = 1979e12
MOE_TABLE = DATA.parent / "moe" / "fused_moe_kernels.csv"
GROUPED_TABLE = DATA.parent / "deepgemm" / "grouped_gemm_h800.csv"
# Published B200 GEMM tables (vLLM's kernel benchmarks; data/vllm_b200/README.md) and
# the bytes a value of each low-precision kind's operands take (NVFP4: 4 bits and an
# fp8 scale per 16 values), as the step model counts them.
B200_TABLE = DATA.parent / "vllm_b200" / "gemm_b200.csv"
B200_ELEM_BYTES = {"fp8": WEIGHT_BYTES["fp8"], "fp4": WEIGHT_BYTES["nvfp4"]}
# The specs (datasheet peaks and HBM bandwidth) of the cards the MoE tables ran on (the
# H800 is the H100 SXM's compute and HBM3).
MOE_CARDS = {"h100": "h100-sxm", "h800": "h100-sxm", "h200": "h200", "a100": "a100-80gb"}
# The kernels differ by architecture (Hopper's WGMMA / TMA tiles vs Ampere's): a profile
# per family, from that family's cards' rows.
MOE_FAMILY = {"h100": "hopper", "h800": "hopper", "h200": "hopper", "a100": "ampere"}
# The most of the roofline a share may be: the family's dense GEMMs' bandwidth share (the
# Vidur fit's eff_bw, H100_KERNELS / A100_KERNELS): no MoE kernel streams its weights
# faster than a dense GEMM. Without it a one-shape table (the A100's) trades its floor
# t0 against shares near 1.
MOE_MAX_SHARE = {"hopper": H100_KERNELS["eff_bw"], "ampere": A100_KERNELS["eff_bw"]}
MOE_WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0, "fp8_block": 1.0}
# Lower edges of the buckets of tokens per busy expert (mean_busy_tokens): one token
# each (decode at small batch), a few, tens, and the compute-bound hundreds and more.
MOE_BUCKETS = (1.0, 2.0, 4.0, 16.0, 64.0, 256.0)
PEAK_BF16 = {"h100": 989e12, "a100": 312e12}
MEM_BW = {"h100": 3.35e12, "a100": 2.039e12}
NETDEV = {"h100": "h100_dgx", "a100": "a100_dgx"}
# (hidden, intermediate, heads, kv_heads, head_dim) of the profiled models.
SHAPES = {"llama2_70b": (8192, 28672, 64, 8, 128), "llama2_7b": (4096, 11008, 32, 32, 128),
          "llama3_8b": (4096, 14336, 32, 8, 128)}
MODELS = {"h100": ("llama2_70b", "llama2_7b"),
          "a100": ("llama2_70b", "llama2_7b", "llama3_8b")}
NONGEMM_KERNELS = 5  # input norm, RoPE, post-attention norm, SiLU-and-mul, residual add
P_GRID = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class KernelFit:
    """A GPU's fitted kernel constants (seconds, shares of the peaks) and their errors."""

    gpu: str
    eff_gemm: float
    eff_bw: float
    gemm_corner_p: float
    gemm_kernel_s: float
    nongemm_kernel_s: float
    eff_elem: float
    allreduce_latency_s: dict[str, float]
    allreduce_bus_bw: float
    gemm_median_err_pct: float
    gemm_worst_err_pct: float
    nongemm_median_err_pct: float
    rows: int


def _read(name: str) -> list[dict[str, str]]:
    with open(DATA / f"{name}.csv", newline="") as f:
        return list(csv.DictReader(f))


def gemm_params(model: str) -> list[float]:
    """Parameters per layer of each of the four GEMMs (QKV, O, gate+up, down), at TP1."""
    h, ffn, heads, kv, d = SHAPES[model]
    return [h * (heads + 2 * kv) * d, heads * d * h, 2 * h * ffn, ffn * h]


def nongemm_bytes_per_token(model: str, tp: int) -> float:
    """Bytes the layer's non-GEMM kernels move per token on one rank, bf16
    (harness.roofline.arch.nongemm_bytes: the step model's own count)."""
    h, ffn, heads, kv, d = SHAPES[model]
    return nongemm_bytes(h, ffn, heads, kv, d, tp, 2.0)


def _gemm_rows(gpu: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(params per GEMM per rank, tokens, seconds), one row per GEMM per table row."""
    ps, ts, secs = [], [], []
    for model in MODELS[gpu]:
        cols = ("attn_pre_proj_us", "attn_post_proj_us", "mlp_up_proj_us", "mlp_down_proj_us")
        for r in _read(f"gemm_{gpu}_{model}"):
            tp, n = int(r["tp"]), int(r["num_tokens"])
            for p, c in zip(gemm_params(model), cols):
                ps.append(p / tp)
                ts.append(n)
                secs.append(float(r[c]) * 1e-6)
    return np.array(ps), np.array(ts, dtype=np.float64), np.array(secs)


def gemm_time(params: np.ndarray | float, tokens: np.ndarray | float, peak: float, bw: float,
              eff_gemm: float, eff_bw: float, p: float, t0: float) -> np.ndarray | float:
    """Seconds of one bf16 GEMM (the module docstring's formula)."""
    c = 2.0 * params * tokens / (peak * eff_gemm)
    m = 2.0 * params / (bw * eff_bw)
    return (c ** p + m ** p) ** (1.0 / p) + t0


def fit_gemm(gpu: str) -> tuple[float, float, float, float, np.ndarray]:
    """The bf16 GEMM constants of Vidur's ``gpu`` tables (:func:`fit_gemm_rows`)."""
    P, T, y = _gemm_rows(gpu)
    return fit_gemm_rows(P, T, y, PEAK_BF16[gpu], MEM_BW[gpu])


def fit_gemm_rows(P: np.ndarray, T: np.ndarray, y: np.ndarray, peak: float,
                  bw: float) -> tuple[float, float, float, float, np.ndarray]:
    """Grid search over (eff_gemm, eff_bw, p, t0) of bf16 GEMMs of ``P`` parameters at
    ``T`` tokens taking ``y`` seconds on a card of ``peak`` FLOP/s and ``bw`` bytes/s,
    minimizing the squared log error; returns the constants and each row's relative
    error."""
    best: tuple[float, float, float, float, float] | None = None
    for p in P_GRID:
        for eg in np.arange(0.40, 1.001, 0.01):
            for eb in np.arange(0.50, 1.001, 0.01):
                base = gemm_time(P, T, peak, bw, eg, eb, p, 0.0)
                # t0 on its own grid (the per-kernel cost: microseconds).
                for t0 in (0.0, 1e-6, 2e-6, 3e-6, 4e-6, 5e-6, 6e-6, 8e-6, 10e-6):
                    err = float(np.mean(np.log((base + t0) / y) ** 2))
                    if best is None or err < best[0]:
                        best = (err, float(eg), float(eb), p, t0)
    assert best is not None
    _, eg, eb, p, t0 = best
    rel = gemm_time(P, T, peak, bw, eg, eb, p, t0) / y - 1.0
    return eg, eb, p, t0, np.asarray(rel)


def fp8_rows() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(M, N, K, seconds) of the FP8 table's GEMMs, timed as its CUTLASS baseline ran them
    (DeepGEMM's TFLOP/s over its speedup)."""
    with open(FP8_TABLE, newline="") as f:
        rows = list(csv.DictReader(f))
    m, n, k = (np.array([float(r[c]) for r in rows]) for c in ("m", "n", "k"))
    tflops = np.array([float(r["deepgemm_tflops"]) / float(r["speedup_vs_cutlass"])
                       for r in rows])
    return m, n, k, 2.0 * m * n * k / (tflops * 1e12)


def fit_fp8(eff_bw: float, p: float, t0: float) -> tuple[float, np.ndarray]:
    """The share of the fp8 peak that fits the FP8 table best (:func:`fit_share`), with
    the bf16 fit's ``eff_bw``, ``p`` and ``t0``; and each row's relative error."""
    m, n, k, y = fp8_rows()
    return fit_share(m, n, k, y, 1.0, PEAK_FP8_H100, MEM_BW["h100"], eff_bw, p, t0)


def fit_share(m: np.ndarray, n: np.ndarray, k: np.ndarray, y: np.ndarray,
              elem_bytes: float, peak: float, bw: float, eff_bw: float, p: float,
              t0: float) -> tuple[float, np.ndarray]:
    """The share of ``peak`` (a low-precision dtype's FLOP/s) that fits GEMMs of M x N x
    K taking ``y`` seconds best (squared log error, on a 0.01 grid), their operands of
    ``elem_bytes`` a value (scales included) and a bf16 output, with a bf16 fit's
    ``eff_bw``, ``p`` and ``t0``; and each row's relative error."""
    flops = 2.0 * m * n * k
    nbytes = elem_bytes * (n * k + m * k) + 2.0 * m * n

    def model(eff: float) -> np.ndarray:
        c, mem = flops / (peak * eff), nbytes / (bw * eff_bw)
        return np.asarray((c ** p + mem ** p) ** (1.0 / p) + t0)

    grid = np.arange(0.20, 1.0001, 0.01)
    errs = [float(np.mean(np.log(model(e) / y) ** 2)) for e in grid]
    eff = round(float(grid[int(np.argmin(errs))]), 2)
    return eff, model(eff) / y - 1.0


def fp8_speedups() -> tuple[float, float]:
    """The median speed of FP8 GEMMs over bf16 ones on one H100 in one run: row-wise
    scales, block-wise scales (the FBGEMM table)."""
    with open(FP8_RATIOS, newline="") as f:
        rows = list(csv.DictReader(f))
    row = [float(r["fp8_rowwise_tflops"]) / float(r["bf16_tflops"]) for r in rows]
    block = [float(r["fp8_blockwise_tflops"]) / float(r["bf16_tflops"]) for r in rows]
    return float(np.median(row)), float(np.median(block))


def fp8_shares(eff_bf16: float, eff_bw: float, p: float, t0: float) -> dict[str, float]:
    """The Hopper specs' fp8 GEMM shares (``HardwareSpec.eff_gemm_dtype``): ``fp8``
    (per-tensor / per-row scales) from the measured speedup, ``fp8_block`` fitted to the
    FP8 table; and ``fp8_block_check``, the block-wise share the speedup gives."""
    row, block = fp8_speedups()
    ratio = PEAK_FP8_H100 / PEAK_BF16["h100"]
    fitted, _ = fit_fp8(eff_bw, p, t0)
    return {"fp8": round(eff_bf16 * row / ratio, 2), "fp8_block": fitted,
            "fp8_block_check": round(eff_bf16 * block / ratio, 2)}


def device_shares(rows: list[dict[str, Any]], peaks: dict[str, float],
                  min_rows: int = 1024) -> dict[str, float | None]:
    """The GEMM shares a GPU check's profile gives (harness.gpucheck.gemm_profile rows):
    per dtype, the median over shapes of the achieved FLOP/s at ``min_rows`` rows or more
    over that dtype's peak (``peaks``: FLOP/s by dtype); None where none was timed."""
    out: dict[str, float | None] = {}
    for dtype, peak in peaks.items():
        got = [r["tflops"] * 1e12 / peak for r in rows
               if r.get("dtype") == dtype and r.get("tflops") and r["m"] >= min_rows]
        out[dtype] = round(float(np.median(got)), 3) if got else None
    return out


# The NVFP4 table timed before vLLM tuned its kernel for SM100 (#20646 shows it as
# "Before"): fitted and reported apart (B200_FP4_UNTUNED), not the share engines reach.
FP4_UNTUNED_SOURCES = ("vllm-20578",)


def b200_rows(kind: str, untuned: bool | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(M, N, K, seconds) of the B200 table's GEMMs of ``kind`` (bf16: torch's, fp8:
    vLLM's CUTLASS per-channel / per-token, fp4: NVFP4 GEMMs; each without the
    activations' quantization), timed as TFLOP/s at that shape. ``untuned`` (fp4): True,
    only the rows of :data:`FP4_UNTUNED_SOURCES`; False, only the others; None, all."""
    if untuned is not None and kind != "fp4":
        raise ValueError(f"b200_rows: untuned= splits the fp4 rows only (got kind {kind!r})")
    with open(B200_TABLE, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["kind"] == kind
                and (untuned is None or (r["source"] in FP4_UNTUNED_SOURCES) == untuned)]
    m, n, k = (np.array([float(r[c]) for r in rows]) for c in ("m", "n", "k"))
    tflops = np.array([float(r["tflops"]) for r in rows])
    return m, n, k, 2.0 * m * n * k / (tflops * 1e12)


def _errs(rel: np.ndarray) -> dict[str, Any]:
    """A fit's median and worst absolute error (%) and its row count, from each row's
    relative error ``rel``."""
    a = np.abs(rel) * 100
    return {"median_err_pct": round(float(np.median(a)), 1),
            "worst_err_pct": round(float(np.max(a)), 1), "rows": len(rel)}


def fit_b200() -> dict[str, Any]:
    """The B200's GEMM constants from published B200 kernel tables (harness/roofline_tools/
    data/vllm_b200), by the H100's rules at the b200 spec's datasheet peaks and HBM
    bandwidth: the bf16 rows give eff_gemm, eff_bw, the corner p and the kernel cost t0
    (:func:`fit_gemm_rows`, on the weights' bytes as Vidur's rows are read); fp8 and
    fp4 rows each the share of their own peak with those kept (:func:`fit_share`, on all
    operand bytes as DeepGEMM's rows are read). Returns the constants, the
    ``eff_gemm_dtype`` shares, and each kind's errors (:func:`_errs`, with each row's)."""
    h = get_hardware("b200")
    m, n, k, y = b200_rows("bf16")
    eg, eb, p, t0, rel = fit_gemm_rows(n * k, m, y, h.flops("bf16"), h.mem_bw)
    out: dict[str, Any] = {"eff_gemm": round(eg, 3), "eff_bw": round(eb, 3),
                           "gemm_corner_p": p, "gemm_kernel_s": t0, "eff_gemm_dtype": {},
                           "errors": {"bf16": _row_errs(rel)}}
    for kind, elem in B200_ELEM_BYTES.items():
        m, n, k, y = b200_rows(kind, False if kind == "fp4" else None)
        eff, rel = fit_share(m, n, k, y, elem, h.flops(kind), h.mem_bw, eb, p, t0)
        out["eff_gemm_dtype"][kind] = eff
        out["errors"][kind] = _row_errs(rel)
    m, n, k, y = b200_rows("fp4", True)
    eff, rel = fit_share(m, n, k, y, B200_ELEM_BYTES["fp4"], h.flops("fp4"), h.mem_bw, eb,
                         p, t0)
    out["fp4_untuned"] = {"eff": eff, "errors": _row_errs(rel)}
    return out


def _row_errs(rel: np.ndarray) -> dict[str, Any]:
    """:func:`_errs` and each row's error (%)."""
    return {**_errs(rel), "rel_pct": [round(float(r) * 100, 1) for r in rel]}


@dataclass(frozen=True)
class MoeRow:
    """One timed MoE kernel: its roofline at the card's datasheet peaks (seconds), its
    tokens per busy expert, and what it took (seconds)."""

    kind: str  # bf16 | fp8 (per-tensor) | fp8_block (128x128 scales)
    family: str  # hopper | ampere (MOE_FAMILY)
    source: str
    roof_s: float
    m_mean: float
    time_s: float
    # Whether the time holds the whole fused MoE (sorting, activation, the two GEMMs: t0
    # applies) or one grouped GEMM kernel alone (DeepGEMM's table: only the share).
    fused: bool = True


def _card(gpu: str) -> tuple[float, float, float]:
    """Dense bf16 and fp8 FLOP/s and HBM bytes/s of a MoE table's card, from its spec."""
    h = get_hardware(MOE_CARDS[gpu])
    return h.flops("bf16"), h.flops("fp8"), h.mem_bw


def moe_rows() -> list[MoeRow]:
    """Every row of the MoE tables: the fused-MoE kernels (vLLM's / SGLang's Triton
    ``fused_experts``, both expert GEMMs of a layer at ``tokens`` tokens routed
    uniformly: their benchmarks draw random gating) and DeepGEMM's grouped GEMMs (one
    GEMM of ``groups`` experts of ``m_per_group`` tokens each; the CUTLASS baseline's
    time, as the dense fp8 fit reads that table)."""
    out = []
    with open(MOE_TABLE, newline="") as f:
        for r in csv.DictReader(f):
            bf16, fp8, bw = _card(r["gpu"])
            e, k, n = int(r["experts"]), int(r["topk"]), int(r["tokens"])
            params = 3.0 * int(r["hidden"]) * int(r["inter"]) / int(r["tp"])
            counts, prob = expert_load(n, e, k)
            roof = moe_roof_s(counts, prob, e, params, MOE_WEIGHT_BYTES[r["kind"]],
                              bf16 if r["kind"] == "bf16" else fp8, bw)
            out.append(MoeRow(r["kind"], MOE_FAMILY[r["gpu"]], r["source"], roof,
                              mean_busy_tokens(n, e, k), float(r["time_us"]) * 1e-6))
    _, fp8, bw = _card("h800")
    with open(GROUPED_TABLE, newline="") as f:
        for r in csv.DictReader(f):
            g, m = int(r["groups"]), int(r["m_per_group"])
            params = float(r["n"]) * float(r["k"])
            flops = 2.0 * g * m * params
            tflops = float(r["deepgemm_tflops"]) / float(r["speedup_vs_cutlass"])
            roof = g * max(2.0 * params * m / fp8, params / bw)
            out.append(MoeRow("fp8_block", "hopper", f"deepgemm-{r['layout']}", roof,
                              float(m), flops / (tflops * 1e12), fused=False))
    return out


def _bucket(m_mean: float) -> int:
    """The index of the MoE bucket ``m_mean`` falls in (MOE_BUCKETS' lower edges), by the
    step model's own lookup (steptime.moe_share)."""
    return int(moe_share(m_mean, tuple((lo, float(i)) for i, lo in enumerate(MOE_BUCKETS))))


def fit_moe(family: str = "hopper") -> dict[str, Any]:
    """The MoE kernel profile of a GPU ``family`` by kind (those its tables time): a
    fixed time per MoE layer ``t0`` (routing, sorting, activation quantization and the
    activation between the two GEMMs: the fused kernel's floor) and, per bucket of
    tokens per busy expert, the share ``f`` of the datasheet roofline the expert GEMMs
    reach, ``t = t0 + roof / f`` (a grouped GEMM timed alone: ``roof / f``); fitted on
    each kind's rows by least squares on log time (t0 on a 0.5 us grid to 100 us, f on
    a 0.01 grid to MOE_MAX_SHARE). A bucket
    without rows of its kind takes its kind's nearest bucket's share (the lower on a
    tie): the tables leave that gap, and another kind's kernel (the per-tensor FP8 rows
    are untuned default configs at large M) is no better a stand-in. Returns {kind:
    {"t0_s", "buckets": [[edge, f], ..], "filled": [edges borrowed], "median_err_pct",
    "worst_err_pct", "rows"}}."""
    rows = [r for r in moe_rows() if r.family == family]
    fs = np.round(np.arange(0.02, MOE_MAX_SHARE[family] + 1e-4, 0.01), 2)
    own: dict[str, tuple[float, dict[int, float], np.ndarray]] = {}
    for kind in sorted({r.kind for r in rows}):
        rk = [r for r in rows if r.kind == kind]
        roof = np.array([r.roof_s for r in rk])
        y = np.array([r.time_s for r in rk])
        b = np.array([_bucket(r.m_mean) for r in rk])
        fused = np.array([1.0 if r.fused else 0.0 for r in rk])  # which rows pay t0
        best: tuple[float, float, dict[int, float]] | None = None
        for t0 in np.arange(0.0, 100.01e-6, 0.5e-6):
            shares, err = {}, 0.0
            for i in sorted(set(b.tolist())):
                sel = b == i
                e = [float(np.sum(np.log((t0 * fused[sel] + roof[sel] / f) / y[sel]) ** 2))
                     for f in fs]
                j = int(np.argmin(e))
                shares[i], err = float(fs[j]), err + e[j]
            if best is None or err < best[0]:
                best = (err, round(float(t0), 7), shares)
        assert best is not None
        _, t0, shares = best
        model = t0 * fused + roof / np.array([shares[i] for i in b])
        own[kind] = (t0, shares, model / y - 1.0)
    out: dict[str, Any] = {}
    for kind, (t0, shares, rel) in own.items():
        buckets, filled = [], []
        for i, lo in enumerate(MOE_BUCKETS):
            f = shares.get(i)
            if f is None:  # no row of this kind here: its nearest bucket's share
                f = shares[min(shares, key=lambda j: (abs(j - i), j))]
                filled.append(lo)
            buckets.append([lo, f])
        out[kind] = {"t0_s": t0, "buckets": buckets, "filled": filled, **_errs(rel)}
    return out


def fit_nongemm(gpu: str) -> tuple[float, float, np.ndarray]:
    """Linear least squares (relative) of t = k t_k + T B_tok / (bw eff_elem)."""
    rows, ys = [], []
    for model in MODELS[gpu]:
        for r in _read(f"nongemm_{gpu}_{model}"):
            tp, n = int(r["tp"]), int(r["num_tokens"])
            # Vidur times one residual add; a layer does two.
            t = (float(r["nongemm_sum_us"]) + float(r["add_us"])) * 1e-6
            rows.append([NONGEMM_KERNELS + 1, n * nongemm_bytes_per_token(model, tp)])
            ys.append(t)
    A, y = np.array(rows, dtype=np.float64), np.array(ys)
    w = 1.0 / y
    coef, *_ = np.linalg.lstsq(A * w[:, None], np.ones_like(y), rcond=None)
    t_k, inv_bw = float(coef[0]), float(coef[1])
    rel = (A @ coef) / y - 1.0
    return t_k, 1.0 / (inv_bw * MEM_BW[gpu]), rel


def fit_allreduce(gpu: str) -> tuple[dict[str, float], float]:
    by: dict[int, list[tuple[int, float]]] = {}
    for r in _read(f"allreduce_{NETDEV[gpu]}"):
        by.setdefault(int(r["num_workers"]), []).append((int(r["size_bytes"]),
                                                         float(r["median_us"]) * 1e-6))
    lat, bus = {}, []
    for tp, pts in sorted(by.items()):
        small = [t for n, t in pts if n <= 2**20]
        lat[str(tp)] = float(np.median(small))
        big = np.array([(n, t) for n, t in pts if 8 * 2**20 <= n <= 64 * 2**20])
        if len(big) > 2:
            slope = np.polyfit(big[:, 0] * 2 * (tp - 1) / tp, big[:, 1], 1)[0]
            bus.append(1.0 / slope)
    return lat, float(np.median(bus))


def fit(gpu: str) -> KernelFit:
    eg, eb, p, t0, rel = fit_gemm(gpu)
    t_k, e_el, nrel = fit_nongemm(gpu)
    lat, bus = fit_allreduce(gpu)
    a, na = np.abs(rel) * 100, np.abs(nrel) * 100
    return KernelFit(gpu, round(eg, 3), round(eb, 3), p, t0, round(t_k, 9), round(e_el, 3),
                     {k: round(v, 7) for k, v in lat.items()}, round(bus, -9),
                     round(float(np.median(a)), 1), round(float(np.max(a)), 1),
                     round(float(np.median(na)), 1), len(rel))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="h100,a100")
    ap.add_argument("--fp8", action="store_true",
                    help="fit the fp8 GEMM shares (Hopper) to the FP8 tables instead")
    ap.add_argument("--moe", action="store_true",
                    help="fit the MoE expert GEMMs' kernel profile (Hopper) to the MoE "
                         "tables instead")
    ap.add_argument("--b200", action="store_true",
                    help="fit the B200's GEMM constants and fp8 / fp4 shares to the "
                         "published B200 tables instead")
    ap.add_argument("--gpu-check", metavar="DIR",
                    help="the GEMM shares a GPU check's kernel-bandwidth.json measured "
                         "(DIR: its output folder), against the h200 spec's peaks")
    args = ap.parse_args(argv)
    if args.gpu_check:
        report = json.loads((Path(args.gpu_check) / "kernel-bandwidth.json").read_text())
        h = get_hardware("h200")
        print(json.dumps(device_shares(report.get("gemm_profile", []),
                                       {d: h.flops(d) for d in ("bf16", "fp8")})))
        return
    if args.b200:
        print(json.dumps(fit_b200(), indent=1))
        return
    if args.moe:
        print(json.dumps({f: fit_moe(f) for f in ("hopper", "ampere")}, indent=1))
        return
    if args.fp8:
        eg, eb, p, t0, _ = fit_gemm("h100")
        _, rel = fit_fp8(eb, p, t0)
        print(json.dumps({**fp8_shares(eg, eb, p, t0),
                          **{f"fp8_block_{k}": v for k, v in _errs(rel).items()}}))
        return
    for g in args.gpu.split(","):
        print(json.dumps(asdict(fit(g)), indent=1))


if __name__ == "__main__":
    main()
