"""``scheduler.admission=reserve``: SGLang's admission by reserved output tokens.

SGLang (python/sglang/srt/managers/schedule_policy.py ``PrefillAdder``, scheduler.py;
v0.3-0.5) admits a waiting request only when its prompt plus its whole ``max_new_tokens``
(clipped at 4,096) fits in the token pool's free and evictable slots after every running
request has reserved ``new_token_ratio`` of the output tokens it may still produce. The
ratio starts at 0.7, decays linearly over 600 decode steps to 0.7 x 0.14, goes back to 0.7
when nothing runs, and after a *retract* (a decode step out of memory: a request preempted
by recompute) becomes the share of the survivors' output budget they have used plus 20
steps of room, at most 1. So a run that filled the pool admits more carefully from then
on, where an engine with admission by the prompt alone (vLLM's ``watermark``) keeps
admitting and preempting (the recompute thrash of long contexts at full memory).

Constants as SGLang names them (environment defaults): ``SGLANG_INIT_NEW_TOKEN_RATIO``
0.7, ``SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR`` 0.14, ``SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS``
600, ``CLIP_MAX_NEW_TOKENS`` 4096, ``retract_decode_steps`` 20.
"""

from __future__ import annotations

from collections.abc import Iterable

from harness.kv.base import KVUsage
from harness.sched.sequence import SequenceGroup

INIT_RATIO = 0.7
MIN_RATIO_FACTOR = 0.14
DECAY_STEPS = 600
CLIP_MAX_NEW = 4096
RETRACT_STEPS = 20


def output_left(g: SequenceGroup, max_model_len: int) -> int:
    """Output tokens one of ``g``'s sequences may still produce (its max_tokens within
    max_model_len, less what it has), clipped as SGLang clips its estimate."""
    n_prompt = len(g.prompt_ids)
    budget = min(g.params.max_tokens, max_model_len - n_prompt)
    done = max((s.num_output_tokens for s in g.live_seqs), default=0)
    return max(0, min(budget - done, CLIP_MAX_NEW))


class TokenReserve:
    """The ``new_token_ratio`` state of one scheduler and the room it leaves."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.min_ratio = INIT_RATIO * MIN_RATIO_FACTOR
        self.decay = (INIT_RATIO - self.min_ratio) / DECAY_STEPS
        self.ratio = INIT_RATIO

    def room(self, usage: KVUsage, block_size: int, running: Iterable[SequenceGroup]) -> float:
        """Token slots a new request may take: the free and evictable blocks' slots less
        the running requests' reserved output (``ratio`` of what each may still write)."""
        free = (usage.free_blocks + usage.cached_free_blocks) * block_size
        reserved = sum(output_left(g, self.max_model_len) * len(g.live_seqs) for g in running)
        return free - self.ratio * reserved

    def need(self, g: SequenceGroup, prompt_left: int) -> int:
        """What admitting ``g`` takes from the room: its uncomputed prompt tokens (all its
        sequences' together: ``prompt_left``) and its whole clipped output budget."""
        return prompt_left + output_left(g, self.max_model_len) * len(g.live_seqs)

    def stepped(self, decoded: bool, running: bool) -> None:
        """After a step: a decode step decays the ratio; an idle engine resets it."""
        if not running:
            self.ratio = INIT_RATIO
        elif decoded:
            self.ratio = max(self.ratio - self.decay, self.min_ratio)

    def retracted(self, running: Iterable[SequenceGroup]) -> None:
        """A running request was preempted for room: the ratio becomes the survivors' used
        share of their output budget plus :data:`RETRACT_STEPS` steps each, at most 1."""
        used = total = n = 0
        for g in running:
            n_prompt = len(g.prompt_ids)
            for s in g.live_seqs:
                used += s.num_output_tokens
                total += min(g.params.max_tokens, self.max_model_len - n_prompt)
                n += 1
        if total > 0:
            self.ratio = min(1.0, (used + RETRACT_STEPS * n) / total)
