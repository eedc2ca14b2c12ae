"""kvpress's side of scripts/peer_kvpress.sh, run in its own venv (.venv-kvpress: kvpress
0.5.5 pins transformers < 5.3; kvbench's venv has 5.x). Imports nothing of kvbench.

    python scripts/peer/kvpress_side.py PROMPTS.json OUT.json [--fixture FILE.pt]

For every press and compression ratio and every prompt: the whole prompt in one prefill
under the press (kvpress compresses each layer's cache after that layer's attention ran,
so the prefill itself is full attention), the first answer token from the prefill's
logits, then greedy decoding to the prompt's max_tokens with positions continuing from
the prompt's length (kvpress's pipeline does the same). Two selections:

* ``head``: kvpress's own (ScorerPress.compress: the top ``n_kept`` per layer and KV head);
* ``sequence``: kvbench's (one cache slot holds a token for every layer and head, so one
  set of tokens is kept): the press's scores, averaged over KV heads, summed over layers,
  top ``n_kept`` once, the same tokens kept in every layer and head.

The per-head presses (pyramidkv, adakv, duo_attention) run ``head`` only: kvbench keeps
per head too (harness/kv/headwise.py). PyramidKVPress and AdaKVPress(SnapKVPress) at
kvbench's defaults (window 64, kernel 5, average pooling, beta 20, alpha_safeguard 0.20);
DuoAttentionPress with the heads, sinks and recent tokens kvbench measured on the model
(prompts.json's ``duo``: kvpress's patterns are downloaded and exist for none of
SmolLM2's size), so that both sides stream the same heads.

``--fixture``: the inputs and outputs of every press's ``score`` on the first two layers
of a short prompt (its first 64 tokens), for tests/backends/test_peer_kvpress.py.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from kvpress import (
    AdaKVPress,
    DuoAttentionPress,
    ExpectedAttentionPress,
    KeyDiffPress,
    KnormPress,
    ObservedAttentionPress,
    PyramidKVPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from kvpress.presses.base_press import BasePress
from kvpress.presses.scorer_press import ScorerPress
from kvpress.utils import get_prerope_query_states
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

# kvbench's snapkv defaults (window 32, kernel 7), with kvpress's average pooling on both.
PRESSES: dict[str, Any] = {
    "snapkv": lambda r: SnapKVPress(compression_ratio=r, window_size=32, kernel_size=7),
    "streaming_llm": lambda r: StreamingLLMPress(compression_ratio=r, n_sink=4),
    "tova": lambda r: TOVAPress(compression_ratio=r),
    "knorm": lambda r: KnormPress(compression_ratio=r),
    "keydiff": lambda r: KeyDiffPress(compression_ratio=r),
    "observed_attention": lambda r: ObservedAttentionPress(compression_ratio=r),
    "expected_attention": lambda r: ExpectedAttentionPress(compression_ratio=r),
}
EAGER = {"observed_attention"}  # needs the attention weights (attn_implementation=eager)
FIXTURE_TOKENS, FIXTURE_LAYERS = 64, (0, 1)
# Per-head presses (kvpress masks what they drop; kvbench frees it): kvbench's defaults.
HEAD_PRESSES: dict[str, Any] = {
    "pyramidkv": lambda r: PyramidKVPress(compression_ratio=r, window_size=64, kernel_size=5),
    "adakv": lambda r: AdaKVPress(SnapKVPress(compression_ratio=r, window_size=64,
                                              kernel_size=5)),
}


@dataclass
class KvbenchHeads(DuoAttentionPress):
    """DuoAttentionPress with the streaming heads given (kvbench's, measured on the model),
    not loaded from DuoAttention's published patterns."""

    heads: Any = None  # prompts.json's "duo": streaming (layers x KV heads), sink, recent

    def post_init_from_model(self, model: Any) -> None:
        self.sink_size, self.recent_size = int(self.heads["sink"]), int(self.heads["recent"])
        self.streaming_mask = torch.tensor(self.heads["streaming"], dtype=torch.bool,
                                           device=model.device)


@dataclass
class RecordScores(BasePress):
    """Scores every layer with ``inner.score`` and compresses nothing."""

    inner: Any = None
    scores: dict[int, torch.Tensor] = field(default_factory=dict)

    def compress(self, module: Any, hidden_states: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, attentions: torch.Tensor, kwargs: dict[str, Any]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.inner.score(module, hidden_states, keys, values, attentions, kwargs)
        self.scores[module.layer_idx] = s.float()[0]  # (KV, T)
        return keys, values


@dataclass
class Capture(BasePress):
    """The fixture: each layer's inputs to ``score`` as kvbench sees them (post-RoPE
    queries and keys, values; kvbench computes the attention weights from them, as its
    attention does) and every press's scores."""

    presses: dict[str, ScorerPress] = field(default_factory=dict)
    out: dict[str, Any] = field(default_factory=dict)

    def compress(self, module: Any, hidden_states: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, attentions: torch.Tensor, kwargs: dict[str, Any]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = module.layer_idx
        if layer not in FIXTURE_LAYERS:
            return keys, values
        q = get_prerope_query_states(module, hidden_states)  # (1, H, T, D)
        cos, sin = kwargs["position_embeddings"]
        q_post, _ = apply_rotary_pos_emb(q, q, cos, sin)
        rec = {"q": q_post[0].transpose(0, 1).contiguous(),  # (T, H, D), as kvbench's attend
               "k": keys[0].transpose(0, 1).contiguous(),  # (T, KV, D)
               "v": values[0].transpose(0, 1).contiguous(),
               "scores": {name: p.score(module, hidden_states, keys, values, attentions,
                                        kwargs).float()[0]  # (KV, T)
                          for name, p in self.presses.items()}}
        self.out[str(layer)] = rec
        return keys, values


def generate(model: Any, ids: list[int], press: BasePress | None, max_tokens: int,
             select: tuple[RecordScores, int] | None = None) -> list[int]:
    """Prefill under ``press``, then greedy decoding. ``select`` = (a RecordScores press,
    n_kept): the sequence selection, the prefill recorded (nothing compressed during it),
    then every layer's cache pruned to the same ``n_kept`` tokens."""
    x = torch.tensor([ids])
    cache = DynamicCache()
    with torch.inference_mode():
        if press is not None:
            with press(model):
                out = model(input_ids=x, past_key_values=cache, use_cache=True)
        else:
            out = model(input_ids=x, past_key_values=cache, use_cache=True)
        if select is not None:
            idx = torch.tensor(sequence_keep(*select))
            for layer in cache.layers:
                layer.keys = layer.keys[:, :, idx].contiguous()
                layer.values = layer.values[:, :, idx].contiguous()
        tok = int(out.logits[0, -1].argmax())
        gen, pos = [tok], len(ids)
        for i in range(max_tokens - 1):
            out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache,
                        position_ids=torch.tensor([[pos + i]]), use_cache=True)
            tok = int(out.logits[0, -1].argmax())
            gen.append(tok)
    return gen


def sequence_keep(rec: RecordScores, n_kept: int) -> list[int]:
    total = sum(s.mean(dim=0) for s in rec.scores.values())  # (T,)
    return sorted(total.topk(n_kept).indices.tolist())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("prompts", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--fixture", type=Path, default=None)
    ap.add_argument("--methods", nargs="+",
                    default=[*PRESSES, *HEAD_PRESSES, "duo_attention"])
    a = ap.parse_args()
    d = json.loads(a.prompts.read_text())
    gguf = Path(d["gguf"])
    torch.set_num_threads(1)
    models = {impl: AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
        attn_implementation=impl).eval() for impl in ("sdpa", "eager")}
    res: dict[str, Any] = {"versions": versions(), "outputs": {}}
    t0 = time.time()
    res["outputs"]["none"] = {str(p["id"]): generate(models["sdpa"], p["ids"], None,
                                                     p["max_tokens"]) for p in d["prompts"]}
    for name in a.methods:
        model = models["eager" if name in EAGER else "sdpa"]
        for ratio in d["ratios"]:
            key = f"{name}@{ratio}"
            head, seq = {}, {}
            for p in d["prompts"]:
                n_kept = d["kept"][str(ratio)][str(p["length"])]
                if name in PRESSES:
                    press = PRESSES[name](ratio)
                elif name in HEAD_PRESSES:
                    press = HEAD_PRESSES[name](ratio)
                else:  # duo_attention: kvbench's heads (the ratio is theirs, head_ratio)
                    press = KvbenchHeads(head_compression_ratio=d["duo"]["head_ratio"],
                                         heads=d["duo"])
                head[str(p["id"])] = generate(model, p["ids"], press, p["max_tokens"])
                if name not in PRESSES:
                    continue  # per head on both sides: no per-sequence selection
                rec = RecordScores(inner=PRESSES[name](ratio))
                seq[str(p["id"])] = generate(model, p["ids"], rec, p["max_tokens"],
                                             (rec, n_kept))
            res["outputs"][key] = {"head": head, **({"sequence": seq} if seq else {})}
            print(f"{key}: {len(d['prompts'])} prompts, {time.time() - t0:.0f} s", flush=True)
            a.out.write_text(json.dumps(res) + "\n")  # as it goes: a kill keeps the rest
    a.out.write_text(json.dumps(res) + "\n")
    if a.fixture is not None:
        write_fixture(models["eager"], d["prompts"][0]["ids"][:FIXTURE_TOKENS], a.fixture)


def write_fixture(model: Any, ids: list[int], path: Path) -> None:
    cap = Capture(presses={name: make(0.5) for name, make in PRESSES.items()
                           if name != "streaming_llm"})
    with torch.inference_mode(), cap(model):
        model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache(), use_cache=True)
    rope = model.model.rotary_emb
    cap.out["meta"] = {"inv_freq": rope.inv_freq.double().clone(),
                       "attention_scaling": float(getattr(rope, "attention_scaling", 1.0)),
                       "num_layers": model.config.num_hidden_layers,
                       "tokens": len(ids), "versions": versions(),
                       "snapkv": {"window": 32, "kernel": 7},
                       "expected_attention": {"n_future_positions": 512, "n_sink": 4}}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(cap.out, path)
    print(f"fixture -> {path} ({path.stat().st_size // 1024} KiB)")


def versions() -> dict[str, str]:
    import importlib.metadata as md

    return {n: md.version(n) for n in ("kvpress", "transformers", "torch")}


if __name__ == "__main__":
    main()
