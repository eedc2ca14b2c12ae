"""kivi's residual: full-precision blocks for the blocks that are still filling.

A block whose first slot is written this step takes a residual block (``slab``); tokens
written into it go there; when it fills it is quantized from there and the slab is free
again; a partly filled block that dies (its sequence finished or was preempted: the step
record's ``invalidated`` slots) frees its slab; copy-on-write of a shared partial block
copies its slab. Host-side bookkeeping, once per step; the tensors are per layer.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from harness.backends.base import AttentionBatch, KVLayout


@dataclass(slots=True)
class StorePlan:
    """Where this step's new tokens go. Batch rows ``res_rows`` go to residual slots
    ``res_slots``; the blocks ``blocks`` are quantized this step, the first from the rows
    ``direct_rows`` (whole blocks written this step, block_size rows each), the rest from
    their residual blocks ``seal_slabs``. All int64 tensors on the cache's device."""

    res_rows: torch.Tensor
    res_slots: torch.Tensor
    direct_rows: torch.Tensor
    seal_slabs: torch.Tensor
    blocks: torch.Tensor


class ResidualPool:
    """``n`` full-precision blocks (per layer: k, v of (n, block_size, KV, D)) lent to
    partly filled blocks; ``slab_map``: int64 (num_blocks,) each block's slab, -1 none."""

    def __init__(self, n: int, num_blocks: int, block_size: int, layout: KVLayout,
                 device: torch.device) -> None:
        shape = (n, block_size, layout.num_kv_heads, layout.head_dim)
        self.k = [torch.zeros(shape, dtype=layout.dtype, device=device)
                  for _ in range(layout.num_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.bs, self.device = block_size, device
        self.slab_of: dict[int, int] = {}  # block -> its slab
        self.free = list(range(n - 1, -1, -1))
        self.slab_map = torch.full((num_blocks,), -1, dtype=torch.int64, device=device)
        self.peak = 0

    def take(self) -> int:
        if not self.free:
            # More sequences hold a partial block than there are residual blocks: grow
            # beyond the budget rather than fail, and say so.
            n = len(self.slab_of)
            print(f"kvbench: kivi needs more than backend.residual_blocks={n} residual "
                  "blocks (more sequences at once than it was sized for); growing beyond "
                  "the budget", file=sys.stderr)
            self.k = [torch.cat([t, torch.zeros_like(t)]) for t in self.k]
            self.v = [torch.cat([t, torch.zeros_like(t)]) for t in self.v]
            self.free = list(range(2 * n - 1, n - 1, -1))
        self.peak = max(self.peak, len(self.slab_of) + 1)
        return self.free.pop()

    def drop(self, blocks: set[int]) -> None:
        """These blocks' tokens are gone: their slabs (if any) are free."""
        for b in blocks & self.slab_of.keys():
            self.free.append(self.slab_of.pop(b))
        if blocks:
            self.slab_map[torch.tensor(sorted(blocks), device=self.device)] = -1

    def copy(self, src: int, dst: int, num_slots: int) -> None:
        """Copy-on-write of partial block ``src``'s first slots into new block ``dst``."""
        slab = self.take()
        self.slab_of[dst] = slab
        self.slab_map[dst] = slab
        for t in (*self.k, *self.v):
            t[slab, :num_slots] = t[self.slab_of[src], :num_slots]

    def plan(self, batch: AttentionBatch) -> StorePlan:
        """Route the step's tokens (host lists: each chunk's slots) and update the slabs."""
        bs = self.bs
        res_rows: list[int] = []
        res_slots: list[int] = []
        direct_rows: list[int] = []
        direct_blocks: list[int] = []
        seal_slabs: list[int] = []
        seal_blocks: list[int] = []
        started: list[int] = []
        chunks = [(i, s) for i, s in enumerate(batch.decode_seqs)]
        chunks += [(c.row, c.sched) for c in batch.prefills]
        for row0, sc in chunks:
            i = 0
            while i < sc.num_tokens:
                b, off = divmod(sc.slots[i], bs)
                run = min(sc.num_tokens - i, bs - off)  # this chunk's tokens in block b
                rows = range(row0 + i, row0 + i + run)
                i += run
                if off == 0 and run == bs:  # written whole this step: quantize directly
                    direct_rows += rows
                    direct_blocks.append(b)
                    continue
                if off == 0:
                    self.slab_of[b] = self.take()
                    started.append(b)
                slab = self.slab_of[b]
                res_rows += rows
                res_slots += range(slab * bs + off, slab * bs + off + run)
                if off + run == bs:  # it fills: quantize from the residual
                    seal_slabs.append(slab)
                    seal_blocks.append(b)
        # Freed only now: a slab sealed this step is read by this step's stores.
        for b in seal_blocks:
            self.free.append(self.slab_of.pop(b))

        def t(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=self.device)

        if started:  # none of them fills this step (that would be a direct block)
            self.slab_map[t(started)] = t([self.slab_of[b] for b in started])
        if seal_blocks:
            self.slab_map[t(seal_blocks)] = -1
        return StorePlan(t(res_rows), t(res_slots), t(direct_rows), t(seal_slabs),
                         t(direct_blocks + seal_blocks))
