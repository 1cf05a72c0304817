"""The size bound of an fs tier's namespace, shared by every engine that uses it, kept without a lock.

Several engines (processes on one host, hosts on NFS) may share one namespace
directory. Its ``max_bytes`` bounds the namespace's value files as a whole,
whoever wrote them, and every engine enforces it: before a store links a new
file in, the engine makes room for it by evicting (its own least recently used
files first, then files found on disk: other engines' files included).

How the engines agree on how many files there are, with no lock and no server:

* **One ledger per tier instance**, ``ledger/<instance>`` (the name of its
  ``tmp/<instance>`` directory): the number of value files that instance added
  to the shards minus those it removed (any engine's), as one 32-byte record
  (magic, count, sequence, xxh64). Only its owner writes it (one ``pwrite``);
  everyone reads it. The namespace's file count is the sum of all ledgers.
* **Claim, then check.** A store first adds one to its own ledger and
  publishes it, then reads every ledger; if the sum is over the bound it evicts
  until it is not (reading the ledgers again after its evictions), and only
  then links its file in. Threads of one engine do not evict twice for the same
  excess: each plans only what the others have not planned already.
* **Counts are published at once**, increments and decrements: a count that stays
  too high makes the other engines evict early, and with every engine doing so
  the namespace would settle about one file per engine below its bound. A publish
  that fails is retried by housekeeping (:meth:`SharedBudget.flush`). A removal is counted after
  its ``unlink`` (or move out of the shard) succeeded; one that finds nothing
  counts nothing (whoever removed the file counted it). Since every claimant
  publishes before it reads, of two concurrent claimants at least one sees the
  other's claim, so *files in the shards + checked claims <= capacity* holds at
  every instant, for any number of engines (each check includes every claim
  published before it, and a claim is checked before its file is linked).
* **No double counting of one key.** Files are linked into place, never renamed
  over an existing entry: a store that finds its key already there (another
  engine was first) gives its claim back.
* **Dead engines' ledgers are adopted.** The ledger of an instance whose lock in
  ``tmp/`` is free keeps counting until a live engine renames it to a name of
  its own (one renamer wins), adds its count to its own ledger and deletes it.
* **Claims not yet linked are in the record too**, so an adopter does not take
  them for files. A record holds the count and, in the top 16 bits of its
  sequence field, how many of its claims are *unsettled*: claimed, their file
  being written. A store settles its claim (one more publish) just before it
  links its file; the adopter counts ``count - unsettled``. A process killed
  while writing its files (most of a store's time) so leaves no phantom file
  behind. Older releases ignore those bits (and write 0 there: their claims are
  adopted as files, as before).
* **Drift only makes the bound stricter.** A process killed between settling a
  claim and linking its file, between an eviction's ``unlink`` and its count, or
  inside an adoption leaves the sum above the truth, by a file or so; without
  the unsettled count every kill during a store would (one file per store in
  flight), and a namespace whose engines are killed again and again, while one
  of them lives, would end up counted full while empty. An engine that
  starts while no other is alive resets the sum to what its start-up scan counted;
  any engine whose scan counts more files than the sum (a root written by an
  older release, a deleted ledger) adds the difference.

On NFS the ledgers are read through the client's cache: the sum lags by the
attribute cache timeout (``actimeo``), plus up to a housekeeping tick (50 ms) while
the writer's stores are queued (its descriptor, which sends its writes to the
server when closed, is closed at every tick), and the bound may be overshot by
what the other hosts wrote in that time; ENOSPC handling still protects the disk.
A host that crashes (not a killed process: its close still sends the writes) may
lose its last tick of updates, leaving the sum low by the files it linked then.

Thread-safe: the tier's I/O threads call :meth:`SharedBudget.claim`,
:meth:`~SharedBudget.settle`, :meth:`~SharedBudget.give_back`, :meth:`~SharedBudget.recheck`,
:meth:`~SharedBudget.release`, :meth:`~SharedBudget.cancel`, :meth:`~SharedBudget.idle`;
housekeeping calls
:meth:`~SharedBudget.refresh` and :meth:`~SharedBudget.adopt_dead`; the scheduler
thread only reads cached figures (:attr:`~SharedBudget.used_files`). Every call
but those reads does small local file I/O.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import re
import stat
import struct
import threading
import time
from dataclasses import dataclass

import xxhash

from kvtier.errors import UnsafeEntryError
from kvtier.failures import describe_error
from kvtier.tiers.fs_files import NamespaceDir, create_file, read_head
from kvtier.tiers.fs_layout import LEDGER_DIR, instance_alive, is_no_space
from kvtier.untrusted import SAFE_OPEN_FLAGS, open_regular

logger = logging.getLogger(__name__)

_HEAD = struct.Struct("<8sqQ")  # magic, files (signed: an engine may remove more than it adds), sequence
_MAGIC = b"KVLEDGR1"
RECORD_BYTES = _HEAD.size + 8
_UNSETTLED_SHIFT = 48  # the sequence field's top 16 bits: unsettled claims (older releases write 0)
_SEQUENCE_MASK = (1 << _UNSETTLED_SHIFT) - 1
MAX_UNSETTLED = (1 << (64 - _UNSETTLED_SHIFT)) - 1
_NAME_RE = re.compile(r"^(\d+-[0-9a-f]{12})(?:\.adopt\.\d+)?$")
_RELIST_RECENT_SECONDS = 2.0
"""A ledger directory changed this recently is listed again even when it looks unchanged (every
``_RELIST_EVERY`` seconds at most): its mtime may be too coarse (1 s on some file systems) to
show a second change."""
_RELIST_EVERY = 0.25


def pack_record(files: int, sequence: int, unsettled: int = 0) -> bytes:
    """A ledger record: count ``files`` (claims included), publish number ``sequence`` (kept to
    48 bits), ``unsettled`` of the claims not linked yet (0 to :data:`MAX_UNSETTLED`)."""
    if not 0 <= unsettled <= MAX_UNSETTLED:
        raise ValueError(f"unsettled claims must be 0..{MAX_UNSETTLED}, not {unsettled}")
    head = _HEAD.pack(_MAGIC, files, (sequence & _SEQUENCE_MASK) | (unsettled << _UNSETTLED_SHIFT))
    return head + xxhash.xxh64_intdigest(head).to_bytes(8, "little")


def read_record(data: bytes) -> tuple[int, int] | None:
    """A ledger record's (count, unsettled claims); (0, 0) for an empty (just created) ledger;
    None if it is not a valid record."""
    if not data:
        return 0, 0
    if len(data) != RECORD_BYTES or xxhash.xxh64_intdigest(data[: _HEAD.size]) != int.from_bytes(
        data[_HEAD.size :], "little"
    ):
        return None
    magic, files, sequence = _HEAD.unpack(data[: _HEAD.size])
    return (files, sequence >> _UNSETTLED_SHIFT) if magic == _MAGIC else None


def parse_record(data: bytes) -> int | None:
    """The file count of a ledger record (unsettled claims included); 0 for an empty (just
    created) ledger; None if invalid."""
    record = read_record(data)
    return None if record is None else record[0]


@dataclass
class _Ledger:
    """Another instance's ledger, held open for reading."""

    name: str
    owner: str
    fd: int
    files: int = 0  # the last valid count read


