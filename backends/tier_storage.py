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
checked on every read: a damaged file is never fed to the model.

Faults mid-run lose a block, not the run (issue #55). A write that fails (a full disk,
ENOSPC; a file-size limit, EFBIG, with SIGXFSZ ignored as Python starts; any other
OSError) leaves no file for its slot, and the tier's bookkeeping drops the block after
the step (:meth:`~harness.kv.tiers.LowerTiers.lose`: counted,
``cache.tier.disk.write_failures``). A prompt's lookup that finds a block on disk first
has its file read back and checked (:meth:`DiskTier.check`, once per version of the
file): a damaged one is removed and dropped from the tier, and the lookup misses there,
so the block is computed again (``cache.tier.disk.damaged_blocks``). Each is warned about
once per run, with its cause. A block loaded back in the step that wrote it (spilled and
hit at once: its file is not checked) is loaded from the bytes written. A file damaged
between its check and its load (the same step) still stops the run
(:class:`CorruptBlock`): a wrong block is never loaded.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import uuid
import weakref
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import torch

from harness.errors import UserError
from harness.kv.tiers import CPU, DISK, GPU, LowerTiers, TierOp
from harness.sched.step import CHECKS
from harness.units import format_bytes

_MAGIC = b"KVBTIER1"
_HEADER = struct.Struct("<8sqqI")  # magic, slot, payload bytes, crc32
# Tests: a path; a write then stops halfway through its temporary file, creates this
# path and waits to be killed (tests/backends/test_tier_storage.py kills it with SIGKILL there).
PAUSE_ENV = "KVBENCH_TEST_DISK_PAUSE"


# A disk tier's folder holds this file from its creation: "kvbench disk tier, pid <pid>".
MARKER = "KVBENCH_DISK_TIER"
MARKER_TEXT = "kvbench disk tier, pid "
# A file checked whole is read again when it changes (inode, size, mtime), or while its
# mtime is this recent: a change within the filesystem's timestamp resolution (1-2 s on
# some) would leave the three as they were.
_RACY_NS = 2_000_000_000


def file_size(payload: int) -> int:
    """The bytes of one block file of ``payload`` bytes: its header, then the payload."""
    return _HEADER.size + payload


