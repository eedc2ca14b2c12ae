"""flex: FlexAttention over the paged cache must match `paged` (an independent paged
implementation), on random steps and through the engine; and its block mask must hold
every slot its mask_mod admits, since compiled kernels visit only the listed blocks."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from harness.backends.flex import FlexBackend
from harness.runner import run
from tests.compose import tiny
from tests.flash_attn_standin import (
    PagedScenario,
    allocated,
    run_scenario,
    standard_scenario,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _flex(sc: PagedScenario, in_place: bool | None = None, device: str = "cpu") -> FlexBackend:
    be = allocated("flex", sc, torch.float32, device)
    assert isinstance(be, FlexBackend)
    if in_place is not None:
        be.in_place = in_place
    return be


def _compare(sc: PagedScenario, in_place: bool | None = None, device: str = "cpu",
             tol: float = 1e-5) -> None:
    got = run_scenario(_flex(sc, in_place, device), sc, torch.float32)
    want = run_scenario(allocated("paged", sc, torch.float32, kernel="torch"), sc,
                        torch.float32)
    for step, (g_rows, w_rows) in enumerate(zip(got, want)):
        for item, g, w in zip(sc.steps[step], g_rows, w_rows):
            torch.testing.assert_close(g, w, atol=tol, rtol=tol, msg=f"step {step} {item}")


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2), (3, 1), (2, 2)])  # GQA, MQA, MHA
@pytest.mark.parametrize("bs", [8, 16])
def test_flex_matches_paged_on_random_steps(heads: int, kv_heads: int, bs: int) -> None:
    _compare(standard_scenario(bs, heads, kv_heads, head_dim=16))


def test_in_place_view_matches_paged() -> None:
    # CUDA's view (the whole cache as the KV sequence), run eagerly here.
    _compare(standard_scenario(16, head_dim=16), in_place=True)


@pytest.mark.parametrize("in_place", [True, False])
def test_block_mask_holds_exactly_what_the_tables_allow(in_place: bool) -> None:
    sc = standard_scenario(256, head_dim=16)  # step 0 has 388 rows: 4 query blocks
    be = _flex(sc, in_place)
    bs, slots = sc.block_size, sc.num_blocks * sc.block_size
    steps = sc.steps
    for n in range(1, len(steps) + 1):
        run_scenario(be, PagedScenario(bs, sc.num_blocks, sc.tables, sc.k, sc.v, sc.q[:n],
                                       steps[:n]), torch.float32)
        st = be._step
        assert st is not None
        rows = int(st.q_pos.shape[0])
        kv_blocks = (torch.arange(sc.num_blocks) if st.kv_blocks is None else st.kv_blocks)
        kv_slots = (kv_blocks.unsqueeze(1) * bs + torch.arange(bs)).flatten()
        assert in_place == (st.kv_blocks is None)
        kv_mask = create_mask(st.block_mask.mask_mod, 1, 1, rows, len(kv_slots))[0, 0]
        mask = torch.zeros(rows, slots, dtype=torch.bool)
        mask[:, kv_slots] = kv_mask  # over physical slots
        # Expected from the tables alone: a row sees its own sequence's slots up to its
        # position (decodes first, then chunks, as build_inputs orders them).
        items = steps[n - 1]
        order = [it for it in items if it[2] == 1] + [it for it in items if it[2] != 1]
        want = torch.zeros(rows, slots, dtype=torch.bool)
        r = 0
        for i, start, cnt in order:
            for p in range(start, start + cnt):
                seen = [sc.tables[i][j // bs] * bs + j % bs for j in range(p + 1)]
                want[r, seen] = True
                r += 1
        assert torch.equal(mask, want), f"step {n - 1}"
        # Every admitted slot lies in a block the BlockMask lists for its query block.
        listed = st.block_mask.to_dense()[0, 0].bool()  # (query blocks, KV blocks)
        listed = listed.repeat_interleave(128, 0)[:rows].repeat_interleave(bs, 1)
        assert not (kv_mask & ~listed).any()
        tile = st.block_mask.BLOCK_SIZE
        assert tile == (128, bs)


@pytest.mark.parametrize("extra", [
    (),  # multiturn: follow-up turns hit the prefix cache (shared blocks)
    ("scheduler.max_num_batched_tokens=24", "backend.block_size=8"),  # chunked prefill
])
def test_engine_tokens_equal_paged(extra: tuple[str, ...]) -> None:
    flex = run(tiny("backend=flex", *extra))
    ref = run(tiny("backend=paged", "backend.kernel=torch", *extra))
    assert flex.metrics["run.kernel"] == "flex_eager"
    assert flex.outputs == ref.outputs and sum(map(len, flex.outputs.values())) > 0
    assert flex.metrics["cache.prefix_hit_rate"] > 0


@pytest.mark.gpu
@cuda
def test_compiled_flex_matches_paged_on_cuda() -> None:
    _compare(standard_scenario(16, 4, 2, head_dim=16), device="cuda", tol=2e-5)
    flex = run(tiny("backend=flex", "device=cuda"))
    ref = run(tiny("backend=paged", "backend.kernel=torch", "device=cuda"))
    assert flex.metrics["run.kernel"] == "flex_compiled"
    assert flex.outputs == ref.outputs
