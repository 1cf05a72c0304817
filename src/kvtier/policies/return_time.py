"""Prefix-closed eviction by learned holding times (``"return-time"``).

Each reference of a block holds it for a time learned online from the return
times of blocks like it; eviction takes the block whose hold ran out first,
leaves before their parents.

**Prefix structure.** The tier reports every request's blocks in prefix order
(:meth:`EvictionPolicy.reference_chain`), so each block knows its parent
(``_parent[slot]``, -1 if unknown) and how many held blocks name it as parent
(``_children[slot]``). A chain's head never expires before its tail (a
reference raises the expiry of the block's ancestors to its own), and eviction
takes leaves first: a block with children is skipped while any leaf qualifies.
Both keep the cache prefix-closed, so no room goes to blocks a prefix lookup
can never reach.

**Holding times.** A reference gives its block a class from cheap features of
the request: whether the block is new here, referenced once before, or more
often; how many of the request's blocks are genuinely new (after the deepest
one that is held and was referenced before, or is the recorded end of one of
the last ``capacity / 4`` requests: ``<= 1, 3, 7`` or more); and whether
it is the request's last block. (A fifth bucket, ``<= 15``, was dropped: on
the conversation trace the 24 classes beat the 30 at every capacity, 1.48 /
1.89 / 1.79 / 1.13x LRU against 1.45 / 1.88 / 1.74 / 1.11x at 0.5-5 %, the
generated workloads moved by -2 to +3 %, and a store probes 9 keys of its
request at most instead of 17.) The table of request ends
(:class:`~kvtier.policies.recent_keys.RecentKeys`) is large enough to cover
the return times that matter, so a conversation that comes back is recognised
whether or not the cache kept its blocks: the classes, and so the statistics
learned per class, do not change when the holds do (with the end of the last
few hundred requests only, the classes followed the cache's own choices, and
the conversation trace's hit rate at 5 % capacity was 1.075x LRU's instead of
1.11x). A block's expiry becomes ``max(expiry, now +
hold[class])`` on the clock of block references. The holds come from
:mod:`kvtier.policies.return_times`: a sample of keys is followed whether
cached or not, their return times per class give survival curves, and the
holds are the ones that maximise predicted hits with predicted occupancy equal
to the capacity. The learned holds are used only while they predict at least
2 % more hits than holding every class alike (which is LRU's order), and only
while a sampled LRU confirms that they do not lose: otherwise every hold is 0,
which is exactly LRU (recency order, heads protected), for a back-off period
that doubles with each loss.

Nothing to tune per workload: the horizon (8x capacity references), sample
size and solve period scale with the capacity.

**Queue.** Evictable blocks sit in intrusive doubly linked lists over row
slots (see :mod:`kvtier.policies.slot_lists`): a timing wheel of ``RING``
lists, each holding the blocks whose expiry falls in one interval of
``_width`` references (sentinel ``capacity + 1 + bucket % RING``), and one
list of expired blocks in expiry order (sentinel ``capacity``), into which a
wheel list is spliced in O(1) when the clock passes its interval. Eviction
scans the expired list and then the wheel in time order; inside a list,
blocks are in reference order, a chain's tail before its head: a block that
becomes evictable goes right before its parent when that is in the same list
(see :meth:`ReturnTimePolicy._to_parent`), so a request stored in pieces or
released head first is ordered like one stored at once. With every hold 0 this
is LRU order.

Per slot: the lists' two pointers and the key (24 bytes), ``_evictable``,
``_touches`` (1 byte each), ``_parent``, ``_children`` (8 bytes each: list
items pointing at shared int objects), ``_expiry`` (8 bytes); plus the sample
tables, about ``capacity / 4`` fingerprints, and the request ends, ``capacity /
4`` fingerprints of 24-40 bytes, all allocated once. Every operation is O(1)
per block, except that eviction passes over blocks that are not leaves (at most
``_PASS_LIMIT + 4n`` a call; chains being linked tail first, it rarely meets
one), a reference walks up the ancestors whose expiry it raises, and a block
linked before its parent takes along the descendants linked right before it.
Called from one thread (the tier's).
"""

from __future__ import annotations

