"""The block pool's eviction orders and admission rules (harness/kv/eviction.py) against
brute-force references: random allocations, releases, prefix hits and missed lookups on a
real BlockPool, the pool's next-to-evict order and every eviction compared, op by op, with
a reference that keeps each cached block's history in plain lists and sorts it. The same
orders over the lower tiers' slots (harness/kv/tiers.py, cache.tiers.<tier>_policy) are
held to the same reference: random stores, spills, loads (pinned while the step stores)
and missed lookups on a real LowerTiers."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.kv.block_pool import BlockPool
from harness.kv.eviction import EVICTIONS
from harness.kv.tiers import CPU, DISK, LowerTiers

N, BS = 8, 2


@dataclass
class Ref:
    """A brute-force model of the cached blocks' order under ``policy``."""

    policy: str
    n: int = N  # the host's size (arc's ghosts, slru's protected share)
    t: int = 0
    floor: float = 0.0
    uses: dict[int, int] = field(default_factory=dict)
    depth: dict[int, int] = field(default_factory=dict)
    first: dict[int, int] = field(default_factory=dict)  # first cached since computed
    cached: dict[int, tuple[float, int]] = field(default_factory=dict)  # block -> key
    # slru / arc: explicit lists, least recent first
    prob: list[int] = field(default_factory=list)
    prot: list[int] = field(default_factory=list)
    t1: list[int] = field(default_factory=list)
    t2: list[int] = field(default_factory=list)
    b1: list[int] = field(default_factory=list)
    b2: list[int] = field(default_factory=list)
    back: set[int] = field(default_factory=set)
    p: float = 0.0

    def allocated(self, b: int, depth: int) -> None:
        self.uses[b], self.depth[b] = 1, depth
        self.first.pop(b, None)

    def insert(self, b: int, name: int) -> None:
        self.t += 1
        self.first.setdefault(b, self.t)
        u, d = self.uses[b], self.depth[b]
        if self.policy == "lru":
            self.cached[b] = (self.t, 0)
        elif self.policy == "fifo":
            self.cached[b] = (self.first[b], 0)
        elif self.policy == "lfu":
            self.cached[b] = (self.floor + u, self.t)
        elif self.policy == "cost":
            self.cached[b] = (self.floor + u * (d + 1), self.t)
        elif self.policy == "slru":
            if u > 1:
                self.prot.append(b)
                if len(self.prot) > int(0.8 * self.n):
                    self.prob.append(self.prot.pop(0))
            else:
                self.prob.append(b)
        else:  # arc
            if u > 1 or name in self.back:
                self.back.discard(name)
                self.t2.append(b)
            else:
                self.t1.append(b)

    def remove(self, b: int) -> None:
        self.cached.pop(b, None)
        for lst in (self.prob, self.prot, self.t1, self.t2):
            if b in lst:
                lst.remove(b)

    def missed(self, name: int) -> None:
        if self.policy != "arc":
            return
        if name in self.b1:
            self.p = min(float(self.n), self.p + max(len(self.b2) / len(self.b1), 1.0))
            self.b1.remove(name)
            self.back.add(name)
        elif name in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            self.b2.remove(name)
            self.back.add(name)

    def order(self) -> list[int]:
        if self.policy in ("slru",):
            return [*self.prob, *self.prot]
        if self.policy == "arc":
            t1, t2, out = list(self.t1), list(self.t2), []
            while t1 or t2:
                if t1 and (len(t1) > self.p or not t2):
                    out.append(t1.pop(0))
                else:
                    out.append(t2.pop(0))
            return out
        return sorted(self.cached, key=lambda b: self.cached[b])

    def evict(self, n: int, names: dict[int, int]) -> list[int]:
        out = []
        for _ in range(n):
            b = self.order()[0]
            if self.policy in ("lfu", "cost"):
                self.floor = self.cached[b][0]
            if self.policy == "arc":
                ghosts = self.b1 if b in self.t1 else self.b2
                self.remove(b)
                if names[b] in ghosts:
                    ghosts.remove(names[b])
                ghosts.append(names[b])
                while len(self.b1) + len(self.b2) > self.n:
                    (self.b1 if len(self.b1) >= len(self.b2) else self.b2).pop(0)
            else:
                self.remove(b)
            out.append(b)
        return out


