"""Paged decode attention: one query token per sequence over its block-tabled context.

Reference: :func:`harness.kernels.reference.paged_decode_ref`.

GQA-aware: one program holds all ``G = H / KV`` query heads of a KV head, so each K/V tile
is read from memory once for the whole group (a (BLOCK_H, D) x (D, BLOCK_N) dot, the
query group padded to 16 rows on the GPU). Online softmax over tiles of ``BLOCK_N`` tokens;
a tile may span several cache blocks (each token's address goes through the block table),
so any block size >= 8 works and the tile size is independent of it.

Split-K (flash-decoding): with ``num_splits > 1`` the grid gets a third axis; split ``s``
covers one contiguous share of the sequence's visible tokens and writes a normalized
partial output plus its log-sum-exp; :func:`_combine_kernel` then merges the splits. It
pays off when batch * KV heads programs leave most of the GPU's SMs idle (small batches,
long contexts).

Windowed attention (``window > 0``): a query at position p sees keys in
``(p - window, p]`` plus the first ``sinks`` positions. The kernel walks only the visible
tokens: virtual index j < n_sink maps to position j, the rest to ``lo + j - n_sink``.

1-byte caches (fp8 e4m3 / int8 with float32 scales per (slot, KV head)): the raw values go
into the dots and the scales are applied to the scores (K) and the probabilities (V), so a
tile is dequantized with two vector multiplies instead of two tile multiplies.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from harness.kernels.common import dot_f32
from harness.kernels.runtime import check_cache, check_scales, interpreting, next_pow2

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, lens_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_sb, stride_st,
    stride_tb, stride_th, stride_cb, stride_ch,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    qk_scale, window, sinks, num_splits,
    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, QUANT: tl.constexpr, FP32_DOT: tl.constexpr,
    SPLIT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # Per-(sequence, KV head) tables and lengths when stride_th / stride_ch are not 0
    # (quest's chosen blocks: every KV head its own).
    ctx = tl.load(lens_ptr + b * stride_cb + kvh * stride_ch).to(tl.int32)
    table_row = table_ptr + b * stride_tb + kvh * stride_th
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)
        n_sink = tl.minimum(sinks, lo)
    else:
        lo = 0
        n_sink = 0
    visible = n_sink + ctx - lo
    share = tl.cdiv(tl.cdiv(visible, num_splits), BLOCK_N) * BLOCK_N
    j_start = split * share
    j_end = tl.minimum(j_start + share, visible)

    g = tl.arange(0, BLOCK_H)
    heads = kvh * G + g
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q_mask = (g < G)[:, None] & dmask[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask,
                other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)  # also the only safe bf16 path in the interpreter

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for j0 in range(j_start, j_end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        nmask = j < j_end
        pos = tl.where(j < n_sink, j, j - n_sink + lo)
        blk = tl.load(table_row + pos // PAGE, mask=nmask, other=0).to(tl.int64)
        off = pos % PAGE
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + (blk * stride_kb + off * stride_kt + kvh * stride_kh)[:, None]
                    + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = dot_f32(q, tl.trans(k), FP32_DOT)
        if QUANT:
            s_off = blk * stride_sb + off * stride_st + kvh
            ks = tl.load(ks_ptr + s_off, mask=nmask, other=0.0)
            s = s * ks[None, :]
        s = tl.where(nmask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + (blk * stride_vb + off * stride_vt + kvh * stride_vh)[:, None]
                    + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        if QUANT:
            vs = tl.load(vs_ptr + s_off, mask=nmask, other=0.0)
            p = p * vs[None, :]
        acc = acc * alpha[:, None] + dot_f32(p.to(q.dtype), v, FP32_DOT)
        m_i = m_new

    # A split with no visible token (short sequence, many splits) has l_i == 0.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    if SPLIT:
        tl.store(o_ptrs + split * stride_os, out, mask=q_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g < G)
    else:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _combine_kernel(
    part_ptr, lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    num_splits,
    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    smask = s < num_splits
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s, mask=smask,
                  other=float("-inf"))
    # Split 0 always holds the first visible token, so the max is finite; empty splits
    # (lse = -inf) weigh 0.
    w = tl.exp2(lse - tl.max(lse, axis=0))
    part = tl.load(part_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps
                   + d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
    out = tl.sum(w[:, None] * part, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=dmask)


# Tokens per tile. 64 keeps a (64, 128) bf16 K tile and its V twin in registers with
# 4 warps; it is also the granularity of a split's share.
BLOCK_N = 64


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            tables: torch.Tensor, lens: torch.Tensor, out: torch.Tensor, num_splits: int,
            window: int, sinks: int, k_scale: torch.Tensor | None,
            v_scale: torch.Tensor | None) -> None:
    _, page, kv, d = check_cache(k_cache, v_cache)
    quant = check_scales(k_cache, k_scale, v_scale)
    batch, h, dq = q.shape
    assert dq == d and h % kv == 0, (q.shape, k_cache.shape)
    assert q.stride(-1) == 1 and out.shape == q.shape and out.stride(-1) == 1
    assert tables.shape[0] == batch and tables.stride(-1) == 1 and not tables.is_floating_point()
    if tables.dim() == 3:  # one table and length per (sequence, KV head)
        assert tables.shape[1] == kv and lens.shape == (batch, kv), (tables.shape, lens.shape)
        t_strides = (tables.stride(0), tables.stride(1), lens.stride(0), lens.stride(1))
    else:
        assert tables.dim() == 2 and lens.shape == (batch,), (tables.shape, lens.shape)
        t_strides = (tables.stride(0), 0, lens.stride(0), 0)
    assert num_splits >= 1 and window >= 0 and sinks >= 0
    if batch == 0:
        return
    g = h // kv
    interp = interpreting() or q.device.type != "cuda"
    # The interpreter computes bf16 on raw bits (FACTS.md): everything in float32 there.
    # Compiled, 16-bit data go into the tensor cores as they are; fp32 stays exact (ieee).
    fp32_dot = interp or q.dtype == torch.float32
    # tl.dot wants >= 16 rows for the tensor cores: pad the query group on the GPU.
    block_h = next_pow2(g) if interp else max(16, next_pow2(g))
    block_d = max(16, next_pow2(d))
    scales = (k_scale, v_scale) if k_scale is not None else (lens, lens)  # unused if no QUANT
    s_strides = (k_scale.stride(0), k_scale.stride(1)) if k_scale is not None else (0, 0)
    split = num_splits > 1
    if split:
        part = torch.empty((batch, h, num_splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((batch, h, num_splits), dtype=torch.float32, device=q.device)
        dst, o_strides = part, part.stride()[:3]
        lse_dst, l_strides = lse, lse.stride()[:2]
    else:
        dst, o_strides = out, (out.stride(0), out.stride(1), 0)
        lse_dst, l_strides = out, (0, 0)
    _decode_kernel[(batch, kv, num_splits)](
        q, k_cache, v_cache, *scales, tables, lens, dst, lse_dst,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *s_strides, *t_strides, *o_strides, *l_strides,
        d ** -0.5 * _LOG2E, window, sinks, num_splits,
        G=g, D=d, PAGE=page, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=BLOCK_N,
        HAS_WINDOW=window > 0, QUANT=quant, FP32_DOT=fp32_dot, SPLIT=split,
        num_warps=4,
    )
    if split:
        _combine_kernel[(batch, h)](
            part, lse, out, *part.stride()[:3], *lse.stride()[:2], out.stride(0),
            out.stride(1), num_splits, D=d, BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d,
            num_warps=4,
        )


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_splits(batch: int, num_kv_heads: int, max_context: int,
                   device: torch.device) -> int:
    """Splits per sequence so that about 4 programs per SM are in flight; each split keeps
    at least 4 tiles. 1 off the GPU (the interpreter runs programs one by one).
    ``max_context`` is a host-side bound (table width * block size): no device sync."""
    if device.type != "cuda" or interpreting():
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    want = triton.cdiv(4 * sms, max(1, batch * num_kv_heads))
    return max(1, min(want, triton.cdiv(max_context, 4 * BLOCK_N), 64))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, *, num_splits: int | None = None,
                 window: int = 0, sinks: int = 0, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V.

    q: (B, H, D), the token at position ``lens[b] - 1``, already in the cache;
    k_cache, v_cache: (num_blocks, block_size, KV, D), H a multiple of KV;
    tables: int (B, max_blocks) block ids; lens: int (B,) context lengths >= 1. Or one
    table and length per KV head: tables (B, KV, max_blocks), lens (B, KV) (quest's
    chosen blocks, :mod:`harness.kernels.quest`).
    num_splits: 1 = one program per (sequence, KV head); > 1 = split-K with a reduction;
    None = :func:`default_splits`. window / sinks: see the module docstring (0 = full).
    k_scale, v_scale: float32 (num_blocks, block_size, KV) for fp8 / int8 caches.
    Returns ``out`` (B, H, D) in q.dtype (allocated when None).
    """
    if out is None:
        out = torch.empty_like(q)
    if num_splits is None:
        num_splits = default_splits(q.shape[0], k_cache.shape[2],
                                    tables.shape[-1] * k_cache.shape[1], q.device)
    _launch(q, k_cache, v_cache, tables, lens, out, num_splits, window, sinks, k_scale,
            v_scale)
    return out
