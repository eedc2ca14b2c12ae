"""A prompt's last token is prefill, whatever the chunking (ScheduledSeq.is_decode).

It once was a decode whenever it came alone in its chunk: snapkv then never scored that
prompt's observation window (and raised a KeyError when the lone token sat at the
window's first position), quest gave it sparse decode attention, and its read was
counted as a decode's. For every backend, one greedy request is prefilled in one chunk,
as N-1 + 1, as 1 + N-1, and (where a method has an observation window) with a one-token
chunk on the window's first position; the tokens and the evictions equal the unchunked
prompt's."""

from __future__ import annotations

from typing import Any

import pytest

from harness.backends import BACKENDS
from harness.kv.evicting import EvictingKVManager, PolicyKVManager, WindowKVManager
from harness.kv.policies.base import Eviction
from harness.runner import run
from harness.sched.scheduler import Scheduler
from harness.sched.sequence import Sequence
from tests.compose import block_size, compose_cfg

P = 60  # prompt tokens
WINDOW = 8  # snapkv's observation window here: its first position is P - WINDOW
OPTIONS = {
    "contiguous": ["backend.reserve=exact"],
    "sliding_window": ["backend.window=24"],
    "streaming_llm": ["backend.window=24"],
    # Budgets of twice the prompt (they prefill in chunks of half the budget): chunking
    # changes nothing before decoding starts; 80 output tokens then pass the budget.
    "h2o": ["backend.budget=120", "backend.budget_ratio=0", "workload.output_tokens=80"],
    "tova": ["backend.budget=120", "backend.budget_ratio=0", "workload.output_tokens=80"],
    "quest": ["backend.token_budget=16"],  # dense prefill, sparse decode: they differ here
    "snapkv": [f"backend.window={WINDOW}", "backend.budget=16", "backend.budget_ratio=0"],
    "pyramidkv": [f"backend.window={WINDOW}", "backend.budget=16", "backend.budget_ratio=0",
                  "backend.beta=2"],
    "adakv": [f"backend.window={WINDOW}", "backend.budget=16", "backend.budget_ratio=0"],
    "duo_attention": ["backend.sink_tokens=4", f"backend.recent={WINDOW}",
                      "backend.calibration_tokens=64"],
}
PLANS = {"whole": [P], "n-1+1": [P - 1, 1], "1+n-1": [1, P - 1],
         "one_at_window_start": [P - WINDOW, 1, WINDOW - 1]}
NAMES = [n for n in BACKENDS if n != "flash_attn"]  # its CPU stand-in: tests/backends/test_costs.py


def _run(name: str, plan: list[int],
         monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[list[int]]]:
    """One request, its prompt prefilled in the chunks of ``plan``; returns the run and
    its evictions: the positions (token-granular methods) and logical blocks (a window)
    given back, in order (a window gives blocks back after each step, so chunking may
    group them into other steps, not change them)."""
    bounds = [sum(plan[:i + 1]) for i in range(len(plan))]

    def chunk_len(self: Scheduler, seq: Sequence, n: int, budget: int) -> int:
        if seq.num_computed >= P:  # past the prompt: as the scheduler would
            return min(n, max(0, budget))
        end = next(b for b in bounds if b > seq.num_computed)
        cap = self.kv.max_chunk(seq)
        return min(n, end - seq.num_computed, cap if cap is not None else n)

    evictions: list[list[int]] = [[], []]
    def recording(cls: type[PolicyKVManager]) -> Any:
        real = cls.evict

        def evict(self: PolicyKVManager, seq: Sequence, ev: Eviction) -> None:
            if ev:
                if ev.slots:
                    assert isinstance(self, EvictingKVManager)
                    evictions[0] += sorted(int(p) for p in self._pos[ev.slots])
                evictions[1] += list(ev.blocks)
            real(self, seq, ev)
        return evict

    monkeypatch.setattr(Scheduler, "_chunk_len", chunk_len)
    for cls in (EvictingKVManager, WindowKVManager):
        monkeypatch.setattr(cls, "evict", recording(cls))
    r = run(compose_cfg(["model=tiny", f"backend={name}", *block_size(name, 8),
                         "workload=shared_prefix", "workload.num_requests=1",
                         f"workload.prefix_tokens={P}", "workload.suffix_tokens=0",
                         "workload.output_tokens=12", *OPTIONS.get(name, []),
                         "cache.kv_budget=1MiB", "cache.enable_prefix_caching=false"]))
    monkeypatch.undo()
    return r, evictions


@pytest.mark.parametrize("name", NAMES)
def test_a_prompt_chunked_any_way_selects_and_decodes_as_unchunked(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    whole, ev_whole = _run(name, PLANS["whole"], monkeypatch)
    assert whole.steps[0].prefill_tokens == P and whole.steps[0].decode_tokens == 0
    if name in ("paged", "contiguous", "quest", "kivi", "fp8", "int8", "flex"):
        assert whole.steps[0].prefill_pairs == P * (P + 1) // 2
    for label, plan in PLANS.items():
        if label == "whole":
            continue
        r, ev = _run(name, plan, monkeypatch)
        # The plan was followed: its chunks, all of them prefill, then the decodes.
        assert [s.prefill_tokens for s in r.steps[:len(plan)]] == plan, label
        assert all(s.decode_tokens == 0 for s in r.steps[:len(plan)]), label
        assert r.outputs == whole.outputs, label
        assert ev == ev_whole, label
        # ... and it was counted as the unchunked prompt is: every prompt token a prefill
        # query (P (P + 1) / 2 causal pairs where nothing bounds them), the same decodes.
        for col in ("prefill_pairs", "kv_read_tokens", "kv_read_bytes", "decode_tokens"):
            assert sum(getattr(s, col) for s in r.steps) == \
                sum(getattr(s, col) for s in whole.steps), (label, col)
        if name == "snapkv":  # it selected once, at the prompt's end, as unchunked
            assert len(ev[0]) == P - 16 - WINDOW, label
