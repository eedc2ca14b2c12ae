"""`int8`: paged K/V in int8 with a per-(token, KV head) scale (backends.quantized)."""

from __future__ import annotations

import torch

from harness.backends.quantized import QuantizedBackend


class Int8Backend(QuantizedBackend):
    name = "int8"
    cache_dtype = torch.int8
