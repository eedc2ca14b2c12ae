"""`knorm`: keep the tokens whose keys have the lowest L2 norm (kvpress's KnormPress;
Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression").

The scorer seam's smallest method (backends/scored.py): a query-agnostic score, so no
attention weights are computed (attention stays SDPA). A key is worth minus its L2 norm,
averaged over layers and KV heads (one slot holds a token for all of them: one number per
token decides), scored once, in the step that writes it. The trigger is kvpress's: the
whole prompt, then one compression to ``budget`` tokens (or ``budget_ratio`` of the
prompt), the kept tokens compacted; what is generated afterwards is all kept (a press has
no decode budget). ``backend.prefill=streaming`` bounds memory while prefilling instead
(chunks of half the budget, each followed by an eviction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.backends.scored import PressOptions, ScoredBackend
from harness.kv.policies.budget import PressPolicy


@dataclass
class KnormOptions(PressOptions):
    """A press's options: ``budget_ratio`` of the prompt kept (default 0.2), ``prefill=full``."""


class KnormPolicy(PressPolicy):
    name = "knorm"


class KnormBackend(ScoredBackend):
    name = "knorm"
    Options = KnormOptions
    Policy = KnormPolicy
    reads = "keys"

    def score(self, w: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor:
        # k: (T, KV, D) -> (T,): minus the norm, the mean over KV heads here and over
        # layers by the 1 / num_layers (summed over layers by the base).
        return -k.norm(dim=-1).mean(dim=-1) / self.layout.num_layers
