"""Multi-turn conversation traces, generated from a seed, in kvbench's JSONL trace format
(``conversation_id`` and ``turn``: a later turn re-sends the conversation so far, then its
new message; harness.workloads.trace): for routing studies, where whether a turn finds
its history cached depends on which replica it goes to.

    python -m harness.workloads.conversation_synth OUT.jsonl --conversations 2000 \\
        [--rate 4] [--turns-mean 4] [--first-median 1500] [--user-median 150] \\
        [--output-median 250] [--think-mean 20] [--seed 0]

Shaped after the Mooncake conversation trace's published summary (FAST'25: long
contexts, most of each prompt a prefix seen before; nothing copied from it):
conversations start as a Poisson process at ``rate`` per second; each has 1 + a geometric
number of turns (mean ``turns_mean``, at most 16); its first prompt is lognormal (median
``first_median`` tokens: a system prompt and a document), each later turn adds the
previous answer and a new user message (lognormal, median ``user_median``); answers are
lognormal (median ``output_median``, at most 1,024); a turn is due ``think`` seconds
(exponential, mean ``think_mean``) after the previous one was due (the replay holds it
until the answer it follows is done). Rows are written in time order; prompts are capped
at 32,768 tokens (a conversation ends there).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
from pathlib import Path

MAX_PROMPT = 32_768
MAX_TURNS = 16


def write_conversations(path: Path, conversations: int, rate: float = 4.0, seed: int = 0,
                        turns_mean: float = 4.0, first_median: float = 1500,
                        user_median: float = 150, output_median: float = 250,
                        think_mean: float = 20.0) -> int:
    """Write the trace to ``path``; returns its number of rows (turns)."""
    rng = random.Random(seed)
    rows: list[tuple[float, int, int, int, int]] = []  # (due, conversation, turn, in, out)
    t = 0.0
    p_more = 1 - 1 / turns_mean  # geometric: mean turns_mean
    for c in range(conversations):
        t += rng.expovariate(rate)
        due = t
        # (capped so that every conversation has its first turn)
        prompt = min(MAX_PROMPT - 1024,
                     max(16, int(rng.lognormvariate(math.log(first_median), 0.8))))
        for turn in range(MAX_TURNS):
            out = min(1024, max(1, int(rng.lognormvariate(math.log(output_median), 0.7))))
            if prompt + out > MAX_PROMPT:
                break
            rows.append((due, c, turn, prompt, out))
            if rng.random() >= p_more:
                break
            due += rng.expovariate(1 / think_mean) if think_mean > 0 else 0.0
            prompt += out + max(1, int(rng.lognormvariate(math.log(user_median), 0.8)))
    heapq.heapify(rows)
    with path.open("w") as f:
        while rows:
            due, c, turn, n_in, n_out = heapq.heappop(rows)
            f.write(json.dumps({"arrival_s": round(due, 6), "prompt_tokens": n_in,
                                "output_tokens": n_out, "conversation_id": f"c{c}",
                                "turn": turn}) + "\n")
    return sum(1 for _ in path.open())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--conversations", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=4.0, help="conversations started per second")
    ap.add_argument("--turns-mean", type=float, default=4.0)
    ap.add_argument("--first-median", type=float, default=1500.0, help="first prompt tokens")
    ap.add_argument("--user-median", type=float, default=150.0, help="tokens a turn adds")
    ap.add_argument("--output-median", type=float, default=250.0, help="answer tokens")
    ap.add_argument("--think-mean", type=float, default=20.0, help="seconds between turns")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.conversations < 0 or not a.rate > 0 or not a.turns_mean >= 1 or a.think_mean < 0 \
            or min(a.first_median, a.user_median, a.output_median) < 1:
        ap.error("--conversations >= 0, --rate > 0, --turns-mean >= 1, --think-mean >= 0 "
                 "and medians >= 1, please")
    n = write_conversations(a.out, a.conversations, a.rate, a.seed, a.turns_mean,
                            a.first_median, a.user_median, a.output_median, a.think_mean)
    print(f"{a.out}: {n} turns of {a.conversations} conversations")


if __name__ == "__main__":
    main()
