"""`sliding_window`: attend to the last ``backend.window`` tokens plus the first
``backend.sink_tokens`` (StreamingLLM's attention sinks; default 4, 0 allowed).

Attention is `paged`'s (torch reference or the Triton kernels' window bound, per
``backend.kernel``). Blocks that fall wholly outside both are given back to the allocator
after every step (counted in ``cache.evicted_tokens``; steps.csv shows reserved bytes
falling), so a long
sequence holds at most ``window + block_size`` tokens plus its sink blocks. The stored
K/V are exact: a block's content still matches its hash, so prefix caching stays on.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.backends.base import KVLayout
from harness.backends.paged import PagedBackend
from harness.kv.paged import PagedKVManager
from harness.sched.sequence import SeqStatus
from harness.sched.step import StepRecord


class SlidingWindowBackend(PagedBackend):
    name = "sliding_window"
    exact = False

    def __init__(self, layout: KVLayout, device: torch.device, *, window: int = 256,
                 sink_tokens: int = 4, **options: Any) -> None:
        super().__init__(layout, device, **options)
        if window < 1 or sink_tokens < 0:
            raise ValueError(f"need backend.window >= 1 and backend.sink_tokens >= 0, got "
                             f"{window} and {sink_tokens}")
        self.window = window
        self.window_sinks = self.sink_tokens = sink_tokens

    def end_step(self, rec: StepRecord) -> None:
        """Free every block no later query can see: the next query of a sequence sits at
        position ``num_computed`` and sees keys from ``num_computed + 1 - window`` on."""
        kv = self.kv
        assert isinstance(kv, PagedKVManager), "sliding_window needs paged storage"
        keep_first = -(-self.sink_tokens // self.block_size)
        for s in rec.seqs:
            seq = s.seq
            if seq.status is not SeqStatus.RUNNING or not seq.block_table:
                continue
            kv.free_leading(seq, max(0, seq.num_computed + 1 - self.window), keep_first)
