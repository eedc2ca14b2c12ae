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

How each engine schedules (``scheduler``, what a published point runs with; a user's
what-if takes its sizes and, with ``roofline.engine_scheduling=true``, the rest):

- **vllm-0.6** (V0): prompt-only steps, whole prompts (chunked prefill off below 32k
  context), watermark admission, recompute preemption, no prefix caching by default;
- **vllm-v1** (0.8+): chunked prefill mixed into every step (decodes first, prefill chunks
  in the budget left), admission by the prompt alone, recompute preemption, prefix caching
  on by default (so a preempted request's computed blocks are found again on
  readmission, unless evicted meanwhile); its batch sizes are vLLM's defaults by usage
  context and card (:data:`VLLM_V1_SIZES`);
- **sglang** (0.4-0.5): prefill batches of their own (``mixing=prefill_first`` with
  chunked prefill: the decodes wait), admission by reserved output tokens
  (``admission=reserve``, harness.sched.admission), the radix cache on, the CPU's
  scheduling overlapped with the GPU (its "zero-overhead" scheduler, on by default since
  0.4), TensorRT-LLM-derived all-reduce kernels, chunk size and running-request cap as
  its server_args derive them (:func:`sglang_sizes`);
- **trtllm**: GUARANTEED_NO_EVICT admission, whole prompts, its own all-reduce kernels.

``served``: a served engine's front end (HTTP, chat template, tokenization; the first
token's detokenization and send) adds ``request_s + prompt_token_s x prompt tokens`` to
each request's TTFT and end-to-end latency (``roofline.served``: benchmark clients over an
HTTP server; ``false`` for offline benchmarks: trtllm-bench, ``LLM.generate``). It runs in a
process of its own beside the engine (vLLM's API server, SGLang's tokenizer manager), so
it delays each request, not the engine's steps. That process is also a queue
(``api_request_s`` a request's input, ``api_token_s`` a streamed token's output, one at a
time: harness.metrics.api_server, ``roofline.api_server``): under 1,000 requests sent at
once it, not the GPU, can set the pace; the light-load delay above is then what its
service does not already account for. ``--fit`` fits its seconds to served bursts of
sources marked ``fit_api``; none is (they are the host's more than the engine's:
docs/results/2026-12-05-whatif-api-server.md), so they are 0 unless a run sets
``roofline.api_request_s`` / ``api_token_s``.

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
    # Its own all-reduce kernels (harness.roofline.allreduce: "vllm-custom",
    # "trtllm-custom"), or "nccl".
    allreduce: str = "nccl"
    overlap_cpu: bool = False  # CPU time overlapped with the forward (async scheduling)
    prefix_caching: bool = False  # on by default in the engine
    # A served request's front-end seconds (fitted to served points' TTFT at low load).
    request_s: float = 0.0
    prompt_token_s: float = 0.0
    # Its API server as a serial stage (harness.metrics.api_server; fitted to served
    # bursts): seconds of one process per request's input and per streamed token.
    api_request_s: float = 0.0
    api_token_s: float = 0.0
    scheduler: dict[str, Any] = field(default_factory=dict)
    memory_utilization: float = 0.9  # the share of GPU memory its published runs used
    memory_utilization_of: str = "total"  # of the device's memory, or "free" (after weights)
    calibrated: bool = False
    fitted_to: tuple[str, ...] = ()  # fit.yaml sources
    note: str = ""

    def frontend_s(self, prompt_tokens: int) -> float:
        """A served request's front-end seconds: ``request_s + prompt_token_s x
        prompt_tokens`` (0 for an offline run: the caller decides whether it is served)."""
        return self.request_s + self.prompt_token_s * prompt_tokens

    @property
    def has_frontend(self) -> bool:
        """Whether a served request pays a front end at all (fitted, or set)."""
        return bool(self.request_s or self.prompt_token_s)


VLLM_V1 = "vllm-v1"  # a size rule: vLLM's defaults by usage context and card
SGLANG = "sglang"  # a size rule: SGLang's server_args by memory and pool

# vLLM (>= 0.9; vllm/engine/arg_utils.py ``get_batch_defaults``): (max_num_batched_tokens,
# max_num_seqs) for the API server and for offline ``LLM``, on a card of >= 70 GiB that is
# not an A100, and on the others. vLLM 0.8.x used the second pair everywhere (a source of
# that version states its sizes).
VLLM_V1_SIZES = {"large": {"served": (8192, 1024), "offline": (16384, 1024)},
                 "other": {"served": (2048, 256), "offline": (8192, 256)}}


