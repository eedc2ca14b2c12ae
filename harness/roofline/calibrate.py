"""Calibrate the ``cpu`` hardware spec from this machine, then predict held-out runs.

    python -m harness.roofline.calibrate [--repeats 3] [--out harness/roofline/cpu_calibration.json]

1. **Profile** (harness.roofline.profile): the default model's own GEMMs at each row count
   give the spec's GEMM profile, its fp32 peak and its weight-streaming bandwidth.
2. **Measure**: short real runs (``executor=model``, SmolLM2-135M fp32, 1 thread, all
   requests at once, so the schedule does not depend on timing: repeats give the same
   steps, and each step's time is the median over the repeats, taken round-robin over
   the configs). A recorder around the model executor keeps each step's shape
   (harness.roofline.shape).
3. **Fit** on the training runs, by bounded linear least squares on the relative error
   (the spec's step time is linear in its inverse efficiencies on a CPU, where nothing
   overlaps): ``eff_profile`` (the real GEMMs against the profiled ones: norms, RoPE and
   activations ride along), ``eff_attn`` and ``eff_bw`` (<= 1: the torch attention path
   against the peak and the bandwidth), ``step_overhead_s`` and ``per_seq_overhead_s``.
4. **Validate** on held-out runs (another workload, other batch mixes, two other
   backends): the median absolute error of step time over their steps, and of each
   run's throughput (its output tokens over the sum of predicted step times). The random
   held-out runs are also replayed end to end under ``executor=roofline`` on the written
   spec.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness.engine.executor import Executor, StepOutput
from harness.engine.sampler import Sampler
from harness.kv.base import StepScores
from harness.roofline.hardware import CALIBRATION, HardwareSpec, spec_from_calibration
from harness.roofline.models import MODEL_SPECS
from harness.roofline.profile import GemmProfile, kv_dtype_of, profile_gemms
from harness.roofline.shape import KVReads, StepShape, step_shape
from harness.roofline.steptime import StepModel, StepWork
from harness.sched.step import StepRecord

BASE = ["device=cpu", "cpu_threads=1", "model.dtype=float32", "quality.enabled=false",
        "cache.kv_budget=64MiB"]
RANDOM = ["workload=random", "workload.num_requests=16", "workload.input_max=384",
          "workload.output_min=4", "workload.output_max=48", "workload.output_mean=24",
          "workload.output_std=16"]
TRAIN: dict[str, list[str]] = {
    "random-paged-b16": [*RANDOM, "scheduler.max_num_seqs=16"],
    "random-paged-b4-long": [*RANDOM, "scheduler.max_num_seqs=4", "workload.input_mean=300",
                             "workload.input_min=128", "workload.num_requests=8"],
    "shared_prefix-paged": ["workload=shared_prefix", "workload.num_requests=12",
                            "workload.output_tokens=16"],
    "random-paged-b16-chunk128": [*RANDOM, "scheduler.max_num_seqs=16",
                                  "scheduler.max_num_batched_tokens=128", "workload.seed=9"],
}
HELD_OUT: dict[str, list[str]] = {
    "multiturn-paged": ["workload=multiturn", "workload.conversations=4", "workload.turns=2",
                        "workload.answer_tokens=24", "workload.system_words=60"],
    "random-contiguous-exact-b32": [*RANDOM, "backend=contiguous", "backend.reserve=exact",
                                    "scheduler.max_num_seqs=32", "workload.num_requests=24",
                                    "workload.seed=7"],
    "random-int8-b8": [*RANDOM, "backend=int8", "scheduler.max_num_seqs=8", "workload.seed=3"],
    # Chunked prefill at 128 tokens a step: every prefill shares its steps with decodes.
    "random-fp8-b16-chunk128": [*RANDOM, "backend=fp8", "scheduler.max_num_seqs=16",
                                "scheduler.max_num_batched_tokens=128", "workload.seed=5"],
    "random-sliding_window-b16": [*RANDOM, "backend=sliding_window", "backend.window=64",
                                  "scheduler.max_num_seqs=16", "workload.seed=11"],
}
FIT_KEYS = ("eff_profile", "eff_attn", "eff_bw", "step_overhead_s", "per_seq_overhead_s")


class Recorder:
    """An executor around another that keeps every step's shape."""

    def __init__(self, inner: Executor, reads: KVReads) -> None:
        self.inner, self.reads = inner, reads
        self.shapes: list[StepShape] = []

    @property
    def clock(self) -> Any:
        return self.inner.clock

    def apply_cache_ops(self, rec: StepRecord) -> None:
        self.inner.apply_cache_ops(rec)

    def forward(self, rec: StepRecord) -> StepOutput:
        self.shapes.append(step_shape(rec, self.reads))
        return self.inner.forward(rec)

    def take_scores(self) -> StepScores | None:
        return self.inner.take_scores()


