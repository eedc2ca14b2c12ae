"""The step-time model: what one engine step costs on a hardware spec.

Per tensor-parallel rank, with T the step's tokens, S the rows that sample, P the dense
linear parameters (MoE: the shared path; the routed experts apart, below), b_w the weight
bytes per parameter (the lm_head's b_lm: 16-bit in quantized checkpoints), b_kv the
backend's bytes per cached token (all layers: a 1-byte cache halves them), L layers, H
query heads, d_qk / d_v the attention product's per-head dims, tp the tensor-parallel
degree, and each term a roofline, max(FLOPs / (peak x eff), bytes /
(bandwidth x eff)), on a GPU (``overlap=1``; where compute and memory traffic overlap
less the terms are max + (1 - overlap) x min: one CPU core, ``overlap=0``, adds them):

    gemm     = max(2 (P T + U cached) / tp / (peak_g eff_g),  b_w P / tp / (bw eff_bw))
               + E x sum_m Pr(m) max(2 P_e m / tp / (peak_g eff_g), b_w P_e / tp / (bw eff_bw))
    lm_head  = max(2 V h S / tp / (peak eff_c), b_lm V h / tp / (bw eff_bw))
    prefill  = max(2 H (d_qk' + d_v') L pairs / tp / (peak eff_attn),
                   b_kv ctx_prefill / tp_kv / (bw eff_bw))
    decode   = max(2 H (d_qk + d_v) L ctx_decode / tp / (peak eff_attn),
                   b_kv ctx_decode / tp_kv / (bw eff_bw))
    allreduce = 2 L (2 (tp - 1) / tp x T h b_act / link_bw + latency)  (tp > 1)
    nongemm  = L (6 t_kernel + T B_tok / (bw eff_elem))
    engine   = [fresh] (schedule_s + schedule_per_seq_s x seqs)
               + step_s + step_per_seq_s x seqs
               (an engine that overlaps it with the forward: max(0, engine - forward))
    step     = gemm + lm_head + prefill + decode + allreduce + nongemm + engine

On a spec fitted to profiled kernels (harness.roofline_tools.kernel_fit: the GPU specs) the GEMM
rooflines' corner is rounded and each GEMM kernel has a fixed cost: with c and m the
compute and memory sides above, ``gemm = (c^p + m^p)^(1/p) + (4 L + 1) t_gemm`` (``p =
gemm_corner_p``; 0 keeps max(c, m)), so a step near the ridge (~256 tokens) is neither
side alone and small TP8 matrices stream below the bandwidth share. ``nongemm`` is the
two RMSNorms, RoPE, SiLU-and-mul and two residual adds of each layer: six kernels of
``nongemm_kernel_s`` and ``B_tok`` bytes a token (ArchSpec.nongemm_bytes_per_token).
``latency`` is a small message's all-reduce time: the engine profile's fitted
``allreduce_latency_s`` where it has one, else the spec's NCCL figure at that degree
(Vidur's tables: 30-45 us on H100 NVLink). An engine whose profile names its own kernels
(``EngineProfile.allreduce``: vLLM's, or the TensorRT-LLM-derived ones TensorRT-LLM and
SGLang run) takes their published time at the message's size instead, on the cards that
table was measured on, up to 8 MiB (harness.roofline.allreduce); NCCL's above.
``engine`` is the serving engine's CPU time (harness.roofline.engines): a scheduling
decision on each step scheduled anew (``StepRecord.fresh``; multi-step scheduling makes
the others not fresh), and per-step work (launch, sampling, output processing); without a
profile, the spec's ``step_overhead_s + per_seq_overhead_s x seqs``; where the engine
overlaps it with the forward (``overlap_cpu``), only what outlasts the forward.
GEMMs run at ``gemm_dtype``'s peak (``roofline.compute_dtype=fp8``: W8A8 on the fp8 units).

``eff_g`` is the GEMM dtype's share of its peak (``HardwareSpec.gemm_eff``: bf16 from
Vidur's profiles, fp8 from FP8 kernel profiles, by how the checkpoint's scales are laid
out: per-tensor, or block-wise as DeepSeek-V3's; harness.roofline_tools.kernel_fit).
Each of the E routed experts (P_e weights each) is a GEMM over its own token count m,
Binomial(T, k/E) under uniform top-k routing (:func:`expert_load`), its weights read only
when m > 0: at small counts an expert streams its weights for few tokens, which one
aggregated GEMM over P T FLOPs hid. On a spec with a MoE kernel profile
(``HardwareSpec.moe_profile``, fitted to published fused / grouped MoE kernel tables:
harness.roofline_tools.kernel_fit --moe) the routed experts' term is instead

    experts = L_moe t0 + E x sum_m Pr(m) max(2 P_e m / tp / peak_g, b_w P_e / tp / bw)
                         / f(m_busy)

the roofline at the datasheet's peaks over the share ``f`` the MoE kernels of that kind
reach (bf16, per-tensor fp8, block-wise fp8; weight-only MXFP4 / int4 take bf16's, a
prior) at the step's mean tokens per busy expert ``m_busy`` (:func:`mean_busy_tokens`),
plus the fused kernel's floor ``t0`` per MoE layer. ``d_qk'``, ``d_v'`` are prefill's per-head dims
(ArchSpec.prefill_dims: MLA un-absorbed, 128 + 64 and 128, where decode's absorbed form
is 576 and 512), and ``U cached`` the up-projection of the cached latents a chunk reads.

``pairs`` are the (query, key) pairs of the step's prefill chunks (a chunk of n tokens
after s cached ones: n s + n (n + 1) / 2, a window bounding each query's keys);
``ctx_prefill`` the keys those chunks read (s + n each); ``ctx_decode`` the keys the
decodes read. What a fused kernel's K/V bytes are (``b_kv ctx`` above) is the backend's
declaration (harness.backends.costs: a window's keys, a budget's held tokens, quest's
chosen blocks plus every block's bounds, 1-byte values with their scales and sinks).
``tp_kv`` is tp for caches split by KV head, 1 for MLA's latent, which every rank holds.

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
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.roofline.allreduce import CUSTOM_MAX_BYTES, applies, custom_allreduce_s
from harness.roofline.arch import ArchSpec
from harness.roofline.engines import EngineProfile
from harness.roofline.hardware import HardwareSpec, dtype_key
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
                 engine: EngineProfile | None = None,
                 overlap_cpu: bool | None = None) -> None:
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
        # The engine's own all-reduce kernels, where their table covers this card and tp
        # (their time replaces the latency and the link term up to CUSTOM_MAX_BYTES).
        self.custom_ar = engine.allreduce if engine is not None \
            and applies(engine.allreduce, hw.name, tp) else None
        if self.custom_ar is not None:
            self.allreduce_latency = 0.0  # in the kernels' table (the fit reads this)
        # The engine's CPU time runs beside the forward (SGLang's overlap scheduler, vLLM's
        # --async-scheduling): only what outlasts the forward shows. None: the profile's.
        self.overlap_cpu = (engine is not None and engine.overlap_cpu) \
            if overlap_cpu is None else overlap_cpu
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
        # Prefill as the engines run it (MLA: un-absorbed, after up-projecting each cached
        # latent a chunk reads: a GEMM over the kv_b_proj weights the layer already reads).
        pre_qk, pre_v = arch.prefill_dims()
        self.pre_flops_per_pair = 2.0 * arch.num_heads * (pre_qk + pre_v) * arch.num_layers / tp
        self.upproj_flops_per_key = 2.0 * arch.prefill_upproj_params * arch.num_layers / tp
        # The lm_head stays 16-bit in quantized checkpoints (TensorRT-LLM's and vLLM's FP8,
        # AWQ int4 exclude it): its GEMM runs at the activations' dtype on 16-bit weights.
        self.lm_weight_bytes = weight_bytes if weight_bytes >= 2.0 else 2.0
        self._experts: dict[int, float] = {}  # _expert_s by token count, on self.hw
        self.moe_kind = moe_kind(self.gemm_dtype, weight_bytes, arch.fp8_block_scaled)
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
        self._lane_cpu: dict[int, float] = {}  # ... and the engine's CPU seconds

    def work_of(self, sh: StepShape, fresh: bool = True) -> StepWork:
        """:meth:`work` of a step's shape (``fresh``: scheduled anew)."""
        w = self.work(sh.tokens, sh.rows, sh.seqs, sh.pairs, sh.ctx_prefill,
                      sh.ctx_decode, sh.pairs_full, sh.gather_decode, sh.pre_bytes,
                      sh.dec_bytes, pre_cached=sh.ctx_prefill - (sh.tokens - sh.num_decode))
        w.fresh = 1.0 if fresh else 0.0
        return w

    def work(self, tokens: int, rows: int, seqs: int, pairs: float, ctx_prefill: float,
             ctx_decode: float, pairs_full: float = 0.0, gather_decode: float = 0.0,
             pre_bytes: float | None = None, dec_bytes: float | None = None,
             pre_cached: float = 0.0) -> StepWork:
        """FLOPs and bytes of a step: ``tokens`` rows through the GEMMs, ``rows`` through
        the lm_head, prefill ``pairs`` (fused) / ``pairs_full`` (gather) over
        ``ctx_prefill`` keys, decodes over ``ctx_decode`` keys (fused) / ``gather_decode``
        (gather); which of each pair counts is the hardware's ``attention``. Fused
        kernels read ``pre_bytes`` / ``dec_bytes`` of cache, the whole model's, as the
        backend declares them (harness.backends.costs: scales, overlays and metadata
        included); without them, the keys at the backend's bytes per slot.
        ``pre_cached``: the keys the prefill chunks read that earlier steps cached (MLA
        up-projects them). The routed experts' GEMMs are apart (:meth:`time`: each expert
        at its own token count); ``gemm_*`` are the dense path's."""
        a, tp, wb = self.arch, self.tp, self.weight_bytes
        vh = a.vocab_size * a.hidden_size
        ar = 0.0
        if self.allreduces:
            ar = self.allreduces * self._allreduce_s(tokens * a.hidden_size * self.act_bytes)
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
            gemm_flops=2.0 * a.dense_params * tokens / tp
            + self.upproj_flops_per_key * pre_cached,
            gemm_bytes=a.dense_weight_bytes(wb) * a.dense_params / tp,
            lm_flops=2.0 * vh * rows / tp,
            lm_bytes=(self.lm_weight_bytes * vh / tp) if rows else 0.0,
            pre_flops=self.pre_flops_per_pair * pairs,
            pre_bytes=pre_b,
            dec_flops=dec_flops,
            dec_bytes=dec_b,
            ar_seconds=ar, seqs=seqs, tokens=tokens, rows=rows,
            pre_widen_s=widen * ctx_prefill, dec_widen_s=dec_widen,
            nongemm_bytes=self.nongemm_per_token * tokens)

    def _allreduce_s(self, nbytes: Any) -> Any:
        """One all-reduce of ``nbytes`` per rank (a float or an array): the engine's own
        kernels' table up to its size limit, else the link's bandwidth plus a small
        message's latency (NCCL's, or the fitted one)."""
        tp = self.tp
        nccl = 2 * (tp - 1) / tp * nbytes / self.hw.link_bw + self.allreduce_latency
        if self.custom_ar is None:
            return nccl
        nccl = nccl + self.hw.allreduce_latency(tp)  # above the kernels' limit: NCCL's
        custom = custom_allreduce_s(self.custom_ar, tp, nbytes)
        if isinstance(nbytes, np.ndarray):
            return np.where(nbytes <= CUSTOM_MAX_BYTES, custom, nccl)
        return custom if nbytes <= CUSTOM_MAX_BYTES else nccl

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
            self._lane_cpu[n] = self._cpu_s(w, self.hw)
        h = self.hw
        decode = _attn_s(*self._decode_side(ctx_decode, gather_decode, dec_bytes),
                         self.peak * h.eff_attn, h.mem_bw * h.eff_bw, 1.0 - h.overlap)
        t = StepTime(base.gemm, base.lm_head, base.prefill_attn, decode, base.allreduce,
                     base.overhead, base.nongemm)
        if self.overlap_cpu:  # the CPU time hides behind this step's own forward
            t.overhead = max(0.0, self._lane_cpu[n] - t.forward)
        return t

    def _expert_s(self, tokens: Any, h: HardwareSpec, cache: bool) -> Any:
        """Seconds of the routed experts' GEMMs in a step of ``tokens`` tokens, per rank:
        each expert a GEMM over its own token count (the engines' grouped / fused MoE
        kernels), its weights read when it has a token, the count drawn as routing draws
        it (:func:`expert_load`), the expectation taken over it. Floats or numpy arrays;
        ``cache``: ``h`` is the model's own spec (memoized by token count)."""
        a = self.arch
        if not a.num_experts:
            return 0.0 * tokens
        if isinstance(tokens, np.ndarray):
            return np.array([self._expert_s(float(t), h, cache) for t in tokens.ravel()]
                            ).reshape(tokens.shape)
        n = round(float(tokens))
        if cache and n in self._experts:
            return self._experts[n]
        out = 0.0
        if n > 0:
            per = a.expert_params / a.num_experts / self.tp  # one expert's weights, a rank
            counts, prob = expert_load(n, a.num_experts, a.experts_per_token)
            prof = h.moe_kernels(self.moe_kind)
            if prof is not None:
                # The spec's MoE kernel profile: the experts' roofline at the datasheet
                # peaks over the profile's share at this step's tokens per busy expert,
                # plus the fused kernel's floor per MoE layer.
                t0, buckets = prof
                roof = moe_roof_s(counts, prob, a.num_experts, per, self.weight_bytes,
                                  h.flops(self.gemm_dtype), h.mem_bw)
                share = moe_share(mean_busy_tokens(n, a.num_experts, a.experts_per_token),
                                  buckets)
                out = (a.moe_layers or a.num_layers) * t0 + roof / share
            else:
                c1 = 2.0 * per / (h.flops(self.gemm_dtype)
                                  * h.gemm_eff(self.gemm_dtype, a.fp8_block_scaled))
                m = self.weight_bytes * per / (h.mem_bw * h.eff_bw)
                busy = counts > 0
                t = _corner(c1 * counts[busy], m, h.gemm_corner_p, 1.0 - h.overlap)
                out = a.num_experts * float(np.dot(prob[busy], t))
        if cache:
            self._experts[n] = out
        return out

    def time(self, w: StepWork, hw: HardwareSpec | None = None) -> StepTime:
        """Seconds of ``w`` on ``hw`` (default: the model's own; calibration passes
        candidates). Works on floats and on numpy arrays alike."""
        h = hw or self.hw
        peak = self.peak if hw is None else hw.flops(self.compute_dtype)
        gpeak = self.gemm_peak if hw is None else hw.flops(self.gemm_dtype)
        # Each GEMM at its dtype's share of its peak (fp8 reaches less of its doubled peak
        # than bf16 of its own); the 16-bit lm_head at the activations'.
        block = self.arch.fp8_block_scaled
        fg, fa = gpeak * h.gemm_eff(self.gemm_dtype, block), peak * h.eff_attn
        bw = h.mem_bw * h.eff_bw
        fl = peak * h.gemm_eff(self.compute_dtype)
        lap = 1.0 - h.overlap
        p = h.gemm_corner_p

        if h.profiled(self.compute_dtype):
            a, tp = self.arch, self.tp
            prof = profile_array(h.gemm_profile)
            gemm = a.active_params / tp * profile_tau(w.tokens, prof[:, 0], prof[:, 1])
            lm = a.vocab_size * a.hidden_size / tp * profile_tau(w.rows, prof[:, 0], prof[:, 2])
            gemm, lm = gemm / h.eff_profile, lm / h.eff_profile
        else:
            kernels = h.gemm_kernel_s  # the fitted GPU specs' cost per kernel (else 0)
            gemm = (_corner(w.gemm_flops / fg, w.gemm_bytes / bw, p, lap)
                    + 4 * self.arch.num_layers * kernels
                    + self._expert_s(w.tokens, h, hw is None))
            lm = _corner(w.lm_flops / fl, w.lm_bytes / bw, p, lap) + kernels * (w.lm_bytes > 0)
        nongemm = 0.0
        if h.eff_elem > 0:
            nongemm = (6 * self.arch.num_layers * h.nongemm_kernel_s
                       + w.nongemm_bytes / (h.mem_bw * h.eff_elem))
        t = StepTime(
            gemm=gemm, lm_head=lm,
            prefill_attn=_attn_s(w.pre_flops, w.pre_bytes, w.pre_widen_s, fa, bw, lap),
            decode_attn=_attn_s(w.dec_flops, w.dec_bytes, w.dec_widen_s, fa, bw, lap),
            allreduce=w.ar_seconds, overhead=self._cpu_s(w, h), nongemm=nongemm)
        if self.overlap_cpu:  # only what outlasts the forward shows
            f = t.forward
            t.overhead = np.maximum(0.0, t.overhead - f) if isinstance(f, np.ndarray) \
                else max(0.0, t.overhead - f)
        return t

    def _cpu_s(self, w: StepWork, h: HardwareSpec) -> Any:
        """The serving engine's CPU seconds of a step (the profile's, or the spec's own
        overheads without one)."""
        e = self.engine
        if e is None:
            return h.step_overhead_s + h.per_seq_overhead_s * w.seqs
        return (w.fresh * (e.schedule_s + e.schedule_per_seq_s * w.seqs)
                + e.step_s + e.step_per_seq_s * w.seqs)