def vllm_v1_sizes(hardware: str, mem_bytes: int, served: bool) -> tuple[int, int]:
    """vLLM V1's default ``(max_num_batched_tokens, max_num_seqs)`` on this card."""
    large = mem_bytes >= 70 * 2**30 and not hardware.startswith("a100")
    return VLLM_V1_SIZES["large" if large else "other"]["served" if served else "offline"]


def sglang_sizes(mem_bytes: int, pool_tokens: int, context_len: int) -> tuple[int, int]:
    """SGLang's ``(chunked_prefill_size, max_running_requests)`` as its server_args derive
    them (python/sglang/srt/server_args.py, 0.4-0.5): the chunk by the card's memory (2048
    below 35 GB, 4096 below 60 GB, 8192 above; 16384 from 160 GB), and the running cap
    ``min(max(pool_tokens / context_len x 512, 2048), 4096)`` (model_runner.py)."""
    gb = mem_bytes / 1e9
    chunk = 2048 if gb < 35 else 4096 if gb < 60 else 8192 if gb < 160 else 16384
    running = min(max(int(pool_tokens / max(1, context_len) * 512), 2048), 4096)
    return chunk, running


# Priors; where fit_result.json (`python -m harness.roofline_tools.validate --fit`) has an
# engine's fit, its constants replace these below (_with_fit) and the profile is calibrated.
PRIORS: dict[str, EngineProfile] = {p.name: p for p in (
    EngineProfile(
        "vllm-0.6", "vLLM 0.6.x (V0 engine)", schedule_s=2e-3, schedule_per_seq_s=60e-6,
        step_s=1e-3, step_per_seq_s=5e-6, allreduce="vllm-custom",
        scheduler={"mixing": "prefill_first", "chunked_prefill": False,
                   "admission": "watermark", "max_num_seqs": 256,
                   "max_num_batched_tokens": "max(max_model_len, 2048)"},
        note="V0 without chunked prefill (its default below 32k context): prompt-only "
             "steps first; --num-scheduler-steps as scheduler.num_scheduler_steps"),
    EngineProfile(
        "vllm-v1", "vLLM V1 engine (0.8+)", schedule_s=1e-3, schedule_per_seq_s=10e-6,
        step_s=1e-3, step_per_seq_s=5e-6, allreduce="vllm-custom", prefix_caching=True,
        scheduler={"mixing": "mixed", "chunked_prefill": True, "admission": "watermark",
                   "max_num_seqs": VLLM_V1, "max_num_batched_tokens": VLLM_V1},
        note="prior until fitted to its own points"),
    EngineProfile(
        "sglang", "SGLang 0.4-0.5", schedule_s=1e-3, schedule_per_seq_s=10e-6,
        step_s=1e-3, step_per_seq_s=5e-6, allreduce="trtllm-custom", overlap_cpu=True,
        prefix_caching=True,
        scheduler={"mixing": "prefill_first", "chunked_prefill": True, "admission": "reserve",
                   "max_num_seqs": SGLANG, "max_num_batched_tokens": SGLANG},
        note="prior until fitted to its own points"),
    EngineProfile(
        "trtllm", "TensorRT-LLM (inflight batching)", step_s=1e-3, step_per_seq_s=5e-6,
        allreduce="trtllm-custom",
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
# What `--fit` fits (harness.roofline_tools.validate): the CPU time's four terms (of an
# engine that overlaps it with the forward, its two per-sequence terms) and the
# all-reduce latency (fitted only for an engine with points at tp > 1).
CONSTANTS = ("schedule_s", "schedule_per_seq_s", "step_s", "step_per_seq_s",
             "allreduce_latency_s")
SERVED = ("request_s", "prompt_token_s",  # fitted to served points' TTFT, apart
          "api_request_s", "api_token_s")  # ... and to served bursts


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
                                      for k in (*CONSTANTS, *SERVED) if k in f}
            out[name] = dataclasses.replace(out[name], calibrated=True,
                                            fitted_to=tuple(f["sources"]), **consts)
    return out


PROFILES: dict[str, EngineProfile] = _with_fit(PRIORS, FIT_RESULT)


def reload_fit() -> None:
    """Read fit_result.json again (``--fit`` wrote it): :data:`PROFILES` in place, so
    every holder of it sees the new constants."""
    PROFILES.clear()
    PROFILES.update(_with_fit(PRIORS, FIT_RESULT))


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
