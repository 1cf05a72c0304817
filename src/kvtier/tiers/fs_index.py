"""In-memory index of the filesystem tier: which keys are on disk, their recency, capacity.

Invariants (all under one lock, held only for in-memory work, never across I/O):

* ``used + reserved <= capacity`` whenever a reservation is granted, where every
  value file is charged :func:`~kvtier.tiers.fs_layout.entry_bytes` (its largest
  possible size). So the directory never holds more than ``capacity`` bytes of
  values, plus whatever the warm-restart scan finds beyond it until it evicts.
* A key is in at most one of: present (``_entries``), being stored or being
  deleted (``_busy``). A store of a busy key is skipped, so an eviction's unlink
  can never delete a newer file of the same key.
* A pinned key (a load is reading its file) is never chosen for eviction.

Called from the scheduler thread (``hit``, ``touch``, ``pin``) and from the I/O
and scan threads (everything else); every method is thread-safe and O(1) except
eviction, which skips pinned entries (there are only as many as loads in flight).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum


class Reservation(Enum):
    GRANTED = "granted"
    PRESENT = "present"
    BUSY = "busy"
    FULL = "full"


@dataclass
class StorePlan:
    """The outcome of :meth:`FileIndex.reserve`: if GRANTED, ``victims`` must be unlinked
    and then released with :meth:`FileIndex.finish_delete`."""

    outcome: Reservation
    victims: list[bytes]


class FileIndex:
    def __init__(self, capacity: int, entry_bytes: int) -> None:
        self.entry_bytes = entry_bytes
        self.max_capacity = capacity
        self._capacity = capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self._pins: dict[bytes, int] = {}
        self._busy: set[bytes] = set()
        self._reserved = 0

    # --- scheduler-thread reads ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def hit(self, key: bytes) -> bool:
        """True if ``key`` is on disk; a hit also makes it most recently used."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return True
            return False

    def touch(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for key in keys:
                if key in self._entries:
                    self._entries.move_to_end(key)

    def pin(self, key: bytes) -> bool:
        """Protect ``key`` from eviction while a load reads it; False if it is not present."""
        with self._lock:
            if key not in self._entries:
                return False
            self._pins[key] = self._pins.get(key, 0) + 1
            return True

    def unpin(self, key: bytes) -> None:
        with self._lock:
            n = self._pins.get(key, 0) - 1
            if n > 0:
                self._pins[key] = n
            else:
                self._pins.pop(key, None)

    # --- capacity ----------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return len(self._entries) * self.entry_bytes

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    @property
    def capacity(self) -> int:
        """Effective capacity: ``max_capacity``, or less after the disk ran out of space."""
        return self._capacity

    def set_capacity(self, capacity: int) -> None:
        """Change the effective capacity, clamped to ``[one entry, max_capacity]``."""
        with self._lock:
            self._capacity = max(self.entry_bytes, min(self.max_capacity, capacity))

    def lower_capacity_to_used(self) -> int:
        """After ENOSPC: what is stored now (plus other writes in flight) is all that fits."""
        with self._lock:
            self._capacity = max(self.entry_bytes, min(self._capacity, self.used_bytes + self._reserved))
            return self._capacity

    # --- stores ------------------------------------------------------------------------------

    def reserve(self, key: bytes) -> StorePlan:
        """Claim room for one new value file of ``key``, choosing LRU victims if needed.

        GRANTED: ``key`` is now busy and charged; the caller writes it and then calls
        :meth:`commit` or :meth:`abort`, and must delete every victim (already removed
        from the index and marked busy). PRESENT/BUSY: nothing to do. FULL: every
        candidate victim is pinned; nothing changed.
        """
        with self._lock:
            if key in self._entries:
                return StorePlan(Reservation.PRESENT, [])
            if key in self._busy:
                return StorePlan(Reservation.BUSY, [])
            need = self.used_bytes + self._reserved + self.entry_bytes - self._capacity
            victims: list[bytes] = []
            if need > 0:
                for candidate in self._entries:
                    if candidate in self._pins:
                        continue
                    victims.append(candidate)
                    need -= self.entry_bytes
                    if need <= 0:
                        break
                if need > 0:
                    return StorePlan(Reservation.FULL, [])
                for victim in victims:
                    del self._entries[victim]
                    self._busy.add(victim)
            self._busy.add(key)
            self._reserved += self.entry_bytes
            return StorePlan(Reservation.GRANTED, victims)

    def commit(self, key: bytes) -> None:
        """The value file of a granted reservation is in place: ``key`` is present, newest."""
        with self._lock:
            self._busy.discard(key)
            self._reserved -= self.entry_bytes
            self._entries[key] = None
            self._entries.move_to_end(key)

    def abort(self, key: bytes) -> None:
        """A granted store failed; its file is gone."""
        with self._lock:
            self._busy.discard(key)
            self._reserved -= self.entry_bytes

    # --- deletions ----------------------------------------------------------------------------

    def begin_delete(self, key: bytes) -> bool:
        """Remove ``key`` (corrupt or vanished) and mark it busy until :meth:`finish_delete`.
        False if it was not present (someone else removed it)."""
        with self._lock:
            if key not in self._entries:
                return False
            del self._entries[key]
            self._busy.add(key)
            return True

    def finish_delete(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._busy.discard(key)

    def evict_over_capacity(self) -> list[bytes]:
        """Pick LRU victims until ``used + reserved <= capacity`` (after a warm-restart scan
        found more than fits). Victims are removed and busy; the caller deletes them."""
        with self._lock:
            victims: list[bytes] = []
            excess = self.used_bytes + self._reserved - self._capacity
            for candidate in self._entries:
                if excess <= 0:
                    break
                if candidate in self._pins:
                    continue
                victims.append(candidate)
                excess -= self.entry_bytes
            for victim in victims:
                del self._entries[victim]
                self._busy.add(victim)
            return victims

    # --- warm restart -------------------------------------------------------------------------

    def add_scanned(self, keys: Iterable[bytes]) -> int:
        """Add keys found on disk as the least recently used (stores made meanwhile stay newer).
        Keys already present or busy are skipped. Returns how many were added."""
        added = 0
        with self._lock:
            for key in keys:
                if key in self._entries or key in self._busy:
                    continue
                self._entries[key] = None
                self._entries.move_to_end(key, last=False)
                added += 1
        return added

    def order_oldest_first(self, keys_newest_first: list[bytes], chunk: int = 4096) -> None:
        """Move scanned keys to the LRU end in the given order (newest first, so the oldest
        ends up first), taking the lock in chunks so lookups never wait long."""
        for start in range(0, len(keys_newest_first), chunk):
            with self._lock:
                for key in keys_newest_first[start : start + chunk]:
                    if key in self._entries:
                        self._entries.move_to_end(key, last=False)

    def keys(self) -> list[bytes]:
        """Snapshot of present keys, least recently used first."""
        with self._lock:
            return list(self._entries)
