"""The executor seam: what runs a step's forward, and on which clock.

The engine knows only the :class:`Executor` protocol. ``ModelExecutor`` (``executor=model``,
here) runs the real forward on the wall clock; ``RooflineExecutor`` (``executor=roofline``,
harness.roofline.executor) has no weights and no K/V tensors and advances a virtual clock
by each step's modelled time. The engine loop, the scheduler, the KV manager and the
backend's memory behaviour (bytes per token, its manager and eviction policy) are the same
code under both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from harness.backends.base import KVBackend
from harness.backends.costs import StepReads, step_reads
from harness.engine.batch import InputBuilder, group_batch
from harness.engine.graphs import DecodeGraphs
from harness.kv.base import KVManager, KVUsage, StepScores
from harness.kv.evicting import EvictingKVManager
from harness.kv.groups import GroupedKVManager
from harness.model.llama import LlamaModel
from harness.sched.sequence import SequenceGroup
from harness.sched.step import CHECKS, LaneSums, ScheduledSeq, StepRecord


class Clock(Protocol):
    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class WallClock:
    """The machine's time: ``time.perf_counter`` and a real sleep."""

    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))


@dataclass(slots=True)
class StepOutput:
    """``logits``: float32 (S, vocab), one row per entry of ``samplers`` (decodes first,
    then prefill chunks, as batch.build_inputs orders them); ``forward_s``: the forward's
    seconds on the executor's clock; ``reads``: the backend's declared reads of the step
    (harness.backends.costs), the same count under both executors.

    ``one_hot``: instead of ``logits`` (None), the rows' ids when every row is one-hot
    (the roofline's synthetic tokens): greedy sampling reads them as they are, and
    :meth:`dense_logits` makes the tensor only for what needs it (temperature, beams)."""

    logits: torch.Tensor | None
    samplers: list[ScheduledSeq]
    forward_s: float
    reads: StepReads  # what the step's attention read, as the backend declares it
    one_hot: list[int] | None = None
    vocab: int = 0  # the one-hot rows' width
    # On CUDA: events around the forward, read once the step's tokens are (no sync of
    # its own); forward_s is then filled by forward_seconds().
    timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def forward_seconds(self) -> float:
        """The forward's seconds: measured on the host, or by the CUDA events (read after
        the step's one sync, the sampled ids, so reading them waits for nothing)."""
        if self.timing is not None:
            start, end = self.timing
            end.synchronize()
            self.forward_s = start.elapsed_time(end) / 1e3
            self.timing = None
        return self.forward_s

    def dense_logits(self) -> torch.Tensor:
        """``logits``, made from ``one_hot`` the first time they are asked for."""
        if self.logits is None:
            ids = self.one_hot
            assert ids is not None, "a step output has logits or one-hot ids"
            t = torch.zeros((len(ids), self.vocab), dtype=torch.float32)
            t[torch.arange(len(ids)), torch.tensor(ids, dtype=torch.long)] = 1.0
            self.logits = t
        return self.logits


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

    @property
    def transfer_s(self) -> float:
        """Seconds the prefix cache's lower tiers spent moving blocks (the model
        executor's measured copies; the roofline's modelled transfers)."""
        ...

    @property
    def transfer_exposed_s(self) -> float:
        """Of :attr:`transfer_s`, the seconds the steps paid: all of it where the copies
        run in the step (the model executor's), only what outlasts a step's own work
        where they overlap it (``cache.tiers.overlap=true`` in the roofline)."""
        ...


@runtime_checkable
class LaneExecutor(Executor, Protocol):
    """An executor that can run a step of decode-lane members given as their sums (the
    roofline's: harness/roofline/fastpath, Engine.lane_step)."""

    def forward_lane(self, n: int, sums: LaneSums) -> tuple[float, StepReads]:
        """The forward of ``n`` members, all the step runs: its seconds and reads."""
        ...


@runtime_checkable
class LaneScheduling(Protocol):
    """A scheduler that also steps decodes in bulk (the roofline's ``LaneScheduler``,
    harness/roofline/fastpath/scheduler.py): whole *lane steps* of bulk decodes only
    (Engine.lane_step), and the bulk decodes' leaving at the end of a run."""

    def lane_step_ready(self) -> bool:
        """Whether the next step is a lane step."""
        ...

    def schedule_lane(self) -> tuple[int, LaneSums, KVUsage]:
        """The lane step's number, its decodes' sums, what the KV manager holds."""
        ...

    def finish_lane(self) -> list[SequenceGroup]:
        """After the lane step's forward: the groups it finished, retired."""
        ...

    def leave_lane(self) -> list[int]:
        """Every bulk decode leaves (the run ended or stopped): their request ids."""
        ...