# Releases outnumber allocations, so that the pool fills with cached blocks and most
# allocations evict (checked: tests below count the evictions).
OPS = st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "release", "release", "release",
                                          "hit", "miss"]),
                         st.integers(0, 10 ** 6), st.integers(1, 3)),
               min_size=20, max_size=150)


@pytest.mark.parametrize("policy", EVICTIONS)
@settings(max_examples=120, deadline=None)
@given(ops=OPS)
def test_every_eviction_order_equals_its_reference(policy: str,
                                                   ops: list[tuple[str, int, int]]) -> None:
    pool = BlockPool(N, BS)
    pool.set_policy(policy, "always")
    ref = Ref(policy)
    names: dict[int, int] = {}  # block -> its name now
    gone: list[int] = []  # names evicted (a lookup of one misses)
    next_name = 1
    for op, r, k in ops:
        held = [b for b in range(N) if pool.ref[b] > 0]
        if op == "alloc" and pool.num_free >= k:
            plain = pool.num_free - pool.num_cached_free
            expect = ref.evict(max(0, k - plain), names)
            out = pool.allocate_all(k, fill=BS)
            assert [b for b in out if b in names] == expect, (policy, out, expect)
            for b in out:
                if b in names:
                    gone.append(names.pop(b))
            for b in out:
                depth = (r + b) % 5
                if r % 3 == 0 and gone:  # evicted content computed again
                    name = gone.pop(r % len(gone))
                else:
                    name, next_name = next_name, next_name + 1
                pool.register(b, name, depth=depth)
                names[b] = name
                ref.allocated(b, depth)
        elif op == "release" and held:
            b = held[r % len(held)]
            pool.release(b)
            if pool.ref[b] == 0:
                ref.insert(b, names[b])
        elif op == "hit" and names:
            b = sorted(names)[r % len(names)]
            assert pool.lookup(names[b]) == b
            if pool.ref[b] == 0:
                ref.remove(b)
            pool.touch(b)
            ref.uses[b] += 1
        elif op == "miss" and gone:
            h = gone[r % len(gone)]
            if h not in names.values():
                assert pool.lookup(h) is None
                ref.missed(h)
        assert pool.lru_order() == ref.order(), (policy, op)
        assert pool.num_cached_free == len(ref.order())
        assert pool.next_victim() == (ref.order() or [None])[0]


@dataclass
class RefTiers:
    """A brute-force model of LowerTiers (harness/kv/tiers.py) over :class:`Ref` orders:
    each tier's names by slot, its fresh slots, and the blocks that fell out."""

    refs: list[Ref]
    caps: list[int]
    held: list[dict[int, int]] = field(default_factory=lambda: [{}, {}])  # name -> slot
    name: list[dict[int, int]] = field(default_factory=lambda: [{}, {}])  # slot -> name
    depth: list[dict[int, int]] = field(default_factory=lambda: [{}, {}])  # slot -> depth
    fresh: list[int] = field(default_factory=lambda: [0, 0])
    spare: list[list[int]] = field(default_factory=lambda: [[], []])  # slots lost blocks left
    dropped: int = 0

    def store(self, name: int, depth: int) -> None:
        if name in self.held[0]:
            self.touch(0, name)
            return
        slot = self.take(0)
        if slot is None:
            self.dropped += 1
        else:
            self.put(0, name, slot, depth)

    def take(self, i: int) -> int | None:
        if self.spare[i]:
            return self.spare[i].pop()
        if self.fresh[i] < self.caps[i]:
            self.fresh[i] += 1
            return self.fresh[i] - 1
        if not self.refs[i].order():
            return None  # every block pinned
        (slot,) = self.refs[i].evict(1, self.name[i])
        name, depth = self.name[i][slot], self.depth[i][slot]
        del self.held[i][name]
        if i + 1 == len(self.caps):
            self.dropped += 1
        elif name in self.held[i + 1]:
            self.touch(i + 1, name)
        else:
            dst = self.take(i + 1)
            if dst is None:
                self.dropped += 1
            else:
                self.put(i + 1, name, dst, depth)
        return slot

    def put(self, i: int, name: int, slot: int, depth: int) -> None:
        self.held[i][name], self.name[i][slot], self.depth[i][slot] = slot, name, depth
        self.refs[i].allocated(slot, depth)
        self.refs[i].insert(slot, name)

    def touch(self, i: int, name: int) -> None:
        self.refs[i].remove(self.held[i][name])
        self.refs[i].insert(self.held[i][name], name)

    def lose(self, i: int, name: int) -> None:
        """``name``'s copy in tier ``i`` is lost (a failed disk write): its slot is spare."""
        slot = self.held[i].pop(name)
        self.refs[i].remove(slot)
        self.spare[i].append(slot)

    def lookup(self, name: int) -> int | None:
        """The tier holding ``name`` (None: none); the tiers above it missed it."""
        for i in range(len(self.caps)):
            if name in self.held[i]:
                return i
            self.refs[i].missed(name)
        return None


