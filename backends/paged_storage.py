"""Shared machinery of every paged backend: the block-shaped cache, stores, copies, swaps.

Cache of one layer: ``(num_blocks, block_size, num_kv_heads, head_dim)`` (flash-attn's
layout), viewed as ``(num_blocks * block_size, num_kv_heads, head_dim)`` flat slots for
stores and copies. Subclasses implement only the attention (and, for lossy backends,
what they store).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from harness.backends.attention_ref import attend_chunk, attend_decode, chunk_mask, decode_mask
from harness.backends.base import CacheSizing, KVBackend
from harness.backends.staging import Staging
from harness.kv.base import CopyOp, KVManager
from harness.kv.paged import PagedKVManager
from harness.sched.step import StepRecord

Index = slice | torch.Tensor


def copy_runs(copies: list[CopyOp], staging: Staging) -> Iterator[tuple[Index, Index, bool]]:
    """The step's copies in order as (src, dst, move) slot indices: a slice per copy, and
    each run of consecutive moves as one pair of int64 index tensors (a compaction moves
    one slot at a time; one gather and scatter per tensor instead of one per slot, which
    its disjoint sources and destinations allow), written through ``staging`` (call once
    a step: :meth:`PagedStorageBackend.step_copies`)."""
    i = 0
    while i < len(copies):
        op = copies[i]
        if not op.move:
            yield (slice(op.src, op.src + op.num_slots),
                   slice(op.dst, op.dst + op.num_slots), False)
            i += 1
            continue
        j = i
        while j < len(copies) and copies[j].move:
            j += 1
        run = copies[i:j]
        src = [s for o in run for s in range(o.src, o.src + o.num_slots)]
        dst = [d for o in run for d in range(o.dst, o.dst + o.num_slots)]
        yield (staging.put(f"copy_src{i}", src, len(src)),
               staging.put(f"copy_dst{i}", dst, len(dst)), True)
        i = j


class PagedStorageBackend(KVBackend):
    """Paged K/V tensors + the cache operations every paged backend shares."""

    storage = "paged"
    default_block_size = 16

    def tensor_blocks(self, sizing: CacheSizing) -> int:
        """Blocks the cache tensors hold: the pool's, and for a graph-safe backend one more
        past them (never in a table: where the padded rows of a replayed decode batch
        store and read, harness.engine.graphs; not charged), which sets :attr:`pad_block`
        and :attr:`pad_slot`."""
        if self.graph_unsafe_reason() is not None:
            return sizing.num_blocks
        self.pad_block = sizing.num_blocks
        self.pad_slot = sizing.num_blocks * sizing.block_size
        return sizing.num_blocks + 1

    def allocate(self, sizing: CacheSizing) -> None:
        lay = self.layout
        shape = (self.tensor_blocks(sizing), sizing.block_size, lay.num_kv_heads,
                 lay.head_dim)
        self.block_size = sizing.block_size
        # One tensor per storage layer: every layer, or under KV cache groups one per group
        # position, each block owned by whichever group took it (LayerSlot).
        n = self.storage_layers
        self.k_cache = [torch.zeros(shape, dtype=lay.dtype, device=self.device)
                        for _ in range(n)]
        self.v_cache = [torch.zeros_like(t) for t in self.k_cache]
        cpu_shape = (sizing.num_cpu_blocks, *shape[1:])
        self.k_cpu = [torch.zeros(cpu_shape, dtype=lay.dtype) for _ in range(n)]
        self.v_cpu = [torch.zeros_like(t) for t in self.k_cpu]

    def make_manager(self, sizing: CacheSizing, **options: Any) -> KVManager:
        return PagedKVManager(sizing.num_blocks, sizing.block_size,
                              num_cpu_blocks=sizing.num_cpu_blocks, **options)

    def swap_pairs(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """(device tensors, their CPU mirrors), each indexed by block: what a swap moves."""
        return [(self.k_cache, self.k_cpu), (self.v_cache, self.v_cpu)]

    def apply_cache_ops(self, rec: StepRecord) -> None:
        if rec.swap_out:
            dev = torch.tensor([d for d, _ in rec.swap_out], device=self.device)
            cpu = torch.tensor([c for _, c in rec.swap_out])
            for caches, cpus in self.swap_pairs():
                for t, c in zip(caches, cpus):
                    c[cpu] = t[dev].cpu()
        if rec.swap_in:
            cpu = torch.tensor([c for c, _ in rec.swap_in])
            dev = torch.tensor([d for _, d in rec.swap_in], device=self.device)
            for caches, cpus in self.swap_pairs():
                for t, c in zip(caches, cpus):
                    t[dev] = c[cpu].to(self.device)
        for src, dst, _ in self.step_copies(rec):
            for t in self.slot_tensors():
                flat = t.view(-1, *t.shape[2:])
                flat[dst] = flat[src]

    def step_copies(self, rec: StepRecord) -> list[tuple[Index, Index, bool]]:
        """:func:`copy_runs` of ``rec``'s copies, made once a step (a subclass that
        copies per-slot state of its own reads the same list)."""
        if getattr(self, "_copies_of", None) is not rec:
            self._copies_of: StepRecord | None = rec
            self._copies = list(copy_runs(rec.copies, self.staging))
        return self._copies

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed (num_blocks, block_size, ...): what a copy copies."""
        return [*self.k_cache, *self.v_cache]

    def block_tensors(self) -> list[torch.Tensor] | None:
        """What a swap moves is what a block is (K/V, and quest's key bounds)."""
        return [t for dev, _ in self.swap_pairs() for t in dev]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the step's new K/V through the slot mapping. k, v: (T, KV, D)."""
        assert self.batch is not None
        slots = self.batch.slot_mapping
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        kc.view(-1, *kc.shape[2:]).index_copy_(0, slots, k.to(kc.dtype))
        vc.view(-1, *vc.shape[2:]).index_copy_(0, slots, v.to(vc.dtype))

    def read_blocks(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor,
                                                                       torch.Tensor]:
        """K and V of ``blocks`` (any int64 shape S) as (*S, block_size, KV, D) tensors in
        the compute dtype. Lossy backends override it (dequantize, overlay sinks)."""
        return self.k_cache[layer][blocks], self.v_cache[layer][blocks]

    def torch_attend(self, layer: int, q: torch.Tensor, window: int | None = None,
                     sinks: int = 0) -> torch.Tensor:
        """The torch reference attention over this step's batch, reading K/V through
        :meth:`read_blocks`: decodes as one padded SDPA call, prefill chunks one by one.
        q: (T, H, D) -> (T, H, D)."""
        out = torch.empty_like(q)
        b = self.batch
        assert b is not None
        nd = b.num_decode
        if nd:
            kd, vd = self.read_blocks(layer, b.decode_tables)
            if f := self.touch_factor(layer):
                self.touch_decode_mask(b.decode_tables, decode_mask(
                    b.decode_lens, kd.shape[1] * kd.shape[2], window, sinks), f)
            out[:nd] = attend_decode(q[:nd], kd.flatten(1, 2).to(q.dtype),
                                     vd.flatten(1, 2).to(q.dtype), b.decode_lens, window,
                                     sinks)
        self.torch_prefills(layer, q, out, window, sinks)
        return out

    def torch_prefills(self, layer: int, q: torch.Tensor, out: torch.Tensor,
                       window: int | None = None, sinks: int = 0) -> None:
        """The step's prefill chunks, one SDPA call each, into their rows of ``out``."""
        b = self.batch
        assert b is not None
        bs = self.block_size
        f = self.touch_factor(layer)
        for c in b.prefills:
            ctx = c.start + c.num_tokens
            kk, vv = self.read_blocks(layer, c.table[:-(-ctx // bs)])
            rows = slice(c.row, c.row + c.num_tokens)
            if f:
                self.touch_prefill(chunk_mask(c.start, c.num_tokens, ctx, window, sinks,
                                              q.device).sum() * f)
            out[rows] = attend_chunk(q[rows], kk.flatten(0, 1)[:ctx].to(q.dtype),
                                     vv.flatten(0, 1)[:ctx].to(q.dtype), c.start, window,
                                     sinks)

    # -- what the attention touched (KVBackend.touched) ---------------------------------
    def touch_decode_mask(self, tables: torch.Tensor, mask: torch.Tensor, layers: int) -> None:
        """Count the decode reads of ``layers`` layers from the attention's ``mask``: bool
        (B, W x block_size), the keys each decode read among its table's positions
        (``tables``: int64 (B, W)). Here a key costs its K and V for every KV head; a
        backend that stores other bytes (scales, overlays, codes) overrides it."""
        self.touch_full_keys(mask.sum() * layers)

    def touch_by_bounds(self, layer: int, window: int | None = None, sinks: int = 0, *,
                        decodes: bool = True, prefills: bool = True) -> None:
        """For a kernel whose masks are not visible here (Triton, flex, flash-attn): the
        keys it reads from the bounds it is given, each decode's length and each chunk's
        start and length (and the window), which it reads exactly. ``decodes`` /
        ``prefills`` False: leave those out (counted elsewhere: a method's own selection,
        a torch path that counts its own masks)."""
        b = self.batch
        assert b is not None
        f = self.touch_factor(layer)
        if not f:
            return
        if b.num_decode and decodes:
            width = b.decode_tables.shape[1] * self.block_size
            self.touch_decode_mask(b.decode_tables,
                                   decode_mask(b.decode_lens, width, window, sinks), f)
        for c in b.prefills if prefills else ():
            self.touch_prefill(chunk_mask(c.start, c.num_tokens, c.start + c.num_tokens,
                                          window, sinks, self.device).sum() * f)
