"""`duo_attention`: DuoAttention (Xiao et al., 2024) as kvpress runs it (DuoAttentionPress),
with the memory its streaming heads drop given back.

When a prompt's prefill ends, each streaming (layer, KV head) keeps the prompt's first
``sink_tokens`` and last ``recent`` tokens, each retrieval head all of it
(harness.kv.policies.duo); what is generated afterwards is kept by every head (as
kvpress: a press compresses the prompt). The ``head_ratio`` share of heads that stream is
chosen at start-up on the model itself (:meth:`DuoAttentionBackend.calibrate`,
backends/duo_heads.py: the heads paying the least attention to distant tokens over a
calibration prompt), never from downloaded patterns. Each head has its own table of pages
(harness.kv.headwise): a streaming head's pages past its sinks and window go back.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from harness.backends.base import BackendOptions
from harness.backends.duo_heads import calibration_ids, measure_heads
from harness.backends.headwise import HeadwiseBackend
from harness.backends.kernel_option import check_kernel
from harness.errors import UserError
from harness.kv.policies.duo import DuoPolicy, check_duo_options, choose_streaming
from harness.kv.policies.headwise import HeadPolicy

if TYPE_CHECKING:
    from harness.model.llama import LlamaModel
    from harness.model.tokenizer import Tokenizer


@dataclass
class DuoAttentionOptions(BackendOptions):
    head_ratio: float = 0.5  # share of (layer, KV head)s that stream (kvpress's
    # head_compression_ratio)
    sink_tokens: int = 128  # a streaming head's first tokens kept (kvpress on the fly: 128)
    recent: int = 256  # and its last ones (kvpress on the fly: 256)
    calibration_tokens: int = 1024  # the calibration prompt, from the model's own text
    # auto | torch | triton: torch only for now (triton refused; backends.kernel_option)
    kernel: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_duo_options(self.head_ratio, self.sink_tokens, self.recent)
        if self.calibration_tokens <= self.sink_tokens + self.recent:
            raise UserError(
                f"backend.calibration_tokens={self.calibration_tokens} must exceed "
                f"backend.sink_tokens + backend.recent ({self.sink_tokens + self.recent}): "
                "its later queries are the ones with distant tokens to measure")
        check_kernel(self, triton_built=False)


# Heads measured per loaded model (weakly held: the model's lifetime) and (calibration
# tokens, sink tokens, recent tokens).
_MEASURED: weakref.WeakKeyDictionary[Any, dict[tuple[int, int, int], np.ndarray]] = \
    weakref.WeakKeyDictionary()


class DuoAttentionBackend(HeadwiseBackend):
    name = "duo_attention"
    Options = DuoAttentionOptions
    # The heads measured at start-up (layers, KV heads) (None: not measured: the what-if).
    calibration: np.ndarray | None = None

    def make_policy(self) -> HeadPolicy:
        o = self.opts
        assert isinstance(o, DuoAttentionOptions)
        return DuoPolicy(self.layout.num_layers, self.layout.num_kv_heads,
                         head_ratio=o.head_ratio, sink=o.sink_tokens, recent=o.recent)

    def calibrate(self, model: LlamaModel, tokenizer: Tokenizer) -> None:
        """Measure every head's attention on distant tokens (backends/duo_heads.py) and
        let the lowest ``head_ratio`` share stream."""
        o, policy = self.opts, self.policy
        assert isinstance(o, DuoAttentionOptions) and isinstance(policy, DuoPolicy)
        n = min(o.calibration_tokens, model.config.max_position_embeddings)
        if n <= o.sink_tokens + o.recent:
            raise UserError(f"backend=duo_attention: the model's {n} positions leave no "
                            "distant token to measure past backend.sink_tokens + "
                            "backend.recent; lower them")
        # One measurement per model and settings in a process: a run builds more stacks
        # on the same model (the quality evaluation's), each a 1,024-token forward.
        known = _MEASURED.setdefault(model, {})
        key = (n, o.sink_tokens, o.recent)
        if key not in known:
            known[key] = measure_heads(model, calibration_ids(tokenizer, n), o.sink_tokens,
                                       o.recent)
        self.calibration = known[key]
        policy.use_streaming(choose_streaming(self.calibration, o.head_ratio).reshape(-1))
