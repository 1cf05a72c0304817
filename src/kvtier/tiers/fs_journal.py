"""Change journals of an fs tier's namespace: how engines sharing a root learn each other's files.

Every tier instance appends to its own journal, ``journal/<instance>.<segment>``, one
80-byte record per value file it linked into a shard (*added*) or removed from one
(*removed*): the key and the time. Only its owner writes it. Every other engine
sharing the root reads it from where it last stopped, on an I/O thread about every
0.05-0.1 s, and applies the records to its index: a key another engine added becomes
a HIT in memory, one it removed a MISS. Lookups never touch the disk and never wait,
and they see other engines' blocks about 0.1 s after they were written. Directory
listings and inotify play no part: a journal is a plain file read at an offset.

Nothing here is trusted for correctness: a record only changes what the index
believes. A key believed present whose file is gone is a MISS at load time (the file
vanished); a file whose record was missed is found by the next start-up scan or a
search for eviction victims, or not at all (a lost hit, never a wrong byte). So
records lost to rotation, torn by a crash, planted or garbled (each carries an xxh32)
cost hits, nothing else.

* **Appends**: records are buffered and written by :meth:`JournalWriter.flush` (after a
  store that leaves no other store queued, else by the tier's housekeeping within 50 ms),
  one ``write`` on a descriptor opened for it
  (``O_APPEND``; no descriptor stays open for writing, so the file system can still be
  remounted read-only). A failed append is logged and dropped.
* **Segments**: past :data:`SEGMENT_BYTES` a journal starts a new segment and deletes
  the one before the previous, so it holds at most three; a reader that fell further
  behind skips ahead (losing records: lost hits). One flush goes to one segment (one
  larger than a segment makes a longer one; past :data:`MAX_SEGMENT_BYTES`, about
  840,000 records, the rest is dropped: lost hits). A segment longer than that (planted,
  or from a broken writer) is never read, and each :meth:`JournalReader.read` parses at
  most :data:`READ_BUDGET` bytes (the rest waits for the next call, whose first journal
  is the next one in turn), so housekeeping and shutdown never wait on a huge file.
* **Readers start at the current ends** (their start-up scan saw what came before) and
  read a journal that appears later from its beginning.
* **Dead instances' journals** (their lock in ``tmp/`` is free) are deleted by any
  engine once their newest segment is :data:`STALE_SECONDS` old, each segment only if it
  is empty or begins with a valid record (or is a first record torn short): a file merely
  named like a segment is kept.
* **On NFS** every read reopens the segment (close-to-open consistency: a fresh size and
  fresh data) and every append ends with a close, which sends it to the server.

Entries of ``journal/`` that are not regular files of this user (or the shared
group), or not named like segments, are never opened or deleted. Thread-safe;
every method does small local file I/O (I/O threads and the constructor only).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash

from kvtier.errors import UnsafeEntryError
from kvtier.failures import describe_error
from kvtier.tiers.format import MAX_KEY_BYTES
from kvtier.tiers.fs_files import NamespaceDir, create_file, read_head
from kvtier.tiers.fs_layout import INSTANCE_NAME, JOURNAL_DIR, instance_alive
from kvtier.untrusted import SAFE_OPEN_FLAGS, open_regular

logger = logging.getLogger(__name__)

ADDED = 1
REMOVED = 2
_BODY = struct.Struct(f"<2sBBd{MAX_KEY_BYTES}s")  # magic, op, key length, time (wall clock), key
_MAGIC = b"KJ"
RECORD_BYTES = _BODY.size + 4  # + xxh32 of the body
SEGMENT_BYTES = 1 << 20
"""A journal starts a new segment past this size (13,107 records)."""
STALE_SECONDS = 60.0
"""A dead instance's journal is deleted once its newest segment is this old."""
MAX_SEGMENT_BYTES = 64 * SEGMENT_BYTES
"""A segment longer than this is not a journal's (its writer never makes one): never read."""
READ_BUDGET = 8 << 20
"""Bytes :meth:`JournalReader.read` parses at most in one call."""
_MAX_READ = 4 << 20
_NAME_RE = re.compile(rf"^({INSTANCE_NAME})\.(\d{{1,9}})$")

