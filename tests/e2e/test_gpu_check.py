"""The GPU check on the CPU: its dry run end to end (every section, tiny sizes, Triton
interpreted), and the driver's handling of sections that fail, hang or leave partial files.

The dry run is what keeps scripts/gpu_check.sh from rotting between GPU runs: it runs the
same script, driver, sections and summary as the H200 run, at sizes a CPU does in seconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from harness.gpucheck import orchestrate
from harness.gpucheck.context import SectionTimeout, time_limit
from harness.gpucheck.kernel_checks import correctness_cases
from harness.gpucheck.profile import (
    COMPRESSION_BACKENDS,
    DRY,
    ENGINE_BACKENDS,
    GPU,
    EngineShape,
)
from harness.gpucheck.sections import section_names
from harness.gpucheck.summary import render

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("TRITON_INTERPRET", None)  # the script sets it for the dry run itself
    for k in [k for k in env if k.startswith("PYTEST_XDIST")]:
        # Run as on the GPU machine, not as a test worker: pytest-benchmark disables
        # itself (no JSON) when it sees an xdist worker's environment.
        del env[k]
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out), "--dry-run"],
                       env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def load(out: Path, name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / f"{name}.json").read_text())
    return data


def test_every_section_ran_ok_within_its_budget(dry_run: Path) -> None:
    status = load(dry_run, "status")
    assert list(status["sections"]) == section_names(DRY)
    for name, rec in status["sections"].items():
        if name == "gpu-tests":  # every gpu test needs CUDA: it ran and checked nothing,
            # and says so (issue #55: it read "ok")
            assert rec["status"] == "empty" and "nothing ran" in rec["error"], rec
        else:
            assert rec["status"] == "ok", (name, rec)
        assert rec["seconds"] <= rec["budget_s"] + orchestrate.GRACE_S
    summary = (dry_run / "summary.md").read_text()
    for title in ("Environment", "Triton kernels vs torch references", "Decode attention",
                  "Engine: tiny", "Engine: tiny-bias", "Compression under one budget",
                  "Roofline executor: h200 spec fitted",
                  "gpu tests", "Benchmarks", "flash-attn"):
        assert f"## {title}" in summary
    assert "install.log" in os.listdir(dry_run)


def test_kernel_sections_check_and_time_every_case(dry_run: Path) -> None:
    rows = load(dry_run, "kernel-correctness")["rows"]
    assert [(r["kernel"], r["batch"], r["context"]) for r in rows] == [
        (k, *size) for k, size, _ in correctness_cases(DRY)]
    assert all(r["ok"] is True for r in rows), [r for r in rows if not r["ok"]]
    bw = load(dry_run, "kernel-bandwidth")
    assert bw["copy_gbps"] > 0
    providers = {r["provider"] for r in bw["rows"] if r["ms"] is not None}
    assert providers == {"triton", "triton-unsplit", "torch-gather", "contiguous-sdpa"}
    assert all(r["gbps"] > 0 for r in bw["rows"])
    # The GEMM profile (bf16 and per-tensor FP8, issue #52): every row timed or its error.
    gemms = bw["gemm_profile"]
    assert {(r["dtype"], r["m"]) for r in gemms} == {(d, m) for d in ("bf16", "fp8")
                                                     for m in (1, 16)}
    assert all((r["ms"] or 0) > 0 or r.get("error") for r in gemms)
    assert any(r["dtype"] == "bf16" and r["tflops"] > 0 for r in gemms)


@pytest.mark.parametrize("shape", DRY.shapes, ids=lambda s: s.name)
def test_engine_sections_run_every_backend_through_the_runner(dry_run: Path,
                                                              shape: EngineShape) -> None:
    data = load(dry_run, f"engine-{shape.name}")
    rows = {r["backend"]: r for r in data["rows"]}
    assert list(rows) == [label for label, _ in ENGINE_BACKENDS
                          if shape.backends is None or label in shape.backends]
    for label, r in rows.items():
        assert r["ok"] is True, (label, r.get("error"))
        assert r["finished"] == 3 and r["rejected"] == 0
        assert r["output_tok_s"] > 0 and r["decode_step_ms_p50"] > 0
        assert r["prefill_step_ms_p50"] > 0 and r["device"] == "cpu"
    if shape.backends is None:
        assert rows["flex"]["kernel"] == "flex_eager"
        assert rows["paged-torch"]["kernel"] == "torch"
        # On the CPU no graph replays: said, not silent; the -eager rows turned them off.
        assert rows["paged"]["cuda_graphs"] == "off: no CUDA device"
        assert rows["paged-eager"]["cuda_graphs"] == "off: engine.cuda_graphs=off"
    assert data["weight_bytes"] > 0


def test_weight_bytes_are_the_models_own() -> None:
    """The engine section's weight-read floor counts every weight of the model once (the
    tied embedding once), in its dtype."""
    from harness.gpucheck.engine_checks import weight_bytes
    from harness.model import load_model

    for source in ("tiny", "tiny-bias", "tiny-deep"):
        model = load_model(source).model
        want = sum(p.numel() * p.element_size() for p in model.parameters())
        assert weight_bytes(["model=tiny", f"model.source={source}"]) == want, source


def test_roofline_section_fits_the_h200_spec_code_path(dry_run: Path) -> None:
    rep = load(dry_run, "roofline-h200")
    assert rep["target"] == "h200" and rep["written_to"].endswith("h200_calibration.json")
    assert Path(rep["written_to"]).parent == dry_run  # a dry run never writes the spec's file
    assert set(rep["held_out"]) == {"random-b4-seed5"} and rep["summary"]["seconds"] > 0
    assert rep["profile"]["dtype"] == "fp32" and len(rep["profile"]["rows"]) > 10
    assert "| random-b4-seed5 |" in (dry_run / "summary.md").read_text()


def test_pytest_sections_record_skips_and_benchmarks(dry_run: Path) -> None:
    gpu = load(dry_run, "gpu-tests")
    assert gpu["returncode"] == 0 and gpu["failed"] == 0 and gpu["passed"] == 0
    assert gpu["skipped"] >= 10 and "tests/backends/test_kernels_decode.py" in gpu["files"]
    assert any("CUDA" in why for why in gpu["skip_reasons"])
    bench = load(dry_run, "benchmarks")
    assert bench["returncode"] == 0
    groups = {r["group"] for r in bench["rows"]}
    assert {"decode 2 x 20", "store 6"} <= groups and (dry_run / "benchmarks-raw.json").is_file()
    assert load(dry_run, "flash-attn")["note"].startswith("Not run: flash-attn 4 is not")


def test_gpu_profile_fits_one_call() -> None:
    assert section_names(GPU) == [n for n in section_names(GPU) if n in GPU.budgets]
    default = sum(GPU.budgets[n] for n in section_names(GPU))
    assert default <= GPU.total_s <= 7.5 * 60 - 5  # the script's 448 s
    assert {s.name for s in GPU.shapes} == {"smollm2", "llama8b"}
    assert all(s.backends is None for s in GPU.shapes)  # every backend at both shapes
    # The compression section is its own call (--only compression), within one too.
    assert "compression" not in section_names(GPU) and GPU.on_request == ("compression",)
    assert section_names(GPU, ["compression"]) == [*section_names(GPU)[:5], "compression",
                                                   *section_names(GPU)[5:]]
    assert GPU.budgets["compression"] <= GPU.total_s - orchestrate.SUMMARY_RESERVE_S \
        - orchestrate.GRACE_S
    plan = GPU.compression
    assert plan is not None and plan.contexts == (4096, 32768)
    assert plan.model == ("model=random_llama8b",)


def test_compression_section_runs_every_method_beside_paged_and_contiguous(
        dry_run: Path) -> None:
    """Issue #56: every compression method under one budget at two contexts (tokens/s,
    decode step, bytes a decode token reads, sequences at once), and one decode step of
    each method's kernel timed against the bytes it must read."""
    data = load(dry_run, "compression")
    plan = DRY.compression
    assert plan is not None
    rows = {(r["backend"], r["context"]): r for r in data["rows"]}
    labels = [label for label, _ in COMPRESSION_BACKENDS]
    assert list(rows) == [(label, c) for c in plan.contexts for label in labels]
    for key, r in rows.items():
        assert r["ok"] is True, (key, r.get("error"))
        assert r["finished"] == 3 and r["rejected"] == 0 and r["output_tok_s"] > 0
        assert r["decode_step_ms_p50"] > 0 and r["kv_read_bytes_per_token"] > 0
    long = plan.contexts[-1]
    paged = rows[("paged", long)]
    assert rows[("contiguous", long)]["kv_read_bytes_per_token"] == \
        paged["kv_read_bytes_per_token"]
    for label in labels[2:]:  # every method reads less than paged and runs no fewer
        r = rows[(label, long)]
        assert r["kv_read_bytes_per_token"] < paged["kv_read_bytes_per_token"], label
        assert r["max_running"] >= paged["max_running"], label
    assert paged["max_running"] == 2 and rows[("h2o", long)]["max_running"] == 3
    kernels = {r["kernel"]: r for r in data["kernels"]}
    assert list(kernels) == ["paged", "slots", "slots+weights", "quest-64", "kivi-2bit"]
    for name, r in kernels.items():
        assert r["ms"] > 0 and r["gbps"] > 0 and r["must_read_bytes"] > 0, name
    assert kernels["slots"]["must_read_bytes"] < kernels["paged"]["must_read_bytes"]
    text = (dry_run / "summary.md").read_text()
    assert "| 2 x 48 | slots+weights |" in text and f"Context {long} (3 requests" in text


