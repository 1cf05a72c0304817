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
* the guard, :class:`~kvtier.policies.return_time.guard.MeasuredGuard`: it stops
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

import numpy as np

from kvtier.keys import BlockKey
from kvtier.policies.fingerprints import _MASK, fingerprint
from kvtier.policies.recent_keys import RecentKeys
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
from kvtier.policies.return_time.hints import HoldBudget, SessionClock
from kvtier.policies.return_time.model import (
    SAMPLE_SCALE,
    HoldingPlan,
    ReturnSampler,
    ReturnTimeModel,
    sample_threshold,
)
from kvtier.policies.return_time.wheel import CLOCK, FIRST, MARK, OPEN, RING, ExpiryWheel
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

SPARE_RECORDS = 64
"""Records of settled requests kept for the next requests, at most."""

GUARD_KEYS = 512
"""The guard's miniature of the learned holds has at least this many entries (if the model's
sample allows): its share of the keys is ``max(512 / capacity, 1 / 256)``, at most the model's."""


HINT_SHARE = 0.75
"""Share of the capacity that holds for expected returns may take, on average (see
:class:`~kvtier.policies.return_time.hints.HoldBudget`); a return later than that allows is evicted first."""

LEARNED_REACH = 2.0
"""While the learned holds are in use, an expected return is held for only if it comes within this
many times the longest learned hold: the model's judgement of what is worth holding at this capacity
(without it, held conversations crowded out what the model holds on a mixed workload: bursty seed 0,
1.05x LRU with hints against 1.11x without)."""
HINT_SLACK = 1.25
"""An expected return is held for this many times the references it is expected in."""

MIN_RETURNS = 64.0
"""Returns the model must have seen (decayed) before :meth:`ReturnTimePolicy.relative_reuse` answers."""


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


