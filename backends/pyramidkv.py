"""`pyramidkv`: PyramidKV (Cai et al., 2024) as kvpress runs it (PyramidKVPress), with the
memory each head drops given back.

When a prompt's prefill ends, layer l keeps a budget from kvpress's pyramid (lower layers
more, the layers' mean ``budget`` tokens or ``budget_ratio`` of the prompt;
harness.kv.policies.pyramidkv) in each of its KV heads: the observation window (the last
``window`` tokens) and the positions with the highest SnapKV score in that head (kvpress's
``SnapKVPress.score``: the window queries' softmax weights averaged over the queries,
pooled over ``pool_width`` positions, averaged over the KV head's query heads). Each head
has its own table of pages (harness.kv.headwise): the kept tokens are compacted into the
head's first pages and the rest go back to the pool. What is generated afterwards is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.backends.headwise import HeadPressOptions, HeadwiseBackend, snapkv_head_scores
from harness.kv.policies.headwise import HeadPolicy
from harness.kv.policies.pyramidkv import PyramidKVPolicy, check_beta


@dataclass
class PyramidKVOptions(HeadPressOptions):
    beta: int = 20  # the pyramid's steepness: the top layer keeps 1/beta of the mean

    def __post_init__(self) -> None:
        super().__post_init__()
        check_beta(self.beta)


class PyramidKVBackend(HeadwiseBackend):
    name = "pyramidkv"
    Options = PyramidKVOptions

    def make_policy(self) -> HeadPolicy:
        o = self.opts
        assert isinstance(o, PyramidKVOptions)
        return PyramidKVPolicy(self.layout.num_layers, self.layout.num_kv_heads,
                               budget=o.budget, budget_ratio=o.budget_ratio,
                               window=o.window, pool_width=o.pool_width, beta=o.beta)

    def head_scores(self, acc: torch.Tensor) -> torch.Tensor:
        o = self.opts
        assert isinstance(o, PyramidKVOptions)
        return snapkv_head_scores(acc, o.window, o.pool_width, o.pooling,
                                  self.layout.num_kv_heads)
