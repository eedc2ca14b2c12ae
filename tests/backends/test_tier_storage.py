"""The bytes of the lower tiers: host tensors and the disk tier's files. Round trips
through both, a damaged file refused, and a run killed (SIGKILL) halfway through a disk
write: the next run that opens the same folder removes what it left, unread."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness.backends.tier_storage import PAUSE_ENV, CorruptBlock, DiskTier, TierStorage
from harness.kv.tiers import CPU, DISK, GPU, TierOp

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
