"""The assembled Gemma 3 GGUF in kvbench's cache is held to its pinned SHA-256 at every
load, not only when it is first joined (issue #55: a cached file whose bytes rotted, its
size unchanged, ran and emitted token 0 for every output). Small stand-in chunks here,
with the pinned hash set to theirs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import harness.model.gemma3_package as gp


def test_a_rotted_cached_model_is_joined_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    chunks = []
    for i in range(3):
        c = tmp_path / f"part{i}"
        c.write_bytes(bytes(range(256)) * (i + 3))
        chunks.append(c)
    whole = b"".join(c.read_bytes() for c in chunks)
    monkeypatch.setattr(gp, "chunk_paths", lambda: chunks)
    monkeypatch.setattr(gp, "GEMMA3_SHA256", hashlib.sha256(whole).hexdigest())
    cache = tmp_path / "cache"
    path = gp.gemma3_270m_path(cache)
    assert path.read_bytes() == whole
    rotted = bytearray(whole)
    rotted[1000] ^= 0x40  # one flipped bit, the size unchanged
    path.write_bytes(bytes(rotted))
    again = gp.gemma3_270m_path(cache)
    assert again == path and again.read_bytes() == whole
    assert "is damaged" in capsys.readouterr().err
    assert gp.gemma3_270m_path(cache).read_bytes() == whole  # a sound copy: used as is
    assert "is damaged" not in capsys.readouterr().err
