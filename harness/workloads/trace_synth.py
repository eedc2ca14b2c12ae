"""Mooncake-like and RAG-like traces of any length, generated from a seed (nothing copied
from a published trace): for testing replay at scale, e.g. a million rows, and for
prefix-cache policies (issue #58).

    python -m harness.workloads.trace_synth OUT.jsonl --rows 1000000 [--rate 300] [--seed 0]
        [--input-median 6000] [--output-median 250] [--block 512] [--kind mooncake|rag]

``--kind rag`` (:func:`write_rag_like`): a retrieval-augmented chat: 80% of the prompts
are one shared system block, two documents drawn from 500 Zipf(1.1)-popular ones (2-8
blocks each) and a question block of their own; 20% are one-off long prompts (the system
block and 8-32 blocks of their own, e.g. pasted files) that no later prompt reuses; outputs
lognormal around ``--output-median``. Which blocks a cache keeps decides its hits there:
the one-offs flush an LRU of the popular documents.

Shaped like the Mooncake conversation trace's published summary (FAST'25: mean input
~12k tokens, mean output ~340, 512-token hash blocks, prompts that share leading blocks):
input lengths lognormal (median 6,000, capped at 64k), outputs lognormal (median 250,
capped at 2,048), Poisson arrivals at ``rate`` per second; each prompt starts with one
of ``docs`` shared documents (Zipf-popular, 1-16 blocks) and ends with blocks of its own.
Written as a stream: memory does not grow with ``rows``. Smaller medians and blocks
(replayed with ``workload.hash_block_tokens`` equal to ``--block``) give a trace one
deployment can keep up with at a high rate (e.g. the million-row replay in
docs/whatif_scale.md).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

BLOCK = 512


def write_mooncake_like(path: Path, rows: int, rate: float = 300.0, seed: int = 0,
                        docs: int = 10_000, input_median: float = 6000,
                        output_median: float = 250, block: int = BLOCK) -> None:
    """Write ``rows`` Mooncake-format lines (timestamp ms, input_length, output_length,
    hash_ids: one per ``block`` prompt tokens) to ``path``."""
    rng = random.Random(seed)
    doc_blocks = [1 + min(15, int(rng.expovariate(1 / 3))) for _ in range(docs)]
    doc_first, next_id = _lay_out(doc_blocks, 0)
    cum, acc = _zipf_cdf(docs)
    t_ms = 0.0
    with path.open("w") as f:
        for _ in range(rows):
            t_ms += rng.expovariate(rate / 1e3)
            n_in = min(65_536, max(16, int(rng.lognormvariate(math.log(input_median), 1.0))))
            n_out = min(2048, max(1, int(rng.lognormvariate(math.log(output_median), 0.9))))
            d = _bisect(cum, rng.random() * acc)
            n_blocks = -(-n_in // block)
            shared = min(doc_blocks[d], n_blocks)
            ids = list(range(doc_first[d], doc_first[d] + shared))
            own = n_blocks - shared
            ids += range(next_id, next_id + own)
            next_id += own
            f.write(json.dumps({"timestamp": int(t_ms), "input_length": n_in,
                                "output_length": n_out, "hash_ids": ids}) + "\n")


def write_rag_like(path: Path, rows: int, rate: float = 300.0, seed: int = 0,
                   docs: int = 500, output_median: float = 100, block: int = BLOCK,
                   one_off_share: float = 0.2) -> None:
    """Write ``rows`` Mooncake-format lines of a RAG-like chat (module docstring) to
    ``path``: hash id 0 is the system block, documents' blocks follow, then each
    prompt's own blocks, never reused."""
    rng = random.Random(seed)
    doc_blocks = [rng.randint(2, 8) for _ in range(docs)]
    doc_first, next_id = _lay_out(doc_blocks, 1)
    cum, acc = _zipf_cdf(docs)
    t_ms = 0.0
    with path.open("w") as f:
        for _ in range(rows):
            t_ms += rng.expovariate(rate / 1e3)
            ids = [0]
            if rng.random() < one_off_share:
                own = rng.randint(8, 32)
            else:
                for _ in range(2):
                    d = _bisect(cum, rng.random() * acc)
                    ids += range(doc_first[d], doc_first[d] + doc_blocks[d])
                own = 1
            ids += range(next_id, next_id + own)
            next_id += own
            n_in = len(ids) * block - rng.randint(0, block - 1)  # its last block partial
            n_out = min(2048, max(1, int(rng.lognormvariate(math.log(output_median), 0.9))))
            f.write(json.dumps({"timestamp": int(t_ms), "input_length": n_in,
                                "output_length": n_out, "hash_ids": ids}) + "\n")


def _lay_out(doc_blocks: list[int], first_id: int) -> tuple[list[int], int]:
    """Each document's first hash id when the documents' blocks take consecutive ids from
    ``first_id`` on, and the next free id after them."""
    firsts, next_id = [], first_id
    for n in doc_blocks:
        firsts.append(next_id)
        next_id += n
    return firsts, next_id


def _zipf_cdf(n: int, s: float = 1.1) -> tuple[list[float], float]:
    """Zipf(``s``) popularity over ``n`` items as an unnormalized cumulative sum and its
    total: item ``_bisect(cum, random() * total)`` is drawn by inverse CDF."""
    cum, acc = [], 0.0
    for k in range(n):
        acc += 1 / (k + 1) ** s
        cum.append(acc)
    return cum, acc


def _bisect(cum: list[float], x: float) -> int:
    lo, hi = 0, len(cum) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cum[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--rate", type=float, default=300.0, help="requests per second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--input-median", type=float, default=6000.0, help="prompt tokens")
    ap.add_argument("--output-median", type=float, default=250.0, help="output tokens")
    ap.add_argument("--block", type=int, default=BLOCK, help="prompt tokens per hash id")
    ap.add_argument("--kind", choices=("mooncake", "rag"), default="mooncake",
                    help="mooncake: shared documents and long own prompts; rag: a shared "
                         "system block, two popular documents and a question, or a one-off "
                         "long prompt (module docstring)")
    a = ap.parse_args(argv)
    finite = all(math.isfinite(x) for x in (a.rate, a.input_median, a.output_median))
    if a.rows < 0 or not a.rate > 0 or a.block < 1 or not a.input_median >= 1 \
            or not a.output_median >= 1 or not finite:
        ap.error("--rows >= 0, --rate > 0, --block >= 1 and medians >= 1, all finite, please")
    if a.out.is_dir():
        ap.error(f"{a.out} is a folder: give the trace file's path (e.g. {a.out / 'trace.jsonl'})")
    if not a.out.parent.is_dir():
        ap.error(f"{a.out.parent} does not exist: create it, or give a path in a folder that "
                 "does")
    try:
        if a.kind == "rag":
            write_rag_like(a.out, a.rows, a.rate, a.seed, output_median=a.output_median,
                           block=a.block)
        else:
            write_mooncake_like(a.out, a.rows, a.rate, a.seed, input_median=a.input_median,
                                output_median=a.output_median, block=a.block)
    except OSError as e:
        ap.exit(1, f"trace_synth: cannot write {a.out}: {e.strerror or e}\n")


if __name__ == "__main__":
    main()
