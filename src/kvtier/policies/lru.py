"""Least-recently-used eviction over evictable blocks only.

An intrusive doubly linked list over row slots: ``_prev[slot]`` / ``_next[slot]``
link the evictable blocks, least recently used first, through the sentinel slot
``capacity`` (``_next[capacity]`` is the head, ``_prev[capacity]`` the tail).
``_evictable[slot]`` is 1 exactly for the linked slots, and ``_key_of[slot]`` is
the key of the block in the slot (``b""`` for a free slot).

Invariants: the linked slots are exactly the blocks with ref count 0, and
``_count`` is their number. A pinned or in-flight block is unlinked, so eviction
never visits it; a pinned block re-enters as most recent when released (it was
just used).

Memory: three lists of ``capacity + 1`` pointers and a byte per slot, allocated
once. The links hold the slot ints the tier passes (one object per slot, owned
by the tier), so linking allocates nothing and churn does not grow anything,
unlike a hash table, which deletions and insertions resize to several times
its entries.
"""

from __future__ import annotations

from collections.abc import Container
from typing import ClassVar

from kvtier.keys import BlockKey
from kvtier.policies.base import EvictionPolicy

_NO_KEY: BlockKey = b""


class LRUPolicy(EvictionPolicy):
    name: ClassVar[str] = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._reset()

    def _reset(self) -> None:
        end = self.capacity
        self._prev: list[int] = [end] * (end + 1)
        self._next: list[int] = [end] * (end + 1)
        self._evictable = bytearray(end)
        self._key_of: list[BlockKey] = [_NO_KEY] * end
        self._count = 0

    def _unlink(self, slot: int) -> None:
        prv, nxt = self._prev, self._next
        before, after = prv[slot], nxt[slot]
        nxt[before] = after
        prv[after] = before

    def _append(self, slot: int) -> None:
        """Link ``slot`` as the most recently used."""
        end = self.capacity
        prv = self._prev
        tail = prv[end]
        self._next[tail] = slot
        prv[slot] = tail
        self._next[slot] = end
        prv[end] = slot

    def insert(self, key: BlockKey, slot: int) -> None:
        self._key_of[slot] = key

    def remove(self, key: BlockKey, slot: int) -> None:
        if self._evictable[slot]:
            self._unlink(slot)
            self._evictable[slot] = 0
            self._count -= 1
        self._key_of[slot] = _NO_KEY

    def touch(self, key: BlockKey, slot: int) -> None:
        if self._evictable[slot] and self._next[slot] != self.capacity:
            self._unlink(slot)
            self._append(slot)

    def mark_evictable(self, key: BlockKey, slot: int) -> None:
        if not self._evictable[slot]:
            self._evictable[slot] = 1
            self._append(slot)
            self._count += 1

    def mark_pinned(self, key: BlockKey, slot: int) -> None:
        if self._evictable[slot]:
            self._unlink(slot)
            self._evictable[slot] = 0
            self._count -= 1

    def evict(self, n: int, protected: Container[BlockKey] = ()) -> list[BlockKey] | None:
        if n <= 0:
            return []
        if n > self._count:
            return None
        end = self.capacity
        nxt, key_of = self._next, self._key_of
        # First choose, changing nothing: protected keys may leave too few.
        slots: list[int] = []
        keys: list[BlockKey] = []
        slot = nxt[end]
        while slot != end:
            key = key_of[slot]
            if key not in protected:
                slots.append(slot)
                keys.append(key)
                if len(keys) == n:
                    break
            slot = nxt[slot]
        else:
            return None
        prv, flags = self._prev, self._evictable
        for slot in slots:
            before, after = prv[slot], nxt[slot]
            nxt[before] = after
            prv[after] = before
            flags[slot] = 0
            key_of[slot] = _NO_KEY
        self._count -= n
        return keys

    def clear(self) -> None:
        self._reset()

    def evictable_count(self) -> int:
        return self._count