# Stores (new content, or content seen before), loads (a lookup, the block pinned while
# ``k - 1`` more stores run, then unpinned), lookups of content no tier holds, and disk
# blocks lost (a failed write: LowerTiers.lose, issue #55).
TIER_OPS = st.lists(st.tuples(st.sampled_from(["store", "store", "store", "load", "miss",
                                               "lose"]),
                              st.integers(0, 10 ** 6), st.integers(1, 3)),
                    min_size=20, max_size=150)
CAPS = [4, 3]  # a CPU tier of 4 slots, a disk tier of 3


@pytest.mark.parametrize("i", range(len(EVICTIONS)))
@settings(max_examples=100, deadline=None)
@given(ops=TIER_OPS)
def test_every_eviction_order_over_a_tiers_slots_equals_its_reference(
        i: int, ops: list[tuple[str, int, int]]) -> None:
    """Each order runs the CPU tier, the next order in the list the disk tier below it."""
    policies = [EVICTIONS[i], EVICTIONS[(i + 1) % len(EVICTIONS)]]
    tiers = LowerTiers(CAPS, BS, policies=policies)
    ref = RefTiers([Ref(p, n=c) for p, c in zip(policies, CAPS)], CAPS)
    seen: list[int] = []  # every content stored so far
    next_name = 1
    for op, r, k in ops:
        if op == "store":
            if r % 3 == 0 and seen:  # content seen before: held (a touch) or fallen out
                name = seen[r % len(seen)]
            else:
                name, next_name = next_name, next_name + 1
                seen.append(name)
            tiers.store(0, name, owner=1, depth=r % 5)
            ref.store(name, r % 5)
        elif op == "load":
            held = sorted(h for t in ref.held for h in t)
            if not held:
                continue
            name = held[r % len(held)]
            hit = tiers.lookup(name)
            level = ref.lookup(name)
            assert hit is not None and level is not None and hit.tier == CPU + level
            tiers.pin([hit])
            rf = ref.refs[level]
            rf.remove(ref.held[level][name])
            rf.uses[ref.held[level][name]] += 1
            for _ in range(k - 1):  # the step's stores, the loaded block pinned
                tiers.store(0, next_name, owner=1, depth=k)
                ref.store(next_name, k)
                seen.append(next_name)
                next_name += 1
            tiers.unpin([hit])
            rf.insert(ref.held[level][name], name)
        elif op == "miss" and seen:
            name = seen[r % len(seen)]
            if all(name not in t for t in ref.held):
                assert tiers.lookup(name) is None
                ref.lookup(name)
        elif op == "lose" and ref.held[1]:
            name = sorted(ref.held[1])[r % len(ref.held[1])]
            tiers.lose(DISK, ref.held[1][name])
            ref.lose(1, name)
        for t, rf, held in zip(tiers.tiers, ref.refs, ref.held):
            assert [s for _, s in t.order()] == rf.order(), (policies, op, t.name)
            assert t.slots == held and t.num_cached_free == len(rf.order())
        assert tiers.stats.dropped_blocks == ref.dropped


def test_a_tiers_order_grows_with_its_slots_and_reads_their_names() -> None:
    """A tier of a billion slots holds per-slot state only for the slots it used; arc's
    ghosts remember a spilled block's name, so content that comes back after a miss
    enters the protected list (t2)."""
    tiers = LowerTiers([10 ** 9], BS, policies=["arc"])
    t = tiers.tiers[0]
    for name in (11, 12, 13):
        tiers.store(0, name, owner=1)
    assert t.fresh == 3 and len(t.eviction.uses) == 3  # type: ignore[attr-defined]
    small = LowerTiers([2], BS, policies=["arc"])
    for name in (1, 2, 3):  # 3 evicts 1 (fell out of the last tier: a ghost)
        small.store(0, name, owner=1)
    assert small.lookup(1) is None  # the lookup's miss finds 1 among the ghosts
    arc = small.tiers[0].eviction
    assert arc.p == 1.0  # type: ignore[attr-defined]  # (a hit on b1 grows t1's target)
    small.store(0, 1, owner=1)  # 1 comes back (evicting 2): into t2
    assert list(arc.t2) == [small.tiers[0].slots[1]]  # type: ignore[attr-defined]
    assert [h for h, _ in small.tiers[0].order()] == [1, 3]  # t1 (3) is at its target


