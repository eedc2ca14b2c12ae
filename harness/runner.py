"""``run(cfg) -> RunResult``: one run of kvbench, callable from tests and from the CLI."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from harness.cluster.disagg import DisaggCluster
from harness.cluster.disagg_records import goodput_per_gpu, summarize_disaggregated
from harness.cluster.driver import Cluster
from harness.cluster.pools import build_pools
from harness.cluster.records import replica_goodput, summarize_cluster
from harness.cluster.run import (
    cluster_record,
    disagg_info,
    make_cluster,
    make_disaggregated,
    pool_gpus,
)
from harness.config import RunConfig, run_config
from harness.engine.gc_quiet import rare_collections
from harness.errors import UserError
from harness.metrics.collector import StepRow
from harness.metrics.goodput import slo_metrics
from harness.metrics.requestlog import RequestLog
from harness.metrics.summary import records_of, summarize
from harness.metrics.tiers import hit_rates, tier_metrics, ttft_by_source
from harness.model_target import ModelTarget
from harness.progress import Backlog, Progress, make_progress
from harness.results import write_results
from harness.roofline.run import RooflineTarget
from harness.sched.spec import SCHEDULER_SIZES
from harness.stack import Stack
from harness.target import RunTarget
from harness.workloads import make_workload
from harness.workloads.base import ReportsMetrics
from harness.workloads.trace import TraceConfig


@dataclass
class RunResult:
    metrics: dict[str, Any]
    requests: RequestLog  # reads as a list of row dicts
    out_dir: Path | None
    outputs: dict[int, list[int]]  # request id -> output ids (the best beam for beams)
    steps: Sequence[StepRow]


def _git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _progress(enabled: bool) -> Progress:
    # A bar on a terminal, periodic status lines elsewhere; counts for INTERRUPTED always.
    return make_progress(enabled)


def run(cfg: DictConfig | dict[str, Any] | RunConfig) -> RunResult:
    """Compose nothing, just run: ``cfg`` is a composed config (see harness.config),
    converted once into the typed :class:`RunConfig` that every layer below receives.

    One pipeline for both executors: the executor's :class:`~harness.target.RunTarget`
    builds the stack and adds its own keys; everything else is this function's."""
    rc = run_config(cfg)
    if rc.workload.seed is None:  # one seed drives the run unless the workload has its own
        rc.workload.seed = rc.seed
    # config.yaml is the composed config as given (workload.seed: null = the run's seed).
    config_yaml = OmegaConf.to_yaml(cfg if isinstance(cfg, DictConfig)
                                    else OmegaConf.structured(rc), resolve=True)
    torch.manual_seed(rc.seed)
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    sha = _git_sha()  # at the start: the code this run imported, not a later commit's
    target: RunTarget = RooflineTarget(rc) if rc.executor == "roofline" else ModelTarget(rc)
    if isinstance(rc.workload, TraceConfig) and rc.workload.max_model_len is None:
        # A trace truncates or rejects its rows against the length the engine enforces.
        rc.workload.max_model_len = min(rc.scheduler.max_model_len, target.max_position)
    workload = make_workload(rc.workload, target.tokenizer)
    disagg = rc.cluster.mode == "disaggregated"
    targets: RunTarget | list[RunTarget] = target
    if disagg:  # a prefill pool and a decode pool (harness.cluster.disagg)
        targets, stacks = build_pools(target, rc, workload)
    else:
        stacks = build_replicas(target, workload, rc.cluster.replicas)
    n = len(stacks)
    st = stacks[0]
    config_yaml = with_resolved(config_yaml, st, rc)
    for s in stacks:
        s.collector.keep_outputs = rc.records.keep_output_ids
    cluster: Cluster | DisaggCluster | None = (
        make_disaggregated(rc, stacks) if disagg else
        make_cluster(rc.cluster, stacks, rc.seed) if n > 1 else None)
    progress = _progress(rc.progress)
    # The total a multi-turn workload will reach (its known requests grow by the turn).
    if hasattr(workload, "expected_requests"):
        progress.expect(lambda: int(workload.expected_requests))
    progress.watch_backlog(backlog_probe(stacks), backlog_hint(rc),
                           modelled=rc.executor == "roofline")
    t0, c0 = time.perf_counter(), time.process_time()
    with rare_collections():  # the loop makes no cycles for the collector to find
        # On the executor's clock (a cluster's: its latest replica's).
        clock_s = st.engine.run(workload, progress) if cluster is None else \
            cluster.run(workload, progress)
    if cluster is None and st.collector.api is not None:  # until the last client got all
        clock_s += st.collector.api.final_lag()
    sim_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    progress.close()
    for s in stacks:
        s.kv.ledger.finish()

    own = target.record(st, sim_s, cpu_s) if cluster is None else \
        cluster_record(targets, stacks, sim_s, cpu_s)
    run_info = {
        "backend": rc.backend.name, "workload": rc.workload.name, "seed": rc.seed,
        "git_sha": sha, "started_at": started, "block_size": st.sizing.block_size,
        "prefix_caching": st.prefix_caching, "tiers": tiers_label(rc, st), **own.run,
        # the prefix cache's eviction order and admission rule (harness/kv/eviction.py)
        **({"eviction": rc.cache.eviction, "admission": rc.cache.admission}
           if st.prefix_caching else {}),
        # each lower tier's eviction order (cache.tiers.<tier>_policy), e.g. cpu=arc,disk=lru
        **({"tier_eviction": ",".join(f"{t.name}={t.policy}" for t in st.tiers.tiers)}
           if st.tiers is not None else {}),
        **({"prefill": st.backend.trigger} if st.backend.trigger else {}),
        **({"replicas": n, "router": rc.cluster.router}
           if cluster is not None and not disagg else {}),
        **({"prefix_scorer": rc.cluster.prefix_scorer}
           if cluster is not None and "prefix_aware" in rc.cluster.routers_in_use() else {}),
        **(disagg_info(rc) if disagg else {}),
    }
    step_extra: dict[str, Sequence[Any]] | None = None
    if cluster is None:
        records = records_of(st.collector)
        metrics = summarize(records, run_info, st.sizing.kv_budget_bytes,
                            st.sizing.num_slots, clock_s)
        rows = records.rows
        metrics.update(hit_rates(st.kv, st.tiers))
        steps: Sequence[StepRow] = st.collector.steps
        outputs = st.collector.outputs()
    elif isinstance(cluster, DisaggCluster):
        metrics, rows, steps, which = summarize_disaggregated(
            cluster, run_info, clock_s, rc.records.keep_output_ids, pool_gpus(rc))
        n_p = rc.cluster.prefill_replicas
        step_extra = {"replica": which,
                      "pool": ["prefill" if i < n_p else "decode" for i in which]}
        outputs = {k: v for s in stacks[n_p:] for k, v in s.collector.outputs().items()}
    else:
        metrics, rows, steps, which = summarize_cluster(
            cluster, run_info, [(st.sizing.kv_budget_bytes, st.sizing.num_slots)] * n,
            clock_s, rc.records.keep_output_ids)
        step_extra = {"replica": which}
        outputs = {k: v for s in stacks for k, v in s.collector.outputs().items()}
    if disagg:  # each request's outputs are its decode side's
        outputs.update({k: v for s in stacks[:rc.cluster.prefill_replicas]
                        for k, v in s.collector.outputs().items() if k not in outputs})
    metrics.update(own.metrics)
    if isinstance(workload, ReportsMetrics):
        metrics.update(workload.workload_metrics())
    if st.tiers is not None:
        if cluster is None:  # a cluster's tiers: their hit rates only (cache.hit_rate.*)
            metrics.update(tier_metrics(st.tiers, steps, st.sizing.block_bytes,
                                        st.engine.executor.transfer_s,
                                        st.engine.executor.transfer_exposed_s))
        metrics.update(ttft_by_source(rows))
    target.score(st, workload, outputs, metrics, rows)
    metrics.update(slo_metrics(rows, rc.slo, clock_s))  # after quality: its agreement floor
    if cluster is not None:
        metrics.update(replica_goodput(rows, n, clock_s))
    if disagg:
        metrics.update(goodput_per_gpu(metrics))
    out_dir = Path(rc.out_dir) if rc.out_dir else None
    if out_dir is not None:
        write_results(out_dir, config_yaml, metrics, steps, rows, rc.records.format,
                      step_extra)
    check_rejections(rows, out_dir)
    return RunResult(metrics, rows, out_dir, outputs, steps)


