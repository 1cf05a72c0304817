"""The fleet's prefix index: which engine holds which block in which tier, from their KV events.

:class:`FleetIndex` applies the decoded event batches of N engines (one writer: the
subscriber thread) and answers, for a prompt's block keys, the longest cached prefix
per engine and tier (any thread). What it keeps:

* Per engine: its **device cache** (vLLM's own ``BlockStored``/``BlockRemoved`` of
  medium GPU, cleared by ``AllBlocksCleared``) and its **private tiers** (the CPU tier:
  kvtier's events of medium CPU; a tier of scope ``engine``), both belonging to the
  engine's current start.
* Per **shared store** (an fs root, a Redis, an S3 prefix; named by the store id in
  kvtier's control records): what it holds, changed by any engine's stored and removed
  events, surviving engine restarts. An engine's tier answers from the store it uses.

Trust rules (kvtier's control records, :mod:`kvtier.engine_events`):

* A control record with a new ``start`` for an engine means it restarted: everything of
  its old start (device cache, private tiers) is dropped at once, before the batch's
  other events are applied (they are the new start's).
* Control records count ``seq`` 0, 1, 2 ... per start: a gap (or a gap the subscriber saw
  in vLLM's own batch sequence and could not replay) means events were lost: the
  engine's device cache and private tiers are dropped and marked incomplete until a
  snapshot (private tiers) or a clear (device cache) makes them whole again. An engine
  first heard in the middle of a start is incomplete the same way.
* Block events of medium GPU (or none: older vLLM) are the device cache's. Those of
  kvtier's media (CPU, STORAGE) only count after a control record of the same batch names
  the start and the tiers; those of any other medium (another connector's) are skipped
  and counted.
* Engines' streams reach the index in any order relative to each other, so changes to a
  shared store carry the time they happened (kvtier's control records; engines' clocks,
  capped at the index's own): a change older than the last one applied to the same key is
  ignored (the latest change wins; exact on one host, as good as clock sync across hosts),
  however old the changes (a replay reaches back minutes).
  A snapshot's stored events report what an engine's index held, which may lag other
  engines' changes (an fs root's journal delay): they count as ``lag_seconds`` older than
  the snapshot. A snapshot that lists a store completely (an fs root with sharing) also
  drops the keys the index believed the store held beyond it, unless changed since
  ``lag_seconds`` before the snapshot.

Answers are in blocks of the engines' ``tokens_per_hash``; kvtier tiers hold chunks of
``blocks_per_chunk`` blocks, keyed by the chunk's last block. An answer's ``blocks`` is
the longest prefix whose every block is in at least one of the engine's tiers (what the
engine would reuse, device cache first); ``tiers`` has the prefix of each tier alone.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.engine_events import SCOPE_SHARED, ControlRecord, TierInfo, is_info_value
from kvtier.fleet.masks import (
    MAX_LOCATIONS,
    ClaimLapsed,
    IndexFull,
    LocationMasks,
    MemoryMasks,
    StoreUnavailable,
    WriterConflict,
)
from kvtier.fleet.records import Kind, WireBatch, WireEvent
from kvtier.types import PRIMARY_LABEL

logger = logging.getLogger(__name__)

DEVICE = "GPU"
"""The name of an engine's device cache in answers (vLLM's medium ``GPU``)."""

TABLE_VERSION = 1
"""The engine table's layout this kvtier writes and reads (its ``version``)."""


_KVTIER_MEDIA = frozenset({"CPU", "STORAGE"})
_MARKS_KEPT = 32
_MAX_REFUSED = 64  # refused stores remembered per start: what one record may name (an engine's tiers stay put)
_KEEP_WRITER_EVERY = 2.0  # seconds between refreshes of a shared index's writer claim
_PUBLISH_COUNTERS_EVERY = 0.5  # seconds: how stale an engine table's counters may be (readers re-read it as often)
# What of an engine table changes with (nearly) every batch and no reader needs at once:
_COUNTERS = frozenset({"seq", "batches", "events", "skipped", "unattributed", "gaps", "restarts", "last_event",
                       "marks"})  # fmt: skip


FAILING_WRITES_GRACE = 5.0
"""Seconds every write to the index's store (Redis) must have failed, none going through since,
before the writer reports the store failing (``GET /health`` answers 503); counted from when the
first failed write was sent (a hung Redis: from before the client's timeout). The writer refreshes
its claim every 2 s, so a store that answers again is seen within about that; one failed write
followed by one that goes through never reports it, unless Redis kept that one write waiting the
whole grace itself (a client timeout as long: the CLI's is 5 s)."""


class LocationsFull(ValueError):
    """A control record names more tiers or stores than the index has location bits for."""


@dataclass
class EngineState:
    """What the index knows of one configured engine (writer side)."""

    name: str
    device_bit: int
    start: str | None = None
    seq: int | None = None
    tiers: dict[str, TierInfo] = field(default_factory=dict)
    bits: dict[str, int] = field(default_factory=dict)  # tier label -> location bit
    spare: list[int] = field(default_factory=list)  # bits of its former private tiers, reused by its next ones
    stores: set[str] = field(default_factory=set)  # every shared store it has named (bounded: max_stores_per_engine)
    refused: set[str] = field(default_factory=set)  # stores of its current start past that bound (not followed)
    dirty: bool = False  # dropping its device cache and private tiers failed (a store error): retried
    info: dict[str, Any] = field(default_factory=dict)
    device_complete: bool = False
    private_complete: bool = False
    needs_snapshot: bool = False
    snapshot_whole: bool = False  # its CPU tier's snapshot under way was heard from part 0 with no gap since
    batches: int = 0
    events: int = 0
    skipped: int = 0
    unattributed: int = 0
    gaps: int = 0
    restarts: int = 0
    last_event: float | None = None
    marks: deque[str] = field(default_factory=lambda: deque(maxlen=_MARKS_KEPT))
    disconnected: bool = False  # the subscriber's connection to its events endpoint went down, not up since

    @property
    def status(self) -> str:
        """``waiting`` (nothing heard yet), ``disconnected`` (heard, but its events endpoint's
        connection is down: the engine stopped, was killed or cannot be reached; what it held is
        kept, and so is its start, until it is heard again), else ``synced`` (every event of its
        start applied) or ``partial`` (some lost: its device cache or private tiers are
        incomplete until a snapshot or a clear)."""
        if self.start is None:
            return "waiting"
        if self.disconnected:
            return "disconnected"
        return "synced" if self.device_complete and self.private_complete else "partial"


