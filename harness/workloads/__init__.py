"""Workloads, registered by hand: name -> (config dataclass, workload class)."""

from __future__ import annotations

import dataclasses
from typing import Any

from harness.errors import UserError
from harness.model.tokenizer import Tokenizer
from harness.workloads.base import Request, Workload, WorkloadOptions
from harness.workloads.long_prompt import LongPromptConfig, LongPromptWorkload
from harness.workloads.multiturn import MultiturnConfig, MultiturnWorkload
from harness.workloads.random_lengths import RandomConfig, RandomWorkload
from harness.workloads.ruler import RulerConfig, RulerWorkload
from harness.workloads.sampling import (
    BeamSearchWorkload,
    ParallelSamplingWorkload,
    SamplingWorkloadConfig,
)
from harness.workloads.shared_context import SharedContextConfig, SharedContextWorkload
from harness.workloads.shared_prefix import SharedPrefixConfig, SharedPrefixWorkload
from harness.workloads.trace import TraceConfig, TraceWorkload

WORKLOADS: dict[str, tuple[type, type]] = {
    "multiturn": (MultiturnConfig, MultiturnWorkload),
    "shared_prefix": (SharedPrefixConfig, SharedPrefixWorkload),
    "beam_search": (SamplingWorkloadConfig, BeamSearchWorkload),
    "parallel_sampling": (SamplingWorkloadConfig, ParallelSamplingWorkload),
    "long_prompt": (LongPromptConfig, LongPromptWorkload),
    "random": (RandomConfig, RandomWorkload),
    "trace": (TraceConfig, TraceWorkload),
    "ruler": (RulerConfig, RulerWorkload),
    "shared_context": (SharedContextConfig, SharedContextWorkload),
}


def workload_options(name: str, values: dict[str, Any] | None = None) -> WorkloadOptions:
    """The typed options of workload ``name`` (defaults, overridden by ``values``)."""
    if name not in WORKLOADS:
        raise UserError(f"workload {name!r} is not registered; known: {', '.join(WORKLOADS)}")
    config_cls = WORKLOADS[name][0]
    values = {k: v for k, v in (values or {}).items() if k != "name"}
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UserError(f"workload {name!r} has no option(s) {', '.join(unknown)}")
    opts: WorkloadOptions = config_cls(name=name, **values)
    return opts


def make_workload(cfg: WorkloadOptions | dict[str, Any], tok: Tokenizer) -> Workload:
    """Build the workload that ``cfg`` (its typed options, or a dict with a name) names."""
    if isinstance(cfg, dict):
        cfg = workload_options(str(cfg.get("name", "")), cfg)
    if cfg.seed is None:  # not resolved against a run's seed (run_config does): seed 0
        cfg = dataclasses.replace(cfg, seed=0)
    if cfg.name not in WORKLOADS:
        raise UserError(f"workload {cfg.name!r} is not registered; known: "
                        f"{', '.join(WORKLOADS)}")
    workload: Workload = WORKLOADS[cfg.name][1](cfg, tok)
    return workload


__all__ = ["WORKLOADS", "Request", "Workload", "WorkloadOptions", "make_workload",
           "workload_options"]
