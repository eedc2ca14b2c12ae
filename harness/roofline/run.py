"""``executor=roofline``: one run of the real engine, scheduler, KV manager and backend
sizing, with each step's time modelled (harness.roofline.steptime) on a virtual clock.

No weights are loaded and no K/V tensors exist. Prompts come from the workload through
the byte tokenizer (so a text workload's lengths are UTF-8 bytes; trace and random
workloads give token counts directly); outputs are synthetic ids that never hit EOS, so a
request ends at its drawn length or max_tokens. Quality metrics are absent: nothing is
computed to score (``run.quality`` says so). The run itself is harness.runner.run's, as
for the model: :class:`RooflineTarget` is this executor's part of it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from harness import layer_types
from harness.backends.base import KVBackend, KVLayout
from harness.engine.sampler import Sampler
from harness.errors import UserError
from harness.metrics.api_server import ApiServer
from harness.metrics.groups import group_metrics
from harness.metrics.requestlog import RequestLog
from harness.model import ByteTokenizer, parse_dtype
from harness.model.tokenizer import Tokenizer
from harness.roofline.arch import ArchSpec
from harness.roofline.bands import describe
from harness.roofline.config import COMPUTE, WEIGHT_BYTES, RooflineConfig, auto_kv_budget
from harness.roofline.engines import PROFILES, EngineProfile, engine_name, get_engine
from harness.roofline.executor import (
    SYNTHETIC_IDS,
    RooflineExecutor,
    TierLinks,
    synthetic_tokens,
)
from harness.roofline.fastpath.scheduler import LaneChoice
from harness.roofline.hardware import HardwareSpec, get_hardware
from harness.roofline.models import get_model_spec
from harness.roofline.profile import kv_dtype_of
from harness.roofline.sizes import model_len, resolve_sizes
from harness.roofline.steptime import StepModel
from harness.sched.scheduler import SchedulerConfig
from harness.sched.spec import scheduler_unset
from harness.stack import Stack, assemble_stack, kv_plan, kv_plan_label, make_backend
from harness.target import ExecutorRecord
from harness.workloads.base import Workload, request_shapes

if TYPE_CHECKING:
    from harness.config import RunConfig

QUALITY_ABSENT = "absent: executor=roofline computes no logits to score"


def _sized_backend(rc: RunConfig, arch: ArchSpec) -> tuple[HardwareSpec, KVBackend, str | int]:
    """The hardware spec, the backend (built for its sizing only: no tensors) and the KV
    budget of ``rc`` on ``arch``."""
    r = rc.roofline
    hw = get_hardware(r.hardware)
    if r.attention != "spec":
        hw = dataclasses.replace(hw, attention=r.attention)
    layout = KVLayout(arch.num_layers, arch.num_kv_heads, arch.head_dim, parse_dtype(r.dtype))
    backend = make_backend(rc.backend, layout, torch.device("cpu"))
    budget = auto_kv_budget(arch, hw, r) if rc.cache.kv_budget == "auto" else \
        rc.cache.kv_budget
    return hw, backend, budget


def build_roofline(rc: RunConfig, workload: Workload, quiet: bool = False,
                   arch: ArchSpec | None = None,
                   len_source: str | None = None) -> tuple[Stack, RooflineExecutor]:
    """The stack of ``rc`` with a :class:`RooflineExecutor` in place of the model
    (``arch``: ``roofline.model``'s spec, when the caller has read it already). The
    scheduler's unset sizes take the modelled engine's (harness.roofline.sizes;
    ``len_source``: where max_model_len came from, when the target resolved it early)."""
    r = rc.roofline
    arch = arch if arch is not None else get_model_spec(r.model)
    hw, backend, budget = _sized_backend(rc, arch)
    device = torch.device("cpu")
    layers = arch.layer_attention
    plan = kv_plan(arch.name, layers, backend, rc.cache.kv_groups) \
        if layers and not layer_types.own_window(layers, rc.backend) else None
    profile = get_engine(r.engine, r.hardware)
    sizes = resolve_sizes(rc.scheduler, profile, engine_name(r.engine, r.hardware), arch, hw,
                          r, backend, budget, lambda: request_shapes(workload))
    if len_source is not None:
        sizes.source["max_model_len"] = len_source
    sched = engine_scheduling(sizes.sched, profile, r.engine) if r.engine_scheduling \
        else sizes.sched
    step = StepModel(arch, hw, backend.bytes_per_slot(), COMPUTE[r.dtype],
                     WEIGHT_BYTES[r.weight_dtype], r.tp, kv_dtype_of(backend),
                     gemm_dtype=r.gemm_dtype(), engine=profile,
                     overlap_cpu=r.async_scheduling)
    t = rc.cache.tiers
    links = TierLinks(t.cpu_bw_gbs * 1e9 if t.cpu_bw_gbs else hw.host_bw,
                      t.cpu_latency_us * 1e-6, t.disk_bw_gbs * 1e9, t.disk_latency_us * 1e-6,
                      t.overlap) if t.enabled else None
    ex = RooflineExecutor(step, backend, links)
    eos = tuple(ByteTokenizer().eos_ids)
    lanes = LaneChoice(backend.costs(), r.fast_path, synthetic_tokens, SYNTHETIC_IDS)
    st = assemble_stack(backend, device, rc.cache, sched, Sampler(rc.seed),
                        arch.max_position_embeddings, eos, executor=ex,
                        shapes=request_shapes(workload), quiet=quiet, kv_budget=budget,
                        groups=plan, make_scheduler=lanes)
    ex.fast_path = "lanes" if lanes.why is None else f"off: {lanes.why}"
    ex.sizes = sizes.label()
    api_in, api_out = api_seconds(r, profile)
    # A cluster's replicas run without their API servers (the router feeds them).
    clustered = rc.cluster.mode == "disaggregated" or rc.cluster.replicas > 1
    api = r.served and r.api_server and bool(api_in or api_out) and not clustered
    if r.served and profile is not None and profile.has_frontend:
        # TTFT and E2E, not the engine's steps. The front end is a first token's delay at
        # light load; where the API server runs, what its service (an input, the first
        # token's output) does not already account for.
        if api:
            fe, served = profile.frontend_s, api_in + api_out
            st.collector.frontend = lambda n: max(0.0, fe(n) - served)
        else:
            st.collector.frontend = profile.frontend_s
    if api:
        st.collector.api = ApiServer(api_in, api_out)
    return st, ex


def api_seconds(r: RooflineConfig, profile: EngineProfile | None) -> tuple[float, float]:
    """The API server's seconds a request's input and a streamed token's output: the
    run's ``roofline.api_request_s`` / ``api_token_s``, else its engine profile's."""
    a = r.api_request_s if r.api_request_s is not None else \
        (profile.api_request_s if profile is not None else 0.0)
    b = r.api_token_s if r.api_token_s is not None else \
        (profile.api_token_s if profile is not None else 0.0)
    return a, b


# kvbench's own scheduling (SchedulerConfig's defaults), what engine_scheduling replaces.
_OWN = {"mixing": "mixed", "chunked_prefill": True, "admission": "watermark"}


def engine_scheduling(sched: SchedulerConfig, profile: EngineProfile | None,
                      engine: str) -> SchedulerConfig:
    """``roofline.engine_scheduling=true``: the profile's mixing, chunked prefill and
    admission in place of kvbench's; a value the command line set otherwise is refused
    (it would be silently replaced)."""
    if profile is None:
        return sched
    changes: dict[str, Any] = {}
    for key, own in _OWN.items():
        want, have = profile.scheduler.get(key, own), getattr(sched, key)
        if have != own and have != want:
            raise UserError(f"scheduler.{key}={have} conflicts with "
                            f"roofline.engine_scheduling=true ({engine} runs {key}={want}): "
                            f"drop scheduler.{key}, or set roofline.engine_scheduling=false")
        changes[key] = want
    return dataclasses.replace(sched, **changes)


class RooflineTarget:
    """The roofline's part of a run: the byte tokenizer, the modelled stack, and its own
    record keys (the modelled seconds per term, the spec it ran, ``engine.sim_wall_s``)."""

    def __init__(self, rc: RunConfig) -> None:
        self.rc = rc
        if rc.cpu_threads > 0:  # the synthetic logits are tiny: threads only fight (12 ms/step)
            torch.set_num_threads(rc.cpu_threads)
        self.arch = get_model_spec(rc.roofline.model)  # a bad spec fails before the workload
        # max_model_len before the workload is made (a trace truncates its rows to it).
        self.len_source: str | None = None
        if "max_model_len" in scheduler_unset(rc.scheduler):
            _, backend, budget = _sized_backend(rc, self.arch)
            mml, self.len_source = model_len(self.arch, backend, budget)
            rc.scheduler = dataclasses.replace(rc.scheduler, max_model_len=mml)
        self.executor: RooflineExecutor | None = None
        self.kv_label = ""
        self._tokenizer = ByteTokenizer()

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def max_position(self) -> int:
        return self.arch.max_position_embeddings

    def build(self, workload: Workload, quiet: bool = False) -> Stack:
        st, self.executor = build_roofline(self.rc, workload, quiet=quiet, arch=self.arch,
                                           len_source=self.len_source)
        if self.arch.layer_attention:
            self.kv_label = kv_plan_label(self.arch.layer_attention, st.kv)
        return st

    def record(self, st: Stack, sim_wall_s: float, sim_cpu_s: float) -> ExecutorRecord:
        ex, r = st.engine.executor, self.rc.roofline
        assert isinstance(ex, RooflineExecutor), "a stack build() made"
        hw = ex.model.hw
        run = {"executor": "roofline", "model": self.arch.name, "kernel": "roofline",
               "device": f"{r.tp}x {hw.name}", "dtype": r.dtype, "hardware": hw.name,
               "hardware_source": hw.source, "tp": r.tp, "weight_dtype": r.weight_dtype,
               "quality": QUALITY_ABSENT}
        eng = engine_name(r.engine, r.hardware)
        prof = PROFILES[eng]
        run.update({"engine": eng, "engine_source": "calibrated" if prof.calibrated
                    else "prior", "compute_dtype": r.gemm_dtype(),
                    "fast_path": ex.fast_path, "served": r.served,
                    "allreduce": ex.model.custom_ar or "nccl",
                    "async_scheduling": ex.model.overlap_cpu})
        # The scheduler's sizes it ran with (the engine's where unset: harness.roofline.sizes)
        cfg = st.scheduler.cfg
        run.update({"max_num_seqs": cfg.max_num_seqs,
                    "max_num_batched_tokens": cfg.max_num_batched_tokens,
                    "max_model_len": cfg.max_model_len, "scheduler_sizes": ex.sizes})
        if self.arch.layer_attention:
            run["kv_groups"] = self.kv_label
        # The band is measured on dense models: an MoE or hybrid run has none (issue #55).
        kind = ("a mixture-of-experts model" if self.arch.num_experts else
                "a hybrid-attention model" if self.arch.layer_attention else None)
        text, pct = describe(eng, hw.name, prof.calibrated, kind)
        run["expected_error"] = text
        metrics: dict[str, Any] = {f"roofline.{k}_s": v for k, v in ex.totals.terms.items()}
        if pct is not None:
            metrics["roofline.expected_error_pct"] = pct
        metrics["roofline.kv_bytes_per_token"] = st.sizing.bytes_per_slot
        metrics.update(group_metrics(st.kv, st.sizing, st.collector.steps))
        metrics["engine.sim_wall_s"] = sim_wall_s  # this CPU's seconds to simulate the run
        metrics["engine.sim_cpu_s"] = sim_cpu_s  # ... of which the process ran
        return ExecutorRecord(run, metrics)

    def score(self, st: Stack, workload: Workload, outputs: dict[int, list[int]],
              metrics: dict[str, Any], rows: RequestLog) -> None:
        """Nothing: the outputs are synthetic ids (``run.quality`` says so)."""
