"""KIVI's decode (Liu et al., 2024): 2/4-bit keys and values dequantized inside the kernel.

The cache (backends.kivi): per block, codes packed ``8 / bits`` to a byte along head_dim
(low bits first), keys' float16 scale and zero per (block, KV head, channel), values'
per (slot, KV head); a block still filling lives in full precision in a residual slab
(``slab_map[block] >= 0``). Each tile of tokens loads the codes of the quantized ones and
the residual rows of the others (masked loads: a token reads one or the other), and
dequantizes in registers, ``code * scale + zero`` in float32; the rest is the paged
decode's (:mod:`harness.kernels.decode`): one program per (sequence, KV head) holding its
query heads, online softmax over tiles that may span blocks, split-K merged by its
combine kernel. Nothing is dequantized in memory.

Reference: :func:`harness.kernels.reference.kivi_decode_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.kernels.common import dot_f32
from harness.kernels.decode import BLOCK_N, combine_splits, default_splits
from harness.kernels.runtime import interpreting, next_pow2

_LOG2E = 1.4426950408889634


@triton.jit
def _kivi_decode_kernel(
    q_ptr, kq_ptr, vq_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, slab_ptr, rk_ptr, rv_ptr,
    table_ptr, lens_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qh,
    stride_cb, stride_ct, stride_ch,
    stride_kb, stride_kh,
    stride_vb, stride_vt,
    stride_rb, stride_rt, stride_rh,
    stride_tb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    qk_scale, num_splits,
    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr, SPLIT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    share = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    j_start = split * share
    j_end = tl.minimum(j_start + share, ctx)

    g = tl.arange(0, BLOCK_H)
    heads = kvh * G + g
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q_mask = (g < G)[:, None] & dmask[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask,
                other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)  # also the only safe bf16 path in the interpreter
    # Channel d's code: byte d // (8 / BITS), bits from (d % (8 / BITS)) * BITS.
    byte = d // (8 // BITS)
    shift = (d % (8 // BITS)) * BITS
    cmask = (1 << BITS) - 1

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for j0 in range(j_start, j_end, BLOCK_N):
        pos = j0 + tl.arange(0, BLOCK_N)
        nmask = pos < j_end
        blk = tl.load(table_ptr + b * stride_tb + pos // PAGE, mask=nmask, other=0).to(tl.int64)
        off = pos % PAGE
        slab = tl.load(slab_ptr + blk, mask=nmask, other=-1)
        res = slab >= 0  # a block still filling: its full-precision residual slab
        qm = (nmask & (slab < 0))[:, None] & dmask[None, :]
        rm = res[:, None] & dmask[None, :]
        c_off = (blk * stride_cb + off * stride_ct + kvh * stride_ch)[:, None] + byte[None, :]
        r_off = ((tl.maximum(slab, 0) * stride_rb + off * stride_rt
                  + kvh * stride_rh)[:, None] + d[None, :])

        # Keys: scale and zero per (block, channel).
        kc = (tl.load(kq_ptr + c_off, mask=qm, other=0).to(tl.int32) >> shift[None, :]) & cmask
        kg = (blk * stride_kb + kvh * stride_kh)[:, None] + d[None, :]
        k = (kc.to(tl.float32) * tl.load(ks_ptr + kg, mask=qm, other=0.0).to(tl.float32)
             + tl.load(kz_ptr + kg, mask=qm, other=0.0).to(tl.float32))
        k = tl.where(res[:, None], tl.load(rk_ptr + r_off, mask=rm, other=0.0).to(tl.float32), k)
        s = dot_f32(q, tl.trans(k.to(q.dtype)), FP32_DOT)
        s = tl.where(nmask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        # Values: scale and zero per (slot, KV head).
        vc = (tl.load(vq_ptr + c_off, mask=qm, other=0).to(tl.int32) >> shift[None, :]) & cmask
        vg = blk * stride_vb + off * stride_vt + kvh
        tm = nmask & (slab < 0)
        v = (vc.to(tl.float32) * tl.load(vs_ptr + vg, mask=tm, other=0.0).to(tl.float32)[:, None]
             + tl.load(vz_ptr + vg, mask=tm, other=0.0).to(tl.float32)[:, None])
        v = tl.where(res[:, None], tl.load(rv_ptr + r_off, mask=rm, other=0.0).to(tl.float32), v)
        acc = acc * alpha[:, None] + dot_f32(p.to(q.dtype), v.to(q.dtype), FP32_DOT)
        m_i = m_new

    # A split with no token (short sequence, many splits) has l_i == 0.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    if SPLIT:
        tl.store(o_ptrs + split * stride_os, out, mask=q_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g < G)
    else:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def kivi_decode(q: torch.Tensor, k_q: torch.Tensor, v_q: torch.Tensor, k_scale: torch.Tensor,
                k_zero: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
                slab_map: torch.Tensor, res_k: torch.Tensor, res_v: torch.Tensor,
                tables: torch.Tensor, lens: torch.Tensor, bits: int, *,
                num_splits: int | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its KIVI-quantized paged K/V.

    q: (B, H, D), the token at position ``lens[b] - 1``, already stored;
    k_q, v_q: uint8 (num_blocks, block_size, KV, D * bits / 8) packed codes;
    k_scale, k_zero: float16 (num_blocks, KV, D), per block and channel;
    v_scale, v_zero: float16 (num_blocks, block_size, KV), per slot;
    slab_map: int64 (num_blocks,) each block's residual slab, -1 for a quantized block;
    res_k, res_v: (slabs, block_size, KV, D) full precision;
    tables: int (B, max_blocks); lens: int (B,) context lengths >= 1; bits: 2 or 4.
    num_splits: None = :func:`~harness.kernels.decode.default_splits`.
    Returns ``out`` (B, H, D) in q.dtype (allocated when None).
    """
    nb, page, kv, packed = k_q.shape
    batch, h, d = q.shape
    assert bits in (2, 4) and packed * 8 == d * bits, (k_q.shape, q.shape, bits)
    assert k_q.dtype == v_q.dtype == torch.uint8 and v_q.stride() == k_q.stride()
    assert k_q.stride(-1) == 1 and h % kv == 0 and q.stride(-1) == 1
    assert k_scale.shape == k_zero.shape == (nb, kv, d) and k_scale.stride() == k_zero.stride()
    assert v_scale.shape == v_zero.shape == (nb, page, kv) and v_scale.stride() == v_zero.stride()
    assert k_scale.stride(-1) == 1 and v_scale.stride(-1) == 1
    assert slab_map.shape == (nb,) and slab_map.dtype == torch.int64 and slab_map.stride(0) == 1
    assert res_k.shape[1:] == (page, kv, d) and res_v.shape == res_k.shape
    assert res_k.stride() == res_v.stride() and res_k.stride(-1) == 1
    assert tables.dim() == 2 and tables.shape[0] == batch and tables.stride(1) == 1
    assert lens.shape == (batch,) and lens.stride(0) == 1 and not tables.is_floating_point()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = default_splits(batch, kv, tables.shape[1] * page, q.device)
    g = h // kv
    interp = interpreting() or q.device.type != "cuda"
    fp32_dot = interp or q.dtype == torch.float32
    block_h = next_pow2(g) if interp else max(16, next_pow2(g))
    block_d = max(16, next_pow2(d))
    split = num_splits > 1
    if split:
        part = torch.empty((batch, h, num_splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((batch, h, num_splits), dtype=torch.float32, device=q.device)
        dst, o_strides = part, part.stride()[:3]
        lse_dst, l_strides = lse, lse.stride()[:2]
    else:
        dst, o_strides = out, (out.stride(0), out.stride(1), 0)
        lse_dst, l_strides = out, (0, 0)
    _kivi_decode_kernel[(batch, kv, num_splits)](
        q, k_q, v_q, k_scale, k_zero, v_scale, v_zero, slab_map, res_k, res_v, tables, lens,
        dst, lse_dst,
        q.stride(0), q.stride(1),
        k_q.stride(0), k_q.stride(1), k_q.stride(2),
        k_scale.stride(0), k_scale.stride(1),
        v_scale.stride(0), v_scale.stride(1),
        res_k.stride(0), res_k.stride(1), res_k.stride(2),
        tables.stride(0), *o_strides, *l_strides,
        d ** -0.5 * _LOG2E, num_splits,
        G=g, D=d, PAGE=page, BITS=bits, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=BLOCK_N,
        FP32_DOT=fp32_dot, SPLIT=split, num_warps=4,
    )
    if split:
        combine_splits(part, lse, out)
    return out
