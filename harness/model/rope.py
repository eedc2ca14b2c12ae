"""Rotary position embedding in Hugging Face's rotate-half convention.

Dimension ``i`` of a head is paired with ``i + head_dim/2`` (not ``2i`` with ``2i+1`` as in
the original paper and in GGUF's stored q/k rows): the GGUF loader un-permutes q/k weights so
that both sources meet this one convention.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None = None
) -> Tensor:
    """Per-pair rotation speeds, float32 ``(head_dim // 2,)``.

    ``scaling`` is Hugging Face's ``rope_scaling`` dict; "default", "linear" and "llama3" are
    supported. Computed exactly as ``transformers.modeling_rope_utils`` does (int64 arange,
    then float32) so that logits match it to the last bits.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    raise ValueError(
        f"rope_scaling type {kind!r} is not supported (known: default, linear, llama3)"
    )


def _llama3(inv_freq: Tensor, scaling: dict[str, Any]) -> Tensor:
    # Llama 3.1: long wavelengths (beyond the original context / low_freq_factor) are slowed
    # by `factor`, short ones are kept, the band in between is interpolated smoothly.
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """Rotates q and k of a flat token batch by each token's own position.

    cos/sin tables cover positions ``[0, capacity)``, built in float32 and cast to the
    activation dtype before use, as Hugging Face does (bf16 rotation in a bf16 model).
    The engine sizes them once, at load, to the longest sequence it admits
    (:meth:`reserve`); from then on :meth:`at` gathers a step's cos/sin without reading
    anything back from the device (no host sync, no data-dependent branch: what CUDA graph
    capture and ``torch.compile(fullgraph=True)`` need). Until then (a caller that never
    reserved: tests, tools), tables grow to the next power of two when a larger position
    shows up, which reads the batch's largest position back (one sync).
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.head_dim = head_dim
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device)
        self._cos = torch.empty(0, head_dim // 2, device=device)
        self._sin = torch.empty(0, head_dim // 2, device=device)
        self._cast: dict[torch.dtype, tuple[Tensor, Tensor]] = {}
        self.reserved = 0  # positions [0, reserved) are covered without a check

    @property
    def capacity(self) -> int:
        return self._cos.shape[0]

    def reserve(self, num_positions: int) -> None:
        """Cover positions ``[0, num_positions)`` from now on, with no per-call check
        (a larger position is then an index error on the CPU, a device assert on CUDA)."""
        if num_positions > self.capacity:
            self._grow(num_positions - 1)
        self.reserved = max(self.reserved, num_positions)

    def _grow(self, max_position: int) -> None:
        # A power of two >= 1024: the values at a position do not depend on the size.
        size = 1 << max(10, max_position.bit_length())
        pos = torch.arange(size, device=self.inv_freq.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]
        self._cos, self._sin = freqs.cos(), freqs.sin()
        self._cast.clear()

    def tables(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The whole cos and sin tables as ``dtype``, (capacity, head_dim // 2) each
        (what a kernel that gathers by position itself reads)."""
        return self._tables(dtype)

    def _tables(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if dtype not in self._cast:
            self._cast[dtype] = (self._cos.to(dtype), self._sin.to(dtype))
        return self._cast[dtype]

    def at(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin at ``positions`` int64 (T,), as ``dtype`` (T, 1, head_dim // 2):
        gathered once per forward and shared by every layer (:func:`rotate_pairs`)."""
        if not self.reserved and positions.numel():
            top = int(positions.max())
            if top >= self.capacity:
                self._grow(top)
        cos_t, sin_t = self._tables(dtype)
        return cos_t[positions].unsqueeze(1), sin_t[positions].unsqueeze(1)

    def apply(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Return rotated copies of ``q`` (T, n_heads, hd) and ``k`` (T, n_kv, hd).

        ``positions`` is int64 (T,): each token's index inside its own sequence.
        """
        assert q.shape[0] == k.shape[0] == positions.shape[0], (q.shape, k.shape, positions.shape)
        assert q.shape[-1] == k.shape[-1] == self.head_dim
        if positions.numel() == 0:
            return q, k
        cos, sin = self.at(positions, q.dtype)
        return rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (..., D) rotated pair by pair (i, i + D/2) by angles with ``cos`` / ``sin``
    (..., D/2), broadcast against x's leading dims; a negated ``sin`` rotates back."""
    # Same arithmetic as HF's `x * cos + rotate_half(x) * sin` on the duplicated tables,
    # without materialising rotate_half or the duplicated halves.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
