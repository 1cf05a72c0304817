"""The CPU primary tier: slots of the shared region, an index, ref counts, events.

Per block (DESIGN.md section 4): ref count ``-1`` means a write is in flight
(a device store or a promotion from a secondary tier), ``0`` means ready and
evictable, ``> 0`` means pinned by that many readers (device loads, cascades
to secondary tiers). Only evictable blocks are ever evicted, and the policy
sees only evictable blocks, so eviction never scans pinned ones. Every policy
call names the block's row slot too, so a policy can keep its per-block state
in slot-indexed arrays rather than hash tables (see ``kvtier.policies.base``).

Every method is called from the scheduler thread and does bookkeeping only;
bytes are moved by engine workers and tier I/O threads, into and out of
``rows[slot]``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.errors import KvtierError
from kvtier.keys import BlockKey
from kvtier.policies import DEFAULT_POLICY, EvictionPolicy, create_policy
from kvtier.region import SharedRegion
from kvtier.types import PRIMARY_LABEL, BlockEvent, LookupResult, RequestHints

logger = logging.getLogger(__name__)

_NO_LOAD = object()
"""No load that a completion may release (see :meth:`PrimaryTier._other_load`)."""

IN_FLIGHT = -1
RESET_HOLD_STEPS = 3
"""Engine steps a reset holds out the rows an engine copy may still touch: vLLM flushes its worker's
copies during the next step's execution, and with async scheduling the step after is scheduled
before that ends; one more of margin."""
"""The ref count of a block whose write is in flight (a device store or a promotion)."""

DEVICE_STORE = 1
"""The kind of a write in flight that :meth:`PrimaryTier.prepare_store` reserved (a device store)."""
PROMOTION = 2
"""The kind of a write in flight that ``prepare_write`` / ``reserve_one`` reserved (a promotion)."""


@dataclass
class PrepareStoreResult:
    """What ``prepare_store`` decided: write ``keys_to_store[i]`` into row ``slots[i]``."""

    keys_to_store: list[BlockKey]
    slots: np.ndarray
    evicted_keys: list[BlockKey] = field(default_factory=list)


@dataclass
class PrimaryStats:
    """The CPU tier's counters. ``hits``, ``hits_pending`` and ``misses`` count calls of
    :meth:`PrimaryTier.lookup`; the :class:`~kvtier.manager.TieringManager` answers its own
    lookups from the index directly and adds its counts in its snapshot of this tier."""

    hits: int = 0
    hits_pending: int = 0
    misses: int = 0
    blocks_stored: int = 0
    store_failures: int = 0
    evictions: int = 0
    store_rejections: int = 0
    stray_load_completions: int = 0
    """Keys given to ``complete_load`` with no load of theirs outstanding (ignored)."""


class _Union:
    """Membership in either of two collections, without building their union."""

    __slots__ = ("a", "b")

    def __init__(self, a: Collection[BlockKey], b: Collection[BlockKey]) -> None:
        self.a, self.b = a, b

    def __contains__(self, key: object) -> bool:
        return key in self.a or key in self.b


class PrimaryTier:
    """CPU tier over a :class:`SharedRegion`; one block per row."""

    tier_label = PRIMARY_LABEL
    medium = "cpu"

    def __init__(
        self,
        region: SharedRegion,
        block_bytes: int,
        policy: str | EvictionPolicy = DEFAULT_POLICY,
        *,
        max_pending_events: int = 4096,
        record_events: bool = True,
    ) -> None:
        """``record_events``: keep stored/removed events for :meth:`take_events`. An engine
        that never takes them passes False and the tier records none (each kept event costs an
        allocation per eviction, and once ``max_pending_events`` are kept, freeing the oldest)."""
        if block_bytes > region.row_stride:
            raise KvtierError(
                f"block_bytes {block_bytes} exceeds the region's row stride {region.row_stride}"
            )
        self.region = region
        self.block_bytes = block_bytes
        self.num_blocks = region.num_rows
        self.policy = policy if isinstance(policy, EvictionPolicy) else create_policy(policy, self.num_blocks)
        self.rows: np.ndarray | None = region.rows
        # The index and the ref counts are never rebound (reset clears them in place), so the
        # views handed out by hot_path() stay valid for the tier's life.
        self._slot_of: dict[BlockKey, int] = {}
        self._ref: list[int] = [0] * self.num_blocks
        self._writer = bytearray(self.num_blocks)  # the kind of each slot's last reservation
        # The device loads' own pins, by the request that took them (None: a load without one),
        # then by row: complete_load releases only these, never a pin a cascade holds on the same
        # row nor one another request's load holds (sparse: a row is here only while a load holds it).
        self._loading: dict[Hashable, dict[int, int]] = {}
        self._free: list[int] = []
        self._next_fresh = 0
        # Rows an engine copy may still touch after a reset: out of ``_free`` until release_held().
        self._held: set[int] = set()
        self.reset_hold_steps = RESET_HOLD_STEPS
        """Engine steps (:meth:`step_ended` calls) after a :meth:`reset` before its held rows come back."""
        self._hold_left = 0
        # Bounded: an engine that never takes events must not grow memory without limit.
        self._events: deque[BlockEvent] = deque(maxlen=max_pending_events)
        self.record_events = record_events
        self.events_overflowed = 0
        self.stats = PrimaryStats()
        self._shut_down = False

    # --- queries -------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    @property
    def free_slots(self) -> int:
        return len(self._free) + self.num_blocks - self._next_fresh

    def ref_count(self, key: BlockKey) -> int | None:
        """The ref count of ``key``, or None if absent."""
        slot = self._slot_of.get(key)
        return None if slot is None else self._ref[slot]

    def slot_of(self, key: BlockKey) -> int | None:
        return self._slot_of.get(key)

    def hot_path(self) -> tuple[Callable[[BlockKey], int | None], list[int]]:
        """``(slot_of, refs)``: the index's ``get`` (key -> slot, or None) and the ref counts by
        slot, for a caller that answers lookups without a call per key (the manager's fast
        path). Read only; both stay valid for the tier's life. Scheduler thread only."""
        return self._slot_of.get, self._ref

    def lookup(self, key: BlockKey) -> LookupResult:
        """HIT if ready, HIT_PENDING if a write is in flight, else MISS."""
        slot = self._slot_of.get(key)
        if slot is None:
            self.stats.misses += 1
            return LookupResult.MISS
        if self._ref[slot] == IN_FLIGHT:
            self.stats.hits_pending += 1
            return LookupResult.HIT_PENDING
        self.stats.hits += 1
        return LookupResult.HIT

    # --- writes into the tier (device stores and promotions) -------------------------

    def prepare_store(
        self, keys: Iterable[BlockKey], protected: Collection[BlockKey] = (), after: BlockKey | None = None,
        continues: bool = False,
    ) -> PrepareStoreResult | None:
        """Reserve rows for the keys not yet present, evicting as needed, for a device store.

        ``keys`` are a request's blocks in prefix order and ``after`` the block
        before the first of them, if the caller knows it: the policy learns the
        chain (see :meth:`EvictionPolicy.reference_chain`); ``continues``: the
        same request stored ``after`` as the tail of its previous store (a
        prefill in chunks, decoded blocks), see :meth:`EvictionPolicy.continue_chain`. Never evicts the keys
        being stored, keys in ``protected``, pinned or in-flight blocks. Returns
        None, changing nothing, if not enough blocks can be evicted. New blocks
        are in flight (ref -1) until ``complete_store``.
        """
        keys = keys if type(keys) is list else list(keys)
        reserved = self._reserve(keys, protected, DEVICE_STORE)
        if reserved is None:
            return None
        new_keys, slots, evicted = reserved
        if keys:
            slot_of = self._slot_of
            if len(new_keys) == len(keys):  # all new (hence distinct): the chain is what was reserved
                chain, chain_slots = new_keys, slots
            else:
                chain = list(dict.fromkeys(keys))
                chain_slots = [slot_of[k] for k in chain]
            parent = -1 if after is None else slot_of.get(after, -1)
            if continues and parent >= 0:
                self.policy.continue_chain(chain, chain_slots, parent)
            else:
                self.policy.reference_chain(chain, chain_slots, parent, False)
        return PrepareStoreResult(new_keys, np.array(slots, dtype=np.int64), evicted)

    def end_request(self, tail: BlockKey, hints: RequestHints | None = None) -> None:
        """The request whose last store ended with ``tail`` finished (see
        :meth:`EvictionPolicy.end_request`), then its ``hints`` if any (see
        :meth:`EvictionPolicy.hint_request`); nothing if ``tail`` has left the tier."""
        slot = self._slot_of.get(tail)
        if slot is not None:
            self.policy.end_request(slot)
            if hints is not None:
                self.policy.hint_request(slot, hints.session, hints.session_end, hints.expected_return_s)

    def prepare_write(
        self, keys: Iterable[BlockKey], protected: Collection[BlockKey] = ()
    ) -> PrepareStoreResult | None:
        """Reserve rows like :meth:`prepare_store`, for a promotion from a secondary tier.

        No reference is reported: the promoted blocks are referenced when the
        request loads them.
        """
        reserved = self._reserve(list(keys), protected, PROMOTION)
        if reserved is None:
            return None
        new_keys, slots, evicted = reserved
        return PrepareStoreResult(new_keys, np.array(slots, dtype=np.int64), evicted)

    def reserve_one(self, key: BlockKey, protected: Collection[BlockKey] = ()) -> int | None:
        """``prepare_write([key], protected)`` for one key known to be absent: its row, or None
        (changing nothing) if no row can be freed. The manager's per-lookup promotion path."""
        free = self._free
        if free:
            slot = free.pop()
        elif self._next_fresh < self.num_blocks:
            slot = self._take_fresh()
        else:
            # The key is absent, so it cannot be evicted for itself: ``protected`` is the whole guard.
            chosen = self.policy.evict_one(protected)
            if chosen is None:  # (the manager counts it: promotion_alloc_failures, not a device store refused)
                return None
            slot = self._slot_of.pop(chosen)
            self.stats.evictions += 1
            if self.record_events:
                self._events.append(BlockEvent((chosen,), self.tier_label, self.medium, removed=True))
        self._slot_of[key] = slot
        self._ref[slot] = IN_FLIGHT
        self._writer[slot] = PROMOTION
        self.policy.insert(key, slot)
        return slot

    def _reserve(
        self, keys: list[BlockKey], protected: Collection[BlockKey], kind: int
    ) -> tuple[list[BlockKey], list[int], list[BlockKey]] | None:
        """Rows for the distinct keys of ``keys`` not yet present: (new keys, their slots, evicted)."""
        slot_of = self._slot_of
        new_keys = [k for k in keys if k not in slot_of]
        all_new = len(new_keys) == len(keys)
        if len(new_keys) > 1 and len(set(new_keys)) < len(new_keys):
            new_keys = list(dict.fromkeys(new_keys))
        free = self._free
        evicted: list[BlockKey] = []
        shortfall = len(new_keys) - len(free) - (self.num_blocks - self._next_fresh)
        if shortfall > 0:
            # Every input key is protected, also those already present: evicting a block the
            # caller is about to rely on would defeat the store. When every key is new (none is
            # in the tier) ``protected`` alone is the same guard, without a union per candidate.
            guard = protected if all_new else _Union(set(keys), protected)
            chosen = self.policy.evict(shortfall, guard)
            if chosen is None:
                self.stats.store_rejections += 1
                return None
            for key in chosen:
                free.append(slot_of.pop(key))
            evicted = chosen
            self.stats.evictions += len(chosen)
            if self.record_events:
                self._events.append(BlockEvent(tuple(chosen), self.tier_label, self.medium, removed=True))
        ref, writer = self._ref, self._writer
        slots: list[int] = []
        for key in new_keys:
            if free:
                slot = free.pop()
            else:
                slot = self._next_fresh
                self._next_fresh = slot + 1
            slot_of[key] = slot
            ref[slot] = IN_FLIGHT
            writer[slot] = kind
            slots.append(slot)
        if new_keys:
            self.policy.insert_many(new_keys, slots)
        return new_keys, slots, evicted

    def _take_fresh(self) -> int:
        slot = self._next_fresh
        self._next_fresh += 1
        return slot

    def complete_store(self, keys: Iterable[BlockKey], success: bool = True) -> list[BlockKey]:
        """Finish writes: make blocks readable, or remove them and free their rows.

        Keys that are not in flight (unknown, or already completed, e.g. after a
        reset) are ignored. Returns the keys whose state changed.
        """
        return self._complete(keys, success, 0, 0)[0]

    def complete_device_store(
        self, keys: Iterable[BlockKey], success: bool = True, pins: int = 0
    ) -> tuple[list[BlockKey], list[int]]:
        """:meth:`complete_store` of the device stores among ``keys`` only (rows reserved by
        :meth:`prepare_store`; a promotion in flight is left alone), each completed block
        pinned ``pins`` times at once (one pin per tier a cascade is about to read it for).
        Returns the completed keys, in the order given, and their rows."""
        return self._complete(keys, success, DEVICE_STORE, pins if success else 0)

    def _complete(
        self, keys: Iterable[BlockKey], success: bool, kind: int, pins: int
    ) -> tuple[list[BlockKey], list[int]]:
        """Complete the writes in flight of ``keys`` (of ``kind`` only, unless 0)."""
        done: list[BlockKey] = []
        slots: list[int] = []
        slot_of, ref, writer = self._slot_of, self._ref, self._writer
        # Tail first, so a policy that orders by completion keeps a chain's head longest.
        for key in reversed(keys if type(keys) is list else list(keys)):
            slot = slot_of.get(key)
            if slot is None or ref[slot] != IN_FLIGHT or (kind and writer[slot] != kind):
                continue
            ref[slot] = pins
            if not success:
                del slot_of[key]
                self._free.append(slot)
                self.policy.remove(key, slot)
            done.append(key)
            slots.append(slot)
        if not done:
            return done, slots
        if success:
            if pins:
                self.policy.mark_evictable_then_pinned_many(done, slots)
            else:
                self.policy.mark_evictable_many(done, slots)
            done.reverse()
            slots.reverse()
            self.stats.blocks_stored += len(done)
            if self.record_events:
                self._events.append(BlockEvent(tuple(done), self.tier_label, self.medium, removed=False))
        else:
            done.reverse()
            slots.reverse()
            self.stats.store_failures += len(done)
        return done, slots

    # Promotions complete rows exactly like device stores.
    complete_write = complete_store

    # --- reads out of the tier (device loads and cascades) --------------------------

    def pin(self, keys: Sequence[BlockKey]) -> np.ndarray:
        """Pin ready blocks for reading; returns their rows. Raises if one is not ready."""
        return np.array(self.pin_slots(keys), dtype=np.int64)

    def pin_slots(self, keys: Sequence[BlockKey], times: int = 1) -> list[int]:
        """:meth:`pin` each block ``times`` times (one pin per reader, e.g. per tier a cascade
        goes to); returns the rows as a list. Raises, pinning nothing, if one is not ready."""
        slot_of, ref = self._slot_of, self._ref
        slots: list[int] = []
        first_keys: list[BlockKey] = []
        first_slots: list[int] = []
        for i, key in enumerate(keys):
            slot = slot_of.get(key)
            if slot is None or ref[slot] == IN_FLIGHT:
                self._undo_pins(keys[:i], first_keys, first_slots, times)
                state = "absent" if slot is None else "still being written"
                raise KvtierError(f"cannot pin block {key.hex()[:16]}: it is {state}; only HIT blocks can be read")
            count = ref[slot]
            if count == 0:
                first_keys.append(key)
                first_slots.append(slot)
            ref[slot] = count + times
            slots.append(slot)
        if first_keys:
            self.policy.mark_pinned_many(first_keys, first_slots)
        return slots

    def _undo_pins(
        self, pinned: Sequence[BlockKey], first_keys: list[BlockKey], first_slots: list[int], times: int
    ) -> None:
        """Release the pins :meth:`pin_slots` took before it found a block it cannot pin (the
        policy sees the same calls as a pin and an unpin of each)."""
        if first_keys:
            self.policy.mark_pinned_many(first_keys, first_slots)
        for _ in range(times):
            for key in pinned:
                self._unpin_one(key)

    def unpin(self, keys: Iterable[BlockKey]) -> None:
        """Release pins taken by :meth:`pin`; keys no longer present are ignored.

        Released tail first, so a policy that orders by release keeps a chain's head longest.
        """
        slot_of, ref = self._slot_of, self._ref
        freed_keys: list[BlockKey] = []
        freed_slots: list[int] = []
        for key in reversed(keys if type(keys) is list else list(keys)):
            slot = slot_of.get(key)
            if slot is None:
                continue
            count = ref[slot]
            if count <= 0:
                logger.error("unpin of block %s with ref count %d ignored", key.hex()[:16], count)
                continue
            ref[slot] = count - 1
            if count == 1:
                freed_keys.append(key)
                freed_slots.append(slot)
        if freed_keys:
            self.policy.mark_evictable_many(freed_keys, freed_slots)

    def unpin_slots(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        """:meth:`unpin` of ``keys``, whose rows ``slots`` the caller got when it pinned them
        (:meth:`pin_slots`, :meth:`complete_device_store`) and still holds pinned: a pinned row
        is never evicted, removed or reused, so it still holds its key and no index lookup is
        needed. Released tail first, like :meth:`unpin`."""
        ref = self._ref
        freed_keys: list[BlockKey] = []
        freed_slots: list[int] = []
        for i in range(len(slots) - 1, -1, -1):
            slot = slots[i]
            count = ref[slot]
            if count <= 0:
                logger.error("unpin of block %s with ref count %d ignored", keys[i].hex()[:16], count)
                continue
            ref[slot] = count - 1
            if count == 1:
                freed_keys.append(keys[i])
                freed_slots.append(slot)
        if freed_keys:
            self.policy.mark_evictable_many(freed_keys, freed_slots)

    def _unpin_one(self, key: BlockKey) -> None:
        slot = self._slot_of.get(key)
        if slot is None:
            return
        ref = self._ref[slot]
        if ref <= 0:
            logger.error("unpin of block %s with ref count %d ignored", key.hex()[:16], ref)
            return
        self._ref[slot] = ref - 1
        if ref == 1:
            self.policy.mark_evictable(key, slot)

    def prepare_load(
        self, keys: Sequence[BlockKey], after: BlockKey | None = None, owner: Hashable = None
    ) -> np.ndarray:
        """Pin ready blocks for a device load (a hit) and report the reference to the policy.

        ``keys`` are in prefix order; ``after`` is the block before the first of
        them, if the caller knows it; ``owner`` is the request's id (None: no request), which
        its :meth:`complete_load` names. Raises like :meth:`pin`.
        """
        slots = self.pin_slots(keys)
        if slots:
            loading = self._loading.get(owner)
            if loading is None:
                loading = self._loading[owner] = {}
            for slot in slots:
                loading[slot] = loading.get(slot, 0) + 1
            parent = -1 if after is None else self._slot_of.get(after, -1)
            self.policy.reference_chain(keys if type(keys) is list else list(keys), slots, parent, True)
        return np.array(slots, dtype=np.int64)

    def complete_load(self, keys: Iterable[BlockKey], owner: Hashable = None) -> None:
        """Release the pins :meth:`prepare_load` took on ``keys`` for ``owner`` (tail first, like
        :meth:`unpin`).

        Only a device load's own pin is released: the owner's, else a load taken without a
        request (and, for a completion without one, the load of the request holding the row). A
        key with no such load outstanding (a duplicate or stray call, one after a
        ``prepare_load`` that raised, one naming another request) is ignored and counted
        (``stats.stray_load_completions``, logged at 1, 2, 4, ... of them), so another reader's
        pin on the row (a cascade's, or another request's load: still copying it) is never taken
        away.
        """
        slot_of, loading = self._slot_of, self._loading
        mine = loading.get(owner)
        mine_keys: list[BlockKey] = []
        mine_slots: list[int] = []
        stray: list[BlockKey] = []
        others: list[Hashable] = []
        for key in keys if type(keys) is list else list(keys):
            slot = slot_of.get(key)
            if slot is None:
                stray.append(key)
                continue
            if mine is not None and slot in mine:
                held_by = mine
            else:
                who = self._other_load(slot, owner)
                if who is _NO_LOAD:
                    stray.append(key)
                    continue
                held_by = loading[who]
                others.append(who)
            held = held_by.pop(slot)
            if held > 1:
                held_by[slot] = held - 1
            mine_keys.append(key)
            mine_slots.append(slot)
        for who in (owner, *others) if mine_keys else ():
            if not loading.get(who, True):  # no load of theirs left
                del loading[who]
        if mine_keys:  # each row pinned by its load: unpin_slots needs no second index lookup
            self.unpin_slots(mine_keys, mine_slots)
        if stray:
            before = self.stats.stray_load_completions
            self.stats.stray_load_completions = after = before + len(stray)
            if after.bit_length() > before.bit_length():
                logger.warning(
                    "complete_load of %d block(s) with no load of theirs outstanding ignored (first %s; %d so "
                    "far): a duplicate call, or one without a successful prepare_load", len(stray),
                    stray[0].hex()[:16], after,
                )  # fmt: skip

    def _other_load(self, slot: int, owner: Hashable) -> Hashable:
        """Whose load on ``slot`` :meth:`complete_load` of ``owner`` may release when ``owner``
        has none there: one taken without a request (None); for a completion without a
        request, also a request's load on the row (the first found: the caller named none).
        :data:`_NO_LOAD` if none may be."""
        unowned = self._loading.get(None)
        if unowned is not None and slot in unowned:
            return None
        if owner is None:
            return next((who for who, rows in self._loading.items() if slot in rows), _NO_LOAD)
        return _NO_LOAD

    def touch(self, keys: Iterable[BlockKey]) -> None:
        """A use of ``keys`` (in prefix order) elsewhere, e.g. a device-cache hit.

        Unknown or in-flight keys are ignored; each run of ready keys is
        reported to the policy as one chain.
        """
        run: list[BlockKey] = []
        slots: list[int] = []
        parent = -1
        for key in keys:
            slot = self._slot_of.get(key)
            if slot is not None and self._ref[slot] != IN_FLIGHT:
                run.append(key)
                slots.append(slot)
                continue
            if run:
                self.policy.reference_chain(run, slots, parent, True)
                run, slots = [], []
            parent = -1 if slot is None else slot
        if run:
            self.policy.reference_chain(run, slots, parent, True)

    # --- events, reset, shutdown -----------------------------------------------------

    def take_events(self) -> list[BlockEvent]:
        """Events since the last call (at most ``max_pending_events``; older ones are dropped,
        and :attr:`events_overflowed` counts the takes that may have lost some; none if the tier
        records no events)."""
        events = list(self._events)
        if len(events) == self._events.maxlen:
            self.events_overflowed += 1
        self._events.clear()
        return events

    def ready_keys(self) -> list[BlockKey]:
        """The keys whose blocks are readable (stored, not being written): what the stored and
        removed events so far add up to."""
        ref = self._ref
        return [key for key, slot in self._slot_of.items() if ref[slot] != IN_FLIGHT]

    def in_flight_count(self) -> int:
        return sum(1 for slot in self._slot_of.values() if self._ref[slot] == IN_FLIGHT)

    def pinned_count(self) -> int:
        return sum(1 for slot in self._slot_of.values() if self._ref[slot] > 0)

    def reset(self) -> None:
        """Forget every block. The caller guarantees that no copy of a *tier* touches the rows any
        more (the manager drains them first); an engine's copy may still run: a row written by a
        device store not yet completed or pinned by a device load not yet completed (and any row
        held out by an earlier reset) is held out, never handed to a new write, until
        :meth:`release_held`: the engine's copies have finished, or :attr:`reset_hold_steps` engine
        steps have ended (:meth:`step_ended`; vLLM's worker flushes them during the next step)."""
        if self._slot_of and self.record_events:
            self._events.append(BlockEvent(tuple(self._slot_of), self.tier_label, self.medium, removed=True))
        ref = self._ref
        held = self._held
        writer = self._writer
        # A device load's pin, or a device store's reservation (a promotion not drained was never submitted).
        held.update(slot for slot in self._slot_of.values()
                    if ref[slot] > 0 or (ref[slot] and writer[slot] != PROMOTION))
        self._slot_of.clear()
        self._loading.clear()
        ref[:] = [0] * self.num_blocks
        writer[:] = bytes(self.num_blocks)
        self._free.clear()
        self._next_fresh = 0
        if held:  # the rows below the highest held one, lowest handed out first; above it, fresh
            top = max(held)
            self._free.extend(slot for slot in range(top, -1, -1) if slot not in held)
            self._next_fresh = top + 1
            self._hold_left = self.reset_hold_steps
        self.policy.clear()

    def step_ended(self) -> None:
        """An engine step ended (the manager's ``on_schedule_end``): the rows a :meth:`reset` held
        come back after :attr:`reset_hold_steps` of them."""
        if self._hold_left:
            self._hold_left -= 1
            if not self._hold_left:
                self.release_held()

    @property
    def held_count(self) -> int:
        """Rows held out by :meth:`reset` until :meth:`release_held`."""
        return len(self._held)

    def release_held(self) -> int:
        """Give the rows :meth:`reset` held out back to new writes (the engine's copies that may
        have touched them have finished). Returns how many."""
        held = sorted(self._held, reverse=True)
        self._held.clear()
        self._hold_left = 0
        self._free.extend(held)
        return len(held)

    @property
    def is_shut_down(self) -> bool:
        """:meth:`shutdown` completed: the region is released."""
        return self._shut_down

    def shutdown(self) -> None:
        """Drop this tier's view and release the region (strict cleanup order). Idempotent."""
        if self._shut_down:
            return
        self.rows = None
        self.region.close()
        self._shut_down = True
