"""The file behind a :class:`~kvtier.region.SharedRegion`: its header, its locks, and the sweep.

A region file is ``PAGE_SIZE + num_rows * row_stride`` bytes in a shared-memory
directory. Its first page::

    offset size field
    0      8    magic b"KVTREG02"
    8      4    format version (2)
    12     4    expected mappers
    16     8    rows
    24     8    row bytes
    32     8    row stride (row bytes rounded up to the page size)
    40     8    creator pid (informational)
    48     16   generation: random per start, so a start never joins another's file
    512    4    attach counter (guarded by an OFD lock on its 4 bytes)
    1024   1    creator lock: an OFD write lock the creator holds while it maps the file
    1536   1    name lock: held while the path is checked and unlinked
    2048   1    scheduler lock: an OFD write lock the start's scheduler holds while it maps the file;
                the byte is 1 once a scheduler mapped it (the lock free then: the start's scheduler is
                gone, and the start with it)

Liveness (every lock is dropped by the kernel when its holder dies):

* every mapper holds a shared ``flock``: a file whose exclusive flock can be
  taken has no live user and is *stale* (the sweep removes exactly those);
* the creator holds the creator lock: a file whose creator lock is free belongs
  to a dead (or finished) start and is never joined; a new start replaces it.

Every unlink of a region path happens under that file's name lock, after
checking that the path still names that very inode, so no process ever unlinks
a newer file of the same name. Format 1 files (``KVTREG01``, no generation and
no creator lock) are recognized so the sweep can clean them up.

The sweep (:func:`sweep`) looks at entries named like regions and treats each as
untrusted (:mod:`kvtier.untrusted`): symlinks, FIFOs, sockets, devices,
directories, other users' files and files without a valid header are reported
as ignored, never opened for I/O, never deleted, never waited on.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.errors import UnsafeEntryError
from kvtier.units import round_up
from kvtier.untrusted import (
    inspect_entry,
    lock_range,
    range_locked_elsewhere,
    reopen,
    try_flock,
    unlock_range,
)

logger = logging.getLogger(__name__)

PAGE_SIZE = mmap.PAGESIZE
FILE_PREFIX = "kvtier-"
FILE_SUFFIX = ".shm"
TMP_PREFIX = f".{FILE_PREFIX}tmp-"
MAGIC = b"KVTREG02"
FORMAT_VERSION = 2
_OLD_MAGIC = b"KVTREG01"
_HEADER = struct.Struct("<8sIIQQQQ16s")
_OLD_HEADER = struct.Struct("<8sIIQQQQ")
ATTACH_COUNT_OFFSET = 512
CREATOR_LOCK_OFFSET = 1024
NAME_LOCK_OFFSET = 1536
SCHEDULER_LOCK_OFFSET = 2048
GENERATION_BYTES = 16
NAME_LOCK_TIMEOUT = 5.0
"""Seconds to wait for a name lock; holders keep it for microseconds."""


@dataclass(frozen=True)
class RegionHeader:
    """The fields of a region file's first page."""

    expected_mappers: int
    num_rows: int
    row_bytes: int
    row_stride: int
    creator_pid: int
    generation: bytes
    version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return PAGE_SIZE + self.num_rows * self.row_stride

    def pack(self) -> bytes:
        return _HEADER.pack(
            MAGIC, FORMAT_VERSION, self.expected_mappers, self.num_rows, self.row_bytes, self.row_stride,
            self.creator_pid, self.generation,
        )


def parse_header(raw: bytes, file_size: int) -> RegionHeader | str:
    """The header of a file of ``file_size`` bytes starting with ``raw``, or why it is no region."""
    if len(raw) < _HEADER.size:
        return f"not a kvtier region ({file_size} bytes, too short for a header)"
    magic = raw[:8]
    if magic == MAGIC:
        _, version, expected, rows, row_bytes, stride, pid, generation = _HEADER.unpack_from(raw)
    elif magic == _OLD_MAGIC:
        _, version, expected, rows, row_bytes, stride, pid = _OLD_HEADER.unpack_from(raw)
        generation = b""
    else:
        return "not a kvtier region (no region header)"
    header = RegionHeader(expected, rows, row_bytes, stride, pid, generation, version)
    if (
        version not in (1, FORMAT_VERSION)
        or expected < 1
        or rows < 1
        or row_bytes < 1
        or stride != round_up(row_bytes)
        or header.total_bytes != file_size
    ):
        return "not a kvtier region (inconsistent header)"
    return header


def read_header(fd: int) -> RegionHeader | str:
    """Read and check the header of an open region file; a string says why it is no region."""
    size = os.fstat(fd).st_size
    return parse_header(os.pread(fd, _HEADER.size, 0), size)


def creator_alive(fd: int) -> bool:
    """True while the creator of this (format 2) file still holds its creator lock."""
    return range_locked_elsewhere(fd, CREATOR_LOCK_OFFSET)


