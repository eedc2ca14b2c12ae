"""A step's row of steps.csv (harness.metrics.collector makes them; StepLog keeps them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepRow:
    step: int
    time_s: float  # since the run started
    step_ms: float
    forward_ms: float
    overhead_ms: float  # step_ms - forward_ms: scheduling, batching, sampling, bookkeeping
    batch_tokens: int
    prefill_tokens: int
    decode_tokens: int
    num_seqs: int
    running: int
    waiting: int
    swapped: int
    reserved_bytes: int  # held while the step's forward ran (after scheduling)
    used_bytes: int
    free_blocks: int
    cached_free_blocks: int
    shared_blocks: int
    logical_blocks: int
    held_blocks: int
    external_frag_bytes: int
    preempted: int
    finished: int
    # What the step's attention read, as the backend declares it (harness.backends.costs):
    # the decodes' cached tokens and bytes (K/V, scales, metadata), the prefill pairs.
    kv_read_tokens: int = 0
    kv_read_bytes: int = 0
    prefill_pairs: int = 0
    # Blocks held in the prefix cache's lower tiers while the step ran (0 without tiers).
    cpu_tier_blocks: int = 0
    disk_tier_blocks: int = 0
    tier_ops: int = 0  # blocks the step moved between tiers (stores, spills, loads)
    # KV cache groups: blocks each group's tables held, "|"-separated ("" without groups).
    group_blocks: str = ""