def with_resolved(config_yaml: str, st: Stack, rc: RunConfig) -> str:
    """config.yaml with the values the run resolved where the config left them unset
    (null): the scheduler's sizes (kvbench's, or the modelled engine's under
    executor=roofline) and ``records.output_ids``."""
    cfg = OmegaConf.create(config_yaml)
    assert isinstance(cfg, DictConfig)
    sched, records = cfg.get("scheduler"), cfg.get("records")
    unset = [k for k in SCHEDULER_SIZES if sched is not None and sched.get(k, 0) is None]
    if not unset and (records is None or records.get("output_ids", False) is not None):
        return config_yaml
    for k in unset:  # the config's value (resolved), else the stack's (the engine's)
        v = getattr(rc.scheduler, k)
        sched[k] = v if v is not None else getattr(st.scheduler.cfg, k)
    if records is not None and records.get("output_ids", False) is None:
        records.output_ids = rc.records.keep_output_ids
    return OmegaConf.to_yaml(cfg)


def backlog_probe(stacks: list[Stack]) -> Callable[[], Backlog]:
    """The run's queue as :meth:`Progress.watch_backlog` reads it: requests waiting and in
    flight over every replica, and the latest replica's clock since now (the run's start)."""
    clocks = [(s.engine.executor.clock, s.engine.executor.clock.now()) for s in stacks]
    scheds = [s.scheduler for s in stacks]

    def probe() -> Backlog:
        waiting = sum(len(s.waiting) + len(s.swapped) for s in scheds)
        return Backlog(waiting, waiting + sum(len(s.running) for s in scheds),
                       max(c.now() - t0 for c, t0 in clocks))
    return probe


