"""Adaptive Replacement Cache (Megiddo & Modha) over evictable blocks only.

Resident keys live in T1 (seen once) or T2 (seen again); B1/B2 remember keys
recently evicted from each. A hit in B1 grows the target size ``p`` of T1, a
hit in B2 shrinks it; eviction takes the LRU evictable key of T1 while T1
exceeds ``p`` and of T2 otherwise.

To keep eviction O(1) without scanning pinned blocks, each resident list is
kept as a count (all members) plus a list of its *evictable* members, least
recent first. Both lists are intrusive doubly linked lists over row slots, as
in :mod:`kvtier.policies.lru`: ``_prev[slot]`` / ``_next[slot]`` link the
evictable slots of T1 through the sentinel slot ``capacity`` and those of T2
through the sentinel slot ``capacity + 1`` (``_next[sentinel]`` is the head,
``_prev[sentinel]`` the tail). ``_where[slot]`` says which list the block in a
slot is in (1: T1, 2: T2, 3: T1 but still being written, 0: free slot),
``_evictable[slot]`` is 1 exactly for the linked slots, and ``_key_of[slot]``
is the key of the block in the slot (``b""`` for a free slot).

The ghost lists B1 and B2 are the two lists of one
:class:`~kvtier.policies.fingerprints.FingerprintLists` of ``capacity``
entries: fixed-size fingerprints of the evicted keys in arrays allocated once,
so remembering an evicted block keeps no key object alive and churn grows
nothing.

Invariants: ``t1`` and ``t2`` count the slots with ``_where`` 1 or 3 and 2
(the resident blocks); the slots linked through each sentinel are exactly the
evictable members of that list, and ``_count`` is their number; after every
insertion and eviction ``|T1| + |B1| <= c`` and ``|B1| + |B2| <= c`` (ARC's
directory bounds).

Memory: three lists of about ``capacity`` pointers and two bytes per slot,
plus about 25-33 bytes per ghost entry, all allocated once.
"""

from __future__ import annotations

from collections.abc import Container
from typing import ClassVar

from kvtier.keys import BlockKey
from kvtier.policies.fingerprints import FingerprintLists, fingerprint
from kvtier.policies.slot_lists import NO_KEY, SlotListPolicy

B1, B2 = 0, 1
"""The ghost lists' numbers in :attr:`ARCPolicy.ghosts`."""

_WRITING = 3
"""``_where`` of a T1 block whose write is still in flight (never evictable yet)."""