def _corner(c: Any, m: Any, p: float, lap: float) -> Any:
    """A GEMM's seconds from its compute seconds ``c`` and memory seconds ``m``: the
    fitted specs' rounded corner ``(c^p + m^p)^(1/p)`` (``p > 0``), else :func:`_roof`."""
    if p > 0:
        return (c ** p + m ** p) ** (1.0 / p)
    return _roof(c, m, lap)


def expert_load(tokens: int, experts: int, per_token: int) -> tuple[np.ndarray, np.ndarray]:
    """The token counts one routed expert receives in a step of ``tokens`` tokens, and
    their probabilities: each token picks ``per_token`` distinct experts of ``experts``,
    uniformly, so one expert's count is Binomial(tokens, per_token / experts) (the
    imbalance uniform routing gives; a skewed router gives more). Counts beyond 12
    standard deviations of the mean are left out (their mass is below 1e-30)."""
    q = per_token / experts
    if q >= 1.0:
        return np.array([float(tokens)]), np.array([1.0])
    mean, sd = tokens * q, math.sqrt(tokens * q * (1.0 - q))
    lo, hi = max(0, int(mean - 12 * sd) - 1), min(tokens, int(mean + 12 * sd) + 2)
    m = np.arange(lo, hi + 1, dtype=np.float64)
    lg = np.vectorize(math.lgamma)
    logp = (math.lgamma(tokens + 1) - lg(m + 1) - lg(tokens - m + 1)
            + m * math.log(q) + (tokens - m) * math.log1p(-q))
    return m, np.exp(logp)


