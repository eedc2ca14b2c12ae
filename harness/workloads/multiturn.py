"""`multiturn`: conversations behind one shared system prompt; each turn re-sends the
whole history and arrives when the previous answer is done (plus a think time).

What it shows: prefix caching. Every turn after the first hits the system prompt and the
conversation's own history, so only the new user message needs a prefill.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from harness.model.tokenizer import Tokenizer
from harness.sched.sequence import SamplingParams, SequenceGroup
from harness.validate import at_least, in_range
from harness.workloads.base import Request, WorkloadOptions
from harness.workloads.chat import next_turn_ids
from harness.workloads.text import random_passage


@dataclass
class MultiturnConfig(WorkloadOptions):
    conversations: int = 8
    turns: int = 3
    system_words: int = 120  # ~1.3 tokens per word with SmolLM2's tokenizer
    user_words: int = 30
    answer_tokens: int = 48
    arrival_interval_s: float = 0.0  # between conversation starts
    think_time_s: float = 0.0  # between an answer and the next turn
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        at_least(self, "workload", 1, "conversations", "turns", "user_words",
                 "answer_tokens")
        at_least(self, "workload", 0, "system_words", "arrival_interval_s", "think_time_s",
                 "temperature")
        in_range(self, "workload", "top_p", 0.0, 1.0, lo_open=True)


class MultiturnWorkload:
    name = "multiturn"

    def __init__(self, cfg: MultiturnConfig, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        self.tok = tokenizer
        rng = random.Random(cfg.seed_value)
        system = "You are a helpful assistant. Answer using this reference:\n" + \
            random_passage(rng, cfg.system_words)
        # Every user message of every conversation is drawn up front: the same seed gives
        # the same requests whatever the model answers.
        self.user_msgs = [[random_passage(rng, cfg.user_words) for _ in range(cfg.turns)]
                          for _ in range(cfg.conversations)]
        self.system = system
        self._history: dict[int, list[dict[str, str]]] = {}
        self._meta: dict[int, tuple[int, int]] = {}  # request id -> (conversation, turn)
        self._first = self._first_turns()

    def request_id(self, conv: int, turn: int) -> int:
        """A request's identity is its place in the workload, never the order in which
        turns happen to finish: the same seed gives the same ids on any backend, so a
        run and its reference pair the same requests."""
        return conv * self.cfg.turns + turn

    def _params(self) -> SamplingParams:
        c = self.cfg
        return SamplingParams(max_tokens=c.answer_tokens, temperature=c.temperature,
                              top_p=c.top_p, ignore_eos=c.ignore_eos, seed=c.seed_value)

    def _first_turns(self) -> list[Request]:
        out = []
        for conv in range(self.cfg.conversations):
            msgs = [{"role": "system", "content": self.system},
                    {"role": "user", "content": self.user_msgs[conv][0]}]
            rid = self.request_id(conv, 0)
            self._history[conv] = msgs
            self._meta[rid] = (conv, 0)
            out.append(Request(rid, self.tok.apply_chat_template(msgs), self._params(),
                               arrival_s=conv * self.cfg.arrival_interval_s,
                               meta={"conversation": conv, "turn": 0}))
        return out

    def initial_requests(self) -> list[Request]:
        """The first turn of every conversation (the same list on every call)."""
        return list(self._first)

    def on_finished(self, group: SequenceGroup) -> list[Request]:
        conv, turn = self._meta.pop(group.request_id)
        if turn + 1 >= self.cfg.turns:
            return []
        msgs = self._history[conv]
        seq = group.seqs[0]
        user = self.user_msgs[conv][turn + 1]
        ids = next_turn_ids(self.tok, msgs, list(group.prompt_ids), seq.output_ids, user)
        answer = self.tok.decode([t for t in seq.output_ids if t not in self.tok.eos_ids])
        self._history[conv] = [*msgs, {"role": "assistant", "content": answer},
                               {"role": "user", "content": user}]
        rid = self.request_id(conv, turn + 1)
        self._meta[rid] = (conv, turn + 1)
        return [Request(rid, ids, self._params(), arrival_s=self.cfg.think_time_s,
                        meta={"conversation": conv, "turn": turn + 1})]