class ARCPolicy(SlotListPolicy):
    name: ClassVar[str] = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # One spare entry: a ghost is added before the bounds are restored.
        self.ghosts = FingerprintLists(capacity + 1, lists=2)
        self._reset()

    def _reset(self) -> None:
        c = self.capacity
        self.p = 0.0
        self.t1 = 0
        self.t2 = 0
        self._where = bytearray(c)
        # Sentinels: T1's evictable list runs through slot c, T2's through slot c + 1.
        self._init_lists(2)
        self._end2 = c + 1
        self.ghosts.clear()

    @property
    def b1(self) -> int:
        """How many keys ghost list B1 remembers."""
        return self.ghosts.count(B1)

    @property
    def b2(self) -> int:
        """How many keys ghost list B2 remembers."""
        return self.ghosts.count(B2)

    def is_ghost(self, key: BlockKey) -> int:
        """1 or 2 if ``key`` is remembered in B1 or B2, else 0."""
        entry = self.ghosts.find(fingerprint(key))
        return 0 if entry < 0 else self.ghosts.list_of(entry) + 1

    def insert(self, key: BlockKey, slot: int) -> None:
        self._key_of[slot] = key
        ghosts = self.ghosts
        entry = ghosts.find(fingerprint(key))
        if entry < 0:
            self._where[slot] = _WRITING
            self.t1 += 1
            self._trim_ghosts()
            return
        b1, b2 = ghosts.count(B1), ghosts.count(B2)
        if ghosts.list_of(entry) == B1:
            self.p = min(float(self.capacity), self.p + max(b2 / b1, 1.0))
        else:
            self.p = max(0.0, self.p - max(b1 / b2, 1.0))
        ghosts.remove(entry)
        self._where[slot] = 2
        self.t2 += 1

    def remove(self, key: BlockKey, slot: int) -> None:
        where = self._where[slot]
        if not where:
            return
        self._unlink_evictable(slot)
        self._where[slot] = 0
        self._key_of[slot] = NO_KEY
        if where == 2:
            self.t2 -= 1
        else:
            self.t1 -= 1

    def touch(self, key: BlockKey, slot: int) -> None:
        where = self._where[slot]
        if where == 1:
            self._where[slot] = 2
            self.t1 -= 1
            self.t2 += 1
            if not self._evictable[slot]:
                return  # pinned: joins T2 when it becomes evictable again
        elif where != 2 or not self._evictable[slot]:
            return  # free, still being written (its store is its first use), or pinned in T2
        if self._next[slot] != self._end2:  # not already T2's most recent
            self._move_to_tail(slot, self._end2)

    def mark_evictable(self, key: BlockKey, slot: int) -> None:
        where = self._where[slot]
        if where == _WRITING:
            self._where[slot] = where = 1
        if where:
            self._link_evictable(slot, self.capacity if where == 1 else self._end2)

    def evict(self, n: int, protected: Container[BlockKey] = ()) -> list[BlockKey] | None:
        if n <= 0:
            return []
        if n > self._count:
            return None
        end1, end2 = self.capacity, self._end2
        nxt, key_of = self._next, self._key_of
        # First choose, changing nothing: protected keys may leave too few. Each cursor
        # rests on its list's least recent unprotected slot (or on the sentinel).
        s1 = nxt[end1]
        while s1 != end1 and key_of[s1] in protected:
            s1 = nxt[s1]
        s2 = nxt[end2]
        while s2 != end2 and key_of[s2] in protected:
            s2 = nxt[s2]
        t1, p = self.t1, self.p
        chosen: list[int] = []
        while len(chosen) < n:
            if s1 != end1 and (t1 > p or s2 == end2):
                chosen.append(s1)
                t1 -= 1
                s1 = nxt[s1]
                while s1 != end1 and key_of[s1] in protected:
                    s1 = nxt[s1]
            elif s2 != end2:
                chosen.append(s2)
                s2 = nxt[s2]
                while s2 != end2 and key_of[s2] in protected:
                    s2 = nxt[s2]
            else:
                return None
        prv, flags, where_of = self._prev, self._evictable, self._where
        ghosts = self.ghosts
        keys: list[BlockKey] = []
        for slot in chosen:
            before, after = prv[slot], nxt[slot]
            nxt[before] = after
            prv[after] = before
            flags[slot] = 0
            key = key_of[slot]
            key_of[slot] = NO_KEY
            keys.append(key)
            fp = fingerprint(key)
            stale = ghosts.find(fp)  # only a fingerprint collision can leave one
            if stale >= 0:
                ghosts.remove(stale)
            if where_of[slot] == 1:
                self.t1 -= 1
                ghosts.add(fp, B1)
            else:
                self.t2 -= 1
                ghosts.add(fp, B2)
            where_of[slot] = 0
            self._trim_ghosts()
        self._count -= n
        return keys

    def _trim_ghosts(self) -> None:
        # ARC's bounds: |T1| + |B1| <= c, and at most c ghosts in all (with a full cache,
        # ARC's |T1| + |T2| + |B1| + |B2| <= 2c allows no more).
        c = self.capacity
        ghosts = self.ghosts
        while ghosts.count(B1) and self.t1 + ghosts.count(B1) > c:
            ghosts.pop_head(B1)
        while ghosts.count(B2) and ghosts.count(B1) + ghosts.count(B2) > c:
            ghosts.pop_head(B2)

    def clear(self) -> None:
        self._reset()
