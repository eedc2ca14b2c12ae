"""A what-if takes the batch sizes of the engine it models where the user gives none
(issue #54; harness/roofline/sizes.py); executor=model keeps kvbench's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from harness.config import run_config
from harness.roofline.arch import ArchSpec
from harness.roofline.config import RooflineConfig
from harness.roofline.engines import PROFILES
from harness.roofline.hardware import get_hardware
from harness.roofline.models import get_model_spec
from harness.roofline.sizes import engine_size, resolve_sizes, rule_pairs, trtllm_limits
from harness.roofline.trtllm_bench import batch_limits
from harness.runner import run
from harness.sched.scheduler import SchedulerConfig
from harness.sched.spec import SCHEDULER_SIZES, SchedulerSpec
from tests.compose import compose_cfg

BASE = ["executor=roofline", "roofline.model=Llama-3.1-8B", "roofline.hardware=h100-sxm",
        "workload=random", "workload.num_requests=12", "workload.input_max=256",
        "workload.output_max=32", "logger=none"]
SIZES = ("max_num_seqs", "max_num_batched_tokens", "max_model_len")
KV_BYTES = 2 * 32 * 8 * 128 * 2  # Llama-3.1-8B's bf16 K/V per token


def sizes_of(out: Path) -> tuple[dict[str, object], dict[str, object]]:
    """(metrics.json's run.<size> keys, config.yaml's scheduler sizes) of a run folder."""
    m = json.loads((out / "metrics.json").read_text())
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    return ({k: m[f"run.{k}"] for k in SIZES}, {k: cfg["scheduler"][k] for k in SIZES})


def test_a_roofline_run_without_sizes_takes_the_engine_profiles(tmp_path: Path) -> None:
    # vllm-0.6 (roofline.engine=auto on a GPU): 256 sequences, a budget of
    # max(max_model_len, 2048); max_model_len: 8 GiB holds 65,536 of Llama-3.1-8B's
    # tokens, below its 131,072 context.
    r = run(compose_cfg([*BASE, "cache.kv_budget=8GiB"], tmp_path))
    want = {"max_num_seqs": 256, "max_num_batched_tokens": 65536, "max_model_len": 65536}
    assert sizes_of(tmp_path) == (want, want)
    assert r.metrics["run.scheduler_sizes"] == (
        "max_num_seqs=256 (vllm-0.6), max_num_batched_tokens=65536 (vllm-0.6), "
        "max_model_len=65536 (kv budget)")
    assert r.metrics["run.fast_path"] == "lanes"  # mixing and chunking stay kvbench's
    assert r.metrics["memory.max_running_seqs"] == 12  # 32 would not have bounded it either


def test_the_models_context_bounds_max_model_len_when_the_budget_holds_more() -> None:
    m = run(compose_cfg([*BASE, "cache.kv_budget=auto", "roofline.engine=sglang"])).metrics
    assert m["run.max_model_len"] == get_model_spec("Llama-3.1-8B").max_position_embeddings
    assert (m["run.max_num_seqs"], m["run.max_num_batched_tokens"]) == (2048, 8192)
    assert m["run.scheduler_sizes"].endswith("max_model_len=131072 (context)")


def test_a_users_sizes_win(tmp_path: Path) -> None:
    run(compose_cfg([*BASE, "scheduler.max_num_seqs=5", "scheduler.max_model_len=1000",
                     "cache.kv_budget=8GiB"], tmp_path))
    m, cfg = sizes_of(tmp_path)
    assert m == cfg == {"max_num_seqs": 5, "max_num_batched_tokens": 2048,
                        "max_model_len": 1000}


def test_the_kvbench_engine_keeps_kvbench_batch_sizes() -> None:
    m = run(compose_cfg([*BASE, "roofline.engine=kvbench", "cache.kv_budget=1GiB"])).metrics
    assert (m["run.max_num_seqs"], m["run.max_num_batched_tokens"]) == (32, 1024)
    assert m["run.max_model_len"] == 1 * 2**30 // KV_BYTES  # 8,192 tokens in 1 GiB


def test_trtllm_takes_trtllm_benchs_limits_from_the_workload() -> None:
    m = run(compose_cfg([*BASE, "roofline.engine=trtllm", "cache.kv_budget=auto",
                         "workload.distribution=uniform", "workload.input_min=200",
                         "workload.input_max=200", "workload.output_min=20",
                         "workload.output_max=20"])).metrics
    hw = get_hardware("h100-sxm")
    bs, tokens = batch_limits(get_model_spec("Llama-3.1-8B"), hw.mem_bytes, 1, 2.0, 2.0,
                              200, 20, 200, 0.9, chunked_prefill=True)
    assert (m["run.max_num_seqs"], m["run.max_num_batched_tokens"]) == (bs, tokens)
    assert "(trtllm)" in m["run.scheduler_sizes"]


def test_engine_rules() -> None:
    assert engine_size(256, "max_num_seqs", 4096, None) == 256
    assert engine_size("max(max_model_len, 2048)", "max_num_batched_tokens", 1000, None) == 2048
    assert engine_size("max(max_model_len, 2048)", "max_num_batched_tokens", 9000, None) == 9000
    assert engine_size("trtllm-bench", "max_num_seqs", 0, (64, 4096)) == 64
    assert engine_size("trtllm-bench", "max_num_batched_tokens", 0, (64, 4096)) == 4096
    with pytest.raises(ValueError, match="unknown engine profile rule"):
        engine_size("twice", "max_num_seqs", 0, None)
    pair = rule_pairs("h100-sxm", get_hardware("h100-sxm").mem_bytes, True, 500_000, 4096)
    for p in PROFILES.values():  # every profile's rule resolves
        for k in ("max_num_seqs", "max_num_batched_tokens"):
            if k in p.scheduler:
                assert engine_size(p.scheduler[k], k, 4096, (64, 4096), pair) > 0


def test_vllm_v1_and_sglang_sizes_are_their_defaults() -> None:
    # vLLM (>= 0.9) by usage context and card: the API server on an H100 / H200 takes
    # 8192 tokens and 1024 sequences, offline LLM 16384; an A100 2048 / 256 (vLLM PR
    # #17885 keeps A100 small).
    h100, a100 = get_hardware("h100-sxm"), get_hardware("a100-80gb")
    assert rule_pairs("h100-sxm", h100.mem_bytes, True, 1, 1)["vllm-v1"] == (8192, 1024)
    assert rule_pairs("h100-sxm", h100.mem_bytes, False, 1, 1)["vllm-v1"] == (16384, 1024)
    assert rule_pairs("a100-80gb", a100.mem_bytes, True, 1, 1)["vllm-v1"] == (2048, 256)
    # SGLang: 8192-token chunks on an 80 GB card, 4096 on 48 GB; the running cap from the
    # pool (500,000 tokens at 4096 context: 62,500 -> capped 4096; 2,000,000 at 131072 ->
    # 7,812 -> 4096; 100,000 at 131072 -> 390 -> at least 2048).
    assert rule_pairs("h100-sxm", h100.mem_bytes, True, 500_000, 4096)["sglang"] == (8192, 4096)
    assert rule_pairs("l40s", get_hardware("l40s").mem_bytes, True, 100_000, 131072)[
        "sglang"] == (4096, 2048)


def test_trtllm_limits_read_the_workload_and_the_backends_bytes() -> None:
    from harness.backends.base import KVLayout
    from harness.stack import make_backend

    arch: ArchSpec = get_model_spec("Llama-3.1-8B")
    layout = KVLayout(arch.num_layers, arch.num_kv_heads, arch.head_dim, __import__(
        "torch").bfloat16)
    rc = run_config(compose_cfg(["backend=fp8"]))
    fp8 = make_backend(rc.backend, layout, __import__("torch").device("cpu"))
    hw, r = get_hardware("h100-sxm"), RooflineConfig()
    shapes = [(100, 10, 1), (300, 30, 1)]
    assert trtllm_limits(arch, hw, r, fp8, shapes, False) == batch_limits(
        arch, hw.mem_bytes, 1, 2.0, 1.0, 200, 20, 300, 0.9, False)
    sched = resolve_sizes(SchedulerSpec(), PROFILES["trtllm"], "trtllm", arch, hw, r, fp8,
                          "1GiB", lambda: shapes)
    assert sched.source == {"max_num_seqs": "trtllm", "max_num_batched_tokens": "trtllm",
                            "max_model_len": "kv budget"}
    assert type(sched.sched) is SchedulerConfig


def test_executor_model_keeps_kvbenchs_sizes_and_output_ids() -> None:
    rc = run_config(compose_cfg(["model=tiny"]))
    assert type(rc.scheduler) is SchedulerConfig
    assert {k: getattr(rc.scheduler, k) for k in SIZES} == SCHEDULER_SIZES == {
        "max_num_seqs": 32, "max_num_batched_tokens": 1024, "max_model_len": 2048}
    assert rc.records.output_ids is True
    rc = run_config(compose_cfg(["model=tiny", "scheduler.max_num_seqs=3"]))
    assert rc.scheduler.max_num_seqs == 3 and rc.scheduler.max_model_len == 2048


def test_roofline_runs_keep_no_output_ids_unless_asked() -> None:
    rc = run_config(compose_cfg(["executor=roofline"]))
    assert rc.records.output_ids is False
    assert isinstance(rc.scheduler, SchedulerSpec) and rc.scheduler.unset() == SIZES
    r = run(compose_cfg(BASE))
    assert r.outputs == {} and "output_ids" not in r.requests[0]
    r = run(compose_cfg([*BASE, "records.output_ids=true"]))
    assert len(r.outputs) == 12 and "output_ids" in r.requests[0]


def test_an_unset_size_is_checked_when_given() -> None:
    from harness.errors import UserError

    with pytest.raises(UserError, match="max_num_seqs"):
        run_config(compose_cfg(["executor=roofline", "scheduler.max_num_seqs=0"]))


def test_as_recorded_fills_what_a_run_resolves_from_the_config_alone() -> None:
    from harness.config import as_recorded

    model = as_recorded({"executor": "model", "scheduler": {"max_num_seqs": 4,
                         "max_num_batched_tokens": None, "max_model_len": None},
                         "records": {"output_ids": None}})
    assert model["scheduler"] == {"max_num_seqs": 4, "max_num_batched_tokens": 1024,
                                  "max_model_len": 2048}
    assert model["records"] == {"output_ids": True}
    roof = as_recorded({"executor": "roofline", "scheduler": {"max_num_seqs": None},
                        "records": {"output_ids": None}})
    assert roof == {"executor": "roofline", "scheduler": {"max_num_seqs": None},
                    "records": {"output_ids": False}}  # the engine's sizes: at the run
