"""The executor seam: what runs a step's forward, and on which clock.

``ModelExecutor`` (``executor=model``) runs the real forward on the wall clock.
``RooflineExecutor`` (``executor=roofline``) has no weights and no K/V tensors: it predicts
the step's time from a model spec and a hardware spec (harness.roofline.steptime) and
advances a virtual clock by it, so arrivals, TTFT and ITL run on modelled time and a run
is deterministic. The engine loop, the scheduler, the KV manager and the backend's memory
behaviour (bytes per token, its manager and eviction policy) are the same code under both.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from harness.backends.base import KVBackend
from harness.backends.costs import StepReads, step_reads
from harness.engine.batch import build_inputs
from harness.kv.base import KVManager, StepScores
from harness.kv.evicting import EvictingKVManager
from harness.model.llama import LlamaModel
from harness.roofline.shape import step_shape
from harness.roofline.steptime import StepModel, StepTime
from harness.sched.step import CHECKS, ScheduledSeq, StepRecord


class Clock(Protocol):
    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class WallClock:
    """The machine's time: ``time.perf_counter`` and a real sleep."""

    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))


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


@dataclass(slots=True)
class StepOutput:
    """``logits``: float32 (S, vocab), one row per entry of ``samplers`` (decodes first,
    then prefill chunks, as batch.build_inputs orders them); ``forward_s``: the forward's
    seconds on the executor's clock; ``reads``: the backend's declared reads of the step
    (harness.backends.costs), the same count under both executors."""

    logits: torch.Tensor
    samplers: list[ScheduledSeq]
    forward_s: float
    reads: StepReads  # what the step's attention read, as the backend declares it


class Executor(Protocol):
    @property
    def clock(self) -> Clock:
        """The time the engine reads: arrivals, token times and step rows."""
        ...

    def bind(self, kv: KVManager) -> None:
        """The KV manager of the stack (block tables, held tokens), once it is built."""
        ...

    def apply_cache_ops(self, rec: StepRecord) -> None:
        """The step's swaps, invalidations and copies, before its forward."""
        ...

    def forward(self, rec: StepRecord) -> StepOutput:
        """Run (or model) the forward of ``rec``; the cache ops are already applied."""
        ...

    def take_scores(self) -> StepScores | None:
        """After the forward: what the eviction policy asked for (None: nothing)."""
        ...


class ModelExecutor:
    """The real forward: inputs as tensors, the model, the backend's attention. Under
    ``KVBENCH_CHECK=1`` every step also holds the backend's declared reads to what its
    attention touched (:func:`check_touched`)."""

    def __init__(self, model: LlamaModel, backend: KVBackend, device: torch.device) -> None:
        self.model, self.backend, self.device = model, backend, device
        self.clock: Clock = WallClock()
        self.kv: KVManager | None = None

    def bind(self, kv: KVManager) -> None:
        self.kv = kv

    def apply_cache_ops(self, rec: StepRecord) -> None:
        self.backend.apply_cache_ops(rec)

    def forward(self, rec: StepRecord) -> StepOutput:
        kv = self.kv
        assert kv is not None, "bind() the KV manager first"
        inputs = build_inputs(rec, kv, self.device)
        self.backend.begin_step(inputs.attn)
        tf = time.perf_counter()
        with torch.inference_mode():
            logits = self.model(inputs.input_ids, inputs.positions, self.backend.attend,
                                inputs.logits_rows)
        forward_s = time.perf_counter() - tf
        reads = step_reads(rec, kv, self.backend.costs())
        if CHECKS and self.backend.track_touches:
            check_touched(rec, reads, self.backend, kv)
        return StepOutput(logits, inputs.samplers, forward_s, reads)

    def take_scores(self) -> StepScores | None:
        return self.backend.take_scores()


