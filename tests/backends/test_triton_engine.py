"""The engine on the Triton kernels (the interpreter on CPU) gives the torch path's tokens."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from harness.backends.base import KVLayout
from harness.backends.paged import PagedBackend
from harness.runner import run
from tests.compose import tiny

pytest.importorskip("triton")


def test_triton_kernels_produce_the_torch_tokens() -> None:
    # Two turns: turn 2 hits the prefix cache, so prefills extend a cached prefix; the
    # step mixes decodes with prefill chunks.
    common = ("backend=paged", "workload.conversations=2", "backend.block_size=8")
    ref = run(tiny(*common, "backend.kernel=torch"))
    tri = run(tiny(*common, "backend.kernel=triton"))
    assert tri.metrics["run.kernel"] == "triton" and ref.metrics["run.kernel"] == "torch"
    assert tri.outputs == ref.outputs
    assert all(len(v) > 0 for v in tri.outputs.values())
    assert tri.metrics["cache.prefill_tokens_saved"] > 0


_MAKE = """
import torch
from harness.backends.base import KVLayout
from harness.backends.paged import PagedBackend
b = PagedBackend(KVLayout(1, 1, 16, torch.float32), torch.device("cpu"), kernel="{kernel}")
import os
print(b.kernel, os.environ.get("TRITON_INTERPRET"))
"""


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env},
                          capture_output=True, text=True, timeout=120)


def test_kernel_triton_on_cpu_switches_the_interpreter_on_or_says_how() -> None:
    # Triton not imported yet: the backend turns the interpreter on itself.
    r = _python(_MAKE.format(kernel="triton"), {})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["triton", "1"]
    # Imported without it: too late to switch, the error says what to set.
    r = _python("import triton\n" + _MAKE.format(kernel="triton"), {"TRITON_INTERPRET": "0"})
    assert r.returncode != 0 and "set TRITON_INTERPRET=1" in r.stderr


def test_kernel_auto_on_cpu_stays_torch() -> None:
    # The interpreter is a correctness tool, never picked automatically.
    b = PagedBackend(KVLayout(1, 1, 16, torch.float32), torch.device("cpu"), kernel="auto")
    assert b.kernel == "torch"
