"""`tova`: Token Omission Via Attention (Oren et al., 2024) under a per-sequence budget.

Each sequence keeps at most ``backend.budget`` tokens (or ``backend.budget_ratio`` of its
prompt + max_tokens); once full, every step drops the token the current query attends to
least, by its attention weight averaged over layers and query heads. The decision is the
KV manager's :class:`~harness.kv.policies.tova.TOVAPolicy`; this backend is h2o's
machinery (backends.scored) with another score: the weights of each sequence's last query
of the step only, and no accumulation across steps. ``backend.prefill=full`` (the
default, as the paper's long-context runs and kvpress): the whole prompt with full
attention, then one selection by its last query's weights, the kept tokens compacted;
``streaming``: prompts longer than half the budget are prefilled in chunks of half the
budget, the last query of each choosing what stays (bounded memory while prefilling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.backends.scored import ScoredBackend, ScorerOptions
from harness.kv.policies.tova import TOVAPolicy


@dataclass
class TOVAOptions(ScorerOptions):
    budget_ratio: float = 0.2  # share of prompt + max_tokens (or budget: tokens)
    # The trigger: full (once, after the whole prompt, by its last query: the TOVA paper's
    # long-context runs, kvpress) | streaming (bounded memory while it is read: chunks of
    # half the budget, each chunk's last query choosing)
    prefill: str = "full"


class TOVABackend(ScoredBackend):
    name = "tova"
    Options = TOVAOptions
    Policy = TOVAPolicy

    weight_rows = "last"  # the Triton path: a chunk's last query, a decode's own

    def score(self, w: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor:
        # The last query's weights (the current token), averaged over the query heads here
        # and over layers by the 1 / num_layers: summed over layers, they are the mean.
        assert w is not None
        return w[:, :, :, -1, :].mean(dim=(1, 2)) / self.layout.num_layers

    def weight_scale(self, num_heads: int) -> float:
        return 1.0 / (num_heads * self.layout.num_layers)
