"""flash_attn: the adapter against a strict stand-in on CPU (the kernels' argument contract,
paged attention from shuffled tables), its start-up failures, and the real kernels in `gpu`
tests wherever flash-attn is installed."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import types
from typing import Any

import pytest
import torch

from harness.backends.attention_ref import attend_chunk
from harness.backends.base import KVLayout
from harness.backends.flash_attn import FlashAttnBackend
from harness.backends.flash_attn_seam import NOT_INSTALLED, load_flash_attn
from harness.runner import run
from tests.compose import tiny
from tests.flash_attn_standin import (
    FlashAttnStandin,
    PagedScenario,
    allocated,
    run_scenario,
    standard_scenario,
)

CPU = torch.device("cpu")
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
# (atol, rtol): the stand-in and the reference differ only in rounding the fp32 result.
TOL = {torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 1.6e-2)}


def _has_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()


gpu = pytest.mark.skipif(not _has_flash_attn(), reason="needs flash-attn and CUDA")


def reference(sc: PagedScenario, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """attention_ref over each sequence's contiguous K/V, from the same dtype-rounded
    inputs the cache holds, in float32."""
    def r(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).float()
    return [[attend_chunk(r(q), r(sc.k[i][:s + n]), r(sc.v[i][:s + n]), s)
             for (i, s, n), q in zip(items, qs)] for items, qs in zip(sc.steps, sc.q)]


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> FlashAttnStandin:
    """The stand-in, put where FlashAttnBackend takes its kernels from."""
    s = FlashAttnStandin()
    monkeypatch.setattr(FlashAttnBackend, "load_kernels", staticmethod(lambda: s.fns()))
    return s


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bs", [256, 16])  # 16: the stand-in told to allow it, more blocks
def test_adapter_matches_reference_on_shuffled_tables(standin: FlashAttnStandin,
                                                      dtype: torch.dtype, bs: int) -> None:
    standin.block_multiple = bs
    sc = standard_scenario(bs)
    flat = [b for t in sc.tables for b in t]
    assert flat != sorted(flat)  # shuffled: logical order is not physical order
    outs = run_scenario(allocated("flash_attn", sc, dtype), sc, dtype)
    for step, (got, want) in enumerate(zip(outs, reference(sc, dtype))):
        for item, g, w in zip(sc.steps[step], got, want):
            assert g.dtype == dtype
            atol, rtol = TOL[dtype]
            torch.testing.assert_close(g.float(), w, atol=atol, rtol=rtol, msg=f"{step} {item}")
    # Decodes went through flash_attn_with_kvcache, chunks through the varlen function,
    # once per step each: step 0's 1-token prefill is a decode.
    assert standin.calls == [("kvcache", 1), ("varlen", 2), ("kvcache", 1), ("varlen", 3),
                             ("kvcache", 3), ("varlen", 1)]


def test_step_arguments_are_int32_and_exact(standin: FlashAttnStandin) -> None:
    sc = standard_scenario(256)
    be = allocated("flash_attn", sc, torch.bfloat16)
    run_scenario(be, sc, torch.bfloat16)
    st = be._step
    assert st is not None and st.prefill_table is not None and st.decode_table is not None
    for t in (st.decode_table, st.cache_seqlens, st.prefill_table, st.cu_seqlens_q,
              st.cu_seqlens_k):
        assert t is not None and t.dtype == torch.int32
    assert st.cache_seqlens.tolist() == [256 + 45, 256 + 2, 2 * 256 + 1]
    assert st.cu_seqlens_q.tolist() == [0, 7] and st.cu_seqlens_k.tolist() == [0, 7]


def _good_varlen_args(bs: int = 256) -> dict[str, Any]:
    kc = torch.zeros(4, bs, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    return {"q": torch.zeros(10, HEADS, HEAD_DIM, dtype=torch.bfloat16), "k": kc,
            "v": kc.clone(), "cu_seqlens_q": torch.tensor([0, 3, 10], dtype=torch.int32),
            "cu_seqlens_k": torch.tensor([0, 5, 300], dtype=torch.int32), "max_seqlen_q": 7,
            "max_seqlen_k": 295, "causal": True,
            "block_table": torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)}


BAD_VARLEN: dict[str, dict[str, Any]] = {
    "int64 block_table": {"block_table": torch.tensor([[2, 0], [1, 3]])},
    "fp32 q": {"q": torch.zeros(10, HEADS, HEAD_DIM)},
    "not causal": {"causal": False},
    "page of 16": {"k": torch.zeros(64, 16, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)},
    "max_seqlen_q too small": {"max_seqlen_q": 3},
    "int64 cu_seqlens": {"cu_seqlens_k": torch.tensor([0, 5, 300])},
    "cu_seqlens not monotone": {"cu_seqlens_q": torch.tensor([0, 11, 10], dtype=torch.int32)},
    "q last dim strided": {"q": torch.zeros(10, HEADS, 2 * HEAD_DIM,
                                            dtype=torch.bfloat16)[..., ::2]},
    "table too narrow": {"block_table": torch.tensor([[2], [1]], dtype=torch.int32)},
}


@pytest.mark.parametrize("bad", list(BAD_VARLEN))
def test_standin_is_strict(bad: str) -> None:
    s = FlashAttnStandin()
    s.flash_attn_varlen_func(**_good_varlen_args())
    with pytest.raises(AssertionError):
        s.flash_attn_varlen_func(**{**_good_varlen_args(), **BAD_VARLEN[bad]})
    kc = torch.zeros(4, 256, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    q = torch.zeros(2, 1, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    table, lens = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32), torch.tensor([5, 300])
    with pytest.raises(AssertionError, match="int32"):
        s.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens, block_table=table, causal=True)
    with pytest.raises(AssertionError, match="no k="):
        s.flash_attn_with_kvcache(q, kc, kc, k=q, v=q, cache_seqlens=lens.int(),
                                  block_table=table, causal=True)


def test_engine_tokens_equal_paged(standin: FlashAttnStandin) -> None:
    common = ("model.dtype=bfloat16", "backend.block_size=256", "cache.kv_budget=2MiB")
    fa = run(tiny("backend=flash_attn", *common))
    ref = run(tiny("backend=paged", "backend.kernel=torch", *common))
    assert fa.metrics["run.kernel"] == "flash_attn-standin"
    assert {k for k, _ in standin.calls} == {"kvcache", "varlen"}
    assert fa.outputs == ref.outputs and sum(map(len, fa.outputs.values())) > 0


# -- start-up failures ------------------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None,
                    reason="flash-attn is installed here")
def test_fails_at_start_without_flash_attn() -> None:
    with pytest.raises(ValueError) as e:
        run(tiny("backend=flash_attn", "model.dtype=bfloat16"))
    assert str(e.value) == NOT_INSTALLED
    assert "pip install flash-attn --no-build-isolation" in NOT_INSTALLED
    assert "backend=paged" in NOT_INSTALLED


@pytest.mark.parametrize("version,cuda,expect", [
    ("2.5.9", True, "2.6 or newer"),
    ("3.0.0b1", True, "flash-attn 2.x"),
    ("2.7.4.post1", False, "CUDA is not available"),
])
def test_seam_says_what_is_wrong(monkeypatch: pytest.MonkeyPatch, version: str, cuda: bool,
                                 expect: str) -> None:
    fake = types.ModuleType("flash_attn")
    fake.__version__ = version  # type: ignore[attr-defined]
    fake.__spec__ = importlib.util.spec_from_loader("flash_attn", loader=None)
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    with pytest.raises(ValueError, match=expect):
        load_flash_attn()


@pytest.mark.parametrize("change,expect", [
    ({"block_size": 128}, "backend.block_size=256"),
    ({"dtype": torch.float32}, "model.dtype=bfloat16"),
    ({"head_dim": 20}, "multiple of 8"),
    ({"device_types": ("cuda",)}, "set device=cuda"),
])
def test_constraints_checked_at_start(monkeypatch: pytest.MonkeyPatch,
                                      change: dict[str, Any], expect: str) -> None:
    fns = dataclasses.replace(FlashAttnStandin().fns(),
                              device_types=change.get("device_types", ("cpu",)))
    monkeypatch.setattr(FlashAttnBackend, "load_kernels", staticmethod(lambda: fns))
    layout = KVLayout(1, KV_HEADS, change.get("head_dim", HEAD_DIM),
                      change.get("dtype", torch.bfloat16))
    with pytest.raises(ValueError, match=expect):
        FlashAttnBackend(layout, CPU, block_size=change.get("block_size", 256))


# -- the real kernels --------------------------------------------------------------------

@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_real_kernels_match_reference(dtype: torch.dtype) -> None:
    sc = standard_scenario(256)
    outs = run_scenario(allocated("flash_attn", sc, dtype, "cuda"), sc, dtype)
    for got, want in zip(outs, reference(sc, dtype)):
        for g, w in zip(got, want):
            torch.testing.assert_close(g.float(), w, atol=TOL[dtype][0], rtol=TOL[dtype][1])


@pytest.mark.gpu
@gpu
def test_real_kernels_engine_tokens_equal_paged() -> None:
    common = ("model.dtype=bfloat16", "backend.block_size=256", "cache.kv_budget=2MiB",
              "device=cuda")
    fa = run(tiny("backend=flash_attn", *common))
    ref = run(tiny("backend=paged", "backend.kernel=torch", *common))
    assert fa.metrics["run.kernel"].startswith("flash_attn-2.")
    assert fa.outputs == ref.outputs
