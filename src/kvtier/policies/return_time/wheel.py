"""A prefix-closed timing wheel over row slots: the storage of ``return-time``.

:class:`ExpiryWheel` keeps the evictable blocks ordered by expiry, on a clock
of block references, and evicts the earliest expiry first, leaves before their
parents. It decides no expiry itself: whoever references a block sets
``_expiry[slot]`` (its policy, :class:`~kvtier.policies.return_time.policy.ReturnTimePolicy`).
Used as a policy on its own, every reference holds its block 0 references, so
every block sits in the expired list in reference order: that is LRU's order
over whole requests (a stored block's ancestors count as referenced with it,
so a chain's leaves go before its head; plain LRU holds a loaded prefix as
older than the blocks stored after it, and cuts it at its head).

**Lists.** Evictable blocks sit in intrusive doubly linked lists over row
slots (see :mod:`kvtier.policies.slot_lists`): a wheel of ``RING`` lists,
each holding the blocks whose expiry falls in one interval of ``_width``
references (sentinel ``capacity + 1 + bucket % RING``), and one list of
expired blocks in expiry order (sentinel ``capacity``), into which a wheel
list is spliced in O(1) when the clock passes its interval. Eviction scans
the expired list and then the wheel in time order. Inside a list, blocks are
in reference order, a chain's tail before its head: a block that becomes
evictable goes right before its parent when that is in the same list (see
:meth:`ExpiryWheel._to_parent`).

**Open and marked blocks.** An expiry with bit :data:`OPEN` is provisional:
its owner sets it when the request that stored the block is complete, no
raise of the block's ancestors passes it, and
:meth:`ExpiryWheel._release_holds` leaves it alone; it is ordered by its
``CLOCK`` bits. A child count of :data:`MARK` or more marks a block (the count
is ``MARK`` more than its children): an eviction that reaches it asks its
owner first (:meth:`ExpiryWheel._reached_open`), and until then it is passed
over like a block with children. Leaves cost the scan nothing more.

**Blocks to evict first.** Its owner gives a block expiry :data:`FIRST` to
have it evicted before any other: it sits at the head of the expired list,
which it joins there whenever it becomes evictable (a store completing, an
unpin; see :meth:`ExpiryWheel._link_first`), tail before parent, so what its
owner decides does not depend on whether the block was evictable then.

**Prefix links.** Each block knows its parent (``_parent[slot]``, -1 if
unknown) and how many held blocks name it as parent (``_children[slot]``).
Eviction passes over a block with children while leaves qualify, so the cache
stays prefix-closed.

Per slot: the lists' two pointers and the key (24 bytes), ``_evictable``,
``_touches`` (1 byte each), ``_parent``, ``_children``, ``_expiry`` (8 bytes each: list
items pointing at shared int objects; a store's blocks share their expiry's), allocated once.
Every operation is O(1) per block, except that eviction passes over blocks
that are not leaves (at most ``PASS_LIMIT + 4n`` a call), raising a block's
ancestors walks up those whose expiry it raises, and a block linked before its
parent takes along the descendants linked right before it. Called from one
thread (the tier's).
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import ClassVar

import numpy as np

from kvtier.keys import BlockKey
from kvtier.policies.slot_lists import NO_KEY, SlotListPolicy

RING = 128
"""Lists in the timing wheel."""

PASS_LIMIT = 64
"""Non-leaves an eviction may pass over (plus 4 per block it evicts) before taking them in order."""

OPEN = 1 << 60
"""Expiry bit: the expiry is provisional, its owner sets it later (see the module docstring)."""

CLOCK = OPEN - 1
"""Mask of an expiry's clock value."""

MARK = 1 << 40
"""Added to a block's child count to mark it (see the module docstring)."""

FIRST = -2
"""Expiry of a block to evict before any other (an ended conversation's: see the module docstring).
Below every expiry a reference sets (those are at least the clock, 0 and up), so a reference, or
a raise of the block as an ancestor, ends it. Not -1: :meth:`ExpiryWheel.mark_evictable_many`'s "no run"."""


