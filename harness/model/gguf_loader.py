"""Load a GGUF checkpoint (llama.cpp's format) into our LlamaModel (or Gemma3Model).

Weights are dequantized once to the run's dtype: the benchmark measures KV-cache
management, not quantized matmuls. The tokenizer is rebuilt by `transformers` from the
vocabulary stored in the same file.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from harness import layer_types
from harness.errors import UserError
from harness.layer_types import FULL, LayerAttention
from harness.model.config import ModelConfig
from harness.model.gemma3 import make_model
from harness.model.llama import LlamaModel
from harness.model.tokenizer import HFTokenizer

# Architectures whose llama.cpp converter stores q/k rows permuted for interleaved RoPE.
# Qwen2 uses NEOX (rotate-half) RoPE in llama.cpp and is stored unpermuted.
_PERMUTED_QK = {"llama", "mistral"}
# Gemma 3 rotates NEOX-style in llama.cpp (unpermuted rows), and its converter stores every
# norm weight as 1 + w (Gemma's RMSNorm scales by 1 + w): the loader subtracts it back.
_SUPPORTED = _PERMUTED_QK | {"qwen2", "gemma3"}
# llama.cpp's Gemma 3: every 6th layer global, the rest sliding, RoPE base 10,000 on the
# sliding ones (src/llama-model.cpp; GGUFs written before the pattern key lack it).
GEMMA3_PATTERN = 6
GEMMA3_LOCAL_THETA = 10000.0

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3's names where they differ: its ffn_norm is the MLP's pre-norm, and it has post-norms
# and QK-norms.
_GEMMA3_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA3_NAMES if arch == "gemma3" else _LAYER_NAMES
    blk, idx, rest = gguf_name.split(".", 2)
    if blk != "blk" or rest not in names:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"model.layers.{idx}.{names[rest]}"


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation, giving rows for rotate-half RoPE.

    llama.cpp reorders each head's rows from halves (i, i + hd/2) to pairs (2i, 2i+1) for
    its interleaved RoPE; ``n_head`` is the query head count for q, the KV head count for k.
    Skipping this still "runs" but gives perplexity ~425 instead of ~12.7 on SmolLM2.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(reader: Any, name: str) -> ModelConfig:
    """ModelConfig from the ``<arch>.*`` and ``tokenizer.ggml.*`` metadata of a GGUFReader."""
    arch = _field(reader, "general.architecture")
    if arch not in _SUPPORTED:
        known = sorted(_SUPPORTED)
        raise ValueError(f"GGUF architecture {arch!r} is not supported (known: {known})")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(
            "this GGUF stores per-frequency RoPE factors (Llama 3.1 style), which the GGUF "
            "loader does not read; load the Hugging Face folder instead (model.source=hf)"
        )

    def get(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling: dict[str, Any] | None = None
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise ValueError(f"GGUF rope scaling {kind!r} is not supported (known: linear)")
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    has_bias = any(t.name.endswith("attn_q.bias") for t in reader.tensors)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    layers, gemma = int(get("block_count")), arch == "gemma3"
    head_dim = int(get("attention.key_length") if gemma else
                   get("rope.dimension_count", hidden // heads))
    extra: dict[str, Any] = {}
    if gemma:
        window = int(get("attention.sliding_window"))
        pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", GEMMA3_PATTERN)
        if isinstance(pattern, list):  # newer converters: one flag per layer (True: slides)
            if len(pattern) != layers:
                raise ValueError(f"{arch}.attention.sliding_window_pattern has {len(pattern)} "
                                 f"entries for {layers} layers")
            kinds = [LayerAttention("sliding", window) if p else FULL for p in pattern]
        else:
            kinds = list(layer_types.from_hf(
                {"sliding_window": window, "sliding_window_pattern": int(pattern)}, layers))
        extra = {
            "family": "gemma3",
            "rope_local_theta": GEMMA3_LOCAL_THETA,
            # The query scale is not in the GGUF; llama.cpp (src/llama-model.cpp) takes
            # 1/sqrt(hidden / heads) for the 27B (62 layers; config.json's
            # query_pre_attn_scalar=168) and 1/sqrt(head_dim) for every other size: so here.
            "query_pre_attn_scalar": float(hidden // heads if layers == 62 else head_dim),
            "layer_attention": layer_types.compact(tuple(kinds)),
        }
    return ModelConfig(
        name=name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings=not has_output,
        attention_bias=has_bias,
        max_position_embeddings=int(get("context_length")),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=[] if eos is None else [int(eos)],
        **extra,
    )


def _weights(reader: Any, cfg: ModelConfig, arch: str) -> Iterator[tuple[str, Tensor]]:
    from gguf.quants import dequantize

    permuted = arch in _PERMUTED_QK
    for t in reader.tensors:
        # dequantize returns float32 in [out, in] order (numpy shape, reversed from GGUF's).
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if not w.flags.writeable:  # F32 tensors come back as read-only views of the mmap
            w = w.copy()
        name = hf_name(t.name, arch)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w - np.float32(1.0)  # llama.cpp stored 1 + w (module docstring)
        if permuted and name.endswith("q_proj.weight"):
            w = unpermute_qk(w, cfg.num_heads)
        elif permuted and name.endswith("k_proj.weight"):
            w = unpermute_qk(w, cfg.num_kv_heads)
        elif permuted and name.endswith(("q_proj.bias", "k_proj.bias")):
            raise ValueError(f"{t.name}: q/k bias with permuted rows is not supported")
        yield name, torch.from_numpy(w)


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[LlamaModel, HFTokenizer]:
    """Read config, dequantized weights and tokenizer from one ``.gguf`` file.

    Measured for SmolLM2-135M Q4_1 on 2 cores: ~3 s to open, ~2 s to dequantize.
    """
    path = Path(path)
    reader = open_gguf(path)
    try:
        cfg = read_config(reader, name=path.stem)
    except ValueError as e:  # what is missing or unsupported, said with the file's name
        raise UserError(f"{path}: {e}") from e
    model = make_model(cfg, dtype, device)
    arch = _field(reader, "general.architecture")
    try:
        model.load_weights(_weights(reader, cfg, arch))
    except UserError:
        raise
    except (ValueError, KeyError, NotImplementedError) as e:
        raise UserError(f"{path}: its tensors cannot be loaded: {e}") from e
    tokenizer = HFTokenizer.from_gguf(path, extra_eos=cfg.eos_token_ids)
    return model, tokenizer


def open_gguf(path: Path) -> Any:
    """A GGUFReader over ``path``; UserError naming the file when it is missing, a folder,
    not GGUF, or truncated (gguf's own errors are a bare "GGUF magic invalid" or numpy's
    reshape errors, without the file's name)."""
    from gguf import GGUFReader

    if path.is_dir():
        raise UserError(f"GGUF file {path} is a folder, not a file (a Hugging Face folder? "
                        "use model=hf model.path=<it>)")
    if not path.is_file():
        raise UserError(f"GGUF file {path} does not exist")
    try:
        return GGUFReader(path)
    except ValueError as e:
        if "magic" in str(e).lower():
            raise UserError(f"{path} is not a GGUF file (it does not start with the GGUF "
                            "magic bytes)") from e
        raise UserError(f"{path} cannot be read as GGUF ({e}): at {path.stat().st_size} "
                        "bytes it is truncated (an interrupted download or copy?) or "
                        "corrupt") from e
    except (IndexError, KeyError, OverflowError, struct.error, OSError) as e:
        raise UserError(f"{path} cannot be read as GGUF ({type(e).__name__}: {e}): "
                        "truncated or corrupt") from e
