"""``executor=model``: the real model's forward on the wall clock (the default)."""

from __future__ import annotations

from typing import Any

import torch

from harness.config import RunConfig
from harness.engine.executor import ModelExecutor
from harness.engine.graphs import setup_graphs
from harness.engine.sampler import make_sampler
from harness.errors import UserError
from harness.kv.groups import GroupedKVManager
from harness.metrics.groups import group_metrics
from harness.metrics.requestlog import RequestLog
from harness.metrics.tasks import ScoresTasks, add_task_scores
from harness.model import load_model
from harness.model.tokenizer import Tokenizer
from harness.quality import load_texts, measure
from harness.quality_check import method_policy, quality_prefill
from harness.stack import Stack, build_stack, kv_plan_label
from harness.target import ExecutorRecord
from harness.workloads.base import Workload, request_shapes


def resolve_device(name: str) -> torch.device:
    """``device=auto|cpu|cuda|cuda:N`` as a torch device, or a UserError saying why not."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UserError(f"device={name!r} is not a device: use auto, cpu, cuda or cuda:N") \
            from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device={name} but this machine has no CUDA device (torch "
                        f"{torch.__version__}): use device=cpu or device=auto")
    if dev.type == "cuda" and dev.index is not None \
            and dev.index >= torch.cuda.device_count():
        raise UserError(f"device={name}: only {torch.cuda.device_count()} CUDA device(s)")
    return dev


class ModelTarget:
    """Loads the model at construction; quality (``quality.*``, task scores) is measured
    on its outputs after the run."""

    def __init__(self, rc: RunConfig) -> None:
        self.rc = rc
        self.device = resolve_device(rc.device)
        if self.device.type == "cpu" and rc.cpu_threads > 0:
            torch.set_num_threads(rc.cpu_threads)
        self.loaded = load_model(rc.model.source, rc.model.path, rc.model.dtype, self.device)
        self.texts: list[list[int]] | None = None
        self.quality_prefill: int | None = None  # each quality text's prompt (build)
        self.cuda_graphs = "off"  # what run.cuda_graphs records (set by build)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    @property
    def max_position(self) -> int:
        return self.loaded.config.max_position_embeddings

    def build(self, workload: Workload, quiet: bool = False) -> Stack:
        rc = self.rc
        # The texts before the stack: a bad quality.text_file fails before the run.
        if self.texts is None and rc.quality.enabled:
            self.texts = load_texts(rc.quality, self.loaded)
        st = build_stack(self.loaded, self.device, rc.backend, rc.cache, rc.scheduler,
                         make_sampler(rc.seed, self.device), request_shapes(workload),
                         quiet=quiet)
        if rc.quality.enabled:
            # The evaluation's prompt, from the backend's policy: a method that would keep
            # every evaluated token is refused here, before the workload runs.
            self.quality_prefill = quality_prefill(
                rc.quality, method_policy(st.backend), rc.backend.name,
                st.sizing.block_size)
        ex = st.engine.executor
        assert isinstance(ex, ModelExecutor)
        ex.graphs, self.cuda_graphs = setup_graphs(
            rc.engine.cuda_graphs, self.loaded.model, st.backend, self.device,
            isinstance(st.kv, GroupedKVManager), st.scheduler.cfg.max_num_seqs,
            st.scheduler.cfg.max_model_len, st.sizing.block_size)
        return st

    def record(self, st: Stack, sim_wall_s: float, sim_cpu_s: float) -> ExecutorRecord:
        run = {
            "executor": "model", "model": self.loaded.description, "kernel": st.backend.kernel,
            "device": str(self.device),
            "dtype": str(st.backend.layout.dtype).removeprefix("torch."),
            "cuda_graphs": self.cuda_graphs,
        }
        layers = self.loaded.config.layer_attention
        if layers:
            run["kv_groups"] = kv_plan_label(layers, st.kv)
        metrics = group_metrics(st.kv, st.sizing, st.collector.steps)
        ex = st.engine.executor
        if isinstance(ex, ModelExecutor) and ex.graphs is not None:
            metrics["memory.cuda_graph_bytes"] = ex.graphs.nbytes
        return ExecutorRecord(run, metrics)

    def score(self, st: Stack, workload: Workload, outputs: dict[int, list[int]],
              metrics: dict[str, Any], rows: RequestLog) -> None:
        rc = self.rc
        add_task_scores(workload, self.loaded.tokenizer, outputs, metrics, rows, rc.seed)
        # A workload with right answers is compared with the reference's answers too
        # (quality.right_to_wrong_share, output_length_ratio), quality.enabled or not.
        if not (rc.quality.enabled or isinstance(workload, ScoresTasks)):
            return
        q = measure(self.loaded, self.device, rc, self.texts, outputs, st.sizing.num_slots,
                    self.quality_prefill, workload)
        metrics.update(q.metrics)
        if rc.quality.enabled and rc.quality.generation_agreement:
            rows.add_column("agree_tokens", [q.agree_tokens.get(rid)
                                             for rid in rows.column("request_id")])
