"""Pieces the workloads share: prompts of an exact token length (arrival processes:
harness.workloads.arrivals)."""

from __future__ import annotations

import random

from harness.model.tokenizer import Tokenizer
from harness.workloads.text import corpus_words, random_passage


def token_prompt(tok: Tokenizer, rng: random.Random, num_tokens: int,
                 add_bos: bool = True) -> list[int]:
    """Exactly ``num_tokens`` ids of real text (BOS included when the model has one)."""
    ids: list[int] = []
    bos = [tok.bos_id] if add_bos and tok.bos_id is not None else []
    # Passages of at most a tenth of the corpus: a longer prompt is several of them (one
    # passage as long as the prompt failed past the corpus' ~100k words).
    words = min(max(8, num_tokens), len(corpus_words()) // 10)
    while len(bos) + len(ids) < num_tokens:
        ids += tok.encode(random_passage(rng, words), add_bos=False)
    return (bos + ids)[:max(1, num_tokens)]
