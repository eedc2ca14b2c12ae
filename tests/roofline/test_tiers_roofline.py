"""The lower tiers in the what-if: transfer time by hand count, overlapped or not, a
multi-turn run whose histories outgrow the device, and the config's refusals."""

from __future__ import annotations

from typing import Any

import pytest

from harness.errors import UserError
from harness.kv.tiers import CPU, DISK, GPU, TierOp
from harness.roofline.executor import TierLinks
from harness.runner import run
from tests.compose import compose_cfg, tiny


def test_transfer_seconds_by_hand() -> None:
    links = TierLinks(host_bw=1e9, host_latency=10e-6, disk_bw=1e8, disk_latency=100e-6)
    ops = [TierOp(GPU, 1, CPU, 0), TierOp(GPU, 2, CPU, 1), TierOp(CPU, 3, DISK, 0),
           TierOp(GPU, 5, CPU, 3), TierOp(DISK, 0, GPU, 7), TierOp(DISK, 1, GPU, 8),
           TierOp(CPU, 4, GPU, 9)]
    rank, block = 1000.0, 8000.0  # one GPU's share of a block; the whole block
    want = ((10e-6 + 3 * rank / 1e9)          # three stores over the host link, one transfer
            + (100e-6 + 1 * block / 1e8)      # one spill to disk (every GPU's share)
            + (100e-6 + 2 * block / 1e8)      # two loads from disk
            + (10e-6 + 1 * rank / 1e9))       # one load from host memory
    assert links.seconds(ops, rank, block) == pytest.approx(want, rel=1e-12)
    assert links.seconds([], rank, block) == 0.0


def what_if(*extra: str) -> dict[str, Any]:
    """Llama-3.1-8B on one H100 (modelled), 48 conversations of 4 turns whose histories
    come back after 20 s: more than a 512 MiB device cache holds between turns."""
    return run(compose_cfg([
        "executor=roofline", "roofline.model=Llama-3.1-8B", "roofline.hardware=h100-sxm",
        "workload=multiturn", "workload.conversations=48", "workload.turns=4",
        "workload.think_time_s=20", "workload.rate=2", "workload.system_words=60",
        "workload.user_words=20", "workload.answer_tokens=48", "cache.kv_budget=512MiB",
        *extra])).metrics


def test_tiers_in_the_what_if() -> None:
    off = what_if()
    on = what_if("cache.tiers.cpu=8GiB")
    lapped = what_if("cache.tiers.cpu=8GiB", "cache.tiers.overlap=true")
    assert on["cache.hit_rate.cpu"] > 0.1
    assert on["cache.prefill_tokens_computed"] < off["cache.prefill_tokens_computed"]
    assert on["cache.hit_rate.miss"] < off["cache.hit_rate.miss"]
    # About the same blocks move either way (the hidden 0.25 s moves the schedule, and a
    # turn that comes back a step earlier or later can find one block more or less);
    # overlapped, the transfers hide behind compute: the steps pay none of them here
    # (each step's transfers are far under its own work), where unoverlapped they pay
    # every one. (Not the run's wall: it is the arrivals' and think times', and a
    # schedule moved by the hidden 0.25 s can end either side of it.)
    assert abs(lapped["cache.tier.cpu.blocks_up"] - on["cache.tier.cpu.blocks_up"]) <= 2
    assert on["cache.tier.transfer_s"] > 0
    assert on["cache.tier.exposed_s"] == on["cache.tier.transfer_s"]
    assert lapped["cache.tier.transfer_s"] > 0 and lapped["cache.tier.exposed_s"] == 0.0
    assert on["run.tiers"] == "cpu=8GiB,write=evict,overlap=false"
    assert on["run.tier_eviction"] == "cpu=lru" and "run.tier_eviction" not in off
    # Bytes: an 8B block of 16 tokens is 16 x 128 KiB in bf16.
    assert on["cache.tier.cpu.bytes_up"] == on["cache.tier.cpu.blocks_up"] * 16 * 131072


