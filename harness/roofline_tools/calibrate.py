"""Calibrate a hardware spec from real runs on it, then predict held-out runs.

    python -m harness.roofline_tools.calibrate [--target cpu|h200|dry] [--repeats 3] [--out F]

The targets (harness.roofline_tools.targets): ``cpu`` (this machine, SmolLM2-135M fp32, one
thread; the default), ``h200`` (the GPU check runs it: Llama-3.1-8B's shape, bf16, the
Triton kernels) and ``dry`` (the h200 code path on the CPU at tiny sizes). The report goes
to the spec's calibration file (``hardware.calibration_path``), which
``roofline.hardware=<spec>`` reads.

1. **Profile** (harness.roofline.profile): the model's own GEMMs at each row count give
   the spec's GEMM profile, its peak and its weight-streaming bandwidth; and the widening
   of 1-byte caches.
2. **Measure**: short real runs (``executor=model``, all requests at once, so the schedule
   does not depend on timing: repeats give the same steps, and each step's time is the
   median over the repeats, taken round-robin over the configs). A recorder around the
   model executor keeps each step's shape (harness.roofline.shape).
3. **Fit** on the training runs, by bounded linear least squares on the relative error
   (the step time is linear in the spec's inverse efficiencies, once each attention term's
   binding side is known; on one CPU core nothing overlaps): ``eff_profile`` (the real
   GEMMs against the profiled ones: norms, RoPE and activations ride along), ``eff_attn``
   and ``eff_bw`` (<= 1), ``step_overhead_s`` and ``per_seq_overhead_s``.
4. **Validate** on held-out runs (another workload, other batch mixes, other backends):
   the median absolute error of step time over their steps, and of each run's throughput
   (its output tokens over the sum of predicted step times). The random held-out runs are
   also replayed end to end under ``executor=roofline`` on the written spec.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness.backends.costs import KVCosts
from harness.engine.executor import Executor, StepOutput
from harness.engine.sampler import Sampler
from harness.kv.base import KVManager, StepScores
from harness.roofline.arch import ArchSpec
from harness.roofline.hardware import (
    CPU_PRIOR,
    HARDWARE,
    HardwareSpec,
    calibration_path,
    spec_from_calibration,
)
from harness.roofline.models import MODEL_SPECS, arch_of, hf_config_of
from harness.roofline.profile import GemmProfile, dtype_name, kv_dtype_of, profile_gemms
from harness.roofline.shape import StepShape, step_shape
from harness.roofline.steptime import StepModel, StepWork
from harness.roofline_tools.targets import BASE, TARGETS, Target
from harness.sched.step import StepRecord

FIT_KEYS = ("eff_profile", "eff_attn", "eff_bw", "step_overhead_s", "per_seq_overhead_s")


class Recorder:
    """An executor around another that keeps every step's shape (as the roofline reads
    it: the backend's declared costs of what the KV manager holds)."""

    def __init__(self, inner: Executor, costs: KVCosts) -> None:
        self.inner, self.costs = inner, costs
        self.kv: KVManager | None = None
        self.shapes: list[StepShape] = []

    @property
    def clock(self) -> Any:
        return self.inner.clock

    def bind(self, kv: KVManager) -> None:
        self.kv = kv
        self.inner.bind(kv)

    def apply_cache_ops(self, rec: StepRecord) -> None:
        self.inner.apply_cache_ops(rec)

    def forward(self, rec: StepRecord) -> StepOutput:
        assert self.kv is not None
        self.shapes.append(step_shape(rec, self.costs, self.kv))
        return self.inner.forward(rec)

    def take_scores(self) -> StepScores | None:
        return self.inner.take_scores()

    @property
    def transfer_s(self) -> float:
        return self.inner.transfer_s

    @property
    def transfer_exposed_s(self) -> float:
        return self.inner.transfer_exposed_s


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
    arch: ArchSpec = MODEL_SPECS["smollm2-135m"]  # the model the runs ran
    compute: str = "fp32"  # its compute dtype, and bytes per weight
    weight_bytes: float = 4.0
    attention: str = ""  # how it ran: "fused" | "gather" ("": as the spec says)

    def work(self, model: StepModel) -> StepWork:
        """The steps' work as arrays, one entry per step."""
        ws = [model.work_of(sh) for sh in self.shapes]
        return StepWork(*[np.array([getattr(w, f.name) for w in ws], dtype=np.float64)  # type: ignore[arg-type]
                          for f in dataclasses.fields(StepWork)])