def check_touched(rec: StepRecord, declared: StepReads, backend: KVBackend,
                  kv: KVManager) -> None:
    """The backend's declared reads of ``rec`` equal what its attention touched, and the
    slots its tensors hold live (where it keeps that) are the KV manager's used slots."""
    read, pairs = backend.touched()
    got = (read.tokens, read.bytes, pairs)
    want = (declared.decode_tokens, declared.decode_bytes, declared.prefill_pairs)
    assert got == want, (
        f"backend {backend.name}, step {rec.step}: its attention touched (decode tokens, "
        f"decode bytes, prefill pairs) = {got}, its declare_costs() says {want}: the "
        "declaration (harness.backends.costs) and the attention disagree")
    held = backend.held_slots()
    used = kv.usage().used_slots if held is not None else None
    assert held == used, (
        f"backend {backend.name}, step {rec.step}: {held} slots hold a live token on the "
        f"device, the KV manager counts {used}")


# Synthetic outputs: lowercase ASCII bytes (the byte tokenizer's ids 97..122), never EOS,
# so a request stops at its drawn length (stop_after) or max_tokens, and a multiturn answer
# decodes and re-encodes to the same ids: the next turn re-sends it and hits the cache.
TOKEN_BASE, TOKEN_SPAN, VOCAB = 97, 26, 258


def synthetic_token(request_id: int, sample: int, position: int) -> int:
    """A token id fixed by the request, the sample and the position: the same on every
    backend and whatever shares the batch."""
    return TOKEN_BASE + (request_id * 7919 + sample * 104729 + position * 31337) % TOKEN_SPAN


@dataclass
class RooflineTotals:
    """Modelled seconds per term, summed over the run (metrics ``roofline.*_s``)."""

    terms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("gemm", "lm_head", "prefill_attn", "decode_attn", "allreduce", "overhead"), 0.0))

    def add(self, t: StepTime) -> None:
        for k in self.terms:
            self.terms[k] += float(getattr(t, k))


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

    def __init__(self, model: StepModel, backend: KVBackend) -> None:
        self.model, self.backend = model, backend
        self.clock = VirtualClock()
        self.totals = RooflineTotals()
        self.costs = backend.costs()
        self.kv: KVManager | None = None
        self.needs_scores = False
        self._written: list[ScheduledSeq] = []
        self._ops_s = 0.0  # cache operations' time, charged to the next forward

    def bind(self, kv: KVManager) -> None:
        self.kv = kv
        self.needs_scores = isinstance(kv, EvictingKVManager) and kv.policy.needs_scores

    def apply_cache_ops(self, rec: StepRecord) -> None:
        """No tensors to move: the copies' and swaps' bytes are charged as time instead
        (copies at device bandwidth, read and written; swaps over the host link)."""
        hw, bps = self.model.hw, self.model.kv_rank_bytes
        slots = sum(op.num_slots for op in rec.copies)
        swapped = (len(rec.swap_out) + len(rec.swap_in)) * self.backend.block_size
        self._ops_s = 2 * slots * bps / (hw.mem_bw * hw.eff_bw) + swapped * bps / hw.host_bw

    def forward(self, rec: StepRecord) -> StepOutput:
        assert self.kv is not None, "bind() the KV manager first"
        sh = step_shape(rec, self.costs, self.kv)
        samplers = sh.samplers
        t = self.model.time(self.model.work_of(sh))
        t.overhead += self._ops_s
        self._ops_s = 0.0
        self.totals.add(t)
        self.clock.advance(float(t.total))
        if self.needs_scores:
            self._written = list(rec.seqs)
        # One-hot rows at each sequence's synthetic token: the engine's own sampling code
        # then runs unchanged (forks, beams); greedy picks exactly these ids.
        ids = [synthetic_token(g.request_id, g.seqs.index(q) if len(g.seqs) > 1 else 0,
                               q.num_tokens) for q, g in ((s.seq, s.seq.group) for s in samplers)]
        logits = torch.nn.functional.one_hot(torch.tensor(ids, dtype=torch.int64),
                                             VOCAB).to(torch.float32)
        return StepOutput(logits, samplers, float(t.forward), sh.reads)

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
