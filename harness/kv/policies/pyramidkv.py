"""PyramidKV (Cai et al., 2024): per-layer budgets in a pyramid, lower layers keeping more,
each head of a layer keeping its own top tokens by SnapKV's score.

The budgets are kvpress's (``PyramidKVPress.get_layer_budget``, NVIDIA/kvpress
kvpress/presses/pyramidkv_press.py at commit 8bb29b9c3078452a86d692f29123fa6c793e2b05,
itself from KVCache-Factory's pyramidkv_utils.py): with ``kept`` the prompt tokens a layer
keeps on average (kvpress: ``q_len * (1 - compression_ratio)``) and ``window`` the
observation window,

    min_num = kept / beta,  max_num = 2 kept - min_num   (capped at q_len - window,
                                                          min_num then 2 kept - max_num)
    layer l keeps round(max_num - l (max_num - min_num) / (layers - 1))

so the layers' mean is ``kept``; unless ``q_len >= max_num >= min_num >= window``, when
every layer keeps ``round(kept)`` (kvpress falls back to SnapKV). A layer's budget counts
its window, which always stays (kvpress pads the window's score above every other).
"""

from __future__ import annotations

import numpy as np

from harness.errors import UserError
from harness.kv.policies.headwise import HeadPolicy, check_window, top_by_score


def pyramid_budgets(q_len: int, kept: float, window: int, beta: int,
                    num_layers: int) -> list[int]:
    """Each layer's kept tokens, kvpress's ``get_layer_budget`` for layer 0..num_layers - 1
    (its arithmetic in its order: ``max_capacity_prompt - window`` is not always ``kept``
    in floating point, and the test holds the two to the bit)."""
    max_capacity_prompt = window + kept
    min_num = (max_capacity_prompt - window) / beta
    max_num = (max_capacity_prompt - window) * 2 - min_num
    if max_num >= q_len - window:
        max_num = q_len - window
        min_num = (max_capacity_prompt - window) * 2 - max_num
    if not (q_len >= max_num >= min_num >= window):
        return [round(kept)] * num_layers  # kvpress: round(q_len * (1 - compression_ratio))
    steps = (max_num - min_num) / (num_layers - 1) if num_layers > 1 else 0.0
    return [round(max_num - layer * steps) for layer in range(num_layers)]


def check_beta(beta: int) -> None:
    if beta < 1:
        raise UserError(f"backend.beta (the pyramid's steepness) must be >= 1, got {beta}")


class PyramidKVPolicy(HeadPolicy):
    """Layer ``l`` keeps ``pyramid_budgets(...)[l]`` tokens in each of its KV heads: the
    window (latest first, should a budget be smaller), then the highest scores (ties: the
    earlier position)."""

    name = "pyramidkv"
    needs_scores = True

    def __init__(self, num_layers: int, kv_heads: int, *, budget: int, budget_ratio: float,
                 window: int, pool_width: int, beta: int) -> None:
        super().__init__(num_layers, kv_heads)
        check_window(window, pool_width)
        check_beta(beta)
        self.budget_tokens, self.budget_ratio = budget, budget_ratio
        self._window, self.beta = window, beta

    def window(self) -> int:
        return self._window

    def layer_budgets(self, prompt_len: int) -> list[int]:
        """Each layer's kept prompt tokens (at most the prompt)."""
        kept: float = (float(min(self.budget_tokens, prompt_len)) if self.budget_tokens
                       else prompt_len * self.budget_ratio)
        return [min(prompt_len, n) for n in pyramid_budgets(
            prompt_len, kept, self._window, self.beta, self.num_layers)]

    def kept_counts(self, prompt_len: int) -> np.ndarray:
        return np.repeat(np.asarray(self.layer_budgets(prompt_len), dtype=np.int64),
                         self.kv_heads)

    def compresses(self, prompt_len: int) -> bool:
        return prompt_len > self._window and min(self.layer_budgets(prompt_len)) < prompt_len

    def keep(self, prompt_len: int, scores: np.ndarray | None) -> np.ndarray:
        assert scores is not None, "pyramidkv ranks by the window's scores"
        p, w = prompt_len, self._window
        lo = p - w
        # The window first, latest first; then the scored positions by score.
        ranked = np.concatenate([np.full((self.heads, w), np.inf), scores[:, :lo]], axis=1)
        pos = np.concatenate([np.arange(p - 1, lo - 1, -1), np.arange(lo)])
        out = np.zeros((self.heads, p), dtype=bool)
        for layer, n in enumerate(self.layer_budgets(p)):
            rows = slice(layer * self.kv_heads, (layer + 1) * self.kv_heads)
            out[rows][:, pos] = top_by_score(ranked[rows], n)  # (a view: written through)
        return out

