"""A hybrid-attention model's KV cache groups in the run's record (harness.kv.groups), the
same keys under both executors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from harness.backends.base import CacheSizing
from harness.kv.base import KVManager
from harness.kv.groups import GroupedKVManager
from harness.metrics.collector import StepRow
from harness.metrics.summary import waste_split


def group_peaks(steps: Sequence[StepRow]) -> list[int]:
    """Most blocks each KV cache group held at a step (steps.csv's ``group_blocks``)."""
    peaks: list[int] = []
    for s in steps:
        for i, n in enumerate(int(x) for x in s.group_blocks.split("|") if x):
            if i == len(peaks):
                peaks.append(0)
            peaks[i] = max(peaks[i], n)
    return peaks


def group_metrics(kv: KVManager, sizing: CacheSizing, steps: Sequence[StepRow]) -> dict[str, Any]:
    """``memory.kv_group_slots`` (the pool's slots: one group's tokens each, a page being
    group_size layers), ``memory.token_capacity`` (tokens every group can hold at once),
    and per group ``memory.kv_group.<i>.peak_held_bytes`` and its waste split. Empty
    without groups."""
    if not isinstance(kv, GroupedKVManager):
        return {}
    out: dict[str, Any] = {"memory.kv_group_slots": sizing.num_slots,
                           "memory.token_capacity": sizing.num_slots // len(kv.plan)}
    for i, peak in enumerate(group_peaks(steps)):
        out[f"memory.kv_group.{i}.peak_held_bytes"] = peak * sizing.block_bytes
    for i, t in sorted(kv.ledger.by_tag.items()):  # the waste split per group
        if t.reserved:  # (a group has no external fragmentation: paged)
            split = waste_split(t)
            for k in ("waste_pct", "reservation_pct", "internal_frag_pct"):
                out[f"memory.kv_group.{i}.{k}"] = split[k]
    return out
