"""`parallel_sampling` and `beam_search`: n sequences per prompt that share its blocks.

parallel_sampling: n seeded temperature samples, forked right after the prompt.
beam_search: real beam search (width n, length penalty), beams forked and pruned each
step (harness.engine.beam); copy-on-write copies a shared last block when beams diverge.
What they show: blocks saved by sharing (the PagedAttention paper: 6-10% for parallel
sampling, 37-55% for beam search widths 2-6).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from harness.model.tokenizer import Tokenizer
from harness.sched.sequence import SamplingParams, SequenceGroup
from harness.validate import at_least, in_range
from harness.workloads.arrivals import ArrivalOptions, arrival_times
from harness.workloads.base import Request
from harness.workloads.common import token_prompt


@dataclass
class SamplingWorkloadConfig(ArrivalOptions):
    num_requests: int = 8
    prompt_tokens: int = 64
    output_tokens: int = 32
    n: int = 4  # samples, or beam width
    temperature: float = 0.8  # parallel sampling only
    top_p: float = 0.95
    length_penalty: float = 1.0  # beam search only
    ignore_eos: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least(self, "workload", 1, "num_requests", "prompt_tokens", "output_tokens", "n")
        at_least(self, "workload", 0, "temperature")
        in_range(self, "workload", "top_p", 0.0, 1.0, lo_open=True)


class _NPerPrompt:
    name = ""
    beam = False
    # Options this workload never reads, {key: why}: set away from their defaults, the run
    # is refused (harness.config.refuse_ignored).
    ignored_options: ClassVar[dict[str, str]] = {}

    def __init__(self, cfg: SamplingWorkloadConfig, tok: Tokenizer) -> None:
        if cfg.n < 1:
            raise ValueError(f"workload.n must be >= 1, got {cfg.n}")
        rng = random.Random(cfg.seed_value)
        times = arrival_times(cfg.num_requests, cfg, rng)
        params = SamplingParams(
            max_tokens=cfg.output_tokens, n=cfg.n, seed=cfg.seed_value, ignore_eos=cfg.ignore_eos,
            temperature=0.0 if self.beam else cfg.temperature, top_p=cfg.top_p,
            use_beam_search=self.beam, length_penalty=cfg.length_penalty)
        self.requests = [Request(i, token_prompt(tok, rng, cfg.prompt_tokens), params,
                                 arrival_s=times[i]) for i in range(cfg.num_requests)]

    def initial_requests(self) -> list[Request]:
        return list(self.requests)

    def on_finished(self, group: SequenceGroup) -> list[Request]:
        return []


class ParallelSamplingWorkload(_NPerPrompt):
    name = "parallel_sampling"
    ignored_options: ClassVar[dict[str, str]] = {
        "length_penalty": "only beam search ranks hypotheses by length"}


class BeamSearchWorkload(_NPerPrompt):
    name = "beam_search"
    beam = True
    ignored_options: ClassVar[dict[str, str]] = {
        "temperature": "beams are the most likely continuations, never sampled",
        "top_p": "beams are the most likely continuations, never sampled"}
