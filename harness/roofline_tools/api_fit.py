"""The served API server's two constants (harness.metrics.api_server: ``api_request_s``
a request's input, ``api_token_s`` a streamed token's output, one process, first come
first served), fitted to an engine's served bursts: its all-at-once served points of
dense models in sources that name it in ``fit_api`` (GPUStack's Qwen3-14B / 32B vLLM
pages: 1,000 requests of ShareGPT or 128 / 4, 100-500 long prompts, sent at once
through one API server). A burst's schedule depends on when its requests reach the
engine, so the figures are not affine in these constants: a grid search (:data:`GRID`),
each candidate a rerun of every burst, minimizing the mean |predicted / published - 1|
over their throughput, TTFT, TPOT and end-to-end figures (the validation's own measure:
a log error would let a TPOT near 0, what a burst's tokens look like with no output
cost, outweigh every other figure). A figure the API server cannot move (a
32,000-token prompt's run) adds the same to every candidate and does not move the
minimum.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

# Candidates: seconds of input a request, seconds of output a streamed token.
GRID = ((0.0, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04),
        (0.0, 50e-6, 100e-6, 200e-6, 400e-6, 800e-6))
FITTED_KINDS = ("throughput", "ttft", "tpot", "e2e")


Rows = list[dict[str, Any]]  # harness.roofline_tools.validate.compare's rows


def bursts(engine: str, runs: list[dict[str, Any]], sources: dict[str, Any],
           served: Callable[[dict[str, Any], dict[str, Any]], bool]) -> list[dict[str, Any]]:
    """``engine``'s served bursts that its API server is fitted to (``served``: whether a
    run went through an HTTP server, validate.served)."""
    from harness.roofline.models import get_model_spec

    return [p for p in runs if p["engine"] == engine and p["rate"] == 0
            and "concurrency" not in p and served(p, sources[p["source"]])
            and engine in sources[p["source"]].get("fit_api", ())
            and not get_model_spec(p["model"]).num_experts]


def loss(rows: Rows) -> float:
    """Mean |predicted / published - 1| over the fitted figures of validate's rows (a
    point the what-if refuses: 1 a figure, as the validation counts it)."""
    errs = [abs(row["error_pct"]) / 100.0 for row in rows if row["kind"] in FITTED_KINDS]
    return sum(errs) / len(errs) if errs else 0.0


def fit_api(engine: str, points: list[dict[str, Any]],
            rerun: Callable[[list[dict[str, Any]]], Rows]) -> dict[str, Any] | None:
    """The grid's best ``(api_request_s, api_token_s)`` for ``engine`` on ``points``
    (:func:`bursts`; ``rerun``: the points run again with the profiles as they are now,
    as validate's rows), with its loss and each candidate's; None: no burst."""
    from harness.roofline.engines import PROFILES

    if not points:
        return None
    base = PROFILES[engine]
    tried: list[tuple[float, float, float]] = []
    try:
        for a in GRID[0]:
            for b in GRID[1]:
                PROFILES[engine] = dataclasses.replace(base, api_request_s=a, api_token_s=b)
                tried.append((loss(rerun(points)), a, b))
    finally:
        PROFILES[engine] = base
    best = min(tried)
    return {"api_request_s": best[1], "api_token_s": best[2],
            "api_loss": round(best[0], 4), "api_points": [p["id"] for p in points],
            "api_grid": [[round(v, 4), a, b] for v, a, b in tried]}
