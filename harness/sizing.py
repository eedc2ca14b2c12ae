"""From a KV budget in bytes to token slots and blocks: the same bytes for every backend."""

from __future__ import annotations

from harness.backends.base import CacheSizing, KVBackend
from harness.units import parse_bytes


def size_cache(backend: KVBackend, kv_budget: str | int, swap_space: str | int) -> CacheSizing:
    """Token capacity = budget // bytes per token; paged backends round down to blocks."""
    if parse_bytes(kv_budget) <= 0:
        raise ValueError(f"cache.kv_budget must be positive, got {kv_budget!r}")
    budget = parse_bytes(kv_budget)
    bps = backend.bytes_per_slot()
    bs = backend.costs().block_size  # the storage granule (1: contiguous ranges)
    # May be 0: the runner then reports the budget the workload needs (harness.runner).
    # What a backend holds outside its slots (kivi's full-precision residual) comes first.
    num_blocks = max(0, budget - backend.reserved_bytes()) // (bps * bs)
    num_cpu_blocks = parse_bytes(swap_space) // (bps * bs)
    return CacheSizing(kv_budget_bytes=budget, bytes_per_slot=bps,
                       num_slots=num_blocks * bs, block_size=bs, num_blocks=num_blocks,
                       num_cpu_blocks=num_cpu_blocks)


def min_budget_for(backend: KVBackend, sizing: CacheSizing, slots_needed: int,
                   watermark: float) -> int:
    """Smallest budget (bytes) whose pool holds ``slots_needed`` plus the watermark."""
    bs = sizing.block_size
    blocks = -(-slots_needed // bs)
    blocks = int(blocks / (1 - watermark)) + 1 if watermark else blocks
    return blocks * bs * sizing.bytes_per_slot + backend.reserved_bytes()
