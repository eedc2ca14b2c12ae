"""The what-if against published measurements: re-run every published point, fit the
engine profiles to the fit set, and report predicted / published on the held-out set.

    python -m harness.roofline_tools.validate [--set fit|validation|both] [--fit] [--only ID,...]
                                        [--jobs 2] [--out F]

Three files (harness/roofline/published): ``fit.yaml`` (../shared/WHATIF_DATA.md's
points), ``calibration.yaml`` (further published points found later, kept apart from it:
the only other end-to-end points any constant is fitted to) and ``validation.yaml``
(frozen before the fit, never fitted to). Each run is one published configuration,
composed as kvbench overrides (:func:`overrides`): its engine's profile and scheduler
settings (harness.roofline.engines), then its source's, then its own (``concurrency: c``,
a closed-loop client, as ``scheduler.max_num_seqs=c`` over a queue). ``--fit`` fits each
engine profile's CPU constants to that engine's all-at-once points of the fit and
calibration sets and its open loops at light load: an all-at-once schedule does not
depend on time (a light open loop's, to first order), so the step shapes are recorded
once and every fitted figure (a run's length for its throughput, a request's end-to-end
time, its mean TPOT) is affine in the constants (:func:`_figure_rows`; an engine that
overlaps its CPU time with the forward, piecewise: :func:`fit_engine`), solved by
non-negative least squares on the relative error; it writes ``fit_result.json``, which
harness.roofline.engines reads. ``validation_result.json``
(what every roofline run's ``roofline.expected_error_pct`` is read from) is written after
a validation run.

Throughput (``requests_per_s``, ``output_tokens_per_s``, ``total_tokens_per_s``) and TPOT
(``tpot_ms_mean`` / ``_median``) are the claimed metrics; TTFT, E2E and ITL figures are
reported beside them, outside the claim.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from harness.errors import UserError
from harness.roofline.bands import GPU_CLASS
from harness.roofline.engines import CONSTANTS, FIT_RESULT, SGLANG, VLLM_V1
from harness.roofline_tools.closed_loop import closed_loop, front_end_extra

HERE = Path(__file__).resolve().parents[1] / "roofline" / "published"
VALIDATION_RESULT = HERE / "validation_result.json"  # read by harness.roofline.bands
SETS = {"fit": HERE / "fit.yaml", "calibration": HERE / "calibration.yaml",
        "validation": HERE / "validation.yaml"}
FITTED_SETS = ("fit", "calibration")  # what --fit fits to; validation never
CLAIMED = {"requests_per_s": "throughput", "output_tokens_per_s": "throughput",
           "total_tokens_per_s": "throughput", "tpot_ms_mean": "tpot",
           "tpot_ms_median": "tpot", "ttft_ms_mean": "ttft", "ttft_ms_median": "ttft",
           "e2e_ms_mean": "e2e", "e2e_ms_median": "e2e"}
METRICS = (*CLAIMED, "itl_ms_median")
BLIND_LOG = HERE / "blind_runs.jsonl"  # one line per run of the whole validation set
# ShareGPT-like lengths (../shared/WHATIF_DATA.md): lognormal, clipped to [4, 1024].
SHAREGPT_MEAN_STD = {"input": (220, 230), "output": (200, 210)}
SHAREGPT_CLIP = (4, 1024)
SHAREGPT = ["workload.distribution=lognormal",
            *(o for side, (mean, std) in SHAREGPT_MEAN_STD.items() for o in (
                f"workload.{side}_mean={mean}", f"workload.{side}_std={std}",
                f"workload.{side}_min={SHAREGPT_CLIP[0]}",
                f"workload.{side}_max={SHAREGPT_CLIP[1]}"))]
# The stand-in's std / mean, kept when sharegpt_at moves its means.
SHAREGPT_CV = {side: std / mean for side, (mean, std) in SHAREGPT_MEAN_STD.items()}


def load(name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A published set's sources and runs."""
    d = yaml.safe_load(SETS[name].read_text())
    for r in d["runs"]:
        r["set"] = name
        unknown = set(r["figures"]) - set(METRICS)
        if unknown:
            raise UserError(f"{SETS[name]}: run {r['id']} has unknown metrics {unknown}")
        if r.get("concurrency") and r["rate"]:  # (a closed loop is sent at t=0)
            raise UserError(f"{SETS[name]}: run {r['id']} has both a rate and a "
                            "concurrency: give one (rate: 0 for a closed loop)")
    return d["sources"], d["runs"]


def _scheduler(run: dict[str, Any], source: dict[str, Any]) -> dict[str, Any]:
    from harness.roofline.engines import PROFILES

    s = dict(PROFILES[run["engine"]].scheduler)
    s.update(source.get("scheduler", {}).get(run["engine"], {}))
    s.update(run.get("scheduler", {}))
    s["max_model_len"] = run["max_model_len"]
    # Budgets an engine derives from the run (harness.roofline.engines names them).
    budget = s.get("max_num_batched_tokens")
    if budget == "max(max_model_len, 2048)":  # vLLM V0 without chunked prefill
        s["max_num_batched_tokens"] = max(run["max_model_len"], 2048)
    if "trtllm-bench" in (s.get("max_num_seqs"), budget):
        s.update(_trtllm_bench(run, s))
    # Rules the run resolves itself (harness.roofline.sizes: they need its card, front end
    # and pool): left unset here.
    for k in ("max_num_seqs", "max_num_batched_tokens"):
        if s.get(k) in (VLLM_V1, SGLANG):
            del s[k]
    if "concurrency" in run:  # a closed loop of c clients: at most c in flight
        s["max_num_seqs"] = min(int(run["concurrency"]), int(s.get("max_num_seqs", 256)))
    return s


def served(run: dict[str, Any], source: dict[str, Any]) -> bool:
    """Whether the published run went through an HTTP server (its source's ``served``;
    offline benchmarks say false)."""
    return bool(run.get("served", source.get("served", True)))


def prefix_caching(run: dict[str, Any], source: dict[str, Any]) -> bool:
    """The run's prefix caching: its own or its source's setting (per engine), else the
    engine's default (vLLM V1 and SGLang on, vLLM 0.6 and TensorRT-LLM off)."""
    from harness.roofline.engines import PROFILES

    if "prefix_caching" in run:
        return bool(run["prefix_caching"])
    flags = run.get("flags") or {}
    if flags.get("disable_radix_cache") or flags.get("enable_prefix_caching") is False:
        return False
    by = source.get("prefix_caching", {})
    if run["engine"] in by:
        return bool(by[run["engine"]])
    return PROFILES[run["engine"]].prefix_caching


