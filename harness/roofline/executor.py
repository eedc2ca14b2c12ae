"""``RooflineExecutor``: the executor of ``executor=roofline``. No weights and no K/V
tensors: each step's time comes from a model spec and a hardware spec
(harness.roofline.steptime) and advances a :class:`VirtualClock`, so arrivals, TTFT and
ITL run on modelled time and a run is deterministic. It implements the engine's
:class:`~harness.engine.executor.Executor` protocol; the engine never imports this module.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np

from harness.backends.base import KVBackend
from harness.backends.costs import LaneSums, StepReads
from harness.engine.executor import StepOutput
from harness.kv.base import KVManager, StepScores
from harness.kv.evicting import EvictingKVManager
from harness.kv.paged import PagedKVManager
from harness.kv.tiers import CPU, DISK, GPU, TierOp
from harness.roofline.shape import StepShape, lane_shape, step_shape
from harness.roofline.steptime import StepModel, StepTime
from harness.sched.step import CHECKS, ScheduledSeq, StepRecord


class VirtualClock:
    """Modelled time: moves only when a step is charged or the engine waits for an
    arrival, so bookkeeping on this CPU never shows in the latencies."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)

    def advance(self, seconds: float) -> None:
        self.t += seconds


# Synthetic outputs: lowercase ASCII bytes (the byte tokenizer's ids 97..122), never EOS,
# so a request stops at its drawn length (stop_after) or max_tokens, and a multiturn answer
# decodes and re-encodes to the same ids: the next turn re-sends it and hits the cache.
TOKEN_BASE, TOKEN_SPAN, VOCAB = 97, 26, 258


def synthetic_token(request_id: int, sample: int, position: int) -> int:
    """A token id fixed by the request, the sample and the position: the same on every
    backend and whatever shares the batch."""
    return TOKEN_BASE + (request_id * 7919 + sample * 104729 + position * 31337) % TOKEN_SPAN


SYNTHETIC_IDS = range(TOKEN_BASE, TOKEN_BASE + TOKEN_SPAN)
# The ids repeat every TOKEN_SPAN positions (position * 31337 is taken mod TOKEN_SPAN).
SYNTHETIC_PERIOD = TOKEN_SPAN
# Sample 0's ids depend on the request only through (request_id * 7919) % TOKEN_SPAN: per
# residue, its ids at positions 0 .. 2 TOKEN_SPAN - 1, so that any run of up to a period
# is one slice (a decode lane reads its members' ids here, harness/roofline/fastpath: 5 million
# calls of synthetic_token at 100,000 requests). Request ids 0 .. TOKEN_SPAN - 1 give
# every residue once (7919 is prime to TOKEN_SPAN).
_CYCLES = {r * 7919 % TOKEN_SPAN: [synthetic_token(r, 0, p) for p in range(2 * TOKEN_SPAN)]
           for r in range(TOKEN_SPAN)}
assert len(_CYCLES) == TOKEN_SPAN


def synthetic_tokens(request_id: int, start: int, count: int) -> list[int]:
    """Sample 0's tokens at positions ``start .. start + count - 1`` (a decode lane's,
    harness/roofline/fastpath, made when read): ``synthetic_token(request_id, 0, p)`` for each."""
    cyc = _CYCLES[request_id * 7919 % TOKEN_SPAN]
    s = start % TOKEN_SPAN
    if count <= TOKEN_SPAN:
        return cyc[s:s + count]
    return (cyc[s:s + TOKEN_SPAN] * (count // TOKEN_SPAN + 1))[:count]  # a period, repeated


@dataclass
class RooflineTotals:
    """Modelled seconds per term, summed over the run (metrics ``roofline.*_s``)."""

    terms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("gemm", "lm_head", "prefill_attn", "decode_attn", "allreduce", "nongemm",
         "overhead"), 0.0))

    def add(self, t: StepTime) -> None:
        for k in self.terms:
            self.terms[k] += float(getattr(t, k))


@dataclass(frozen=True)
class TierLinks:
    """The lower tiers' links: host (per GPU: each has its own PCIe link, as swaps do) and
    disk (per node: one drive serves every GPU's share). Bandwidths in bytes/s, latencies
    in seconds per transfer (one step's blocks between one pair of tiers)."""

    host_bw: float
    host_latency: float
    disk_bw: float
    disk_latency: float
    overlap: bool = False

    def seconds(self, ops: list[TierOp], rank_block_bytes: float,
                block_bytes: float) -> float:
        """A step's tier transfers, one after another on one copy stream:
        sum over (src, dst) pairs present of ``latency + n x bytes / bandwidth``, where a
        host move (GPU <-> CPU) moves one GPU's share of a block (``rank_block_bytes``)
        over the host link, and a disk move (CPU -> disk, disk -> GPU) a whole block
        (``block_bytes``, every GPU's share) at the drive's bandwidth."""
        counts: dict[tuple[int, int], int] = {}
        for op in ops:
            key = (op.src_tier, op.dst_tier)
            counts[key] = counts.get(key, 0) + 1
        total = 0.0
        for (src, dst), n in counts.items():
            if DISK in (src, dst):
                total += self.disk_latency + n * block_bytes / self.disk_bw
            else:
                assert {src, dst} == {GPU, CPU}, (src, dst)
                total += self.host_latency + n * rank_block_bytes / self.host_bw
        return total


