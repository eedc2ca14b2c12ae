"""Persistent buffers for a step's metadata, filled from the host without a sync.

nano-vllm and vLLM v1 build a step's positions, slot mapping, lengths and block tables
into buffers that live for the whole run: a pinned host buffer written from Python, copied
into its device twin without blocking (``non_blocking=True`` from pinned memory is an
asynchronous DMA; from pageable memory, or ``torch.tensor(list, device=cuda)``, the copy
waits for the device). The device buffer's address never changes, which a CUDA graph
replay needs. On the CPU the host buffer is the tensor itself: nothing is copied.

A pinned buffer must not be rewritten while the copy out of it is still in flight: each
step's copies are followed by an event (:meth:`Staging.end`), and the next step's first
write waits for it (already passed in practice: the step's sampled tokens were read
after it). So a field is written at most once between two ``end()`` calls.
"""

from __future__ import annotations

import numpy as np
import torch

_NP = {torch.int64: np.int64, torch.float32: np.float32, torch.float64: np.float64}


class Staging:
    """The fields of a step's metadata (int64 unless a field is first written with
    another dtype), each a persistent (host, device) pair that grows (doubling) when a
    step needs more than it holds."""

    def __init__(self, device: torch.device, capacity: int = 1024) -> None:
        self.device = device
        self.capacity = capacity
        self._cuda = device.type == "cuda"
        self._host: dict[str, torch.Tensor] = {}
        self._np: dict[str, np.ndarray] = {}
        self._dev: dict[str, torch.Tensor] = {}
        self._copied: torch.cuda.Event | None = None  # after the last step's copies
        self._open = False  # between begin() and end(): a step is writing

    def _buffers(self, name: str, n: int,
                 dtype: torch.dtype = torch.int64) -> tuple[np.ndarray, torch.Tensor]:
        arr = self._np.get(name)
        if arr is None or arr.shape[0] < n:
            size = max(self.capacity, 1 << max(0, (n - 1).bit_length()))
            if self._cuda:  # page-locked, so that the copy to the device is a DMA
                host = torch.zeros(size, dtype=dtype, pin_memory=True)
                arr = host.numpy()
            else:
                arr = np.zeros(size, dtype=_NP[dtype])
                host = torch.from_numpy(arr)
            self._host[name], self._np[name] = host, arr
            self._dev[name] = torch.zeros(size, dtype=dtype, device=self.device) \
                if self._cuda else host
        return arr, self._host[name]

    def begin(self) -> None:
        """Before a step's first write: the previous step's copies out of the pinned
        buffers have finished (a no-op off CUDA). :meth:`put` calls it when a step's
        first write comes without it."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        self._open = True

    def put(self, name: str, values: list[int] | list[float] | range, n: int,
            dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """``values`` (``n`` numbers) into field ``name``; its device tensor (n,) of
        ``dtype`` (the field's, fixed by its first write), valid until the same field is
        written again (the next step)."""
        if not self._open:
            self.begin()
        arr, _ = self._buffers(name, n, dtype)
        if n:
            arr[:n] = values
        return self._publish(name, n)

    def put2d(self, name: str, rows: list[list[int]], width: int) -> torch.Tensor:
        """Rows of ints, each padded with 0 to ``width``, as one int64 (len(rows), width)
        tensor of field ``name`` (contiguous: row stride ``width``)."""
        if not self._open:
            self.begin()
        n = len(rows) * width
        arr, _ = self._buffers(name, n)
        if n:
            # One flat list, one conversion: row by row costs a conversion per row.
            pad = [0] * width
            arr[:n] = [b for r in rows for b in (r + pad[len(r):] if len(r) < width else r)]
        return self._publish(name, n).view(len(rows), width)

    def _publish(self, name: str, n: int) -> torch.Tensor:
        host = self._host[name]
        if not self._cuda:
            return host[:n]
        dev = self._dev[name]
        dev[:n].copy_(host[:n], non_blocking=True)
        return dev[:n]

    def end(self) -> None:
        """After a step's last write: mark its copies (CUDA), so the next :meth:`begin`
        knows when the pinned buffers may be written again."""
        if self._cuda and self._open:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self._open = False
