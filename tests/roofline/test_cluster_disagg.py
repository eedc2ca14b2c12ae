"""A disaggregated cluster in the what-if (harness.cluster.disagg): the link's bandwidth
sets a whole-request transfer's time and TTFT moves by it; a one-request case worked by
hand; the decode side's prefix cache skips the transfer of what it holds; fewer bytes
per block move fewer bytes; layer-wise streaming hides the transfer behind the prefill;
the records add up; nothing stays held when the run ends; refusals."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest

from harness.cluster.config import SchedulerOverrides
from harness.cluster.disagg import DisaggCluster
from harness.cluster.pools import build_pools
from harness.cluster.run import make_disaggregated
from harness.config import run_config
from harness.errors import UserError
from harness.roofline.run import RooflineTarget
from harness.runner import run
from harness.sched.scheduler import SchedulerConfig
from harness.workloads import make_workload
from tests.compose import compose_cfg

ROOF = ["executor=roofline", "roofline.model=Llama-3.1-8B", "roofline.hardware=h100-sxm",
        "logger=none"]
DIS = ["cluster.mode=disaggregated"]
# One request of a 1,000-token prompt and 8 output tokens, alone in the cluster.
ONE = ["workload=random", "workload.num_requests=1", "workload.distribution=uniform",
       "workload.input_min=1000", "workload.input_max=1000", "workload.output_min=8",
       "workload.output_max=8", "cache.kv_budget=4GiB"]
MULTITURN = ["workload=multiturn", "workload.conversations=12", "workload.turns=4",
             "workload.rate=20", "cache.kv_budget=1GiB"]
# The TTFT split's parts (requests.csv's <part>_ms add up to ttft_ms).
PARTS = ("frontend", "prefill_queue", "prefill", "transfer", "decode_queue")
# Llama-3.1-8B in bf16: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes a token.
BF16_BLOCK = 16 * 32 * 8 * 128 * 2 * 2


def _run(*overrides: str, out: Path | None = None) -> Any:
    return run(compose_cfg([*ROOF, *overrides], out))


def test_halving_the_link_bandwidth_doubles_the_transfer_and_adds_it_to_ttft() -> None:
    """Whole-request transfer of one request, no latency: its time is bytes / bandwidth,
    so half the bandwidth takes twice as long, and the first token comes that much later
    (nothing else changes: the same prefill, the same decode step)."""
    def one(gbs: float) -> tuple[float, float, dict[str, Any]]:
        res = _run(*ONE, *DIS, f"cluster.link_gbs={gbs}", "cluster.link_latency_us=0")
        row = res.requests[0]
        return res.metrics["cluster.transfer_time_ms.mean"], row["ttft_ms"], row

    t_fast, ttft_fast, a = one(20.0)
    t_slow, ttft_slow, b = one(10.0)
    assert t_slow == pytest.approx(2 * t_fast, rel=1e-12)
    assert ttft_slow - ttft_fast == pytest.approx(t_slow - t_fast, rel=1e-9)
    assert b["transfer_ms"] - a["transfer_ms"] == pytest.approx(t_fast, rel=1e-9)
    for k in ("prefill_queue_ms", "prefill_ms", "decode_queue_ms"):
        assert a[k] == pytest.approx(b[k], rel=1e-9, abs=1e-12), k


def test_one_request_worked_by_hand() -> None:
    """A 1,000-token prompt: its 62 full blocks (999 // 16) move, 2 MiB each in bf16;
    over a 10 GB/s link with 5 us latency that is 5 us + 130,023,424 B / 1e10 B/s. The
    prefill side's step is the colocated engine's prefill (the same 1,000 tokens); the
    decode side computes the last 8 tokens (1,000 - 62 x 16) and makes the first token."""
    # Offline (no served front end: the split is the engines' and the link's time alone).
    res = _run(*ONE, *DIS, "cluster.link_gbs=10", "cluster.link_latency_us=5",
               "roofline.served=false")
    m, row = res.metrics, res.requests[0]
    moved = 62 * BF16_BLOCK
    assert row["prompt_tokens"] == 1000 and BF16_BLOCK == 2 * 1024 * 1024
    assert row["transfer_blocks"] == 62 and row["decode_hit_blocks"] == 0
    assert row["transfer_bytes"] == moved == m["cluster.transfer_bytes"]
    link_ms = 5e-3 + moved / 10e9 * 1e3
    assert m["cluster.transfer_time_ms.mean"] == pytest.approx(link_ms, rel=1e-12)
    assert row["transfer_ms"] == pytest.approx(link_ms, rel=1e-9)
    assert row["prefill_queue_ms"] == 0.0
    colocated = _run(*ONE, "roofline.served=false").requests[0]
    assert row["prefill_ms"] == pytest.approx(colocated["ttft_ms"], rel=1e-9)
    split = sum(row[f"{k}_ms"] for k in PARTS)
    assert split == pytest.approx(row["ttft_ms"], rel=1e-12)
    # The decode side's first step: 8 prompt tokens, far less than the prefill's 1,000.
    assert 0 < row["decode_queue_ms"] < row["prefill_ms"] / 2
    assert row["output_tokens"] == 8 and row["status"] == "finished"
    # Both pools' steps are in steps.csv's order, each with its replica and pool.
    assert m["cluster.prefill.replicas"] == 1 and m["cluster.gpus"] == 2


def test_a_served_front_end_is_its_own_part_of_the_split() -> None:
    """Served (the default), the same request's TTFT carries the engine profile's front
    end, request_s + prompt_token_s x 1,000 tokens: the split shows it as ``frontend``,
    and every other part is the offline run's (the engines' steps do not change)."""
    from harness.roofline.engines import PROFILES, engine_name

    prof = PROFILES[engine_name("auto", "h100-sxm")]
    front_ms = (prof.request_s + prof.prompt_token_s * 1000) * 1e3
    assert front_ms > 1.0, "the default engine profile has a fitted front end"
    offline = _run(*ONE, *DIS, "roofline.served=false").requests[0]
    served = _run(*ONE, *DIS).requests[0]
    assert offline["frontend_ms"] == 0.0
    assert served["frontend_ms"] == pytest.approx(front_ms, rel=1e-12)
    assert served["ttft_ms"] == pytest.approx(offline["ttft_ms"] + front_ms, rel=1e-9)
    for k in ("prefill_queue", "prefill", "transfer", "decode_queue"):
        assert served[f"{k}_ms"] == pytest.approx(offline[f"{k}_ms"], rel=1e-9, abs=1e-9), k


def test_layerwise_streaming_hides_the_transfer_behind_the_prefill() -> None:
    """The same request with its layers sent as the prefill computes them: the link
    (slow here) still takes its time, but from the prefill's start, so the first token
    comes sooner than after a whole-request transfer."""
    slow = ["cluster.link_gbs=2", "cluster.link_latency_us=0"]
    whole = _run(*ONE, *DIS, *slow).requests[0]
    layers = _run(*ONE, *DIS, *slow, "cluster.transfer=layerwise").requests[0]
    assert layers["transfer_bytes"] == whole["transfer_bytes"]
    assert layers["ttft_ms"] < whole["ttft_ms"] - whole["prefill_ms"] / 2
    # Only what the prefill could not hide is left: the link time past the prefill.
    link_ms = whole["transfer_ms"]
    assert layers["transfer_ms"] == pytest.approx(link_ms - layers["prefill_ms"], rel=1e-9)


def test_the_decode_sides_prefix_cache_skips_the_transfer_of_what_it_holds() -> None:
    """A conversation's second turn re-sends the first (prompt and answer): the decode
    replica that served the first holds it, so only the new blocks move."""
    res = _run("workload=multiturn", "workload.conversations=1", "workload.turns=3",
               "cache.kv_budget=2GiB", *DIS)
    rows = list(res.requests)
    assert [r["status"] for r in rows] == ["finished"] * 3
    assert rows[0]["decode_hit_blocks"] == 0
    for r in rows:
        assert r["transfer_blocks"] + r["decode_hit_blocks"] == (r["prompt_tokens"] - 1) // 16
    assert all(r["decode_hit_blocks"] > 0 for r in rows[1:])
    assert rows[1]["transfer_blocks"] < rows[1]["decode_hit_blocks"]
    m = res.metrics
    assert m["cluster.transfer_skipped_blocks"] == sum(r["decode_hit_blocks"] for r in rows)
    # The prefill side's own cache found the history too (its hits are the prompt's).
    assert all(r["prefix_hit_tokens"] > 0 for r in rows[1:])


def test_fewer_bytes_per_block_move_fewer_bytes() -> None:
    per = {b: _run(*ONE, *DIS, f"backend={b}").metrics["cluster.transfer_bytes_per_request"]
           for b in ("paged", "fp8", "kivi")}
    assert per["paged"] == 62 * BF16_BLOCK
    assert per["fp8"] <= 0.55 * per["paged"]
    assert per["kivi"] < per["fp8"]


def _records(tmp_path: Path, *more: str) -> tuple[Any, list[dict[str, str]],
                                                  list[dict[str, str]]]:
    res = _run(*MULTITURN, *DIS, "cluster.prefill_replicas=2", "cluster.decode_replicas=3",
               "cluster.router=least_loaded", "slo.ttft_ms=200", *more, out=tmp_path)
    with open(tmp_path / "requests.csv") as f:
        reqs = list(csv.DictReader(f))
    with open(tmp_path / "steps.csv") as f:
        steps = list(csv.DictReader(f))
    return res, reqs, steps


def test_records_add_up(tmp_path: Path) -> None:
    res, reqs, steps = _records(tmp_path)
    m = res.metrics
    assert m["requests.finished"] == len(reqs) == 48
    assert m["run.prefill_replicas"] == 2 and m["run.decode_replicas"] == 3
    assert m["run.prefill_router"] == m["run.decode_router"] == "least_loaded"
    assert sum(m[f"replica.{i}.requests_routed"] for i in range(2)) == 48
    assert sum(m[f"replica.{i}.requests_routed"] for i in range(2, 5)) == 48
    for r in reqs:  # each request's row is its decode replica's, its TTFT split whole
        assert int(r["replica"]) == 2 + int(r["decode_replica"])
        parts = sum(float(r[f"{k}_ms"]) for k in PARTS)
        assert parts == pytest.approx(float(r["ttft_ms"]), rel=1e-9)
        assert min(float(r[f"{k}_ms"]) for k in PARTS) >= -1e-9
    assert {s["pool"] for s in steps} == {"prefill", "decode"}
    assert all((s["pool"] == "prefill") == (int(s["replica"]) < 2) for s in steps)
    assert sum(int(r["transfer_bytes"]) for r in reqs) == m["cluster.transfer_bytes"]
    for side in ("prefill", "decode"):
        assert 0 < m[f"cluster.{side}.utilization"] <= 1
        assert 0 < m[f"cluster.{side}.kv_peak_share"] <= 1
    assert m["cluster.goodput_rps_per_gpu"] == pytest.approx(
        m["latency.goodput_rps"] / 5)
    for k in PARTS:
        assert m[f"latency.ttft_ms.{k}.p50"] <= m[f"latency.ttft_ms.{k}.p99"]
    # The prefix hit rate is the prompts' (the prefill pool's lookups).
    hit = sum(int(r["prefix_hit_tokens"]) for r in reqs)
    assert m["cache.prefix_hit_rate"] == pytest.approx(
        hit / sum(int(r["prompt_tokens"]) for r in reqs), rel=0.05)


def _cluster(*overrides: str) -> DisaggCluster:
    """A disaggregated cluster of ``overrides`` after its run (its replicas to look at)."""
    rc = run_config(compose_cfg([*ROOF, *DIS, *overrides]))
    rc.workload.seed = rc.seed
    target = RooflineTarget(rc)
    wl = make_workload(rc.workload, target.tokenizer)
    _, stacks = build_pools(target, rc, wl)
    c = make_disaggregated(rc, stacks)
    c.run(wl)
    return c


@pytest.mark.parametrize("more", [
    [],
    ["cluster.transfer=layerwise"],
    ["cluster.decode.scheduler.max_num_seqs=4", "cache.kv_budget=256MiB"],  # tight room
], ids=["whole", "layerwise", "tight-decode"])
def test_nothing_stays_held_and_every_request_lands(more: list[str]) -> None:
    c = _cluster(*MULTITURN, "cluster.decode_replicas=2", *more)
    assert len(c.handoffs) == 48
    for h in c.handoffs:
        assert h.landed is not None and h.d_row >= 0
        assert h.landed >= (h.prefill_end or 0.0)
    for r in c.replicas:
        assert all(sid >= 0 for sid in r.kv._seqs), (r.pool, r.index)  # no hold, no slot
        assert not r.stack.scheduler.has_unfinished
        assert r.kv.pool.num_free == r.kv.pool.num_blocks
    # Each request's prompt is looked up once, on its prefill replica.
    asked = sum(r.kv.stats.prefix_query_tokens for r in c.prefill)
    assert asked == sum(len(h.group.prompt_ids) for h in c.handoffs)


def test_a_request_the_decode_side_refuses_moves_nothing_and_ends_there() -> None:
    """A decode pool whose max_model_len is shorter than a prompt: that request is
    prefilled, nothing is held or moved for it, and the decode replica rejects it on
    landing with its reason (its row the decode side's); the others run as usual."""
    c = _cluster(*MULTITURN, "cluster.decode.scheduler.max_model_len=1400")
    refused = [h for h in c.handoffs if h.refused is not None]
    assert refused and len(refused) < len(c.handoffs)
    for h in refused:
        assert h.held is None and h.slot is None and h.sent is None
        assert "max_model_len=1400" in (h.group.rejected_reason or "")
        assert h.d_row >= 0 and h.landed == h.prefill_end
    for r in c.replicas:
        assert all(sid >= 0 for sid in r.kv._seqs) and r.stack.scheduler.loans == 0


def test_each_pool_takes_its_own_hardware_and_scheduler() -> None:
    c = _cluster(*ONE, "cluster.prefill.hardware=h200", "cluster.decode.tp=2",
                     "cluster.prefill.scheduler.max_num_batched_tokens=4096",
                     "cluster.decode.scheduler.max_num_seqs=7")
    p, d = c.prefill[0].stack, c.decode[0].stack
    assert p.engine.executor.model.hw.name != d.engine.executor.model.hw.name
    assert p.scheduler.cfg.max_num_batched_tokens == 4096
    assert d.scheduler.cfg.max_num_seqs == 7
    assert c.lanes == 1  # min(tp): the prefill replica's one GPU sends everything
    assert p.sizing.kv_budget_bytes == d.sizing.kv_budget_bytes  # 4GiB each


def test_scheduler_overrides_name_every_scheduler_option() -> None:
    from dataclasses import fields

    assert [f.name for f in fields(SchedulerOverrides)] == \
        [f.name for f in fields(SchedulerConfig)]


@pytest.mark.parametrize(("overrides", "message"), [
    ([*DIS, "cluster.replicas=4"], r"cluster\.replicas=4 sizes a colocated cluster"),
    (["cluster.link=nvlink"], r"cluster\.link=nvlink: ignored.*colocated"),
    (["cluster.decode_replicas=2"], r"cluster\.decode_replicas=2: ignored"),
    (["cluster.prefill.tp=2"], r"cluster\.prefill\.\*: ignored.*colocated"),
    ([*DIS, "cluster.link=carrier_pigeon"], r"cluster\.link='carrier_pigeon'"),
    ([*DIS, "cluster.link_gbs=0"], r"cluster\.link_gbs=0\.0 must be"),
    ([*DIS, "cluster.transfer=bulk"], r"cluster\.transfer='bulk'"),
    ([*DIS, "cluster.prefill.router=random"], r"cluster\.prefill\.router=random: ignored"),
    ([*DIS, "cluster.decode_replicas=2", "cluster.decode.router=random",
      "cluster.router=least_loaded"], r"cluster\.router=least_loaded: ignored"),
    ([*DIS, "cluster.seed=3"], r"cluster\.seed=3: ignored"),
    ([*DIS, "+cluster.prefill.scheduler.max_num_seq=8"],
     r"did you mean cluster\.prefill\.scheduler\.max_num_seqs"),
    ([*DIS, "cluster.decode.scheduler.mixing=interleaved"],
     r"cluster\.decode: unknown scheduler\.mixing .interleaved."),
    ([*DIS, "backend=h2o"], r"backend h2o runs without prefix caching"),
    ([*DIS, "backend=sliding_window"], r"backend sliding_window keeps its blocks"),
    ([*DIS, "cache.enable_prefix_caching=false"], r"cache\.enable_prefix_caching=true"),
    ([*DIS, "cache.admission=second_hit"], r"cache\.admission=second_hit may not cache"),
    ([*DIS, "cluster.decode_replicas=5000"], r"cluster\.decode_replicas=5,000 is more"),
])
def test_refusals(overrides: list[str], message: str) -> None:
    with pytest.raises(UserError, match=message):
        _run(*ONE, *overrides)


def test_real_engine_refuses_what_if_options() -> None:
    with pytest.raises(UserError, match=r"cluster\.prefill\.tp=2, cluster\.link=eth: "
                                        r"what-if options"):
        run_config(compose_cfg([*DIS, "cluster.prefill.tp=2", "cluster.link=eth"]))
