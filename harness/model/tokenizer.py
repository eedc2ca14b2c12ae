"""Tokenizers behind one small Protocol: bytes for tests, Hugging Face for real models."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine and workloads need from a tokenizer."""

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_ids(self) -> list[int]: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt ids for a conversation, ending with the assistant's turn to speak."""
        ...

    def render_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The conversation as the model's chat template writes it (text, specials kept)."""
        ...

    def token_text(self, token_id: int) -> str:
        """The text of one token, special tokens included ("" for a textless special)."""
        ...


def plain_chat_text(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """Fallback chat format for models without a template: one "role: content" line each."""
    lines = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return lines + "assistant: " if add_generation_prompt else lines


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS=256 and EOS=257. Needs no files."""

    BOS = 256
    EOS = 257

    @property
    def bos_id(self) -> int:
        return self.BOS

    @property
    def eos_ids(self) -> list[int]:
        return [self.EOS]

    @property
    def vocab_size(self) -> int:
        return 258

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(plain_chat_text(messages), add_bos=True)

    def render_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return plain_chat_text(messages, add_generation_prompt)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])


def set_offline() -> None:
    """Forbid Hugging Face hub downloads; must run before `transformers` is first imported."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class HFTokenizer:
    """Wraps a `transformers` tokenizer; ids are added explicitly, never implicitly.

    ``encode`` never lets the tokenizer add its own specials (some add BOS, some do not), so
    ``add_bos`` means the same for every model.
    """

    def __init__(self, tok: PreTrainedTokenizerBase, extra_eos: list[int] | None = None) -> None:
        self.tok = tok
        eos: list[int] = []
        for i in [tok.eos_token_id, *(extra_eos or [])]:
            if isinstance(i, int) and i not in eos:
                eos.append(i)
        self._eos = eos

    @classmethod
    def from_folder(
        cls, folder: str | Path, gguf_file: str | None = None, extra_eos: list[int] | None = None
    ) -> HFTokenizer:
        """Tokenizer files of an HF folder, or the vocabulary inside ``folder/gguf_file``."""
        set_offline()
        from transformers import AutoTokenizer

        kwargs: dict[str, Any] = {"local_files_only": True}
        if gguf_file is not None:
            kwargs["gguf_file"] = gguf_file
        return cls(AutoTokenizer.from_pretrained(str(folder), **kwargs), extra_eos)

    @classmethod
    def from_gguf(cls, path: str | Path, extra_eos: list[int] | None = None) -> HFTokenizer:
        """Tokenizer stored inside a GGUF file, cached as tokenizer.json after the first load.

        transformers rebuilds it by re-parsing the whole GGUF (~5 s on 2 cores for SmolLM2);
        the cached copy loads in ~0.3 s. The cache key is the file's name, size and mtime; it
        lives under ``$KVBENCH_CACHE`` (default ``~/.cache/kvbench``).
        """
        path = Path(path)
        st = path.stat()
        root = Path(os.environ.get("KVBENCH_CACHE", Path.home() / ".cache" / "kvbench"))
        cached = root / "tokenizers" / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}"
        if (cached / "tokenizer.json").is_file():
            return cls.from_folder(cached, extra_eos=extra_eos)
        tok = cls.from_folder(path.parent, gguf_file=path.name, extra_eos=extra_eos)
        try:
            # Write aside, then rename: parallel sweep jobs may race to fill the same entry.
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=cached.parent))
            tok.tok.save_pretrained(str(tmp))
            try:
                tmp.rename(cached)
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass  # read-only home: stay correct, just slower next time
        return tok

    @property
    def bos_id(self) -> int | None:
        bos = self.tok.bos_token_id
        return bos if isinstance(bos, int) else None

    @property
    def eos_ids(self) -> list[int]:
        return list(self._eos)

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids: list[int] = self.tok.encode(text, add_special_tokens=False)
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        text = self.tok.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str), type(text)
        return text

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self.tok, "chat_template", None):
            return self.encode(plain_chat_text(messages), add_bos=True)
        ids: list[int] = self.tok.encode(self.render_chat(messages), add_special_tokens=False)
        return ids

    def render_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        if not getattr(self.tok, "chat_template", None):
            return plain_chat_text(messages, add_generation_prompt)
        # Render to text: the return type of tokenize=True changed across versions.
        text = self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert isinstance(text, str), type(text)
        return text

    def token_text(self, token_id: int) -> str:
        text = self.tok.decode([token_id], skip_special_tokens=False)
        assert isinstance(text, str), type(text)
        return text
