"""Intrusive doubly linked lists over row slots, the storage of the built-in policies.

``_prev[slot]`` / ``_next[slot]`` link the evictable blocks of each list through
a sentinel slot (``capacity + i`` for list ``i``; ``_next[sentinel]`` is the
head, least recent, and ``_prev[sentinel]`` the tail, most recent).
``_evictable[slot]`` is 1 exactly for the linked slots, ``_count`` is their
number, and ``_key_of[slot]`` is the key of the block in the slot (``b""`` for
a free slot).

Memory: three lists of about ``capacity`` pointers and a byte per slot,
allocated once. The links hold the slot ints the tier passes (one object per
slot, owned by the tier), so linking allocates nothing and churn grows
nothing, unlike a hash table, which deletions and insertions resize to several
times its entries.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.keys import BlockKey
from kvtier.policies.base import EvictionPolicy

NO_KEY: BlockKey = b""


class SlotListPolicy(EvictionPolicy):
    """Base of policies that keep their evictable blocks in slot-linked lists."""

    def _init_lists(self, lists: int) -> None:
        c = self.capacity
        self._prev: list[int] = [c] * (c + lists)
        self._next: list[int] = [c] * (c + lists)
        for end in range(c + 1, c + lists):
            self._prev[end] = self._next[end] = end
        self._evictable = bytearray(c)
        self._key_of: list[BlockKey] = [NO_KEY] * c
        self._count = 0

    def _unlink(self, slot: int) -> None:
        prv, nxt = self._prev, self._next
        before, after = prv[slot], nxt[slot]
        nxt[before] = after
        prv[after] = before

    def _append(self, slot: int, end: int) -> None:
        """Link ``slot`` as the most recent of the list with sentinel ``end``."""
        prv = self._prev
        tail = prv[end]
        self._next[tail] = slot
        prv[slot] = tail
        self._next[slot] = end
        prv[end] = slot

    def _link_run(self, first: int, last: int, after: int) -> None:
        """Link the run ``first .. last`` (linked among itself, not in a list) right before
        ``after``: a linked slot, or a sentinel (the run becomes its list's most recent)."""
        prv, nxt = self._prev, self._next
        before = prv[after]
        nxt[before] = first
        prv[first] = before
        nxt[last] = after
        prv[after] = last

    def _move_to_tail(self, slot: int, end: int) -> None:
        """Move a linked ``slot`` to the most recent end of the list with sentinel ``end``."""
        prv, nxt = self._prev, self._next
        before, after = prv[slot], nxt[slot]
        nxt[before] = after
        prv[after] = before
        tail = prv[end]
        nxt[tail] = slot
        prv[slot] = tail
        nxt[slot] = end
        prv[end] = slot

    def _move_to_head(self, slot: int, end: int) -> None:
        """Move a linked ``slot`` to the least recent end (the first evicted) of the list with sentinel ``end``."""
        prv, nxt = self._prev, self._next
        before, after = prv[slot], nxt[slot]
        nxt[before] = after
        prv[after] = before
        first = nxt[end]
        nxt[end] = slot
        prv[slot] = end
        nxt[slot] = first
        prv[first] = slot

    def _link_evictable(self, slot: int, end: int) -> None:
        if not self._evictable[slot]:
            self._evictable[slot] = 1
            self._append(slot, end)
            self._count += 1

    def _unlink_evictable(self, slot: int) -> None:
        if self._evictable[slot]:
            self._unlink(slot)
            self._evictable[slot] = 0
            self._count -= 1

    def mark_pinned(self, key: BlockKey, slot: int) -> None:
        self._unlink_evictable(slot)

    def _unlink_many(self, slots: Sequence[int]) -> None:
        """:meth:`_unlink_evictable` of each slot, inlined: the batched :meth:`mark_pinned` of a
        policy that keeps the base one (a Python call per block would cost more than the work)."""
        flags, prv, nxt = self._evictable, self._prev, self._next
        unlinked = 0
        for slot in slots:
            if flags[slot]:
                before, after = prv[slot], nxt[slot]
                nxt[before] = after
                prv[after] = before
                flags[slot] = 0
                unlinked += 1
        self._count -= unlinked

    def evictable_count(self) -> int:
        return self._count
