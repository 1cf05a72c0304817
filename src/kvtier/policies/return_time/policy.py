"""Prefix-closed eviction by learned holding times (``"return-time"``).

Each reference of a block holds it for a time learned online from the return
times of blocks like it; eviction takes the block whose hold ran out first,
leaves before their parents. Three parts, as cachetools splits storage from
policy:

* the storage, :class:`~kvtier.policies.return_time.wheel.ExpiryWheel`: a
  timing wheel of slot lists, prefix links, leaves-first eviction (with every
  hold 0 it is LRU's order);
* the classifier, :class:`~kvtier.policies.return_time.classes.HoldClassifier`:
  the class of each reference and the hold of each class;
* the guard, :class:`~kvtier.policies.return_time.guard.LruGuard`: it stops
  the learned holds while a sampled LRU beats them.

This module joins them: it reports each reference to the classifier, sets the
block's expiry to ``max(expiry, now + hold[class])`` (a chain's head never
below its tail, its ancestors raised to it), feeds the sampled references to
the learning half (:mod:`kvtier.policies.return_time.model`) and solves the
holds every ``solve_every`` references. The learned holds are used while they
predict at least ``GAIN_NEEDED`` times the hits of holding every class alike
(LRU's order) and the guard lets them; otherwise every hold is 0.

Nothing to tune per workload: the horizon (8x capacity references), sample
size and solve period scale with the capacity. Memory: the wheel's per-slot
state, plus the sample tables, about ``capacity / 4`` fingerprints, and the
request ends, ``capacity / 4`` fingerprints of 24-40 bytes, all allocated
once. Called from one thread (the tier's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, NamedTuple

from kvtier.keys import BlockKey
from kvtier.policies.fingerprints import fingerprint
from kvtier.policies.return_time.classes import (
    BASE_OF_NEW,
    CLASSES,
    LAST,
    NEW_BUCKET_SPAN,
    HoldClassifier,
    OpenRequest,
    class_id,
    new_bucket,
    touches_of,
)
from kvtier.policies.return_time.guard import LruGuard
from kvtier.policies.return_time.model import (
    SAMPLE_SCALE,
    HoldingPlan,
    ReturnSampler,
    ReturnTimeModel,
    sample_threshold,
)
from kvtier.policies.return_time.wheel import RING, ExpiryWheel
from kvtier.policies.slot_lists import NO_KEY

GAIN_NEEDED = 1.05
"""Learned holds are used only if they predict this many times the hits of uniform holds."""

HORIZON = 8
"""Return times are followed up to this many times the capacity, in references."""

SAMPLE_SIZE = 16384
"""Sampled keys followed at least (and a quarter of the capacity if more)."""

OPEN_REQUESTS = 4096
"""Requests whose last store :meth:`ReturnTimePolicy.continue_chain` can extend, at most: more than
an engine runs at once; and one per 32 blocks of capacity (a record costs about 250 bytes), at
least 16. Kept in two generations of half as many: the older goes whole when the newer is full,
so a request's record lives for at least half the limit of stores after its last one."""

HALF_LIFE = 2.0
"""Statistics lose half their weight in this many horizons."""


class LoadedChain(NamedTuple):
    """The last hit chain (a load), which the same request's store may re-classify."""

    tail: int
    """Its tail's slot."""
    ends_at: int
    """The clock after it: a store at that clock came right after it."""
    keys: list[BlockKey]
    slots: list[int]
    expiries: list[int]
    """Each block's expiry before the load, tail first."""
    classes: list[int]
    """Each block's class at the load, tail first."""
    then: int
    """The clock of the load."""


