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

Slot lists (``slot_pos``: the token-evicting methods, backends.slotted): a sequence's
tokens sit in its table's slots out of position order, with holes where tokens were
evicted. The kernel then walks every slot of the table (``lens`` counts slots, not
positions), reads each slot's position and skips the holes (position < 0); a decode sees
every token its sequence holds, so no position is compared. A tile of holes leaves the
running maximum at -inf, which the update guards (as the prefill kernel's).

Scores (``logits`` and ``lse``, with slot lists): each visited key's logit (log2 units,
-inf at a hole) is written to a scratch row and each query head's log-sum-exp (split-K:
the combine kernel's) to ``lse``; :func:`harness.kernels.scores.decode_weights` turns
them into each slot's attention weight. The logits are 4 bytes per (query head, key): 3%
of a bf16 8B-shape decode's K/V bytes, written once and read once, where recomputing
q.k in a second pass would read the keys again (half the K/V bytes).
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
    pos_ptr, logit_ptr, lse_out_ptr,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_sb, stride_st,
    stride_tb, stride_th, stride_cb, stride_ch,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_gb, stride_gh, stride_eb,
    qk_scale, window, sinks, num_splits,
    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, QUANT: tl.constexpr, FP32_DOT: tl.constexpr,
    SPLIT: tl.constexpr, HAS_POS: tl.constexpr, SCORES: tl.constexpr,
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
        live = nmask
        if HAS_POS:  # a slot list: holes (position < 0) are no keys
            live = nmask & (tl.load(pos_ptr + blk * PAGE + off, mask=nmask, other=-1) >= 0)
        kv_mask = live[:, None] & dmask[None, :]
        k = tl.load(k_ptr + (blk * stride_kb + off * stride_kt + kvh * stride_kh)[:, None]
                    + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = dot_f32(q, tl.trans(k), FP32_DOT)
        if QUANT:
            s_off = blk * stride_sb + off * stride_st + kvh
            ks = tl.load(ks_ptr + s_off, mask=live, other=0.0)
            s = s * ks[None, :]
        s = tl.where(live[None, :], s * qk_scale, float("-inf"))
        if SCORES:
            tl.store(logit_ptr + b * stride_gb + heads[:, None] * stride_gh + j[None, :], s,
                     mask=(g < G)[:, None] & nmask[None, :])
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A tile of holes only: keep m at -inf without a NaN (a constexpr branch).
        if HAS_POS:  # noqa: SIM108
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + (blk * stride_vb + off * stride_vt + kvh * stride_vh)[:, None]
                    + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        if QUANT:
            vs = tl.load(vs_ptr + s_off, mask=live, other=0.0)
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
        if SCORES:
            tl.store(lse_out_ptr + b * stride_eb + heads,
                     tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=g < G)


@triton.jit
def _combine_kernel(
    part_ptr, lse_ptr, out_ptr, lse_out_ptr,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh, stride_eb,
    num_splits,
    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    WRITE_LSE: tl.constexpr,
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
    top = tl.max(lse, axis=0)
    w = tl.exp2(lse - top)
    part = tl.load(part_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps
                   + d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
    out = tl.sum(w[:, None] * part, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=dmask)
    if WRITE_LSE:  # the whole row's log-sum-exp (log2 units), for the scores
        tl.store(lse_out_ptr + b * stride_eb + h, top + tl.log2(tl.sum(w, axis=0)))


# Tokens per tile. 64 keeps a (64, 128) bf16 K tile and its V twin in registers with
# 4 warps; it is also the granularity of a split's share.
BLOCK_N = 64


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            tables: torch.Tensor, lens: torch.Tensor, out: torch.Tensor, num_splits: int,
            window: int, sinks: int, k_scale: torch.Tensor | None,
            v_scale: torch.Tensor | None, slot_pos: torch.Tensor | None = None,
            logits: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> None:
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
    if slot_pos is not None:  # slot lists: every slot of the table, holes skipped
        assert window == 0 and slot_pos.dim() == 1 and slot_pos.stride(0) == 1
        assert slot_pos.numel() >= k_cache.shape[0] * page and not slot_pos.is_floating_point()
    scores = logits is not None
    assert scores == (lse is not None) and (not scores or slot_pos is not None), (
        "logits and lse come together, with slot_pos")
    if logits is not None and lse is not None:
        assert logits.dtype == lse.dtype == torch.float32 and logits.stride(-1) == 1
        assert logits.shape[:2] == (batch, h) and lse.shape == (batch, h) and lse.stride(1) == 1
        assert logits.shape[2] >= tables.shape[-1] * page, (logits.shape, tables.shape)
        g_strides = (logits.stride(0), logits.stride(1), lse.stride(0))
    else:
        g_strides = (0, 0, 0)
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
        lse_part = torch.empty((batch, h, num_splits), dtype=torch.float32, device=q.device)
        dst, o_strides = part, part.stride()[:3]
        lse_dst, l_strides = lse_part, lse_part.stride()[:2]
    else:
        dst, o_strides = out, (out.stride(0), out.stride(1), 0)
        lse_dst, l_strides = out, (0, 0)
    # Unused pointers (no slot list, no scores) get a tensor that is never read.
    _decode_kernel[(batch, kv, num_splits)](
        q, k_cache, v_cache, *scales, tables, lens, dst, lse_dst,
        slot_pos if slot_pos is not None else lens, logits if scores else lens,
        lse if scores else lens,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *s_strides, *t_strides, *o_strides, *l_strides, *g_strides,
        d ** -0.5 * _LOG2E, window, sinks, num_splits,
        G=g, D=d, PAGE=page, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=BLOCK_N,
        HAS_WINDOW=window > 0, QUANT=quant, FP32_DOT=fp32_dot, SPLIT=split,
        HAS_POS=slot_pos is not None, SCORES=scores,
        num_warps=4,
    )
    if split:
        combine_splits(part, lse_part, out, lse)


def combine_splits(part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor | None = None) -> None:
    """Merge split-K partials: part float32 (B, H, S, D) normalized outputs and lse_part
    (B, H, S) their log2-sum-exps -> out (B, H, D); with ``lse`` (B, H), each row's whole
    log-sum-exp too (the scores'). Shared with kivi's decode."""
    batch, h, splits, d = part.shape
    _combine_kernel[(batch, h)](
        part, lse_part, out, lse if lse is not None else out, *part.stride()[:3],
        *lse_part.stride()[:2], out.stride(0), out.stride(1),
        lse.stride(0) if lse is not None else 0, splits,
        D=d, BLOCK_S=next_pow2(splits), BLOCK_D=max(16, next_pow2(d)),
        WRITE_LSE=lse is not None, num_warps=4,
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
                 v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 slot_pos: torch.Tensor | None = None, logits: torch.Tensor | None = None,
                 lse: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V.

    q: (B, H, D), the token at position ``lens[b] - 1``, already in the cache;
    k_cache, v_cache: (num_blocks, block_size, KV, D), H a multiple of KV;
    tables: int (B, max_blocks) block ids; lens: int (B,) context lengths >= 1. Or one
    table and length per KV head: tables (B, KV, max_blocks), lens (B, KV) (quest's
    chosen blocks, :mod:`harness.kernels.quest`).
    num_splits: 1 = one program per (sequence, KV head); > 1 = split-K with a reduction;
    None = :func:`default_splits`. window / sinks: see the module docstring (0 = full).
    k_scale, v_scale: float32 (num_blocks, block_size, KV) for fp8 / int8 caches.
    slot_pos: int64 (>= num_blocks x block_size,) each slot's position, -1 = a hole (slot
    lists, module docstring): ``lens`` then counts the table's slots to scan (its blocks x
    block_size), and every slot holding a token is a key. logits, lse (with slot_pos):
    float32 (B, H, >= max_blocks x block_size) and (B, H), written with each scanned
    slot's logit and each head's log-sum-exp, both in log2 units.
    Returns ``out`` (B, H, D) in q.dtype (allocated when None).
    """
    if out is None:
        out = torch.empty_like(q)
    if num_splits is None:
        num_splits = default_splits(q.shape[0], k_cache.shape[2],
                                    tables.shape[-1] * k_cache.shape[1], q.device)
    _launch(q, k_cache, v_cache, tables, lens, out, num_splits, window, sinks, k_scale,
            v_scale, slot_pos, logits, lse)
    return out
