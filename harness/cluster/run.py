"""A cluster run's own part of :func:`harness.runner.run`: its replicas' stacks behind a
router, and the executor's record keys over all of them."""

from __future__ import annotations

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
    return Cluster(stacks, make_router(cfg, run_seed))


def cluster_record(target: RunTarget, stacks: list[Stack], sim_wall_s: float) -> ExecutorRecord:
    """The executor's keys for a cluster: replica 0's run keys and metrics, but the
    roofline's modelled seconds per term (``roofline.*_s``), summed over the replicas
    (device-seconds of the whole cluster)."""
    recs = [target.record(st, sim_wall_s) for st in stacks]
    metrics: dict[str, Any] = dict(recs[0].metrics)
    for k, v in metrics.items():
        if k.startswith("roofline.") and k.endswith("_s") and isinstance(v, float):
            metrics[k] = sum(r.metrics[k] for r in recs)
    return ExecutorRecord(recs[0].run, metrics)
