"""Private temporary directories that a crash cannot leak: lock-held while in use, swept when stale.

``kvtier bench`` keeps its fs tier (hundreds of MB) in a temporary directory.
Removing it in a ``finally`` is not enough: ``kill -9`` skips that. So each such
directory holds a lock file that its creator keeps locked (``flock``) for its
whole life; the kernel drops the lock when the process dies, however it dies.
A later start (or ``kvtier sweep``) removes directories whose lock nobody holds.

The parent (``/tmp``) is shared and hostile, so the sweep proves ownership
before it deletes anything, and never follows a symlink:

* only entries named ``<prefix>*`` that are real directories (``lstat``, then
  opened with ``O_NOFOLLOW | O_DIRECTORY`` and checked to be the same inode) of
  this process's uid;
* holding a regular file named :data:`LOCK_NAME` of our uid, opened with
  ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO or device there never blocks us);
* whose lock we can take without waiting: a live owner keeps it, so a held
  lock means "in use" and the directory is left alone. The sweeper holds the
  lock while it deletes, so two sweepers never race on one directory.

Removal (by the owner's :meth:`LockedTempDir.cleanup` or by a sweeper) deletes
everything but the lock file first, then the lock file, then the directory: a
remover killed half way leaves the lock file behind, so the directory is still
provably ours and dead, and the next sweep finishes it.

A directory with no lock file at all (left by a remover killed between the lock
file and the directory, or by a creator killed before its lock was in place) is
empty but for that creator's lock file under its staging name: it is taken as dead once it has not changed for
:data:`_STALE_UNLOCKED_DIR_SECONDS`. One with anything in it is never taken (a
user's own directory named like ours holds something; an older version that
removed the lock file early left such directories too, and they are left alone).
A creator is without its lock only between ``mkdtemp`` and two system calls
later, so that is normally enough; and it stays safe if a creator is stopped
for longer there: the sweeper claims such a directory by creating the lock file
itself (``O_EXCL``), while a creator publishes its already-locked lock file
with ``link`` (which fails if the name exists, unlike ``rename``). Whoever is
first owns the directory; a creator that loses starts over with a new one, so
no directory a live process uses is ever removed.

Called from any thread; each function does blocking file-system I/O.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

logger = logging.getLogger(__name__)

LOCK_NAME = ".kvtier-lock"
"""The lock file inside every locked temporary directory."""

_STALE_UNLOCKED_DIR_SECONDS = 60.0
"""A directory of ours without a lock file, unchanged (mtime) this long, is abandoned (as in the fs tier)."""

_MKDTEMP_SUFFIX = re.compile(r"[a-z0-9_]{8}")
"""What ``tempfile.mkdtemp`` appends to a prefix (CPython's ``_RandomNameSequence``)."""

_STAGING_LOCK = re.compile(r"\.lock-\d+-[0-9a-f]{8}")
"""The name a creator's lock file has until it is published as :data:`LOCK_NAME` (:func:`_lock_new_dir`)."""

_CREATE_ATTEMPTS = 5
"""New directories a :class:`LockedTempDir` tries when a sweeper claims the one it is making."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})


class _Claimed(Exception):
    """The directory being created was claimed (or removed) by a sweeper before its lock was in place."""


class LockedTempDir:
    """A new private directory (mode 0700) under ``parent``, locked until :meth:`cleanup`.

    Used as a context manager, or created and later cleaned up by its owner
    (one thread). :meth:`cleanup` removes the tree (lock file last), then
    releases the lock; if the process dies first, even during :meth:`cleanup`,
    a later :func:`sweep_stale_temp_dirs` removes it. Raises :class:`OSError`
    if the directory cannot be created and locked (nothing is left behind).
    """

    def __init__(self, prefix: str, parent: str | os.PathLike[str] | None = None) -> None:
        for _attempt in range(_CREATE_ATTEMPTS):
            path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
            try:
                self._lock_fd: int | None
                self._lock_fd, self._ident = _lock_new_dir(path)
            except _Claimed:
                logger.debug("temporary directory %s was claimed by a sweeper while being created", path)
                continue
            self.path = path
            return
        raise FileExistsError(errno.EEXIST, "temporary directory claimed by a sweeper on every attempt", str(path))

    def cleanup(self) -> None:
        """Remove the directory and everything in it (lock file last), then release the lock. Idempotent.

        Never raises for a file-system error: a directory it cannot remove is logged and, its lock
        released, left to a later sweep.
        """
        if self._lock_fd is None:
            return
        try:
            _remove_own_dir(self.path, self._ident)
        finally:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> LockedTempDir:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cleanup()


def _lock_new_dir(path: Path) -> tuple[int, tuple[int, int]]:
    """Lock the new directory ``path``: (its lock file's fd, locked by us; its (st_dev, st_ino)).

    The lock file is made under a staging name, locked, then published as :data:`LOCK_NAME` with
    ``link`` so that it never appears unlocked and never replaces a sweeper's claim. Raises
    :class:`_Claimed` if a sweeper claimed or removed the directory first (it is then the
    sweeper's to remove); on any other error removes the directory and re-raises.
    """
    try:
        dir_fd = os.open(path, _DIR_FLAGS)
    except FileNotFoundError as exc:
        raise _Claimed from exc
    try:
        held = os.fstat(dir_fd)
        ident = (held.st_dev, held.st_ino)
        staging = f".lock-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # (_STAGING_LOCK)
        try:
            fd = os.open(staging, _LOCK_FLAGS, 0o600, dir_fd=dir_fd)
        except FileNotFoundError as exc:  # the directory was removed under us
            raise _Claimed from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _publish_lock(staging, dir_fd)
        except BaseException:
            os.close(fd)
            raise
    except _Claimed:
        raise
    except BaseException:
        _remove_own_dir(path, None)
        raise
    finally:
        os.close(dir_fd)
    return fd, ident


def _publish_lock(staging: str, dir_fd: int) -> None:
    """Give the locked staging file the name :data:`LOCK_NAME`; :class:`_Claimed` if a sweeper was first.

    On a file system without hard links, falls back to ``rename`` (which would replace a
    sweeper's claim made in the same instant: only possible after a creator stopped for
    :data:`_STALE_UNLOCKED_DIR_SECONDS` right here).
    """
    try:
        os.link(staging, LOCK_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except (FileExistsError, FileNotFoundError) as exc:
        raise _Claimed from exc
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
        try:
            os.rename(staging, LOCK_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except FileNotFoundError as exc2:
            raise _Claimed from exc2
        return
    with contextlib.suppress(OSError):  # a leftover staging file goes with the directory
        os.unlink(staging, dir_fd=dir_fd)


@dataclass(frozen=True)
class StaleTempDir:
    """A temporary directory whose creator is gone (and, with ``removed``, that was deleted)."""

    path: Path
    size: int
    removed: bool


def _tree_size(dir_fd: int) -> int:
    """Bytes of the regular files under the open directory (symlinks are not followed)."""
    total = 0
    for _root, _dirs, files, root_fd in os.fwalk(".", dir_fd=dir_fd, follow_symlinks=False):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total


def _open_owned_dir(parent_fd: int, name: str) -> int | None:
    """The directory ``name`` opened without following links, or None unless it is a real dir of our uid."""
    try:
        before = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        if not stat.S_ISDIR(before.st_mode) or before.st_uid != os.getuid():
            return None
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError:
        return None
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino) or st.st_uid != os.getuid():
        os.close(fd)
        return None
    return fd


def _take_stale_lock(dir_fd: int) -> int | None:
    """Our lock file in the directory, locked by us now; None if absent, not ours, or held by a live owner."""
    try:
        fd = os.open(LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None  # missing, a symlink (ELOOP), or unreadable: not proven ours
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            os.close(fd)
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            logger.debug("lock file check failed: %s", exc)
        return None
    return fd


def _abandoned_unlocked(dir_fd: int) -> bool:
    """Is the directory (ours, checked by the caller) empty, without a lock file, and unchanged for a while?

    Such a directory was left by a remover killed after the lock file went (it goes after
    everything else) or by a creator that died before publishing it: either way it is empty but
    for, at most, the creator's lock file under its staging name. One with anything else in it
    was not left so (a user's own directory that merely looks like ours, say
    ``kvtier-bench-baseline``), and is never taken. A future mtime is not old.
    """
    try:
        os.stat(LOCK_NAME, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    else:
        return False  # a lock file (or something in its place): decided by _take_stale_lock
    if not _holds_only_locks(dir_fd, own_lock=False):
        return False
    return time.time() - os.fstat(dir_fd).st_mtime >= _STALE_UNLOCKED_DIR_SECONDS


def _holds_only_locks(dir_fd: int, own_lock: bool) -> bool:
    """Does the directory open as ``dir_fd`` hold nothing but creators' lock files under their
    staging name (empty regular files of our uid so named, see :func:`_lock_new_dir`), and, with
    ``own_lock``, the :data:`LOCK_NAME` a sweeper just made? False if it cannot be listed."""
    try:
        for name in os.listdir(dir_fd):
            if own_lock and name == LOCK_NAME:
                continue
            if not _STAGING_LOCK.fullmatch(name):
                return False
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if not (stat.S_ISREG(st.st_mode) and st.st_size == 0 and st.st_uid == os.getuid()):
                return False
    except OSError:
        return False
    return True


def _claim_unlocked(dir_fd: int) -> int | None:
    """Create :data:`LOCK_NAME` in the lock-less directory and lock it: the fd, or None if someone was first.

    ``O_EXCL`` makes this atomic against a creator publishing its lock (``link``) and against
    another sweeper: if the name appeared, the lock there decides (:func:`_take_stale_lock`).
    Once claimed, the directory is listed again: anything written into it since it was found
    empty (:func:`_abandoned_unlocked`) makes it not ours, and the claim is withdrawn (None).
    """
    try:
        fd = os.open(LOCK_NAME, _LOCK_FLAGS, 0o600, dir_fd=dir_fd)
    except FileExistsError:
        return _take_stale_lock(dir_fd)
    except OSError as exc:
        logger.debug("could not claim a temporary directory without a lock file: %s", exc)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    if not _holds_only_locks(dir_fd, own_lock=True):  # written to since it was found empty: not taken
        with contextlib.suppress(OSError):
            os.unlink(LOCK_NAME, dir_fd=dir_fd)
        os.close(fd)
        return None
    return fd


def _empty_but_lock(dir_fd: int, path: Path) -> None:
    """Delete every entry of the directory open as ``dir_fd`` (at ``path``) except :data:`LOCK_NAME`.

    Links are removed, never followed. Raises :class:`OSError` if an entry cannot be removed.
    """
    for entry in list(os.scandir(dir_fd)):
        if entry.name == LOCK_NAME:
            continue
        with contextlib.suppress(FileNotFoundError):
            if entry.is_dir(follow_symlinks=False):
                if sys.version_info >= (3, 11):
                    shutil.rmtree(entry.name, dir_fd=dir_fd)
                else:  # pragma: no cover - 3.10: path based; still refuses a symlinked top and never follows links
                    shutil.rmtree(path / entry.name)
            else:
                os.unlink(entry.name, dir_fd=dir_fd)


def _remove(parent: Path, parent_fd: int, name: str, dir_fd: int) -> bool:
    """Delete ``name`` if it is still the directory open as ``dir_fd``; True if it is gone.

    The caller holds the directory's lock (or it has none). Everything but the lock file goes
    first, then the lock file, then the directory, so a kill half way leaves the lock file. A
    failure is logged and returns False.
    """
    try:
        now = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except OSError:
        return False
    held = os.fstat(dir_fd)
    if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
        return False
    try:
        _empty_but_lock(dir_fd, parent / name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(LOCK_NAME, dir_fd=dir_fd)
        os.rmdir(name, dir_fd=parent_fd)
    except OSError as exc:
        logger.warning("could not remove temporary directory %s: %s", parent / name, exc)
        return False
    return True


def _remove_own_dir(path: Path, ident: tuple[int, int] | None) -> None:
    """Remove our directory ``path`` (if it is still the inode ``ident``, when given); never raises OSError."""
    try:
        parent_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        logger.warning("could not remove temporary directory %s: %s", path, exc)
        return
    try:
        dir_fd = _open_owned_dir(parent_fd, path.name)
        if dir_fd is None:
            return
        try:
            st = os.fstat(dir_fd)
            if ident is None or (st.st_dev, st.st_ino) == ident:
                _remove(path.parent, parent_fd, path.name, dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        os.close(parent_fd)


def sweep_stale_temp_dirs(
    prefix: str, parent: str | os.PathLike[str] | None = None, *, remove: bool = False
) -> list[StaleTempDir]:
    """The directories ``<parent>/<prefix>*`` left by dead creators; deleted too with ``remove``.

    ``parent`` defaults to :func:`tempfile.gettempdir`. See the module docstring
    for what proves a directory stale and ours (a lock file nobody holds, or no
    lock file, nothing in it but creators' staging lock files, and no change for
    :data:`_STALE_UNLOCKED_DIR_SECONDS`); anything else is left alone. Listing (without ``remove``) changes nothing.
    Raises :class:`FileNotFoundError`/:class:`NotADirectoryError` if ``parent``
    is not a directory.
    """
    base = Path(parent if parent is not None else tempfile.gettempdir())
    parent_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    found: list[StaleTempDir] = []
    try:
        for name in sorted(os.listdir(parent_fd)):
            if not name.startswith(prefix):
                continue
            dir_fd = _open_owned_dir(parent_fd, name)
            if dir_fd is None:
                continue
            try:
                lock_fd = _take_stale_lock(dir_fd)
                if lock_fd is None:
                    # Lock-less: only a name mkdtemp makes (the prefix and 8 characters), so a
                    # user's own directory that merely starts with the prefix is never taken.
                    if not _MKDTEMP_SUFFIX.fullmatch(name[len(prefix) :]) or not _abandoned_unlocked(dir_fd):
                        continue
                    if remove and (lock_fd := _claim_unlocked(dir_fd)) is None:
                        continue
                try:
                    size = _tree_size(dir_fd)
                    removed = remove and _remove(base, parent_fd, name, dir_fd)
                finally:
                    if lock_fd is not None:
                        os.close(lock_fd)
                if removed:
                    logger.info("removed stale temporary directory %s (%d bytes)", base / name, size)
                found.append(StaleTempDir(base / name, size, removed))
            finally:
                os.close(dir_fd)
    finally:
        os.close(parent_fd)
    return found


__all__ = ["LOCK_NAME", "LockedTempDir", "StaleTempDir", "sweep_stale_temp_dirs"]
