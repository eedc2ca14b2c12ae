"""The `ruler` workload's tasks (modelled on RULER's synthetic categories, Hsieh et al.
2024): each builds, for one (length, depth, sample) cell, prompts of exactly ``length``
tokens and the strings a correct answer contains.

Prompts are in completion form (the question, then the start of its answer), not in the
chat template: on SmolLM2-135M the completion form finds a pass key 20/20 up to 4k tokens
where the chat template fails at 4k (../shared/FACTS.md). Questions come after the
haystack, so every question about one haystack shares its whole prefix.

``workload.haystack`` (a cell's ``haystack``) chooses the text and the words: ``essays``
(the default) is RULER's own: Paul Graham's essays as the essay haystack, keys drawn from
wonderwords' adjective-noun words and cwe's words from its lists, as RULER draws them
(harness/workloads/ruler_words.py); ``own`` is kvbench's first suite, unchanged: Python's
help texts, the plain-word :data:`KEYS` and a vocabulary from the help texts.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from harness.model.tokenizer import Tokenizer
from harness.workloads.ruler_text import (
    Needle,
    UnitStream,
    essay_stream,
    fill,
    noise_stream,
    paul_graham_stream,
)
from harness.workloads.ruler_words import cwe_words, draw_key, draw_keys
from harness.workloads.text import corpus_words

NIAH_HEADER = ("Some special magic numbers are hidden within the following text. Make sure "
               "to memorize them. I will quiz you about the numbers afterwards.\n")
VT_HEADER = ("Memorize and track the chain(s) of variable assignment hidden in the following "
             "text.\n")
CWE_HEADER = ("Below is a numbered list of words. In these words, some appear more often "
              "than others. Memorize the ones that appear most often.\n")
FWE_HEADER = ("Read the following coded text and track the frequency of each coded word. "
              "Find the three most frequently appeared coded words.\n")

# Needle keys of the own suite (haystack=own): plain words the haystacks do not use.
KEYS = ("apple banana cherry dolphin eagle falcon garden harbor island jungle kettle lemon "
        "meadow nectar orchid pepper quartz raven saddle tiger umbrella violet walnut "
        "yellow zebra anchor breeze canyon desert ember forest glacier hollow ivory jasmine "
        "lantern marble nutmeg oyster pebble quiver ribbon sparrow thistle velvet willow "
        "acorn basil cobalt dune fern goblet hazel indigo juniper koala lilac mango").split()


@dataclass
class Item:
    """One request of the suite, before it gets an id."""

    task: str
    length: int
    depth: float  # the needle's (first needle's) realised depth, 0..1; -1: no needle
    sample: int
    prompt: list[int]
    expected: list[str]
    metric: str  # "all" (string_match_all) or "part" (string_match_part)
    max_tokens: int
    shared: str = ""  # items with the same key share a haystack (ordering for the cache)
    meta: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Knobs:
    """The tasks' sizes (RULER's defaults; smaller ones make a task easier)."""

    num_values: int = 4  # niah_multivalue: values of the one key
    num_queries: int = 4  # niah_multiquery: keys asked at once
    num_hops: int = 4  # vt: assignments after the first
    num_common: int = 10  # cwe: words to find


@dataclass
class Cell:
    """What a task builds from: the cell, its seeded rng and the run-wide knobs."""

    tok: Tokenizer
    seed: int
    length: int
    depths: list[float]  # every configured depth, 0..1 (a cell's own is depths[index])
    index: int
    sample: int
    value_digits: int
    rng: random.Random
    knobs: Knobs = field(default_factory=Knobs)
    haystack: str = "essays"  # "essays" (RULER's text and words) or "own"

    @property
    def depth(self) -> float:
        return self.depths[self.index]

    def value(self) -> str:
        lo = 10 ** (self.value_digits - 1)
        return str(self.rng.randrange(lo, 10 * lo))

    def essay(self) -> UnitStream:
        if self.haystack == "essays":
            return paul_graham_stream(self.tok)
        return essay_stream(self.tok, f"{self.seed}:essay:{self.sample}")

    @property
    def essay_key(self) -> str:
        """Items with one essay haystack (ordering for the prefix cache): the essays are
        one text for every sample; the own haystack's start depends on the sample."""
        return "essay" if self.haystack == "essays" else f"essay{self.sample}"

    def key(self) -> str:
        """One needle key, drawn from the cell's rng."""
        return draw_key(self.rng) if self.haystack == "essays" else self.rng.choice(KEYS)


def needle_text(key: str, value: str) -> str:
    return f" One of the special magic numbers for {key} is: {value}."


