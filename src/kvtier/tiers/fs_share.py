"""Live sharing of an fs root: finding the blocks other engines write while this one runs.

The index (:mod:`kvtier.tiers.fs_index`) knows what this engine stored and what
its start-up scan found. Other live engines sharing the root and namespace add
files behind its back, so with sharing on, a lookup that misses the index
checks the root, but never on the scheduler thread, whose calls must not wait
on a disk or a network file system:

* The lookup answers RETRY and queues the key in its request's chain (keys in
  prefix order). At step end the step's chains go to an I/O thread as one work
  item, in the EXISTS lane (served before loads and stores).
* The I/O thread checks each chain's keys in order with one ``fstatat`` under
  the shard's directory descriptor, following no link and opening nothing (a
  FIFO cannot block it): a regular file of this user (or the shared group) with
  a value's size is adopted into the index; the chain stops at its first key
  that is not there (the engine stops its prefix scan there too).
* The next step's lookup answers from memory: HIT for an adopted key; MISS for
  a key found absent, for ``miss_seconds`` (the negative cache; after that it is
  checked again). A check still running after :data:`PATIENCE` seconds answers
  MISS (a hung network file system makes the engine recompute, never wait).
* Adoption is checked at load time: the load verifies header, namespace, key,
  length and checksum, so a planted or foreign file is a MISS (and the inode
  that failed is remembered and never adopted again), and a file another engine
  evicted meanwhile is a MISS too (it vanished).

Correctness never depends on inotify or on directory modification times: the
check is a plain ``fstatat`` per key. On NFS the client caches lookups, so a
file another host created becomes visible once the client revalidates the
directory; mount with ``lookupcache=positive`` to have every negative lookup
asked of the server.

``sharing: auto`` turns the checks on once another tier instance has used the
namespace directory since this one started (its ``tmp/<instance>`` directory
appears), so a lone engine pays nothing; ``true`` always, ``false`` never.

:class:`ExistenceChecks` is thread-safe (one lock, held for dictionary work
only); its scheduler-side methods never do I/O. :class:`PeerWatch` runs on an
I/O thread (housekeeping).
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict

from kvtier.tiers.fs_files import NamespaceDir
from kvtier.tiers.fs_layout import TMP_DIR
from kvtier.types import LookupResult, RequestContext

PATIENCE = 1.0
"""Seconds a lookup answers RETRY for a key whose check has not come back; MISS after that."""

_MAX_ABSENT = 1 << 18  # negative-cache entries kept at most (the oldest go first)
_MAX_REJECTED = 4096  # inodes that failed verification, remembered at most
_PRUNE_PER_TICK = 10_000
_RECENT_SECONDS = 2.0  # a directory changed this recently is listed again (coarse mtimes)...
_RELIST_EVERY = 0.25  # ...this often at most


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


class ExistenceChecks:
    """Keys the index does not hold, checked on disk: the chains to check, the checks in
    flight, the keys found absent (for ``miss_seconds``), the files that failed verification."""

    def __init__(self, miss_seconds: float) -> None:
        self.miss_seconds = float(miss_seconds)
        self._lock = threading.Lock()
        self._absent: dict[bytes, float] = {}  # key -> answer MISS until (monotonic); expiry order
        self._checking: dict[bytes, float] = {}  # key -> when its check was queued
        self._rejected: OrderedDict[bytes, tuple[int, int, int, int]] = OrderedDict()
        # Scheduler thread only: this step's keys to check, per request chain, in lookup order.
        self._chains: dict[object, list[bytes]] = {}
        self._pending: set[bytes] = set()

    # --- scheduler thread (no I/O) -----------------------------------------------------------------

    def answer(self, key: bytes, request: RequestContext | None, now: float) -> LookupResult:
        """MISS while ``key`` is known absent or its check is overdue; else RETRY (queued for a
        check at step end, unless one is under way)."""
        with self._lock:
            until = self._absent.get(key)
            since = self._checking.get(key)
        if until is not None and until > now:
            return LookupResult.MISS
        if since is not None:
            return LookupResult.MISS if now - since > PATIENCE else LookupResult.RETRY
        if key not in self._pending:
            self._pending.add(key)
            chain = request.req_id if request is not None else object()
            self._chains.setdefault(chain, []).append(key)
        return LookupResult.RETRY

    def take(self) -> list[list[bytes]]:
        """This step's chains of keys to check (step end); they count as being checked from now."""
        if not self._chains:
            return []
        chains = list(self._chains.values())
        self._chains = {}
        self._pending = set()
        now = time.monotonic()
        with self._lock:
            for chain in chains:
                for key in chain:
                    self._checking[key] = now
        return chains

    def busy(self) -> bool:
        """True while checks are queued or running."""
        return bool(self._checking) or bool(self._chains)

    # --- I/O threads --------------------------------------------------------------------------------

    def record(self, key: bytes, present: bool) -> None:
        """The answer of a check (or of a load that found the file gone or bad)."""
        with self._lock:
            self._checking.pop(key, None)
            self._absent.pop(key, None)
            if not present:
                self._absent[key] = time.monotonic() + self.miss_seconds

    def finish(self, keys: list[bytes]) -> None:
        """The checks of ``keys`` are over (keys after a chain's first absent one stay unknown)."""
        with self._lock:
            for key in keys:
                self._checking.pop(key, None)

    def forget(self, key: bytes) -> None:
        """``key`` was just stored by this engine: no longer absent."""
        if key in self._absent:
            with self._lock:
                self._absent.pop(key, None)

    def reject(self, key: bytes, st: os.stat_result) -> None:
        """The file ``st`` of ``key`` failed verification and stays (not ours to delete): never
        adopt that inode again (a new file of the key, another inode or mtime, is checked)."""
        with self._lock:
            self._rejected[key] = _identity(st)
            self._rejected.move_to_end(key)
            while len(self._rejected) > _MAX_REJECTED:
                self._rejected.popitem(last=False)

    def rejected(self, key: bytes, st: os.stat_result) -> bool:
        with self._lock:
            return self._rejected.get(key) == _identity(st)

    def prune(self) -> None:
        """Drop expired negative answers (bounded work per call; housekeeping)."""
        now = time.monotonic()
        with self._lock:
            absent = self._absent
            for _ in range(_PRUNE_PER_TICK):
                first = next(iter(absent), None)
                if first is None or absent[first] > now:
                    break
                del absent[first]
            while len(absent) > _MAX_ABSENT:
                del absent[next(iter(absent))]


