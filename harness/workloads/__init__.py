"""Workloads, registered by hand: name -> (config dataclass, workload class)."""

from __future__ import annotations

import dataclasses
from typing import Any

from harness.model.tokenizer import Tokenizer
from harness.workloads.base import Request, Workload
from harness.workloads.long_prompt import LongPromptConfig, LongPromptWorkload
from harness.workloads.multiturn import MultiturnConfig, MultiturnWorkload
from harness.workloads.random_lengths import RandomConfig, RandomWorkload
from harness.workloads.sampling import (
    BeamSearchWorkload,
    ParallelSamplingWorkload,
    SamplingWorkloadConfig,
)
from harness.workloads.shared_prefix import SharedPrefixConfig, SharedPrefixWorkload

WORKLOADS: dict[str, tuple[type, type]] = {
    "multiturn": (MultiturnConfig, MultiturnWorkload),
    "shared_prefix": (SharedPrefixConfig, SharedPrefixWorkload),
    "beam_search": (SamplingWorkloadConfig, BeamSearchWorkload),
    "parallel_sampling": (SamplingWorkloadConfig, ParallelSamplingWorkload),
    "long_prompt": (LongPromptConfig, LongPromptWorkload),
    "random": (RandomConfig, RandomWorkload),
}


def make_workload(cfg: dict[str, Any], tok: Tokenizer) -> Workload:
    """Build the workload named ``cfg["name"]`` from the rest of ``cfg``."""
    name = cfg.get("name", "")
    if name not in WORKLOADS:
        raise ValueError(f"workload {name!r} is not registered; known: {', '.join(WORKLOADS)}")
    config_cls, workload_cls = WORKLOADS[name]
    fields = {f.name for f in dataclasses.fields(config_cls)}
    workload: Workload = workload_cls(
        config_cls(**{k: v for k, v in cfg.items() if k in fields}), tok)
    return workload


__all__ = ["WORKLOADS", "Request", "Workload", "make_workload"]
