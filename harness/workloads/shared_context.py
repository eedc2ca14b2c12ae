"""`shared_context`: SCBench's shared-context setting (Li et al. 2024, arXiv 2412.10319)
in its multi-turn mode: one long context, several questions about it asked over turns,
each turn's prompt the context + every earlier turn + a new question, with answers that
are checked, so what a KV method's reuse of the context costs shows up turn by turn.

Each of ``contexts`` conversations has its own haystack (the `ruler` workload's: Paul
Graham's essays with RULER's keys, Python's help texts, or RULER's noise) holding
``turns`` needles ("One of the special magic numbers for <key> is: <value>.") at depths
spread evenly over it; turn k asks for one needle's value (a seeded order per context, so
every turn asks at every depth across contexts), in RULER's completion form. The first
turn's prompt is exactly ``length`` tokens; a later turn re-sends the earlier prompt and
the model's answer token for token (the EOS that ended it left out) and adds the question,
so a prefix cache finds the whole history. Scored as RULER scores niah: the value in the
answer (1) or not (0); harness/metrics/tasks.py reports ``quality.turn.<k>.accuracy`` and
the prefix cache's ``cache.turn.<k>.hit_rate`` beside the usual task keys.

Every conversation starts at once; a turn arrives when the previous answer is done.
Request ids follow (context, turn), never the order turns finish.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from harness.errors import UserError
from harness.model.tokenizer import Tokenizer
from harness.sched.sequence import SamplingParams, SequenceGroup
from harness.validate import at_least, in_range
from harness.workloads.base import Request, WorkloadOptions
from harness.workloads.ruler import MAX_LENGTH, string_match
from harness.workloads.ruler_tasks import (
    KEYS,
    NIAH_HEADER,
    Cell,
    ask_one,
    needle_text,
    niah_prompt,
)
from harness.workloads.ruler_text import Needle, UnitStream, noise_stream
from harness.workloads.ruler_words import draw_keys

HAYSTACKS = ("essays", "own", "noise")
TASK = "shared_context"


@dataclass
class SharedContextConfig(WorkloadOptions):
    contexts: int = 4  # conversations, each its own haystack and needles
    turns: int = 4  # questions per context, one a turn (one needle each)
    length: int = 1024  # tokens of the first turn's prompt (context + first question)
    haystack: str = "essays"  # essays (RULER's) | own (Python's help texts) | noise
    value_digits: int = 7  # the needles' numbers (RULER: 7 digits)
    answer_tokens: int = 16  # max_tokens of each answer
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        at_least(self, "workload", 1, "contexts", "turns", "answer_tokens")
        in_range(self, "workload", "value_digits", 1, 12)
        if self.haystack not in HAYSTACKS:
            raise UserError(f"workload.haystack={self.haystack!r}: choose one of "
                            f"{', '.join(HAYSTACKS)}")
        if not 64 <= self.length <= MAX_LENGTH:
            raise UserError(f"workload.length={self.length}: the first turn's prompt must be "
                            f"in [64, {MAX_LENGTH}] tokens")


@dataclass(frozen=True)
class _Context:
    """One conversation's haystack: its first prompt, its needles and the order asked."""

    prompt: list[int]
    keys: list[str]
    values: list[str]
    depths: list[float]  # each needle's realised depth (0..1 of the filler)
    order: list[int]  # needle asked at turn k: order[k]


class SharedContextWorkload:
    name = "shared_context"

    def __init__(self, cfg: SharedContextConfig, tok: Tokenizer) -> None:
        self.cfg, self.tok = cfg, tok
        self.contexts = [self._context(c) for c in range(cfg.contexts)]
        self._prompts: dict[int, list[int]] = {}  # request id -> prompt, as sent
        self._first = [self._request(c, 0, self.contexts[c].prompt)
                       for c in range(cfg.contexts)]

    def _context(self, c: int) -> _Context:
        cfg, n = self.cfg, self.cfg.turns
        rng = random.Random(f"{cfg.seed_value}:shared_context:{c}")
        keys = draw_keys(rng, n) if cfg.haystack == "essays" else rng.sample(KEYS, n)
        lo = 10 ** (cfg.value_digits - 1)
        values = [str(rng.randrange(lo, 10 * lo)) for _ in keys]
        spread = [(i + 0.5) / n for i in range(n)]
        order = list(range(n))
        rng.shuffle(order)
        cell = Cell(self.tok, cfg.seed_value, cfg.length, spread, 0, c, cfg.value_digits, rng,
                    haystack="own" if cfg.haystack == "own" else "essays")
        stream: UnitStream = noise_stream(self.tok) if cfg.haystack == "noise" else cell.essay()
        needles = [Needle(d, needle_text(k, v)) for d, k, v in zip(spread, keys, values)]
        try:
            ids, depths = niah_prompt(cell, NIAH_HEADER, stream, needles, ask_one(keys[order[0]]))
        except UserError as e:
            msg = str(e).replace("workload.lengths", "workload.length")
            raise UserError(f"workload.length={cfg.length}: {msg}") from None
        return _Context(ids, keys, values, depths, order)

    def request_id(self, context: int, turn: int) -> int:
        return context * self.cfg.turns + turn

    def _request(self, context: int, turn: int, prompt: list[int]) -> Request:
        c = self.cfg
        rid = self.request_id(context, turn)
        self._prompts[rid] = prompt
        params = SamplingParams(max_tokens=c.answer_tokens, temperature=0.0,
                                ignore_eos=c.ignore_eos)
        return Request(rid, prompt, params, meta={"context": context, "turn": turn})

    @property
    def expected_requests(self) -> int:
        return self.cfg.contexts * self.cfg.turns

    def initial_requests(self) -> list[Request]:
        return list(self._first)

    def on_finished(self, group: SequenceGroup) -> list[Request]:
        context, turn = divmod(group.request_id, self.cfg.turns)
        if turn + 1 >= self.cfg.turns:
            return []
        ctx = self.contexts[context]
        answer = list(group.output_ids)
        if answer and answer[-1] in self.tok.eos_ids and group.seqs[0].finish_reason == "stop":
            answer.pop()  # the EOS that ended it (under ignore_eos every token is re-sent)
        question = self.tok.encode("\n" + ask_one(ctx.keys[ctx.order[turn + 1]]),
                                   add_bos=False)
        return [self._request(context, turn + 1, list(group.prompt_ids) + answer + question)]

    # -- scoring (harness.metrics.tasks.ScoresTasks) ------------------------------------
    def _asked(self, request_id: int) -> tuple[_Context, int, int]:
        context, turn = divmod(request_id, self.cfg.turns)
        ctx = self.contexts[context]
        return ctx, turn, ctx.order[turn]

    def task_meta(self, request_id: int) -> dict[str, object]:
        """The task, the context's length (the first prompt's tokens), the asked needle's
        depth (%), the turn and the context."""
        ctx, turn, needle = self._asked(request_id)
        return {"task": TASK, "length": self.cfg.length,
                "depth": round(100 * ctx.depths[needle], 1), "turn": turn,
                "context": request_id // self.cfg.turns}

    def score(self, request_id: int, text: str) -> float:
        """1 if the answer holds the asked needle's value, else 0."""
        ctx, _, needle = self._asked(request_id)
        return string_match(text, [ctx.values[needle]])
