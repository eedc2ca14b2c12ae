"""Time-integrated accounting of reserved KV slots, for the fragmentation split.

Every unit of reservation (a paged block, or a contiguous range) lives through *epochs*:
it is opened when a sequence starts holding it and closed when the last holder lets go.
Within an epoch its fill count (slots holding a token's K/V) only grows. Whether a
reserved-but-empty slot is *reservation* (a later token fills it) or *internal
fragmentation* (nothing ever does) is only known when the epoch closes, so the ledger
keeps per-epoch integrals and classifies at close:

    reserved     = capacity * duration
    used         = integral of fill over the epoch
    reservation  = final_fill * duration - used
    internal     = (capacity - final_fill) * duration

Time is the engine's step counter (``now``), so "time-averaged" means averaged over steps,
as DESIGN.md's ``memory.waste_pct`` is. Every event is O(1). A unit opened while ``tag``
is set (KV cache groups: the group allocating, harness.kv.groups) is also summed into
``by_tag[tag]``, so the split is known per group and in total.
"""

from __future__ import annotations

from dataclasses import dataclass

# An epoch is a list, [capacity, fill, opened, last_change, fill_integral, tag], not an
# object: every block of every request opens and closes one, and a list is made and read
# in half the time of a slots dataclass (the roofline's decode lanes, issue #24).
_CAP, _FILL, _OPENED, _LAST, _INTEGRAL, _TAG = range(6)


@dataclass(slots=True)
class LedgerTotals:
    """Slot-steps summed over the run (divide by steps for time averages)."""

    reserved: int = 0
    used: int = 0
    reservation: int = 0
    internal: int = 0
    external: int = 0


class ReservationLedger:
    """Records open / fill / close events of reservation units keyed by an int id."""

    def __init__(self) -> None:
        self.now = 0
        self._open: dict[int, list] = {}  # unit -> its epoch (see _CAP ... _TAG)
        self.totals = LedgerTotals()
        self.tag: int | None = None  # who opens units now (KV cache groups)
        self.by_tag: dict[int, LedgerTotals] = {}

    def open(self, unit: int, capacity: int, fill: int = 0, tag: int | None = None) -> None:
        """Open ``unit``'s epoch (``tag``: whose it is; default the ledger's ``tag``)."""
        self.open_all([unit], capacity, fill, tag)

    def open_all(self, units: list[int], capacity: int, fill: int = 0,
                 tag: int | None = None, ramp: int = 0) -> None:
        """:meth:`open` of each of ``units`` (not open) at the same capacity, fill and tag
        (a block pool's allocations: every block of every request). ``ramp``: each
        unit's :meth:`ramp` by ``ramp`` recorded now, ahead of its ticks (the roofline's
        fast path's blocks, whose writes to their last slot are known when taken;
        :meth:`trim` takes back what did not happen)."""
        now, epochs = self.now, self._open
        tag = self.tag if tag is None else tag
        before = len(epochs)
        # (as ramp() from fill at now: fill * k + k (k - 1) / 2 slot-ticks, last at now + k)
        f, last, integral = fill + ramp, now + ramp, fill * ramp + ramp * (ramp - 1) // 2
        for unit in units:
            epochs[unit] = [capacity, f, now, last, integral, tag]
        assert len(epochs) == before + len(units), f"a unit of {units} opened twice"

    def fill(self, unit: int, fill: int) -> None:
        ep = self._open[unit]
        assert ep[_FILL] <= fill <= ep[_CAP], (unit, ep[_FILL], fill, ep[_CAP])
        now = self.now
        ep[_INTEGRAL] += ep[_FILL] * (now - ep[_LAST])
        ep[_FILL] = fill
        ep[_LAST] = now

    def ramp(self, unit: int, k: int) -> None:
        """``unit``'s fill grew by one at each of the ``k`` clock ticks after its last
        change (the last of them now or the tick before): one call for what ``fill`` would
        have recorded tick by tick (the roofline's fast path, harness/roofline/fastpath)."""
        ep = self._open[unit]
        f = ep[_FILL]
        assert f + k <= ep[_CAP] and self.now - 1 <= ep[_LAST] + k <= self.now, \
            (unit, f, k, ep[_LAST], self.now)
        ep[_INTEGRAL] += f * k + k * (k - 1) // 2
        ep[_FILL] = f + k
        ep[_LAST] += k

    def ramp_all(self, units: list[int], ks: list[int]) -> None:
        """:meth:`ramp` of each of ``units`` by its ``k`` (``k = 0``: nothing)."""
        epochs, now = self._open, self.now
        for unit, k in zip(units, ks):
            if k:
                ep = epochs[unit]
                f = ep[_FILL]
                assert f + k <= ep[_CAP] and now - 1 <= ep[_LAST] + k <= now, \
                    (unit, f, k, ep[_LAST], now)
                ep[_INTEGRAL] += f * k + k * (k - 1) // 2
                ep[_FILL] = f + k
                ep[_LAST] += k

    def trim(self, unit: int, k: int) -> None:
        """Take back the last ``k`` ticks of ``unit``'s ramp, recorded ahead (its writer
        stopped ``k`` writes short of what :meth:`open_all`'s ``ramp`` recorded): those
        ticks held fills ``f - k .. f - 1``, ``f`` the recorded fill."""
        ep = self._open[unit]
        f = ep[_FILL]
        assert 0 <= k <= f and ep[_LAST] - k >= ep[_OPENED], (unit, f, k, ep[_LAST])
        ep[_INTEGRAL] -= k * f - k * (k + 1) // 2
        ep[_FILL] = f - k
        ep[_LAST] -= k

    def close(self, unit: int) -> int | None:
        """Close ``unit``'s epoch and classify it; returns its tag."""
        tag: int | None = self._open[unit][_TAG]
        self.close_all([unit])
        return tag

    def close_all(self, units: list[int]) -> None:
        """Close each of ``units``' epochs and classify it (the per-unit sums are added
        up here, then once to the totals: every block of every request closes one)."""
        now, epochs = self.now, self._open
        # Three sums per unit: reserved (cap x duration), used, and final fill x duration,
        # of which reservation = final - used and internal = reserved - final.
        reserved = used = final = 0
        for unit in units:
            cap, fill, opened, last, integral, tag = epochs.pop(unit)
            duration = now - opened
            u = integral + fill * (now - last)
            if tag is not None:
                _add(self.by_tag.setdefault(tag, LedgerTotals()), cap * duration, u,
                     fill * duration - u, (cap - fill) * duration)
            reserved += cap * duration
            used += u
            final += fill * duration
        _add(self.totals, reserved, used, final - used, reserved - final)

    def open_units(self) -> dict[int, int]:
        """Every open unit and its fill (tests: the ledger tracks what the pool holds)."""
        return {u: ep[_FILL] for u, ep in self._open.items()}

    def add_external(self, slots: int) -> None:
        """Free slots that the allocator could not give to the next request this step."""
        self.totals.external += slots

    def finish(self) -> LedgerTotals:
        """Close every open epoch at ``now`` and return the totals (call once, at the end)."""
        self.close_all(list(self._open))
        return self.totals


def _add(t: LedgerTotals, reserved: int, used: int, reservation: int, internal: int) -> None:
    t.reserved += reserved
    t.used += used
    t.reservation += reservation
    t.internal += internal
