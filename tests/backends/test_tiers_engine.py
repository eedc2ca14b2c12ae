"""The lower tiers in the real engine (tiny model, CPU): the same tokens with tiers on and
off, although every block loaded from a tier first has its device block filled with
garbage (KVBENCH_CHECK, which the suite sets), so a load that reads nothing fails; the
hit-rate split, the traffic in the backend's own bytes, and a load that is broken on
purpose caught."""

from __future__ import annotations

import errno
import os
from typing import Any

import pytest
import torch

from harness.backends.tier_storage import TierStorage
from harness.kv.tiers import GPU, TierOp
from harness.runner import run
from harness.sched.step import CHECKS
from tests.compose import tiny

# 8 conversations x 3 turns behind one system prompt, on a device pool that holds about
# two of them: the histories leave the device between turns and come back from the tiers.
LOAD = ("workload.conversations=8", "workload.turns=3", "workload.system_words=60",
        "workload.user_words=12", "workload.answer_tokens=12")
TIERS = ("cache.tiers.cpu=96KiB", "cache.tiers.disk=4MiB")


def outputs(m: Any) -> dict[int, list[int]]:
    return dict(m.outputs)


# Per backend: a device budget that holds about two conversations, and a CPU tier of a
# few of its own blocks, so that blocks reach the disk tier too. Not quest: its decodes'
# K/V come from sparse attention, so a block a decode wrote differs from the same tokens
# recomputed by a dense prefill, and any extra hit (device or tier) changes later tokens.
# A window (positional eviction) keeps prefix caching, so it takes tiers too: its
# given-back blocks are named, may go down, and a later prompt loads them back.
CASES = [("paged", "700KiB", "96KiB"), ("fp8", "400KiB", "24KiB"),
         ("kivi", "300KiB", "36KiB"), ("sliding_window", "500KiB", "64KiB")]
WINDOW = ("backend.window=96", "backend.sink_tokens=4")


@pytest.mark.parametrize("backend,budget,cpu", CASES)
def test_same_tokens_with_tiers_on_and_off(backend: str, budget: str, cpu: str) -> None:
    assert CHECKS, "the suite runs with KVBENCH_CHECK=1: loads poison their target first"
    common = (f"backend={backend}", f"cache.kv_budget={budget}", *LOAD,
              *(WINDOW if backend == "sliding_window" else ()))
    off = run(tiny(*common))
    on = run(tiny(*common, f"cache.tiers.cpu={cpu}", "cache.tiers.disk=4MiB"))
    assert outputs(on) == outputs(off)
    m = on.metrics
    assert m["run.tiers"] == f"cpu={cpu},disk=4MiB,write=evict"
    assert m["run.tier_eviction"] == "cpu=lru,disk=lru"
    # Both tiers served prompt blocks, and the four shares are the whole lookup.
    assert m["cache.hit_rate.cpu"] > 0 and m["cache.hit_rate.disk"] > 0, m
    shares = [m[f"cache.hit_rate.{k}"] for k in ("gpu", "cpu", "disk", "miss")]
    assert sum(shares) == pytest.approx(1.0) and min(shares) >= 0
    # Tier hits are hits: the tokens they saved were not computed again.
    assert m["cache.prefill_tokens_computed"] < off.metrics["cache.prefill_tokens_computed"]
    # What the tiers served, per request: some prompts came from each tier.
    assert {r["prefix_source"] for r in on.requests} >= {"cpu", "disk"}
    assert sum(r["tier_hit_blocks_cpu"] for r in on.requests) \
        == m["cache.tier.cpu.blocks_up"]


def test_block_bytes_are_what_the_backend_holds() -> None:
    """What TierStorage moves per block is the backend's declared bytes of a block."""
    for backend, budget, _ in [*CASES[:3], ("quest", "760KiB", "100KiB")]:
        from harness.config import run_config
        from harness.model_target import ModelTarget
        from harness.workloads import make_workload

        rc = run_config(tiny(f"backend={backend}", f"cache.kv_budget={budget}", *TIERS))
        target = ModelTarget(rc)
        st = target.build(make_workload(rc.workload, target.tokenizer))
        ts = st.backend.tier_storage
        assert ts is not None
        assert ts.block_bytes == st.sizing.bytes_per_slot * st.sizing.block_size, backend
        ts.close()


