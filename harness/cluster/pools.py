"""The two pools of a disaggregated cluster (``cluster.mode=disaggregated``): each pool's
run config (the run's, with ``cluster.prefill.*`` / ``cluster.decode.*`` over it), its
stacks, and the refusal of a run whose blocks cannot be handed from one to the other."""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

from harness.cluster.handoff import movable_manager
from harness.errors import UserError
from harness.stack import Stack
from harness.target import RunTarget

if TYPE_CHECKING:
    from harness.config import RunConfig

SIDES = ("prefill", "decode")


def pool_config(rc: RunConfig, side: str) -> RunConfig:
    """``rc`` with the ``side`` pool's own hardware, TP and scheduler options over it."""
    pool = getattr(rc.cluster, side)
    roof = {k: getattr(pool, k) for k in ("hardware", "tp") if getattr(pool, k) is not None}
    sched = pool.scheduler.given()
    try:
        return dataclasses.replace(
            rc, roofline=dataclasses.replace(rc.roofline, **roof) if roof else rc.roofline,
            scheduler=dataclasses.replace(rc.scheduler, **sched) if sched else rc.scheduler)
    except UserError as e:
        raise UserError(f"cluster.{side}: {e}") from None


def pool_target(target: RunTarget, rc: RunConfig, side: str) -> RunTarget:
    """The run's target for the ``side`` pool: a what-if's own (its hardware may differ),
    or the real engine's sharing the one loaded model."""
    side_rc = pool_config(rc, side)
    if rc.executor == "roofline":
        from harness.roofline.run import RooflineTarget

        return RooflineTarget(side_rc)
    out = copy.copy(target)  # the loaded model is shared: only the config differs
    out.rc = side_rc  # type: ignore[attr-defined]
    return out


def refusal(st: Stack, rc: RunConfig) -> str | None:
    """Why ``st``'s blocks cannot be handed from a prefill replica to a decode replica
    (None: they can)."""
    name = st.backend.name
    if not st.prefix_caching:
        return (f"backend {name} runs without prefix caching here, and a request's blocks "
                "reach the decode side as its prefix cache's (harness.cluster.handoff)"
                + ("" if rc.cache.enable_prefix_caching else
                   ": set cache.enable_prefix_caching=true"))
    if movable_manager(st.kv) is None:
        return (f"backend {name} keeps its blocks under a window or eviction policy, or in "
                "KV cache groups, which a handoff of whole named blocks does not carry")
    if rc.executor == "model" and not st.backend.block_tensors_supported():
        return f"backend {name} cannot move whole blocks (no block_tensors)"
    if rc.cache.admission != "always":
        return (f"cache.admission={rc.cache.admission} may not cache a finished prefill's "
                "blocks, which the prefill side holds until they are moved: use "
                "cache.admission=always")
    return None


def build_pools(target: RunTarget, rc: RunConfig, workload: Any
                ) -> tuple[list[RunTarget], list[Stack]]:
    """The prefill pool's stacks, then the decode pool's (each replica its own
    cache.kv_budget on its pool's hardware), and the target each was built by; refused
    when the backend's blocks cannot be handed over."""
    targets: list[RunTarget] = []
    stacks: list[Stack] = []
    for side in SIDES:
        t = pool_target(target, rc, side)
        n = rc.cluster.pool_replicas(side)
        for i in range(n):
            try:
                st = t.build(workload, quiet=bool(stacks))
            except UserError as e:
                raise UserError(f"{side} replica {i} of cluster.{side}_replicas={n}: {e}") \
                    from None
            if (why := refusal(st, rc)) is not None:
                raise UserError(f"cluster.mode=disaggregated: {why}. Backends whose blocks "
                                "move: paged, fp8, int8, quest, kivi (with prefix caching)")
            targets.append(t)
            stacks.append(st)
    return targets, stacks