def niah_prompt(c: Cell, header: str, stream: UnitStream, needles: list[Needle],
                question: str) -> tuple[list[int], list[float]]:
    """BOS + header + haystack + question, exactly ``c.length`` tokens."""
    tok = c.tok
    head = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(header, add_bos=False)
    tail = tok.encode("\n" + question, add_bos=False)
    body, depths = fill(stream, tok, c.length - len(head) - len(tail), needles,
                        overhead=len(head) + len(tail))
    return head + body + tail, depths


def ask_one(key: str) -> str:
    return (f"What is the special magic number for {key} mentioned in the provided text? "
            f"The special magic number for {key} mentioned in the provided text is")


def ask_all(keys: list[str]) -> str:
    names = keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + " and " + keys[-1]
    return (f"What are all the special magic numbers for {names} mentioned in the provided "
            f"text? The special magic numbers for {names} mentioned in the provided text are")


def niah_single(c: Cell, essay: bool) -> list[Item]:
    """One needle at the cell's depth in noise (RULER niah_single_1) or an essay
    (niah_single_2)."""
    key, value = c.key(), c.value()
    stream = c.essay() if essay else noise_stream(c.tok)
    ids, d = niah_prompt(c, NIAH_HEADER, stream, [Needle(c.depth, needle_text(key, value))],
                         ask_one(key))
    task = "niah_single_2" if essay else "niah_single_1"
    shared = c.essay_key if essay else "noise"
    return [Item(task, c.length, d[0], c.sample, ids, [value], "all", 16, shared)]


def _multikey_haystack(c: Cell) -> tuple[list[str], list[str], list[Needle]]:
    """One needle per configured depth, each with its own key: for each question, the
    other needles are distractors (RULER niah_multikey_1, essay haystack)."""
    rng = random.Random(f"{c.seed}:multikey:{c.length}:{c.sample}")
    keys = (draw_keys(rng, len(c.depths)) if c.haystack == "essays"
            else rng.sample(KEYS, len(c.depths)))
    lo = 10 ** (c.value_digits - 1)
    values = [str(rng.randrange(lo, 10 * lo)) for _ in keys]
    return keys, values, [Needle(d, needle_text(k, v)) for d, k, v in zip(c.depths, keys, values)]


def niah_multikey(c: Cell) -> list[Item]:
    """The question about the needle at the cell's depth, among the others."""
    keys, values, needles = _multikey_haystack(c)
    i = c.index
    ids, d = niah_prompt(c, NIAH_HEADER, c.essay(), needles, ask_one(keys[i]))
    return [Item("niah_multikey", c.length, d[i], c.sample, ids, [values[i]], "all", 16,
                 f"mk{c.length}:{c.sample}")]


def niah_multiquery(c: Cell) -> list[Item]:
    """All values of ``num_queries`` keys of the multi-key haystack at once (its prefix is
    shared with niah_multikey's questions): the key at the cell's depth and the next ones."""
    keys, values, needles = _multikey_haystack(c)
    n, num_queries = len(keys), c.knobs.num_queries
    pick = [(c.index + j) % n for j in range(min(num_queries, n))]
    ids, d = niah_prompt(c, NIAH_HEADER, c.essay(), needles, ask_all([keys[j] for j in pick]))
    return [Item("niah_multiquery", c.length, d[c.index], c.sample, ids,
                 [values[j] for j in pick], "all", 16 * len(pick), f"mk{c.length}:{c.sample}")]


def niah_multivalue(c: Cell) -> list[Item]:
    """One key with ``num_values`` values, the first at the cell's depth and the rest spread
    evenly over what follows (RULER niah_multivalue)."""
    key, num_values = c.key(), c.knobs.num_values
    values = [c.value() for _ in range(num_values)]
    depths = [c.depth + (1 - c.depth) * j / num_values for j in range(num_values)]
    ids, d = niah_prompt(c, NIAH_HEADER, c.essay(),
                         [Needle(x, needle_text(key, v)) for x, v in zip(depths, values)],
                         ask_all([key]))
    return [Item("niah_multivalue", c.length, d[0], c.sample, ids, values, "all",
                 16 * num_values, c.essay_key)]