def _trtllm_bench(run: dict[str, Any], s: dict[str, Any]) -> dict[str, Any]:
    """The ``"trtllm-bench"`` rule: the batch limits trtllm-bench derives from the run's
    dataset (harness.roofline.trtllm_bench), for the limits the profile leaves to it."""
    from harness.roofline.config import WEIGHT_BYTES
    from harness.roofline.engines import PROFILES
    from harness.roofline.hardware import get_hardware
    from harness.roofline.models import get_model_spec
    from harness.roofline.trtllm_bench import batch_limits

    wl = run["workload"]
    means = _sharegpt_means(wl)
    if wl == "sharegpt":  # the lognormal stand-in's means; its prompts stop at 1024
        isl, osl = (SHAREGPT_MEAN_STD[side][0] for side in ("input", "output"))
        longest = SHAREGPT_CLIP[1]
    elif means is not None:  # the published means, the same stop
        isl, osl, longest = round(means[0]), round(means[1]), SHAREGPT_CLIP[1]
    else:
        (i0, i1), (o0, o1) = _bounds(wl["input"]), _bounds(wl["output"])
        isl, osl, longest = (i0 + i1) // 2, (o0 + o1) // 2, i1
    kv_bytes = 1.0 if run["backend"] in ("fp8", "int8") else 2.0
    try:
        bs, tokens = batch_limits(
            get_model_spec(run["model"]), get_hardware(run["hardware"]).mem_bytes,
            int(run["tp"]), WEIGHT_BYTES[run["weight_dtype"]], kv_bytes, isl, osl, longest,
            PROFILES[run["engine"]].memory_utilization, bool(s.get("chunked_prefill")))
    except ValueError as e:  # reported as the point's error, never dropped
        raise UserError(f"roofline.engine=trtllm: {e}") from None
    out: dict[str, Any] = {}
    if s.get("max_num_seqs") == "trtllm-bench":
        out["max_num_seqs"] = bs
    if s.get("max_num_batched_tokens") == "trtllm-bench":
        out["max_num_batched_tokens"] = tokens
    return out


def overrides(run: dict[str, Any], source: dict[str, Any]) -> list[str]:
    """The kvbench overrides that stand for one published run."""
    from harness.roofline.engines import PROFILES

    prof = PROFILES[run["engine"]]
    ov = ["executor=roofline", f"roofline.model={run['model']}",
          f"roofline.hardware={run['hardware']}", f"roofline.tp={run['tp']}",
          f"roofline.weight_dtype={run['weight_dtype']}", f"roofline.engine={run['engine']}",
          f"roofline.compute_dtype={run.get('compute_dtype', 'auto')}",
          f"roofline.gpu_memory_utilization={prof.memory_utilization}",
          f"roofline.memory_utilization_of={prof.memory_utilization_of}",
          f"backend={run['backend']}", "cache.kv_budget=auto",
          f"cache.enable_prefix_caching={str(prefix_caching(run, source)).lower()}",
          f"roofline.served={str(served(run, source)).lower()}",
          f"roofline.async_scheduling={_async(run, source)}", "workload=random",
          f"workload.num_requests={run['num_prompts']}", f"workload.rate={run['rate']}",
          "progress=false", f"seed={run.get('seed', 0)}"]
    wl = run["workload"]
    means = _sharegpt_means(wl)
    if wl == "sharegpt":
        ov += SHAREGPT
    elif means is not None:  # the stand-in at this run's published means
        ov += sharegpt_at(*means)
    else:  # fixed lengths, or [lo, hi]: uniform between (SGLang's random dataset)
        (i0, i1), (o0, o1) = (_bounds(wl["input"]), _bounds(wl["output"]))
        ov += ["workload.distribution=uniform", f"workload.input_min={i0}",
               f"workload.input_max={i1}", f"workload.output_min={o0}",
               f"workload.output_max={o1}"]
    ov += [f"scheduler.{k}={str(v).lower() if isinstance(v, bool) else v}"
           for k, v in _scheduler(run, source).items()]
    if "concurrency" in run:  # its queue at t=0 is not a burst: no API-server queue
        ov.append("roofline.api_server=false")  # (harness.roofline_tools.closed_loop)
    return ov


def _async(run: dict[str, Any], source: dict[str, Any]) -> str:
    """``roofline.async_scheduling`` of a run: its source's setting per engine (vLLM's
    --async-scheduling), else the profile's default."""
    v = (run.get("flags") or {}).get("async_scheduling")
    if v is None:
        v = source.get("async_scheduling", {}).get(run["engine"])
    return "null" if v is None else str(bool(v)).lower()


def is_fitted(run: dict[str, Any], source: dict[str, Any]) -> bool:
    """Whether ``--fit`` fits to ``run``: its source's ``fit`` (default true), which may
    name the engines whose rows are fitted."""
    f = source.get("fit", True)
    return run["engine"] in f if isinstance(f, list) else bool(f)


def _sharegpt_means(wl: Any) -> tuple[float, float] | None:
    """``(input_mean, output_mean)`` of a ``{dataset: sharegpt, input_mean, output_mean}``
    workload (the run's published token totals over its prompts), else None."""
    if isinstance(wl, dict) and wl.get("dataset") == "sharegpt":
        return float(wl["input_mean"]), float(wl["output_mean"])
    return None


def _clipped_lognormal_mean(mean: float, cv: float, lo: float, hi: float) -> float:
    """E[clip(X, lo, hi)] for a lognormal X of mean ``mean`` and std ``cv x mean``
    (harness.workloads.random_lengths.draw_length's parametrization), in closed form:
    ``lo P(X < lo) + E[X; lo <= X < hi] + hi P(X >= hi)``."""
    s2 = math.log(1.0 + cv * cv)
    s, mu = math.sqrt(s2), math.log(mean) - s2 / 2.0
    cdf = lambda z: 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))  # noqa: E731
    a, b = (math.log(lo) - mu) / s, (math.log(hi) - mu) / s
    return lo * cdf(a) + mean * (cdf(b - s) - cdf(a - s)) + hi * (1.0 - cdf(b))