def compose(overrides: list[str]) -> Any:
    from harness.config import compose_config

    return compose_config(overrides)


Run = tuple[list[StepShape], list[float], int, float, int, str, str]


def run_once(overrides: list[str], loaded: Any, base: list[str] = BASE,
             device: str = "cpu") -> Run:
    """One real run of a config: its step shapes, step seconds, output tokens, wall
    seconds, the backend's bytes per slot and stored dtype, and how its attention ran
    ("fused" kernels, or the torch "gather" path: what the step model then counts)."""
    from harness.config import run_config
    from harness.stack import build_stack
    from harness.workloads import make_workload
    from harness.workloads.base import request_shapes

    rc = run_config(compose([*base, *overrides]))
    if rc.workload.seed is None:
        rc.workload.seed = rc.seed
    torch.manual_seed(rc.seed)
    wl = make_workload(rc.workload, loaded.tokenizer)
    st = build_stack(loaded, torch.device(device), rc.backend, rc.cache, rc.scheduler,
                     Sampler(rc.seed), request_shapes(wl), quiet=True)
    rec = Recorder(st.engine.executor, st.backend.costs())
    rec.bind(st.kv)
    st.engine.executor = rec
    wall = st.engine.run(wl)
    out = sum(len(o) for o in st.collector.outputs().values())
    return (rec.shapes, [r.step_ms / 1e3 for r in st.collector.steps], out, wall,
            st.backend.bytes_per_slot(), kv_dtype_of(st.backend),
            "gather" if st.backend.kernel == "torch" else "fused")


def measure(configs: dict[str, list[str]], repeats: int, loaded: Any,
            target: Target | None = None) -> list[Measured]:
    """``repeats`` real runs of every config, taken round-robin (repeat 1 of each, then
    repeat 2, ...: this shared machine's speed drifts by several % over minutes, and
    interleaving puts the drift into every config's median alike instead of into the
    gap between training and held-out runs); per-step medians (the steps must agree)."""
    t = target or TARGETS["cpu"]
    arch = arch_of(loaded.model.config)
    compute = dtype_name(loaded.model.dtype)
    runs: dict[str, list[Run]] = {k: [] for k in configs}
    for _ in range(repeats):
        for name, overrides in configs.items():
            runs[name].append(run_once(overrides, loaded, t.base, t.device))
    out = []
    for name, all_runs in runs.items():
        rs = agreeing(all_runs)
        step_s = np.median(np.array([r[1] for r in rs]), axis=0)
        shapes, _, tokens, _, bps, kv_dtype, attention = rs[0]
        out.append(Measured(name, configs[name], shapes, step_s, tokens, bps,
                            [r[3] for r in rs], kv_dtype, arch, compute,
                            loaded.model.dtype.itemsize, attention))
    return out


def agreeing(runs: list[Run]) -> list[Run]:
    """The repeats with the most common schedule (step count, output tokens): a step's
    median needs the same steps in each. The calibration configs do not depend on
    timing, but on a GPU a near-tie between two tokens may round either way from run to
    run, and a different token can end a sequence sooner; such a repeat is left out (the
    report's ``repeats_used`` says so) rather than failing the calibration."""
    keys = [(len(r[1]), r[2]) for r in runs]
    best = max(set(keys), key=lambda k: (keys.count(k), -keys.index(k)))
    return [r for r, k in zip(runs, keys) if k == best]


def step_model(m: Measured, hw: HardwareSpec) -> StepModel:
    if m.attention and m.attention != hw.attention:  # a run is modelled as it ran
        hw = dataclasses.replace(hw, attention=m.attention)
    return StepModel(m.arch, hw, m.bytes_per_slot, m.compute, m.weight_bytes,
                     kv_dtype=m.kv_dtype)


def predict(m: Measured, hw: HardwareSpec) -> np.ndarray:
    model = step_model(m, hw)
    return np.asarray(model.time(m.work(model), hw).total, dtype=np.float64)


