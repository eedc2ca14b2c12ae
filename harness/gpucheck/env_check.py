"""Section ``env``: what the check ran on (versions, device, the bundle and its install)."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import sys
from typing import Any

from harness.gpucheck.context import SectionContext

PACKAGES = ("torch", "triton", "numpy", "hydra-core", "omegaconf", "antlr4-python3-runtime",
            "PyYAML", "pytest", "pytest-benchmark", "transformers", "kvbench", "flash-attn-4",
            "nvidia-cutlass-dsl", "flash-attn")


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def git_sha(ctx: SectionContext) -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ctx.root,
                           capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None


def env_section(ctx: SectionContext) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "profile": ctx.profile.name, "python": sys.version.split()[0],
        "executable": sys.executable, "platform": platform.platform(),
        "packages": versions(), "git_sha": git_sha(ctx),
        "cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1),
                    sms=props.multi_processor_count)
    else:
        info["device"] = "cpu"
    for name in ("install.log", "bundle.txt"):
        path = ctx.out / name
        if path.is_file():
            info[name] = path.read_text(errors="replace")[-3000:]
    return info
