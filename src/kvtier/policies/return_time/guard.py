"""The guard of ``return-time``: it measures the learned holds against LRU, and stops them while they lose.

Safety by measurement, on the live stream (SHARDS-style miniature
simulations, Waldspurger et al., ATC'17): the policy follows a spatial hash
sample of the keys (a key is in the sample by its bytes), and two miniature
caches of the sampled share of the capacity see every sampled reference,
whatever order the real cache follows:

* a sampled LRU (the recency segment of the policy's
  :class:`~kvtier.policies.return_time.model.ReturnSampler`);
* :class:`MiniWheel`, the plan's learned holds on the sampled keys: earliest
  expiry first, a request's blocks held open until it is complete, its earlier
  keys raised to its head, as the real cache does (even while the real cache
  runs LRU order).

Both count *prefix* hits: a sampled block hits only if every sampled block
before it in its request hit too (the state is carried from a request's load
to its stores and from store to store); a per-key count cannot see a prefix
cut. :class:`MeasuredGuard` keeps the paired difference (learned minus LRU
prefix hits) per request, decays the sums of each solve period, and leaves
the learned holds when the difference falls ``SIGMAS`` standard deviations
below 0. The same sums decayed slowly (``LONG_DECAY``) catch a loss too small
for a few periods' noise: past ``LONG_WARM_UP`` periods the holds are also
left when that long-run lead falls ``LONG_SIGMAS`` standard deviations below 0.
They are taken up again when both leads are above 0.

It bounds a sustained loss; it cannot make one impossible: it acts periods
after the evidence, so the reuse lost right after the workload changes is
lost first, and it sees only the sampled share of the keys. Everything is
O(1) per sampled reference (the wheel's lists are spliced as the clock
passes them, each entry once per reference) and its memory is fixed: the
miniature of the learned holds is a :class:`~kvtier.policies.fingerprints.FingerprintLists`
of the sampled share of the capacity with an expiry per entry. Called from
the policy's thread.
"""

from __future__ import annotations

import math
from array import array
from typing import Literal

from kvtier.policies.fingerprints import FingerprintLists

SIGMAS = 1.0
"""The learned holds are left when their lead over LRU falls this many standard deviations below 0.
One, not three: holds kept while they lose cost hits below LRU's, LRU order kept while they would
win costs only the gain (at 3, an LRU-friendly stack-distance workload lost up to 3.6 % to LRU;
docs/policies.md gives both sides of the change)."""

DECAY = 0.8
"""Weight of the earlier periods in the guard's sums."""

WARM_UP = 2
"""Periods judged before the guard may act."""

LONG_DECAY = 0.98
"""Weight of the earlier periods in the guard's long-run sums (about 50 periods)."""

LONG_SIGMAS = 1.0
"""The learned holds are also left when their long-run lead falls this many standard deviations below 0."""

LONG_WARM_UP = 20
"""Periods judged before the long-run test may act."""

PREFIX_HITS = 3
"""A request's prefix state before its first sampled reference: bit 1, the sampled LRU's prefix
still hits; bit 2, the learned miniature's."""

GuardState = Literal["learning", "ahead", "fallen_back"]


class MiniWheel:
    """A cache of ``size`` fingerprints that evicts the earliest expiry first (a small timing wheel).

    Lists of a :class:`FingerprintLists`: 0 holds the expired entries in
    expiry order, ``1 + bucket % ring`` the entries whose expiry falls in
    ``bucket`` (intervals of ``width`` references). ``open_at``: an expiry at
    or above it is ``open_at + e``, ordered as ``e`` (a request still open).
    """

    def __init__(self, size: int, width: int, ring: int, open_at: int, clock: int) -> None:
        self.size = size
        self.width = width
        self.ring = ring
        self.open_at = open_at
        self.clock = clock
        self.table = FingerprintLists(size, lists=ring + 1)
        self.expiry = array("q", bytes(8 * size))
        self.cur = 0

    def __len__(self) -> int:
        return len(self.table)

    def holds(self, fp: int) -> bool:
        return self.table.find(fp) >= 0

    def _list(self, expiry: int) -> int:
        bucket = (expiry & self.clock) // self.width
        return 0 if bucket < self.cur else 1 + bucket % self.ring

    def advance(self, now: int) -> None:
        """Move the entries of the buckets the clock passed to the expired list."""
        cur = now // self.width
        table, ring = self.table, self.ring
        for bucket in range(self.cur, min(cur, self.cur + ring)):
            which = 1 + bucket % ring
            entry = table.head(which)
            while entry >= 0:
                table.move_to_end(entry, 0)
                entry = table.head(which)
        self.cur = cur

    def reference(self, fp: int, expiry: int) -> None:
        """``fp`` referenced, held until ``expiry`` at least (an open one stays open until set)."""
        table = self.table
        entry = table.find(fp)
        if entry >= 0:
            old = self.expiry[entry]
            if old >= self.open_at or old >= expiry:
                return
        else:
            if len(table) >= self.size:
                self._evict()
            entry = table.add(fp, 0)
        self.expiry[entry] = expiry
        bucket = (expiry & self.clock) // self.width  # _list, inlined
        table.move_to_end(entry, 0 if bucket < self.cur else 1 + bucket % self.ring)

    def settle(self, fp: int, expiry: int, raise_only: bool) -> None:
        """Set ``fp``'s expiry (``raise_only``: only upwards, an open one untouched), if held."""
        entry = self.table.find(fp)
        if entry < 0:
            return
        old = self.expiry[entry]
        if raise_only and (old >= self.open_at or old >= expiry):
            return
        self.expiry[entry] = expiry
        self.table.move_to_end(entry, self._list(expiry))

    def _evict(self) -> None:
        """Make room: the expired list's head, else the head of the first wheel list in time order
        that holds one. With every entry held far ahead that walks up to ``ring`` empty lists, so
        the lists' heads are read in place (``head`` per list cost 17 calls an eviction where most
        entries were held 20 intervals ahead)."""
        table = self.table
        heads, end = table._next, table.capacity  # a list's head follows its sentinel, end + list
        entry = heads[end]
        if entry >= end:
            first = end + 1
            start = self.cur % self.ring
            for sentinel in range(first + start, first + self.ring):
                entry = heads[sentinel]
                if entry < end:
                    break
            else:
                for sentinel in range(first, first + start):
                    entry = heads[sentinel]
                    if entry < end:
                        break
        table.remove(entry)


