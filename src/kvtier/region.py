"""The shared CPU region: one file in /dev/shm mapped by the scheduler and every worker.

Layout: a header page, then ``num_rows`` rows of ``row_stride`` bytes, where the
stride is ``row_bytes`` rounded up to the page size, so every row is page
aligned (O_DIRECT and pinning need it).

Lifecycle (DESIGN.md section 3):

* **Create-or-attach.** A creator builds the file fully sized, with its header
  written, as an anonymous ``O_TMPFILE`` and links it into place atomically,
  so an attacher never sees a half-made file and exactly one creator wins. The
  others attach, waiting (bounded) for the file to appear.
* **Free space** in the directory is checked before anything is created; a
  shortfall raises :class:`InsufficientSpaceError` naming both sizes.
* **Liveness.** Every process holds a shared ``flock`` on the file while it maps
  it. The kernel drops the lock when the process dies, so a file whose
  exclusive lock can be taken has no live user: :meth:`SharedRegion.sweep_stale`
  removes exactly those, and never another live engine's file.
* **Unlink once mapped.** Each mapper increments an attach counter in the
  header (under a byte-range lock); the one that reaches ``expected_mappers``
  unlinks the path, guarded by ``(st_dev, st_ino)`` so a late process of an old
  generation cannot delete a new engine's file. From then on nothing can leak:
  the kernel frees the memory with the last mapping, even after SIGKILL.
* **Cleanup order:** unpin, drop the exported views, close the mapping, close
  the fd. A view still held elsewhere makes :meth:`close` raise
  :class:`RegionBusyError` (the region stays valid); it never crashes.

Thread-safety: construct and close from one thread. ``rows`` may be read and
written from any thread; coordinating who touches which row is the primary
tier's job.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import struct
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.errors import InsufficientSpaceError, RegionBusyError, RegionError
from kvtier.units import format_size as format_bytes
from kvtier.units import round_up as round_up

logger = logging.getLogger(__name__)

PAGE_SIZE = mmap.PAGESIZE
FILE_PREFIX = "kvtier-"
FILE_SUFFIX = ".shm"
_MAGIC = b"KVTREG01"
# magic, version, expected_mappers, num_rows, row_bytes, row_stride, creator_pid
_HEADER = struct.Struct("<8sIIQQQQ")
_ATTACHED_OFFSET = 512  # uint32 attach counter, guarded by a byte-range lock
_MADV_POPULATE_WRITE = 23


def region_path(name: str, shm_dir: str | os.PathLike[str] = "/dev/shm") -> Path:
    """The file path of region ``name`` (only ``[A-Za-z0-9._-]`` allowed in names)."""
    if not name or any(not (c.isalnum() or c in "._-") for c in name):
        raise RegionError(f"region name {name!r} must be non-empty and use only letters, digits, '.', '_', '-'")
    return Path(shm_dir) / f"{FILE_PREFIX}{name}{FILE_SUFFIX}"


def _link_fd(fd: int, path: Path) -> None:
    """Give an O_TMPFILE file a name, atomically; FileExistsError if the name is taken."""
    proc_fd = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        # linkat(..., AT_SYMLINK_FOLLOW) through /proc: plain link() would not follow the magic link.
        os.link(str(fd), path, src_dir_fd=proc_fd, follow_symlinks=True)
    finally:
        os.close(proc_fd)


@dataclass(frozen=True)
class StaleRegion:
    path: Path
    size: int
    removed: bool


class SharedRegion:
    """A page-aligned array of rows in a shared-memory file; see the module docstring.

    ``create``: None = create or attach (whoever comes first creates); True =
    must create (fails if the file exists); False = attach only (waits up to
    ``attach_timeout`` seconds for it to appear).
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
    ) -> None:
        if num_rows <= 0 or row_bytes <= 0:
            raise RegionError(f"a region needs num_rows > 0 and row_bytes > 0, got {num_rows} and {row_bytes}")
        if expected_mappers < 1:
            raise RegionError(f"expected_mappers must be >= 1, got {expected_mappers}")
        self.name = name
        self.path = region_path(name, shm_dir)
        self.num_rows = num_rows
        self.row_bytes = row_bytes
        self.row_stride = round_up(row_bytes)
        self.total_bytes = PAGE_SIZE + num_rows * self.row_stride
        self.expected_mappers = expected_mappers
        self.is_creator = False
        self.unlinked = False
        self._fd = -1
        self._mmap: mmap.mmap | None = None
        self._rows: np.ndarray | None = None
        self._pinned_ptr: int | None = None
        self._closed = False
        self._views: list[weakref.ref[Any]] = []
        try:
            if create is not False:
                created = self._try_create(prefault)
                if not created and create is True:
                    raise RegionError(f"region file {self.path} already exists; pick another name")
            if self._fd < 0:
                self._attach(attach_timeout)
            self._count_attach()
            if pin:
                self._pin()
        except BaseException:
            self._release_quietly()
            raise

    # --- construction ------------------------------------------------------------

    def _check_space(self) -> None:
        st = os.statvfs(self.path.parent)
        free = st.f_bavail * st.f_frsize
        if free < self.total_bytes:
            raise InsufficientSpaceError(
                f"{self.path.parent} has {format_bytes(free)} free, {format_bytes(self.total_bytes)} needed "
                f"for region {self.name!r} ({self.num_rows} rows of {format_bytes(self.row_stride)}): "
                f"lower cpu_bytes or enlarge {self.path.parent}"
            )

    def _try_create(self, prefault: bool) -> bool:
        if self.path.exists():
            return False
        if not self.path.parent.is_dir():
            raise RegionError(f"shared-memory directory {self.path.parent} does not exist")
        self._check_space()
        tmp_path: Path | None = None
        try:
            fd = os.open(self.path.parent, os.O_TMPFILE | os.O_RDWR, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            tmp_path = self.path.parent / f".{FILE_PREFIX}tmp-{uuid.uuid4().hex}{FILE_SUFFIX}"
            fd = os.open(tmp_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._fd = fd
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.ftruncate(fd, self.total_bytes)
            header = _HEADER.pack(
                _MAGIC, 1, self.expected_mappers, self.num_rows, self.row_bytes, self.row_stride, os.getpid()
            )
            os.pwrite(fd, header, 0)
            self._map()
            if prefault:
                self._prefault()
            try:
                if tmp_path is not None:
                    os.link(tmp_path, self.path)
                else:
                    _link_fd(fd, self.path)
            except FileExistsError:
                self._release_quietly()
                return False
            self.is_creator = True
            return True
        finally:
            if tmp_path is not None:
                tmp_path.unlink(missing_ok=True)

    def _attach(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR)
                break
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise RegionError(
                        f"region file {self.path} did not appear within {timeout}s: is the creating process "
                        "running and using the same region name and shm_dir?"
                    ) from None
                time.sleep(0.01)
        self._fd = fd
        fcntl.flock(fd, fcntl.LOCK_SH)
        st = os.fstat(fd)
        if st.st_nlink == 0:
            raise RegionError(f"region file {self.path} was removed while attaching (its creator exited?)")
        raw = os.pread(fd, _HEADER.size, 0)
        if len(raw) < _HEADER.size:
            raise RegionError(f"{self.path} is too short to be a kvtier region ({st.st_size} bytes)")
        magic, _version, _expected, num_rows, row_bytes, row_stride, _pid = _HEADER.unpack(raw)
        if magic != _MAGIC:
            raise RegionError(f"{self.path} is not a kvtier region (bad magic)")
        if (num_rows, row_bytes, row_stride) != (self.num_rows, self.row_bytes, self.row_stride):
            raise RegionError(
                f"region {self.path} has {num_rows} rows of {row_bytes} bytes, but {self.num_rows} rows of "
                f"{self.row_bytes} bytes were asked for: every process must use the same geometry and cpu size"
            )
        if st.st_size != self.total_bytes:
            raise RegionError(f"region {self.path} is {st.st_size} bytes, expected {self.total_bytes}")
        self._map()

    def _map(self) -> None:
        self._mmap = mmap.mmap(self._fd, self.total_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        base = np.frombuffer(self._mmap, dtype=np.uint8, count=self.num_rows * self.row_stride, offset=PAGE_SIZE)
        self._rows = base.reshape(self.num_rows, self.row_stride)

    def _prefault(self) -> None:
        assert self._mmap is not None
        try:
            self._mmap.madvise(_MADV_POPULATE_WRITE)
        except OSError:
            # Older kernel: a write per page faults it in (the file is new, so zeros are correct).
            assert self._rows is not None
            self._rows.reshape(-1)[::PAGE_SIZE] = 0

    def _count_attach(self) -> None:
        assert self._mmap is not None
        fcntl.lockf(self._fd, fcntl.LOCK_EX, 4, _ATTACHED_OFFSET)
        try:
            (count,) = struct.unpack_from("<I", self._mmap, _ATTACHED_OFFSET)
            count += 1
            struct.pack_into("<I", self._mmap, _ATTACHED_OFFSET, count)
            if count >= self.expected_mappers:
                self._unlink_if_ours()
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 4, _ATTACHED_OFFSET)

    def _unlink_if_ours(self) -> None:
        mine = os.fstat(self._fd)
        try:
            there = os.stat(self.path)
        except FileNotFoundError:
            self.unlinked = True
            return
        if (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
            self.path.unlink(missing_ok=True)
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
        if self._fd < 0:
            return
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # another live process still maps it; the last one out removes the path
        else:
            if not self.unlinked:
                self._unlink_if_ours()
        os.close(self._fd)
        self._fd = -1

    def _release_quietly(self) -> None:
        self._rows = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                logger.warning("region %s: mapping still referenced during failed setup", self.name)
            self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

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
    def sweep_stale(shm_dir: str | os.PathLike[str] = "/dev/shm", remove: bool = False) -> list[StaleRegion]:
        """Find (and with ``remove``, delete) region files that no live process holds.

        Liveness is the flock every mapper holds: if an exclusive lock can be taken,
        no live process maps the file. Files of live processes are never touched.
        """
        found: list[StaleRegion] = []
        directory = Path(shm_dir)
        candidates = sorted(directory.glob(f"{FILE_PREFIX}*{FILE_SUFFIX}"))
        candidates += sorted(directory.glob(f".{FILE_PREFIX}tmp-*{FILE_SUFFIX}"))
        for path in candidates:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                st = os.fstat(fd)
                removed = False
                if remove:
                    try:
                        there = os.stat(path)
                        if (there.st_dev, there.st_ino) == (st.st_dev, st.st_ino):
                            path.unlink()
                            removed = True
                            logger.info("removed stale region %s (%s)", path, format_bytes(st.st_size))
                    except FileNotFoundError:
                        pass
                found.append(StaleRegion(path, st.st_size, removed))
            finally:
                os.close(fd)
        return found
