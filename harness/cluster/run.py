"""A cluster run's own part of :func:`harness.runner.run`: its replicas' stacks behind a
router, and the executor's record keys over all of them."""

from __future__ import annotations

import sys
from typing import Any

from harness.cluster.clock import ReplicaClock
from harness.cluster.config import ClusterConfig
from harness.cluster.driver import Cluster
from harness.cluster.router import make_router
from harness.engine.executor import ModelExecutor
from harness.stack import Stack
from harness.target import ExecutorRecord, RunTarget


def make_cluster(cfg: ClusterConfig, stacks: list[Stack], run_seed: int) -> Cluster:
    """The replicas (each stack one) behind ``cfg.router``. Under executor=model each
    replica's clock becomes a :class:`ReplicaClock` (its own steps' wall time)."""
    for st in stacks:
        ex = st.engine.executor
        if isinstance(ex, ModelExecutor):
            ex.clock = ReplicaClock()
    if cfg.router == "prefix_aware" and not stacks[0].prefix_caching:
        print("kvbench: warning: cluster.router=prefix_aware with prefix caching off (run."
              "prefix_caching=false): no replica caches a prefix, so it routes on load alone",
              file=sys.stderr)
    return Cluster(stacks, make_router(cfg, run_seed))


# An executor's keys that a cluster sums over its replicas: the roofline's modelled seconds
# per term (device-seconds of the whole cluster) and a grouped cache's capacities.
SUMMED = ("memory.token_capacity", "memory.kv_group_slots")


def cluster_record(target: RunTarget, stacks: list[Stack], sim_wall_s: float,
                   sim_cpu_s: float) -> ExecutorRecord:
    """The executor's keys for a cluster: replica 0's run keys and its keys that every
    replica shares; ``roofline.*_s`` and the capacities (:data:`SUMMED`) summed over the
    replicas; a KV cache group's own figures (``memory.kv_group.<g>.*``: one pool's peak
    and waste) per replica, as ``replica.<i>.memory.kv_group.<g>.*``."""
    recs = [target.record(st, sim_wall_s, sim_cpu_s) for st in stacks]
    metrics: dict[str, Any] = {}
    for k, v in recs[0].metrics.items():
        if k.startswith("memory.kv_group."):
            for i, r in enumerate(recs):
                metrics[f"replica.{i}.{k}"] = r.metrics[k]
        elif k in SUMMED or (k.startswith("roofline.") and k.endswith("_s")
                             and isinstance(v, float)):
            metrics[k] = sum(r.metrics[k] for r in recs)
        else:
            metrics[k] = v
    return ExecutorRecord(recs[0].run, metrics)
