"""Fit the ``cpu`` hardware spec's factors from short real runs, then predict held-out runs.

    python -m harness.roofline.calibrate [--repeats 3] [--out results/roofline/cpu_calibration.json]

Every run is ``executor=model`` on SmolLM2-135M (fp32, 1 thread), all requests at once, so
its schedule does not depend on timing: repeats give the same steps, and each step's time
is the median over the repeats (this machine is shared; single runs are noisy). A recorder
around the model executor keeps each step's shape (harness.roofline.shape); the step-time
model turns shapes into FLOPs and bytes, and the fit chooses ``eff_gemm``, ``eff_attn``,
``eff_bw``, ``step_overhead_s`` and ``per_seq_overhead_s`` minimizing the squared log error
of the training runs' step times. Held-out runs (other workloads, batch mixes, backends)
are then predicted: the median absolute error of step time over their steps, and of each
run's throughput (its output tokens over the sum of predicted step times). The random
held-out runs are also replayed under ``executor=roofline`` on the fitted spec, end to end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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
from harness.roofline.hardware import CALIBRATION, CPU_PRIOR, HardwareSpec
from harness.roofline.models import MODEL_SPECS
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
}
HELD_OUT: dict[str, list[str]] = {
    "multiturn-paged": ["workload=multiturn", "workload.conversations=4", "workload.turns=2",
                        "workload.answer_tokens=24", "workload.system_words=60"],
    "random-contiguous-exact-b32": [*RANDOM, "backend=contiguous", "backend.reserve=exact",
                                    "scheduler.max_num_seqs=32", "workload.num_requests=24",
                                    "workload.seed=7"],
    "random-int8-b8": [*RANDOM, "backend=int8", "scheduler.max_num_seqs=8", "workload.seed=3"],
}
FIT_KEYS = ("eff_gemm", "eff_attn", "eff_bw", "overlap", "step_overhead_s",
            "per_seq_overhead_s")


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

    def work(self, model: StepModel) -> StepWork:
        ws = [model.work(s.tokens, len(s.samplers), s.seqs, s.pairs, s.ctx_prefill,
                         s.ctx_decode) for s in self.shapes]
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


def measure(name: str, overrides: list[str], repeats: int, loaded: Any) -> Measured:
    """``repeats`` real runs of one config; per-step medians (the steps must agree)."""
    from harness.config import run_config
    from harness.stack import build_stack
    from harness.workloads import make_workload

    cpu = torch.device("cpu")
    runs: list[tuple[list[StepShape], list[float], int, float]] = []
    for _ in range(repeats):
        rc = run_config(compose([*BASE, *overrides]))
        if rc.workload.seed is None:
            rc.workload.seed = rc.seed
        torch.manual_seed(rc.seed)
        wl = make_workload(rc.workload, loaded.tokenizer)
        st = build_stack(loaded, cpu, rc.backend, rc.cache, rc.scheduler, Sampler(rc.seed),
                         wl.initial_requests(), quiet=True)
        rec = Recorder(st.engine.executor, KVReads(st.backend))
        st.engine.executor = rec
        wall = st.engine.run(wl)
        out = sum(len(g.output_ids) for g in st.collector.groups.values())
        runs.append((rec.shapes, [r.step_ms / 1e3 for r in st.collector.steps], out, wall))
        bps = st.backend.bytes_per_slot()
    n = {len(r[1]) for r in runs}
    if len(n) != 1 or len({r[2] for r in runs}) != 1:
        raise RuntimeError(f"{name}: repeats disagree on the schedule ({n} steps): the "
                           "calibration runs must not depend on timing")
    step_s = np.median(np.array([r[1] for r in runs]), axis=0)
    return Measured(name, overrides, runs[0][0], step_s, runs[0][2], bps,
                    [r[3] for r in runs])


def predict(m: Measured, hw: HardwareSpec) -> np.ndarray:
    model = StepModel(MODEL_SPECS["smollm2-135m"], hw, m.bytes_per_slot, "fp32", 4.0)
    return np.asarray(model.time(m.work(model), hw).total, dtype=np.float64)


def _with(hw: HardwareSpec, key: str, value: float) -> HardwareSpec:
    return dataclasses.replace(hw, **{key: value})  # type: ignore[arg-type]


def fit(train: list[Measured], rounds: int = 8) -> HardwareSpec:
    """Coordinate descent on a log grid: squared log error of the training steps."""
    hw = CPU_PRIOR
    meas = np.concatenate([m.step_s for m in train])

    def loss(h: HardwareSpec) -> float:
        pred = np.concatenate([predict(m, h) for m in train])
        return float(np.mean(np.log(pred / meas) ** 2))

    span = 4.0
    for _ in range(rounds):
        for key in FIT_KEYS:
            base = getattr(hw, key)
            cands = [base * f for f in np.geomspace(1 / span, span, 25)]
            if key == "overlap":
                cands = [float(x) for x in np.linspace(0.0, 1.0, 11)]
            elif key.startswith("eff_"):
                cands = [min(1.0, c) for c in cands]
            best = min(cands, key=lambda c: loss(_with(hw, key, c)))
            hw = _with(hw, key, float(best))
        span = max(1.15, span ** 0.6)
    return dataclasses.replace(hw, source="calibrated")


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


def main(argv: list[str] | None = None) -> None:
    from harness.model import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=CALIBRATION)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    loaded = load_model("smollm2", dtype=torch.float32, device="cpu")
    train = [measure(k, v, args.repeats, loaded) for k, v in TRAIN.items()]
    held = [measure(k, v, args.repeats, loaded) for k, v in HELD_OUT.items()]
    hw = fit(train)
    report: dict[str, Any] = {
        "fit": {k: getattr(hw, k) for k in FIT_KEYS},
        "priors": {"peak_flops_fp32": CPU_PRIOR.peak_flops["fp32"],
                   "mem_bw": CPU_PRIOR.mem_bw},
        "model": "SmolLM2-135M-Instruct fp32, 1 thread", "repeats": args.repeats,
        "machine": f"{platform.processor() or platform.machine()}, "
                   f"{torch.get_num_threads()} thread(s) used",
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
