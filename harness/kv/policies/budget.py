"""What the per-sequence-budget policies share (h2o, tova): a token budget, and one score
per slot that decides which token goes.

A slot holds a token's K/V for every layer and head, so a whole token goes at a time: the
one with the lowest score among the candidates a policy allows. Scores live in a numpy
array indexed by slot; a slot's score belongs to the token in it (zeroed when a new token
is written there, carried along by copies).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import numpy as np

from harness.errors import UserError
from harness.kv.policies.base import Eviction, EvictionPolicy, HeldBlocks, HeldTokens

if TYPE_CHECKING:
    from harness.kv.base import StepScores
    from harness.sched.sequence import Sequence


def ratio_budget(budget: int, ratio: float, prompt_len: int, max_tokens: int) -> int:
    """``budget`` tokens, or ``ratio`` of prompt + max_tokens (rounded up), at least 2."""
    if budget:
        return max(budget, 2)
    total = prompt_len + max_tokens
    # Integer arithmetic on a rounded ratio: 0.3 * 10 must give 3, not 3.0000000000000004.
    return max(-(-round(ratio * 1_000_000) * total // 1_000_000), 2)


PREFILL = ("full", "streaming")  # when a scored method compresses a prompt (its trigger)


def check_budget_options(budget: int, budget_ratio: float) -> None:
    if budget < 0 or not 0.0 <= budget_ratio <= 1.0:
        raise UserError(f"need backend.budget >= 0 and 0 <= backend.budget_ratio <= 1, got "
                        f"{budget} and {budget_ratio}")
    if (budget <= 0) == (budget_ratio <= 0):
        raise UserError("set exactly one of backend.budget (tokens) and "
                        "backend.budget_ratio (share of prompt + max_tokens)")


class ScorerOpts(Protocol):
    """The options every scored eviction method has: its one options dataclass
    (backends/scored.py ``ScorerOptions``, extended per method), read by its backend and
    its policy alike."""

    budget: int  # tokens per sequence; or
    budget_ratio: float  # a share of the request (set exactly one)
    prefill: str  # the trigger: full | streaming


class BudgetPolicy(EvictionPolicy):
    """A per-sequence budget of ``opts.budget`` tokens (or ``opts.budget_ratio`` of prompt
    + max_tokens) and per-slot ``scores``; subclasses say how scores arrive
    (``accumulates``: summed over steps, or each step's replacing the last), which tokens
    may go (:meth:`candidates`) and whether the budget holds while decoding
    (``decode_budget``: else a prompt is compressed to ``budget_ratio`` of itself and what
    is generated is all kept, as kvpress's presses do).

    ``prefill`` is the trigger, when a prompt is compressed: ``streaming`` keeps memory
    bounded while the prompt is read (chunks of :meth:`max_chunk`, each followed by an
    eviction down to the budget, by the scores that chunk gave); ``full`` holds the whole
    prompt under full attention and compresses it once, at its end, by the scores of the
    prompt's own queries (the papers' long-context evaluations, kvpress), the kept tokens
    compacted into fewer blocks; memory then peaks at the prompt. Both then keep the
    budget while decoding."""

    needs_scores = True
    accumulates = False
    decode_budget = True

    def __init__(self, opts: ScorerOpts) -> None:
        self.opts = opts
        self.budget_tokens, self.budget_ratio = opts.budget, opts.budget_ratio
        self.prefill = opts.prefill
        check_budget_options(self.budget_tokens, self.budget_ratio)
        if self.prefill not in PREFILL:
            raise UserError(f"unknown backend.prefill {self.prefill!r}; known: "
                            f"{', '.join(PREFILL)}")
        # One selection leaves holes in every block of the prompt: move the kept tokens
        # together so that whole blocks go back (as snapkv). Streaming evictions refill
        # their holes with the next tokens instead.
        self.compacts = self.prefill == "full"
        self.scores = np.zeros(0)

    @property
    def streaming(self) -> bool:
        return self.prefill == "streaming"

    @property
    def compresses_once(self) -> bool:
        # A press under the full trigger; a decode budget (h2o, tova) re-scores every step.
        return self.prefill == "full" and not self.decode_budget

    def params(self) -> dict[str, object]:
        o = self.opts
        return dataclasses.asdict(o) if dataclasses.is_dataclass(o) and \
            not isinstance(o, type) else dict(vars(o))

    def budget(self, prompt_len: int, max_tokens: int) -> int:
        if not self.decode_budget:  # the prompt's share, what it is compressed to
            return min(prompt_len, ratio_budget(self.budget_tokens, self.budget_ratio,
                                                prompt_len, 0))
        return ratio_budget(self.budget_tokens, self.budget_ratio, prompt_len, max_tokens)

    def keep(self, prompt_len: int, max_tokens: int = 0) -> int:
        """Prompt tokens a full-trigger compression keeps (the prompt, when it fits)."""
        return min(prompt_len, self.budget(prompt_len, max_tokens))

    def seq_budget(self, seq: Sequence) -> int:
        return self.budget(seq.num_prompt_tokens, seq.group.params.max_tokens)

    def peak(self, prompt_len: int, max_tokens: int) -> int:
        """Streaming: the budget plus one prefill chunk (see :meth:`held_limit`); full:
        the whole prompt, until its selection."""
        b = self.budget(prompt_len, max_tokens)
        if not self.streaming:
            return max(prompt_len, b)
        chunk = self.max_chunk(b)
        return b + (chunk if chunk is not None else 0)

    def max_chunk(self, budget: int | None) -> int | None:
        """Streaming: most tokens one prefill chunk may bring (the method's own bound)."""
        return self.streaming_chunk(budget) if self.streaming else None

    def streaming_chunk(self, budget: int | None) -> int | None:
        return None

    def held_limit(self, seq: Sequence, n: int) -> int | None:
        """The budget; while the prompt is prefilled in chunks, the budget plus the chunk.

        A chunk comes on top of the full budget and its tokens are chosen among after it
        ran: evicting room for the chunk first would drop every heavy hitter before each
        chunk of a long prompt (with the chunk as large as the heavy part, the chunk then
        saw only the recent window, the attention sink gone: h2o missed needles lying
        inside its recent window). Memory is then bounded by budget + one chunk while a
        prompt is prefilled, and by the budget once it decodes."""
        b = self.seq_budget(seq)
        prefilling = seq.num_computed < seq.num_prompt_tokens or seq.num_uncomputed > 1
        if prefilling and not self.streaming:
            return None  # full: the prompt is held whole until its last chunk has run
        if prefilling:
            return b + n
        # Decoding: the budget, or the compressed prompt + everything generated since.
        return b if self.decode_budget else b + seq.num_computed + n - seq.num_prompt_tokens

    def reset(self, num_slots: int) -> None:
        self.scores = np.zeros(num_slots)

    def on_scores(self, scores: StepScores) -> None:
        if self.accumulates:
            self.scores[scores.slots] += scores.values
        else:
            self.scores[scores.slots] = scores.values

    def on_write(self, slots: list[int]) -> None:
        self.scores[slots] = 0.0

    def on_copy(self, src: int, dst: int, num_slots: int) -> None:
        self.scores[dst:dst + num_slots] = self.scores[src:src + num_slots]

    def candidates(self, seq: Sequence, positions: np.ndarray) -> np.ndarray:
        """Which of ``seq``'s live tokens (at ``positions``, int64 (held,)) may go: bool."""
        return np.ones(len(positions), dtype=bool)

    def rank(self, seq: Sequence, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """What decides among ``seq``'s tokens at ``slots`` (``positions``): the lowest
        goes. Default: their scores as kept (observed_attention divides them by how many
        queries saw each token)."""
        return self.scores[slots]

    def select(self, seq: Sequence, held: HeldBlocks | HeldTokens, need: int) -> Eviction:
        assert isinstance(held, HeldTokens), "a token policy decides by slots"
        if need <= 0:
            return Eviction()
        slots, pos = held
        cand = self.candidates(seq, pos)
        assert int(cand.sum()) >= need, "a chunk larger than the evictable budget"
        score = np.where(cand, self.rank(seq, slots, pos), np.inf)
        # Stable: equal scores go oldest slot first, so runs are reproducible. One token (a
        # decode step's usual need) is the first minimum, which argmin gives in O(held).
        if need == 1:
            return Eviction(slots=[int(slots[int(np.argmin(score))])])
        order = np.argsort(score, kind="stable")[:need]
        return Eviction(slots=slots[order].tolist())


class PressPolicy(BudgetPolicy):
    """A kvpress-style press (knorm, keydiff, observed_attention, expected_attention): the
    prompt is compressed to ``budget`` tokens (or ``budget_ratio`` of itself) and what is
    generated afterwards is all kept (no decode budget); ``streaming`` prefills in chunks
    of half the budget, each followed by an eviction."""

    decode_budget = False

    def streaming_chunk(self, budget: int | None) -> int:
        assert budget is not None
        return max(1, budget // 2)
