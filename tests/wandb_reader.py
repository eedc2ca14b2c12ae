"""Read back what an offline W&B run logged, from its ``run-<id>.wandb`` file.

wandb 0.31 ships no Python reader for run files (its writer lives in the Go wandb-core).
The format, checked against files wandb 0.31 writes:

- a 7-byte file header: ``b":W&B"``, magic 0xBEE1 (uint16 LE), version 0 (uint8);
- then LevelDB-log style 32 KiB blocks (the header counts toward the first block). Each
  chunk has a 7-byte header: CRC32 (uint32 LE), data length (uint16 LE), chunk type
  (uint8: 1 full, 2 first, 3 middle, 4 last), then its data. The CRC is zlib's crc32 of
  the data, seeded with the crc32 of the type byte. A block's tail shorter than a chunk
  header is zero padding;
- a record's data (one chunk, or first + middles + last) is a serialized
  ``wandb.proto.wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

# wandb_internal_pb2 star-imports the module built for the installed protobuf major.
Record: Any = wandb_internal_pb2.Record  # type: ignore[attr-defined]

FILE_HEADER = struct.Struct("<4sHB")
MAGIC = 0xBEE1
BLOCK = 32 * 1024
CHUNK_HEADER = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _chunks(data: bytes) -> Iterator[tuple[int, bytes]]:
    ident, magic, version = FILE_HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", MAGIC, 0), "not a W&B run file"
    pos = FILE_HEADER.size
    while pos < len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER.size:
            pos += left  # padding at a block's end
            continue
        crc, length, kind = CHUNK_HEADER.unpack_from(data, pos)
        pos += CHUNK_HEADER.size
        if kind == 0 and length == 0:  # zeroed tail of a preallocated block
            pos += left - CHUNK_HEADER.size
            continue
        chunk = data[pos:pos + length]
        pos += length
        assert len(chunk) == length, "truncated chunk"
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"bad CRC at {pos}"
        yield kind, chunk


def iter_records(path: Path) -> Iterator[Any]:
    """Every record of a ``.wandb`` file, in order (CRC-checked)."""
    pending: list[bytes] | None = None
    for kind, chunk in _chunks(path.read_bytes()):
        if kind == FULL:
            payload = chunk
        elif kind == FIRST:
            pending = [chunk]
            continue
        elif kind == MIDDLE:
            assert pending is not None, "middle chunk without a first"
            pending.append(chunk)
            continue
        else:
            assert kind == LAST and pending is not None, f"unexpected chunk type {kind}"
            payload, pending = b"".join([*pending, chunk]), None
        rec = Record()
        rec.ParseFromString(payload)
        yield rec


def _path(item: Any) -> tuple[str, ...]:
    return (item.key,) if item.key else tuple(item.nested_key)


def _set(tree: dict[str, Any], keys: tuple[str, ...], value: Any) -> None:
    for k in keys[:-1]:
        tree = tree.setdefault(k, {})
    tree[keys[-1]] = value


@dataclass
class LoggedRun:
    """What the run logged. ``config`` and ``summary`` are nested by W&B's own key paths
    (a flat dotted key such as ``backend.name`` stays one key)."""

    run_id: str = ""
    project: str = ""
    name: str = ""
    group: str = ""
    job_type: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    # define_metric calls, by name or glob: {"step_metric": ..., "summary_none": ...}
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    exit_code: int | None = None


def read_run(path: Path) -> LoggedRun:
    """``path``: a ``run-<id>.wandb`` file or the offline run folder holding one."""
    if path.is_dir():
        (path,) = path.glob("run-*.wandb")
    run = LoggedRun()
    for rec in iter_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            run.run_id, run.project, run.name = r.run_id, r.project, r.display_name
            run.group, run.job_type, run.tags = r.run_group, r.job_type, list(r.tags)
            for c in r.config.update:
                _set(run.config, _path(c), json.loads(c.value_json))
        elif kind == "config":
            for c in rec.config.update:
                _set(run.config, _path(c), json.loads(c.value_json))
        elif kind == "history":
            run.history.append({".".join(_path(i)): json.loads(i.value_json)
                                for i in rec.history.item})
        elif kind == "summary":
            for s in rec.summary.update:
                _set(run.summary, _path(s), json.loads(s.value_json))
        elif kind == "metric":
            m = rec.metric
            run.metrics[m.name or m.glob_name] = {"step_metric": m.step_metric,
                                                  "summary_none": m.summary.none}
        elif kind == "exit":
            run.exit_code = rec.exit.exit_code
    return run