from array import array
from collections.abc import Container, Sequence
from typing import ClassVar

import numpy as np

from kvtier.keys import BlockKey
from kvtier.policies.fingerprints import fingerprint
from kvtier.policies.recent_keys import RecentKeys
from kvtier.policies.return_times import (
    SAMPLE_SCALE,
    HoldingPlan,
    ReturnSampler,
    ReturnTimeModel,
    sample_threshold,
)
from kvtier.policies.slot_lists import NO_KEY, SlotListPolicy

RING = 128
"""Lists in the timing wheel."""

NEW_BUCKETS = 4
"""Classes by genuinely new blocks in the request: <= 1, <= 3, <= 7, more."""

CLASSES = NEW_BUCKETS * 2 * 3
"""new-blocks bucket x last block or not x referenced 0 / 1 / 2+ times before."""

_NEW_BUCKET = [0, 0, 1, 1, 2, 2, 2, 2, 3]
"""Bucket of ``min(new_blocks, 8)``."""

_GAIN_NEEDED = 1.05
"""Learned holds are used only if they predict this many times the hits of uniform holds."""

_GUARD_SIGMAS = 1.0
"""The sampled LRU must beat the learned holds by this many standard deviations to stop them."""

_GUARD_DECAY = 0.8
"""Weight of the previous periods in the guard's sums."""

_HORIZON = 8
"""Return times are followed up to this many times the capacity, in references."""

_SAMPLE_SIZE = 16384
"""Sampled keys followed at least (and a quarter of the capacity if more)."""

_PASS_LIMIT = 64
"""Non-leaves an eviction may pass over (plus 4 per block it evicts) before taking them in order."""

_OPEN_REQUESTS = 4096
"""Requests whose last store :meth:`ReturnTimePolicy.continue_chain` can extend, at most: more than
an engine runs at once; and one per 32 blocks of capacity (a record costs about 250 bytes), at
least 16. Kept in two generations of half as many: the older goes whole when the newer is full,
so a request's record lives for at least half the limit of stores after its last one."""
_HALF_LIFE = 2.0
"""Statistics lose half their weight in this many horizons."""


_RequestRecord = tuple[BlockKey, int, int, int, int, int, int, bool, int]
"""A request stored in pieces, between them (see :meth:`ReturnTimePolicy.continue_chain`): the key
its last store ended with, its new blocks so far, class base, blocks stored, its end now, the end
in the table of request ends (its first store's until the request ends: see
:meth:`ReturnTimePolicy.end_request`), clock of its last store, whether it drew the partial
class's extended hold, and its guard difference so far."""


