"""`long_prompt`: short chat requests decoding while long prompts arrive.

Run it with `scheduler.chunked_prefill=true|false`: without chunking a long prompt's whole
prefill runs in one step and every running decode waits for it (ITL p99 jumps); with
chunking the prompt is split across steps beside the decodes, at some cost in its TTFT.
The short chats arrive by the arrival process (all at once by default); the long prompts
at their fixed times, which are the point of the scenario.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from harness.errors import UserError
from harness.model.tokenizer import Tokenizer
from harness.sched.sequence import SamplingParams, SequenceGroup
from harness.validate import at_least
from harness.workloads.arrivals import ArrivalOptions, arrival_times
from harness.workloads.base import Request
from harness.workloads.common import token_prompt


@dataclass
class LongPromptConfig(ArrivalOptions):
    num_short: int = 8
    short_prompt_tokens: int = 32
    short_output_tokens: int = 64
    num_long: int = 2
    long_prompt_tokens: int = 1536
    long_output_tokens: int = 8
    long_start_s: float = 1.0  # first long prompt arrives after the short ones decode
    long_interval_s: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least(self, "workload", 1, "short_prompt_tokens", "short_output_tokens",
                 "long_prompt_tokens", "long_output_tokens")
        at_least(self, "workload", 0, "num_short", "num_long", "long_start_s",
                 "long_interval_s")
        if self.num_short + self.num_long < 1:
            raise UserError("workload.num_short + workload.num_long must be >= 1")


class LongPromptWorkload:
    name = "long_prompt"

    def __init__(self, cfg: LongPromptConfig, tok: Tokenizer) -> None:
        rng = random.Random(cfg.seed_value)
        short = SamplingParams(max_tokens=cfg.short_output_tokens, ignore_eos=True)
        long = SamplingParams(max_tokens=cfg.long_output_tokens, ignore_eos=True)
        starts = arrival_times(cfg.num_short, cfg, rng)
        reqs = [Request(i, token_prompt(tok, rng, cfg.short_prompt_tokens), short,
                        arrival_s=starts[i], meta={"kind": "short"})
                for i in range(cfg.num_short)]
        reqs += [Request(cfg.num_short + j, token_prompt(tok, rng, cfg.long_prompt_tokens),
                         long, arrival_s=cfg.long_start_s + j * cfg.long_interval_s,
                         meta={"kind": "long"}) for j in range(cfg.num_long)]
        self.requests = reqs

    def initial_requests(self) -> list[Request]:
        return list(self.requests)

    def on_finished(self, group: SequenceGroup) -> list[Request]:
        return []
