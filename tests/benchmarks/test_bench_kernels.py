"""pytest-benchmark: our Triton kernels next to the torch paths the backends use otherwise.

On CUDA (compiled; the GPU check's ``benchmarks`` section, ``TRITON_INTERPRET=0``):
Llama-3-8B head geometry (32 query heads, 8 KV heads, head dim 128), bf16, block size 16;
decode at batch x context 1 x 4k, 16 x 8k, 64 x 8k (our kernel; the ``paged`` backend's
torch path, gather + masked SDPA; SDPA over contiguous K/V), one 512-token prefill chunk
over a 4k prefix (our kernel; gather + SDPA), and storing 64 tokens (our kernel; indexed
copy). Elsewhere the same tests run under Triton's interpreter at tiny sizes: in the
suite (benchmarks disabled) each body runs once, so this file cannot rot; the times mean
nothing there. Each size is its own group: the ``(x.xx)`` column is the ratio to the
fastest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from harness.backends.attention_ref import attend_chunk, attend_decode
from harness.kernels.cases import paged_case
from harness.kernels.runtime import interpreting

CUDA = torch.cuda.is_available() and not interpreting()
DEV = "cuda" if CUDA else "cpu"
if CUDA:
    H, KV, D, BS, DTYPE = 32, 8, 128, 16, torch.bfloat16
    DECODE = [(1, 4096), (16, 8192), (64, 8192)]
    CHUNK, PREFIX, STORE = 512, 4096, 64
else:
    H, KV, D, BS, DTYPE = 4, 2, 16, 8, torch.float32
    DECODE = [(2, 20)]
    CHUNK, PREFIX, STORE = 5, 11, 6


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _run(benchmark: Any, fn: Callable[[], object], group: str, **info: Any) -> None:
    def step() -> None:
        fn()
        _sync()

    fn()  # compile / warm outside the timing
    _sync()
    benchmark.group = group
    benchmark.extra_info.update(device=DEV, **info)
    benchmark(step)


@pytest.mark.parametrize("provider", ["triton", "torch-gather", "contiguous"])
@pytest.mark.parametrize(("batch", "context"), DECODE, ids=str)
def test_decode(benchmark: Any, batch: int, context: int, provider: str) -> None:
    from harness.kernels.decode import paged_decode

    gen = torch.Generator(DEV).manual_seed(0)
    case = paged_case([context] * batch, block_size=BS, num_kv_heads=KV, head_dim=D,
                      dtype=DTYPE, device=DEV, generator=gen, spare_blocks=0)
    q = torch.randn(batch, H, D, generator=gen, device=DEV, dtype=DTYPE)
    kc, vc, tables, lens = case.k_cache, case.v_cache, case.tables, case.lens
    fns: dict[str, Callable[[], object]] = {
        "triton": lambda: paged_decode(q, kc, vc, tables, lens),
        "torch-gather": lambda: attend_decode(q, kc[tables].flatten(1, 2),
                                              vc[tables].flatten(1, 2), lens),
    }
    if provider == "contiguous":
        kd, vd = kc[tables].flatten(1, 2).clone(), vc[tables].flatten(1, 2).clone()
        fns["contiguous"] = lambda: attend_decode(q, kd, vd, lens)
    _run(benchmark, fns[provider], f"decode {batch} x {context}",
         kv_bytes=2 * batch * context * KV * D * q.element_size())


@pytest.mark.parametrize("provider", ["triton", "torch-gather"])
def test_prefill_chunk(benchmark: Any, provider: str) -> None:
    from harness.kernels.prefill import paged_prefill

    gen = torch.Generator(DEV).manual_seed(1)
    ctx = PREFIX + CHUNK
    case = paged_case([ctx], block_size=BS, num_kv_heads=KV, head_dim=D, dtype=DTYPE,
                      device=DEV, generator=gen)
    q = torch.randn(CHUNK, H, D, generator=gen, device=DEV, dtype=DTYPE)
    rows = torch.tensor([0, CHUNK], device=DEV)
    starts = torch.tensor([PREFIX], device=DEV)
    kc, vc, table = case.k_cache, case.v_cache, case.tables

    def gathered() -> torch.Tensor:
        k = kc[table[0]].flatten(0, 1)[:ctx]
        v = vc[table[0]].flatten(0, 1)[:ctx]
        return attend_chunk(q, k, v, PREFIX)

    fns: dict[str, Callable[[], object]] = {
        "triton": lambda: paged_prefill(q, kc, vc, rows, starts, table, CHUNK),
        "torch-gather": gathered,
    }
    _run(benchmark, fns[provider], f"prefill {CHUNK} over {PREFIX}")


@pytest.mark.parametrize("provider", ["triton", "torch"])
def test_store(benchmark: Any, provider: str) -> None:
    from harness.kernels.reference import store_kv_ref
    from harness.kernels.store import store_kv

    gen = torch.Generator(DEV).manual_seed(2)
    case = paged_case([STORE * 4], block_size=BS, num_kv_heads=KV, head_dim=D, dtype=DTYPE,
                      device=DEV, generator=gen)
    k = torch.randn(STORE, KV, D, generator=gen, device=DEV, dtype=DTYPE)
    v = torch.randn_like(k)
    slots = torch.randperm(case.k_cache.shape[0] * BS, generator=gen, device=DEV)[:STORE]
    fn = store_kv if provider == "triton" else store_kv_ref
    _run(benchmark, lambda: fn(k, v, case.k_cache, case.v_cache, slots), f"store {STORE}")
