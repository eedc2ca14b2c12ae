"""``summary.md``: the check's tables in markdown, from status.json and each section's JSON.

Every section is optional here: a section that did not run, or died before saving, shows
as its status line only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _load(out: Path, name: str) -> dict[str, Any] | None:
    path = out / f"{name}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _f(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _size(row: dict[str, Any]) -> str:
    c = int(row["context"])
    return f"{row['batch']} x {c // 1024}k" if c >= 1024 and c % 1024 == 0 else \
        f"{row['batch']} x {c}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(r) + " |" for r in rows)]


def sections_table(status: dict[str, Any]) -> list[str]:
    rows = [[n, r["status"], f"{_f(r.get('seconds'), '{:.0f}')} / "
             f"{_f(r.get('budget_s'), '{:.0f}')}", (r.get("error") or "").replace("|", "/")]
            for n, r in status.get("sections", {}).items()]
    return _table(["section", "status", "s / budget", "error"], rows)


def env_lines(d: dict[str, Any]) -> list[str]:
    pk = d.get("packages", {})
    return [f"{d.get('device')} (capability {d.get('capability', '-')}, "
            f"{d.get('memory_gib', '-')} GiB); Python {d.get('python')}, torch "
            f"{pk.get('torch')} (CUDA {d.get('torch_cuda')}), triton {pk.get('triton')}, "
            f"hydra-core {pk.get('hydra-core')}; kvbench at {d.get('git_sha') or '?'}; "
            f"profile {d.get('profile')}"]


def correctness_lines(d: dict[str, Any]) -> list[str]:
    rows = d.get("rows", [])
    bad = [r for r in rows if r.get("ok") is False]
    lines = [f"{sum(r.get('ok') is True for r in rows)} of {len(rows)} checks passed "
             f"(geometry {d.get('geometry')})."]
    table = [[r["kernel"], _size(r), {True: "ok", False: "FAIL", None: "-"}[r.get("ok")],
              _f(r.get("max_abs_diff"), "{:.2e}"), (r.get("error") or "")[:120]]
             for r in rows]
    lines += [f"- FAILED {r['kernel']} at {_size(r)}: {r.get('error') or 'mismatch'}"
              for r in bad]
    return [*lines, "", *_table(["kernel", "batch x context", "result", "max abs diff",
                                 "error"], table)]


def bandwidth_lines(d: dict[str, Any]) -> list[str]:
    copy = d.get("copy_gbps")
    lines = [f"Device copy bandwidth: {_f(copy, '{:,.0f}')} GB/s (read + write)."
             + (f" ({d['copy_error']})" if d.get("copy_error") else "")]
    by_size: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for r in d.get("rows", []):
        by_size.setdefault((r["batch"], r["context"]), {})[r["provider"]] = r
    providers = ["triton", "triton-unsplit", "torch-gather", "contiguous-sdpa"]
    table = []
    for (b, c), rs in by_size.items():
        cells = [_size({"batch": b, "context": c})]
        for p in providers:
            r = rs.get(p, {})
            cells.append("-" if r.get("ms") is None else
                         f"{r['ms']:.3f} ms, {_f(r.get('pct_of_copy'), '{:.0f}')}%")
        tri, gat, con = (rs.get(p, {}).get("ms") for p in
                         ("triton", "torch-gather", "contiguous-sdpa"))
        cells += [_f(tri / con if tri and con else None), _f(gat / con if gat and con else None)]
        table.append(cells)
    head = ["batch x context", *[f"{p} (ms, % copy BW)" for p in providers],
            "triton / contiguous", "gather / contiguous"]
    return [*lines, "", *_table(head, table)]


def engine_lines(d: dict[str, Any]) -> list[str]:
    table = [[r["backend"], str(r.get("kernel", "-")),
              str(r.get("cuda_graphs") or "-").split(":")[0],
              _f(r.get("output_tok_s"), "{:.0f}"),
              _f(r.get("total_tok_s"), "{:.0f}"), _f(r.get("decode_step_ms_p50")),
              _f(r.get("decode_over_weight_read"), "{:.1f}"),
              _f(r.get("prefill_step_ms_p50")), _f(r.get("step_ms_mean")),
              str(r.get("slow_steps", "-")), str(r.get("finished", "-")),
              (r.get("error") or "")[:120].replace("|", "/")]
             for r in d.get("rows", [])]
    model = next((r["model"] for r in d.get("rows", []) if r.get("model")), d.get("shape"))
    head = ["backend", "kernel", "graphs", "output tok/s", "total tok/s",
            "decode step ms (p50)", "x weight read", "prefill step ms (p50)",
            "step ms (mean)", "steps > 2x median", "finished", "error"]
    floor = d.get("weight_read_ms")
    return [f"Model: {model}; workload {' '.join(d.get('workload', []))}; KV budget "
            f"{d.get('kv_budget')}; reading its weights once: "
            f"{_f(floor, '{:.3f}')} ms at the measured copy bandwidth.", "",
            *_table(head, table)]


def compression_lines(d: dict[str, Any]) -> list[str]:
    """The compression section: its kernels' bandwidth, then the engine per context."""
    copy = d.get("copy_gbps")
    lines = [f"Model {' '.join(d.get('model', []))}, KV budget {d.get('kv_budget')}; "
             f"device copy {_f(copy, '{:,.0f}')} GB/s. Kernels: one decode step, GB/s over "
             "the bytes the method must read (its K/V and metadata, the queries).", ""]
    kernels = [[_size(r), str(r.get("kernel")), _f(r.get("must_read_bytes"), "{:,.0f}"),
                _f(r.get("ms"), "{:.3f}"), _f(r.get("gbps"), "{:,.0f}"),
                _f(r.get("pct_of_copy"), "{:.0f}"), (r.get("error") or "")[:100]]
               for r in d.get("kernels", [])]
    lines += _table(["batch x context", "kernel", "must read (B)", "ms", "GB/s", "% copy",
                     "error"], kernels)
    for c in d.get("contexts", []):
        rows = [r for r in d.get("rows", []) if r.get("context") == c]
        if not rows:
            continue
        table = [[r["backend"], str(r.get("kernel", "-")), _f(r.get("output_tok_s"), "{:.0f}"),
                  _f(r.get("decode_step_ms_p50")),
                  _f(r.get("kv_read_bytes_per_token"), "{:,.0f}"),
                  str(r.get("max_running", "-")), str(r.get("finished", "-")),
                  str(r.get("preemptions", "-")),
                  (r.get("error") or "")[:100].replace("|", "/")] for r in rows]
        lines += ["", f"Context {c} ({rows[0].get('requests')} requests at once):", "",
                  *_table(["backend", "kernel", "output tok/s", "decode step ms (p50)",
                           "KV bytes / decode token", "seqs at once", "finished",
                           "preemptions", "error"], table)]
    return lines


