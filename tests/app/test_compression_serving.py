"""``+experiment=compression_serving`` (issue #56): every compression method beside paged and
contiguous under one KV budget at 4k and 32k prompts; in the what-if (executor=roofline)
a method that frees memory runs more sequences at once and reads fewer bytes a decode
token than paged, at the same prompts."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from harness.config import CONF_DIR, compose_config, run_config
from harness.runner import run


def _what_if(*over: str) -> dict[str, Any]:
    cfg = compose_config(["+experiment=compression_serving", "executor=roofline",
                          "records.output_ids=false", *over])
    return run(cfg).metrics


def test_the_experiment_sweeps_every_method_at_two_prompt_lengths() -> None:
    exp = OmegaConf.load(CONF_DIR / "experiment" / "compression_serving.yaml")
    params = exp.hydra.sweeper.params
    assert params["workload.input_min"] == "4032,32704"
    assert params["backend"].split(",") == [
        "paged", "contiguous", "quest", "kivi", "h2o", "tova", "snapkv", "knorm", "keydiff",
        "observed_attention", "expected_attention"]
    rc = run_config(compose_config(["+experiment=compression_serving",
                                    "workload.input_min=32704", "backend=knorm"]))
    assert (rc.workload.input_min, rc.workload.input_max) == (32704, 32704)
    assert rc.cache.kv_budget == "6GiB" and rc.model.source == "random-llama8b"


def test_in_the_what_if_a_method_runs_more_sequences_and_reads_less() -> None:
    paged, knorm = (_what_if(f"backend={b}") for b in ("paged", "knorm"))
    for m in (paged, knorm):
        assert m["requests.finished"] == 16 and m["run.executor"] == "roofline"
    assert paged["memory.max_running_seqs"] == 12 and knorm["memory.max_running_seqs"] == 16
    assert knorm["attention.kv_read_bytes_per_token"] < \
        0.25 * paged["attention.kv_read_bytes_per_token"]
    assert knorm["throughput.output_tokens_per_s"] > paged["throughput.output_tokens_per_s"]
