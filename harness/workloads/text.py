"""Offline text for prompts: the help texts that ship with Python (pydoc_data.topics)."""

from __future__ import annotations

import random
from functools import lru_cache


@lru_cache(maxsize=1)
def corpus_words() -> list[str]:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).split()


def corpus_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def random_passage(rng: random.Random, num_words: int) -> str:
    """A seeded window of ``num_words`` consecutive words of the corpus."""
    words = corpus_words()
    start = rng.randrange(0, len(words) - num_words)
    return " ".join(words[start:start + num_words])
