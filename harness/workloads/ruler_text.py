"""Haystacks for the `ruler` workload, built in token space so lengths are exact.

A haystack is a stream of *units* (short texts, each tokenized on its own and starting
with a space or newline, so that any concatenation of units reads as text) with needles
inserted between units at chosen depths. Two prompts built from the same unit stream
share every token before their first needle, whatever their length or depth: the prefix
cache then computes that part once for all of them (why the noise is one fixed stream and
an essay depends at most on its sample, never on the length or depth asked).

Essay haystacks (``workload.haystack``): ``essays``, Paul Graham's essays from the
Needle-in-a-Haystack package taken from their start for every prompt, as RULER takes
them (harness/workloads/essays.py); ``own``, Python's help texts from a start seeded by
the sample (kvbench's first haystack, kept for comparison).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from harness.errors import UserError
from harness.model.tokenizer import Tokenizer
from harness.workloads.essays import essay_words
from harness.workloads.text import corpus_words

# RULER's noise haystack (niah_single_1, variable tracking): the same sentences repeated.
NOISE_UNIT = (" The grass is green. The sky is blue. The sun is yellow. Here we go. There and "
              "back again.")
ESSAY_UNIT_WORDS = 24  # words per essay unit: the needle's position is rounded to a unit


@dataclass(frozen=True)
class Needle:
    """Text to insert at ``depth`` (0..1 of the haystack's filler) and what it answers."""

    depth: float
    text: str


def _unit_ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_bos=False)


class UnitStream:
    """Filler units tokenized lazily and cached, so a 4k haystack tokenizes its units once
    for every prompt that uses them."""

    def __init__(self, tok: Tokenizer, units: list[str]) -> None:
        self.tok, self.units = tok, units
        self._ids: list[list[int]] = []

    def ids(self, i: int) -> list[int]:
        while len(self._ids) <= i:
            self._ids.append(_unit_ids(self.tok, self.units[len(self._ids) % len(self.units)]))
        return self._ids[i]

    def take(self, num_tokens: int) -> list[list[int]]:
        """Whole units (the last one cut) adding up to exactly ``num_tokens`` ids."""
        out: list[list[int]] = []
        n = 0
        while n < num_tokens:
            u = self.ids(len(out))
            out.append(u[:num_tokens - n])
            n += len(out[-1])
        return out


def noise_stream(tok: Tokenizer) -> UnitStream:
    return UnitStream(tok, [NOISE_UNIT])


@lru_cache(maxsize=64)
def essay_units(seed: str, num_units: int = 2048) -> tuple[str, ...]:
    """``num_units`` consecutive units of Python's help texts from a seeded start (the
    corpus holds ~400k words: enough for 8k-token haystacks)."""
    words = corpus_words()
    rng = random.Random(seed)
    span = num_units * ESSAY_UNIT_WORDS
    start = rng.randrange(0, max(1, len(words) - span))
    chunk = words[start:start + span]
    return tuple(" " + " ".join(chunk[i:i + ESSAY_UNIT_WORDS])
                 for i in range(0, len(chunk), ESSAY_UNIT_WORDS))


def essay_stream(tok: Tokenizer, seed: str) -> UnitStream:
    return UnitStream(tok, list(essay_units(seed)))


@lru_cache(maxsize=1)
def paul_graham_units() -> tuple[str, ...]:
    """The Needle-in-a-Haystack essays as units of :data:`ESSAY_UNIT_WORDS` words, from
    their first word (RULER takes ``haystack[:num_words]``, the same start every time)."""
    words = essay_words()
    return tuple(" " + " ".join(words[i:i + ESSAY_UNIT_WORDS])
                 for i in range(0, len(words), ESSAY_UNIT_WORDS))


def paul_graham_stream(tok: Tokenizer) -> UnitStream:
    return UnitStream(tok, list(paul_graham_units()))


def fill(stream: UnitStream, tok: Tokenizer, num_tokens: int,
         needles: list[Needle], overhead: int = 0) -> tuple[list[int], list[float]]:
    """``num_tokens`` ids: the stream's filler with the needles inserted between units,
    each at the unit boundary nearest its depth. Returns the ids and each needle's
    realised depth (its first token's position / the filler's length), in input order."""
    needle_ids = [_unit_ids(tok, n.text) for n in needles]
    filler_len = num_tokens - sum(len(x) for x in needle_ids)
    if filler_len < 1:
        # overhead: the prompt's tokens around the haystack (header, question).
        need = overhead + sum(len(x) for x in needle_ids) + 1
        raise UserError(f"a {num_tokens + overhead}-token prompt cannot hold its header, "
                        f"question and needles ({need - 1} tokens with this tokenizer): "
                        f"the shortest it can be is {need} tokens; raise workload.lengths")
    units = stream.take(filler_len)
    starts = [0]
    for u in units:
        starts.append(starts[-1] + len(u))
    # Unit index before which each needle goes (len(units): at the very end).
    order = sorted(range(len(needles)), key=lambda i: needles[i].depth)
    at: dict[int, list[int]] = {}
    where: dict[int, int] = {}
    for i in order:
        target = needles[i].depth * filler_len
        k = min(range(len(starts)), key=lambda j: abs(starts[j] - target))
        at.setdefault(k, []).append(i)
        where[i] = starts[k]
    out: list[int] = []
    for k in range(len(units) + 1):
        for i in at.get(k, []):
            out += needle_ids[i]
        if k < len(units):
            out += units[k]
    return out, [where[i] / filler_len for i in range(len(needles))]
