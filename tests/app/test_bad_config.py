"""Bad values, table-driven and in-process: each row is a set of overrides and a phrase
the UserError must contain (the valid range, or what to change). The CLI maps UserError
to exit 2 (tests/e2e/test_bad_inputs.py runs the CLI itself); these rows fail before any
model work, except the ones about what a run did (all requests rejected)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.errors import UserError
from harness.runner import run
from tests.compose import compose_cfg
from tests.compose import tiny as _tiny_multiturn


def tiny(*overrides: str):  # type: ignore[no-untyped-def]
    """The tiny model; multiturn's small defaults unless another workload is chosen."""
    if any(o.startswith("workload=") for o in overrides):
        return compose_cfg(["model=tiny", "cache.kv_budget=256KiB", "progress=false",
                            *overrides])
    return _tiny_multiturn(*overrides)

ROWS = [
    (["backend=h2o", "backend.budget_ratio=1.5"], "0 <= backend.budget_ratio <= 1"),
    (["backend=h2o", "backend.budget=10", "backend.budget_ratio=0.5"], "exactly one"),
    (["backend=h2o", "backend.heavy_ratio=1"], "backend.heavy_ratio must be in (0, 1)"),
    (["backend=tova", "backend.prefill=once"], "unknown backend.prefill 'once'; known: "
                                               "full, streaming"),
    (["backend=snapkv", "backend.prefill=chunked"], "unknown backend.prefill 'chunked'"),
    (["backend=sliding_window", "backend.window=0"], "backend.window >= 1"),
    (["backend=int8", "backend.sink_tokens=-1"], "backend.sink_tokens must be >= 0"),
    (["backend.kernel=cuda"], "unknown backend.kernel"),
    (["backend.block_size=0"], "backend.block_size must be >= 1"),
    (["backend.block_size=3", "backend.kernel=triton"],  # issue 27: was an assertion
     "backend.kernel=triton needs backend.block_size >= 8, got 3: raise the block size or "
     "use backend.kernel=torch"),
    (["backend=contiguous", "backend.reserve=all"], "unknown backend.reserve"),
    (["workload.turns=0"], "workload.turns=0 is out of range: it must be >= 1"),
    (["workload.answer_tokens=0"], "workload.answer_tokens=0 is out of range"),
    (["workload.top_p=0"], "workload.top_p=0.0 is out of range: it must be in (0.0, 1.0]"),
    (["workload=random", "workload.input_mean=0"], "workload.input_mean=0.0 is out of range"),
    (["workload=random", "workload.rate=-1"], "workload.rate=-1.0 is out of range"),
    (["workload=random", "workload.priority_levels=-1"], "workload.priority_levels=-1"),
    (["workload=random", "workload.input_min=50", "workload.input_max=10"],
     "workload.input_min=50 is larger than workload.input_max=10"),
    (["workload=random", "workload.distribution=zipf"], "unknown workload.distribution"),
    (["workload=shared_prefix", "workload.num_prefixes=0"], "workload.num_prefixes=0"),
    (["workload=beam_search", "workload.n=0"], "workload.n=0 is out of range"),
    (["workload=long_prompt", "workload.num_short=0", "workload.num_long=0"],
     "num_short + workload.num_long must be >= 1"),
    (["cache.watermark=1.0"], "cache.watermark is a share of the cache in [0, 1)"),
    (["cache.watermark=-0.1"], "cache.watermark is a share of the cache in [0, 1)"),
    (["cache.kv_budget=lots"], "is not a size in bytes"),
    (["cache.kv_budget=1TiB"], "lower cache.kv_budget"),
    (["cpu_threads=-1"], "cpu_threads must be >= 0"),
    (["seed=-3"], "seed must be in [0, 2^63)"),
    (["device=cuda:0"], "use device=cpu or device=auto"),
    (["device=tpu"], "is not a device"),
    (["scheduler.max_num_seqs=0"], "scheduler.max_num_seqs=0 is out of range: it must be >= 1"),
    (["scheduler.max_model_len=1"], "scheduler.max_model_len=1 is out of range: it must be >= 2"),
    (["roofline.tp=0"], "roofline.tp=0 is out of range: it must be >= 1"),
    (["roofline.dtype=int4"], "unknown roofline.dtype 'int4'; known: float32, bfloat16"),
    (["roofline.weight_dtype=int3"], "unknown roofline.weight_dtype 'int3'; known:"),
    (["roofline.gpu_memory_utilization=0"],
     "roofline.gpu_memory_utilization=0.0 is out of range: it must be in (0.0, 1.0]"),
    # The what-if's specs (issue 27): a tp vLLM refuses, a reserve above the memory.
    (["executor=roofline", "roofline.tp=3"],
     "roofline.tp=3 must divide its 32 query heads for Llama-3.1-8B (vLLM refuses it too): "
     "use one of 1, 2, 4, 8, 16, 32"),
    (["executor=roofline", "roofline.model=Qwen2.5-7B", "roofline.tp=7"],
     "roofline.tp=7 must divide its 4 KV heads or be a multiple of them for Qwen2.5-7B"),
    (["executor=roofline", "roofline.activation_reserve=100GiB", "cache.kv_budget=auto"],
     "roofline.activation_reserve=100GiB is not below the usable memory of one h100-sxm "
     "(71.20GiB: 79.11GiB at gpu_memory_utilization 0.9): lower roofline.activation_reserve"),
    (["scheduler.policy=lifo"], "unknown scheduler.policy"),
    (["quality.enabled=true", "quality.prefill_tokens=0"], "1 <= quality.prefill_tokens"),
    (["quality.enabled=true", "quality.num_texts=0"], "quality.num_texts must be >= 1"),
    # What a run did: nothing finished is a failure, with the first reason.
    (["scheduler.max_model_len=16"], "no request finished: all 3 were rejected"),
    (["scheduler.chunked_prefill=false", "scheduler.max_num_batched_tokens=64"],
     "exceeds scheduler.max_num_batched_tokens=64 with chunked_prefill off"),
    # Issue #55: NaN and infinity were accepted (a NaN bandwidth stalled the run after
    # ~150 steps; an infinite latency wrote Infinity into metrics.json).
    (["cache.tiers.cpu=1MiB", "cache.tiers.cpu_bw_gbs=nan"],
     "cache.tiers.cpu_bw_gbs=nan is not a finite number"),
    (["cache.tiers.cpu=1MiB", "cache.tiers.cpu_latency_us=inf"],
     "cache.tiers.cpu_latency_us=inf is not a finite number"),
    (["workload=random", "workload.rate=inf"], "workload.rate=inf"),
    (["engine.cuda_graphs=yes"], "unknown engine.cuda_graphs 'yes'; known: auto, off, on"),
    # Options a cluster never reads, set away from their defaults (issue #55).
    (["cluster.router=least_loaded"],
     "cluster.router=least_loaded: ignored, as with cluster.replicas=1 there is no router"),
    (["cluster.replicas=2", "cluster.prefix_scorer=llm_d"],
     "cluster.prefix_scorer=llm_d: ignored, as cluster.router=round_robin does not read it"),
    (["cluster.replicas=2", "cluster.router=prefix_aware", "cluster.kv_weight=3"],
     "cluster.kv_weight=3.0: ignored, as cluster.router=prefix_aware with "
     "prefix_scorer=dynamo does not read it"),
    (["cluster.replicas=2", "cluster.seed=4"], "cluster.seed=4: ignored"),
    # Issue #55: 100,000 replicas spent minutes and gigabytes building stacks (each step
    # then scanned them all) and ignored Ctrl-C while it freed them.
    (["cluster.replicas=100000"], "cluster.replicas=100,000 is more than one run simulates "
                                  "(at most 4,096)"),
    (["slo.ttft_ms=500", "slo.e2e_ms=200"],
     "slo.e2e_ms=200.0 is below slo.ttft_ms=500.0: end to end includes the first token"),
    # Issue #54: a key no schema has (Hydra's "+key" hint for a typo) or a key the chosen
    # backend or workload ignores ran with the default, exit 0.
    (["+backend.blocksize=32"], "backend.blocksize is not an option of backend=paged; did "
                                "you mean backend.block_size? Known: block_size, kernel"),
    (["++backend.budget_ratio=0.2"], "backend.budget_ratio is not an option of backend=paged. "
                                     "Known: block_size, kernel (backend=h2o, tova"),
    (["backend=h2o", "+backend.budget_ration=0.3"], "did you mean backend.budget_ratio?"),
    (["+workload.conversation=2"], "workload.conversation is not an option of "
                                   "workload=multiturn; did you mean workload.conversations?"),
    (["++workload.num_requests=2"], "workload.num_requests is not an option of "
                                    "workload=multiturn. Known: seed, rate"),
    (["+scheduler.max_num_seq=4"], "scheduler.max_num_seq is not an option of scheduler; did "
                                   "you mean scheduler.max_num_seqs?"),
    (["+cache.tiers.cpux=1MiB"], "cache.tiers.cpux is not an option of cache.tiers; did you "
                                 "mean cache.tiers.cpu?"),
    (["+model.dtpye=float16"], "model.dtpye is not an option of model; did you mean "
                               "model.dtype?"),
    (["+seeds=3"], "seeds is not an option of the run config; did you mean seed?"),
    (["backend=contiguous", "backend.block_size=32"],
     "backend.block_size=32: ignored by backend=contiguous (contiguous storage reserves one "
     "range of single slots per sequence, it has no blocks)"),
    (["workload=beam_search", "workload.temperature=0.5", "workload.top_p=0.5"],
     "workload.temperature=0.5, workload.top_p=0.5: ignored by workload=beam_search"),
    (["workload=parallel_sampling", "workload.length_penalty=2"],
     "workload.length_penalty=2.0: ignored by workload=parallel_sampling"),
]


