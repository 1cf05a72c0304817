"""In-memory index of the filesystem tier: which keys are on disk as this engine knows them, their recency.

The index is a cache of the namespace directory, not its truth: other engines
sharing the root add and remove files behind its back (see
:mod:`kvtier.tiers.fs_share`), so a key it holds may be gone (a load then finds it
vanished: a miss) and a key it lacks may be on disk (a lookup checks the root).
How many files the namespace may hold is not decided here but by the shared
budget (:mod:`kvtier.tiers.fs_budget`); the index only picks the victims.

Invariants (all under one lock, held only for in-memory work, never across I/O):

* A key is in at most one of: present (``_entries``), being stored or being
  deleted (``_busy``). A store of a busy key is skipped, so an eviction's unlink
  can never delete a newer file of the same key written by this engine.
* A pinned key (a load is reading its file) is never chosen for eviction.

Called from the scheduler thread (``hit``, ``touch``, ``pin``) and from the I/O
and scan threads (everything else); every method is thread-safe and O(1) except
victim choice, which skips pinned entries (there are only as many as loads in flight).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from enum import Enum


class Reservation(Enum):
    GRANTED = "granted"
    PRESENT = "present"
    BUSY = "busy"


class FileIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self._pins: dict[bytes, int] = {}
        self._busy: set[bytes] = set()

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

    # --- stores ------------------------------------------------------------------------------

    def reserve(self, key: bytes) -> Reservation:
        """GRANTED: ``key`` is now busy; the caller stores it and then calls :meth:`commit` or
        :meth:`abort`. PRESENT (on disk) or BUSY (being stored or deleted): nothing to do."""
        with self._lock:
            if key in self._entries:
                return Reservation.PRESENT
            if key in self._busy:
                return Reservation.BUSY
            self._busy.add(key)
            return Reservation.GRANTED

    def commit(self, key: bytes) -> None:
        """The value file of a granted reservation is in place: ``key`` is present, newest."""
        with self._lock:
            self._busy.discard(key)
            self._entries[key] = None
            self._entries.move_to_end(key)

    def abort(self, key: bytes) -> None:
        """A granted store failed; its file is gone."""
        with self._lock:
            self._busy.discard(key)

    def take_victims(self, count: int) -> list[bytes]:
        """Up to ``count`` least recently used keys no load is reading, removed from the index
        and busy until :meth:`finish_delete` (the caller deletes their files). Fewer (or none)
        when the rest is pinned."""
        with self._lock:
            victims: list[bytes] = []
            if count <= 0:
                return victims
            for candidate in self._entries:
                if candidate in self._pins:
                    continue
                victims.append(candidate)
                if len(victims) >= count:
                    break
            for victim in victims:
                del self._entries[victim]
                self._busy.add(victim)
            return victims

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

    # --- files found on disk ------------------------------------------------------------------

    def adopt(self, key: bytes) -> bool:
        """A file of ``key`` was found on disk (another engine wrote it): present, most recently
        used (it is about to be loaded). False if the key is present or busy already."""
        with self._lock:
            if key in self._entries or key in self._busy:
                return False
            self._entries[key] = None
            return True

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
