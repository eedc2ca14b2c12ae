"""The SLA search (bisection over probe runs) and the latency-vs-rate figure."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from harness.app.report import build_report
from harness.app.sla import ProbeFailed, Searcher, bisect_rate, main, write_outputs
from harness.errors import UserError
from harness.reporting.rate import rate_series
from harness.reporting.runs import find_runs


def test_bisection_brackets_the_threshold_geometrically() -> None:
    seen: list[float] = []

    def passes(rate: float) -> bool:
        seen.append(rate)
        return rate <= 3.0

    best, fail = bisect_rate(passes, 0.25, 8.0, steps=4)
    assert best is not None and fail is not None
    assert best <= 3.0 < fail
    # hi, lo, then 4 midpoints; each step takes the square root of the bracket's ratio.
    assert len(seen) == 6 and seen[:3] == [8.0, 0.25, math.sqrt(2.0)]
    assert fail / best == pytest.approx(32 ** (1 / 16))
    assert bisect_rate(lambda r: True, 1, 4, 3) == (4, None)  # never failed
    assert bisect_rate(lambda r: False, 1, 4, 3) == (None, 1)  # failed even at lo


class FakeRuns(Searcher):
    """Probes that write a run folder by hand: attainment 1 up to 2 req/s, then falling."""

    runs: int = 0

    def _run(self, backend: str, rate: float, folder: Path) -> None:
        FakeRuns.runs += 1
        folder.mkdir(parents=True)
        cap = 2.0 if backend == "paged" else 0.4
        att = 1.0 if rate <= cap else cap / rate
        (folder / "config.yaml").write_text(yaml.safe_dump(self.planned(backend, rate)))
        (folder / "metrics.json").write_text(json.dumps({
            "run.backend": backend, "run.workload": "random", "latency.slo_attainment": att,
            "latency.goodput_rps": att * rate, "throughput.requests_per_s": rate,
            "latency.ttft_ms.p50": 100 / att, "latency.ttft_ms.p99": 300 / att,
            "latency.tpot_ms.p50": 50.0, "latency.tpot_ms.p99": 80.0,
            "latency.e2e_ms.p50": 900.0, "latency.e2e_ms.p99": 1500.0}))


def test_a_search_finds_each_backends_rate_and_reuses_its_probes(tmp_path: Path) -> None:
    FakeRuns.runs = 0
    s = FakeRuns(tmp_path, ["workload=random", "slo.ttft_ms=1000"], "workload.rate", 0.9)
    results = [s.search(b, 0.5, 8.0, 4) for b in ("paged", "contiguous")]
    paged, cont = results
    assert paged.best is not None and paged.first_fail is not None
    assert paged.best <= 2.0 / 0.9 < paged.first_fail  # attainment 0.9 at 2.22 req/s
    assert cont.best is None and cont.first_fail == 0.5  # misses already at lo
    assert (tmp_path / "paged" / "rate_8" / "metrics.json").is_file()
    assert FakeRuns.runs == 6 + 2
    again = FakeRuns(tmp_path, ["workload=random", "slo.ttft_ms=1000"], "workload.rate",
                     0.9).search("paged", 0.5, 8.0, 4)
    assert FakeRuns.runs == 8 and again.best == paged.best  # every probe was on disk
    # Issue 27: a stricter SLO found the old probes and reported their pass. A probe of
    # another config is refused, saying what differs.
    with pytest.raises(UserError, match=r"paged/rate_8 holds a probe of another config "
                                        r"\(slo.ttft_ms: 1000.0 here, 200.0 now\)"):
        FakeRuns(tmp_path, ["workload=random", "slo.ttft_ms=200"], "workload.rate",
                 0.9).search("paged", 0.5, 8.0, 4)
    assert FakeRuns.runs == 8
    write_outputs(tmp_path, results, "workload.rate", 0.9, ["slo.ttft_ms=1000"])
    md = (tmp_path / "sla.md").read_text()
    assert f"| paged | {paged.best:.4g} | {paged.first_fail:.4g} |" in md
    assert "| contiguous | below 0.5 | 0.5 |" in md
    saved = json.loads((tmp_path / "sla.json").read_text())
    assert saved["backends"]["paged"]["best"] == paged.best
    assert (tmp_path / "latency_vs_rate.png").stat().st_size > 10_000


def test_the_report_draws_latency_against_rate_for_a_rate_sweep(tmp_path: Path) -> None:
    s = FakeRuns(tmp_path / "sweep", ["workload=random"], "workload.rate", 0.9)
    for rate in (0.5, 1.0, 2.0, 4.0):
        s.probe("paged", rate)
        s.probe("contiguous", rate)
    series = rate_series(find_runs([tmp_path / "sweep"]))
    assert {k for k in series} == {("random", "paged"), ("random", "contiguous")}
    assert [x for x, _ in series[("random", "paged")]] == [0.5, 1.0, 2.0, 4.0]
    files = build_report([tmp_path / "sweep"], out=tmp_path / "report")
    assert (tmp_path / "report" / "latency_vs_rate.png") in files.plots
    assert "latency_vs_rate.png" in files.markdown.read_text()


def test_the_command_runs_real_probes_and_refuses_bad_searches(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = ["model=tiny", "workload=random", "workload.num_requests=3",
           "workload.input_max=24", "workload.output_max=6", "cache.kv_budget=256KiB",
           "device=cpu", f"results_dir={tmp_path}"]
    out = tmp_path / "sla"
    # A target any rate meets: the search stops at --hi after one real run.
    assert main(["--lo", "1", "--hi", "50", "--out", str(out), "--",
                 *run, "slo.e2e_ms=600000"]) == 0
    probe = out / "paged" / "rate_50"
    m = json.loads((probe / "metrics.json").read_text())
    assert m["latency.slo_attainment"] == 1.0 and (probe / "config.yaml").is_file()
    assert "| paged | 50 (never failed: raise --hi) |" in (out / "sla.md").read_text()
    capsys.readouterr()
    # The same search again reuses the real probe (its config is what would run) ...
    assert main(["--lo", "1", "--hi", "50", "--out", str(out), "--",
                 *run, "slo.e2e_ms=600000"]) == 0
    assert "attainment 1.000 pass" in capsys.readouterr().out
    # ... and one with a stricter SLO into the same --out is refused before it overwrites
    # the earlier summary (issue 27: it reported the old pass).
    before = (out / "sla.md").read_text()
    assert main(["--lo", "1", "--hi", "50", "--out", str(out), "--",
                 *run, "slo.e2e_ms=1"]) == 2
    err = capsys.readouterr().err
    assert f"--out {out} holds an earlier search with other settings (overrides:" in err
    assert (out / "sla.md").read_text() == before
    assert main(["--out", str(probe / "metrics.json"), "--", *run, "slo.e2e_ms=1"]) == 2
    assert "metrics.json is a file: give a folder" in capsys.readouterr().err
    assert main(["--out", str(out), "--", *run]) == 2
    assert "no SLO target" in capsys.readouterr().err
    assert main(["--out", str(out), "--", *run, "backend=contiguous", "slo.ttft_ms=1"]) == 2
    assert "sets backend= and workload.rate= itself" in capsys.readouterr().err
    assert main(["--lo", "4", "--hi", "2", "--", *run, "slo.ttft_ms=1"]) == 2
    # A typo in --key: refused before any probe runs (issue #55: exit 1 after one).
    typo = tmp_path / "typo"
    assert main(["--key", "workload.rat", "--out", str(typo), "--", *run,
                 "slo.ttft_ms=1"]) == 2
    assert "--key workload.rat: not an option these runs have" in capsys.readouterr().err
    assert not (typo / "paged").exists()


def test_ctrl_c_during_a_probe_is_one_line_and_130(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # Issue 27: a traceback. (The probe run itself gets the signal too and marks its folder.)
    def stopped(self: Searcher, backend: str, rate: float, folder: Path) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Searcher, "_run", stopped)
    out = tmp_path / "sla"
    assert main(["--out", str(out), "--", "model=tiny", "workload=random",
                 "slo.e2e_ms=1000"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == (f"kvbench sla: stopped by SIGINT (Ctrl-C); the probes that "
                           f"finished are in {out}/ and the same command reuses them")


# -- messages after a rerun, an interrupt, a type error (issue #55) ----------------------------
TINY = ["model=tiny", "workload=random", "workload.input_max=24", "workload.output_max=6",
        "cache.kv_budget=256KiB", "device=cpu"]


def test_a_key_that_takes_no_real_number_or_repeats_is_refused_before_any_probe(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue #55: --key workload.num_requests (an integer) failed the first probe, exit 1,
    naming a probe folder that was never made; repeats=N left no metrics.json and the
    probe "exited 0". Both are configuration errors, refused up front."""
    out = tmp_path / "sla"
    assert main(["--key", "workload.num_requests", "--lo", "1", "--hi", "4", "--out",
                 str(out), "--", *TINY, "slo.e2e_ms=1000"]) == 2
    err = capsys.readouterr().err
    assert "--key workload.num_requests does not take a real number such as 2.0 (Value " \
           "'2.0' of type 'float' could not be converted to Integer" in err
    assert "search a real-valued option (workload.rate" in err
    assert main(["--out", str(out), "--", *TINY, "slo.e2e_ms=1000", "repeats=3"]) == 2
    assert "repeats=3: the search runs one probe per rate" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("code,said", [
    (0, "exited 0 but wrote no metrics.json there"),
    (2, "was refused (exit 2: a configuration or capacity error)"),
    (-9, "was killed by SIGKILL"),
])
def test_a_probe_that_left_no_results_says_how_it_ended_and_where(
        tmp_path: Path, code: int, said: str) -> None:
    """Issue #55: a probe that exited 0 without results read "exited 0" as its failure,
    and one that never made its folder was said to have run into it."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'the end of its output'\n"
                    + ("kill -9 $$\n" if code < 0 else f"exit {code}\n"))
    fake.chmod(0o755)
    s = Searcher(tmp_path / "sla", [*TINY, "slo.e2e_ms=1000"], "workload.rate", 0.9,
                 python=str(fake))
    with pytest.raises(ProbeFailed) as e:
        s.probe("paged", 4.0)
    folder = tmp_path / "sla" / "paged" / "rate_4"
    assert str(e.value).startswith(f"the probe run for workload.rate=4 (its folder {folder} "
                                   f"was never made) {said}:")
    assert "the end of its output" in str(e.value)


def test_ctrl_c_stops_the_probe_and_waits_for_its_marker(tmp_path: Path) -> None:
    """Issue #55: Ctrl-C sent to the search killed its probe before the probe wrote its
    marker (a folder with no outcome) and said "the same command reuses them" without
    naming the probe. Now the probe gets the signal, the search waits for its marker, and
    the message names it."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "sla"
    cmd = [sys.executable, "-m", "harness.sla", "--lo", "0.5", "--hi", "1", "--out",
           str(out), "--", *TINY, "workload.num_requests=3", f"results_dir={tmp_path}",
           "slo.e2e_ms=600000"]
    p = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[2], text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    probe = out / "paged" / "rate_1"
    deadline = time.monotonic() + 120
    while not (probe / "config.yaml").is_file():  # the probe has begun its run
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.02)
    p.send_signal(signal.SIGINT)  # to the search alone, not to its probe
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert "Traceback" not in err
    assert f"stopped by SIGINT (Ctrl-C) during the probe into {probe} (marked INTERRUPTED: " \
           "the search probes it again)" in err and "the same command reuses them" in err
    assert (probe / "INTERRUPTED").is_file() and not (probe / "metrics.json").exists()