@pytest.mark.parametrize("overrides,phrase", ROWS, ids=[" ".join(r[0]) for r in ROWS])
def test_bad_value_is_a_user_error(overrides: list[str], phrase: str) -> None:
    with pytest.raises(UserError) as e:
        run(tiny(*overrides))
    assert phrase in str(e.value)


def test_binary_text_file_is_rejected(tmp_path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "weights.bin"
    f.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(UserError, match="looks binary"):
        run(tiny("quality.enabled=true", f"quality.text_file={f}"))
    g = tmp_path / "latin1.txt"
    g.write_bytes("caf\xe9 au lait ".encode("latin-1") * 50)
    with pytest.raises(UserError, match="is not UTF-8"):
        run(tiny("quality.enabled=true", f"quality.text_file={g}"))


def test_some_rejected_is_a_warning_with_a_budget_that_fits_all(capsys) -> None:  # type: ignore[no-untyped-def]
    # Random lengths under a budget that holds the small requests but not the large ones.
    r = run(tiny("workload=random", "workload.num_requests=12", "workload.input_max=400",
                 "workload.output_max=16", "cache.kv_budget=96KiB"))
    err = capsys.readouterr().err
    assert 0 < r.metrics["requests.rejected"] < 12
    assert "will be rejected: cache.kv_budget=" in err and "fits them all" in err
    assert "requests were rejected" in err


def test_seed_drives_the_workload() -> None:
    a = run(tiny("workload=random", "workload.num_requests=4", "seed=1"))
    b = run(tiny("workload=random", "workload.num_requests=4", "seed=2"))
    assert [r["prompt_tokens"] for r in a.requests] != [r["prompt_tokens"] for r in b.requests]
    own = run(tiny("workload=random", "workload.num_requests=4", "seed=2",
                   "workload.seed=1"))
    assert [r["prompt_tokens"] for r in own.requests] == \
        [r["prompt_tokens"] for r in a.requests]


def test_triton_on_cpu_says_it_is_the_interpreter(capsys) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("triton")
    import harness.kernels.runtime as rt

    rt._warned.clear()
    run(tiny("backend.kernel=triton", "workload.conversations=1", "workload.turns=1",
             "workload.answer_tokens=2"))
    assert "Triton's interpreter: correctness only, about 1000x slower" in \
        capsys.readouterr().err


def test_a_block_larger_than_any_sequence_is_a_warning(capsys) -> None:  # type: ignore[no-untyped-def]
    # Issue 27: accepted silently.
    run(tiny("backend.block_size=512", "scheduler.max_model_len=400", "cache.kv_budget=4MiB",
             "workload.conversations=1", "workload.turns=1", "workload.answer_tokens=2"))
    assert "warning: backend.block_size=512 exceeds the longest sequence " \
           "(max_model_len=400)" in capsys.readouterr().err


def test_metrics_json_is_standard_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A figure with no value is null in metrics.json, never NaN or Infinity (which JSON
    readers other than Python's refuse)."""
    import json

    from harness.results import json_text

    text = json_text({"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": -float("inf")},
                      "e": 2.5, "f": "x"})
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard {c}")) == {
        "a": None, "b": [1.0, None], "c": {"d": None}, "e": 2.5, "f": "x"}


