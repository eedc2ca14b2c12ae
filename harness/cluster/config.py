"""The ``cluster`` config section: how many replicas serve the workload, and how a request
is routed to one of them; or (``cluster.mode=disaggregated``) a prefill pool and a decode
pool, each behind its router, and the link between them (harness.cluster.link)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from harness.cluster.link import LINKS, TRANSFERS
from harness.errors import UserError

ROUTERS = ("round_robin", "random", "least_loaded", "prefix_aware")
PREFIX_SCORERS = ("dynamo", "llm_d")
# The most replicas one run simulates. Every replica is a whole stack (block pool,
# scheduler, clock; ~30 KB and ~1 ms to build under executor=roofline) built before the
# run in this one process, the least_loaded and prefix_aware routers score every replica
# for every request, and metrics.json reports each (replica.<i>.*, ~600 bytes): at 100,000
# replicas the set-up alone took minutes and gigabytes before one request ran (issue #55).
# 4,096 builds in seconds and is beyond the single-model fleets the routers were modelled
# on (docs/cluster_routing.md).
MAX_REPLICAS = 4096
MODES = ("colocated", "disaggregated")


@dataclass
class SchedulerOverrides:
    """``cluster.prefill.scheduler.*`` / ``cluster.decode.scheduler.*``: a pool's own value
    of each ``scheduler.*`` option (None: the run's). The same names as SchedulerConfig's
    fields (a test holds them equal)."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    chunked_prefill: bool | None = None
    preemption_mode: str | None = None
    policy: str | None = None
    max_model_len: int | None = None
    mixing: str | None = None
    admission: str | None = None
    num_scheduler_steps: int | None = None

    def given(self) -> dict[str, Any]:
        """The options set (not None)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}


@dataclass
class PoolSpec:
    """``cluster.prefill.*`` / ``cluster.decode.*``: one pool's own settings under
    ``cluster.mode=disaggregated``; each unset (None) is the run's own
    (``roofline.hardware``, ``roofline.tp``, ``scheduler.*``, ``cluster.router``)."""

    hardware: str | None = None  # executor=roofline: a hardware spec
    tp: int | None = None  # executor=roofline: devices per replica of this pool
    router: str | None = None  # this pool's router (ROUTERS)
    # scheduler.* for this pool's replicas (e.g. max_num_batched_tokens=16384 for
    # prefill, max_num_seqs=512 for decode), over the run's scheduler section.
    scheduler: SchedulerOverrides = field(default_factory=SchedulerOverrides)

    def is_default(self) -> bool:
        return self == PoolSpec()

    def check(self, side: str) -> None:
        if self.tp is not None and self.tp < 1:
            raise UserError(f"cluster.{side}.tp={self.tp} must be >= 1")
        if self.router is not None and self.router not in ROUTERS:
            raise UserError(f"cluster.{side}.router={self.router!r} is not a router: use one "
                            f"of {', '.join(ROUTERS)}")


@dataclass
class ClusterConfig:
    """``cluster.*``. One replica (the default) is a plain run: no router, no ``replica``
    columns. Each replica is the run's whole stack (``roofline.tp`` devices under
    executor=roofline) with its own ``cache.kv_budget``, scheduler and clock."""

    replicas: int = 1
    # round_robin: in turn (data parallelism); random: uniformly, seeded; least_loaded:
    # fewest requests in flight (running, waiting or swapped: Vidur's least outstanding
    # requests); prefix_aware: cached prompt blocks balanced against load, scored as
    # ``prefix_scorer`` says (harness.cluster.router).
    router: str = "round_robin"
    # dynamo: the lowest cost overlap_weight * prompt blocks to compute + blocks the
    # replica's requests hold or wait for (NVIDIA Dynamo's KV router); llm_d: the highest
    # weighted sum of llm-d's normalised scorers (prefix, KV cache use, queue).
    prefix_scorer: str = "dynamo"
    overlap_weight: float = 1.0  # Dynamo's --router-kv-overlap-score-weight default
    # llm_d's weights, llm-d's precise-prefix-cache example's (prefix 2, KV cache
    # utilisation 1, queue 1; llm-d-inference-scheduler deploy/config/
    # epp-precise-prefix-cache-config.yaml).
    prefix_weight: float = 2.0
    kv_weight: float = 1.0
    queue_weight: float = 1.0
    seed: int | None = None  # random's draws (None: the run's seed)
    # colocated: every replica prefills and decodes (cluster.replicas of them);
    # disaggregated: prefill_replicas compute prompts, decode_replicas generate, each
    # request's KV blocks moved between them over ``link`` (harness.cluster.disagg).
    mode: str = "colocated"
    prefill_replicas: int = 1
    decode_replicas: int = 1
    prefill: PoolSpec = field(default_factory=PoolSpec)
    decode: PoolSpec = field(default_factory=PoolSpec)
    link: str = "ib"  # nvlink | ib | eth: published figures (harness.cluster.link)
    link_gbs: float | None = None  # the link's bandwidth per GPU, one way (None: link's)
    link_latency_us: float | None = None  # per transfer (None: link's)
    # whole: a request's blocks move once its prefill ended (vLLM's NIXL connector);
    # layerwise: each layer's blocks move as the prefill computes them (Mooncake, SGLang
    # and LMCache's layer-wise transfer), the decode side's room reserved at arrival.
    transfer: str = "whole"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UserError(f"cluster.mode={self.mode!r}: use one of {', '.join(MODES)}")
        if self.mode == "disaggregated":
            self._check_disaggregated()
        else:
            self._refuse_pool_keys()
        if self.replicas < 1:
            raise UserError(f"cluster.replicas={self.replicas} must be >= 1 (1: one engine, "
                            "no router)")
        self._check_size("cluster.replicas", self.replicas)
        if self.router not in ROUTERS:
            raise UserError(f"cluster.router={self.router!r} is not a router: use one of "
                            f"{', '.join(ROUTERS)}")
        if self.prefix_scorer not in PREFIX_SCORERS:
            raise UserError(f"cluster.prefix_scorer={self.prefix_scorer!r}: use one of "
                            f"{', '.join(PREFIX_SCORERS)}")
        for key in ("overlap_weight", "prefix_weight", "kv_weight", "queue_weight"):
            v = getattr(self, key)
            if not (v >= 0 and v < float("inf")):
                raise UserError(f"cluster.{key}={v} must be a finite weight >= 0")
        self._refuse_ignored()

    @staticmethod
    def _check_size(key: str, n: int) -> None:
        if n > MAX_REPLICAS:
            raise UserError(
                f"{key}={n:,} is more than one run simulates (at most "
                f"{MAX_REPLICAS:,}): every replica is a whole stack built before the run in "
                "this one process, scored by the router for every request and reported on "
                "its own in metrics.json, so past that a run spends its time and memory on "
                "bookkeeping, not on requests. Model a larger fleet by a share of it: fewer "
                "replicas at the same share of the traffic (workload.rate)")

    def _check_disaggregated(self) -> None:
        """Two pools and a link: the pools' sizes and overrides, the link's numbers."""
        if self.replicas != 1:
            raise UserError(
                f"cluster.replicas={self.replicas} sizes a colocated cluster: under "
                "cluster.mode=disaggregated the pools are cluster.prefill_replicas and "
                "cluster.decode_replicas; drop cluster.replicas")
        for side in ("prefill", "decode"):
            n = getattr(self, f"{side}_replicas")
            if n < 1:
                raise UserError(f"cluster.{side}_replicas={n} must be >= 1")
            self._check_size(f"cluster.{side}_replicas", n)
            pool: PoolSpec = getattr(self, side)
            pool.check(side)
            if pool.router is not None and n == 1:
                raise UserError(f"cluster.{side}.router={pool.router}: ignored, as with "
                                f"cluster.{side}_replicas=1 there is no {side} router; "
                                "drop it")
        if self.link not in LINKS:
            raise UserError(f"cluster.link={self.link!r}: use one of {', '.join(LINKS)} "
                            "(or give cluster.link_gbs and cluster.link_latency_us)")
        if self.link_gbs is not None and not (0 < self.link_gbs < math.inf):
            raise UserError(f"cluster.link_gbs={self.link_gbs} must be a finite bandwidth > 0 "
                            "(GB/s per GPU, one way)")
        if self.link_latency_us is not None and not (0 <= self.link_latency_us < math.inf):
            raise UserError(f"cluster.link_latency_us={self.link_latency_us} must be a finite "
                            "latency >= 0 (microseconds per transfer)")
        if self.transfer not in TRANSFERS:
            raise UserError(f"cluster.transfer={self.transfer!r}: use one of "
                            f"{', '.join(TRANSFERS)}")

    def _refuse_pool_keys(self) -> None:
        """The disaggregated cluster's keys set on a colocated one: read by nothing."""
        cls = ClusterConfig
        keys = [f"cluster.{k}={getattr(self, k)}" for k in (
            "prefill_replicas", "decode_replicas", "link", "link_gbs", "link_latency_us",
            "transfer") if getattr(self, k) != getattr(cls, k)]
        keys += [f"cluster.{k}.*" for k in ("prefill", "decode")
                 if not getattr(self, k).is_default()]
        if keys:
            given = ", ".join(keys)
            raise UserError(
                f"{given}: ignored, as they size and link "
                "the pools of cluster.mode=disaggregated and this cluster is colocated; set "
                "cluster.mode=disaggregated, or drop "
                f"{'it' if len(keys) == 1 else 'them'}")

    def check_executor(self, executor: str) -> None:
        """What only the what-if reads, refused under ``executor=model``: a pool's own
        hardware and TP (the real engine runs every replica on this machine's device) and
        the link (it copies each request's blocks in this one process and measures that)."""
        if self.mode != "disaggregated" or executor != "model":
            return
        keys = [f"cluster.{side}.{k}={getattr(getattr(self, side), k)}"
                for side in ("prefill", "decode") for k in ("hardware", "tp")
                if getattr(getattr(self, side), k) is not None]
        cls = ClusterConfig
        keys += [f"cluster.{k}={getattr(self, k)}"
                 for k in ("link", "link_gbs", "link_latency_us", "transfer")
                 if getattr(self, k) != getattr(cls, k)]
        if keys:
            raise UserError(
                f"{', '.join(keys)}: what-if options (executor=roofline); the real engine "
                "(executor=model) runs every replica on this machine's device and copies "
                "each request's blocks in this one process, timing the copy: drop "
                f"{'it' if len(keys) == 1 else 'them'}")

    def pool_replicas(self, side: str) -> int:
        """Replicas of the ``prefill`` or ``decode`` pool (disaggregated)."""
        return int(getattr(self, f"{side}_replicas"))

    def pool_router(self, side: str) -> str:
        """The router of the ``prefill`` or ``decode`` pool: its own, else cluster.router."""
        pool: PoolSpec = getattr(self, side)
        return pool.router if pool.router is not None else self.router

    def routers_in_use(self) -> list[str]:
        """The routers that place requests in this cluster (none with one replica, or
        with one replica in each pool)."""
        if self.mode == "colocated":
            return [self.router] if self.replicas > 1 else []
        return [self.pool_router(side) for side in ("prefill", "decode")
                if self.pool_replicas(side) > 1]

    def _refuse_ignored(self) -> None:
        """An option set away from its default where this cluster never reads it is a
        mistake, not a no-op (issue #55: a router with one replica, llm_d's scorer under
        round_robin, were ignored without a word)."""
        defaults = {f: getattr(ClusterConfig, f) for f in (  # (the class's defaults)
            "router", "prefix_scorer", "overlap_weight", "prefix_weight", "kv_weight",
            "queue_weight", "seed")}
        changed = [k for k, v in defaults.items() if getattr(self, k) != v]
        routers = self.routers_in_use()
        if not routers:
            used: set[str] = set()
            why = ("with cluster.replicas=1 there is no router: set cluster.replicas >= 2"
                   if self.mode == "colocated" else
                   "with one replica in each pool there is no router: set "
                   "cluster.prefill_replicas or cluster.decode_replicas >= 2")
        else:
            used = set()
            if self.mode == "colocated" or any(
                    getattr(self, side).router is None and self.pool_replicas(side) > 1
                    for side in ("prefill", "decode")):
                used.add("router")
            if "prefix_aware" in routers:
                used.add("prefix_scorer")
                used |= {"overlap_weight"} if self.prefix_scorer == "dynamo" else {
                    "prefix_weight", "kv_weight", "queue_weight"}
            if "random" in routers:
                used.add("seed")
            names = " and ".join(sorted(set(routers)))
            why = (f"cluster.router={names}" if self.mode == "colocated" else
                   f"the pools' routers ({names})") + (
                f" with prefix_scorer={self.prefix_scorer}"
                if "prefix_aware" in routers else "") + " do" + (
                "es" if self.mode == "colocated" else "") + " not read it"
        ignored = [k for k in changed if k not in used]
        if routers and "router" in ignored:
            why = ("each pool with a router has its own (cluster.prefill.router, "
                   "cluster.decode.router), so nothing reads it")
        if ignored:
            keys = ", ".join(f"cluster.{k}={getattr(self, k)}" for k in ignored)
            raise UserError(f"{keys}: ignored, as {why}; drop "
                            f"{'it' if len(ignored) == 1 else 'them'}")
