"""Test-wide setup. TRITON_INTERPRET must be set before anything imports triton
(FACTS.md): kernels then run on CPU tensors under Triton's interpreter."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