def test_every_shipped_preset_and_experiment_job_is_accepted() -> None:
    """No conf/backend, conf/workload preset, nor any job of a conf/experiment sweep (every
    value of each swept key, the others at their first value: the full products cost
    ~0.1 s a job to compose) sets a key its backend or workload ignores, or one no schema
    has."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from harness.config import CONF_DIR, register_configs, run_config

    register_configs()
    parser = OverridesParser.create()
    jobs = [[f"{group}={f.stem}"] for group in ("backend", "workload")
            for f in sorted((CONF_DIR / group).glob("*.yaml"))]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for exp in sorted((CONF_DIR / "experiment").glob("*.yaml")):
            base = [f"+experiment={exp.stem}"]
            full = compose(config_name="config", overrides=base, return_hydra_config=True)
            swept = [(str(k), parser.parse_override(f"{k}={v}"))
                     for k, v in (full.hydra.sweeper.get("params") or {}).items()]
            axes = [(k, list(o.sweep_string_iterator()) if o.is_sweep_override()
                     else [o.get_value_element_as_str()]) for k, o in swept]
            first = [f"{k}={vs[0]}" for k, vs in axes]
            jobs += [[*base, *first[:i], f"{k}={v}", *first[i + 1:]]
                     for i, (k, vs) in enumerate(axes) for v in vs] or [base]
        seen, refused = set(), []
        for job in jobs:
            if tuple(job) in seen:
                continue
            seen.add(tuple(job))
            try:
                run_config(compose(config_name="config", overrides=job))
            except UserError as e:
                refused.append(f"{' '.join(job)}: {e}")
    assert not refused, "\n".join(refused)
    assert len(seen) > 100


def _harness(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[2], timeout=300)


def test_cli_refuses_the_append_hint_and_a_sweep_before_any_job(tmp_path: Path) -> None:
    # Hydra's hint for a typo (+backend.blocksize=32) used to run with block size 16, exit 0.
    p = _harness("model=tiny", "+backend.blocksize=32", f"hydra.run.dir={tmp_path}/run")
    assert p.returncode == 2, p.stderr
    assert "backend.blocksize is not an option of backend=paged; did you mean " \
           "backend.block_size?" in p.stderr
    assert not (tmp_path / "run" / "metrics.json").exists()
    # Without the +, Hydra's own refusal no longer suggests adding it.
    p = _harness("model=tiny", "backend=h2o", "backend.budget_ration=0.3",
                 f"hydra.run.dir={tmp_path}/run2")
    assert p.returncode == 2, p.stderr
    assert "backend.budget_ration is not an option of backend=h2o; did you mean " \
           "backend.budget_ratio?" in p.stderr and "To append" not in p.stderr
    # A sweep with one such job starts none.
    sweep = tmp_path / "sweep"
    p = _harness("-m", "model=tiny", "backend=paged,contiguous", "backend.block_size=32",
                 f"hydra.sweep.dir={sweep}")
    assert p.returncode == 2, p.stderr
    assert "sweep job #1 (backend=contiguous): backend.block_size=32: ignored by " \
           "backend=contiguous" in p.stderr and "no job was started" in p.stderr
    assert not sweep.exists() or not [d for d in sweep.iterdir() if d.is_dir()]
