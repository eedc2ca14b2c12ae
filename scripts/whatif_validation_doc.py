"""docs/whatif_validation.md's tables from the rows ``python -m harness.roofline_tools.validate
--out rows.json`` wrote: the summary by set, source, engine and metric kind, the
TensorRT-LLM online table's light / saturated split, and every figure.

    python scripts/whatif_validation_doc.py rows.json > tables.md
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


def main() -> None:
    rows = json.loads(Path(sys.argv[1]).read_text())
    print("\n".join(["## Summary by set, source, engine and metric kind", "", *summary(rows),
                     "", "## Light vs saturated load (TensorRT-LLM online table)", "",
                     *light_vs_saturated(rows), "", "## Every figure", "", *figure_table(rows)]))


if __name__ == "__main__":
    main()