def terms(m: Measured, hw: HardwareSpec) -> tuple[np.ndarray, np.ndarray]:
    """(steps, 5): the columns the step time is linear in — profiled GEMM seconds,
    attention FLOPs, attention bytes, 1, running sequences — on ``hw``'s profile; and
    (steps,) the seconds no factor scales (measured widening, all-reduces).

    An attention term is max(c, m) + (1 - overlap) min(c, m): linear in its FLOPs and
    bytes once it is known which side binds, which ``hw``'s current factors decide (one
    CPU core, overlap 0, adds both whatever binds)."""
    unit = dataclasses.replace(hw, eff_profile=1.0)
    model = step_model(m, unit)
    w = m.work(model)
    t = model.time(w, unit)
    gemm = np.asarray(t.gemm + t.lm_head, dtype=np.float64)
    fa, bw, lap = hw.flops(m.compute) * hw.eff_attn, hw.mem_bw * hw.eff_bw, 1.0 - hw.overlap
    flops_col = np.zeros_like(gemm)
    bytes_col = np.zeros_like(gemm)
    for fl, by in ((w.pre_flops, w.pre_bytes), (w.dec_flops, w.dec_bytes)):
        f, b = np.asarray(fl, dtype=np.float64), np.asarray(by, dtype=np.float64)
        compute_bound = f / fa >= b / bw
        flops_col += f * np.where(compute_bound, 1.0, lap)
        bytes_col += b * np.where(compute_bound, lap, 1.0)
    cols = np.stack([gemm, flops_col, bytes_col, np.ones_like(gemm),
                     np.asarray(w.seqs, dtype=np.float64)], axis=1)
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


def fit(train: list[Measured], hw: HardwareSpec, rounds: int = 8) -> HardwareSpec:
    """The factors minimizing the training steps' squared relative error, with the
    attention's efficiencies at most 1 and the overheads at least 0. Where compute and
    memory overlap, which side of each attention term binds depends on the factors: fit,
    re-decide the sides, refit, until they settle (``rounds`` at most)."""
    if not train:
        raise ValueError("calibration needs at least one training run")
    peak, bw = hw.flops(train[0].compute), hw.mem_bw
    parts = [terms(m, hw) for m in train]
    for _ in range(rounds):
        a = np.concatenate([c / m.step_s[:, None] for (c, _), m in zip(parts, train)])
        b = np.concatenate([1 - f / m.step_s for (_, f), m in zip(parts, train)])
        x = bounded_lsq(a, b, np.array([1e-3, 1 / peak, 1 / bw, 0.0, 0.0]))
        hw = dataclasses.replace(hw, eff_profile=float(1 / x[0]),
                                 eff_attn=float(1 / (x[1] * peak)),
                                 eff_bw=float(1 / (x[2] * bw)), step_overhead_s=float(x[3]),
                                 per_seq_overhead_s=float(x[4]), source="calibrated")
        if hw.overlap == 0.0:  # both sides always count: nothing to re-decide
            break
        new = [terms(m, hw) for m in train]
        if all(np.array_equal(c[:, 1:3], d[:, 1:3])  # the same sides bind: settled
               for (c, _), (d, _) in zip(parts, new)):
            break
        parts = new
    return hw


def errors(m: Measured, hw: HardwareSpec) -> dict[str, Any]:
    pred = predict(m, hw)
    rel = np.abs(pred - m.step_s) / m.step_s
    tput_meas = m.out_tokens / float(m.step_s.sum())
    tput_pred = m.out_tokens / float(pred.sum())
    return {"steps": len(pred), "repeats_used": len(m.walls),
            "attention": m.attention or hw.attention,
            "step_mdape_pct": 100 * float(np.median(rel)),
            "step_p90_ape_pct": 100 * float(np.percentile(rel, 90)),
            "throughput_meas": tput_meas, "throughput_pred": tput_pred,
            "throughput_ape_pct": 100 * abs(tput_pred - tput_meas) / tput_meas}