class RooflineExecutor:
    """No forward: the step's time from :class:`StepModel`, logits from
    :func:`synthetic_token`.

    Attention reads what the backend declares (``backend.costs()``, of what the KV
    manager holds: harness.backends.costs), as the model executor counts it. A policy
    that needs attention scores (h2o, tova, snapkv) gets a stand-in: each token, in the
    step that writes it, earns a pseudo-random score in [0, 1) fixed by its request and
    position (no attention exists to score it). Its victims are then a random choice
    among the old tokens; what the run measures is the budget's effect on memory and
    batch size, not which tokens a model would keep.
    """

    def __init__(self, model: StepModel, backend: KVBackend,
                 tiers: TierLinks | None = None) -> None:
        """``tiers``: the links of the prefix cache's lower tiers (cache.tiers), whose
        transfers are charged as time (:meth:`TierLinks.seconds`)."""
        self.model, self.backend = model, backend
        self.links = tiers
        self.transfer_s = 0.0  # tier transfers, modelled (overlapped or not)
        self.transfer_exposed_s = 0.0  # ... of which the steps paid
        self._tier_s = 0.0
        self.clock = VirtualClock()
        self.totals = RooflineTotals()
        self.costs = backend.costs()
        self.kv: KVManager | None = None
        self.needs_scores = False
        self._written: list[ScheduledSeq] = []
        self._ops_s = 0.0  # cache operations' time, charged to the next forward
        # The fit's record (harness.roofline_tools.validate): per step (forward s, seqs, fresh,
        # the clock at its end), when set to a list.
        self.trace: list[tuple[float, int, bool, float]] | None = None
        self.fast_path = "off"  # the run's decode lanes: "lanes", or "off: why" (run.py)
        self.sizes = ""  # run.scheduler_sizes: the scheduler's sizes and their sources (run.py)

    def bind(self, kv: KVManager) -> None:
        self.kv = kv
        self.needs_scores = isinstance(kv, EvictingKVManager) and kv.policy.needs_scores
        if isinstance(kv, PagedKVManager):
            # Only the scores (take_scores) and the slot checks read a step's slots.
            kv.slot_maps = self.needs_scores or CHECKS

    def apply_cache_ops(self, rec: StepRecord) -> None:
        """No tensors to move: the copies' and swaps' bytes are charged as time instead
        (copies at device bandwidth, read and written, each slot its share of a token:
        a per-head page's slot is one (layer, KV head); swaps over the host link)."""
        hw, bps = self.model.hw, self.model.kv_rank_bytes
        slots = sum(op.num_slots * op.share for op in rec.copies)
        swapped = (len(rec.swap_out) + len(rec.swap_in)) * self.backend.block_size
        self._ops_s = 2 * slots * bps / (hw.mem_bw * hw.eff_bw) + swapped * bps / hw.host_bw
        if rec.tier_ops:
            assert self.links is not None, "tier ops without tier links"
            bs = self.backend.block_size
            self._tier_s = self.links.seconds(rec.tier_ops, bs * bps,
                                              bs * self.backend.bytes_per_slot())

    def forward(self, rec: StepRecord) -> StepOutput:
        assert self.kv is not None, "bind() the KV manager first"
        sh = step_shape(rec, self.costs, self.kv)
        samplers = sh.samplers
        t = self._charge(self.model.time(self.model.work_of(sh, rec.fresh)), sh, rec.fresh)
        if self.needs_scores:
            self._written = list(rec.seqs)
        # One-hot rows at each sequence's synthetic token, as their ids: the engine's own
        # sampling code then runs unchanged (forks, beams), greedy reading the ids and
        # the rest the tensor they stand for (making it each step and taking the argmax
        # back cost ~8% of a decode-lane run).
        ids = [synthetic_token(g.request_id, g.seqs.index(q) if len(g.seqs) > 1 else 0,
                               q.num_tokens) for q, g in ((s.seq, s.seq.group) for s in samplers)]
        return StepOutput(None, samplers, float(t.forward), sh.reads, one_hot=ids, vocab=VOCAB)

    def forward_lane(self, n: int, sums: LaneSums) -> tuple[float, StepReads]:
        """:meth:`forward` of a step whose ``n`` decodes are all decode-lane members and
        which has no cache operations (harness.engine.engine's lane steps): its forward
        seconds and reads, with nothing to sample."""
        sh = lane_shape(n, sums, self.costs)
        assert sh.dec_bytes is not None
        t = self._charge(self.model.lane_time(n, sh.ctx_decode, sh.gather_decode,
                                              sh.dec_bytes), sh, True)
        return float(t.forward), sh.reads

    def _charge(self, t: StepTime, sh: StepShape, fresh: bool) -> StepTime:
        """The step's modelled time ``t`` (of shape ``sh``), with the cache operations and
        tier transfers charged before it: added to the totals and the clock."""
        t.overhead += self._ops_s
        self._ops_s = 0.0
        if self._tier_s:
            # Overlapped, a transfer shows only where it outlasts the step's own work.
            assert self.links is not None
            shown = max(0.0, self._tier_s - t.total) if self.links.overlap else self._tier_s
            t.overhead += shown
            self.transfer_exposed_s += shown
            self.transfer_s += self._tier_s
            self._tier_s = 0.0
        self.totals.add(t)
        self.clock.advance(float(t.total))
        if self.trace is not None:
            self.trace.append((float(t.forward), sh.seqs, fresh, self.clock.t))
        return t

    def take_scores(self) -> StepScores | None:
        if not self.needs_scores or not self._written:
            return None
        slots: list[int] = []
        vals: list[float] = []
        for s in self._written:
            rid = s.seq.group.request_id
            slots += s.slots
            vals += [zlib.crc32(f"{rid}/{p}".encode()) / 2**32
                     for p in range(s.start, s.start + s.num_tokens)]
        self._written = []
        return StepScores(np.asarray(slots, dtype=np.int64), np.asarray(vals, dtype=np.float64))
