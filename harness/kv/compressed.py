"""Compressed prefixes: what a compress-once method leaves of a sequence, named so that a
later prompt starting with the same original tokens reuses it (issue #59, SCBench's
shared-context setting: one long context, several questions over turns).

A method that compresses a prompt once, at its end, and evicts nothing after
(``EvictionPolicy.compresses_once``: snapkv without ``max_tokens``, the presses knorm,
keydiff, observed_attention and expected_attention under ``prefill=full``, and the
per-head pyramidkv, adakv and duo_attention) leaves a sequence holding a function of
three things: the method with its parameters, the tokens the sequence computed, and where
its compression happened (the prompt's end). When such a sequence ends (it finished, or
it was preempted after its prompt) its state is kept as a *compressed prefix* under a name
made of those three:

* the method's :func:`fingerprint` (its name and every option) is the root of paged's
  chain of block hashes over the original tokens' full blocks (``block_hash``, with the
  request's extra key), so equal tokens under another method or other parameters never
  share a name;
* the name adds the tokens after the last full block and the *marks*, the positions
  where the state was compressed (``(prompt_len,)``; a state built on a hit keeps the
  marks of the prefix it hit: it was not compressed again).

A prompt whose first ``L`` tokens are those of a compressed prefix, ``L`` below the
prompt's length (its last token is always computed), hits the longest such prefix: the
sequence starts from a copy of its kept tokens with positions ``[0, L)`` computed, so the
prefill and the compression of those tokens are both skipped, and **the prompt is not
compressed again**: the rest of it, and what it generates, is all kept (the KV cache of an
earlier turn carried into the next, as a serving engine reusing it would; the same method
re-applied per turn is ``cache.enable_prefix_caching=false``). A hit copies the blocks
(or pages) rather than sharing them: the kept tokens' per-slot state (positions, scores)
is then the sequence's own, and the cached prefix stays as it was for the next hit. It
saves the prefill and the selection, not memory.

This module is the index (the names, the lookup); the KV managers keep the blocks
(harness.kv.evicting: named blocks in the pool's cache of freed blocks, evicted in its
order; harness.kv.headwise: pages the cache holds). No torch here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from harness.kv.paged import block_hash

_ROOT = 0x636F_6D70_7265_7373  # the chain's parent before the fingerprint is mixed in
_BLOCK = 0x626C_6F63_6B  # tags a compressed prefix's block names apart from chain links


def fingerprint(method: str, params: Mapping[str, Any]) -> int:
    """A stable 63-bit number for ``method`` with ``params`` (option -> value; lists,
    tuples, numbers, strings, bools, None, or anything with ``tolist()``, as a numpy
    mask of streaming heads): equal inputs give equal numbers in every process."""
    def plain(v: Any) -> Any:
        if hasattr(v, "tolist"):
            return plain(v.tolist())
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        return v

    text = repr((method, sorted((k, plain(v)) for k, v in params.items())))
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(slots=True, eq=False)
class CompressedPrefix:
    """One kept state. ``covered``: the original tokens it stands for (positions
    ``[0, covered)``); ``marks``: where it was compressed; ``owner``: the request that
    computed it; ``blocks``: the pool blocks (or pages) holding it, in the order a hit
    copies them; ``state``: what the manager needs besides (its free slots, its counts).
    ``chain`` and ``tail``: where the index files it (the chain hashes of its full
    blocks, then the tokens after them)."""

    name: int
    chain: tuple[int, ...]
    tail: tuple[int, ...]
    covered: int
    marks: tuple[int, ...]
    owner: int
    blocks: list[int] = field(default_factory=list)
    state: Any = None


class CompressedIndex:
    """The compressed prefixes of one KV manager, by name, found by a prompt's tokens.

    A prefix of ``covered`` tokens is filed under the chain hash of its first
    ``covered // block_size`` blocks (from the method's root); every chain hash on the way
    to it is counted, so a lookup hashes a prompt only as far as some prefix's chain goes.
    O(blocks hashed + prefixes filed at those depths) per lookup."""

    def __init__(self, method_fingerprint: int, block_size: int) -> None:
        self.root = hash((_ROOT, method_fingerprint))
        self.block_size = block_size
        self._by_name: dict[int, CompressedPrefix] = {}
        self._at: dict[int, list[CompressedPrefix]] = {}  # depth hash -> prefixes there
        self._passing: dict[int, int] = {}  # chain hash -> prefixes whose chain passes it

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, p: CompressedPrefix) -> bool:
        return self._by_name.get(p.name) is p

    def _chain(self, tokens: list[int], n: int, key: object) -> list[int]:
        """The chain hashes after each of the first ``n`` full blocks of ``tokens``."""
        bs, h, out = self.block_size, self.root, []
        for i in range(n):
            h = block_hash(h, tokens[i * bs:(i + 1) * bs], key)
            out.append(h)
        return out

    def name_of(self, tokens: list[int], covered: int, marks: tuple[int, ...],
                key: object) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """(name, chain, tail) of the state of ``tokens[:covered]`` compressed at
        ``marks``, under the group's extra ``key``: ``chain`` the hashes after each full
        block, ``tail`` the tokens after them."""
        d = covered // self.block_size
        chain = tuple(self._chain(tokens, d, key))
        tail = tuple(tokens[d * self.block_size:covered])
        last = chain[-1] if chain else self.root
        return hash((last, tail, marks, covered)), chain, tail

    @staticmethod
    def block_names(p: CompressedPrefix) -> list[int]:
        """The pool names of ``p``'s blocks (a block holds no original block's tokens:
        its name is the prefix's, and its place in it)."""
        return [hash((_BLOCK, p.name, i)) for i in range(len(p.blocks))]

    def _depth(self, p: CompressedPrefix) -> int:
        """Where ``p`` is filed: the chain hash after its last full block."""
        return p.chain[-1] if p.chain else self.root

    def get(self, name: int) -> CompressedPrefix | None:
        return self._by_name.get(name)

    def add(self, p: CompressedPrefix) -> None:
        """File ``p`` (its name not filed yet)."""
        assert p.name not in self._by_name, "a compressed prefix is filed once"
        self._by_name[p.name] = p
        self._at.setdefault(self._depth(p), []).append(p)
        for h in (self.root, *p.chain):
            self._passing[h] = self._passing.get(h, 0) + 1

    def remove(self, p: CompressedPrefix) -> None:
        """Unfile ``p`` (nothing if it is not filed)."""
        if self._by_name.get(p.name) is not p:
            return
        del self._by_name[p.name]
        depth = self._depth(p)
        here = self._at[depth]
        here.remove(p)
        if not here:
            del self._at[depth]
        for h in (self.root, *p.chain):
            n = self._passing[h] - 1
            if n:
                self._passing[h] = n
            else:
                del self._passing[h]

    def lookup(self, tokens: list[int], limit: int, key: object) -> CompressedPrefix | None:
        """The longest filed prefix whose original tokens are ``tokens[:covered]`` with
        ``covered <= limit`` (the latest filed of equals), or None."""
        bs, best = self.block_size, None
        h, d = self.root, 0
        while h in self._passing:
            for p in self._at.get(h, ()):
                if p.covered <= limit and (best is None or p.covered >= best.covered) \
                        and tuple(tokens[d * bs:p.covered]) == p.tail:
                    best = p
            if (d + 1) * bs > limit:
                break
            h = block_hash(h, tokens[d * bs:(d + 1) * bs], key)
            d += 1
        return best


def index_for(method: str, params: Mapping[str, Any], block_size: int) -> CompressedIndex:
    """An empty index of ``method``'s compressed prefixes (its name and options as the
    fingerprint), what the evicting and the per-head managers each keep."""
    return CompressedIndex(fingerprint(method, params), block_size)
