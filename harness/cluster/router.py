"""Routers: which replica a request goes to, decided when it arrives.

- ``round_robin``: replica 0, 1, ..., N-1, 0, ... in arrival order (data parallelism);
- ``random``: uniformly at random, from the run's seed;
- ``least_loaded``: the replica with the fewest requests in flight (running, waiting or
  swapped out), as Vidur's least-outstanding-requests global scheduler;
- ``prefix_aware``: the leading prompt blocks each replica's prefix cache holds (device,
  then lower tiers, as its scheduler would find them), balanced against its load, in one
  of two published ways (``cluster.prefix_scorer``):

  - ``dynamo`` (default): the lowest cost ``overlap_weight * prefill blocks + load
    blocks``, NVIDIA Dynamo's KV router's (docs "Routing Concepts": cost =
    overlap_score_weight * prefill_blocks + decode_blocks; weight 1 by default,
    temperature 0): the prompt blocks the replica would compute, and the blocks its
    requests hold (running) or will need (their prompts, waiting or swapped out);
  - ``llm_d``: the highest weighted sum of llm-d's scorers (llm-d-inference-scheduler,
    precise prefix-cache scheduling): cached leading blocks and queued requests, each
    min-max normalised over the replicas (the queue inverted), and one minus KV cache
    utilisation; weights ``cluster.prefix_weight``, ``kv_weight``, ``queue_weight``
    (2, 1, 1 as in its example config).

Ties go to the replica with fewer requests in flight, then to the lower index: routing is
deterministic for a given seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq
from typing import Protocol

from harness.cluster.config import ClusterConfig
from harness.kv.base import KVManager
from harness.kv.groups import GroupedKVManager
from harness.sched.sequence import Sequence, SequenceGroup


class ReplicaView(Protocol):
    """What a router sees of one replica."""

    @property
    def index(self) -> int: ...

    def in_flight(self) -> int:
        """Requests routed here and not finished: running, waiting or swapped out."""
        ...

    def queued(self) -> int:
        """Requests routed here that wait to run: waiting or swapped out."""
        ...

    def kv_utilization(self) -> float:
        """Share of the replica's KV cache held now (0..1)."""
        ...

    def load_blocks(self) -> int:
        """Blocks the replica's requests hold (running) or will need for their prompts
        (waiting or swapped out): Dynamo's decode blocks."""
        ...

    @property
    def block_size(self) -> int: ...

    def cached_prefix_tokens(self, group: SequenceGroup) -> int:
        """Leading prompt tokens of ``group`` this replica's prefix cache holds now."""
        ...


class Router(Protocol):
    name: str

    def route(self, group: SequenceGroup, replicas: Seq[ReplicaView]) -> int:
        """The index of the replica ``group`` (just arrived, not yet queued) goes to."""
        ...


def cached_prefix_tokens(kv: KVManager, group: SequenceGroup) -> int:
    """Prompt tokens of ``group`` found in ``kv``'s prefix cache (its device blocks, then
    its lower tiers), as its scheduler's lookup would find them now; no side effect on
    the cache (a probe sequence that no table holds)."""
    if not group.prompt_ids:
        return 0
    probe = Sequence(-1, group, group.prompt_ids)
    hit = kv.lookup_prefix(probe)
    if isinstance(kv, GroupedKVManager):  # it keeps a lookup's plan and hashes by seq id
        kv.forget_lookup(probe)
    return hit.num_tokens(kv.block_size)


def _least(replicas: Seq[ReplicaView], among: Seq[int]) -> int:
    return min(among, key=lambda i: (replicas[i].in_flight(), i))


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, group: SequenceGroup, replicas: Seq[ReplicaView]) -> int:
        i = self._next % len(replicas)
        self._next += 1
        return i


class RandomRouter:
    name = "random"

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def route(self, group: SequenceGroup, replicas: Seq[ReplicaView]) -> int:
        return self._rng.randrange(len(replicas))


class LeastLoaded:
    name = "least_loaded"

    def route(self, group: SequenceGroup, replicas: Seq[ReplicaView]) -> int:
        return _least(replicas, range(len(replicas)))


def min_max(xs: list[float]) -> list[float]:
    """``xs`` scaled to 0..1 (the largest 1); all equal: all 1 (no replica preferred)."""
    lo, hi = min(xs), max(xs)
    return [1.0] * len(xs) if hi == lo else [(x - lo) / (hi - lo) for x in xs]


class DynamoCost:
    """cost = overlap_weight * (prompt blocks - cached blocks) + load blocks; lowest wins
    (NVIDIA Dynamo's KV router at temperature 0)."""

    name = "prefix_aware"

    def __init__(self, overlap_weight: float) -> None:
        self.overlap_weight = overlap_weight

    def costs(self, group: SequenceGroup, replicas: Seq[ReplicaView]) -> list[float]:
        out = []
        for r in replicas:
            bs = r.block_size
            prefill = -(-len(group.prompt_ids) // bs) - r.cached_prefix_tokens(group) // bs
            out.append(self.overlap_weight * prefill + r.load_blocks())
        return out

    def route(self, group: SequenceGroup, replicas: Seq[ReplicaView]) -> int:
        costs = self.costs(group, replicas)
        best = min(costs)
        return _least(replicas, [i for i, c in enumerate(costs) if c == best])


class PrefixAware:
    """score = prefix_weight * prefix + kv_weight * (1 - KV utilisation)
    + queue_weight * queue, ``prefix`` the replica's cached leading prompt blocks and
    ``queue`` one minus its queued requests, each min-max normalised over the replicas
    (llm-d's precise prefix-cache scorer and queue scorer; its KV-cache-utilisation
    scorer). Highest wins."""

    name = "prefix_aware"

    def __init__(self, prefix_weight: float, kv_weight: float, queue_weight: float) -> None:
        self.prefix_weight, self.kv_weight, self.queue_weight = (prefix_weight, kv_weight,
                                                                 queue_weight)

    def scores(self, group: SequenceGroup, replicas: Seq[ReplicaView]) -> list[float]:
        prefix = min_max([float(r.cached_prefix_tokens(group)) for r in replicas])
        queue = min_max([-float(r.queued()) for r in replicas])
        return [self.prefix_weight * p + self.kv_weight * (1.0 - r.kv_utilization())
                + self.queue_weight * q for p, q, r in zip(prefix, queue, replicas)]

    def route(self, group: SequenceGroup, replicas: Seq[ReplicaView]) -> int:
        scores = self.scores(group, replicas)
        best = max(scores)
        return _least(replicas, [i for i, s in enumerate(scores) if s == best])


def make_router(cfg: ClusterConfig, run_seed: int, name: str | None = None,
                offset: int = 0) -> Router:
    """The router ``name`` names (default ``cluster.router``; a disaggregated cluster's
    pool may have its own), with the cluster's options; ``random`` draws from its seed
    plus ``offset`` (a second pool's router: not the first's draws again)."""
    name = cfg.router if name is None else name
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomRouter((run_seed if cfg.seed is None else cfg.seed) + offset)
    if name == "least_loaded":
        return LeastLoaded()
    assert name == "prefix_aware", name  # ClusterConfig checked the name
    if cfg.prefix_scorer == "dynamo":
        return DynamoCost(cfg.overlap_weight)
    return PrefixAware(cfg.prefix_weight, cfg.kv_weight, cfg.queue_weight)
