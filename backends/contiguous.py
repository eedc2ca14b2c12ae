"""`contiguous`: each sequence's K/V in one range of slots reserved at admission.

The way serving systems held the cache before paging; kept to measure what paging
removes. ``backend.reserve`` = ``max`` | ``pow2`` | ``exact`` (harness.kv.contiguous).
Attention is the paged torch path's, so that a throughput ratio compares the memory
designs and not two loops: the step's decodes gather their ranges into one padded batch
and run one SDPA call (a range is one block as long as its sequence); prefill chunks run
one call each over a view of their range, as the paged path does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from harness.backends.attention_ref import attend_chunk, attend_decode, chunk_mask, decode_mask
from harness.backends.base import (
    AttentionBatch,
    BackendOptions,
    CacheSizing,
    KVBackend,
    KVLayout,
)
from harness.backends.costs import KVCosts
from harness.kv.base import KVManager
from harness.kv.contiguous import POLICIES, ContiguousKVManager
from harness.sched.step import StepRecord
from harness.validate import one_of


@dataclass
class ContiguousOptions(BackendOptions):
    reserve: str = "max"  # max | pow2 | exact

    def __post_init__(self) -> None:
        super().__post_init__()
        one_of(self, "backend", "reserve", POLICIES)


class ContiguousBackend(KVBackend):
    name = "contiguous"
    storage = "contiguous"
    Options = ContiguousOptions
    ignored_options: ClassVar[Mapping[str, str]] = {
        "block_size": "contiguous storage reserves one range of single slots per sequence, "
                      "it has no blocks"}

    def __init__(self, layout: KVLayout, device: torch.device, **options: Any) -> None:
        super().__init__(layout, device, **options)
        assert isinstance(self.opts, ContiguousOptions)
        self.reserve = self.opts.reserve

    def allocate(self, sizing: CacheSizing) -> None:
        lay = self.layout
        shape = (sizing.num_slots, lay.num_kv_heads, lay.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=lay.dtype, device=self.device)
                        for _ in range(lay.num_layers)]
        self.v_cache = [torch.zeros_like(t) for t in self.k_cache]
        self._num_slots = sizing.num_slots

    def declare_costs(self) -> KVCosts:
        return KVCosts(self.full_slot_bytes())  # a range per sequence: no block granule

    def make_manager(self, sizing: CacheSizing, **options: Any) -> KVManager:
        return ContiguousKVManager(sizing.num_slots, policy=self.reserve, **options)

    def apply_cache_ops(self, rec: StepRecord) -> None:
        assert not rec.swap_in and not rec.swap_out, "contiguous storage never swaps"
        for op in rec.copies:
            for t in (*self.k_cache, *self.v_cache):
                t[op.dst:op.dst + op.num_slots] = t[op.src:op.src + op.num_slots]

    def begin_step(self, batch: AttentionBatch) -> None:
        super().begin_step(batch)
        # What every layer reads the same way, made once a step from the host's lengths
        # (no device sync to size the gather): the decodes' (B, width) slot indices into
        # their ranges, and each chunk's range start.
        self._decode_idx: torch.Tensor | None = None
        if batch.num_decode:
            self._width = max(d.start + 1 for d in batch.decode_seqs)
            idx = batch.decode_tables[:, :1] + torch.arange(self._width, device=self.device)
            # Past a row's length the key is masked: any slot will do.
            self._decode_idx = idx.clamp_(max=self._num_slots - 1)
        self._chunk_first = [c.sched.slots[0] - c.start for c in batch.prefills]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        b = self.batch
        assert b is not None
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        kc.index_copy_(0, b.slot_mapping, k.to(kc.dtype))
        vc.index_copy_(0, b.slot_mapping, v.to(vc.dtype))
        out = torch.empty_like(q)
        nd = b.num_decode
        if nd:
            idx = self._decode_idx
            assert idx is not None
            if f := self.touch_factor(layer):
                self.touch_full_keys(decode_mask(b.decode_lens, self._width).sum() * f)
            out[:nd] = attend_decode(q[:nd], kc[idx].to(q.dtype), vc[idx].to(q.dtype),
                                     b.decode_lens)
        for c, first in zip(b.prefills, self._chunk_first):
            n = c.start + c.num_tokens
            if f := self.touch_factor(layer):
                self.touch_prefill(chunk_mask(c.start, c.num_tokens, n, device=q.device).sum()
                                   * f)
            out[c.row:c.row + c.num_tokens] = attend_chunk(
                q[c.row:c.row + c.num_tokens], kc[first:first + n].to(q.dtype),
                vc[first:first + n].to(q.dtype), c.start)
        return out