class SharedBudget:
    """The namespace's file count (the sum of every instance's ledger) against its capacity.

    ``dirs`` is the namespace directory, ``instance`` this tier instance's name (its
    ``tmp`` directory), ``max_files`` the bound (``max_bytes // file size``). Creates this
    instance's ledger; raises OSError if it cannot. See the module docstring.
    """

    def __init__(self, dirs: NamespaceDir, instance: str, max_files: int) -> None:
        self._dirs = dirs
        self.instance = instance
        self.max_files = max(1, int(max_files))
        self._capacity = self.max_files
        self._lock = threading.Lock()
        self._own = 0
        self._unsettled = 0  # claims counted in _own whose file is not linked yet
        self._evicting = 0  # evictions planned by this instance's threads and not done yet
        self._seq = 0
        self._write_fd = -1  # this ledger open for writing while the tier stores (see _publish)
        self._changes = 0
        self._ledgers: dict[tuple[int, int], _Ledger] = {}
        self._signature: tuple[int, ...] | None = None
        self._listed = 0.0
        self._total = 0
        self._publish_error: str | None = None
        self._dirty = False
        self._adopt_names = itertools.count(1)
        self._unsafe: set[tuple[int, int]] = set()
        self._unadoptable: set[str] = set()
        self.adopted = 0
        """Ledgers of dead instances adopted by this one."""
        self._dir_fd = dirs.subdir(LEDGER_DIR)
        created = False
        try:
            fd = create_file(self._dir_fd, instance, 0, dirs.modes)
            created = True
            try:
                st = os.fstat(fd)
                self._ident = (st.st_dev, st.st_ino)
                self._write_first_record(fd)
            finally:
                os.close(fd)
        except BaseException:
            if created:  # a start that fails leaves no ledger behind
                with contextlib.suppress(OSError):
                    os.unlink(instance, dir_fd=self._dir_fd)
            self.close()
            raise

    def _write_first_record(self, fd: int) -> None:
        """Write the new ledger's first record (count 0), which allocates what every later publish
        overwrites. On a full disk (ENOSPC, EDQUOT: a tier that filled it before a restart) the
        ledger stays empty, which reads as 0, and the record is published by the next
        :meth:`flush` or count change that finds room (the tier evicts to make it): the tier
        starts and serves what the disk holds. Raises any other OSError."""
        try:
            os.pwrite(fd, pack_record(0, 0), 0)
        except OSError as exc:
            if not is_no_space(exc):
                raise
            self._dirty = True
            self._publish_error = str(exc)
            logger.warning("fs tier %s: cannot write its ledger yet: %s", self._dirs.path, describe_error(exc))

    # --- cached figures (any thread, no I/O) -------------------------------------------------------

    @property
    def used_files(self) -> int:
        """The namespace's file count as last read (claims in flight included)."""
        return self._total

    @property
    def capacity(self) -> int:
        """Effective capacity in files: ``max_files``, or less after the disk ran out of space."""
        return self._capacity

    @property
    def own_files(self) -> int:
        """This instance's ledger: files it added minus files it removed."""
        return self._own

    @property
    def unsafe_entries(self) -> int:
        """Entries of ``ledger/`` named like ledgers that are not valid ledgers of ours (ignored)."""
        return len(self._unsafe)

    # --- I/O threads ----------------------------------------------------------------------------

    def claim(self) -> int:
        """Count one more file (a store about to link one in), unsettled, then :meth:`recheck`.
        The caller calls :meth:`settle` just before it links the file, and gives the claim back
        with :meth:`give_back` if it links nothing."""
        with self._lock:
            self._own += 1
            self._unsettled += 1
            self._changes += 1
            self._publish()
            try:
                return self._plan_locked()
            except BaseException:
                self._own -= 1
                self._unsettled -= 1
                self._publish()
                raise

    def settle(self) -> None:
        """A claim's file is about to be linked: from now on an adopter of this ledger counts it
        as a file (a kill before the link leaves the sum a file too high, never too low)."""
        with self._lock:
            self._unsettled = max(0, self._unsettled - 1)
            self._publish()

    def give_back(self, settled: bool) -> None:
        """A claim's store linked nothing: count it no more (``settled``: :meth:`settle` was called)."""
        with self._lock:
            self._own -= 1
            if not settled:
                self._unsettled = max(0, self._unsettled - 1)
            self._changes += 1
            self._publish()

    def recheck(self) -> int:
        """How many files the caller must evict now: what the namespace is over its capacity
        (every ledger read now) less what this instance's other threads plan to evict. The
        caller reports each removal with ``release(n, planned=True)`` and gives back what it
        could not evict with :meth:`cancel`; after evicting it calls this again, until 0."""
        with self._lock:
            return self._plan_locked()

    def release(self, files: int, planned: bool = False) -> None:
        """Count ``files`` fewer: files removed from the shards (``planned``: evictions that
        :meth:`claim`/:meth:`recheck` asked for). A claim is given back with :meth:`give_back`."""
        if files:
            with self._lock:
                self._own -= files
                if planned:
                    self._evicting = max(0, self._evicting - files)
                self._changes += 1
                self._publish()

    def flush(self) -> None:
        """Publish the count again if the last publish failed, and close the ledger's write
        descriptor (housekeeping, every tick, busy or not; shutdown): on NFS a write reaches the
        server, and the other hosts, when its descriptor is closed (close-to-open consistency),
        so a busy tier's count is sent at least once a tick."""
        with self._lock:
            if self._dirty:
                self._publish()
            self._close_write_fd()

    def idle(self) -> None:
        """No store is queued (a write thread, after its store): close the ledger's write
        descriptor unless a claim is still being written (that thread's next publish would
        open it again)."""
        with self._lock:
            if self._unsettled == 0:
                self._close_write_fd()

    def cancel(self, files: int) -> None:
        """``files`` planned evictions will not happen (nothing left to evict)."""
        if files > 0:
            with self._lock:
                self._evicting = max(0, self._evicting - files)

    def refresh(self) -> int:
        """Read every ledger again; returns the file count (housekeeping)."""
        with self._lock:
            return self._total_locked()

    def set_capacity(self, files: int) -> None:
        """Change the effective capacity, clamped to ``[1, max_files]``."""
        with self._lock:
            self._capacity = max(1, min(self.max_files, int(files)))

    def lower_capacity_to_used(self) -> int:
        """After ENOSPC: what the namespace holds now (claims in flight included) is all that fits."""
        with self._lock:
            self._capacity = max(1, min(self._capacity, self._total_locked()))
            return self._capacity

    def mark(self) -> tuple[int, tuple[int, ...] | None]:
        """A token of this instance's activity and the ledger directory's state (before a scan)."""
        with self._lock:
            self._total_locked()
            return self._changes, self._signature

    def reconcile(self, scanned: int, mark: tuple[int, tuple[int, ...] | None]) -> int:
        """The start-up scan counted ``scanned`` value files: fix the sum where it is provably
        wrong. If no other ledger exists and nothing changed since :meth:`mark` (this
        instance is alone and stored nothing meanwhile), the sum becomes ``scanned``;
        otherwise it only ever grows to ``scanned``. Returns the change."""
        with self._lock:
            total = self._total_locked()
            alone = not self._ledgers and (self._changes, self._signature) == mark
            change = scanned - total
            if change < 0 and not alone:
                change = 0
            if change:
                self._own += change
                self._changes += 1
                self._publish()
                self._total += change
            return change

    def adopt_dead(self) -> int:
        """Adopt the ledgers of dead instances (their lock in ``tmp/`` is free); returns how many."""
        with self._lock:
            self._total_locked()
            candidates = [
                (led.name, led.owner)
                for led in self._ledgers.values()
                if led.owner != self.instance and led.name not in self._unadoptable
            ]
        adopted = 0
        for name, owner in candidates:
            if instance_alive(self._dirs.path, owner):
                continue
            if self._adopt(name):
                adopted += 1
        if adopted:
            self.adopted += adopted
            logger.info("fs tier %s: adopted %d ledger(s) of dead instances", self._dirs.path, adopted)
        return adopted

    def close(self) -> None:
        """Publish the last count and close every descriptor; this instance's ledger stays (a
        later instance adopts it)."""
        self.flush()
        with self._lock:
            self._close_write_fd()
            for ledger in self._ledgers.values():
                os.close(ledger.fd)
            self._ledgers = {}
            if self._dir_fd >= 0:
                os.close(self._dir_fd)
                self._dir_fd = -1

    # --- internals (caller holds _lock) ------------------------------------------------------------

    def _publish(self) -> None:
        """Write this instance's count. A failure is logged, never raised: the count in memory
        stays right and the next publish carries it (the record was allocated at creation, so
        overwriting it needs no space).

        The write descriptor is opened by name (and checked to be this ledger's inode) when
        none is open and kept while stores are queued (an open and close per publish cost more
        than the write, and a store that evicts publishes three times); :meth:`idle` closes it
        when the store queue runs empty and :meth:`flush` at every housekeeping tick, so an
        idle tier holds no descriptor open for writing (which would keep the file system from
        being remounted read-only) and a busy one's count reaches an NFS server within a tick
        (a close sends an NFS client's writes to the server)."""
        self._seq += 1
        self._dirty = False
        try:
            if self._write_fd < 0:
                # Kept from the open on: the except clause below closes it, whatever fails.
                self._write_fd = os.open(self.instance, os.O_WRONLY | SAFE_OPEN_FLAGS, dir_fd=self._dir_fd)
                st = os.fstat(self._write_fd)
                if (st.st_dev, st.st_ino) != self._ident:
                    raise OSError(errno.ESTALE, "the ledger was replaced")
            os.pwrite(self._write_fd, pack_record(self._own, self._seq, min(self._unsettled, MAX_UNSETTLED)), 0)
        except OSError as exc:
            self._close_write_fd()
            if self._publish_error is None:
                logger.warning("fs tier %s: cannot update its ledger: %s", self._dirs.path, describe_error(exc))
            self._publish_error = str(exc)
            self._dirty = True
            return
        self._publish_error = None

    def _close_write_fd(self) -> None:
        if self._write_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._write_fd)
            self._write_fd = -1

    def _plan_locked(self) -> int:
        need = max(0, self._total_locked() - self._capacity - self._evicting)
        self._evicting += need
        return need

    def _total_locked(self) -> int:
        self._relist()
        total = self._own
        for ledger in self._ledgers.values():
            total += self._read(ledger)
        self._total = total
        return total

    def _read(self, ledger: _Ledger) -> int:
        for _ in range(3):  # a read racing the owner's pwrite may see a torn record: read again
            try:
                data = os.pread(ledger.fd, RECORD_BYTES, 0)
            except OSError:
                break
            files = parse_record(data)
            if files is not None:
                ledger.files = files
                return files
        return ledger.files

    def _relist(self) -> None:
        """Open the ledgers that appeared, close those that went (only when the directory changed)."""
        st = os.fstat(self._dir_fd)
        signature = (st.st_mtime_ns, st.st_ctime_ns, st.st_nlink, st.st_size)
        if signature == self._signature:
            now = time.monotonic()
            if now - self._listed < _RELIST_EVERY or time.time() - st.st_mtime > _RELIST_RECENT_SECONDS:
                return
        self._signature = signature
        self._listed = time.monotonic()
        found: dict[tuple[int, int], _Ledger] = {}
        with os.scandir(self._dir_fd) as entries:
            for entry in entries:
                match = _NAME_RE.match(entry.name)
                if match is None:
                    continue
                try:
                    est = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                ident = (est.st_dev, est.st_ino)
                if ident == self._ident:
                    continue
                ledger = self._ledgers.pop(ident, None) or self._open(entry.name, match.group(1), est)
                if ledger is not None:
                    ledger.name, ledger.owner = entry.name, match.group(1)
                    found[ident] = ledger
        for gone in self._ledgers.values():
            os.close(gone.fd)
        self._ledgers = found

    def _open(self, name: str, owner: str, est: os.stat_result) -> _Ledger | None:
        """Open another instance's ledger for reading: a regular file of ours (or the group's)."""
        ident = (est.st_dev, est.st_ino)
        reason = None
        if not stat.S_ISREG(est.st_mode) or not self._dirs.modes.trusted(est):
            reason = "not a regular file of this user or group"
        else:
            try:
                fd = open_regular(name, os.O_RDONLY, dir_fd=self._dir_fd)
            except FileNotFoundError:
                return None
            except (OSError, UnsafeEntryError) as exc:
                reason = str(exc)
            else:
                fst = os.fstat(fd)
                if (fst.st_dev, fst.st_ino) == ident:
                    return _Ledger(name, owner, fd)
                os.close(fd)  # replaced between the listing and the open: seen at the next listing
                return None
        if ident not in self._unsafe:
            self._unsafe.add(ident)
            logger.warning("fs tier %s: ignoring ledger/%s: %s", self._dirs.path, name, reason)
        return None

    def _adopt(self, name: str) -> bool:
        """Rename a dead instance's ledger to a name of ours, add its count less its unsettled
        claims (files it never linked) to ours, delete it."""
        d = self._dir_fd
        taken = f"{self.instance}.adopt.{next(self._adopt_names)}"
        try:
            os.rename(name, taken, src_dir_fd=d, dst_dir_fd=d)
        except OSError:
            return False  # another engine adopted it first
        try:
            head = read_head(d, taken, self._dirs.modes, RECORD_BYTES)[1]
            data = b"?" if head is None else head
        except (OSError, UnsafeEntryError):
            data = b"?"
        record = read_record(data)
        if record is None:  # not a ledger of ours after all: put it back, untouched
            self._unadoptable.add(name)
            with contextlib.suppress(OSError):
                os.rename(taken, name, src_dir_fd=d, dst_dir_fd=d)
            return False
        files, unsettled = record
        with self._lock:
            self._own += files - unsettled
            self._changes += 1
            self._publish()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(taken, dir_fd=d)
            self._total_locked()
        return True


__all__ = ["MAX_UNSETTLED", "RECORD_BYTES", "SharedBudget", "pack_record", "parse_record", "read_record"]