def _lognormal_mean_for(target: float, cv: float, lo: float, hi: float) -> float:
    """The lognormal mean whose draws, clipped to [lo, hi], average ``target`` tokens
    (clipping at 1,024 takes ~2.5% off a ShareGPT-like mean; bisection: the clipped
    mean rises with the parameter)."""
    if not lo < target < hi:
        raise UserError(f"a ShareGPT mean of {target} tokens is outside its clip [{lo}, {hi}]")
    a, b = target, 4.0 * target
    for _ in range(60):
        m = 0.5 * (a + b)
        a, b = (m, b) if _clipped_lognormal_mean(m, cv, lo, hi) < target else (a, m)
    return 0.5 * (a + b)


def sharegpt_at(input_mean: float, output_mean: float) -> list[str]:
    """The ShareGPT stand-in's overrides (:data:`SHAREGPT`: lognormal, its std / mean,
    clipped to [4, 1024]) with the means a run published (its total input and generated
    tokens over its prompts): the parameters are solved so that the clipped draws average
    those means, which a run's throughput in requests a second depends on directly."""
    lo, hi = SHAREGPT_CLIP
    ov = ["workload.distribution=lognormal"]
    for side, target in (("input", input_mean), ("output", output_mean)):
        m = _lognormal_mean_for(target, SHAREGPT_CV[side], lo, hi)
        ov += [f"workload.{side}_mean={m:.2f}", f"workload.{side}_std="
               f"{SHAREGPT_CV[side] * m:.2f}", f"workload.{side}_min={lo}",
               f"workload.{side}_max={hi}"]
    return ov


def _bounds(v: Any) -> tuple[int, int]:
    """A published length: a number (fixed) or ``[lo, hi]`` (uniform between)."""
    if isinstance(v, list):
        return int(v[0]), int(v[1])
    return int(v), int(v)


def predicted(result: Any, concurrency: int = 0,
              frontend: Callable[[int], float] | None = None) -> dict[str, float]:
    """Every metric of :data:`METRICS` from a run's result (``harness.runner.RunResult``).
    ``concurrency``: a closed loop of that many clients, run as a queue at t=0 under
    ``max_num_seqs`` (:func:`overrides`; harness.roofline_tools.closed_loop): a client
    sends its next request when one finishes, so a request's TTFT and end-to-end time
    count from the finish that freed its slot, and keep its own front end
    (``frontend``: a served run's seconds by prompt tokens, already in each request's
    TTFT and end-to-end time); each client's chain of requests pays its front ends."""
    m = result.metrics
    rows = [r for r in result.requests if r["status"] == "finished"]
    tpot = [float(r["tpot_ms"]) for r in rows if r["output_tokens"] > 1]
    ttft = [float(r["ttft_ms"]) for r in rows]
    e2e = [float(r["e2e_ms"]) for r in rows]
    scale = 1.0  # a closed loop's throughput, its run longer by the front ends
    if concurrency and rows:
        fe = [frontend(int(r["prompt_tokens"])) if frontend else 0.0 for r in rows]
        order = sorted(range(len(rows)), key=lambda i: rows[i]["request_id"])
        # The engine's finishes (the front end out: it delays a request's arrival at the
        # engine, not the next one's send).
        fin = [rows[i]["arrival_s"] + e2e[i] / 1e3 - fe[i] for i in order]
        sent, client = closed_loop(fin, concurrency)
        for i, s_at in zip(order, sent):
            wait = (s_at - rows[i]["arrival_s"]) * 1e3
            ttft[i] -= wait
            e2e[i] -= wait
        wall = len(rows) / m["throughput.requests_per_s"]
        scale = wall / (wall + front_end_extra(fin, [fe[i] for i in order], client))
    return {"requests_per_s": m["throughput.requests_per_s"] * scale,
            "output_tokens_per_s": m["throughput.output_tokens_per_s"] * scale,
            "total_tokens_per_s": m["throughput.total_tokens_per_s"] * scale,
            "tpot_ms_mean": statistics.fmean(tpot), "tpot_ms_median": statistics.median(tpot),
            "ttft_ms_mean": statistics.fmean(ttft), "ttft_ms_median": statistics.median(ttft),
            "e2e_ms_mean": statistics.fmean(e2e), "e2e_ms_median": statistics.median(e2e),
            "itl_ms_median": m["latency.itl_ms.p50"]}


def run_point(args: tuple[dict[str, Any], dict[str, Any], bool]) -> dict[str, Any]:
    """One published run under executor=roofline: its predicted metrics, and with
    ``trace`` each step's (forward s, seqs, fresh, clock at its end), the run's output
    and prompt tokens and each finished request's (arrival, first token, finish) times and
    output tokens; a point the what-if refuses comes back with its ``error``."""
    point, source, trace = args
    try:
        return _run_point(point, source, trace)
    except UserError as e:  # a point that cannot run is reported, never dropped
        return {"id": point["id"], "error": str(e)}


def _run_point(point: dict[str, Any], source: dict[str, Any], trace: bool) -> dict[str, Any]:
    from harness.config import compose_config
    from harness.roofline.run import RooflineTarget
    from harness.runner import run

    cfg = compose_config(overrides(point, source))
    t0 = time.perf_counter()
    traced: list[tuple[float, int, bool, float]] = []
    allreduce: list[Any] = []  # the step model's all-reduces a step and their latency
    # The served front end the run's collector adds (seconds by prompt tokens; None:
    # none), as harness.roofline.run decides it. RooflineTarget.build hands it over, and
    # with ``trace`` the executor, to record the steps.
    front: list[Callable[[int], float] | None] = [None]
    orig = RooflineTarget.build

    def build(self: RooflineTarget, workload: Any, quiet: bool = False) -> Any:
        st = orig(self, workload, quiet)
        front[0] = st.collector.frontend
        if not trace:
            return st
        assert self.executor is not None
        self.executor.trace = traced
        m = self.executor.model
        # (the NCCL latency a profile without a fitted one takes: none with the
        # engine's own kernels, whose time is inside the forward)
        allreduce[:] = [m.allreduces, m.allreduce_latency,
                        0.0 if m.custom_ar else m.hw.allreduce_latency(m.tp),
                        m.overlap_cpu]
        if st.collector.api is not None:  # (a fit reads the engine's own times)
            raise UserError(f"{point['id']}: a served run through the API server's "
                            "queue cannot be traced for a fit (its clients' times are "
                            "not the engine's): fit its engine's API server to it "
                            "(fit_api), or run it as a closed loop")
        return st

    RooflineTarget.build = build  # type: ignore[method-assign]
    try:
        res = run(cfg)
    finally:
        RooflineTarget.build = orig  # type: ignore[method-assign]
    fe = front[0]
    out = {"id": point["id"], "pred": predicted(res, int(point.get("concurrency", 0)), fe),
           "sim_s": time.perf_counter() - t0,
           "preemptions": res.metrics["sched.preemptions_recompute"],
           "max_running_seqs": res.metrics["memory.max_running_seqs"],
           "duration_s": res.metrics["engine.wall_s"]}
    if trace:
        out["trace"] = traced
        (out["allreduces"], out["allreduce_latency"], out["spec_allreduce_latency"],
         out["overlap_cpu"]) = allreduce
        out["output_tokens"] = sum(r["output_tokens"] for r in res.requests)
        out["prompt_tokens"] = sum(r["prompt_tokens"] for r in res.requests)
        # Each finished request's (arrival, first token, finish, output tokens, prompt
        # tokens, front end), in the order sent, its times as the engine made them (a
        # served front end's share out, kept apart: its seconds).
        rows = sorted((r for r in res.requests if r["status"] == "finished"),
                      key=lambda r: r["request_id"])
        out["requests"] = [
            (r["arrival_s"], r["arrival_s"] + r["ttft_ms"] / 1e3 - f,
             r["arrival_s"] + r["e2e_ms"] / 1e3 - f, r["output_tokens"], r["prompt_tokens"], f)
            for r in rows for f in [fe(r["prompt_tokens"]) if fe else 0.0]]
    return out


