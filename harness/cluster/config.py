"""The ``cluster`` config section: how many replicas serve the workload, and how a request
is routed to one of them."""

from __future__ import annotations

from dataclasses import dataclass

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

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise UserError(f"cluster.replicas={self.replicas} must be >= 1 (1: one engine, "
                            "no router)")
        if self.replicas > MAX_REPLICAS:
            raise UserError(
                f"cluster.replicas={self.replicas:,} is more than one run simulates (at most "
                f"{MAX_REPLICAS:,}): every replica is a whole stack built before the run in "
                "this one process, scored by the router for every request and reported on "
                "its own in metrics.json, so past that a run spends its time and memory on "
                "bookkeeping, not on requests. Model a larger fleet by a share of it: fewer "
                "replicas at the same share of the traffic (workload.rate)")
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

    def _refuse_ignored(self) -> None:
        """An option set away from its default where this cluster never reads it is a
        mistake, not a no-op (issue #55: a router with one replica, llm_d's scorer under
        round_robin, were ignored without a word)."""
        defaults = {f: getattr(ClusterConfig, f) for f in (  # (the class's defaults)
            "router", "prefix_scorer", "overlap_weight", "prefix_weight", "kv_weight",
            "queue_weight", "seed")}
        changed = [k for k, v in defaults.items() if getattr(self, k) != v]
        if self.replicas == 1:
            used: set[str] = set()
            why = "with cluster.replicas=1 there is no router: set cluster.replicas >= 2"
        else:
            used = {"router"}
            if self.router == "prefix_aware":
                used.add("prefix_scorer")
                used |= {"overlap_weight"} if self.prefix_scorer == "dynamo" else {
                    "prefix_weight", "kv_weight", "queue_weight"}
            if self.router == "random":
                used.add("seed")
            why = (f"cluster.router={self.router}" + (
                f" with prefix_scorer={self.prefix_scorer}"
                if self.router == "prefix_aware" else "") + " does not read it")
        ignored = [k for k in changed if k not in used]
        if ignored:
            keys = ", ".join(f"cluster.{k}={getattr(self, k)}" for k in ignored)
            raise UserError(f"{keys}: ignored, as {why}; drop "
                            f"{'it' if len(ignored) == 1 else 'them'}")
