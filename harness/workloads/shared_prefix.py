"""`shared_prefix`: many requests behind one long shared system prompt (or a few).

What it shows: prefix caching. Every request after the first of its prefix skips the
prefix's full blocks; with `cache.enable_prefix_caching=false` each computes it again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from harness.model.tokenizer import Tokenizer
from harness.sched.sequence import SamplingParams, SequenceGroup
from harness.validate import at_least
from harness.workloads.arrivals import ArrivalOptions, arrival_times
from harness.workloads.base import Request
from harness.workloads.common import token_prompt


@dataclass
class SharedPrefixConfig(ArrivalOptions):
    num_requests: int = 24
    num_prefixes: int = 1  # distinct shared prompts; request i uses prefix i % num_prefixes
    prefix_tokens: int = 256
    suffix_tokens: int = 24  # each request's own question
    output_tokens: int = 24
    temperature: float = 0.0
    ignore_eos: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least(self, "workload", 1, "num_requests", "num_prefixes", "prefix_tokens",
                 "output_tokens")
        at_least(self, "workload", 0, "suffix_tokens", "temperature")


class SharedPrefixWorkload:
    name = "shared_prefix"

    def __init__(self, cfg: SharedPrefixConfig, tok: Tokenizer) -> None:
        if cfg.num_prefixes < 1 or cfg.num_requests < 1:
            raise ValueError("workload.num_prefixes and workload.num_requests must be >= 1")
        rng = random.Random(cfg.seed_value)
        prefixes = [token_prompt(tok, rng, cfg.prefix_tokens) for _ in range(cfg.num_prefixes)]
        times = arrival_times(cfg.num_requests, cfg, rng)
        params = SamplingParams(max_tokens=cfg.output_tokens, temperature=cfg.temperature,
                                ignore_eos=cfg.ignore_eos, seed=cfg.seed_value)
        self.requests = [
            Request(i, prefixes[i % cfg.num_prefixes]
                    + token_prompt(tok, rng, cfg.suffix_tokens, add_bos=False),
                    params, arrival_s=times[i], meta={"prefix": i % cfg.num_prefixes})
            for i in range(cfg.num_requests)]

    def initial_requests(self) -> list[Request]:
        return list(self.requests)

    def on_finished(self, group: SequenceGroup) -> list[Request]:
        return []
