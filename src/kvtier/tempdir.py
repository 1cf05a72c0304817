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

A creator makes its lock file under a temporary name, locks it, then renames
it into place, so no sweeper can ever find a new directory's lock unlocked.

Called from any thread; each function does blocking file-system I/O.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

logger = logging.getLogger(__name__)

LOCK_NAME = ".kvtier-lock"
"""The lock file inside every locked temporary directory."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class LockedTempDir:
    """A new private directory (mode 0700) under ``parent``, locked until :meth:`cleanup`.

    Used as a context manager, or created and later cleaned up by its owner
    (one thread). :meth:`cleanup` removes the tree, then releases the lock; if
    the process dies first, a later :func:`sweep_stale_temp_dirs` removes it.
    """

    def __init__(self, prefix: str, parent: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        dir_fd = os.open(self.path, _DIR_FLAGS)
        try:
            staging = f".lock-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dir_fd)  # fmt: skip
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.rename(staging, LOCK_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise
        finally:
            os.close(dir_fd)
        self._lock_fd: int | None = fd

    def cleanup(self) -> None:
        """Remove the directory and everything in it, then release the lock. Idempotent."""
        if self._lock_fd is None:
            return
        try:
            shutil.rmtree(self.path, ignore_errors=True)
        finally:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> LockedTempDir:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cleanup()


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


def _remove(parent: Path, parent_fd: int, name: str, dir_fd: int) -> bool:
    """Delete ``name`` if it is still the directory open as ``dir_fd``; True if it is gone."""
    try:
        now = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except OSError:
        return False
    held = os.fstat(dir_fd)
    if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
        return False
    try:
        if sys.version_info >= (3, 11):
            shutil.rmtree(name, dir_fd=parent_fd)
        else:  # pragma: no cover - 3.10: path based; still refuses a symlinked top and never follows links
            shutil.rmtree(parent / name)
    except OSError as exc:
        logger.warning("could not remove stale temporary directory %s: %s", parent / name, exc)
        return False
    return True


def sweep_stale_temp_dirs(
    prefix: str, parent: str | os.PathLike[str] | None = None, *, remove: bool = False
) -> list[StaleTempDir]:
    """The directories ``<parent>/<prefix>*`` left by dead creators; deleted too with ``remove``.

    ``parent`` defaults to :func:`tempfile.gettempdir`. See the module docstring
    for what proves a directory stale and ours; anything else is left alone.
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
                    continue
                try:
                    size = _tree_size(dir_fd)
                    removed = remove and _remove(base, parent_fd, name, dir_fd)
                finally:
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
