"""Property test: random admissions (with prefix hits across groups), decodes, evictions
and frees against the grouped KV manager (harness.kv.groups), with a shadow cache per slot
of what the K/V there stands for (the group and the token's whole prefix: a hit on another
request's blocks must read back the same). After every step each live sequence must read
back its own tokens in every group, at every position that group still holds (a full
group: all; a sliding group: at least its window; a chunked group: its current chunk),
and the pool's count of used blocks must be the blocks the groups' tables hold. A block
handed to two groups, a window giving back a block it still sees, or a lost block fails."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from harness.kv.base import Demand
from harness.kv.groups import GroupedKVManager, KVGroup
from harness.kv.tiers import GPU, LowerTiers
from harness.layer_types import FULL, LayerAttention
from harness.sched.sequence import Sequence
from tests.helpers import make_seq

BS = 4
# Prompts share one of a few leading runs (multi-turn histories, a system prompt), so
# prefix hits across groups are common.
BASES = [(), tuple(range(12)), (*range(12), 7, 7, 7, 7, 8, 8), (5,) * 20]
PLAN = [KVGroup(FULL, 2), KVGroup(LayerAttention("sliding", 6), 2),
        KVGroup(LayerAttention("chunked", 8), 2)]


class GroupedMachine(RuleBasedStateMachine):
    @initialize(blocks=st.integers(12, 40))
    def setup(self, blocks: int) -> None:
        self.m = GroupedKVManager(blocks, BS, PLAN, watermark=0.0, max_chunk_tokens=16)
        self.live: list[Sequence] = []
        self.shadow: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.hit_tokens = 0

    def _write(self, seq: Sequence, start: int, end: int) -> None:
        for g, member in enumerate(self.m.members):
            table = member.table_of(seq)
            for p in range(start, end):
                slot = table[p // BS] * BS + p % BS
                self.shadow[slot] = (g, tuple(seq.token_ids[:p + 1]))

    def _step_end(self) -> None:
        self.m.end_forward()
        self.m.observe(list(self.live), None)

    @rule(base=st.sampled_from(BASES), tail=st.lists(st.integers(0, 3), max_size=10))
    def admit(self, base: tuple[int, ...], tail: list[int]) -> None:
        seq = make_seq([*base, *tail] or [0])
        hit = self.m.lookup_prefix(seq)
        start = hit.num_blocks * BS
        d = Demand.after(seq, seq.num_tokens - start, hit)
        if not self.m.can_allocate([d], watermark=False):
            return
        self.m.allocate_group([d])
        self.hit_tokens += start
        seq.num_computed = seq.num_tokens
        self._write(seq, start, seq.num_tokens)
        self.live.append(seq)
        self._step_end()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1 << 16), tok=st.integers(0, 5))
    def decode(self, i: int, tok: int) -> None:
        seq = self.live[i % len(self.live)]
        seq.token_ids.append(tok)
        before = self.m.pool.num_used
        slot = self.m.append_slot(seq)
        if slot is None:  # all or nothing: no group took a block
            seq.token_ids.pop()
            assert self.m.pool.num_used == before
            return
        pos = seq.num_computed
        seq.num_computed += 1
        self._write(seq, pos, pos + 1)
        self._step_end()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1 << 16))
    def finish(self, i: int) -> None:
        seq = self.live.pop(i % len(self.live))
        self.m.free(seq)

    @invariant()
    def every_group_reads_back_what_it_must(self) -> None:
        if not hasattr(self, "m"):
            return
        for seq in self.live:
            n = seq.num_computed
            for g, (member, grp) in enumerate(zip(self.m.members, PLAN)):
                a = grp.attention
                table = member.table_of(seq)
                first = 0 if a.kind == "full" else n - a.held(n + 1) + 1 if a.kind == \
                    "chunked" else max(0, n + 1 - a.span)
                for p in range(max(0, first), n):
                    b = table[p // BS]
                    assert b >= 0, f"group {g} gave back position {p} of {n} it still sees"
                    want = (g, tuple(seq.token_ids[:p + 1]))
                    assert self.shadow.get(b * BS + p % BS) == want, (g, p)

    @invariant()
    def pool_counts_the_groups_blocks(self) -> None:
        if not hasattr(self, "m"):
            return
        held = {b for m in self.m.members for s in self.live for b in m.table_of(s) if b >= 0}
        assert self.m.pool.num_used == len(held)
        per_group = [sum(1 for s in self.live for b in m.table_of(s) if b >= 0)
                     for m in self.m.members]
        assert self.m.group_blocks() == per_group
        # No block in two groups' tables (pages of different layers).
        owners: dict[int, int] = {}
        for g, m in enumerate(self.m.members):
            for s in self.live:
                for b in m.table_of(s):
                    if b >= 0:
                        assert owners.setdefault(b, g) == g, f"block {b} in groups {owners[b]}, {g}"

    def teardown(self) -> None:
        if hasattr(self, "m"):
            # Every block's epochs are some group's: the per-group sums are the totals.
            led = self.m.ledger
            led.finish()
            for f in ("reserved", "used", "reservation", "internal"):
                assert sum(getattr(t, f) for t in led.by_tag.values()) == \
                    getattr(led.totals, f), f
            self.m._sum_stats()
            assert self.m.stats.prefix_hit_tokens + self.m.stats.self_hit_tokens == \
                self.hit_tokens


TestGrouped = GroupedMachine.TestCase
TestGrouped.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


class GroupedTiersMachine(GroupedMachine):
    """The same machine with the prefix cache's lower tiers below a small pool: blocks
    leave the device (stores, spills between tiers) and come back (loads) through the
    step's tier ops, applied to a shadow of every tier slot before the step's new tokens
    are written, as the engine applies them before the forward. A load into the wrong
    block, a group's load evicting another group's hit, or an op out of order shows as a
    group reading back another prefix than its own."""

    @initialize(blocks=st.integers(12, 30), cpu=st.integers(1, 8), disk=st.integers(0, 12),
                write=st.sampled_from(["evict", "through"]))
    def setup_tiers(self, blocks: int, cpu: int, disk: int, write: str) -> None:
        self.tiers = LowerTiers([cpu, disk] if disk else [cpu], BS, write)
        self.m = GroupedKVManager(blocks, BS, PLAN, watermark=0.0, max_chunk_tokens=16,
                                  tiers=self.tiers)
        self.live = []
        self.shadow = {}
        self.below: dict[tuple[int, int], list[object]] = {}  # (tier, slot) -> content
        self.hit_tokens = 0

    def setup(self, blocks: int) -> None:  # type: ignore[override]
        pass  # replaced by setup_tiers (one initializer per machine)

    def _apply_tier_ops(self) -> None:
        for op in self.m.take_cache_ops().tier_ops:
            if op.src_tier == GPU:
                content = [self.shadow.get(op.src * BS + i) for i in range(BS)]
            else:
                content = self.below[(op.src_tier, op.src)]
            if op.dst_tier == GPU:
                for i, c in enumerate(content):
                    if c is None:
                        self.shadow.pop(op.dst * BS + i, None)
                    else:
                        self.shadow[op.dst * BS + i] = c  # type: ignore[assignment]
            else:
                self.below[(op.dst_tier, op.dst)] = content

    def _write(self, seq: Sequence, start: int, end: int) -> None:
        self._apply_tier_ops()
        super()._write(seq, start, end)

    def teardown(self) -> None:
        super().teardown()
        if hasattr(self, "tiers"):
            assert not any(t.pinned for t in self.tiers.tiers), "a hit left pinned"


TestGroupedTiers = GroupedTiersMachine.TestCase
# 250 programs (600 took ~17 s of the default run, against the suite's time limit).
TestGroupedTiers.settings = settings(max_examples=250, stateful_step_count=60, deadline=None)