@dataclass
class Measured:
    name: str
    overrides: list[str]
    shapes: list[StepShape]
    step_s: np.ndarray  # median over repeats, per step
    out_tokens: int
    bytes_per_slot: int
    walls: list[float] = field(default_factory=list)
    kv_dtype: str = ""  # the stored K/V dtype's name (profile.kv_dtype_of)

    def work(self, model: StepModel) -> StepWork:
        """The steps' work as arrays, one entry per step."""
        ws = [model.work_of(sh) for sh in self.shapes]
        return StepWork(*[np.array([getattr(w, f.name) for w in ws], dtype=np.float64)  # type: ignore[arg-type]
                          for f in dataclasses.fields(StepWork)])


def compose(overrides: list[str]) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from harness.config import register_configs

    register_configs()
    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


Run = tuple[list[StepShape], list[float], int, float, int, str]


def run_once(overrides: list[str], loaded: Any) -> Run:
    """One real run of a config: its step shapes, step seconds, output tokens, wall
    seconds, the backend's bytes per slot and stored dtype."""
    from harness.config import run_config
    from harness.stack import build_stack
    from harness.workloads import make_workload

    rc = run_config(compose([*BASE, *overrides]))
    if rc.workload.seed is None:
        rc.workload.seed = rc.seed
    torch.manual_seed(rc.seed)
    wl = make_workload(rc.workload, loaded.tokenizer)
    st = build_stack(loaded, torch.device("cpu"), rc.backend, rc.cache, rc.scheduler,
                     Sampler(rc.seed), wl.initial_requests(), quiet=True)
    rec = Recorder(st.engine.executor, KVReads(st.backend))
    st.engine.executor = rec
    wall = st.engine.run(wl)
    out = sum(len(g.output_ids) for g in st.collector.groups.values())
    return (rec.shapes, [r.step_ms / 1e3 for r in st.collector.steps], out, wall,
            st.backend.bytes_per_slot(), kv_dtype_of(st.backend))


def measure(configs: dict[str, list[str]], repeats: int, loaded: Any) -> list[Measured]:
    """``repeats`` real runs of every config, taken round-robin (repeat 1 of each, then
    repeat 2, ...: this shared machine's speed drifts by several % over minutes, and
    interleaving puts the drift into every config's median alike instead of into the
    gap between training and held-out runs); per-step medians (the steps must agree)."""
    runs: dict[str, list[Run]] = {k: [] for k in configs}
    for _ in range(repeats):
        for name, overrides in configs.items():
            runs[name].append(run_once(overrides, loaded))
    out = []
    for name, rs in runs.items():
        n = {len(r[1]) for r in rs}
        if len(n) != 1 or len({r[2] for r in rs}) != 1:
            raise RuntimeError(f"{name}: repeats disagree on the schedule ({n} steps): the "
                               "calibration runs must not depend on timing")
        step_s = np.median(np.array([r[1] for r in rs]), axis=0)
        shapes, _, tokens, _, bps, kv_dtype = rs[0]
        out.append(Measured(name, configs[name], shapes, step_s, tokens, bps,
                            [r[3] for r in rs], kv_dtype))
    return out


def step_model(m: Measured, hw: HardwareSpec) -> StepModel:
    return StepModel(MODEL_SPECS["smollm2-135m"], hw, m.bytes_per_slot, "fp32", 4.0,
                     kv_dtype=m.kv_dtype)


def predict(m: Measured, hw: HardwareSpec) -> np.ndarray:
    model = step_model(m, hw)
    return np.asarray(model.time(m.work(model), hw).total, dtype=np.float64)


def terms(m: Measured, hw: HardwareSpec) -> tuple[np.ndarray, np.ndarray]:
    """(steps, 5): the columns the step time is linear in — profiled GEMM seconds,
    attention FLOPs, attention bytes, 1, running sequences — on ``hw``'s profile; and
    (steps,) the seconds no factor scales (measured widening, all-reduces)."""
    unit = dataclasses.replace(hw, eff_profile=1.0)
    model = step_model(m, unit)
    w = m.work(model)
    t = model.time(w, unit)
    gemm = np.asarray(t.gemm + t.lm_head, dtype=np.float64)
    cols = np.stack([gemm, w.pre_flops + w.dec_flops, w.pre_bytes + w.dec_bytes,
                     np.ones_like(gemm), np.asarray(w.seqs, dtype=np.float64)], axis=1)
    return cols, np.asarray(w.pre_widen_s + w.dec_widen_s + w.ar_seconds, dtype=np.float64)


def bounded_lsq(a: np.ndarray, b: np.ndarray, lower: np.ndarray) -> np.ndarray:
    """argmin |a x - b|^2 subject to x >= lower: x = lower + y, y >= 0, by trying every
    set of free columns (five columns: 31 small solves) and keeping the best feasible."""
    rhs = b - a @ lower
    n, best, best_y = a.shape[1], np.inf, np.zeros(a.shape[1])
    for mask in range(1, 2 ** n):
        cols = [i for i in range(n) if mask >> i & 1]
        y, *_ = np.linalg.lstsq(a[:, cols], rhs, rcond=None)
        if (y < 0).any():
            continue
        r = float(np.sum((a[:, cols] @ y - rhs) ** 2))
        if r < best:
            best, best_y = r, np.zeros(n)
            best_y[cols] = y
    return lower + best_y


