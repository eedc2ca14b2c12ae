"""The bytes of the lower tiers: host tensors and the disk tier's files. Round trips
through both, a damaged file refused, and a run killed (SIGKILL) halfway through a disk
write: the next run that opens the same folder removes what it left, unread. The disk
tier's faults mid-run (issue #55): a full disk (ENOSPC) or a file-size limit (EFBIG, a
real ulimit) drops the block and the run goes on; a damaged block is dropped at its
lookup (missed, so computed again); the space check counts files as the disk stores them.
A user's run-* folders and files under disk_dir are never removed (the data-loss case)."""

from __future__ import annotations

import errno
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import BinaryIO

import pytest
import torch

from harness.backends import tier_storage
from harness.backends.tier_storage import PAUSE_ENV, CorruptBlock, DiskTier, TierStorage
from harness.kv.tiers import CPU, DISK, GPU, LowerTiers, TierOp

ROOT = Path(__file__).resolve().parents[2]


def blocks(n: int = 6) -> list[torch.Tensor]:
    """Two layers' K and V (n blocks of 4 slots x 2 heads x 8) and 1-byte codes."""
    g = torch.Generator().manual_seed(0)
    fl = [torch.randn(n, 4, 2, 8, generator=g) for _ in range(4)]
    codes = torch.randint(0, 255, (n, 4, 2, 8), generator=g, dtype=torch.uint8)
    return [*fl, codes, torch.randn(n, 4, 2, generator=g).to(torch.float8_e4m3fn)]


def test_round_trip_gpu_cpu_disk_gpu(tmp_path: Path) -> None:
    ts = TierStorage(blocks(), [2, 3], str(tmp_path))
    want = [t[1].clone() for t in ts.tensors]
    ts.apply([TierOp(GPU, 1, CPU, 0), TierOp(CPU, 0, DISK, 2)])
    for t in ts.tensors:  # the device block is reused for something else
        t[1] = 0
    ts.poison_loads = True
    ts.apply([TierOp(DISK, 2, GPU, 4), TierOp(CPU, 0, GPU, 5)])
    for t, w in zip(ts.tensors, want):
        assert torch.equal(t[4].view(torch.uint8), w.view(torch.uint8))
        assert torch.equal(t[5].view(torch.uint8), w.view(torch.uint8))
    assert ts.bytes_moved == 4 * ts.block_bytes
    assert ts.block_bytes == sum(t[0].numel() * t.element_size() for t in ts.tensors)
    ts.close()
    assert not ts.disk or not ts.disk.dir.exists()


def test_damaged_files_are_refused(tmp_path: Path) -> None:
    ts = TierStorage(blocks(), [1, 2], str(tmp_path))
    ts.apply([TierOp(GPU, 0, CPU, 0), TierOp(CPU, 0, DISK, 0), TierOp(CPU, 0, DISK, 1)])
    assert ts.disk is not None
    p = ts.disk.path(0)
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit of K/V
    p.write_bytes(bytes(data))
    with pytest.raises(CorruptBlock, match="damaged"):
        ts.apply([TierOp(DISK, 0, GPU, 3)])
    q = ts.disk.path(1)
    q.write_bytes(q.read_bytes()[:50])  # cut short
    with pytest.raises(CorruptBlock, match=r"damaged|truncated"):
        ts.apply([TierOp(DISK, 1, GPU, 3)])
    os.replace(q, ts.disk.path(0))  # slot 1's file under slot 0's name
    with pytest.raises(CorruptBlock):
        ts.apply([TierOp(DISK, 0, GPU, 3)])


WRITER = """
import os, sys
from harness.backends.tier_storage import PAUSE_ENV, DiskTier
tier = DiskTier(sys.argv[1], 4)
tier.write(0, b"x" * 100_000)          # one whole block
print(tier.dir, flush=True)
os.environ[PAUSE_ENV] = sys.argv[2]
tier.write(1, b"y" * 100_000)          # stops halfway, then is killed
"""


def test_a_run_killed_during_a_disk_write_leaves_nothing_to_read(tmp_path: Path) -> None:
    marker = tmp_path / "paused"
    parent = tmp_path / "tier"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(PAUSE_ENV, None)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(parent), str(marker)], env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    dead_dir = Path(proc.stdout.readline().strip())  # written once block 0 is on disk
    deadline = time.monotonic() + 120
    while not marker.exists():  # the event: the second write is halfway
        assert proc.poll() is None, "the writer died before pausing"
        assert time.monotonic() < deadline, "the writer never reached its pause"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # What the killed run left: a whole block and half of another under a temporary name.
    assert (dead_dir / "0.kv").exists() and (dead_dir / "1.tmp").exists()
    assert not (dead_dir / "1.kv").exists()
    rerun = DiskTier(parent, 4)  # the next run on the same folder
    assert rerun.discarded == [dead_dir] and not dead_dir.exists()
    with pytest.raises(CorruptBlock, match="cannot be read"):
        rerun.read(0)  # a fresh run holds nothing: the old block is never returned
    rerun.write(0, b"z" * 10)
    assert rerun.read(0) == b"z" * 10
    rerun.close()
    assert not rerun.dir.exists()