class PeerWatch:
    """Has another tier instance used this namespace directory since this one started?

    Sticky: once seen, always (the files it wrote stay). Looks at ``tmp/``, where every
    instance (this release or an older one) keeps a directory while it lives; listed only
    when that directory changed. Called on an I/O thread.
    """

    def __init__(self, dirs: NamespaceDir, own: str, always: bool) -> None:
        self._dirs = dirs
        self._own = own
        self._signature: tuple[int, ...] | None = None
        self._listed = 0.0
        self.seen = always
        if not always:
            self.check()

    def check(self) -> bool:
        if self.seen:
            return True
        fd = self._dirs.subdir(TMP_DIR)
        try:
            st = os.fstat(fd)
            signature = (st.st_mtime_ns, st.st_ctime_ns, st.st_nlink, st.st_size)
            if signature == self._signature:
                now = time.monotonic()
                if now - self._listed < _RELIST_EVERY or time.time() - st.st_mtime > _RECENT_SECONDS:
                    return False
            self._signature = signature
            self._listed = time.monotonic()
            with os.scandir(fd) as entries:
                self.seen = any(e.name != self._own and e.is_dir(follow_symlinks=False) for e in entries)
        finally:
            os.close(fd)
        return self.seen


__all__ = ["PATIENCE", "ExistenceChecks", "PeerWatch"]
