"""`observed_attention`: keep the tokens that received the most attention from the
queries that saw them (kvpress's ObservedAttentionPress; the attention-based score of
H2O, Zhang et al., 2023, averaged rather than summed).

On the scorer seam (backends/scored.py) with ``reads = "weights"``: each step's explicit
float32 softmax weights, summed over the step's queries, averaged over query heads and
layers, accumulated per slot across the prompt's chunks; at the selection each token's
sum is divided by the number of queries that attended to it (a causal prompt's key at
position ``j`` of ``P`` is seen by ``P - j`` queries, :meth:`ObservedAttentionPolicy.rank`),
so early tokens are not favoured for having been seen more often. The trigger is kvpress's:
the whole prompt, then one compression to ``budget`` tokens (or ``budget_ratio`` of the
prompt), the kept tokens compacted, what is generated kept; ``backend.prefill=streaming``
bounds memory while prefilling (chunks of half the budget, each followed by an eviction by
the averages so far).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from harness.backends.scored import PressOptions, ScoredBackend
from harness.kv.policies.budget import PressPolicy

if TYPE_CHECKING:
    from harness.sched.sequence import Sequence


@dataclass
class ObservedAttentionOptions(PressOptions):
    """A press's options: ``budget_ratio`` of the prompt kept (default 0.2), ``prefill=full``."""


class ObservedAttentionPolicy(PressPolicy):
    name = "observed_attention"
    accumulates = True  # attention received, summed over the steps that computed it

    def rank(self, seq: Sequence, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        # The mean over the queries that saw each token: every computed position at or
        # after it (causal), its own included.
        seen = np.maximum(1, seq.num_computed - positions)
        return self.scores[slots] / seen


class ObservedAttentionBackend(ScoredBackend):
    name = "observed_attention"
    Options = ObservedAttentionOptions
    Policy = ObservedAttentionPolicy
    reads = "weights"

    def score(self, w: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor:
        # w: (B, KV, G, n, L) -> (B, L): the weight each key received, summed over this
        # step's n queries, averaged over the query heads here and over layers by the
        # 1 / num_layers (summed over layers by the base).
        assert w is not None
        return w.sum(dim=3).mean(dim=(1, 2)) / self.layout.num_layers

    def weight_scale(self, num_heads: int) -> float:
        return 1.0 / (num_heads * self.layout.num_layers)