def break_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every load into the device writes a huge value instead of the tier's block."""
    real = TierStorage._one

    def skip_loads(self: TierStorage, op: TierOp) -> None:
        if op.dst_tier == GPU:
            for t in self.tensors:
                t[op.dst] = 1e4
            return
        real(self, op)

    monkeypatch.setattr(TierStorage, "_one", skip_loads)


def test_a_load_that_reads_nothing_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: skip every load's copy (the target keeps its garbage) and the tokens
    differ, so the equality above can fail."""
    common = ("cache.kv_budget=700KiB", *LOAD)
    off = run(tiny(*common))
    break_loads(monkeypatch)
    broken = run(tiny(*common, *TIERS))
    assert broken.metrics["cache.tier.cpu.blocks_up"] > 0
    assert outputs(broken) != outputs(off)


def test_a_full_disk_mid_run_loses_blocks_not_the_run(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Every disk-tier write fails (a full disk, issue #55): the run ends, with the same
    tokens as without tiers; the blocks never landed (counted), and the disk serves only
    blocks spilled and hit in the same step (loaded from the failed write's bytes)."""
    from harness.backends.tier_storage import DiskTier

    def full(self: DiskTier, slot: int, payload: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    common = ("cache.kv_budget=700KiB", *LOAD)
    off = run(tiny(*common))
    disk = run(tiny(*common, *TIERS)).metrics
    monkeypatch.setattr(DiskTier, "write", full)
    on = run(tiny(*common, *TIERS))
    m = on.metrics
    assert outputs(on) == outputs(off)
    assert m["cache.tier.disk.write_failures"] > 0 and m["cache.tier.disk.blocks_down"] == 0
    assert m["cache.hit_rate.disk"] < disk["cache.hit_rate.disk"] / 2
    assert m["cache.hit_rate.cpu"] > 0
    assert capsys.readouterr().err.count("No space left on device") == 1


def test_disk_blocks_damaged_mid_run_are_computed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every disk-tier file rots as soon as it is written (issue #55): each is dropped at
    the lookup that finds it and computed again (a block loaded in the step that wrote it
    is loaded from the bytes written); the run ends with the same tokens as without
    tiers."""
    from harness.backends.tier_storage import DiskTier

    real = DiskTier.write

    def write_then_rot(self: DiskTier, slot: int, payload: bytes) -> None:
        real(self, slot, payload)
        p = self.path(slot)
        data = bytearray(p.read_bytes())
        data[-1] ^= 0xFF
        p.write_bytes(bytes(data))

    common = ("cache.kv_budget=700KiB", *LOAD)
    off = run(tiny(*common))
    monkeypatch.setattr(DiskTier, "write", write_then_rot)
    on = run(tiny(*common, *TIERS))
    assert outputs(on) == outputs(off)
    assert on.metrics["cache.tier.disk.damaged_blocks"] > 0
    assert on.metrics["cache.tier.disk.write_failures"] == 0


@pytest.mark.parametrize("write", ["evict", "through"])
def test_tiers_beside_swap_preemption(write: str) -> None:
    """Swaps and tier moves in the same run (and steps): swap-outs release named blocks
    into the LRU that stores then read, swap-ins take blocks that stores freed."""
    common = ("cache.kv_budget=500KiB", "scheduler.preemption_mode=swap",
              "cache.swap_space=1MiB", *LOAD, "workload.answer_tokens=96")
    off = run(tiny(*common))
    on = run(tiny(*common, "cache.tiers.cpu=64KiB", "cache.tiers.disk=4MiB",
                  f"cache.tiers.write={write}"))
    assert off.metrics["sched.preemptions_swap"] > 0
    assert on.metrics["cache.tier.cpu.blocks_up"] > 0
    assert outputs(on) == outputs(off)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tiers_on_cuda_pinned_host_tier() -> None:
    """On a GPU the CPU tier is pinned host memory and loads copy asynchronously (then
    synchronize): the same tokens as without tiers, both tiers used."""
    common = ("device=cuda", "cache.kv_budget=700KiB", *LOAD)
    off = run(tiny(*common))
    on = run(tiny(*common, "cache.tiers.cpu=96KiB", "cache.tiers.disk=4MiB"))
    assert outputs(on) == outputs(off)
    assert on.metrics["cache.hit_rate.cpu"] > 0 and on.metrics["cache.hit_rate.disk"] > 0
