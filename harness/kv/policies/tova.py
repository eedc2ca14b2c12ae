"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"): within a per-sequence
budget, evict the token the *current* query attends to least.

Scores: the attention weight each slot gets from the step's last query of the sequence
(its decode token, or the last token of a prefill chunk), averaged over layers and query
heads; each step's scores replace the previous ones (no history, unlike h2o). Every live
token is a candidate, the newest included, as in the paper.
"""

from __future__ import annotations

from harness.kv.policies.budget import BudgetPolicy


class TOVAPolicy(BudgetPolicy):
    name = "tova"

    def streaming_chunk(self, budget: int | None) -> int:
        """Half the budget: a prompt chunk always sees at least as many kept tokens as it
        brings, and its last query then chooses among them."""
        assert budget is not None
        return max(1, budget // 2)
