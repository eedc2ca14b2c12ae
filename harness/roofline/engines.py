"""Engine profiles (``roofline.engine``): the serving software's share of a step, apart
from the hardware's.

A profile is the engine's CPU time per step, as a few constants (harness.roofline.
steptime's ``engine`` term): ``schedule_s + schedule_per_seq_s x seqs`` on each step
scheduled anew (multi-step scheduling makes the others not fresh) and ``step_s +
step_per_seq_s x seqs`` on every step (launch, sampling, output processing); its
all-reduce kernels' small-message latency (``allreduce_latency_s``); plus the
``scheduler.*`` settings that mirror how that engine batches (``scheduler``: what
``python -m harness.roofline_tools.validate`` runs each published point with).

A user's what-if takes the profile's batch sizes where it sets none: ``max_num_seqs`` and
``max_num_batched_tokens`` from ``scheduler`` (its rules resolved: ``"max(max_model_len,
2048)"``, ``"trtllm-bench"`` from the workload), ``max_model_len`` the model's context or
what one sequence can hold in the KV budget (harness.roofline.sizes; recorded as
``run.max_num_seqs`` ... and ``run.scheduler_sizes``). Its mixing, chunked prefill and
admission are taken only as given on the command line (kvbench's defaults keep the fast
path on); see docs/whatif.md.

A profile is ``calibrated`` only when fitted to published points of its own engine
(harness/roofline/published/fit.yaml, by ``python -m harness.roofline_tools.validate --fit``);
otherwise it is a prior: labelled so in every record, outside the accuracy claim.
``kvbench`` is this engine itself: the hardware spec's own overheads (the ``cpu`` spec's
are measured here).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import UserError


@dataclass(frozen=True)
class EngineProfile:
    name: str
    engine: str  # the software and version it stands for
    schedule_s: float = 0.0  # CPU seconds per scheduling decision
    schedule_per_seq_s: float = 0.0  # ... per running sequence
    step_s: float = 0.0  # CPU seconds on every step
    step_per_seq_s: float = 0.0  # ... per running sequence
    # One small all-reduce's seconds with the engine's own kernels (None: the hardware
    # spec's NCCL latency, harness.roofline.steptime).
    allreduce_latency_s: float | None = None
    scheduler: dict[str, Any] = field(default_factory=dict)
    memory_utilization: float = 0.9  # the share of GPU memory its published runs used
    memory_utilization_of: str = "total"  # of the device's memory, or "free" (after weights)
    calibrated: bool = False
    fitted_to: tuple[str, ...] = ()  # fit.yaml sources
    note: str = ""


# Priors; where fit_result.json (`python -m harness.roofline_tools.validate --fit`) has an
# engine's fit, its constants replace these below (_with_fit) and the profile is calibrated.
PROFILES: dict[str, EngineProfile] = {p.name: p for p in (
    EngineProfile(
        "vllm-0.6", "vLLM 0.6.x (V0 engine)", schedule_s=2e-3, schedule_per_seq_s=60e-6,
        step_s=1e-3, step_per_seq_s=5e-6,
        scheduler={"mixing": "prefill_first", "chunked_prefill": False,
                   "admission": "watermark", "max_num_seqs": 256,
                   "max_num_batched_tokens": "max(max_model_len, 2048)"},
        note="V0 without chunked prefill (its default below 32k context): prompt-only "
             "steps first; --num-scheduler-steps as scheduler.num_scheduler_steps"),
    EngineProfile(
        "vllm-v1", "vLLM V1 engine (0.8+)", schedule_s=1e-3, schedule_per_seq_s=10e-6,
        step_s=1e-3, step_per_seq_s=5e-6,
        scheduler={"mixing": "mixed", "chunked_prefill": True, "admission": "watermark",
                   "max_num_seqs": 256, "max_num_batched_tokens": 8192},
        note="prior: no published V1 points in fit.yaml"),
    EngineProfile(
        "sglang", "SGLang 0.3-0.4", schedule_s=1e-3, schedule_per_seq_s=10e-6,
        step_s=1e-3, step_per_seq_s=5e-6,
        scheduler={"mixing": "mixed", "chunked_prefill": True, "admission": "watermark",
                   "max_num_seqs": 2048, "max_num_batched_tokens": 8192},
        note="prior: no published SGLang points in fit.yaml"),
    EngineProfile(
        "trtllm", "TensorRT-LLM (inflight batching)", step_s=1e-3, step_per_seq_s=5e-6,
        scheduler={"mixing": "mixed", "chunked_prefill": False, "admission": "no_evict",
                   "max_num_seqs": "trtllm-bench", "max_num_batched_tokens": "trtllm-bench"},
        memory_utilization=0.95, memory_utilization_of="free",
        note="GUARANTEED_NO_EVICT admission, context requests whole (chunked context off), "
             "max_batch_size / max_num_tokens as trtllm-bench derives them from the "
             "dataset (harness.roofline.trtllm_bench); "
             "kv_cache_free_gpu_mem_fraction 0.95 as its perf docs use (a fraction of "
             "the memory free after the weights, not of the device's)"),
    EngineProfile("kvbench", "this engine (the hardware spec's own overheads)",
                  calibrated=True, note="the cpu spec's overheads are measured here"),
)}


FIT_RESULT = Path(__file__).resolve().parent / "published" / "fit_result.json"
# What `--fit` fits (harness.roofline_tools.validate): the CPU time's four terms and the
# all-reduce latency (fitted only for an engine with points at tp > 1).
CONSTANTS = ("schedule_s", "schedule_per_seq_s", "step_s", "step_per_seq_s",
             "allreduce_latency_s")


def _with_fit(profiles: dict[str, EngineProfile], path: Path) -> dict[str, EngineProfile]:
    """The profiles with the constants ``python -m harness.roofline_tools.validate --fit``
    fitted to their engines' published points: those become calibrated."""
    if not path.is_file():
        return profiles
    fitted = json.loads(path.read_text()).get("engines", {})
    out = dict(profiles)
    for name, f in fitted.items():
        if name in out:
            consts: dict[str, Any] = {k: None if f[k] is None else float(f[k])
                                      for k in CONSTANTS if k in f}
            out[name] = dataclasses.replace(out[name], calibrated=True,
                                            fitted_to=tuple(f["sources"]), **consts)
    return out


PROFILES = _with_fit(PROFILES, FIT_RESULT)


def engine_name(name: str, hardware: str) -> str:
    """The profile name ``roofline.engine=<name>`` resolves to (``auto``: kvbench on the
    cpu spec, else vllm-0.6, the calibrated default)."""
    key = name.lower()
    if key == "auto":
        return "kvbench" if hardware.lower() == "cpu" else "vllm-0.6"
    if key not in PROFILES:
        raise UserError(f"unknown roofline.engine {name!r}: use one of auto, "
                        f"{', '.join(PROFILES)}")
    return key


def get_engine(name: str, hardware: str) -> EngineProfile | None:
    """The profile ``roofline.engine`` names; None for ``kvbench`` (the spec's overheads)."""
    key = engine_name(name, hardware)
    return None if key == "kvbench" else PROFILES[key]
