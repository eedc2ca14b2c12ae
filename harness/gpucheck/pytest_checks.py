"""Sections ``gpu-tests`` (``pytest -m gpu``, compiled) and ``benchmarks`` (the
pytest-benchmark suite, tests/benchmarks, its JSON kept as ``benchmarks-raw.json``).

Both run pytest in a child process with the section's time left as its timeout; pytest's
own output goes to ``<section>.pytest.log``. The gpu tests' outcomes come from a JUnit XML
report: counts, and each failure's or skip's first line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from harness.gpucheck.context import SectionContext

GPU_MARK = "pytest.mark.gpu"


def gpu_test_files(root: Path) -> list[str]:
    """The test files holding ``gpu``-marked tests (collecting only these is quicker);
    tests/benchmarks is the benchmarks section's own."""
    return sorted(str(p.relative_to(root)) for p in (root / "tests").glob("*/test_*.py")
                  if p.parent.name != "benchmarks" and GPU_MARK in p.read_text(errors="replace"))


def run_pytest(ctx: SectionContext, args: list[str], log_name: str) -> dict[str, Any]:
    """``python -m pytest args`` in the repository, bounded by the section's time left."""
    env = {**os.environ, "TRITON_INTERPRET": "1" if ctx.profile.triton_interpret else "0",
           "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=",
           *args]
    log = ctx.out / log_name
    timeout = max(1.0, ctx.left() - 1)
    with log.open("w") as f:
        try:
            r = subprocess.run(cmd, cwd=ctx.root, env=env, stdout=f, stderr=subprocess.STDOUT,
                               timeout=timeout)
            rc: int | None = r.returncode
            error = None
        except subprocess.TimeoutExpired:
            rc, error = None, f"timeout: pytest ran past {timeout:.0f} s"
    tail = log.read_text(errors="replace").splitlines()[-15:]
    return {"command": " ".join(cmd[1:]), "returncode": rc, "error": error, "tail": tail}


def _first_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[0][:300] if (text or "").strip() else ""


def junit_outcomes(path: Path) -> dict[str, Any]:
    """Counts and failed / skipped test names (with the first line of why) from JUnit XML."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failed: list[str] = []
    skipped: dict[str, int] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            counts["failed"] += 1
            failed.append(f"{name}: {_first_line(bad.get('message'))}")
        elif skip is not None:
            counts["skipped"] += 1
            why = _first_line(skip.get("message"))
            skipped[why] = skipped.get(why, 0) + 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failed, "skip_reasons": skipped}


def gpu_tests_section(ctx: SectionContext) -> dict[str, Any]:
    files = gpu_test_files(ctx.root)
    xml = ctx.out / "gpu-tests.junit.xml"
    xml.unlink(missing_ok=True)
    result: dict[str, Any] = {"files": files}
    result.update(run_pytest(ctx, ["-m", "gpu", "-q", "-rfEs", f"--junitxml={xml}", *files],
                             "gpu-tests.pytest.log"))
    if xml.is_file():
        result.update(junit_outcomes(xml))
    return result


def benchmark_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per benchmark of pytest-benchmark's JSON: group, name, median / mean (us)."""
    rows = []
    for b in data.get("benchmarks", []):
        st = b.get("stats", {})
        rows.append({"group": b.get("group"), "name": b.get("name"),
                     "median_us": st.get("median", 0.0) * 1e6,
                     "mean_us": st.get("mean", 0.0) * 1e6, "rounds": st.get("rounds"),
                     "extra_info": b.get("extra_info", {})})
    return rows


def benchmarks_section(ctx: SectionContext) -> dict[str, Any]:
    raw = ctx.out / "benchmarks-raw.json"
    raw.unlink(missing_ok=True)
    result = run_pytest(ctx, ["tests/benchmarks", "-q", "--benchmark-enable",
                              f"--benchmark-json={raw}", *ctx.profile.bench_args],
                        "benchmarks.pytest.log")
    if raw.is_file() and raw.stat().st_size:  # pytest stopped early: empty or absent
        data = json.loads(raw.read_text())
        result["machine"] = data.get("machine_info", {}).get("cpu", {}).get("brand_raw")
        result["rows"] = benchmark_rows(data)
    return result