def backlog_hint(rc: RunConfig) -> str:
    """What to change when the backlog outgrows the deployment."""
    rate = ("a smaller workload.speedup or workload.max_requests"
            if isinstance(rc.workload, TraceConfig) else "a lower workload.rate")
    return f"give {rate}, or more capacity (cache.kv_budget, cluster.replicas)"


def build_replicas(target: RunTarget, workload: Any, n: int) -> list[Stack]:
    """The run's stack, or a cluster's ``n`` (each its own cache.kv_budget): a replica
    that cannot be built says which one and what to lower."""
    stacks = []
    for i in range(n):
        try:
            stacks.append(target.build(workload, quiet=i > 0))
        except UserError as e:
            if i == 0:
                raise
            raise UserError(f"replica {i} of cluster.replicas={n}: {e} (each replica holds "
                            "its own cache.kv_budget: lower cluster.replicas or "
                            "cache.kv_budget)") from None
    return stacks


def tiers_label(rc: RunConfig, st: Stack) -> str:
    """``run.tiers``: the lower tiers this run's prefix cache had (``off`` if none)."""
    if st.tiers is None:
        return "off"
    t = rc.cache.tiers
    parts = [f"cpu={t.cpu}"] + ([f"disk={t.disk}"] if len(st.tiers.tiers) > 1 else [])
    parts.append(f"write={t.write}")
    if rc.executor == "roofline":
        parts.append(f"overlap={str(t.overlap).lower()}")
    return ",".join(parts)


def check_rejections(rows: RequestLog, out_dir: Path | None) -> None:
    """A run where nothing finished is a failed run, not a result (UserError, after the
    results are written); one that rejected a sizeable share says so on the terminal."""
    rejected = np.flatnonzero(rows.matches("status", "rejected"))
    if not len(rejected):
        return
    first = rows[int(rejected[0])]
    why = f"e.g. request {first['request_id']}: {first['rejected_reason']}"
    where = f" (results in {out_dir})" if out_dir is not None else ""
    if not rows.matches("status", "finished").any():
        raise UserError(f"no request finished: all {len(rejected)} were rejected{where}: "
                        f"{why}")
    if len(rejected) >= 0.1 * len(rows):
        print(f"kvbench: warning: {len(rejected)} of {len(rows)} requests were rejected: "
              f"{why}", file=sys.stderr)


def print_summary(m: dict[str, Any], out_dir: Path | None) -> None:
    """A short table on the terminal at the end of a run."""
    def f(key: str, fmt: str = "{:.1f}") -> str:
        v = m.get(key)
        if v is None:
            return "-"
        low, high = m.get(key + "_ci95_low"), m.get(key + "_ci95_high")
        ci = f" [{fmt.format(low)}, {fmt.format(high)}]" if low is not None \
            and high is not None else ""
        return fmt.format(v) + ci

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
        *([("goodput req/s (SLO attainment)", f"{f('latency.goodput_rps', '{:.2f}')} "
            f"({f('latency.slo_attainment', '{:.3f}')})")]
          if "latency.goodput_rps" in m else []),
        ("prefix hit rate", f("cache.prefix_hit_rate", "{:.3f}")),
        ("preemptions (recompute / swap)",
         f"{m['sched.preemptions_recompute']} / {m['sched.preemptions_swap']}"),
        ("engine overhead % of step", f("engine.overhead_pct")),
        ("wall time (s)", f("engine.wall_s")),
    ]
    if "run.replicas" in m:
        lines.insert(1, ("replicas / router (load imbalance)",
                         f"{m['run.replicas']} / {m['run.router']} "
                         f"({f('cluster.load_imbalance', '{:.2f}')})"))
    if m.get("run.executor") == "roofline":  # modelled times: with their validated error
        lines.insert(1, ("what-if (modelled) error band", str(m.get("run.expected_error"))))
    if "quality.task_accuracy" in m:  # a task workload (ruler): its score, with its interval
        lines[-1:-1] = [("task accuracy [95% CI]", f("quality.task_accuracy", "{:.3f}"))]
    if "quality.ppl" in m:
        lines[-1:-1] = [
            ("quality: ppl / ref (delta %)",
             f"{f('quality.ppl', '{:.3f}')} / {f('quality.ppl_ref', '{:.3f}')} "
             f"({f('quality.ppl_delta_pct', '{:+.2f}')})"),
            ("quality: KL mean / top-1 agreement",
             f"{f('quality.kl_mean', '{:.5f}')} / {f('quality.top1_agreement', '{:.4f}')}"),
        ]
    # Against the reference's outputs (absent where the workload fixes output lengths).
    out_keys = [("output length / reference's", "quality.output_length_ratio"),
                ("answers right -> wrong vs reference", "quality.right_to_wrong_share")]
    lines[-1:-1] = [(k, f(key, "{:.3f}")) for k, key in out_keys if key in m]
    width = max(len(k) for k, _ in lines)
    print()
    for k, v in lines:
        print(f"  {k:<{width}}  {v}")
    if out_dir is not None:
        print(f"\n  results: {out_dir}")
