"""A roofline spec from a Hugging Face ``config.json``: read strictly, never guessed.

Every number the step model multiplies comes from a named key, checked to be a positive
integer; a key that is missing, zero, null, a string or a float stops the run with one
error naming the file and the key. Dense Llama-family models (llama, mistral, qwen2,
qwen3, ...) are read as :func:`~harness.roofline.arch.llama_like`. Mixtures of experts
are read as such (active parameters for FLOPs, every expert's weights for bytes) in the
layouts this reader knows:

* ``mixtral``: every layer's MLP is ``num_local_experts`` SwiGLU experts of
  ``intermediate_size``, ``num_experts_per_tok`` per token, and a router;
* ``qwen2_moe`` / ``qwen3_moe`` / ``olmoe``: ``num_experts`` experts of
  ``moe_intermediate_size`` (+ a shared expert of ``shared_expert_intermediate_size``
  and its gate, qwen2_moe), ``num_experts_per_tok`` per token, every layer sparse;
* ``deepseek_v2`` / ``deepseek_v3`` / ``kimi_k2`` / ``glm4_moe`` (DeepSeek's layout):
  the first ``first_k_dense_replace`` layers dense (``intermediate_size``), then
  ``n_routed_experts`` experts of ``moe_intermediate_size``, ``num_experts_per_tok`` a
  token, beside ``n_shared_experts`` shared ones of the same size; attention latent
  (MLA: ``kv_lora_rank``, ``q_lora_rank`` (null: none), ``qk_nope_head_dim``,
  ``qk_rope_head_dim``, ``v_head_dim``) or, GLM-4.5's, GQA (:func:`fine_grained_moe`).
  A multi-token-prediction layer (``num_nextn_predict_layers``) is not counted.

Any other config with experts (gpt-oss, Llama 4, a Qwen-MoE with dense layers between
sparse ones, DeepSeek's layout with ``moe_layer_freq`` above 1) is refused with what to
use instead: read as dense it would be a wrong number (a Mixtral read as dense put 50 GiB
of KV on one A100-80GB).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from harness import layer_types
from harness.errors import UserError
from harness.roofline.arch import MLA, ArchSpec, fine_grained_moe, llama_like

# Keys that mean "this model has routed experts", in the configs we know of.
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
FINE_GRAINED = ("deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", *FINE_GRAINED)


class _Config:
    """A config.json's object, its keys read as checked positive integers."""

    def __init__(self, path: Path, raw: dict[str, Any]) -> None:
        self.path, self.raw = path, raw

    def fail(self, what: str) -> UserError:
        return UserError(f"roofline.model: {self.path}: {what}")

    def int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        """``key`` as an integer >= ``minimum`` (``default`` when absent or null)."""
        if self.raw.get(key) is None:
            if default is None:
                raise self.fail(f"lacks {key!r} (a positive integer)")
            return default
        v = self.raw[key]
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(f"{key}={v!r} is not an integer")
        if v < minimum:
            raise self.fail(f"{key}={v} must be >= {minimum}")
        return v


def read_hf_json(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The config.json at ``path`` (a file or its folder) as an object; UserError naming
    the file otherwise."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        raw = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"roofline.model={str(path)!r}: cannot read a config.json ({e})") \
            from None
    except ValueError as e:  # JSONDecodeError
        raise UserError(f"roofline.model: {p} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise UserError(f"roofline.model: {p} holds a JSON {type(raw).__name__}, not an "
                        "object (a Hugging Face config.json is one object)")
    return p, raw


def from_hf_config(path: str | Path) -> ArchSpec:
    """The spec of the model a Hugging Face ``config.json`` (a file or its folder)
    describes: a dense Llama-family decoder or a known mixture of experts."""
    p, raw = read_hf_json(path)
    c = _Config(p, raw)
    layers, hidden = c.int("num_hidden_layers"), c.int("hidden_size")
    heads = c.int("num_attention_heads")
    kv_heads = c.int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise c.fail(f"num_attention_heads={heads} is not a multiple of "
                     f"num_key_value_heads={kv_heads}")
    if raw.get("head_dim") is None and hidden % heads:
        raise c.fail(f"hidden_size={hidden} is not a multiple of num_attention_heads="
                     f"{heads}, and there is no head_dim")
    head_dim = c.int("head_dim", hidden // heads)
    model_type = str(raw.get("model_type", ""))
    name = str(raw.get("_name_or_path") or p.parent.name or "hf-model")
    bias = raw.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))
    common = dict(vocab=c.int("vocab_size"),
                  max_pos=c.int("max_position_embeddings", 4096),
                  head_dim=head_dim, tied=bool(raw.get("tie_word_embeddings", False)),
                  qkv_bias=bool(bias))
    experts = {k: raw[k] for k in EXPERT_KEYS if raw.get(k)}
    if not experts:
        spec = llama_like(name, layers, hidden, c.int("intermediate_size"), heads,
                          kv_heads, **common)  # type: ignore[arg-type]
    else:
        spec = _moe(c, name, model_type, experts, layers, hidden, heads, kv_heads, common)
    # What each layer's cache must hold (sliding / chunked layers: harness.layer_types);
    # an FP8 checkpoint with block-wise scales (quantization_config.weight_block_size).
    # A checkpoint that leaves attention unquantized (modules_to_not_convert, gpt-oss's
    # MXFP4) quantizes the experts alone.
    quant = raw.get("quantization_config")
    block = isinstance(quant, dict) and bool(quant.get("weight_block_size"))
    kept = quant.get("modules_to_not_convert") if isinstance(quant, dict) else None
    experts_only = bool(spec.num_experts) and isinstance(kept, list) \
        and any("self_attn" in str(m) for m in kept)
    return dataclasses.replace(
        spec, layer_attention=layer_types.compact(layer_types.from_hf(raw, layers)),
        fp8_block_scaled=block, experts_only_quant=experts_only)


