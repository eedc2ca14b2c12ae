"""Compression across turns (issue #59): every compress-once method on
``workload=shared_context`` with its compressed prefixes reused (``cache.enable_prefix_caching
=true``) and re-applied per turn (``=false``), h2o and tova (re-scored every step: never
reused), and the exact reference (paged, prefix caching on and off), on the default model.

    .venv/bin/python scripts/across_turns_table.py [--out results/across_turns] [--only a,b]

Each run writes a run folder ``OUT/<backend>-<reuse|reapplied>/`` (one already there is
read, not run again) and the script prints one markdown table: accuracy per turn
(``quality.turn.<k>.accuracy``), prefix-cache hit rate per turn (``cache.turn.<k>.hit_rate``),
the prompt tokens prefilled, the KV bytes a decode token reads (what the sequences held
while answering) and the KV bytes used at the peak. The workload: 8 contexts of
1,024 tokens (RULER's noise haystack, SmolLM2-135M's tokenizer), 4 turns each, greedy;
1 GiB of KV cache (room for every conversation's history: the per-head presses' kept
pages, counted used, fill it and the oldest go); every method keeps a quarter
(``OPTIONS``), duo_attention at its defaults.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORKLOAD = ["workload=shared_context", "workload.contexts=8", "workload.turns=4",
            "workload.length=1024", "workload.haystack=noise",
            "quality.generation_agreement=false", "cache.kv_budget=1GiB", "seed=0"]
REUSED = ["snapkv", "knorm", "pyramidkv", "adakv", "duo_attention", "keydiff",
          "expected_attention", "observed_attention"]
RUNS = [("paged", True), ("paged", False),
        *[(b, reuse) for b in REUSED for reuse in (True, False)],
        ("h2o", True), ("tova", True)]
# A quarter: each method keeps a quarter of a prompt (snapkv: besides its 32-token window;
# h2o and tova: of prompt + answer); duo_attention at its defaults (half the heads stream,
# keeping 128 sinks + 256 recent: 69% of a 1,024-token prompt). On the essay haystack
# SmolLM2-135M lost the first turn's needle already, even keeping half (snapkv 0/8 and
# knorm 0/8 at turn 0, paged 7/8): the noise haystack's needles survive compression, so
# what the turns after it lose is the reuse's.
OPTIONS = {b: ["backend.budget_ratio=0.25"] for b in [*REUSED, "h2o", "tova"]
           if b != "duo_attention"}


def folder(out: Path, backend: str, reuse: bool) -> Path:
    return out / f"{backend}-{'reuse' if reuse else 'reapplied'}"


def metrics(out: Path, backend: str, reuse: bool) -> dict[str, object]:
    from omegaconf import OmegaConf

    from harness.runner import run
    from tests.compose import compose_cfg

    d = folder(out, backend, reuse)
    cfg = compose_cfg([*WORKLOAD, f"backend={backend}", *OPTIONS.get(backend, []),
                       f"cache.enable_prefix_caching={str(reuse).lower()}"], out_dir=d)
    if (d / "metrics.json").is_file():  # a run already there must be this one
        old = OmegaConf.load(d / "config.yaml")
        for part in ("backend", "workload", "cache"):
            if old[part] != cfg[part]:
                raise SystemExit(f"{d} holds another run ({part} differs): remove it")
    else:
        run(cfg)
    m: dict[str, object] = json.loads((d / "metrics.json").read_text())
    return m


def row(backend: str, reuse: bool, m: dict[str, object], turns: int) -> str:
    def f(key: str) -> float:
        return float(m[key])  # type: ignore[arg-type]

    mode = ("reused" if m["run.prefix_caching"] else "no prefix cache") if reuse \
        else "re-applied" if backend != "paged" else "no prefix cache"
    acc = " | ".join(f"{f(f'quality.turn.{k}.accuracy'):.2f}" for k in range(turns))
    hit = " | ".join(f"{f(f'cache.turn.{k}.hit_rate'):.2f}" for k in range(1, turns))
    return (f"| {backend} | {mode} | {acc} | {f('quality.task_accuracy'):.2f} | {hit} | "
            f"{f('cache.prefill_tokens_computed') / 1000:.1f}k | "
            f"{f('attention.kv_read_bytes_per_token') / 2**20:.1f} | "
            f"{f('memory.peak_used_bytes') / 2**20:.0f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "across_turns")
    ap.add_argument("--only", default="", help="comma-separated backends")
    a = ap.parse_args()
    turns = 4
    print("| backend | prefix | " + " | ".join(f"acc. turn {k}" for k in range(turns))
          + " | acc. all | " + " | ".join(f"hit turn {k}" for k in range(1, turns))
          + " | prefilled tokens | KV read / decode token (MiB) | peak KV used (MiB) |")
    print("|---|---|" + "---|" * (2 * turns + 3))
    for backend, reuse in RUNS:
        if a.only and backend not in a.only.split(","):
            continue
        print(row(backend, reuse, metrics(a.out, backend, reuse), turns), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
