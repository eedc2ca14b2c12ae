"""Standalone decode benchmark: the ``gpu`` kernel tests, then decode attention timed
against memory bandwidth, with flash-attn 2/3's paged kernel as a provider when installed.

scripts/gpu_check.sh no longer runs this: it runs :mod:`harness.gpucheck` (whose
``kernel-bandwidth`` section times the same decode sizes, plus the torch gather path).
Run on a CUDA machine (``python -m harness.kernels.bench --out report.json``); needs only
torch and triton, no network. Steps, all recorded in one JSON report:

1. ``pytest -m gpu`` over tests/**/test_kernels_*.py, compiled (TRITON_INTERPRET=0).
2. Device copy bandwidth: a 2 GiB device-to-device copy, (read + write bytes) / time.
3. Decode attention at Llama-3-8B head geometry (32 query heads, 8 KV heads, head dim 128,
   bf16, block size 16) for every batch x context of :func:`decode_sizes`, timed with
   ``triton.testing.do_bench`` (median): our paged kernel, its split-K variant, torch SDPA
   on the same K/V laid out contiguously, and flash-attn's paged kernel when installed.
   Achieved bandwidth = bytes of K/V + Q read once / time; also as a percent of step 2.

The pure-Python parts (sizes, byte counts, rows, table, JSON) import and run without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
BATCHES = (1, 4, 16, 64)
CONTEXTS = (4096, 8192, 16384, 32768)
PROVIDERS = ("triton", "triton-splitk", "torch-sdpa", "flash-attn")
COPY_BYTES = 2 << 30


def decode_sizes(batches: tuple[int, ...] = BATCHES,
                 contexts: tuple[int, ...] = CONTEXTS) -> list[tuple[int, int]]:
    """(batch, context) pairs from 1 x 4k to 64 x 32k, smallest working set first."""
    return sorted(((b, c) for b in batches for c in contexts), key=lambda s: (s[0] * s[1], s))


def bytes_read(batch: int, context: int, *, num_heads: int = NUM_HEADS,
               num_kv_heads: int = NUM_KV_HEADS, head_dim: int = HEAD_DIM,
               elem_bytes: int = 2) -> int:
    """Bytes a decode step must read at least once: every K and V of the context plus Q."""
    kv = 2 * batch * context * num_kv_heads * head_dim * elem_bytes
    return kv + batch * num_heads * head_dim * elem_bytes


@dataclass(slots=True)
class Row:
    """One provider at one size. ms is None when it did not run (see ``error``)."""

    provider: str
    batch: int
    context: int
    ms: float | None
    gbps: float | None = None
    pct_of_copy: float | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def make_row(provider: str, batch: int, context: int, ms: float | None, copy_gbps: float,
             error: str | None = None, **extra: Any) -> Row:
    if ms is None or ms <= 0:
        return Row(provider, batch, context, None, error=error or "no time", extra=extra)
    gbps = bytes_read(batch, context) / (ms * 1e-3) / 1e9
    pct = 100.0 * gbps / copy_gbps if copy_gbps > 0 else None
    return Row(provider, batch, context, ms, gbps, pct, error, extra)


def format_table(rows: list[Row], copy_gbps: float) -> str:
    """Fixed-width table: one line per (size, provider), errors shortened in place."""
    head = f"{'batch x context':>16}  {'provider':<14} {'ms':>9} {'GB/s':>8} {'% copy':>7}"
    lines = [f"device copy bandwidth: {copy_gbps:,.0f} GB/s (read + write)", head,
             "-" * len(head)]
    for r in rows:
        size = f"{r.batch} x {r.context // 1024}k"
        if r.ms is None:
            why = (r.error or "").splitlines()[0][:60] if r.error else ""
            lines.append(f"{size:>16}  {r.provider:<14} {'-':>9} {'-':>8} {'-':>7}  {why}")
        else:
            pct = f"{r.pct_of_copy:.0f}%" if r.pct_of_copy is not None else "-"
            lines.append(f"{size:>16}  {r.provider:<14} {r.ms:9.3f} {r.gbps:8.0f} {pct:>7}")
    return "\n".join(lines)


def write_report(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def report_dict(rows: list[Row], copy_gbps: float, **info: Any) -> dict[str, Any]:
    return {**info, "copy_gbps": copy_gbps,
            "geometry": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS,
                         "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE,
                         "dtype": str(DTYPE).removeprefix("torch.")},
            "decode": [asdict(r) for r in rows]}


def default_out() -> Path:
    return Path(os.environ.get("OUT") or ".") / "gpu_check.json"


# -- GPU only below ----------------------------------------------------------------------

def run_gpu_tests(root: Path, timeout_s: float) -> dict[str, Any]:
    """``pytest -m gpu`` on the kernel tests, compiled. Returns rc and the output's tail."""
    files = sorted(str(p) for p in (root / "tests").rglob("test_kernels_*.py"))
    if not files:
        return {"returncode": None, "error": f"no tests/**/test_kernels_*.py under {root}"}
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
           "-o", "addopts=", *files]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else ""
        return {"returncode": None, "error": f"timed out after {timeout_s:.0f} s",
                "tail": out[-4000:]}
    return {"returncode": r.returncode, "seconds": round(time.perf_counter() - t0, 1),
            "tail": (r.stdout + r.stderr)[-4000:]}


