"""SnapKV (Li et al., 2024): at the end of a prompt's prefill, keep the prompt tokens the
prompt's last queries (the observation window) attend to most, and the window itself.

This is the variant that frees memory: one selection per sequence, the scores summed over
every layer and head (the backend pools each head's scores over neighbouring positions
before summing, as the paper does). A slot holds a token for all layers and heads, so a
per-head selection would free nothing here.

Per sequence with a prompt of P tokens: ``keep(P)`` = the window + ``budget`` tokens (or
``budget_ratio`` x P of them) of the P - window before it. Until the prompt is prefilled
the sequence holds it all (``peak``); after, the kept prompt plus everything it
generates, optionally capped at ``max_tokens`` held (``held_limit``); admission promises
only the kept prompt (``budget``), the rest grows as in a paged cache. Under the cap, the
oldest generated tokens go first (a sliding window over what it generates), then the
lowest-scored prompt tokens. The manager compacts the kept tokens into fewer blocks
(``compacts``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from harness.errors import UserError
from harness.kv.policies.base import Eviction, HeldBlocks, HeldTokens
from harness.kv.policies.budget import (
    BudgetPolicy,
    ScorerOpts,
    check_budget_options,
    ratio_budget,
)

if TYPE_CHECKING:
    from harness.sched.sequence import Sequence


def check_snapkv_options(budget: int, budget_ratio: float, window: int,
                         max_tokens: int) -> None:
    check_budget_options(budget, budget_ratio)
    if window < 1 or max_tokens < 0:
        raise UserError(f"need backend.window >= 1 and backend.max_tokens >= 0, got "
                        f"{window} and {max_tokens}")
    if max_tokens and max_tokens <= window:
        raise UserError(f"backend.max_tokens={max_tokens} must exceed backend.window="
                        f"{window} (0: no cap)")


class SnapKVOpts(ScorerOpts, Protocol):
    """backends/snapkv.py's ``SnapKVOptions``: ``budget`` (or ``budget_ratio`` of the
    prompt) are the prompt tokens kept besides the window."""

    window: int  # the prompt's last queries, whose attention scores the rest
    max_tokens: int  # cap on tokens held while decoding (0: none)
    prefill: str  # full: one selection at the prompt's end | streaming: one per chunk


class SnapKVPolicy(BudgetPolicy):
    """A :class:`BudgetPolicy` (the scored methods' per-slot scores, options and trigger)
    whose budget is the kept prompt and whose window is never a candidate. Reads the
    backend's one options dataclass (``opts``), as every scored method's."""

    name = "snapkv"

    def __init__(self, opts: SnapKVOpts) -> None:
        super().__init__(opts)
        self.window, self.max_tokens = opts.window, opts.max_tokens
        check_snapkv_options(self.budget_tokens, self.budget_ratio, self.window,
                             self.max_tokens)
        # Both triggers leave holes in every block of the prompt (streaming: one selection
        # per chunk of the kept prompt), so the kept tokens always move together.
        self.compacts = True

    @property
    def compresses_once(self) -> bool:
        # Full trigger, and no cap evicting generated tokens while decoding.
        return self.prefill == "full" and not self.max_tokens

    def keep(self, prompt_len: int, max_tokens: int = 0) -> int:
        """Prompt tokens kept after the selection: the window + the selected ones."""
        before = max(0, prompt_len - self.window)
        chosen = ratio_budget(self.budget_tokens, self.budget_ratio, prompt_len, 0)
        return min(prompt_len, self.window + min(before, chosen))

    def _capped(self, n: int) -> int:
        return min(n, self.max_tokens) if self.max_tokens else n

    def budget(self, prompt_len: int, max_tokens: int) -> int:
        """What admission promises: the kept prompt only. Decoding then grows lazily, as
        a paged sequence does (preempting when the pool runs out); promising
        keep + max_tokens up front admitted 3 sequences where paged ran 16."""
        return self._capped(self.keep(prompt_len))

    def max_chunk(self, budget: int | None) -> int | None:
        """Streaming: chunks of the kept prompt, at least the window (each chunk's own last
        ``window`` queries score what came before; fewer in a shorter last chunk)."""
        if not self.streaming:
            return None
        assert budget is not None
        return max(self.window, budget)

    def peak(self, prompt_len: int, max_tokens: int) -> int:
        generating = self._capped(self.keep(prompt_len) + max_tokens)
        if self.streaming:  # the kept prompt + one chunk while prefilling
            chunk = self.max_chunk(self.budget(prompt_len, max_tokens)) or 0
            return max(min(prompt_len, self.keep(prompt_len) + chunk), generating)
        return max(prompt_len, generating)

    def held_limit(self, seq: Sequence, n: int) -> int | None:
        p = seq.num_prompt_tokens
        if seq.num_computed < p:
            # Full: the prompt is still being prefilled, it is all held. Streaming: the kept
            # prompt, the next chunk on top of it (chosen among after it ran).
            return self.keep(p) + n if self.streaming else None
        return self._capped(self.keep(p) + seq.num_computed + n - p)

    def select(self, seq: Sequence, held: HeldBlocks | HeldTokens, need: int) -> Eviction:
        assert isinstance(held, HeldTokens), "a token policy decides by slots"
        if need <= 0:
            return Eviction()
        slots, pos = held
        p = seq.num_prompt_tokens
        # The prompt so far (all of it once prefilled; streaming: up to the chunk just run),
        # of which the tokens before its last `window` are what the window scored.
        end = min(p, seq.num_computed)
        scored = np.flatnonzero(pos < end - self.window)
        # Lowest score first; ties (max-pooling makes neighbours equal) go latest first,
        # so the earliest of equals is kept.
        by_score = scored[np.lexsort((-pos[scored], self.scores[slots[scored]]))]
        # The selection proper: the prompt down to keep(p), lowest scores first.
        excess = max(0, int((pos < end).sum()) - self.keep(p))
        first = by_score[:min(need, excess)]
        rest = need - len(first)
        if rest:  # the cap: old generated tokens, then more of the prompt, then the rest
            old = np.flatnonzero((pos >= p) & (pos < seq.num_computed - 1))
            left = np.setdiff1d(np.arange(len(pos)), np.concatenate([first, old]),
                                assume_unique=True)
            tail = np.concatenate([old[np.argsort(pos[old], kind="stable")],
                                   by_score[len(first):],
                                   left[np.argsort(pos[left], kind="stable")]])
            _, idx = np.unique(tail, return_index=True)
            first = np.concatenate([first, tail[np.sort(idx)][:rest]])
        assert len(first) >= need, "snapkv: fewer tokens than the budget needs"
        return Eviction(slots=slots[first].tolist())
