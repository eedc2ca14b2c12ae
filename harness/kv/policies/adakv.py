"""AdaKV (Feng et al., 2024): per-head budgets from the scores, under one total per layer,
as kvpress runs it (``AdaKVPress.compress``, NVIDIA/kvpress
kvpress/presses/adakv_press.py at commit 8bb29b9c3078452a86d692f29123fa6c793e2b05).

Per layer, over a prompt of ``k_len`` tokens with each KV head's scores (SnapKV's here,
the window padded with the layer's highest score + 1, as kvpress's ``SnapKVPress.score``
pads it): each head first protects its top ``int(n_kept * alpha_safeguard)`` positions;
then the ``kv_heads * (k_len - n_kept)`` lowest scores of the whole layer, whichever head
they are in, go. Heads whose scores are flat lose more, peaked ones less; the layer keeps
``kv_heads * n_kept`` tokens in all. ``n_kept``: ``budget`` tokens, or ``budget_ratio``
of the prompt rounded up (kvbench's presses' rule; kvpress floors ``k_len * (1 -
compression_ratio)``).
"""

from __future__ import annotations

import numpy as np

from harness.errors import UserError
from harness.kv.policies.headwise import HeadPolicy, check_window, kept_count


def adakv_keep(scores: np.ndarray, n_kept: int, alpha: float) -> np.ndarray:
    """kvpress's AdaKV selection of one layer: ``scores`` (kv_heads, k_len) -> bool, what
    stays. Ties go by a stable order (the safeguard: the earlier position; the pruning:
    the lower head, then the earlier position), where kvpress's ``topk`` leaves them open."""
    s = scores.astype(np.float64, copy=True)
    kv, k_len = s.shape
    n_safe = int(n_kept * alpha)
    if n_safe > 0:  # kvpress: finfo.max at each head's top n_safe
        top = np.argsort(-s, axis=1, kind="stable")[:, :n_safe]
        np.put_along_axis(s, top, np.inf, axis=1)
    keep = np.ones(kv * k_len, dtype=bool)
    keep[np.argsort(s.ravel(), kind="stable")[:kv * (k_len - n_kept)]] = False
    return keep.reshape(kv, k_len)


def check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise UserError(f"backend.alpha_safeguard must be in [0, 1], got {alpha}")


class AdaKVPolicy(HeadPolicy):
    """:func:`adakv_keep` per layer over the window-ranked scores."""

    name = "adakv"
    needs_scores = True

    def __init__(self, num_layers: int, kv_heads: int, *, budget: int, budget_ratio: float,
                 window: int, pool_width: int, alpha_safeguard: float) -> None:
        super().__init__(num_layers, kv_heads)
        check_window(window, pool_width)
        check_alpha(alpha_safeguard)
        self.budget_tokens, self.budget_ratio = budget, budget_ratio
        self._window, self.alpha = window, alpha_safeguard

    def window(self) -> int:
        return self._window

    def n_kept(self, prompt_len: int) -> int:
        """Tokens each head keeps on average (the layer's total over its KV heads)."""
        return kept_count(self.budget_tokens, self.budget_ratio, prompt_len)

    def compresses(self, prompt_len: int) -> bool:
        return prompt_len > self._window and self.n_kept(prompt_len) < prompt_len

    def keep(self, prompt_len: int, scores: np.ndarray | None) -> np.ndarray:
        assert scores is not None, "adakv ranks by the window's scores"
        p, kv = prompt_len, self.kv_heads
        lo, n = p - self._window, self.n_kept(prompt_len)
        out = np.zeros((self.heads, p), dtype=bool)
        for layer in range(self.num_layers):
            rows = slice(layer * kv, (layer + 1) * kv)
            s = scores[rows, :lo]
            window = np.full((kv, self._window), s.max() + 1)  # kvpress's padding
            out[rows] = adakv_keep(np.concatenate([s, window], axis=1), n, self.alpha)
        return out
