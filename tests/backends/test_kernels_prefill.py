"""Paged prefill / extend attention against the torch reference: chunks that start a
sequence, extend a cached prefix, end on and off block boundaries, and one-token chunks.

CPU runs go through Triton's interpreter; the ``gpu`` test repeats it compiled at
Llama-3-8B head geometry with long prefixes.
"""

from __future__ import annotations

import pytest
import torch

from harness.backends.attention_ref import attend_chunk
from harness.kernels.cases import PAIRWISE, Geometry, paged_case, tolerance
from harness.kernels.prefill import paged_prefill
from harness.kernels.reference import paged_prefill_ref
from harness.kernels.runtime import interpreting


def _chunks(bs: int) -> list[tuple[int, int]]:
    """(start, num_tokens): a fresh prompt ending mid-block; an extension ending exactly
    on a block boundary; a one-token chunk; a chunk starting on a boundary."""
    return [(0, bs + 3), (bs + 5, 2 * bs - 5), (7, 1), (bs, 5)]


def _check(geo: Geometry, chunks: list[tuple[int, int]], *, window: int = 0, sinks: int = 0,
           cache_dtype: torch.dtype | None = None, device: str = "cpu", lead_rows: int = 2,
           seed: int = 0) -> None:
    gen = torch.Generator(device).manual_seed(seed)
    case = paged_case([s + n for s, n in chunks], block_size=geo.block_size,
                      num_kv_heads=geo.num_kv_heads, head_dim=geo.head_dim, dtype=geo.dtype,
                      cache_dtype=cache_dtype, device=device, generator=gen)
    # The chunks follow ``lead_rows`` rows (the step's decodes) that they must not touch.
    rows = [lead_rows]
    for _, n in chunks:
        rows.append(rows[-1] + n)
    cu = torch.tensor(rows, device=device)
    starts = torch.tensor([s for s, _ in chunks], device=device)
    q = torch.randn(rows[-1], geo.num_heads, geo.head_dim, generator=gen, device=device,
                    dtype=geo.dtype)
    out = paged_prefill(q, case.k_cache, case.v_cache, cu, starts, case.tables,
                        max(n for _, n in chunks), window=window, sinks=sinks, **case.scales)
    ref = paged_prefill_ref(q, case.k_cache, case.v_cache, cu, starts, case.tables,
                            window=window, sinks=sinks, **case.scales)
    torch.testing.assert_close(out, ref, **tolerance(geo.dtype, device))
    assert bool((out[:lead_rows] == 0).all())


@pytest.mark.parametrize("geo", PAIRWISE, ids=str)
def test_prefill_matches_reference(geo: Geometry) -> None:
    _check(geo, _chunks(geo.block_size))


@pytest.mark.parametrize(("geo", "window", "sinks"), [
    (PAIRWISE[2], 10, 0),    # shorter than a chunk: early rows and late rows see apart
    (PAIRWISE[4], 16, 3),
    (PAIRWISE[6], 1, 2),     # each token sees itself and the sinks only
], ids=str)
def test_prefill_window_and_sinks(geo: Geometry, window: int, sinks: int) -> None:
    _check(geo, _chunks(geo.block_size), window=window, sinks=sinks)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8],
                         ids=["fp8", "int8"])
def test_prefill_dequantizes_1byte_caches(cache_dtype: torch.dtype) -> None:
    _check(PAIRWISE[7], _chunks(16), cache_dtype=cache_dtype)
    _check(PAIRWISE[4], _chunks(16), window=12, sinks=1, cache_dtype=cache_dtype)


def test_reference_windows_agree_with_the_backend_reference() -> None:
    # The kernels' reference and the backends' SDPA reference read "window" the same way.
    geo = PAIRWISE[4]
    case = paged_case([40], block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    q = torch.randn(25, geo.num_heads, 64)
    k = case.k_cache[case.tables[0]].flatten(0, 1)[:40]
    v = case.v_cache[case.tables[0]].flatten(0, 1)[:40]
    for window, sinks in ((0, 0), (7, 0), (7, 3)):
        ours = paged_prefill_ref(q, case.k_cache, case.v_cache, torch.tensor([0, 25]),
                                 torch.tensor([15]), case.tables, window=window, sinks=sinks)
        theirs = attend_chunk(q, k, v, 15, window or None, sinks)
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


gpu = pytest.mark.skipif(not torch.cuda.is_available() or interpreting(),
                         reason="needs CUDA and compiled Triton (TRITON_INTERPRET unset)")


@pytest.mark.gpu
@gpu
def test_prefill_gpu_llama3_sizes() -> None:
    geo = Geometry(4, 8, 128, 16, torch.bfloat16)
    chunks = [(0, 2048), (3000, 512), (4096, 1), (100, 777), (0, 1)]
    _check(geo, chunks, device="cuda")
    _check(geo, chunks, window=1024, sinks=4, device="cuda")
    _check(geo, chunks[:3], cache_dtype=torch.float8_e4m3fn, device="cuda")
    for g in PAIRWISE:
        _check(g, [*_chunks(g.block_size), (300, 200)], device="cuda")