def run_all(points: list[dict[str, Any]], sources: dict[str, Any], jobs: int,
            trace: bool = False, partial: Path | None = None) -> list[dict[str, Any]]:
    """Every point's result, in order; with ``partial``, the rows of the points done so
    far are rewritten there after each one (a long run killed keeps what it did)."""
    args = [(p, sources[p["source"]], trace) for p in points]
    out: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []

    def done(r: dict[str, Any]) -> None:
        out.append(r)
        if partial is not None:  # the new point's rows added to those before it
            rows.extend(compare([points[len(out) - 1]], [r]))
            partial.write_text(json.dumps(rows, indent=1))

    if jobs <= 1:
        for a in args:
            done(run_point(a))
        return out
    with ProcessPoolExecutor(jobs) as ex:
        for r in ex.map(run_point, args):
            done(r)
    return out


# -- the fit --------------------------------------------------------------------------
def _steps(r: dict[str, Any], c: np.ndarray | None = None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A traced run's per-step seconds apart from the fitted terms, its per-step linear
    terms in the profile's constants (:data:`CONSTANTS`: fresh, fresh x seqs, 1, seqs, the
    all-reduces) and each step's end time. A run whose engine overlaps its CPU time with
    the forward (a step is max(forward, CPU)) is linearized at the constants ``c``: a
    step whose CPU time outlasts its forward is that CPU time, any other its forward."""
    tr = r["trace"]
    n_ar = float(r.get("allreduces", 0))
    fwd = np.array([s[0] for s in tr], dtype=np.float64) \
        - n_ar * float(r.get("allreduce_latency", 0.0))
    seqs = np.array([s[1] for s in tr], dtype=np.float64)
    fresh = np.array([1.0 if s[2] else 0.0 for s in tr])
    x = np.stack([fresh, fresh * seqs, np.ones_like(seqs), seqs,
                  np.full_like(seqs, n_ar)], axis=1)
    if r.get("overlap_cpu") and c is not None:
        cpu_bound = x @ c > fwd
        fwd = np.where(cpu_bound, 0.0, fwd)
        x = x * cpu_bound[:, None]
    return fwd, x, np.array([s[3] for s in tr], dtype=np.float64)


def _figure_rows(point: dict[str, Any], r: dict[str, Any], c: np.ndarray | None = None
                 ) -> list[tuple[str, float, np.ndarray, float]]:
    """Each fitted figure of a traced run as ``(metric, base, a, published)``:
    predicted = base + a . constants, exactly, while the schedule stays the one traced (it
    does not depend on time when every request is there at t=0; an open loop at light
    load keeps it to first order, and has no throughput figure here: its length is its
    arrivals'). A run's length for a
    throughput figure (its tokens or requests over the figure); a request's end-to-end
    time, the sum of the steps up to the one that finished it and its served front end; a
    mean TPOT, each request's steps after its first token over its output tokens - 1. A
    median is the median request's (two middle ones averaged). A closed loop's run is
    longer by its clients' front ends (harness.roofline_tools.closed_loop: a constant
    here, taken at the traced finishes). ``c``: the constants an overlapping engine's
    steps are linearized at (:func:`_steps`; default the run's own)."""
    now = _current(point, r)
    fwd, x, t_end = _steps(r, now if c is None else c)
    cf = np.concatenate([[0.0], np.cumsum(fwd)])
    cx = np.vstack([np.zeros((1, x.shape[1])), np.cumsum(x, axis=0)])
    # The steps that ended by time t (a token's time is the clock at the end of the step
    # that made it; the requests' times come back through milliseconds: a tolerance).
    at = lambda t: int(np.searchsorted(t_end, t + 1e-9 * max(1.0, t), side="right"))  # noqa: E731
    reqs = r["requests"]
    # When each request was sent: at t=0, or in a closed loop of c clients when the
    # finish that freed its slot came (:func:`predicted`), itself a step's end.
    clients = int(point.get("concurrency", 0))
    sent = [q[0] for q in reqs]
    front = [q[5] for q in reqs]
    extra = 0.0
    if clients:
        fin = [q[2] for q in reqs]
        sent, client = closed_loop(fin, clients)
        extra = front_end_extra(fin, front, client)
    fig = point["figures"]
    out: list[tuple[str, float, np.ndarray, float]] = []
    for metric, pub in fig.items():
        kind = CLAIMED.get(metric)
        if kind == "throughput":
            if point.get("rate", 0) > 0:  # an open loop's length is its arrivals', not its steps'
                continue
            work = {"output_tokens_per_s": r["output_tokens"], "requests_per_s":
                    point["num_prompts"],
                    "total_tokens_per_s": r["output_tokens"] + r["prompt_tokens"]}[metric]
            out.append((metric, float(cf[-1]) + extra, cx[-1], work / pub))
            continue
        if metric.startswith("e2e_ms"):
            per = [(cf[at(q[2])] - cf[at(arr)] + fe, cx[at(q[2])] - cx[at(arr)])
                   for arr, q, fe in zip(sent, reqs, front)]
        elif metric.startswith("tpot_ms"):
            per = [((cf[at(fin)] - cf[at(first)]) / (n - 1),
                    (cx[at(fin)] - cx[at(first)]) / (n - 1))
                   for _, first, fin, n, *_ in reqs if n > 1]
        else:
            continue  # TTFT and ITL are not fitted
        if not per:  # (no request with two tokens: no TPOT to fit)
            continue
        if metric.endswith("_median"):  # the median request at the linearization point
            lin = now if c is None else c
            per = sorted(per, key=lambda p: float(p[0] + p[1] @ lin))
            mid = per[(len(per) - 1) // 2: len(per) // 2 + 1]
        else:
            mid = per
        out.append((metric, float(np.mean([m[0] for m in mid])),
                    np.mean([m[1] for m in mid], axis=0), pub / 1e3))
    return out


def _current(point: dict[str, Any], r: dict[str, Any]) -> np.ndarray:
    """The constants the traced run ran with (its engine profile's, the latency its step
    model used)."""
    from harness.roofline.engines import PROFILES

    prof = PROFILES[point["engine"]]
    c = [float(getattr(prof, k) or 0.0) for k in CONSTANTS]
    c[CONSTANTS.index("allreduce_latency_s")] = float(r.get("allreduce_latency", 0.0))
    return np.array(c)


# Where a multi-start fit of an engine that overlaps its CPU time with the forward
# begins: each fitted per-sequence term at each of these seconds (the fixed terms of such
# an engine are not fitted: _fit_cpu). Its least squares has no column where no step's
# CPU time outlasts its forward (a start under which none does falls to 0), so the
# starts reach CPU times of the order of a large batch's forward (~100 ms at ~500
# sequences).
OVERLAP_STARTS = (0.0, 25e-6, 50e-6, 100e-6, 200e-6, 400e-6)
PER_SEQ = (CONSTANTS.index("schedule_per_seq_s"), CONSTANTS.index("step_per_seq_s"))


def fit_engine(runs: list[tuple[dict[str, Any], dict[str, Any]]],
               keys: tuple[int, ...]) -> dict[str, float]:
    """Non-negative least squares on the relative error of every fitted figure of each
    run (:func:`_figure_rows`), over the constants ``keys`` (indices into
    :data:`CONSTANTS`); each run weighs the same whatever its number of figures.

    An engine that overlaps its CPU time with the forward (a step is max(forward, CPU))
    is not affine in the constants: its least squares is linearized at a point and solved
    again at each solution until the steps it linearizes at settle. Started where no
    step's CPU time outlasts its forward, that iteration has nothing to fit and falls to
    0, so it starts from the profile's constants and from :data:`OVERLAP_STARTS`, and the
    solution whose exact error (its least squares at its own point) is least is kept."""
    c = _current(*runs[0]) if runs else np.zeros(len(CONSTANTS))
    c[[i for i in range(4) if i not in keys]] = 0.0  # (the CPU terms not fitted are 0)
    if not any(r.get("overlap_cpu") for _, r in runs):
        return _as_constants(_solve(*_system(runs, keys, c)), keys)
    starts = [c]
    fitted_per_seq = [k for k in PER_SEQ if k in keys]
    for values in itertools.product(OVERLAP_STARTS, repeat=len(fitted_per_seq)):
        start = c.copy()
        start[fitted_per_seq] = values
        if not any(np.array_equal(start, o) for o in starts):
            starts.append(start)
    best: tuple[float, np.ndarray] | None = None
    for c in starts:
        for _ in range(12):
            new = c.copy()
            new[list(keys)] = _solve(*_system(runs, keys, c))
            if np.allclose(new, c, rtol=1e-6, atol=1e-12):
                break
            c = new
        A, b = _system(runs, keys, c)  # exact at c: its steps linearized at c itself
        err = float(np.sum((A @ c[list(keys)] - b) ** 2))
        if best is None or err < best[0] - 1e-12:
            best = (err, c)
    assert best is not None
    return _as_constants(best[1][list(keys)], keys)


def _as_constants(coef: np.ndarray, keys: tuple[int, ...]) -> dict[str, float]:
    """``coef`` (one per fitted key) as every constant's value (0 for the others)."""
    out = dict.fromkeys(CONSTANTS, 0.0)
    for i, v in zip(keys, coef):
        out[CONSTANTS[i]] = float(v)
    return out


def _system(runs: list[tuple[dict[str, Any], dict[str, Any]]], keys: tuple[int, ...],
            c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`fit_engine`'s least squares ``A x ~ b`` over the constants ``keys``,
    overlapping engines' steps linearized at ``c`` (each figure's relative error: a run
    weighs the same whatever its number of figures)."""
    rows, target = [], []
    ar = CONSTANTS.index("allreduce_latency_s")
    for point, r in runs:
        figs = _figure_rows(point, r, c)
        for _, base, a, pub in figs:
            if ar not in keys:  # not fitted: the spec's latency (the profile's None)
                base += a[ar] * r.get("spec_allreduce_latency", 0.0)
            w = 1.0 / np.sqrt(len(figs))
            rows.append(w * a[list(keys)] / pub)
            target.append(w * (1.0 - base / pub))
    if not rows:
        raise UserError("the CPU fit has no figure to fit: its points publish no "
                        "throughput of a run at t=0, TPOT or end-to-end time")
    return np.array(rows), np.array(target)


def _solve(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares of ``A x ~ b`` (every subset of the columns: the
    optimum is one of them); zeros where no subset has a non-negative solution."""
    n = A.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for k in range(n, 0, -1):
        for sub in itertools.combinations(range(n), k):
            coef, *_ = np.linalg.lstsq(A[:, sub], b, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(n)
            full[list(sub)] = coef
            err = float(np.sum((A @ full - b) ** 2))
            if best is None or err < best[0]:
                best = (err, full)
    return best[1] if best is not None else np.zeros(n)


def do_fit(jobs: int) -> dict[str, Any]:
    """Fit every engine profile with all-at-once points in :data:`FITTED_SETS` and its
    open loops at light load (its CPU constants: the open loops' per-token figures), then
    its served front end to its served points at light load (:func:`fit_served`: open
    loops at a finite rate and closed loops), then the CPU constants again with that front
    end in those points' end-to-end times and closed loops' lengths (the same traces: a
    front end does not change a schedule). The
    API servers between (harness.roofline_tools.api_fit: bursts of ``fit_api`` sources).
    The first pass traces the points with the front end fit_result.json had: a fit run
    again from its own result moves little. Dense models' points only: a
    mixture-of-experts point's error at full load is not yet explained (its expert GEMMs
    have a kernel profile; prefill and scheduling at full load do not:
    docs/results/2026-12-05-whatif-moe-kernels.md); CPU time fitted to it would hide that
    and misprice every dense run (reported, never fitted)."""
    from harness.roofline.engines import PROFILES, reload_fit
    from harness.roofline.models import get_model_spec
    from harness.roofline_tools.api_fit import bursts, fit_api

    sources: dict[str, Any] = {}
    fitted_runs: list[dict[str, Any]] = []
    every: list[dict[str, Any]] = []
    for name in FITTED_SETS:
        s, runs = load(name)
        sources.update(s)
        every += runs
        fitted_runs += [p for p in runs if is_fitted(p, s[p["source"]])
                        and not get_model_spec(p["model"]).num_experts]
    at_once = [p for p in fitted_runs if p["rate"] == 0]
    light = [p for p in fitted_runs if (p["rate"] > 0 or p.get("concurrency"))
             and served(p, sources[p["source"]])
             and any(m.startswith("ttft") for m in p["figures"])]
    online = [p for p in light if p["rate"] > 0]
    res = {r["id"]: r for r in run_all(at_once + online, sources, jobs, trace=True)}
    # The CPU constants' points: every all-at-once run, and the open loops at light load
    # (their per-token figures: what pins the per-step time where the batch is small,
    # which the full batches of the others cannot tell from a per-sequence term when the
    # engine overlaps its CPU time with the forward).
    cpu_pts = at_once + [p for p in online if _light(p, res[p["id"]])]
    result: dict[str, Any] = {"fitted_at": time.strftime("%Y-%m-%d"), "engines": {}}
    _fit_cpu(cpu_pts, res, result)
    FIT_RESULT.write_text(json.dumps(result, indent=1) + "\n")
    reload_fit()  # the served points run with the CPU constants just fitted
    # Each engine's API server, to its served bursts (harness.roofline_tools.api_fit).
    for eng in sorted({p["engine"] for p in every}):
        api = fit_api(eng, bursts(eng, every, sources, served),
                      lambda pts: compare(pts, run_all(pts, sources, jobs)))
        if api is not None:
            result["engines"].setdefault(eng, {"points": [], "sources": []}).update(api)
    FIT_RESULT.write_text(json.dumps(result, indent=1) + "\n")
    reload_fit()
    lres = {r["id"]: r for r in run_all(light, sources, jobs, trace=True)}
    for eng in sorted({p["engine"] for p in light}):
        pts = [(p, lres[p["id"]]) for p in light
               if p["engine"] == eng and "error" not in lres[p["id"]]]
        front = fit_served(pts)
        if front is None:
            continue
        entry = result["engines"].setdefault(eng, {"points": [], "sources": []})
        entry.update(front)
        entry["sources"] = sorted(set(entry["sources"]) | {p["source"] for p, _ in pts})
    FIT_RESULT.write_text(json.dumps(result, indent=1) + "\n")
    reload_fit()
    # The CPU constants again, each served point's requests paying the front end just
    # fitted (what its predicted end-to-end times and closed-loop lengths will carry).
    # The light points' traces are the ones just made at the first pass's constants (an
    # open loop's schedule depends on them; a closed loop's, queued at t=0, does not: its
    # new trace has the same steps).
    res.update({k: v for k, v in lres.items() if k in res and "error" not in v})
    for p in cpu_pts:
        r, fe = res[p["id"]], PROFILES[p["engine"]].frontend_s
        if "requests" in r and served(p, sources[p["source"]]):
            r["requests"] = [(*q[:5], fe(q[4])) for q in r["requests"]]
    _fit_cpu(cpu_pts, res, result)
    FIT_RESULT.write_text(json.dumps(result, indent=1) + "\n")
    reload_fit()
    return result


def _fit_cpu(points: list[dict[str, Any]], res: dict[str, dict[str, Any]],
             result: dict[str, Any]) -> None:
    """Each engine's CPU constants fitted to its traced ``points`` (all-at-once runs and
    open loops at light load; ``res``: their traces), into ``result["engines"]`` (a front
    end fitted before is kept)."""
    from harness.roofline.engines import PROFILES

    for eng in sorted({p["engine"] for p in points}):
        pts = [(p, res[p["id"]]) for p in points
               if p["engine"] == eng and "error" not in res[p["id"]]]
        # An engine whose points all schedule every step cannot tell scheduling from
        # per-step time: fit the per-step pair only. Its all-reduce latency only from
        # per-token latencies (TPOT, end-to-end) at tp > 1, and only where it runs NCCL's
        # (its own kernels' times are published: harness.roofline.allreduce): a throughput
        # at full batch cannot tell it from the per-step time; else the spec's (None).
        multi = any(not s[2] for _, r in pts for s in r["trace"])
        ar = PROFILES[eng].allreduce == "nccl" and any(
            r["allreduces"] and any(CLAIMED.get(m) != "throughput" for m in p["figures"])
            for p, r in pts)
        keys = ((0, 1) if multi else ()) + (2, 3) + ((4,) if ar else ())
        # An engine that overlaps its CPU time with the forward shows a fixed CPU term
        # only where it outlasts a whole forward: at small batches, where what the model
        # misses of the GPU's own time looks the same (a floor under every step, fitted
        # on one model shape and priced on every other). Its per-sequence terms show at
        # full batches, where the CPU time grows past the forward: those alone are fitted.
        overlap = {bool(r.get("overlap_cpu")) for _, r in pts}
        if len(overlap) > 1:
            raise UserError(f"{eng}: its fitted points mix CPU time overlapped with the "
                            "forward and not (async scheduling on some): one profile "
                            "cannot be fitted to both; mark one kind fit: false")
        if overlap == {True}:
            keys = tuple(k for k in keys if k in (*PER_SEQ, 4))
        fitted: dict[str, Any] = fit_engine(pts, keys)
        if not ar:
            fitted["allreduce_latency_s"] = None
        old = result["engines"].get(eng, {})
        kept = {k: v for k, v in old.items() if k.startswith(("request_s", "prompt_token_s",
                                                              "served_points", "api_"))}
        result["engines"][eng] = {**fitted, **kept,
                                  "points": [p["id"] for p, _ in pts],
                                  "sources": sorted({p["source"] for p, _ in pts}
                                                    | set(old.get("sources", ())))}


LIGHT_TTFT_S = 0.2  # a served point's engine-side median TTFT below this: light load


def _engine_ttft(point: dict[str, Any], r: dict[str, Any]) -> np.ndarray:
    """Each request's TTFT as the engine made it in a traced run (no front end), counted
    from when its client sent it (a closed loop's: harness.roofline_tools.closed_loop)."""
    sent = [q[0] for q in r["requests"]]
    if point.get("concurrency"):
        sent, _ = closed_loop([q[2] for q in r["requests"]], int(point["concurrency"]))
    return np.array([q[1] - s for q, s in zip(r["requests"], sent)])


def _light(point: dict[str, Any], r: dict[str, Any], eng: np.ndarray | None = None) -> bool:
    """Whether a traced run is at light load: its engine's median TTFT (``eng``, else
    computed) under :data:`LIGHT_TTFT_S` (no queue)."""
    if eng is None:
        eng = _engine_ttft(point, r) if "requests" in r else np.zeros(0)
    return bool(len(eng)) and float(np.median(eng)) < LIGHT_TTFT_S


def fit_served(runs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any] | None:
    """A served engine's front end, ``request_s + prompt_token_s x prompt tokens`` added to
    each request's TTFT (harness.roofline.engines), by least squares with ``request_s >=
    0`` and ``0 <= prompt_token_s <=`` :data:`TOKENIZE_S` (:func:`_bounded_front_end`) on the
    relative error of every TTFT figure of its served points at light load (the engine's
    own median TTFT under :data:`LIGHT_TTFT_S`: no queue, so what the model misses there
    is the front end, not the schedule). A closed loop's request counts from when its
    client sent it (harness.roofline_tools.closed_loop). None: no such point."""
    rows, target, used = [], [], []
    for point, r in runs:
        eng = _engine_ttft(point, r)
        prompt = np.array([float(q[4]) for q in r["requests"]])
        if not _light(point, r, eng):
            continue
        used.append(point["id"])
        for metric, pub in point["figures"].items():
            if not metric.startswith("ttft"):
                continue
            y = pub / 1e3
            if metric.endswith("_median"):
                k = int(np.argsort(eng)[(len(eng) - 1) // 2])
                base, p = float(eng[k]), float(prompt[k])
            else:
                base, p = float(eng.mean()), float(prompt.mean())
            rows.append([1.0 / y, p / y])
            target.append(1.0 - base / y)
    if not rows:
        return None
    a, per = _bounded_front_end(np.array(rows), np.array(target))
    return {"request_s": float(a), "prompt_token_s": float(per), "served_points": used}


# A front end's time a prompt token is its tokenizer's (the rest of a request's path,
# HTTP, templating, queueing for the engine, does not grow with the prompt): a BPE
# tokenizer encodes at 1.1-1.9 us a token on one core of this machine's AMD EPYC
# (scripts/tokenizer_cost.py, 2026-12-05: SmolLM2's 49k-entry BPE, best to median of five
# passes over three runs under varying load), above every median here. The served models'
# own tokenizers (Llama-3's 128k entries, Qwen's) were not at hand (no Hugging Face hub
# here): a bound to measure again with them, on a server's CPU. Unbounded, the fit had
# priced what the step model misses of long prompts' prefill at light load (SGLang
# 0.4.0's 41 us a token, trtllm-serve's 18) as a front end every served request of every
# host pays.
TOKENIZE_S = 2e-6


def _bounded_front_end(A: np.ndarray, b: np.ndarray, cap: float = TOKENIZE_S
                       ) -> tuple[float, float]:
    """Least squares of ``A [a, per] ~ b`` with ``a >= 0`` and ``0 <= per <= cap``: the
    non-negative solution where it keeps under the cap, else ``per = cap`` and ``a`` the
    non-negative fit of the rest (the objective is convex: from a point of the box off
    that face, the way toward the non-negative optimum past the cap goes down and stays in
    the box, so the box's optimum is on it)."""
    a, per = _solve(A, b)
    if per <= cap:
        return float(a), float(per)
    (a,) = _solve(A[:, :1], b - cap * A[:, 1])
    return float(a), cap


# -- the report -----------------------------------------------------------------------
def compare(points: list[dict[str, Any]], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from harness.roofline.engines import PROFILES

    by = {r["id"]: r for r in results}
    rows = []
    for p in points:
        r = by[p["id"]]
        run = {"set": p["set"], "id": p["id"], "source": p["source"], "engine": p["engine"],
               "model": p["model"], "calibrated": PROFILES[p["engine"]].calibrated,
               "gpu": GPU_CLASS.get(p["hardware"], p["hardware"])}
        for metric, pub in p["figures"].items():
            row = {**run, "metric": metric, "kind": CLAIMED.get(metric, "other"),
                   "published": pub}
            if "error" in r:  # counted as a 100% miss, with its reason
                row.update(predicted=float("nan"), error_pct=100.0, failed=r["error"])
            else:
                pred = r["pred"][metric]
                row.update(predicted=pred, error_pct=100.0 * (pred / pub - 1.0))
            rows.append(row)
    return rows


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median and worst |error| per (set, calibrated profile or prior, metric kind)."""
    out = []
    keyf = lambda r: (r["set"], r["calibrated"], r["kind"])  # noqa: E731
    for key, grp in itertools.groupby(sorted(rows, key=keyf), key=keyf):
        errs = [abs(r["error_pct"]) for r in grp]
        out.append({"set": key[0], "profile": "calibrated" if key[1] else "prior",
                    "kind": key[2], "n": len(errs), "median_abs_pct": statistics.median(errs),
                    "worst_abs_pct": max(errs)})
    return out


def bands(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Validated error per engine profile and GPU class (claimed metrics only), from dense
    models' points: the band is what a dense run records (an MoE or hybrid run records
    none, harness.roofline.bands)."""
    from harness.roofline.models import get_model_spec

    out: dict[str, Any] = {}
    keyf = lambda r: (r["engine"], r["gpu"], r["kind"])  # noqa: E731
    claimed = [r for r in rows if r["set"] == "validation" and r["kind"] != "other"
               and not get_model_spec(r["model"]).num_experts]
    for (eng, gpu, kind), grp in itertools.groupby(sorted(claimed, key=keyf), key=keyf):
        errs = [abs(r["error_pct"]) for r in grp]
        out.setdefault(eng, {}).setdefault(gpu, {})[kind] = {
            "median_abs_pct": round(statistics.median(errs), 1),
            "worst_abs_pct": round(max(errs), 1), "n": len(errs)}
    return out


def _stats(errs: list[float]) -> dict[str, Any]:
    return {"n": len(errs), "median_abs_pct": round(statistics.median(errs), 1) if errs
            else None, "worst_abs_pct": round(max(errs), 1) if errs else None}


def blind_entry(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One line of :data:`BLIND_LOG`: when, at which commit, and the validation rows'
    |error| pooled and per metric kind (throughput, TTFT, TPOT, end-to-end)."""
    val = [r for r in rows if r["set"] == "validation" and r["kind"] != "other"]
    rev = HERE.parents[2] / "SNAPSHOT_REV"  # scripts/snapshot_run.sh's copy
    commit = rev.read_text().strip() if rev.is_file() else _git_head()
    kinds = sorted({r["kind"] for r in val})
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit,
            "pooled": _stats([abs(r["error_pct"]) for r in val]),
            **{k: _stats([abs(r["error_pct"]) for r in val if r["kind"] == k])
               for k in kinds}}


def claim_table(path: Path = BLIND_LOG) -> str:
    """The README's accuracy table: the last run of the whole blind validation set
    (:data:`BLIND_LOG`), pooled and per metric kind."""
    if not path.is_file():
        return "no run of the blind validation set is logged yet"
    last = json.loads(path.read_text().splitlines()[-1])
    lines = [f"Blind validation, {last['date']} (commit {last['commit'][:9]}): |predicted / "
             "published - 1|", "", "| metric | n | median | worst |", "|---|---|---|---|"]
    for k in ("pooled", "throughput", "ttft", "tpot", "e2e"):
        v = last.get(k)
        if v and v["n"]:
            lines.append(f"| {k} | {v['n']} | {v['median_abs_pct']}% | {v['worst_abs_pct']}% |")
    return "\n".join(lines)


def _git_head() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=HERE, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def figure_table(rows: list[dict[str, Any]]) -> list[str]:
    """Every figure as a markdown table: predicted against published."""
    head = ["| set | run | engine | metric | published | predicted | error % |",
            "|---|---|---|---|---|---|---|"]
    return head + [
        f"| {r['set']} | {r['id']} | {r['engine']}{'' if r['calibrated'] else ' (prior)'}"
        f" | {r['metric']} | {r['published']:.4g} | {r['predicted']:.4g} | "
        f"{r['error_pct']:+.1f} |" for r in rows]


def markdown(rows: list[dict[str, Any]]) -> str:
    summ = ["", "| set | profile | metric kind | n | median abs. error % | worst % |",
            "|---|---|---|---|---|---|"]
    summ += [f"| {s['set']} | {s['profile']} | {s['kind']} | {s['n']} | "
             f"{s['median_abs_pct']:.1f} | {s['worst_abs_pct']:.1f} |" for s in summary(rows)]
    return "\n".join([*figure_table(rows), *summ])


def measured_specs() -> str:
    """The specs calibrated on their own hardware (``<spec>_calibration.json``: the cpu
    here, the h200 once the GPU check has run): their held-out errors, for the same table
    (those runs are this engine's, ``roofline.engine=kvbench``)."""
    from harness.roofline.hardware import calibration_path

    out = ["", "| calibrated spec | held-out step error (median) | throughput error "
           "(median / worst) |", "|---|---|---|"]
    for name in ("cpu", "h200"):
        path = calibration_path(name)
        if path.is_file():
            s = json.loads(path.read_text())["summary"]
            out.append(f"| {name} | {s['held_out_step_mdape_pct']:.1f}% | "
                       f"{s['held_out_throughput_mdape_pct']:.1f}% / "
                       f"{s['held_out_throughput_max_ape_pct']:.1f}% |")
    return "\n".join(out) if len(out) > 3 else ""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", default="all",
                    choices=("fit", "calibration", "validation", "fitted", "both", "all"),
                    help="fitted: fit and calibration (what --fit reads); both: fit and "
                         "validation; all: the three sets")
    ap.add_argument("--fit", action="store_true", help="fit the engine profiles first")
    ap.add_argument("--only", default="", help="comma-separated run ids")
    ap.add_argument("--source", default="", help="only the runs of these sources (comma-separated)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="", help="also write the rows as JSON here (and, as "
                    "the run goes, those done so far to OUT.partial)")
    ap.add_argument("--claim", action="store_true", help="print the README's accuracy "
                    "table (the last logged run of the blind validation set) and exit")
    args = ap.parse_args(argv)
    if args.claim:
        print(claim_table())
        return
    if args.fit:
        print(json.dumps(do_fit(args.jobs), indent=1))
        import importlib

        import harness.roofline.engines as engines

        importlib.reload(engines)  # the profiles now read the new fit
    names = {"both": ("fit", "validation"), "fitted": FITTED_SETS,
             "all": tuple(SETS)}.get(args.set, (args.set,))
    points: list[dict[str, Any]] = []
    sources: dict[str, Any] = {}
    for n in names:
        s, r = load(n)
        sources.update(s)
        points += r
    if args.only:
        keep = set(args.only.split(","))
        points = [p for p in points if p["id"] in keep]
    if args.source:
        srcs = set(args.source.split(","))
        points = [p for p in points if p["source"] in srcs]
    t0 = time.perf_counter()
    partial = Path(f"{args.out}.partial") if args.out else None
    rows = compare(points, run_all(points, sources, args.jobs, partial=partial))
    if partial is not None:
        partial.unlink(missing_ok=True)
    print(markdown(rows))
    print(measured_specs())
    print(f"\n({len(points)} runs, {time.perf_counter() - t0:.0f} s)")
    if "validation" in names and not args.only:
        # Every run of the sources it ran (all of them without --source): the bands say
        # which, so that a band from part of the set reads as such.
        ran = sorted({p["source"] for p in points if p["set"] == "validation"})
        VALIDATION_RESULT.write_text(json.dumps(
            {"validated_at": time.strftime("%Y-%m-%d"), "sources": ran,
             "all_sources": not args.source, "bands": bands(rows)}, indent=1) + "\n")
        if not args.source:  # the protocol: every run of the blind set is reported
            with BLIND_LOG.open("a") as f:
                f.write(json.dumps(blind_entry(rows)) + "\n")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
