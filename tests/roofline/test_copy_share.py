"""What a copy costs in the what-if (issue #59's per-head tables): a slot of a per-head
page is one (layer, KV head) of a token, so its copy moves that share of a token's bytes;
charged as a whole token, a compaction cost up to layers x KV heads times too much."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness.kv.base import CopyOp
from harness.kv.headwise import HeadwiseKVManager
from harness.roofline.executor import RooflineExecutor
from harness.sched.step import StepRecord
from tests.backend_steps import Driver
from tests.backends.headwise_ref import prefill_recording


def _charged(copies: list[CopyOp]) -> float:
    hw = SimpleNamespace(mem_bw=1e12, eff_bw=1.0, host_bw=1e10)
    fake = SimpleNamespace(model=SimpleNamespace(hw=hw, kv_rank_bytes=4096.0),
                           backend=SimpleNamespace(block_size=16), links=None)
    rec = StepRecord(step=0)
    rec.copies = copies
    RooflineExecutor.apply_cache_ops(fake, rec)  # type: ignore[arg-type]
    return float(fake._ops_s)


def test_a_copy_is_charged_its_slots_share_of_a_token() -> None:
    whole = _charged([CopyOp(0, 16, 8)])
    assert whole == pytest.approx(2 * 8 * 4096 / 1e12)  # read and written
    per_head = _charged([CopyOp(0, 16, 8, share=1 / 64)])
    assert per_head == pytest.approx(whole / 64)


def test_a_per_head_compaction_marks_its_copies_as_one_heads_slots() -> None:
    d = Driver("pyramidkv", block_size=8,
               options={"budget": 20, "budget_ratio": 0.0, "window": 8, "beta": 2}, seed=3)
    kv = d.kv
    assert isinstance(kv, HeadwiseKVManager)
    seq = d.add(60, max_tokens=4)
    prefill_recording(d, seq, [60], observe=False)
    kv._ops.copies.clear()
    kv.observe([seq], d.last_scores)  # the selection: kept tokens compacted per head
    copies = kv._ops.copies
    assert copies and all(op.share == pytest.approx(1 / kv.heads) for op in copies)
