"""`fp8`: paged K/V in float8 e4m3 with a per-(token, KV head) scale (backends.quantized)."""

from __future__ import annotations

import torch

from harness.backends.quantized import QuantizedBackend


class Fp8Backend(QuantizedBackend):
    name = "fp8"
    cache_dtype = torch.float8_e4m3fn