class MeasuredGuard:
    """Sampled prefix hits of LRU and of the learned holds, and whether the learned holds may be used.

    The policy feeds each request's sampled references (:meth:`count`), folds
    each chain's difference in (:meth:`end_chain`), and calls :meth:`judge`
    once per solve period.
    """

    def __init__(self, mini: MiniWheel) -> None:
        self.mini = mini
        self.fallen_back = False
        self.fallbacks = 0
        self.refs = 0
        self.lru_hits = 0
        self.learned_hits = 0
        self.chain_diff = 0  # the current chain's difference, learned minus LRU prefix hits
        self.chain_sampled = False
        self._period = [0, 0]  # this period: sum of the differences, and of their squares by request
        self._lead = 0.0  # decayed sums over the periods
        self._spread = 0.0
        self._long_lead = 0.0  # the same, decayed slowly
        self._long_spread = 0.0
        self._periods = 0

    def count(self, lru_hit: bool, learned_hit: bool) -> None:
        """A sampled reference's prefix hits in the two miniatures."""
        self.refs += 1
        self.lru_hits += lru_hit
        self.learned_hits += learned_hit
        self.chain_diff += learned_hit - lru_hit
        self.chain_sampled = True

    def end_chain(self, before: int = 0) -> int:
        """Fold the current chain into the period's sums; returns its request's difference so far.

        A request stored in pieces is one term: ``before`` is the difference of
        its earlier chains, and its square is replaced by the square of the total.
        """
        diff = self.chain_diff
        total = before + diff
        self._period[0] += diff
        self._period[1] += total * total - before * before
        self.chain_diff = 0
        self.chain_sampled = False
        return total

    def judge(self) -> bool:
        """End a period; returns whether the guard just fell back (the learned holds must stop now).

        Falls back on either test (the fast one, or the long-run one once it
        may act); returns to the learned holds when both leads are above 0."""
        diff, square = self._period
        self._period = [0, 0]
        self._lead = DECAY * self._lead + diff
        self._spread = DECAY * self._spread + square
        self._long_lead = LONG_DECAY * self._long_lead + diff
        self._long_spread = LONG_DECAY * self._long_spread + square
        self._periods += 1
        if self._periods < WARM_UP:
            return False
        long_behind = self._periods >= LONG_WARM_UP and self._long_lead < -LONG_SIGMAS * math.sqrt(
            max(self._long_spread, 0.0))
        if self.fallen_back:
            if self._lead > 0 and self._long_lead > 0:
                self.fallen_back = False
            return False
        if long_behind or self._lead < -SIGMAS * math.sqrt(max(self._spread, 0.0)):
            self.fallen_back = True
            self.fallbacks += 1
            return True
        return False

    def state(self, learning: bool) -> GuardState:
        """``fallen_back`` (the learned holds lose: LRU order), ``ahead`` (in use, and leading), or
        ``learning`` (anything else: warming up, nothing worth holding yet, or no lead measured)."""
        if self.fallen_back:
            return "fallen_back"
        return "ahead" if learning and self._lead > 0 else "learning"

    @property
    def lead(self) -> float:
        """The decayed sum of the learned holds' extra sampled prefix hits over LRU's."""
        return self._lead

    @property
    def spread(self) -> float:
        """The standard deviation of :attr:`lead`."""
        return math.sqrt(max(self._spread, 0.0))

    @property
    def long_lead(self) -> float:
        """:attr:`lead` over the long run (the earlier periods weigh :data:`LONG_DECAY` each)."""
        return self._long_lead

    @property
    def long_spread(self) -> float:
        """The standard deviation of :attr:`long_lead`."""
        return math.sqrt(max(self._long_spread, 0.0))