def end_to_end(m: Measured, target: Target, model_json: Path) -> dict[str, float]:
    """The same config under executor=roofline on the fitted spec (read from disk), for
    the model the runs ran (``model_json``: its config.json fields)."""
    from harness.config import run_config
    from harness.runner import run

    base = [o for o in target.base if not o.startswith(("device=", "model="))]
    rc = run_config(compose([*base, *m.overrides, "executor=roofline",
                             f"roofline.hardware={target.hardware}",
                             f"roofline.model={model_json}", *target.roofline,
                             f"roofline.attention={m.attention or 'spec'}",
                             # the runs measured this engine: its overheads, no profile's
                             "roofline.engine=kvbench", "progress=false"]))
    r = run(rc).metrics
    meas = m.out_tokens / float(m.step_s.sum())
    return {"roofline_run_throughput": r["throughput.output_tokens_per_s"],
            "roofline_run_steps": r["sched.steps"],
            "roofline_run_throughput_ape_pct":
                100 * abs(r["throughput.output_tokens_per_s"] - meas) / meas}


def measured_section(prof: GemmProfile) -> dict[str, Any]:
    return {f"peak_flops_{prof.dtype}": prof.peak_flops, "mem_bw": prof.mem_bw,
            "widen_s_per_elem": prof.widen_s_per_elem}


def profiled_prior(prof: GemmProfile, prior: HardwareSpec = CPU_PRIOR) -> HardwareSpec:
    """``prior`` with the profile's peak, bandwidth and table (factors still priors)."""
    return spec_from_calibration({"fit": {}, "profile": prof.as_json(),
                                  "measured": measured_section(prof)}, prior)


def prior_of(target: Target) -> HardwareSpec:
    return CPU_PRIOR if target.hardware == "cpu" else HARDWARE[target.hardware]


def calibrate(target: Target, repeats: int, out: Path) -> dict[str, Any]:
    """Profile, measure, fit and validate ``target``; write the report to ``out`` (a
    spec's calibration when ``out`` is :func:`calibration_path` of it) and return it."""
    from harness.model import load_model

    if target.device == "cpu":
        torch.set_num_threads(target.threads)
    t0 = time.perf_counter()
    loaded = load_model(target.model, dtype=target.dtype, device=target.device)
    prof = profile_gemms(loaded.model, repeats)
    both = measure({**target.train, **target.held_out}, repeats, loaded, target)
    train, held = both[:len(target.train)], both[len(target.train):]
    hw = fit(train, profiled_prior(prof, prior_of(target)))
    threads = f"{torch.get_num_threads()} thread(s) used" if target.device == "cpu" else \
        torch.cuda.get_device_name() if torch.cuda.is_available() else target.device
    report: dict[str, Any] = {
        "target": target.hardware, "fit": {k: getattr(hw, k) for k in FIT_KEYS},
        "measured": measured_section(prof), "profile": prof.as_json(),
        "model": f"{loaded.model.config.name} {prof.dtype}", "repeats": repeats,
        "machine": f"{platform.processor() or platform.machine()}, {threads}",
        "load_average": list(os.getloadavg()),
        "caveat": "each step is the median of its repeats, taken round-robin over the "
                  "configs; other processes' load moves step times",
        "train": {m.name: errors(m, hw) for m in train},
        "held_out": {m.name: errors(m, hw) for m in held},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    # A replay reads the spec's own calibration file: only when that is the one written.
    if out.resolve() == calibration_path(target.hardware).resolve():
        with tempfile.TemporaryDirectory() as tmp:
            model_json = Path(tmp) / "config.json"
            model_json.write_text(json.dumps(hf_config_of(loaded.model.config)))
            for m in held:
                if "workload=random" in m.overrides:
                    report["held_out"][m.name].update(end_to_end(m, target, model_json))
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
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=sorted(TARGETS), default="cpu",
                    help="the spec to calibrate (h200 needs its GPU; dry: the h200 "
                         "code path on the CPU at tiny sizes)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None,
                    help="default: the spec's calibration file next to hardware.py")
    args = ap.parse_args(argv)
    target = TARGETS[args.target]
    out = args.out or calibration_path(target.hardware)
    if args.target == "dry" and args.out is None:
        ap.error("--target dry needs --out (it must not overwrite the h200 calibration)")
    report = calibrate(target, args.repeats, out)
    print(json.dumps(report["summary"], indent=2))
    for name, e in report["held_out"].items():
        print(f"{name}: step MdAPE {e['step_mdape_pct']:.1f}%, throughput error "
              f"{e['throughput_ape_pct']:.1f}%"
              + (f", roofline run {e['roofline_run_throughput_ape_pct']:.1f}%"
                 if "roofline_run_throughput_ape_pct" in e else ""))


if __name__ == "__main__":
    main()
