"""pyproject.toml lists its packages by hand (backends/ and kernels/ ship under harness.*):
every folder of Python code must be listed, and every data file the code reads shipped,
or a non-editable install (a wheel) breaks where the editable one works."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_python_folder_is_a_listed_package() -> None:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {v: k for k, v in tool["package-dir"].items()}  # folder -> package name
    found = set()
    for top, pkg in dirs.items():
        for d in sorted({p.parent for p in (ROOT / top).rglob("*.py")}):
            if "__pycache__" not in d.parts:
                rel = d.relative_to(ROOT / top).parts
                found.add(".".join([pkg, *rel]))
    assert found - set(tool["packages"]) == set(), "add these to [tool.setuptools] packages"


def test_the_cpu_calibration_ships_with_the_package() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]
    assert "cpu_calibration.json" in data["harness.roofline"]
    assert (ROOT / "harness" / "roofline" / "cpu_calibration.json").is_file()
