"""Every wait has an end: how long a lookup may keep a request waiting on a block, and what a
tier may not promise after it failed one.

A request waits while :meth:`~kvtier.manager.TieringManager.lookup` answers RETRY or
HIT_PENDING for one of its blocks: it asks again next step. The manager keeps one clock
per block (:class:`BlockWaits`), whatever the tiers involved: a wait starts at the first
RETRY or HIT_PENDING answered for the block and goes on while lookups keep answering so
(with less than ``failed_load_seconds`` or ``wait_timeout``, the longer, between two of them:
not ``wait_timeout`` alone, or an engine whose steps are further apart than a short
``wait_timeout`` would start a new wait at every lookup and wait forever); ``wait_timeout``
after it started the lookup answers MISS and the engine recomputes the block. Then:

* **RETRY** (a secondary tier's existence check under way): the tiers that answered
  RETRY are not asked about the block for ``failed_load_seconds`` (every request waiting
  on it sees MISS at its next lookup; later ones start a new wait afterwards);
* **HIT_PENDING on a promotion** (tier -> CPU load), or on a **device store** (device ->
  CPU, the engine's own copy): every lookup answers MISS for the block until the write
  ends. The CPU row stays reserved for it: the tier (or the engine's worker) may still be
  writing it.

A wait goes on through a failed promotion (the block's next RETRY or promotion, from
another tier, continues it), and ends when the block becomes readable. So no request
waits on one block longer than ``wait_timeout`` in all.

**Failed promises.** A tier whose promise for a block failed (its load job failed or was
refused, or its RETRY outlived the deadline) is not believed about that block for
``failed_load_seconds``: its HIT and RETRY answers count as MISS (:meth:`TierWaits.withholds`).
The manager keeps this per tier, bounded, so it holds for every tier, in-tree or not,
whether or not the tier re-verifies the block itself; afterwards the tier's answer is
trusted again (for the built-in tiers it then reflects what they re-verified: fs
forgets corrupt, vanished and unsafe files; redis and s3 remember a missing or corrupt
value as absent and check again with STRLEN / HEAD once that answer expires).

Tier jobs past ``wait_timeout`` (:mod:`kvtier.manager.ledger`), parked request-level
cascades (:mod:`kvtier.manager.requests`) and the blocking calls of ``reset_cache`` and
``shutdown`` (:mod:`kvtier.manager.blocking`) have their own ends.

Counted per tier (``TierSnapshot.failures``): ``retry_expired``, ``load_expired``,
``store_expired`` (the CPU tier: device stores) and ``withheld`` (answers not believed).
Scheduler thread only; nothing here blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from time import perf_counter

from kvtier.keys import BlockKey
from kvtier.telemetry import TierTelemetry
from kvtier.types import LookupResult

DEFAULT_WAIT_TIMEOUT = 10.0
"""Seconds a request may wait on one block (RETRY, HIT_PENDING) before its lookup answers MISS."""

DEFAULT_FAILED_LOAD_SECONDS = 30.0
"""Seconds a tier is not believed about a block after its promise for it failed."""

WAIT_TIMEOUT_RANGE = (0.001, 3600.0)
"""The ``wait_timeout`` accepted: a millisecond to an hour."""

FAILED_LOAD_SECONDS_RANGE = (1.0, 86400.0)
"""The ``failed_load_seconds`` accepted: a second (more than an engine step, so a request that
waited on a failed load sees MISS at its next lookup) to a day."""

MAX_KEYS = 65536
"""Blocks per tier remembered in each of its RETRY clocks and failed promises; beyond it the
oldest are forgotten (the memory stays bounded whatever keys a tier answers for)."""


def _remember(table: dict[BlockKey, float], key: BlockKey, value: float) -> None:
    """``table[key] = value`` as the newest entry, forgetting the oldest beyond :data:`MAX_KEYS`."""
    table.pop(key, None)
    if len(table) >= MAX_KEYS:
        del table[next(iter(table))]
    table[key] = value


class TierWaits:
    """One secondary tier's part, held by its ``TierHandle``: when it first answered RETRY for
    each block (to time its answer after), and the blocks it may not promise for now."""

    __slots__ = ("_hold", "_telemetry", "retry_since", "withheld")

    def __init__(self, hold: float, telemetry: TierTelemetry) -> None:
        self._hold = hold
        self._telemetry = telemetry
        self.retry_since: dict[BlockKey, float] = {}
        """When this tier first answered RETRY for each block it has not answered since."""
        self.withheld: dict[BlockKey, float] = {}
        """Blocks this tier may not promise, and until when (oldest first)."""

    def retried(self, key: BlockKey, now: float) -> None:
        """The tier answered RETRY for ``key`` at ``now`` (the first RETRY starts its clock)."""
        if key not in self.retry_since:
            _remember(self.retry_since, key, now)

    def answered(self, key: BlockKey, now: float) -> None:
        """The tier answered HIT or MISS for ``key``: the RETRY wait before it, if any, is timed
        (``lookup_async_seconds``)."""
        start = self.retry_since.pop(key, None)
        if start is not None:
            self._telemetry.lookup_async_seconds.observe(now - start)

    def withhold(self, key: BlockKey, now: float) -> None:
        """Believe no HIT or RETRY of the tier for ``key`` for ``failed_load_seconds``."""
        _remember(self.withheld, key, now + self._hold)

    def withholds(self, key: BlockKey, now: float) -> bool:
        """True (counted ``withheld``) while the tier's answer for ``key`` is not believed."""
        until = self.withheld.get(key)
        if until is None:
            return False
        if now < until:
            self._telemetry.fail("withheld")
            return True
        del self.withheld[key]
        return False

    def gave_up(self, key: BlockKey, now: float) -> None:
        """The block's wait passed the deadline while this tier answered RETRY for it."""
        if self.retry_since.pop(key, None) is not None:
            self._telemetry.fail("retry_expired")
            self.withhold(key, now)


