"""pytest-benchmark: the host time of one kernel launch through its torch op
(``torch.ops.kvbench.*``) with the kernel itself stubbed out: what kvbench adds around each
Triton launch (the op's dispatch, argument checks, strides, the grid), before Triton's
own launch. Target (issue #50): <= 15 us a launch. Measured at Llama-3-8B's geometry on a
decode batch of 32, so the argument shapes are a real step's.

Run: ``.venv/bin/python -m pytest tests/benchmarks/test_bench_launch.py --benchmark-enable``.
Without ``--benchmark-enable`` each body runs once, as a test of the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

import harness.kernels.ops  # noqa: F401  (registers torch.ops.kvbench.*)
from harness.kernels import decode, layers, store

B, H, KV, D, BS, NB, HIDDEN, INTER = 32, 32, 8, 128, 16, 512, 4096, 14336


class _NoKernel:
    """A ``@triton.jit`` kernel that launches nothing (``kernel[grid](...)``)."""

    def __init__(self) -> None:
        self.calls = 0

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.calls += 1
        return launch


@pytest.fixture
def stubbed(monkeypatch: pytest.MonkeyPatch) -> Iterator[_NoKernel]:
    stub = _NoKernel()
    for mod, names in ((decode, ("_decode_kernel", "_combine_kernel")),
                       (store, ("_store_kv_kernel", "_store_kv_quant_kernel")),
                       (layers, ("_add_rms_norm_kernel", "_rope_kernel", "_silu_mul_kernel"))):
        for name in names:
            monkeypatch.setattr(mod, name, stub)
    yield stub


def _cases() -> dict[str, Callable[[], None]]:
    q = torch.randn(B, H, D)
    kc = torch.zeros(NB, BS, KV, D)
    vc = torch.zeros_like(kc)
    tables = torch.zeros(B, 32, dtype=torch.int64)
    lens = torch.full((B,), 300)
    out = torch.empty_like(q)
    k, v, slots = torch.randn(B, KV, D), torch.randn(B, KV, D), torch.arange(B)
    x, res, w = torch.randn(B, HIDDEN), torch.randn(B, HIDDEN), torch.randn(HIDDEN)
    xo = torch.empty_like(x)
    qkv = torch.randn(B, (H + 2 * KV) * D)
    cos, sin, pos = torch.randn(2048, D // 2), torch.randn(2048, D // 2), torch.arange(B)
    gate_up, act = torch.randn(B, 2 * INTER), torch.empty(B, INTER)
    ops = torch.ops.kvbench
    return {
        "store_kv": lambda: ops.store_kv(k, v, kc, vc, slots),
        "paged_decode": lambda: ops.paged_decode(q, kc, vc, tables, lens, out, 1, 0, 0,
                                                 None, None),
        "add_rms_norm": lambda: ops.add_rms_norm(x, res, w, 1e-5, xo),
        "rope_qkv": lambda: ops.rope_qkv(qkv, cos, sin, pos, H, KV, D),
        "silu_mul": lambda: ops.silu_mul(gate_up, act),
    }


@pytest.mark.parametrize("name", ["store_kv", "paged_decode", "add_rms_norm", "rope_qkv",
                                  "silu_mul"])
def test_launch_host_time(benchmark: Any, stubbed: _NoKernel, name: str) -> None:
    launch = _cases()[name]
    benchmark.pedantic(launch, rounds=2000, warmup_rounds=100)
    assert stubbed.calls >= 1  # the launcher reached the kernel
