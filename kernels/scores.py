"""Attention weights per cached slot: what the token-evicting methods score keys by.

h2o sums the attention each key receives, tova keeps the current query's, observed
attention averages over the queries that saw a key, snapkv sums its observation window's
per query head. All of them are sums of softmax weights over some query rows; the weights
need each row's log-sum-exp, which is known only once the attention has seen every key. So
the attention kernels (slot-list form: :mod:`harness.kernels.decode`,
:mod:`harness.kernels.prefill`) write it, and one launch here turns it into weights:

- :func:`decode_weights`, after the decode: the decode kernel also wrote each visited
  slot's logit (a scratch row per query head), so this pass reads 4 bytes per (head, key)
  and no K: ``out[slot] += coef x sum_h exp2(logit - lse_h)``.
- :func:`prefill_weights`, after the prefill: the chunk's rows times the keys is too many
  logits to keep (a 256-token chunk over 32k keys at 32 heads: 1 GiB), so q.k is computed
  again, for the rows that score (``row_lo .. row_hi`` of each chunk: all for h2o, the last
  for tova, the window for snapkv) and the keys below ``key_limit``; each program takes a
  tile of key slots and walks every query head's rows over it. ``per_head=False`` adds
  ``coef x`` the sum over heads and rows to ``out[slot]``; ``per_head=True`` adds each
  head's sum over rows to ``out[c, head, position]`` (snapkv's window, pooled later).

A slot may be scored by two sequences (forks sharing a block), so the adds are atomic.
References: :func:`harness.kernels.reference.decode_weights_ref`,
:func:`~harness.kernels.reference.prefill_weights_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.kernels.common import dot_f32
from harness.kernels.runtime import check_cache, interpreting, next_pow2

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_weights_kernel(
    logit_ptr, lse_ptr, table_ptr, lens_ptr, pos_ptr, out_ptr,
    stride_gb, stride_gh, stride_eb, stride_tb,
    coef,
    H: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    n = tl.load(lens_ptr + b).to(tl.int32)
    if tile * BLOCK_N >= n:
        return
    j = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    jmask = j < n
    blk = tl.load(table_ptr + b * stride_tb + j // PAGE, mask=jmask, other=0).to(tl.int64)
    slot = blk * PAGE + j % PAGE
    live = jmask & (tl.load(pos_ptr + slot, mask=jmask, other=-1) >= 0)
    h = tl.arange(0, BLOCK_H)
    hmask = h < H
    s = tl.load(logit_ptr + b * stride_gb + h[:, None] * stride_gh + j[None, :],
                mask=hmask[:, None] & live[None, :], other=float("-inf"))
    lse = tl.load(lse_ptr + b * stride_eb + h, mask=hmask, other=0.0)
    w = tl.sum(tl.exp2(s - lse[:, None]), axis=0) * coef
    tl.atomic_add(out_ptr + slot, w, mask=live)


@triton.jit
def _prefill_weights_kernel(
    q_ptr, k_ptr, pos_ptr, table_ptr, cu_ptr, start_ptr, kvlen_ptr, rlo_ptr, rhi_ptr,
    klim_ptr, lse_ptr, out_ptr,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_tb, stride_et, stride_oc, stride_oh,
    qk_scale, coef, num_kv_heads,
    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PER_HEAD: tl.constexpr, FP32_DOT: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    kv_len = tl.load(kvlen_ptr + c).to(tl.int32)
    if tile * BLOCK_N >= kv_len:
        return
    row0 = tl.load(cu_ptr + c).to(tl.int64)
    start = tl.load(start_ptr + c).to(tl.int32)
    t_lo = tl.load(rlo_ptr + c).to(tl.int32)
    t_hi = tl.load(rhi_ptr + c).to(tl.int32)
    k_lim = tl.load(klim_ptr + c)

    j = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    jmask = j < kv_len
    blk = tl.load(table_ptr + c * stride_tb + j // PAGE, mask=jmask, other=0).to(tl.int64)
    off = j % PAGE
    kpos = tl.load(pos_ptr + blk * PAGE + off, mask=jmask, other=-1)
    live = jmask & (kpos >= 0) & (kpos < k_lim)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    total = tl.zeros([BLOCK_N], tl.float32)
    for kvh in range(0, num_kv_heads):
        k = tl.load(k_ptr + (blk * stride_kb + off * stride_kt + kvh * stride_kh)[:, None]
                    + d[None, :], mask=live[:, None] & dmask[None, :], other=0.0)
        if FP32_DOT:
            k = k.to(tl.float32)
        for g in tl.static_range(G):
            head = kvh * G + g
            acc = tl.zeros([BLOCK_N], tl.float32)
            for t0 in range(t_lo, t_hi, BLOCK_M):
                t = t0 + tl.arange(0, BLOCK_M)
                tmask = t < t_hi
                rows = row0 + t
                q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                            mask=tmask[:, None] & dmask[None, :], other=0.0).to(k.dtype)
                lse = tl.load(lse_ptr + rows * stride_et + head, mask=tmask, other=0.0)
                s = dot_f32(q, tl.trans(k), FP32_DOT) * qk_scale
                see = tmask[:, None] & live[None, :] & (kpos[None, :] <= (start + t)[:, None])
                acc += tl.sum(tl.where(see, tl.exp2(s - lse[:, None]), 0.0), axis=0)
            if PER_HEAD:
                tl.atomic_add(out_ptr + c * stride_oc + head * stride_oh + kpos, acc * coef,
                              mask=live)
            else:
                total += acc
    if not PER_HEAD:
        tl.atomic_add(out_ptr + blk * PAGE + off, total * coef, mask=live)


# Keys per program: a (64, 128) bf16 K tile, as the attention kernels'.
BLOCK_N = 64
# Query rows per dot (>= 16 for the tensor cores; tova scores one row of them).
BLOCK_M = 16


def decode_weights(logits: torch.Tensor, lse: torch.Tensor, tables: torch.Tensor,
                   lens: torch.Tensor, slot_pos: torch.Tensor, block_size: int,
                   out: torch.Tensor, *, coef: float = 1.0) -> None:
    """Add each decode's attention weights, summed over its query heads, to its slots.

    logits: float32 (B, H, >= W x block_size) and lse: float32 (B, H), as the decode kernel
    wrote them (log2 units); tables: int (B, W); lens: int (B,) the slots scanned (blocks x
    block_size); slot_pos: int64 each slot's position (-1: a hole, skipped); out: float32
    (num_slots,): ``out[slot] += coef x sum_h 2^(logit - lse_h)``.
    """
    batch, h, width = logits.shape
    assert logits.dtype == lse.dtype == out.dtype == torch.float32 and lse.shape == (batch, h)
    assert logits.stride(2) == 1 and lse.stride(1) == 1 and out.dim() == 1
    assert tables.dim() == 2 and tables.shape[0] == batch and tables.stride(1) == 1
    assert lens.shape == (batch,) and width >= tables.shape[1] * block_size
    assert slot_pos.dim() == 1 and out.is_contiguous()
    if batch == 0:
        return
    grid = (batch, triton.cdiv(tables.shape[1] * block_size, BLOCK_N))
    _decode_weights_kernel[grid](
        logits, lse, tables, lens, slot_pos, out,
        logits.stride(0), logits.stride(1), lse.stride(0), tables.stride(0), coef,
        H=h, PAGE=block_size, BLOCK_H=next_pow2(h), BLOCK_N=BLOCK_N, num_warps=4,
    )


def prefill_weights(q: torch.Tensor, k_cache: torch.Tensor, slot_pos: torch.Tensor,
                    cu_rows: torch.Tensor, starts: torch.Tensor, tables: torch.Tensor,
                    kv_lens: torch.Tensor, row_lo: torch.Tensor, row_hi: torch.Tensor,
                    key_limit: torch.Tensor, lse: torch.Tensor, out: torch.Tensor,
                    max_slots: int, *, coef: float = 1.0, per_head: bool = False) -> None:
    """Add prefill chunks' attention weights to their keys.

    q: (T, H, D) the step's queries; k_cache: (num_blocks, block_size, KV, D); slot_pos:
    int64 each slot's position (-1: a hole); chunk c is rows ``[cu_rows[c], cu_rows[c+1])``
    at positions ``starts[c] ...`` over the first ``kv_lens[c]`` slots of ``tables[c]``;
    only its rows ``[row_lo[c], row_hi[c])`` (chunk-relative) score, and only keys at
    positions ``< key_limit[c]`` are scored (a row sees a key at or before it); lse: float32
    (T, H), the prefill kernel's (log2 units); max_slots: the largest ``kv_lens`` (a host
    int: it sizes the grid). ``per_head=False``: out float32 (num_slots,),
    ``out[slot] += coef x`` the weights summed over heads and rows; ``True``: out float32
    (C, H, >= max key_limit), ``out[c, h, position] += coef x`` head h's sum over rows.
    """
    _, page, kv, d = check_cache(k_cache, k_cache)
    _, h, dq = q.shape
    chunks = tables.shape[0]
    assert dq == d and h % kv == 0 and q.stride(-1) == 1, (q.shape, k_cache.shape)
    assert tables.dim() == 2 and tables.stride(1) == 1 and cu_rows.shape == (chunks + 1,)
    for t in (starts, kv_lens, row_lo, row_hi, key_limit):
        assert t.shape == (chunks,) and not t.is_floating_point()
    assert lse.dtype == out.dtype == torch.float32 and lse.shape == q.shape[:2]
    assert lse.stride(1) == 1 and slot_pos.dim() == 1
    if per_head:
        assert out.dim() == 3 and out.shape[:2] == (chunks, h) and out.stride(2) == 1
        o_strides = (out.stride(0), out.stride(1))
    else:
        assert out.dim() == 1 and out.is_contiguous()
        o_strides = (0, 0)
    if chunks == 0 or max_slots == 0:
        return
    fp32_dot = interpreting() or q.device.type != "cuda" or q.dtype == torch.float32
    _prefill_weights_kernel[(chunks, triton.cdiv(max_slots, BLOCK_N))](
        q, k_cache, slot_pos, tables, cu_rows, starts, kv_lens, row_lo, row_hi, key_limit,
        lse, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        tables.stride(0), lse.stride(0), *o_strides,
        d ** -0.5 * _LOG2E, coef, kv,
        G=h // kv, D=d, PAGE=page, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, next_pow2(d)), PER_HEAD=per_head, FP32_DOT=fp32_dot, num_warps=4,
    )
