"""Every wait has an end: how long a lookup may keep a request waiting on a block, what a tier
may not promise after it failed one, and blocking tier calls abandoned at a deadline.

A request waits while :meth:`~kvtier.manager.TieringManager.lookup` answers RETRY or
HIT_PENDING for one of its blocks (it asks again next step). Each such wait has a
clock, and ``wait_timeout`` seconds after it started the lookup answers MISS (the
engine recomputes the block):

* **RETRY from a secondary tier** (an existence check under way): from that tier's
  first RETRY for the block (:meth:`TierWaits.retried`). Past the deadline the tier
  is not asked about the block for ``failed_load_seconds``.
* **HIT_PENDING on a promotion** (a tier -> CPU load): from the tier's first RETRY for
  the block if it answered RETRY before its HIT, else from the lookup that started the
  promotion (:meth:`WriteWaits.promoting`). Past the deadline every lookup answers
  MISS for the block until its load job is reported; the CPU row stays reserved for
  the job, since the tier may still be writing it.
* **HIT_PENDING on a device store** (device -> CPU, the engine's own copy): from the
  first lookup that answered HIT_PENDING for it; then as for a promotion, until the
  engine completes the store.

The clock is the block's, not the tier's: a promotion that fails passes its start on
(:meth:`WriteWaits.ended`), and the next RETRY or promotion of the block from another
tier, within ``wait_timeout``, continues it. So a request never waits on one block
longer than ``wait_timeout`` across tiers.

**Failed promises.** A tier whose promise for a block failed (its load job failed or was
refused, or its RETRY outlived the deadline) is not believed about that block for
``failed_load_seconds``: its HIT and RETRY answers count as MISS (:meth:`TierWaits.withholds`).
The manager keeps this per tier, bounded, so it holds for every tier, in-tree or not,
whether or not the tier re-verifies the block itself; afterwards the tier's answer is
trusted again (for the built-in tiers it then reflects what they re-verified: fs
forgets corrupt, vanished and unsafe files; redis and s3 remember a missing or corrupt
value as absent and check again with EXISTS / HEAD once that answer expires).

The other waits (``reset_cache``'s drain, ``shutdown``) are bounded by their own timeouts
(:mod:`kvtier.manager.blocking`).

Counted per tier (``TierSnapshot.failures``): ``retry_expired``, ``load_expired``,
``store_expired`` (the CPU tier: device stores) and ``withheld`` (answers not believed).
Scheduler thread only; nothing here blocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from time import perf_counter
from typing import Any

from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.telemetry import TierTelemetry

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


def check_seconds(name: str, value: Any, bounds: tuple[float, float]) -> float:
    """``value`` as a finite number of seconds within ``bounds``; ConfigError naming ``name`` otherwise."""
    low, high = bounds
    fix = f"give a number of seconds from {low:g} to {high:g}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number of seconds, got {type(value).__name__} {value!r:.60}: {fix}")
    if isinstance(value, int) and not low <= value <= high:  # also a 400-digit int, before float() overflows
        raise ConfigError(f"{name}={str(value)[:24]} is out of range: {fix}")
    seconds = float(value)
    if not (math.isfinite(seconds) and low <= seconds <= high):
        raise ConfigError(f"{name}={value!r} is out of range: {fix}")
    return seconds


def _remember(table: dict[BlockKey, float], key: BlockKey, value: float) -> None:
    """``table[key] = value`` as the newest entry, forgetting the oldest beyond :data:`MAX_KEYS`."""
    table.pop(key, None)
    if len(table) >= MAX_KEYS:
        del table[next(iter(table))]
    table[key] = value


class TierWaits:
    """One secondary tier's wait state, held by its ``TierHandle``: when it first answered
    RETRY for each block, and the blocks it may not promise for now (see the module docstring)."""

    __slots__ = ("_carried", "_hold", "_telemetry", "_timeout", "retry_since", "withheld")

    def __init__(self, timeout: float, hold: float, telemetry: TierTelemetry,
                 carried: dict[BlockKey, float]) -> None:
        self._timeout = timeout
        self._hold = hold
        self._telemetry = telemetry
        self._carried = carried
        self.retry_since: dict[BlockKey, float] = {}
        """When this tier's RETRY wait for each block began (its first RETRY, or a failed
        promotion's start carried over)."""
        self.withheld: dict[BlockKey, float] = {}
        """Blocks this tier may not promise, and until when (oldest first)."""

    def retried(self, key: BlockKey, now: float) -> bool:
        """The tier answered RETRY for ``key`` at ``now``: True while the wait is within the
        deadline; False once it outlived it (then the block is withheld, counted ``retry_expired``)."""
        since = self.retry_since
        start = since.get(key)
        if start is None:
            carried = self._carried.get(key) if self._carried else None
            _remember(since, key, carried if carried is not None and now - carried <= self._timeout else now)
            return True
        if now - start <= self._timeout:
            return True
        del since[key]
        self._telemetry.fail("retry_expired")
        self.withhold(key, now)
        return False

    def answered(self, key: BlockKey, now: float) -> float:
        """The tier answered HIT or MISS for ``key``: the RETRY wait before it, if any, is timed
        (``lookup_async_seconds``); returns when that wait began, or 0.0."""
        start = self.retry_since.pop(key, None)
        if start is None:
            return 0.0
        self._telemetry.lookup_async_seconds.observe(now - start)
        return start

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


