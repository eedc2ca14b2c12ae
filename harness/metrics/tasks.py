"""Task accuracy of a workload whose requests have right answers (``ruler``): the
quality.task_* keys of metrics.json and the task columns of requests.csv.

The workload scores one output text at a time (it knows what each request asked); this
module decodes the outputs, asks for the scores and aggregates them. Keys:

- ``quality.task_accuracy``: the mean over tasks of each task's mean score (every task
  weighs the same, as RULER averages, whatever its request count);
- ``quality.task_accuracy.<task>`` and ``quality.task_accuracy.<task>.<length>``;
- ``quality.task_accuracy.all.<length>``: every task at one prompt length;
- each with ``_ci95_low`` / ``_ci95_high``: a seeded bootstrap over requests;
- ``quality.task_requests``: requests scored (a request that ran and got no output
  scores 0);
- ``quality.task_not_run``: requests that never ran (rejected: longer than the model's
  context, say). They are left out of every average: scored 0 they would pass for wrong
  answers (a cell that could not run read 0.5 where what ran scored 1.0), and their
  requests.csv rows carry no score.

A multi-turn workload (``shared_context``: its ``task_meta`` has a ``turn``) also gets,
per turn k (0 the first): ``quality.turn.<k>.accuracy`` (the mean score of that turn's
requests, with its bootstrap interval) and ``cache.turn.<k>.hit_rate`` (prompt tokens its
requests found in the prefix cache, computed by other requests, over their prompt tokens:
``cache.prefix_hit_rate`` turn by turn); requests.csv gets a ``turn`` column. Its later
turns are scored too (they are not among ``initial_requests()``: every request with an
output is).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from harness.metrics.bootstrap import ci_keys
from harness.metrics.requestlog import RequestLog
from harness.model.tokenizer import Tokenizer
from harness.workloads.base import Request


@runtime_checkable
class ScoresTasks(Protocol):
    """A workload that can score its requests' outputs."""

    def initial_requests(self) -> list[Request]: ...

    def task_meta(self, request_id: int) -> dict[str, Any]:
        """At least ``task``, ``length`` (prompt tokens) and ``depth`` (%, -1: none)."""
        ...

    def score(self, request_id: int, text: str) -> float:
        """The output's score in [0, 1]."""
        ...


@dataclass(frozen=True, slots=True)
class Scored:
    task: str
    length: int
    depth: float
    score: float
    turn: int = -1  # a multi-turn workload's turn (0 the first); -1: none


def score_requests(workload: ScoresTasks, outputs: dict[int, list[int]],
                   tok: Tokenizer, not_run: frozenset[int] = frozenset()) -> dict[int, Scored]:
    """Every request of the workload that ran (all but ``not_run``), scored on its decoded
    output ("" if it had none): the initial requests, and any follow-up with an output."""
    first = [r.request_id for r in workload.initial_requests()]
    later = sorted(set(outputs) - set(first))
    out = {}
    for rid in [*first, *later]:
        if rid in not_run:
            continue
        m = workload.task_meta(rid)
        text = tok.decode(outputs.get(rid, []))
        out[rid] = Scored(str(m["task"]), int(m["length"]), float(m["depth"]),
                          float(workload.score(rid, text)), int(m.get("turn", -1)))
    return out


def _macro(rows: np.ndarray) -> float:
    """Mean over tasks (column 1: task index) of the mean score (column 0)."""
    tasks = np.unique(rows[:, 1])
    return float(np.mean([rows[rows[:, 1] == t, 0].mean() for t in tasks]))


def task_metrics(scored: dict[int, Scored], seed: int = 0,
                 not_run: int = 0) -> dict[str, float]:
    """The quality.task_* keys (see the module's docstring)."""
    if not scored:
        return {"quality.task_requests": 0.0, "quality.task_not_run": float(not_run)} \
            if not_run else {}
    rows = sorted(scored.items())
    names = sorted({s.task for _, s in rows})
    table = np.array([[s.score, names.index(s.task)] for _, s in rows])
    base = "quality.task_accuracy"
    m: dict[str, float] = {base: _macro(table), "quality.task_requests": float(len(rows)),
                           "quality.task_not_run": float(not_run)}
    m.update(ci_keys(base, table, _macro, seed=seed))
    groups: dict[str, list[float]] = defaultdict(list)
    for _, s in rows:
        groups[f"{base}.{s.task}"].append(s.score)
        groups[f"{base}.{s.task}.{s.length}"].append(s.score)
    for key, xs in sorted(groups.items()):
        m[key] = float(np.mean(xs))
        m.update(ci_keys(key, xs, seed=seed))
    for length in sorted({s.length for _, s in rows}):
        part = table[[s.length == length for _, s in rows]]
        key = f"{base}.all.{length}"
        m[key] = _macro(part)
        m.update(ci_keys(key, part, _macro, seed=seed))
    for turn in sorted({s.turn for _, s in rows if s.turn >= 0}):
        xs = [s.score for _, s in rows if s.turn == turn]
        key = f"quality.turn.{turn}.accuracy"
        m[key] = float(np.mean(xs))
        m.update(ci_keys(key, xs, seed=seed))
    return m


def turn_hit_rates(rows: RequestLog, scored: dict[int, Scored]) -> dict[str, float]:
    """``cache.turn.<k>.hit_rate`` of the scored requests with a turn (module docstring)."""
    turn = {rid: s.turn for rid, s in scored.items() if s.turn >= 0}
    if not turn:
        return {}
    hits: dict[int, int] = defaultdict(int)
    prompt: dict[int, int] = defaultdict(int)
    for rid, n, h in zip(rows.column("request_id"), rows.column("prompt_tokens"),
                         rows.column("prefix_hit_tokens")):
        k = turn.get(rid)
        if k is not None:
            hits[k] += h
            prompt[k] += n
    return {f"cache.turn.{k}.hit_rate": hits[k] / prompt[k] if prompt[k] else 0.0
            for k in sorted(prompt)}


def task_columns(rows: RequestLog, scored: dict[int, Scored]) -> None:
    """Add task, length, depth and score to requests.csv (None on a row not scored), and
    turn for a multi-turn workload."""
    if not scored:
        return
    got = [scored.get(rid) for rid in rows.column("request_id")]
    turns = ("turn",) if any(s.turn >= 0 for s in scored.values()) else ()
    for k in ("task", "length", "depth", "score", *turns):
        rows.add_column(k, [None if s is None else getattr(s, k) for s in got],
                        every_row=False)  # only on the requests that ran


def add_task_scores(workload: object, tok: Tokenizer, outputs: dict[int, list[int]],
                    metrics: dict[str, Any], rows: RequestLog, seed: int) -> None:
    """The runner's one call: for a workload with right answers, its quality.task_* keys
    into ``metrics`` and its task columns into ``rows``; nothing for any other workload."""
    if not isinstance(workload, ScoresTasks):
        return
    not_run = frozenset(rows.values("request_id")[rows.matches("status", "rejected")].tolist())
    scored = score_requests(workload, outputs, tok, not_run)
    metrics.update(task_metrics(scored, seed, len(not_run)))
    metrics.update(turn_hit_rates(rows, scored))
    task_columns(rows, scored)