def fit(train: list[Measured], hw: HardwareSpec) -> HardwareSpec:
    """The factors minimizing the training steps' squared relative error, with the
    attention's efficiencies at most 1 and the overheads at least 0."""
    parts = [terms(m, hw) for m in train]
    a = np.concatenate([c / m.step_s[:, None] for (c, _), m in zip(parts, train)])
    b = np.concatenate([1 - f / m.step_s for (_, f), m in zip(parts, train)])
    peak, bw = hw.flops("fp32"), hw.mem_bw
    x = bounded_lsq(a, b, np.array([1e-3, 1 / peak, 1 / bw, 0.0, 0.0]))
    return dataclasses.replace(hw, eff_profile=float(1 / x[0]),
                               eff_attn=float(1 / (x[1] * peak)),
                               eff_bw=float(1 / (x[2] * bw)), step_overhead_s=float(x[3]),
                               per_seq_overhead_s=float(x[4]), source="calibrated")


def errors(m: Measured, hw: HardwareSpec) -> dict[str, float]:
    pred = predict(m, hw)
    rel = np.abs(pred - m.step_s) / m.step_s
    tput_meas = m.out_tokens / float(m.step_s.sum())
    tput_pred = m.out_tokens / float(pred.sum())
    return {"steps": len(pred), "step_mdape_pct": 100 * float(np.median(rel)),
            "step_p90_ape_pct": 100 * float(np.percentile(rel, 90)),
            "throughput_meas": tput_meas, "throughput_pred": tput_pred,
            "throughput_ape_pct": 100 * abs(tput_pred - tput_meas) / tput_meas}


def end_to_end(m: Measured) -> dict[str, float]:
    """The same config under executor=roofline on the fitted cpu spec (read from disk)."""
    from harness.config import run_config
    from harness.runner import run

    rc = run_config(compose([*BASE, *m.overrides, "executor=roofline",
                             "roofline.model=SmolLM2-135M", "roofline.hardware=cpu",
                             "roofline.dtype=float32", "roofline.weight_dtype=float32",
                             "progress=false"]))
    r = run(rc).metrics
    meas = m.out_tokens / float(m.step_s.sum())
    return {"roofline_run_throughput": r["throughput.output_tokens_per_s"],
            "roofline_run_steps": r["sched.steps"],
            "roofline_run_throughput_ape_pct":
                100 * abs(r["throughput.output_tokens_per_s"] - meas) / meas}


def profiled_prior(prof: GemmProfile) -> HardwareSpec:
    """The prior cpu spec with the profile's peak, bandwidth and table (factors still priors)."""
    return spec_from_calibration({
        "fit": {}, "profile": prof.as_json(),
        "measured": {"peak_flops_fp32": prof.peak_flops, "mem_bw": prof.mem_bw,
                     "widen_s_per_elem": prof.widen_s_per_elem}})


def main(argv: list[str] | None = None) -> None:
    from harness.model import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=CALIBRATION)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    loaded = load_model("smollm2", dtype=torch.float32, device="cpu")
    prof = profile_gemms(loaded.model, args.repeats)
    both = measure({**TRAIN, **HELD_OUT}, args.repeats, loaded)
    train, held = both[:len(TRAIN)], both[len(TRAIN):]
    hw = fit(train, profiled_prior(prof))
    report: dict[str, Any] = {
        "fit": {k: getattr(hw, k) for k in FIT_KEYS},
        "measured": {"peak_flops_fp32": prof.peak_flops, "mem_bw": prof.mem_bw,
                     "widen_s_per_elem": prof.widen_s_per_elem},
        "profile": prof.as_json(),
        "model": "SmolLM2-135M-Instruct fp32, 1 thread", "repeats": args.repeats,
        "machine": f"{platform.processor() or platform.machine()}, "
                   f"{torch.get_num_threads()} thread(s) used",
        "load_average": list(os.getloadavg()),
        "caveat": "a shared 2-core machine: other processes' load moves step times; each "
                  "step is the median of the repeats",
        "train": {m.name: errors(m, hw) for m in train},
        "held_out": {m.name: errors(m, hw) for m in held},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for m in held:  # hardware=cpu reads the default file: only when that is the one written
        if "workload=random" in m.overrides and args.out.resolve() == CALIBRATION:
            report["held_out"][m.name].update(end_to_end(m))
    ho = report["held_out"].values()
    report["summary"] = {
        "held_out_step_mdape_pct": statistics.median(
            float(e) for m in held for e in
            100 * np.abs(predict(m, hw) - m.step_s) / m.step_s),
        "held_out_throughput_mdape_pct": statistics.median(e["throughput_ape_pct"]
                                                           for e in ho),
        "held_out_throughput_max_ape_pct": max(e["throughput_ape_pct"] for e in ho),
        "seconds": time.perf_counter() - t0,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["summary"], indent=2))
    for name, e in report["held_out"].items():
        print(f"{name}: step MdAPE {e['step_mdape_pct']:.1f}%, throughput error "
              f"{e['throughput_ape_pct']:.1f}%"
              + (f", roofline run {e['roofline_run_throughput_ape_pct']:.1f}%"
                 if "roofline_run_throughput_ape_pct" in e else ""))


if __name__ == "__main__":
    main()
