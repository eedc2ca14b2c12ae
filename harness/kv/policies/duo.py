"""DuoAttention (Xiao et al., 2024): retrieval heads keep every token, streaming heads keep
the first ``sink`` tokens and the last ``recent`` of a prompt, as kvpress runs it
(``DuoAttentionPress``, NVIDIA/kvpress kvpress/presses/duo_attention_press.py at commit
8bb29b9c3078452a86d692f29123fa6c793e2b05: the ``round(heads x head_ratio)`` heads of the
lowest score stream, and a streaming head loses prompt positions ``[sink, P - recent)``).

Which heads score lowest is measured on the model at start-up (backends/duo_heads.py: no
downloaded patterns); until then (``executor=roofline``, which has no model) the first
heads in layer order stand in: the counts, what the what-if measures, are the same.
"""

from __future__ import annotations

import numpy as np

from harness.errors import UserError
from harness.kv.policies.headwise import HeadPolicy


def choose_streaming(head_scores: np.ndarray, head_ratio: float) -> np.ndarray:
    """kvpress's rule (``post_init_from_model``): the ``round(size x head_ratio)`` heads
    with the lowest ``head_scores`` (any shape; ties: the earlier head) stream -> bool,
    the same shape."""
    n = round(head_scores.size * head_ratio)
    mask = np.zeros(head_scores.size, dtype=bool)
    mask[np.argsort(head_scores, axis=None, kind="stable")[:n]] = True
    return mask.reshape(head_scores.shape)


def check_duo_options(head_ratio: float, sink: int, recent: int) -> None:
    if not 0.0 <= head_ratio <= 1.0:
        raise UserError(f"backend.head_ratio (the streaming heads' share) must be in [0, 1], "
                        f"got {head_ratio}")
    if sink < 0 or recent < 1:
        raise UserError(f"need backend.sink_tokens >= 0 and backend.recent >= 1, got {sink} "
                        f"and {recent}")


class DuoPolicy(HeadPolicy):
    """Streaming heads (:attr:`streaming`, (heads,) bool) keep the prompt's sinks and its
    last ``recent`` tokens; the others keep it all."""

    name = "duo_attention"

    def __init__(self, num_layers: int, kv_heads: int, *, head_ratio: float, sink: int,
                 recent: int) -> None:
        super().__init__(num_layers, kv_heads)
        check_duo_options(head_ratio, sink, recent)
        self.head_ratio, self.sink, self.recent = head_ratio, sink, recent
        # Until the model is measured: the first heads (the same count).
        self.streaming = choose_streaming(np.arange(self.heads, dtype=np.float64), head_ratio)

    def use_streaming(self, mask: np.ndarray) -> None:
        """The streaming heads measured on the model: bool (heads,), the same count."""
        assert mask.shape == (self.heads,) and mask.sum() == self.streaming.sum()
        self.streaming = mask.astype(bool)

    def params(self) -> dict[str, object]:
        return {**super().params(), "streaming": self.streaming}

    def compresses(self, prompt_len: int) -> bool:
        return bool(self.streaming.any()) and prompt_len > self.sink + self.recent

    def kept_counts(self, prompt_len: int) -> np.ndarray:
        short = min(prompt_len, self.sink + self.recent)
        return np.where(self.streaming, short, prompt_len).astype(np.int64)

    def keep(self, prompt_len: int, scores: np.ndarray | None) -> np.ndarray:
        out = np.ones((self.heads, prompt_len), dtype=bool)
        if prompt_len > self.sink + self.recent:
            out[np.flatnonzero(self.streaming), self.sink:prompt_len - self.recent] = False
        return out
