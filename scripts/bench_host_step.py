"""What the engine does on the host in a decode step, per backend: syncs, ops, Triton
launches (counted) and seconds (timed), on a 30-layer tiny model where the arithmetic is
negligible, so what is left is the engine's own per-step and per-layer work.

    .venv/bin/python scripts/bench_host_step.py                       # the default matrix
    .venv/bin/python scripts/bench_host_step.py --backends paged,fp8 --kernels torch
    .venv/bin/python scripts/bench_host_step.py --out docs/results/host_step.json

Each backend runs one workload: ``--batch`` requests of ``--prompt`` tokens arriving at
once, each decoding ``--output`` tokens (EOS ignored), so most steps decode the whole batch.
Counts come from a run under :class:`harness.engine.host_syncs.HostSyncCounter` (a
dispatch mode; syncs are what a CUDA device would wait for); seconds from a second,
unpatched run (the median decode step). ``kernel=triton`` runs the Triton kernels under
the interpreter: counted with every launch stubbed to the real kernel with counting paused,
never timed (the interpreter's seconds say nothing about a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# --code DIR measures another checkout (a snapshot of an older commit, as
# scripts/records_equal.py makes): its harness is imported, this checkout's counter.
_code = sys.argv[sys.argv.index("--code") + 1] if "--code" in sys.argv else str(ROOT)
sys.path.insert(0, _code)


def _counter_module() -> Any:
    """harness.engine.host_syncs of this checkout, whichever harness is imported."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "kvbench_host_syncs", ROOT / "harness" / "engine" / "host_syncs.py")
    assert spec is not None and spec.loader is not None
    if spec.name in sys.modules:
        return sys.modules[spec.name]
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod

# Every backend but flex (compiled by torch.compile, which a dispatch mode cannot watch)
# and flash_attn (CUDA only).
DEFAULT = ("paged,contiguous,fp8,int8,sliding_window,streaming_llm,h2o,tova,snapkv,knorm,"
           "keydiff,observed_attention,expected_attention,quest,kivi,pyramidkv,adakv,"
           "duo_attention")
# The per-head presses compress a prompt only past their window (64) or sinks + recent
# (128 + 256): on the short prompts of the sync test (--prompt 64 or fewer) they get
# windows that fit, so their decodes read compressed per-head tables.
SHORT_PROMPT_OPTIONS = {
    "pyramidkv": ["backend.window=8"],
    "adakv": ["backend.window=8"],
    "duo_attention": ["backend.sink_tokens=4", "backend.recent=8",
                      "backend.calibration_tokens=64"],
}
TRITON = ("paged", "fp8", "int8", "sliding_window", "streaming_llm", "quest", "kivi", "h2o", "tova",
          "snapkv", "knorm", "keydiff", "observed_attention", "expected_attention")


def has_kernel_option(backend: str) -> bool:
    """Whether ``backend`` takes ``backend.kernel`` (every method does since issue #56;
    contiguous, flex and flash_attn do not)."""
    import dataclasses

    from harness.backends import get_backend

    fields = {f.name for f in dataclasses.fields(get_backend(backend).Options)}
    return "kernel" in fields


def overrides(backend: str, kernel: str, a: argparse.Namespace) -> list[str]:
    from harness.gpucheck.profile import fixed_lengths  # (the GPU check's engine workload)

    o = [f"backend={backend}", "model=tiny", f"model.source={a.model}",
         *fixed_lengths(a.batch, a.prompt, a.output), "device=cpu", "cache.kv_budget=64MiB",
         f"scheduler.max_num_seqs={a.batch}", "scheduler.max_model_len=2048"]
    if kernel != "default" and has_kernel_option(backend):
        o.append(f"backend.kernel={kernel}")
    if a.prompt <= 64:
        o += SHORT_PROMPT_OPTIONS.get(backend, [])
    return o


def measure(backend: str, kernel: str, a: argparse.Namespace) -> dict[str, Any]:
    from harness.runner import run
    from tests.compose import compose_cfg

    profile_steps = _counter_module().profile_steps
    cfg = compose_cfg(overrides(backend, kernel, a))
    triton = kernel == "triton"
    with profile_steps(count=True, launches=triton) as counted:
        run(cfg)
    row: dict[str, Any] = {
        "backend": backend, "kernel": kernel,
        "decode_steps": len(counted.decode_steps()),
        "syncs_per_decode_step": round(counted.per_decode_step("syncs"), 3),
        "max_syncs_decode_step": max(s.syncs for s in counted.decode_steps()),
        "syncs_per_step": round(sum(s.syncs for s in counted.steps) / len(counted.steps), 3),
        "run_syncs_per_decode_step": round(counted.run_syncs_per_decode_step(), 3),
        "ops_per_decode_step": round(counted.per_decode_step("ops"), 1),
        "launches_per_decode_step": round(counted.per_decode_step("launches"), 1),
        "sync_causes": dict(counted.causes.most_common(8)),
    }
    if not triton and a.time:
        with profile_steps(count=False) as timed:
            run(cfg)
        secs = [s.seconds for s in timed.decode_steps()]
        row["decode_step_ms_median"] = round(1e3 * statistics.median(secs), 3)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default=DEFAULT)
    p.add_argument("--kernels", default="torch,triton",
                   help="torch, triton (interpreted; counts only) or default, comma-separated")
    p.add_argument("--model", default="tiny-deep")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--output", type=int, default=24)
    p.add_argument("--no-time", dest="time", action="store_false",
                   help="counts only (no second, timed run)")
    p.add_argument("--code", default=None, help="measure this checkout instead (a folder)")
    p.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    a = p.parse_args()
    if "triton" in a.kernels.split(","):  # read once, at triton's first import
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    torch.set_num_threads(1)
    rows = []
    for kernel in a.kernels.split(","):
        for backend in a.backends.split(","):
            if kernel == "triton" and backend not in TRITON:
                continue
            row = measure(backend, kernel, a)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
