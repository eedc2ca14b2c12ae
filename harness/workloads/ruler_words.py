"""RULER's key words and word-list vocabulary, from the ``wonderwords`` package's lists as
RULER draws them (NVIDIA/RULER scripts/data/synthetic/niah.py and
common_words_extraction.py):

- a needle's key (``type_needle_k: words``): ``random.choice(words)`` where ``words =
  sorted(set(f"{adj}-{noun}" for adj in adjectives for noun in nouns))``;
- the cwe task's words: ``random.sample`` of ``sorted(set(nouns + adjectives + verbs))``.

Building RULER's 6,171,620 key strings takes ~9 s and ~800 MB here, once per process.
Every adjective-noun pair gives a different string (checked at load,
:func:`_distinct_pairs`), so a uniform index over (adjective, noun) draws from exactly
the same set with the same chance each, without building it. Values stay numbers
(``type_needle_v: numbers``): 7 digits, RULER's ``random.randint(10**6, 10**7 - 1)``.
"""

from __future__ import annotations

import random
from functools import lru_cache

from harness.errors import UserError

WONDERWORDS = "3.0.1"  # pinned in pyproject.toml; its lists are what the keys come from


def _lists(*names: str) -> list[list[str]]:
    try:
        from wonderwords import random_word
    except ImportError:
        raise UserError("workload.haystack=essays draws RULER's keys from the wonderwords "
                        f"package, which is not installed: .venv/bin/python -m pip install "
                        f"wonderwords=={WONDERWORDS} (scripts/setup.sh installs it); or "
                        "workload.haystack=own") from None
    return [list(random_word._get_words_from_text_file(n)) for n in names]


def _distinct_pairs(adjs: tuple[str, ...], nouns: tuple[str, ...]) -> bool:
    """Whether ``f"{a}-{n}"`` differs for every pair. Two pairs can only give one string
    when a hyphen moves: ``a1-x`` (an adjective) with ``n2`` and ``a1`` with ``x-n2`` (a
    noun); only hyphenated words need looking at."""
    adj_set, noun_set = set(adjs), set(nouns)
    for adj in adjs:
        for i, ch in enumerate(adj):
            if ch == "-" and adj[:i] in adj_set:
                rest = adj[i + 1:]
                if any(n.startswith(rest + "-") and n[len(rest) + 1:] in noun_set
                       for n in nouns):
                    return False
    return True


@lru_cache(maxsize=1)
def key_parts() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """RULER's key vocabulary as its two sorted, distinct halves (adjectives, nouns)."""
    adjs_l, nouns_l = _lists("adjectivelist.txt", "nounlist.txt")
    adjs, nouns = tuple(sorted(set(adjs_l))), tuple(sorted(set(nouns_l)))
    if not _distinct_pairs(adjs, nouns):
        raise UserError("wonderwords' word lists give two adjective-noun pairs one string: "
                        f"the keys would not be RULER's; install wonderwords=={WONDERWORDS}")
    return adjs, nouns


def num_keys() -> int:
    adjs, nouns = key_parts()
    return len(adjs) * len(nouns)


def _key(i: int) -> str:
    adjs, nouns = key_parts()
    return f"{adjs[i // len(nouns)]}-{nouns[i % len(nouns)]}"


def draw_key(rng: random.Random) -> str:
    """One key, uniform over RULER's adjective-noun words."""
    return _key(rng.randrange(num_keys()))


def draw_keys(rng: random.Random, k: int) -> list[str]:
    """``k`` different keys (RULER draws each with ``random.choice``; two equal keys in
    one haystack, one chance in ~10^12, would make a question ambiguous)."""
    return [_key(i) for i in rng.sample(range(num_keys()), k)]


@lru_cache(maxsize=1)
def cwe_words() -> tuple[str, ...]:
    """RULER cwe's vocabulary: the sorted distinct nouns, adjectives and verbs."""
    nouns, adjs, verbs = _lists("nounlist.txt", "adjectivelist.txt", "verblist.txt")
    return tuple(sorted(set(nouns + adjs + verbs)))