def test_failing_and_hanging_sections_are_recorded_and_the_rest_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands = {"env": "raise SystemExit('env broke')", "kernel-correctness":
                "import time; time.sleep(30)", "kernel-bandwidth": "print('fine')"}

    def command(profile: object, name: str, *args: object) -> list[str]:
        return [sys.executable, "-c", commands[name]]

    monkeypatch.setattr(orchestrate, "section_command", command)
    monkeypatch.setattr(orchestrate, "GRACE_S", 0.0)
    profile = dataclasses.replace(DRY, budgets={**DRY.budgets, "kernel-correctness": 2})
    t0 = time.monotonic()
    status = orchestrate.run_all(profile, tmp_path, ROOT, list(commands), total_s=60)
    assert time.monotonic() - t0 < 15
    recs = status["sections"]
    assert recs["env"]["status"] == "failed" and "env broke" in recs["env"]["error"]
    assert recs["kernel-correctness"]["status"] == "timeout"
    assert recs["kernel-bandwidth"]["status"] == "ok"
    assert "| kernel-correctness | timeout |" in (tmp_path / "summary.md").read_text()


def test_total_budget_skips_what_does_not_fit(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(orchestrate, "section_command",
                        lambda *a: [sys.executable, "-c", "pass"])
    status = orchestrate.run_all(DRY, tmp_path, ROOT, ["env", "benchmarks"], total_s=3)
    assert {r["status"] for r in status["sections"].values()} == {"skipped"}


def test_summary_survives_missing_and_malformed_section_files(tmp_path: Path) -> None:
    (tmp_path / "engine-tiny.json").write_text(json.dumps({"rows": [{"nonsense": 1}],
                                                           "error": "boom"}))
    (tmp_path / "kernel-bandwidth.json").write_text("{ half a file")
    status = {"profile": "dry", "sections": {
        "env": {"status": "timeout", "seconds": 5, "budget_s": 4, "error": "killed"},
        "kernel-bandwidth": {"status": "ok"}, "engine-tiny": {"status": "failed"}}}
    text = render(tmp_path, status)
    assert "| env | timeout |" in text and "**Section error:** boom" in text
    assert "could not render" in text and "Decode attention" not in text


def test_time_limit_interrupts_python_code() -> None:
    t0 = time.monotonic()
    with pytest.raises(SectionTimeout), time_limit(0.2):
        while True:
            pass
    assert time.monotonic() - t0 < 2
    with time_limit(5):
        pass  # and leaves no alarm behind
    time.sleep(0.01)


def test_a_section_with_failed_rows_or_pytest_is_not_ok() -> None:
    # On the first H200 run every kernel row held a ModuleNotFoundError and pytest stopped
    # at collection, and those sections read "ok": the verdict reads what they saved.
    from harness.gpucheck.verdict import problems

    assert problems({"rows": [{"kernel": "store", "ok": True}]}) == []
    assert problems({"rows": [{"backend": "flex", "ok": None,
                               "error": "skipped: time budget"}]}) == []
    bad = problems({"rows": [{"kernel": "store-fp8", "batch": 8, "ok": False},
                             {"kernel": "decode", "error": "ModuleNotFoundError: x"}]})
    assert len(bad) == 2 and "store-fp8" in bad[0] and "ModuleNotFoundError" in bad[1]
    assert problems({"engine": [{"error": "InductorError"}], "kernels": [], "timings": []})
    ran = {"command": "pytest", "tail": ["5 errors in 1.2s"]}
    assert problems({**ran, "returncode": 0}) == []
    assert "5 errors" in problems({**ran, "returncode": 2})[0]
    assert problems({**ran, "returncode": 0, "failed": 1, "failures": ["t::x"]})
    assert problems({"error": "timeout"}) == ["timeout"]


def test_a_failed_row_fails_its_section_through_the_driver(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake(ctx: Any) -> dict[str, Any]:
        return {"rows": [{"kernel": "store-fp8", "ok": False}]}

    monkeypatch.setattr(orchestrate, "get_section", lambda name, profile: fake)
    assert orchestrate.run_one("kernel-correctness", DRY, tmp_path, ROOT, 10) == 1
    saved = json.loads((tmp_path / "kernel-correctness.json").read_text())
    assert saved["problems"] == ["rows: store-fp8: not equal to its reference"]


def test_engine_row_counts_steps_far_over_their_median() -> None:
    # A kernel compiled inside the measured run shows as a few steps far over the median.
    from types import SimpleNamespace

    from harness.gpucheck.engine_checks import engine_row

    def step(ms: float, prefill: int) -> SimpleNamespace:
        return SimpleNamespace(step_ms=ms, prefill_tokens=prefill, decode_tokens=4)

    steps = [step(30, 256), step(29, 256), step(700, 256),
             *[step(22, 0) for _ in range(9)], step(45, 0), step(44, 0)]
    metrics = {k: 0 for k in ("run.kernel", "run.model", "run.device",
                              "throughput.output_tokens_per_s",
                              "throughput.total_tokens_per_s", "engine.step_ms_mean",
                              "engine.wall_s", "requests.finished", "requests.rejected",
                              "sched.preemptions_recompute", "memory.max_running_seqs",
                              "memory.token_capacity", "engine.overhead_pct")}
    row = engine_row(metrics, steps)
    assert row["slow_steps"] == 2 and row["step_ms_max"] == 700  # 700 and 45; not 44
    assert row["decode_step_ms_p50"] == 22 and row["prefill_step_ms_p50"] == 30


def test_a_section_that_checked_nothing_is_empty_not_ok() -> None:
    from harness.gpucheck.verdict import nothing_ran, problems

    skipped = {"command": ["pytest"], "returncode": 0, "passed": 0, "failed": 0,
               "skipped": 4, "skip_reasons": {"needs CUDA": 4}, "failures": []}
    assert problems(skipped) == []
    assert nothing_ran(skipped) == "nothing ran: 4 skipped (4 x needs CUDA)"
    assert nothing_ran({**skipped, "passed": 1}) is None
    assert nothing_ran({"rows": [{"ok": True}]}) is None  # not a pytest section


@pytest.mark.parametrize("args", [["--total-s", "-5"], ["--total-s", "0"],
                                  ["--total-s", "nan"], ["--budget", "env=-1"]])
def test_a_budget_that_is_not_positive_is_refused(args: list[str], tmp_path: Path) -> None:
    """Issue #55: a negative total budget skipped every section and exited 1."""
    done = subprocess.run([sys.executable, "-m", "harness.gpucheck", "--dry-run", "--out",
                           str(tmp_path / "o"), *args], capture_output=True, text=True,
                          cwd=ROOT)
    assert done.returncode == 2 and "give a positive number of seconds" in done.stderr
    assert not (tmp_path / "o").exists()
