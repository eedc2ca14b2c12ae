"""Count what a GPU step would wait for, on any device: host syncs, ops and kernel launches.

On CUDA a host sync (a value read back, a shape that depends on data) stalls the CPU until
the GPU has caught up, so a step that syncs once per layer is paced by the host, and it
also forbids CUDA-graph capture. These counts do not depend on the device: the same calls
sync on CUDA that are counted here on the CPU, so a CPU test can hold the engine to a
budget of syncs per step (issue #31 / tracker #50).

What counts as a sync:
- ATen ops whose result is a host value or a data-dependent shape: ``_local_scalar_dense``
  (``item()``, ``int(t)``, ``bool(t)``, a tensor as a slice bound), ``nonzero``, ``unique``
  and its variants, ``masked_select``, ``equal``, ``repeat_interleave`` with tensor repeats
  and no output size, and indexing (``index``, ``index_put``) with a boolean mask (which
  runs ``nonzero`` to find its size);
- the Tensor methods that copy to the host: ``tolist``, ``item``, ``cpu``, ``numpy``
  (patched: on the CPU ``cpu()`` and ``numpy()`` dispatch nothing, yet on CUDA each is a
  blocking copy). Ops dispatched inside one of them are not counted again, nor is
  ``numpy()`` of what a counted ``cpu()`` returned (one transfer).

``ops`` counts every ATen op that is not a view (a view launches no kernel): with the
Triton launches of harness.kernels (stubbed by :func:`count_launches`, which runs the real
kernel with counting paused), the kernels a step launches.
"""

from __future__ import annotations

import contextlib
import importlib
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops that read a value back or size their output by the data.
_SYNC_OPS = {
    aten._local_scalar_dense, aten.nonzero, aten.nonzero_static, aten._unique,
    aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.unique_dim_consecutive,
    aten.masked_select, aten.equal, aten.is_nonzero, aten.item,
}
# Indexing ops that sync when an index is a boolean mask.
_INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
_HOST_METHODS = ("tolist", "item", "cpu", "numpy")


def _has_bool_index(args: tuple[Any, ...]) -> bool:
    if len(args) < 2:
        return False
    idx = args[1]
    return isinstance(idx, list | tuple) and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)


class HostSyncCounter(TorchDispatchMode):
    """A dispatch mode that counts host syncs (by cause) and non-view ops.

    Use as a context manager; :meth:`paused` stops counting inside (a stubbed kernel's
    reference, a check that is not part of the measured path)."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.syncs: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()
        self.launches: Counter[str] = Counter()
        self._quiet = 0  # > 0: inside a patched host method or a paused region

    @property
    def num_syncs(self) -> int:
        return sum(self.syncs.values())

    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def num_launches(self) -> int:
        return sum(self.launches.values())

    def snapshot(self) -> tuple[int, int, int]:
        """(syncs, non-view ops, Triton launches) so far."""
        return self.num_syncs, self.num_ops, self.num_launches

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):  # flex_attention: one kernel
            if not self._quiet:
                self.ops[func.name()] += 1
            return func(*args, **kwargs)
        if not self._quiet:
            packet = func.overloadpacket
            name = packet.__name__
            if packet in _SYNC_OPS:
                self.syncs[name] += 1
            elif packet in _INDEX_OPS and _has_bool_index(args):
                self.syncs[f"{name}[bool mask]"] += 1
            elif packet is aten.repeat_interleave and func is aten.repeat_interleave.Tensor \
                    and kwargs.get("output_size") is None:
                self.syncs[name] += 1
            # A kvbench custom op wraps Triton launches, which count_launches counts.
            if not func.is_view and func.namespace != "kvbench":
                self.ops[name] += 1
        return func(*args, **kwargs)

    def __enter__(self) -> HostSyncCounter:
        super().__enter__()
        self._undo = _patch_host_methods(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._undo()
        super().__exit__(*exc)


def _patch_host_methods(counter: HostSyncCounter) -> Callable[[], None]:
    originals = {name: getattr(torch.Tensor, name) for name in _HOST_METHODS}

    # What a counted cpu() returned is on the host already: its numpy() copies nothing
    # (``t.cpu().numpy()`` is one transfer).
    fetched: set[int] = set()  # ids of live tensors a counted cpu() returned

    def wrap(name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        def method(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            if counter._quiet or (name == "numpy" and id(self) in fetched):
                return orig(self, *a, **k)
            counter.syncs[f"Tensor.{name}"] += 1
            with counter.paused():
                out = orig(self, *a, **k)
            if name == "cpu" and isinstance(out, torch.Tensor):
                fetched.add(id(out))
                weakref.finalize(out, fetched.discard, id(out))
            return out
        return method

    for name, orig in originals.items():
        setattr(torch.Tensor, name, wrap(name, orig))

    def undo() -> None:
        for name, orig in originals.items():
            setattr(torch.Tensor, name, orig)
    return undo


KERNEL_MODULES = ("harness.kernels.store", "harness.kernels.decode", "harness.kernels.prefill",
                  "harness.kernels.layers", "harness.kernels.quest", "harness.kernels.kivi",
                  "harness.kernels.scores")


class _StubKernel:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` counts one launch and
    runs the real kernel with counting paused (the interpreter's own host copies are not
    the engine's)."""

    def __init__(self, name: str, kernel: Any, counter: HostSyncCounter) -> None:
        self.name, self.kernel, self.counter = name, kernel, counter

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            self.counter.launches[self.name] += 1
            with self.counter.paused():
                return launch(*args, **kwargs)
        return run


