"""Sections ``kernel-correctness`` and ``kernel-bandwidth``: our Triton kernels on random
paged caches (blocks shuffled, lengths varied), compiled on CUDA, interpreted in the dry run.

Correctness: for every (batch, context) of the profile's grid, decode, prefill (the last
``prefill_chunk`` tokens of each sequence as one chunk) and store against their torch
references; at ``quant_sizes`` also fp8 / int8 caches and a window with sinks.

Bandwidth: device copy bandwidth, then per (batch, context) of ``timing_sizes`` one decode
step's attention timed four ways: our kernel (default split-K), our kernel unsplit, the
``paged`` backend's torch path (gather each sequence's blocks through its table, masked
SDPA) and SDPA over the same K/V already contiguous (the ``contiguous`` backend's
layout). Achieved bandwidth = K/V + Q bytes / time, and as a percent of the copy's.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from harness.gpucheck.context import SectionContext, error_text
from harness.gpucheck.profile import Profile, Size
from harness.gpucheck.timing import copy_gbps, time_bandwidth

if TYPE_CHECKING:
    from harness.kernels.cases import PagedCase

QUANT = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


def varied_lens(batch: int, context: int) -> list[int]:
    """``batch`` lengths in (context / 2, context], the first exactly ``context``."""
    span = max(1, context // 2)
    return [max(1, context - (i * 997) % span) for i in range(batch)]


def _case(profile: Profile, lens: list[int], cache: str | None,
          seed: int) -> tuple[PagedCase, torch.Generator]:
    from harness.kernels.cases import paged_case

    g = profile.geometry
    gen = torch.Generator(profile.device).manual_seed(seed)
    return paged_case(lens, block_size=g.block_size, num_kv_heads=g.num_kv_heads,
                      head_dim=g.head_dim, dtype=getattr(torch, g.dtype),
                      cache_dtype=QUANT.get(cache or ""), device=profile.device,
                      generator=gen), gen


def _compare(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype,
             device: str) -> dict[str, Any]:
    from harness.kernels.cases import tolerance

    tol = tolerance(dtype, device)
    diff = (got.float() - want.float()).abs()
    finite = bool(torch.isfinite(got).all())
    ok = finite and bool(torch.allclose(got.float(), want.float(), **tol))
    return {"ok": ok, "max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
            "atol": tol["atol"], "finite": finite}


def check_decode(profile: Profile, size: Size, cache: str | None = None,
                 window: int = 0, sinks: int = 0) -> dict[str, Any]:
    from harness.kernels.decode import paged_decode
    from harness.kernels.reference import paged_decode_ref

    g, dtype = profile.geometry, getattr(torch, profile.geometry.dtype)
    case, gen = _case(profile, varied_lens(*size), cache, seed=size[0] * 7 + size[1])
    q = torch.randn(size[0], g.num_heads, g.head_dim, generator=gen, device=profile.device,
                    dtype=dtype)
    got = paged_decode(q, case.k_cache, case.v_cache, case.tables, case.lens, window=window,
                       sinks=sinks, **case.scales)
    want = paged_decode_ref(q, case.k_cache, case.v_cache, case.tables, case.lens,
                            window=window, sinks=sinks, **case.scales)
    return _compare(got, want, dtype, profile.device)


def check_prefill(profile: Profile, size: Size, cache: str | None = None) -> dict[str, Any]:
    from harness.kernels.prefill import paged_prefill
    from harness.kernels.reference import paged_prefill_ref

    g, dtype, dev = profile.geometry, getattr(torch, profile.geometry.dtype), profile.device
    lens = varied_lens(*size)
    case, gen = _case(profile, lens, cache, seed=size[0] * 11 + size[1])
    chunks = [min(profile.prefill_chunk, n) for n in lens]
    rows = torch.tensor([0, *chunks], device=dev).cumsum(0)
    starts = torch.tensor([n - c for n, c in zip(lens, chunks)], device=dev)
    q = torch.randn(int(rows[-1]), g.num_heads, g.head_dim, generator=gen, device=dev,
                    dtype=dtype)
    got = paged_prefill(q, case.k_cache, case.v_cache, rows, starts, case.tables, max(chunks),
                        **case.scales)
    want = paged_prefill_ref(q, case.k_cache, case.v_cache, rows, starts, case.tables,
                             **case.scales)
    return _compare(got, want, dtype, dev)


def check_store(profile: Profile, size: Size, cache: str | None = None) -> dict[str, Any]:
    """Store ``batch`` x 4 tokens (a few padded with slot -1) at shuffled slots: caches and
    scales must equal the reference's bit for bit."""
    from harness.kernels.reference import store_kv_quant_ref, store_kv_ref
    from harness.kernels.store import store_kv, store_kv_quant

    g, dtype, dev = profile.geometry, getattr(torch, profile.geometry.dtype), profile.device
    case, gen = _case(profile, varied_lens(*size), cache, seed=size[0] * 13 + size[1])
    t = 4 * size[0]
    k = torch.randn(t, g.num_kv_heads, g.head_dim, generator=gen, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    slots = torch.randperm(case.k_cache.shape[0] * g.block_size, generator=gen,
                           device=dev)[:t]
    slots[::5] = -1
    ours = [case.k_cache.clone(), case.v_cache.clone()]
    ref = [case.k_cache.clone(), case.v_cache.clone()]
    if cache is None:
        store_kv(k, v, *ours, slots)
        store_kv_ref(k, v, *ref, slots)
    else:
        assert case.k_scale is not None and case.v_scale is not None
        our_s = [case.k_scale.clone(), case.v_scale.clone()]
        ref_s = [case.k_scale.clone(), case.v_scale.clone()]
        store_kv_quant(k, v, *ours, *our_s, slots)
        store_kv_quant_ref(k, v, *ref, *ref_s, slots)
        ours, ref = ours + our_s, ref + ref_s
    bits = [(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else (a, b)
            for a, b in zip(ours, ref)]
    return {"ok": all(torch.equal(a, b) for a, b in bits)}


def correctness_cases(profile: Profile) -> list[tuple[str, Size, Callable[[], dict[str, Any]]]]:
    """(kernel, size, check) for every check of the section, cheapest first per size."""
    cases: list[tuple[str, Size, Callable[[], dict[str, Any]]]] = []
    for size in profile.grid:
        cases += [("store", size, partial(check_store, profile, size)),
                  ("decode", size, partial(check_decode, profile, size)),
                  ("prefill", size, partial(check_prefill, profile, size))]
    for size in profile.quant_sizes:
        for name in QUANT:
            cases += [(f"store-{name}", size, partial(check_store, profile, size, name)),
                      (f"decode-{name}", size, partial(check_decode, profile, size, name)),
                      (f"prefill-{name}", size, partial(check_prefill, profile, size, name))]
        window = max(1, size[1] // 8)
        cases.append((f"decode-window{window}-sinks4", size,
                      partial(check_decode, profile, size, window=window, sinks=4)))
    return cases


def _empty_cache(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def correctness_section(ctx: SectionContext) -> dict[str, Any]:
    p = ctx.profile
    result: dict[str, Any] = {"geometry": _geometry(p), "rows": []}
    for kernel, (batch, context), check in correctness_cases(p):
        row: dict[str, Any] = {"kernel": kernel, "batch": batch, "context": context}
        if ctx.left() < 2:
            row.update(ok=None, error="skipped: time budget")
        else:
            try:
                row.update(check())
            except Exception as e:  # a failing check is a result; the next one runs
                row.update(ok=False, error=error_text(e))
        result["rows"].append(row)
        ctx.save(result)
        _empty_cache(p.device)
    return result


def _geometry(p: Profile) -> dict[str, Any]:
    g = p.geometry
    return {"num_heads": g.num_heads, "num_kv_heads": g.num_kv_heads, "head_dim": g.head_dim,
            "block_size": g.block_size, "dtype": g.dtype}


def kv_bytes(profile: Profile, batch: int, context: int) -> int:
    """Bytes one decode step must read at least once: every K and V of the context, and Q."""
    g = profile.geometry
    elem = torch.empty((), dtype=getattr(torch, g.dtype)).element_size()
    return (2 * batch * context * g.num_kv_heads + batch * g.num_heads) * g.head_dim * elem


def decode_providers(profile: Profile, size: Size) -> dict[str, Callable[[], object]]:
    """The four ways of one decode step's attention, on one random cache of ``size``."""
    from harness.backends.attention_ref import attend_decode
    from harness.kernels.decode import paged_decode

    batch, context = size
    g, dev = profile.geometry, profile.device
    case, gen = _case(profile, [context] * batch, None, seed=batch * 100_003 + context)
    q = torch.randn(batch, g.num_heads, g.head_dim, generator=gen, device=dev,
                    dtype=getattr(torch, g.dtype))
    kc, vc, tables, lens = case.k_cache, case.v_cache, case.tables, case.lens
    out = torch.empty_like(q)
    kd = kc[tables].flatten(1, 2)[:, :context].contiguous()
    vd = vc[tables].flatten(1, 2)[:, :context].contiguous()
    return {
        "triton": lambda: paged_decode(q, kc, vc, tables, lens, out=out),
        "triton-unsplit": lambda: paged_decode(q, kc, vc, tables, lens, num_splits=1, out=out),
        "torch-gather": lambda: attend_decode(q, kc[tables].flatten(1, 2),
                                              vc[tables].flatten(1, 2), lens),
        "contiguous-sdpa": lambda: attend_decode(q, kd, vd, lens),
    }


def bandwidth_section(ctx: SectionContext) -> dict[str, Any]:
    p = ctx.profile
    dev = torch.device(p.device)
    result: dict[str, Any] = {"geometry": _geometry(p), "rows": []}
    try:
        result["copy_gbps"] = copy_gbps(p.copy_bytes, dev, warmup_ms=p.warmup_ms,
                                        rep_ms=p.rep_ms)
    except Exception as e:
        result.update(copy_gbps=None, copy_error=error_text(e))
    _empty_cache(p.device)
    ctx.save(result)
    for size in p.timing_sizes:
        rows = _time_size(ctx, size, result.get("copy_gbps"))
        result["rows"] += rows
        ctx.save(result)
        _empty_cache(p.device)
    # The weight GEMMs' shares of the peaks, bf16 and FP8 (harness.gpucheck.gemm_profile):
    # what the what-if's GEMM terms take from published tables until a card measures them.
    from harness.gpucheck.gemm_profile import gemm_profile
    result["gemm_profile"] = gemm_profile(dev, p.device == "cuda", p.warmup_ms, p.rep_ms,
                                          ctx.left)
    _empty_cache(p.device)
    return result


def _time_size(ctx: SectionContext, size: Size, copy: float | None) -> list[dict[str, Any]]:
    p = ctx.profile
    names = ("triton", "triton-unsplit", "torch-gather", "contiguous-sdpa")
    base = {"batch": size[0], "context": size[1]}
    if ctx.left() < 3:
        return [{**base, "provider": n, "ms": None, "error": "skipped: time budget"}
                for n in names]
    try:
        providers = decode_providers(p, size)
    except Exception as e:  # out of memory building the case, say
        return [{**base, "provider": n, "ms": None, "error": error_text(e)} for n in names]
    rows = []
    nbytes = kv_bytes(p, *size)
    for name, fn in providers.items():
        rows.append(time_bandwidth({**base, "provider": name, "ms": None}, fn,
                                   torch.device(p.device), nbytes, copy, warmup_ms=p.warmup_ms,
                                   rep_ms=p.rep_ms, error=error_text))
    return rows
