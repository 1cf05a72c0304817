"""Entries of shared, untrusted directories: opened without following, blocking or trusting.

/dev/shm is world-writable and an fs tier's root may be shared, so anything found
there may have been planted: a symlink to a file worth overwriting, a FIFO that
blocks the first ``open``, a socket, a device, a directory, a file of another
user. The rules every kvtier component follows there:

* Open with ``O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC`` (a symlink fails
  with ELOOP, a FIFO never blocks, a tty never becomes ours), then ``fstat`` the
  *descriptor*: only a regular file passes, and, where an owner is required, only
  one owned by that uid. Where even opening a device would be too much,
  :func:`inspect_entry` looks with ``O_PATH`` first and :func:`reopen` opens the
  inode it saw.
* Byte-range locks are open-file-description locks (``F_OFD_*``): they belong
  to one ``open()``, not to the process, so closing another descriptor of the same
  file never drops them, and two opens in one process see each other's locks.
  The kernel drops them when the descriptor's last copy closes, SIGKILL included:
  they are liveness proofs, never guesses from names or ages.

Plain functions, thread-safe, no state.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import time
from collections.abc import Callable

from kvtier.errors import UnsafeEntryError

SAFE_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
"""Flags added to every open of an entry in a shared directory."""

_F_OFD_GETLK: int = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK: int = getattr(fcntl, "F_OFD_SETLK", 37)
# struct flock: short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid (+ padding)
_FLOCK = struct.Struct("@hhqqi4x")


_KINDS = {
    stat.S_IFREG: "a regular file",
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
}


def kind_of(mode: int) -> str:
    """What a ``st_mode`` is, in words ("a FIFO", "a symbolic link", ...)."""
    return _KINDS.get(stat.S_IFMT(mode), f"an entry of unknown type {stat.S_IFMT(mode):o}")


def check_regular(st: os.stat_result, path: str | os.PathLike[str], owner: int | None = None) -> None:
    """Raise :class:`UnsafeEntryError` unless ``st`` is a regular file (owned by ``owner``, if given)."""
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeEntryError(path, kind_of(st.st_mode))
    if owner is not None and st.st_uid != owner:
        raise UnsafeEntryError(path, f"owned by uid {st.st_uid}, not {owner}")


def open_regular(
    path: str | os.PathLike[str],
    flags: int,
    *,
    owner: int | None = None,
    dir_fd: int | None = None,
    mode: int = 0o600,
) -> int:
    """``open`` with :data:`SAFE_OPEN_FLAGS` added, then prove the descriptor is a regular file.

    Returns the descriptor; raises :class:`UnsafeEntryError` (descriptor closed) for
    anything else, FileNotFoundError if there is nothing, OSError (ELOOP for a
    symlink is turned into UnsafeEntryError) otherwise.
    """
    try:
        fd = os.open(path, flags | SAFE_OPEN_FLAGS, mode, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        # ELOOP: a symlink; ENXIO: a socket; EINVAL: O_DIRECT on a FIFO... say what is there.
        try:
            st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            raise exc from None
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeEntryError(path, kind_of(st.st_mode)) from None
        raise
    return _proven_regular(fd, path, owner)


def inspect_entry(path: str | os.PathLike[str], owner: int | None = None) -> int:
    """An ``O_PATH`` descriptor of the regular file at ``path``, opened for no I/O at all.

    A device, FIFO or socket is looked at but never opened; a symlink is never followed.
    Raises :class:`UnsafeEntryError` (nothing left open) or FileNotFoundError.
    """
    return _proven_regular(os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC), path, owner)


def _proven_regular(fd: int, path: str | os.PathLike[str], owner: int | None) -> int:
    """``fd`` if it is a regular file (of ``owner``); else close it and raise UnsafeEntryError."""
    try:
        check_regular(os.fstat(fd), path, owner)
    except BaseException:
        os.close(fd)
        raise
    return fd


def reopen(path_fd: int, flags: int) -> int:
    """Open the very inode an ``O_PATH`` descriptor refers to, for I/O (through /proc/self/fd)."""
    return os.open(f"/proc/self/fd/{path_fd}", flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)


# --- open-file-description byte-range locks ----------------------------------------------------


def _flock(kind: int, start: int, length: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, start, length, 0)


def try_lock_range(fd: int, start: int, length: int = 1, exclusive: bool = True) -> bool:
    """Take an OFD lock on ``[start, start + length)`` without waiting; False if another holds it."""
    kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
    try:
        fcntl.fcntl(fd, _F_OFD_SETLK, _flock(kind, start, length))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):  # held by another open file description
            return False
        raise
    return True


def _retry(attempt: Callable[[], bool], timeout: float, what: str) -> None:
    """Call ``attempt`` until it succeeds, sleeping between tries, for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.0005
    while not attempt():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"could not take {what} within {timeout}s: another process holds it")
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def lock_range(fd: int, start: int, length: int = 1, *, timeout: float, what: str = "the lock") -> None:
    """Take an exclusive OFD lock, retrying for at most ``timeout`` seconds (never a blocking wait).

    Raises TimeoutError naming ``what``. Holders of kvtier's locks keep them for
    microseconds; only a stuck or hostile process of the same user makes this time out.
    """
    _retry(lambda: try_lock_range(fd, start, length), timeout, what)


def unlock_range(fd: int, start: int, length: int = 1) -> None:
    fcntl.fcntl(fd, _F_OFD_SETLK, _flock(fcntl.F_UNLCK, start, length))


def range_locked_elsewhere(fd: int, start: int, length: int = 1) -> bool:
    """True if another open file description holds any lock on ``[start, start + length)``."""
    raw = fcntl.fcntl(fd, _F_OFD_GETLK, _flock(fcntl.F_WRLCK, start, length))
    kind = _FLOCK.unpack(raw)[0]
    return bool(kind != fcntl.F_UNLCK)


def try_flock(fd: int, exclusive: bool) -> bool:
    """``flock`` without waiting; False if a conflicting lock is held."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def flock_within(fd: int, exclusive: bool, timeout: float, what: str) -> None:
    """``flock``, retrying for at most ``timeout`` seconds; TimeoutError naming ``what``."""
    _retry(lambda: try_flock(fd, exclusive), timeout, f"a lock on {what}")


__all__ = [
    "SAFE_OPEN_FLAGS",
    "check_regular",
    "flock_within",
    "inspect_entry",
    "kind_of",
    "lock_range",
    "open_regular",
    "range_locked_elsewhere",
    "reopen",
    "try_flock",
    "try_lock_range",
    "unlock_range",
]
