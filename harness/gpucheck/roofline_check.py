"""Section ``roofline-h200``: fit the roofline executor's ``h200`` spec on the device, as
``python -m harness.roofline_tools.calibrate --target h200`` does (a GEMM profile of
Llama-3.1-8B's shape in bf16, short real engine runs with the Triton kernels, the bounded
fit, held-out runs predicted and replayed under executor=roofline).

The section's JSON is the calibration report itself: committed as
``harness/roofline/h200_calibration.json`` it becomes what ``roofline.hardware=h200``
reads. The dry run fits the same code path on the CPU at tiny sizes (``--target dry``).
"""

from __future__ import annotations

from typing import Any

from harness.gpucheck.context import SectionContext, time_limit


def roofline_section(ctx: SectionContext) -> dict[str, Any]:
    from harness.roofline.hardware import calibration_path
    from harness.roofline_tools.calibrate import calibrate
    from harness.roofline_tools.targets import TARGETS

    gpu = ctx.profile.device == "cuda"
    # On the device the spec's own file (this tree is the device's copy), so the held-out
    # runs are also replayed on the fitted spec; a dry run must not write it here.
    out = calibration_path("h200") if gpu else ctx.out / "h200_calibration.json"
    # Three repeats on the device: each step's median then drops the repeat in which
    # Triton compiled the kernels a backend's first run needs.
    with time_limit(ctx.left() - 5):
        report = calibrate(TARGETS["h200" if gpu else "dry"], 3 if gpu else 1, out)
    report["written_to"] = str(out)
    return report