def _moe(c: _Config, name: str, model_type: str, experts: dict[str, Any], layers: int,
         hidden: int, heads: int, kv_heads: int, common: dict[str, Any]) -> ArchSpec:
    """A known mixture-of-experts layout (module docstring), or a refusal."""
    found = ", ".join(f"{k}={v!r}" for k, v in experts.items())
    if model_type not in MOE_TYPES:
        raise c.fail(f"a mixture-of-experts model ({found}, model_type {model_type!r}) "
                     f"whose layout this reader does not know (it knows "
                     f"{', '.join(MOE_TYPES)}); read as dense its FLOPs, weights and KV "
                     "room would be wrong. Use a preset (roofline.model=gpt-oss-120b, "
                     "Llama-4-Scout: harness/roofline/models.py) or a config of a known "
                     "layout")
    if model_type in FINE_GRAINED:
        return _fine_grained(c, name, model_type, layers, hidden, heads, kv_heads, common)
    if model_type == "mixtral":
        n, ffn, shared = c.int("num_local_experts"), c.int("intermediate_size"), 0
    else:
        n, ffn = c.int("num_experts"), c.int("moe_intermediate_size")
        shared = c.int("shared_expert_intermediate_size", 0, minimum=0)
        if c.int("decoder_sparse_step", 1) != 1 or c.raw.get("mlp_only_layers"):
            raise c.fail("decoder_sparse_step / mlp_only_layers make some layers dense: "
                         "this reader takes every layer sparse; not supported")
    k = _per_token(c, n)
    # Attention from the dense reader (no MLP), then the experts apart: each a SwiGLU of
    # `ffn`; the router (hidden x n) and a shared expert with its gate run for every token.
    attn = llama_like(name, layers, hidden, 0, heads, kv_heads, **common)
    per_layer = hidden * n + (3 * hidden * shared + hidden if shared else 0)
    return ArchSpec(attn.name, layers, hidden, attn.vocab_size, heads, kv_heads,
                    attn.head_dim, attn.attn_qk_dim, attn.attn_v_dim,
                    attn.dense_params + layers * per_layer, attn.max_position_embeddings,
                    attn.tie_word_embeddings, expert_params=layers * n * 3 * hidden * ffn,
                    num_experts=n, experts_per_token=k)


def _per_token(c: _Config, experts: int) -> int:
    """``num_experts_per_tok``, checked against the ``experts`` it picks from."""
    k = c.int("num_experts_per_tok")
    if k > experts:
        raise c.fail(f"num_experts_per_tok={k} exceeds the {experts} experts")
    return k


def _fine_grained(c: _Config, name: str, model_type: str, layers: int, hidden: int,
                  heads: int, kv_heads: int, common: dict[str, Any]) -> ArchSpec:
    """DeepSeek's layout (module docstring): dense layers first, then routed + shared
    experts; MLA where the config has ``kv_lora_rank``, else GQA (GLM-4.5)."""
    if c.int("moe_layer_freq", 1) != 1:
        raise c.fail("moe_layer_freq above 1 makes every other layer dense: this reader "
                     "takes every layer after first_k_dense_replace sparse; not supported")
    n = c.int("n_routed_experts")
    k = _per_token(c, n)
    ffn = c.int("moe_intermediate_size")
    # (null: none, as the DeepSeek modeling code reads it)
    shared = c.int("n_shared_experts", 0, minimum=0) * ffn
    dense_layers = c.int("first_k_dense_replace", minimum=0)
    if dense_layers >= layers:
        raise c.fail(f"first_k_dense_replace={dense_layers} leaves no sparse layer of the "
                     f"{layers}")
    mla = None
    if c.raw.get("kv_lora_rank") is not None:
        sizes = (c.int("q_lora_rank", 0, minimum=0), c.int("kv_lora_rank"),
                 c.int("qk_nope_head_dim"), c.int("qk_rope_head_dim"), c.int("v_head_dim"))
        try:
            mla = MLA(*sizes)
        except UserError as e:  # (named by its file, as every other key is)
            raise c.fail(str(e)) from None
    elif model_type != "glm4_moe":
        raise c.fail(f"model_type {model_type!r} without kv_lora_rank: DeepSeek's layout "
                     "is read with its latent attention's sizes (kv_lora_rank, q_lora_rank, "
                     "qk_nope_head_dim, qk_rope_head_dim, v_head_dim)")
    return fine_grained_moe(
        name, layers, hidden, common["vocab"], common["max_pos"], heads, experts=n,
        per_token=k, expert_ffn=ffn, shared_ffn=shared, dense_layers=dense_layers,
        dense_ffn=c.int("intermediate_size") if dense_layers else 0, kv_heads=kv_heads,
        head_dim=common["head_dim"], qkv_bias=common["qkv_bias"], mla=mla,
        tied=common["tied"])
