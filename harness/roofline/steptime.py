"""The step-time model: what one engine step costs on a hardware spec.

Per tensor-parallel rank, with T the step's tokens, S the rows that sample, P the active
linear parameters (MoE: shared path + k/E of the routed experts), b_w the weight bytes per
parameter, b_kv the backend's bytes per cached token (all layers: a 1-byte cache halves
them), L layers, H query heads, d_qk / d_v the attention product's per-head dims, tp the
tensor-parallel degree, and each term a roofline, max(FLOPs / (peak x eff), bytes /
(bandwidth x eff)), on a GPU (``overlap=1``; where compute and memory traffic overlap
less the terms are max + (1 - overlap) x min: one CPU core, ``overlap=0``, adds them):

    gemm     = max(2 P T / tp / (peak eff_gemm),  b_w (P_dense + E_touched(T)) / tp / (bw eff_bw))
    lm_head  = max(2 V h S / tp / (peak eff_gemm), b_w V h / tp / (bw eff_bw))
    prefill  = max(2 H (d_qk + d_v) L pairs / tp / (peak eff_attn),
                   b_kv ctx_prefill / tp_kv / (bw eff_bw))
    decode   = max(2 H (d_qk + d_v) L ctx_decode / tp / (peak eff_attn),
                   b_kv ctx_decode / tp_kv / (bw eff_bw))
    allreduce = 2 L (2 (tp - 1) / tp x T h b_act / link_bw + latency)  (tp > 1)
    nongemm  = L (6 t_kernel + T B_tok / (bw eff_elem))
    engine   = [fresh] (schedule_s + schedule_per_seq_s x seqs)
               + step_s + step_per_seq_s x seqs
    step     = gemm + lm_head + prefill + decode + allreduce + nongemm + engine

On a spec fitted to profiled kernels (harness.roofline_tools.kernel_fit: the GPU specs) the GEMM
rooflines' corner is rounded and each GEMM kernel has a fixed cost: with c and m the
compute and memory sides above, ``gemm = (c^p + m^p)^(1/p) + (4 L + 1) t_gemm`` (``p =
gemm_corner_p``; 0 keeps max(c, m)), so a step near the ridge (~256 tokens) is neither
side alone and small TP8 matrices stream below the bandwidth share. ``nongemm`` is the
two RMSNorms, RoPE, SiLU-and-mul and two residual adds of each layer: six kernels of
``nongemm_kernel_s`` and ``B_tok`` bytes a token (ArchSpec.nongemm_bytes_per_token).
``latency`` is a small message's all-reduce time: the engine profile's
``allreduce_latency_s`` where it has one (the custom one-shot all-reduce kernels vLLM and
TensorRT-LLM use on NVLink below a few MB, fitted), else the spec's NCCL figure at that
degree (Vidur's tables: 30-45 us on H100 NVLink). ``engine`` is the serving engine's CPU
time (harness.roofline.engines): a scheduling decision on each step scheduled anew
(``StepRecord.fresh``; multi-step scheduling makes the others not fresh), and per-step
work (launch, sampling, output processing); without a profile, the spec's
``step_overhead_s + per_seq_overhead_s x seqs``.
GEMMs run at ``gemm_dtype``'s peak (``roofline.compute_dtype=fp8``: W8A8 on the fp8 units).

``pairs`` are the (query, key) pairs of the step's prefill chunks (a chunk of n tokens
after s cached ones: n s + n (n + 1) / 2, a window bounding each query's keys);
``ctx_prefill`` the keys those chunks read (s + n each); ``ctx_decode`` the keys the
decodes read. What a fused kernel's K/V bytes are (``b_kv ctx`` above) is the backend's
declaration (harness.backends.costs: a window's keys, a budget's held tokens, quest's
chosen blocks plus every block's bounds, 1-byte values with their scales and sinks).
``tp_kv`` is tp for caches split by KV head, 1 for MLA's latent, which every rank holds.
``E_touched(T)`` is the expected share of routed experts T tokens read.

The H100 in numbers: 989 TFLOP/s bf16 and 3.35 TB/s give a ridge of ~295 FLOP/byte. A
bf16 weight GEMM does 2 T FLOPs per 2 bytes of weight, T FLOP/byte: memory-bound below
~295 x eff_bw / eff_gemm tokens per step (~340 with the priors), compute-bound above.
Decode attention does 2 H (2 d) FLOPs per 2 KV d x 2 bytes: H / KV FLOP/byte, the GQA
group size (8 for Llama-3.1-70B), always memory-bound: its time is the KV bytes read.

Two refinements a spec may switch on (the calibrated ``cpu`` spec uses both):

- a **GEMM profile** (``HardwareSpec.gemm_profile``, measured): the GEMM and lm_head
  terms become ``P_dense x tau_layers(T) / eff_profile`` and ``V h x tau_lm(S) /
  eff_profile``, tau the measured seconds per weight parameter at that row count
  (linear between measured counts, proportional to the rows past the last);
- **gather attention** (``HardwareSpec.attention="gather"``, the torch reference path):
  a decode batch is copied padded to its widest table (``gather_decode`` keys) and a
  prefill chunk computes all n (s + n) pairs under its mask (``pairs_full``); each
  gathered key moves its stored bytes twice (read, write the copy) and the attention
  reads the copy in the compute dtype; a quantized cache's copy is also widened to the
  compute dtype and scaled (its stored bytes once more, the compute-dtype bytes three
  times more) before the attention reads it; and the widening's compute, where the spec
  has measured it (``widen_s_per_elem``: fp8 is software on a CPU), per element:

      b_gather = 2 b_kv + b_c (+ b_kv + 3 b_c quantized),  b_c = b_kv at compute precision
      widen    = keys x L x 2 KV d x s_widen(stored dtype)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.roofline.arch import ArchSpec
from harness.roofline.engines import EngineProfile
from harness.roofline.hardware import HardwareSpec
from harness.roofline.shape import StepShape


@dataclass(slots=True)
class StepWork:
    """A step's FLOPs and bytes per rank, before any hardware efficiency is applied.
    Fields may be floats or numpy arrays (one entry per step, for calibration)."""

    gemm_flops: float
    gemm_bytes: float
    lm_flops: float
    lm_bytes: float
    pre_flops: float
    pre_bytes: float
    dec_flops: float
    dec_bytes: float
    ar_seconds: float  # the all-reduces' time (link-bound, no efficiency)
    seqs: float
    tokens: float = 0.0  # the GEMMs' rows (a profile's lookup)
    rows: float = 0.0  # the lm_head's rows
    pre_widen_s: float = 0.0  # measured widening of a 1-byte cache (gather path)
    dec_widen_s: float = 0.0
    nongemm_bytes: float = 0.0  # the layers' non-GEMM kernels' bytes
    fresh: float = 1.0  # 1 when the step was scheduled anew (multi-step: the first)


@dataclass(slots=True)
class StepTime:
    """Seconds per term; ``total`` is the step."""

    gemm: float
    lm_head: float
    prefill_attn: float
    decode_attn: float
    allreduce: float
    overhead: float
    nongemm: float = 0.0

    @property
    def forward(self) -> float:
        return (self.gemm + self.lm_head + self.prefill_attn + self.decode_attn
                + self.allreduce + self.nongemm)

    @property
    def total(self) -> float:
        return self.forward + self.overhead


class StepModel:
    """Turns a step's shape into :class:`StepWork` and then seconds on ``hw``."""

    def __init__(self, arch: ArchSpec, hw: HardwareSpec, kv_bytes_per_token: int,
                 compute_dtype: str = "bf16", weight_bytes: float = 2.0, tp: int = 1,
                 kv_dtype: str = "", gemm_dtype: str = "",
                 engine: EngineProfile | None = None) -> None:
        """``compute_dtype``: activations and attention; ``gemm_dtype``: the weight GEMMs'
        (default the same; "fp8" for W8A8); ``engine``: the serving engine's CPU time
        (default: the spec's own overheads)."""
        arch.check_tp(tp)
        self.arch, self.hw, self.tp = arch, hw, tp
        self.compute_dtype = compute_dtype
        self.gemm_dtype = gemm_dtype or compute_dtype
        self.peak = hw.flops(compute_dtype)
        self.gemm_peak = hw.flops(self.gemm_dtype)
        self.engine = engine
        # Two all-reduces a layer under tensor parallelism, each paying a small message's
        # latency: the engine's own kernels' where its profile has one (custom one-shot
        # all-reduce, vLLM's and TensorRT-LLM's), else the spec's (NCCL, Vidur's tables).
        self.allreduces = 2 * arch.num_layers if tp > 1 and hw.link_bw > 0 else 0
        self.allreduce_latency = (
            engine.allreduce_latency_s if engine is not None
            and engine.allreduce_latency_s is not None else hw.allreduce_latency(tp))
        self.weight_bytes = weight_bytes
        self.act_bytes = 2.0 if compute_dtype in ("bf16", "fp16", "bfloat16", "float16",
                                                  "fp8") else 4.0
        self.nongemm_per_token = arch.num_layers * arch.nongemm_bytes_per_token(
            tp, self.act_bytes)
        # K/V bytes per token on one rank: split by KV head, a head replicated past tp =
        # kv_heads (MLA's one latent: every rank holds it all).
        self.kv_split = arch.kv_shards(tp)
        self.kv_rank_bytes = kv_bytes_per_token / self.kv_split
        self.attn_flops_per_pair = 2.0 * arch.num_heads * (arch.attn_qk_dim + arch.attn_v_dim) \
            * arch.num_layers / tp
        # Bytes a gathered key moves on the torch path (module docstring), per rank.
        full = arch.num_layers * arch.kv_elems_per_layer * self.act_bytes / self.kv_split
        quantized = self.kv_rank_bytes < full
        self.gather_rank_bytes = 2 * self.kv_rank_bytes + full \
            + ((self.kv_rank_bytes + 3 * full) if quantized else 0.0)
        # kv_dtype: the stored dtype's name (profile.kv_dtype_of), for its widening cost.
        elems = arch.num_layers * arch.kv_elems_per_layer / self.kv_split
        self.widen_s_per_key = elems * hw.widen_s_per_elem.get(kv_dtype, 0.0) \
            if quantized else 0.0
        self._lane_base: dict[int, StepTime] = {}  # lane_time's terms of n alone, by n

    def work_of(self, sh: StepShape, fresh: bool = True) -> StepWork:
        """:meth:`work` of a step's shape (``fresh``: scheduled anew)."""
        w = self.work(sh.tokens, sh.rows, sh.seqs, sh.pairs, sh.ctx_prefill,
                      sh.ctx_decode, sh.pairs_full, sh.gather_decode, sh.pre_bytes,
                      sh.dec_bytes)
        w.fresh = 1.0 if fresh else 0.0
        return w

    def work(self, tokens: int, rows: int, seqs: int, pairs: float, ctx_prefill: float,
             ctx_decode: float, pairs_full: float = 0.0, gather_decode: float = 0.0,
             pre_bytes: float | None = None, dec_bytes: float | None = None) -> StepWork:
        """FLOPs and bytes of a step: ``tokens`` rows through the GEMMs, ``rows`` through
        the lm_head, prefill ``pairs`` (fused) / ``pairs_full`` (gather) over
        ``ctx_prefill`` keys, decodes over ``ctx_decode`` keys (fused) / ``gather_decode``
        (gather); which of each pair counts is the hardware's ``attention``. Fused
        kernels read ``pre_bytes`` / ``dec_bytes`` of cache, the whole model's, as the
        backend declares them (harness.backends.costs: scales, overlays and metadata
        included); without them, the keys at the backend's bytes per slot."""
        a, tp, wb = self.arch, self.tp, self.weight_bytes
        touched = a.expert_params * a.expert_share_touched(tokens) if a.num_experts else 0.0
        vh = a.vocab_size * a.hidden_size
        ar = 0.0
        if self.allreduces:
            nbytes = tokens * a.hidden_size * self.act_bytes
            ar = self.allreduces * (2 * (tp - 1) / tp * nbytes / self.hw.link_bw
                                    + self.allreduce_latency)
        widen = 0.0
        if self.hw.attention == "gather":
            pairs, kvb = pairs_full, self.gather_rank_bytes
            widen = self.widen_s_per_key
            pre_b = kvb * ctx_prefill
        else:
            kvb, split = self.kv_rank_bytes, self.kv_split
            pre_b = kvb * ctx_prefill if pre_bytes is None else pre_bytes / split
        dec_flops, dec_b, dec_widen = self._decode_side(ctx_decode, gather_decode, dec_bytes)
        return StepWork(
            gemm_flops=2.0 * a.active_params * tokens / tp,
            gemm_bytes=wb * (a.dense_params + touched) / tp,
            lm_flops=2.0 * vh * rows / tp, lm_bytes=(wb * vh / tp) if rows else 0.0,
            pre_flops=self.attn_flops_per_pair * pairs,
            pre_bytes=pre_b,
            dec_flops=dec_flops,
            dec_bytes=dec_b,
            ar_seconds=ar, seqs=seqs, tokens=tokens, rows=rows,
            pre_widen_s=widen * ctx_prefill, dec_widen_s=dec_widen,
            nongemm_bytes=self.nongemm_per_token * tokens)

    def _decode_side(self, ctx_decode: Any, gather_decode: Any,
                     dec_bytes: Any) -> tuple[Any, Any, Any]:
        """The decodes' FLOPs, bytes and widening seconds as :meth:`work` counts them (the
        gather path copies ``gather_decode`` keys; fused kernels read ``ctx_decode``, or
        the declared ``dec_bytes``)."""
        if self.hw.attention == "gather":
            return (self.attn_flops_per_pair * gather_decode,
                    self.gather_rank_bytes * gather_decode,
                    self.widen_s_per_key * gather_decode)
        dec_b = self.kv_rank_bytes * ctx_decode if dec_bytes is None \
            else dec_bytes / self.kv_split
        return self.attn_flops_per_pair * ctx_decode, dec_b, 0.0 * ctx_decode

    def lane_time(self, n: int, ctx_decode: float, gather_decode: float,
                  dec_bytes: float) -> StepTime:
        """:meth:`time` of :meth:`work` of a fresh step of ``n`` decodes and nothing else
        (a roofline run's decode-lane steps, harness.roofline.shape.lane_shape), the same
        floats: the terms that depend on ``n`` alone (GEMMs, lm_head, the empty prefill,
        all-reduces, non-GEMM kernels, the engine's time) are made once per ``n``, and
        only the decodes' attention each step."""
        base = self._lane_base.get(n)
        if base is None:
            w = self.work(n, n, n, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
            w.fresh = 1.0
            base = self._lane_base[n] = self.time(w)
        h = self.hw
        decode = _attn_s(*self._decode_side(ctx_decode, gather_decode, dec_bytes),
                         self.peak * h.eff_attn, h.mem_bw * h.eff_bw, 1.0 - h.overlap)
        return StepTime(base.gemm, base.lm_head, base.prefill_attn, decode, base.allreduce,
                        base.overhead, base.nongemm)

    def time(self, w: StepWork, hw: HardwareSpec | None = None) -> StepTime:
        """Seconds of ``w`` on ``hw`` (default: the model's own; calibration passes
        candidates). Works on floats and on numpy arrays alike."""
        h = hw or self.hw
        peak = self.peak if hw is None else hw.flops(self.compute_dtype)
        gpeak = self.gemm_peak if hw is None else hw.flops(self.gemm_dtype)
        fg, fa, bw = gpeak * h.eff_gemm, peak * h.eff_attn, h.mem_bw * h.eff_bw
        lap = 1.0 - h.overlap
        p = h.gemm_corner_p

        def mx(c: Any, m: Any) -> Any:
            return _roof(c, m, lap)

        if h.profiled(self.compute_dtype):
            a, tp = self.arch, self.tp
            prof = profile_array(h.gemm_profile)
            gemm = a.active_params / tp * profile_tau(w.tokens, prof[:, 0], prof[:, 1])
            lm = a.vocab_size * a.hidden_size / tp * profile_tau(w.rows, prof[:, 0], prof[:, 2])
            gemm, lm = gemm / h.eff_profile, lm / h.eff_profile
        elif p > 0:  # the fitted GPU specs: a rounded corner and a cost per kernel
            kernels = h.gemm_kernel_s
            gemm = (((w.gemm_flops / fg) ** p + (w.gemm_bytes / bw) ** p) ** (1.0 / p)
                    + 4 * self.arch.num_layers * kernels)
            lm = ((w.lm_flops / fg) ** p + (w.lm_bytes / bw) ** p) ** (1.0 / p) \
                + kernels * (w.lm_bytes > 0)
        else:
            gemm = mx(w.gemm_flops / fg, w.gemm_bytes / bw)
            lm = mx(w.lm_flops / fg, w.lm_bytes / bw)
        nongemm = 0.0
        if h.eff_elem > 0:
            nongemm = (6 * self.arch.num_layers * h.nongemm_kernel_s
                       + w.nongemm_bytes / (h.mem_bw * h.eff_elem))
        e = self.engine
        if e is None:
            overhead = h.step_overhead_s + h.per_seq_overhead_s * w.seqs
        else:
            overhead = (w.fresh * (e.schedule_s + e.schedule_per_seq_s * w.seqs)
                        + e.step_s + e.step_per_seq_s * w.seqs)
        return StepTime(
            gemm=gemm, lm_head=lm,
            prefill_attn=_attn_s(w.pre_flops, w.pre_bytes, w.pre_widen_s, fa, bw, lap),
            decode_attn=_attn_s(w.dec_flops, w.dec_bytes, w.dec_widen_s, fa, bw, lap),
            allreduce=w.ar_seconds, overhead=overhead, nongemm=nongemm)


def _roof(c: Any, m: Any, lap: float) -> Any:
    """The roofline of compute seconds ``c`` and memory seconds ``m``, or their sum where
    nothing overlaps (``lap = 1 - overlap``); floats or numpy arrays."""
    if isinstance(c, float) and isinstance(m, float):  # one step: no numpy scalars
        return max(c, m) + lap * min(c, m)
    return np.maximum(c, m) + lap * np.minimum(c, m)


def _attn_s(flops: Any, nbytes: Any, widen_s: Any, fa: float, bw: float, lap: float) -> Any:
    """An attention term's seconds: the roofline of its FLOPs at ``fa`` FLOP/s and its
    bytes at ``bw`` bytes/s, plus a 1-byte cache's widening (``time`` and ``lane_time``)."""
    return _roof(flops / fa, nbytes / bw, lap) + widen_s


@functools.lru_cache(maxsize=8)
def profile_array(profile: tuple[tuple[float, float, float], ...]) -> np.ndarray:
    """A spec's GEMM profile as a read-only (rows, 3) array, built once per profile (a
    roofline run times every step with it)."""
    arr = np.array(profile, dtype=np.float64)
    arr.setflags(write=False)
    return arr


def profile_tau(m: Any, rows: np.ndarray, tau: np.ndarray) -> Any:
    """Seconds per weight parameter at ``m`` rows (a float or an array) from a measured
    profile: linear between measured row counts, from 0 at 0 rows to the first, and
    proportional to the rows past the last (compute-bound there)."""
    x = np.asarray(m, dtype=np.float64)
    inside = np.interp(x, np.concatenate([[0.0], rows]), np.concatenate([[0.0], tau]))
    out = np.where(x > rows[-1], tau[-1] * x / rows[-1], inside)
    return float(out) if out.ndim == 0 else out