class ReturnTimePolicy(ExpiryWheel):
    """``"return-time"``: learned holds on a prefix-closed timing wheel; see the module docstring."""

    name: ClassVar[str] = "return-time"

    def __init__(self, capacity: int) -> None:
        c = capacity
        super().__init__(capacity, max(256, HORIZON * c))
        # A quarter of the keys referenced within the horizon for small tiers (at most 2c),
        # and at least an eighth of the capacity for large ones (1 in 64 references).
        sample_size = max(min(2 * c, SAMPLE_SIZE), c // 8)
        self._sample_below = sample_threshold(min(0.25, sample_size / self.horizon))
        self.sample_rate = self._sample_below / SAMPLE_SCALE
        self.solve_every = max(2048, c // 2)
        self.model = ReturnTimeModel(CLASSES, self.horizon)
        self.sampler = ReturnSampler(
            sample_size, self.horizon, self.model, lru_size=min(sample_size, max(1, round(self.sample_rate * c)))
        )
        self.classes = HoldClassifier(max(256, c // 4))
        self.guard = LruGuard()
        self.plan: HoldingPlan | None = None
        self.learning = False
        self._last_solve = 0
        self._next_solve = self.solve_every
        self._loaded: LoadedChain | None = None
        self._open_limit = max(8, min(OPEN_REQUESTS, c // 32) // 2)  # per generation

    def _reset_blocks(self) -> None:
        super()._reset_blocks()
        # Requests stored in pieces, by the slot their last store ended in (see continue_chain).
        # Two generations of half the limit each: the older goes whole when the newer is full.
        # (Taking the oldest entry of one dict that keeps deleting its first entries scans the
        # deleted ones each time: 2.4 us a store at 3,000 entries; an OrderedDict costs 0.2 us.)
        self._open: dict[int, OpenRequest] = {}
        self._open_old: dict[int, OpenRequest] = {}

    @property
    def fallbacks(self) -> int:
        """Times the guard stopped the learned holds."""
        return self.guard.fallbacks

    # --- references -------------------------------------------------------------------

    def reference_chain(self, keys: Sequence[BlockKey], slots: Sequence[int], parent: int, hit: bool) -> None:
        """Link, classify and hold each block of the chain (tail first), then raise its ancestors.

        A store that follows the load of its own prefix (the same request:
        its ``parent`` is the tail the load ended with, and nothing came in
        between) and holds blocks referenced before (the general path)
        re-classifies the loaded blocks with the request's count of new
        blocks, which the load could not know. A store of new blocks only
        (the fast path, :meth:`_store_new`) leaves them in the load's classes.
        Cost: O(len(slots)), plus one step per ancestor whose expiry is
        raised, plus a solve every ``solve_every`` references (see :meth:`_solve`).
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
            self._loaded = None
            self._store_new(keys, slots, parent, now, None)
            return
        else:
            classes = self.classes
            base = class_id(new_bucket(classes.new_blocks(keys, slots, self._touches)), False, 0)
            classes.history.add(classes.request_end(keys, self._key_of[parent] if parent >= 0 else None))
        fresh.clear()
        self._raise_ancestors(*self._hold_chain(keys, slots, parent, hit, base, now))
        self._end_reference(n)

    def _hold_chain(
        self, keys: Sequence[BlockKey], slots: Sequence[int], parent: int, hit: bool, base: int, now: int
    ) -> tuple[int, int]:
        """The general path of :meth:`reference_chain`: returns (ancestor to raise first, expiry to raise to)."""
        par, children, touches, expiry = self._parent, self._children, self._touches, self._expiry
        classes = self.classes
        hold, refs, partial = classes.hold, classes.refs, classes.partial
        flags = self._evictable
        width, c1, below = self._width, self.capacity + 1, self._sample_below
        extended = classes.extension_hold(classes.draw_extension())
        n = len(slots)
        moved = moved_to = -1  # the last block moved (the head-most) and its list
        olds: list[int] = []
        chain_classes: list[int] = []
        last_class = 0 if hit else LAST
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
                chain_classes.append(cls)
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
        loaded = self._loaded
        if hit:
            self._loaded = LoadedChain(slots[-1], now + n, list(keys), list(slots), olds, chain_classes, now)
        elif loaded is not None:
            self._loaded = None
            if base and loaded.tail == parent and loaded.ends_at == now:
                deeper, up = self._reclassify(loaded, base, deeper)
        return up, deeper

    def _end_reference(self, n: int) -> None:
        if self.guard.chain_sampled:
            self.guard.end_chain()
        self._now += n
        if self._now >= self._next_solve:
            self._solve()

    def _reclassify(self, loaded: LoadedChain, base: int, floor: int) -> tuple[int, int]:
        """Give the hit prefix loaded just before the classes of its request, now known to add new blocks."""
        keys, slots, olds, chain_classes, then = loaded.keys, loaded.slots, loaded.expiries, loaded.classes, loaded.then
        key_of, expiry, flags = self._key_of, self._expiry, self._evictable
        refs, hold = self.classes.refs, self.classes.hold
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
            old_cls = chain_classes[j]
            cls = base + touches_of(old_cls)
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

    # --- requests stored in pieces ----------------------------------------------------

    def continue_chain(self, keys: Sequence[BlockKey], slots: Sequence[int], parent: int) -> None:
        """A store that continues the request whose last store ended in ``parent``: one request, one class.

        The request's new blocks are counted over all its stores, its end
        moves to this store (the table of request ends gets it, in place of
        the first store's, when the request ends: one entry per request
        however many stores), and its earlier blocks are re-classified: the
        previous tail is no longer the request's last block, and all of them
        move to the request's bucket of new blocks if it grew out of theirs
        (at most three times a request: the buckets end at 8). A
        re-classified block's expiry counts from the request's last store
        with its new class (lower, if that class holds less), and never falls
        below its descendants' in the request. Anything but a store of new
        blocks continuing an open request (see :data:`OPEN_REQUESTS`) is a
        store of its own. Cost: :meth:`reference_chain`'s, plus one step per
        re-classified block.
        """
        n = len(slots)
        record = self._open.pop(parent, None) or self._open_old.pop(parent, None)
        if not n or record is None or slots != self._fresh or self._key_of[parent] != record.tail_key:
            if record is not None:
                self.classes.publish(record)
            self.reference_chain(keys, slots, parent, False)
            return
        now = self._now
        if now // self._width != self._cur:
            self._advance(now // self._width)
        self._fresh.clear()
        self._loaded = None
        self._store_new(keys, slots, parent, now, record)

    def end_request(self, tail_slot: int) -> None:
        """The request whose last store ended in ``tail_slot`` finished: its record goes, and its
        end takes the place of its first store's in the table of request ends.

        Until then a store that continues it only notes its end in the record: a
        request's end is what a later one (the conversation's next turn) meets.
        A record dropped unfinished (see :data:`OPEN_REQUESTS`) publishes its
        end the same way.
        """
        record = self._open.pop(tail_slot, None) or self._open_old.pop(tail_slot, None)
        if record is not None:
            self.classes.publish(record)

    def _reclass_stored(self, tail: int, count: int, old_base: int, base: int, then: int) -> None:
        """Re-classify the ``count`` blocks a request stored up to slot ``tail`` (tail first).

        They were new when stored: class ``old_base`` (``+ LAST`` for the tail,
        then the request's last block), now ``base``. Their holds count from
        ``then`` (the request's last store), each at least its descendant's;
        the request's ancestors are raised to them.
        """
        par, key_of, expiry, flags = self._parent, self._key_of, self._expiry, self._evictable
        refs, hold, below = self.classes.refs, self.classes.hold, self._sample_below
        floor = 0
        slot = tail
        moved = moved_to = -1
        for k in range(count):
            key = key_of[slot] if slot >= 0 else NO_KEY
            if key is NO_KEY:  # the chain was cut (a block evicted and its children orphaned)
                break
            old_cls = old_base + LAST if k == 0 else old_base
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
        self, keys: Sequence[BlockKey], slots: Sequence[int], parent: int, now: int, record: OpenRequest | None
    ) -> None:
        """A store of new blocks: of a new request (``record`` None) or continuing one (its record).

        Classifies by the recorded request ends only (none of the blocks was
        referenced before) and the request's new blocks so far, records the
        request's end (in place of its earlier one, see :meth:`continue_chain`),
        holds the blocks (class ``base``, ``base + LAST`` for the last), raises the
        ancestors, ends the reference and notes the request, which may go on.
        New blocks have no parent, no touches and expiry 0, and are not
        evictable yet. The path of every store: inlined, as a call costs about
        as much as a block's work.
        Long because the classification and the hold loop share the chain's state.
        """
        n = len(slots)
        classes = self.classes
        history = classes.history
        found = history.deepest(keys, n - NEW_BUCKET_SPAN if n > NEW_BUCKET_SPAN else 0)  # new_blocks(keys, ())
        # HoldClassifier.request_end, inlined (a call per store)
        end = fingerprint(keys[-2] if n >= 2 else self._key_of[parent] if parent >= 0 else keys[-1])
        if record is None:
            new = n if found < 0 else n - 1 - found
            base = BASE_OF_NEW[new if new < 8 else 8]
            history.add(end)
            drawn, diff = classes.draw_extension(), 0
            record = OpenRequest(keys[-1], new, base, n, end, end, now, drawn, 0)
        else:
            new = n - 1 - found if found >= 0 else record.new + n
            base = BASE_OF_NEW[new if new < 8 else 8]
            old_base = record.base
            self._reclass_stored(parent, record.stored if base != old_base else 1, old_base, base, record.then)
            drawn, diff = record.drawn, record.diff
            record.tail_key, record.new, record.base, record.end, record.then = keys[-1], new, base, end, now
            record.stored += n
        par, children, touches, expiry = self._parent, self._children, self._touches, self._expiry
        hold, partial, refs = classes.hold, classes.partial, classes.refs
        extended = classes.extension_hold(drawn)
        last = base + LAST
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
        if self.guard.chain_sampled:  # _end_reference
            record.diff = self.guard.end_chain(diff)
        self._now = now + n
        if self._now >= self._next_solve:
            self._solve()
        opened = self._open  # the request may go on (see continue_chain)
        opened[slots[-1]] = record
        if len(opened) >= self._open_limit:  # the older generation goes: finished requests, most likely
            for gone in self._open_old.values():
                classes.publish(gone)
            self._open_old, self._open = opened, {}

    # --- learning ---------------------------------------------------------------------

    def _observe(self, fp: int, cls: int, hit: bool) -> None:
        """A sampled reference: a return time for the model, a paired hit for the guard."""
        sampler = self.sampler
        prev = sampler.observe(fp, self._now, cls)
        if prev >= 0:
            self.model.record(prev, sampler.last_age)
        self.guard.add(hit, sampler.lru_hit)

    def _solve(self) -> None:
        """Refresh the holding times from the statistics (every ``solve_every`` references).

        The guard judges the period first: if it stops the learned holds,
        every hold ends at once (:meth:`_release_holds`).
        """
        now = self._now
        elapsed = now - self._last_solve
        self._last_solve = now
        self._next_solve = now + self.solve_every
        self.sampler.expire(now)
        decay = 0.5 ** (elapsed / (HALF_LIFE * self.horizon))
        plan = self.model.solve(self.capacity, self.classes.take_refs(), elapsed, decay, self.sampler.in_progress(now))
        self.plan = plan
        if self.guard.judge(now, self.learning, self.solve_every):
            self._release_holds(now)
        useful = bool(plan.learned_hits >= GAIN_NEEDED * plan.lru_hits and plan.learned_hits > 0)
        was_learning = self.learning
        self.learning = useful and now >= self.guard.lru_until
        if self.learning and not was_learning:
            self.guard.start_trial()
        self.classes.use(plan if self.learning else None, self.max_hold)

    # --- reset ------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget every block; what was learned about the workload stays."""
        for records in (self._open_old, self._open):
            for record in records.values():
                self.classes.publish(record)
        self._reset_blocks()
