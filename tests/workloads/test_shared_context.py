"""`shared_context` (SCBench's shared-context setting, multi-turn): one haystack per
context with a needle per turn, each turn's prompt the previous prompt + the answer as
generated (an EOS that ended it left out) + the next question, scored per turn; and the
per-turn keys harness/metrics/tasks.py computes from it."""

from __future__ import annotations

import pytest

from harness.metrics.requestlog import FIXED, RequestLog
from harness.metrics.tasks import Scored, task_metrics, turn_hit_rates
from harness.model.tokenizer import ByteTokenizer
from harness.sched.sequence import SamplingParams, Sequence, SequenceGroup
from harness.workloads import make_workload, workload_options
from harness.workloads.ruler_tasks import ask_one

TOK = ByteTokenizer()


def _workload(**kw: object) -> object:
    opts = {"contexts": 2, "turns": 3, "length": 600, "haystack": "noise", **kw}
    return make_workload(workload_options("shared_context", opts), TOK)


def _finish(request_id: int, prompt: list[int], output: list[int], reason: str) -> SequenceGroup:
    g = SequenceGroup(request_id, prompt, SamplingParams(max_tokens=16))
    s = Sequence(request_id, g, list(prompt))
    s.token_ids += output
    s.finish_reason = reason
    g.seqs.append(s)
    return g


def test_each_turn_re_sends_the_history_and_asks_the_next_needle() -> None:
    wl = _workload()
    first = wl.initial_requests()
    assert [r.request_id for r in first] == [0, 3] and all(len(r.prompt_ids) == 600
                                                          for r in first)
    ctx = wl.contexts[0]
    # Every needle is in the haystack, each turn asks for another one.
    text = TOK.decode(first[0].prompt_ids)
    assert all(f"for {k} is: {v}." in text for k, v in zip(ctx.keys, ctx.values))
    assert sorted(ctx.order) == [0, 1, 2]
    assert text.endswith(ask_one(ctx.keys[ctx.order[0]]))
    answer = TOK.encode(" " + ctx.values[ctx.order[0]], add_bos=False)
    (nxt,) = wl.on_finished(_finish(0, first[0].prompt_ids, [*answer, *TOK.eos_ids], "stop"))
    question = TOK.encode("\n" + ask_one(ctx.keys[ctx.order[1]]), add_bos=False)
    assert nxt.request_id == 1 and nxt.prompt_ids == first[0].prompt_ids + answer + question
    # Under ignore_eos an EOS is an answer token like any other: re-sent as generated.
    (again,) = wl.on_finished(_finish(1, nxt.prompt_ids, [*TOK.eos_ids, 65], "length"))
    assert again.prompt_ids[len(nxt.prompt_ids):len(nxt.prompt_ids) + 2] == [*TOK.eos_ids, 65]
    assert wl.on_finished(_finish(2, again.prompt_ids, [65], "length")) == []
    # Scored per turn on the asked needle's value; the meta says which turn and depth.
    assert wl.score(0, "it is " + ctx.values[ctx.order[0]]) == 1.0
    assert wl.score(1, "it is " + ctx.values[ctx.order[0]]) == 0.0
    meta = wl.task_meta(1)
    assert (meta["turn"], meta["context"], meta["length"]) == (1, 0, 600)
    assert meta["depth"] == round(100 * ctx.depths[ctx.order[1]], 1)


def test_a_too_short_context_says_the_shortest_length() -> None:
    with pytest.raises(ValueError, match=r"workload.length=300: .* raise workload.length$"):
        _workload(length=300)


def test_per_turn_accuracy_and_hit_rate() -> None:
    scored = {0: Scored("shared_context", 600, 10.0, 1.0, 0),
              1: Scored("shared_context", 600, 50.0, 0.0, 1),
              3: Scored("shared_context", 600, 90.0, 1.0, 0),
              4: Scored("shared_context", 600, 30.0, 1.0, 1)}
    m = task_metrics(scored)
    assert (m["quality.turn.0.accuracy"], m["quality.turn.1.accuracy"]) == (1.0, 0.5)
    assert m["quality.turn.1.accuracy_ci95_low"] <= 0.5 <= m["quality.turn.1.accuracy_ci95_high"]
    rows = RequestLog(outputs=False)
    blank = {k: "" if kind == "s" else None if kind == "n" else 0 for k, kind in FIXED.items()}
    for rid, prompt, hit in [(0, 600, 0), (3, 600, 100), (1, 700, 600), (4, 800, 500)]:
        rows.fill(rows.reserve(), {**blank, "request_id": rid, "prompt_tokens": prompt,
                                   "prefix_hit_tokens": hit})
    assert turn_hit_rates(rows, scored) == {"cache.turn.0.hit_rate": 100 / 1200,
                                            "cache.turn.1.hit_rate": 1100 / 1500}
