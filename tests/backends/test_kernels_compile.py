"""Every kernel variant compiles for an H100/H200 (sm_90) and keeps its registers: the one
check of the compiled path a CPU-only CI can make (the interpreter accepts ``tl.dot``
shapes and dtype mixes the GPU compiler refuses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@pytest.mark.skipif(not (_BIN / "ptxas").exists() or not (_BIN / "cuobjdump").exists(),
                    reason="triton's bundled ptxas / cuobjdump are missing")
def test_every_variant_compiles_for_sm90_without_spills() -> None:
    # A fresh process: this one runs triton in its interpreter (conftest).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    r = subprocess.run([sys.executable, "-m", "harness.kernels.compile_check", "--arch", "90"],
                       env=env, capture_output=True, text=True, timeout=300)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert rows, r.stderr[-3000:]
    failed = [x for x in rows if "error" in x]
    assert not failed, failed
    assert r.returncode == 0, r.stderr[-3000:]
    # Register spills to local memory would cost the decode kernel its bandwidth.
    assert all(x["stack_bytes"] == 0 for x in rows), rows
    assert {x["variant"].split("-")[0] for x in rows} == {"decode", "combine", "prefill",
                                                          "store", "quest", "kivi",
                                                          "scores"}
