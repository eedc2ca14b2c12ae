"""What a workload is: requests with arrival times, and follow-ups when one finishes."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from harness.sched.sequence import SamplingParams, SequenceGroup


@dataclass(slots=True)
class Request:
    """One request: its prompt, how to sample it and when it arrives (seconds from the
    run's start, or from the finish of the request it follows)."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival_s: float = 0.0
    priority: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    # A follow-up arrives no earlier than this (seconds from the run's start): a trace's
    # later turn keeps its own timestamp when the answer it follows came sooner.
    earliest_s: float | None = None
    # Set by a workload that knows the request cannot run as given (a trace row longer
    # than max_model_len): the scheduler rejects it with this reason, and it is counted.
    rejected_reason: str | None = None

    def to_group(self, arrival_time: float) -> SequenceGroup:
        return SequenceGroup(self.request_id, list(self.prompt_ids), self.params,
                             arrival_time=arrival_time, priority=self.priority,
                             rejected_reason=self.rejected_reason)


@dataclass
class WorkloadOptions:
    """What every workload's options share; each workload's config dataclass extends it
    and is the one place for its defaults (and the Hydra schema of
    ``conf/workload/<name>.yaml``, registered from the workload registry)."""

    name: str = ""
    seed: int | None = None  # None: the run's seed (one seed drives a run unless overridden)

    @property
    def seed_value(self) -> int:
        """The seed to draw with (0 when neither the workload nor a run set one)."""
        return 0 if self.seed is None else self.seed


@runtime_checkable
class FollowsRejections(Protocol):
    """A workload whose later requests depend on an earlier one that may be rejected
    (never run): a conversation whose turn was rejected ends, and the slot it held under a
    cap passes on; a trace's later turn still arrives when the trace says."""

    def on_rejected(self, group: SequenceGroup) -> list[Request]:
        """Follow-ups of a rejected request (as ``on_finished``'s: arrival_s from now)."""
        ...


@runtime_checkable
class StreamsRequests(Protocol):
    """A workload too large to hold as requests (a million-row trace): the engine pulls
    its initial requests one at a time as their arrival comes (:meth:`stream_requests`,
    in nondecreasing (arrival_s, request_id) order), and the stack checks the budget from
    their shapes alone. Its ``initial_requests()`` still builds them all (for small runs
    and tests)."""

    num_initial: int  # how many stream_requests yields

    def stream_requests(self) -> Iterator[Request]:
        """The initial requests, built as they are reached, sorted by arrival then id."""
        ...

    def initial_shapes(self) -> Iterator[tuple[int, int, int]]:
        """(prompt tokens, max_tokens, n) per initial request, without building them."""
        ...


RequestShape = tuple[int, int, int]  # (prompt tokens, max_tokens, n): what sizes a request


def request_shapes(workload: Workload) -> Iterator[RequestShape]:
    """Every initial request's shape: a streamed workload's without building its
    requests, any other's from them."""
    if isinstance(workload, StreamsRequests):
        return workload.initial_shapes()
    return ((len(r.prompt_ids), r.params.max_tokens, r.params.n)
            for r in workload.initial_requests())


@runtime_checkable
class ReportsMetrics(Protocol):
    """A workload with metrics of its own (a trace: rows replayed, truncated, rejected),
    merged into metrics.json by the runner."""

    def workload_metrics(self) -> dict[str, float]:
        """Flat dotted keys (``trace.*``) -> values."""
        ...


class Workload(Protocol):
    """A seeded, reproducible source of requests."""

    name: str

    def initial_requests(self) -> list[Request]:
        """Requests known at the start, arrival_s relative to the run's start."""
        ...

    def on_finished(self, group: SequenceGroup) -> list[Request]:
        """Follow-ups of a finished request (the next turn of a conversation); their
        arrival_s is relative to now."""
        ...
