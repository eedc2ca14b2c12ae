"""The flash-attn 4 adapter (harness.gpucheck.fa4) and the check's flash-attn section on
the CPU, against a fake of flash-attn 4's one paged entry point.

The fake holds flash-attn 4's argument contract as the adapter uses it (int32 page table
and ``seqused_k``, no ``cu_seqlens_k`` with a page table, batched q for decodes, varlen q
with ``cu_seqlens_q`` for chunks, returns (out, lse)) and computes paged attention with
the flash-attn 2 stand-in's float32 reference. The real kernels run only on the GPU
machine (scripts/gpu_fa4.sh).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from harness.backends.flash_attn import FlashAttnBackend
from harness.gpucheck import fa4
from harness.gpucheck.engine_checks import compose_run, run_overrides
from harness.gpucheck.fa4_check import check_kernels, engine_agreement
from harness.gpucheck.profile import DRY
from harness.runner import run
from tests.flash_attn_standin import FlashAttnStandin, paged_attention_f32


class FakeFa4:
    """``flash_attn.cute.flash_attn_varlen_func`` as far as the adapter calls it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 cu_seqlens_q: torch.Tensor | None = None,
                 cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                 max_seqlen_k: int | None = None, seqused_k: torch.Tensor | None = None,
                 page_table: torch.Tensor | None = None, causal: bool = False,
                 **rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
        assert not rest and causal is True
        assert cu_seqlens_k is None, "page_table is not supported with cu_seqlens_k"
        assert page_table is not None and page_table.dtype == torch.int32
        assert page_table.stride(-1) == 1
        assert seqused_k is not None and seqused_k.dtype == torch.int32
        assert seqused_k.is_contiguous() and seqused_k.shape == (page_table.shape[0],)
        assert k.dim() == 4 and k.shape == v.shape
        scale = q.shape[-1] ** -0.5
        lens = seqused_k.tolist()
        if cu_seqlens_q is None:  # batched: (batch, seqlen_q, H, D)
            assert q.dim() == 4 and q.shape[0] == len(lens)
            self.calls.append("batched")
            out = torch.stack([paged_attention_f32(q[b], k, v, page_table[b], n, scale)
                               for b, n in enumerate(lens)])
        else:
            assert q.dim() == 3 and cu_seqlens_q.dtype == torch.int32
            assert max_seqlen_q is not None and max_seqlen_k is not None
            rows = cu_seqlens_q.tolist()
            assert max_seqlen_q == max(b - a for a, b in itertools.pairwise(rows))
            assert max_seqlen_k == max(lens)
            self.calls.append("varlen")
            out = torch.cat([paged_attention_f32(q[a:b], k, v, page_table[i], lens[i], scale)
                             for i, (a, b) in enumerate(itertools.pairwise(rows))])
        return out.to(q.dtype), torch.zeros(1)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeFa4:
    f = FakeFa4()
    fns = fa4.fa4_fns(f, "fake", device_types=("cpu", "cuda"))
    monkeypatch.setattr(FlashAttnBackend, "load_kernels", staticmethod(lambda: fns))
    return f


def test_adapter_kernels_match_the_references(fake: FakeFa4) -> None:
    fns = FlashAttnBackend.load_kernels()
    for size in [(1, 9), (3, 20)]:
        rows = check_kernels(DRY, fns, size, 8, torch.float32)
        assert [r["kernel"] for r in rows] == ["decode", "prefill"]
        assert all(r["ok"] for r in rows), rows
    assert fake.calls == ["batched", "varlen"] * 2


def test_engine_through_the_seam(fake: FakeFa4, monkeypatch: pytest.MonkeyPatch) -> None:
    row = engine_agreement(DRY, DRY.shapes[0], 16)
    assert row["kernel"] == "flash_attn-fake" and row["requests_identical"].endswith("/3")
    assert {"batched", "varlen"} <= set(fake.calls) and row["output_tok_s"] > 0
    # bf16: the paged torch path rounds otherwise, so its tokens may differ; the flash-attn
    # 2 stand-in computes as the fake does, and the engine must give the same tokens.
    cfg = [*run_overrides(DRY, DRY.shapes[0], ("backend=flash_attn",), warmup=False),
           "model.dtype=bfloat16", "backend.block_size=16"]
    ours = run(compose_run(cfg)).outputs
    standin = FlashAttnStandin(block_multiple=16)
    monkeypatch.setattr(FlashAttnBackend, "load_kernels", staticmethod(standin.fns))
    assert run(compose_run(cfg)).outputs == ours


def test_loader_says_what_to_do_without_flash_attn_4() -> None:
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"gpu_fa4\.sh"):
            fa4.load_flash_attn4()
    else:
        pytest.skip("flash-attn 4 is installed here")