def file_bytes(payload: int, where: str | os.PathLike[str]) -> int:
    """What one block file of ``payload`` bytes takes on the filesystem holding ``where``
    (an existing path): :func:`file_size` rounded up to its allocation unit (an 8 KiB
    block took a 12 KiB file in 4 KiB units)."""
    try:
        st = os.statvfs(where)
        unit = st.f_frsize or st.f_bsize or 4096
    except OSError:
        unit = 4096
    return -(-file_size(payload) // unit) * unit


def check_room(parent: str | None, num_blocks: int, payload: int, size: str) -> None:
    """A disk tier of ``num_blocks`` blocks of ``payload`` bytes (``cache.tiers.disk=
    size``) fits under ``parent`` (None: the temp folder): each block file whole under
    this process's file-size limit (``ulimit -f``), and the files as the filesystem
    stores them (:func:`file_bytes`; one more while a slot is rewritten, and the marker)
    in its free space. UserError, saying what to change, if not."""
    one = file_size(payload)
    limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limit != resource.RLIM_INFINITY and one > limit:
        raise UserError(f"cache.tiers.disk={size}: one block file is {format_bytes(one)}, "
                        f"over this process's file-size limit ({format_bytes(limit)}, "
                        "`ulimit -f`): raise it (`ulimit -f unlimited`) or drop "
                        "cache.tiers.disk")
    where = Path(parent or tempfile.gettempdir())
    probe = next((p for p in (where, *where.parents) if p.exists()), Path("/"))
    each = file_bytes(payload, probe)
    need = (num_blocks + 2) * each
    left = shutil.disk_usage(probe).free
    if need > left:
        raise UserError(f"cache.tiers.disk={size} needs {format_bytes(need)} on {probe} "
                        f"({num_blocks} block files of {format_bytes(each)} as the "
                        f"filesystem stores them: {format_bytes(payload)} of K/V and a "
                        f"header each), which has {format_bytes(left)} free: lower "
                        "cache.tiers.disk or set cache.tiers.disk_dir to a larger disk")


def _write_all(f: BinaryIO, chunks: Iterable[bytes]) -> None:
    """Write ``chunks`` to ``f`` (tests: a disk that fills up halfway)."""
    for c in chunks:
        f.write(c)


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
        # Python ignores SIGXFSZ from its start, so a write past a file-size limit raises
        # EFBIG instead of killing the run: keep it so if something set it back.
        xfsz = getattr(signal, "SIGXFSZ", None)
        if xfsz is not None and signal.getsignal(xfsz) == signal.SIG_DFL:
            with contextlib.suppress(ValueError):  # (settable from the main thread only)
                signal.signal(xfsz, signal.SIG_IGN)
        self._whole: dict[int, tuple[int, int, int]] = {}  # slot -> its file checked whole
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
        """Store ``payload`` as slot ``slot``'s block. An OSError (a full disk, a
        file-size limit) is raised after removing the partial file and the slot's old
        one: the slot then holds nothing, never a stale block."""
        assert 0 <= slot < self.num_blocks
        header = _HEADER.pack(_MAGIC, slot, len(payload), zlib.crc32(payload))
        tmp = self.dir / f"{slot}.tmp"
        pause = os.environ.get(PAUSE_ENV)
        self._whole.pop(slot, None)
        try:
            with open(tmp, "wb") as f:
                if pause:  # tests: die halfway through a write
                    f.write(header)
                    f.write(payload[:len(payload) // 2])
                    f.flush()
                    Path(pause).touch()
                    while True:
                        time.sleep(3600)
                _write_all(f, (header, payload))
            os.replace(tmp, self.path(slot))  # atomic: the slot's file is whole or absent
        except OSError:
            for p in (tmp, self.path(slot)):
                p.unlink(missing_ok=True)
            raise

    def check(self, slot: int) -> str | None:
        """None when slot ``slot``'s file holds a whole block (read back, its header and
        checksum checked; again only once the file changed), else what is wrong."""
        p = self.path(slot)
        try:
            st = os.stat(p)
        except OSError as e:
            return f"disk tier slot {slot}: {p} cannot be read ({e.strerror or e})"
        sig = (st.st_ino, st.st_size, st.st_mtime_ns)
        if self._whole.get(slot) == sig:
            return None
        try:
            self.read(slot)
        except CorruptBlock as e:
            return str(e)
        if time.time_ns() - st.st_mtime_ns > _RACY_NS:
            self._whole[slot] = sig
        return None

    def discard(self, slot: int) -> None:
        """Remove slot ``slot``'s file (a damaged block: never read again)."""
        self._whole.pop(slot, None)
        self.path(slot).unlink(missing_ok=True)

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
                               "checksum wrong)")
        return payload


class TierStorage:
    """Host tensors and the disk tier for ``tensors`` (each (num_blocks, ...) on the
    device); ``num_blocks``: the CPU tier's and (optionally) the disk tier's slots.
    ``tiers``: their bookkeeping, told of the disk tier's faults (module docstring)."""

    def __init__(self, tensors: list[torch.Tensor], num_blocks: list[int],
                 disk_dir: str | None = None, tiers: LowerTiers | None = None) -> None:
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
        self.tiers = tiers
        self._lost: dict[int, bool] = {}  # disk slots written this step: the last write failed
        # Blocks this step writes to disk and loads back later in the same step (spilled
        # and hit in one step, a lookup that did not check their files: LowerTiers), by
        # slot: the load reads the bytes written (landed or not), never the file.
        self._reloaded: set[int] = set()
        self._step_bytes: dict[int, bytes] = {}
        self._warned: set[str] = set()  # the faults said on stderr (once each per run)
        if tiers is not None and self.disk is not None:
            tiers.check_disk = self._disk_whole

    def apply(self, ops: list[TierOp]) -> None:
        """Perform ``ops`` in order (spills before the writes that reuse their slots)."""
        if not ops:
            return
        t0 = time.perf_counter()
        if self.disk is not None:
            self._reloaded = {op.src for op in ops if op.src_tier == DISK}
        for op in ops:
            self._one(op)
        if self.tensors[0].is_cuda:
            torch.cuda.synchronize(self.tensors[0].device)
        self.transfer_s += time.perf_counter() - t0
        self.bytes_moved += len(ops) * self.block_bytes
        if self._lost:
            # A slot's last write decides what it holds after the step (the bookkeeping's
            # state): drop the blocks whose last write failed.
            for slot, lost in self._lost.items():
                if lost and self.tiers is not None:
                    self.tiers.lose(DISK, slot)
            self._lost = {}
        self._step_bytes = {}

    def _one(self, op: TierOp) -> None:
        src, dst = op.src, op.dst
        if op.src_tier == GPU and op.dst_tier == CPU:
            for t, h in zip(self.tensors, self.host):
                h[dst].copy_(t[src])
        elif op.src_tier == CPU and op.dst_tier == DISK:
            assert self.disk is not None
            payload = self._pack([h[src] for h in self.host])
            if dst in self._reloaded:
                self._step_bytes[dst] = payload
            try:
                self.disk.write(dst, payload)
                self._lost[dst] = False
            except OSError as e:
                self._lost[dst] = True
                self._warn("write", f"writing a block to {self.disk.path(dst)} failed "
                           f"({e.strerror or e}): blocks that cannot be written are dropped "
                           "from the disk tier and computed again when needed (counted in "
                           "cache.tier.disk.write_failures)")
        elif op.dst_tier == GPU:
            if self.poison_loads:
                for t in self.tensors:
                    t[dst] = garbage(t[dst])
            if op.src_tier == CPU:
                for t, h in zip(self.tensors, self.host):
                    t[dst].copy_(h[src], non_blocking=True)
            else:
                assert self.disk is not None and op.src_tier == DISK
                try:
                    written = self._step_bytes.get(src)
                    payload = self.disk.read(src) if written is None else written
                except CorruptBlock as e:
                    raise CorruptBlock(f"{e}, after the lookup that found it checked it "
                                       "whole: the run stops rather than load a wrong "
                                       "block") from None
                for t, row in zip(self.tensors, self._unpack(payload)):
                    t[dst].copy_(row)
        else:
            raise AssertionError(f"no such tier move: {op}")

    def _disk_whole(self, slot: int) -> bool:
        """Whether disk slot ``slot`` holds a whole block (LowerTiers.check_disk): a
        damaged file is removed, and said once."""
        assert self.disk is not None
        why = self.disk.check(slot)
        if why is None:
            return True
        self.disk.discard(slot)
        self._warn("damaged", f"{why}: damaged blocks are dropped from the disk tier and "
                   "computed again (counted in cache.tier.disk.damaged_blocks)")
        return False

    def _warn(self, kind: str, text: str) -> None:
        """Say ``text`` on stderr, the first time a fault of ``kind`` happens."""
        if kind not in self._warned:
            self._warned.add(kind)
            print(f"kvbench: warning: disk tier: {text}; later ones are not reported",
                  file=sys.stderr)

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
