"""A cluster run's own part of :func:`harness.runner.run`: its replicas' stacks behind a
router, and the executor's record keys over all of them."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from harness.cluster.clock import ReplicaClock
from harness.cluster.config import ClusterConfig
from harness.cluster.disagg import DisaggCluster
from harness.cluster.driver import Cluster
from harness.cluster.link import make_link
from harness.cluster.router import make_router
from harness.engine.executor import ModelExecutor
from harness.stack import Stack
from harness.target import ExecutorRecord, RunTarget

if TYPE_CHECKING:
    from harness.config import RunConfig


def make_cluster(cfg: ClusterConfig, stacks: list[Stack], run_seed: int) -> Cluster:
    """The replicas (each stack one) behind ``cfg.router``. Under executor=model each
    replica's clock becomes a :class:`ReplicaClock` (its own steps' wall time)."""
    replica_clocks(stacks)
    if cfg.router == "prefix_aware" and not stacks[0].prefix_caching:
        print("kvbench: warning: cluster.router=prefix_aware with prefix caching off (run."
              "prefix_caching=false): no replica caches a prefix, so it routes on load alone",
              file=sys.stderr)
    return Cluster(stacks, make_router(cfg, run_seed))


def replica_clocks(stacks: list[Stack]) -> None:
    """Under executor=model, each replica's clock a :class:`ReplicaClock`: its own
    steps' wall time (replicas stepped in turn in this one process)."""
    for st in stacks:
        ex = st.engine.executor
        if isinstance(ex, ModelExecutor):
            ex.clock = ReplicaClock()


def pool_gpus(rc: RunConfig) -> tuple[int, int]:
    """Devices per replica of the prefill and of the decode pool (the real engine's
    replicas: one each)."""
    if rc.executor != "roofline":
        return 1, 1
    c = rc.cluster
    return (c.prefill.tp or rc.roofline.tp, c.decode.tp or rc.roofline.tp)


def make_disaggregated(rc: RunConfig, stacks: list[Stack]) -> DisaggCluster:
    """The prefill pool (the first ``cluster.prefill_replicas`` stacks) and the decode
    pool behind their routers, over ``cluster.link``."""
    cfg = rc.cluster
    replica_clocks(stacks)
    routers = (make_router(cfg, rc.seed, cfg.pool_router("prefill")),
               make_router(cfg, rc.seed, cfg.pool_router("decode"), offset=1))
    n = cfg.prefill_replicas
    return DisaggCluster(stacks[:n], stacks[n:], routers,
                         make_link(cfg.link, cfg.link_gbs, cfg.link_latency_us),
                         cfg.transfer == "layerwise", pool_gpus(rc),
                         measured=rc.executor == "model")


def disagg_info(rc: RunConfig) -> dict[str, Any]:
    """``run.*`` keys of a disaggregated cluster: its pools (size, router, and under
    executor=roofline hardware and TP) and its link."""
    c = rc.cluster
    out: dict[str, Any] = {"cluster_mode": "disaggregated"}
    for side in ("prefill", "decode"):
        n = c.pool_replicas(side)
        out[f"{side}_replicas"] = n
        if n > 1:
            out[f"{side}_router"] = c.pool_router(side)
        if rc.executor == "roofline":
            pool = getattr(c, side)
            out[f"{side}_hardware"] = pool.hardware or rc.roofline.hardware
            out[f"{side}_tp"] = pool.tp or rc.roofline.tp
    if rc.executor == "roofline":
        out.update({"link": c.link, "transfer": c.transfer})
    else:
        out["transfer"] = "copied in this process (timed)"
    return out


# An executor's keys that a cluster sums over its replicas: the roofline's modelled seconds
# per term (device-seconds of the whole cluster) and a grouped cache's capacities.
SUMMED = ("memory.token_capacity", "memory.kv_group_slots")


def cluster_record(target: RunTarget | Sequence[RunTarget], stacks: list[Stack],
                   sim_wall_s: float, sim_cpu_s: float) -> ExecutorRecord:
    """The executor's keys for a cluster: replica 0's run keys and its keys that every
    replica shares; ``roofline.*_s`` and the capacities (:data:`SUMMED`) summed over the
    replicas; a KV cache group's own figures (``memory.kv_group.<g>.*``: one pool's peak
    and waste) per replica, as ``replica.<i>.memory.kv_group.<g>.*``. ``target``: the
    one that built every stack, or each stack's own (a disaggregated cluster's pools)."""
    targets = [target] * len(stacks) if not isinstance(target, Sequence) else target
    recs = [t.record(st, sim_wall_s, sim_cpu_s) for t, st in zip(targets, stacks)]
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