@contextlib.contextmanager
def count_launches(counter: HostSyncCounter) -> Iterator[None]:
    """Count every launch of the Triton kernels of harness.kernels into ``counter``
    (imports the kernel modules: triton must be usable, e.g. under TRITON_INTERPRET=1)."""
    undo: list[tuple[Any, str, Any]] = []
    for modname in KERNEL_MODULES:
        mod = importlib.import_module(modname)
        for attr, obj in vars(mod).items():
            if attr.startswith("_") and attr.endswith("_kernel") and hasattr(obj, "__getitem__"):
                undo.append((mod, attr, obj))
                setattr(mod, attr, _StubKernel(attr, obj, counter))
    try:
        yield
    finally:
        for mod, attr, obj in undo:
            setattr(mod, attr, obj)


@dataclass(slots=True)
class StepCount:
    """One engine step: whether every scheduled sequence decoded (one token each), and what
    the step did on the host (syncs, non-view ops, Triton launches), or its wall seconds
    when timed instead."""

    decode_only: bool
    batch: int
    syncs: int = 0
    ops: int = 0
    launches: int = 0
    seconds: float = 0.0


@dataclass
class StepProfile:
    """Every step of the runs made inside :func:`profile_steps`, and what caused the syncs."""

    steps: list[StepCount] = field(default_factory=list)
    causes: Counter[str] = field(default_factory=Counter)
    ops: Counter[str] = field(default_factory=Counter)

    def decode_steps(self) -> list[StepCount]:
        return [s for s in self.steps if s.decode_only]

    def per_decode_step(self, key: str) -> float:
        """Mean of ``key`` (syncs, ops, launches, seconds) over the decode-only steps."""
        d = self.decode_steps()
        assert d, "no decode-only step was profiled"
        return sum(getattr(s, key) for s in d) / len(d)

    def run_syncs_per_decode_step(self) -> float:
        """Every step's syncs (prefills included) over the decode-only steps: the whole
        engine loop's syncs charged to its decodes."""
        d = self.decode_steps()
        assert d, "no decode-only step was profiled"
        return sum(s.syncs for s in self.steps) / len(d)


@contextlib.contextmanager
def profile_steps(count: bool = True, launches: bool = False) -> Iterator[StepProfile]:
    """Profile every :meth:`Engine.step` of the model executor run inside: with ``count``,
    the syncs, ops (and with ``launches`` the Triton launches) of each step, from its
    scheduling to its metrics row; without, each step's wall seconds (nothing patched
    inside the step, so nothing slows it)."""
    import time

    from harness.engine.engine import Engine
    from harness.engine.executor import ModelExecutor

    prof = StepProfile()
    counter = HostSyncCounter()
    orig_step, orig_forward = Engine.step, ModelExecutor.forward
    kind: list[tuple[bool, int]] = []

    def forward(self: ModelExecutor, rec: Any) -> Any:
        kind.append((all(s.is_decode for s in rec.seqs), len(rec.seqs)))
        return orig_forward(self, rec)

    def step(self: Engine, *a: Any, **k: Any) -> bool:
        kind.clear()
        if not count:
            t0 = time.perf_counter()
            ran = orig_step(self, *a, **k)
            seconds = time.perf_counter() - t0
            syncs = ops = nl = 0
        else:
            before = counter.snapshot()
            with counter:
                ran = orig_step(self, *a, **k)
            syncs, ops, nl = (x - y for x, y in zip(counter.snapshot(), before, strict=True))
            seconds = 0.0
        if kind:
            prof.steps.append(StepCount(kind[0][0], kind[0][1], syncs, ops, nl, seconds))
        return ran

    Engine.step = step  # type: ignore[method-assign]
    ModelExecutor.forward = forward  # type: ignore[method-assign]
    try:
        with count_launches(counter) if launches else contextlib.nullcontext():
            yield prof
    finally:
        Engine.step = orig_step  # type: ignore[method-assign]
        ModelExecutor.forward = orig_forward  # type: ignore[method-assign]
        prof.causes.update(counter.syncs)
        prof.ops.update(counter.ops)
