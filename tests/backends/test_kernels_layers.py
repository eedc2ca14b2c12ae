"""The fused layer kernels (harness.kernels.layers) against their torch references on
random inputs, odd shapes included: RMSNorm with and without the residual add, RoPE on
q and k inside one fused projection's output, SiLU x mul; through the custom ops too."""

from __future__ import annotations

import pytest
import torch

import harness.kernels.ops  # noqa: F401  (torch.ops.kvbench.*)
from harness.kernels.layers import add_rms_norm, rope_qk, silu_mul
from harness.kernels.reference import add_rms_norm_ref, rope_qk_ref, silu_mul_ref

pytest.importorskip("triton")

# The interpreter computes in float32 here; a 16-bit output is one rounding of it, which the
# reference rounds the same way up to an ulp of the dtype (bf16: GPU check).
TOL = {torch.float32: (2e-6, 1e-5), torch.float16: (2e-3, 2e-3)}


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    atol, rtol = TOL[a.dtype]
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("rows,cols", [(1, 16), (5, 40), (7, 123), (3, 576)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm(dtype: torch.dtype, rows: int, cols: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=gen) * 2).to(dtype)
    res = torch.randn(rows, cols, generator=gen).to(dtype)
    w = torch.randn(cols, generator=gen).to(dtype)
    want, want_res = add_rms_norm_ref(x, res if with_residual else None, w, 1e-5)
    out, ours = torch.empty_like(x), res.clone()
    add_rms_norm(x, ours if with_residual else None, w, 1e-5, out)
    _close(out, want)
    if with_residual:
        assert torch.equal(ours, want_res)  # one addition in the dtype, both ways
    else:
        assert torch.equal(ours, res)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (3, 1, 64), (8, 8, 6)])
def test_rope_rotates_q_and_k_in_place_inside_the_projection(
        dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(heads * head_dim)
    t = 9
    qs, ks = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(t, qs + 2 * ks, generator=gen).to(dtype)
    q = qkv[:, :qs].view(t, heads, head_dim)  # strided views, as the model hands them
    k = qkv[:, qs:qs + ks].view(t, kv_heads, head_dim)
    angles = torch.rand(300, head_dim // 2, generator=gen) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.randint(0, 300, (t,), generator=gen)
    want_q, want_k = rope_qk_ref(q, k, cos, sin, positions)
    v = qkv[:, qs + ks:].clone()
    rope_qk(q, k, cos, sin, positions)
    _close(q, want_q)
    _close(k, want_k)
    assert torch.equal(qkv[:, qs + ks:], v)  # v untouched
    again = torch.randn(t, qs + 2 * ks, generator=gen).to(dtype)
    wq, wk = rope_qk_ref(again[:, :qs].view(t, heads, head_dim),
                         again[:, qs:qs + ks].view(t, kv_heads, head_dim), cos, sin, positions)
    torch.ops.kvbench.rope_qkv(again, cos, sin, positions, heads, kv_heads, head_dim)
    _close(again[:, :qs].view(t, heads, head_dim), wq)
    _close(again[:, qs:qs + ks].view(t, kv_heads, head_dim), wk)


def test_rope_matches_the_models_rotation() -> None:
    """The kernel's convention is the model's own (harness.model.rope): rotate-half."""
    from harness.model.rope import RotaryEmbedding

    rope = RotaryEmbedding(16, 10000.0)
    rope.reserve(512)
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(6, 4, 16, generator=gen), torch.randn(6, 2, 16, generator=gen)
    positions = torch.tensor([0, 1, 17, 300, 511, 64])
    want = rope.apply(q, k, positions)
    cos, sin = rope.tables(torch.float32)
    rope_qk(q, k, cos, sin, positions)
    _close(q, want[0])
    _close(k, want[1])


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("rows,inter", [(1, 8), (5, 37), (3, 1536)])
def test_silu_mul(dtype: torch.dtype, rows: int, inter: int) -> None:
    gen = torch.Generator().manual_seed(inter)
    x = (torch.randn(rows, 2 * inter, generator=gen) * 3).to(dtype)
    out = torch.empty(rows, inter, dtype=dtype)
    silu_mul(x, out)
    _close(out, silu_mul_ref(x))
    out2 = torch.empty_like(out)
    torch.ops.kvbench.silu_mul(x, out2)
    assert torch.equal(out, out2)