def variable_tracking(c: Cell) -> list[Item]:
    """A chain ``VAR A = 12345``, ``VAR B = A``, ... in noise, its first link at the cell's
    depth and the others spread after it; the answer names every variable of the chain."""
    num_hops = c.knobs.num_hops
    names = ["".join(c.rng.choices(string.ascii_uppercase, k=5)) for _ in range(num_hops + 1)]
    value = c.value()
    links = [f" VAR {names[0]} = {value}."] + [
        f" VAR {names[j]} = {names[j - 1]}." for j in range(1, num_hops + 1)]
    depths = [c.depth + (1 - c.depth) * j / len(links) for j in range(len(links))]
    question = (f"Question: Find all variables that are assigned the value {value} in the "
                f"text above. Answer: According to the chain(s) of variable assignment in the "
                f"text above, {len(names)} variables are assigned the value {value}, they are:")
    ids, d = niah_prompt(c, VT_HEADER, noise_stream(c.tok),
                         [Needle(x, t) for x, t in zip(depths, links)], question)
    return [Item("vt", c.length, d[0], c.sample, ids, names, "all", 32, "vt-noise")]


@lru_cache(maxsize=1)
def _vocab() -> list[str]:
    seen: dict[str, None] = {}
    for w in corpus_words():
        if w.isalpha() and w.islower() and 4 <= len(w) <= 9:
            seen.setdefault(w, None)
    return list(seen)


def _numbered_list(c: Cell, header: str, question: str, make: Callable[[int], list[str]],
                   answers: list[str], task: str, max_tokens: int) -> list[Item]:
    """A numbered word list sized to ``c.length`` tokens (words added until it fills)."""
    tok = c.tok
    head = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(header, add_bos=False)
    tail = tok.encode("\n" + question, add_bos=False)
    room = c.length - len(head) - len(tail)
    best: list[int] = []
    n = 16
    while True:  # grow the list until the next size would overflow the room
        words = make(n)
        body = tok.encode(" " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(words)),
                          add_bos=False)
        if len(body) > room and best:
            break
        best, n = body, int(n * 1.25) + 1
    body = best[:room]
    pad = tok.encode(" .", add_bos=False)[:1] * (room - len(body))  # the list, to the length
    ids = head + body + pad + tail
    return [Item(task, c.length, -1.0, c.sample, ids, answers, "all", max_tokens)]


def common_words(c: Cell, common_freq: int = 30, rare_freq: int = 3) -> list[Item]:
    """RULER cwe: ``knobs.num_common`` words each ``common_freq`` times among rare ones."""
    num_common = c.knobs.num_common
    pool = list(cwe_words()) if c.haystack == "essays" else _vocab()
    vocab = c.rng.sample(pool, min(len(pool), 1200))
    common, rare = vocab[:num_common], vocab[num_common:]
    shuffle_seed = c.rng.random()  # one order per cell, the same for every list size

    def make(n: int) -> list[str]:
        # n words in all; a short list scales the common words' count down (never below
        # twice the rare words'), as RULER does for short contexts.
        freq = max(2 * rare_freq, min(common_freq, n // (2 * num_common)))
        words = [w for w in common for _ in range(freq)]
        words += [w for w in rare[:max(0, (n - len(words)) // rare_freq)]
                  for _ in range(rare_freq)]
        random.Random(shuffle_seed).shuffle(words)
        return words

    q = (f"Question: What are the {num_common} most common words in the above list? Answer: "
         f"The top {num_common} words that appear most often in the list are:")
    return _numbered_list(c, CWE_HEADER, q, make, common, "cwe", 12 * num_common)


def frequent_words(c: Cell, alpha: float = 2.0, num_answers: int = 3) -> list[Item]:
    """RULER fwe: coded words with Zipf frequencies; the answer is the top three."""
    coded = ["".join(c.rng.choices(string.ascii_lowercase, k=6)) for _ in range(400)]
    weights = [1.0 / (r + 1) ** alpha for r in range(len(coded))]
    total = sum(weights)
    shuffle_seed = c.rng.random()

    def make(n: int) -> list[str]:
        counts = [max(1, round(n * w / total)) for w in weights]
        words = [w for w, k in zip(coded, counts) for _ in range(k)]
        random.Random(shuffle_seed).shuffle(words)
        return words

    q = ("Question: What are the three most frequently appeared words in the above coded "
         "text? Answer: According to the coded text above, the three most frequently "
         "appeared words are:")
    return _numbered_list(c, FWE_HEADER, q, make, coded[:num_answers], "fwe", 32)


TASKS: dict[str, Callable[[Cell], list[Item]]] = {
    "niah_single_1": lambda c: niah_single(c, essay=False),
    "niah_single_2": lambda c: niah_single(c, essay=True),
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "niah_multiquery": niah_multiquery,
    "vt": variable_tracking,
    "cwe": common_words,
    "fwe": frequent_words,
}
# Tasks without a needle depth: one item per (length, sample), not per depth.
DEPTHLESS = {"cwe", "fwe"}