class BlockWaits:
    """The manager's clock of every block a lookup keeps a request waiting on, and the writes
    into the CPU tier given up; see the module docstring."""

    __slots__ = ("_cpu", "_gap", "_hold", "_next_prune", "_tiers", "_timeout", "abandoned", "since", "started",
                 "writer")  # fmt: skip

    def __init__(self, timeout: float, hold: float, cpu: TierTelemetry, rows: int) -> None:
        self._timeout = timeout
        self._gap = max(timeout, hold)  # no lookup for this long: the wait's requests stopped asking
        self._hold = hold
        self._cpu = cpu
        self._tiers: list[TierWaits] = []
        self._next_prune = 0.0
        self.since: dict[BlockKey, list[float]] = {}
        """The waits under way outside a promotion: ``[started, last answered]`` per block."""
        self.started = [0.0] * rows
        """Per CPU row: when the wait on the promotion into it began (0.0: no promotion). The
        promotion path stores one float: no allocation, no hashing."""
        self.abandoned: set[BlockKey] = set()
        """Writes in flight waited on past the deadline: lookups answer MISS until they end."""
        self.writer: Callable[[int], TierTelemetry | None] = lambda slot: None
        """The telemetry of the tier promoting into a row (the ledger's; for counting only)."""

    def for_tier(self, telemetry: TierTelemetry) -> TierWaits:
        """A secondary tier's part (kept here too: a RETRY past the deadline withholds the block
        from every tier that answered RETRY for it)."""
        tier = TierWaits(self._hold, telemetry)
        self._tiers.append(tier)
        return tier

    def _within(self, key: BlockKey, now: float) -> bool:
        """Count one more RETRY or HIT_PENDING answer for ``key`` at ``now``: True while its wait
        is within the deadline. A wait whose last answer is older than ``failed_load_seconds`` and
        ``wait_timeout`` is over (its requests stopped asking): a new one starts."""
        since = self.since
        gap = self._gap
        if now >= self._next_prune:
            self._next_prune = now + gap
            for old in [k for k, (_, last) in since.items() if now - last > gap]:
                del since[old]
        clock = since.get(key)
        if clock is None or now - clock[1] > gap:
            if len(since) >= MAX_KEYS:
                del since[next(iter(since))]
            since[key] = [now, now]
            return True
        clock[1] = now
        if now - clock[0] <= self._timeout:
            return True
        del since[key]
        return False

    def missed(self, key: BlockKey) -> LookupResult:
        """A lookup answers MISS for ``key`` (absent, or no row for it): its wait, if any, is over,
        and a later RETRY or HIT_PENDING starts a new one. Returns MISS."""
        if self.since:
            self.since.pop(key, None)
        return LookupResult.MISS

    def retrying(self, key: BlockKey) -> bool:
        """The lookup of ``key`` is about to answer RETRY: False (MISS) once the block's wait is
        past the deadline (then the tiers that answered RETRY withhold it: ``retry_expired``)."""
        now = perf_counter()
        if self._within(key, now):
            return True
        for tier in self._tiers:
            tier.gave_up(key, now)
        return False

    def promoting(self, key: BlockKey) -> bool:
        """A lookup is about to start a promotion of ``key``, which continues the block's wait
        (its RETRYs or a failed promotion, see :meth:`Ledger.queue_promotion`): False (MISS) if
        that wait is already past the deadline, which ends it."""
        clock = self.since.get(key)
        if clock is None:
            return True
        now = perf_counter()
        if now - clock[1] > self._gap or now - clock[0] <= self._timeout:
            return True
        del self.since[key]
        return False

    def pending(self, key: BlockKey, slot: int, now: float) -> bool:
        """A lookup found ``key`` being written into CPU row ``slot``: True to answer HIT_PENDING,
        False (MISS) once the wait is past the deadline; then every lookup answers MISS until
        the write ends (counted once: ``load_expired`` on the promoting tier, or
        ``store_expired`` on the CPU tier for a device store)."""
        if key in self.abandoned:
            return False
        now = now or perf_counter()
        start = self.started[slot]
        if (now - start <= self._timeout) if start else self._within(key, now):
            return True
        self.abandoned.add(key)
        telemetry = self.writer(slot) if start else None
        (telemetry or self._cpu).fail("load_expired" if start else "store_expired")
        return False

    def stored(self, keys: Iterable[BlockKey], success: bool) -> None:
        """Device stores of ``keys`` completed (``success``: the waits on them are over) or failed
        (a wait goes on if the block's next answer is a RETRY or a promotion). The caller skips
        the call while no one waits (``since`` and ``abandoned`` empty)."""
        for key in keys:
            if success:
                self.since.pop(key, None)
            self.abandoned.discard(key)

    def loaded(self, keys: Sequence[BlockKey], slots: Sequence[int], failed: Collection[BlockKey] = ()) -> None:
        """Promotions of ``keys`` into rows ``slots`` ended: loaded (the waits are over), or
        ``failed`` (the wait goes on if the block's next answer is a RETRY or a promotion from
        another tier: within the deadline it continues, it does not start again)."""
        started, abandoned, since = self.started, self.abandoned, self.since
        if not (failed or abandoned or since):  # the usual case: loaded, no one waited past a deadline
            for slot in slots:
                started[slot] = 0.0
            return
        now = perf_counter() if failed else 0.0
        for key, slot in zip(keys, slots, strict=True):
            if abandoned:
                abandoned.discard(key)
            if key in failed:
                if started[slot]:
                    since[key] = [started[slot], now]
            elif since:
                since.pop(key, None)
            started[slot] = 0.0

    def clear(self) -> None:
        """The CPU tier was reset: no write is in flight, and no one waits."""
        self.since.clear()
        self.abandoned.clear()
        self.started[:] = [0.0] * len(self.started)


__all__ = [
    "DEFAULT_FAILED_LOAD_SECONDS", "DEFAULT_WAIT_TIMEOUT", "FAILED_LOAD_SECONDS_RANGE", "MAX_KEYS",
    "WAIT_TIMEOUT_RANGE", "BlockWaits", "TierWaits",
]