def unlink_if_same(path: Path, fd: int, timeout: float = NAME_LOCK_TIMEOUT) -> bool:
    """Unlink ``path`` if it still names the file open as ``fd``; True if it did.

    Runs under the file's name lock (``fd`` must be open for writing), so two
    processes never both act on one check, and never unlinks a newer file that
    took the name. A name lock that cannot be taken within ``timeout`` (a stuck
    process of the same user) leaves the path alone and logs why.
    """
    try:
        lock_range(fd, NAME_LOCK_OFFSET, timeout=timeout, what=f"the name lock of {path}")
    except TimeoutError as exc:
        logger.warning("region path %s left in place: %s", path, exc)
        return False
    try:
        mine = os.fstat(fd)
        try:
            there = os.lstat(path)
        except FileNotFoundError:
            return False
        if (there.st_dev, there.st_ino) != (mine.st_dev, mine.st_ino):
            return False
        os.unlink(path)
        return True
    finally:
        unlock_range(fd, NAME_LOCK_OFFSET)


# --- the sweep ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class StaleRegion:
    """A region file no live process holds (``removed``: the sweep deleted it)."""

    path: Path
    size: int
    removed: bool


@dataclass(frozen=True)
class IgnoredEntry:
    """An entry named like a region that is not one of ours; never opened for I/O nor deleted."""

    path: Path
    reason: str


@dataclass
class ShmSweep:
    """What :func:`sweep` found in one directory."""

    directory: Path
    stale: list[StaleRegion] = field(default_factory=list)
    ignored: list[IgnoredEntry] = field(default_factory=list)
    live: list[Path] = field(default_factory=list)


def is_region_name(name: str) -> bool:
    """True for names kvtier gives region files (``kvtier-*.shm``) and their temp files."""
    return name.endswith(FILE_SUFFIX) and (name.startswith(FILE_PREFIX) or name.startswith(TMP_PREFIX))


def sweep(shm_dir: str | os.PathLike[str] = "/dev/shm", remove: bool = False) -> ShmSweep:
    """Find (and with ``remove``, delete) region files of this user that no live process holds.

    A file counts as a stale region only when proven: a regular file owned by this
    uid, with a valid header, whose exclusive flock can be taken (no live mapper).
    Anything else named like a region is listed in ``ignored`` with the reason.
    Never blocks (every lock is tried without waiting), never follows a link.
    """
    directory = Path(shm_dir)
    result = ShmSweep(directory)
    try:
        names = sorted(e.name for e in os.scandir(directory) if is_region_name(e.name))
    except FileNotFoundError:
        return result
    uid = os.geteuid()
    for name in names:
        path = directory / name
        try:
            _sweep_one(path, uid, remove, result)
        except FileNotFoundError:
            continue  # gone meanwhile: its owner unlinked it
        except UnsafeEntryError as exc:
            result.ignored.append(IgnoredEntry(path, exc.reason))
        except OSError as exc:
            result.ignored.append(IgnoredEntry(path, f"unreadable ({exc.strerror or exc})"))
    if result.ignored:
        logger.info(
            "shm sweep of %s ignored %d entr%s named like regions that are not ours: %s",
            directory, len(result.ignored), "y" if len(result.ignored) == 1 else "ies",
            "; ".join(f"{e.path.name}: {e.reason}" for e in result.ignored[:5]),
        )
    return result


def _sweep_one(path: Path, uid: int, remove: bool, result: ShmSweep) -> None:
    path_fd = inspect_entry(path, owner=uid)
    try:
        fd = reopen(path_fd, os.O_RDWR)
    finally:
        os.close(path_fd)
    try:
        header = read_header(fd)
        if isinstance(header, str):
            result.ignored.append(IgnoredEntry(path, header))
            return
        if not try_flock(fd, exclusive=True):
            result.live.append(path)
            return
        size = os.fstat(fd).st_size
        removed = False
        if remove:
            removed = unlink_if_same(path, fd)
            if removed:
                logger.info("removed stale region %s (%d bytes, creator pid %d)", path, size, header.creator_pid)
        result.stale.append(StaleRegion(path, size, removed))
    finally:
        os.close(fd)  # drops the flock we may hold


def link_fd(fd: int, path: Path) -> None:
    """Give an O_TMPFILE file a name, atomically; FileExistsError if the name is taken."""
    proc_fd = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # linkat(..., AT_SYMLINK_FOLLOW) through /proc: plain link() would not follow the magic link.
        os.link(str(fd), path, src_dir_fd=proc_fd, follow_symlinks=True)
    finally:
        os.close(proc_fd)


def tmpfile_unsupported(exc: OSError) -> bool:
    """True if ``open(dir, O_TMPFILE)`` failed because the file system lacks O_TMPFILE."""
    return exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL)
