"""``executor=roofline``: one run of the real engine, scheduler, KV manager and backend
sizing, with each step's time modelled (harness.roofline.steptime) on a virtual clock.

No weights are loaded and no K/V tensors exist. Prompts come from the workload through
the byte tokenizer (so a text workload's lengths are UTF-8 bytes; trace and random
workloads give token counts directly); outputs are synthetic ids that never hit EOS, so a
request ends at its drawn length or max_tokens. Quality metrics are absent: nothing is
computed to score (``run.quality`` says so).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from harness.backends.base import KVLayout
from harness.engine.executor import RooflineExecutor
from harness.engine.sampler import Sampler
from harness.metrics.goodput import slo_metrics
from harness.metrics.summary import request_rows, summarize
from harness.model import ByteTokenizer, parse_dtype
from harness.progress import make_progress
from harness.results import write_results
from harness.roofline.config import COMPUTE, WEIGHT_BYTES, auto_kv_budget
from harness.roofline.hardware import get_hardware
from harness.roofline.models import get_model_spec
from harness.roofline.profile import kv_dtype_of
from harness.roofline.steptime import StepModel
from harness.stack import Stack, assemble_stack, make_backend
from harness.workloads import make_workload
from harness.workloads.base import ReportsMetrics, Workload

if TYPE_CHECKING:
    from harness.config import RunConfig
    from harness.runner import RunResult

QUALITY_ABSENT = "absent: executor=roofline computes no logits to score"


def build_roofline(rc: RunConfig, workload: Workload,
                   quiet: bool = False) -> tuple[Stack, RooflineExecutor]:
    """The stack of ``rc`` with a :class:`RooflineExecutor` in place of the model."""
    r = rc.roofline
    arch, hw = get_model_spec(r.model), get_hardware(r.hardware)
    if r.attention != "spec":
        hw = dataclasses.replace(hw, attention=r.attention)
    layout = KVLayout(arch.num_layers, arch.num_kv_heads, arch.head_dim, parse_dtype(r.dtype))
    device = torch.device("cpu")  # backends are built for their sizing only: no tensors
    backend = make_backend(rc.backend, layout, device)
    budget = auto_kv_budget(arch, hw, r) if rc.cache.kv_budget == "auto" else \
        rc.cache.kv_budget
    step = StepModel(arch, hw, backend.bytes_per_slot(), COMPUTE[r.dtype],
                     WEIGHT_BYTES[r.weight_dtype], r.tp, kv_dtype_of(backend))
    ex = RooflineExecutor(step, backend)
    eos = tuple(ByteTokenizer().eos_ids)
    st = assemble_stack(backend, device, rc.cache, rc.scheduler, Sampler(rc.seed),
                        arch.max_position_embeddings, eos, executor=ex,
                        requests=workload.initial_requests(), quiet=quiet, kv_budget=budget)
    return st, ex


def run_roofline(rc: RunConfig, config_yaml: str) -> RunResult:
    from harness.runner import RunResult, _git_sha, check_rejections  # runner imports us

    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    if rc.cpu_threads > 0:  # the synthetic logits are tiny: threads only fight (12 ms/step)
        torch.set_num_threads(rc.cpu_threads)
    workload = make_workload(rc.workload, ByteTokenizer())
    st, ex = build_roofline(rc, workload)
    progress = make_progress(rc.progress)
    t0 = time.perf_counter()
    modelled_s = st.engine.run(workload, progress)
    sim_s = time.perf_counter() - t0
    progress.close()
    st.kv.ledger.finish()
    r, arch = rc.roofline, ex.model.arch
    run_info = {
        "backend": rc.backend.name, "workload": rc.workload.name, "model": arch.name,
        "kernel": "roofline", "device": f"{r.tp}x {ex.model.hw.name}", "seed": rc.seed,
        "git_sha": _git_sha(), "started_at": started, "dtype": r.dtype,
        "block_size": st.sizing.block_size, "prefix_caching": st.prefix_caching,
        "executor": "roofline", "hardware": ex.model.hw.name,
        "hardware_source": ex.model.hw.source, "tp": r.tp, "weight_dtype": r.weight_dtype,
        "quality": QUALITY_ABSENT,
        **({"prefill": st.backend.trigger} if st.backend.trigger else {}),
    }
    m = summarize(st.collector, run_info, st.sizing.kv_budget_bytes, st.sizing.num_slots,
                  modelled_s)
    m.update({f"roofline.{k}_s": v for k, v in ex.totals.terms.items()})
    m["roofline.kv_bytes_per_token"] = st.sizing.bytes_per_slot
    m["engine.sim_wall_s"] = sim_s  # this CPU's seconds to simulate the run
    if isinstance(workload, ReportsMetrics):
        m.update(workload.workload_metrics())
    rows = request_rows(st.collector)
    m.update(slo_metrics(rows, rc.slo, modelled_s))  # goodput on the modelled clock
    out_dir = Path(rc.out_dir) if rc.out_dir else None
    if out_dir is not None:
        write_results(out_dir, config_yaml, m, st.collector.steps, rows)
    check_rejections(rows, out_dir)
    return RunResult(m, rows, out_dir, st.collector.outputs(), st.collector.steps)
