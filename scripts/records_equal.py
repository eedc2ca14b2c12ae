"""Hold this checkout's records equal to another commit's, run for run.

    .venv/bin/python scripts/records_equal.py e82b94d              # the engine matrix
    .venv/bin/python scripts/records_equal.py e82b94d --matrix whatif   # scripts/records_equal.sh
    .venv/bin/python scripts/records_equal.py e82b94d --only paged,fp8 --keep /tmp/eq

Runs every configuration of the matrix twice, from a snapshot of REV (``git archive``,
backends/ and kernels/ placed under harness/ as the installed package maps them) and from
this working tree, each side in one process, then compares what each run wrote:
steps.csv and requests.csv row for row, metrics.json key for key, all but the wall-clock
fields (WALL_*). Exit 0 when every record is equal, 1 with the first differences otherwise.

The engine matrix (``executor=model``, the tiny models on the CPU, ``backend.kernel=torch``
where a backend has the option): every backend, the sampling, forking and beam paths,
swap preemption, chunked prefill, tiers, KV cache groups and quality scoring, each under
memory pressure so that admission, preemption and eviction act. Arrivals are at t = 0 or
follow an answer at once, so no wall-clock time can change a schedule.

The what-if matrix (``executor=roofline``: modelled time, so every column is compared but
the engine's own CPU seconds): the 13 runs of docs/whatif_scale.md, the fast path on and
the paths it leaves to stepping one by one.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Columns and keys that are times on the wall clock (or name the code): never compared.
WALL_STEPS = {"time_s", "step_ms", "forward_ms", "overhead_ms"}
# (arrival_s: a follow-up turn arrives when its answer is done, on the clock)
WALL_REQUESTS = {"arrival_s", "ttft_ms", "tpot_ms", "itl_ms_max", "e2e_ms"}
WALL_PREFIXES = ("latency.", "throughput.", "engine.", "goodput.")
WALL_KEYS = {"run.git_sha", "run.started_at"}

_BASE = ["model=tiny", "device=cpu", "cpu_threads=1", "cache.kv_budget=1536KiB",
         "scheduler.max_model_len=2048"]
_MT = ["workload=multiturn", "workload.conversations=4", "workload.turns=2",
       "workload.answer_tokens=24"]
_T = ["backend.kernel=torch"]

ENGINE: dict[str, list[str]] = {
    "paged": [*_MT, "backend=paged", *_T],
    "paged_bs8": [*_MT, "backend=paged", *_T, "backend.block_size=8"],
    "contiguous": [*_MT, "backend=contiguous"],
    "contiguous_pow2": ["workload=shared_prefix", "backend=contiguous",
                        "backend.reserve=pow2"],
    "fp8": [*_MT, "backend=fp8", *_T],
    "int8": [*_MT, "backend=int8", *_T],
    "int8_sinks": [*_MT, "backend=int8", *_T, "backend.sink_tokens=4"],
    "sliding_window": [*_MT, "backend=sliding_window", *_T, "backend.window=64"],
    "streaming_llm": [*_MT, "backend=streaming_llm", *_T, "backend.window=48"],
    "h2o": [*_MT, "backend=h2o"],
    "tova": [*_MT, "backend=tova"],
    "snapkv": [*_MT, "backend=snapkv"],
    "knorm": [*_MT, "backend=knorm"],
    "keydiff": [*_MT, "backend=keydiff"],
    "observed_attention": [*_MT, "backend=observed_attention"],
    "expected_attention": [*_MT, "backend=expected_attention"],
    "quest": [*_MT, "backend=quest"],
    "kivi": [*_MT, "backend=kivi"],
    "flex": [*_MT, "backend=flex"],
    "sampling": [*_MT, "backend=paged", *_T, "workload.temperature=0.8",
                 "workload.top_p=0.9"],
    "parallel_sampling": ["workload=parallel_sampling", "backend=paged", *_T],
    "beam_search": ["workload=beam_search", "backend=paged", *_T],
    "long_prompt": ["workload=long_prompt", "backend=paged", *_T, "cache.kv_budget=4MiB"],
    "swap": [*_MT, "backend=paged", *_T, "scheduler.preemption_mode=swap",
             "cache.swap_space=1MiB"],
    "tiers": [*_MT, "backend=paged", *_T, "cache.tiers.cpu=1MiB"],
    "h2o_quality": [*_MT, "backend=h2o", "quality.enabled=true"],
    "fp8_quality": [*_MT, "backend=fp8", *_T, "quality.enabled=true"],
    "gemma3_paged": [*_MT, "backend=paged", *_T, "model=tiny_gemma3", "cache.kv_budget=2MiB"],
    "gemma3_h2o": [*_MT, "backend=h2o", "model=tiny_gemma3", "cache.kv_budget=2MiB"],
}
# The what-if matrix (``executor=roofline``, Llama-3.1-8B on one H100; the 13 runs of
# docs/whatif_scale.md): the fast path (decode lanes) on every backend it takes, and the
# paths it leaves to stepping one by one, each under memory pressure.
_W = ["executor=roofline", "roofline.model=Llama-3.1-8B", "roofline.hardware=h100-sxm",
      "scheduler.max_num_seqs=64", "scheduler.max_num_batched_tokens=2048",
      "scheduler.max_model_len=4096", "cache.kv_budget=1GiB", "records.output_ids=true"]
_RND = ["workload=random", "workload.num_requests=500", "workload.rate=40",
        "workload.input_mean=400", "workload.input_std=300", "workload.input_max=2048",
        "workload.output_mean=200", "workload.output_std=150", "workload.output_max=1024"]
_WMT = ["workload=multiturn", "workload.conversations=24", "workload.turns=3",
        "workload.answer_tokens=96"]

WHATIF: dict[str, list[str]] = {
    "paged": [*_W, *_RND, "backend=paged"],
    "fp8_preempting": [*_W, *_RND, "backend=fp8", "cache.kv_budget=512MiB"],
    "swap": [*_W, *_RND, "backend=paged", "scheduler.preemption_mode=swap",
             "cache.swap_space=2GiB"],
    "contiguous_shared_prefix": [*_W, "workload=shared_prefix", "backend=contiguous"],
    "sliding_window": [*_W, *_WMT, "backend=sliding_window", "backend.window=256"],
    "h2o": [*_W, *_WMT, "backend=h2o"],
    "snapkv": [*_W, *_WMT, "backend=snapkv"],
    "kivi": [*_W, *_WMT, "backend=kivi"],
    "quest": [*_W, *_WMT, "backend=quest"],
    "parallel_sampling": [*_W, "workload=parallel_sampling", "backend=paged"],
    "beam_search": [*_W, "workload=beam_search", "backend=paged"],
    "temperature": [*_W, *_WMT, "backend=paged", "workload.temperature=0.7"],
    "tiers": [*_W, *_WMT, "backend=paged", "cache.kv_budget=512MiB", "cache.tiers.cpu=1GiB",
              "cache.tiers.disk=4GiB"],
}
MATRICES = {"engine": ENGINE, "whatif": WHATIF}
BASES = {"engine": _BASE, "whatif": []}


def run_side(matrix: str, names: list[str], out: Path) -> None:
    """Run ``names`` of ``matrix`` with whatever ``harness`` is importable (the caller's
    PYTHONPATH), each into ``out/<name>``."""
    import torch
    from omegaconf import open_dict

    from harness.config import compose_config
    from harness.runner import run

    torch.set_num_threads(1)
    for name in names:
        cfg = compose_config([*BASES[matrix], *MATRICES[matrix][name]])
        with open_dict(cfg):
            cfg.out_dir = str(out / name)
            cfg.progress = False
        run(cfg)
        print(f"  {name}: done", file=sys.stderr, flush=True)


def _rows(path: Path, skip: set[str]) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return [{k: v for k, v in r.items() if k not in skip} for r in csv.DictReader(f)]


def _metrics(path: Path) -> dict[str, object]:
    m = json.loads(path.read_text())
    return {k: v for k, v in m.items()
            if k not in WALL_KEYS and not k.startswith(WALL_PREFIXES)}


def compare(old: Path, new: Path, name: str) -> list[str]:
    """The differences between one run's records on both sides (empty: equal)."""
    a, b = old / name, new / name
    problems: list[str] = []
    for fname, skip in (("steps.csv", WALL_STEPS), ("requests.csv", WALL_REQUESTS)):
        ra, rb = _rows(a / fname, skip), _rows(b / fname, skip)
        if len(ra) != len(rb):
            problems.append(f"{name}/{fname}: {len(ra)} rows at REV, {len(rb)} here")
            continue
        for i, (x, y) in enumerate(zip(ra, rb, strict=True)):
            if x != y:
                diff = {k: (x.get(k), y.get(k)) for k in set(x) | set(y) if x.get(k) != y.get(k)}
                problems.append(f"{name}/{fname} row {i}: {dict(list(diff.items())[:4])}")
                break
    ma, mb = _metrics(a / "metrics.json"), _metrics(b / "metrics.json")
    # A key only this side has is an addition (DESIGN.md: add keys, never rename them),
    # listed apart; a key changed or gone is a difference.
    diff = {k: (ma.get(k), mb.get(k)) for k in ma if ma.get(k) != mb.get(k)}
    if diff:
        problems.append(f"{name}/metrics.json: {dict(sorted(diff.items())[:6])}")
    ADDED.update(set(mb) - set(ma))
    return problems


