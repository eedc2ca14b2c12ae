"""Heavy-Hitter Oracle (Zhang et al., 2023): keep the most recent tokens and the tokens
that received the most attention so far, within a per-sequence budget.

Scores: the attention each slot received, summed over layers, KV heads, query heads and
queries, accumulated over the steps since its token was written (``on_scores``). A slot
holds a token for every layer and head, so a whole token goes at a time: the lowest
accumulated score outside the recent window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from harness.errors import UserError
from harness.kv.policies.budget import BudgetPolicy, ScorerOpts, check_budget_options, ratio_budget

if TYPE_CHECKING:
    from harness.sched.sequence import Sequence

__all__ = ["H2OPolicy", "check_budget_options", "ratio_budget"]


class H2OOpts(ScorerOpts, Protocol):
    heavy_ratio: float  # heavy hitters' share of the budget; the rest is recent


class H2OPolicy(BudgetPolicy):
    name = "h2o"
    accumulates = True

    def __init__(self, opts: H2OOpts) -> None:
        super().__init__(opts)
        self.heavy_ratio = opts.heavy_ratio
        if not 0.0 < self.heavy_ratio < 1.0:
            raise UserError(f"backend.heavy_ratio must be in (0, 1), got {self.heavy_ratio}")

    def recent(self, budget: int) -> int:
        """The recent window's share of ``budget`` (the rest is for heavy hitters)."""
        return max(1, budget - max(1, round(self.heavy_ratio * budget)))

    def streaming_chunk(self, budget: int | None) -> int:
        """The heavy part of the budget: a chunk never has to evict the recent window."""
        assert budget is not None
        return max(1, budget - self.recent(budget))

    def candidates(self, seq: Sequence, positions: np.ndarray) -> np.ndarray:
        return positions < seq.num_computed - self.recent(self.seq_budget(seq))
