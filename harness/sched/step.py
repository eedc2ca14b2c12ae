"""What a step passes between the scheduler and the engine: the :class:`StepRecord`
(``Scheduler.schedule`` -> engine, backend), the :class:`StepOutcome` of its forward and
sampling (engine -> ``Scheduler.update``, the only way a step changes sequences) and the
:class:`StepUpdate` that ``update`` returns."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from harness.kv.base import CopyOp, KVUsage, StepScores
from harness.kv.tiers import TierOp
from harness.sched.sequence import Sequence, SequenceGroup


@dataclass(frozen=True, slots=True)
class LaneSums:
    """The decodes of one step that the roofline's fast path (harness/roofline/fastpath)
    advances in bulk, as sums over their contexts instead of each, for the backend's
    cost declaration (harness/backends/costs.py): ``n`` members, their contexts' sum and
    max, ``by_mod[r]`` members whose context is r modulo the KV block size; and of those
    whose context exceeds the declaration's :meth:`KVCosts.lane_split` (if it has one),
    the count, the contexts' sum and the same histogram."""

    n: int
    ctx_sum: int
    ctx_max: int
    by_mod: tuple[int, ...] = ()
    over_n: int = 0
    over_sum: int = 0
    over_by_mod: tuple[int, ...] = ()


@dataclass(slots=True)
class ScheduledSeq:
    """``num_tokens`` new tokens of ``seq`` starting at position ``start``.

    ``slots[i]`` is the cache slot of token ``start + i`` (a prefill chunk's are empty
    when nothing reads them: ``PagedKVManager.slot_maps``). ``sample`` is True when the
    chunk reaches the end of the known tokens, so the step yields this sequence's next
    token; a partial prefill chunk has ``sample=False``.
    """

    seq: Sequence
    start: int
    num_tokens: int
    slots: list[int]
    sample: bool

    @property
    def is_decode(self) -> bool:
        """One new output token, sampled from: a decode (one query over the context). A
        prompt's tokens are prefill whatever the chunking, its last one included even
        alone in its chunk (a method acting at a prompt's end, as snapkv, must see it as
        prefill; so must the read counts). The one rule the forward (engine/batch.py),
        the scheduler's token counts and the roofline's step shape all use."""
        return self.num_tokens == 1 and self.sample and self.start >= self.seq.num_prompt_tokens


@dataclass(slots=True)
class StepRecord:
    """What runs this step and the cache operations to perform before the forward.

    Order for the backend: ``tier_ops`` (harness.kv.tiers: blocks written down to the
    lower tiers of the prefix cache, spilled between them and loaded from them, in list
    order), then ``swap_out`` (device block, cpu block), then ``swap_in`` (cpu block,
    device block), then ``invalidated`` (slots that stopped holding a token: backends with
    per-slot metadata clear it), then ``copies`` (slot ranges), then the forward, whose
    layers each store the step's new K/V before attending. Tier ops can go first: they
    read device blocks that are named (their content final) and load only into blocks
    taken at admission, and a step that swaps out admits nobody.
    """

    step: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    copies: list[CopyOp] = field(default_factory=list)
    invalidated: list[int] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    tier_ops: list[TierOp] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    # An empty step with nothing preempted: the waiting head that can never be admitted
    # (Scheduler.schedule rejects it; the run goes on without it).
    rejected: list[SequenceGroup] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    usage: KVUsage | None = None  # what the KV manager holds for this step's forward
    # Scheduled anew (False: a later step of a multi-step window, num_scheduler_steps).
    fresh: bool = True
    # Decodes this step also runs in bulk (the roofline's fast path,
    # harness/roofline/fastpath), one token each, counted in num_decode_tokens but not
    # listed in ``seqs``; their contexts as sums (what the step shape needs of them); and
    # the requests that left the bulk path while this step was scheduled (a preemption:
    # the metrics collector brings their token times up to date).
    lane_n: int = 0
    lane_sums: LaneSums | None = None
    lane_left: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_seqs(self) -> int:
        """Sequences this step runs (lane members included)."""
        return len(self.seqs) + self.lane_n

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.lane_n


@dataclass(slots=True)
class NewToken:
    """A sampled token for ``seq``; with ``fork``, for a new sequence of ``seq``'s group
    that first shares all of ``seq``'s K/V and tokens (a parallel sample, a beam chosen
    more than once). ``cum_logprob``: beam search's cumulative log-prob after the token."""

    seq: Sequence
    token: int
    fork: bool = False
    cum_logprob: float | None = None


@dataclass(slots=True)
class StepOutcome:
    """Everything a step's forward and sampling change, for ``Scheduler.update`` to apply,
    in this order: forks (each copies its parent before anything is appended), beam
    hypotheses, ``stops`` (beams pruned or done, in order), then the tokens.

    ``hypotheses``: finished beam candidates ``(group, score, tokens)``; ``beams_done``:
    groups whose beam search ended (their best hypothesis becomes the output);
    ``scores``: what the eviction policy asked the backend for."""

    tokens: list[NewToken] = field(default_factory=list)
    stops: list[tuple[Sequence, str]] = field(default_factory=list)
    hypotheses: list[tuple[SequenceGroup, float, list[int]]] = field(default_factory=list)
    beams_done: list[SequenceGroup] = field(default_factory=list)
    scores: StepScores | None = None

    @classmethod
    def appending(cls, pairs: list[tuple[Sequence, int]],
                  scores: StepScores | None = None) -> StepOutcome:
        """Plain appends, one token per sequence (no forks, no beams)."""
        return cls([NewToken(s, t) for s, t in pairs], scores=scores)


@dataclass(slots=True)
class StepUpdate:
    """What ``Scheduler.update`` did: the groups that finished this step and the free slots
    no waiting request could use (external fragmentation)."""

    finished: list[SequenceGroup] = field(default_factory=list)
    external_slots: int = 0
    lane_joined: list[int] = field(default_factory=list)  # request ids that joined the lane


# KVBENCH_CHECK=1 (the test suite sets it): every step asserts its invariants, e.g. that no
# two new tokens of one step share a slot. Cheap, but off for benchmarks.
CHECKS = os.environ.get("KVBENCH_CHECK", "") not in ("", "0")


def check_distinct_slots(rec: StepRecord) -> None:
    """No two new tokens of one step write the same slot (h2o once did)."""
    slots = [x for s in rec.seqs for x in s.slots]
    if len(set(slots)) != len(slots):
        seen: dict[int, tuple[int, int]] = {}
        for s in rec.seqs:
            for i, x in enumerate(s.slots):
                assert x not in seen, (f"step {rec.step}: slot {x} written twice: seq "
                                       f"{seen[x][0]} pos {seen[x][1]} and seq "
                                       f"{s.seq.seq_id} pos {s.start + i}")
                seen[x] = (s.seq.seq_id, s.start + i)
