"""`h2o`: Heavy-Hitter Oracle eviction (Zhang et al., 2023) under a per-sequence budget.

Each sequence keeps at most ``backend.budget`` tokens (or ``backend.budget_ratio`` of its
prompt + max_tokens): the most recent ``(1 - heavy_ratio)`` share of the budget, and as
heavy hitters the tokens that received the most attention so far. The decision is the KV
manager's :class:`~harness.kv.policies.h2o.H2OPolicy`; this backend stores, attends with
explicit softmax weights (backends.scored), and after each forward hands the manager the
attention every touched slot received (summed over layers, KV heads, query heads and
queries). A slot holds a token's K/V for every layer and head, so memory is given back a
whole token at a time, and new tokens reuse the freed slots: the sequence never holds more
than its budget (the allocator's count, not a mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.backends.scored import ScoredBackend, ScorerOptions
from harness.kv.policies.h2o import H2OPolicy


@dataclass
class H2OOptions(ScorerOptions):
    budget_ratio: float = 0.2  # share of prompt + max_tokens (or budget: tokens)
    heavy_ratio: float = 0.5  # heavy hitters' share of the budget; the rest is recent
    # The trigger: streaming (H2O's step-by-step eviction, the paper's algorithm: bounded
    # memory while the prompt is read) | full (once, after the whole prompt)
    prefill: str = "streaming"


class H2OBackend(ScoredBackend):
    name = "h2o"
    Options = H2OOptions
    Policy = H2OPolicy

    def score(self, w: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor:
        # Attention received, summed over KV heads, their query heads and the queries.
        assert w is not None
        return w.sum(dim=(1, 2, 3))