def test_a_tiers_own_eviction_order() -> None:
    """cache.tiers.cpu_policy orders the CPU tier alone: on a CPU tier too small for the
    histories, arc keeps the blocks loaded back (t2) over the ones written once, and
    serves more of them than lru; the device's order is unchanged, and its hits move only
    as the tier's load times move the conversations' next turns (within a point)."""
    lru = what_if("cache.tiers.cpu=1GiB")
    arc = what_if("cache.tiers.cpu=1GiB", "cache.tiers.cpu_policy=arc")
    assert (lru["run.tier_eviction"], arc["run.tier_eviction"]) == ("cpu=lru", "cpu=arc")
    assert arc["run.eviction"] == "lru"
    assert arc["cache.hit_rate.cpu"] > lru["cache.hit_rate.cpu"] + 0.01
    assert arc["cache.hit_rate.gpu"] == pytest.approx(lru["cache.hit_rate.gpu"], abs=0.01)
    # Unset, a tier's order is cache.eviction's; set to it, nothing changes.
    both = what_if("cache.tiers.cpu=1GiB", "cache.eviction=arc")
    same = what_if("cache.tiers.cpu=1GiB", "cache.eviction=arc", "cache.tiers.cpu_policy=arc")
    assert both["run.tier_eviction"] == "cpu=arc" and both == same | {
        k: both[k] for k in both if k.startswith(("run.started_at", "engine."))}


@pytest.mark.parametrize("overrides,message", [
    (["cache.tiers.disk=1GiB"], "needs a CPU tier above it"),
    (["cache.tiers.cpu=1GiB", "cache.tiers.write=lazy"], "cache.tiers.write must be one of"),
    (["cache.tiers.cpu=lots"], "is not a size in bytes"),
    (["cache.tiers.cpu=1KiB"], "holds no block"),
    (["cache.tiers.cpu=1MiB", "cache.tiers.overlap=true"], "what-if option"),
    (["cache.tiers.cpu=1MiB", "cache.tiers.disk_latency_us=-1"], "must be >= 0"),
    # A tier's eviction order where that tier cannot be (as cache.eviction without
    # prefix caching), or one that does not exist.
    (["cache.tiers.cpu_policy=arc"], r"there are no tiers \(cache\.tiers\.cpu=0\)"),
    (["cache.tiers.cpu=1MiB", "cache.tiers.disk_policy=lfu"],
     r"the disk tier gives up, but there is none"),
    (["cache.enable_prefix_caching=false", "cache.tiers.cpu=1MiB",
      "cache.tiers.cpu_policy=slru"], r"need cache\.enable_prefix_caching=true"),
    (["backend=h2o", "cache.tiers.cpu=1MiB", "cache.tiers.cpu_policy=arc"],
     r"this run has no lower tiers \(prefix caching is off"),
    (["backend=snapkv", "cache.tiers.cpu=1MiB", "cache.tiers.cpu_policy=arc"],
     r"no lower tiers \(backend snapkv caches compressed prefixes, not blocks by"),
    (["cache.tiers.cpu=1MiB", "cache.tiers.cpu_policy=mru"],
     r"unknown cache\.tiers\.cpu_policy 'mru'; known: lru, fifo"),
])
def test_bad_tier_configs_say_what_to_change(overrides: list[str], message: str) -> None:
    with pytest.raises(UserError, match=message):
        run(tiny(*overrides))


def test_a_method_that_rewrites_blocks_runs_without_tiers(capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    m = run(tiny("backend=snapkv", "backend.budget_ratio=0.5",
                 "cache.tiers.cpu=1MiB")).metrics
    assert m["run.tiers"] == "off" and "cache.tier.transfer_s" not in m
    assert "run.tiers=off" in capsys.readouterr().err


def test_tiers_larger_than_the_machine_are_refused_before_allocating() -> None:
    with pytest.raises(UserError, match="host memory"):
        run(tiny("cache.tiers.cpu=100TiB"))
    with pytest.raises(UserError, match=r"free: lower cache\.tiers\.disk"):
        run(tiny("cache.tiers.cpu=1MiB", "cache.tiers.disk=1000TiB"))
