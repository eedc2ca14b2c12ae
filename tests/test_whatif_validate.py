"""The what-if's published sets, its engine-profile fit and its kernel fit (issue: the
what-if against real GPUs). Nothing here runs the published points (that is
``python -m harness.roofline.validate``, minutes); every point is composed, the fits are
checked on inputs with a known answer, and the committed kernel constants are checked to
be the optimum of Vidur's tables."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from harness.config import compose_config, run_config
from harness.roofline import bands, kernel_fit, validate
from harness.roofline.hardware import A100_KERNELS, H100_KERNELS


def test_every_published_run_composes_and_the_sets_are_apart() -> None:
    ids: dict[str, str] = {}
    for name in ("fit", "validation"):
        sources, runs = validate.load(name)
        for r in runs:
            assert r["id"] not in ids, f"{r['id']} in both {ids.get(r['id'])} and {name}"
            ids[r["id"]] = name
            assert r["source"] in sources
            rc = run_config(compose_config(validate.overrides(r, sources[r["source"]])))
            assert rc.executor == "roofline" and rc.roofline.engine == r["engine"]
            assert rc.workload.num_requests == r["num_prompts"]


def test_the_validation_set_has_the_shape_the_claim_needs() -> None:
    _, runs = validate.load("validation")
    figures = [(r, m) for r in runs for m in r["figures"]]
    assert len(figures) >= 15
    assert len({r["engine"] for r in runs}) >= 2
    assert len({validate.GPU_CLASS[r["hardware"]] for r in runs}) >= 2
    assert any(r["model"] == "Llama-3.1-8B" and r["tp"] == 1 for r in runs)
    assert any(r["model"] == "Llama-3.1-70B" and r["tp"] >= 4 for r in runs)
    kinds = {validate.CLAIMED.get(m) for _, m in figures}
    assert {"throughput", "tpot"} <= kinds
    # TPOT under load: at a finite request rate.
    assert any(validate.CLAIMED.get(m) == "tpot" and r["rate"] > 0 for r, m in figures)


def test_vllm_scheduler_setup_reaches_the_run() -> None:
    sources, runs = validate.load("validation")
    r = next(x for x in runs if x["engine"] == "vllm-0.6")
    ov = validate.overrides(r, sources[r["source"]])
    assert "scheduler.num_scheduler_steps=10" in ov
    assert "scheduler.mixing=prefill_first" in ov and "scheduler.chunked_prefill=false" in ov
    assert f"scheduler.max_num_batched_tokens={max(r['max_model_len'], 2048)}" in ov


def test_engine_fit_recovers_known_constants() -> None:
    # Synthetic runs whose length is forward + the engine terms with known constants.
    rng = np.random.default_rng(0)
    truth = np.array([3e-3, 80e-6, 1e-3, 4e-6])
    runs = []
    for i in range(6):
        steps = [(float(rng.uniform(5e-3, 30e-3)), int(rng.integers(1, 256)),
                  bool(j % (1 + i % 3) == 0)) for j in range(200)]
        fwd, x = validate._features({"trace": steps})
        dur = fwd + float(x @ truth)
        point = {"figures": {"requests_per_s": 100 / dur}, "num_prompts": 100}
        runs.append((point, {"trace": steps, "output_tokens": 0}))
    got = validate.fit_engine(runs, (0, 1, 2, 3))
    for k, v in zip(("schedule_s", "schedule_per_seq_s", "step_s", "step_per_seq_s"), truth):
        assert got[k] == pytest.approx(v, rel=1e-6)


@pytest.mark.parametrize(("gpu", "consts"), [("h100", H100_KERNELS), ("a100", A100_KERNELS)])
def test_committed_gemm_constants_are_the_fit_of_vidurs_tables(
        gpu: str, consts: dict[str, float]) -> None:
    P, T, y = kernel_fit._gemm_rows(gpu)
    peak, bw = kernel_fit.PEAK_BF16[gpu], kernel_fit.MEM_BW[gpu]

    def loss(eg: float, eb: float, p: float, t0: float) -> float:
        t = kernel_fit.gemm_time(P, T, peak, bw, eg, eb, p, t0)
        return float(np.mean(np.log(t / y) ** 2))

    c = (consts["eff_gemm"], consts["eff_bw"], consts["gemm_corner_p"], consts["gemm_kernel_s"])
    here = loss(*c)
    rel = kernel_fit.gemm_time(P, T, peak, bw, *c) / y - 1
    assert float(np.median(np.abs(rel))) < 0.08  # the fit's stated median error
    # Every neighbour on the fit's grid is worse: these are its optimum.
    for i, step in enumerate((0.01, 0.01, 0.5, 1e-6)):
        for sign in (-1, 1):
            n = list(c)
            n[i] += sign * step
            if n[i] > 0:
                assert loss(*n) >= here - 1e-12, (i, sign)
    # The plain roofline (max, no kernel cost) is far worse: what the fit buys.
    assert loss(c[0], c[1], 50.0, 0.0) > 2 * here


def test_allreduce_latency_is_vidurs_small_message_median() -> None:
    lat, bus = kernel_fit.fit_allreduce("h100")
    assert {int(k): v for k, v in lat.items()} == pytest.approx(
        H100_KERNELS["allreduce_latency_s"], abs=1e-6)
    assert 300e9 < bus < 400e9  # the spec's 340 GB/s


def test_band_reads_the_validated_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "v.json"
    f.write_text(json.dumps({"bands": {"trtllm": {"hopper": {
        "throughput": {"median_abs_pct": 7.5, "worst_abs_pct": 21.0, "n": 40},
        "tpot": {"median_abs_pct": 9.0, "worst_abs_pct": 24.0, "n": 40}}}}}))
    monkeypatch.setattr(bands, "RESULT", f)
    monkeypatch.setattr(bands.band, "__defaults__", (f,))
    text, pct = bands.describe("trtllm", "h200", calibrated=True)
    assert pct == 9.0 and "throughput: median 7.5%, worst 21.0% (n=40)" in text
    text, pct = bands.describe("sglang", "a100-80gb", calibrated=False)
    assert pct is None and "unvalidated" in text and "prior" in text


def test_a_point_the_what_if_refuses_is_reported_not_dropped() -> None:
    sources, runs = validate.load("validation")
    p = dict(next(r for r in runs if r["model"] == "Llama-3.1-70B"))
    p.update(id="too-big", tp=1, weight_dtype="bfloat16", hardware="h100-sxm")  # 141 GB
    r = validate.run_point((p, sources[p["source"]], False))
    assert "leave no room" in r["error"]
    rows = validate.compare([p], [r])
    assert rows and all(x["error_pct"] == 100.0 and "failed" in x for x in rows)
