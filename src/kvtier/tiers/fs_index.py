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
* Eviction order is by time across two lists: keys this engine used (stored,
  hit, touched, adopted for a load), each with its last use, least recent first;
  and files found on disk and not used here yet (start-up scan, files of other
  engines found while looking for victims), each with its mtime, oldest first.
  The older head goes first, so an engine sharing a root evicts the oldest of
  what it knows, its own files or not (loads refresh a file's mtime, so other
  engines see the use). Times are wall-clock seconds (file mtimes are too).

Called from the scheduler thread (``hit``, ``touch``, ``pin``) and from the I/O
and scan threads (everything else); every method is thread-safe and O(1) except
victim choice, which skips pinned entries (there are only as many as loads in flight).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from enum import Enum


class Reservation(Enum):
    GRANTED = "granted"
    PRESENT = "present"
    BUSY = "busy"


class PeerRemoval(Enum):
    """What :meth:`FileIndex.forget_if_older` made of another engine's removal of a key."""

    DROPPED = "dropped"  # the key was present here: it is not any more
    UNKNOWN = "unknown"  # not present here: nothing to do
    NEWER = "newer"  # a file of it was proven here after the removal's time: check the disk
    BUSY = "busy"  # a store, deletion or load of it is under way here: ask again later


SEEN_SECONDS = 120.0
"""How long the index remembers when a file of a used key was last proven to exist (stored,
adopted, announced by another engine): a removal another engine announces with an older time
does not drop it. Removals arrive within seconds (journal lag), so older proofs never matter."""


class FileIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._used: OrderedDict[bytes, float] = OrderedDict()  # last use, least recent first
        self._found: OrderedDict[bytes, float] = OrderedDict()  # mtime, oldest first (roughly)
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # used keys: when a file was last proven
        self._gone: OrderedDict[bytes, float] = OrderedDict()  # keys whose file this engine deleted, when
        self._pins: dict[bytes, int] = {}
        self._busy: set[bytes] = set()

    # --- scheduler-thread reads ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._used) + len(self._found)

    def __contains__(self, key: object) -> bool:
        return key in self._used or key in self._found

    @property
    def found_files(self) -> int:
        """Files found on disk and not used by this engine yet (eviction candidates by mtime)."""
        return len(self._found)

    def _use_locked(self, key: bytes, now: float) -> bool:
        if key in self._used:
            self._used.move_to_end(key)
            self._used[key] = now
            return True
        if self._found.pop(key, None) is not None:
            self._used[key] = now
            return True
        return False

    def hit(self, key: bytes) -> bool:
        """True if ``key`` is on disk; a hit also makes it most recently used."""
        now = time.time()
        with self._lock:
            return self._use_locked(key, now)

    def touch(self, keys: Iterable[bytes]) -> None:
        now = time.time()
        with self._lock:
            for key in keys:
                self._use_locked(key, now)

    def pin(self, key: bytes) -> bool:
        """Protect ``key`` from eviction while a load reads it; False if it is not present."""
        with self._lock:
            if key not in self._used and key not in self._found:
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
            if key in self._used or key in self._found:
                return Reservation.PRESENT
            if key in self._busy:
                return Reservation.BUSY
            self._busy.add(key)
            return Reservation.GRANTED

    def commit(self, key: bytes) -> None:
        """The value file of a granted reservation is in place: ``key`` is present, newest."""
        now = time.time()
        with self._lock:
            self._busy.discard(key)
            self._found.pop(key, None)
            self._used[key] = now
            self._used.move_to_end(key)
            self._saw_locked(key, now)

    def _saw_locked(self, key: bytes, when: float) -> None:
        seen = self._seen
        if seen.get(key, 0.0) < when:
            seen[key] = when
            seen.move_to_end(key)
        horizon = when - SEEN_SECONDS
        while seen:
            first = next(iter(seen))
            if seen[first] >= horizon:
                break
            del seen[first]

    def abort(self, key: bytes) -> None:
        """A granted store failed; its file is gone."""
        with self._lock:
            self._busy.discard(key)

    def take_victims(self, count: int) -> list[bytes]:
        """Up to ``count`` of the oldest keys no load is reading (see the module docstring),
        removed from the index and busy until :meth:`finish_delete` (the caller deletes their
        files). Fewer (or none) when the rest is pinned."""
        with self._lock:
            victims = list(_oldest(self._unpinned(self._used), self._unpinned(self._found), count))
            for victim in victims:
                if self._used.pop(victim, None) is None:
                    del self._found[victim]
                self._seen.pop(victim, None)
                self._busy.add(victim)
            return victims

    def _unpinned(self, entries: OrderedDict[bytes, float]) -> Iterator[tuple[float, bytes]]:
        pins = self._pins
        return ((when, key) for key, when in entries.items() if key not in pins)

    # --- deletions ----------------------------------------------------------------------------

    def begin_delete(self, key: bytes) -> bool:
        """Remove ``key`` (corrupt or vanished) and mark it busy until :meth:`finish_delete`.
        False if it was not present (someone else removed it)."""
        with self._lock:
            if self._used.pop(key, None) is None and self._found.pop(key, None) is None:
                return False
            self._seen.pop(key, None)
            self._busy.add(key)
            return True

    def finish_delete(self, keys: Iterable[bytes]) -> None:
        """The files of ``keys`` are gone (deleted here, or found gone): remembered for
        ``SEEN_SECONDS``, so another engine's older announcement of a file of one of them,
        read from its journal after the deletion, does not bring it back."""
        now = time.time()
        with self._lock:
            gone = self._gone
            for key in keys:
                self._busy.discard(key)
                gone.pop(key, None)
                gone[key] = now
            horizon = now - SEEN_SECONDS
            while gone and next(iter(gone.values())) < horizon:
                gone.popitem(last=False)

    # --- files found on disk ------------------------------------------------------------------

    def adopt(self, key: bytes) -> bool:
        """A file of ``key`` was found on disk by a lookup's check (another engine wrote it):
        present and most recently used (it is about to be loaded). False if the key is
        present or busy already."""
        now = time.time()
        with self._lock:
            if key in self._used or key in self._found or key in self._busy:
                return False
            self._used[key] = now
            self._saw_locked(key, now)
            return True

    def forget_if_older(self, key: bytes, when: float) -> PeerRemoval:
        """Another engine removed ``key``'s file at ``when`` (wall clock): drop the key unless a
        load or store of it is under way here (BUSY), or a file of it was proven to exist after
        ``when`` (NEWER: stored or adopted here, announced or found on disk since; a mere use
        proves nothing). Times bracket the actions they stand for only loosely (a store is timed
        after its link, a removal before its unlink), so NEWER and BUSY leave the truth to the
        disk: the caller looks (see ``FilesystemTier._apply_journal``)."""
        with self._lock:
            if key in self._busy or key in self._pins:
                return PeerRemoval.BUSY
            found = self._found.get(key)
            if found is not None:
                if found > when:
                    return PeerRemoval.NEWER
                del self._found[key]
                return PeerRemoval.DROPPED
            if key not in self._used:
                return PeerRemoval.UNKNOWN
            if self._seen.get(key, 0.0) > when:
                return PeerRemoval.NEWER
            del self._used[key]
            self._seen.pop(key, None)
            return PeerRemoval.DROPPED

    def add_found(self, files: Iterable[tuple[float, bytes]]) -> int:
        """Add files found on disk or announced by another engine (``(mtime, key)``, oldest
        first) that this engine has not used; keys busy are skipped, and so are files this
        engine deleted after their time (an announcement read late); keys present only
        remember the newer proof. Returns how many were added."""
        added = 0
        with self._lock:
            gone = self._gone
            for mtime, key in files:
                if key in self._busy or gone.get(key, -1.0) >= mtime:
                    continue
                if key in self._used:
                    self._saw_locked(key, mtime)
                elif key in self._found:
                    self._found[key] = max(self._found[key], mtime)
                else:
                    self._found[key] = mtime
                    added += 1
        return added

    def order_found(self, keys_oldest_first: list[bytes], chunk: int = 4096) -> None:
        """Put found files in this order (the start-up scan's, by mtime), taking the lock in
        chunks so lookups never wait long."""
        for start in range(0, len(keys_oldest_first), chunk):
            with self._lock:
                for key in keys_oldest_first[start : start + chunk]:
                    if key in self._found:
                        self._found.move_to_end(key)

    def keys(self) -> list[bytes]:
        """Snapshot of present keys in eviction order (the oldest first)."""
        with self._lock:
            return [key for _, key in heapq.merge(
                ((w, k) for k, w in self._used.items()), ((w, k) for k, w in self._found.items()))]  # fmt: skip


def _oldest(
    used: Iterator[tuple[float, bytes]], found: Iterator[tuple[float, bytes]], count: int
) -> Iterator[bytes]:
    """The first ``count`` keys of two time-ordered streams merged, the older first (ties: used)."""
    if count <= 0:
        return
    u, f = next(used, None), next(found, None)
    while count > 0 and (u is not None or f is not None):
        if f is None or (u is not None and u[0] <= f[0]):
            assert u is not None
            yield u[1]
            u = next(used, None)
        else:
            yield f[1]
            f = next(found, None)
        count -= 1