MAX_LISTED = 1 << 22
"""The most keys a complete snapshot of a shared store may list to an index in Redis (held in
this process until its last part); an in-memory index's ``max_keys`` bounds it there."""


class FleetIndex:
    """The writer's index (see the module docstring). ``masks`` holds the key bitmaps
    (default: in memory; :class:`~kvtier.fleet.masks.RedisMasks` to share them with
    readers). ``max_stores_per_engine`` bounds the shared stores one engine may name over all
    its starts (each takes a location bit for good, and the engine table lists them).
    ``failing_writes_grace``: how long every write to the store must have failed, none going
    through since, before :meth:`store_failing` reports it (one failed write alone does not, unless
    it waited that long itself). Every method is thread-safe."""

    def __init__(
        self,
        engines: Iterable[str] = (),
        masks: LocationMasks | None = None,
        *,
        lag_seconds: float = 5.0,
        max_times: int = 1 << 20,
        max_locations: int = MAX_LOCATIONS,
        max_stores_per_engine: int = 16,
        failing_writes_grace: float = FAILING_WRITES_GRACE,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.masks: LocationMasks = masks if masks is not None else MemoryMasks()
        self.failing_writes_grace = failing_writes_grace
        self.lag_seconds = lag_seconds
        self.max_times = max_times
        self.max_locations = min(max_locations, MAX_LOCATIONS)
        self.max_stores_per_engine = max_stores_per_engine
        self._clock = clock
        self._wall = wall_clock
        self._lock = threading.RLock()
        self._engines: dict[str, EngineState] = {}
        self._stores: dict[str, int] = {}
        # store bit -> key -> when its last applied change happened (engines' clocks), for recent keys
        self._times: dict[int, OrderedDict[int, float]] = {}
        self._floor: dict[int, float] = {}  # store bit -> the newest time forgotten from _times
        self._times_held = 0  # the sizes of the _times together (at most max_times, over all stores)
        # (engine, tier label) -> (when a complete snapshot of a shared store was taken, the keys it listed)
        self._sweeps: dict[tuple[str, str], tuple[float, set[int]]] = {}
        self._sweeps_due: list[tuple[str, str]] = []
        self._max_listed = self.masks.max_keys if isinstance(self.masks, MemoryMasks) else MAX_LISTED
        """The most keys the complete shared-store snapshots in flight may list, all together (:attr:`_sweeps`)."""
        self._listed_held = 0
        """The keys listed by every sweep in :attr:`_sweeps`, summed."""
        self._next_bit = 0
        self._kept_writer = clock()
        self._published_shape: dict[str, Any] | None = None
        self._published_at = -float("inf")
        self._publish_due = False
        self.writer_lost: str | None = None
        """Why this writer no longer writes its shared store (another writer took it); None if it does."""
        self._table: dict[str, Any] = {"version": TABLE_VERSION, "engines": {}, "stores": {}}
        self.masks.open_writer()
        try:
            for name in engines:
                self.add_engine(name)
        except BaseException:  # (no writer runs: its claim is given back, not left to run out)
            with contextlib.suppress(Exception):
                self.masks.close_writer()
            raise

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """The writer's lock around a change; a write the store refused because another writer
        took the prefix over leaves the reason in :attr:`writer_lost` (answers are 503 from then on)."""
        with self._lock:
            try:
                yield
            except WriterConflict as exc:
                self.writer_lost = self.writer_lost or str(exc)
                raise

    # --- engines -------------------------------------------------------------------------

    def add_engine(self, name: str) -> None:
        with self._writing():
            if name in self._engines:
                raise ValueError(f"engine {name!r} is configured twice")
            self._engines[name] = EngineState(name, self._alloc())
            self._publish()

    @property
    def engine_names(self) -> list[str]:
        return list(self._engines)

    def engine(self, name: str) -> EngineState:
        return self._engines[name]

    def tick(self) -> None:
        """Called every fraction of a second by the writer's thread (the subscriber): keeps a
        shared index's writer claim every 2 s, then writes the engine table's counters if due.
        Raises :class:`~kvtier.fleet.masks.WriterConflict` if another writer took the claim (found
        by either write), keeping the reason in :attr:`writer_lost`. A claim that had run out with
        nobody else holding it is taken again (at once where the table's write found it so:
        :class:`~kvtier.fleet.masks.ClaimLapsed`), and a Redis that restarted (maybe from an older
        save) is noticed: the index under the prefix is then deleted and every engine is treated
        as having lost events; shared stores' keys are reported again as they are stored."""
        now = self._clock()
        if now - self._kept_writer >= _KEEP_WRITER_EVERY:
            self.keep_writer()
        if self._publish_due and now - self._published_at >= _PUBLISH_COUNTERS_EVERY:
            self.retaking(self._publish_now)

    def _publish_now(self) -> None:
        with self._writing():
            self._publish()

    def retaking(self, write: Callable[[], None]) -> None:
        """``write()`` (the subscriber thread); where it found the claim had run out with nobody
        else holding it (:class:`~kvtier.fleet.masks.ClaimLapsed`: Redis restarted, or stalled past
        the claim's lease, since the last tick) the claim is taken again now, not at the next tick,
        and ``write()`` runs once more on the index rebuilt for it instead of being lost."""
        try:
            write()
        except ClaimLapsed:
            if not self.keep_writer():
                raise
            write()

    def keep_writer(self) -> bool:
        """Keep the writer's claim now, as :meth:`tick` does every 2 s (the subscriber thread; also
        when a write found the claim had run out: :class:`~kvtier.fleet.masks.ClaimLapsed`). True
        where it was taken again or Redis changed under it: the index under the prefix was then
        deleted and every engine treated as having lost events. Raises like :meth:`tick`."""
        self._kept_writer = self._clock()
        try:
            reclaimed = self.masks.keep_writer()
        except WriterConflict as exc:
            self.writer_lost = str(exc)
            raise
        if reclaimed:
            self._store_forgot()
        elif self.masks.evicting() != self._table.get("evicting"):  # (readers refuse to answer while it evicts)
            with self._writing():
                self._publish()
        return reclaimed

    def store_failing(self) -> str | None:
        """Why the index's store (Redis) is failing the writer, or None: the writer does not hold
        its claim on it (it ran out, or Redis changed under it, and was not yet taken again and
        the index under the prefix deleted: what is there may be older than what was written), or
        every write to it has failed for at least ``failing_writes_grace`` seconds with none going
        through since (events are lost meanwhile and engines turn partial). Any thread; never
        waits for the writer."""
        unclaimed = self.masks.claim_failure()
        if unclaimed is not None:
            return (f"the fleet writer does not hold its claim on the index's Redis ({unclaimed}): what is there "
                    "is not trusted until the claim is taken again and the index rebuilt")
        evicting = self.masks.evicting()
        if evicting is not None:
            return evicting
        failing = self.masks.write_failure()
        if failing is None:
            return None
        since, why = failing
        lasted = time.monotonic() - since
        if lasted < self.failing_writes_grace:
            return None
        return (f"the index's Redis has failed every write for {lasted:.0f} s (the last: {why}): the engines' "
                "events are not applied and they turn partial until it answers")

    def _store_forgot(self) -> None:
        with self._writing():
            for eng in self._engines.values():  # all incomplete first: the drops below may fail midway
                eng.device_complete = eng.private_complete = False
                eng.dirty = True
                eng.needs_snapshot = eng.start is not None
                eng.gaps += 1
            self._table = self._build_meta()
            self._published_shape = None  # the engine table was deleted too: written again below
            for eng in self._engines.values():
                self._drop_private(eng)
            self._publish()

    def close(self) -> None:
        """Release a shared index's writer claim (the writer is done)."""
        self.masks.close_writer()

    def _alloc(self) -> int:
        # Bits are never handed to another location: an engine's private tiers reuse its own
        # former ones (EngineState.spare), so what a reader's older engine table says a bit is
        # stays true, and an engine restarting in a loop does not use up bits.
        if self._next_bit >= self.max_locations:
            raise LocationsFull(f"all {self.max_locations} location bits are in use")
        self._next_bit += 1
        return self._next_bit - 1

    def _check_room(self, eng: EngineState, tiers: Sequence[TierInfo], switching: bool) -> None:
        """Raise :class:`LocationsFull` before anything changes if ``tiers`` need more new bits than are left."""
        private = [t for t in tiers if t.scope != SCOPE_SHARED or t.store is None]
        spare = len(eng.spare) + sum(
            1 for label, info in eng.tiers.items() if info.scope != SCOPE_SHARED and (switching or label not in
                                                                                       {t.label for t in tiers})
        )  # fmt: skip
        kept = 0 if switching else sum(1 for t in private if t.label in eng.bits)
        named = {t.store for t in tiers if t.scope == SCOPE_SHARED and t.store is not None}
        stores = named - set(self._stores)
        needed = max(0, len(private) - kept - spare) + len(stores)
        if self._next_bit + needed > self.max_locations:
            raise LocationsFull(f"engine {eng.name} names {len(private)} private tier(s) and {len(stores)} new "
                                f"store(s); {self.max_locations - self._next_bit} location bit(s) left")  # fmt: skip

    def _admitted(self, eng: EngineState, tiers: Sequence[TierInfo]) -> tuple[TierInfo, ...]:
        """``tiers`` less those naming a shared store past the engine's ``max_stores_per_engine``
        over its starts (each takes a location bit for good): such a tier is not followed (its
        events are counted as unattributed, the refusal as skipped: once per start for the first
        64 such stores, each time for any further one, which is not remembered (memory stays bounded
        whatever an engine names)); the start, the device cache and the other tiers are. A tier
        labelled ``"GPU"`` (:data:`DEVICE`, the device cache's name in answers) is not followed
        either (counted as skipped with each record naming it): its blocks must not pass for the
        device cache's. Nor is a second tier of the list naming the store an earlier one names (counted
        as skipped with each record naming it): one store is one location, whose snapshots would
        sweep each other's keys."""
        out, named, listed = [], set(eng.stores), set()
        for tier in tiers:
            if tier.label == DEVICE:  # (answers name the device cache so: such a tier would pass for it)
                eng.skipped += 1
                logger.debug("fleet: engine %s names a tier %r, the device cache's name in answers; not followed",
                             eng.name, DEVICE)  # fmt: skip
                continue
            store = tier.store if tier.scope == SCOPE_SHARED else None
            if store is not None and store in listed:
                eng.skipped += 1
                logger.debug("fleet: engine %s names store %.200s again as tier %s; not followed", eng.name, store,
                             tier.label)  # fmt: skip
                continue
            if store is not None and store not in named and len(named) >= self.max_stores_per_engine:
                if store in eng.refused:
                    continue
                eng.skipped += 1
                if len(eng.refused) >= _MAX_REFUSED:  # (a hostile engine naming ever new stores: bounded memory)
                    continue  # counted each time, never remembered nor logged
                eng.refused.add(store)  # (counted and logged once per start)
                logger.warning("fleet: engine %s names a shared store past its %d over its starts (%.200s); its tier "
                               "%s is not followed", eng.name, self.max_stores_per_engine, store,
                               tier.label)  # fmt: skip
                continue
            if store is not None:
                named.add(store)
                listed.add(store)
            out.append(tier)
        return tuple(out)

    def _private_bit(self, eng: EngineState) -> int:
        return eng.spare.pop() if eng.spare else self._alloc()

    def _store_bit(self, store: str) -> int:
        bit = self._stores.get(store)
        if bit is None:
            bit = self._stores[store] = self._alloc()
            self._times[bit] = OrderedDict()
            self._floor[bit] = -float("inf")
        return bit

    def _drop_private(self, eng: EngineState) -> None:
        """Forget the engine's device cache and private tiers (their contents are unknown now),
        and any snapshot of a shared store it was sending (it may have lost parts). The engine
        is incomplete from the first line on; if the store fails midway, the next batch retries."""
        eng.device_complete = eng.private_complete = eng.snapshot_whole = False
        eng.dirty = True
        self._table = self._build_meta()  # answers say so before the store is written (it may hang or fail)
        for sweep in [k for k in self._sweeps if k[0] == eng.name]:
            self._end_sweep(sweep)
        self.masks.clear(eng.device_bit)
        for label, info in eng.tiers.items():
            if info.scope != SCOPE_SHARED:
                self.masks.clear(eng.bits[label])
        eng.dirty = False

    def _switch_start(self, eng: EngineState, record: ControlRecord) -> None:
        eng.refused = set()
        tiers = self._admitted(eng, record.tiers)
        self._check_room(eng, tiers, switching=True)
        if eng.start is not None:
            eng.restarts += 1
            logger.info("fleet: engine %s restarted (start %s -> %s)", eng.name, eng.start, record.start)
        self._drop_private(eng)
        for label, info in eng.tiers.items():
            if info.scope != SCOPE_SHARED:
                eng.spare.append(eng.bits[label])
        eng.tiers, eng.bits = {}, {}
        if record.info:  # (an "events" record has none: the last start's is kept, block size included, until one has)
            eng.info = dict(record.info)
        eng.start = record.start
        eng.seq = record.seq - 1
        # Heard from its first record on: nothing of this start was missed.
        whole = record.op == "hello" and record.seq == 0
        eng.device_complete = eng.private_complete = whole
        eng.needs_snapshot = not whole
        self._set_tiers(eng, tiers, admitted=True)

    def _set_tiers(self, eng: EngineState, tiers: Sequence[TierInfo], admitted: bool = False) -> None:
        if not admitted:
            tiers = self._admitted(eng, tiers)
        new = {t.label: t for t in tiers}
        if new == eng.tiers:
            return
        self._check_room(eng, tiers, switching=False)
        for label, info in eng.tiers.items():  # a start's tiers never change; be safe if they do
            if new.get(label) != info and info.scope != SCOPE_SHARED:
                self.masks.clear(eng.bits[label])
                eng.spare.append(eng.bits.pop(label))
            elif new.get(label) != info:
                eng.bits.pop(label)
        for label, info in new.items():
            if label not in eng.bits:
                shared = info.scope == SCOPE_SHARED and info.store is not None
                eng.bits[label] = self._store_bit(info.store) if shared and info.store else self._private_bit(eng)
                if shared and info.store:
                    eng.stores.add(info.store)
        eng.tiers = new

    def lost_events(self, name: str, why: str) -> None:
        """The subscriber lost batches of ``name`` it could not replay (or the publisher
        restarted): drop what they could have changed and wait for a snapshot."""
        with self._writing():
            eng = self._engines[name]
            eng.gaps += 1
            logger.warning("fleet: engine %s lost events (%s); its device cache and private tiers are dropped",
                           name, why)  # fmt: skip
            eng.needs_snapshot = eng.start is not None
            self._drop_private(eng)
            self._publish()

    def publisher_restarted(self, name: str) -> None:
        """vLLM's batch sequence started over: a new process. Its first control record
        will name the new start; until then nothing of the old one is trusted."""
        with self._writing():
            eng = self._engines[name]
            self._drop_private(eng)
            self._publish()

    def engine_connected(self, name: str, connected: bool) -> None:
        """The subscriber's connection to engine ``name``'s events endpoint came up (``connected``:
        a ZMQ handshake with its publisher succeeded) or went down (the engine stopped, was killed,
        or cannot be reached: ZMQ saw the connection close). While it is down a heard engine's
        status is ``disconnected``: a router must not take its answer for what a live engine
        holds. What it held is kept (an engine cut off for a moment comes back with the same
        start, and its lost batches are replayed; one that restarted has its old start dropped
        with its first batch, :meth:`apply`). A heard engine that connects again is due a
        snapshot (:meth:`take_snapshot_wanted`): a restarted engine sends its hello at its first
        step, which ZMQ's publisher drops when it comes before the subscriber has reconnected, and
        an idle engine sends nothing more; the snapshot's batch is heard, and tells the new start
        (or, same start, what was lost meanwhile)."""
        with self._writing():
            eng = self._engines[name]
            if eng.disconnected != connected:
                return
            eng.disconnected = not connected
            if not connected:
                logger.warning("fleet: engine %s: its events endpoint disconnected (stopped, killed or unreachable); "
                               "its status is 'disconnected' until it connects again", name)  # fmt: skip
            elif eng.start is not None:
                eng.needs_snapshot = True
            self._publish()

    def take_snapshot_wanted(self, name: str) -> bool:
        """True while the engine's private tiers are incomplete, or it connected again (it may have
        restarted unheard, :meth:`engine_connected`), and a snapshot should be asked for: until one
        arrives whole (an engine may refuse an ask, one soon after another or while it
        sends one; the subscriber asks at most once per ``snapshot_retry``)."""
        with self._lock:
            eng = self._engines[name]
            return eng.needs_snapshot and eng.start is not None

    # --- events -------------------------------------------------------------------------

    def apply(self, name: str, batch: WireBatch) -> None:
        """Apply one decoded batch of engine ``name``, in order (the subscriber thread). A batch
        refused partway (:class:`LocationsFull`, :class:`~kvtier.fleet.masks.IndexFull`, a store
        error) still has the removals of its shared stores that follow applied: they need no room,
        and other engines answer from those stores."""
        with self._writing():
            eng = self._engines[name]
            eng.batches += 1
            eng.events += len(batch.events)
            eng.skipped += batch.skipped
            eng.last_event = time.time()
            if eng.dirty:
                self._drop_private(eng)
            done: list[int] = [0]
            try:
                self._apply_events(eng, batch.events, done)
            except (LocationsFull, IndexFull) as exc:
                eng.skipped += 1
                logger.warning("fleet: engine %s: %s; the rest of its batch is skipped (but for its removals from "
                               "shared stores) and the engine is partial", name, exc)  # fmt: skip
                self._drop_private(eng)
                self._shared_removals(eng, batch.events, done[0])
            except WriterConflict:
                raise
            except Exception:
                with contextlib.suppress(Exception):  # (the store failed: it may fail again; the caller is told)
                    self._shared_removals(eng, batch.events, done[0])
                raise
            self._finish_sweeps()
            self._publish()

    def _shared_removals(self, eng: EngineState, events: Sequence[WireEvent], failed: int) -> None:
        """The removals from shared stores among ``events`` from index ``failed`` on (the event a
        batch was refused at, and what follows it): applied even though the batch was not."""
        context: ControlRecord | None = None
        stores = {label: info.store for label, info in eng.tiers.items() if info.scope == SCOPE_SHARED}
        for at, event in enumerate(events):
            if event.control is not None:
                context = event.control
                if event.control.tiers:  # (the tiers it names, refused or not: stores are named by id)
                    stores = {t.label: t.store for t in event.control.tiers if t.scope == SCOPE_SHARED}
            elif at >= failed and event.kind is Kind.REMOVED and event.medium in _KVTIER_MEDIA and context:
                store = stores.get(event.ownership) if event.ownership is not None else None
                bit = self._stores.get(store) if store is not None else None
                if bit is not None:
                    self._store_event(bit, event.keys, True, self._event_time(context))

    def _apply_events(self, eng: EngineState, events: Sequence[WireEvent], done: list[int]) -> None:
        """Apply ``events``; ``done[0]`` is kept at the index of the event being applied."""
        first = next((e.control for e in events if e.control is not None), None)
        if first is not None and first.start != eng.start:
            self._switch_start(eng, first)
        context: ControlRecord | None = None
        for done[0], event in enumerate(events):
            if event.control is not None:
                self._finish_sweeps()
                self._control(eng, event.control)
                context = event.control
            elif event.kind is Kind.CLEARED:
                self.masks.clear(eng.device_bit)
                eng.device_complete = eng.start is not None
            elif event.medium is None or event.medium == DEVICE:  # (None: vLLM before media)
                self._block_event(eng.device_bit, event)
            elif event.medium not in _KVTIER_MEDIA:  # another connector's ("cpu", "LocalDiskBackend"...)
                eng.skipped += 1
            elif context is None:
                eng.unattributed += 1
            else:
                self._tier_event(eng, event, context)

    def _control(self, eng: EngineState, record: ControlRecord) -> None:
        if record.start != eng.start:
            self._switch_start(eng, record)
        elif eng.seq is not None and record.seq != eng.seq + 1:
            eng.gaps += 1
            logger.warning("fleet: engine %s control records jumped from seq %d to %d; its device cache and "
                           "private tiers are dropped", eng.name, eng.seq, record.seq)  # fmt: skip
            self._drop_private(eng)
            eng.needs_snapshot = True
        eng.seq = record.seq
        if record.tiers:  # "events" records leave them out
            eng.info = dict(record.info)
            self._set_tiers(eng, record.tiers)
        tier = eng.tiers.get(record.tier) if record.tier is not None else None
        if record.op == "clear" and tier is not None and tier.scope != SCOPE_SHARED:
            self.masks.clear(eng.bits[tier.label])
        elif record.op == "snapshot" and tier is not None and tier.scope != SCOPE_SHARED:
            if record.part == 0:
                self.masks.clear(eng.bits[tier.label])
                if tier.label == PRIMARY_LABEL:
                    eng.snapshot_whole = True
            if record.last and tier.label == PRIMARY_LABEL:
                # Complete only if every part since part 0 arrived (a gap meanwhile dropped the tier).
                if eng.snapshot_whole and record.reason != "start":
                    eng.private_complete = True
                    eng.needs_snapshot = False
                eng.snapshot_whole = False
        elif record.op == "snapshot" and tier is not None:
            sweep = (eng.name, tier.label)
            if record.part == 0:
                self._end_sweep(sweep)
                if record.complete:
                    self._sweeps[sweep] = (self._event_time(record), set())
            if record.last and sweep in self._sweeps:
                self._sweeps_due.append(sweep)  # after the stored events that follow this record
        elif record.op == "mark" and record.marker is not None:
            eng.marks.append(record.marker)

    def _tier_event(self, eng: EngineState, event: WireEvent, context: ControlRecord) -> None:
        label = event.ownership if event.ownership is not None else (PRIMARY_LABEL if event.medium == "CPU" else None)
        tier = eng.tiers.get(label) if label is not None else None
        if tier is None:
            eng.unattributed += 1
            return
        bit = eng.bits[tier.label]
        if tier.scope != SCOPE_SHARED:
            self._block_event(bit, event)
            return
        snapshot = context.op == "snapshot" and context.tier == tier.label
        sweep = (eng.name, tier.label)
        if snapshot and event.kind is Kind.STORED and sweep in self._sweeps:
            listed = self._sweeps[sweep][1]
            # Held until the last part, applied or not: every sweep in flight shares one budget, so
            # an engine naming one store under many labels (or many engines at once) holds no more.
            if self._listed_held + len(event.keys) > self._max_listed:
                self._end_sweep(sweep)
                raise IndexFull(f"a complete snapshot of {tier.label} would take the keys listed by the complete "
                                f"snapshots in flight past {self._max_listed}; its sweep is given up")  # fmt: skip
            before = len(listed)
            listed.update(event.keys)
            self._listed_held += len(listed) - before
        # What a snapshot lists may lag the store by an engine's view of other engines' changes.
        when = self._event_time(context) - (self.lag_seconds if snapshot else 0.0)
        keys: Sequence[int] = event.keys
        if snapshot and not context.complete and event.kind is Kind.STORED:
            # What a tier knows, learned at any time within its memory (an S3 tier's existence
            # index: up to hit_seconds old), only fills gaps: a key with a change on record keeps it.
            times = self._times[bit]
            keys = [key for key in keys if key not in times]
        self._store_event(bit, keys, event.kind is Kind.REMOVED, when)

    def _block_event(self, bit: int, event: WireEvent) -> None:
        if event.kind is Kind.REMOVED:
            self.masks.remove(bit, event.keys)
        else:
            self.masks.add(bit, event.keys)

    def _event_time(self, record: ControlRecord) -> float:
        """When what follows ``record`` happened: its time, but never later than now here (an
        engine whose clock runs ahead must not outrank every other engine)."""
        return min(record.time, self._wall())

    def _store_event(self, bit: int, keys: Sequence[int], removed: bool, when: float) -> None:
        """Apply a change to a shared store's keys unless a later change of the same key was
        applied already (engines' streams interleave in any order, and a replay brings changes of
        minutes ago: the latest change wins). The times of at most ``max_times`` keys over all
        stores are kept, whatever their age; past that the least recently changed are forgotten, and a
        change of a forgotten key no newer than the newest forgotten time may be older than what
        was forgotten: a removal is applied (the index under-claims at worst), a store is not."""
        times = self._times[bit]
        floor = self._floor[bit]
        apply = []
        for key in keys:
            last = times.get(key)
            if last is not None and last > when:
                continue
            if last is None and when <= floor and not removed:
                continue
            apply.append(key)
            if last is not None:
                del times[key]
            else:
                self._times_held += 1
            times[key] = when
        if apply:
            if removed:
                self.masks.remove(bit, apply)
            else:
                self.masks.add(bit, apply)
        if self._times_held > self.max_times:
            self._forget_times(bit, self._times_held - self.max_times)

    def _forget_times(self, bit: int, excess: int) -> None:
        """Forget the ``excess`` least recently changed times, this store's first (what one engine
        floods a store with costs that store's times, not others')."""
        others = sorted((b for b in self._times if b != bit), key=lambda b: len(self._times[b]), reverse=True)
        for victim in [bit, *others]:
            times, floor = self._times[victim], self._floor[victim]
            while excess > 0 and times:
                floor = max(floor, times.popitem(last=False)[1])
                excess -= 1
                self._times_held -= 1
            self._floor[victim] = floor
            if excess <= 0:
                return

    def _end_sweep(self, sweep: tuple[str, str]) -> tuple[float, set[int]] | None:
        """Forget the sweep ``sweep`` (engine, tier label), if any: what it listed leaves the budget."""
        taken_keys = self._sweeps.pop(sweep, None)
        if taken_keys is not None:
            self._listed_held -= len(taken_keys[1])
        return taken_keys

    def _finish_sweeps(self) -> None:
        """Complete snapshots of shared stores: drop what the store was believed to hold beyond
        what the snapshot listed, unless changed since shortly before the snapshot was taken."""
        while self._sweeps_due:
            name, label = self._sweeps_due.pop()
            taken_keys = self._end_sweep((name, label))
            eng = self._engines[name]
            if taken_keys is None or label not in eng.bits:
                continue
            taken, listed = taken_keys
            bit = eng.bits[label]
            stale = list(self.masks.members(bit) - listed)
            if stale:
                before = len(self.masks.members(bit))
                self._store_event(bit, stale, True, taken - self.lag_seconds)
                dropped = before - len(self.masks.members(bit))
                if dropped:
                    logger.info("fleet: engine %s's snapshot of %s dropped %d stale key(s)", name, label, dropped)

    # --- answers ----------------------------------------------------------------------

    def _publish(self) -> None:
        """Write the engine table to the masks' store (Redis: for readers) when what a reader
        needs to read masks changed (engines, starts, statuses, tiers, bits, stores); a change
        of counters alone is written at most every ``_PUBLISH_COUNTERS_EVERY`` seconds (by
        :meth:`tick`), not with every batch."""
        meta = self._table = self._build_meta()
        shape: dict[str, Any] = {name: {k: v for k, v in eng.items() if k not in _COUNTERS}
                                 for name, eng in meta["engines"].items()}  # fmt: skip
        shape["\0stores"] = meta["stores"]
        shape["\0evicting"] = meta.get("evicting")
        now = self._clock()
        if shape == self._published_shape and now - self._published_at < _PUBLISH_COUNTERS_EVERY:
            self._publish_due = True
            return
        try:
            self.masks.put_meta(meta)
        except BaseException:  # written again by the next tick (a dead engine's status has no next batch)
            self._published_shape, self._publish_due = None, True
            raise
        self._published_shape, self._published_at, self._publish_due = shape, now, False

    def meta(self) -> dict[str, Any]:
        """The engine and location table (JSON-able): what a reader needs to read masks. Answers
        take the copy the writer keeps after each change (never its lock: the writer holds it
        across its store's writes, which a hung Redis makes last seconds); raises
        :class:`~kvtier.fleet.masks.StoreUnavailable` once another writer took the prefix over
        (this writer's table no longer describes what is there), and while its store may evict the
        index's keys (:meth:`~kvtier.fleet.masks.LocationMasks.evicting`: what is there may claim
        blocks engines dropped)."""
        if self.writer_lost is not None:
            raise StoreUnavailable(f"this fleet writer no longer answers: {self.writer_lost}")
        evicting = self.masks.evicting()
        if evicting is not None:
            raise StoreUnavailable(evicting)
        return self._table

    def _build_meta(self) -> dict[str, Any]:
        with self._lock:
            return {
                "version": TABLE_VERSION,
                "engines": {
                    eng.name: {
                        "start": eng.start, "seq": eng.seq, "status": eng.status,
                        "device_complete": eng.device_complete, "private_complete": eng.private_complete,
                        "device_bit": eng.device_bit, "info": eng.info,
                        "tiers": [dict(t.as_dict(), bit=eng.bits[t.label]) for t in eng.tiers.values()],
                        "batches": eng.batches, "events": eng.events, "skipped": eng.skipped,
                        "unattributed": eng.unattributed, "gaps": eng.gaps, "restarts": eng.restarts,
                        "last_event": eng.last_event, "marks": list(eng.marks),
                    }
                    for eng in self._engines.values()
                },
                "stores": dict(self._stores),
            } | ({} if (evicting := self.masks.evicting()) is None else {"evicting": evicting})  # fmt: skip

    def prefix(self, keys: Sequence[int], engines: Sequence[str] | None = None) -> dict[str, Any]:
        """The longest cached prefix of ``keys`` per engine and tier (see :func:`longest_prefix`);
        reads the keys' bitmaps only as far as some engine's prefix still reaches. The index's
        lock is not held while they are read (a slow Redis must not stall the writer)."""
        return prefix_answer(self.meta(), self.masks, keys, engines, first_window=64)

    def held(self, name: str, label: str) -> set[int]:
        """The keys the index says engine ``name`` holds in tier ``label`` (or ``"GPU"``)."""
        with self._lock:
            eng = self._engines[name]
            bit = eng.device_bit if label == DEVICE else eng.bits.get(label)
            return set() if bit is None else self.masks.members(bit)


class FleetReader:
    """Answers from an index another process writes (:class:`~kvtier.fleet.masks.RedisMasks`):
    for routers sharing one index. The engine table is re-read at most every ``meta_ttl``
    seconds, with a check that a writer still holds its claim on the index (else every answer
    raises :class:`~kvtier.fleet.masks.StoreUnavailable`: an index nobody keeps is frozen while
    the engines evict and restart); an answer reads the prompt's key bitmaps ``first_window`` at
    a time (one round trip each, doubling), until no engine's prefix reaches further."""

    def __init__(
        self,
        masks: LocationMasks,
        meta_ttl: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        first_window: int = 512,
    ) -> None:
        self.masks = masks
        self.meta_ttl = meta_ttl
        self.first_window = first_window
        self._clock = clock
        self._lock = threading.Lock()
        self._meta: dict[str, Any] = {}
        self._read_at = -float("inf")
        self._refreshing = False
        self._failure: str | None = None  # why the last read of the engine table failed; None: it did not

    def meta(self) -> dict[str, Any]:
        """The engine table, re-read at most every ``meta_ttl`` seconds. No lock is held while
        Redis is read: while one thread re-reads it the others answer from the table read before
        (a hung Redis holds each caller for its own timeout, not for everyone's in turn). Raises
        :class:`~kvtier.fleet.masks.StoreUnavailable` if Redis does not answer, or no writer holds
        its claim on the index (:meth:`~kvtier.fleet.masks.LocationMasks.writer_missing`): a failed
        read's outcome is kept ``meta_ttl`` seconds too, and every caller meanwhile raises it."""
        now = self._clock()
        with self._lock:
            have = self._read_at > -float("inf")
            if now - self._read_at < self.meta_ttl or (self._refreshing and have):
                if self._failure is not None:  # (the last read's outcome, for everyone: review, 2026-12-05)
                    raise StoreUnavailable(self._failure)
                return self._meta
            self._refreshing = True
        try:
            meta = checked_meta(self.masks.get_meta(), strict=True)
            missing = self.masks.writer_missing()
            if missing is not None:  # (what is there is frozen: engines evict, restart, go away unseen)
                raise StoreUnavailable(missing)
        except StoreUnavailable as exc:
            with self._lock:  # (kept for meta_ttl as a table read is: a failing Redis is not asked on every request)
                self._failure, self._read_at = str(exc), now
            raise
        finally:
            with self._lock:
                self._refreshing = False
        with self._lock:
            self._meta, self._read_at, self._failure = meta, now, None
        return meta

    def store_failing(self) -> str | None:
        """Why this reader cannot answer (its Redis did not answer the last read of the engine
        table, or no writer keeps the index), or None: for ``GET /health``. Reads the table as
        :meth:`meta` does (at most every ``meta_ttl`` seconds, one thread at a time; the others
        take the last read's outcome), so a probe may wait up to the client's socket timeout for
        a hung Redis. Any thread."""
        try:
            self.meta()
        except StoreUnavailable as exc:
            return str(exc)
        return self._failure

    def prefix(self, keys: Sequence[int], engines: Sequence[str] | None = None) -> dict[str, Any]:
        return prefix_answer(self.meta(), self.masks, keys, engines, first_window=self.first_window)


def prefix_answer(
    meta: dict[str, Any],
    masks: LocationMasks,
    keys: Sequence[int],
    engines: Sequence[str] | None = None,
    first_window: int = 64,
) -> dict[str, Any]:
    """:func:`longest_prefix` of ``keys``, reading their bitmaps only as far as some engine's
    prefix reaches (in windows of ``first_window`` keys, doubling): the cost follows the longest
    cached prefix, not the prompt."""
    return _walk(meta, lambda start, count, bits: masks.masks(keys[start : start + count], bits), len(keys),
                 engines, first_window)  # fmt: skip


def longest_prefix(meta: dict[str, Any], masks: Sequence[int], engines: Sequence[str] | None = None) -> dict[str, Any]:
    """For the blocks whose location bitmasks are ``masks`` (a prompt's keys in order), per
    engine of ``meta`` (or of ``engines``): the leading blocks held by its device cache, by
    each of its tiers (whole chunks of ``blocks_per_chunk``, keyed by their last block), and by
    any of them (``blocks``: each block in the device cache, or its chunk in a tier). One pass
    that stops where the last of these prefixes ends."""
    return _walk(meta, lambda start, count, bits: masks[start : start + count], len(masks), engines, len(masks))


def checked_meta(meta: Any, strict: bool = False) -> dict[str, Any]:
    """An engine table read from a shared store, with every engine whose entry is not what an
    index writes left out (a reader must not trust a store others may write): bits are
    integers below :data:`~kvtier.fleet.masks.MAX_LOCATIONS`, labels strings, none of them the
    device cache's name in answers (``"GPU"``) nor twice in an engine, info an object of scalars
    (:func:`~kvtier.engine_events.is_info_value`). With ``strict``, a table that is not empty but
    not of :data:`TABLE_VERSION` (another kvtier's layout, or not an index's table) raises
    :class:`~kvtier.fleet.masks.StoreUnavailable` naming it: its bits need not mean what this
    reader would read them as, so answering from it could claim blocks no engine holds."""
    if strict and isinstance(meta, dict) and meta and meta.get("version") != TABLE_VERSION:
        raise StoreUnavailable(f"the engine table in the index's store is not one this kvtier reads (version "
                               f"{meta.get('version')!r:.40}, this kvtier reads version {TABLE_VERSION}): run readers "
                               "and the writer of one kvtier version, each index under its own prefix")  # fmt: skip
    if strict and isinstance(meta, dict) and isinstance(meta.get("evicting"), str):
        raise StoreUnavailable(f"the fleet writer reports that {meta['evicting']:.400}")
    if not isinstance(meta, dict) or not isinstance(meta.get("engines"), dict):
        return {}
    engines, malformed = {}, []
    for name, engine in meta["engines"].items():
        if _engine_entry_ok(engine):
            engines[name] = engine
        else:
            malformed.append(name)
    if malformed:  # (one line per read, however many: a table of a million bad entries must not flood the log)
        names = ", ".join(f"{name!r:.80}" for name in malformed[:8]) + (" ..." if len(malformed) > 8 else "")
        logger.warning("fleet: %d engine entry(ies) of the shared engine table malformed, left out: %s",
                       len(malformed), names)  # fmt: skip
    return dict(meta, engines=engines)


def _is_bit(value: Any) -> bool:
    return type(value) is int and 0 <= value < MAX_LOCATIONS


def _engine_entry_ok(engine: Any) -> bool:
    if not isinstance(engine, dict) or not _is_bit(engine.get("device_bit")):
        return False
    info = engine.get("info", {})
    if not isinstance(info, dict) or not all(is_info_value(v) for v in info.values()):
        return False
    tiers = engine.get("tiers", [])
    if not isinstance(tiers, list):
        return False
    if not all(isinstance(t, dict) and _is_bit(t.get("bit")) and isinstance(t.get("label"), str) for t in tiers):
        return False
    labels = [t["label"] for t in tiers]  # (answers name tiers by label and the device cache "GPU")
    return DEVICE not in labels and len(set(labels)) == len(labels)


def _chunk(engine: dict[str, Any]) -> int:
    value = engine.get("info", {}).get("blocks_per_chunk", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


class _Walk:
    """One engine's prefixes as the blocks go by (see :func:`_walk`)."""

    __slots__ = ("any_alive", "any_blocks", "any_flag", "chunk", "device", "device_alive", "device_blocks",
                 "labels", "lead", "tier_alive", "tier_blocks", "tier_flags", "tiers_alive")  # fmt: skip

    def __init__(self, engine: dict[str, Any]) -> None:
        self.chunk = _chunk(engine)
        self.device = 1 << engine["device_bit"]
        tiers = list(engine.get("tiers", ()))
        self.labels = [t["label"] for t in tiers]
        self.tier_flags = [1 << t["bit"] for t in tiers]
        self.any_flag = 0
        for flag in self.tier_flags:
            self.any_flag |= flag
        self.tier_blocks = [0] * len(tiers)
        self.tier_alive = [True] * len(tiers)
        self.tiers_alive = len(tiers)
        self.device_blocks = 0
        self.device_alive = True
        self.any_blocks = 0
        self.any_alive = True
        self.lead = 0  # leading blocks of the current chunk in the device cache

    def see(self, i: int, mask: int) -> bool:
        """Block ``i`` has ``mask``; False once every prefix of this engine has ended."""
        in_device = mask & self.device
        if self.device_alive:
            if in_device:
                self.device_blocks = i + 1
            else:
                self.device_alive = False
        chunk = self.chunk
        offset = i % chunk
        if self.any_alive and in_device and self.lead == offset:
            self.lead = offset + 1
        if offset == chunk - 1:
            if self.tiers_alive:
                for t, flag in enumerate(self.tier_flags):
                    if self.tier_alive[t]:
                        if mask & flag:
                            self.tier_blocks[t] = i + 1
                        else:
                            self.tier_alive[t] = False
                            self.tiers_alive -= 1
            if self.any_alive:
                if mask & self.any_flag or self.lead == chunk:
                    self.any_blocks = i + 1
                else:
                    self.any_blocks = i + 1 - chunk + self.lead
                    self.any_alive = False
                self.lead = 0
        return self.device_alive or self.any_alive or self.tiers_alive > 0

    def end(self, n: int) -> None:
        """The prompt ended at ``n`` blocks: a last, partial chunk counts by its device blocks."""
        if self.any_alive and n % self.chunk:
            self.any_blocks = n - n % self.chunk + self.lead


def _walk(
    meta: dict[str, Any],
    fetch: Callable[[int, int, int], Sequence[int]],
    n: int,
    engines: Sequence[str] | None,
    window: int,
) -> dict[str, Any]:
    known = meta.get("engines", {})
    names = list(known) if engines is None else [e for e in engines if e in known]
    walks = {name: _Walk(known[name]) for name in names}
    live = list(walks.values())
    bits = max((w.any_flag | w.device).bit_length() for w in live) if live else 1
    read: list[int] = []
    window = max(1, window)
    i = 0
    while live and i < n:
        if i == len(read):
            read.extend(fetch(i, window, bits))
            window *= 2
        mask = read[i]
        ended = False
        for w in live:
            if not w.see(i, mask):
                ended = True
        if ended:
            live = [w for w in live if w.device_alive or w.any_alive or w.tiers_alive]
        i += 1
    for w in live:
        w.end(n)
    out: dict[str, Any] = {}
    for name, w in walks.items():
        tiers = {DEVICE: w.device_blocks}
        tiers.update(zip(w.labels, w.tier_blocks, strict=True))
        engine = known[name]
        out[name] = {"blocks": w.any_blocks, "tiers": tiers, "status": engine.get("status"),
                     "start": engine.get("start")}  # fmt: skip
    return out
