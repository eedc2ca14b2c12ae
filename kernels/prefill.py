"""Paged prefill / extend attention: chunks of new query tokens over their cached prefix
and causally over themselves, all K/V read from the paged cache through the block table.

Reference: :func:`harness.kernels.reference.paged_prefill_ref`.

GQA-aware: a program takes a KV head and packs ``BLOCK_M`` (token, query head) rows of its
group into the tile's M dimension (row r is token ``r // G``, head ``r % G``), so a K/V tile
serves every query head of the group. Grid: (chunk, row tile, KV head); tiles past a
chunk's end exit at once. Each tile walks only the keys some row of it can see: up to its
last token, and with a window from the first token's window start (plus the sinks), in
``BLOCK_N``-token steps that may span cache blocks. Windows and 1-byte caches work as in
:mod:`harness.kernels.decode`.

Slot lists (``slot_pos``, ``kv_lens``: the token-evicting methods): a chunk's keys are the
slots of its table, out of position order and with holes, so each tile walks all
``kv_lens[c]`` of them and a row sees a slot whose position is >= 0 and <= its own.
``lse`` (optional) receives each row's log-sum-exp in log2 units: what
:func:`harness.kernels.scores.prefill_weights` needs to turn a logit into a weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.kernels.common import dot_f32
from harness.kernels.runtime import check_cache, check_scales, interpreting, next_pow2

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, cu_ptr, start_ptr, out_ptr,
    pos_ptr, kvlen_ptr, lse_ptr,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_sb, stride_st,
    stride_tb,
    stride_ot, stride_oh, stride_et,
    qk_scale, window, sinks,
    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, QUANT: tl.constexpr, FP32_DOT: tl.constexpr,
    HAS_POS: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    row0 = tl.load(cu_ptr + c).to(tl.int32)
    n = tl.load(cu_ptr + c + 1).to(tl.int32) - row0
    if tile * BLOCK_M >= n * G:
        return
    start = tl.load(start_ptr + c).to(tl.int32)

    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    t = r // G
    rmask = t < n
    heads = kvh * G + r % G
    qpos = start + t
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q_mask = rmask[:, None] & dmask[None, :]
    q_rows = (row0 + t).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)

    # Keys this tile can see: [lo, hi) plus the sinks below lo (slot lists: every slot).
    if HAS_POS:
        hi = tl.load(kvlen_ptr + c).to(tl.int32)
    else:
        hi = start + tl.minimum(tile * BLOCK_M + BLOCK_M - 1, n * G - 1) // G + 1
    if HAS_WINDOW:
        lo = tl.maximum(start + (tile * BLOCK_M) // G - window + 1, 0)
        n_sink = tl.minimum(sinks, lo)
    else:
        lo = 0
        n_sink = 0
    visible = n_sink + hi - lo

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j0 in range(0, visible, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        nmask = j < visible
        pos = tl.where(j < n_sink, j, j - n_sink + lo)
        blk = tl.load(table_ptr + c * stride_tb + pos // PAGE, mask=nmask, other=0).to(tl.int64)
        off = pos % PAGE
        if HAS_POS:  # the slot's position: -1 (a hole) or the token's
            kpos = tl.load(pos_ptr + blk * PAGE + off, mask=nmask, other=-1)
            live = nmask & (kpos >= 0)
        else:
            kpos = pos
            live = nmask
        kv_mask = live[:, None] & dmask[None, :]
        k = tl.load(k_ptr + (blk * stride_kb + off * stride_kt + kvh * stride_kh)[:, None]
                    + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = dot_f32(q, tl.trans(k), FP32_DOT)
        if QUANT:
            s_off = blk * stride_sb + off * stride_st + kvh
            s = s * tl.load(ks_ptr + s_off, mask=live, other=0.0)[None, :]
        see = live[None, :] & (kpos[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            see = see & ((pos[None, :] > qpos[:, None] - window) | (pos[None, :] < sinks))
        s = tl.where(see, s * qk_scale, float("-inf"))
        # A row may see nothing in this tile (windowed rows, padding rows): keep it at
        # m = -inf without producing NaN.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + (blk * stride_vb + off * stride_vt + kvh * stride_vh)[:, None]
                    + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        if QUANT:
            p = p * tl.load(vs_ptr + s_off, mask=nmask, other=0.0)[None, :]
        acc = acc * alpha[:, None] + dot_f32(p.to(q.dtype), v, FP32_DOT)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)
    if WRITE_LSE:
        tl.store(lse_ptr + q_rows * stride_et + heads,
                 tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=rmask)


# (64 rows, 128 dims) x (64 tokens): the usual flash-attention forward tile for 4 warps.
BLOCK_M = 64
BLOCK_N = 64
# Slot lists: 32 rows. At 64 the positions read per key (and the mask from them) took
# the bf16 variant to 255 registers and 56-88 bytes of spills on sm_90; 32 rows: 204, none
# (kernels/compile_check.py).
BLOCK_M_SLOTS = 32


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            cu_rows: torch.Tensor, starts: torch.Tensor, tables: torch.Tensor,
            max_tokens: int, out: torch.Tensor, window: int, sinks: int,
            k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
            slot_pos: torch.Tensor | None = None, kv_lens: torch.Tensor | None = None,
            lse: torch.Tensor | None = None) -> None:
    _, page, kv, d = check_cache(k_cache, v_cache)
    quant = check_scales(k_cache, k_scale, v_scale)
    _, h, dq = q.shape
    assert dq == d and h % kv == 0, (q.shape, k_cache.shape)
    assert q.stride(-1) == 1 and out.shape == q.shape and out.stride(-1) == 1
    chunks = tables.shape[0]
    assert tables.dim() == 2 and tables.stride(1) == 1 and not tables.is_floating_point()
    assert cu_rows.shape == (chunks + 1,) and starts.shape == (chunks,)
    assert window >= 0 and sinks >= 0
    assert (slot_pos is None) == (kv_lens is None), "slot_pos and kv_lens come together"
    if slot_pos is not None and kv_lens is not None:
        assert window == 0 and slot_pos.dim() == 1 and slot_pos.stride(0) == 1
        assert not slot_pos.is_floating_point() and kv_lens.shape == (chunks,)
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:2] and lse.stride(1) == 1
    if chunks == 0 or max_tokens == 0:
        return
    g = h // kv
    fp32_dot = interpreting() or q.device.type != "cuda" or q.dtype == torch.float32
    scales = (k_scale, v_scale) if k_scale is not None else (starts, starts)
    s_strides = (k_scale.stride(0), k_scale.stride(1)) if k_scale is not None else (0, 0)
    block_m = BLOCK_M if slot_pos is None else BLOCK_M_SLOTS
    grid = (chunks, triton.cdiv(max_tokens * g, block_m), kv)
    # Unused pointers (no slot list, no lse) get a tensor that is never read.
    _prefill_kernel[grid](
        q, k_cache, v_cache, *scales, tables, cu_rows, starts, out,
        slot_pos if slot_pos is not None else starts,
        kv_lens if kv_lens is not None else starts, lse if lse is not None else out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *s_strides, tables.stride(0), out.stride(0), out.stride(1),
        lse.stride(0) if lse is not None else 0,
        d ** -0.5 * _LOG2E, window, sinks,
        G=g, D=d, PAGE=page, BLOCK_M=block_m, BLOCK_D=max(16, next_pow2(d)), BLOCK_N=BLOCK_N,
        HAS_WINDOW=window > 0, QUANT=quant, FP32_DOT=fp32_dot,
        HAS_POS=slot_pos is not None, WRITE_LSE=lse is not None,
        num_warps=4,
    )


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  cu_rows: torch.Tensor, starts: torch.Tensor, tables: torch.Tensor,
                  max_tokens: int, *, window: int = 0, sinks: int = 0,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, slot_pos: torch.Tensor | None = None,
                  kv_lens: torch.Tensor | None = None,
                  lse: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of C query chunks over their paged K/V (prefix + the chunk itself).

    q: (T, H, D); chunk c is rows ``[cu_rows[c], cu_rows[c+1])`` at positions
    ``starts[c] ...``, its own K/V already stored; cu_rows: int (C+1,); starts: int (C,);
    tables: int (C, max_blocks); max_tokens: the longest chunk (a host int: it sizes the
    grid without a device sync). window / sinks / k_scale / v_scale: as
    :func:`harness.kernels.decode.paged_decode`. slot_pos, kv_lens (together): slot
    lists (module docstring), int64 (>= num_blocks x block_size,) each slot's position
    (-1: a hole) and int (C,) the slots of each chunk's table to scan. lse: float32 (T, H),
    written with each chunk row's log-sum-exp (log2 units). Writes the chunks' rows of
    ``out`` (default: zeros like q) and returns it.
    """
    if out is None:
        out = torch.zeros_like(q)
    _launch(q, k_cache, v_cache, cu_rows, starts, tables, max_tokens, out, window, sinks,
            k_scale, v_scale, slot_pos, kv_lens, lse)
    return out