def moe_kind(gemm_dtype: str, weight_bytes: float, block_scaled: bool) -> str:
    """Which MoE kernels a model's experts run (HardwareSpec.moe_kernels' key): "fp8" /
    "fp8_block" (W8A8, by the checkpoint's scale layout), "w4a16" / "w8a16" (weights of
    under 2 bytes dequantized to 16-bit compute: MXFP4 / NVFP4 / int4, int8), else the
    GEMM dtype ("bf16", "fp16", "fp4", ...)."""
    key = dtype_key(gemm_dtype)
    if key == "fp8":
        return "fp8_block" if block_scaled else "fp8"
    if key in ("bf16", "fp16") and weight_bytes < 2.0:
        return "w4a16" if weight_bytes < 1.0 else "w8a16"
    return key


def mean_busy_tokens(tokens: float, experts: int, per_token: int) -> float:
    """The mean token count of a routed expert that has any, in a step of ``tokens``
    tokens under uniform top-k routing: ``T k / (E Pr(busy))``, ``Pr(busy) = 1 - (1 -
    k/E)^T``; 1.0 at one token. The per-expert M the fused-MoE kernels see (they pick
    their tiles by the step's token count): the key of a spec's MoE kernel profile."""
    if tokens <= 0 or experts <= 0:
        return 0.0
    q = min(1.0, per_token / experts)
    busy = 1.0 - (1.0 - q) ** tokens
    return tokens * q / busy


def moe_roof_s(counts: np.ndarray, prob: np.ndarray, experts: int, params: float,
               weight_bytes: float, peak: float, bw: float) -> float:
    """Seconds of ``experts`` expert GEMMs at the datasheet's peaks (no efficiency): each
    expert of ``params`` weights a roofline ``max(2 P m / peak, b_w P / bw)`` over its
    own token count m (``counts`` with probabilities ``prob``, :func:`expert_load`), its
    weights read only when m > 0; the expectation over the counts, summed over experts."""
    busy = counts > 0
    t = np.maximum(2.0 * params * counts[busy] / peak, weight_bytes * params / bw)
    return experts * float(np.dot(prob[busy], t))


def moe_share(m_mean: float, buckets: tuple[tuple[float, float], ...]) -> float:
    """A MoE kernel profile's share of the roofline at ``m_mean`` tokens per busy expert
    (:func:`mean_busy_tokens`): the bucket whose lower edge is the largest at or below
    it (``buckets``: (lower edge, share), edges ascending; below the first, the first)."""
    share = buckets[0][1]
    for lo, f in buckets:
        if m_mean >= lo:
            share = f
    return share


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
