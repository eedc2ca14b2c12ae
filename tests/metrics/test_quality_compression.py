"""The quality evaluation sees what a method compresses (issue #57): a prompt-time
compressor gets a prompt it compresses, its row shows the compression, and a setting on
which a method would keep every evaluated token is refused before the run (a backstop
warns when the KV manager counted nothing given back)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.backends.h2o import H2OOptions
from harness.backends.knorm import KnormOptions, KnormPolicy
from harness.backends.snapkv import SnapKVOptions
from harness.errors import UserError
from harness.kv.policies.h2o import H2OPolicy
from harness.kv.policies.snapkv import SnapKVPolicy
from harness.kv.policies.window import WindowPolicy
from harness.quality_check import check_evicted, quality_prefill
from harness.quality_config import QualityConfig
from harness.runner import run
from tests.compose import tiny


def _snapkv(**kw: object) -> SnapKVPolicy:
    return SnapKVPolicy(SnapKVOptions(name="snapkv", **kw))  # type: ignore[arg-type]


def test_prompt_time_compressors_get_a_prompt_they_compress() -> None:
    qc = QualityConfig(enabled=True, text_tokens=512)
    # snapkv and a press compress only a prompt's end: 3/4 of the text is their prompt.
    assert quality_prefill(qc, _snapkv(), "snapkv", 16) == 384
    knorm = KnormPolicy(KnormOptions(name="knorm"))
    assert quality_prefill(qc, knorm, "knorm", 16) == 384
    # Methods that act while decoding, and exact ones, keep the 32-token prompt.
    h2o = H2OPolicy(H2OOptions(name="h2o"))
    assert quality_prefill(qc, h2o, "h2o", 16) == 32
    assert quality_prefill(qc, WindowPolicy(window=256, sinks=4), "sliding_window", 16) == 32
    assert quality_prefill(qc, None, "paged", 16) == 32
    # snapkv with a cap on what it holds while decoding acts on a short prompt too.
    assert quality_prefill(qc, _snapkv(max_tokens=128), "snapkv", 16) == 32


def test_a_method_that_would_keep_everything_is_refused() -> None:
    # The case: snapkv on a 32-token prompt (its window) compresses nothing; it
    # keeps its window + 20% of the prompt, less than the prompt from 42 tokens on.
    qc = QualityConfig(enabled=True, text_tokens=512, prefill_tokens=32)
    with pytest.raises(UserError, match=r"backend snapkv would keep every token of the "
                                        r"evaluated text \(512 tokens, quality\.prefill_"
                                        r"tokens=32\).*keeps 32 of the 32 prompt tokens.*"
                                        r"a prompt of at least 42 tokens"):
        quality_prefill(qc, _snapkv(), "snapkv", 16)
    # A fixed budget larger than the default prompt: the way out names the lengths.
    with pytest.raises(UserError, match=r"quality\.text_tokens>=\d+"):
        quality_prefill(QualityConfig(enabled=True, text_tokens=512),
                        _snapkv(budget=480, budget_ratio=0.0), "snapkv", 16)
    # A window wider than the text; a budget that holds it all.
    with pytest.raises(UserError, match=r"gives a block back only once"):
        quality_prefill(QualityConfig(enabled=True, text_tokens=512),
                        WindowPolicy(window=1024, sinks=4), "sliding_window", 16)
    h2o_all = H2OPolicy(H2OOptions(name="h2o", budget=600, budget_ratio=0.0))
    with pytest.raises(UserError, match=r"its budget \(600 tokens per sequence\) holds"):
        quality_prefill(QualityConfig(enabled=True, text_tokens=512), h2o_all, "h2o", 16)


def test_a_method_keeping_more_gets_the_shortest_prompt_it_compresses() -> None:
    # duo_attention's streaming heads keep sinks + recent tokens: 3/4 of a 500-token text
    # (375) fits in them, so its prompt is the shortest it compresses (389 on model=tiny).
    m = run(tiny("backend=duo_attention", "quality.enabled=true", "quality.num_texts=1",
                 "quality.text_tokens=500", "quality.generation_agreement=false",
                 "workload.conversations=1", "workload.turns=1", "cache.kv_budget=1MiB")).metrics
    assert 375 < m["quality.prefill_tokens"] <= 500 - 16
    assert m["quality.evicted_tokens_per_seq"] > 0 and m["quality.kl_mean"] > 0


def test_no_token_given_back_warns_loudly(capsys: pytest.CaptureFixture[str]) -> None:
    check_evicted("snapkv", _snapkv(), 0.0, 32)
    assert "WARNING: quality: backend snapkv gave back no token" in capsys.readouterr().err
    check_evicted("snapkv", _snapkv(), 12.0, 32)
    check_evicted("paged", None, 0.0, 32)  # evicts nothing by design: nothing to say
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("backend", ["snapkv", "knorm", "pyramidkv", "adakv"])
def test_a_prompt_time_compressor_shows_its_compression(backend: str) -> None:
    common = ("quality.enabled=true", "quality.num_texts=2", "quality.text_tokens=96",
              "quality.generation_agreement=false", "workload.conversations=1",
              "workload.turns=1", "cache.kv_budget=1MiB")
    m = run(tiny(f"backend={backend}", *common)).metrics
    # Its prompt: 3/4 of each text (72 tokens), compressed (snapkv keeps its 32-token
    # window + 20% of 72, knorm 20% of 72, the per-head ones their heads' shares); the 24
    # tokens after it see what is left.
    assert m["quality.prefill_tokens"] == 72 and m["quality.tokens"] == 2 * 24
    assert m["quality.evicted_tokens_per_seq"] > 20
    assert m["quality.kl_mean"] > 1e-4 and abs(m["quality.ppl_delta_pct"]) > 1e-3
    # The same texts on the exact backend: nothing given back, no difference.
    exact = run(tiny("backend=paged", *common, "quality.prefill_tokens=72")).metrics
    assert exact["quality.evicted_tokens_per_seq"] == 0 and exact["quality.kl_mean"] < 1e-6


@pytest.mark.parametrize(("backend", "extra", "why"), [
    ("snapkv", ["quality.prefill_tokens=16"], "keeps 16 of the 16 prompt tokens"),
    # duo_attention's streaming heads keep their sinks and recent tokens: a 72-token
    # prompt (3/4 of 96) fits in them; the way out names the lengths it needs.
    ("duo_attention", [], r"no head gives back a token of a 72-token prompt.*"
                          r"quality\.text_tokens>=\d+")])
def test_the_refusal_comes_before_the_workload_runs(tmp_path: Path, backend: str,
                                                    extra: list[str], why: str) -> None:
    with pytest.raises(UserError, match=f"backend {backend} would keep every token.*{why}"):
        run(tiny(f"backend={backend}", "quality.enabled=true", "quality.text_tokens=96",
                 *extra, out_dir=tmp_path))
    assert not (tmp_path / "steps.csv").exists() and not (tmp_path / "metrics.json").exists()
