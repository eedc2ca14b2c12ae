"""Per-layer attention types of a model (issue #29's first step): full attention, a
sliding window of W tokens, or chunked attention over chunks of C tokens, read from a
Hugging Face ``config.json`` as transformers reads it.

A layer's type decides what its KV cache must hold: a full layer every token, a sliding
layer its last W, a chunked layer the tokens of the current chunk. A model whose layers
differ (Gemma 2/3, gpt-oss, Llama 4) needs one KV cache group per type to be measured
right: harness.stack.kv_plan builds them (harness.kv.groups) under both executors, and
gives each layer its window in the real engine (backends.base.LayerSlot).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from harness.errors import UserError

KINDS = ("full", "sliding", "chunked")
# transformers' layer_types names.
_HF_NAMES = {"full_attention": "full", "sliding_attention": "sliding",
             "chunked_attention": "chunked"}


@dataclass(frozen=True, order=True)
class LayerAttention:
    """One layer's attention: ``kind`` full, sliding (``span`` = the window) or chunked
    (``span`` = the chunk)."""

    kind: str = "full"
    span: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"attention kind must be one of {KINDS}, got {self.kind!r}")
        if (self.kind == "full") != (self.span == 0) or self.span < 0:
            want = "0" if self.kind == "full" else "> 0"
            raise ValueError(f"{self.kind} attention needs span {want}, got {self.span}")

    def __str__(self) -> str:
        return self.kind if self.kind == "full" else f"{self.kind} {self.span}"

    def held(self, context: int) -> int:
        """Tokens whose K/V this layer needs for the next query after ``context``."""
        if self.kind == "sliding":
            return min(context, self.span)
        if self.kind == "chunked":
            return (context - 1) % self.span + 1 if context else 0
        return context


FULL = LayerAttention()


def from_hf(raw: dict[str, Any], num_layers: int) -> tuple[LayerAttention, ...]:
    """Every layer's attention in a config.json's fields, as transformers reads them:
    ``layer_types`` (newer configs of every hybrid model); else Gemma 3's
    ``sliding_window_pattern`` (layer i is global when (i + 1) % pattern == 0); else
    Llama 4's ``attention_chunk_size`` with ``no_rope_layers`` (a layer with RoPE is
    chunked, a NoPE one global; default: every 4th layer NoPE); else ``sliding_window``
    (Qwen2: only with ``use_sliding_window``, from layer ``max_window_layers`` on;
    Mistral: every layer); else full attention everywhere."""
    window = raw.get("sliding_window")
    chunk = raw.get("attention_chunk_size")

    def need(value: Any, key: str) -> int:
        if not isinstance(value, int) or value <= 0:
            raise UserError(f"config.json: its layers use {key.split('_')[0]} attention but "
                            f"{key}={value!r} is not a positive integer")
        return value

    def make(name: str) -> LayerAttention:
        kind = _HF_NAMES.get(name)
        if kind is None:
            raise UserError(f"config.json: unknown layer type {name!r} in layer_types "
                            f"(known: {', '.join(_HF_NAMES)})")
        if kind == "sliding":
            return LayerAttention(kind, need(window, "sliding_window"))
        if kind == "chunked":
            return LayerAttention(kind, need(chunk, "attention_chunk_size"))
        return FULL

    types = raw.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise UserError(f"config.json: layer_types has {len(types)} entries for "
                            f"num_hidden_layers={num_layers}")
        return tuple(make(str(t)) for t in types)
    pattern = raw.get("sliding_window_pattern")
    if pattern is not None or raw.get("model_type") in ("gemma3", "gemma3_text"):
        # Gemma 3: both must be positive integers. A 0, null or text in either once made
        # every layer full (or every layer sliding) without a word (issue #55).
        p = need(pattern if pattern is not None else 6, "sliding_window_pattern")
        w = need(window, "sliding_window")
        return tuple(FULL if (i + 1) % p == 0 else LayerAttention("sliding", w)
                     for i in range(num_layers))
    if chunk:
        nope = raw.get("no_rope_layers") or [int((i + 1) % 4 != 0) for i in range(num_layers)]
        if len(nope) != num_layers:
            raise UserError(f"config.json: no_rope_layers has {len(nope)} entries for "
                            f"num_hidden_layers={num_layers}")
        c = LayerAttention("chunked", need(chunk, "attention_chunk_size"))
        return tuple(c if uses_rope else FULL for uses_rope in nope)
    if window:
        if raw.get("model_type") in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
            if not raw.get("use_sliding_window", False):
                return (FULL,) * num_layers
            first = int(raw.get("max_window_layers", 0))
            return tuple(LayerAttention("sliding", window) if i >= first else FULL
                         for i in range(num_layers))
        return (LayerAttention("sliding", need(window, "sliding_window")),) * num_layers
    return (FULL,) * num_layers


def compact(layers: tuple[LayerAttention, ...]) -> tuple[LayerAttention, ...]:
    """``layers`` as configs store them: empty when every layer is full."""
    return () if all(a == FULL for a in layers) else layers


def groups(layers: tuple[LayerAttention, ...]) -> list[tuple[LayerAttention, int]]:
    """(attention, number of layers) per distinct attention, full first."""
    return sorted(Counter(layers).items(), key=lambda g: (g[0].kind != "full", g[0]))


def held_bytes(layers: tuple[LayerAttention, ...], bytes_per_layer_token: float,
               context: int) -> float:
    """KV bytes one sequence of ``context`` tokens needs across its layers, each layer
    holding what its attention sees (a full layer every token, a sliding one its window,
    a chunked one the current chunk): what KV cache groups would hold, before blocks."""
    return sum(n * a.held(context) for a, n in groups(layers)) * bytes_per_layer_token


def describe(layers: tuple[LayerAttention, ...]) -> str:
    """E.g. ``10 full + 52 sliding 1024``."""
    return " + ".join(f"{n} {a}" for a, n in groups(layers))


def own_window(layers: tuple[LayerAttention, ...], backend: Any) -> bool:
    """Whether the run's backend options are the model's own cache: one sliding window
    over every layer and ``backend=sliding_window`` with that window and no sinks (then a
    uniform cache is the model's, and no KV cache groups are needed)."""
    kinds = set(layers)
    if len(kinds) != 1:
        return False
    (only,) = kinds
    return (only.kind == "sliding" and backend.name == "sliding_window"
            and getattr(backend, "window", None) == only.span
            and getattr(backend, "sink_tokens", 0) == 0)
