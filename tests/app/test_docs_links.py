"""The README is the front door and docs/ holds the rest (issue #54): every relative link
in README.md and docs/**/*.md names a file or folder of this repository, the README stays
short (<= 400 lines of <= 100 characters, code blocks and tables included), and no page
names a path outside the repository (such as the team's notes beside the checkout).

Plain text and regular expressions only: nothing of the harness is imported."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 400
MAX_WIDTH = 100

# [text](target) and [text](target "title"); images ![alt](target) too. The text may hold
# backticks and brackets one level deep ([`a`](b), [see [x]](y)).
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# A path token in running text that climbs: ../x, ../../x (not the ellipsis .../x).
CLIMB = re.compile(r"(?<![.\w/])((?:\.\./)+[^\s)`'\"\]>,;]*)")
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def page_ids() -> list[str]:
    return [str(p.relative_to(ROOT)) for p in pages()]


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every markdown link, fenced code blocks left out; a link's
    text may run over several lines."""
    kept: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            kept.append("")
        else:
            kept.append("" if fenced else line)
    prose = "\n".join(kept)
    return [(prose.count("\n", 0, m.start()) + 1, m.group(1)) for m in LINK.finditer(prose)]


def inside_repo(path: Path) -> bool:
    try:
        path.resolve().relative_to(ROOT)
    except ValueError:
        return False
    return True


def test_pages_found() -> None:
    assert README.is_file()
    assert len(pages()) > 1, "no docs/*.md pages found"


@pytest.mark.parametrize("page", pages(), ids=page_ids())
def test_relative_links_resolve(page: Path) -> None:
    bad = []
    for line, target in links(page.read_text(encoding="utf-8")):
        if target.startswith(EXTERNAL) or target.startswith("#"):
            continue
        path_part = target.split("#", 1)[0].split("?", 1)[0]
        if not path_part:
            continue
        dest = page.parent / path_part
        if not inside_repo(dest):
            bad.append(f"{page.relative_to(ROOT)}:{line}: {target} (outside the repository)")
        elif not dest.exists():
            bad.append(f"{page.relative_to(ROOT)}:{line}: {target} (no such file or folder)")
    assert not bad, "broken links:\n" + "\n".join(bad)


@pytest.mark.parametrize("page", pages(), ids=page_ids())
def test_no_path_outside_the_repository(page: Path) -> None:
    bad = []
    for i, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if "../shared" in line:
            bad.append(f"{page.relative_to(ROOT)}:{i}: ../shared")
            continue
        for m in CLIMB.finditer(line):
            if not inside_repo(page.parent / m.group(1)):
                bad.append(f"{page.relative_to(ROOT)}:{i}: {m.group(1)}")
    assert not bad, "paths outside the repository:\n" + "\n".join(bad)


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES})"
    wide = [f"README.md:{i}: {len(s)} characters" for i, s in enumerate(lines, 1)
            if len(s) > MAX_WIDTH]
    assert not wide, f"lines over {MAX_WIDTH} characters:\n" + "\n".join(wide)


def test_link_pattern() -> None:
    text = ("see [a](docs/x.md), [`b`](docs/y.md#z \"t\"), ![i](img/p.png), "
            "[c](https://e.org) and [d](#top)\n```\n[e](in/code.md)\n```\n"
            "[two\nlines](docs/w.md)\n")
    assert links(text) == [(1, "docs/x.md"), (1, "docs/y.md#z"), (1, "img/p.png"),
                           (1, "https://e.org"), (1, "#top"), (5, "docs/w.md")]
    assert CLIMB.findall("a ../shared/X.md, .../performance.md and x/../y") == [
        "../shared/X.md"]
