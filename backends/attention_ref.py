"""Plain torch attention over gathered K/V: the reference every backend is checked against.

Shapes follow the backend contract: K/V of one sequence as (ctx, num_kv_heads, head_dim).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chunk_mask(start: int, n: int, ctx: int, window: int | None = None, sinks: int = 0,
               device: torch.device | None = None) -> torch.Tensor:
    """bool (n, ctx): which keys (positions ``0 .. ctx-1``) the queries at positions
    ``start .. start+n-1`` see, causal, within ``window`` (plus the first ``sinks``)."""
    qpos = torch.arange(start, start + n, device=device).unsqueeze(1)
    kpos = torch.arange(ctx, device=device).unsqueeze(0)
    mask = kpos <= qpos
    if window is not None:
        mask &= (kpos > qpos - window) | (kpos < sinks)
    return mask


def decode_mask(lens: torch.Tensor, width: int, window: int | None = None,
                sinks: int = 0) -> torch.Tensor:
    """bool (B, width): the keys each decode (at position ``lens[b] - 1``) sees among
    positions ``0 .. width-1``: its context, the last ``window`` and first ``sinks``."""
    kpos = torch.arange(width, device=lens.device).unsqueeze(0)
    last = lens.unsqueeze(1)
    mask = kpos < last
    if window is not None:
        mask &= (kpos >= last - window) | (kpos < sinks)
    return mask


def attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                 window: int | None = None, sinks: int = 0) -> torch.Tensor:
    """Causal attention of a query chunk over its sequence's cached keys.

    q: (n, H, D) at positions ``start .. start+n-1``; k, v: (ctx, KV, D) for positions
    ``0 .. ctx-1`` with ``ctx >= start + n``. With ``window``, query at position p sees keys
    in ``(p - window, p]`` plus the first ``sinks`` positions. Returns (n, H, D).
    """
    mask = chunk_mask(start, q.shape[0], k.shape[0], window, sinks, q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), attn_mask=mask, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def attend_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  lens: torch.Tensor, window: int | None = None,
                  sinks: int = 0) -> torch.Tensor:
    """One query per sequence (at position ``lens[b] - 1``) over padded keys.

    q: (B, H, D); k, v: (B, L, KV, D) with sequence b valid in ``[0, lens[b])``. With
    ``window``, only the last ``window`` positions and the first ``sinks`` are seen.
    Returns (B, H, D).
    """
    mask = decode_mask(lens, k.shape[1], window, sinks)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None, None, :], enable_gqa=True)
    return out.squeeze(2)
