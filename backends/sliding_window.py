"""`sliding_window`: attend to the last ``backend.window`` tokens plus the first
``backend.sink_tokens`` (StreamingLLM's attention sinks; default 4, 0 allowed).

Attention is `paged`'s (torch reference or the Triton kernels' window bound, per
``backend.kernel``), and so is its cost declaration (paged's window knobs:
:class:`~harness.backends.costs.WindowCosts`). What is freed is the KV manager's
:class:`WindowPolicy` (harness.kv.policies.window): after every step, blocks that fall
wholly outside both are given back (counted in ``cache.evicted_tokens``; steps.csv shows
reserved bytes falling), so a long sequence holds at most ``window + block_size`` tokens
plus its sink blocks. The stored K/V are exact: a block's content still matches its hash,
so prefix caching stays on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from harness.backends.base import CacheSizing, KVLayout
from harness.backends.paged import PagedBackend, PagedOptions
from harness.kv.base import KVManager
from harness.kv.evicting import WindowKVManager
from harness.kv.policies.base import EvictionPolicy
from harness.kv.policies.window import WindowPolicy


@dataclass
class SlidingWindowOptions(PagedOptions):
    window: int = 256  # tokens a query sees back from itself (itself included)
    sink_tokens: int = 4  # first tokens always seen (StreamingLLM's attention sinks)


class SlidingWindowBackend(PagedBackend):
    name = "sliding_window"
    # A hybrid model: the window (and sinks) on its full layers only, its sliding layers
    # keeping their own (harness.stack.kv_plan; the full KV cache groups give blocks back).
    supports_groups = True
    exact = False
    Options = SlidingWindowOptions

    def __init__(self, layout: KVLayout, device: torch.device, **options: Any) -> None:
        super().__init__(layout, device, **options)
        o = self.opts
        assert isinstance(o, SlidingWindowOptions)
        self.policy = WindowPolicy(o.window, o.sink_tokens)
        self.window = o.window
        self.window_sinks = self.sink_tokens = o.sink_tokens

    def full_group_policy(self) -> EvictionPolicy | None:
        return self.policy

    def make_manager(self, sizing: CacheSizing, **options: Any) -> KVManager:
        return WindowKVManager(sizing.num_blocks, sizing.block_size, self.policy,
                                 num_cpu_blocks=sizing.num_cpu_blocks, **options)


class StreamingLLMBackend(SlidingWindowBackend):
    """`streaming_llm`: StreamingLLM (Xiao et al., 2024) by name, a preset of
    sliding_window with 4 attention sinks (conf/backend/streaming_llm.yaml); no code of its
    own beyond the name the run records."""

    name = "streaming_llm"
