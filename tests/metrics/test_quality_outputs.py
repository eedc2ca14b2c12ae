"""quality.output_length_ratio and quality.right_to_wrong_share (issue #57): by hand, in
metrics.json of quality and task runs, absent where the workload fixes output lengths,
and in the report's tables."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from harness.model import ByteTokenizer
from harness.quality_outputs import (
    lengths_fixed,
    output_length_ratio,
    output_metrics,
    right_to_wrong_share,
)
from harness.runner import run
from harness.sched.sequence import SamplingParams
from harness.workloads.base import Request
from tests.compose import compose_cfg, tiny


class _Tasks:
    """A workload with right answers: a request is right when its output says "yes"."""

    name = "tasks"

    def __init__(self, ignore_eos: bool = False) -> None:
        self.params = SamplingParams(max_tokens=8, ignore_eos=ignore_eos)

    def initial_requests(self) -> list[Request]:
        return [Request(i, [1, 2], self.params) for i in range(4)]

    def on_finished(self, group: Any) -> list[Request]:
        return []

    def task_meta(self, request_id: int) -> dict[str, Any]:
        return {"task": "t", "length": 2, "depth": -1.0}

    def score(self, request_id: int, text: str) -> float:
        return 1.0 if "yes" in text else 0.0


def _ids(text: str) -> list[int]:
    return ByteTokenizer().encode(text, add_bos=False)


def test_by_hand() -> None:
    # Mean 6 tokens against mean 4, on the ids both have (3 is the run's alone).
    assert output_length_ratio({1: [0] * 4, 2: [0] * 8, 3: [0]}, {1: [0] * 2, 2: [0] * 6}) \
        == pytest.approx(12 / 8)
    assert output_length_ratio({1: [0]}, {2: [0]}) is None
    assert output_length_ratio({1: [0]}, {1: []}) is None
    # Right by the reference (full marks), not by the run: request 2 (0.5) of the 4 both
    # scored; 3 went wrong to right, which does not count; 9 the run never scored.
    ref = {1: 1.0, 2: 1.0, 3: 0.0, 4: 0.0, 9: 1.0}
    assert right_to_wrong_share({1: 1.0, 2: 0.5, 3: 1.0, 4: 0.0}, ref) == pytest.approx(1 / 4)
    assert right_to_wrong_share({5: 1.0}, ref) is None


def test_output_metrics_score_both_sides_with_the_workload() -> None:
    wl = _Tasks()
    out = {0: _ids("no no no no"), 1: _ids("yes"), 2: _ids("no"), 3: _ids("yes")}
    ref = {0: _ids("yes"), 1: _ids("yes"), 2: _ids("yes"), 3: _ids("no")}
    m = output_metrics(wl, ByteTokenizer(), out, ref, lambda: lengths_fixed(wl))
    assert m["quality.right_to_wrong_share"] == pytest.approx(2 / 4)  # requests 0 and 2
    assert m["quality.output_length_ratio"] == pytest.approx((11 + 3 + 2 + 3) / (3 * 3 + 2))
    fixed = _Tasks(ignore_eos=True)
    assert lengths_fixed(fixed)
    m = output_metrics(fixed, ByteTokenizer(), out, ref, lambda: lengths_fixed(fixed))
    assert "quality.output_length_ratio" not in m and "quality.right_to_wrong_share" in m


def _output_tokens(folder: Path) -> dict[str, int]:
    with open(folder / "requests.csv") as f:
        return {r["request_id"]: int(r["output_tokens"]) for r in csv.DictReader(f)}


def test_a_quality_run_reports_the_ratio_against_the_reference(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The tiny model never writes its EOS (257): make a byte it writes now and then an
    # EOS, so that the window's answers and the reference's end at different lengths.
    monkeypatch.setattr(ByteTokenizer, "eos_ids", property(lambda self: [self.EOS, 179]))
    common = ("quality.enabled=true", "quality.num_texts=1", "quality.text_tokens=64",
              "workload.answer_tokens=40", "cache.kv_budget=1MiB")
    lossy = tmp_path / "lossy"
    m = run(tiny("backend=sliding_window", "backend.window=16", "backend.sink_tokens=0",
                 *common, out_dir=lossy)).metrics
    ref = tmp_path / "ref"
    run(tiny("backend=contiguous", "backend.reserve=exact", *common, out_dir=ref))
    mine, theirs = _output_tokens(lossy), _output_tokens(ref)
    assert sum(theirs.values()) > 0
    want = sum(mine.values()) / sum(theirs[k] for k in mine)
    assert want != pytest.approx(1.0)
    assert m["quality.output_length_ratio"] == pytest.approx(want)
    assert "quality.right_to_wrong_share" not in m  # multiturn has no right answers
    # Output lengths fixed by the workload (every request ignores EOS): absent, not 1.0.
    fixed = run(tiny(*common, "workload.ignore_eos=true")).metrics
    assert "quality.output_length_ratio" not in fixed and "quality.ppl" in fixed


def test_a_task_run_reports_both_without_quality_enabled(tmp_path: Path) -> None:
    run(compose_cfg(["model=tiny", "+experiment=ruler", "cache.kv_budget=8MiB",
                     "workload.tasks=[niah_single_1]", "workload.lengths=[600]",
                     "workload.depths=[0,100]", "backend=sliding_window",
                     "backend.window=64"], tmp_path))
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert "quality.ppl" not in m  # no streamed-text evaluation was asked for
    assert 0.0 <= m["quality.right_to_wrong_share"] <= 1.0
    assert m["quality.output_length_ratio"] > 0
    # Off with the reference rerun.
    off = tmp_path / "off"
    run(compose_cfg(["model=tiny", "+experiment=ruler", "cache.kv_budget=8MiB",
                     "workload.tasks=[niah_single_1]", "workload.lengths=[600]",
                     "workload.depths=[0]", "quality.generation_agreement=false"], off))
    m = json.loads((off / "metrics.json").read_text())
    assert "quality.right_to_wrong_share" not in m and "quality.task_accuracy" in m


def test_the_report_shows_them(tmp_path: Path) -> None:
    from harness.reporting.runs import find_runs
    from harness.reporting.task_plots import table

    run(compose_cfg(["model=tiny", "+experiment=ruler", "cache.kv_budget=8MiB",
                     "workload.tasks=[niah_single_1]", "workload.lengths=[600]",
                     "workload.depths=[0]"], tmp_path / "0-run"))
    md = table(find_runs([tmp_path]), [])
    head, _, row = md.splitlines()[:3]
    cols = [c.strip() for c in head.split("|")]
    assert "right -> wrong" in cols and "output len / ref" in cols
    cells = [c.strip() for c in row.split("|")]
    m = json.loads((tmp_path / "0-run" / "metrics.json").read_text())
    assert cells[cols.index("right -> wrong")] == f"{m['quality.right_to_wrong_share']:.2f}"
