"""`multiturn`: conversations behind one shared system prompt; each turn re-sends the
whole history and arrives when the previous answer is done, plus a think time.

What it shows: prefix caching. Every turn after the first hits the system prompt and the
conversation's own history, so only the new user message needs a prefill.

User-centric timing, as a chat service sees it: conversations start by the arrival
process (``rate``, ``arrival``: harness.workloads.arrivals); a user reads each answer for
a think time (``think_time_s``, drawn per turn from ``think_time_dist``, seeded) before
the next turn; at most ``max_active_conversations`` are open at once (the next one starts
when one ends, or at its own arrival time if later). Longer think times and more users
keep more histories waiting between turns: the prefix cache must hold them or lose them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from harness.errors import UserError
from harness.model.tokenizer import Tokenizer
from harness.sched.sequence import SamplingParams, SequenceGroup
from harness.validate import at_least, in_range
from harness.workloads.arrivals import THINK_TIMES, ArrivalOptions, arrival_times, think_time
from harness.workloads.base import Request
from harness.workloads.chat import next_turn_ids
from harness.workloads.text import random_passage


@dataclass
class MultiturnConfig(ArrivalOptions):
    conversations: int = 8
    turns: int = 3
    system_words: int = 120  # ~1.3 tokens per word with SmolLM2's tokenizer
    user_words: int = 30
    answer_tokens: int = 48
    think_time_s: float = 0.0  # mean time between an answer and the next turn
    think_time_dist: str = "constant"  # constant | exponential | lognormal
    think_time_cv: float = 1.0  # lognormal only: std / mean
    max_active_conversations: int = 0  # 0: no cap (every conversation starts on arrival)
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least(self, "workload", 1, "conversations", "turns", "user_words",
                 "answer_tokens")
        at_least(self, "workload", 0, "system_words", "think_time_s", "think_time_cv",
                 "max_active_conversations", "temperature")
        if self.think_time_dist not in THINK_TIMES:
            raise UserError(f"unknown workload.think_time_dist {self.think_time_dist!r}; "
                            f"known: {', '.join(THINK_TIMES)}")
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
        # Drawn after the prompts, so timing options never change the text.
        self.starts = arrival_times(cfg.conversations, cfg, rng)
        think_rng = random.Random(f"{cfg.seed_value}/think")
        self.think = [[think_time(think_rng, cfg.think_time_dist, cfg.think_time_s,
                                  cfg.think_time_cv) for _ in range(cfg.turns)]
                      for _ in range(cfg.conversations)]
        self._history: dict[int, list[dict[str, str]]] = {}
        self._meta: dict[int, tuple[int, int]] = {}  # request id -> (conversation, turn)
        cap = cfg.max_active_conversations or cfg.conversations
        self._first = [self._first_turn(c) for c in range(min(cap, cfg.conversations))]
        self._next_conv = len(self._first)  # the next conversation waiting for a slot
        self.turns_not_sent = 0  # later turns of conversations a rejection ended

    @property
    def expected_requests(self) -> int:
        """Every turn of every conversation (less those a rejection ended): what the
        progress bar's total and ETA count to, while the known requests grow by a turn
        as each answer is done."""
        return self.cfg.conversations * self.cfg.turns - self.turns_not_sent

    def request_id(self, conv: int, turn: int) -> int:
        """A request's identity is its place in the workload, never the order in which
        turns happen to finish: the same seed gives the same ids on any backend, so a
        run and its reference pair the same requests."""
        return conv * self.cfg.turns + turn

    def _params(self) -> SamplingParams:
        c = self.cfg
        return SamplingParams(max_tokens=c.answer_tokens, temperature=c.temperature,
                              top_p=c.top_p, ignore_eos=c.ignore_eos, seed=c.seed_value)

    def _first_turn(self, conv: int, later: bool = False) -> Request:
        """Conversation ``conv``'s first turn, at its arrival time (``later``: it waited
        for a slot, so it arrives then or now, whichever is later)."""
        msgs = [{"role": "system", "content": self.system},
                {"role": "user", "content": self.user_msgs[conv][0]}]
        rid = self.request_id(conv, 0)
        self._history[conv] = msgs
        self._meta[rid] = (conv, 0)
        return Request(rid, self.tok.apply_chat_template(msgs), self._params(),
                       arrival_s=0.0 if later else self.starts[conv],
                       earliest_s=self.starts[conv] if later else None,
                       meta={"conversation": conv, "turn": 0})

    def initial_requests(self) -> list[Request]:
        """The first turn of every conversation that has a slot (the same list on every
        call)."""
        return list(self._first)

    def _next_conversation(self) -> list[Request]:
        """A conversation ended: its slot goes to the next one waiting, if any."""
        if self._next_conv >= self.cfg.conversations:
            return []
        self._next_conv += 1
        return [self._first_turn(self._next_conv - 1, later=True)]

    def on_rejected(self, group: SequenceGroup) -> list[Request]:
        """A rejected turn has no answer to build the next turn on: its conversation ends
        there (its later turns are counted in ``multiturn.turns_not_sent``)."""
        _, turn = self._meta.pop(group.request_id)
        self.turns_not_sent += self.cfg.turns - turn - 1
        return self._next_conversation()

    def workload_metrics(self) -> dict[str, float]:
        return {"multiturn.turns_not_sent": float(self.turns_not_sent)}

    def on_finished(self, group: SequenceGroup) -> list[Request]:
        conv, turn = self._meta.pop(group.request_id)
        if turn + 1 >= self.cfg.turns:  # the conversation ends: its slot goes to the next
            return self._next_conversation()
        msgs = self._history[conv]
        seq = group.seqs[0]
        user = self.user_msgs[conv][turn + 1]
        ids = next_turn_ids(self.tok, msgs, list(group.prompt_ids), seq.output_ids, user)
        answer = self.tok.decode([t for t in seq.output_ids if t not in self.tok.eos_ids])
        self._history[conv] = [*msgs, {"role": "assistant", "content": answer},
                               {"role": "user", "content": user}]
        rid = self.request_id(conv, turn + 1)
        self._meta[rid] = (conv, turn + 1)
        return [Request(rid, ids, self._params(), arrival_s=self.think[conv][turn + 1],
                        meta={"conversation": conv, "turn": turn + 1})]