class ExpiryWheel(SlotListPolicy):
    """Evictable blocks by expiry (a timing wheel), leaves before parents; holds of 0 on its own.

    ``horizon``: the longest hold, in references, that the wheel must order
    (``max_hold`` is that, rounded up to whole intervals).
    """

    name: ClassVar[str] = "expiry-wheel"

    def __init__(self, capacity: int, horizon: int | None = None) -> None:
        super().__init__(capacity)
        self.horizon = horizon if horizon is not None else max(256, 8 * capacity)
        self._width = max(1, -(-self.horizon // (RING - 2)))
        self.max_hold = (RING - 2) * self._width
        self._now = 0
        self._reset_blocks()

    def _reset_blocks(self) -> None:
        c = self.capacity
        self._init_lists(1 + RING)
        # Lists, not arrays: parents are the tier's own slot ints and counts are small ints,
        # both shared objects, and list items are read without boxing.
        self._parent: list[int] = [-1] * c
        self._children: list[int] = [0] * c
        # A list too: an array('q') item costs 3-5x a list item to write (argument parsing, and a
        # multi-digit int's conversion), and the expiries of a store's blocks are one int object.
        self._expiry: list[int] = [0] * c
        self._touches = bytearray(c)
        self._cur = self._now // self._width
        self._fresh: list[int] = []  # slots inserted since the last chain, in order
        self._cut: list[int] = []  # see _cut_at
        self._rescan = False  # evict is scanning a second time (see there)

    # --- the tier's calls -------------------------------------------------------------

    def insert(self, key: BlockKey, slot: int) -> None:
        # A free slot already has no parent, no touches and expiry 0 (see _forget, remove);
        # _children[slot] keeps counting orphans of an earlier block of this slot (see evict).
        self._key_of[slot] = key
        self._fresh.append(slot)  # cleared by the next chain or eviction: at most capacity long

    def remove(self, key: BlockKey, slot: int) -> None:
        if self._key_of[slot] is NO_KEY:
            return
        self._unlink_evictable(slot)
        if self._children[slot] >= MARK:
            self._children[slot] -= MARK
        parent = self._parent[slot]
        if parent >= 0:
            self._children[parent] -= 1
            self._parent[slot] = -1
        self._key_of[slot] = NO_KEY
        self._touches[slot] = 0
        self._expiry[slot] = 0

    def touch(self, key: BlockKey, slot: int) -> None:
        if self._key_of[slot] is not NO_KEY:
            self.reference_chain((key,), (slot,), -1, True)

    def reference_chain(self, keys: Sequence[BlockKey], slots: Sequence[int], parent: int, hit: bool) -> None:
        """Link the chain under ``parent`` and hold every block 0 references, tail first; raise the
        ancestors to the head (LRU order, a stored block's ancestors never older than it)."""
        n = len(slots)
        if not n:
            return
        now = self._now
        if now // self._width != self._cur:
            self._advance(now // self._width)
        self._fresh.clear()
        self._link_chain(slots, parent)
        expiry, flags = self._expiry, self._evictable
        moved = moved_to = -1
        for i in range(n - 1, -1, -1):
            s = slots[i]
            expiry[s] = max(expiry[s], now)
            if flags[s]:
                moved, moved_to = s, self._list_for(expiry[s])
                self._move_to_tail(s, moved_to)
        if moved >= 0:
            self._to_parent(moved, moved_to)
        if parent >= 0:
            self._raise_ancestors(parent, expiry[slots[0]])
        self._now = now + n

    def _link_chain(self, slots: Sequence[int], parent: int) -> None:
        """Make ``slots[i - 1]`` (``parent`` for the first) the parent of ``slots[i]``."""
        par, children = self._parent, self._children
        up = parent
        for s in slots:
            if up >= 0 and up != s and par[s] != up:
                old = par[s]
                if old >= 0:
                    children[old] -= 1
                par[s] = up
                children[up] += 1
            up = s

    def mark_evictable(self, key: BlockKey, slot: int) -> None:
        # One block (a single unpin); the CPU tier's stores and releases take mark_evictable_many.
        if not self._evictable[slot]:
            if self._expiry[slot] == FIRST:
                self._evictable[slot] = 1
                self._count += 1
                self._link_first(slot, slot)
                return
            end = self._list_for(self._expiry[slot])
            self._link_evictable(slot, end)
            self._to_parent(slot, end)

    # Batched forms, inlined: the CPU tier calls them for every block it stores, pins and
    # releases, and a Python call per block would cost more than the work.

    def insert_many(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        key_of = self._key_of
        for i in range(len(slots)):
            key_of[slots[i]] = keys[i]
        self._fresh.extend(slots)

    def mark_evictable_many(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        if len(slots) == 1:  # a decode store's block
            slot = slots[0]
            parent = self._parent[slot]
            flags, expiry = self._evictable, self._expiry
            if (
                parent >= 0 and not flags[slot] and not self._children[slot] and flags[parent]
                and expiry[parent] == expiry[slot]
            ):  # fmt: skip
                # Its parent is linked in its list (the same expiry), and it has no descendant to
                # take along: it goes right before its parent (mark_evictable, inlined).
                prv, nxt = self._prev, self._next
                flags[slot] = 1
                self._count += 1
                before = prv[parent]
                nxt[before] = slot
                prv[slot] = before
                nxt[slot] = parent
                prv[parent] = slot
            else:
                self._mark_one(slot)
            return
        # mark_evictable of each block in order, inlined. Blocks of one expiry bucket are linked
        # among themselves as they come and spliced onto their list's tail once (_link_run):
        # the list then is what a tail append per block makes. A store completes tail first, so
        # a parent comes after its child and only the head's parent is linked already: there the
        # run goes to the list and the head before its parent (_to_parent), as a single call
        # would do. A run of blocks to evict first (end -1) goes to the expired list's head instead
        # (_link_first): a test per run, not per block.
        flags, expiry, prv, nxt, par = self._evictable, self._expiry, self._prev, self._next, self._parent
        width, cur, cap = self._width, self._cur, self.capacity
        skipped = 0
        last = end = first = tail = -1
        for slot in slots:
            if flags[slot]:
                skipped += 1
                continue
            flags[slot] = 1
            e = expiry[slot]
            if e != last:
                if first >= 0:  # close the run: onto its list's tail
                    if end >= 0:
                        self._link_run(first, tail, end)
                    else:
                        self._link_first(first, tail)
                last = e
                bucket = (e & CLOCK) // width  # _list_for, inlined
                end = cap if bucket < cur else cap + 1 + bucket % RING if e >= 0 else -1
                first = slot
            else:
                nxt[tail] = slot
                prv[slot] = tail
            tail = slot
            # The parent linked already, or in this run: close the run first. (No parent, -1, reads
            # the last slot's flag: at worst a run closed early, which _to_parent leaves in place.)
            if flags[par[slot]]:
                if end >= 0:
                    self._link_run(first, slot, end)
                    self._to_parent(slot, end)
                else:
                    self._link_first(first, slot)
                first = last = -1
        if first >= 0:
            if end >= 0:
                self._link_run(first, tail, end)
            else:
                self._link_first(first, tail)
        self._count += len(slots) - skipped

    def _mark_one(self, slot: int) -> None:
        """:meth:`mark_evictable` of one block, inlined for a block with no descendant linked at the
        tail of its list (a decode store's): right before its parent when that is in the same
        list, else at the list's tail."""
        flags = self._evictable
        if flags[slot]:
            return
        cap, width, cur = self.capacity, self._width, self._cur
        expiry, prv, nxt = self._expiry, self._prev, self._next
        bucket = (expiry[slot] & CLOCK) // width
        if bucket >= cur and expiry[slot] == FIRST:  # (FIRST's bucket is never past)
            self._evictable[slot] = 1
            self._count += 1
            self._link_first(slot, slot)
            return
        end = cap if bucket < cur else cap + 1 + bucket % RING
        parent = self._parent[slot]
        tail = prv[end]
        if tail < cap and self._parent[tail] == slot:  # a descendant is linked there: the general way
            self._link_evictable(slot, end)
            self._to_parent(slot, end)
            return
        flags[slot] = 1
        self._count += 1
        if parent >= 0 and parent != slot and flags[parent]:
            up = (expiry[parent] & CLOCK) // width
            # (a parent to evict first is in the expired list whatever its bucket says)
            if (cap if up < cur or expiry[parent] == FIRST else cap + 1 + up % RING) == end:
                before = prv[parent]
                nxt[before] = slot
                prv[slot] = before
                nxt[slot] = parent
                prv[parent] = slot
                return
        nxt[tail] = slot
        prv[slot] = tail
        nxt[slot] = end
        prv[end] = slot

    def mark_pinned_many(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        self._unlink_many(slots)

    def mark_evictable_then_pinned_many(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        # mark_evictable only links a block into its expiry's list, so linking then unlinking
        # leaves a block that was not linked as it was, and unlinks one that was.
        self._unlink_many(slots)

    # --- ordering ---------------------------------------------------------------------

    def _list_for(self, expiry: int) -> int:
        """The list (sentinel) of a block of this expiry: its wheel list, or the expired list."""
        bucket = (expiry & CLOCK) // self._width
        if bucket < self._cur or expiry == FIRST:
            return self.capacity
        return self.capacity + 1 + bucket % RING

    def _link_first(self, first: int, last: int, outside: tuple[int, ...] = ()) -> None:
        """Link the run ``first .. last`` (linked among itself, flagged evictable, expiry
        :data:`FIRST`, tail first) into the expired list, to be evicted before any other block:
        right before ``last``'s parent when that is linked there to go first too, else at the
        list's head, after the run of ``first``'s descendants leading it (linked while ``first``
        was pinned or in flight; at most ``PASS_LIMIT`` are looked at).

        A chain that becomes evictable tail first (a store completing, an unpin) or head first
        stays tail first. Only blocks to evict first come here: O(the run) at most. ``outside``:
        blocks of the caller's run not linked yet (flagged, in no list), never taken for linked.
        """
        par, nxt, cap = self._parent, self._next, self.capacity
        parent = par[last]
        if parent >= 0 and parent != last and self._evictable[parent] and self._expiry[parent] == FIRST:
            slot = first
            while slot != last and slot != parent:
                slot = nxt[slot]
            if slot != parent:
                if parent not in outside:  # flagged, in no run of ours: linked, in the expired list
                    self._link_run(first, last, parent)
                    return
                # (stale parent links made a cycle through a block of the caller's run: the head)
            else:
                # The parent is in the run (a chain head first in one call): the rest of the run
                # first, then the block right before its parent.
                self._link_first(first, self._prev[last], (*outside, last))
                self._link_run(last, last, parent)
                return
        at = nxt[cap]
        slot = at
        for _ in range(PASS_LIMIT):
            if slot >= cap:
                break
            up = par[slot]
            if up == first:  # the run's child ends the descendants leading the list
                at = nxt[slot]
                break
            if up != nxt[slot]:  # not a chain tail first: no descendant of the run
                break
            slot = up
        self._link_run(first, last, at)

    def _to_parent(self, slot: int, end: int) -> None:
        """Move ``slot``, just linked at the tail of list ``end``, with the run of its descendants
        linked right before it, to just before its parent, when the parent is in the same list.

        A chain stays tail first in its list whatever order its blocks become
        evictable in, and however many pieces it was stored in (a prefill in
        chunks, a decode block at a time; the CPU tier completes a store tail
        first and releases a cascaded one head first): eviction meets the
        leaves before their ancestors, and passes over none of them.
        """
        parent = self._parent[slot]
        if parent < 0 or parent == slot or not self._evictable[parent] or self._list_for(self._expiry[parent]) != end:
            return
        prv, par, cap = self._prev, self._parent, self.capacity
        first = slot
        before = prv[slot]
        while before < cap and par[before] == first:  # the block before is a child of the run's first
            if before == parent:  # a cycle through stale parent links: stay at the tail
                return
            first = before
            before = prv[before]
        # The run leaves the tail and goes before the parent (_link_run, inlined: once a store).
        nxt = self._next
        after = nxt[slot]
        nxt[before] = after
        prv[after] = before
        before = prv[parent]
        nxt[before] = first
        prv[first] = before
        nxt[slot] = parent
        prv[parent] = slot

    def _raise_ancestors(self, slot: int, expiry_at_least: int) -> None:
        """Raise ``slot`` and its ancestors to ``expiry_at_least`` until one is there already, or a
        free slot (the stale link of a block whose parent was evicted: a free slot keeps expiry 0,
        where a walk over a request's blocks stops)."""
        expiry, flags, par, key_of = self._expiry, self._evictable, self._parent, self._key_of
        width = self._width
        bucket = expiry_at_least // width
        # A past expiry (a request settled after its last store's bucket went by) goes to the
        # expired list: a wheel list of a past bucket is scanned as the farthest future.
        end = self._list_for(expiry_at_least)
        moved = -1
        while slot >= 0 and expiry[slot] // width < bucket and key_of[slot] is not NO_KEY:
            expiry[slot] = expiry_at_least
            if flags[slot]:
                moved = slot
                self._move_to_tail(slot, end)
            slot = par[slot]
        if moved >= 0:  # moved child first: keep them before the first ancestor not raised
            self._to_parent(moved, end)

    def _advance(self, cur: int) -> None:
        """Splice the wheel lists whose interval the clock passed onto the expired list."""
        prv, nxt = self._prev, self._next
        expired, c1 = self.capacity, self.capacity + 1
        for bucket in range(self._cur, min(cur, self._cur + RING)):
            end = c1 + bucket % RING
            first = nxt[end]
            if first == end:
                continue
            self._link_run(first, prv[end], expired)
            nxt[end] = prv[end] = end
        self._cur = cur

    def _release_holds(self, now: int) -> None:
        """End every hold now but the open blocks': the wheel joins the expired list, in expiry order.

        O(capacity) in numpy (and a walk of the evictable blocks when open ones
        are among them, to put those back), so LRU order takes over at once
        instead of after the longest hold.
        """
        self._advance(self._cur + RING)
        self._cur = now // self._width
        expiries = self._expiry
        values = np.array(expiries, dtype=np.int64)
        held_open = values >= OPEN
        floor = max(now, 1)  # a held block stays above 0
        for slot in np.flatnonzero((values > floor) & ~held_open).tolist():
            expiries[slot] = floor
        if not held_open.any():
            return
        nxt, cap = self._next, self.capacity
        slot = nxt[cap]
        while slot != cap:  # an open block keeps its expiry, so it goes back to that bucket
            after = nxt[slot]
            if expiries[slot] >= OPEN:
                end = self._list_for(expiries[slot])
                if end != cap:  # one whose bucket is past stays where it is: moved to the tail of
                    self._move_to_tail(slot, end)  # the list walked, two of them swapped forever
            slot = after

    # --- eviction ---------------------------------------------------------------------

    def evict(self, n: int, protected: Container[BlockKey] = ()) -> list[BlockKey] | None:
        """Take ``n`` unprotected evictable blocks, earliest expiry first, leaves before parents.

        A block with held children is passed over while leaves qualify (its
        children usually follow it in the same list and leave first); it is
        taken only when leaves, counting those its chosen children leave
        behind, are too few, or once the scan has passed ``64 + 4n`` such
        blocks (a long chain stored piece by piece), so one scan never passes
        more than that beyond the blocks it takes (an eviction scans twice at
        most: see the end). Atomic: None, nothing taken, if fewer than ``n``
        qualify (requests whose last block a scan reached stay opened).
        Long because the eviction of one block (a decode store's) is inlined:
        a call costs as much as its work.
        """
        self._fresh.clear()  # the tier evicts before it inserts
        if n <= 0:
            return []
        if n > self._count:
            return None
        if n == 1:  # a decode store's eviction: the first block in eviction order, if a leaf (inlined)
            nxt, cap = self._next, self.capacity
            end = cap
            slot = nxt[cap]
            if slot == cap:
                end = cap + 1 + self._cur % RING
                slot = nxt[end]
            if slot != end and not self._children[slot]:
                key = self._key_of[slot]
                if key not in protected:
                    after = nxt[slot]
                    before = self._prev[slot]
                    nxt[before] = after
                    self._prev[after] = before
                    parent = self._parent[slot]
                    if self._expiry[slot] >= OPEN:
                        self._cut_at(slot)
                    if parent >= 0:
                        self._children[parent] -= 1
                        self._parent[slot] = -1
                    self._evictable[slot] = 0
                    self._key_of[slot] = NO_KEY
                    self._touches[slot] = 0
                    self._expiry[slot] = 0
                    self._count -= 1
                    return [key]
        taken = self._evict_run(n, protected)
        if taken is not None:
            return taken
        nxt, key_of, children, par = self._next, self._key_of, self._children, self._parent
        chosen: list[int] = []
        passed: list[int] = []
        # Once an owner moved blocks out of the way (_reached_open), the scan may meet a block it
        # passed or chose before, in a list further on: from then on, those it saw are skipped.
        seen: set[int] | None = None
        budget = PASS_LIMIT + 4 * n
        need = n
        cap, c1, cur = self.capacity, self.capacity + 1, self._cur
        # The expired list, then the wheel's lists in time order (no generator: one per store).
        for k in range(-1, RING):
            end = cap if k < 0 else c1 + (cur + k) % RING
            slot = nxt[end]
            while slot != end:
                if seen is not None:
                    if slot in seen:
                        slot = nxt[slot]
                        continue
                    seen.add(slot)
                if children[slot] and budget:
                    if children[slot] >= MARK and (resume := self._reached_open(slot)) >= 0:
                        if seen is None:
                            seen = {*passed, *chosen}
                        seen.discard(slot)  # moved on, unmarked: it may still qualify where it went
                        slot = resume  # it moved out of the way: go on where it was
                        continue
                    passed.append(slot)
                    budget -= 1
                    if not budget:  # older non-leaves go before newer blocks from now on
                        passed = self._take_passed(n, chosen, passed, protected)
                        need = n - len(chosen)
                        if not need:
                            break
                elif key_of[slot] not in protected:
                    chosen.append(slot)
                    parent = par[slot]
                    if parent >= 0:
                        children[parent] -= 1
                    need -= 1
                    if not need:
                        break
                slot = nxt[slot]
            if not need:
                break
        if need:
            self._take_passed(n, chosen, passed, protected)
            if len(chosen) < n:
                for slot in chosen:  # undo: too few qualify
                    parent = par[slot]
                    if parent >= 0:
                        children[parent] += 1
                if seen is not None and not self._rescan:
                    # An owner moved blocks during the scan (_reached_open), maybe into a list it
                    # had passed (an open request's expiry can be past): one more scan, never a
                    # third, finds them (the marks this one reached are cleared).
                    self._rescan = True
                    try:
                        return self.evict(n, protected)
                    finally:
                        self._rescan = False
                return None
        return self._forget(chosen)

    def _evict_run(self, n: int, protected: Container[BlockKey]) -> list[BlockKey] | None:
        """:meth:`evict` of the first ``n`` blocks in eviction order when they are one run of one
        list, each a leaf once the ones before it are taken (a request's blocks, tail first) and
        none protected: the usual case, in two plain passes; None, changing nothing, otherwise."""
        nxt, children, key_of, par = self._next, self._children, self._key_of, self._parent
        cap, c1, cur = self.capacity, self.capacity + 1, self._cur
        end = cap
        first = nxt[cap]
        k = 0
        while first == end:  # the first list that holds a block: expired, then the wheel in time order
            if k == RING:
                return None
            end = c1 + (cur + k) % RING
            first = nxt[end]
            k += 1
        keys: list[BlockKey] = []
        slot = first
        for _ in range(n):
            if slot == end or children[slot]:
                break
            key = key_of[slot]
            if key in protected:
                break
            keys.append(key)
            parent = par[slot]
            if parent >= 0:
                children[parent] -= 1
            slot = nxt[slot]
        else:
            return self._take_run(first, slot, end, keys)
        slot = first
        for _ in range(len(keys)):  # undo
            parent = par[slot]
            if parent >= 0:
                children[parent] += 1
            slot = nxt[slot]
        return None

    def _take_run(self, first: int, after: int, end: int, keys: list[BlockKey]) -> list[BlockKey]:
        """Unlink and reset the run ``first`` up to the block before ``after`` in the list with
        sentinel ``end`` (its blocks' keys: ``keys``, their parents' counts already lowered)."""
        key_of, par, nxt = self._key_of, self._parent, self._next
        flags, touches, expiry = self._evictable, self._touches, self._expiry
        s = first
        while s != after:
            key_of[s] = NO_KEY
            flags[s] = 0
            if expiry[s] >= OPEN:
                self._cut_at(s)
            par[s] = -1
            touches[s] = 0
            expiry[s] = 0
            s = nxt[s]
        nxt[end] = after
        self._prev[after] = end
        self._count -= len(keys)
        return keys

    def _cut_at(self, slot: int) -> None:
        """An eviction takes ``slot``, an open block (nothing else qualified): if its parent is
        open with the same expiry (the same request), the request's chain is cut there, and the
        parent is noted in ``_cut``, for the owner to settle what stays of the request once the
        eviction is over (an open block is held after nearly every other block: left open, what
        stays would outlive the blocks the tier keeps for their reuse). Called before the slot is
        reset; rare (an open request's blocks go last)."""
        parent = self._parent[slot]
        if parent >= 0 and self._expiry[parent] == self._expiry[slot]:
            self._cut.append(parent)

    def _reached_open(self, slot: int) -> int:
        """An eviction reached the marked block in ``slot``: -1, it is passed over like a block with
        children (its mark may be cleared: then it is one no longer); or its owner moved it (and
        whatever else) out of the way, and the eviction goes on from the slot returned (what
        followed it in its list). The wheel clears the mark."""
        self._children[slot] -= MARK
        return -1

    def _take_passed(self, n: int, chosen: list[int], passed: list[int], protected: Container[BlockKey]) -> list[int]:
        """Top ``chosen`` up from ``passed``: leaves by now first, then any (orphaning children).

        Returns the passed blocks not taken.
        """
        key_of, children, par = self._key_of, self._children, self._parent
        taken = set(chosen)  # never a slot twice (a scan that met a moved block again: see evict)
        for leaves_only in (True, False):
            left: list[int] = []
            for slot in passed:
                if slot in taken:
                    continue
                if len(chosen) == n or (leaves_only and children[slot]) or key_of[slot] in protected:
                    left.append(slot)
                    continue
                chosen.append(slot)
                taken.add(slot)
                if children[slot] >= MARK:
                    children[slot] -= MARK
                parent = par[slot]
                if parent >= 0:
                    children[parent] -= 1
            passed = left
        return passed

    def _forget(self, chosen: list[int]) -> list[BlockKey]:
        """Unlink and reset the ``chosen`` slots; their keys, in order.

        Chosen blocks are mostly runs of one list (its oldest blocks, in list
        order): each run is unlinked at once, joining the block before its
        first to the block after its last.
        """
        prv, nxt, flags, key_of, par = self._prev, self._next, self._evictable, self._key_of, self._parent
        touches, expiry = self._touches, self._expiry
        keys: list[BlockKey] = []
        first = last = chosen[0]
        for slot in chosen:
            if slot != last and nxt[last] != slot:  # a run ends: unlink it
                before, after = prv[first], nxt[last]
                nxt[before] = after
                prv[after] = before
                first = slot
            last = slot
            flags[slot] = 0
            keys.append(key_of[slot])
            key_of[slot] = NO_KEY
            if expiry[slot] >= OPEN:
                self._cut_at(slot)
            par[slot] = -1
            touches[slot] = 0
            expiry[slot] = 0
        before, after = prv[first], nxt[last]
        nxt[before] = after
        prv[after] = before
        self._count -= len(chosen)
        return keys

    def clear(self) -> None:
        """Forget every block."""
        self._reset_blocks()
