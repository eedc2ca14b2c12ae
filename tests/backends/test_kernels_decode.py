"""Paged decode attention (plain and split-K, windowed, fp8/int8 caches) against the torch
reference, on random caches whose blocks are shuffled.

CPU runs go through Triton's interpreter (conftest sets TRITON_INTERPRET=1): sizes stay
small. The ``gpu`` tests repeat the comparison compiled, at Llama-3-8B head geometry.
"""

from __future__ import annotations

import pytest
import torch

from harness.kernels.cases import PAIRWISE, Geometry, paged_case, tolerance
from harness.kernels.decode import default_splits, paged_decode
from harness.kernels.reference import paged_decode_ref
from harness.kernels.runtime import interpreting


def _lens(bs: int) -> list[int]:
    # One token; exactly one block; mid-block; exactly three blocks; long, mid-block.
    return [1, bs, 2 * bs + 3, 3 * bs, 5 * bs + 5]


def _check(geo: Geometry, lens: list[int], *, num_splits: int | None, window: int = 0,
           sinks: int = 0, cache_dtype: torch.dtype | None = None, device: str = "cpu",
           seed: int = 0) -> None:
    gen = torch.Generator(device).manual_seed(seed)
    case = paged_case(lens, block_size=geo.block_size, num_kv_heads=geo.num_kv_heads,
                      head_dim=geo.head_dim, dtype=geo.dtype, cache_dtype=cache_dtype,
                      device=device, generator=gen)
    q = torch.randn(len(lens), geo.num_heads, geo.head_dim, generator=gen, device=device,
                    dtype=geo.dtype)
    out = paged_decode(q, case.k_cache, case.v_cache, case.tables, case.lens,
                       num_splits=num_splits, window=window, sinks=sinks, **case.scales)
    ref = paged_decode_ref(q, case.k_cache, case.v_cache, case.tables, case.lens,
                           window=window, sinks=sinks, **case.scales)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out, ref, **tolerance(geo.dtype, device))


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("geo", PAIRWISE, ids=str)
def test_decode_matches_reference(geo: Geometry, num_splits: int) -> None:
    # 3 splits of a 1-token sequence leave two splits empty: the reduction must skip them.
    _check(geo, _lens(geo.block_size), num_splits=num_splits)


@pytest.mark.parametrize(("geo", "window", "sinks", "num_splits"), [
    (PAIRWISE[1], 21, 0, 1),   # window only, ends mid-block
    (PAIRWISE[4], 16, 4, 2),   # window of exactly one block + sinks, split
    (PAIRWISE[6], 1, 1, 1),    # only the token itself and the first one
    (PAIRWISE[9], 30, 50, 3),  # more sinks than tokens before the window
], ids=str)
def test_decode_window_and_sinks(geo: Geometry, window: int, sinks: int,
                                 num_splits: int) -> None:
    _check(geo, _lens(geo.block_size), num_splits=num_splits, window=window, sinks=sinks)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8],
                         ids=["fp8", "int8"])
@pytest.mark.parametrize(("geo", "num_splits", "window"), [
    (PAIRWISE[5], 1, 0),
    (PAIRWISE[6], 2, 0),
    (PAIRWISE[3], 1, 20),
], ids=str)
def test_decode_dequantizes_1byte_caches(geo: Geometry, num_splits: int, window: int,
                                          cache_dtype: torch.dtype) -> None:
    _check(geo, _lens(geo.block_size), num_splits=num_splits, window=window, sinks=2,
           cache_dtype=cache_dtype)


def test_decode_writes_into_a_row_slice_of_out() -> None:
    geo = PAIRWISE[3]
    case = paged_case([5, 40], block_size=geo.block_size, num_kv_heads=geo.num_kv_heads,
                      head_dim=geo.head_dim, dtype=geo.dtype)
    q = torch.randn(2, geo.num_heads, geo.head_dim, dtype=geo.dtype)
    out = torch.full((5, geo.num_heads, geo.head_dim), 7.0, dtype=geo.dtype)
    paged_decode(q, case.k_cache, case.v_cache, case.tables, case.lens, out=out[:2])
    ref = paged_decode_ref(q, case.k_cache, case.v_cache, case.tables, case.lens)
    torch.testing.assert_close(out[:2], ref, **tolerance(geo.dtype))
    assert bool((out[2:] == 7.0).all())


def test_default_splits_is_one_off_the_gpu() -> None:
    assert default_splits(1, 8, 32768, torch.device("cpu")) == 1


def test_1byte_cache_without_scales_is_refused() -> None:
    case = paged_case([3], block_size=8, num_kv_heads=1, head_dim=16, dtype=torch.float32,
                      cache_dtype=torch.int8)
    q = torch.randn(1, 1, 16)
    with pytest.raises(AssertionError, match="scale"):
        paged_decode(q, case.k_cache, case.v_cache, case.tables, case.lens)


gpu = pytest.mark.skipif(not torch.cuda.is_available() or interpreting(),
                         reason="needs CUDA and compiled Triton (TRITON_INTERPRET unset)")
LLAMA3_8B = Geometry(4, 8, 128, 16, torch.bfloat16)  # 32 query heads, 8 KV heads


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_splits", [1, 7, None])
def test_decode_gpu_llama3_sizes(num_splits: int | None) -> None:
    lens = [1, 16, 1000, 4096, 4099, 8191, 333, 2048]
    _check(LLAMA3_8B, lens, num_splits=num_splits, device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
def test_decode_gpu_1byte(cache_dtype: torch.dtype) -> None:
    _check(LLAMA3_8B, [17, 4096, 3000], num_splits=4, cache_dtype=cache_dtype, device="cuda")


@pytest.mark.gpu
@gpu
def test_decode_gpu_window_and_other_geometries() -> None:
    _check(LLAMA3_8B, [5000, 20, 4097], num_splits=3, window=1024, sinks=4, device="cuda")
    for geo in PAIRWISE:
        _check(geo, [*_lens(geo.block_size), 1500], num_splits=2, device="cuda")
