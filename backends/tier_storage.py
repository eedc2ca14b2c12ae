"""The bytes of the prefix cache's lower tiers: host tensors, then a folder of files.

:class:`TierStorage` performs a step's :class:`~harness.kv.tiers.TierOp` list in order on
the backend's block tensors (``KVBackend.block_tensors()``: every tensor indexed by block
first, K/V with their scales and metadata, so a 1-byte or kivi cache moves its own
fewer bytes). The CPU tier is one host tensor per block tensor (pinned when the device is
CUDA, so copies can run asynchronously); the disk tier is :class:`DiskTier`.

The disk tier does **not** outlive a run: each run writes into a fresh folder of its own
(``run-<pid>-<random>``, marked with a :data:`MARKER` file written as it is made) under
``cache.tiers.disk_dir`` and removes it when it ends. A marked folder left by a run that
died (``kill -9``, a lost machine: its pid is gone) is removed, unread, by the next run
that opens the same parent, and said so; nothing unmarked is ever removed; no run ever reads
another run's blocks, so a block from another model, backend or layout cannot come back.
Within a run every file is written to a temporary name and renamed when complete (a
reader never sees half a block), and carries a header with its slot, length and CRC-32,
checked on every read: a damaged file fails the run loudly instead of feeding the model
garbage.
"""

from __future__ import annotations

import os
import shutil
import struct
import sys
import tempfile
import time
import uuid
import weakref
import zlib
from pathlib import Path

import torch

from harness.errors import UserError
from harness.kv.tiers import CPU, DISK, GPU, TierOp
from harness.sched.step import CHECKS

_MAGIC = b"KVBTIER1"
_HEADER = struct.Struct("<8sqqI")  # magic, slot, payload bytes, crc32
# Tests: a path; a write then stops halfway through its temporary file, creates this
# path and waits to be killed (tests/backends/test_tier_storage.py kills it with SIGKILL there).
PAUSE_ENV = "KVBENCH_TEST_DISK_PAUSE"


# A disk tier's folder holds this file from its creation: "kvbench disk tier, pid <pid>".
MARKER = "KVBENCH_DISK_TIER"
MARKER_TEXT = "kvbench disk tier, pid "


def _marked_pid(d: Path) -> int | None:
    """The pid of the run whose disk tier made folder ``d``, or None when ``d`` is not
    one (not a real folder, no marker, or a marker of another text)."""
    if d.is_symlink() or not d.is_dir():
        return None
    try:
        text = (d / MARKER).read_text()
    except OSError:
        return None
    if not text.startswith(MARKER_TEXT):
        return None
    pid = text[len(MARKER_TEXT):].strip()
    return int(pid) if pid.isdigit() and int(pid) > 0 else None


