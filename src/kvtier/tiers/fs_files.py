"""The fs tier's directories and value files, handled as untrusted content.

Whoever can write under the tier's root (this user, root, the members of a
shared group, another engine sharing the root) may have put anything there: a
symlink named like a value pointing at a file worth overwriting, a FIFO that
blocks the first ``open``, another user's file, a file that another process is
recycling right now. The rules (DESIGN.md "Untrusted storage"):

* **No link is ever followed.** The namespace directory is opened once with
  ``O_DIRECTORY | O_NOFOLLOW`` and every operation below it goes through
  directory descriptors (``openat``, ``renameat``, ``unlinkat``, ``fstatat``
  without following), so neither a value name nor a shard directory can
  redirect I/O outside the root.
* **Only regular files are opened for I/O, and never waited on.** Value files
  are opened ``O_NOFOLLOW | O_NONBLOCK`` and checked on the descriptor: a regular
  file owned by this user (or, with a shared group, by that group). Anything
  else is skipped (counted as an unsafe entry), never indexed, served,
  recycled or deleted.
* **A reader never reads a file being rewritten.** A reader holds a shared
  ``flock`` while it reads and proves the file is still at its name; a writer
  recycles an evicted file only while holding its exclusive ``flock``, after
  moving it out of its shard. Readers that lose a race see the value as
  vanished (a miss), not as corrupt. This holds between engines sharing a root.
* **Nothing is replaced.** A finished value is hard-linked to its name, which
  fails if anything is there (another engine's value of the same key, or an
  entry planted there); only where the file system has no hard links is it
  renamed, after checking the name is free.
* **Nothing valid is deleted because of a race.** A value that failed
  verification is first moved out of its shard, then deleted only if it is
  still the inode that failed (else it is put back).
* **Private by default.** Directories 0700, files 0600; with ``share_group``,
  directories 2770 (setgid, so files inherit the group) and files 0640.

Plain functions and one small class; called from the tier's I/O threads and
constructor. Every function may block on local file-system I/O only.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError, CorruptValueError, UnsafeEntryError
from kvtier.untrusted import kind_of, open_regular, try_flock

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
NO_HARD_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
"""``link`` errors that mean the file system has no hard links (some FUSE and SMB mounts)."""


class ValueVanished(FileNotFoundError):
    """The value file is gone, was replaced, or is being recycled: a miss, not corruption."""


@dataclass(frozen=True)
class FileModes:
    """Who may own what the tier reads, and the modes of what it creates."""

    dir_mode: int
    file_mode: int
    group: int | None = None
    uid: int = -1

    @classmethod
    def for_group(cls, share_group: str | int | None) -> FileModes:
        """Private modes, or group-shared ones for ``share_group`` (a group name or gid)."""
        uid = os.geteuid()
        if share_group is None:
            return cls(0o700, 0o600, None, uid)
        try:
            gid = share_group if isinstance(share_group, int) else grp.getgrnam(share_group).gr_gid
            grp.getgrgid(gid)
        except (KeyError, OverflowError) as exc:
            raise ConfigError(
                f"fs tier share_group {share_group!r} is not a group on this host: name an existing group, "
                "or leave share_group unset for a private cache"
            ) from exc
        return cls(0o2770, 0o640, gid, uid)

    def trusted(self, st: os.stat_result) -> bool:
        """May the tier serve this file? Ours, or (shared) the group's."""
        return st.st_uid == self.uid or (self.group is not None and st.st_gid == self.group)

    def why_untrusted(self, st: os.stat_result) -> str:
        if self.group is None:
            return f"owned by uid {st.st_uid}, not {self.uid}"
        return f"owned by uid {st.st_uid} and gid {st.st_gid}, neither {self.uid} nor group {self.group}"


def make_dirs(path: Path, modes: FileModes) -> None:
    """Create directory ``path`` and its missing parents with ``modes``' directory mode (0700, or
    2770 owned by the shared group); one that exists is left as its owner made it, never chmodded.

    ``mkdir -p`` (``Path.mkdir(parents=True)``) would make them 0777 less the umask (0755):
    the namespace digests in the root would be listable by every user. Raises OSError.
    """
    missing: list[Path] = []
    while not os.path.lexists(path) and path.parent != path:
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)  # never wider than asked, even for a moment
        except FileExistsError:
            continue  # made meanwhile by someone else: theirs, left as it is
        if modes.dir_mode != 0o700 or modes.group is not None:
            fd = os.open(directory, DIR_FLAGS)
            try:
                if modes.group is not None:
                    os.fchown(fd, -1, modes.group)
                os.fchmod(fd, modes.dir_mode)
            finally:
                os.close(fd)