def gpu_tests_lines(d: dict[str, Any]) -> list[str]:
    lines = [f"`pytest -m gpu` over {', '.join(d.get('files', []))}: "
             f"{d.get('passed', '-')} passed, {d.get('failed', '-')} failed, "
             f"{d.get('skipped', '-')} skipped (exit status {d.get('returncode')})."
             + (f" {d['error']}" if d.get("error") else "")]
    lines += [f"- FAILED {f}" for f in d.get("failures", [])]
    lines += [f"- skipped ({n}): {why}" for why, n in d.get("skip_reasons", {}).items()]
    return lines


def benchmarks_lines(d: dict[str, Any]) -> list[str]:
    table = [[str(r.get("group")), str(r.get("name")), _f(r.get("median_us"), "{:.1f}"),
              str(r.get("rounds"))] for r in d.get("rows", [])]
    return [f"pytest-benchmark (exit status {d.get('returncode')}; raw JSON in "
            "benchmarks-raw.json)." + (f" {d['error']}" if d.get("error") else ""), "",
            *_table(["group", "benchmark", "median (us)", "rounds"], table)]


def roofline_lines(d: dict[str, Any]) -> list[str]:
    fit, summ = d.get("fit", {}), d.get("summary", {})
    lines = ["Fitted: " + ", ".join(f"{k}={_f(v, '{:.4g}')}" for k, v in fit.items()) + ". "
             f"Held-out: step error {_f(summ.get('held_out_step_mdape_pct'), '{:.1f}')}% "
             f"(median), throughput {_f(summ.get('held_out_throughput_mdape_pct'), '{:.1f}')}"
             f"% (median), {_f(summ.get('held_out_throughput_max_ape_pct'), '{:.1f}')}% "
             f"(worst). Written to {d.get('written_to')}."]
    rows = [[name, str(e.get("steps")), _f(e.get("step_mdape_pct"), "{:.1f}"),
             _f(e.get("throughput_ape_pct"), "{:.1f}"),
             _f(e.get("roofline_run_throughput_ape_pct"), "{:.1f}")]
            for name, e in d.get("held_out", {}).items()]
    return [*lines, "", *_table(["held-out run", "steps", "step error %", "throughput error %",
                                 "roofline replay error %"], rows)]


def flash_attn_lines(d: dict[str, Any]) -> list[str]:
    lines = [str(d.get("note", ""))]
    for key in ("kernels", "engine", "timings"):
        for r in d.get(key, []):
            lines.append(f"- {key}: " + ", ".join(f"{k}={v}" for k, v in r.items()))
    return lines


SECTIONS: dict[str, tuple[str, Callable[[dict[str, Any]], list[str]]]] = {
    "env": ("Environment", env_lines),
    "kernel-correctness": ("Triton kernels vs torch references", correctness_lines),
    "kernel-bandwidth": ("Decode attention: time and bandwidth", bandwidth_lines),
    "compression": ("Compression under one budget", compression_lines),
    "roofline-h200": ("Roofline executor: h200 spec fitted", roofline_lines),
    "gpu-tests": ("gpu tests", gpu_tests_lines),
    "benchmarks": ("Benchmarks", benchmarks_lines),
    "flash-attn": ("flash-attn (4, CuTe DSL)", flash_attn_lines),
}


def render(out: Path, status: dict[str, Any]) -> str:
    lines = [f"# kvbench GPU check ({status.get('profile')} profile)", "",
             *sections_table(status)]
    for name in status.get("sections", {}):
        data = _load(out, name)
        if data is None:
            continue
        title, fn = SECTIONS.get(name, (f"Engine: {name.removeprefix('engine-')}",
                                        engine_lines))
        try:
            body = fn(data)
        except Exception as e:  # a malformed partial file must not lose the other tables
            body = [f"(could not render: {type(e).__name__}: {e})"]
        if data.get("error"):
            body = [f"**Section error:** {data['error']}", "", *body]
        lines += ["", f"## {title}", "", *body]
    return "\n".join(lines) + "\n"


def write_summary(out: Path, status: dict[str, Any]) -> Path:
    path = out / "summary.md"
    path.write_text(render(out, status))
    return path
