"""Keep the checkout's top-level ``kernels/`` and ``backends/`` from shadowing installed
distributions.

kvbench installs those two folders as ``harness.kernels`` and ``harness.backends``
(pyproject.toml), because ``kernels`` and ``backends`` are names other distributions use
at top level: Hugging Face's ``kernels``, which transformers >= 5.25 requires and imports
when a model module loads. ``python -m ...`` run from the checkout puts the checkout first
on ``sys.path``, so ``import kernels`` would find our folder instead, and transformers
fails with ``cannot import name 'CUDAProperties' from 'kernels'``. The entry points
(``python -m harness``, the test suite's conftest) move the checkout to the end of
``sys.path``: installed distributions then come first, and what only the checkout holds
(``tests``, imported by the test modules) still imports.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: The checkout: the folder that holds harness/, kernels/ and backends/.
CHECKOUT = Path(__file__).resolve().parents[1]


def shadowing_entries(path: list[str], cwd: str, checkout: Path = CHECKOUT) -> list[int]:
    """Indices of ``path`` entries that are ``checkout`` (``""`` means ``cwd``), when it holds
    a top-level ``kernels`` or ``backends`` package that would shadow an installed one."""
    if not any((checkout / name / "__init__.py").is_file() for name in ("kernels", "backends")):
        return []
    hits = []
    for i, entry in enumerate(path):
        try:
            if Path(entry or cwd).resolve() == checkout:
                hits.append(i)
        except OSError:  # an unreadable entry cannot be the checkout
            continue
    return hits


def unshadow() -> None:
    """Move the checkout to the end of ``sys.path`` (see the module docstring). Idempotent."""
    moved = [sys.path.pop(i) for i in reversed(shadowing_entries(sys.path, os.getcwd()))]
    sys.path.extend(reversed(moved))
