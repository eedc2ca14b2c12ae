"""Sequences and sequence groups: the scheduler's and the allocator's view of a request.

A *request* becomes one :class:`SequenceGroup`; the group holds one sequence per sample or
beam. Plain Python objects with ``__slots__``: the per-step bookkeeping touches every
running sequence, so attribute access must stay cheap.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True)
class SamplingParams:
    """How the tokens of one request are chosen and when it stops."""

    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    n: int = 1  # parallel samples (or beams, for beam search)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # A trace's output length: the sequence stops ("stop", as at EOS) after this many
    # tokens. Length-distribution workloads use it so max_tokens stays an upper bound.
    stop_after: int | None = None
    use_beam_search: bool = False  # n beams instead of n samples
    length_penalty: float = 1.0  # beam score = cum_logprob / len ** length_penalty


class Sequence:
    """One stream of tokens: what it holds, how far it is computed, and its status.

    Invariants: ``num_computed <= len(token_ids)``; tokens ``[0, num_computed)`` have their
    K/V in the cache (or are being written by the current step). Where that K/V lives is
    the KV manager's business (it owns the block tables, keyed by ``seq_id``).
    """

    __slots__ = (
        "compressed_prefix",
        "cum_logprob",
        "finish_reason",
        "group",
        "num_computed",
        "num_prompt_tokens",
        "seq_id",
        "status",
        "token_ids",
    )

    def __init__(self, seq_id: int, group: SequenceGroup, token_ids: list[int]) -> None:
        self.seq_id = seq_id
        self.group = group
        self.token_ids = token_ids
        self.num_prompt_tokens = len(token_ids)
        self.num_computed = 0
        # Prompt tokens that came from a compressed prefix (harness.kv.compressed): the
        # method compressed them already, and this prompt is not compressed again.
        self.compressed_prefix = 0
        self.status = SeqStatus.WAITING
        self.cum_logprob = 0.0
        self.finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={len(self.token_ids)}, "
                f"computed={self.num_computed}, status={self.status.value})")


@dataclass(eq=False, slots=True)
class SequenceGroup:
    """The sequences of one request: admitted, preempted and finished together."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first under the priority policy
    extra_key: int | str | None = None  # e.g. a LoRA / model id: part of every block hash
    seqs: list[Sequence] = field(default_factory=list)
    rejected_reason: str | None = None
    # Metrics hooks, filled by the engine.
    first_scheduled_time: float | None = None
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    num_recomputed_tokens: int = 0
    num_swapped_blocks: int = 0
    prefix_hit_tokens: int = 0
    tier_hit_blocks: list[int] = field(default_factory=lambda: [0, 0])  # loaded: cpu, disk
    # Beam search: finished hypotheses (score, tokens) and the chosen output.
    beam_finished: list[tuple[float, list[int]]] = field(default_factory=list)
    best_output: list[int] | None = None
    # The scheduler's: the order it entered ``running`` in; and, while the roofline's fast
    # path advances the group in bulk, that path's record of it (harness/roofline/fastpath;
    # None: stepped one by one).
    run_order: int = 0
    lane: Any = None

    @property
    def live_seqs(self) -> list[Sequence]:
        seqs = self.seqs
        if len(seqs) == 1:  # the common case, read every step by the scheduler
            return [] if seqs[0].status is SeqStatus.FINISHED else [seqs[0]]
        return [s for s in seqs if s.status is not SeqStatus.FINISHED]

    @property
    def output_ids(self) -> list[int]:
        """The request's output: the chosen beam for beam search, else its first
        sequence's generated tokens."""
        if self.best_output is not None:
            return self.best_output
        return self.seqs[0].output_ids if self.seqs else []

    @property
    def prefix_source(self) -> str:
        """Where the request's cached prefix came from: the farthest tier that served a
        block of it (``disk``, ``cpu``), ``gpu`` for device hits only, else ``none``."""
        if self.tier_hit_blocks[1]:
            return "disk"
        if self.tier_hit_blocks[0]:
            return "cpu"
        return "gpu" if self.prefix_hit_tokens else "none"

    @property
    def is_finished(self) -> bool:
        return all(s.status is SeqStatus.FINISHED for s in self.seqs)

    def sort_key(self, by_priority: bool) -> tuple[int, float, int]:
        return (self.priority if by_priority else 0, self.arrival_time, self.request_id)
