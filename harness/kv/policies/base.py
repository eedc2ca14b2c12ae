"""The eviction-policy seam: what a policy decides, and what it is told.

A policy lives with the KV manager (harness.kv.evicting: ``WindowKVManager`` for a
positional one, ``EvictingKVManager`` for a token-granular one), as
vLLM v1 frees sliding-window blocks inside its manager. After every step's forward the
backend hands the manager the scores the policy asked for (one batched device-to-host
transfer, :class:`~harness.kv.base.StepScores`); the manager calls :meth:`select` with
what the sequence holds (:class:`HeldBlocks` or :class:`HeldTokens`, the manager's own
view, handed over: a policy never calls back into the manager nor writes its fields) and
frees what it returns through one path, the manager's ``evict``. No policy touches
tensors; no backend calls the manager.

Two granularities, because one slot holds a token's K/V for every layer and head:

* ``positional`` policies (a window) keep tokens at their positional slots and give back
  whole blocks (logical indices); the stored K/V stay what their hashes name, so prefix
  caching stays on;
* the others (h2o, ...) give back single tokens (slots). The manager reuses those slots
  for later tokens of the same sequence, so a sequence never holds more than its budget;
  a block whose tokens are all gone returns to the pool. Prefix caching is off: a block
  whose slots were rewritten is no longer the block its hash names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import numpy as np

    from harness.kv.base import StepScores
    from harness.sched.sequence import Sequence


class HeldBlocks(NamedTuple):
    """What a sequence holds, block by block (a positional policy's view): ``table`` its
    logical blocks (a negative entry: given back), ``cursor`` the first block not yet
    decided about, ``block_size`` tokens per block. Read only."""

    table: list[int]
    cursor: int
    block_size: int


class HeldTokens(NamedTuple):
    """What a sequence holds, token by token (a token policy's view): ``slots`` and their
    ``positions``, int64 (held,) each, in no particular order."""

    slots: np.ndarray
    positions: np.ndarray


@dataclass(slots=True)
class Eviction:
    """What to give back: logical ``blocks`` (positional policies) or token ``slots``.
    ``considered``: a positional policy has decided about every block before this index
    (the manager keeps it as the sequence's cursor, so the next decision starts there)."""

    blocks: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    considered: int | None = None

    def __bool__(self) -> bool:
        return bool(self.blocks or self.slots)


class EvictionPolicy(ABC):
    """Decides which tokens of a sequence go. Subclasses set the class flags and
    implement :meth:`select`; the hooks keep whatever per-slot state they score with."""

    name: str = ""
    positional: bool = False  # whole blocks at positional slots (window) vs single tokens
    needs_scores: bool = False  # the backend must return StepScores after each forward
    # After giving tokens back, move the kept ones into fewer blocks so that whole blocks
    # return to the pool (a one-shot selection leaves holes in every block: snapkv).
    compacts: bool = False

    @property
    def compresses_once(self) -> bool:
        """Whether a prompt is compressed once, at its end, and nothing is given back
        after: a sequence's state is then a function of its tokens and that one selection,
        which harness.kv.compressed names for a later prompt to reuse."""
        return False

    def params(self) -> dict[str, object]:
        """What decides what the policy keeps (its method's options): part of a compressed
        prefix's name, so other parameters never share one."""
        return {}

    def budget(self, prompt_len: int, max_tokens: int) -> int | None:
        """Tokens a sequence of this shape holds at most once it runs steadily (None: no
        bound): what admission promises it (blocks kept free for it, ``_owed``). Beyond
        it a sequence grows as a paged one does, preempting when the pool runs out."""
        return None

    def peak(self, prompt_len: int, max_tokens: int) -> int | None:
        """Tokens it may hold at any moment (None: all of them). Default: its budget;
        snapkv holds its whole prompt until the prompt's prefill ends."""
        return self.budget(prompt_len, max_tokens)

    def held_limit(self, seq: Sequence, n: int) -> int | None:
        """Most tokens ``seq`` may hold once ``n`` more are written (None: no bound now):
        what the manager evicts down to. Default: its budget."""
        return self.budget(seq.num_prompt_tokens, seq.group.params.max_tokens)

    def max_chunk(self, budget: int | None) -> int | None:
        """Most tokens one step may add to a sequence with this budget."""
        return None

    def reset(self, num_slots: int) -> None:  # noqa: B027 (an optional hook)
        """Size per-slot state for a pool of ``num_slots`` slots."""

    def on_scores(self, scores: StepScores) -> None:  # noqa: B027
        """This step's scores, before any :meth:`select` of the step."""

    def on_write(self, slots: list[int]) -> None:  # noqa: B027
        """New tokens now occupy ``slots``: whatever was scored there belongs to nobody."""

    def on_copy(self, src: int, dst: int, num_slots: int) -> None:  # noqa: B027
        """Slots ``[src, src + n)`` were copied to ``[dst, dst + n)`` (copy-on-write)."""

    @abstractmethod
    def select(self, seq: Sequence, held: HeldBlocks | HeldTokens, need: int) -> Eviction:
        """What ``seq`` gives back now, of what it ``held`` (a positional policy gets
        :class:`HeldBlocks` every step; a token policy :class:`HeldTokens`, asked only
        when ``need`` > 0). ``need``: tokens it must give back to keep within its budget
        before its next step; a policy may give back more (a window returns every block
        it no longer sees), never fewer."""
