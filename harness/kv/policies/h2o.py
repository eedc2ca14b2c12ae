"""Heavy-Hitter Oracle (Zhang et al., 2023): keep the most recent tokens and the tokens
that received the most attention so far, within a per-sequence budget.

Scores: the attention each slot received, summed over layers, KV heads, query heads and
queries, accumulated over the steps since its token was written (``on_scores``). A slot
holds a token for every layer and head, so a whole token goes at a time: the lowest
accumulated score outside the recent window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from harness.errors import UserError
from harness.kv.policies.base import Eviction, EvictionPolicy

if TYPE_CHECKING:
    from harness.kv.base import StepScores
    from harness.kv.evicting import EvictingKVManager
    from harness.sched.sequence import Sequence


def ratio_budget(budget: int, ratio: float, prompt_len: int, max_tokens: int) -> int:
    """``budget`` tokens, or ``ratio`` of prompt + max_tokens (rounded up), at least 2."""
    if budget:
        return max(budget, 2)
    total = prompt_len + max_tokens
    # Integer arithmetic on a rounded ratio: 0.3 * 10 must give 3, not 3.0000000000000004.
    return max(-(-round(ratio * 1_000_000) * total // 1_000_000), 2)


def check_budget_options(budget: int, budget_ratio: float) -> None:
    if budget < 0 or not 0.0 <= budget_ratio <= 1.0:
        raise UserError(f"need backend.budget >= 0 and 0 <= backend.budget_ratio <= 1, got "
                        f"{budget} and {budget_ratio}")
    if (budget <= 0) == (budget_ratio <= 0):
        raise UserError("set exactly one of backend.budget (tokens) and "
                        "backend.budget_ratio (share of prompt + max_tokens)")


@dataclass
class H2OPolicy(EvictionPolicy):
    budget_tokens: int = 0
    budget_ratio: float = 0.2
    heavy_ratio: float = 0.5
    name = "h2o"
    needs_scores = True

    def __post_init__(self) -> None:
        check_budget_options(self.budget_tokens, self.budget_ratio)
        if not 0.0 < self.heavy_ratio < 1.0:
            raise UserError(f"backend.heavy_ratio must be in (0, 1), got {self.heavy_ratio}")
        self.scores = np.zeros(0)

    def budget(self, prompt_len: int, max_tokens: int) -> int:
        return ratio_budget(self.budget_tokens, self.budget_ratio, prompt_len, max_tokens)

    def recent(self, budget: int) -> int:
        """The recent window's share of ``budget`` (the rest is for heavy hitters)."""
        return max(1, budget - max(1, round(self.heavy_ratio * budget)))

    def max_chunk(self, budget: int | None) -> int:
        """The heavy part of the budget: a chunk never has to evict the recent window."""
        assert budget is not None
        return max(1, budget - self.recent(budget))

    def reset(self, num_slots: int) -> None:
        self.scores = np.zeros(num_slots)

    def on_scores(self, scores: StepScores) -> None:
        self.scores[scores.slots] += scores.values

    def on_write(self, slots: list[int]) -> None:
        self.scores[slots] = 0.0

    def on_copy(self, src: int, dst: int, num_slots: int) -> None:
        self.scores[dst:dst + num_slots] = self.scores[src:src + num_slots]

    def select(self, seq: Sequence, kv: EvictingKVManager, need: int) -> Eviction:
        if need <= 0:
            return Eviction()
        slots, pos = kv.live_slots(seq)
        recent_from = seq.num_computed - self.recent(self.budget(
            seq.num_prompt_tokens, seq.group.params.max_tokens))
        cand = pos < recent_from
        assert int(cand.sum()) >= need, "a chunk larger than the evictable budget"
        score = np.where(cand, self.scores[slots], np.inf)
        # Stable: equal scores go oldest slot first, so runs are reproducible.
        order = np.argsort(score, kind="stable")[:need]
        return Eviction(slots=slots[order].tolist())
