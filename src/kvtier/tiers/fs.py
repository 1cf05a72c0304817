"""The filesystem secondary tier: a bounded, crash-safe, warm-restartable disk cache.

Configured as ``{"type": "fs", "root": "/nvme/kvtier", "max_bytes": 200e9, ...}``;
the keyword arguments of :class:`FilesystemTier` are the schema's option names.

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
  (write, read back, delete a small file) tries to close it again.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvtier.errors import ConfigError, CorruptValueError, TierDrainTimeout, TierError
from kvtier.keys import BlockKey
from kvtier.tiers.base import (
    ExtraMetric,
    HealthState,
    JobResult,
    SecondaryTier,
    TierContext,
    TierHealth,
    TierUsage,
    TransferJob,
)
from kvtier.tiers.fs_index import FileIndex, Reservation
from kvtier.tiers.fs_layout import (
    PAGE,
    SHARDS,
    InstanceDir,
    NamespaceReport,
    RootReport,
    aligned_buffer,
    ensure_manifest,
    entry_bytes,
    fsync_dir,
    is_no_space,
    make_dirs,
    manifest_dict,
    probe_direct_io,
    read_value,
    round_up,
    scan_shard,
    sweep_temp_dirs,
    value_path,
    verify_root,
    write_value,
)
from kvtier.tiers.health import CircuitBreaker
from kvtier.types import BlockEvent, LookupResult, RequestContext
from kvtier.units import parse_size

__all__ = ["FilesystemTier", "FilesystemTierOptions", "NamespaceReport", "RootReport", "verify_root"]

logger = logging.getLogger(__name__)

DEFAULT_FREE_FRACTION = 0.5
"""Without ``max_bytes``: the tier may use this share of (free space + its own files)."""


class FilesystemTierOptions(BaseModel):
    """Local disk / NVMe tier (``type: fs``): the keyword options of :class:`FilesystemTier`."""

    model_config = ConfigDict(extra="forbid")

    root: str = Field(description="Directory that holds the tier's files (created if missing).")
    max_bytes: int | None = Field(
        default=None,
        description="Byte budget of this namespace's files, e.g. '64GiB' (LRU of files beyond it). "
        "Default: half of the free space plus what the namespace already holds.",
    )
    read_threads: int = Field(default=4, gt=0, description="I/O threads serving only loads (promotions).")
    write_threads: int = Field(default=2, gt=0, description="I/O threads serving stores, loads first.")
    fsync: bool = Field(default=False, description="fsync each value and its directory before a store reports.")
    direct_io: bool | Literal["auto"] = Field(
        default="auto", description="O_DIRECT: 'auto' (where the file system allows it), true (required), false."
    )
    scan_in_background: bool = Field(
        default=True, description="Rebuild the index from disk in a thread (unscanned keys answer RETRY)."
    )
    failure_threshold: int = Field(default=5, ge=1, description="Consecutive I/O errors that open the breaker.")
    probe_interval: float = Field(default=2.0, gt=0, description="Seconds between health probes while open.")
    max_queued_stores: int = Field(
        default=256, ge=1, description="Blocks waiting to be written beyond which new stores are shed."
    )
    shutdown_timeout: float = Field(
        default=30.0, gt=0, description="Seconds shutdown() lets queued jobs finish, then per thread join."
    )

    @field_validator("root", mode="before")
    @classmethod
    def _path(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("max_bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return None if value is None else parse_size(value)


@dataclass
class _Job:
    """Book-keeping of one submitted job while its blocks are in flight."""

    job: TransferJob
    started: float
    remaining: int
    ok: set[BlockKey] = field(default_factory=set)
    bytes_moved: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class _Task:
    """One block of a job (or the health probe when ``job`` is None)."""

    job: _Job | None
    key: BlockKey = b""
    slot: int = 0
    pinned: bool = False


class _WorkQueue:
    """Loads before stores: read threads take only loads; write threads take a load
    when one is queued, else a store."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._loads: deque[_Task] = deque()
        self._stores: deque[_Task] = deque()
        self._closed = False

    def put(self, tasks: Sequence[_Task], load: bool) -> None:
        with self._cond:
            (self._loads if load else self._stores).extend(tasks)
            self._cond.notify_all()

    def get(self, takes_stores: bool) -> tuple[_Task, bool] | None:
        """Next ``(task, is_load)``; None once closed (queued tasks are left for ``cancel_all``)."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                if self._loads:
                    return self._loads.popleft(), True
                if takes_stores and self._stores:
                    return self._stores.popleft(), False
                self._cond.wait()

    def queued_stores(self) -> int:
        return len(self._stores)

    def close(self) -> list[tuple[_Task, bool]]:
        """Stop handing out work; returns the tasks still queued."""
        with self._cond:
            self._closed = True
            left = [(t, True) for t in self._loads] + [(t, False) for t in self._stores]
            self._loads.clear()
            self._stores.clear()
            self._cond.notify_all()
            return left


class FilesystemTier(SecondaryTier):
    """A secondary tier on a local file system (NVMe, SSD, any POSIX directory).

    Options (the config schema's names):

    * ``root``: directory of the cache; created if missing. Several engines may
      share it; each namespace gets its own subdirectory.
    * ``max_bytes``: byte budget of this namespace's value files. Default: half of
      (free space on the file system + what this namespace already holds).
    * ``read_threads`` / ``write_threads``: I/O threads for loads / stores (write
      threads also serve loads first when any are queued).
    * ``fsync``: fsync each value and its directory before reporting a store (survives
      power loss, costs write throughput). Crash safety against process death does
      not need it.
    * ``direct_io``: ``"auto"`` (O_DIRECT if the file system supports it and the CPU
      rows are page aligned), ``True`` (require it; ConfigError otherwise), ``False``.
    * ``scan_in_background``: rebuild the index from disk in a background thread
      (lookups of keys in shards not yet scanned answer RETRY) instead of in the
      constructor.
    * ``failure_threshold``: consecutive I/O errors that take the tier out of service.
    * ``probe_interval``: seconds between health probes while out of service.
    * ``max_queued_stores``: blocks waiting to be written beyond which new stores are
      dropped (each queued store pins a CPU row), so a slow disk sheds writes first.
    * ``shutdown_timeout``: seconds ``shutdown()`` lets queued jobs finish before
      failing the rest, and then waits for each thread to exit.
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
    }

    def __init__(
        self,
        context: TierContext,
        *,
        root: str | os.PathLike[str],
        max_bytes: int | float | None = None,
        read_threads: int = 4,
        write_threads: int = 2,
        fsync: bool = False,
        direct_io: bool | str = "auto",
        scan_in_background: bool = True,
        failure_threshold: int = 5,
        probe_interval: float = 2.0,
        max_queued_stores: int = 256,
        shutdown_timeout: float = 30.0,
    ) -> None:
        """Check the options, prepare the namespace directory, size the budget, start the threads.

        Long because it is the tier's start-up sequence, in order: each step is a few
        lines that need the previous one (directory before manifest, probe before budget).
        """
        super().__init__(context)
        if read_threads < 1 or write_threads < 1:
            raise ConfigError(
                f"fs tier needs read_threads >= 1 and write_threads >= 1, got {read_threads} and {write_threads}"
            )
        if direct_io not in (True, False, "auto"):
            raise ConfigError(f"fs tier direct_io must be true, false or 'auto', got {direct_io!r}")
        if probe_interval <= 0 or shutdown_timeout <= 0 or max_queued_stores < 1:
            raise ConfigError(
                "fs tier probe_interval and shutdown_timeout must be > 0 and max_queued_stores >= 1, got "
                f"{probe_interval}, {shutdown_timeout}, {max_queued_stores}"
            )
        rows = context.rows
        block_bytes = context.block_bytes
        if rows.ndim != 2 or rows.dtype != np.uint8 or block_bytes > rows.shape[1]:
            raise ConfigError(
                f"fs tier needs rows as a 2-D uint8 array with rows of >= {block_bytes} bytes, "
                f"got shape {rows.shape} dtype {rows.dtype}"
            )
        self.root = Path(root)
        self.ns_dir = self.root / context.namespace.hexdigest
        self.block_bytes = block_bytes
        self.entry_bytes = entry_bytes(block_bytes)
        self.fsync = bool(fsync)
        self.read_threads = int(read_threads)
        self.write_threads = int(write_threads)
        self.max_queued_stores = int(max_queued_stores)
        self.shutdown_timeout = float(shutdown_timeout)
        self._digest = context.namespace.digest
        self._rows: np.ndarray | None = rows

        try:
            make_dirs(self.ns_dir)
        except OSError as exc:
            raise ConfigError(f"fs tier root {self.root} is not usable ({exc}): pick a writable 'root'") from exc
        ensure_manifest(self.ns_dir, manifest_dict(self._digest, context.namespace.canonical(), block_bytes))
        self.swept_temp_dirs, self.swept_temp_files = sweep_temp_dirs(self.ns_dir)
        self._instance = InstanceDir(self.ns_dir)

        self.direct_io, self.direct_io_reason = self._choose_direct_io(direct_io)
        # Bytes moved per block: O_DIRECT needs whole pages (the row's padding rides along).
        self._io_bytes = round_up(block_bytes) if self.direct_io else block_bytes

        existing = self._count_existing_files()
        self.max_bytes = self._resolve_max_bytes(max_bytes, existing)
        self._index = FileIndex(self.max_bytes, self.entry_bytes)
        self._breaker = CircuitBreaker(failure_threshold=failure_threshold, open_seconds=probe_interval)
        self._free_recheck_interval = probe_interval
        self._last_enospc = 0.0

        self._lock = threading.Lock()  # jobs, results, events, stats written by I/O threads
        self._idle = threading.Condition(self._lock)
        self._outstanding = 0
        self._finished: list[JobResult] = []
        self._events: list[BlockEvent] = []
        self._probe_queued = False
        self._accepting = True
        self._shut = False
        self._queue = _WorkQueue()
        self._stop_scan = threading.Event()
        self._scan_done = threading.Event()
        self._scanned = bytearray(256)
        self.stats.extra.update(
            {
                "io_errors": 0,
                "enospc": 0,
                "vanished": 0,
                "stores_skipped": 0,
                "scan_entries": 0,
                "scan_seconds": 0.0,
                "temp_files_swept": float(self.swept_temp_files),
            }
        )

        self._threads: list[threading.Thread] = []
        try:
            for i in range(self.read_threads):
                self._start_thread(f"kvtier-fs-read-{i}", self._io_loop, False)
            for i in range(self.write_threads):
                self._start_thread(f"kvtier-fs-write-{i}", self._io_loop, True)
            if scan_in_background:
                self._start_thread("kvtier-fs-scan", self._scan, None)
            else:
                self._scan(None)
        except BaseException:
            with contextlib.suppress(Exception):
                self.shutdown()
            raise
        logger.info(
            "fs tier %s: %s, capacity %.2f GiB, %s, %d read / %d write threads",
            self.label,
            self.ns_dir,
            self.max_bytes / 2**30,
            "O_DIRECT" if self.direct_io else f"buffered I/O ({self.direct_io_reason})",
            self.read_threads,
            self.write_threads,
        )

    # --- construction helpers -------------------------------------------------------------

    def _start_thread(self, name: str, target: Any, arg: Any) -> None:
        thread = threading.Thread(target=target, args=(arg,), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _choose_direct_io(self, mode: bool | str) -> tuple[bool, str]:
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
        return sum(len(os.listdir(self.ns_dir / shard)) for shard in SHARDS)

    def _resolve_max_bytes(self, max_bytes: int | float | None, existing_files: int) -> int:
        if max_bytes is None:
            usage = shutil.disk_usage(self.ns_dir)
            budget = int((usage.free + existing_files * self.entry_bytes) * DEFAULT_FREE_FRACTION)
        else:
            budget = int(max_bytes)
        if budget < self.entry_bytes:
            raise ConfigError(
                f"fs tier max_bytes={budget} is smaller than one block file ({self.entry_bytes} bytes): "
                "raise max_bytes or free space under 'root'"
            )
        return budget

    # --- scheduler-thread calls (never block on I/O) -----------------------------------------

    def lookup(self, key: BlockKey, request: RequestContext | None) -> LookupResult:
        """HIT if the index holds ``key``; RETRY while its shard is not scanned yet; else MISS.
        MISS while the tier is out of service."""
        if not self._breaker.serving:
            self._maybe_probe()
            self.stats.lookups_miss += 1
            return LookupResult.MISS
        scanned = self._scanned[key[0]]  # read before the index: the scan adds keys, then flags
        if self._index.hit(key):
            self.stats.lookups_hit += 1
            return LookupResult.HIT
        if not scanned:
            self.stats.lookups_retry += 1
            return LookupResult.RETRY
        self.stats.lookups_miss += 1
        return LookupResult.MISS

    def touch(self, keys: Sequence[BlockKey], request: RequestContext | None) -> None:
        self._index.touch(keys)

    def submit_store(self, job: TransferJob) -> None:
        """Queue the writes of ``job``; keys already on disk are skipped (reported as success).
        When out of service or when ``max_queued_stores`` blocks already wait, the new blocks
        are dropped (reported as failed, counted in ``stats.stores_dropped``)."""
        self._check_accepting()
        state = self._register(job)
        tasks: list[_Task] = []
        dropped = skipped = 0
        shed = (not self._breaker.serving) or self._queue.queued_stores() >= self.max_queued_stores
        for key, slot in zip(job.keys, job.slots, strict=True):
            if key in self._index:
                state.ok.add(key)
                skipped += 1
            elif shed:
                dropped += 1
            else:
                tasks.append(_Task(state, key, int(slot)))
        self.stats.stores_submitted += len(job.keys)
        with self._lock:
            self.stats.stores_dropped += dropped
            self.stats.extra["stores_skipped"] += skipped
            if dropped:
                state.errors.append(f"{dropped} block(s) dropped: tier out of service or write queue full")
        if not self._breaker.serving:
            self._maybe_probe()
        self._dispatch(state, tasks, load=False)

    def submit_load(self, job: TransferJob) -> None:
        """Queue the reads of ``job`` into its reserved rows. Keys no longer on disk fail at once;
        the others are pinned against eviction until read."""
        self._check_accepting()
        state = self._register(job)
        tasks: list[_Task] = []
        missing = 0
        for key, slot in zip(job.keys, job.slots, strict=True):
            if self._index.pin(key):
                tasks.append(_Task(state, key, int(slot), pinned=True))
            else:
                missing += 1
        self.stats.loads_submitted += len(job.keys)
        if missing:
            with self._lock:
                self.stats.loads_failed += missing
                state.errors.append(f"{missing} block(s) no longer on disk")
        self._dispatch(state, tasks, load=True)

    def poll_finished(self) -> list[JobResult]:
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def on_schedule_end(self) -> None:
        if not self._breaker.serving:
            self._maybe_probe()

    def has_pending_work(self) -> bool:
        return self._outstanding > 0

    def take_events(self) -> list[BlockEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def health(self) -> TierHealth:
        return self._breaker.health()

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
            "root": str(self.root),
            "namespace_dir": str(self.ns_dir),
            "max_bytes": self.max_bytes,
            "capacity_bytes": usage.capacity_bytes,
            "used_bytes": usage.used_bytes,
            "entries": usage.entries,
            "block_bytes": self.block_bytes,
            "file_bytes": self.entry_bytes,
            "direct_io": self.direct_io,
            "direct_io_reason": self.direct_io_reason,
            "fsync": self.fsync,
            "read_threads": self.read_threads,
            "write_threads": self.write_threads,
            "max_queued_stores": self.max_queued_stores,
            "scan_complete": self.scan_complete,
            "health": self._breaker.state.value,
        }

    # --- job plumbing ------------------------------------------------------------------------

    def _check_accepting(self) -> None:
        if not self._accepting:
            raise TierError(f"fs tier {self.label} is shut down; it accepts no more jobs")

    def _register(self, job: TransferJob) -> _Job:
        if len(job.keys) != len(job.slots):
            raise TierError(f"job {job.job_id} has {len(job.keys)} keys but {len(job.slots)} slots")
        state = _Job(job, time.perf_counter(), remaining=1)  # the 1 is dropped in _dispatch
        with self._lock:
            self._outstanding += 1
        return state

    def _dispatch(self, state: _Job, tasks: list[_Task], load: bool) -> None:
        with self._lock:
            state.remaining += len(tasks)
        if tasks:
            self._queue.put(tasks, load)
        self._block_done(state, None, 0, None)

    def _block_done(self, state: _Job, key: BlockKey | None, nbytes: int, error: str | None) -> None:
        """Record one block's outcome (``key`` None: the dispatch placeholder); report the job
        when its last block is done."""
        with self._lock:
            if key is not None:
                if error is None:
                    state.ok.add(key)
                    state.bytes_moved += nbytes
                elif len(state.errors) < 8:
                    state.errors.append(error)
            state.remaining -= 1
            if state.remaining:
                return
            job = state.job
            seconds = time.perf_counter() - state.started
            all_ok = len(state.ok) == len(set(job.keys))
            self._finished.append(
                JobResult(
                    job_id=job.job_id,
                    success=all_ok,
                    successful_keys=None if all_ok else frozenset(state.ok),
                    bytes_moved=state.bytes_moved,
                    seconds=seconds,
                    error=None if all_ok else "; ".join(state.errors) or "failed",
                )
            )
            if job.is_promotion:
                self.stats.seconds_reading += seconds
            else:
                self.stats.seconds_writing += seconds
            self._outstanding -= 1
            if self._outstanding == 0:
                self._idle.notify_all()

    def _maybe_probe(self) -> None:
        if not self._breaker.probe_due():
            return
        with self._lock:
            if self._probe_queued or not self._accepting:
                return
            self._probe_queued = True
        self._queue.put([_Task(None)], load=False)

    # --- I/O threads ----------------------------------------------------------------------

    def _io_loop(self, takes_stores: bool) -> None:
        header_buf = aligned_buffer(PAGE)
        header = memoryview(header_buf)
        try:
            while True:
                item = self._queue.get(takes_stores)
                if item is None:
                    return
                task, is_load = item
                try:
                    if task.job is None:
                        self._run_probe(header)
                    elif is_load:
                        self._load_block(task, header)
                    else:
                        self._store_block(task, header)
                except BaseException as exc:  # never lose a job: report, then keep serving
                    logger.exception("fs tier %s: unexpected error in I/O thread", self.label)
                    if task.job is not None:
                        self._block_done(task.job, task.key, 0, f"internal error: {exc!r}")
        finally:
            header.release()
            header_buf.close()

    def _row_view(self, slot: int) -> memoryview:
        rows = self._rows
        if rows is None:
            raise TierError("CPU rows were released")
        return rows[slot, : self._io_bytes].data

    def _load_block(self, task: _Task, header: memoryview) -> None:
        assert task.job is not None
        key = task.key
        path = value_path(self.ns_dir, key)
        error: str | None = None
        nbytes = 0
        t0 = time.perf_counter()
        try:
            row = self._row_view(task.slot)
            try:
                nbytes = read_value(
                    path,
                    header,
                    row,
                    namespace=self._digest,
                    key=key,
                    block_bytes=self.block_bytes,
                    direct=self.direct_io,
                )
            finally:
                row.release()
            self._breaker.record_success(time.perf_counter() - t0)
        except CorruptValueError as exc:
            error = f"corrupt value {key.hex()[:16]}: {exc}"
            logger.warning("fs tier %s: %s; deleting it", self.label, error)
            with self._lock:
                self.stats.corrupt_values += 1
            self._delete(key)
        except FileNotFoundError:
            error = f"value {key.hex()[:16]} vanished from disk"
            with self._lock:
                self.stats.extra["vanished"] += 1
            self._delete(key)
        except OSError as exc:
            error = f"read of {path} failed: {exc.strerror or exc}"
            self._io_error(error)
        finally:
            if task.pinned:
                self._index.unpin(key)
        with self._lock:
            if error is None:
                self.stats.bytes_read += nbytes
            else:
                self.stats.loads_failed += 1
        self._block_done(task.job, key, nbytes, error)

    def _store_block(self, task: _Task, header: memoryview) -> None:
        assert task.job is not None
        key = task.key
        if not self._breaker.serving:
            with self._lock:
                self.stats.stores_dropped += 1
            self._block_done(task.job, key, 0, "dropped: tier out of service")
            return
        self._maybe_regrow_capacity()
        plan = self._index.reserve(key)
        if plan.outcome is not Reservation.GRANTED:
            if plan.outcome is Reservation.FULL:
                with self._lock:
                    self.stats.stores_dropped += 1
                self._block_done(task.job, key, 0, "no room: every evictable file is being read")
            else:  # present or being written by another job: nothing to do
                with self._lock:
                    self.stats.extra["stores_skipped"] += 1
                self._block_done(task.job, key, 0, None)
            return
        error: str | None = None
        tmp = self._instance.temp_path(key)
        reuse = False
        if plan.victims:
            reuse = self._unlink_victims(plan.victims, recycle_to=tmp)
        try:
            row = self._row_view(task.slot)
            try:
                write_value(
                    tmp,
                    header,
                    row,
                    namespace=self._digest,
                    key=key,
                    block_bytes=self.block_bytes,
                    direct=self.direct_io,
                    fsync=self.fsync,
                    reuse=reuse,
                )
            finally:
                row.release()
            final = value_path(self.ns_dir, key)
            os.rename(tmp, final)
            if self.fsync:
                fsync_dir(final.parent)
            self._index.commit(key)
            self._breaker.record_success()
        except BaseException as exc:
            self._index.abort(key)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if not isinstance(exc, OSError):
                raise
            if is_no_space(exc):
                capacity = self._index.lower_capacity_to_used()
                self._last_enospc = time.monotonic()
                error = f"no space left under {self.root}; capacity lowered to {capacity} bytes"
                logger.warning("fs tier %s: %s", self.label, error)
                with self._lock:
                    self.stats.extra["enospc"] += 1
            else:
                error = f"write of {key.hex()[:16]} failed: {exc.strerror or exc}"
                self._io_error(error)
        with self._lock:
            if error is None:
                self.stats.bytes_written += self.block_bytes
                self._events.append(BlockEvent((key,), self.label, self.medium, removed=False))
            else:
                self.stats.stores_failed += 1
        self._block_done(task.job, key, self.block_bytes if error is None else 0, error)

    def _unlink_victims(self, victims: list[BlockKey], recycle_to: Path | None = None) -> bool:
        """Delete evicted values. With ``recycle_to``, the first victim's file is renamed there
        instead, for the caller to overwrite: rewriting allocated blocks is about twice as fast as
        filling a fresh file (no block allocation). Returns True if a file was recycled."""
        recycled = False
        for victim in victims:
            path = value_path(self.ns_dir, victim)
            try:
                if recycle_to is not None and not recycled:
                    os.rename(path, recycle_to)
                    recycled = True
                else:
                    os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._io_error(f"evicting {victim.hex()[:16]} failed: {exc.strerror or exc}")
        self._index.finish_delete(victims)
        with self._lock:
            self.stats.evictions += len(victims)
            self._events.append(BlockEvent(tuple(victims), self.label, self.medium, removed=True))
        return recycled

    def _delete(self, key: BlockKey) -> None:
        """Remove a corrupt or vanished value from the index and the disk."""
        if not self._index.begin_delete(key):
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(value_path(self.ns_dir, key))
        except OSError as exc:
            logger.warning("fs tier %s: could not delete %s: %s", self.label, key.hex()[:16], exc)
        finally:
            self._index.finish_delete([key])
        with self._lock:
            self._events.append(BlockEvent((key,), self.label, self.medium, removed=True))

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
        with self._lock:
            self.stats.extra["io_errors"] += 1
        before = self._breaker.state
        self._breaker.record_failure(detail)
        if before is not HealthState.OPEN and self._breaker.state is HealthState.OPEN:
            logger.error("fs tier %s taken out of service after repeated I/O errors: %s", self.label, detail)

    def _run_probe(self, header: memoryview) -> None:
        """Write, read back and delete a one-page file; closes or re-opens the breaker."""
        path = self._instance.path / "health-probe"
        try:
            self._instance.ensure()
            payload = os.urandom(PAGE)
            with open(path, "wb") as f:
                f.write(payload)
            with open(path, "rb") as f:
                back = f.read()
            os.unlink(path)
            if back != payload:
                raise OSError(errno.EIO, "probe read back different bytes")
            self._breaker.record_success()
            logger.info("fs tier %s back in service", self.label)
        except OSError as exc:
            self._breaker.record_failure(f"health probe failed: {exc}")
        finally:
            with self._lock:
                self._probe_queued = False

    # --- warm restart scan -------------------------------------------------------------------

    def _scan(self, _: object) -> None:
        """Index every value file on disk, shard by shard (oldest files become LRU)."""
        t0 = time.perf_counter()
        found: list[tuple[float, bytes]] = []
        try:
            for i, shard in enumerate(SHARDS):
                if self._stop_scan.is_set():
                    return
                entries = scan_shard(self.ns_dir, shard)
                self._index.add_scanned(key for _, key in entries)
                self._scanned[i] = 1
                found.extend(entries)
            found.sort(reverse=True)
            self._index.order_oldest_first([key for _, key in found])
            victims = self._index.evict_over_capacity()
            if victims:
                logger.info("fs tier %s: %d files beyond max_bytes evicted after restart", self.label, len(victims))
                self._unlink_victims(victims)
        except Exception:
            logger.exception("fs tier %s: scan of %s failed; unscanned keys answer MISS", self.label, self.ns_dir)
        finally:
            for i in range(256):
                self._scanned[i] = 1
            with self._lock:
                self.stats.extra["scan_entries"] = float(len(found))
                self.stats.extra["scan_seconds"] = time.perf_counter() - t0
            self._scan_done.set()

    # --- blocking calls ------------------------------------------------------------------------

    def drain(self, timeout: float | None = None) -> None:
        """Block until every submitted job is reported (finished or failed); never aborts I/O."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._outstanding:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TierDrainTimeout(
                        f"fs tier {self.label}: {self._outstanding} job(s) still in flight after {timeout}s"
                    )
                self._idle.wait(left)

    def shutdown(self) -> None:
        """Stop accepting jobs, let queued ones finish for up to ``shutdown_timeout`` seconds,
        fail the rest, join every thread (``shutdown_timeout`` each) and drop the CPU rows.

        Raises :class:`TierError` if a thread did not exit; the rows are then kept (the
        thread may still touch them) and calling ``shutdown()`` again retries. Idempotent.
        """
        if self._shut:
            return
        self._accepting = False
        try:
            self.drain(self.shutdown_timeout)
        except TierDrainTimeout:
            logger.warning("fs tier %s: jobs still queued at shutdown are reported as failed", self.label)
        for task, is_load in self._queue.close():
            if task.job is None:
                continue
            if task.pinned:
                self._index.unpin(task.key)
            with self._lock:
                if is_load:
                    self.stats.loads_failed += 1
                else:
                    self.stats.stores_failed += 1
            self._block_done(task.job, task.key, 0, "tier shut down before the block was moved")
        self._stop_scan.set()
        deadline = time.monotonic() + self.shutdown_timeout
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            raise TierError(
                f"fs tier {self.label}: threads {alive} did not stop within {self.shutdown_timeout}s; "
                "the CPU rows are still referenced. Call shutdown() again to retry"
            )
        self._threads.clear()
        self._rows = None
        self.context.release_rows()
        self._instance.close(remove=True)
        self._shut = True
