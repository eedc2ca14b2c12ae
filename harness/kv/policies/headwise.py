"""What the per-head methods decide (pyramidkv, adakv, duo_attention): which prompt tokens
each (layer, KV head) keeps, once, when the prompt's prefill ends.

A head here is one KV head of one layer, ``layer * num_kv_heads + kv_head`` (layer-major,
as the model's layers run); each has its own table of pages in the KV manager
(harness.kv.headwise), so a token one head drops and another keeps frees that head's
share of its bytes. The policy sees only numbers: per-slot scores kept from the step that
scored the prompt (``on_scores``; the slots are the heads' own), and at the selection the
prompt's scores laid out by head and position (:meth:`HeadPolicy.keep`). What is generated
after the prompt is all kept (a press has no decode budget). No torch here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import numpy as np

from harness.errors import UserError

if TYPE_CHECKING:
    from harness.kv.base import StepScores


def check_window(window: int, pool_width: int) -> None:
    """The observation window and its pooling width (odd, as kvpress's padding needs)."""
    if window < 1:
        raise UserError(f"backend.window must be >= 1, got {window}")
    if pool_width < 1 or pool_width % 2 == 0:
        raise UserError(f"backend.pool_width must be odd and >= 1, got {pool_width}")


def kept_count(budget: int, budget_ratio: float, prompt_len: int) -> int:
    """Prompt tokens a head keeps on average: ``budget``, or ``budget_ratio`` of the prompt
    rounded up (kvbench's presses' rule; kvpress floors ``k_len * (1 - ratio)``), at most
    the prompt."""
    if budget:
        return min(budget, prompt_len)
    # Integer arithmetic on a rounded ratio: 0.3 * 10 must give 3, not 3.0000000000000004.
    return min(prompt_len, -(-round(budget_ratio * 1_000_000) * prompt_len // 1_000_000))


def top_by_score(scores: np.ndarray, n: int) -> np.ndarray:
    """Bool mask of the ``n`` highest of each row of ``scores`` (rows, L): ties go to the
    earlier position (a stable sort of the negated scores)."""
    keep = np.zeros(scores.shape, dtype=bool)
    if n > 0:
        order = np.argsort(-scores, axis=-1, kind="stable")[..., :n]
        np.put_along_axis(keep, order, True, axis=-1)
    return keep


class HeadPolicy(ABC):
    """The per-head selection of one method: ``heads`` = layers x KV heads tables.
    Subclasses say whether a prompt is compressed at all and what each head keeps."""

    name: str = ""
    needs_scores: bool = False  # the backend sends per-slot scores of the prompt's end

    def __init__(self, num_layers: int, kv_heads: int) -> None:
        self.num_layers, self.kv_heads = num_layers, kv_heads
        self.heads = num_layers * kv_heads
        self.scores = np.zeros(0)
        # The method's options (its backend's, set by it): a compressed prefix's name.
        self.options: dict[str, object] = {}

    @property
    def compresses_once(self) -> bool:
        """A prompt is compressed once, at its end; what follows is all kept."""
        return True

    def params(self) -> dict[str, object]:
        """What decides what each head keeps: part of a compressed prefix's name."""
        return dict(self.options)

    def reset(self, num_slots: int) -> None:
        """Size the per-slot scores for ``num_slots`` head slots (pages x block size)."""
        self.scores = np.zeros(num_slots)

    def on_scores(self, scores: StepScores) -> None:
        """A step's scores: each prompt slot scored at the prompt's end (no history)."""
        self.scores[scores.slots] = scores.values

    def window(self) -> int:
        """The prompt's last tokens every head keeps and that score the rest (0: none)."""
        return 0

    @abstractmethod
    def compresses(self, prompt_len: int) -> bool:
        """Whether a prompt of ``prompt_len`` tokens loses any token in any head."""

    @abstractmethod
    def keep(self, prompt_len: int, scores: np.ndarray | None) -> np.ndarray:
        """What each head keeps of a ``prompt_len``-token prompt: bool (heads, prompt_len).
        ``scores``: float64 (heads, prompt_len), each position's score in each head (the
        last :meth:`window` positions hold nothing: they are kept), or None when the
        method reads none (``needs_scores`` False)."""

    def kept_counts(self, prompt_len: int) -> np.ndarray | None:
        """Tokens each head keeps, (heads,) int64, when a function of the prompt's length
        alone (None: it depends on the scores)."""
        return None
