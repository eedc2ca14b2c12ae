"""Test-wide setup. TRITON_INTERPRET must be set before anything imports triton
(FACTS.md): kernels then run on CPU tensors under Triton's interpreter."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
# Every engine step asserts its invariants (harness.sched.step): e.g. no two new tokens of
# a step share a slot.
os.environ.setdefault("KVBENCH_CHECK", "1")


from harness.checkout_path import unshadow

# `python -m pytest` from the checkout puts it first on sys.path, where our kernels/ would
# shadow Hugging Face's `kernels`, which transformers imports: move it last
# (harness/checkout_path.py).
unshadow()

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Workers run side by side, one per core (scripts/test.sh: -n logical): one thread each,
    # or in-process model tests oversubscribe the cores and all of them slow down.
    torch.set_num_threads(1)

import harness.model as hm  # noqa: E402
from harness.model import load_model  # noqa: E402

# The default model is loaded once per session: our loader (~5 s) and transformers' (~10 s).


@pytest.fixture(scope="session")
def smollm2() -> hm.LoadedModel:
    try:
        hm.default_gguf_path()
    except ValueError as e:
        pytest.skip(f"SmolLM2 GGUF not installed: {e}")
    return load_model("smollm2", dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_transformers() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        path = hm.default_gguf_path()
    except ValueError as e:
        pytest.skip(f"SmolLM2 GGUF not installed: {e}")
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


CORE = Path(__file__).resolve().parent / "core"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """tests/core/ is the core's unit tests (the allocator, pool, ledger, scheduler, waiting
    queue, evicting manager, tiers): marked ``core``, so that ``pytest -m core`` runs them
    alone, in seconds."""
    for item in items:
        if CORE in item.path.parents:
            item.add_marker(pytest.mark.core)