@pytest.mark.parametrize("left", ["INTERRUPTED", "FAILED", "a dead process's claim"])
def test_a_rerun_probes_again_what_has_no_results(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], left: str) -> None:
    """Issue #55: after an interrupt the same command stopped at the interrupted probe
    ("holds a run that ended INTERRUPTED: remove it", exit 1). A probe without results is
    set aside into .kvbench-attempts/ and probed again, as a resumed sweep's job is."""
    s = FakeRuns(tmp_path, ["workload=random", "slo.ttft_ms=1000"], "workload.rate", 0.9)
    folder = s.folder("paged", 1.0)
    folder.mkdir(parents=True)
    if left == "a dead process's claim":
        (folder / ".kvbench-run").write_text(json.dumps(
            {"pid": 2 ** 22 + 12345, "host": __import__("socket").gethostname()}))
    else:
        (folder / left).write_text("interrupted by SIGINT (Ctrl-C)\n")
    assert s.probe("paged", 1.0).passed
    said = capsys.readouterr().out
    why = f"ended {left}" if left != "a dead process's claim" else \
        "no outcome: its process is gone"
    assert f"rerun: {folder} ({why}; the earlier attempt is in {tmp_path / '.kvbench-attempts'}" \
        in said
    assert (folder / "metrics.json").is_file()
    assert len(list((tmp_path / ".kvbench-attempts").rglob("rate_1"))) == 1