Entry = tuple[int, float, bytes]
"""``(ADDED or REMOVED, wall-clock time, key)``."""


def pack_entry(op: int, key: bytes, when: float) -> bytes:
    body = _BODY.pack(_MAGIC, op, len(key), when, key)
    return body + xxhash.xxh32_intdigest(body).to_bytes(4, "little")


def parse_entries(data: bytes) -> tuple[list[Entry], int]:
    """The valid entries of whole records in ``data``, and how many records were invalid."""
    entries: list[Entry] = []
    bad = 0
    size = _BODY.size
    for start in range(0, len(data) - RECORD_BYTES + 1, RECORD_BYTES):
        body = data[start : start + size]
        if xxhash.xxh32_intdigest(body) != int.from_bytes(data[start + size : start + RECORD_BYTES], "little"):
            bad += 1
            continue
        magic, op, length, when, key = _BODY.unpack(body)
        if magic != _MAGIC or op not in (ADDED, REMOVED) or not 0 < length <= MAX_KEY_BYTES:
            bad += 1
            continue
        entries.append((op, when, key[:length]))
    return entries, bad


def _segment_name(instance: str, segment: int) -> str:
    return f"{instance}.{segment}"


class JournalWriter:
    """This instance's journal; see the module docstring. Creates its first segment."""

    def __init__(self, dirs: NamespaceDir, instance: str) -> None:
        self._modes = dirs.modes
        self._path = dirs.path
        self.instance = instance
        self._lock = threading.Lock()
        self._pending: list[bytes] = []
        self._segment = 1
        self._size = 0
        self._error: str | None = None
        self._dir_fd = dirs.subdir(JOURNAL_DIR)
        try:
            os.close(create_file(self._dir_fd, _segment_name(instance, 1), 0, dirs.modes))
        except BaseException:
            os.close(self._dir_fd)
            raise

    def append(self, op: int, keys: Iterable[bytes], when: float | None = None) -> None:
        """Record that ``keys`` were added to (or removed from) the shards (written by :meth:`flush`)."""
        stamp = time.time() if when is None else when
        records = [pack_entry(op, key, stamp) for key in keys]
        if records:
            with self._lock:
                self._pending += records

    def flush(self) -> None:
        """Write the buffered records. Never raises (a failure is logged, the records dropped)."""
        if not self._pending:
            return
        with self._lock:
            records = b"".join(self._pending)
            self._pending = []
            if not records or self._dir_fd < 0:
                return
            try:
                # One flush, one segment (a rotation deletes the segment before the previous: a
                # flush split over segments would delete its own first records before anyone read
                # them). A flush larger than a segment makes a longer one, up to MAX_SEGMENT_BYTES.
                if self._size + len(records) > SEGMENT_BYTES and self._size:
                    self._rotate()
                self._append(memoryview(records[: MAX_SEGMENT_BYTES - MAX_SEGMENT_BYTES % RECORD_BYTES]))
                self._error = None
            except OSError as exc:
                if self._error is None:
                    logger.warning("fs tier %s: cannot append to its journal: %s", self._path, describe_error(exc))
                self._error = str(exc)

    def _append(self, piece: memoryview) -> None:
        """Write ``piece`` (whole records) at the end of the current segment."""
        fd = os.open(_segment_name(self.instance, self._segment), os.O_WRONLY | os.O_APPEND | SAFE_OPEN_FLAGS,
                     dir_fd=self._dir_fd)  # fmt: skip
        size = len(piece)
        try:
            while piece:
                piece = piece[os.write(fd, piece) :]
        finally:
            os.close(fd)
        self._size += size

    def _rotate(self) -> None:
        self._segment += 1
        os.close(create_file(self._dir_fd, _segment_name(self.instance, self._segment), 0, self._modes))
        self._size = 0
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_segment_name(self.instance, self._segment - 2), dir_fd=self._dir_fd)

    def close(self) -> None:
        """Write what is buffered and stop; the journal stays for readers (deleted once its
        instance is dead and stale)."""
        self.flush()
        with self._lock:
            if self._dir_fd >= 0:
                os.close(self._dir_fd)
                self._dir_fd = -1


