"""Section ``flash-attn``: flash-attn 4 through the flash_attn backend's seam, where the
check's second call (scripts/gpu_fa4.sh) has installed it; otherwise it says it has not run.

Three parts: its paged decode and prefill against the torch references on random caches
(pages of 16 and 128 tokens); decode timings next to our Triton kernel on the same cache;
the engine with ``backend=flash_attn`` (its kernels from :func:`load_flash_attn4`) next to
``paged`` with the torch path on the same random-weight model, and how many requests'
tokens agree (bf16: kernels that round differently may flip a near-tie).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from harness.backends.flash_attn_seam import FlashAttnFns
from harness.gpucheck.context import SectionContext, error_text, time_limit
from harness.gpucheck.engine_checks import compose_run, run_overrides
from harness.gpucheck.fa4 import load_flash_attn4
from harness.gpucheck.kernel_checks import _compare, kv_bytes, varied_lens
from harness.gpucheck.profile import EngineShape, Profile, Size
from harness.gpucheck.timing import time_ms

if TYPE_CHECKING:
    from harness.kernels.cases import PagedCase

GPU_PAGES = (16, 128)


def _case(profile: Profile, lens: list[int], page: int,
          seed: int) -> tuple[PagedCase, torch.Generator]:
    from harness.kernels.cases import paged_case

    g = profile.geometry
    gen = torch.Generator(profile.device).manual_seed(seed)
    case = paged_case(lens, block_size=page, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
                      dtype=getattr(torch, g.dtype), device=profile.device, generator=gen)
    return case, gen


def check_kernels(profile: Profile, fns: FlashAttnFns, size: Size, page: int,
                  dtype: torch.dtype) -> list[dict[str, Any]]:
    """flash-attn's decode and prefill (through the seam) vs the torch references."""
    from harness.kernels.reference import paged_decode_ref, paged_prefill_ref

    g, dev = profile.geometry, profile.device
    lens = varied_lens(*size)
    case, gen = _case(profile, lens, page, seed=size[0] + size[1] + page)
    kc, vc = case.k_cache.to(dtype), case.v_cache.to(dtype)
    tables, seqlens = case.tables.to(torch.int32), case.lens.to(torch.int32)
    q = torch.randn(size[0], g.num_heads, g.head_dim, generator=gen, device=dev, dtype=dtype)
    got = fns.with_kvcache(q.unsqueeze(1), kc, vc, cache_seqlens=seqlens, block_table=tables,
                           causal=True).squeeze(1)
    want = paged_decode_ref(q, kc, vc, case.tables, case.lens)
    base = {"batch": size[0], "context": size[1], "page": page}
    rows = [{"kernel": "decode", **base, **_compare(got, want, dtype, dev)}]
    chunks = [min(profile.prefill_chunk, n) for n in lens]
    cu_q = torch.tensor([0, *chunks], device=dev).cumsum(0)
    cu_k = torch.tensor([0, *lens], device=dev).cumsum(0)
    starts = torch.tensor([n - c for n, c in zip(lens, chunks)], device=dev)
    qp = torch.randn(int(cu_q[-1]), g.num_heads, g.head_dim, generator=gen, device=dev,
                     dtype=dtype)
    got = fns.varlen(qp, kc, vc, cu_q.to(torch.int32), cu_k.to(torch.int32), max(chunks),
                     max(lens), causal=True, block_table=tables)
    want = paged_prefill_ref(qp, kc, vc, cu_q, starts, case.tables)
    rows.append({"kernel": "prefill", **base, **_compare(got, want, dtype, dev)})
    return rows


