"""The what-if's published sets, its engine-profile fit and its kernel fit (issue: the
what-if against real GPUs). Nothing here runs the published points (that is
``python -m harness.roofline_tools.validate``, minutes); every point is composed, the fits are
checked on inputs with a known answer, and the committed kernel constants are checked to
be the optimum of Vidur's tables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omegaconf import DictConfig, OmegaConf

from harness.config import compose_config, run_config
from harness.errors import UserError
from harness.roofline import bands
from harness.roofline.hardware import A100_KERNELS, H100_KERNELS, get_hardware
from harness.roofline.models import get_model_spec
from harness.roofline.trtllm_bench import batch_limits
from harness.roofline_tools import kernel_fit, validate


def test_every_published_run_composes_and_the_sets_are_apart() -> None:
    # Hydra composes once per distinct choice of groups (backend=, workload=, ...; 0.3 s
    # each, two minutes for all 243 runs); each run's dotted overrides then merge into
    # that typed config, which checks every key and value as composing would.
    ids: dict[str, str] = {}
    base: dict[tuple[str, ...], DictConfig] = {}
    for name in validate.SETS:
        sources, runs = validate.load(name)
        for r in runs:
            assert r["id"] not in ids, f"{r['id']} in both {ids.get(r['id'])} and {name}"
            ids[r["id"]] = name
            assert r["source"] in sources
            ov = validate.overrides(r, sources[r["source"]])
            groups = tuple(o for o in ov if "." not in o.split("=")[0])
            if groups not in base:
                base[groups] = compose_config(list(groups))
            cfg = OmegaConf.merge(base[groups], OmegaConf.from_dotlist(
                [o for o in ov if o not in groups]))
            rc = run_config(cfg)  # type: ignore[arg-type]
            assert rc.executor == "roofline" and rc.roofline.engine == r["engine"]
            assert rc.workload.num_requests == r["num_prompts"]
    assert len(base) < 10 and len(ids) > 200
    # the shortcut composes what composing composes: one run both ways
    sources, runs = validate.load("validation")
    ov = validate.overrides(runs[-1], sources[runs[-1]["source"]])
    groups = tuple(o for o in ov if "." not in o.split("=")[0])
    assert OmegaConf.to_yaml(compose_config(ov)) == OmegaConf.to_yaml(OmegaConf.merge(
        base[groups], OmegaConf.from_dotlist([o for o in ov if o not in groups])))


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
    # TPOT under load: at a finite request rate or a closed loop of clients.
    assert any(validate.CLAIMED.get(m) == "tpot" and (r["rate"] > 0 or r.get("concurrency"))
               for r, m in figures)
    # Blind: no validation source is also a fit or calibration source.
    fitted = {k for name in validate.FITTED_SETS for k in validate.load(name)[0]}
    assert not fitted & set(validate.load("validation")[0])


def test_vllm_scheduler_setup_reaches_the_run() -> None:
    sources, runs = validate.load("calibration")
    r = next(x for x in runs if x["engine"] == "vllm-0.6"
             and x["source"] == "sglang-benchmark-vllm-060")
    ov = validate.overrides(r, sources[r["source"]])
    assert "scheduler.num_scheduler_steps=10" in ov
    assert "scheduler.mixing=prefill_first" in ov and "scheduler.chunked_prefill=false" in ov
    assert f"scheduler.max_num_batched_tokens={max(r['max_model_len'], 2048)}" in ov


def test_engine_fit_recovers_known_constants() -> None:
    # Synthetic runs whose length and whose requests' TPOT and end-to-end times are the
    # forward time + the engine terms with known constants (all-reduce latency included:
    # the trace's forward carries the latency the run used, 40 us, which the fit replaces).
    rng = np.random.default_rng(0)
    truth = np.array([3e-3, 80e-6, 1e-3, 4e-6, 12e-6])
    runs = []
    for i in range(6):
        n_ar = 160 * (i % 2)
        fwd = rng.uniform(5e-3, 30e-3, 200)
        seqs = rng.integers(1, 256, 200)
        fresh = np.arange(200) % (1 + i % 3) == 0
        x = np.stack([fresh, fresh * seqs, np.ones(200), seqs, np.full(200, n_ar)], 1)
        true_t = np.cumsum(fwd + x @ truth)
        ran_t = np.cumsum(fwd + n_ar * 40e-6 + x[:, :4] @ truth[:4] * 0.5)
        steps = [(float(f + n_ar * 40e-6), int(q), bool(fr), float(t))
                 for f, q, fr, t in zip(fwd, seqs, fresh, ran_t)]
        # One request finishes at each of four steps, its first token at step 10.
        ends = (60, 99, 150, 199)
        reqs = [(0.0, float(ran_t[10]), float(ran_t[e]), e - 9, 100, 0.0) for e in ends]
        tpot = np.mean([(true_t[e] - true_t[10]) / (e - 10) for e in ends])
        e2e = np.median([true_t[e] for e in ends])
        point = {"figures": {"requests_per_s": 100 / true_t[-1], "tpot_ms_mean": 1e3 * tpot,
                             "e2e_ms_median": 1e3 * e2e},
                 "num_prompts": 100, "engine": "trtllm"}
        runs.append((point, {"trace": steps, "output_tokens": 0, "prompt_tokens": 0,
                             "requests": reqs, "allreduces": n_ar,
                             "allreduce_latency": 40e-6}))
    got = validate.fit_engine(runs, (0, 1, 2, 3, 4))
    for k, v in zip(validate.CONSTANTS, truth):
        assert got[k] == pytest.approx(v, rel=1e-6), k
    # Latency not fitted: the spec's stays in the runs' time, the CPU terms still come out.
    for _, r in runs:
        r["spec_allreduce_latency"] = truth[4]
    got = validate.fit_engine(runs, (0, 1, 2, 3))
    for k, v in zip(validate.CONSTANTS[:4], truth[:4]):
        assert got[k] == pytest.approx(v, rel=1e-6), k
    for _, r in runs:
        r["spec_allreduce_latency"] = 0.0
    assert validate.fit_engine(runs, (0, 1, 2, 3))["step_s"] != pytest.approx(truth[2])


def test_fitted_figures_are_exactly_affine_in_the_constants(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A real traced all-at-once run: its figures predicted from the trace at other
    # constants equal a second run's at those constants (the fit's premise).
    import dataclasses

    from harness.roofline import engines

    sources, _ = validate.load("calibration")
    point = {"id": "t", "set": "calibration", "source": "nim-1.8.0-llama33-70b-fp8-tp2",
             "engine": "trtllm", "model": "Llama-3.1-70B", "hardware": "h100-sxm", "tp": 2,
             "weight_dtype": "fp8", "compute_dtype": "fp8", "backend": "fp8",
             "workload": {"input": 300, "output": 24}, "concurrency": 3, "num_prompts": 7,
             "rate": 0, "max_model_len": 400,
             "figures": {"tpot_ms_mean": 20.0, "output_tokens_per_s": 100.0,
                         "e2e_ms_median": 900.0, "e2e_ms_mean": 950.0}}
    src = sources[point["source"]]
    first = validate.run_point((point, src, True))
    rows = validate._figure_rows(point, first)
    # (no all-reduce latency: trtllm's own kernels' published times price its all-reduces)
    other = np.array([2e-3, 50e-6, 1.5e-3, 30e-6, 0.0])
    monkeypatch.setitem(engines.PROFILES, "trtllm", dataclasses.replace(
        engines.PROFILES["trtllm"], **dict(zip(validate.CONSTANTS, other))))
    second = validate.run_point((point, src, False))["pred"]
    assert second["tpot_ms_mean"] != pytest.approx(first["pred"]["tpot_ms_mean"], rel=1e-3)
    for metric, base, a, _pub in rows:
        pred = base + float(a @ other)
        want = (first["output_tokens"] / second[metric] if metric.endswith("_per_s")
                else second[metric] / 1e3)
        assert pred == pytest.approx(want, rel=1e-9), metric


def test_concurrency_caps_the_running_requests() -> None:
    sources, runs = validate.load("calibration")
    r = next(x for x in runs if x.get("concurrency") == 5)
    assert "scheduler.max_num_seqs=5" in validate.overrides(r, sources[r["source"]])


def test_trtllm_bench_limits_follow_its_heuristic() -> None:
    # Worked by hand from TensorRT-LLM's tuning.py: Llama-3.1-8B fp8 (8.03e9 params, 1 B
    # each; KV 2 x 32 layers x 8 heads x 128 x 1 B) on one H200 (139.8 GiB as CUDA
    # reports it) at 0.95:
    # (139.8 - 7.48) GiB x 0.95 / (64 KiB x 22,000) = 93.6 requests -> 96 (32s);
    # tokens 87.6 x 11 = 963 -> 2048, then at least 20,000 + 96 with chunking off.
    arch = get_model_spec("Llama-3.1-8B")
    h200 = get_hardware("h200").mem_bytes
    assert batch_limits(arch, h200, 1, 1.0, 1.0, 20000, 2000, 20000, 0.95) == (96, 20096)
    # Chunked prefill on: no prompt floor on the token budget.
    assert batch_limits(arch, h200, 1, 1.0, 1.0, 20000, 2000, 20000, 0.95, True) == (96, 2048)
    # Short sequences: the request cap of 4096, tokens 4096 x 2 capped at 32768 -> 8192.
    assert batch_limits(arch, h200, 1, 1.0, 1.0, 128, 128, 128, 0.95) == (4096, 8192)
    # 256 <= R < 1024 rounds to 128s: 8B fp8 on an H100 (79.11 GiB) at 128/2048:
    # (79.11 - 7.48) x 0.95 / (64 KiB x 2176) = 512.4 requests -> 640.
    h100 = get_hardware("h100-sxm").mem_bytes
    assert batch_limits(arch, h100, 1, 1.0, 1.0, 128, 2048, 128, 0.95) == (640, 2048)


def test_the_trtllm_profile_runs_trtllm_bench_limits() -> None:
    # The v0.19 long-prompt row: a prompt plus a full batch of decodes fit one step (the
    # budget of the prompt alone let one sequence run at a time: 83% low).
    sources, runs = validate.load("calibration")
    r = next(x for x in runs if x["id"] == "trt-v0.19-8b-h200-tp1-20000x2000")
    ov = validate.overrides(r, sources[r["source"]])
    assert "scheduler.max_num_seqs=96" in ov and "scheduler.max_num_batched_tokens=20096" in ov
    # A closed loop of clients caps what trtllm-bench would allow.
    sources, runs = validate.load("calibration")
    r = next(x for x in runs if x.get("concurrency") == 5 and x["engine"] == "trtllm")
    assert "scheduler.max_num_seqs=5" in validate.overrides(r, sources[r["source"]])


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
    sources, runs = validate.load("calibration")
    p = dict(next(r for r in runs if r["model"] == "Llama-3.1-70B" and r["engine"] != "trtllm"))
    p.update(id="too-big", tp=1, weight_dtype="bfloat16", hardware="h100-sxm")  # 141 GB
    r = validate.run_point((p, sources[p["source"]], False))
    assert "leave no room" in r["error"]
    rows = validate.compare([p], [r])
    assert rows and all(x["error_pct"] == 100.0 and "failed" in x for x in rows)


def test_a_long_run_keeps_the_rows_done_so_far(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    sources, runs = validate.load("calibration")
    pts = runs[:3]
    seen: list[int] = []
    partial = tmp_path / "rows.json.partial"

    def fake(args: tuple[dict, dict, bool]) -> dict:
        # What the partial file holds when the next point starts: every point before it.
        seen.append(len(json.loads(partial.read_text())) if partial.exists() else 0)
        if len(seen) == 3:
            raise KeyboardInterrupt  # killed while running the third point
        return {"id": args[0]["id"], "pred": dict.fromkeys(validate.METRICS, 1.0)}

    monkeypatch.setattr(validate, "run_point", fake)
    with pytest.raises(KeyboardInterrupt):
        validate.run_all(pts, sources, jobs=1, partial=partial)
    rows = json.loads(partial.read_text())
    assert seen == [0, len(pts[0]["figures"]), len(rows)]
    assert {r["id"] for r in rows} == {pts[0]["id"], pts[1]["id"]}


def test_a_sharegpt_run_at_its_published_means_draws_those_means() -> None:
    # The stand-in's lognormal clipped to [4, 1024] averages ~2.5% under its parameter;
    # a run that states its own token totals gets parameters solved for them.
    import random

    from harness.workloads.random_lengths import draw_length

    ov = dict(o.split("=") for o in validate.sharegpt_at(232.6, 220.6))
    assert ov["workload.distribution"] == "lognormal" and ov["workload.input_max"] == "1024"
    rng = random.Random(0)
    for side, target in (("input", 232.6), ("output", 220.6)):
        mean, std = float(ov[f"workload.{side}_mean"]), float(ov[f"workload.{side}_std"])
        assert mean > target * 1.02  # the clip takes its share off
        xs = [draw_length(rng, "lognormal", mean, std, 4, 1024) for _ in range(40000)]
        assert sum(xs) / len(xs) == pytest.approx(target, rel=0.01)
    # and a run written that way composes with them (the plain 'sharegpt' keeps the old ones)
    run = {"id": "x", "engine": "vllm-v1", "model": "Qwen3-8B", "hardware": "h100-sxm",
           "tp": 1, "weight_dtype": "bfloat16", "backend": "paged", "num_prompts": 10,
           "rate": 0, "max_model_len": 40960, "workload": {
               "dataset": "sharegpt", "input_mean": 232.6, "output_mean": 220.6}}
    got = validate.overrides(run, {})
    assert f"workload.output_mean={ov['workload.output_mean']}" in got
    assert "workload.output_mean=200" in validate.overrides({**run, "workload": "sharegpt"}, {})


def _overlap_runs(truth: np.ndarray) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Synthetic all-at-once runs of an engine that overlaps its CPU time with the
    forward: each step takes max(forward, CPU time at ``truth``); at their large batches
    the CPU time outlasts the forward (a step's forward 20-60 ms, up to 600 sequences)."""
    rng = np.random.default_rng(1)
    runs = []
    for i in range(4):
        n = 300
        seqs = np.concatenate([rng.integers(1, 40, n // 2), rng.integers(200, 600, n // 2)])
        fwd = 20e-3 + 60e-6 * seqs + rng.uniform(0, 5e-3, n)
        x = np.stack([np.ones(n), seqs, np.ones(n), seqs, np.zeros(n)], 1)
        true_t = np.cumsum(np.maximum(fwd, x @ truth))
        steps = [(float(f), int(q), True, float(t))
                 for f, q, t in zip(fwd, seqs, np.cumsum(fwd))]
        ends = (100 + i, 180, 250, 299)
        reqs = [(0.0, float(np.cumsum(fwd)[5]), float(np.cumsum(fwd)[e]), e - 4, 100, 0.0)
                for e in ends]
        point = {"figures": {"requests_per_s": 100 / true_t[-1],
                             "e2e_ms_median": 1e3 * np.median([true_t[e] for e in ends])},
                 "num_prompts": 100, "engine": "sglang", "rate": 0}
        runs.append((point, {"trace": steps, "output_tokens": 0, "prompt_tokens": 0,
                             "requests": reqs, "allreduces": 0, "allreduce_latency": 0.0,
                             "overlap_cpu": True}))
    return runs


def test_an_overlapping_engines_fit_leaves_a_start_where_no_step_is_cpu_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # From constants under which no step's CPU time outlasts its forward the figures are
    # flat in the constants: a fit linearized there stayed at 0 (sglang's fitted 0 CPU
    # time, 2026-12-05). The multi-start fit finds the per-sequence time that is there.
    import dataclasses

    from harness.roofline import engines

    truth = np.array([0.0, 0.0, 0.0, 150e-6, 0.0])
    monkeypatch.setitem(engines.PROFILES, "sglang", dataclasses.replace(
        engines.PROFILES["sglang"], schedule_s=0.0, schedule_per_seq_s=0.0, step_s=0.0,
        step_per_seq_s=0.0))
    got = validate.fit_engine(_overlap_runs(truth), (3,))
    assert got["step_per_seq_s"] == pytest.approx(150e-6, rel=1e-3)
    # _fit_cpu fits such an engine's per-sequence terms alone (a fixed term it overlaps
    # shows only as a floor under small forwards), and refuses a mix of overlapping and
    # synchronous points of one engine.
    runs = _overlap_runs(truth)
    points = [{**p, "id": f"p{i}", "source": "synthetic"} for i, (p, _) in enumerate(runs)]
    res = {f"p{i}": {**r, "trace": [(*s[:2], False, s[3]) if j % 2 else s
                                    for j, s in enumerate(r["trace"])]}
           for i, (_, r) in enumerate(runs)}
    result: dict[str, Any] = {"engines": {}}
    validate._fit_cpu(points, res, result)
    fit = result["engines"]["sglang"]
    assert (fit["schedule_s"], fit["step_s"]) == (0.0, 0.0)
    assert fit["step_per_seq_s"] == pytest.approx(150e-6, rel=1e-3)
    assert fit["schedule_per_seq_s"] == pytest.approx(0.0, abs=1e-9)
    res["p1"] = {**res["p1"], "overlap_cpu": False}
    with pytest.raises(UserError, match="mix CPU time overlapped"):
        validate._fit_cpu(points, res, {"engines": {}})


def test_an_open_loop_fits_per_token_figures_not_its_length() -> None:
    # An open loop's length is its arrivals' (not a sum of steps): no throughput row;
    # its end-to-end time is a row, and a run at light load (engine TTFT under 0.2 s) is
    # told from one with a queue.
    (point, r), = _overlap_runs(np.zeros(5))[:1]
    point = {**point, "rate": 4.0}
    assert [m for m, *_ in validate._figure_rows(point, r)] == ["e2e_ms_median"]
    assert validate._light(point, r)
    late = {**r, "requests": [(0.0, 0.5, *q[2:]) for q in r["requests"]]}
    assert not validate._light(point, late)


def _light_runs(request_s: float, token_s: float) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Served open loops at light load whose published median TTFT is the engine's own
    (10 ms) plus a front end of ``request_s + token_s x prompt tokens``, at 500-8000
    tokens a prompt."""
    runs = []
    for n in (500, 2000, 4000, 8000):
        reqs = [(0.1 * i, 0.1 * i + 0.010, 0.1 * i + 1.0, 100, n, 0.0) for i in range(5)]
        point = {"id": f"l{n}", "rate": 10.0, "concurrency": 0,
                 "figures": {"ttft_ms_median": (0.010 + request_s + token_s * n) * 1e3}}
        runs.append((point, {"requests": reqs}))
    return runs


def test_a_front_ends_per_token_time_is_at_most_a_tokenizers() -> None:
    # Under the bound the front end is recovered exactly; above it (what SGLang 0.4.0's
    # long prompts asked: 41 us a token, what the step model missed of their prefill) the
    # per-token term stops at a tokenizer's cost and the fixed term takes the rest.
    got = validate.fit_served(_light_runs(0.020, 1.5e-6))
    assert got is not None
    assert (got["request_s"], got["prompt_token_s"]) == (pytest.approx(0.020, rel=1e-6),
                                                         pytest.approx(1.5e-6, rel=1e-6))
    got = validate.fit_served(_light_runs(0.015, 41e-6))
    assert got is not None
    assert got["prompt_token_s"] == validate.TOKENIZE_S == 2e-6
    assert got["request_s"] > 0.015