def test_a_live_runs_folder_is_left_alone(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, 2)
    second = DiskTier(tmp_path, 2)  # same process (quality's stacks): both in use
    assert second.discarded == [] and first.dir.exists()
    first.close()
    second.close()


def test_a_disk_dir_that_cannot_be_written_says_so(tmp_path: Path) -> None:
    from harness.errors import UserError

    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    with pytest.raises(UserError, match=r"cache\.tiers\.disk_dir=.*give a writable folder"):
        DiskTier(a_file, 2)
    with pytest.raises(UserError, match="give a writable folder"):
        DiskTier(a_file / "below", 2)


def test_a_users_run_folders_under_disk_dir_are_never_removed(tmp_path: Path) -> None:
    """Only what a disk tier made (its marker inside) is cleaned: a user's own run-*
    folders and files under cache.tiers.disk_dir survive with their contents, also a
    folder whose OWNER names a dead pid (the old rule removed it) and a link."""
    from harness.backends.tier_storage import MARKER

    mine = tmp_path / "run-results"
    mine.mkdir()
    (mine / "data.csv").write_text("keep me")
    dead = tmp_path / "run-99999999-abc"  # looks like a tier's, is not marked
    dead.mkdir()
    (dead / "OWNER").write_text("99999999\n")
    (tmp_path / "run-notes.txt").write_text("a file")
    forged = tmp_path / "run-1-x"
    forged.mkdir()
    (forged / MARKER).write_text("something else\n")
    (tmp_path / "run-link").symlink_to(mine)
    stale = tmp_path / "run-2-y"  # a real tier's folder of a dead run: removed
    stale.mkdir()
    (stale / MARKER).write_text("kvbench disk tier, pid 99999998\n")
    (stale / "0.kv").write_bytes(b"x")
    tier = DiskTier(tmp_path, 2)
    assert tier.discarded == [stale] and not stale.exists()
    assert (mine / "data.csv").read_text() == "keep me"
    assert (dead / "OWNER").exists() and (forged / MARKER).exists()
    assert (tmp_path / "run-notes.txt").read_text() == "a file"
    assert (tmp_path / "run-link").is_symlink()
    assert (tier.dir / MARKER).read_text().startswith("kvbench disk tier, pid ")
    tier.close()
    assert not tier.dir.exists() and mine.exists()


# -- faults mid-run and the space check (issue #55) ----------------------------------------


def _disk(tmp_path: Path) -> tuple[LowerTiers, TierStorage]:
    """A CPU tier of one slot over a disk tier of two, bookkeeping and bytes."""
    lt = LowerTiers([1, 2], 4)
    return lt, TierStorage(blocks(), [1, 2], str(tmp_path), lt)


def _spill(lt: LowerTiers, ts: TierStorage, *names: int) -> None:
    """Store device blocks 0, 1, ... as ``names``, a step each: each after the first
    spills the one before it to disk."""
    for b, h in enumerate(names):
        lt.store(b, h, owner=1)
        ts.apply(lt.take_ops())


def fill_disk(monkeypatch: pytest.MonkeyPatch, err: int = errno.ENOSPC) -> None:
    """Every block file's write stops halfway, on an OSError ``err`` (a full disk)."""
    def half(f: BinaryIO, chunks: Iterable[bytes]) -> None:
        f.write(b"".join(chunks)[:20])
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(tier_storage, "_write_all", half)


def test_a_full_disk_drops_the_block_and_the_run_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    lt, ts = _disk(tmp_path)
    assert ts.disk is not None
    fill_disk(monkeypatch)
    _spill(lt, ts, 100, 200)  # 100's spill to disk slot 0 fails halfway
    assert lt.find(100) is None and lt.tier(DISK).num_used == 0
    assert lt.stats.disk_write_failures == 1 and lt.stats.blocks_down == [2, 0]
    assert list(ts.disk.dir.glob("0.*")) == []  # no partial file, no stale one
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "No space left on device" in err
    assert "cache.tier.disk.write_failures" in err
    _spill(lt, ts, 300)  # 200's spill, into the slot 100 left: fails, counted, not said
    assert lt.stats.disk_write_failures == 2 and capsys.readouterr().err == ""
    monkeypatch.undo()  # room again: the next spill lands, and loads back whole
    want = [t[0].clone() for t in ts.tensors]
    _spill(lt, ts, 400)
    hit = lt.lookup(300)
    assert hit is not None and hit.tier == DISK
    lt.pin([hit])
    lt.load(hit, 5)
    ts.apply(lt.take_ops())
    for t, w in zip(ts.tensors, want):
        assert torch.equal(t[5].view(torch.uint8), w.view(torch.uint8))
    ts.close()


