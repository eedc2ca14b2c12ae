"""scripts/quality_goodput.py (issue #59): its points compose, each backend gets the option
its ratio means, and the table and frontier read a tiny fake results folder right."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def qg():
    spec = importlib.util.spec_from_file_location("quality_goodput",
                                                  ROOT / "scripts" / "quality_goodput.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while defining
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def test_ratios_map_to_each_method_s_option(qg):
    by = {p.label: p for p in qg.POINTS}
    assert by["paged@exact"].overrides(1024) == []
    assert by["snapkv@25"].overrides(1024) == ["backend.budget=0", "backend.budget_ratio=0.25"]
    assert by["pyramidkv@50"].overrides(4096)[-1] == "backend.budget_ratio=0.5"
    # quest keeps everything: its ratio is the tokens a decode reads, of the prompt
    assert by["quest@25"].overrides(1024) == ["backend.token_budget=256"]
    assert by["quest@25"].overrides(4096) == ["backend.token_budget=1024"]
    assert by["kivi@2bit"].overrides(1024) == ["backend.bits=2", "backend.residual_blocks=10"]
    assert len(by) == len(qg.POINTS)  # labels name folders: never two alike


def test_points_compose(qg):
    """Each method once in the CPU traffic (what the SLA search probes), paged in the
    accuracy and what-if phases: a typo in an option name fails at compose time."""
    from harness.config import compose_config

    one = {p.method: p for p in qg.POINTS}
    for p in one.values():
        cfg = compose_config([*qg.CPU, f"backend={p.method}", *p.overrides(qg.TRAFFIC_PROMPT)])
        assert cfg.backend.name == p.method
    assert cfg.workload.input_max == qg.TRAFFIC_PROMPT and cfg.slo.ttft_ms is not None
    acc = compose_config([*qg.ACCURACY, "backend=paged"])
    assert acc.workload.name == "ruler" and list(acc.workload.lengths) == [qg.CPU_PROMPT]
    wi = compose_config([*qg.WHATIF, "backend=paged"])
    assert wi.executor == "roofline" and wi.workload.input_min == qg.WHATIF_PROMPT


def _fake(out: Path, label: str, method: str, acc: float | None,
          cpu: tuple[float | None, float | None] | None,
          whatif: tuple[float | None, float | None] | None) -> None:
    if acc is not None:
        (out / "accuracy" / label).mkdir(parents=True)
        (out / "accuracy" / label / "metrics.json").write_text(json.dumps({
            "quality.task_accuracy": acc, "quality.task_accuracy_ci95_low": acc - 0.1,
            "quality.task_accuracy_ci95_high": min(1.0, acc + 0.1)}))
    for phase, g in (("cpu", cpu), ("whatif", whatif)):
        if g is not None:
            (out / phase / label).mkdir(parents=True)
            (out / phase / label / "sla.json").write_text(json.dumps(
                {"backends": {method: {"best": g[0], "first_fail": g[1], "probes": []}}}))


def test_table_and_frontier_from_fake_folders(qg, tmp_path):
    _fake(tmp_path, "paged@exact", "paged", 1.0, (0.2, 0.3), (2.0, 2.5))
    _fake(tmp_path, "snapkv@25", "snapkv", 0.8, (0.4, 0.5), (None, 0.25))  # lo failed
    _fake(tmp_path, "h2o@25", "h2o", 0.3, (0.3, 0.4), (64.0, None))  # hi passed
    _fake(tmp_path, "kivi@2bit", "kivi", None, None, None)
    (tmp_path / "cpu" / "kivi@2bit").mkdir(parents=True)  # its search's probe was refused
    (tmp_path / "cpu" / "kivi@2bit" / qg.REFUSED).write_text("the probe run ... exit 2\n")
    pts = [p for p in qg.POINTS if p.label in ("paged@exact", "snapkv@25", "h2o@25",
                                                   "kivi@2bit")]
    rows = qg.collect(tmp_path, pts)
    md = qg.table(rows).splitlines()
    assert md[2] == "| paged | 100% (exact) | 1.00 [0.90, 1.00] | 0.2 (fails 0.3) | 2 (fails 2.5) |"
    snap = next(line for line in md if line.startswith("| snapkv"))
    assert "| 25% | 0.80 [0.70, 0.90] | 0.4 (fails 0.5) | < 0.25 |" in snap
    h2o = next(line for line in md if line.startswith("| h2o"))
    assert h2o.endswith("| >= 64 |")
    assert md[-1] == "| kivi | 2-bit | not run | run failed (refused.txt) | not run |"
    # CPU: h2o (0.3 req/s, 0.3) is beaten by snapkv on both; what-if: snapkv has no rate
    assert qg.frontier(rows, "cpu") == ["paged@exact", "snapkv@25"]
    assert qg.frontier(rows, "whatif") == ["paged@exact", "h2o@25"]


def test_table_only_writes_outputs(qg, tmp_path, capsys):
    _fake(tmp_path, "paged@exact", "paged", 1.0, (0.2, 0.3), None)
    assert qg.main(["--table-only", "--out", str(tmp_path), "--only", "paged"]) == 0
    assert "| paged | 100% (exact) | 1.00" in (tmp_path / "frontier.md").read_text()
    assert json.loads((tmp_path / "frontier.json").read_text())[0]["accuracy"] == 1.0
    assert qg.main(["--table-only", "--out", str(tmp_path), "--only", "nosuch"]) == 2
