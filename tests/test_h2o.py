"""h2o: exact when the budget covers the sequence; never holds more than its budget
(allocator accounting, not a mask); evicts the lowest-scoring tokens outside the recent
window."""

from __future__ import annotations

import torch

from harness.runner import run
from tests.compose import tiny

ONE_LONG = ("workload.conversations=1", "workload.turns=1", "workload.answer_tokens=64",
            "workload.ignore_eos=true", "backend.block_size=8")


def test_budget_covering_the_sequence_is_exact() -> None:
    exact = run(tiny("backend=paged", "cache.enable_prefix_caching=false"))
    h2o = run(tiny("backend=h2o", "backend.budget=100000", "backend.budget_ratio=0"))
    assert h2o.outputs == exact.outputs
    assert h2o.metrics["cache.evicted_tokens"] == 0
    assert h2o.metrics["run.prefix_caching"] is False


def test_never_holds_more_than_its_budget() -> None:
    budget = 40
    r = run(tiny("backend=h2o", f"backend.budget={budget}", "backend.budget_ratio=0",
                 *ONE_LONG))
    m = r.metrics
    per_slot = m["memory.kv_budget_bytes"] // m["memory.token_capacity"]
    bound_blocks = -(-budget // 8)
    # The allocator's own count of blocks held, every step, for the one sequence.
    assert max(s.held_blocks for s in r.steps) <= bound_blocks
    assert max(s.reserved_bytes for s in r.steps) <= bound_blocks * 8 * per_slot
    prompt = r.requests[0]["prompt_tokens"]
    # Written: the prompt and 63 of the 64 answers (the last is never fed back).
    assert m["cache.evicted_tokens"] == prompt + 63 - budget
    # A prompt longer than the evictable part is prefilled in bounded chunks.
    assert max(s.prefill_tokens for s in r.steps) <= budget // 2


def test_victims_are_low_scores_outside_the_recent_window() -> None:
    from harness.backends.base import CacheSizing, KVLayout
    from harness.backends.h2o import H2OBackend
    from harness.sched.sequence import SamplingParams, Sequence, SequenceGroup

    be = H2OBackend(KVLayout(2, 2, 8, torch.float32), torch.device("cpu"), budget=8,
                    block_size=4)
    sizing = CacheSizing(0, be.bytes_per_slot(), 64, 4, 16, 0)
    kv = be.make_manager(sizing, watermark=0.0)
    be.allocate(sizing)
    be.bind(kv)
    g = SequenceGroup(0, [1] * 8, SamplingParams())
    seq = Sequence(0, g, [1] * 8)
    g.seqs.append(seq)
    slots = list(range(8))
    be.slot_pos[:8] = torch.arange(8)
    # Scores per (layer, slot, head): slot 5 lowest overall but recent (positions >= 4 are
    # the recent half of a budget of 8 when the next token is at 8); slots 2 and 0 next.
    score = torch.tensor([3.0, 9.0, 1.0, 7.0, 8.0, 0.0, 0.5, 0.1])
    be.scores[:, :8, :] = score[None, :, None]
    assert be.victims(seq, slots, 2, next_pos=8) == [2, 0]
