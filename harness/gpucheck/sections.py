"""The sections of the GPU check, by name, in the order they run. Each section module is
imported only when its section runs (the driver imports no torch); none imports this one
(they build on harness.gpucheck.context)."""

from __future__ import annotations

from harness.gpucheck.context import SectionFn
from harness.gpucheck.profile import Profile


def section_names(profile: Profile, requested: tuple[str, ...] | list[str] = ()) -> list[str]:
    """The sections in the order they run: those of a default run, and of the profile's
    on-request sections (``profile.on_request``: run only when named) those ``requested``."""
    engines = [f"engine-{s.name}" for s in profile.shapes]
    compression = ["compression"] if profile.compression is not None else []
    names = ["env", "kernel-correctness", "kernel-bandwidth", *engines, *compression,
             "roofline-h200", "gpu-tests", "benchmarks", "flash-attn"]
    return [n for n in names if n not in profile.on_request or n in requested]


def get_section(name: str, profile: Profile) -> SectionFn:
    """The function of section ``name`` (imported lazily: the driver imports no torch)."""
    if name == "env":
        from harness.gpucheck.env_check import env_section
        return env_section
    if name == "kernel-correctness":
        from harness.gpucheck.kernel_checks import correctness_section
        return correctness_section
    if name == "kernel-bandwidth":
        from harness.gpucheck.kernel_checks import bandwidth_section
        return bandwidth_section
    if name in ("gpu-tests", "benchmarks"):
        from harness.gpucheck.pytest_checks import benchmarks_section, gpu_tests_section
        return gpu_tests_section if name == "gpu-tests" else benchmarks_section
    if name == "roofline-h200":
        from harness.gpucheck.roofline_check import roofline_section
        return roofline_section
    if name == "compression":
        from harness.gpucheck.compression_check import compression_section
        return compression_section
    if name == "flash-attn":
        from harness.gpucheck.fa4_check import flash_attn_section
        return flash_attn_section
    for shape in profile.shapes:
        if name == f"engine-{shape.name}":
            from harness.gpucheck.engine_checks import engine_section
            return lambda ctx, shape=shape: engine_section(ctx, shape)  # type: ignore[misc]
    raise ValueError(f"unknown section {name!r}; known: "
                     f"{section_names(profile, profile.on_request)}")
