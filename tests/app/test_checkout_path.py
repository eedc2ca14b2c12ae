"""The checkout's kernels/ must not shadow Hugging Face's ``kernels`` (harness/checkout_path.py):
transformers >= 5.25 imports it, and our folder made every transformers model test fail."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

from harness.checkout_path import CHECKOUT, shadowing_entries

OURS = CHECKOUT / "kernels" / "__init__.py"


def _origin(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    return None if spec is None else spec.origin


def test_entries_naming_the_checkout_are_found(tmp_path: Path) -> None:
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    other = tmp_path / "elsewhere"
    other.mkdir()
    path = [str(other), "", str(tmp_path), str(tmp_path / "kernels" / ".."), "/no/such/dir"]
    assert shadowing_entries(path, cwd=str(tmp_path), checkout=tmp_path) == [1, 2, 3]
    assert shadowing_entries(path, cwd=str(other), checkout=tmp_path) == [2, 3]


def test_a_folder_without_the_generic_packages_is_left_alone(tmp_path: Path) -> None:
    assert shadowing_entries([str(tmp_path), ""], cwd=str(tmp_path), checkout=tmp_path) == []


def test_this_process_puts_the_checkout_last() -> None:
    # conftest.py moved it; without that, `python -m pytest` from the checkout has it first.
    hits = shadowing_entries(sys.path, cwd=str(CHECKOUT))
    assert hits and hits == list(range(len(sys.path) - len(hits), len(sys.path)))
    if _installed("kernels"):  # transformers >= 5.25 installs Hugging Face's
        assert _origin("kernels") != str(OURS)


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_unshadow_from_the_checkout_as_cwd() -> None:
    code = ("from harness.checkout_path import unshadow; import importlib.util as u; "
            "s = u.find_spec('kernels'); print(s.origin if s else None); unshadow(); "
            "s = u.find_spec('kernels'); print(s.origin if s else None)")
    r = subprocess.run([sys.executable, "-c", code], cwd=CHECKOUT, capture_output=True,
                       text=True, timeout=60, check=True)
    before, after = r.stdout.split()
    assert before == str(OURS)  # `python -c` puts the cwd first: the hazard is real
    if _installed("kernels"):
        assert after != str(OURS)
