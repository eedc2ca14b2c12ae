"""Quest's block-sparse decode (Tang et al., 2024): each KV head reads only its chosen blocks.

Two launches per layer. :func:`quest_select` (one program per sequence and KV head) bounds
every competing block's q.k by its keys' elementwise min and max,
``sum_d max(q_d min_d, q_d max_d)``, the largest over the KV head's query heads, and
chooses the top ``k_sel - 1`` of them plus the sequence's last (partly filled) block; it
writes the chosen physical blocks as a per-head block table, the last block last, and the
length that table holds. :func:`harness.kernels.decode.paged_decode` then attends over
those tables (its per-(sequence, KV head) form): only the chosen blocks are read, and the
bounds are the only other bytes.

Ties rank the lower block column first (a stable descending sort: the torch path's
``QuestBackend.select_blocks`` does the same). The selection is ``k_sel - 1`` scans of the
bounds (written once to a scratch row), each taking the next (bound, column) in that
order: no sort, no atomics; its cost is ``k_sel x`` the context's block count in floats,
small beside the bounds' own bytes (2 x D each block) and the chosen K/V.

Reference: :func:`harness.kernels.reference.quest_decode_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.kernels.decode import paged_decode
from harness.kernels.runtime import next_pow2


@triton.jit
def _quest_select_kernel(
    q_ptr, kmin_ptr, kmax_ptr, table_ptr, nblk_ptr, lens_ptr, bound_ptr, sel_ptr,
    sel_lens_ptr,
    stride_qb, stride_qh,
    stride_mb, stride_mh,
    stride_tb,
    stride_bb, stride_bh,
    stride_sb, stride_sh,
    stride_lb, stride_lh,
    k_sel,
    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    n = tl.load(nblk_ptr + b).to(tl.int32)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    cand = n - 1  # columns [0, n - 1) compete; column n - 1 is always read
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    t_row = table_ptr + b * stride_tb
    b_row = bound_ptr + b * stride_bb + kvh * stride_bh

    # Pass 1: each competing block's bound, the largest over the group's query heads.
    for w0 in range(0, cand, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        wmask = w < cand
        blk = tl.load(t_row + w, mask=wmask, other=0).to(tl.int64)
        m_off = (blk * stride_mb + kvh * stride_mh)[:, None] + d[None, :]
        m_mask = wmask[:, None] & dmask[None, :]
        lo = tl.load(kmin_ptr + m_off, mask=m_mask, other=0.0).to(tl.float32)
        hi = tl.load(kmax_ptr + m_off, mask=m_mask, other=0.0).to(tl.float32)
        bound = tl.full([BLOCK_W], float("-inf"), tl.float32)
        for g in tl.static_range(G):
            qg = tl.load(q_ptr + b * stride_qb + (kvh * G + g) * stride_qh + d, mask=dmask,
                         other=0.0).to(tl.float32)
            s = tl.sum(tl.maximum(qg[None, :] * lo, qg[None, :] * hi), axis=1)
            bound = tl.maximum(bound, s)
        tl.store(b_row + w, bound, mask=wmask)
    tl.debug_barrier()  # the scans below read what other threads of this program wrote

    # Pass 2: k_sel - 1 scans, each taking the next (bound descending, column ascending).
    cnt = tl.minimum(n, k_sel)
    s_row = sel_ptr + b * stride_sb + kvh * stride_sh
    prev_v = tl.max(tl.full([BLOCK_W], float("inf"), tl.float32), axis=0)
    prev_i = tl.max(tl.full([BLOCK_W], -1, tl.int32), axis=0)
    for r in range(0, cnt - 1):
        best_v = tl.max(tl.full([BLOCK_W], float("-inf"), tl.float32), axis=0)
        best_i = cand  # none yet
        for w0 in range(0, cand, BLOCK_W):
            w = w0 + tl.arange(0, BLOCK_W)
            wmask = w < cand
            v = tl.load(b_row + w, mask=wmask, other=float("-inf"))
            after = wmask & ((v < prev_v) | ((v == prev_v) & (w > prev_i)))
            tile_v = tl.max(tl.where(after, v, float("-inf")), axis=0)
            tile_i = tl.min(tl.where(after & (v == tile_v), w, cand), axis=0)
            # Tiles go in column order: on a tie the earlier tile's column stays.
            take = (tile_i < cand) & ((best_i == cand) | (tile_v > best_v))
            best_v = tl.where(take, tile_v, best_v)
            best_i = tl.where(take, tile_i, best_i)
        tl.store(s_row + r, tl.load(t_row + best_i))
        prev_v = best_v
        prev_i = best_i
    tl.store(s_row + cnt - 1, tl.load(t_row + cand))
    # Every chosen block but the last is full: the table holds (cnt - 1) whole blocks and
    # the last block's tokens.
    tl.store(sel_lens_ptr + b * stride_lb + kvh * stride_lh, (cnt - 1) * PAGE + ctx - cand * PAGE)


# Bounds per tile of pass 1 (and floats per tile of the scans).
BLOCK_W = 32


def quest_select(q: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor,
                 tables: torch.Tensor, num_blocks: torch.Tensor, lens: torch.Tensor,
                 k_sel: int, block_size: int, bounds: torch.Tensor, sel: torch.Tensor,
                 sel_lens: torch.Tensor) -> None:
    """Choose each (sequence, KV head)'s blocks into ``sel`` / ``sel_lens``.

    q: (B, H, D); k_min, k_max: (num_blocks, KV, D) each block's elementwise key bounds;
    tables: int (B, W) block ids; num_blocks: int (B,) table entries in use (>= 1); lens:
    int (B,) context lengths, at most ``num_blocks x block_size``. k_sel >= 1: blocks
    read per KV head (the last included). Scratch ``bounds``: float32 (B, KV, >= W).
    Written: sel, int64 (B, KV, >= k_sel), the chosen physical blocks (the first
    ``min(num_blocks, k_sel)`` entries, the last block last; the rest untouched);
    sel_lens, int64 (B, KV), the tokens they hold.
    """
    batch, h, d = q.shape
    _, kv, dm = k_min.shape
    assert k_max.shape == k_min.shape and dm == d and h % kv == 0, (q.shape, k_min.shape)
    assert q.stride(-1) == 1 and k_min.stride() == k_max.stride() and k_min.stride(-1) == 1
    assert tables.dim() == 2 and tables.shape[0] == batch and tables.stride(1) == 1
    assert num_blocks.shape == lens.shape == (batch,) and k_sel >= 1 and block_size >= 1
    assert bounds.dtype == torch.float32 and bounds.shape[:2] == (batch, kv)
    assert bounds.shape[2] >= tables.shape[1] and bounds.stride(2) == 1
    assert sel.shape[:2] == (batch, kv) and sel.shape[2] >= k_sel and sel.stride(2) == 1
    assert sel_lens.shape == (batch, kv) and sel.dtype == sel_lens.dtype == torch.int64
    if batch == 0:
        return
    _quest_select_kernel[(batch, kv)](
        q, k_min, k_max, tables, num_blocks, lens, bounds, sel, sel_lens,
        q.stride(0), q.stride(1), k_min.stride(0), k_min.stride(1), tables.stride(0),
        bounds.stride(0), bounds.stride(1), sel.stride(0), sel.stride(1),
        sel_lens.stride(0), sel_lens.stride(1), k_sel,
        G=h // kv, D=d, PAGE=block_size, BLOCK_D=max(16, next_pow2(d)), BLOCK_W=BLOCK_W,
        num_warps=4,
    )


def quest_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, num_blocks: torch.Tensor, lens: torch.Tensor,
                 k_min: torch.Tensor, k_max: torch.Tensor, k_sel: int, *,
                 num_splits: int | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Quest's decode: :func:`quest_select`, then the paged decode over the chosen blocks.

    q: (B, H, D); k_cache, v_cache: (num_blocks, block_size, KV, D); tables, num_blocks,
    lens, k_min, k_max, k_sel: as :func:`quest_select`. Returns ``out`` (B, H, D).
    """
    batch, kv = q.shape[0], k_cache.shape[2]
    width = tables.shape[1]
    bounds = torch.empty((batch, kv, width), dtype=torch.float32, device=q.device)
    sel = torch.empty((batch, kv, k_sel), dtype=torch.int64, device=q.device)
    sel_lens = torch.empty((batch, kv), dtype=torch.int64, device=q.device)
    quest_select(q, k_min, k_max, tables, num_blocks, lens, k_sel, k_cache.shape[1], bounds,
                 sel, sel_lens)
    return paged_decode(q, k_cache, v_cache, sel, sel_lens, num_splits=num_splits, out=out)
