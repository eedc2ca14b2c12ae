"""Fused layer kernels: what a decoder layer launches besides its matmuls and attention.

On the torch path a Llama layer's norms, RoPE and activation are ~30 small ops (RMSNorm
alone is five: pow, mean, add, rsqrt, two muls; RoPE seven per q and per k), each a kernel
launch on a GPU. Here each is one launch:

- :func:`add_rms_norm`: ``residual += x`` then RMSNorm of the sum (vLLM's
  fused_add_rms_norm): one read of each row, one write of each output;
- :func:`rope_qk`: q and k rotated in place (rotate-half, Hugging Face's convention), cos
  and sin read from the tables at each token's position, every head of a token in one
  program;
- :func:`silu_mul`: ``silu(gate) * up`` of a fused gate/up projection.

Arithmetic in float32, stored in the activation dtype. References:
:func:`harness.kernels.reference.add_rms_norm_ref`, ``rope_qk_ref``, ``silu_mul_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.kernels.runtime import interpreting, next_pow2


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    stride_x, stride_r, stride_o,
    n_cols, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < n_cols
    x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * stride_r + c, mask=mask, other=0.0)
        tl.store(res_ptr + row * stride_r + c, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    y = (xf * inv).to(x.dtype).to(tl.float32)  # rounded to the dtype before the weight, as HF
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(base, stride_h, n, cos, sin, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """Rotate the ``n`` heads at ``base`` (one token) in place, pair (i, i + HALF)."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    m = (h < n)[:, None] & (d < HALF)[None, :]
    p1 = base + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(p1, mask=m, other=0.0)
    x2 = tl.load(p1 + HALF, mask=m, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(p1, (a * cos[None, :] - b * sin[None, :]).to(x1.dtype), mask=m)
    tl.store(p1 + HALF, (b * cos[None, :] + a * sin[None, :]).to(x1.dtype), mask=m)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
    H: tl.constexpr, KV: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    cos = tl.load(cos_ptr + pos * stride_c + d, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_c + d, mask=dmask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, H, cos, sin, HALF, BLOCK_H, BLOCK_D)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, KV, cos, sin, HALF, BLOCK_H, BLOCK_D)


@triton.jit
def _silu_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, n_cols,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < n_cols
    g = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n_cols + c, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + c, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, out: torch.Tensor) -> None:
    """``out`` (T, C) = RMSNorm(x + residual) * weight, and ``residual`` (T, C) becomes
    x + residual, in place (None: the norm of x alone). Rows contiguous."""
    t, n = x.shape
    assert x.stride(-1) == 1 and out.shape == x.shape and out.stride(-1) == 1
    assert weight.shape == (n,) and weight.is_contiguous()
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
        assert residual.dtype == x.dtype
    if t == 0:
        return
    res = residual if residual is not None else x
    _add_rms_norm_kernel[(t,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0),
                               n, eps, HAS_RES=residual is not None, BLOCK=next_pow2(n))


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            positions: torch.Tensor) -> None:
    """Rotate q (T, H, D) and k (T, KV, D) in place (views with unit stride on D, any
    token and head strides: q and k may live in one fused projection's output) by each
    token's position (T,): cos, sin (P, D/2) tables, positions < P."""
    t, h, d = q.shape
    kv = k.shape[1]
    assert k.shape == (t, kv, d) and d % 2 == 0 and q.stride(-1) == 1 and k.stride(-1) == 1
    assert cos.shape == sin.shape and cos.shape[1] == d // 2 and cos.stride() == sin.stride()
    assert cos.stride(-1) == 1 and positions.shape == (t,)
    if t == 0:
        return
    _rope_kernel[(t,)](q, k, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0),
                       k.stride(1), cos.stride(0), H=h, KV=kv, HALF=d // 2,
                       BLOCK_H=next_pow2(max(h, kv)), BLOCK_D=next_pow2(d // 2))


def silu_mul(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (T, I) = silu(x[:, :I]) * x[:, I:] of a gate/up output x (T, 2I)."""
    t, two = x.shape
    n = two // 2
    assert two == 2 * n and out.shape == (t, n) and x.stride(-1) == 1 and out.stride(-1) == 1
    if t == 0:
        return
    block = min(next_pow2(n), 4096 if interpreting() else 1024)
    _silu_mul_kernel[(t, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n,
                                                BLOCK=block)