class ReturnTimePolicy(SlotListPolicy):
    name: ClassVar[str] = "return-time"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        c = capacity
        self.horizon = max(256, _HORIZON * c)
        self._width = max(1, -(-self.horizon // (RING - 2)))
        self.max_hold = (RING - 2) * self._width
        # A quarter of the keys referenced within the horizon for small tiers (at most 2c),
        # and at least an eighth of the capacity for large ones (1 in 64 references).
        sample_size = max(min(2 * c, _SAMPLE_SIZE), c // 8)
        self._sample_below = sample_threshold(min(0.25, sample_size / self.horizon))
        self.sample_rate = self._sample_below / SAMPLE_SCALE
        self.solve_every = max(2048, c // 2)
        self.model = ReturnTimeModel(CLASSES, self.horizon)
        self.sampler = ReturnSampler(
            sample_size, self.horizon, self.model, lru_size=min(sample_size, max(1, round(self.sample_rate * c)))
        )
        self._history = RecentKeys(max(256, c // 4))
        self.hold: list[int] = [0] * CLASSES
        self.plan: HoldingPlan | None = None
        self.learning = False
        self.fallbacks = 0
        self._partial = -1
        self._extended = 0
        self._fraction = 0.0
        self._dither = 0.0
        self._class_refs = [0] * CLASSES
        self._now = 0
        self._last_solve = 0
        self._next_solve = self.solve_every
        self._backoff = 1
        self._lru_until = 0
        self._guard = [0, 0]  # this period, over chains: sum and sum of squares of (realised - LRU) sampled hits
        self._trial = [0.0, 0.0, 0]  # decayed guard sums since learning started, periods
        self._call_diff = 0
        self._call_sampled = False
        self._pending: tuple[int, int, list[BlockKey], list[int], list[int], list[int], int] | None = None
        self._fresh: list[int] = []  # slots inserted since the last chain, in order
        # Requests stored in pieces, by the slot their last store ended in (see continue_chain).
        # Two generations of half the limit each: the older goes whole when the newer is full.
        # (Taking the oldest entry of one dict that keeps deleting its first entries scans the
        # deleted ones each time: 2.4 us a store at 3,000 entries; an OrderedDict costs 0.2 us.)
        self._open: dict[int, _RequestRecord] = {}
        self._open_old: dict[int, _RequestRecord] = {}
        self._open_limit = max(8, min(_OPEN_REQUESTS, c // 32) // 2)  # per generation
        self._reset_blocks()

    def _reset_blocks(self) -> None:
        c = self.capacity
        self._init_lists(1 + RING)
        # Lists, not arrays: parents are the tier's own slot ints and counts are small ints,
        # both shared objects, and list items are read without boxing.
        self._parent: list[int] = [-1] * c
        self._children: list[int] = [0] * c
        self._expiry = array("q", bytes(8 * c))
        self._touches = bytearray(c)
        self._cur = self._now // self._width
        self._fresh = []
        self._open = {}
        self._open_old = {}

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

    def mark_evictable(self, key: BlockKey, slot: int) -> None:
        # One block (a single unpin); the CPU tier's stores and releases take mark_evictable_many.
        if not self._evictable[slot]:
            end = self._list_for(self._expiry[slot])
            self._link_evictable(slot, end)
            self._to_parent(slot, end)

    def _to_parent(self, slot: int, end: int) -> None:
        """Move ``slot``, just linked at the tail of list ``end``, with the run of its descendants
        linked right before it, to just before its parent, when the parent is in the same list.

        A chain stays tail first in its list whatever order its blocks become
        evictable in, and however many pieces it was stored in (a prefill in
        chunks, a decode block at a time; the CPU tier completes a store tail
        first and releases a cascaded one head first): eviction meets the
        leaves before their ancestors. Appended instead, each piece sat behind
        the pieces before it, and every eviction passed up to ``_PASS_LIMIT``
        ancestors, then took the oldest of them (measured: a decode store cost
        1.5x more, and a request's prefix was cut at its head).
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

    # Batched forms, inlined: the CPU tier calls them for every block it stores, pins and
    # releases, and a Python call per block would cost more than the work.

    def insert_many(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        key_of = self._key_of
        for i in range(len(slots)):
            key_of[slots[i]] = keys[i]
        self._fresh.extend(slots)

    def mark_evictable_many(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        # mark_evictable of each block in order, inlined. Blocks of one expiry bucket are linked
        # among themselves as they come and spliced onto their list's tail once (_link_run):
        # the list then is what a tail append per block makes. A store completes tail first, so
        # a parent comes after its child and only the head's parent is linked already: there the
        # run goes to the list and the head before its parent (_to_parent), as a single call
        # would do.
        flags, expiry, prv, nxt, par = self._evictable, self._expiry, self._prev, self._next, self._parent
        width, cur, cap = self._width, self._cur, self.capacity
        linked = 0
        last = end = first = tail = -1
        for slot in slots:
            if flags[slot]:
                continue
            flags[slot] = 1
            e = expiry[slot]
            if e != last:
                if first >= 0:  # close the run: onto its list's tail
                    self._link_run(first, tail, end)
                last = e
                bucket = e // width  # _list_for, inlined
                end = cap if bucket < cur else cap + 1 + bucket % RING
                first = slot
            else:
                nxt[tail] = slot
                prv[slot] = tail
            tail = slot
            linked += 1
            parent = par[slot]
            if parent >= 0 and flags[parent]:  # linked already, or in this run: close the run first
                self._link_run(first, slot, end)
                self._to_parent(slot, end)
                first = last = -1
        if first >= 0:
            self._link_run(first, tail, end)
        self._count += linked

    def mark_pinned_many(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        self._unlink_many(slots)

    def mark_evictable_then_pinned_many(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        # mark_evictable only links a block into its expiry's list, so linking then unlinking
        # leaves a block that was not linked as it was, and unlinks one that was.
        self._unlink_many(slots)

    def _list_for(self, expiry: int) -> int:
        bucket = expiry // self._width
        return self.capacity if bucket < self._cur else self.capacity + 1 + bucket % RING

    def reference_chain(self, keys: Sequence[BlockKey], slots: Sequence[int], parent: int, hit: bool) -> None:
        """Link, classify and hold each block of the chain (tail first), then raise its ancestors.

        A store that follows the load of its own prefix (the same request:
        its ``parent`` is the tail the load ended with, and nothing came in
        between) and holds blocks referenced before (the general path)
        re-classifies the loaded blocks with the request's count of new
        blocks, which the load could not know. A store of new blocks only
        (the fast path) leaves them in the load's classes: doing it there too
        measured mixed on the conversation trace (+1.4 / +1.8 / -0.6 / -1.3 /
        +0.8 % at 0.5-10 %) and worse with requests stored in pieces (-7 % at
        0.5 %, -2 % at 5 % with 4-block stores). Cost: O(len(slots)), plus
        one step per ancestor whose expiry is raised, plus a solve every
        ``solve_every`` references (see :meth:`_solve`).
        """
        n = len(slots)
        if not n:
            return
        now = self._now
        if now // self._width != self._cur:
            self._advance(now // self._width)
        fresh = self._fresh
        if hit:
            base = 0
        elif slots == fresh:
            # The fast path: every store of new blocks.
            fresh.clear()
            self._pending = None
            self._store_new(keys, slots, parent, now, None)
            return
        else:
            base = _NEW_BUCKET[min(self._new_blocks(keys, slots), 8)] * 6
            self._history.add(self._request_end(keys, parent))
        fresh.clear()
        self._raise_ancestors(*self._hold_chain(keys, slots, parent, hit, base, now))
        self._end_reference(n)

    def _hold_chain(
        self, keys: Sequence[BlockKey], slots: Sequence[int], parent: int, hit: bool, base: int, now: int
    ) -> tuple[int, int]:
        """The general path of :meth:`reference_chain`: returns (ancestor to raise first, expiry to raise to)."""
        par, children, touches, expiry = self._parent, self._children, self._touches, self._expiry
        hold, refs, partial = self.hold, self._class_refs, self._partial
        flags = self._evictable
        width, c1, below = self._width, self.capacity + 1, self._sample_below
        extended = self._extension()
        n = len(slots)
        moved = moved_to = -1  # the last block moved (the head-most) and its list
        olds: list[int] = []
        classes: list[int] = []
        last_class = 0 if hit else 3
        deeper = 0
        for i in range(n - 1, -1, -1):
            s = slots[i]
            up = slots[i - 1] if i else parent
            if up >= 0 and up != s and par[s] != up:
                old = par[s]
                if old >= 0:
                    children[old] -= 1
                par[s] = up
                children[up] += 1
            t = touches[s]
            cls = base + last_class + t
            last_class = 0
            if t < 2:
                touches[s] = t + 1
            refs[cls] += 1
            e = now + (extended if cls == partial else hold[cls])
            old = expiry[s]
            if hit:
                olds.append(old)
                classes.append(cls)
            if old > e:
                e = old
            if deeper > e:
                e = deeper
            expiry[s] = deeper = e
            if flags[s]:
                moved = s
                moved_to = c1 + (e // width) % RING  # e >= now: never a past bucket
                self._move_to_tail(s, moved_to)
            key = keys[i]
            if key[-1] < below:
                self._observe(fingerprint(key), cls, hit)
        if moved >= 0:  # the chain moved tail first: keep it before its parent
            self._to_parent(moved, moved_to)
        up = parent if parent >= 0 else par[slots[0]]
        pending = self._pending
        if hit:
            self._pending = (slots[-1], now + n, list(keys), list(slots), olds, classes, now)
        elif pending is not None:
            self._pending = None
            if base and pending[0] == parent and pending[1] == now:
                deeper, up = self._reclassify(pending, base, deeper)
        return up, deeper

    def _extension(self) -> int:
        """The hold of the partial class for this chain.

        Decided per chain (per request, for a request stored in pieces: see
        :meth:`continue_chain`): the tail's hold reaches the head anyway, so
        deciding per block would extend nearly every long chain.
        """
        return self._extension_hold(self._draw_extension())

    def _draw_extension(self) -> bool:
        """Whether this chain takes the partial class's extended hold (a share ``_fraction`` do)."""
        self._dither += self._fraction
        if self._dither >= 1.0:
            self._dither -= 1.0
            return True
        return False

    def _extension_hold(self, drawn: bool) -> int:
        return self._extended if drawn else self.hold[self._partial] if self._partial >= 0 else 0

    def _end_reference(self, n: int) -> None:
        if self._call_sampled:
            self._judge_chain()
        self._now += n
        if self._now >= self._next_solve:
            self._solve()

    def continue_chain(self, keys: Sequence[BlockKey], slots: Sequence[int], parent: int) -> None:
        """A store that continues the request whose last store ended in ``parent``: one request, one class.

        The request's new blocks are counted over all its stores, its end
        moves to this store (the table of request ends gets it, in place of
        the first store's, when the request ends: one entry per request
        however many stores), and its earlier blocks are re-classified: the previous tail is
        no longer the request's last block, and all of them move to the
        request's bucket of new blocks if it grew out of theirs (at most three
        times a request: the buckets end at 8). A re-classified block's expiry
        counts from the request's last store with its new class (lower, if
        that class holds less), and never falls below its descendants' in the
        request. Anything but a store of new blocks continuing an
        open request (see :data:`_OPEN_REQUESTS`) is a store of its own.
        Cost: :meth:`reference_chain`'s, plus one step per re-classified block.
        """
        n = len(slots)
        record = self._open.pop(parent, None) or self._open_old.pop(parent, None)
        if not n or record is None or slots != self._fresh or self._key_of[parent] != record[0]:
            if record is not None:
                self._publish_end(record)
            self.reference_chain(keys, slots, parent, False)
            return
        now = self._now
        if now // self._width != self._cur:
            self._advance(now // self._width)
        self._fresh.clear()
        self._pending = None
        self._store_new(keys, slots, parent, now, record)

    def _reclass_stored(self, tail: int, count: int, old_base: int, base: int, then: int) -> None:
        """Re-classify the ``count`` blocks a request stored up to slot ``tail`` (tail first).

        They were new when stored: class ``old_base`` (``+ 3`` for the tail,
        then the request's last block), now ``base``. Their holds count from
        ``then`` (the request's last store), each at least its descendant's;
        the request's ancestors are raised to them.
        """
        par, key_of, expiry, flags = self._parent, self._key_of, self._expiry, self._evictable
        refs, hold, below = self._class_refs, self.hold, self._sample_below
        floor = 0
        slot = tail
        moved = moved_to = -1
        for k in range(count):
            key = key_of[slot] if slot >= 0 else NO_KEY
            if key is NO_KEY:  # the chain was cut (a block evicted and its children orphaned)
                break
            old_cls = old_base + 3 if k == 0 else old_base
            if refs[old_cls]:  # the counts are since the last solve
                refs[old_cls] -= 1
                refs[base] += 1
            e = max(then + hold[base], floor)
            if e != expiry[slot]:
                expiry[slot] = e
                if flags[slot]:
                    moved, moved_to = slot, self._list_for(e)
                    self._move_to_tail(slot, moved_to)
            floor = e
            if key[-1] < below:
                self.sampler.reclass(fingerprint(key), base)
            slot = par[slot]
        else:
            self._raise_ancestors(slot, floor)
        if moved >= 0:
            self._to_parent(moved, moved_to)

    def _store_new(
        self, keys: Sequence[BlockKey], slots: Sequence[int], parent: int, now: int, record: _RequestRecord | None
    ) -> None:
        """A store of new blocks: of a new request (``record`` None) or continuing one (its record).

        Classifies by the recorded request ends only (none of the blocks was
        referenced before) and the request's new blocks so far, records the
        request's end (in place of its earlier one, see :meth:`continue_chain`),
        holds the blocks (class ``base``, ``base + 3`` for the last), raises the
        ancestors, ends the reference and notes the request, which may go on.
        New blocks have no parent, no touches and expiry 0, and are not
        evictable yet. The path of every store: inlined, as a call costs about
        as much as a block's work.
        Long because the classification and the hold loop share the chain's state.
        """
        n = len(slots)
        history = self._history
        found = history.deepest(keys, n - 9 if n > 9 else 0)  # _new_blocks(keys, ())
        end = self._request_end(keys, parent)
        if record is None:
            new = n if found < 0 else n - 1 - found
            base = _NEW_BUCKET[new if new < 8 else 8] * 6
            history.add(end)
            drawn, diff, stored, published = self._draw_extension(), 0, n, end
        else:
            _, new, old_base, stored, _, published, then, drawn, diff = record
            new = n - 1 - found if found >= 0 else new + n
            base = _NEW_BUCKET[new if new < 8 else 8] * 6
            self._reclass_stored(parent, stored if base != old_base else 1, old_base, base, then)
            stored += n
        par, children, touches, expiry = self._parent, self._children, self._touches, self._expiry
        hold, partial, refs = self.hold, self._partial, self._class_refs
        extended = self._extension_hold(drawn)
        last = base + 3
        tail_expiry = now + (extended if last == partial else hold[last])
        head_expiry = max(now + (extended if base == partial else hold[base]), tail_expiry)
        refs[last] += 1
        refs[base] += n - 1
        below = self._sample_below
        sampled: list[int] = []
        up = slots[0]
        if parent >= 0 and parent != up:
            par[up] = parent
            children[parent] += 1
        touches[up] = 1
        expiry[up] = head_expiry
        if keys[0][-1] < below:
            sampled.append(0)
        for i in range(1, n):  # the hot path of every store
            s = slots[i]
            par[s] = up
            children[up] += 1
            touches[s] = 1
            expiry[s] = head_expiry
            up = s
            if keys[i][-1] < below:
                sampled.append(i)
        expiry[up] = tail_expiry
        for i in sampled:
            self._observe(fingerprint(keys[i]), last if i == n - 1 else base, False)
        if parent >= 0:
            self._raise_ancestors(parent, head_expiry)
        if self._call_sampled:  # _end_reference
            diff = self._judge_chain(diff)
        self._now = now + n
        if self._now >= self._next_solve:
            self._solve()
        opened = self._open  # the request may go on (see continue_chain)
        opened[slots[-1]] = (keys[-1], new, base, stored, end, published, now, drawn, diff)
        if len(opened) >= self._open_limit:  # the older generation goes: finished requests, most likely
            for gone in self._open_old.values():
                self._publish_end(gone)
            self._open_old, self._open = opened, {}

    def end_request(self, tail_slot: int) -> None:
        """The request whose last store ended in ``tail_slot`` finished: its record goes, and its
        end takes the place of its first store's in the table of request ends.

        Until then a store that continues it only notes its end in the record: a
        request's end is what a later one (the conversation's next turn) meets,
        and moving it in the table at every decoded block cost a tenth of a
        decode store. A record dropped unfinished (see :data:`_OPEN_REQUESTS`)
        publishes its end the same way.
        """
        record = self._open.pop(tail_slot, None) or self._open_old.pop(tail_slot, None)
        if record is not None:
            self._publish_end(record)

    def _publish_end(self, record: _RequestRecord) -> None:
        if record[4] != record[5]:
            self._history.replace(record[5], record[4])

    def _raise_ancestors(self, slot: int, expiry_at_least: int) -> None:
        """Raise ``slot`` and its ancestors to ``expiry_at_least`` until one is there already."""
        expiry, flags, par = self._expiry, self._evictable, self._parent
        width = self._width
        bucket = expiry_at_least // width
        end = self.capacity + 1 + bucket % RING
        moved = -1
        while slot >= 0 and expiry[slot] // width < bucket:
            expiry[slot] = expiry_at_least
            if flags[slot]:
                moved = slot
                self._move_to_tail(slot, end)
            slot = par[slot]
        if moved >= 0:  # moved child first: keep them before the first ancestor not raised
            self._to_parent(moved, end)

    def _request_end(self, keys: Sequence[BlockKey], parent: int) -> int:
        """The fingerprint to record as the request's end, so its return is known even once
        its blocks are evicted: its last full block.

        That is the block before the last one (the last is usually partial, and a
        partial block is never referenced again); for a request of one block, the
        block it extends. One entry per request, so the table covers as many
        requests as it has entries.
        """
        return fingerprint(keys[-2] if len(keys) >= 2 else self._key_of[parent] if parent >= 0 else keys[-1])

    def _reclassify(
        self, pending: tuple[int, int, list[BlockKey], list[int], list[int], list[int], int], base: int, floor: int
    ) -> tuple[int, int]:
        """Give the hit prefix loaded just before the classes of its request, now known to add new blocks."""
        _, _, keys, slots, olds, classes, then = pending
        key_of, expiry, flags, refs, hold = self._key_of, self._expiry, self._evictable, self._class_refs, self.hold
        below = self._sample_below
        n = len(slots)
        moved = moved_to = -1
        for j in range(n):  # olds / classes are tail first
            i = n - 1 - j
            s = slots[i]
            if key_of[s] != keys[i]:
                if moved >= 0:
                    self._to_parent(moved, moved_to)
                return floor, -1
            old_cls = classes[j]
            cls = base + old_cls % 3
            refs[old_cls] -= 1
            refs[cls] += 1
            e = max(olds[j], then + hold[cls], floor)
            expiry[s] = floor = e
            if flags[s]:
                moved, moved_to = s, self._list_for(e)
                self._move_to_tail(s, moved_to)
            if keys[i][-1] < below:
                self.sampler.reclass(fingerprint(keys[i]), cls)
        if moved >= 0:
            self._to_parent(moved, moved_to)
        return floor, self._parent[slots[0]]

    def _new_blocks(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> int:
        """Blocks after the deepest one held and referenced before, or recorded as a request's end.

        ``slots`` empty: all the blocks are new here (only the recorded ends count).
        Looks 9 blocks back at most: more than 7 new blocks is the last class anyway.
        """
        n = len(keys)
        low = max(0, n - 9)
        found = self._history.deepest(keys, low)
        if slots:
            touches = self._touches
            for i in range(n - 1, max(found, low - 1), -1):
                if touches[slots[i]]:
                    return n - 1 - i
        return n if found < 0 else n - 1 - found

    def _observe(self, fp: int, cls: int, hit: bool) -> None:
        """A sampled reference: a return time for the model, a paired hit for the guard."""
        sampler = self.sampler
        prev = sampler.observe(fp, self._now, cls)
        if prev >= 0:
            self.model.record(prev, sampler.last_age)
        self._call_diff += hit - sampler.lru_hit
        self._call_sampled = True

    def _judge_chain(self, before: int = 0) -> int:
        """Add this chain's paired hit difference to the guard's sums; returns the request's so far.

        The guard pairs realised and sampled-LRU hits per chain: a chain's blocks
        hit or miss together, so its variance is taken over chains, not over
        blocks. A request stored in pieces is one chain: ``before`` is the
        difference of its earlier pieces, and its square is replaced by the
        square of the total.
        """
        diff = self._call_diff
        total = before + diff
        self._guard[0] += diff
        self._guard[1] += total * total - before * before
        self._call_diff = 0
        self._call_sampled = False
        return total

    def evict(self, n: int, protected: Container[BlockKey] = ()) -> list[BlockKey] | None:
        """Take ``n`` unprotected evictable blocks, earliest expiry first, leaves before parents.

        A block with held children is passed over while leaves qualify (its
        children usually follow it in the same list and leave first); it is
        taken only when leaves, counting those its chosen children leave
        behind, are too few, or once the scan has passed ``64 + 4n`` such
        blocks (a long chain stored piece by piece), so one eviction never
        scans more than that beyond the blocks it takes. Atomic: None and no
        change if fewer than ``n`` qualify.
        """
        self._fresh.clear()  # the tier evicts before it inserts
        if n <= 0:
            return []
        if n > self._count:
            return None
        nxt, key_of, children, par = self._next, self._key_of, self._children, self._parent
        chosen: list[int] = []
        passed: list[int] = []
        budget = _PASS_LIMIT + 4 * n
        need = n
        cap, c1, cur = self.capacity, self.capacity + 1, self._cur
        # The expired list, then the wheel's lists in time order (no generator: one per store).
        for k in range(-1, RING):
            end = cap if k < 0 else c1 + (cur + k) % RING
            slot = nxt[end]
            while slot != end:
                if children[slot] and budget:
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
                return None
        return self._forget(chosen)

    def _take_passed(self, n: int, chosen: list[int], passed: list[int], protected: Container[BlockKey]) -> list[int]:
        """Top ``chosen`` up from ``passed``: leaves by now first, then any (orphaning children).

        Returns the passed blocks not taken.
        """
        key_of, children, par = self._key_of, self._children, self._parent
        for leaves_only in (True, False):
            left: list[int] = []
            for slot in passed:
                if len(chosen) == n or (leaves_only and children[slot]) or key_of[slot] in protected:
                    left.append(slot)
                    continue
                chosen.append(slot)
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
            par[slot] = -1
            touches[slot] = 0
            expiry[slot] = 0
        before, after = prv[first], nxt[last]
        nxt[before] = after
        prv[after] = before
        self._count -= len(chosen)
        return keys

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

    # --- learning ---------------------------------------------------------------------

    def _release_holds(self, now: int) -> None:
        """End every hold now: the whole wheel joins the expired list, in expiry order.

        O(capacity) in numpy, once per fallback, so LRU order takes over at once
        instead of after the longest hold.
        """
        self._advance(self._cur + RING)
        self._cur = now // self._width
        expiry = np.frombuffer(self._expiry, dtype=np.int64)
        np.minimum(expiry, now, out=expiry)

    def _judge(self, now: int) -> None:
        """The guard: stop the learned holds while they lose to LRU on the sample.

        While learning, the sampled references' realised hits are compared
        with the sampled LRU's on the same references (decayed sums over the
        last few periods). If the learned holds fall behind (by half a
        standard deviation of the paired difference), every hold is 0 (LRU
        order) for a back-off period that doubles with each consecutive loss.
        """
        diff, square = self._guard
        self._guard = [0, 0]
        if not self.learning:
            return
        trial = self._trial
        trial[0] = _GUARD_DECAY * trial[0] + diff
        trial[1] = _GUARD_DECAY * trial[1] + square
        trial[2] += 1
        if trial[2] >= 2 and trial[0] < -_GUARD_SIGMAS * trial[1] ** 0.5:
            self.fallbacks += 1
            self._lru_until = now + self._backoff * self.solve_every
            self._backoff = min(2 * self._backoff, 64)
            self._release_holds(now)
        elif trial[2] >= 4:
            self._backoff = max(1, self._backoff // 2)

    def _solve(self) -> None:
        """Refresh the holding times from the statistics (every ``solve_every`` references)."""
        now = self._now
        elapsed = now - self._last_solve
        self._last_solve = now
        self._next_solve = now + self.solve_every
        self.sampler.expire(now)
        decay = 0.5 ** (elapsed / (_HALF_LIFE * self.horizon))
        plan = self.model.solve(
            self.capacity, self._class_refs, elapsed, decay, self.sampler.in_progress(now)
        )
        self._class_refs = [0] * CLASSES
        self.plan = plan
        self._judge(now)
        useful = bool(plan.learned_hits >= _GAIN_NEEDED * plan.lru_hits and plan.learned_hits > 0)
        was_learning = self.learning
        self.learning = useful and now >= self._lru_until
        if self.learning and not was_learning:
            self._trial = [0.0, 0.0, 0]
        if self.learning:
            self.hold = [min(h, self.max_hold) for h in plan.hold]
            self._partial, self._fraction = plan.partial, plan.fraction
            self._extended = min(plan.extended, self.max_hold)
        else:
            self.hold = [0] * CLASSES
            self._partial, self._extended, self._fraction = -1, 0, 0.0

    # --- reset ------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget every block; what was learned about the workload stays."""
        for records in (self._open_old, self._open):
            for record in records.values():
                self._publish_end(record)
        self._reset_blocks()
