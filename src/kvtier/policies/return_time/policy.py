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
from kvtier.policies.return_time.guard import PREFIX_HITS, GuardState, MeasuredGuard, MiniWheel
from kvtier.policies.return_time.model import (
    SAMPLE_SCALE,
    HoldingPlan,
    ReturnSampler,
    ReturnTimeModel,
    sample_threshold,
)
from kvtier.policies.return_time.wheel import OPEN, RING, ExpiryWheel

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
    prefix: int
    """The guard's prefix state after it (see :data:`~kvtier.policies.return_time.guard.PREFIX_HITS`)."""
    diff: int
    """The guard's difference of the request so far."""
    sampled: list[int] | None
    """Fingerprints of its sampled blocks, head first (None: none)."""


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
        mini = min(sample_size, max(1, round(self.sample_rate * c)))  # the sampled share of the capacity
        self.sampler = ReturnSampler(sample_size, self.horizon, self.model, lru_size=mini)
        self.classes = HoldClassifier(max(256, c // 4))
        self.guard = MeasuredGuard(MiniWheel(mini, self._width, RING, OPEN))
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

    @property
    def state(self) -> GuardState:
        """``learning``, ``ahead`` or ``fallen_back``: see :meth:`MeasuredGuard.state`."""
        return self.guard.state(self.learning)

    def stats(self) -> dict[str, float | str]:
        """The guard's state, its sampled prefix-hit rates of LRU and of the learned holds, and
        its counts (see :meth:`EvictionPolicy.stats`)."""
        guard = self.guard
        refs = guard.refs
        return {
            "state": self.state,
            "holds_in_use": float(self.learning),
            "sampled_refs": float(refs),
            "sampled_hit_rate_lru": guard.lru_hits / refs if refs else 0.0,
            "sampled_hit_rate_learned": guard.learned_hits / refs if refs else 0.0,
            "lead": guard.lead,
            "lead_sigma": guard.spread,
            "fallbacks": float(guard.fallbacks),
            "open_requests": float(len(self._open) + len(self._open_old)),
        }

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
            loaded, self._loaded = self._loaded, None
            if loaded is not None and (loaded.tail != parent or loaded.ends_at != now):
                loaded = None  # not this request's load
            self._store_new(keys, slots, parent, now, None, loaded)
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
        drawn = classes.draw_extension()
        extended = classes.extension_hold(drawn)
        n = len(slots)
        moved = moved_to = -1  # the last block moved (the head-most) and its list
        olds: list[int] = []
        chain_classes: list[int] = []
        sampled: list[int] = []  # tail first: positions, then their classes
        sampled_classes: list[int] = []
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
            old = expiry[s]
            if hit:
                olds.append(old)
                chain_classes.append(cls)
            if old < OPEN:  # an open block's request sets its expiry when complete
                e = now + (extended if cls == partial else hold[cls])
                if old > e:
                    e = old
                if deeper > e:
                    e = deeper
                expiry[s] = deeper = e
                if flags[s]:
                    moved = s
                    moved_to = c1 + (e // width) % RING  # e >= now: never a past bucket
                    self._move_to_tail(s, moved_to)
            if keys[i][-1] < below:
                sampled.append(i)
                sampled_classes.append(cls)
        if moved >= 0:  # the chain moved tail first: keep it before its parent
            self._to_parent(moved, moved_to)
        up = parent if parent >= 0 else par[slots[0]]
        loaded = self._loaded
        if loaded is not None and (hit or loaded.tail != parent or loaded.ends_at != now):
            loaded = None  # a load starts a request; a store continues the load right before it, or none
        prefix, diff = (loaded.prefix, loaded.diff) if loaded is not None else (PREFIX_HITS, 0)
        fps = None
        if sampled:
            fps = [fingerprint(keys[i]) for i in reversed(sampled)]
            sampled_classes.reverse()
            learned = classes.learned_hold_of
            minis = [now + learned(cls, drawn) for cls in sampled_classes]
            for j in range(len(minis) - 2, -1, -1):  # the miniature raises the head like the cache
                if minis[j] < minis[j + 1]:
                    minis[j] = minis[j + 1]
            prefix = self._sample_chain(fps, sampled_classes, minis, prefix)
        if self.guard.chain_sampled:
            diff = self.guard.end_chain(diff)
        if hit:
            self._loaded = LoadedChain(
                slots[-1], now + n, list(keys), list(slots), olds, chain_classes, now, prefix, diff, fps
            )
        elif self._loaded is not None:
            self._loaded = None
            if base and loaded is not None:
                deeper, up = self._reclassify(loaded, base, deeper)
        return up, deeper

    def _end_reference(self, n: int) -> None:
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
            if expiry[s] >= OPEN:  # its own request sets its expiry
                continue
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

    # --- requests, open until complete ----------------------------------------------

    def continue_chain(self, keys: Sequence[BlockKey], slots: Sequence[int], parent: int) -> None:
        """A store that continues the request whose last store ended in ``parent``: one request.

        A request is classified when it is complete, not piece by piece: until
        then its blocks are open (expiry ``OPEN +`` :attr:`OpenRequest.deadline`,
        its first store's clock plus the longest hold), so they go after
        nearly every other block, and never
        for a later store of their own request while others qualify. Its new
        blocks are counted over all its stores and its end moves to its last
        store. It is settled (:meth:`_settle`) when it ends
        (:meth:`end_request`), when its record is dropped (see
        :data:`OPEN_REQUESTS`) or taken by a store that does not continue it
        (anything but new blocks after its last store), or when the tier is
        cleared. Cost: :meth:`reference_chain`'s.
        """
        n = len(slots)
        record = self._open.pop(parent, None) or self._open_old.pop(parent, None)
        if not n or record is None or slots != self._fresh or self._key_of[parent] != record.tail_key:
            if record is not None:
                self._settle(parent, record)
            self.reference_chain(keys, slots, parent, False)
            return
        now = self._now
        if now // self._width != self._cur:
            self._advance(now // self._width)
        self._fresh.clear()
        self._loaded = None
        self._store_new(keys, slots, parent, now, record, None)

    def end_request(self, tail_slot: int) -> None:
        """The request whose last store ended in ``tail_slot`` finished: it is settled (see
        :meth:`continue_chain`) and its end takes the place of its first store's in the table
        of request ends."""
        record = self._open.pop(tail_slot, None) or self._open_old.pop(tail_slot, None)
        if record is not None:
            self._settle(tail_slot, record)

    def _settle(self, tail: int, record: OpenRequest) -> None:
        """Classify and hold a complete request's blocks: ``tail``, its last, and the rest.

        Its last block is the request's last (class ``base + LAST``), the others
        are of ``base``, by its count of new blocks; each holds from the
        request's last store, at least as long as its descendant in the
        request, and the request's ancestors are raised to its head. The walk
        goes up from ``tail`` over the open blocks the request stored and stops
        where its chain was cut (a block evicted or removed): what stays open
        beyond expires at the request's deadline. The end is published.
        O(blocks stored), once per request: a request whose blocks are linked
        as one run in their list (the usual case) moves as one run.
        """
        classes = self.classes
        classes.publish(record)
        key_of = self._key_of
        if key_of[tail] != record.tail_key:
            return
        par, nxt, expiry, flags = self._parent, self._next, self._expiry, self._evictable
        base = BASE_OF_NEW[record.new if record.new < 8 else 8]
        then, drawn = record.then, record.drawn
        last_expiry = then + classes.hold_of(base + LAST, drawn)
        body_expiry = max(then + classes.hold_of(base, drawn), last_expiry)
        opened = OPEN + record.deadline  # the expiry of the request's open blocks, its own
        expiry[tail] = last_expiry
        head = tail
        walked = 1
        stored = record.stored
        if flags[tail]:  # while the request is one run of its list, tail first: it moves as one
            while walked < stored:
                slot = par[head]
                if slot < 0 or expiry[slot] != opened or nxt[head] != slot:
                    break
                expiry[slot] = body_expiry
                head = slot
                walked += 1
            run = walked == stored
        else:
            run = False
        while walked < stored:
            slot = par[head]
            if slot < 0 or expiry[slot] != opened:  # the chain was cut here
                break
            expiry[slot] = body_expiry
            head = slot
            walked += 1
        else:
            up = par[head]
            if up >= 0:
                self._raise_ancestors(up, body_expiry if walked > 1 else last_expiry)
        classes.refs[base + LAST] += 1
        classes.refs[base] += walked - 1
        if record.sampled is not None or record.loaded is not None:
            self._settle_sampled(record, base, key_of[tail][-1] < self._sample_below)
        self._relink_settled(tail, head, run, last_expiry, body_expiry)

    def _relink_settled(self, tail: int, head: int, run: int, last_expiry: int, body_expiry: int) -> None:
        """Move a settled request's blocks, ``tail`` up to ``head``, into the lists of their new
        expiries, tail first, and the request before its parent there. ``run``: they are one run
        of their list, ``tail`` first (moved as one)."""
        par, flags, nxt = self._parent, self._evictable, self._next
        last_list, body_list = self._list_for(last_expiry), self._list_for(body_expiry)
        if run:
            if head != tail:
                body = par[tail]
                if last_list != body_list:
                    self._move_to_tail(tail, last_list)
                    tail = body
                before, after = self._prev[tail], nxt[head]
                nxt[before] = after
                self._prev[after] = before
                self._link_run(tail, head, body_list)
                self._to_parent(head, body_list)
            else:
                self._move_to_tail(tail, last_list)
                self._to_parent(tail, last_list)
            return
        slot, moved, moved_to = tail, -1, -1
        while True:
            if flags[slot]:
                moved, moved_to = slot, last_list if slot == tail else body_list
                self._move_to_tail(slot, moved_to)
            if slot == head:
                break
            slot = par[slot]
        if moved >= 0:
            self._to_parent(moved, moved_to)

    def _settle_sampled(self, record: OpenRequest, base: int, tail_sampled: bool) -> None:
        """A settled request's sampled blocks get its classes (the model's) and the learned holds'
        expiries in the guard's miniature, each at least its descendant's; the sampled blocks of
        the prefix it loaded are raised to its head's. ``tail_sampled``: the last of
        ``record.sampled`` is the request's last block."""
        reclass, settle, learned = self.sampler.reclass, self.guard.mini.settle, self.classes.learned_hold_of
        then, drawn = record.then, record.drawn
        floor = 0
        sampled = record.sampled or []
        last = len(sampled) - 1 if tail_sampled else -1
        for i in range(len(sampled) - 1, -1, -1):
            cls = base + LAST if i == last else base
            fp = sampled[i]
            reclass(fp, cls)
            floor = max(then + learned(cls, drawn), floor)
            settle(fp, floor, False)
        head = max(floor, then + learned(base, drawn))
        for fp in record.loaded or ():
            settle(fp, head, True)

    def _store_new(
        self,
        keys: Sequence[BlockKey],
        slots: Sequence[int],
        parent: int,
        now: int,
        record: OpenRequest | None,
        loaded: LoadedChain | None,
    ) -> None:
        """A store of new blocks: of a new request (``record`` None; ``loaded``: its load, right
        before) or continuing one (its record).

        Counts the request's new blocks by the recorded request ends only (none
        of the blocks was referenced before), records its first store's end,
        links the blocks open (expiry: the request's deadline; see
        :meth:`continue_chain`), raises the ancestors to what the request's head
        would hold if it ended now, ends the reference and keeps the request's
        record, which the next store may continue. New blocks have no parent,
        no touches and expiry 0, and are not evictable yet. The path of every
        store: inlined, as a call costs about as much as a block's work.
        """
        n = len(slots)
        classes = self.classes
        history = classes.history
        found = history.deepest(keys, n - NEW_BUCKET_SPAN if n > NEW_BUCKET_SPAN else 0)  # new_blocks(keys, ())
        # HoldClassifier.request_end, inlined (a call per store)
        end = fingerprint(keys[-2] if n >= 2 else self._key_of[parent] if parent >= 0 else keys[-1])
        if record is None:
            new = n if found < 0 else n - 1 - found
            history.add(end)
            record = OpenRequest(keys[-1], new, n, end, end, now, now + self.max_hold, classes.draw_extension(), 0)
            if loaded is not None:
                record.prefix, record.diff, record.loaded = loaded.prefix, loaded.diff, loaded.sampled
        else:
            new = n - 1 - found if found >= 0 else record.new + n
            record.tail_key, record.new, record.end, record.then = keys[-1], new, end, now
            record.stored += n
        opened = OPEN + record.deadline
        par, children, touches, expiry = self._parent, self._children, self._touches, self._expiry
        below = self._sample_below
        sampled: list[int] = []
        up = slots[0]
        if parent >= 0 and parent != up:
            par[up] = parent
            children[parent] += 1
        touches[up] = 1
        expiry[up] = opened
        if keys[0][-1] < below:
            sampled.append(0)
        for i in range(1, n):  # the hot path of every store
            s = slots[i]
            par[s] = up
            children[up] += 1
            touches[s] = 1
            expiry[s] = opened
            up = s
            if keys[i][-1] < below:
                sampled.append(i)
        if sampled:
            base = BASE_OF_NEW[new if new < 8 else 8]
            fps = [fingerprint(keys[i]) for i in sampled]
            if record.sampled is None:
                record.sampled = fps
            else:
                record.sampled += fps
            # The model's classes as if the request ended now (_settle corrects them); open in the miniature.
            model_classes = [base + LAST if i == n - 1 else base for i in sampled]
            record.prefix = self._sample_chain(fps, model_classes, [opened] * len(fps), record.prefix)
        if parent >= 0 and expiry[parent] < OPEN:  # the loaded prefix, or what the request extends
            base = BASE_OF_NEW[new if new < 8 else 8]
            self._raise_ancestors(parent, now + classes.hold_of(base, record.drawn))
        if self.guard.chain_sampled:  # _end_reference
            record.diff = self.guard.end_chain(record.diff)
        self._now = now + n
        if self._now >= self._next_solve:
            self._solve()
        records = self._open  # the request may go on (see continue_chain)
        records[slots[-1]] = record
        if len(records) >= self._open_limit:  # the older generation goes: finished requests, most likely
            for tail, gone in self._open_old.items():
                self._settle(tail, gone)
            self._open_old, self._open = records, {}

    # --- learning ---------------------------------------------------------------------

    def _sample_chain(self, fps: list[int], model_classes: list[int], minis: list[int], prefix: int) -> int:
        """A chain's sampled references (fingerprints head first, their classes, their expiries in
        the miniature of the learned holds), given its request's prefix state; returns the new state.

        Head first, the sampled LRU and the miniature say whether each is a
        prefix hit (held, and every sampled block before it in the request
        too); then, tail first (so the head ends the most recent), the sampler
        takes each reference (a return time for the model; the sampled LRU's
        recency) and the miniature holds it.
        """
        now = self._now
        guard, sampler = self.guard, self.sampler
        mini, table = guard.mini, sampler.table
        if now // mini.width != mini.cur:
            mini.advance(now)
        lru_hit, learned_hit = bool(prefix & 1), bool(prefix & 2)
        lru_hits = learned_hits = 0
        for fp in fps:
            if lru_hit:
                entry = table.find(fp)
                lru_hit = entry >= 0 and table.list_of(entry) == 0
                lru_hits += lru_hit
            if learned_hit:
                learned_hit = mini.holds(fp)
                learned_hits += learned_hit
        guard.refs += len(fps)
        guard.lru_hits += lru_hits
        guard.learned_hits += learned_hits
        guard.chain_diff += learned_hits - lru_hits
        guard.chain_sampled = True
        record, observe = self.model.record, sampler.observe
        for i in range(len(fps) - 1, -1, -1):
            fp = fps[i]
            previous = observe(fp, now, model_classes[i])
            if previous >= 0:
                record(previous, sampler.last_age)
            mini.reference(fp, minis[i])
        return lru_hit | learned_hit << 1

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
        fell_back = self.guard.judge()
        if fell_back and self.learning:
            self._release_holds(now)
        useful = bool(plan.learned_hits >= GAIN_NEEDED * plan.lru_hits and plan.learned_hits > 0)
        self.learning = useful and not self.guard.fallen_back
        self.classes.use(plan, self.max_hold, self.learning)

    # --- reset ------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget every block; what was learned about the workload stays (the ends of open
        requests are published)."""
        for records in (self._open_old, self._open):
            for record in records.values():
                self.classes.publish(record)
        self._reset_blocks()