def copy_bandwidth_gbps(nbytes: int = COPY_BYTES) -> float:
    from triton.testing import do_bench

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _flash_attn_paged() -> tuple[str, Callable[..., torch.Tensor]] | None:
    """flash-attn's paged decode when installed: FA3 (Hopper) first, then FA2 (which
    wants blocks of >= 256 tokens: at block size 16 its error is recorded)."""
    try:
        from flash_attn_interface import flash_attn_with_kvcache as fa3

        def call3(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, lens: torch.Tensor,
                  tables: torch.Tensor) -> torch.Tensor:
            return fa3(q, kc, vc, cache_seqlens=lens, page_table=tables)
        return "flash-attn-3", call3
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_with_kvcache as fa2

        def call2(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, lens: torch.Tensor,
                  tables: torch.Tensor) -> torch.Tensor:
            return fa2(q, kc, vc, cache_seqlens=lens, block_table=tables)
        return "flash-attn-2", call2
    except ImportError:
        return None


def bench_size(batch: int, context: int, copy_gbps: float) -> list[Row]:
    """Every provider at one size, on one random paged cache (blocks shuffled)."""
    import torch.nn.functional as F
    from triton.testing import do_bench

    from harness.kernels.cases import paged_case
    from harness.kernels.decode import default_splits, paged_decode

    torch.manual_seed(batch * 100_003 + context)
    case = paged_case([context] * batch, block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                      head_dim=HEAD_DIM, dtype=DTYPE, device="cuda", spare_blocks=0)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    out = torch.empty_like(q)
    kc, vc, tables, lens = case.k_cache, case.v_cache, case.tables, case.lens
    rows: list[Row] = []

    def timed(provider: str, fn: Callable[[], object], **extra: Any) -> None:
        try:
            fn()
            torch.cuda.synchronize()
            ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
            rows.append(make_row(provider, batch, context, ms, copy_gbps, **extra))
        except Exception as e:  # a provider failing is a result, not a crash
            rows.append(make_row(provider, batch, context, None, copy_gbps,
                                 error=f"{type(e).__name__}: {e}", **extra))

    timed("triton", lambda: paged_decode(q, kc, vc, tables, lens, num_splits=1, out=out))
    splits = max(2, default_splits(batch, NUM_KV_HEADS, context, q.device))
    timed("triton-splitk", lambda: paged_decode(q, kc, vc, tables, lens, num_splits=splits,
                                                out=out), num_splits=splits)

    # SDPA on contiguous (B, KV, L, D): the G query heads of a KV head ride as G queries
    # of one head, so K/V are read once (no GQA expansion) and no mask is needed.
    g = NUM_HEADS // NUM_KV_HEADS
    kd = kc[tables].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    vd = vc[tables].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    qd = q.view(batch, NUM_KV_HEADS, g, HEAD_DIM)
    timed("torch-sdpa", lambda: F.scaled_dot_product_attention(qd, kd, vd))
    # The providers must agree, or their times compare nothing.
    want = F.scaled_dot_product_attention(qd, kd, vd).reshape(batch, NUM_HEADS, HEAD_DIM)
    for r, n in zip(rows[:2], (1, splits)):
        if r.ms is not None:
            got = paged_decode(q, kc, vc, tables, lens, num_splits=n)
            r.extra["max_abs_diff_vs_sdpa"] = float((got.float() - want.float()).abs().max())

    fa = _flash_attn_paged()
    if fa is None:
        rows.append(make_row("flash-attn", batch, context, None, copy_gbps,
                             error="not installed"))
    else:
        name, call = fa
        lens32, tables32 = lens.to(torch.int32), tables.to(torch.int32)
        timed("flash-attn", lambda: call(q.unsqueeze(1), kc, vc, lens32, tables32),
              impl=name)
        if rows[-1].ms is not None:
            got = call(q.unsqueeze(1), kc, vc, lens32, tables32)
            got = got[0] if isinstance(got, tuple) else got
            rows[-1].extra["max_abs_diff_vs_sdpa"] = float(
                (got.reshape(want.shape).float() - want.float()).abs().max())
    return rows  # the caches go with this frame; the caller empties torch's cache


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON report path (default: $OUT/gpu_check.json)")
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                    help="repository root holding tests/ (for the gpu tests)")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--budget-s", type=float, default=400.0,
                    help="stop timing new sizes after this many seconds in all")
    args = ap.parse_args(argv)
    out = args.out or default_out()
    t0 = time.perf_counter()
    info: dict[str, Any] = {"torch": torch.__version__, "started": time.strftime("%FT%T")}
    if not torch.cuda.is_available():
        write_report(out, {**info, "error": "no CUDA device"})
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    import triton

    info.update(device=torch.cuda.get_device_name(), triton=triton.__version__)
    if not args.skip_tests:
        info["tests"] = run_gpu_tests(args.root, timeout_s=max(60.0, args.budget_s / 2))
        print(info["tests"].get("tail", info["tests"].get("error", "")))
    copy_gbps = copy_bandwidth_gbps()
    torch.cuda.empty_cache()
    rows: list[Row] = []
    for batch, context in decode_sizes():
        if time.perf_counter() - t0 > args.budget_s:
            rows += [make_row(p, batch, context, None, copy_gbps, error="skipped: time budget")
                     for p in PROVIDERS]
            continue
        try:
            rows += bench_size(batch, context, copy_gbps)
        except Exception as e:  # e.g. out of memory building the case: record, go on
            rows += [make_row(p, batch, context, None, copy_gbps,
                              error=f"{type(e).__name__}: {e}") for p in PROVIDERS]
        torch.cuda.empty_cache()
        write_report(out, report_dict(rows, copy_gbps, **info))  # partial results survive
    info["seconds"] = round(time.perf_counter() - t0, 1)
    write_report(out, report_dict(rows, copy_gbps, **info))
    print(format_table(rows, copy_gbps))
    print(f"report: {out}")
    tests_rc = info.get("tests", {}).get("returncode", 0)
    return 0 if tests_rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