ADDED: set[str] = set()  # metrics keys this side added (compare() fills it)


def snapshot(rev: str, dest: Path) -> None:
    """``rev``'s tree at ``dest``, laid out as the installed package (scripts/snapshot_run.sh)."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    for pkg in ("backends", "kernels"):
        shutil.move(str(dest / pkg), str(dest / "harness" / pkg))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rev", nargs="?", help="the commit to compare with")
    p.add_argument("--matrix", default="engine", choices=sorted(MATRICES))
    p.add_argument("--only", default="", help="comma-separated run names (default: all)")
    p.add_argument("--keep", type=Path, default=None, help="work here and keep it")
    p.add_argument("--run-side", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    names = a.only.split(",") if a.only else list(MATRICES[a.matrix])
    unknown = [n for n in names if n not in MATRICES[a.matrix]]
    if unknown:
        p.error(f"unknown run(s) {unknown}; known: {', '.join(MATRICES[a.matrix])}")
    if a.run_side is not None:
        run_side(a.matrix, names, a.run_side)
        return 0
    if not a.rev:
        p.error("give the commit to compare with (e.g. e82b94d)")
    work = a.keep or Path(tempfile.mkdtemp(prefix="kvbench-records-equal-"))
    snap = work / "snapshot"
    if not (snap / "harness").exists():
        snapshot(a.rev, snap)
    py = str(ROOT / ".venv" / "bin" / "python")
    if not Path(py).exists():
        py = sys.executable
    for side, path in (("REV", snap), ("here", ROOT)):
        out = work / ("old" if side == "REV" else "new")
        shutil.rmtree(out, ignore_errors=True)
        print(f"{side}: {len(names)} runs into {out}", file=sys.stderr, flush=True)
        env = {**os.environ, "PYTHONPATH": str(path), "KVBENCH_CHECK": "0"}
        subprocess.run([py, str(Path(__file__).resolve()), "--matrix", a.matrix, "--only",
                        ",".join(names), "--run-side", str(out)], cwd=path, env=env,
                       check=True)
    problems = [x for n in names for x in compare(work / "old", work / "new", n)]
    for line in problems:
        print(line)
    if ADDED:
        print(f"metrics keys added here (not compared): {', '.join(sorted(ADDED))}")
    print(f"records_equal: {len(names) - len({x.split('/')[0] for x in problems})} of "
          f"{len(names)} runs equal to {a.rev} ({work})")
    if a.keep is None and not problems:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
