"""pytest-benchmark: decode attention on CPU, paged (the torch reference path of
``backend=paged``: gather each sequence's blocks through its table, one masked SDPA) vs
contiguous (the same SDPA over K/V already laid out per sequence). The ratio is the price
of the gather on CPU.

Run: ``.venv/bin/python -m pytest tests/benchmarks/test_bench_attention.py
--benchmark-enable``; each size is its own group, so the table's ``(x.xx)`` column is the
paged / contiguous ratio. SmolLM2-135M head geometry (9 query heads, 3 KV heads, head dim
64), float32, block size 16; every sequence at the full context.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness.backends.attention_ref import attend_decode
from harness.kernels.cases import paged_case

H, KV, D, BS = 9, 3, 64, 16
SIZES = [(1, 2048), (8, 512), (8, 2048), (32, 1024)]


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize(("batch", "context"), SIZES, ids=lambda x: str(x))
def test_decode_attention(benchmark: Any, batch: int, context: int, layout: str) -> None:
    gen = torch.Generator().manual_seed(0)
    case = paged_case([context] * batch, block_size=BS, num_kv_heads=KV, head_dim=D,
                      dtype=torch.float32, generator=gen, spare_blocks=0)
    q = torch.randn(batch, H, D, generator=gen)
    kc, vc, tables, lens = case.k_cache, case.v_cache, case.tables, case.lens
    benchmark.group = f"decode {batch} x {context}"
    benchmark.extra_info["kv_bytes"] = 2 * batch * context * KV * D * 4
    if layout == "paged":
        def step() -> torch.Tensor:
            return attend_decode(q, kc[tables].flatten(1, 2), vc[tables].flatten(1, 2), lens)
    else:
        kd, vd = kc[tables].flatten(1, 2).clone(), vc[tables].flatten(1, 2).clone()

        def step() -> torch.Tensor:
            return attend_decode(q, kd, vd, lens)
    out = benchmark(step)
    assert out.shape == (batch, H, D) and bool(torch.isfinite(out).all())
