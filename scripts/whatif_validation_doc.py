"""docs/whatif_validation.md's tables from the rows ``python -m harness.roofline_tools.validate
--out rows.json`` wrote: the summary by set, source, engine and metric kind, the
TensorRT-LLM online table's light / saturated split, and every figure.

    python scripts/whatif_validation_doc.py rows.json > tables.md
    python scripts/whatif_validation_doc.py --compare before=a.json after=b.json ...
    python scripts/whatif_validation_doc.py --blind rows.json   # the blind set's tables

``--compare`` puts several runs of the same points side by side (one column per labelled
rows file: median / worst absolute error by set, source and metric kind), e.g. a change's
ablation, each variant run with ``validate --set all --fit`` from its own snapshot.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from harness.roofline_tools.validate import figure_table


def summary(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| set | source | engine | kind | n | median abs. error % | worst % |",
           "|---|---|---|---|---|---|---|"]
    order = {"fit": 0, "calibration": 1, "validation": 2}
    keyf = lambda r: (order[r["set"]], r["source"], r["engine"], r["kind"])  # noqa: E731
    for (s, src, eng, kind), grp in itertools.groupby(sorted(rows, key=keyf), key=keyf):
        errs = [abs(r["error_pct"]) for r in grp]
        name = next(k for k, v in order.items() if v == s)
        out.append(f"| {name} | {src} | {eng} | {kind} | {len(errs)} | "
                   f"{statistics.median(errs):.1f} | {max(errs):.1f} |")
    return out


def light_vs_saturated(rows: list[dict[str, Any]]) -> list[str]:
    online = [r for r in rows if r["source"] == "trtllm-perf-overview-online-v0.14"
              and r["kind"] != "other"]
    out = []
    for label, pick in (("QPS 2-16", lambda i: not i.endswith(("qps32", "qpsinf"))),
                        ("QPS 32 and INF", lambda i: i.endswith(("qps32", "qpsinf")))):
        for kind in ("throughput", "tpot"):
            errs = [abs(r["error_pct"]) for r in online if r["kind"] == kind and pick(r["id"])]
            if errs:
                out.append(f"- {label}, {kind}: n={len(errs)}, median "
                           f"{statistics.median(errs):.1f}%, worst {max(errs):.1f}%")
    return out


def compare(named: list[tuple[str, list[dict[str, Any]]]]) -> list[str]:
    """One row per (set, source, metric kind), one "median / worst" column per variant."""
    order = {"fit": 0, "calibration": 1, "validation": 2}
    keys = sorted({(r["set"], r["source"], r["kind"]) for _, rows in named for r in rows},
                  key=lambda k: (order.get(k[0], 3), k[1], k[2]))
    out = ["| set | source | kind | n | " + " | ".join(n for n, _ in named) + " |",
           "|---|---|---|---|" + "---|" * len(named)]
    for key in [*keys, ("validation", "all", "throughput"), ("validation", "all", "tpot")]:
        cells, n = [], 0
        for _, rows in named:
            errs = [abs(r["error_pct"]) for r in rows if r["set"] == key[0]
                    and key[1] in ("all", r["source"]) and r["kind"] == key[2]]
            n = max(n, len(errs))
            cells.append(f"{statistics.median(errs):.1f} / {max(errs):.1f}" if errs else "-")
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | {n} | " + " | ".join(cells) + " |")
    return out


def by_engine_gpu(rows: list[dict[str, Any]]) -> list[str]:
    """The blind validation set per engine, GPU class and metric kind (n, median, worst
    absolute error %), then pooled per kind: what the README's claim reads."""
    from harness.roofline.bands import GPU_CLASS

    val = [r for r in rows if r["set"] == "validation" and r["kind"] != "other"]
    out = ["| engine | GPU | kind | n | median % | worst % |", "|---|---|---|---|---|---|"]
    keyf = lambda r: (r["engine"], GPU_CLASS.get(r["gpu"], r["gpu"]), r["kind"])  # noqa: E731
    for (eng, gpu, kind), grp in itertools.groupby(sorted(val, key=keyf), key=keyf):
        errs = [abs(r["error_pct"]) for r in grp]
        out.append(f"| {eng} | {gpu} | {kind} | {len(errs)} | "
                   f"{statistics.median(errs):.1f} | {max(errs):.1f} |")
    for kind in ("throughput", "ttft", "tpot", "e2e"):
        errs = [abs(r["error_pct"]) for r in val if r["kind"] == kind]
        if errs:
            out.append(f"| all | all | {kind} | {len(errs)} | "
                       f"{statistics.median(errs):.1f} | {max(errs):.1f} |")
    errs = [abs(r["error_pct"]) for r in val]
    if errs:
        within = sum(e <= 25 for e in errs)
        out.append(f"| all | all | pooled | {len(errs)} | {statistics.median(errs):.1f} | "
                   f"{max(errs):.1f} ({within} of {len(errs)} within 25%) |")
    return out


def blind_log(path: Path) -> list[str]:
    """Every logged run of the blind validation set (validate's blind_runs.jsonl)."""
    out = ["| date | commit | pooled n / median / worst | throughput | TTFT | TPOT | E2E |",
           "|---|---|---|---|---|---|---|"]
    def cell(e: dict[str, Any], k: str) -> str:
        v = e.get(k)
        return f"{v['median_abs_pct']} / {v['worst_abs_pct']} (n={v['n']})" \
            if v and v["n"] else "-"

    for line in path.read_text().splitlines():
        e = json.loads(line)
        out.append(f"| {e['date']} | {e['commit'][:9]} | "
                   + " | ".join(cell(e, k) for k in ("pooled", "throughput", "ttft", "tpot",
                                                     "e2e")) + " |")
    return out


def main() -> None:
    if sys.argv[1] == "--blind":
        rows = json.loads(Path(sys.argv[2]).read_text())
        print("\n".join(by_engine_gpu(rows)))
        from harness.roofline_tools.validate import BLIND_LOG
        if BLIND_LOG.is_file():
            print("\n" + "\n".join(blind_log(BLIND_LOG)))
        return
    if sys.argv[1] == "--compare":
        named = [(a.split("=", 1)[0], json.loads(Path(a.split("=", 1)[1]).read_text()))
                 for a in sys.argv[2:]]
        print("\n".join(compare(named)))
        return
    rows = json.loads(Path(sys.argv[1]).read_text())
    print("\n".join(["## Summary by set, source, engine and metric kind", "", *summary(rows),
                     "", "## Light vs saturated load (TensorRT-LLM online table)", "",
                     *light_vs_saturated(rows), "", "## Every figure", "", *figure_table(rows)]))


if __name__ == "__main__":
    main()
