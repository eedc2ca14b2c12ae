"""``backend.kernel`` as every method backend takes it: ``auto`` | ``torch`` | ``triton``.

``torch`` is each method's reference path; ``triton`` its Triton kernels (compiled on CUDA,
Triton's interpreter on the CPU); ``auto`` picks triton on CUDA where the method has a
Triton path and torch otherwise (backends.paged decides, through
:func:`harness.kernels.runtime.triton_for`). The run records what ran in ``run.kernel``.

A method whose Triton path is not built yet refuses ``triton`` here, when its options are
typed (never a silent fall back to torch); ``auto`` is torch for it.
"""

from __future__ import annotations

from typing import Any

from harness.errors import UserError
from harness.validate import one_of

KERNELS = ("auto", "torch", "triton")

# Where the missing Triton paths are planned: the token-evicting methods (h2o, tova,
# snapkv, knorm, keydiff, observed / expected attention) come after quest and kivi.
PENDING = ("issue #56's second stage, the token-evicting methods' kernels; quest and kivi "
           "have theirs")


def check_kernel(opts: Any, *, triton_built: bool) -> None:
    """``opts.kernel`` is one of :data:`KERNELS`; ``triton`` only where ``triton_built``.
    ``opts``: a backend's options dataclass (its ``name`` and ``kernel``)."""
    one_of(opts, "backend", "kernel", KERNELS)
    if opts.kernel == "triton" and not triton_built:
        name = opts.name or "this method"
        raise UserError(f"backend.kernel=triton: backend={name} has no Triton path yet "
                        f"({PENDING}); use backend.kernel=torch, or auto (torch for {name})")
