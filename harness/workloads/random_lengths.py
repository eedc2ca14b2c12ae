"""`random`: input and output lengths drawn from high-variance distributions.

Distributions: ``uniform`` (between min and max), ``normal`` (mean, std) and
``lognormal`` (a ShareGPT-like shape with the given mean and std; the PagedAttention paper
reports ShareGPT means of 161 input and 338 output tokens). Lengths are clipped to
[min, max]. Each request's drawn output length ends it (as an EOS would) while
``max_tokens`` stays the upper bound ``output_max``: a reservation made from max_tokens then
over-reserves exactly as a real server does. The workload of the memory-waste experiment.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from harness.model.tokenizer import Tokenizer
from harness.sched.sequence import SamplingParams, SequenceGroup
from harness.validate import at_least, in_range, one_of, ordered
from harness.workloads.arrivals import ArrivalOptions, arrival_times
from harness.workloads.base import Request
from harness.workloads.common import token_prompt

DISTRIBUTIONS = ("uniform", "normal", "lognormal")


@dataclass
class RandomConfig(ArrivalOptions):
    num_requests: int = 32
    distribution: str = "lognormal"
    input_mean: float = 80.0
    input_std: float = 60.0
    input_min: int = 4
    input_max: int = 512
    output_mean: float = 96.0
    output_std: float = 80.0
    output_min: int = 1
    output_max: int = 384
    priority_levels: int = 1  # >1: each request gets a random priority (scheduler.policy)

    def __post_init__(self) -> None:
        super().__post_init__()
        one_of(self, "workload", "distribution", DISTRIBUTIONS)
        at_least(self, "workload", 1, "num_requests", "input_min", "output_min",
                 "priority_levels")
        at_least(self, "workload", 0, "input_std", "output_std")
        in_range(self, "workload", "input_mean", 0, float("inf"), lo_open=True)
        in_range(self, "workload", "output_mean", 0, float("inf"), lo_open=True)
        ordered(self, "workload", "input_min", "input_max")
        ordered(self, "workload", "output_min", "output_max")


def draw_length(rng: random.Random, dist: str, mean: float, std: float, lo: int,
                hi: int) -> int:
    if dist == "uniform":
        x = rng.uniform(lo, hi)
    elif dist == "normal":
        x = rng.gauss(mean, std)
    elif dist == "lognormal":
        # Match the requested mean and std: sigma^2 = ln(1 + std^2/mean^2).
        sigma2 = math.log(1 + (std / mean) ** 2)
        x = rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))
    else:
        raise ValueError(f"unknown workload.distribution {dist!r}; known: "
                         f"{', '.join(DISTRIBUTIONS)}")
    return int(min(hi, max(lo, round(x))))


class RandomWorkload:
    name = "random"

    def __init__(self, cfg: RandomConfig, tok: Tokenizer) -> None:
        rng = random.Random(cfg.seed_value)
        times = arrival_times(cfg.num_requests, cfg, rng)
        self.requests = []
        for i in range(cfg.num_requests):
            n_in = draw_length(rng, cfg.distribution, cfg.input_mean, cfg.input_std,
                               cfg.input_min, cfg.input_max)
            n_out = draw_length(rng, cfg.distribution, cfg.output_mean, cfg.output_std,
                                cfg.output_min, cfg.output_max)
            params = SamplingParams(max_tokens=cfg.output_max, ignore_eos=True,
                                    stop_after=n_out)
            prio = rng.randrange(cfg.priority_levels) if cfg.priority_levels > 1 else 0
            self.requests.append(Request(i, token_prompt(tok, rng, n_in), params,
                                         arrival_s=times[i], priority=prio,
                                         meta={"output_len": n_out}))

    def initial_requests(self) -> list[Request]:
        return list(self.requests)

    def on_finished(self, group: SequenceGroup) -> list[Request]:
        return []