def time_decode(profile: Profile, fns: FlashAttnFns, size: Size,
                page: int) -> list[dict[str, Any]]:
    """One decode step by flash-attn and by our Triton kernel, on the same cache."""
    from harness.kernels.decode import paged_decode

    g, dev = profile.geometry, torch.device(profile.device)
    case, gen = _case(profile, [size[1]] * size[0], page, seed=size[0] * 31 + size[1])
    q = torch.randn(size[0], g.num_heads, g.head_dim, generator=gen, device=dev,
                    dtype=case.k_cache.dtype)
    t32, l32 = case.tables.to(torch.int32), case.lens.to(torch.int32)
    calls: dict[str, Callable[[], object]] = {
        f"flash-attn-{fns.version}": lambda: fns.with_kvcache(
            q.unsqueeze(1), case.k_cache, case.v_cache, cache_seqlens=l32, block_table=t32,
            causal=True),
        "triton": lambda: paged_decode(q, case.k_cache, case.v_cache, case.tables,
                                       case.lens),
    }
    rows = []
    for name, fn in calls.items():
        row: dict[str, Any] = {"provider": name, "batch": size[0], "context": size[1],
                               "page": page}
        try:
            fn()
            ms = time_ms(fn, dev, warmup_ms=profile.warmup_ms, rep_ms=profile.rep_ms)
            row.update(ms=round(ms, 4), gbps=round(kv_bytes(profile, *size) / ms / 1e6, 1))
        except Exception as e:
            row["error"] = error_text(e)
        rows.append(row)
    return rows


def engine_agreement(profile: Profile, shape: EngineShape, page: int) -> dict[str, Any]:
    """flash_attn (kernels from the seam as patched) vs paged's torch path, same model."""
    from harness.runner import run

    common = ("model.dtype=bfloat16", f"backend.block_size={page}")
    fa = run(compose_run([*run_overrides(profile, shape, ("backend=flash_attn",),
                                         warmup=False), *common]))
    ref = run(compose_run([*run_overrides(profile, shape, ("backend=paged",
                                                           "backend.kernel=torch"),
                                          warmup=False), *common]))
    same = sum(fa.outputs[r] == ref.outputs.get(r) for r in fa.outputs)
    return {"shape": shape.name, "page": page, "kernel": fa.metrics["run.kernel"],
            "requests_identical": f"{same}/{len(fa.outputs)}",
            "output_tok_s": round(fa.metrics["throughput.output_tokens_per_s"], 1),
            "paged_torch_output_tok_s": round(ref.metrics["throughput.output_tokens_per_s"],
                                              1)}


def engine_rows(profile: Profile, shape: EngineShape, page: int) -> list[dict[str, Any]]:
    return [engine_agreement(profile, shape, page)]


def run_parts(ctx: SectionContext, fns: FlashAttnFns, pages: tuple[int, ...],
              result: dict[str, Any]) -> None:
    """Each part within the section's time; a failing part is recorded, the next runs."""
    p = ctx.profile
    dtype = torch.bfloat16 if p.device == "cuda" else torch.float32
    parts: list[tuple[str, Callable[[], list[dict[str, Any]]]]] = []
    for page in pages:
        parts += [("kernels", partial(check_kernels, p, fns, s, page, dtype))
                  for s in p.quant_sizes]
        parts += [("timings", partial(time_decode, p, fns, s, page))
                  for s in p.timing_sizes[-2:]]
    parts.append(("engine", partial(engine_rows, p, p.shapes[0], pages[-1])))
    for key, part in parts:
        try:
            with time_limit(ctx.left() - 1):
                result[key] += part()
        except Exception as e:
            result[key].append({"error": error_text(e)})
        ctx.save(result)


def flash_attn_section(ctx: SectionContext) -> dict[str, Any]:
    result: dict[str, Any] = {"kernels": [], "timings": [], "engine": []}
    try:
        fns = load_flash_attn4()
    except ValueError as e:
        result["note"] = f"Not run: {e}"
        return result
    from harness.backends.flash_attn import FlashAttnBackend

    FlashAttnBackend.load_kernels = staticmethod(load_flash_attn4)  # the seam
    result["note"] = f"flash-attn {fns.version} (CuTe DSL) through the flash_attn seam."
    pages = GPU_PAGES if ctx.profile.device == "cuda" else GPU_PAGES[:1]
    run_parts(ctx, fns, pages, result)
    return result
