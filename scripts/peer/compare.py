"""kvbench's side, step 3 of scripts/peer_kvpress.sh: kvbench's backends on the same
prompts at the same kept counts, and one table beside kvpress's.

    python scripts/peer/compare.py DIR     # DIR holds prompts.json and kvpress.json

Each kvbench method runs through the real engine (harness.runner.run: RULER prompts of one
length, ``backend.prefill=full``: the whole prompt, then one selection at its end, as
kvpress compresses) with ``backend.budget`` = kvpress's kept count (snapkv: the count
minus its 32-token window, which it keeps besides; streaming_llm: 4 sinks + a window of the
rest; pyramidkv and adakv: the count per head on average; duo_attention: its defaults, the
heads kvbench measured given to kvpress's side). Writes DIR/table.md and DIR/results.json:
accuracy per method and length with 95% bootstrap intervals for kvbench, kvpress with
kvbench's per-sequence selection (``sequence``) and kvpress's own per-head selection
(``head``); paired agreement and identical outputs between kvbench and kvpress-sequence
(kvpress's per-head selection for the per-head presses, which select per head on both
sides); the KV bytes kvbench's sequences held; and the score check on the fixture
(scripts/peer/score_check.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness.config import compose_config
from harness.metrics.bootstrap import bootstrap_ci
from harness.metrics.tasks import score_requests
from harness.model import load_model
from harness.runner import run
from harness.workloads import make_workload, workload_options

sys.path.insert(0, str(Path(__file__).resolve().parent))
from score_check import check_scores

WINDOW, SINKS = 32, 4  # kvbench's snapkv window; streaming_llm's sinks (kvpress's n_sink)
# Per head on both sides (harness/kv/headwise.py): paired with kvpress's own selection.
PER_HEAD = ("pyramidkv", "adakv", "duo_attention")


def overrides(method: str, n_kept: int) -> list[str]:
    """The kvbench backend that keeps ``n_kept`` prompt tokens per sequence."""
    if method == "none":
        return ["backend=paged", "cache.enable_prefix_caching=false"]
    if method == "streaming_llm":
        return ["backend=streaming_llm", f"backend.window={n_kept - SINKS}",
                f"backend.sink_tokens={SINKS}"]
    if method == "snapkv":
        return ["backend=snapkv", f"backend.budget={n_kept - WINDOW}", "backend.budget_ratio=0",
                "backend.pooling=avg", "backend.prefill=full"]
    if method == "duo_attention":  # its heads, sinks and recent tokens, as kvpress's side got
        return ["backend=duo_attention"]
    if method in PER_HEAD:  # n_kept per head on average (the window among them, as kvpress)
        return [f"backend={method}", f"backend.budget={n_kept}", "backend.budget_ratio=0"]
    return [f"backend={method}", f"backend.budget={n_kept}", "backend.budget_ratio=0",
            "backend.prefill=full"]


def cell(p: dict[str, Any]) -> tuple[str, int, float, int]:
    return (str(p["task"]), int(p["length"]), float(p["depth"]), int(p["sample"]))


def ci(xs: list[float]) -> tuple[float, float, float]:
    low, high = bootstrap_ci(np.asarray(xs, dtype=float))
    return float(np.mean(xs)), low, high


def run_kvbench(d: dict[str, Any], methods: list[str], tok: Any, cache: Path) -> dict[str, Any]:
    """kvbench's outputs per method and length, by prompt cell, and the KV its sequences
    held; kept in ``cache`` (kvbench.json) as they come, so a rerun (or the table, once
    kvpress's side has finished) starts from what is done."""
    done: dict[str, Any] = json.loads(cache.read_text()) if cache.is_file() else {}
    by_cell = {cell(p): p for p in d["prompts"]}
    ratio = d["ratios"][0]
    for method in methods:
        for length in d["lengths"]:
            key = f"{method}/{length}"
            if key in done:
                continue
            n_kept = d["kept"][str(ratio)][str(length)]
            wl = ruler(d, length, tok)
            cells = {r.request_id: cell({**wl.task_meta(r.request_id), "length": length})
                     for r in wl.initial_requests()}
            for r in wl.initial_requests():  # the same prompts as kvpress ran
                assert list(r.prompt_ids) == by_cell[cells[r.request_id]]["ids"], \
                    cells[r.request_id]
            cfg = compose_config([*overrides(method, n_kept), "workload=ruler",
                                  f"workload.lengths=[{length}]",
                                  f"workload.samples={d['samples']}",
                                  "scheduler.max_model_len=8192", "cache.kv_budget=1GiB",
                                  "progress=false"])
            res = run(cfg)
            busy = [s for s in res.steps if s.running > 0]
            per_seq = max(1, sum(s.running for s in busy)) * 2**20
            # Reserved counts whole blocks; used, the tokens in them (the per-head methods
            # hold a block while any of its pages is: harness/kv/headwise.py).
            done[key] = {"kept": n_kept,
                         "outputs": {str(by_cell[c]["id"]): res.outputs[rid]
                                     for rid, c in cells.items()},
                         "kv_held_mib": sum(s.reserved_bytes for s in busy) / per_seq,
                         "kv_used_mib": sum(s.used_bytes for s in busy) / per_seq}
            cache.write_text(json.dumps(done) + "\n")
            print(f"kvbench {key}: done", flush=True)
    return done


def until_eos(ids: list[int], eos: frozenset[int]) -> list[int]:
    """``ids`` up to and including the first EOS, as the engine ends a sequence."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i + 1]
    return ids


def ruler(d: dict[str, Any], length: int, tok: Any) -> Any:
    opts = workload_options("ruler", {"lengths": [length], "samples": d["samples"], "seed": 0})
    return make_workload(opts, tok)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--methods", nargs="+", default=None)
    ap.add_argument("--kvbench-only", action="store_true",
                    help="run kvbench's side only (kvbench.json), no table yet")
    a = ap.parse_args()
    d = json.loads((a.dir / "prompts.json").read_text())
    tok = load_model("smollm2").tokenizer
    methods = a.methods or ["none", "snapkv", "streaming_llm", "tova", "knorm", "keydiff",
                            "observed_attention", "expected_attention", *PER_HEAD]
    ours_all = run_kvbench(d, methods, tok, a.dir / "kvbench.json")
    if a.kvbench_only:
        return
    kvp = json.loads((a.dir / "kvpress.json").read_text())
    ratio = d["ratios"][0]
    by_cell = {cell(p): p for p in d["prompts"]}
    eos = frozenset(tok.eos_ids)
    rows: list[dict[str, Any]] = []
    for method in methods:
        key = "none" if method == "none" else f"{method}@{ratio}"
        if key not in kvp["outputs"]:
            continue
        theirs = kvp["outputs"][key]
        modes = {"head": theirs, "sequence": theirs} if method == "none" else theirs
        for length in d["lengths"]:
            wl = ruler(d, length, tok)
            ids = {r.request_id: by_cell[cell({**wl.task_meta(r.request_id),
                                               "length": length})]["id"]
                   for r in wl.initial_requests()}
            mine = ours_all[f"{method}/{length}"]
            ours_out = {rid: mine["outputs"][str(pid)] for rid, pid in ids.items()}
            ours = score_requests(wl, ours_out, tok)
            row: dict[str, Any] = {"method": method, "length": length, "kept": mine["kept"],
                                   "n": len(ours), "kv_held_mib": mine["kv_held_mib"],
                                   "kv_used_mib": mine.get("kv_used_mib"),  # newer runs
                                   "kvbench": ci([ours[r].score for r in sorted(ours)])}
            # kvbench's selection is kvpress's per-sequence one, or per head for PER_HEAD.
            paired = "head" if method in PER_HEAD else "sequence"
            for mode, outs in modes.items():
                # kvpress's side decodes max_tokens; kvbench stops at EOS (kept): as it.
                mapped = {rid: until_eos(outs[str(pid)], eos) for rid, pid in ids.items()}
                s = score_requests(wl, mapped, tok)
                row[f"kvpress_{mode}"] = ci([s[r].score for r in sorted(ours)])
                if mode == paired:
                    row["agree"] = float(np.mean([(ours[r].score == 1.0) == (s[r].score == 1.0)
                                                  for r in ours]))
                    row["identical"] = sum(ours_out[r] == mapped[r] for r in ours)
            rows.append(row)
            print(json.dumps(row), flush=True)
    fixture = a.dir / "kvpress_scores.pt"
    checks = [c.__dict__ for c in check_scores(torch.load(fixture))] if fixture.is_file() else []
    (a.dir / "results.json").write_text(json.dumps({"rows": rows, "score_checks": checks,
                                                    "versions": kvp.get("versions")},
                                                   indent=2) + "\n")
    (a.dir / "table.md").write_text(to_markdown(rows, checks, kvp.get("versions", {})))
    print((a.dir / "table.md").read_text())


def _fmt(x: tuple[float, float, float] | None) -> str:
    return "-" if x is None else f"{x[0]:.2f} [{x[1]:.2f}, {x[2]:.2f}]"


def to_markdown(rows: list[dict[str, Any]], checks: list[dict[str, Any]],
                versions: dict[str, str]) -> str:
    out = [f"kvpress {versions.get('kvpress', '?')}, transformers "
           f"{versions.get('transformers', '?')}, torch {versions.get('torch', '?')}", "",
           "| method | length | kept | kvbench [95% CI] | kvpress, per-sequence selection | "
           "kvpress, per-head (its own) | paired agreement | identical outputs | kvbench KV "
           "held / seq (MiB) | of it used |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:  # (pyramidkv, adakv, duo_attention: paired with kvpress's per-head)
        used = "-" if r.get("kv_used_mib") is None else f"{r['kv_used_mib']:.1f}"
        out.append(f"| {r['method']} | {r['length']} | {r['kept']} | {_fmt(r['kvbench'])} | "
                   f"{_fmt(r.get('kvpress_sequence'))} | {_fmt(r['kvpress_head'])} | "
                   f"{r['agree']:.2f} | {r['identical']}/{r['n']} | {r['kv_held_mib']:.1f} | "
                   f"{used} |")
    if checks:
        out += ["", "| method | layer | max rel. error | constant (kvbench / kvpress) |",
                "|---|---|---|---|"]
        out += [f"| {c['method']} | {c['layer']} | {c['rel_error']:.1e} | {c['constant']:.4g} |"
                for c in checks]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
