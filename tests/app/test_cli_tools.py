"""The small command-line tools answer bad arguments with one clear line and exit 2, no
traceback (issue #55's rows for trace_synth and cluster_table)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args,phrase", [
    (["-m", "harness.workloads.trace_synth", "{tmp}/nope/x.jsonl", "--rows", "3"],
     "does not exist: create it"),
    (["-m", "harness.workloads.trace_synth", "{tmp}", "--rows", "3"],
     "is a folder: give the trace file's path"),
    (["-m", "harness.workloads.trace_synth", "{tmp}/t.jsonl", "--input-median", "inf"],
     "all finite"),
    (["-m", "harness.workloads.trace_synth", "{tmp}/t.jsonl", "--rate", "nan"],
     "all finite"),
    ([str(ROOT / "scripts" / "cluster_table.py"), "{tmp}/no-such-sweep"],
     "no such folder"),
])
def test_bad_arguments_get_one_line(args: list[str], phrase: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, *(a.format(tmp=tmp_path) for a in args)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert phrase in done.stderr and "Traceback" not in done.stderr


def test_trace_synth_writes_what_it_was_asked(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    done = subprocess.run([sys.executable, "-m", "harness.workloads.trace_synth", str(out),
                           "--rows", "5"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert len(out.read_text().splitlines()) == 5


@pytest.mark.parametrize("arg,code", [("--help", 0), ("-h", 0), ("--bogus", 2)])
def test_peer_kvpress_answers_help_without_installing_anything(arg: str, code: int,
                                                               tmp_path: Path) -> None:
    """Issue #55: --help built a 1.4 GB venv and ran `mkdir -p --help`."""
    done = subprocess.run(["bash", str(ROOT / "scripts" / "peer_kvpress.sh"), arg],
                          capture_output=True, text=True, cwd=tmp_path, timeout=30)
    assert done.returncode == code, done.stderr
    text = done.stdout + done.stderr
    assert ("usage" in text.lower() or "scripts/peer_kvpress.sh [OUT_DIR]" in text)
    assert "mkdir" not in text and not (tmp_path / arg).exists()
