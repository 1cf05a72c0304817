"""The shared CPU region: one file in /dev/shm mapped by the scheduler and every worker.

Layout: a header page, then ``num_rows`` rows of ``row_stride`` bytes, where the
stride is ``row_bytes`` rounded up to the page size, so every row is page
aligned (O_DIRECT and pinning need it). The header and the locks in it are
described in :mod:`kvtier.region_file`.

Lifecycle (DESIGN.md section 3):

* **Create-or-attach.** A creator builds the file fully sized, with its header
  (and a random per-start *generation*) written and every page backed, as an
  anonymous ``O_TMPFILE``, takes its creator lock and links it into place
  atomically, so an attacher never sees a half-made file and exactly one
  creator wins. The others attach, waiting (bounded) for the file to appear.
* **One start, one mapping.** A file whose creator lock is free belongs to a
  dead start: it is never joined, whatever its attach count says; a process
  that may create replaces it (unlinks the proven-stale name, then links a new
  file), one that may only attach waits for its own creator to do so. Given a
  ``generation``, an attacher joins only the file of that generation.
* **Untrusted directory.** Nothing at the region's path is trusted: it is looked
  at with ``O_PATH | O_NOFOLLOW`` and only a regular file of this uid with a
  valid header is opened; anything else is refused with a clear error, never
  followed, opened for I/O, waited on or deleted.
* **Free space** in the directory is checked before anything is created; a
  shortfall, or a prefault the memory cannot back (memory cgroup limit, full
  tmpfs), raises :class:`InsufficientSpaceError` naming both sizes.
* **Liveness.** Every process holds a shared ``flock`` on the file while it maps
  it; :func:`sweep_stale` removes exactly the files whose exclusive lock can be
  taken, and never another live engine's file.
* **Unlink once mapped.** Each mapper increments an attach counter in the
  header (under a byte-range lock); the one that reaches ``expected_mappers``
  unlinks the path, under the file's name lock and only if the path still names
  this inode, so a late process of an old generation cannot delete a new
  engine's file. From then on nothing can leak: the kernel frees the memory
  with the last mapping, even after SIGKILL. A process arriving after all
  ``expected_mappers`` attached is refused.
* **Fork.** A child forked from a process that maps a region (a plain ``fork``, a
  multiprocessing ``fork`` pool) gives up what it inherited at once: its descriptors, and
  its mapping, which is replaced in place by private zeroed memory. Inherited, they would
  hold the start's locks after the engine is killed, and its restart would join the dead
  start's file (:func:`_drop_inherited`). A process that needs the rows attaches by name.
* **Exit.** A region never closed is released at interpreter exit as when it is garbage
  collected: a creator that exits before every mapper attached removes its path then, if
  no other process maps it.
* **Cleanup order:** unpin, drop the exported views, close the mapping, close
  the fd. A view still held elsewhere makes :meth:`close` raise
  :class:`RegionBusyError` (the region stays valid); it never crashes. A failed
  construction closes its mapping and descriptor before raising.

Thread-safety: construct and close from one thread. ``rows`` may be read and
written from any thread; coordinating who touches which row is the primary
tier's job.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import math
import mmap
import os
import secrets
import struct
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from kvtier.errors import InsufficientSpaceError, RegionBusyError, RegionError, UnsafeEntryError, int_text
from kvtier.region_file import (
    ATTACH_COUNT_OFFSET,
    CREATOR_LOCK_OFFSET,
    FILE_PREFIX,
    FILE_SUFFIX,
    GENERATION_BYTES,
    PAGE_SIZE,
    SCHEDULER_LOCK_OFFSET,
    TMP_PREFIX,
    IgnoredEntry,
    RegionHeader,
    ShmSweep,
    StaleRegion,
    creator_alive,
    link_fd,
    read_header,
    sweep,
    tmpfile_unsupported,
    unlink_if_same,
)
from kvtier.units import format_size as format_bytes
from kvtier.units import round_up as round_up
from kvtier.units import type_and_size
from kvtier.untrusted import (
    flock_within,
    inspect_entry,
    lock_range,
    range_locked_elsewhere,
    reopen,
    try_flock,
    try_lock_range,
    unlock_range,
)

logger = logging.getLogger(__name__)

_MAX_MAPPERS = 2**32 - 1
"""The most ``expected_mappers`` the header records (an unsigned 32-bit count)."""



def _whole(what: str, value: object) -> int:
    """``value``, an argument given directly, as an int (a bool or a float is refused, not read)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise RegionError(f"{what} must be an integer, got {type(value).__name__} {value!r:.40}")
    return int(value)