@dataclass
class _Cursor:
    segment: int
    offset: int


class JournalReader:
    """Follows every other instance's journal from where it last stopped; see the module docstring."""

    def __init__(self, dirs: NamespaceDir, instance: str) -> None:
        self._modes = dirs.modes
        self._path = dirs.path
        self.instance = instance
        self._lock = threading.Lock()
        self._cursors: dict[str, _Cursor] = {}
        self._unsafe: set[str] = set()
        self._turn = 0  # the journal read first by the next read(), in name order
        self.bad_records = 0
        """Records that failed their checksum or made no sense (skipped)."""
        self._dir_fd = dirs.subdir(JOURNAL_DIR)
        try:
            for owner, segments in self._segments().items():
                last = segments[-1]
                end = self._size(owner, last)
                self._cursors[owner] = _Cursor(last, end - end % RECORD_BYTES)
        except BaseException:
            os.close(self._dir_fd)
            raise

    @property
    def unsafe_entries(self) -> int:
        return len(self._unsafe)

    def read(self) -> list[Entry]:
        """The records the other instances appended since the last call, in each one's order: all
        of them, or those of the first :data:`READ_BUDGET` bytes (the journals are taken in turn,
        starting one further each call; the rest is read by the next calls)."""
        out: list[Entry] = []
        with self._lock:
            listing = self._segments()
            owners = sorted(listing)
            self._turn = turn = (self._turn + 1) % len(owners) if owners else 0
            budget = READ_BUDGET
            for owner in owners[turn:] + owners[:turn]:
                if budget <= 0:
                    break
                segments = listing[owner]
                cursor = self._cursors.get(owner) or _Cursor(segments[0], 0)
                self._cursors[owner] = cursor
                if cursor.segment not in segments:  # rotated and deleted past us: skip ahead
                    later = [s for s in segments if s > cursor.segment]
                    cursor.segment, cursor.offset = (later[0] if later else segments[-1]), 0
                while True:
                    data = self._read_at(owner, cursor.segment, cursor.offset)
                    whole = len(data) - len(data) % RECORD_BYTES
                    entries, bad = parse_entries(data[:whole])
                    out += entries
                    self.bad_records += bad
                    cursor.offset += whole
                    budget -= len(data)
                    if len(data) == _MAX_READ:
                        if budget <= 0:
                            break
                        continue
                    later = [s for s in segments if s > cursor.segment]
                    if not later:
                        break
                    # The owner appends to its newest segment only: this one is complete (a torn
                    # record at its end, from a failed append, is skipped).
                    cursor.segment, cursor.offset = later[0], 0
            for gone in set(self._cursors) - set(listing):
                del self._cursors[gone]
        return out

    def remove_dead(self) -> int:
        """Delete the journals of dead instances whose newest segment is stale; returns how many
        segments were deleted.

        A segment is deleted only once proven a journal (:meth:`_proven_journal`): a file merely
        named like one (another user's in a shared group, a stray one) is kept and logged once."""
        removed = 0
        now = time.time()
        newest: dict[str, float] = {}
        with self._lock:
            for owner, segments in self._segments(newest).items():
                if now - newest[owner] < STALE_SECONDS or instance_alive(self._path, owner):
                    continue
                for segment in segments:
                    name = _segment_name(owner, segment)
                    proven = self._proven_journal(name)
                    if proven is None:
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
                        if (st.st_dev, st.st_ino) == proven:  # still the file proven (not replaced since)
                            os.unlink(name, dir_fd=self._dir_fd)
                            removed += 1
        return removed

    def _proven_journal(self, name: str) -> tuple[int, int] | None:
        """The (device, inode) of segment ``name`` if it is a journal: a regular file of ours that is
        empty (a journal killed before its first record: nothing to lose), begins with a valid
        record (its magic and checksum), or is shorter than a record and begins with its magic
        (the first append torn, on a full disk); else None, logged once (it is never deleted)."""
        why = "neither empty nor beginning with a journal record"
        try:
            st, head = read_head(self._dir_fd, name, self._modes, RECORD_BYTES)
        except FileNotFoundError:
            return None
        except (OSError, UnsafeEntryError) as exc:
            why = describe_error(exc)
        else:
            if head is None:
                why = "not a file of ours"
            elif not head or parse_entries(head)[0] or (st.st_size < RECORD_BYTES and head.startswith(_MAGIC)):
                return st.st_dev, st.st_ino  # (the last: a first record torn by a failed append)
        if name not in self._unsafe:
            self._unsafe.add(name)
            logger.warning("fs tier %s: keeping journal/%s of a dead instance: %s", self._path, name, why)
        return None

    def close(self) -> None:
        with self._lock:
            if self._dir_fd >= 0:
                os.close(self._dir_fd)
                self._dir_fd = -1

    # --- internals (caller holds _lock, or the constructor) ---------------------------------------

    def _segments(self, newest_mtime: dict[str, float] | None = None) -> dict[str, list[int]]:
        """Other instances' segment numbers, sorted, by owner (regular files of ours only)."""
        found: dict[str, list[int]] = {}
        with os.scandir(self._dir_fd) as entries:
            for entry in entries:
                match = _NAME_RE.match(entry.name)
                if match is None or match.group(1) == self.instance:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(st.st_mode) or not self._modes.trusted(st) or st.st_size > MAX_SEGMENT_BYTES:
                    if entry.name not in self._unsafe:
                        self._unsafe.add(entry.name)
                        ours = stat.S_ISREG(st.st_mode) and self._modes.trusted(st)
                        why = f"{st.st_size} bytes, longer than any journal segment" if ours else \
                            "not a regular file of ours"
                        logger.warning("fs tier %s: ignoring journal/%s: %s", self._path, entry.name, why)
                    continue
                owner = match.group(1)
                found.setdefault(owner, []).append(int(match.group(2)))
                if newest_mtime is not None:
                    newest_mtime[owner] = max(newest_mtime.get(owner, 0.0), st.st_mtime)
        for segments in found.values():
            segments.sort()
        return found

    def _size(self, owner: str, segment: int) -> int:
        try:
            return os.stat(_segment_name(owner, segment), dir_fd=self._dir_fd, follow_symlinks=False).st_size
        except FileNotFoundError:
            return 0

    def _read_at(self, owner: str, segment: int, offset: int) -> bytes:
        """Up to ``_MAX_READ`` bytes of a segment from ``offset`` (reopened: fresh on NFS too); none
        from a segment gone, not a regular file of ours, or whose mode keeps this user out (logged
        once: one such file must not fail every read, nor hide the other engines' records)."""
        name = _segment_name(owner, segment)
        try:
            fd = open_regular(name, os.O_RDONLY, dir_fd=self._dir_fd)
        except (FileNotFoundError, UnsafeEntryError):
            return b""
        except PermissionError as exc:  # a mode that keeps this user out: skipped like an unsafe entry
            if name not in self._unsafe:
                self._unsafe.add(name)
                logger.warning("fs tier %s: ignoring journal/%s: %s", self._path, name, describe_error(exc))
            return b""
        try:
            st = os.fstat(fd)
            if not self._modes.trusted(st) or st.st_size <= offset:
                return b""
            return os.pread(fd, min(_MAX_READ, st.st_size - offset), offset)
        finally:
            os.close(fd)


__all__ = [
    "ADDED",
    "MAX_SEGMENT_BYTES",
    "READ_BUDGET",
    "RECORD_BYTES",
    "REMOVED",
    "SEGMENT_BYTES",
    "STALE_SECONDS",
    "Entry",
    "JournalReader",
    "JournalWriter",
    "pack_entry",
    "parse_entries",
]
