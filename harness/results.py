"""The results folder of one run: config.yaml, metrics.json, steps.csv, requests.csv.

Every file is written to a temporary name and renamed into place, so a crash never
leaves a half-written file (metrics.json is written last: its presence means done).
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from harness.metrics.collector import StepRow


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _csv_text(rows: list[dict[str, Any]]) -> str:
    import io

    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return buf.getvalue()


def write_results(out: Path, config_yaml: str, metrics: dict[str, Any],
                  steps: list[StepRow], requests: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / "config.yaml", config_yaml)
    _atomic_write(out / "steps.csv", _csv_text([asdict(s) for s in steps]))
    _atomic_write(out / "requests.csv", _csv_text(requests))
    _atomic_write(out / "metrics.json", json.dumps(metrics, indent=2, sort_keys=True) + "\n")


def write_failure(out: Path, error: BaseException) -> None:
    """Mark a run folder as failed (a sweep goes on past it)."""
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / "FAILED", f"{type(error).__name__}: {error}\n")
