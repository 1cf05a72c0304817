"""The filesystem secondary tier: a bounded, crash-safe, warm-restartable disk cache.

Configured as ``{"type": "fs", "root": "/nvme/kvtier", "max_bytes": "200GB", ...}``;
the options are declared once, in :class:`FilesystemTierOptions`.

How it works (layout and file format: :mod:`kvtier.tiers.fs_layout`):

* Values live under ``root/<namespace digest>/``, one file per block, named by
  the block key and sharded by its first byte. A manifest records the namespace
  and block size; a directory that holds anything else is refused.
* Stores write a temp file and rename it into place (fsync optional), so no
  reader ever sees a partial value, even after SIGKILL or power loss (a value
  that lost its bytes fails its checksum and is dropped on load).
* Bytes move with one ``pwritev``/``preadv`` per block straight between the file
  and a memoryview of the CPU row, with O_DIRECT when the file system supports
  it (probed at start) and the rows are page aligned; else through the page cache.
* Every load verifies header, key, namespace, length and the xxh3_64 payload
  checksum before the key is reported as a success. A mismatch fails that key,
  deletes the file and counts ``stats.corrupt_values``.
* ``read_threads`` threads serve only loads; ``write_threads`` threads take loads
  first and stores only when no load is queued. Job results carry per-key success.
* A byte budget (``max_bytes``) is enforced before each write by evicting least
  recently used files that no load is reading. ENOSPC lowers the budget to what
  fits, fails that key, and the budget grows back once the disk has room again.
* Lookups are answered from the in-memory index. At start it is rebuilt from the
  directory (in a background thread by default; keys of shards not yet scanned
  answer RETRY), and temp files of dead processes are swept.
* ``failure_threshold`` consecutive I/O errors open a circuit breaker: lookups
  answer MISS and stores are dropped. Every ``probe_interval`` seconds a probe
  (open a shard; write, read back, delete a small file) tries to close it again.

Job tracking, the queues, the threads, ``drain``, ``shutdown`` and the breaker's
wiring are the tier platform's (:class:`~kvtier.tiers.jobs.ThreadedTier`); this
module holds the index, the file I/O and the warm-restart scan.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import Field, field_validator

from kvtier.errors import ConfigError, CorruptValueError, TierError, UnsafeEntryError
from kvtier.failures import log_failure
from kvtier.keys import BlockKey
from kvtier.tiers.base import ExtraMetric, TierContext, TierUsage
from kvtier.tiers.fs_files import (
    FileModes,
    create_file,
    discard_corrupt,
    open_for_read,
    remove_value,
    take_for_recycling,
)
from kvtier.tiers.fs_index import FileIndex, Reservation
from kvtier.tiers.fs_layout import (
    O_DIRECT,
    PAGE,
    SHARDS,
    SUFFIX,
    InstanceDir,
    NamespaceReport,
    RootReport,
    aligned_buffer,
    ensure_manifest,
    entry_bytes,
    is_no_space,
    make_dirs,
    manifest_dict,
    probe_direct_io,
    read_value,
    round_up,
    scan_shard,
    sweep_temp_dirs,
    value_name,
    verify_root,
    write_value,
)
from kvtier.tiers.health import CircuitBreaker
from kvtier.tiers.jobs import ALL_LANES, Lane, ThreadedTier, Work
from kvtier.tiers.options import ByteSize, QueueLength, Seconds, Threads, TierOptions, tier_options
from kvtier.types import LookupResult, RequestContext
from kvtier.untrusted import open_regular

__all__ = ["FilesystemTier", "FilesystemTierOptions", "NamespaceReport", "RootReport", "verify_root"]

logger = logging.getLogger(__name__)

DEFAULT_FREE_FRACTION = 0.5
"""Without ``max_bytes``: the tier may use this share of (free space + its own files)."""


class FilesystemTierOptions(TierOptions):
    """Local disk / NVMe tier (``type: fs``): the options of :class:`FilesystemTier`."""

    root: str = Field(
        min_length=1,
        description="Directory that holds the tier's files (created if missing). Several engines may share it; "
        "each namespace gets its own subdirectory.",
    )
    max_bytes: ByteSize | None = Field(
        default=None,
        gt=0,
        description="Byte budget of this namespace's files, e.g. '64GiB' (LRU of files beyond it). "
        "Default: half of the free space plus what the namespace already holds.",
    )
    read_threads: Threads = Field(default=4, description="I/O threads serving only loads (promotions).")
    write_threads: Threads = Field(default=2, description="I/O threads serving stores, loads first.")
    fsync: bool = Field(
        default=False,
        description="fsync each value and its directory before a store reports (survives power loss, costs "
        "write throughput; crash safety against process death does not need it).",
    )
    direct_io: bool | Literal["auto"] = Field(
        default="auto",
        description="O_DIRECT: 'auto' (where the file system allows it and the CPU rows are page aligned), "
        "true (required: refused where impossible), false.",
    )
    scan_in_background: bool = Field(
        default=True, description="Rebuild the index from disk in a thread (unscanned keys answer RETRY)."
    )
    failure_threshold: int = Field(
        default=5, ge=1, le=1_000_000, description="Consecutive I/O errors that open the breaker."
    )
    probe_interval: Seconds = Field(default=2.0, gt=0, description="Seconds between health probes while open.")
    max_queued_stores: QueueLength = Field(
        default=256,
        description="Blocks waiting to be written beyond which new stores are shed (each pins a CPU row).",
    )
    shutdown_timeout: Seconds = Field(
        default=30.0, gt=0, description="Seconds shutdown() lets queued jobs finish, then per thread join."
    )
    share_group: str | Annotated[int, Field(ge=0, le=2**32 - 2)] | None = Field(
        default=None,
        description="Share the cache with this Unix group (directories 2770, files 0640, the group's files "
        "are served). Default: private to this user (0700 / 0600).",
    )

    @field_validator("root", mode="before")
    @classmethod
    def _path(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    def capacity(self) -> int | None:
        return self.max_bytes


class _Corrupt(Exception):
    """A value failed verification (``removed``: its file was ours and is deleted)."""

    def __init__(self, reason: str, removed: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.removed = removed


class FilesystemTier(ThreadedTier):
    """A secondary tier on a local file system (NVMe, SSD, any POSIX directory).

    Options: :class:`FilesystemTierOptions` (an instance, or its fields as keyword
    arguments: ``FilesystemTier(context, root="/nvme/kv", max_bytes="64GiB")``).

    The root is untrusted content (see :mod:`kvtier.tiers.fs_files`): no link is
    followed, only regular files of this user (or group) are opened, nothing else is
    indexed, served, recycled or deleted, and engines sharing a root never read a file
    the other is recycling. Every option is validated before anything is created.
    """

    tier_type = "fs"
    medium = "disk"
    options_model = FilesystemTierOptions
    extra_metrics: ClassVar[Mapping[str, ExtraMetric]] = {
        "io_errors": ExtraMetric("counter", "I/O errors (each also counts against the health breaker)."),
        "enospc": ExtraMetric("counter", "Writes that found the file system full (capacity lowered)."),
        "vanished": ExtraMetric("counter", "Values gone from disk when read (removed by someone else)."),
        "stores_skipped": ExtraMetric("counter", "Blocks of store jobs already on disk (nothing written)."),
        "scan_entries": ExtraMetric("gauge", "Values indexed by the warm-restart scan."),
        "scan_seconds": ExtraMetric("gauge", "Duration of the warm-restart scan."),
        "temp_files_swept": ExtraMetric("gauge", "Temporary files of dead writers removed at start."),
        "unsafe_entries": ExtraMetric("counter", "Entries of the root that are not regular files of ours (untouched)."),
    }

    @classmethod
    def bytes_per_block(cls, block_bytes: int) -> int:
        """One value file: the header page plus the payload rounded up to whole pages."""
        return entry_bytes(block_bytes)

    def __init__(
        self, context: TierContext, options: FilesystemTierOptions | None = None, /, **fields: Any
    ) -> None:
        """Check the options, prepare the namespace directory, size the budget, start the threads."""
        self.options = opts = tier_options(FilesystemTierOptions, self.tier_type, options, fields)
        rows, block_bytes = context.rows, context.block_bytes
        if rows.ndim != 2 or rows.dtype != np.uint8 or block_bytes > rows.shape[1]:
            raise ConfigError(
                f"fs tier needs rows as a 2-D uint8 array with rows of >= {block_bytes} bytes, "
                f"got shape {rows.shape} dtype {rows.dtype}"
            )
        self.entry_bytes = entry_bytes(block_bytes)
        if opts.max_bytes is not None and opts.max_bytes < self.entry_bytes:
            raise ConfigError(
                f"fs tier max_bytes={opts.max_bytes} is smaller than one block file ({self.entry_bytes} "
                "bytes): raise max_bytes"
            )
        super().__init__(
            context,
            breaker=CircuitBreaker(failure_threshold=opts.failure_threshold, open_seconds=opts.probe_interval),
            max_queued_stores=opts.max_queued_stores,
            shutdown_timeout=opts.shutdown_timeout,
            shutdown_grace=opts.shutdown_timeout,
        )
        self.modes = FileModes.for_group(opts.share_group)
        self.root = Path(opts.root)
        self.ns_dir = self.root / context.namespace.hexdigest
        self.block_bytes = block_bytes
        self.fsync = opts.fsync
        self._digest = context.namespace.digest
        self._open_directories()
        self._direct_flag = O_DIRECT if self.direct_io else 0
        self._index = FileIndex(self.max_bytes, self.entry_bytes)
        self._free_recheck_interval = opts.probe_interval
        self._last_enospc = 0.0
        self._probe_seq = itertools.count(1)
        self._stop_scan = threading.Event()
        self._scan_done = threading.Event()
        self._scanned = bytearray(256)
        self.stats.extra.update(
            {"io_errors": 0, "enospc": 0, "vanished": 0, "scan_entries": 0, "scan_seconds": 0.0,
             "unsafe_entries": 0, "temp_files_swept": float(self.swept_temp_files)}
        )  # fmt: skip
        self._start()

    # --- construction helpers -------------------------------------------------------------

    def _open_directories(self) -> None:
        """Adopt the namespace directory (manifest, sweep of dead writers, this instance's temp
        directory), then choose O_DIRECT and the byte budget; each step undone if a later one fails."""
        self._dirs = make_dirs(self.ns_dir, self.modes)
        try:
            manifest = manifest_dict(self._digest, self.context.namespace.canonical(), self.block_bytes)
            ensure_manifest(self._dirs, manifest)
            self.swept_temp_dirs, self.swept_temp_files = sweep_temp_dirs(self._dirs)
            self._instance = InstanceDir(self._dirs)
        except BaseException:
            self._dirs.close()
            raise
        try:
            self.direct_io, self.direct_io_reason = self._choose_direct_io(self.options.direct_io)
            # Bytes moved per block: O_DIRECT needs whole pages (the row's padding rides along).
            self._io_bytes = round_up(self.block_bytes) if self.direct_io else self.block_bytes
            self.max_bytes = self._resolve_max_bytes(self.options.max_bytes, self._count_existing_files())
        except BaseException:
            self._instance.close(remove=True)
            self._dirs.close()
            raise

    def _start(self) -> None:
        """Start the I/O threads and the warm-restart scan (or run it here); shut down if that fails."""
        opts = self.options
        try:
            self._start_workers(opts.read_threads, frozenset({Lane.LOAD}), "read")
            self._start_workers(opts.write_threads, ALL_LANES, "write")
            if opts.scan_in_background:
                self._start_thread("scan", self._scan)
            else:
                self._scan()
        except BaseException:
            with contextlib.suppress(Exception):
                self.shutdown()
            raise
        logger.info(
            "fs tier %s: %s, capacity %.2f GiB, %s, %d read / %d write threads",
            self.label, self.ns_dir, self.max_bytes / 2**30,
            "O_DIRECT" if self.direct_io else f"buffered I/O ({self.direct_io_reason})",
            opts.read_threads, opts.write_threads,
        )  # fmt: skip

    def _choose_direct_io(self, mode: bool | Literal["auto"]) -> tuple[bool, str]:
        if mode is False:
            return False, "direct_io=false"
        assert self._rows is not None
        rows = self._rows
        reason: str | None = None
        if rows.ctypes.data % PAGE or rows.strides[0] % PAGE or rows.strides[1] != 1:
            reason = "CPU rows are not page aligned"
        elif round_up(self.block_bytes) > rows.strides[0]:
            reason = "CPU rows have no room for page padding"
        else:
            reason = probe_direct_io(self._instance.path)
        if reason is None:
            return True, "O_DIRECT"
        if mode is True:
            raise ConfigError(
                f"fs tier direct_io=true is impossible under {self.root}: {reason}. Use direct_io='auto' or false"
            )
        logger.info("fs tier under %s: O_DIRECT not used: %s", self.root, reason)
        return False, reason

    def _count_existing_files(self) -> int:
        return sum(1 for shard in SHARDS for e in self._dirs.entries(shard) if e.name.endswith(SUFFIX))

    def _resolve_max_bytes(self, max_bytes: int | None, existing_files: int) -> int:
        if max_bytes is None:
            usage = shutil.disk_usage(self.ns_dir)
            budget = int((usage.free + existing_files * self.entry_bytes) * DEFAULT_FREE_FRACTION)
        else:
            budget = max_bytes
        if budget < self.entry_bytes:
            raise ConfigError(
                f"fs tier max_bytes={budget} is smaller than one block file ({self.entry_bytes} bytes): "
                "raise max_bytes or free space under 'root'"
            )
        return budget

    # --- scheduler-thread calls (never block on I/O) -----------------------------------------

    def _lookup(self, key: BlockKey, request: RequestContext | None) -> LookupResult:
        """HIT if the index holds ``key``; RETRY while its shard is not scanned yet; else MISS."""
        scanned = self._scanned[key[0]]  # read before the index: the scan adds keys, then flags
        if self._index.hit(key):
            return LookupResult.HIT
        return LookupResult.MISS if scanned else LookupResult.RETRY

    def touch(self, keys: Sequence[BlockKey], request: RequestContext | None) -> None:
        self._index.touch(keys)

    def _holds(self, key: BlockKey) -> bool:
        """Stores skip keys already on disk."""
        return key in self._index

    def _admit_load(self, key: BlockKey) -> bool:
        """Pin ``key`` against eviction until its load ran; False if it is no longer on disk."""
        return self._index.pin(key)

    def _abandon(self, work: Work) -> None:
        if work.lane is Lane.LOAD:
            self._index.unpin(work.keys[0])

    def usage(self) -> TierUsage:
        return TierUsage(self._index.used_bytes, self._index.capacity, len(self._index))

    @property
    def scan_complete(self) -> bool:
        """True once the warm-restart scan has indexed every shard."""
        return self._scan_done.is_set()

    def describe(self) -> dict[str, Any]:
        usage = self.usage()
        return {
            "type": self.tier_type,
            "medium": self.medium,
            **self.options.model_dump(mode="json"),
            "namespace_dir": str(self.ns_dir),
            "max_bytes": self.max_bytes,
            "capacity_bytes": usage.capacity_bytes,
            "used_bytes": usage.used_bytes,
            "entries": usage.entries,
            "block_bytes": self.block_bytes,
            "file_bytes": self.entry_bytes,
            "direct_io": self.direct_io,
            "direct_io_reason": self.direct_io_reason,
            "scan_complete": self.scan_complete,
            "health": self._breaker.state.value,
        }

    # --- I/O threads ----------------------------------------------------------------------

    def _open_worker(self) -> Any:
        """A page-aligned header buffer per thread (O_DIRECT reads and writes the header page)."""
        buffer = aligned_buffer(PAGE)
        return buffer, memoryview(buffer)

    def _close_worker(self, local: Any) -> None:
        buffer, header = local
        header.release()
        buffer.close()

    def _run(self, work: Work, local: Any) -> None:
        if work.lane is Lane.LOAD:
            self._load_block(work, local[1])
        else:
            self._store_block(work, local[1])

    def _row_view(self, slot: int) -> memoryview:
        rows = self._rows
        if rows is None:
            raise TierError("CPU rows were released")
        return rows[slot, : self._io_bytes].data

    def _load_block(self, work: Work, header: memoryview) -> None:
        key, slot = work.keys[0], work.slots[0]
        shard, name = f"{key[0]:02x}", value_name(key)
        error: str | None = None
        t0 = time.perf_counter()
        try:
            shard_fd = self._dirs.subdir(shard)
            try:
                self._read_into_row(slot, shard_fd, name, key, header)
            finally:
                os.close(shard_fd)
            self._breaker.record_success(time.perf_counter() - t0)
        except _Corrupt as exc:
            error = f"corrupt value {key.hex()[:16]}: {exc.reason}"
            logger.warning("fs tier %s: %s; %s", self.label, error, "deleted" if exc.removed else "left in place")
            self._count(corrupt_values=1)
            self._forget(key)
        except UnsafeEntryError as exc:
            error = f"value {key.hex()[:16]} is not served: {exc}"
            what = f"fs tier {self.label}: value {key.hex()[:16]} is not served (never opened for I/O, never deleted)"
            log_failure(logger, logging.WARNING, what, exc)
            self._count(unsafe_entries=1)
            self._forget(key)
        except FileNotFoundError:
            error = f"value {key.hex()[:16]} vanished from disk"
            self._count(vanished=1)
            self._forget(key)
        except OSError as exc:
            error = f"read of {shard}/{name} failed: {exc.strerror or exc}"
            self._io_error(error)
        finally:
            self._index.unpin(key)
        if error is None:
            self._complete(work, ok=[key], nbytes=self.block_bytes)
        else:
            self._complete(work, error=error)

    def _read_into_row(self, slot: int, shard_fd: int, name: str, key: BlockKey, header: memoryview) -> None:
        """Read value ``name`` into CPU row ``slot`` and verify it; raises _Corrupt (after removing
        the file if it is ours and still the one that failed), UnsafeEntryError, FileNotFoundError."""
        fd, st = open_for_read(shard_fd, name, self._direct_flag, self.modes)
        try:
            row = self._row_view(slot)
            try:
                read_value(
                    fd, st.st_size, header, row, namespace=self._digest, key=key,
                    block_bytes=self.block_bytes, direct=self.direct_io, name=f"{key[0]:02x}/{name}",
                )  # fmt: skip
            finally:
                row.release()
        except CorruptValueError as exc:
            removed = discard_corrupt(
                shard_fd, name, st, self._instance.fd, self._instance.temp_name(key), self.modes
            )
            raise _Corrupt(str(exc), removed) from None
        finally:
            os.close(fd)

    def _store_block(self, work: Work, header: memoryview) -> None:
        key, slot = work.keys[0], work.slots[0]
        if not self._breaker.serving:
            self._complete(work, error="dropped: tier out of service", dropped=True)
            return
        self._maybe_regrow_capacity()
        plan = self._index.reserve(key)
        if plan.outcome is not Reservation.GRANTED:
            if plan.outcome is Reservation.FULL:
                self._complete(work, error="no room: every evictable file is being read", dropped=True)
            else:  # present or being written by another job: nothing to do
                self._count(stores_skipped=1)
                self._complete(work, ok=[key])
            return
        error: str | None = None
        tmp = self._instance.temp_name(key)
        tmp_dir = self._instance.fd
        fd: int | None = None
        if plan.victims:
            fd = self._unlink_victims(plan.victims, recycle_to=tmp)
        recycled = fd is not None
        try:
            if fd is None:
                fd = create_file(tmp_dir, tmp, self._direct_flag, self.modes)
            row = self._row_view(slot)
            try:
                write_value(
                    fd, header, row, namespace=self._digest, key=key, block_bytes=self.block_bytes,
                    fsync=self.fsync, reuse=recycled,
                )  # fmt: skip
            finally:
                row.release()
            os.close(fd)  # drops a recycled file's exclusive lock before it is visible again
            fd = None
            shard_fd = self._dirs.subdir(f"{key[0]:02x}")
            try:
                os.rename(tmp, value_name(key), src_dir_fd=tmp_dir, dst_dir_fd=shard_fd)
                if self.fsync:
                    os.fsync(shard_fd)
            finally:
                os.close(shard_fd)
            self._index.commit(key)
            self._breaker.record_success()
        except BaseException as exc:
            if fd is not None:
                os.close(fd)
            self._index.abort(key)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=tmp_dir)
            if not isinstance(exc, OSError):
                raise
            if is_no_space(exc):
                capacity = self._index.lower_capacity_to_used()
                self._last_enospc = time.monotonic()
                error = f"no space left under {self.root}; capacity lowered to {capacity} bytes"
                logger.warning("fs tier %s: %s", self.label, error)
                self._count(enospc=1)
            else:
                error = f"write of {key.hex()[:16]} failed: {exc.strerror or exc}"
                self._io_error(error)
        if error is None:
            self._emit([key], removed=False)
            self._complete(work, ok=[key], nbytes=self.block_bytes)
        else:
            self._complete(work, error=error)

    def _unlink_victims(self, victims: list[BlockKey], recycle_to: str | None = None) -> int | None:
        """Delete evicted values. With ``recycle_to``, the first victim that may be recycled (a
        regular file of ours that no reader holds, in any process) is moved there instead and
        returned open and exclusively locked, for the caller to overwrite: rewriting allocated
        blocks is about twice as fast as filling a fresh file. Entries that are not regular
        files we may remove are left alone (they were never ours)."""
        recycled: int | None = None
        for victim in victims:
            shard, name = f"{victim[0]:02x}", value_name(victim)
            try:
                shard_fd = self._dirs.subdir(shard)
                try:
                    if recycle_to is not None and recycled is None:
                        recycled = take_for_recycling(
                            shard_fd, name, self._instance.fd, recycle_to, self._direct_flag, self.modes
                        )
                        if recycled is not None:
                            continue
                    remove_value(shard_fd, name, self.modes)
                finally:
                    os.close(shard_fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._io_error(f"evicting {victim.hex()[:16]} failed: {exc.strerror or exc}")
        self._index.finish_delete(victims)
        self._count(evictions=len(victims))
        self._emit(victims, removed=True)
        return recycled

    def _forget(self, key: BlockKey) -> None:
        """Drop a value that is corrupt, vanished or unsafe from the index (its file, if any, was
        dealt with by the caller: a file is only ever removed when proven ours)."""
        if not self._index.begin_delete(key):
            return
        self._index.finish_delete([key])
        self._emit([key], removed=True)

    def _maybe_regrow_capacity(self) -> None:
        """After ENOSPC, let the budget grow back once the disk has room again (checked at
        most every ``probe_interval`` seconds, on a write thread)."""
        if self._index.capacity >= self._index.max_capacity:
            return
        now = time.monotonic()
        if now - self._last_enospc < self._free_recheck_interval:
            return
        self._last_enospc = now
        try:
            free = shutil.disk_usage(self.ns_dir).free
        except OSError:
            return
        # Keep one file of headroom so the next ENOSPC is not immediate.
        grown = self._index.used_bytes + self._index.reserved_bytes + free - self.entry_bytes
        if grown > self._index.capacity:
            self._index.set_capacity(grown)
            logger.info("fs tier %s: capacity back to %d bytes", self.label, self._index.capacity)

    def _io_error(self, detail: str) -> None:
        logger.warning("fs tier %s: %s", self.label, detail)
        self._count(io_errors=1)
        self._note_failure(detail)

    def _probe(self) -> None:
        """Open a shard, then write, read back and delete a one-page file; raises if any step fails."""
        os.close(self._dirs.subdir(SHARDS[0]))
        name = f"health-probe.{next(self._probe_seq)}"
        dir_fd = self._instance.fd
        payload = os.urandom(PAGE)
        fd = create_file(dir_fd, name, 0, self.modes)
        try:
            os.write(fd, payload)
        finally:
            os.close(fd)
        fd = open_regular(name, os.O_RDONLY, dir_fd=dir_fd)
        try:
            back = os.read(fd, PAGE + 1)
        finally:
            os.close(fd)
        os.unlink(name, dir_fd=dir_fd)
        if back != payload:
            raise OSError(errno.EIO, "probe read back different bytes")

    # --- warm restart scan -------------------------------------------------------------------

    def _scan(self) -> None:
        """Index every value file on disk, shard by shard (oldest files become LRU)."""
        t0 = time.perf_counter()
        found: list[tuple[float, bytes]] = []
        try:
            for i, shard in enumerate(SHARDS):
                if self._stop_scan.is_set():
                    return
                entries, unsafe = scan_shard(self._dirs, shard)
                if unsafe:
                    self._count(unsafe_entries=unsafe)
                self._index.add_scanned(key for _, key in entries)
                self._scanned[i] = 1
                found.extend(entries)
            found.sort(reverse=True)
            self._index.order_oldest_first([key for _, key in found])
            victims = self._index.evict_over_capacity()
            if victims:
                logger.info("fs tier %s: %d files beyond max_bytes evicted after restart", self.label, len(victims))
                self._unlink_victims(victims)
        except Exception as exc:
            what = f"fs tier {self.label}: scan of {self.ns_dir} failed; unscanned keys answer MISS"
            log_failure(logger, logging.ERROR, what, exc, with_traceback=True)
        finally:
            for i in range(256):
                self._scanned[i] = 1
            with self._stats_lock:
                self.stats.extra["scan_entries"] = float(len(found))
                self.stats.extra["scan_seconds"] = time.perf_counter() - t0
            self._scan_done.set()

    # --- shutdown (the platform's hooks) --------------------------------------------------------

    def _stop(self) -> None:
        self._stop_scan.set()

    def _close(self) -> None:
        self._instance.close(remove=True)
        self._dirs.close()
