"""Compaction of a token-granular sequence's blocks: which tokens move where so that its
live tokens fill as few blocks as they can (the rest go back to the pool)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class Compaction:
    """Move the token in slot ``src[i]`` to slot ``dst[i]`` (int64 (M,) each), then give
    back the blocks ``release`` (empty by then)."""

    src: np.ndarray
    dst: np.ndarray
    release: list[int]


def plan_compaction(blocks: list[int], pos: np.ndarray, bs: int) -> Compaction:
    """``blocks``: a sequence's private blocks; ``pos``: position per slot (-1: empty).
    Keep the ``ceil(live / bs)`` densest blocks (ties: the earlier in ``blocks``), move
    the other blocks' tokens into their holes in slot order. Sources and destinations are
    disjoint (moves may be applied in any order, or at once)."""
    none = Compaction(np.zeros(0, np.int64), np.zeros(0, np.int64), [])
    if not blocks:
        return none
    arr = np.asarray(blocks, dtype=np.int64)
    slots = arr[:, None] * bs + np.arange(bs, dtype=np.int64)  # (n, bs)
    live = pos[slots] >= 0
    counts = live.sum(axis=1)
    keep = -(-int(counts.sum()) // bs)
    if keep >= len(blocks):
        return none
    order = np.argsort(-counts, kind="stable")
    kept, gone = order[:keep], order[keep:]
    holes = slots[kept][~live[kept]]
    movers = slots[gone][live[gone]]
    assert len(holes) >= len(movers)
    return Compaction(movers, np.sort(holes)[:len(movers)], arr[gone].tolist())
