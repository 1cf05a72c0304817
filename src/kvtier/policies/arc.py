"""Adaptive Replacement Cache (Megiddo & Modha) over evictable blocks only.

Resident keys live in T1 (seen once) or T2 (seen again); B1/B2 remember keys
recently evicted from each. A hit in B1 grows the target size ``p`` of T1, a
hit in B2 shrinks it; eviction takes the LRU evictable key of T1 while T1
exceeds ``p`` and of T2 otherwise.

To keep eviction O(1) without scanning pinned blocks, each resident list is
kept as a count (all members) plus an ordered dict of its *evictable* members
(key -> slot). ``_where[slot]`` says which list the block in a slot is in (1:
T1, 2: T2, 0: free slot), one byte per slot instead of a hash table.
Invariants: ``t1`` and ``t2`` count the slots with ``_where`` 1 and 2 (the
resident blocks); ``_t1e`` and ``_t2e`` hold exactly the evictable members of
each, with their slots; after every insertion and eviction ``|T1| + |B1| <= c``
and ``|B1| + |B2| <= c`` (ARC's directory bounds).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container
from typing import ClassVar

from kvtier.keys import BlockKey
from kvtier.policies.base import EvictionPolicy


class ARCPolicy(EvictionPolicy):
    name: ClassVar[str] = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0.0
        self._where = bytearray(capacity)
        self.t1 = 0
        self.t2 = 0
        self._t1e: OrderedDict[BlockKey, int] = OrderedDict()
        self._t2e: OrderedDict[BlockKey, int] = OrderedDict()
        self._b1: OrderedDict[BlockKey, None] = OrderedDict()
        self._b2: OrderedDict[BlockKey, None] = OrderedDict()

    def insert(self, key: BlockKey, slot: int) -> None:
        if key in self._b1:
            self.p = min(float(self.capacity), self.p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._where[slot] = 2
            self.t2 += 1
        elif key in self._b2:
            self.p = max(0.0, self.p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._where[slot] = 2
            self.t2 += 1
        else:
            self._where[slot] = 1
            self.t1 += 1
            self._trim_ghosts()

    def remove(self, key: BlockKey, slot: int) -> None:
        where = self._where[slot]
        self._where[slot] = 0
        if where == 1:
            self.t1 -= 1
            self._t1e.pop(key, None)
        elif where == 2:
            self.t2 -= 1
            self._t2e.pop(key, None)

    def touch(self, key: BlockKey, slot: int) -> None:
        where = self._where[slot]
        if where == 1:
            self._where[slot] = 2
            self.t1 -= 1
            self.t2 += 1
            if self._t1e.pop(key, None) is not None:
                self._t2e[key] = slot
        elif where == 2 and key in self._t2e:
            self._t2e.move_to_end(key)

    def mark_evictable(self, key: BlockKey, slot: int) -> None:
        where = self._where[slot]
        if where == 1:
            self._t1e[key] = slot
        elif where == 2:
            self._t2e[key] = slot

    def mark_pinned(self, key: BlockKey, slot: int) -> None:
        self._t1e.pop(key, None)
        self._t2e.pop(key, None)

    def evict(self, n: int, protected: Container[BlockKey] = ()) -> list[BlockKey] | None:
        if n <= 0:
            return []
        if n > len(self._t1e) + len(self._t2e):
            return None
        it1 = ((k, s) for k, s in self._t1e.items() if k not in protected)
        it2 = ((k, s) for k, s in self._t2e.items() if k not in protected)
        next1: tuple[BlockKey, int] | None = next(it1, None)
        next2: tuple[BlockKey, int] | None = next(it2, None)
        t1 = self.t1
        chosen: list[tuple[BlockKey, int, int]] = []
        while len(chosen) < n:
            take_t1 = next1 is not None and (t1 > self.p or next2 is None)
            if take_t1:
                assert next1 is not None
                chosen.append((*next1, 1))
                t1 -= 1
                next1 = next(it1, None)
            elif next2 is not None:
                chosen.append((*next2, 2))
                next2 = next(it2, None)
            else:
                return None
        for key, slot, where in chosen:
            self._where[slot] = 0
            if where == 1:
                del self._t1e[key]
                self.t1 -= 1
                self._b1[key] = None
            else:
                del self._t2e[key]
                self.t2 -= 1
                self._b2[key] = None
        self._trim_ghosts()
        return [key for key, _, _ in chosen]

    def _trim_ghosts(self) -> None:
        # ARC's bounds: |T1| + |B1| <= c, and at most c ghosts in all (with a full cache,
        # ARC's |T1| + |T2| + |B1| + |B2| <= 2c allows no more).
        c = self.capacity
        while self._b1 and self.t1 + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and len(self._b1) + len(self._b2) > c:
            self._b2.popitem(last=False)

    def clear(self) -> None:
        self.p = 0.0
        self._where = bytearray(self.capacity)
        self.t1 = self.t2 = 0
        for d in (self._t1e, self._t2e, self._b1, self._b2):
            d.clear()

    def evictable_count(self) -> int:
        return len(self._t1e) + len(self._t2e)