class CorruptBlock(RuntimeError):
    """A disk tier file that is not the block it should be (never returned as K/V)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


class DiskTier:
    """``num_blocks`` slots, one file each, in a folder of this run's own."""

    def __init__(self, parent: str | os.PathLike[str] | None, num_blocks: int) -> None:
        root = Path(parent) if parent else Path(tempfile.gettempdir()) / "kvbench-disk-tier"
        try:
            root.mkdir(parents=True, exist_ok=True)
            probe = root / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise UserError(f"cache.tiers.disk_dir={str(root)!r}: the disk tier cannot write "
                            f"there ({e.strerror or e}); give a writable folder") from None
        self.discarded = self.discard_stale(root)
        for d in self.discarded:
            print(f"kvbench: disk tier: removed {d}, left by a run that ended without "
                  "cleaning up (its blocks are never read: the disk tier lives one run)",
                  file=sys.stderr)
        self.num_blocks = num_blocks
        self.dir = root / f"run-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.dir.mkdir()
        # The marker is what makes the folder kvbench's: only a marked folder is ever
        # removed by a later run (a user's own run-* folders under disk_dir are not).
        (self.dir / MARKER).write_text(f"{MARKER_TEXT}{os.getpid()}\n")
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)

    @staticmethod
    def discard_stale(root: Path) -> list[Path]:
        """Remove the folders that a disk tier of a process now gone created (marked:
        :data:`MARKER`); returns them. Anything else under ``root`` (a file, a link, a
        folder without the marker or with another text in it) is left as it is."""
        gone = []
        for d in sorted(root.glob("run-*")):
            pid = _marked_pid(d)
            if pid is None or pid == os.getpid() or _pid_alive(pid):
                continue  # not a tier's, or one still in use (quality's stacks share a pid)
            try:
                shutil.rmtree(d)
            except OSError as e:
                print(f"kvbench: disk tier: could not remove {d}, left by a run that ended "
                      f"without cleaning up ({e.strerror or e}); it is never read",
                      file=sys.stderr)
                continue
            gone.append(d)
        return gone

    def close(self) -> None:
        self._cleanup()

    def path(self, slot: int) -> Path:
        return self.dir / f"{slot}.kv"

    def write(self, slot: int, payload: bytes) -> None:
        assert 0 <= slot < self.num_blocks
        header = _HEADER.pack(_MAGIC, slot, len(payload), zlib.crc32(payload))
        tmp = self.dir / f"{slot}.tmp"
        pause = os.environ.get(PAUSE_ENV)
        with open(tmp, "wb") as f:
            f.write(header)
            if pause:  # tests: die halfway through a write
                f.write(payload[:len(payload) // 2])
                f.flush()
                Path(pause).touch()
                while True:
                    time.sleep(3600)
            f.write(payload)
        os.replace(tmp, self.path(slot))  # atomic: the slot's file is whole or absent

    def read(self, slot: int) -> bytes:
        p = self.path(slot)
        try:
            data = p.read_bytes()
        except OSError as e:
            raise CorruptBlock(f"disk tier slot {slot}: {p} cannot be read ({e})") from None
        if len(data) < _HEADER.size:
            raise CorruptBlock(f"disk tier slot {slot}: {p} is truncated")
        magic, s, n, crc = _HEADER.unpack_from(data)
        payload = data[_HEADER.size:]
        if magic != _MAGIC or s != slot or n != len(payload) or zlib.crc32(payload) != crc:
            raise CorruptBlock(f"disk tier slot {slot}: {p} is damaged (header, length or "
                               "checksum wrong); its block is not used")
        return payload


class TierStorage:
    """Host tensors and the disk tier for ``tensors`` (each (num_blocks, ...) on the
    device); ``num_blocks``: the CPU tier's and (optionally) the disk tier's slots."""

    def __init__(self, tensors: list[torch.Tensor], num_blocks: list[int],
                 disk_dir: str | None = None) -> None:
        assert tensors, "a tiered backend has block tensors"
        pin = tensors[0].is_cuda
        self.tensors = tensors
        self.host = [torch.zeros((num_blocks[0], *t.shape[1:]), dtype=t.dtype,
                                 pin_memory=pin) for t in tensors]
        self.disk = DiskTier(disk_dir, num_blocks[1]) if len(num_blocks) > 1 and \
            num_blocks[1] else None
        self.block_bytes = sum(t[0].numel() * t.element_size() for t in tensors)
        self.transfer_s = 0.0  # wall seconds spent in tier operations
        self.bytes_moved = 0
        # Under KVBENCH_CHECK (the tests), a load's target block is first filled with
        # garbage: a load that copies nothing, or the wrong rows, then shows in the tokens.
        self.poison_loads = CHECKS

    def apply(self, ops: list[TierOp]) -> None:
        """Perform ``ops`` in order (spills before the writes that reuse their slots)."""
        if not ops:
            return
        t0 = time.perf_counter()
        for op in ops:
            self._one(op)
        if self.tensors[0].is_cuda:
            torch.cuda.synchronize(self.tensors[0].device)
        self.transfer_s += time.perf_counter() - t0
        self.bytes_moved += len(ops) * self.block_bytes

    def _one(self, op: TierOp) -> None:
        src, dst = op.src, op.dst
        if op.src_tier == GPU and op.dst_tier == CPU:
            for t, h in zip(self.tensors, self.host):
                h[dst].copy_(t[src])
        elif op.src_tier == CPU and op.dst_tier == DISK:
            assert self.disk is not None
            self.disk.write(dst, self._pack([h[src] for h in self.host]))
        elif op.dst_tier == GPU:
            if self.poison_loads:
                for t in self.tensors:
                    t[dst] = garbage(t[dst])
            if op.src_tier == CPU:
                for t, h in zip(self.tensors, self.host):
                    t[dst].copy_(h[src], non_blocking=True)
            else:
                assert self.disk is not None and op.src_tier == DISK
                for t, row in zip(self.tensors, self._unpack(self.disk.read(src))):
                    t[dst].copy_(row)
        else:
            raise AssertionError(f"no such tier move: {op}")

    @staticmethod
    def _pack(rows: list[torch.Tensor]) -> bytes:
        return b"".join(r.contiguous().view(torch.uint8).numpy().tobytes() for r in rows)

    def _unpack(self, payload: bytes) -> list[torch.Tensor]:
        rows, off = [], 0
        for h in self.host:
            n = h[0].numel() * h.element_size()
            raw = torch.frombuffer(bytearray(payload[off:off + n]), dtype=torch.uint8)
            rows.append(raw.view(h.dtype).view(h.shape[1:]))
            off += n
        if off != len(payload):
            raise CorruptBlock(f"disk tier block of {len(payload)} bytes, expected {off}")
        return rows

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()


def garbage(t: torch.Tensor) -> torch.Tensor:
    """Values no computation produces, of ``t``'s shape and dtype (a load that copies
    nothing then shows in the outputs)."""
    if t.dtype.is_floating_point:
        return torch.full_like(t, 1e4) if t.element_size() > 1 else torch.full_like(t, 448.0)
    return torch.full_like(t, 0x5A)