def test_the_default_is_lru_on_every_tier_and_unknown_orders_are_refused() -> None:
    assert LowerTiers([2, 2], BS).policies == ["lru", "lru"]
    with pytest.raises(ValueError, match="one eviction order"):
        LowerTiers([2, 2], BS, policies=["lru"])
    with pytest.raises(ValueError, match="one eviction order"):
        LowerTiers([2], BS, policies=["mru"])


def _cycle(pool: BlockPool, name: int, uses: int = 1) -> int:
    """A block computed with content ``name``, hit ``uses - 1`` times, then released."""
    (b,) = pool.allocate_all(1, fill=BS)
    pool.register(b, name)
    for _ in range(uses - 1):
        assert pool.lookup(name) == b
        pool.touch(b)
        pool.release(b)
    pool.release(b)
    return b


def test_second_hit_caches_only_content_used_twice() -> None:
    pool = BlockPool(N, BS)
    pool.set_policy("lru", "second_hit")
    once = _cycle(pool, 100)  # computed once: not admitted, first in line
    twice = _cycle(pool, 200, uses=2)  # hit once more: admitted
    also_once = _cycle(pool, 300)
    assert pool.lru_order() == [once, also_once, twice]
    # Still findable until evicted: a hit revives it, and its second use admits it.
    assert pool.lookup(100) == once
    pool.touch(once)
    pool.release(once)
    assert pool.lru_order() == [also_once, twice, once]
    # Content computed again after its block was evicted is admitted (its second use).
    pool.allocate_all(N - 3 + 1, fill=BS)  # the plain free blocks, then also_once
    assert pool.lookup(300) is None
    again = _cycle(pool, 300)
    assert pool.lru_order()[-1] == again


def test_tinylfu_admits_content_used_more_than_the_next_victim() -> None:
    pool = BlockPool(N, BS)
    pool.set_policy("lru", "tinylfu")
    popular = _cycle(pool, 100, uses=3)  # nothing cached before it: admitted
    one_off = _cycle(pool, 200)  # 1 use against the next victim's 3: first in line
    assert pool.lru_order() == [one_off, popular]
    hot = _cycle(pool, 300, uses=5)  # 5 uses against the next victim's (one_off) 1
    assert pool.lru_order() == [one_off, popular, hot]


def test_a_policy_is_chosen_before_anything_is_cached_and_lru_is_the_default() -> None:
    pool = BlockPool(N, BS)
    assert pool.policy == ("lru", "always")
    _cycle(pool, 1)
    with pytest.raises(AssertionError):
        pool.set_policy("lfu", "always")


def test_lfu_ages_old_counts_out() -> None:
    """LFU-DA: a block used three times long ago loses, in time, to one-off blocks cached
    after evictions raised the floor (plain LFU would keep it for ever)."""
    pool = BlockPool(4, BS)
    pool.set_policy("lfu", "always")
    old = _cycle(pool, 1, uses=3)  # priority 0 + 3
    for name in range(2, 11):  # 2-4 take the plain free blocks; each later one evicts
        _cycle(pool, name)
    assert pool.lookup(1) == old  # the floor is 2 now: one-offs cached at 3, after it
    _cycle(pool, 11)
    assert pool.lookup(1) is None  # evicted: tied at 3 with later blocks, the oldest


def test_cost_keeps_deeper_blocks_at_equal_use() -> None:
    pool = BlockPool(N, BS)
    pool.set_policy("cost", "always")
    blocks = []
    for depth in (3, 0, 1):
        (b,) = pool.allocate_all(1, fill=BS)
        pool.register(b, 10 + depth, depth=depth)
        pool.release(b)
        blocks.append((depth, b))
    by_depth = [b for _, b in sorted(blocks)]
    assert pool.lru_order() == by_depth  # shallowest first
