"""`adakv`: AdaKV (Feng et al., 2024) as kvpress runs it (AdaKVPress around SnapKVPress),
with the memory each head drops given back.

When a prompt's prefill ends, each layer keeps ``kv_heads x n_kept`` tokens (``n_kept``:
``budget``, or ``budget_ratio`` of the prompt) shared among its KV heads by their
scores: each head protects its top ``alpha_safeguard`` share of ``n_kept``, then the
layer's lowest scores go whichever head holds them (harness.kv.policies.adakv). The score
is SnapKV's per KV head as kvpress computes it (backends.headwise.snapkv_head_scores).
Each head has its own table of pages (harness.kv.headwise), so a head that keeps little
frees its pages; what is generated afterwards is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.backends.headwise import HeadPressOptions, HeadwiseBackend, snapkv_head_scores
from harness.kv.policies.adakv import AdaKVPolicy, check_alpha
from harness.kv.policies.headwise import HeadPolicy


@dataclass
class AdaKVOptions(HeadPressOptions):
    alpha_safeguard: float = 0.2  # each head's protected share of n_kept (kvpress's)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_alpha(self.alpha_safeguard)


class AdaKVBackend(HeadwiseBackend):
    name = "adakv"
    Options = AdaKVOptions

    def make_policy(self) -> HeadPolicy:
        o = self.opts
        assert isinstance(o, AdaKVOptions)
        return AdaKVPolicy(self.layout.num_layers, self.layout.num_kv_heads,
                           budget=o.budget, budget_ratio=o.budget_ratio, window=o.window,
                           pool_width=o.pool_width, alpha_safeguard=o.alpha_safeguard)

    def head_scores(self, acc: torch.Tensor) -> torch.Tensor:
        o = self.opts
        assert isinstance(o, AdaKVOptions)
        return snapkv_head_scores(acc, o.window, o.pool_width, o.pooling,
                                  self.layout.num_kv_heads)