class NamespaceDir:
    """The namespace directory, its 256 shards and ``tmp``: created with the tier's modes,
    each proven a real directory we may use, held open so nothing can swap it for a link.

    Raises :class:`ConfigError` naming the entry when something in the way is not a
    directory of ours (or of the shared group).
    """

    def __init__(self, path: Path, subdirs: tuple[str, ...], modes: FileModes) -> None:
        self.path = path
        self.modes = modes
        self.on_unsafe: Callable[[str, UnsafeEntryError], None] | None = None
        """Told of each shard :meth:`entries` skipped as not a real directory (the tier counts it)."""
        root = path.parent
        if os.path.lexists(root) and not os.path.isdir(root):  # a file, a FIFO, a dangling link...
            raise ConfigError(f"fs tier root {root} is not a directory: give a directory for 'root' (made if missing)")
        try:
            make_dirs(root, modes)  # the configured root: trusted as given
        except OSError as exc:
            raise ConfigError(f"fs tier root {root} is not usable ({exc}): pick a writable 'root'") from exc
        self.fd = self._adopt(None, str(path))
        try:
            for name in subdirs:
                os.close(self._adopt(self.fd, name))
        except BaseException:
            os.close(self.fd)
            raise

    def _adopt(self, parent_fd: int | None, name: str) -> int:
        """Create (or find) directory ``name``, open it without following, check and fix its mode."""
        where = self.path if parent_fd is None else self.path / name
        try:
            os.mkdir(name, self.modes.dir_mode, dir_fd=parent_fd)
        except FileExistsError:
            pass
        except OSError as exc:
            raise ConfigError(f"fs tier directory {where} cannot be created ({exc}): pick a writable 'root'") from exc
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                try:
                    kind = kind_of(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode)
                except OSError:
                    kind = "not a directory"
                raise ConfigError(
                    f"fs tier directory {where} is {kind}, not a directory: kvtier follows no link in its "
                    "root; remove it or point 'root' elsewhere"
                ) from None
            raise ConfigError(f"fs tier directory {where} cannot be opened ({exc})") from exc
        try:
            st = os.fstat(fd)
            if st.st_uid == self.modes.uid:
                want = self.modes.dir_mode
                if self.modes.group is not None and st.st_gid != self.modes.group:
                    os.fchown(fd, -1, self.modes.group)
                if stat.S_IMODE(st.st_mode) != want:
                    os.fchmod(fd, want)
            elif not self.modes.trusted(st):
                raise ConfigError(
                    f"fs tier directory {where} is {self.modes.why_untrusted(st)}: kvtier will not use another "
                    "user's directory; point 'root' elsewhere or set share_group"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def subdir(self, name: str) -> int:
        """A descriptor of shard (or ``tmp``) ``name``, opened without following; caller closes."""
        return os.open(name, DIR_FLAGS, dir_fd=self.fd)

    def shard(self, name: str) -> int:
        """:meth:`subdir` for a value's shard: a link or a special file (FIFO, socket, device)
        where the shard belongs raises :class:`UnsafeEntryError` (someone else's entry, never
        followed: not an I/O failure of the medium); anything else raises as :meth:`subdir` does
        (a regular file there fails with ``ENOTDIR``: the medium's failure, as a broken mount's,
        which the breaker counts; the conformance suite's outage of an fs tier is made so)."""
        try:
            return os.open(name, DIR_FLAGS, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            try:
                mode = os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode
            except OSError:
                raise exc from None
            if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
                raise
            raise UnsafeEntryError(self.path / name, f"{kind_of(mode)}, where a shard directory belongs") from None

    def entries(self, name: str) -> Iterator[os.DirEntry[str]]:
        """The entries of shard ``name``: none if it vanished, none if it is not a real directory
        (never followed: handed to :attr:`on_unsafe`, which counts and logs it)."""
        try:
            fd = self.shard(name)
        except FileNotFoundError:
            return
        except UnsafeEntryError as exc:
            if self.on_unsafe is not None:
                self.on_unsafe(name, exc)
            return
        try:
            yield from os.scandir(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# --- value files ----------------------------------------------------------------------------------


def open_for_read(dir_fd: int, name: str, flags: int, modes: FileModes) -> tuple[int, os.stat_result]:
    """Open value ``name`` for reading: a regular, trusted file, share-locked and still at its name.

    Raises :class:`UnsafeEntryError` (not a regular file, another user's, or one whose mode
    does not let this user read it: a group member's 0600 file, a file made 0000; not a failure
    of the medium, so never an I/O error that counts towards the breaker),
    :class:`ValueVanished`/FileNotFoundError (gone, replaced, or being recycled).
    """
    try:
        fd = open_regular(name, os.O_RDONLY | flags, dir_fd=dir_fd)
    except PermissionError:
        try:
            mode = stat.S_IMODE(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            raise ValueVanished(f"{name} vanished while opening it") from None
        raise UnsafeEntryError(name, f"not readable by this user (mode {mode:04o})") from None
    try:
        st = os.fstat(fd)
        if not modes.trusted(st):
            raise UnsafeEntryError(name, modes.why_untrusted(st))
        hold_at_name(dir_fd, name, fd, st)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_head(dir_fd: int, name: str, modes: FileModes, size: int) -> tuple[os.stat_result, bytes | None]:
    """The fstat of ``name`` (opened without following a link or blocking, a regular file) and its
    first ``size`` bytes, or None instead of them when ``modes`` do not trust it (nothing read):
    how a small file of another instance (a ledger, a journal segment) is proven one. Raises
    FileNotFoundError, :class:`UnsafeEntryError` (not a regular file) or OSError."""
    fd = open_regular(name, os.O_RDONLY, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        return st, (os.pread(fd, size, 0) if modes.trusted(st) else None)
    finally:
        os.close(fd)


def hold_at_name(dir_fd: int, name: str, fd: int, st: os.stat_result) -> None:
    """Share-lock value ``name`` open as ``fd`` (``st`` its fstat) and check it is still at its
    name: from then on no engine rewrites it (recycling takes the exclusive lock first). Raises
    :class:`ValueVanished` if it is being recycled or was replaced meanwhile."""
    if not try_flock(fd, exclusive=False):
        raise ValueVanished(f"{name} is being recycled")
    now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        raise ValueVanished(f"{name} was replaced while opening it")


def find_value(dir_fd: int, name: str, modes: FileModes, sizes: tuple[int, ...]) -> os.stat_result | None:
    """The ``lstat`` of value ``name`` if a regular, trusted file of one of ``sizes`` bytes is
    there; None if nothing is. Follows no link and opens nothing (a FIFO cannot block it).

    Raises :class:`UnsafeEntryError` (not a regular file, another user's) and
    :class:`CorruptValueError` (a size no value has).
    """
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeEntryError(name, kind_of(st.st_mode))
    if not modes.trusted(st):
        raise UnsafeEntryError(name, modes.why_untrusted(st))
    if st.st_size not in sizes:
        raise CorruptValueError(f"{name} has {st.st_size} bytes, no value has that size")
    return st


def place_value(tmp_fd: int, tmp_name: str, dir_fd: int, name: str, *, hard_link: bool) -> bool:
    """Give the finished temp file ``tmp_name`` its value name, never replacing what is there.

    True if it now stands at ``name`` (the temp name removed, or left if removing it failed);
    False if the name was taken (by another engine's value of the same key, or by anything
    planted there): the temp file is left for the caller to link again (the name may be free
    again: the value that took it evicted or recycled meanwhile) or to remove. ``hard_link``
    False (the file system has none): rename, after checking the name is free (a writer racing
    in that instant may be replaced: both wrote the same key). Raises OSError; with
    ``hard_link``, one whose errno is in :data:`NO_HARD_LINKS` says the file system has no hard
    links (the temp file is left for a retry).
    """
    if hard_link:
        try:
            os.link(tmp_name, name, src_dir_fd=tmp_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        except FileExistsError:
            # NFS: a retransmitted LINK whose first try succeeded answers EEXIST; then ours has 2 links.
            if os.stat(tmp_name, dir_fd=tmp_fd, follow_symlinks=False).st_nlink <= 1:
                return False
        # Linked: the value stands at its name whatever the temp name's removal says (a temp
        # link left behind is removed by the next store of the key or the sweep of the directory).
        with contextlib.suppress(OSError):
            os.unlink(tmp_name, dir_fd=tmp_fd)
        return True
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        os.rename(tmp_name, name, src_dir_fd=tmp_fd, dst_dir_fd=dir_fd)
        return True
    return False


def create_file(dir_fd: int, name: str, flags: int, modes: FileModes) -> int:
    """Create a new file ``name`` (never an existing entry, never through a link)."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | flags,
                 modes.file_mode, dir_fd=dir_fd)  # fmt: skip
    if modes.group is not None:
        try:
            os.fchmod(fd, modes.file_mode)  # the umask may have taken the group bits
        except BaseException:
            os.close(fd)
            raise
    return fd


def take_for_recycling(
    dir_fd: int, name: str, tmp_fd: int, tmp_name: str, flags: int, modes: FileModes
) -> int | None:
    """Move an evicted value out of its shard to ``tmp_name`` for overwriting; its descriptor,
    exclusively locked, or None when it may not be recycled (then write a new file).

    Recycled only if it is a regular file of ours with one link and no reader holds
    it (readers keep a shared lock); a late reader then sees it vanish.
    """
    try:
        fd = open_regular(name, os.O_WRONLY | flags, dir_fd=dir_fd)
    except (OSError, UnsafeEntryError):
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != modes.uid or st.st_nlink != 1 or not try_flock(fd, exclusive=True):
            os.close(fd)
            return None
        os.rename(name, tmp_name, src_dir_fd=dir_fd, dst_dir_fd=tmp_fd)
        moved = os.stat(tmp_name, dir_fd=tmp_fd, follow_symlinks=False)
        if (moved.st_dev, moved.st_ino) != (st.st_dev, st.st_ino):
            # A value stored meanwhile under this name was moved instead: put it back.
            os.rename(tmp_name, name, src_dir_fd=tmp_fd, dst_dir_fd=dir_fd)
            os.close(fd)
            return None
    except OSError:
        os.close(fd)
        return None
    return fd


def remove_value(dir_fd: int, name: str, modes: FileModes) -> bool:
    """Unlink an evicted value if it is a regular file we may remove; True if it went."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or not modes.trusted(st):
        return False
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def discard_corrupt(
    dir_fd: int, name: str, failed: os.stat_result, tmp_fd: int, tmp_name: str, modes: FileModes
) -> bool:
    """Delete the value that failed verification (``failed`` is its fstat) if it is a regular file
    of ours and still the same inode; a valid value that took the name meanwhile is kept."""
    if failed.st_uid != modes.uid or not stat.S_ISREG(failed.st_mode):
        return False
    try:
        os.rename(name, tmp_name, src_dir_fd=dir_fd, dst_dir_fd=tmp_fd)
    except FileNotFoundError:
        return False
    moved = os.stat(tmp_name, dir_fd=tmp_fd, follow_symlinks=False)
    if (moved.st_dev, moved.st_ino) != (failed.st_dev, failed.st_ino):
        os.rename(tmp_name, name, src_dir_fd=tmp_fd, dst_dir_fd=dir_fd)
        return False
    os.unlink(tmp_name, dir_fd=tmp_fd)
    return True


def classify_entry(entry: os.DirEntry[str], modes: FileModes) -> tuple[os.stat_result | None, str | None]:
    """``(lstat, None)`` for a regular, trusted file; ``(None, reason)`` for anything else."""
    st = entry.stat(follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        return None, kind_of(st.st_mode)
    if not modes.trusted(st):
        return None, modes.why_untrusted(st)
    return st, None


__all__ = [
    "DIR_FLAGS",
    "NO_HARD_LINKS",
    "FileModes",
    "NamespaceDir",
    "ValueVanished",
    "classify_entry",
    "create_file",
    "discard_corrupt",
    "find_value",
    "hold_at_name",
    "open_for_read",
    "place_value",
    "read_head",
    "remove_value",
    "take_for_recycling",
]