class ModelExecutor:
    """The real forward: inputs as tensors, the model, the backend's attention. Under
    ``KVBENCH_CHECK=1`` every step also holds the backend's declared reads to what its
    attention touched (:func:`check_touched`)."""

    def __init__(self, model: LlamaModel, backend: KVBackend, device: torch.device) -> None:
        self.model, self.backend, self.device = model, backend, device
        self.clock: Clock = WallClock()
        self.kv: KVManager | None = None
        self.inputs = InputBuilder(device)  # the step's metadata, in persistent buffers
        # Decode steps replayed per batch bucket (harness.engine.graphs), when the run has
        # them (harness.engine.graphs.setup_graphs); None: every step eager.
        self.graphs: DecodeGraphs | None = None

    def bind(self, kv: KVManager) -> None:
        self.kv = kv

    @property
    def transfer_s(self) -> float:
        """Wall seconds the prefix cache's tier operations took (measured)."""
        ts = self.backend.tier_storage
        return ts.transfer_s if ts is not None else 0.0

    @property
    def transfer_exposed_s(self) -> float:
        return self.transfer_s  # synchronous copies, inside the steps

    def apply_cache_ops(self, rec: StepRecord) -> None:
        if rec.tier_ops:  # first: StepRecord says why they may
            ts = self.backend.tier_storage
            assert ts is not None, "tier ops without tier storage"
            ts.apply(rec.tier_ops)
        self.backend.apply_cache_ops(rec)

    def forward(self, rec: StepRecord) -> StepOutput:
        kv = self.kv
        assert kv is not None, "bind() the KV manager first"
        bucket: int | None = None  # the graph bucket this step replays in (None: eager)
        if isinstance(kv, GroupedKVManager):  # each layer attends through its group's
            inputs = self.inputs.build(rec, kv, kv.members, kv.block_size)
            if CHECKS and not kv.chooses:  # positional: the first group's slots read from
                # its tables are the record's (the others are read the same way)
                again = group_batch(inputs.attn, kv.members[0], kv.block_size, self.device)
                assert torch.equal(again.slot_mapping, inputs.attn.slot_mapping)
            self.backend.begin_groups(inputs.groups)
        else:
            inputs = self.inputs.build(rec, kv)
            bucket = self.graphs.bucket(inputs) if self.graphs is not None else None
            if bucket is None:  # (a replay begins the step on its own static batch)
                self.backend.begin_step(inputs.attn)
        self.backend.staging.end()  # what the cache ops and begin_step wrote is copied
        cuda = self.device.type == "cuda"
        timing = (torch.cuda.Event(enable_timing=True),
                  torch.cuda.Event(enable_timing=True)) if cuda else None
        tf = time.perf_counter()
        if timing is not None:
            timing[0].record()
        if self.graphs is not None and bucket is not None:
            logits = self.graphs.run(inputs, bucket)
        else:
            with torch.inference_mode():
                logits = self.model(inputs.input_ids, inputs.positions, self.backend.attend,
                                    inputs.logits_rows)
        if timing is not None:
            timing[1].record()
        forward_s = time.perf_counter() - tf
        reads = step_reads(rec, kv, self.backend.costs())
        if CHECKS and self.backend.track_touches:
            check_touched(rec, reads, self.backend, kv)
        return StepOutput(logits, inputs.samplers, forward_s, reads, timing=timing)

    def take_scores(self) -> StepScores | None:
        return self.backend.take_scores()


def check_touched(rec: StepRecord, declared: StepReads, backend: KVBackend,
                  kv: KVManager) -> None:
    """The backend's declared reads of ``rec`` equal what its attention touched, and the
    slots its tensors hold live (where it keeps that) are the KV manager's used slots."""
    read, pairs = backend.touched()
    got = (read.tokens, read.bytes, pairs)
    want = (declared.decode_tokens, declared.decode_bytes, declared.prefill_pairs)
    if backend.per_layer_masks:
        # Layers that see different keys: tokens and pairs are layer-weighted averages,
        # which the declaration rounds down per decode (per chunk) and the count once for
        # the step, so it may be up to one less per decode (per chunk); bytes are exact
        # sums either way.
        chunks = sum(1 for s in rec.seqs if not s.is_decode)
        ok = (got[1] == want[1] and 0 <= got[0] - want[0] <= declared.decode_queries
              and 0 <= got[2] - want[2] <= chunks)
    else:
        ok = got == want
    assert ok, (
        f"backend {backend.name}, step {rec.step}: its attention touched (decode tokens, "
        f"decode bytes, prefill pairs) = {got}, its declare_costs() says {want}: the "
        "declaration (harness.backends.costs) and the attention disagree")
    held = backend.held_slots()
    used = None if held is None else kv.group_used_slots(0) if isinstance(
        kv, GroupedKVManager) and kv.chooses else kv.usage().used_slots
    if used is not None and isinstance(kv, EvictingKVManager):
        used += kv.cached_slots()  # kept compressed prefixes' tokens (harness.kv.compressed)
    assert held == used, (
        f"backend {backend.name}, step {rec.step}: {held} slots hold a live token on the "
        f"device, the KV manager counts {used}")
