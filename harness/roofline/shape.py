"""A step's shape as the step-time model reads it: tokens, sampled rows, and the keys its
attention touches, read from the StepRecord, the KV manager's holdings and the backend's
declared costs (harness.backends.costs: the same declaration the engine's read metrics
use; nothing here knows a method by its attributes).

Two readings of the same step, for the two ways attention is run (``HardwareSpec.attention``):
``fused`` kernels (paged decode / varlen prefill on a GPU) read each sequence's keys in
place and skip what a causal mask, a window or a method's selection hides (the declared
reads); the ``gather`` torch reference path (what runs on a CPU) copies the decodes'
blocks into one batch padded to the widest table (``KVCosts.gathered``) and computes every
(query, key) pair of a prefill chunk under an explicit mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.backends.costs import HeldSource, KVCosts, LaneSums, StepReads
from harness.sched.step import ScheduledSeq, StepRecord


@dataclass(slots=True)
class StepShape:
    tokens: int
    seqs: int
    pairs: float  # prefill (query, key) pairs a fused kernel computes (causal, windowed)
    ctx_prefill: float  # keys the prefill chunks' tables hold (s + n each: the gather path)
    ctx_decode: float  # keys the decodes read, as the backend declares them
    num_decode: int
    samplers: list[ScheduledSeq] = field(default_factory=list)  # decodes, then prefills
    pairs_full: float = 0.0  # prefill pairs under an explicit mask: n x (start + n) a chunk
    gather_decode: float = 0.0  # decode keys the gather path copies: rows x widest table
    dec_bytes: float | None = None  # bytes the decodes read, declared (fused kernels)
    pre_bytes: float | None = None  # bytes the prefill chunks read, declared
    reads: StepReads = field(default_factory=StepReads)  # the engine's per-step counts
    lane_rows: int = 0  # decode-lane members (harness/roofline/fastpath): sampled, not listed

    @property
    def rows(self) -> int:
        """Rows that get logits (and are sampled)."""
        return len(self.samplers) + self.lane_rows


def lane_shape(n: int, sums: LaneSums, costs: KVCosts) -> StepShape:
    """The shape of a step whose ``n`` decodes are all decode-lane members (harness.sched
    .lane), given as their sums: what :func:`step_shape` makes of such a step."""
    r = costs.summed_decode_read(sums)
    widest = costs.gathered(sums.ctx_max, sums.ctx_max)
    return StepShape(n, n, 0.0, 0.0, float(r.tokens), n, [], 0.0, float(n * widest),
                     float(r.bytes), 0.0, StepReads(n, r.tokens, r.bytes, 0), n)


def step_shape(rec: StepRecord, costs: KVCosts, kv: HeldSource) -> StepShape:
    """The shape of ``rec``'s forward, with the KV manager in its state during it."""
    if not rec.seqs and rec.lane_n:  # every decode a lane member: the one rule above
        assert rec.lane_sums is not None
        return lane_shape(rec.lane_n, rec.lane_sums, costs)
    decodes: list[ScheduledSeq] = []
    prefills: list[ScheduledSeq] = []
    dec_tok = dec_b = pre_b = pairs = 0
    ctx_pre = full = 0
    nd = widest = 0
    for s in rec.seqs:
        n = s.num_tokens
        held = kv.held_tokens(s.seq)
        if s.is_decode:  # one rule with the forward (engine/batch.py)
            ctx = s.start + 1
            r = costs.decode_read(ctx, held)
            dec_tok += r.tokens
            dec_b += r.bytes
            widest = max(widest, costs.gathered(ctx, held))
            nd += 1
            decodes.append(s)
        else:
            pairs += costs.prefill_pairs(s.start, n, held)
            pre_b += costs.prefill_read(s.start, n, held).bytes
            full += n * (s.start + n)
            ctx_pre += s.start + n
            if s.sample:
                prefills.append(s)
    if rec.lane_n:  # decode-lane members: their reads as sums (harness/roofline/fastpath)
        assert rec.lane_sums is not None
        ctx_max = rec.lane_sums.ctx_max
        r = costs.summed_decode_read(rec.lane_sums)
        dec_tok += r.tokens
        dec_b += r.bytes
        widest = max(widest, costs.gathered(ctx_max, ctx_max))
        nd += rec.lane_n
    return StepShape(rec.num_tokens, rec.num_seqs, float(pairs), float(ctx_pre),
                     float(dec_tok), nd, decodes + prefills, float(full),
                     float(nd * widest), float(dec_b), float(pre_b),
                     StepReads(nd, dec_tok, dec_b, pairs), rec.lane_n)