def _of_session(session: str, key: BlockKey) -> int:
    """A 63-bit fingerprint of ``key`` within ``session`` (for :attr:`ReturnTimePolicy._conversation_ends`)."""
    return (fingerprint(key) ^ (hash(session) * 0x9E3779B97F4A7C15)) & _MASK


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
        lru = min(sample_size, max(1, round(self.sample_rate * c)))  # the sampled share of the capacity
        self.sampler = ReturnSampler(sample_size, self.horizon, self.model, lru_size=lru)
        self.classes = HoldClassifier(max(256, c // 4))
        # The guard's keys: the model's sample, or a part of it large enough for its miniatures
        # (GUARD_KEYS at least) on large tiers, where the whole sample would cost more than it tells.
        self._guard_below = min(self._sample_below, sample_threshold(GUARD_KEYS / c))
        mini = min(sample_size, max(1, round(self._guard_below / SAMPLE_SCALE * c)))
        self.guard = MeasuredGuard(MiniWheel(mini, self._width, RING, OPEN, CLOCK))
        self.plan: HoldingPlan | None = None
        self.learning = False
        self._last_solve = 0
        self._next_solve = self.solve_every
        self._loaded: LoadedChain | None = None
        self._open_limit = max(8, min(OPEN_REQUESTS, c // 32) // 2)  # per generation
        self._odds_key: tuple[int, int] | None = None  # (solve clock, horizon) of _odds
        self._odds: list[float] | None = None
        self.sessions = SessionClock(max(64, min(OPEN_REQUESTS, c // 128)))  # about 205 B a session
        # Where hinted conversations' requests ended (the block before each one's last, mixed with
        # the session): an ended conversation's walk passes a branch only at one of its own.
        self._conversation_ends = RecentKeys(max(64, min(OPEN_REQUESTS, c // 8)))
        self.budget = HoldBudget(c, HINT_SHARE, self.horizon)
        self.hinted = {"ended": 0, "held": 0, "late": 0}  # requests by what their hints did

    def _reset_blocks(self) -> None:
        super()._reset_blocks()
        # Requests stored in pieces, by the slot their last store ended in (see continue_chain).
        # Two generations of half the limit each: the older goes whole when the newer is full.
        # (Taking the oldest entry of one dict that keeps deleting its first entries scans the
        # deleted ones each time: 2.4 us a store at 3,000 entries; an OrderedDict costs 0.2 us.)
        self._open: dict[int, OpenRequest] = {}
        self._open_old: dict[int, OpenRequest] = {}
        self._spare: list[OpenRequest] = []  # records of settled requests, for the next ones

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
            "long_lead": guard.long_lead,
            "long_lead_sigma": guard.long_spread,
            "fallbacks": float(guard.fallbacks),
            "open_requests": float(len(self._open) + len(self._open_old)),
            **{f"hinted_{what}": float(n) for what, n in self.hinted.items()},
        }

    def relative_reuse(self, tail_slot: int, horizon: int) -> float | None:
        """The chance that blocks like those of the store that ended in ``tail_slot`` return within
        ``horizon`` references (at most the model's horizon), over the average stored block's
        (see :meth:`EvictionPolicy.relative_reuse`); None before the first solve or while the
        model has seen too few returns to tell.

        A stored block is one of its request's blocks but the last (the request may go on: its
        last block is known only when it ends), classed by the request's count of genuinely new
        blocks so far (its record; a settled request's store gets the average). The odds per
        class come from the model's survival curves, refreshed once per solve.
        """
        odds = self._reuse_odds(horizon)
        if odds is None:
            return None
        record = self._open.get(tail_slot) or self._open_old.get(tail_slot)
        if record is None:
            return 1.0
        new = record.new
        return odds[BASE_OF_NEW[new if new < 8 else 8]]

    def _reuse_odds(self, horizon: int) -> list[float] | None:
        """Per class, its chance of a return within ``horizon`` over the average new block's,
        cached until the next solve (None: too few returns observed)."""
        key = (self._last_solve, horizon)
        if self._odds_key == key:
            return self._odds
        self._odds_key = key
        model = self.model
        at = min(model.age_bucket(max(1, horizon)) + 1, len(model.edges) - 1)
        returned = 1.0 - model.survival(model.events, model.censored)[:, at]
        bodies = sorted(set(BASE_OF_NEW))  # the classes of stored blocks but a request's last
        weights = model.refs[bodies]
        mean = float(np.dot(weights, returned[bodies]) / weights.sum()) if weights.sum() > 0 else 0.0
        enough = model.events.sum() >= MIN_RETURNS and mean > 0
        self._odds = [float(r) / mean for r in returned] if enough else None
        return self._odds

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
        if self._cut:
            self._settle_cuts()
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
            self._store_new(keys, slots, parent, now, loaded)
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
        """The general path of :meth:`reference_chain`: returns (ancestor to raise first, expiry to raise to).

        Long because linking, classifying and holding each block share the loop's state, and the
        sampled blocks go to the model and the guard after it.
        """
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
                if old >= e:  # >=: the same value, the same int object (blocks share it)
                    e = old
                if deeper >= e:
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
            guard_below = self._guard_below
            guarded = None if guard_below == below else [keys[i][-1] < guard_below for i in reversed(sampled)]
            prefix = self._sample_chain(fps, sampled_classes, minis, prefix, guarded)
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
            old = olds[j]
            if old >= OPEN:  # open at the load, its request settled since: not held open again
                old = expiry[s]
            e = max(old, then + hold[cls], floor)
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

        A request is classified when it is complete, not piece by piece. Its
        first store holds its blocks as if it ended there (what it gets if it
        does), its last block marked (see
        :data:`~kvtier.policies.return_time.wheel.MARK`); once it stores more (here), or an eviction reaches its last
        block first (see :meth:`evict`), all its blocks are open until it is
        complete: expiry :attr:`OpenRequest.opened` (``OPEN |`` its first
        store's clock plus the longest hold), after nearly every other block,
        so never evicted for a later store of their own request while others
        qualify. Its new blocks are counted over all its stores and its end
        moves to its last store. It is settled (:meth:`_settle`) when it ends
        (:meth:`end_request`), when its record is dropped (see
        :data:`OPEN_REQUESTS`) or taken by a store that does not continue it
        (anything but new blocks after its last store), or when the tier is
        cleared. Cost: :meth:`reference_chain`'s, and once a request, a step
        per block it stored before. Long because the store of every decode
        step is inlined here, a one-block path beside the general one.
        """
        if self._cut:
            self._settle_cuts()
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
        if record.held >= 0:
            self._open_request(parent, record)
        # The store, open (_store_new's continuing path, inlined: every decode store takes it).
        # A decoded block is hardly ever a recorded request end: one filter read rules it out.
        history = self.classes.history
        opened = record.opened
        if n == 1:  # a decode store: one block, no loop
            up = slots[0]
            key = keys[0]
            if history.filter[hash(key) & history.filter_mask] and history.deepest(keys, 0) == 0:
                record.new = 0
            else:
                record.new += 1
            record.tail_key, record.then = key, now
            record.stored += 1
            self._parent[up] = parent
            self._children[parent] += 1
            self._touches[up] = 1
            self._expiry[up] = opened
            if key[-1] < self._sample_below:
                new = record.new
                self._sample_stored(keys, [0], record, BASE_OF_NEW[new if new < 8 else 8], opened)
        else:
            found = history.deepest(keys, n - NEW_BUCKET_SPAN if n > NEW_BUCKET_SPAN else 0)
            new = n - 1 - found if found >= 0 else record.new + n
            record.tail_key, record.new, record.then = keys[-1], new, now
            record.stored += n
            par, children, touches, expiry = self._parent, self._children, self._touches, self._expiry
            below = self._sample_below
            sampled: list[int] | None = None
            up = parent
            for i in range(n):
                slot = slots[i]
                par[slot] = up
                children[up] += 1
                touches[slot] = 1
                expiry[slot] = opened
                up = slot
                if keys[i][-1] < below:
                    if sampled is None:
                        sampled = []
                    sampled.append(i)
            if sampled is not None:
                self._sample_stored(keys, sampled, record, BASE_OF_NEW[new if new < 8 else 8], opened)
        if self.guard.chain_sampled:
            record.diff = self.guard.end_chain(record.diff)
        self._now = now + n
        if self._now >= self._next_solve:
            self._solve()
        records = self._open  # _keep, inlined
        records[up] = record
        if len(records) >= self._open_limit:
            self._next_generation()

    def _keep(self, tail: int, record: OpenRequest) -> None:
        """Keep ``record``, whose last store ended in ``tail``: the request may go on (see
        :meth:`continue_chain`)."""
        records = self._open
        records[tail] = record
        if len(records) >= self._open_limit:
            self._next_generation()

    def _next_generation(self) -> None:
        """The newer generation of records is full: the older goes (finished requests, most
        likely: they are settled) and the newer takes its place."""
        for gone_tail, gone in self._open_old.items():
            self._settle(gone_tail, gone)
        self._open_old, self._open = self._open, {}

    def end_request(self, tail_slot: int) -> None:
        """The request whose last store ended in ``tail_slot`` finished: it is settled (see
        :meth:`continue_chain`) and its end takes the place of its first store's in the table
        of request ends."""
        record = self._open.pop(tail_slot, None) or self._open_old.pop(tail_slot, None)
        if record is None:
            return
        if record.held >= 0 and record.end == record.published and self._key_of[tail_slot] == record.tail_key:
            # A request that stored once, held as it is now complete, its end published: _settle's
            # path for it, inlined (every request that is not stored in pieces ends here).
            new = record.new
            base = BASE_OF_NEW[new if new < 8 else 8]
            refs = self.classes.refs
            refs[base + LAST] += 1
            refs[base] += record.stored - 1
            if self._children[tail_slot] >= MARK:
                self._children[tail_slot] -= MARK
            if len(self._spare) < SPARE_RECORDS:
                self._spare.append(record)
            return
        self._settle(tail_slot, record)

    def hint_request(
        self, tail_slot: int, session: str | None, session_end: bool, expected_return_s: float | None
    ) -> None:
        """Hints of the request that ended in ``tail_slot`` (see :meth:`EvictionPolicy.hint_request`).

        A session id teaches :attr:`sessions` the references per announced
        second. If the conversation ended or is expected back later than
        :meth:`_hint_reach`, its own blocks (up from ``tail_slot`` while
        each has at most one other child, and that only where a request of
        the conversation ended, its partial last block branching off: not a
        prefix shared with other conversations) are evicted first; if it is expected
        back sooner, the request's blocks (up while each is its parent's only
        child) are held until then (with ``HINT_SLACK``), their ancestors raised
        to that. Nothing if ``tail_slot`` has children or is open. O(blocks walked).
        """
        now = self._now
        children, expiry, par = self._children, self._expiry, self._parent
        key_of = self._key_of  # a stale link (an evicted parent) ends the walk at a free slot
        if session is not None:
            self.sessions.observe(session, now, expected_return_s)
            if par[tail_slot] >= 0 and key_of[par[tail_slot]] is not NO_KEY:
                self._conversation_ends.add(_of_session(session, key_of[par[tail_slot]]))
        expected = None if expected_return_s is None else self.sessions.references(expected_return_s)
        if not session_end and expected is None:
            return
        if children[tail_slot] or expiry[tail_slot] >= OPEN:
            return
        if now // self._width != self._cur:
            self._advance(now // self._width)
        if expected is not None and not session_end:
            depth, up = 1, par[tail_slot]
            while up >= 0 and depth < self.capacity:
                depth += 1
                up = par[up]
            expected *= HINT_SLACK
            self.budget.add(now, depth, expected)
        expire = session_end or expected is None or expected > self._hint_reach()
        # Expiring also walks past a block with one other child where an earlier request of this
        # conversation ended, its (partial, never reused) last block branching off: a block its
        # hints recorded (above). Any other branch is a prefix shared with another conversation
        # (or a conversation whose requests came without a session): the walk stops below it.
        private = 2 if expire else 1
        chain = [tail_slot]
        up = par[tail_slot]
        ends = self._conversation_ends
        while (
            up >= 0 and children[up] <= private and expiry[up] < OPEN and key_of[up] is not NO_KEY
            and len(chain) < self.capacity
        ):  # fmt: skip
            if children[up] > 1 and (session is None or _of_session(session, key_of[up]) not in ends):
                break
            chain.append(up)
            up = par[up]
        if expire or expected is None:
            self.hinted["ended" if session_end else "late"] += 1
            self._expire_first(chain)
            return
        self.hinted["held"] += 1
        e = max(now + min(int(expected), self.max_hold), 1)
        end = self._list_for(e)
        flags = self._evictable
        for slot in chain:  # tail first
            expiry[slot] = e
            if flags[slot]:
                self._move_to_tail(slot, end)
        if flags[chain[-1]]:
            self._to_parent(chain[-1], end)
        if up >= 0:
            self._raise_ancestors(up, e)

    def _hint_reach(self) -> float:
        """The longest expected return (references) held for: what the :attr:`budget` allows, and
        while the learned holds are in use, ``LEARNED_REACH`` times the longest of them."""
        reach = self.budget.reach()
        if self.learning:
            reach = min(reach, LEARNED_REACH * max(self.classes.hold))
        return reach

    def _expire_first(self, chain: list[int]) -> None:
        """Give ``chain`` (slots, tail first, each the parent of the one before) expiry
        :data:`~kvtier.policies.return_time.wheel.FIRST` and put its evictable blocks first in the
        expired list, tail first: evicted before any other. Its blocks not evictable now (in flight:
        the request's last store completes after it ends, under vLLM; pinned: a cascade reading
        them) go there when they become so (:meth:`ExpiryWheel._link_first`); a reference of a
        block (a load, a store, a raise as an ancestor) gives it a hold again."""
        expiry, flags, end = self._expiry, self._evictable, self.capacity  # the expired list's sentinel
        for i in range(len(chain) - 1, -1, -1):  # head first, each linked before the previous
            slot = chain[i]
            expiry[slot] = FIRST
            if flags[slot]:
                self._move_to_head(slot, end)

    def _release_holds(self, now: int) -> None:
        """:meth:`ExpiryWheel._release_holds`, and the requests that stored once note their blocks'
        expiry released (so :meth:`_rehold` still finds them), as does the load a store may follow
        (:meth:`_reclassify` keeps each loaded block's expiry from before the load at least)."""
        super()._release_holds(now)
        floor = max(now, 1)
        for records in (self._open_old, self._open):
            for record in records.values():
                if record.held > now:
                    record.held = floor
        if self._loaded is not None:
            expiries = self._loaded.expiries
            for j, e in enumerate(expiries):
                if floor < e < OPEN:
                    expiries[j] = floor

    def _reached_open(self, slot: int) -> int:
        """An eviction reached ``slot``, marked open: if it is the last block of a request that
        stored once (held as if it had ended), that request's blocks become open and the eviction
        goes on from what followed them (returned); else -1 (an open request's block, reached
        after all the others: it may go)."""
        record = self._open.get(slot) or self._open_old.get(slot)
        if record is None or record.held < 0 or self._key_of[slot] != record.tail_key:
            return super()._reached_open(slot)  # a mark left behind: cleared
        # The eviction goes on after the nearest block before this one that stays: the blocks that
        # move are the ones _rehold walks (usually this one's ancestors, after it in its list).
        moving = {slot}
        par, expiry = self._parent, self._expiry
        up = slot
        for _ in range(record.stored - 1):
            up = par[up]
            if up < 0 or expiry[up] != record.held:
                break
            moving.add(up)
        prv, cap = self._prev, self.capacity
        before = prv[slot]
        while before < cap and before in moving:
            before = prv[before]
        self._open_request(slot, record)
        return self._next[before]

    def _open_request(self, tail: int, record: OpenRequest) -> None:
        """The request whose last store ended in ``tail`` stores more, or an eviction reached its
        last block: its blocks, held as if it had ended at its first store, become open."""
        opened = record.opened
        if self._key_of[tail] == record.tail_key:
            if self._children[tail] >= MARK:
                self._children[tail] -= MARK
            walked = self._rehold(tail, record.stored, self._expiry[tail], record.held, opened, opened, False)
            if walked == record.stored:  # all of its store: its sampled blocks, noted then
                watched = record.watched
                if watched is not None:
                    settle = self.guard.mini.settle
                    for i in range(len(watched) - 1, -1, -1):  # tail first, as _open_sampled
                        settle(watched[i], opened, False)
            else:
                record.sampled = self._open_sampled(tail, walked, opened)
        else:
            record.sampled = None
        record.held = -1
        record.watched = None

    def _open_sampled(self, tail: int, count: int, opened: int) -> list[int] | None:
        """The sampled blocks among the ``count`` a request stored up to ``tail``, which just became
        open: their fingerprints, head first (None: none), the guard's open in its miniature too.
        (Those its store noted are used instead when the walk reached all of them.)"""
        key_of, par = self._key_of, self._parent
        below, guard_below, settle = self._sample_below, self._guard_below, self.guard.mini.settle
        fps: list[int] = []
        slot = tail
        for _ in range(count):
            key = key_of[slot]
            if key and key[-1] < below:  # (a free slot's key is empty)
                fp = fingerprint(key)
                fps.append(fp)
                if key[-1] < guard_below:
                    settle(fp, opened, False)
            slot = par[slot]
        fps.reverse()
        return fps or None

    def _settle(self, tail: int, record: OpenRequest) -> None:
        """:meth:`_settle_request`, then the record is kept for the next request (a record built
        per request cost a tenth of a 16-block store)."""
        self._settle_request(tail, record)
        if len(self._spare) < SPARE_RECORDS:
            self._spare.append(record)

    def _settle_request(self, tail: int, record: OpenRequest) -> None:
        """Classify and hold a complete request's blocks: ``tail``, its last, and the rest; publish
        its end.

        Its last block is the request's last (class ``base + LAST``), the others
        are of ``base``, by its count of new blocks; each holds from the
        request's last store, at least as long as its descendant in the
        request, and the request's ancestors are raised to its head. A request
        that stored once is held so already (its last block is unmarked); an
        open one moves (:meth:`_rehold`). A request an eviction cut (its last
        block gone, or blocks between): what stays above each cut is held as
        its body (:meth:`_settle_cut`), its ancestors left as they are. O(1), or
        O(blocks stored) for an open request.
        """
        classes = self.classes
        key_of = self._key_of
        here = key_of[tail] == record.tail_key
        if here and record.held < 0:  # its end: its last full block, the one before its last
            record.end = self._end_of(tail, record)
        classes.publish(record)
        base = BASE_OF_NEW[record.new if record.new < 8 else 8]
        if not here:  # its last block was evicted (an open one: what stays of it may be in _cut)
            if record.held < 0:
                if self._cut:
                    self._settle_cut(record, self._hold_ends(record, base)[1])
                if record.sampled is not None or record.loaded is not None:
                    self._settle_sampled(record, base, False)  # the guard's miniature holds them open
            return
        if record.held >= 0:  # stored once, held as it is now complete
            classes.refs[base + LAST] += 1
            classes.refs[base] += record.stored - 1
            if self._children[tail] >= MARK:
                self._children[tail] -= MARK
            return
        last_expiry, body_expiry = self._hold_ends(record, base)
        opened = record.opened
        walked = self._rehold(tail, record.stored, opened, opened, last_expiry, body_expiry, True)
        if self._cut and walked < record.stored:
            self._settle_cut(record, body_expiry)
        classes.refs[base + LAST] += 1
        classes.refs[base] += walked - 1
        if record.sampled is not None or record.loaded is not None:
            self._settle_sampled(record, base, key_of[tail][-1] < self._sample_below)

    def _settle_cuts(self) -> None:
        """Settle the open requests an eviction cut (see :meth:`ExpiryWheel._cut_at`): each is
        complete as far as the cache goes (its blocks below the cut are gone; a store that goes
        on from its last block, if that stays, starts a request of its own), and what stays of
        it is held as its complete request's body, from its last store. Runs before the next
        chain, after the eviction that cut them. A part whose request has no record left is held
        as referenced now."""
        expiry = self._expiry
        cut_open = dict.fromkeys(e for e in (expiry[bottom] for bottom in self._cut) if e >= OPEN)  # (in cut order)
        owners = {
            record.opened: (records, tail)
            for records in (self._open_old, self._open)
            for tail, record in records.items()
            if record.held < 0 and record.opened in cut_open
        }
        for opened in cut_open:
            owner = owners.get(opened)
            if owner is not None:
                records, tail = owner
                self._settle(tail, records.pop(tail))  # settles every part of it in _cut
        now = max(self._now, 1)
        for bottom in self._cut:
            e = expiry[bottom]
            if e >= OPEN:  # no record: held as referenced now
                self._rehold(bottom, self.capacity, e, e, now, now, False)
        self._cut.clear()

    def _hold_ends(self, record: OpenRequest, base: int) -> tuple[int, int]:
        """``(last, body)``: the expiries of a complete request's last block (class ``base + LAST``)
        and of its body (class ``base``, never before its last), from its last store."""
        classes, then, drawn = self.classes, record.then, record.drawn
        last_expiry = then + classes.hold_of(base + LAST, drawn)
        return last_expiry, max(then + classes.hold_of(base, drawn), last_expiry)

    def _settle_cut(self, record: OpenRequest, body_expiry: int) -> None:
        """Hold what stays of an open request above a cut (see :meth:`_settle_cuts`) until
        ``body_expiry``, its complete request's body's (:meth:`_hold_ends`)."""
        opened, expiry = record.opened, self._expiry
        for bottom in self._cut:
            if expiry[bottom] == opened:
                self._rehold(bottom, record.stored, opened, opened, body_expiry, body_expiry, False)

    def _end_of(self, tail: int, record: OpenRequest) -> int:
        """The fingerprint to record as the end of the request whose last block is in ``tail``:
        the block before it (see :meth:`HoldClassifier.request_end`)."""
        up = self._parent[tail]
        key = self._key_of[up] if up >= 0 else NO_KEY
        return fingerprint(key if key is not NO_KEY else record.tail_key)

    def _rehold(
        self, tail: int, stored: int, was_last: int, was: int, last_expiry: int, body_expiry: int, settle: bool
    ) -> int:
        """Give a request's blocks new expiries: ``tail`` (expiry ``was_last``) ``last_expiry``, the
        blocks it stored before (expiry ``was``) ``body_expiry``; returns how many it walked.

        Walks up from ``tail`` over at most ``stored`` blocks and stops where the
        chain was cut (a block evicted, or held otherwise since: another
        request raised it); moves them into their new lists, as one run when
        they are one (the usual case), tail first, the request before its
        parent; ``settle``: raises the request's ancestors to its head when it
        walked all.
        """
        par, nxt, expiry, flags = self._parent, self._next, self._expiry, self._evictable
        if expiry[tail] != was_last:
            return 0
        expiry[tail] = last_expiry
        head = tail
        walked = 1
        run = flags[tail]  # while the request is one run of its list, tail first: it moves as one
        for walked in range(1, stored):  # noqa: B007 (read after a break: the blocks walked)
            slot = par[head]
            if slot < 0 or expiry[slot] != was:  # the chain was cut here
                break
            if run and nxt[head] != slot:
                run = 0
            expiry[slot] = body_expiry
            head = slot
        else:
            walked = stored
            up = par[head]
            if settle and up >= 0:
                self._raise_ancestors(up, body_expiry if walked > 1 else last_expiry)
        last_list, body_list = self._list_for(last_expiry), self._list_for(body_expiry)
        if not run:
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
        elif head == tail:
            self._move_to_tail(tail, last_list)
            self._to_parent(tail, last_list)
        else:
            first = tail
            if last_list != body_list:
                first = par[tail]
                self._move_to_tail(tail, last_list)
            prv = self._prev
            before, after = prv[first], nxt[head]
            nxt[before] = after
            prv[after] = before
            self._link_run(first, head, body_list)
            self._to_parent(head, body_list)
        return walked

    def _settle_sampled(self, record: OpenRequest, base: int, tail_sampled: bool) -> None:
        """An open request's sampled blocks, settled, get its classes (the model's) and the learned
        holds' expiries in the guard's miniature, each at least its descendant's; the sampled
        blocks of the prefix it loaded are raised to its head's. ``tail_sampled``: the last of
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
        self, keys: Sequence[BlockKey], slots: Sequence[int], parent: int, now: int, loaded: LoadedChain | None
    ) -> None:
        """The first store of a request, all of it new blocks (``loaded``: its load, right before).

        Counts the request's new blocks by the recorded request ends only (none
        of the blocks was referenced before), records its end, holds the blocks
        as if the request ended now (see :meth:`continue_chain`), its last block
        marked, raises the ancestors to its head, feeds the sampled blocks to the
        model and the guard, ends the reference and keeps the request's record,
        which the next store may continue. New blocks have no parent, no
        touches and expiry 0, and are not evictable yet. The path of every
        store: inlined, as a call costs about as much as a block's work.
        """
        n = len(slots)
        classes = self.classes
        history = classes.history
        found = history.deepest(keys, n - NEW_BUCKET_SPAN if n > NEW_BUCKET_SPAN else 0)  # new_blocks(keys, ())
        # HoldClassifier.request_end, inlined (a call per store)
        end = fingerprint(keys[-2] if n >= 2 else self._key_of[parent] if parent >= 0 else keys[-1])
        new = n if found < 0 else n - 1 - found
        history.add(end)
        base = BASE_OF_NEW[new if new < 8 else 8]
        drawn = classes.draw_extension()
        hold, partial = classes.hold, classes.partial
        extended = classes.extension_hold(drawn)
        last_expiry = now + (extended if base + LAST == partial else hold[base + LAST])
        # At least 1: a free slot's expiry is 0, so a walk over the request's blocks (_rehold) stops there.
        # last_expiry first: where the two are equal (every hold 0, say), the blocks share one int.
        held = max(last_expiry, now + (extended if base == partial else hold[base]), 1)
        record = self._new_record(keys[-1], new, n, end, now, held, drawn, loaded, base)
        par, children, touches, expiry = self._parent, self._children, self._touches, self._expiry
        below = self._sample_below
        sampled: list[int] = []
        up = slots[0]
        if parent >= 0 and parent != up:
            par[up] = parent
            children[parent] += 1
        touches[up] = 1
        expiry[up] = held
        if keys[0][-1] < below:
            sampled.append(0)
        for i in range(1, n):  # the hot path of every store
            s = slots[i]
            par[s] = up
            children[up] += 1
            touches[s] = 1
            expiry[s] = held
            up = s
            if keys[i][-1] < below:
                sampled.append(i)
        expiry[up] = last_expiry
        children[up] += MARK  # an eviction that reaches its last block first opens the request
        if sampled:
            self._sample_stored(keys, sampled, record, base, held)
        if parent >= 0 and expiry[parent] < OPEN:  # the loaded prefix, or what the request extends
            self._raise_ancestors(parent, held)
        if self.guard.chain_sampled:  # _end_reference
            record.diff = self.guard.end_chain(record.diff)
        self._now = now + n
        if self._now >= self._next_solve:
            self._solve()
        self._keep(up, record)

    def _new_record(
        self, tail_key: BlockKey, new: int, n: int, end: int, now: int, held: int, drawn: bool,
        loaded: LoadedChain | None, base: int,
    ) -> OpenRequest:
        """The record of a request that just stored ``n`` blocks (a settled request's, reused, when
        there is one); it inherits the guard's state of its load, whose sampled blocks the guard's
        miniature raises to the request's head."""
        spare = self._spare
        if spare:
            record = spare.pop()
            record.tail_key, record.new, record.stored, record.end, record.published = tail_key, new, n, end, end
            record.then, record.opened, record.held, record.drawn = now, OPEN + now + self.max_hold, held, drawn
            record.diff, record.sampled, record.prefix, record.loaded = 0, None, PREFIX_HITS, None
            record.watched = None
        else:
            record = OpenRequest(tail_key, new, n, end, end, now, OPEN + now + self.max_hold, held, drawn, 0)
        if loaded is not None:
            record.prefix, record.diff, record.loaded = loaded.prefix, loaded.diff, loaded.sampled
            if loaded.sampled is not None:
                learned = self.classes.learned_hold_of
                head = now + max(learned(base, drawn), learned(base + LAST, drawn))
                for fp in loaded.sampled:
                    self.guard.mini.settle(fp, head, True)
        return record

    def _sample_stored(self, keys: Sequence[BlockKey], sampled: list[int], record: OpenRequest, base: int,
                       held: int) -> None:
        """The sampled blocks (positions ``sampled`` of ``keys``) of a store of new blocks: to the
        model with the classes they have if the request ends now (an open request's are corrected
        when it settles), and to the guard, held in its miniature as the cache holds them (``held``:
        an open request's expiry, or the body's of a first store)."""
        n = len(keys)
        fps = [fingerprint(keys[i]) for i in sampled]
        model_classes = [base + LAST if i == n - 1 else base for i in sampled]
        guard_below = self._guard_below
        guarded = None if guard_below == self._sample_below else [keys[i][-1] < guard_below for i in sampled]
        if held >= OPEN:  # an open request's: for its settling
            if record.sampled is None:
                record.sampled = fps
            else:
                record.sampled += fps
        else:  # a first store's: for the opening of its blocks, if it stores more (which drops watched)
            record.sampled = fps
            watched = fps if guarded is None else [fp for fp, g in zip(fps, guarded, strict=True) if g]
            record.watched = watched or None
        if guarded is not None and not any(guarded):  # none of the guard's: only the model's sample
            self._observe_all(fps, model_classes)
            return
        if held >= OPEN:
            minis = [held] * len(fps)
        else:
            learned, then, drawn = self.classes.learned_hold_of, record.then, record.drawn
            tail = then + learned(base + LAST, drawn)
            body = max(then + learned(base, drawn), tail)
            minis = [tail if i == n - 1 else body for i in sampled]
        record.prefix = self._sample_chain(fps, model_classes, minis, record.prefix, guarded)

    # --- learning ---------------------------------------------------------------------

    def _sample_chain(
        self, fps: list[int], model_classes: list[int], minis: list[int], prefix: int, guarded: list[bool] | None
    ) -> int:
        """A chain's sampled references (fingerprints head first, their classes, their expiries in
        the miniature of the learned holds), given its request's prefix state; returns the new
        state. ``guarded[i]``: ``fps[i]`` is one of the guard's keys (None: all are).

        Head first, the sampled LRU and the miniature say whether each of the
        guard's keys is a prefix hit (held, and every one before it in the
        request too); then, tail first (so the head ends the most recent), the
        sampler takes each reference (a return time for the model; the sampled
        LRU's recency) and the miniature holds the guard's.
        """
        now = self._now
        guard, sampler = self.guard, self.sampler
        mini, table = guard.mini, sampler.table
        if guarded is None:
            watched, holds = fps, minis
        else:
            watched = [fp for fp, g in zip(fps, guarded, strict=True) if g]
            holds = [e for e, g in zip(minis, guarded, strict=True) if g]
        if watched:
            if now // mini.width != mini.cur:
                mini.advance(now)
            lru_hit, learned_hit = bool(prefix & 1), bool(prefix & 2)
            lru_hits = learned_hits = 0
            for fp in watched:
                if lru_hit:
                    entry = table.find(fp)
                    lru_hit = entry >= 0 and table.list_of(entry) == 0
                    lru_hits += lru_hit
                if learned_hit:
                    learned_hit = mini.holds(fp)
                    learned_hits += learned_hit
            guard.refs += len(watched)
            guard.lru_hits += lru_hits
            guard.learned_hits += learned_hits
            guard.chain_diff += learned_hits - lru_hits
            guard.chain_sampled = True
            prefix = lru_hit | learned_hit << 1
        self._observe_all(fps, model_classes)
        for i in range(len(watched) - 1, -1, -1):
            mini.reference(watched[i], holds[i])
        return prefix

    def _observe_all(self, fps: list[int], model_classes: list[int]) -> None:
        """The sampler takes each of a chain's sampled references (fingerprints head first, their
        classes), tail first: a return time for the model, the sampled LRU's recency."""
        sampler, now = self.sampler, self._now
        record, observe = self.model.record, sampler.observe
        for i in range(len(fps) - 1, -1, -1):
            previous = observe(fps[i], now, model_classes[i])
            if previous >= 0:
                record(previous, sampler.last_age)

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
            for tail, record in records.items():
                if record.held < 0 and self._key_of[tail] == record.tail_key:
                    record.end = self._end_of(tail, record)
                self.classes.publish(record)
        self._reset_blocks()
