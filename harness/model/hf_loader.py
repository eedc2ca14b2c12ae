"""Load (and save) a Hugging Face folder: config.json + *.safetensors + tokenizer files.

Covers the Llama-shaped families (llama, mistral, qwen2) and Gemma 3's text decoder
(gemma3_text). Sliding-window attention is an attention concern and therefore the KV
backend's: the forward computes whatever attention the backend gives it, and a run gives
each layer its window (backends.base.LayerSlot) or refuses a model it cannot
(harness.stack.check_model_groups).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from harness import layer_types
from harness.errors import UserError
from harness.model.config import ModelConfig
from harness.model.gemma3 import make_model
from harness.model.llama import LlamaModel
from harness.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "gemma3_text")
# config.json key naming a tokenizer that needs no files (written by `save_hf` for tiny models).
BYTE_TOKENIZER_KEY = "kvbench_tokenizer"


def config_from_hf(raw: dict[str, Any], name: str) -> ModelConfig:
    """ModelConfig from a parsed config.json (transformers 4.x or 5.x layout)."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise UserError(f"model_type {model_type!r} is not supported (known: {SUPPORTED_TYPES})")
    heads = int(raw["num_attention_heads"])
    # transformers 5 moves rope_theta / rope_scaling into one "rope_parameters" dict.
    rope_params: dict[str, Any] = raw.get("rope_parameters") or {}
    theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling")
    if scaling is None and rope_params.get("rope_type", "default") != "default":
        scaling = rope_params
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "llama3":
        # As transformers: the original context defaults to max_position_embeddings.
        scaling = {"original_max_position_embeddings": raw["max_position_embeddings"], **scaling}
    extra: dict[str, Any] = {}
    if model_type == "gemma3_text":
        # transformers 5 keeps one RoPE dict per layer type; 4.x rope_theta (global) and
        # rope_local_base_freq (sliding), with rope_scaling for the global layers only.
        full = rope_params.get("full_attention") or {}
        local = rope_params.get("sliding_attention") or {}
        theta = raw.get("rope_theta", full.get("rope_theta", 1_000_000.0))
        if scaling is None and full.get("rope_type", "default") != "default":
            scaling = full
        extra = {"family": "gemma3",
                 "rope_local_theta": float(raw.get("rope_local_base_freq",
                                                   local.get("rope_theta", 10000.0))),
                 "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar", 256))}
        if raw.get("attn_logit_softcapping") or raw.get("final_logit_softcapping"):
            raise ValueError("logit soft-capping (Gemma 2) is not supported")
    eos = raw.get("eos_token_id")
    eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return ModelConfig(
        name=name,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        rope_theta=float(theta),
        rope_scaling=scaling,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias and has no key for it; Llama says so in attention_bias.
        attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        layer_attention=layer_types.compact(
            layer_types.from_hf(raw, int(raw["num_hidden_layers"]))),
        **extra,
    )


def read_config_json(folder: Path) -> dict[str, Any]:
    """config.json of a Hugging Face folder; UserError naming the path for a missing
    folder, a file given for the folder, a missing or unreadable config.json."""
    config_file = folder / "config.json"
    if folder.is_file():
        raise UserError(f"{folder} is a file, not a Hugging Face model folder (a .gguf? use "
                        "model=gguf model.path=<it>)")
    if not folder.exists():
        raise UserError(f"Hugging Face model folder {folder} does not exist")
    if not config_file.is_file():
        raise UserError(f"{folder} is not a Hugging Face model folder: no config.json")
    try:
        raw = json.loads(config_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise UserError(f"{config_file} is not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise UserError(f"{config_file} holds a JSON {type(raw).__name__}, not an object")
    return raw


def _safetensors_weights(folder: Path) -> Iterator[tuple[str, Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder} has no *.safetensors files")
    for file in files:
        # One tensor at a time: peak memory stays near one copy of the model.
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    yield key, f.get_tensor(key)
        except SafetensorError as e:  # a header or tensor cut short: say which file
            raise UserError(f"{file} cannot be read as safetensors ({e}): truncated (an "
                            "interrupted download or copy?) or corrupt") from e


def load_hf(
    folder: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[LlamaModel, Tokenizer]:
    """Model and tokenizer from a Hugging Face folder, weights cast to ``dtype``."""
    folder = Path(folder)
    config_file = folder / "config.json"
    raw = read_config_json(folder)
    try:
        cfg = config_from_hf(raw, name=folder.name)
    except KeyError as e:
        raise UserError(f"{config_file} lacks {e}, which a {raw.get('model_type')} config "
                        "needs") from e
    except (ValueError, TypeError) as e:
        raise UserError(f"{config_file}: {e}") from e
    model = make_model(cfg, dtype, device)
    try:
        model.load_weights(_safetensors_weights(folder))
    except UserError:
        raise
    except (KeyError, ValueError) as e:
        raise UserError(f"{folder}: the weights do not load ({e})") from e
    tokenizer: Tokenizer
    if raw.get(BYTE_TOKENIZER_KEY) == "byte":
        tokenizer = ByteTokenizer()
    else:
        tokenizer = HFTokenizer.from_folder(folder, extra_eos=cfg.eos_token_ids)
    return model, tokenizer


def save_hf(model: LlamaModel, folder: str | Path, byte_tokenizer: bool = False) -> None:
    """Write ``model`` as a folder that both `load_hf` and transformers can read.

    Llama naming and config keys; a model with q/k/v bias is written as Qwen2, a Gemma 3
    one as gemma3_text (its layer types, window, RoPE bases and query scale). With
    ``byte_tokenizer`` the config marks that no tokenizer files are needed.
    """
    c = model.config
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw: dict[str, Any] = {
        "model_type": "qwen2" if c.attention_bias else "llama",
        "architectures": ["Qwen2ForCausalLM" if c.attention_bias else "LlamaForCausalLM"],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
        "max_position_embeddings": c.max_position_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else c.eos_token_ids,
        "hidden_act": "silu",
        "torch_dtype": str(model.dtype).removeprefix("torch."),
    }
    if c.family == "gemma3":
        windows = {a.span for a in c.layer_attention if a.kind == "sliding"}
        raw.update({
            "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
            "hidden_activation": "gelu_pytorch_tanh", "sliding_window": max(windows, default=0),
            "layer_types": ["sliding_attention" if a.kind == "sliding" else "full_attention"
                            for a in c.layer_attention] or None,
            "query_pre_attn_scalar": int(c.query_pre_attn_scalar or c.head_dim),
            "rope_local_base_freq": c.rope_local_theta, "pad_token_id": 0})
        raw.pop("hidden_act")
    if byte_tokenizer:
        raw[BYTE_TOKENIZER_KEY] = "byte"
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    save_file(model.hf_state_dict(), str(folder / "model.safetensors"), metadata={"format": "pt"})
