"""``run(cfg) -> RunResult``: one run of kvbench, callable from tests and from the CLI."""

from __future__ import annotations

import datetime as dt
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from harness.engine.sampler import Sampler
from harness.metrics.collector import StepRow
from harness.metrics.summary import request_rows, summarize
from harness.model import load_model
from harness.progress import Progress, make_progress
from harness.quality import (
    agreement,
    evaluate_quality,
    fp32_bytes_per_token,
    load_texts,
    quality_config,
    reference_model,
)
from harness.results import write_results
from harness.stack import build_stack
from harness.workloads import make_workload


@dataclass
class RunResult:
    metrics: dict[str, Any]
    requests: list[dict[str, Any]]
    out_dir: Path | None
    outputs: dict[int, list[int]]  # request id -> output ids (the best beam for beams)
    steps: list[StepRow]


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _progress(enabled: bool) -> Progress:
    # A bar on a terminal, periodic status lines elsewhere; counts for INTERRUPTED always.
    return make_progress(enabled)


def run(cfg: DictConfig | dict[str, Any]) -> RunResult:
    """Compose nothing, just run: ``cfg`` is a composed config (see harness.config)."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(cfg)
    torch.manual_seed(cfg.seed)
    device = _device(cfg.device)
    if device.type == "cpu" and cfg.get("cpu_threads", 0) > 0:
        torch.set_num_threads(cfg.cpu_threads)
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")

    loaded = load_model(cfg.model.source, cfg.model.path, cfg.model.dtype, device)
    workload = make_workload(OmegaConf.to_container(cfg.workload), loaded.tokenizer)  # type: ignore[arg-type]
    texts = load_texts(quality_config(cfg), loaded) if cfg.quality.enabled else None
    container = OmegaConf.to_container(cfg.backend)
    assert isinstance(container, dict)
    backend_cfg = {str(k): v for k, v in container.items()}
    st = build_stack(loaded, device, backend_cfg, cfg.cache,
                     cfg.scheduler, Sampler(cfg.seed), workload.initial_requests())
    backend, sizing, kv, collector = st.backend, st.sizing, st.kv, st.collector
    progress = _progress(cfg.get("progress", True))
    wall = st.engine.run(workload, progress)
    progress.close()
    kv.ledger.finish()

    run_info = {
        "backend": cfg.backend.name, "workload": cfg.workload.name,
        "model": loaded.description, "kernel": backend.kernel, "device": str(device),
        "seed": cfg.seed, "git_sha": _git_sha(), "started_at": started,
        "dtype": str(backend.layout.dtype).removeprefix("torch."),
        "block_size": sizing.block_size,
        "prefix_caching": st.prefix_caching,
    }
    metrics = summarize(collector, run_info, sizing.kv_budget_bytes, sizing.num_slots, wall)
    rows = request_rows(collector)
    outputs = collector.outputs()
    if cfg.quality.enabled:
        metrics.update(evaluate_quality(loaded, device, cfg, backend_cfg, texts))
        if cfg.quality.generation_agreement:
            agree = _generation_agreement(cfg, loaded, device, outputs, sizing.num_slots)
            for r in rows:
                r["agree_tokens"] = agree.get(r["request_id"])
            metrics["quality.gen_agree_tokens_mean"] = (
                sum(agree.values()) / len(agree) if agree else 0.0)
            metrics["quality.gen_exact_match_rate"] = (
                sum(agree[r] == len(outputs[r]) for r in agree) / len(agree) if agree else 0.0)
    out_dir = Path(cfg.out_dir) if cfg.get("out_dir") else None
    if out_dir is not None:
        write_results(out_dir, OmegaConf.to_yaml(cfg, resolve=True), metrics,
                      collector.steps, rows)
    return RunResult(metrics, rows, out_dir, outputs, collector.steps)


def _generation_agreement(cfg: DictConfig, loaded: Any, device: torch.device,
                          outputs: dict[int, list[int]], capacity: int) -> dict[int, int]:
    """Rerun the workload on the exact reference (contiguous, fp32) and count, per request,
    the generated tokens equal to the reference's before the first difference."""
    ref_model = reference_model(loaded, cfg, device)
    workload = make_workload(OmegaConf.to_container(cfg.workload), ref_model.tokenizer)  # type: ignore[arg-type]
    budget = fp32_bytes_per_token(ref_model) * max(2 * capacity, 4096)
    st = build_stack(ref_model, device, {"name": "contiguous", "reserve": "exact"}, cfg.cache,
                     cfg.scheduler, Sampler(cfg.seed), quiet=True, kv_budget=budget)
    st.engine.run(workload)
    return agreement(outputs, st.collector.outputs())


def print_summary(m: dict[str, Any], out_dir: Path | None) -> None:
    """A short table on the terminal at the end of a run."""
    def f(key: str, fmt: str = "{:.1f}") -> str:
        v = m.get(key)
        return "-" if v is None else fmt.format(v)

    lines = [
        ("backend / workload", f"{m['run.backend']} / {m['run.workload']} "
                               f"(kernel {m['run.kernel']}, {m['run.device']})"),
        ("requests finished / rejected", f"{m['requests.finished']} / {m['requests.rejected']}"),
        ("output tokens/s", f("throughput.output_tokens_per_s")),
        ("TTFT p50 / p99 (ms)", f"{f('latency.ttft_ms.p50')} / {f('latency.ttft_ms.p99')}"),
        ("ITL p50 / p99 (ms)", f"{f('latency.itl_ms.p50')} / {f('latency.itl_ms.p99')}"),
        ("KV token capacity", f"{m['memory.token_capacity']}"),
        ("KV waste % (reservation / internal / external)",
         f"{f('memory.waste_pct')} ({f('memory.reservation_pct')} / "
         f"{f('memory.internal_frag_pct')} / {f('memory.external_frag_pct')})"),
        ("max running seqs", f"{m['memory.max_running_seqs']}"),
        ("prefix hit rate", f("cache.prefix_hit_rate", "{:.3f}")),
        ("preemptions (recompute / swap)",
         f"{m['sched.preemptions_recompute']} / {m['sched.preemptions_swap']}"),
        ("engine overhead % of step", f("engine.overhead_pct")),
        ("wall time (s)", f("engine.wall_s")),
    ]
    if "quality.ppl" in m:
        lines[-1:-1] = [
            ("quality: ppl / ref (delta %)",
             f"{f('quality.ppl', '{:.3f}')} / {f('quality.ppl_ref', '{:.3f}')} "
             f"({f('quality.ppl_delta_pct', '{:+.2f}')})"),
            ("quality: KL mean / top-1 agreement",
             f"{f('quality.kl_mean', '{:.5f}')} / {f('quality.top1_agreement', '{:.4f}')}"),
        ]
    width = max(len(k) for k, _ in lines)
    print()
    for k, v in lines:
        print(f"  {k:<{width}}  {v}")
    if out_dir is not None:
        print(f"\n  results: {out_dir}")
