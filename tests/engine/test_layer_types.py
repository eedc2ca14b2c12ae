"""Per-layer attention types (harness.layer_types, issue #29's first step): read from
config.json as transformers reads them, the three hybrid presets' KV bytes per token per
group by hand count, and the refusal of a model a uniform cache would misreport."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.errors import UserError
from harness.layer_types import FULL, LayerAttention, describe, from_hf, groups, held_bytes
from harness.model import load_model, save_hf
from harness.roofline.hf_config import from_hf_config
from harness.roofline.models import GEMMA_2_27B, GEMMA_3_27B, GPT_OSS_120B, LLAMA_4_SCOUT
from harness.runner import run
from tests.compose import compose_cfg, tiny

S128, S1024 = LayerAttention("sliding", 128), LayerAttention("sliding", 1024)
C8192 = LayerAttention("chunked", 8192)


def test_gemma3_pattern_every_sixth_layer_global() -> None:
    layers = from_hf({"sliding_window": 1024, "sliding_window_pattern": 6}, 62)
    assert [i for i, a in enumerate(layers) if a == FULL] == list(range(5, 62, 6))
    assert describe(layers) == "10 full + 52 sliding 1024"
    assert layers == GEMMA_3_27B.layer_attention


def test_layer_types_list_and_its_errors() -> None:
    names = ["sliding_attention", "full_attention"] * 18
    layers = from_hf({"layer_types": names, "sliding_window": 128}, 36)
    assert layers[0] == S128 and layers[1] == FULL and layers == GPT_OSS_120B.layer_attention
    with pytest.raises(UserError, match="35 entries"):
        from_hf({"layer_types": names[:35], "sliding_window": 128}, 36)
    with pytest.raises(UserError, match="unknown layer type 'local'"):
        from_hf({"layer_types": ["local"] * 2, "sliding_window": 128}, 2)
    with pytest.raises(UserError, match="sliding_window=None"):
        from_hf({"layer_types": names}, 36)


def test_llama4_chunks_on_rope_layers() -> None:
    given = from_hf({"attention_chunk_size": 8192, "no_rope_layers": [1, 1, 1, 0] * 12}, 48)
    default = from_hf({"attention_chunk_size": 8192}, 48)  # transformers: every 4th NoPE
    assert given == default == LLAMA_4_SCOUT.layer_attention
    assert [i for i, a in enumerate(given) if a == FULL] == list(range(3, 48, 4))


def test_sliding_window_alone() -> None:
    assert from_hf({"model_type": "mistral", "sliding_window": 4096}, 4) == \
        (LayerAttention("sliding", 4096),) * 4
    assert from_hf({"model_type": "mistral", "sliding_window": None}, 4) == (FULL,) * 4
    # Qwen2 carries a window it does not use unless told to, from max_window_layers on.
    assert from_hf({"model_type": "qwen2", "sliding_window": 4096,
                    "use_sliding_window": False}, 4) == (FULL,) * 4
    assert from_hf({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True,
                    "max_window_layers": 2}, 4) == (FULL, FULL) + (
        LayerAttention("sliding", 64),) * 2


def test_hybrid_presets_bytes_per_token_per_group_by_hand() -> None:
    """bf16 K and V: 2 x KV heads x head_dim x 2 bytes per token and layer."""
    per_layer = {"gpt-oss-120b": 2 * 8 * 64 * 2, "Gemma-3-27B": 2 * 16 * 128 * 2,
                 "Llama-4-Scout": 2 * 8 * 128 * 2}
    want = {"gpt-oss-120b": [(FULL, 18 * 2048), (S128, 18 * 2048)],
            "Gemma-3-27B": [(FULL, 10 * 8192), (S1024, 52 * 8192)],
            "Llama-4-Scout": [(FULL, 12 * 4096), (C8192, 36 * 4096)]}
    for a in (GPT_OSS_120B, GEMMA_3_27B, LLAMA_4_SCOUT):
        assert a.kv_elems_per_layer * 2 == per_layer[a.name]
        got = [(g, n * a.kv_elems_per_layer * 2) for g, n in groups(a.layer_attention)]
        assert got == want[a.name]
    # At 32k tokens a Gemma-3-27B sequence needs its 10 full layers' every token and
    # its 52 sliding layers' last 1024: 3.12 GB, not a uniform cache's 16.6 GB.
    assert held_bytes(GEMMA_3_27B.layer_attention, 8192, 32768) == \
        10 * 8192 * 32768 + 52 * 8192 * 1024
    # A chunked layer holds the current chunk: 8192 at a chunk's end, 1 past it.
    assert C8192.held(8192) == 8192 and C8192.held(8193) == 1 and C8192.held(100) == 100
    # Published sizes: gpt-oss-120b 117B (5.1B active), Gemma 3 27B, Scout 109B (17B).
    assert GPT_OSS_120B.total_params() == pytest.approx(117e9, rel=0.01)
    assert GEMMA_3_27B.total_params() == pytest.approx(27e9, rel=0.01)
    assert LLAMA_4_SCOUT.total_params() == pytest.approx(109e9, rel=0.02)
    # Gemma 2 27B: alternating, layer 0 sliding (transformers' rule), 27.2B.
    assert GEMMA_2_27B.layer_attention == from_hf(
        {"layer_types": ["sliding_attention", "full_attention"] * 23,
         "sliding_window": 4096}, 46)
    assert GEMMA_2_27B.total_params() == pytest.approx(27.2e9, rel=0.01)


def roofline(*extra: str) -> dict[str, object]:
    return run(compose_cfg(["executor=roofline", "roofline.hardware=h100-sxm",
                            "cache.kv_budget=auto", "workload=random",
                            "workload.num_requests=4", *extra])).metrics


def test_hybrid_models_run_grouped_or_are_refused(tmp_path: Path) -> None:
    """In the what-if a hybrid model's cache is KV cache groups (harness.kv.groups); a
    backend whose costs do not split by layer is refused, not misreported."""
    m = roofline("roofline.model=Gemma-3-27B", "roofline.tp=8")
    assert m["run.kv_groups"] == "1 full + 6 sliding 1024 (10 layers a group; 8 padded)"
    with pytest.raises(UserError, match=r"10 full \+ 52 sliding 1024.*backend quest"):
        roofline("roofline.model=Gemma-3-27B", "roofline.tp=8", "backend=quest")
    cfg = {"model_type": "gemma3_text", "num_hidden_layers": 62, "hidden_size": 5376,
           "intermediate_size": 21504, "num_attention_heads": 32, "num_key_value_heads": 16,
           "head_dim": 128, "vocab_size": 262208, "sliding_window": 1024,
           "sliding_window_pattern": 6}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    assert from_hf_config(p).layer_attention == GEMMA_3_27B.layer_attention
    assert roofline(f"roofline.model={p}", "roofline.tp=8")["run.kv_groups"] == \
        m["run.kv_groups"]


def test_a_windowed_model_runs_its_window_on_paged_or_its_own_backend(
        tmp_path: Path) -> None:
    """A Mistral-style folder with a 32-token window on every layer: paged runs it as one
    sliding KV cache group (its layers masked to the window, blocks outside it given
    back), with the same tokens as its own window backend; a backend that cannot attend
    per layer is refused, never run with full attention."""
    folder = tmp_path / "mistral"
    save_hf(load_model("tiny").model, folder, byte_tokenizer=True)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(model_type="mistral", sliding_window=32)
    (folder / "config.json").write_text(json.dumps(raw))
    grouped = run(tiny("model=hf", f"model.path={folder}"))
    own = run(tiny("model=hf", f"model.path={folder}", "backend=sliding_window",
                   "backend.window=32", "backend.sink_tokens=0"))
    assert grouped.metrics["requests.finished"] > 0
    assert grouped.metrics["run.kv_groups"] == "1 sliding 32 (2 layers a group)"
    assert grouped.outputs == own.outputs
    assert grouped.metrics["cache.evicted_tokens"] > 0
    assert own.metrics["run.kv_groups"] == "the model's own window: 2 sliding 32, one cache"
    # Another window over a model that has no full layer would apply to none: refused.
    with pytest.raises(UserError, match=r"no full-attention layer.*backend\.window=32 "
                       r"backend\.sink_tokens=0"):
        run(tiny("model=hf", f"model.path={folder}", "backend=sliding_window",
                 "backend.window=16"))
    with pytest.raises(UserError, match=r"backend quest cannot attend per layer"):
        run(tiny("model=hf", f"model.path={folder}", "backend=quest"))


@pytest.mark.parametrize("raw,phrase", [
    ({"sliding_window": "512", "sliding_window_pattern": 6}, "sliding_window='512'"),
    ({"sliding_window": 0, "sliding_window_pattern": 6}, "sliding_window=0"),
    ({"sliding_window": None, "sliding_window_pattern": 6}, "sliding_window=None"),
    ({"sliding_window": 512, "sliding_window_pattern": 0}, "sliding_window_pattern=0"),
    ({"model_type": "gemma3_text", "sliding_window": None}, "sliding_window=None"),
])
def test_gemma3_window_fields_that_are_not_positive_integers_are_refused(
        raw: dict[str, object], phrase: str) -> None:
    """Issue #55: a text, 0 or null in Gemma 3's window fields made every layer full or
    every layer sliding, silently (or a traceback later, for a text)."""
    with pytest.raises(UserError, match=re.escape(phrase) + " is not a positive integer"):
        from_hf(raw, 12)


def test_the_error_band_is_only_where_it_was_validated() -> None:
    """Issue #55: the what-if printed its dense-Llama error band for MoE and hybrid models
    it was never validated on. A dense validated run carries it; Gemma 3 (hybrid) and
    gpt-oss (MoE, and hybrid) say they are unvalidated."""
    # (trtllm on Hopper: a band of the blind set; vllm-0.6, the default, has no blind point)
    dense = roofline("roofline.model=Llama-3.1-8B", "roofline.engine=trtllm",
                     "scheduler.max_num_seqs=64", "scheduler.max_num_batched_tokens=4096")
    assert dense["roofline.expected_error_pct"] > 0 and "median" in dense["run.expected_error"]
    for model, kind in (("Gemma-3-27B", "a hybrid-attention model"),
                        ("gpt-oss-120b", "a mixture-of-experts model")):
        m = roofline(f"roofline.model={model}", "roofline.tp=8")
        assert "roofline.expected_error_pct" not in m, model
        assert m["run.expected_error"].endswith(
            f"unvalidated: the published points validate dense models only, not {kind}")
