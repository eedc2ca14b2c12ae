"""Every what-if result's error band: what ``python -m harness.roofline_tools.validate``
measured against published points it was not fitted to, for the run's engine profile and
GPU class (harness/roofline/published/validation_result.json), or "unvalidated"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULT = Path(__file__).resolve().parent / "published" / "validation_result.json"
GPU_CLASS = {"h100-sxm": "hopper", "h200": "hopper", "a100-80gb": "ampere",
             "a100-40gb": "ampere", "l40s": "ada", "b200": "blackwell", "cpu": "cpu"}
# Metrics whose value is the what-if's modelled time (the band applies to them).
TIMED = ("throughput.", "latency.", "roofline.", "engine.wall_s", "goodput")


def band(engine: str, hardware: str, path: Path = RESULT) -> dict[str, Any] | None:
    """The validated median and worst |error| (%) per metric kind for ``engine`` on
    ``hardware``'s GPU class, or None where no validation point covers them."""
    if not path.is_file():
        return None
    bands = json.loads(path.read_text()).get("bands", {})
    got = bands.get(engine, {}).get(GPU_CLASS.get(hardware, hardware))
    return got or None


def describe(engine: str, hardware: str, calibrated: bool,
             unvalidated_model: str | None = None) -> tuple[str, float | None]:
    """(the record's ``run.expected_error`` text, ``roofline.expected_error_pct``: the
    largest validated median |error| over throughput and TPOT (over the kinds validated
    when neither is), None if unvalidated; the text lists every kind: throughput, TTFT,
    TPOT, end-to-end).
    ``unvalidated_model``: what kind of model no published point covers (the validation
    set holds dense Llama models only): then no band, whatever the engine and GPU."""
    b = band(engine, hardware)
    prior = "" if calibrated else f"engine profile {engine} is a prior (not fitted); "
    if hardware == "cpu":
        return ("cpu spec: calibrated on this machine (held-out error: "
                "docs/results/2026-12-01-whatif-cpu-calibration.md)", None)
    if unvalidated_model is not None:
        return (f"{prior}unvalidated: the published points validate dense models only, "
                f"not {unvalidated_model}", None)
    if not b:
        return (f"{prior}unvalidated: no published point validates {engine} on "
                f"{GPU_CLASS.get(hardware, hardware)} GPUs", None)
    parts = [f"{k}: median {v['median_abs_pct']}%, worst {v['worst_abs_pct']}% "
             f"(n={v['n']})" for k, v in sorted(b.items())]
    main = [v for k, v in b.items() if k in ("throughput", "tpot")] or list(b.values())
    return (prior + "; ".join(parts), max(v["median_abs_pct"] for v in main))


def timed(metric: str) -> bool:
    return metric.startswith(TIMED)