def test_a_probe_whose_process_still_runs_is_not_moved(tmp_path: Path) -> None:
    import os
    import socket

    s = FakeRuns(tmp_path, ["workload=random", "slo.ttft_ms=1000"], "workload.rate", 0.9)
    folder = s.folder("paged", 1.0)
    folder.mkdir(parents=True)
    (folder / ".kvbench-run").write_text(json.dumps({"pid": os.getpid(),
                                                     "host": socket.gethostname()}))
    with pytest.raises(ProbeFailed, match=r"may still run it: wait for it"):
        s.probe("paged", 1.0)
    assert folder.is_dir() and not (tmp_path / ".kvbench-attempts").exists()


def test_ctrl_c_without_out_says_which_out_reuses_the_probes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue #55: without --out, "the same command reuses them" was wrong: it starts a new
    folder (results/sla/<time>). The message gives the --out that does."""
    def stopped(self: Searcher, backend: str, rate: float, folder: Path) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Searcher, "_run", stopped)
    monkeypatch.chdir(tmp_path)
    assert main(["--", "model=tiny", "workload=random", "slo.e2e_ms=1000"]) == 130
    err = capsys.readouterr().err
    (out,) = (tmp_path / "results" / "sla").iterdir()
    assert f"the same command with --out {out.relative_to(tmp_path)} reuses them (without " \
           "--out a search starts a new folder)" in err