FSIZE = """
import resource, signal, sys
import torch
from harness.backends.tier_storage import TierStorage
from harness.kv.tiers import LowerTiers
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # (as a library might set it: it kills)
lt = LowerTiers([1, 2], 4)
ts = TierStorage([torch.zeros(3, 1024)], [1, 2], sys.argv[1], lt)  # 4 KiB blocks
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
for b, h in enumerate((100, 200)):  # 100's file (a header + 4 KiB) is past the limit
    lt.store(b, h, owner=1)
    ts.apply(lt.take_ops())
print(lt.stats.disk_write_failures, lt.find(100), lt.find(200) is not None)
"""


def test_a_file_size_limit_drops_the_block_and_the_run_goes_on(tmp_path: Path) -> None:
    """A real RLIMIT_FSIZE (ulimit -f): the write fails with EFBIG (SIGXFSZ ignored,
    even when something set it back to its default, which kills), the block is dropped."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", FSIZE, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "None", "True"]
    assert "File too large" in out.stderr


def test_a_damaged_block_is_dropped_at_its_lookup_and_missed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lt, ts = _disk(tmp_path)
    assert ts.disk is not None
    _spill(lt, ts, 100, 200, 300)  # 100 and 200 on disk (slots 0, 1)
    p = ts.disk.path(0)
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit of K/V
    p.write_bytes(bytes(data))
    assert lt.lookup(100) is None  # a miss: the prompt computes the block again
    assert lt.stats.disk_damaged == 1 and lt.find(100) is None and not p.exists()
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "is damaged" in err
    assert "cache.tier.disk.damaged_blocks" in err
    # A file checked whole is read again only once it changed, and then found out.
    q = ts.disk.path(1)
    os.utime(q, (time.time() - 60, time.time() - 60))  # (an old file: its check is kept)
    assert lt.lookup(200) is not None and lt.lookup(200) is not None
    with q.open("r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\0" if q.read_bytes()[-1:] != b"\0" else b"\1")
    assert lt.lookup(200) is None and lt.stats.disk_damaged == 2
    assert capsys.readouterr().err == ""  # said once
    assert lt.tier(DISK).num_used == 0 and sorted(lt.tier(DISK).spare) == [0, 1]
    ts.close()


def test_the_space_check_counts_block_files_as_the_filesystem_stores_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """8 KiB blocks take 12 KiB files (a header, in 4 KiB units): a disk tier of 1000
    of them on a disk with 10 MiB free does not fit, though its payload (7.8 MiB) would."""
    from harness.backends.tier_storage import file_bytes
    from harness.config import CacheSpec, TierSpec
    from harness.errors import UserError
    from harness.stack import check_tier_space

    tier = DiskTier(tmp_path, 1)
    tier.write(0, b"x" * 8192)
    on_disk = os.stat(tier.path(0)).st_blocks * 512
    assert on_disk > 8192 and file_bytes(8192, tmp_path) >= on_disk
    tier.close()
    cache = CacheSpec(tiers=TierSpec(cpu="8KiB", disk="8000KiB", disk_dir=str(tmp_path)))
    sizing = SimpleNamespace(block_bytes=8192, num_blocks=4, num_cpu_blocks=0)
    unit = file_bytes(8192, tmp_path) - 8192  # (what a header costs here: a unit)

    def free(mib: float) -> None:
        usage = SimpleNamespace(total=1 << 40, used=0, free=int(mib * 2 ** 20))
        monkeypatch.setattr(shutil, "disk_usage", lambda _: usage)

    free(10)
    with pytest.raises(UserError, match=r"needs .* \(1000 block files of .* as the "
                                         r"filesystem stores them.*10\.00MiB free"):
        check_tier_space(cache, LowerTiers([1, 1000], 16), sizing,  # type: ignore[arg-type]
                         torch.device("cpu"))
    free(1002 * (8192 + unit) / 2 ** 20)
    check_tier_space(cache, LowerTiers([1, 1000], 16), sizing,  # type: ignore[arg-type]
                     torch.device("cpu"))
    # A file-size limit below one block file is said before the run, not at its writes.
    monkeypatch.setattr(resource, "getrlimit", lambda _: (8192, resource.RLIM_INFINITY))
    with pytest.raises(UserError, match=r"over this process's file-size limit .*ulimit -f"):
        check_tier_space(cache, LowerTiers([1, 1000], 16), sizing,  # type: ignore[arg-type]
                         torch.device("cpu"))


def test_a_block_spilled_and_loaded_in_one_step_loads_though_its_write_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's ops spill a block to disk (the write fails) and then load it back (a
    lookup in the same step found it there): the load reads the bytes that did not land,
    not a missing file."""
    ts = TierStorage(blocks(), [1, 2], str(tmp_path), LowerTiers([1, 2], 4))
    want = [t[1].clone() for t in ts.tensors]
    fill_disk(monkeypatch)
    ts.apply([TierOp(GPU, 1, CPU, 0), TierOp(CPU, 0, DISK, 1), TierOp(GPU, 2, CPU, 0),
              TierOp(DISK, 1, GPU, 4)])
    for t, w in zip(ts.tensors, want):
        assert torch.equal(t[4].view(torch.uint8), w.view(torch.uint8))
    assert ts.disk is not None and not ts.disk.path(1).exists()
    ts.close()