class WriteWaits:
    """The writes into the CPU tier that lookups wait on (promotions and device stores), and
    the block clocks carried over from failed promotions; see the module docstring."""

    __slots__ = ("_cpu", "_hold", "_timeout", "abandoned", "carried", "since")

    def __init__(self, timeout: float, hold: float, cpu: TierTelemetry) -> None:
        self._timeout = timeout
        self._hold = hold
        self._cpu = cpu
        self.since: dict[BlockKey, tuple[float, TierTelemetry]] = {}
        """Writes in flight that a lookup waited on: when the wait began, and the telemetry of
        the tier writing (the CPU tier's for a device store)."""
        self.abandoned: set[BlockKey] = set()
        """Writes in flight past the deadline: lookups answer MISS until they end."""
        self.carried: dict[BlockKey, float] = {}
        """When the wait on a block whose promotion failed began (oldest first); a new wait on
        it within ``wait_timeout`` continues from there."""

    def for_tier(self, telemetry: TierTelemetry) -> TierWaits:
        """The wait state of one secondary tier, sharing these carried clocks."""
        return TierWaits(self._timeout, self._hold, telemetry, self.carried)

    def promoting(self, key: BlockKey, telemetry: TierTelemetry, since: float) -> bool:
        """A promotion of ``key`` is about to start, its tier's RETRY wait having begun at
        ``since`` (0.0: none). False if the block's wait is already past the deadline (then
        no promotion starts and the lookup answers MISS)."""
        now = perf_counter()
        start = since or now
        carried = self.carried.pop(key, None) if self.carried else None
        if carried is not None and carried < start:
            start = carried
        if now - start > self._timeout:
            telemetry.fail("load_expired")
            return False
        self.since[key] = (start, telemetry)
        return True

    def pending(self, key: BlockKey, now: float) -> bool:
        """A lookup found ``key`` being written into the CPU tier: True to answer HIT_PENDING,
        False (MISS) once the wait outlived the deadline (counted once, ``load_expired`` on the
        promoting tier or ``store_expired`` on the CPU tier)."""
        if key in self.abandoned:
            return False
        entry = self.since.get(key)
        if entry is None:  # promotions are clocked when they start: this is a device store
            self.since[key] = (now, self._cpu)
            return True
        if now - entry[0] <= self._timeout:
            return True
        del self.since[key]
        self.abandoned.add(key)
        entry[1].fail("store_expired" if entry[1] is self._cpu else "load_expired")
        return False

    def ended(self, keys: Iterable[BlockKey], failed: bool = False) -> None:
        """The writes of ``keys`` ended (completed, or ``failed``: the clock of each block a
        lookup waited on is carried over to its next wait)."""
        if not (self.since or self.abandoned):
            return
        since, abandoned = self.since, self.abandoned
        now = perf_counter() if failed else 0.0
        for key in keys:
            entry = since.pop(key, None)
            abandoned.discard(key)
            if failed and entry is not None:
                self._carry(key, entry[0], now)

    def _carry(self, key: BlockKey, start: float, now: float) -> None:
        carried = self.carried
        while carried:  # oldest first: drop the clocks that can no longer shorten a wait
            first = next(iter(carried))
            if now - carried[first] <= self._timeout:
                break
            del carried[first]
        if now - start <= self._timeout:
            _remember(carried, key, start)

    def clear(self) -> None:
        """The CPU tier was reset: no write is in flight."""
        self.since.clear()
        self.abandoned.clear()
        self.carried.clear()


__all__ = [
    "DEFAULT_FAILED_LOAD_SECONDS", "DEFAULT_WAIT_TIMEOUT", "FAILED_LOAD_SECONDS_RANGE", "MAX_KEYS",
    "WAIT_TIMEOUT_RANGE", "TierWaits", "WriteWaits", "check_seconds",
]
