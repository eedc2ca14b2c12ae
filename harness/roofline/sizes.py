"""The batch sizes of the engine a what-if models (issue #54): ``scheduler.max_num_seqs``,
``max_num_batched_tokens`` and ``max_model_len`` left unset under ``executor=roofline``.

- ``max_num_seqs`` and ``max_num_batched_tokens``: the engine profile's
  (harness.roofline.engines, ``roofline.engine``), its rules resolved as
  harness.roofline_tools.validate resolves them for a published point:
  ``"max(max_model_len, 2048)"`` (vLLM V0), ``"trtllm-bench"`` (the limits trtllm-bench
  derives from the dataset, harness.roofline.trtllm_bench, from the workload's initial
  requests), ``"vllm-v1"`` (vLLM's defaults for the API server, or offline ``LLM`` with
  ``roofline.served=false``, by card) and ``"sglang"`` (its chunk size by the card's
  memory, its running cap by the pool); the ``kvbench`` profile has none: kvbench's own
  (harness.config's ``SCHEDULER_SIZES``, 32 and 1024). Changing a profile's rule changes
  every what-if's default sizes for that engine (docs/whatif.md says which);
- ``max_model_len``: what a serving engine allows by default, the model's context
  (``max_position_embeddings``), capped at what one sequence can hold in the KV budget
  (the pool's token slots for this backend), as vLLM refuses a longer one.

A size the user gives is kept. The scheduler's mixing, chunked prefill and admission stay
kvbench's defaults (so the decode lanes stay on); only the sizes follow the engine. The run
records the values used (``run.max_num_seqs`` ... and ``run.scheduler_sizes``, where each came
from) and writes them into config.yaml.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from harness.backends.base import KVBackend
from harness.errors import UserError
from harness.roofline.arch import ArchSpec
from harness.roofline.config import WEIGHT_BYTES, RooflineConfig
from harness.roofline.engines import (
    SGLANG,
    VLLM_V1,
    EngineProfile,
    sglang_sizes,
    vllm_v1_sizes,
)
from harness.roofline.hardware import HardwareSpec
from harness.roofline.trtllm_bench import batch_limits
from harness.sched.scheduler import SchedulerConfig
from harness.sched.spec import SCHEDULER_SIZES, SchedulerSpec, scheduler_unset
from harness.sizing import size_cache
from harness.workloads.base import RequestShape

V0_BUDGET = "max(max_model_len, 2048)"  # vLLM V0 without chunked prefill
TRTLLM_BENCH = "trtllm-bench"


@dataclass(frozen=True)
class Sizes:
    """The scheduler a what-if runs with, and where each size came from (``given``, the
    engine's name, ``kvbench``, or ``context`` / ``kv budget`` for max_model_len)."""

    sched: SchedulerConfig
    source: dict[str, str]

    def label(self) -> str:
        """``run.scheduler_sizes``: e.g. ``max_num_seqs=256 (vllm-0.6), ...``."""
        return ", ".join(f"{k}={getattr(self.sched, k)} ({self.source[k]})"
                         for k in SCHEDULER_SIZES)


def model_len(arch: ArchSpec, backend: KVBackend, kv_budget: str | int) -> tuple[int, str]:
    """``max_model_len`` unset: the model's context, or one sequence's room in the budget
    when that is smaller (at least 2, the scheduler's floor), and which it was."""
    slots = size_cache(backend, kv_budget, 0).num_slots
    if arch.max_position_embeddings <= slots:
        return arch.max_position_embeddings, "context"
    return max(2, slots), "kv budget"


def _mean(values: Iterable[int]) -> float:
    total = n = 0
    for v in values:
        total += v
        n += 1
    return total / n if n else 0.0


def trtllm_limits(arch: ArchSpec, hw: HardwareSpec, r: RooflineConfig, backend: KVBackend,
                  shapes: Iterable[RequestShape], chunked_prefill: bool) -> tuple[int, int]:
    """trtllm-bench's ``(max_batch_size, max_num_tokens)`` for this run's initial requests
    (mean prompt and max_tokens as ISL / OSL, the longest prompt), as validate.py derives
    them for a published point."""
    prompts: list[int] = []
    outputs: list[int] = []
    for prompt, max_tokens, _n in shapes:
        prompts.append(prompt)
        outputs.append(max_tokens)
    if not prompts:
        raise UserError("roofline.engine=trtllm derives scheduler.max_num_seqs and "
                        "max_num_batched_tokens from the workload's requests, and it has "
                        "none at the start: set both")
    isl, osl = _mean(prompts), _mean(outputs)
    kv_bytes = backend.bytes_per_slot() / (2 * arch.num_layers * arch.num_kv_heads
                                           * arch.head_dim)
    try:
        return batch_limits(arch, hw.mem_bytes, r.tp, WEIGHT_BYTES[r.weight_dtype], kv_bytes,
                            max(1, round(isl)), max(1, round(osl)), max(prompts),
                            r.gpu_memory_utilization, chunked_prefill)
    except ValueError as e:
        raise UserError(f"roofline.engine=trtllm: {e}; set scheduler.max_num_seqs and "
                        "scheduler.max_num_batched_tokens") from None


def engine_size(value: int | str, key: str, max_model_len: int,
                trtllm: tuple[int, int] | None,
                pair: dict[str, tuple[int, int]] | None = None) -> int:
    """One profile value: a number, or a rule resolved (:data:`V0_BUDGET`,
    :data:`TRTLLM_BENCH` with ``trtllm`` = its limits, :data:`VLLM_V1` / :data:`SGLANG`
    with ``pair[rule]`` = its (max_num_batched_tokens, max_num_seqs))."""
    if isinstance(value, int):
        return value
    if value == V0_BUDGET:
        return max(max_model_len, 2048)
    if value == TRTLLM_BENCH and trtllm is not None:
        return trtllm[0] if key == "max_num_seqs" else trtllm[1]
    if pair is not None and value in pair:
        return pair[value][1] if key == "max_num_seqs" else pair[value][0]
    raise ValueError(f"unknown engine profile rule {key}={value!r}")


def rule_pairs(hardware: str, mem_bytes: int, served: bool, pool_tokens: int,
               max_model_len: int) -> dict[str, tuple[int, int]]:
    """The (max_num_batched_tokens, max_num_seqs) the ``vllm-v1`` and ``sglang`` rules
    give on this card, front end, pool and max_model_len."""
    return {VLLM_V1: vllm_v1_sizes(hardware, mem_bytes, served),
            SGLANG: sglang_sizes(mem_bytes, pool_tokens, max_model_len)}


def resolve_sizes(sched: SchedulerConfig, profile: EngineProfile | None, engine: str,
                  arch: ArchSpec, hw: HardwareSpec, r: RooflineConfig, backend: KVBackend,
                  kv_budget: str | int,
                  shapes: Callable[[], Iterable[RequestShape]] | None = None) -> Sizes:
    """``sched`` with its unset sizes taken from the engine ``profile`` (None: kvbench's;
    ``engine``: its name for the record), the module docstring's rules. ``shapes``: gives
    the workload's initial requests' shapes, called only for a ``trtllm-bench`` rule."""
    unset = scheduler_unset(sched)
    source = {k: "given" for k in SCHEDULER_SIZES if k not in unset}
    values: dict[str, int] = {}
    if "max_model_len" in unset:
        values["max_model_len"], source["max_model_len"] = model_len(arch, backend, kv_budget)
    mml = values.get("max_model_len", sched.max_model_len)
    given = profile.scheduler if profile is not None else {}
    rules = {k: given[k] for k in ("max_num_seqs", "max_num_batched_tokens")
             if k in unset and k in given}
    trtllm = trtllm_limits(arch, hw, r, backend, shapes() if shapes else (),
                           sched.chunked_prefill) \
        if TRTLLM_BENCH in rules.values() else None
    pair = rule_pairs(hw.name, hw.mem_bytes, r.served,
                      size_cache(backend, kv_budget, 0).num_slots, mml) \
        if {VLLM_V1, SGLANG} & set(rules.values()) else None
    for k in ("max_num_seqs", "max_num_batched_tokens"):
        if k not in unset:
            continue
        if k in rules:
            values[k], source[k] = engine_size(rules[k], k, mml, trtllm, pair), engine
        else:
            values[k], source[k] = SCHEDULER_SIZES[k], "kvbench"
    resolved = sched.resolved(**values) if isinstance(sched, SchedulerSpec) else sched
    return Sizes(resolved, source)