def _finite_seconds(what: str, value: object) -> float:
    """``value`` as seconds to wait: finite and >= 0 (a NaN or infinite deadline never comes)."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating) \
            or not 0 <= float(value) < math.inf:
        raise RegionError(f"{what} must be a finite number of seconds >= 0, got {value!r:.40}")
    return float(value)


_MADV_POPULATE_WRITE = 23
_MAP_FIXED = 0x10  # (Linux; not in Python's mmap module)
_SCHEDULED = b"\x01"  # the scheduler lock's byte once a scheduler of the start mapped the file
_RETRY_SECONDS = 0.01

__all__ = [
    "FILE_PREFIX",
    "FILE_SUFFIX",
    "PAGE_SIZE",
    "IgnoredEntry",
    "SharedRegion",
    "ShmSweep",
    "StaleRegion",
    "format_bytes",
    "region_path",
    "round_up",
]


def region_path(name: str, shm_dir: str | os.PathLike[str] = "/dev/shm") -> Path:
    """The file path of region ``name`` (only ``[A-Za-z0-9._-]`` allowed in names)."""
    if not isinstance(name, str) or not name or any(not (c.isalnum() or c in "._-") for c in name):
        raise RegionError(f"region name {name!r} must be non-empty and use only letters, digits, '.', '_', '-'")
    file_name = f"{FILE_PREFIX}{name}{FILE_SUFFIX}"
    if len(file_name.encode()) > 255:
        raise RegionError(f"region name {name[:40]!r}... is too long: a file name holds at most 255 bytes with "
                          f"kvtier's {len(file_name) - len(name)} around it")  # fmt: skip
    return _shm_dir_path(shm_dir) / file_name


def _shm_dir_path(shm_dir: object) -> Path:
    """``shm_dir`` as a Path; RegionError naming ``shm_dir`` for anything but a non-empty str or
    ``os.PathLike`` of one (an empty one would be the current directory, maybe not a tmpfs)."""
    if not isinstance(shm_dir, str | os.PathLike) or not isinstance(os.fspath(shm_dir), str) or not os.fspath(shm_dir):
        raise RegionError(
            f"shm_dir must be a directory path (a non-empty str or os.PathLike), got {type_and_size(shm_dir)}"
        )
    return Path(shm_dir)


def check_shm_dir(shm_dir: str | os.PathLike[str]) -> None:
    """RegionError unless ``shm_dir`` is a directory (a link to one is fine: the region's own file
    is never followed), naming what it is instead: missing, or a file of another kind."""
    path = _shm_dir_path(shm_dir)
    if not path.is_dir():
        what = "is not a directory" if os.path.lexists(path) else "does not exist"
        raise RegionError(f"shared-memory directory {path} {what}: give shm_dir a directory on a tmpfs "
                          "(the default /dev/shm)")  # fmt: skip


def _release_dropped(fd_box: list[int], path: Path, name: str) -> None:
    """The finalizer of a :class:`SharedRegion` collected without :meth:`~SharedRegion.close`:
    close its descriptor, so the tmpfs pages go with the last mapping (a numpy view still
    alive keeps them until it goes), and unlink its path if no other process maps it and it
    still names this file. Runs at garbage collection; never raises."""
    fd = fd_box[0]
    if fd < 0:
        return
    try:
        if try_flock(fd, exclusive=True):
            unlink_if_same(path, fd, timeout=0.1)
    except OSError:
        pass
    finally:
        # Never waits for the guard: a finalizer runs wherever garbage is collected, maybe on a
        # thread holding a lock (logging's) that a thread forking under the guard waits for.
        guarded = _FORK_GUARD.acquire(blocking=False)
        try:
            fd_box[0] = -1
            os.close(fd)
        finally:
            if guarded:
                _FORK_GUARD.release()
    logger.warning("region %r was dropped without close() (its manager was never shut down): its descriptor is "
                   "closed, and its memory is returned with its last view", name)  # fmt: skip


_LIVE: weakref.WeakSet[SharedRegion] = weakref.WeakSet()
"""Every region of this process with its descriptor open (see :func:`_drop_inherited`)."""

_MAPPED: dict[int, tuple[int, int]] = {}
"""(st_dev, st_ino) of the file of every region mapping object alive in this process, by the
object's id (its entry goes with the object, not at close: a view of the rows may outlive both
the region and its close)."""


def _drop_inherited() -> None:
    """After a plain ``fork()``, in the child: close every region descriptor it inherited.

    A forked child shares its parent's open file descriptions, and with them the locks that prove
    a start alive (the creator lock, the shared ``flock``): were it to keep them, a killed engine's
    file would still look alive to its restart, which would join it (its workers then creating a
    second region: two mappings, wrong bytes), and at the child's exit an exclusive ``flock``
    could be converted from its parent's and the parent's path unlinked. The mapping's own
    descriptor (``mmap`` keeps a duplicate) is pointed at ``/dev/null`` instead of closed, so the
    mapping it inherited stays valid and closing it later closes nothing else; the mapping itself
    holds the file (and so its locks) too, so it is replaced, at the same address, by private
    zeroed memory. The child's region objects own no descriptor and no longer share the rows: a
    process that needs them attaches by name."""
    for region in list(_LIVE):
        fd = region._fd_box[0]
        if fd >= 0:
            region._fd_box[0] = -1
            with contextlib.suppress(OSError):
                os.close(fd)
    files = set(_MAPPED.values())  # (a region dropped while a view of its rows lives is mapped still)
    if not files:
        return
    _unshare(files)
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # no /proc: the mapping's duplicate stays (nothing else holds the locks)
        return
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for name in names:
            fd = int(name)
            if fd == null:
                continue
            try:
                st = os.fstat(fd)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in files:
                os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)


def _unshare(files: set[tuple[int, int]]) -> None:
    """Replace every mapping of ``files`` ((st_dev, st_ino) of region files) in this process, in
    place, by private anonymous memory (a forked child's: see :func:`_drop_inherited`); numpy
    views of them stay valid and read zeros. The mappings are found in ``/proc/self/maps``."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED
    for line in lines:
        fields = line.split(None, 5)
        if len(fields) < 5 or fields[4] == "0":
            continue
        major, _, minor = fields[3].partition(":")
        try:
            if (os.makedev(int(major, 16), int(minor, 16)), int(fields[4])) not in files:
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
        except ValueError:
            continue
        if libc.mmap(start, end - start, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0) != start:
            logger.warning("a forked child could not unshare an inherited region mapping (errno %d): it keeps "
                           "its parent's start alive while it lives", ctypes.get_errno())  # fmt: skip


_FORK_GUARD = threading.RLock()
"""Held while a region's descriptor or mapping changes hands (opened and recorded, mapped,
unmapped, closed and forgotten), and by a thread that forks: a child never inherits one half done
(re-entrant: a region's finalizer may run, at garbage collection, inside a guarded step)."""


def _after_fork_in_child() -> None:
    _FORK_GUARD._at_fork_reinit()  # type: ignore[attr-defined]  # (the child has one thread: a fresh lock)
    _drop_inherited()


os.register_at_fork(before=_FORK_GUARD.acquire, after_in_parent=_FORK_GUARD.release,
                    after_in_child=_after_fork_in_child)  # fmt: skip


class SharedRegion:
    """A page-aligned array of rows in a shared-memory file; see the module docstring.

    ``create``: None = create or attach (whoever comes first creates); True =
    must create (fails if a live file exists); False = attach only (waits up to
    ``attach_timeout`` seconds for a live file of this start to appear).
    ``generation``: 16 bytes shared by every process of one start, if the caller
    has such a value; the creator stamps it (default: random) and attachers that
    pass it join only that file. Without it, attachers join only a file whose
    creator is alive.
    ``scheduler``: this process is its start's scheduler (the manager's region): a live file
    that another scheduler maps is refused (a second engine under the same name), whoever
    created it. ``worker``: this process is a worker of a start that has a scheduler (an engine
    integration's copier): the start's last place is kept for the scheduler (see
    :meth:`_count_attach`).
    """

    def __init__(
        self,
        name: str,
        num_rows: int,
        row_bytes: int,
        *,
        expected_mappers: int = 1,
        shm_dir: str | os.PathLike[str] = "/dev/shm",
        create: bool | None = None,
        attach_timeout: float = 30.0,
        prefault: bool = True,
        pin: bool = False,
        generation: bytes | None = None,
        scheduler: bool = False,
        worker: bool = False,
    ) -> None:
        num_rows, row_bytes = _whole("num_rows", num_rows), _whole("row_bytes", row_bytes)
        expected_mappers = _whole("expected_mappers", expected_mappers)
        if num_rows <= 0 or row_bytes <= 0:
            raise RegionError(f"a region needs num_rows > 0 and row_bytes > 0, got {num_rows} and {row_bytes}")
        if not 1 <= expected_mappers <= _MAX_MAPPERS:
            raise RegionError(f"expected_mappers must lie in 1..{_MAX_MAPPERS}, got {expected_mappers}")
        attach_timeout = _finite_seconds("attach_timeout", attach_timeout)
        if generation is not None and (not isinstance(generation, bytes) or len(generation) != GENERATION_BYTES):
            raise RegionError(f"generation must be {GENERATION_BYTES} bytes, got {generation!r}")
        self.name = name
        self.path = region_path(name, shm_dir)
        self.num_rows = num_rows
        self.row_bytes = row_bytes
        self.row_stride = round_up(row_bytes)
        self.total_bytes = PAGE_SIZE + num_rows * self.row_stride
        self.expected_mappers = expected_mappers
        self.generation = generation
        self.scheduler = scheduler
        self.worker = worker and not scheduler
        self.is_creator = False
        self.unlinked = False
        # The descriptor lives in a box the finalizer shares: a region dropped without close()
        # (its manager never shut down) still gives its pages back with its last view.
        self._fd_box = [-1]
        # At exit too: a creator that exits (sys.exit, an exception at start-up) before every
        # mapper attached removes its path then, if no other process maps it.
        self._finalizer = weakref.finalize(self, _release_dropped, self._fd_box, self.path, name)
        _LIVE.add(self)
        self._mmap: mmap.mmap | None = None
        self._rows: np.ndarray | None = None
        self._pinned_ptr: int | None = None
        self._closed = False
        self._views: list[weakref.ref[Any]] = []
        try:
            self._create_or_attach(create, attach_timeout, prefault)
            if pin:
                self._pin()
        except BaseException:
            self._release_quietly()
            raise

    # --- construction ------------------------------------------------------------

    def _create_or_attach(self, create: bool | None, timeout: float, prefault: bool) -> None:
        """Loop until this process created or joined the file of its start (bounded by ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            with _FORK_GUARD:  # (recorded as soon as opened: see _drop_inherited)
                fd = self._open_existing()
                if fd is not None:
                    self._fd = fd
            if fd is None:
                if create is not False and self._create(prefault):
                    self._count_attach()
                    return
                waiting = "did not appear"
            else:
                waiting = self._join(create, deadline)
                if not waiting:
                    return
                self._release_quietly()
            if time.monotonic() >= deadline:
                raise RegionError(
                    f"region file {self.path} {waiting} within {timeout}s: is the creating process running "
                    "and using the same region name and shm_dir?"
                )
            time.sleep(_RETRY_SECONDS)

    def _open_existing(self) -> int | None:
        """A read-write fd of the regular file of ours at the path, None if there is none.

        Looks first with O_PATH | O_NOFOLLOW, so a symlink, FIFO, socket, device or
        directory planted at the path is never followed, opened or waited on.
        """
        try:
            path_fd = inspect_entry(self.path, owner=os.geteuid())
        except FileNotFoundError:
            return None
        except UnsafeEntryError as exc:
            raise RegionError(
                f"region path {self.path} is {exc.reason}, not a kvtier region: kvtier will not use or remove "
                "it; remove it yourself or choose another region name"
                if exc.reason.startswith(("a ", "an "))
                else f"region path {self.path} is not a kvtier region of this user ({exc.reason}): remove it "
                "or choose another region name"
            ) from None
        try:
            return reopen(path_fd, os.O_RDWR)
        except FileNotFoundError:
            return None
        finally:
            os.close(path_fd)

    def _join(self, create: bool | None, deadline: float) -> str:
        """Join the file open as ``self._fd``. Returns "" once joined, else why to try again."""
        fd = self._fd
        header = read_header(fd)
        if isinstance(header, str):
            raise RegionError(
                f"region path {self.path} is a file of this user but {header}: kvtier will not use or remove "
                "it; remove it or choose another region name"
            )
        if header.version != 2:
            return self._replace_old_format(create)
        try:
            flock_within(fd, False, max(0.0, deadline - time.monotonic()), f"region {self.path}")
        except TimeoutError as exc:
            raise RegionError(str(exc)) from None
        if os.fstat(fd).st_nlink == 0:
            return "was replaced while attaching"
        if not creator_alive(fd):
            if create is False:
                return f"belongs to a dead start (creator pid {header.creator_pid}) and was not replaced"
            if unlink_if_same(self.path, fd):
                logger.warning(
                    "region %s: replaced file %s of a dead start (creator pid %d, %d of %d mappers had attached)",
                    self.name, self.path, header.creator_pid, self._attach_count(), header.expected_mappers,
                )
            return "was being replaced"
        if create is True:
            raise RegionError(f"region file {self.path} already exists; pick another name")
        if self.generation is not None and header.generation != self.generation:
            raise RegionError(
                f"region {self.path} belongs to another live start (creator pid {header.creator_pid}, "
                f"generation {header.generation.hex()}, not {self.generation.hex()}): another engine uses "
                "this region name"
            )
        found = (header.num_rows, header.row_bytes, header.row_stride, header.expected_mappers)
        if found != (self.num_rows, self.row_bytes, self.row_stride, self.expected_mappers):
            raise RegionError(
                f"region {self.path} has {header.num_rows} rows of {header.row_bytes} bytes for "
                f"{header.expected_mappers} mappers, but {self.num_rows} rows of {self.row_bytes} bytes for "
                f"{self.expected_mappers} mappers were asked for: every process must use the same geometry, "
                "cpu size and number of mappers"
            )
        if self.scheduler and not try_lock_range(fd, SCHEDULER_LOCK_OFFSET):
            raise RegionError(
                f"region file {self.path} already exists and a live engine's scheduler maps it (creator pid "
                f"{header.creator_pid}): another engine uses this region name; pick another name"
            )
        if os.pread(fd, 1, SCHEDULER_LOCK_OFFSET) == _SCHEDULED and (
                self.scheduler or not range_locked_elsewhere(fd, SCHEDULER_LOCK_OFFSET)):  # fmt: skip
            # Its start's scheduler is gone (killed, or shut down before its workers): the start is
            # dead, whoever still maps it (its workers, exiting); no process of a new start joins it.
            if create is False:
                return "belongs to a start whose scheduler is gone, and was not replaced"
            if unlink_if_same(self.path, fd):
                logger.warning("region %s: replaced file %s of a start whose scheduler is gone (creator pid "
                               "%d, still alive)", self.name, self.path, header.creator_pid)  # fmt: skip
            return "was being replaced"
        self.generation = header.generation
        self._map()
        self._count_attach()  # (a scheduler marks the start scheduled there: only once joined)
        return ""

    def _replace_old_format(self, create: bool | None) -> str:
        """A format-1 file (older kvtier) has no creator lock: replace it only if no one maps it."""
        if not try_flock(self._fd, exclusive=True):
            raise RegionError(
                f"region file {self.path} is in use by a process of an older kvtier version: stop it or "
                "choose another region name"
            )
        if create is False:
            return "is a stale file of an older kvtier and was not replaced"
        if unlink_if_same(self.path, self._fd):
            logger.warning("region %s: replaced stale file %s of an older kvtier version", self.name, self.path)
        return "was being replaced"

    def _check_space(self) -> None:
        st = os.statvfs(self.path.parent)
        free = st.f_bavail * st.f_frsize
        if free < self.total_bytes:
            raise InsufficientSpaceError(
                f"{self.path.parent} has {format_bytes(free)} free, {format_bytes(self.total_bytes)} needed "
                f"for region {self.name!r} ({int_text(self.num_rows)} rows of {format_bytes(self.row_stride)}): "
                f"lower cpu_bytes or enlarge {self.path.parent}"
            )

    def _create(self, prefault: bool) -> bool:
        """Build a complete file and link it at the path; False if another creator won the name."""
        check_shm_dir(self.path.parent)
        self._check_space()
        tmp_path: Path | None = None
        with _FORK_GUARD:  # (recorded as soon as opened: see _drop_inherited)
            try:
                fd = os.open(self.path.parent, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                if not tmpfile_unsupported(exc):
                    raise
                tmp_path = self.path.parent / f"{TMP_PREFIX}{uuid.uuid4().hex}{FILE_SUFFIX}"
                flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(tmp_path, flags, 0o600)
            self._fd = fd
        try:
            # The creator lock first: nobody may ever see this file linked without a live creator.
            if not try_lock_range(fd, CREATOR_LOCK_OFFSET) or (self.scheduler and not try_lock_range(
                    fd, SCHEDULER_LOCK_OFFSET)):  # fmt: skip
                raise RegionError(f"could not take the creator lock of a new file for region {self.name!r}")
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.ftruncate(fd, self.total_bytes)
            generation = self.generation or secrets.token_bytes(GENERATION_BYTES)
            header = RegionHeader(
                self.expected_mappers, self.num_rows, self.row_bytes, self.row_stride, os.getpid(), generation
            )
            os.pwrite(fd, header.pack(), 0)
            if self.scheduler:
                os.pwrite(fd, _SCHEDULED, SCHEDULER_LOCK_OFFSET)
            self._map()
            if prefault:
                self._prefault()
            try:
                if tmp_path is not None:
                    os.link(tmp_path, self.path)
                else:
                    link_fd(fd, self.path)
            except FileExistsError:
                self._release_quietly()
                return False
            self.generation = generation
            self.is_creator = True
            return True
        finally:
            if tmp_path is not None:
                tmp_path.unlink(missing_ok=True)

    def _map(self) -> None:
        st = os.fstat(self._fd)
        with _FORK_GUARD:
            self._mmap = mmap.mmap(self._fd, self.total_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            _MAPPED[id(self._mmap)] = (st.st_dev, st.st_ino)
            weakref.finalize(self._mmap, _MAPPED.pop, id(self._mmap), None).atexit = False
            base = np.frombuffer(self._mmap, dtype=np.uint8, count=self.num_rows * self.row_stride, offset=PAGE_SIZE)
            self._rows = base.reshape(self.num_rows, self.row_stride)

    def _prefault(self) -> None:
        """Back every page of the new (not yet linked) file now, or raise InsufficientSpaceError.

        Only EINVAL (a kernel without MADV_POPULATE_WRITE) falls back: fallocate, which
        fails cleanly when the space is not there, then a write per page. Any other errno
        (ENOMEM: memory cgroup limit; EFAULT: tmpfs full; EIO) means the memory is not
        there: touching pages would end in a SIGBUS or an OOM kill later, so the pages got
        so far are given back and the creation fails.
        """
        assert self._mmap is not None
        try:
            self._mmap.madvise(_MADV_POPULATE_WRITE)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                self._fail_prefault(exc)
            try:
                os.posix_fallocate(self._fd, 0, self.total_bytes)
            except OSError as fallocate_exc:
                if fallocate_exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    self._fail_prefault(fallocate_exc)
            # The file is new, so zeros are correct; every page is backed now.
            assert self._rows is not None
            self._rows.reshape(-1)[::PAGE_SIZE] = 0

    def _fail_prefault(self, exc: OSError) -> NoReturn:
        got = os.fstat(self._fd).st_blocks * 512
        os.ftruncate(self._fd, 0)  # give the pages back at once; the file was never linked
        short = max(self.total_bytes - got, PAGE_SIZE)
        reason = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        raise InsufficientSpaceError(
            f"{self.path.parent} could not back region {self.name!r} of {format_bytes(self.total_bytes)} "
            f"({reason}: {exc.strerror} after {format_bytes(got)}; {format_bytes(short)} short): a memory "
            f"cgroup limit or the size of {self.path.parent} allows less than its free space suggests; "
            "lower cpu_bytes or raise the limit"
        ) from None

    def _attach_count(self) -> int:
        (count,) = struct.unpack("<I", os.pread(self._fd, 4, ATTACH_COUNT_OFFSET))
        return int(count)

    def _count_attach(self) -> None:
        """Count this mapper in; the one that completes the start unlinks the path.

        A process arriving after every expected mapper attached (a wrong
        ``expected_mappers``, or another engine with this name) is refused. The
        last place is kept for a scheduler (a manager's region) while none has
        attached: a ``worker`` that would take it is refused, so that the start
        never completes without its scheduler (which would then find the path
        gone and make a second file: two mappings of one engine's rows). A
        scheduler marks the start as scheduled here, under the counter's lock.
        """
        assert self._mmap is not None
        try:
            lock_range(self._fd, ATTACH_COUNT_OFFSET, 4, timeout=10.0, what=f"the attach counter of {self.path}")
        except TimeoutError as exc:
            raise RegionError(str(exc)) from None
        try:
            (count,) = struct.unpack_from("<I", self._mmap, ATTACH_COUNT_OFFSET)
            if count >= self.expected_mappers:
                raise RegionError(
                    f"region {self.path} already has all {self.expected_mappers} expected mappers attached: "
                    "expected_mappers is too low, or another engine uses this region name"
                )
            scheduled = self._mmap[SCHEDULER_LOCK_OFFSET : SCHEDULER_LOCK_OFFSET + 1] == _SCHEDULED
            if self.worker and count + 1 >= self.expected_mappers and not scheduled:
                raise RegionError(
                    f"region {self.path} has {count} of {self.expected_mappers} expected mappers attached and the "
                    "last place is its scheduler's, which has not attached: more workers than expected_mappers "
                    "counts (expected_mappers is too low), or another engine uses this region name"
                )
            count += 1
            struct.pack_into("<I", self._mmap, ATTACH_COUNT_OFFSET, count)
            if self.scheduler:
                os.pwrite(self._fd, _SCHEDULED, SCHEDULER_LOCK_OFFSET)
            if count >= self.expected_mappers:
                self.unlink_if_ours()
        finally:
            unlock_range(self._fd, ATTACH_COUNT_OFFSET, 4)

    def start_complete(self) -> bool:
        """Every expected mapper of this start attached (the scheduler among them, where one is
        expected: see :meth:`_count_attach`). False for a file no start will complete: a worker
        that came after its engine's start completed made a file of its own. Any thread."""
        if self._mmap is None:
            return False
        (count,) = struct.unpack_from("<I", self._mmap, ATTACH_COUNT_OFFSET)
        return bool(count >= self.expected_mappers)

    def unlink_if_ours(self) -> None:
        """Remove the region's path if it is still this region's file (never another start's made
        under the name since), keeping the mapping: a restart under the name makes a new file.
        Called when every expected mapper attached, by the last one out, and by a failed
        construction whose interrupted tier may still use the rows."""
        if unlink_if_same(self.path, self._fd):
            logger.debug("unlinked region path %s (all %d mappers attached)", self.path, self.expected_mappers)
        self.unlinked = True

    def _pin(self) -> None:
        try:
            import torch

            if not torch.cuda.is_available():
                logger.warning("pin requested for region %s but CUDA is not available; not pinned", self.name)
                return
            ptr = np.asarray(self.rows).ctypes.data
            rc = torch.cuda.cudart().cudaHostRegister(ptr, self.num_rows * self.row_stride, 0)
            if int(rc) != 0:
                logger.warning("cudaHostRegister failed for region %s (code %s); using unpinned copies", self.name, rc)
                return
            self._pinned_ptr = ptr
        except Exception as exc:
            logger.warning("could not pin region %s (%s); using unpinned copies", self.name, exc)

    # --- use -------------------------------------------------------------------

    @property
    def rows(self) -> np.ndarray:
        """A ``(num_rows, row_stride)`` uint8 view of the rows. Drop it before :meth:`close`."""
        if self._rows is None:
            raise RegionError(f"region {self.name!r} is closed")
        view = self._rows[:]
        self._views = [ref for ref in self._views if ref() is not None]
        self._views.append(weakref.ref(view))
        return view

    @property
    def pinned(self) -> bool:
        return self._pinned_ptr is not None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def _fd(self) -> int:
        """The region file's descriptor (-1: none)."""
        return self._fd_box[0]

    @_fd.setter
    def _fd(self, fd: int) -> None:
        self._fd_box[0] = fd

    # --- cleanup -----------------------------------------------------------------

    def close(self) -> None:
        """Release the mapping in the strict order; idempotent.

        Raises :class:`RegionBusyError` (leaving the region usable) if a view of the
        rows is still referenced elsewhere.
        """
        if self._closed:
            return
        if self._pinned_ptr is not None:
            try:
                import torch

                torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)
            except Exception as exc:
                logger.warning("cudaHostUnregister failed for region %s: %s", self.name, exc)
            self._pinned_ptr = None
        live = sum(1 for ref in self._views if ref() is not None)
        with _FORK_GUARD:  # (a fork sees the rows and the mapping both there, or both gone)
            rows, self._rows = self._rows, None
            del rows
            if self._mmap is not None:
                try:
                    self._mmap.close()
                except BufferError:
                    self._rows = np.frombuffer(
                        self._mmap, dtype=np.uint8, count=self.num_rows * self.row_stride, offset=PAGE_SIZE
                    ).reshape(self.num_rows, self.row_stride)
                    raise RegionBusyError(
                        f"region {self.name!r} still has {max(live, 1)} exported view(s) of its rows alive; "
                        "drop every view (numpy arrays, memoryviews) before closing"
                    ) from None
                self._mmap = None
        self._close_fd()
        self._closed = True

    def _close_fd(self) -> None:
        fd = self._fd
        if fd < 0:
            return
        if try_flock(fd, exclusive=True) and not self.unlinked:
            # No other live process maps it: the last one out removes the path.
            self.unlink_if_ours()
        with _FORK_GUARD:  # (forgotten before closed: a fork never closes a number reused meanwhile)
            self._fd = -1
            os.close(fd)  # drops the flock and, for the creator, the creator lock

    def _release_quietly(self) -> None:
        """Close the mapping and the descriptor of a failed or abandoned attempt (never raises
        for a mapping still referenced: the kernel frees it with the last reference)."""
        with _FORK_GUARD:
            self._rows = None
            if self._mmap is not None:
                try:
                    self._mmap.close()
                except BufferError:
                    logger.warning("region %s: mapping still referenced during failed setup", self.name)
                self._mmap = None
            fd = self._fd
            if fd >= 0:
                self._fd = -1
                os.close(fd)

    def __enter__(self) -> SharedRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"SharedRegion({self.name!r}, rows={self.num_rows}, row_stride={self.row_stride}, "
            f"creator={self.is_creator}, unlinked={self.unlinked}, closed={self._closed})"
        )

    # --- stale sweep -------------------------------------------------------------

    @staticmethod
    def sweep(shm_dir: str | os.PathLike[str] = "/dev/shm", remove: bool = False) -> ShmSweep:
        """Stale regions of this user (removed with ``remove``), live ones, and ignored entries.

        See :func:`kvtier.region_file.sweep`: only a regular file of this uid with a valid
        header and no live mapper (flock) is stale; symlinks, FIFOs, devices, sockets,
        directories, other users' and header-less files are listed as ignored, with the
        reason, and never opened for I/O, waited on or deleted.
        """
        return sweep(shm_dir, remove)

    @staticmethod
    def sweep_stale(shm_dir: str | os.PathLike[str] = "/dev/shm", remove: bool = False) -> list[StaleRegion]:
        """The stale regions :meth:`sweep` finds (and with ``remove``, deletes)."""
        return sweep(shm_dir, remove).stale
