"""KV backends (installed as ``harness.backends``). The registry is explicit: every
backend is listed here by hand, and an unknown name fails with the known ones."""

from __future__ import annotations

from harness.backends.adakv import AdaKVBackend
from harness.backends.base import AttentionBatch, CacheSizing, KVBackend, KVLayout, PrefillChunk
from harness.backends.contiguous import ContiguousBackend
from harness.backends.duo_attention import DuoAttentionBackend
from harness.backends.expected_attention import ExpectedAttentionBackend
from harness.backends.flash_attn import FlashAttnBackend
from harness.backends.flex import FlexBackend
from harness.backends.fp8 import Fp8Backend
from harness.backends.h2o import H2OBackend
from harness.backends.int8 import Int8Backend
from harness.backends.keydiff import KeyDiffBackend
from harness.backends.kivi import KIVIBackend
from harness.backends.knorm import KnormBackend
from harness.backends.observed_attention import ObservedAttentionBackend
from harness.backends.paged import PagedBackend
from harness.backends.pyramidkv import PyramidKVBackend
from harness.backends.quest import QuestBackend
from harness.backends.sliding_window import SlidingWindowBackend, StreamingLLMBackend
from harness.backends.snapkv import SnapKVBackend
from harness.backends.tova import TOVABackend

BACKENDS: dict[str, type[KVBackend]] = {
    "contiguous": ContiguousBackend,
    "paged": PagedBackend,
    "flex": FlexBackend,
    "flash_attn": FlashAttnBackend,
    "fp8": Fp8Backend,
    "int8": Int8Backend,
    "kivi": KIVIBackend,
    "quest": QuestBackend,
    "sliding_window": SlidingWindowBackend,
    "streaming_llm": StreamingLLMBackend,
    "h2o": H2OBackend,
    "tova": TOVABackend,
    "snapkv": SnapKVBackend,
    "knorm": KnormBackend,
    "keydiff": KeyDiffBackend,
    "observed_attention": ObservedAttentionBackend,
    "expected_attention": ExpectedAttentionBackend,
    "pyramidkv": PyramidKVBackend,
    "adakv": AdaKVBackend,
    "duo_attention": DuoAttentionBackend,
}


def get_backend(name: str) -> type[KVBackend]:
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not registered; known: {', '.join(BACKENDS)}")
    return BACKENDS[name]


__all__ = ["BACKENDS", "AttentionBatch", "CacheSizing", "KVBackend", "KVLayout",
           "PrefillChunk", "get_backend"]
