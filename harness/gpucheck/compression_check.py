"""Section ``compression`` (issue #56): what a compression method buys on the device, beside
``paged`` and ``contiguous``, under one memory budget.

Engine rows: every row of :data:`~harness.gpucheck.profile.COMPRESSION_BACKENDS` through
``harness.runner.run`` at the plan's model (Llama-3.1-8B's shape on the GPU) and KV budget,
once per context (4k and 32k on the GPU): its requests all at once, each ``context``
tokens long, after a warm-up of the same requests (the kernels compile there). Reported:
output tokens/s, the median decode step, the bytes a decode token reads
(``attention.kv_read_bytes_per_token``, as the method declares them and the attention
counts them), the sequences that ran at once, the kernel that ran.

Kernel rows: one decode step of each method's attention kernel at the plan's (batch,
context) sizes, timed (triton's do_bench on CUDA) against the bytes the method must read
(its K/V, its metadata, the queries): GB/s and a percent of a device copy's. ``paged``
reads the whole context; ``slots`` / ``slots+weights`` are the token-evicting methods'
decode over their slot lists (``held_share`` of the context held, an eighth of the slots
holes), without and with the logits for their scores and the weights launch; ``quest-64``
its block selection and decode over 64 tokens' blocks (the bounds of every block read);
``kivi-2bit`` its decode over 2-bit codes. The dry run (CPU, interpreted) checks the code
path; its times mean nothing.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from harness.gpucheck.context import SectionContext, error_text
from harness.gpucheck.engine_checks import run_backend
from harness.gpucheck.profile import (
    COMPRESSION_BACKENDS,
    CompressionPlan,
    EngineShape,
    Profile,
    fixed_lengths,
)
from harness.gpucheck.timing import copy_gbps, time_bandwidth

# Bytes a 2-bit KIVI token costs per KV head beside its codes: the value's float16 scale
# and zero (the keys' per-channel scale and zero are per block).
_KIVI_SCALE = 2


def context_profile(p: Profile, plan: CompressionPlan, context: int,
                    requests: int) -> tuple[Profile, EngineShape]:
    """The engine section's profile and shape for one context of the plan: ``requests``
    requests of ``context - output`` prompt tokens and ``output`` new ones, all at once."""
    prompt = context - plan.output_tokens
    common = (*plan.common, f"scheduler.max_model_len={context}")
    prof = dataclasses.replace(
        p, workload=fixed_lengths(requests, prompt, plan.output_tokens),
        warmup_workload=fixed_lengths(requests, prompt, plan.warmup_output),
        engine_common=common)
    return prof, EngineShape(f"ctx{context}", plan.model, plan.kv_budget)


def engine_rows(ctx: SectionContext, plan: CompressionPlan, result: dict[str, Any]) -> None:
    """Every backend at every context, an even share of the time left each (saved as
    they come)."""
    p = ctx.profile
    jobs = [(c, n, label, b) for c, n in zip(plan.contexts, plan.requests)
            for label, b in COMPRESSION_BACKENDS]
    for i, (context, n, label, backend) in enumerate(jobs):
        base = {"backend": label, "context": context, "requests": n}
        left = ctx.left()
        if left < p.min_backend_s:
            result["rows"].append({**base, "ok": None, "error": "skipped: time budget"})
            continue
        share = max(p.min_backend_s, left / (len(jobs) - i))
        prof, shape = context_profile(p, plan, context, n)
        row = run_backend(prof, shape, label, backend, min(left - 0.5, 2.5 * share))
        result["rows"].append({**base, **row})
        ctx.save(result)


def _bf(p: Profile) -> tuple[torch.dtype, int]:
    dt = getattr(torch, p.geometry.dtype)
    return dt, torch.empty((), dtype=dt).element_size()


def kernel_providers(p: Profile, size: tuple[int, int],
                     held_share: float) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (one decode step of that method's kernel, the bytes it must read) on random
    caches of ``size`` = (batch, context) at the profile's geometry."""
    from harness.kernels.cases import paged_case
    from harness.kernels.decode import paged_decode
    from harness.kernels.kivi import kivi_decode
    from harness.kernels.quest import quest_decode
    from harness.kernels.scores import decode_weights

    g, dev = p.geometry, p.device
    dt, elem = _bf(p)
    batch, context = size
    bs, kv, d, h = g.block_size, g.num_kv_heads, g.head_dim, g.num_heads
    gen = torch.Generator(dev).manual_seed(batch * 7919 + context)
    q = torch.randn(batch, h, d, generator=gen, device=dev, dtype=dt)
    qb = batch * h * d * elem
    out = torch.empty_like(q)
    provs: dict[str, tuple[Callable[[], object], int]] = {}

    full = paged_case([context] * batch, block_size=bs, num_kv_heads=kv, head_dim=d,
                      dtype=dt, device=dev, generator=gen)
    kc, vc, tables, lens = full.k_cache, full.v_cache, full.tables, full.lens
    provs["paged"] = (lambda: paged_decode(q, kc, vc, tables, lens, out=out),
                      2 * batch * context * kv * d * elem + qb)

    # The token-evicting methods: held_share of the context in its blocks, 1/8 holes.
    held = max(1, int(context * held_share))
    blocks = -(-held * 8 // (7 * bs))
    nslots = kc.shape[0] * bs
    slot_pos = torch.full((nslots,), -1, dtype=torch.int64, device=dev)
    table = tables[:, :blocks]
    slots = (table[:, :, None] * bs + torch.arange(bs, device=dev)).flatten(1)
    live = torch.rand(slots.shape, generator=gen, device=dev) >= 1 / 8
    slot_pos[slots[live]] = 0
    kept = int(live.sum())
    slot_lens = torch.full((batch,), blocks * bs, dtype=torch.int64, device=dev)
    logits = torch.empty(batch, h, blocks * bs, dtype=torch.float32, device=dev)
    lse = torch.empty(batch, h, dtype=torch.float32, device=dev)
    scores = torch.zeros(nslots, dtype=torch.float32, device=dev)
    must = 2 * kept * kv * d * elem + qb

    def slotted(with_scores: bool) -> None:
        paged_decode(q, kc, vc, table, slot_lens, out=out, slot_pos=slot_pos,
                     logits=logits if with_scores else None, lse=lse if with_scores else None)
        if with_scores:
            decode_weights(logits, lse, table, slot_lens, slot_pos, bs, scores)
    provs["slots"] = (lambda: slotted(False), must)
    provs["slots+weights"] = (lambda: slotted(True), must)

    # quest at a 64-token budget: its chosen blocks' K/V and every block's bounds.
    k_sel = max(1, 64 // bs)
    nblk = torch.full((batch,), -(-context // bs), dtype=torch.int64, device=dev)
    kmin, kmax = kc.amin(1), kc.amax(1)
    read = min(k_sel * bs, context)
    provs["quest-64"] = (
        lambda: quest_decode(q, kc, vc, tables, nblk, lens, kmin, kmax, k_sel, out=out),
        2 * batch * read * kv * d * elem + 2 * batch * int(nblk[0]) * kv * d * elem + qb)

    # kivi 2-bit: codes, value scales and zeros per token, key scales and zeros per block.
    nb = kc.shape[0]
    k_q = torch.randint(0, 256, (nb, bs, kv, d // 4), generator=gen, device=dev,
                        dtype=torch.uint8)
    v_q = torch.randint_like(k_q, 0, 256)
    half = torch.float16
    k_scale = torch.rand(nb, kv, d, generator=gen, device=dev).to(half) / 2
    k_zero = torch.randn(nb, kv, d, generator=gen, device=dev).to(half)
    v_scale = torch.rand(nb, bs, kv, generator=gen, device=dev).to(half) / 2
    v_zero = torch.randn(nb, bs, kv, generator=gen, device=dev).to(half)
    slab_map = torch.full((nb,), -1, dtype=torch.int64, device=dev)
    res = torch.zeros(1, bs, kv, d, dtype=dt, device=dev)
    provs["kivi-2bit"] = (
        lambda: kivi_decode(q, k_q, v_q, k_scale, k_zero, v_scale, v_zero, slab_map, res, res,
                            tables, lens, 2, out=out),
        batch * context * kv * (2 * d // 4 + 2 * _KIVI_SCALE)
        + batch * int(nblk[0]) * kv * d * 2 * _KIVI_SCALE + qb)
    return provs


def kernel_rows(ctx: SectionContext, plan: CompressionPlan,
                copy: float | None) -> list[dict[str, Any]]:
    p = ctx.profile
    rows: list[dict[str, Any]] = []
    dev = torch.device(p.device)
    for size in plan.timing_sizes:
        base = {"batch": size[0], "context": size[1]}
        if ctx.left() < 3:
            rows.append({**base, "kernel": "all", "ms": None, "error": "skipped: time budget"})
            continue
        try:
            provs = kernel_providers(p, size, plan.held_share)
        except Exception as e:  # out of memory building the case, say
            rows.append({**base, "kernel": "all", "ms": None, "error": error_text(e)})
            continue
        for name, (fn, nbytes) in provs.items():
            rows.append(time_bandwidth(
                {**base, "kernel": name, "must_read_bytes": nbytes, "ms": None}, fn, dev,
                nbytes, copy, warmup_ms=p.warmup_ms, rep_ms=p.rep_ms, error=error_text))
        del provs
        if p.device == "cuda":
            torch.cuda.empty_cache()
    return rows


def compression_section(ctx: SectionContext) -> dict[str, Any]:
    p = ctx.profile
    plan = p.compression
    assert plan is not None, f"profile {p.name} has no compression plan"
    result: dict[str, Any] = {"model": list(plan.model), "kv_budget": plan.kv_budget,
                              "contexts": list(plan.contexts),
                              "requests": list(plan.requests), "rows": [], "kernels": []}
    t0 = time.monotonic()
    try:
        copy = copy_gbps(p.copy_bytes, torch.device(p.device), warmup_ms=p.warmup_ms,
                         rep_ms=p.rep_ms)
    except Exception as e:
        copy, result["copy_error"] = None, error_text(e)
    result["copy_gbps"] = copy
    result["kernels"] = kernel_rows(ctx, plan, copy)
    result["kernel_s"] = round(time.monotonic() - t0, 2)
    ctx.save(result)
    engine_rows(ctx, plan, result)
    return result
