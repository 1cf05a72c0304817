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

Memory and list layout: see :mod:`kvtier.policies.slot_lists`.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import ClassVar

from kvtier.keys import BlockKey
from kvtier.policies.slot_lists import NO_KEY, SlotListPolicy


class LRUPolicy(SlotListPolicy):
    name: ClassVar[str] = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._reset()

    def _reset(self) -> None:
        self._init_lists(1)

    def insert(self, key: BlockKey, slot: int) -> None:
        self._key_of[slot] = key

    def remove(self, key: BlockKey, slot: int) -> None:
        self._unlink_evictable(slot)
        self._key_of[slot] = NO_KEY

    def touch(self, key: BlockKey, slot: int) -> None:
        if self._evictable[slot] and self._next[slot] != self.capacity:
            self._unlink(slot)
            self._append(slot, self.capacity)

    def mark_evictable(self, key: BlockKey, slot: int) -> None:
        self._link_evictable(slot, self.capacity)

    # Batched forms and the chain report, inlined: the CPU tier calls them for every block it
    # stores, pins and releases, and a Python call per block would cost more than the work.

    def insert_many(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        key_of = self._key_of
        for i in range(len(slots)):
            key_of[slots[i]] = keys[i]

    def mark_evictable_many(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        flags, prv, nxt, end = self._evictable, self._prev, self._next, self.capacity
        linked = 0
        for slot in slots:
            if not flags[slot]:
                flags[slot] = 1
                tail = prv[end]
                nxt[tail] = slot
                prv[slot] = tail
                nxt[slot] = end
                prv[end] = slot
                linked += 1
        self._count += linked

    def mark_pinned_many(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        self._unlink_many(slots)

    def mark_evictable_then_pinned_many(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        # Linked at the tail, then unlinked: a block that was not linked stays so, one that was
        # (never the case for a block whose write just completed) leaves the list.
        self._unlink_many(slots)

    def reference_chain(self, keys: Sequence[BlockKey], slots: Sequence[int], parent: int, hit: bool) -> None:
        """Touches, tail first (the head ends most recent); blocks not evictable are left alone."""
        # SlotListPolicy._move_to_tail, inlined: a method call less per block on the scheduler's path.
        flags, prv, nxt, end = self._evictable, self._prev, self._next, self.capacity
        for i in range(len(slots) - 1, -1, -1):
            slot = slots[i]
            if flags[slot] and nxt[slot] != end:
                before, after = prv[slot], nxt[slot]
                nxt[before] = after
                prv[after] = before
                tail = prv[end]
                nxt[tail] = slot
                prv[slot] = tail
                nxt[slot] = end
                prv[end] = slot

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
            key_of[slot] = NO_KEY
        self._count -= n
        return keys

    def evict_one(self, protected: Container[BlockKey] = ()) -> BlockKey | None:
        if type(self).evict is not LRUPolicy.evict:  # a subclass chooses differently: ask it
            return super().evict_one(protected)
        end = self.capacity
        nxt, key_of = self._next, self._key_of
        slot = nxt[end]
        while slot != end:
            key = key_of[slot]
            if key not in protected:
                before, after = self._prev[slot], nxt[slot]
                nxt[before] = after
                self._prev[after] = before
                self._evictable[slot] = 0
                key_of[slot] = NO_KEY
                self._count -= 1
                return key
            slot = nxt[slot]
        return None

    def clear(self) -> None:
        self._reset()
