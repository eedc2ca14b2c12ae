"""`keydiff`: keep the tokens whose keys are least like the others (kvpress's KeyDiffPress;
Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
Inference in Resource-Constrained Environments").

A query-agnostic score on the scorer seam (backends/scored.py), read from every key the
sequence holds at once (``reads = "held"``): the anchor is the mean of the held keys,
each normalized to unit length, per layer and KV head; a key is worth minus its cosine
similarity to the anchor, averaged over KV heads and layers (one slot holds a token for
all of them: one number per token decides). Attention stays SDPA. The trigger is
kvpress's: the whole prompt, then one compression to ``budget`` tokens (or
``budget_ratio`` of the prompt), the kept tokens compacted; what is generated afterwards
is all kept (a press has no decode budget). ``backend.prefill=streaming`` is the paper's
own block-wise form (kvpress's BlockPress around KeyDiffPress): chunks of half the budget,
after each of which the held keys are scored again and the least distinctive go.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness.backends.scored import PressOptions, ScoredBackend
from harness.kv.policies.budget import PressPolicy


@dataclass
class KeyDiffOptions(PressOptions):
    """A press's options; ``prefill=streaming`` is the paper's block-wise eviction."""


class KeyDiffPolicy(PressPolicy):
    name = "keydiff"


class KeyDiffBackend(ScoredBackend):
    name = "keydiff"
    Options = KeyDiffOptions
    Policy = KeyDiffPolicy
    reads = "held"

    def score(self, w: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor:
        # k: (T, KV, D) every key the sequence holds -> (T,): minus the cosine similarity
        # to the mean unit key (per KV head), the mean over KV heads here and over layers
        # by the 1 / num_layers (summed over layers by the base).
        anchor = F.normalize(k, dim=-1).mean(dim=0, keepdim=True)  # (1, KV, D)
        cos = F.cosine_similarity(k, anchor, dim=-1)  # (T, KV)
        return -cos.mean(dim=-1) / self.layout.num_layers
