"""The in-process memory tier: the reference secondary tier, and the example to copy.

Configured as ``{"type": "memory", "max_bytes": "1GiB"}``. It keeps values in a
dict in this process (lost when the process exits), so it is useful for tests,
for ``kvtier bench --memory-tier``, and as the smallest complete tier: read it
before writing a backend.

What a backend on the tier platform (:mod:`kvtier.tiers.jobs`) writes itself,
and what this one does:

* **Options** declared once, as a pydantic model (:class:`MemoryTierOptions`) set as
  ``options_model``; the constructor takes an instance of it or keyword arguments,
  validated through it (:func:`~kvtier.tiers.options.tier_options`); the model
  also says what capacity its options give (:meth:`MemoryTierOptions.capacity`).
* **Lookup** (:meth:`MemoryTier._lookup`, scheduler thread): answered from
  memory. A remote tier that cannot know answers RETRY and queues an existence
  check in ``on_schedule_end`` (see :mod:`kvtier.tiers.redis`, :mod:`kvtier.tiers.s3`).
* **Reservations** (scheduler thread): ``_holds`` lets stores skip keys already
  held; ``_admit_load`` pins a key so eviction cannot take it while it is read,
  and ``_abandon`` unpins work that will never run.
* **I/O** (:meth:`MemoryTier._run`, worker threads): one work item per block.
  A store writes ``header + payload`` (:mod:`kvtier.tiers.format`) from the
  pinned CPU row; a load copies the payload into the reserved row and verifies
  header and checksum *before* reporting the key as loaded. A mismatch is a
  failed key, counted in ``stats.corrupt_values``, and the value is deleted.
  Each item is reported once with :meth:`~kvtier.tiers.jobs.ThreadedTier._complete`.

Everything else (job ids and results, queues with loads before stores and
store shedding, drain, shutdown, health, events, counters) is the platform's.
Capacity: values are evicted least recently used first, never while being read.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from kvtier.errors import ConfigError, CorruptValueError
from kvtier.failures import log_failure
from kvtier.keys import BlockKey
from kvtier.tiers.base import TierContext, TierUsage
from kvtier.tiers.format import HEADER_SIZE, decode_header, encode_header, verify_payload
from kvtier.tiers.health import CircuitBreaker
from kvtier.tiers.jobs import ALL_LANES, Lane, ThreadedTier, Work
from kvtier.tiers.options import ByteSize, QueueLength, Seconds, Threads, TierOptions, tier_options
from kvtier.types import LookupResult, RequestContext

logger = logging.getLogger(__name__)


class MemoryTierOptions(TierOptions):
    """In-process memory tier (``type: memory``): the reference tier; values are lost with the process."""

    max_bytes: ByteSize = Field(
        default=256 * 1024**2, gt=0, description="Bytes of values (header + block) it may hold; LRU beyond."
    )
    io_threads: Threads = Field(default=1, description="Worker threads copying between CPU rows and values.")
    max_queued_stores: QueueLength = Field(
        default=256, description="Blocks waiting to be stored beyond which stores are shed."
    )
    shutdown_timeout: Seconds = Field(default=10.0, gt=0, description="Seconds shutdown() waits for the threads.")

    def capacity(self) -> int | None:
        return self.max_bytes


class MemoryTier(ThreadedTier):
    """Blocks in a dict of this process; see the module docstring (the example to copy)."""

    tier_type = "memory"
    medium = "memory"
    options_model = MemoryTierOptions

    def __init__(self, context: TierContext, options: MemoryTierOptions | None = None, /, **fields: Any) -> None:
        self.options = tier_options(MemoryTierOptions, self.tier_type, options, fields)
        if self.options.max_bytes < HEADER_SIZE + context.block_bytes:  # every store would find no room
            raise ConfigError(
                f"memory tier max_bytes={self.options.max_bytes} is smaller than one value "
                f"({HEADER_SIZE + context.block_bytes} bytes): raise max_bytes"
            )
        super().__init__(
            context,
            breaker=CircuitBreaker(),
            max_queued_stores=self.options.max_queued_stores,
            shutdown_timeout=self.options.shutdown_timeout,
        )
        self._value_bytes = HEADER_SIZE + context.block_bytes
        self._digest = context.namespace.digest
        # Values, their readers and the byte count, guarded by _values_lock.
        self._values_lock = threading.Lock()
        self._values: OrderedDict[BlockKey, bytearray] = OrderedDict()
        self._readers: dict[BlockKey, int] = {}
        self._used = 0
        self._start_workers(self.options.io_threads, ALL_LANES, "io")

    # --- scheduler thread ------------------------------------------------------------------

    def _lookup(self, key: BlockKey, request: RequestContext | None) -> LookupResult:
        return LookupResult.HIT if key in self._values else LookupResult.MISS

    def _holds(self, key: BlockKey) -> bool:
        return key in self._values

    lists_holdings = True

    def held_keys(self) -> list[BlockKey]:
        with self._values_lock:
            return list(self._values)

    def holdings_complete(self) -> bool:
        return True

    def holds(self, key: BlockKey) -> bool:
        return key in self._values

    def _admit_load(self, key: BlockKey) -> bool:
        with self._values_lock:
            if key not in self._values:
                return False
            self._readers[key] = self._readers.get(key, 0) + 1
            return True

    def _abandon(self, work: Work) -> None:
        if work.lane is Lane.LOAD:
            self._unpin(work.keys[0])

    def touch(self, keys: Sequence[BlockKey], request: RequestContext | None) -> None:
        with self._values_lock:
            for key in keys:
                if key in self._values:
                    self._values.move_to_end(key)

    def usage(self) -> TierUsage:
        return TierUsage(self._used, self.options.max_bytes, len(self._values))

    def describe(self) -> dict[str, Any]:
        return {"type": self.tier_type, "medium": self.medium, **self.options.model_dump()}

    # --- worker threads -----------------------------------------------------------------------

    def _run(self, work: Work, local: Any) -> None:
        if work.lane is Lane.STORE:
            self._store(work)
        else:
            self._load(work)

    def _store(self, work: Work) -> None:
        key, slot = work.keys[0], work.slots[0]
        row = self._row(slot)
        try:
            value = bytearray(self._value_bytes)
            value[HEADER_SIZE:] = row
            value[:HEADER_SIZE] = encode_header(self._digest, key, row)
        finally:
            row.release()
        evicted = self._insert(key, value)
        if evicted:
            self._count(evictions=len(evicted))
            self._emit(evicted, removed=True)
        if evicted is None:
            self._complete(work, error="no room: every value is being read", dropped=True)
            return
        self._emit([key], removed=False)
        self._complete(work, ok=[key], nbytes=self._value_bytes)

    def _insert(self, key: BlockKey, value: bytearray) -> list[BlockKey] | None:
        """Add ``value``, evicting LRU values nobody reads; None if no room can be made."""
        with self._values_lock:
            if key in self._values:
                return []
            evicted: list[BlockKey] = []
            while self._used + len(value) > self.options.max_bytes:
                # Oldest first; values being read stay (few, so the scan is short).
                victim = next((k for k in self._values if k not in self._readers), None)
                if victim is None:
                    return None
                self._used -= len(self._values.pop(victim))
                evicted.append(victim)
            self._values[key] = value
            self._used += len(value)
            return evicted

    def _load(self, work: Work) -> None:
        key, slot = work.keys[0], work.slots[0]
        try:
            with self._values_lock:
                value = self._values.get(key)
            if value is None:  # cannot happen while pinned; kept for safety
                self._complete(work, error=f"value {key.hex()[:16]} vanished")
                return
            row = self._row(slot)
            try:
                row[:] = memoryview(value)[HEADER_SIZE:]
                header = decode_header(value, namespace=self._digest, key=key, payload_len=self._block_bytes)
                verify_payload(header, row)
            except CorruptValueError as exc:
                what = f"memory tier {self.label}: value {key.hex()[:16]} is corrupt; dropped"
                log_failure(logger, logging.WARNING, what, exc)
                self._count(corrupt_values=1)
                self._drop(key)
                self._complete(work, error=f"corrupt value {key.hex()[:16]}: {exc}")
                return
            finally:
                row.release()
        finally:
            self._unpin(key)
        self._complete(work, ok=[key], nbytes=self._value_bytes)

    def _unpin(self, key: BlockKey) -> None:
        with self._values_lock:
            left = self._readers.get(key, 0) - 1
            if left > 0:
                self._readers[key] = left
            else:
                self._readers.pop(key, None)

    def _drop(self, key: BlockKey) -> None:
        with self._values_lock:
            value = self._values.pop(key, None)
            if value is not None:
                self._used -= len(value)
        if value is not None:
            self._emit([key], removed=True)


__all__ = ["MemoryTier", "MemoryTierOptions"]
