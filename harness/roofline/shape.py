"""A step's shape as the step-time model reads it: tokens, sampled rows, and the keys its
attention touches, read from the StepRecord and the backend's read rule.

Two readings of the same step, for the two ways attention is run (``HardwareSpec.attention``):
``fused`` kernels (paged decode / varlen prefill on a GPU) read each sequence's keys in
place and skip what a causal mask or a window hides; the ``gather`` torch reference path
(what runs on a CPU) copies the decodes' blocks into one batch padded to the widest table
and computes every (query, key) pair of a prefill chunk under an explicit mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.sched.step import ScheduledSeq, StepRecord


class KVReads:
    """How many cached tokens a decode query of this backend reads.

    A backend with ``kv_read_tokens(seq, context)`` says it (a method that reads chosen
    blocks); otherwise a window (``backend.window`` + its sinks) or an eviction budget
    (``policy.budget``) bounds the context; else the whole context is read."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.window = int(getattr(backend, "window", 0) or 0)
        self.sinks = int(getattr(backend, "window_sinks", 0) or 0)
        self.policy = getattr(backend, "policy", None)
        self.reader = getattr(backend, "kv_read_tokens", None)
        self._block: int | None = None

    def decode(self, s: ScheduledSeq, context: int) -> int:
        if self.reader is not None:
            return int(self.reader(s.seq, context))
        if self.window:
            context = min(context, self.window + self.sinks)
        if self.policy is not None:
            b = self.policy.budget(s.seq.num_prompt_tokens, s.seq.group.params.max_tokens)
            if b is not None:
                context = min(context, b)
        return context

    def gathered(self, read: int, context: int) -> int:
        """Keys the gather path copies for one decode that reads ``read`` of its
        ``context`` keys (:meth:`decode`): its table's blocks (a window masks keys but its
        given-back entries are still gathered; contiguous storage gathers the range
        itself, no block rounding)."""
        n = context if self.window else read
        if self._block is None:  # known once the cache is sized (never, under roofline)
            paged = getattr(self.backend, "storage", "paged") == "paged"
            self._block = int(getattr(self.backend, "block_size", 1) or 1) if paged else 1
        return -(-n // self._block) * self._block

    def prefill_keys(self, start: int, n: int) -> float:
        """Mean keys a query of a chunk of ``n`` after ``start`` cached tokens sees."""
        keys = start + (n + 1) / 2
        return min(keys, self.window + self.sinks) if self.window else keys


@dataclass(slots=True)
class StepShape:
    tokens: int
    seqs: int
    pairs: float  # prefill (query, key) pairs a fused kernel computes (causal, windowed)
    ctx_prefill: float  # keys the prefill chunks read
    ctx_decode: float  # keys the decodes read
    num_decode: int
    samplers: list[ScheduledSeq] = field(default_factory=list)  # decodes, then prefills
    pairs_full: float = 0.0  # prefill pairs under an explicit mask: n x (start + n) a chunk
    gather_decode: float = 0.0  # decode keys the gather path copies: rows x widest table

    @property
    def rows(self) -> int:
        """Rows that get logits (and are sampled)."""
        return len(self.samplers)


def step_shape(rec: StepRecord, reads: KVReads) -> StepShape:
    decodes: list[ScheduledSeq] = []
    prefills: list[ScheduledSeq] = []
    ctx_dec = ctx_pre = pairs = full = 0.0
    nd = widest = 0
    for s in rec.seqs:
        n = s.num_tokens
        if n == 1:  # any one-token chunk is a decode for attention (as batch.py)
            read = reads.decode(s, s.start + 1)
            ctx_dec += read
            widest = max(widest, reads.gathered(read, s.start + 1))
            nd += 1
            if s.sample:
                decodes.append(s)
        else:
            pairs += n * reads.prefill_keys(s.start, n)
            full += n * (s.start + n)
            ctx_pre += s.start + n
            if s.sample:
                prefills.append(s)
    return StepShape(rec.num_tokens, len(rec.seqs), pairs, ctx_pre, ctx_dec, nd,
                     decodes + prefills, full, float(nd * widest))
