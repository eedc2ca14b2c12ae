"""``backend.kernel=auto|torch|triton`` on every method backend (issue #56): the methods
without a Triton path (the per-head presses) refuse ``triton`` saying why and run torch
under ``auto``; snapkv's old ``backend.kernel=<width>`` is refused with ``backend.pool_width``;
``run.kernel`` records what ran."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.backends import BACKENDS
from harness.backends.base import KVLayout
from harness.backends.kernel_option import KERNELS
from harness.backends.snapkv import SnapKVBackend, SnapKVOptions
from harness.config import run_config
from harness.errors import UserError
from harness.runner import run
from tests.compose import compose_cfg, tiny

# Backends that are an attention implementation or a storage, not a method.
NOT_METHODS = {"contiguous", "flex", "flash_attn"}
METHODS = sorted(set(BACKENDS) - NOT_METHODS)
# Methods without a Triton path: the per-head tables of issue #59.
TORCH_ONLY = ["pyramidkv", "adakv", "duo_attention"]
LAYOUT = KVLayout(2, 2, 16, torch.float32, rope_inv_freq=(1.0,) * 8)


@pytest.mark.parametrize("name", METHODS)
def test_every_method_takes_the_kernel_option_default_auto(name: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(BACKENDS[name].Options)}
    assert "kernel" in fields, name
    assert fields["kernel"].default == "auto"
    with pytest.raises(UserError, match=r"unknown backend\.kernel 'cuda'"):
        BACKENDS[name](LAYOUT, torch.device("cpu"), kernel="cuda")


@pytest.mark.parametrize("name", TORCH_ONLY)
def test_methods_without_a_triton_path_refuse_it_and_auto_is_torch(name: str) -> None:
    with pytest.raises(UserError) as e:
        run_config(compose_cfg([f"backend={name}", "backend.kernel=triton"]))
    msg = str(e.value)
    assert f"backend={name} has no Triton path yet" in msg
    assert "(layer, KV head)" in msg and "backend.kernel=torch" in msg
    for kernel in ("auto", "torch"):
        assert BACKENDS[name](LAYOUT, torch.device("cpu"), kernel=kernel).kernel == "torch"


@pytest.mark.parametrize("old", ["5", "7"])
def test_snapkv_old_pooling_key_is_refused_with_the_new_one(old: str) -> None:
    with pytest.raises(UserError) as e:
        run_config(compose_cfg(["backend=snapkv", f"backend.kernel={old}"]))
    assert f"use backend.pool_width={old}" in str(e.value)
    with pytest.raises(UserError, match=r"backend\.pool_width=7"):  # built directly, too
        BACKENDS["snapkv"](LAYOUT, torch.device("cpu"), kernel=7)


def test_snapkv_pool_width_is_checked_and_read() -> None:
    with pytest.raises(UserError, match=r"backend.pool_width \(SnapKV's pooling width\) must "
                                        r"be odd and >= 1, got 4"):
        run_config(compose_cfg(["backend=snapkv", "backend.pool_width=4"]))
    rc = run_config(compose_cfg(["backend=snapkv", "backend.pool_width=3",
                                 "backend.kernel=torch"]))
    assert isinstance(rc.backend, SnapKVOptions) and rc.backend.pool_width == 3
    be = SnapKVBackend(LAYOUT, torch.device("cpu"), pool_width=3)
    acc = torch.zeros(1, 1, 9)
    acc[0, 0, 4] = 1.0  # a max-pool of width 3 spreads it to its two neighbours
    assert be.pool(acc).tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0]


def test_kernels_are_the_three_choices() -> None:
    assert KERNELS == ("auto", "torch", "triton")


def test_run_records_the_kernel_that_ran() -> None:
    m = run(tiny("backend=h2o", "backend.kernel=auto")).metrics
    assert m["run.kernel"] == "torch"
