"""The engines' own all-reduce kernels (custom one-shot / two-shot over NVLink peer memory),
from a published kernel table, in place of NCCL's small-message latency.

vLLM (``custom_all_reduce``, since PR #2192), SGLang (sgl-kernel's, TensorRT-LLM-derived
since v0.4.2) and TensorRT-LLM (``customAllReduceKernels``) reduce a tensor-parallel
layer's activations with their own kernels up to 8 MiB (vLLM's ``max_size``), NCCL above.
At decode sizes (tokens x hidden x 2 bytes: 16 KiB a token for Llama-3.1-70B) they take
4-10 us where NCCL takes 30-45 us (Vidur's H100 tables, the spec's ``allreduce_latency_s``).

The table: sgl-project/sglang pull request #2904 ("optimize custom allreduce kernel",
2025-01-15), its description's H100 unit-test latencies (``tests/test_trt_reduce.py``,
without CUDA graphs) at TP 2 / 4 / 8 for 512 to 1,048,576 elements: the ``vllm`` rows are
vLLM's kernel, the ``custom allreduce`` rows the TensorRT-LLM-derived one. kvbench reads an
element as 2 bytes (bf16 activations, as the engines reduce them) and interpolates in the
message size (linear in time between tabled sizes, the first size's time below it, the
last two sizes' slope above it, up to :data:`CUSTOM_MAX_BYTES`). Measured on H100 NVLink 4;
the H200 has the same NVLink, so both take it; other cards keep the spec's NCCL figure
(no published table: the record's all-reduce term says which ran).
"""

from __future__ import annotations

from typing import Any

import numpy as np

CUSTOM_MAX_BYTES = 8 * 1024 * 1024  # vLLM's custom all-reduce max_size; NCCL above it
NVLINK4 = ("h100-sxm", "h200")  # the cards the table was measured on (NVLink 4)
ELEMENT_BYTES = 2

_SIZES = (512, 4096, 32768, 262144, 524288, 1048576)  # elements, as tabled
# Milliseconds at TP 2, 4, 8 for each size (sglang #2904).
_TABLES: dict[str, dict[int, tuple[float, ...]]] = {
    "vllm-custom": {
        2: (0.0095, 0.0088, 0.0087, 0.0129, 0.0177, 0.0266),
        4: (0.0091, 0.0085, 0.0092, 0.0206, 0.0269, 0.0402),
        8: (0.0101, 0.0093, 0.0118, 0.0241, 0.0304, 0.0450),
    },
    "trtllm-custom": {
        2: (0.0037, 0.0039, 0.0045, 0.0079, 0.0125, 0.0199),
        4: (0.0048, 0.0037, 0.0048, 0.0139, 0.0202, 0.0311),
        8: (0.0059, 0.0057, 0.0078, 0.0167, 0.0221, 0.0338),
    },
}
KINDS = ("nccl", *_TABLES)
SOURCE = ("sgl-project/sglang#2904 (2025-01-15): H100 custom all-reduce latencies, "
          "vLLM's and the TensorRT-LLM-derived kernel, TP 2/4/8, without CUDA graphs")


def applies(kind: str, hardware: str, tp: int) -> bool:
    """Whether ``kind``'s table prices this card's all-reduces at ``tp``."""
    return kind in _TABLES and hardware in NVLINK4 and tp in _TABLES[kind]


def custom_allreduce_s(kind: str, tp: int, nbytes: Any) -> Any:
    """Seconds of one all-reduce of ``nbytes`` (a float or a numpy array) with the
    ``kind`` kernels at ``tp`` ranks (:func:`applies` said yes), up to
    :data:`CUSTOM_MAX_BYTES` (the caller prices larger messages as NCCL's)."""
    sizes = np.array(_SIZES, dtype=np.float64) * ELEMENT_BYTES
    ms = np.array(_TABLES[kind][tp], dtype=np.float64)
    x = np.asarray(nbytes, dtype=np.float64)
    slope = (ms[-1] - ms[-2]) / (sizes[-1] - sizes[-2])
    t = np.where(x > sizes[-1], ms[-1] + slope * (x - sizes[-1]), np.interp(x, sizes, ms))
    out = t * 1e-3
    return float(out) if out.ndim == 0 else out
