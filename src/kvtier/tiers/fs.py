"""The filesystem secondary tier: a bounded, crash-safe, warm-restartable disk cache.

Configured as ``{"type": "fs", "root": "/nvme/kvtier", "max_bytes": "200GB", ...}``;
the options are declared once, in :class:`FilesystemTierOptions`.

How it works (layout and file format: :mod:`kvtier.tiers.fs_layout`):

* Values live under ``root/<namespace digest>/``, one file per block, named by
  the block key and sharded by its first byte. A manifest records the namespace
  and block size; a directory that holds anything else is refused. A ``store-id``
  beside it, made once, names the directory in the fleet's events (:meth:`store_location`).
* Stores write a temp file and link it into place (fsync optional), so no
  reader ever sees a partial value, even after SIGKILL or power loss (a value
  that lost its bytes fails its checksum and is dropped on load), and nothing
  already at the name (another engine's value, a planted entry) is replaced.
* Bytes move with one ``pwritev``/``preadv`` per block straight between the file
  and a memoryview of the CPU row, with O_DIRECT when the file system supports
  it (probed at start) and the rows are page aligned; else through the page cache.
* Every load verifies header, key, namespace, length and the xxh3_64 payload
  checksum before the key is reported as a success. A mismatch fails that key,
  deletes the file and counts ``stats.corrupt_values``.
* ``read_threads`` threads serve only loads; ``write_threads`` threads take loads
  first and stores only when no load is queued. Job results carry per-key success.
* A byte budget (``max_bytes``) bounds the namespace as a whole, shared by every
  engine using it (:mod:`kvtier.tiers.fs_budget`): before each write the engine
  claims room and evicts least recently used files no load of its own is reading
  (other engines' files included) until the namespace fits. ENOSPC lowers the
  budget to what fits, fails that key, and the budget grows back once the disk has
  room again.
* Lookups are answered from the in-memory index. At start it is rebuilt from the
  directory (in a background thread by default; keys of shards not yet scanned
  answer RETRY), and temp files of dead processes are swept. With ``sharing``, the
  index follows the change journals of the other engines using the root
  (:mod:`kvtier.tiers.fs_journal`), so blocks they write become HITs within about 0.1 s
  later and blocks they evict MISSes; with ``miss_checks``, a key the index lacks
  is also checked on disk by an I/O thread (the lookup answers RETRY, then HIT or
  MISS; :mod:`kvtier.tiers.fs_share`).
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
from pydantic import Field, StrictBool, field_validator

from kvtier.errors import ConfigError, CorruptValueError, ForeignFormatError, TierError, UnsafeEntryError
from kvtier.failures import log_failure
from kvtier.keys import BlockKey
from kvtier.tiers.base import FOREIGN_FORMAT_METRIC, ExtraMetric, TierContext, TierUsage
from kvtier.tiers.fs_budget import SharedBudget
from kvtier.tiers.fs_files import (
    NO_HARD_LINKS,
    FileModes,
    create_file,
    discard_corrupt,
    find_value,
    open_for_read,
    place_value,
    remove_value,
    take_for_recycling,
)
from kvtier.tiers.fs_index import FileIndex, PeerRemoval, Reservation
from kvtier.tiers.fs_journal import ADDED, REMOVED, Entry, JournalReader, JournalWriter
from kvtier.tiers.fs_layout import (
    O_DIRECT,
    PAGE,
    PAYLOAD_OFFSET,
    SHARDS,
    SUFFIX,
    InstanceDir,
    NamespaceReport,
    RootReport,
    aligned_buffer,
    ensure_manifest,
    ensure_store_id,
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
from kvtier.tiers.fs_share import ExistenceChecks, PeerWatch
from kvtier.tiers.health import CircuitBreaker
from kvtier.tiers.jobs import ALL_LANES, READ_LANES, Lane, ThreadedTier, Work
from kvtier.tiers.options import ByteSize, QueueLength, Seconds, Threads, TierOptions, tier_options
from kvtier.types import LookupResult, RequestContext
from kvtier.untrusted import open_regular

__all__ = ["FilesystemTier", "FilesystemTierOptions", "NamespaceReport", "RootReport", "verify_root"]

logger = logging.getLogger(__name__)

DEFAULT_FREE_FRACTION = 0.5
"""Without ``max_bytes``: the tier may use this share of (free space + its own files)."""

_SCAVENGE_BATCH = 64
"""Files of other engines a search for eviction candidates collects before it stops listing shards."""

_SCAVENGE_IDLE_SECONDS = 1.0
"""After a pass over every shard found no file this engine did not know, stores that need
victims do not list the shards again for this long (they are dropped as finding no room)."""

_JOURNAL_SECONDS = 0.05
"""At most this often housekeeping reads the other engines' journals and looks for new engines
(it also runs after every work item under load; idle, every ``housekeeping_interval``)."""

_REMOVALS_AGAIN_MAX = 4096
"""Peers' removals of keys busy here kept for the next journal read (more are dropped: a load finds
such a file vanished)."""

_LEDGER_SECONDS = 1.0
"""How often housekeeping adopts dead instances' ledgers and rereads the shared file count."""


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
        description="Byte budget of this namespace's files, e.g. '64GiB', whoever wrote them: engines sharing the "
        "root share it (give each the same value); the oldest files go beyond it. "
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
    sharing: StrictBool = Field(
        default=True,
        description="Learn the blocks other engines write into (and evict from) this root and namespace while "
        "this one runs, from the change journal every engine keeps (within about 0.1 s; lookups never wait). "
        "false: only what the start-up scan found and this engine stored.",
    )
    miss_checks: StrictBool = Field(
        default=False,
        description="With sharing, while other engines use the root, also check on disk each key the index "
        "lacks: the lookup answers RETRY until an I/O thread's check comes back (then HIT, or MISS for "
        "miss_seconds). Finds blocks the moment they are written, and blocks of engines that keep no journal "
        "(older releases), at the cost of one engine step for every new prompt.",
    )
    miss_seconds: Seconds = Field(
        default=1.0,
        gt=0,
        description="With miss_checks: seconds a key checked and not found answers MISS before it is checked again.",
    )

    @field_validator("root", mode="before")
    @classmethod
    def _path(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("root", "share_group")
    @classmethod
    def _no_nul(cls, value: Any) -> Any:
        # (no path or group name holds one: refused here, not by the first system call after start-up)
        if isinstance(value, str) and "\0" in value:
            raise ValueError("holds a NUL character (\\0), which no path or group name can")
        return value

    @field_validator("root")
    @classmethod
    def _a_directory_name(cls, value: str) -> str:
        # Refused when the config loads: a blank root would make a directory named by its spaces, and
        # "~" is not expanded (no shell reads the config), so "~/kv" would make "./~/kv" wherever the
        # engine happens to run.
        if not value.strip():
            raise ValueError(f"root {value!r} names no directory: give a directory such as /mnt/nvme/kvtier")
        if value.startswith("~"):
            raise ValueError(f"root {value!r:.120} starts with '~', which is not expanded: give the full path "
                             f"(such as {os.path.expanduser(value)!r:.120})")  # fmt: skip
        return value

    def capacity(self) -> int | None:
        return self.max_bytes


class _Corrupt(Exception):
    """A value failed verification (``removed``: its file was ours and is deleted; ``st``: its fstat;
    ``foreign``: it is another release's format, never deleted)."""

    def __init__(self, reason: str, removed: bool, st: os.stat_result, foreign: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.removed = removed
        self.st = st
        self.foreign = foreign


class _NoRoom(Exception):
    """A store found nothing to evict: every file it could evict is being read."""


class _LostRace(Exception):
    """A store's link found its name taken twice, and free each time it looked: values of other
    engines (same key) linked there and evicted or recycled meanwhile. Nothing was written."""


def _is_gone(exc: OSError) -> bool:
    """The file is gone: removed (ENOENT), or removed by another NFS client while open (ESTALE)."""
    return isinstance(exc, FileNotFoundError) or exc.errno == errno.ESTALE


class FilesystemTier(ThreadedTier):
    """A secondary tier on a local file system (NVMe, SSD, any POSIX directory).

    Options: :class:`FilesystemTierOptions` (an instance, or its fields as keyword
    arguments: ``FilesystemTier(context, root="/nvme/kv", max_bytes="64GiB")``). ``max_bytes``
    is shared by every engine using the root (:mod:`kvtier.tiers.fs_budget`); ``sharing``
    follows the other engines' journals (:mod:`kvtier.tiers.fs_journal`); ``miss_checks``
    also checks on disk each key the index lacks (:mod:`kvtier.tiers.fs_share`).

    The root is untrusted content (see :mod:`kvtier.tiers.fs_files`): no link is
    followed, only regular files of this user (or group) are opened, nothing else is
    indexed, served, recycled or deleted, and engines sharing a root never read a file
    the other is recycling. Every option is validated before anything is created.
    """

    tier_type = "fs"
    medium = "disk"
    options_model = FilesystemTierOptions
    extra_metrics: ClassVar[Mapping[str, ExtraMetric]] = {
        **ThreadedTier.extra_metrics,
        "io_errors": ExtraMetric("counter", "I/O errors (each also counts against the health breaker)."),
        "enospc": ExtraMetric("counter", "Writes that found the file system full (capacity lowered)."),
        "vanished": ExtraMetric("counter", "Values gone from disk when read (removed by someone else)."),
        "stores_skipped": ExtraMetric("counter", "Blocks of store jobs already on disk (nothing written)."),
        "scan_entries": ExtraMetric("gauge", "Values indexed by the warm-restart scan."),
        "scan_seconds": ExtraMetric("gauge", "Duration of the warm-restart scan."),
        "temp_files_swept": ExtraMetric("gauge", "Temporary files of dead writers removed at start."),
        "unsafe_entries": ExtraMetric("counter", "Entries of the root that are not regular files of ours (untouched)."),
        "foreign_format": FOREIGN_FORMAT_METRIC,
        "journal_added": ExtraMetric("counter", "Blocks other engines stored, learned from their journals."),
        "journal_removed": ExtraMetric("counter", "Blocks other engines evicted, learned from their journals."),
        "checks": ExtraMetric("counter", "Keys the index did not hold, checked on disk (miss_checks)."),
        "checks_found": ExtraMetric("counter", "Checked keys found on disk: blocks another engine wrote."),
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
        try:
            self._open_directories()
        except OSError as exc:  # a read-only or full file system, a permission: named by the root, not a temp name
            raise ConfigError(
                f"fs tier directory {self.ns_dir} cannot be used ({exc.strerror or exc}): the tier writes its "
                "manifest, a temp directory, a ledger and a journal there; pick a 'root' on a writable file "
                "system with free space"
            ) from exc
        self._direct_flag = O_DIRECT if self.direct_io else 0
        self._index = FileIndex()
        self.sharing = opts.sharing
        self.miss_checks = opts.miss_checks and opts.sharing
        self._checks = ExistenceChecks(opts.miss_seconds)
        self._checks_live = self.miss_checks and self._peers.seen
        self._value_sizes = (PAYLOAD_OFFSET + block_bytes, self.entry_bytes)
        self._hard_links = True
        self._next_ledger_check = 0.0
        self._next_journal_read = 0.0
        self._scavenge_next = 0
        self._scavenge_idle_until = 0.0
        self._free_recheck_interval = opts.probe_interval
        self._last_enospc = 0.0
        self._probe_seq = itertools.count(1)
        self._stop_scan = threading.Event()
        self._scan_done = threading.Event()
        self._scanned = bytearray(256)
        self.stats.extra.update(
            {"io_errors": 0, "enospc": 0, "vanished": 0, "scan_entries": 0, "scan_seconds": 0.0,
             "unsafe_entries": 0, "temp_files_swept": float(self.swept_temp_files), "journal_added": 0,
             "journal_removed": 0, "checks": 0, "checks_found": 0}
        )  # fmt: skip
        self._unsafe_shards: set[str] = set()  # shards found not to be directories (logged once each)
        self._dirs.on_unsafe = self._unsafe_shard
        self._start()

    # --- construction helpers -------------------------------------------------------------

    def _open_directories(self) -> None:
        """Adopt the namespace directory (manifest, sweep of dead writers, this instance's temp
        directory, the directory's identity), then choose O_DIRECT and the byte budget; each step
        undone if a later one fails."""
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
            # Read once, here: store_location() runs on the scheduler thread and must do no I/O.
            self.store_identity = ensure_store_id(self._dirs, self._instance.fd)
            self._location = f"fs:{os.path.realpath(self.root)}#{self.store_identity}"
            self.direct_io, self.direct_io_reason = self._choose_direct_io(self.options.direct_io)
            # Bytes moved per block: O_DIRECT needs whole pages (the row's padding rides along).
            self._io_bytes = round_up(self.block_bytes) if self.direct_io else self.block_bytes
            self.max_bytes = self._resolve_max_bytes(self.options.max_bytes, self._count_existing_files())
            self._peers = PeerWatch(self._dirs, self._instance.name, always=False)
            self._budget = SharedBudget(self._dirs, self._instance.name, self.max_bytes // self.entry_bytes)
        except BaseException:
            self._instance.close(remove=True)
            self._dirs.close()
            raise
        try:  # before the scan: records appended from now on are read, what came before is scanned
            self._journal = JournalWriter(self._dirs, self._instance.name)
            self._follow = JournalReader(self._dirs, self._instance.name) if self.options.sharing else None
            self._removals_again: dict[BlockKey, float] = {}  # peers' removals of keys busy here, by time
        except BaseException:
            self._instance.close(remove=True)
            self._budget.close()
            self._dirs.close()
            raise

    def _start(self) -> None:
        """Start the I/O threads and the warm-restart scan (or run it here); shut down if that fails."""
        opts = self.options
        try:
            self._budget.adopt_dead()
            self._start_workers(opts.read_threads, READ_LANES, "read")
            self._start_workers(opts.write_threads, ALL_LANES, "write")
            if opts.scan_in_background:
                self._start_thread("scan", self._scan)
            else:
                self._scan()
        except BaseException:
            self._shut_after_failed_start()
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
            reason = probe_direct_io(self._instance.fd)
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
        """HIT if the index holds ``key``; RETRY while its shard is not scanned yet; else MISS, or
        with ``miss_checks`` the answer of a check on disk (RETRY until it came back)."""
        scanned = self._scanned[key[0]]  # read before the index: the scan adds keys, then flags
        if self._index.hit(key):
            return LookupResult.HIT
        if not scanned:
            return LookupResult.RETRY
        if not self._checks_live:
            return LookupResult.MISS
        return self._checks.answer(key, request, time.monotonic())

    def on_schedule_end(self) -> None:
        """Send this step's keys to check on disk (``miss_checks``) to an I/O thread, as one item."""
        chains = self._checks.take()
        if not chains:
            return
        keys = [key for chain in chains for key in chain]
        serving = not self._closed and self._breaker.serving
        if not serving or not self._queue_internal(Work(Lane.EXISTS, keys=keys, payload=chains)):
            self._checks.finish(keys)

    def has_pending_work(self) -> bool:
        """True while jobs are in flight or unreported, or checks on disk are under way."""
        return super().has_pending_work() or self._checks.busy()

    def touch(self, keys: Sequence[BlockKey], request: RequestContext | None) -> None:
        self._index.touch(keys)

    def _holds(self, key: BlockKey) -> bool:
        """Stores skip keys already on disk."""
        return key in self._index

    lists_holdings = True

    def store_location(self) -> str:
        """``fs:<real path of the root>#<identity>``, the identity being the namespace directory's
        (its ``store-id``, :func:`~kvtier.tiers.fs_layout.ensure_store_id`), read at start: engines
        that see this very directory (on one host, or hosts mounting a shared file system at the
        same path) share its blocks; a directory at the same path on another host's own disk, or
        one made anew at this path, is another store. No I/O."""
        return self._location

    def held_keys(self) -> list[BlockKey] | None:
        """The index's keys once the start-up scan is done (before: None)."""
        return self._index.keys() if self._scan_done.is_set() else None

    def holdings_complete(self) -> bool:
        """With ``sharing`` the index follows every engine's journal: it lists the whole namespace."""
        return self.sharing

    def holds(self, key: BlockKey) -> bool:
        return key in self._index

    def _admit_load(self, key: BlockKey) -> bool:
        """Pin ``key`` against eviction until its load ran; False if it is no longer on disk."""
        return self._index.pin(key)

    def _abandon(self, work: Work) -> None:
        if work.lane is Lane.LOAD:
            self._index.unpin(work.keys[0])

    def usage(self) -> TierUsage:
        """The namespace's bytes (every engine's files: the budget is shared) against this
        engine's capacity; ``entries``: the files this engine's index holds."""
        budget = self._budget
        return TierUsage(max(0, budget.used_files) * self.entry_bytes, budget.capacity * self.entry_bytes,
                         len(self._index))  # fmt: skip

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
            "sharing": self.sharing,
            "miss_checks": self.miss_checks,
            "miss_checks_active": self._checks_live,
            "miss_seconds": self._checks.miss_seconds,
            "hard_links": self._hard_links,
            "instance": self._instance.name,
            "ledger_files": self._budget.own_files,
            "ledgers_adopted": self._budget.adopted,
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
        elif work.lane is Lane.EXISTS:
            self._check_keys(work)
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
        started = time.time()  # a value found gone or corrupt was so no later than this
        t0 = time.perf_counter()
        try:
            shard_fd = self._dirs.shard(shard)
            try:
                self._read_into_row(slot, shard_fd, name, key, header)
            finally:
                os.close(shard_fd)
            self._breaker.record_success(time.perf_counter() - t0)
        except _Corrupt as exc:
            if exc.foreign:  # a newer release's value, sharing the root: unreadable here, not corrupt
                error = f"value {key.hex()[:16]} is not served: {exc.reason}"
                logger.warning("fs tier %s: %s; left in place", self.label, error)
                self._count(foreign_format=1)
            else:
                error = f"corrupt value {key.hex()[:16]}: {exc.reason}"
                logger.warning("fs tier %s: %s; %s", self.label, error, "deleted" if exc.removed else "left in place")
                self._count(corrupt_values=1)
            if not exc.removed:
                self._checks.reject(key, exc.st)
            self._forget(key, started)
        except UnsafeEntryError as exc:
            error = f"value {key.hex()[:16]} is not served: {exc}"
            what = f"fs tier {self.label}: value {key.hex()[:16]} is not served (never opened for I/O, never deleted)"
            log_failure(logger, logging.WARNING, what, exc)
            self._count(unsafe_entries=1)
            self._forget(key, started)
        except OSError as exc:
            if _is_gone(exc):  # another engine evicted or recycled it: a miss
                error = f"value {key.hex()[:16]} vanished from disk"
                self._count(vanished=1)
                self._forget(key, started)
            else:
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
            with contextlib.suppress(OSError):  # the use, for other engines' eviction order and restarts
                os.utime(fd)
        except CorruptValueError as exc:
            foreign = isinstance(exc, ForeignFormatError)
            removed = not foreign and discard_corrupt(
                shard_fd, name, st, self._instance.fd, self._instance.temp_name(key), self.modes
            )
            if removed:
                self._budget.release(1)
                self._journal.append(REMOVED, [key])
            raise _Corrupt(str(exc), removed, st, foreign) from None
        finally:
            os.close(fd)

    def _store_block(self, work: Work, header: memoryview) -> None:
        key, slot = work.keys[0], work.slots[0]
        if not self._breaker.serving:
            self._complete(work, error="dropped: tier out of service", dropped=True)
            return
        self._maybe_regrow_capacity()
        if self._index.reserve(key) is not Reservation.GRANTED:  # present, or being written by another job
            self._count(stores_skipped=1)
            self._complete(work, ok=[key])
            return
        try:
            written = self._write_block(key, slot, header)
        except _NoRoom:
            self._index.abort(key)
            self._complete(work, error="no room: every evictable file is being read", dropped=True)
            return
        except _LostRace:
            self._index.abort(key)
            self._complete(work, error=f"store of {key.hex()[:16]} dropped: lost a race for its name to other "
                           "engines' values of the key, evicted or recycled since", dropped=True)  # fmt: skip
            return
        except UnsafeEntryError as exc:
            self._index.abort(key)
            self._count(unsafe_entries=1)
            self._complete(work, error=f"store of {key.hex()[:16]} failed: {exc} (left alone)")
            return
        except OSError as exc:
            self._index.abort(key)
            if is_no_space(exc):
                capacity = self._budget.lower_capacity_to_used() * self.entry_bytes
                self._last_enospc = time.monotonic()
                error = f"no space left under {self.root}; capacity lowered to {capacity} bytes"
                logger.warning("fs tier %s: %s", self.label, error)
                self._count(enospc=1)
            else:
                error = f"write of {key.hex()[:16]} failed: {exc.strerror or exc}"
                self._io_error(error)
            self._complete(work, error=error)
            return
        except BaseException:
            self._index.abort(key)
            raise
        finally:
            if not self._queue.queued(Lane.STORE):  # idle: tell the others now; busy: housekeeping batches
                self._journal.flush()
                self._budget.idle()
        if written:  # before the commit: a peer's removal read after it is timed later (_apply_journal)
            self._emit([key], removed=False)
        self._index.commit(key)
        self._checks.forget(key)
        self._breaker.record_success()
        if written:
            self._complete(work, ok=[key], nbytes=self.block_bytes)
        else:
            self._count(stores_skipped=1)
            self._complete(work, ok=[key])

    def _write_block(self, key: BlockKey, slot: int, header: memoryview) -> bool:
        """Write ``key``'s value from CPU row ``slot`` and link it into its shard: True. False
        when another engine's value of ``key`` got there first (what was written is dropped;
        the index usually knows such a file from the other engine's journal, and ``_holds``
        skipped the store).

        A name found taken and then free (the value there was evicted or recycled by its
        engine before it could be looked at) is linked once more. Claims room in the shared
        budget first and evicts what that takes; every failure before the link gives the claim
        back and removes the temp file (a linked file stays counted: with ``fsync``, a failed
        fsync of its directory raises OSError, the file in place). The claim is settled just
        before the file is linked (an engine killed while writing leaves no phantom file in its
        ledger: see :mod:`~kvtier.tiers.fs_budget`). Raises _NoRoom (nothing evictable), _LostRace (taken
        and free again twice), UnsafeEntryError (the name is taken by an entry that is not a
        value of ours: left alone, never replaced), OSError.
        """
        tmp, tmp_dir = self._instance.temp_name(key), self._instance.fd
        fd: int | None = None
        claimed = True
        settled = False
        at_name: bool | None = None
        need = self._budget.claim()
        try:
            fd = self._make_room(need, recycle_to=tmp)
            recycled = fd is not None
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
            written, fd = fd, None  # (never closed twice: a close that raises may have freed the number)
            os.close(written)  # drops a recycled file's exclusive lock before it is visible again
            self._budget.settle()
            settled = True
            placed = self._place(tmp, tmp_dir, key)
            if not placed:
                at_name = self._value_at(key)
                if at_name is None:  # taken at the link, free now: that value is gone, link once more
                    placed = self._place(tmp, tmp_dir, key)
                    if not placed:
                        at_name = self._value_at(key)
            if placed:
                claimed = False  # linked: counted whatever fails next (the directory's fsync)
                self._journal.append(ADDED, [key])
                if self.fsync:
                    self._sync_shard(key)
                return True
        finally:
            if fd is not None:
                os.close(fd)
            if claimed:
                self._budget.give_back(settled)
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=tmp_dir)
        if at_name:
            return False
        if at_name is None:
            raise _LostRace
        raise UnsafeEntryError(value_name(key), "a name taken by an entry that is not a value of ours")

    def _place(self, tmp: str, tmp_dir: int, key: BlockKey) -> bool:
        """Link the written temp file to ``key``'s name; False if the name is taken."""
        shard_fd = self._dirs.shard(f"{key[0]:02x}")
        try:
            if self._hard_links:
                try:
                    placed = place_value(tmp_dir, tmp, shard_fd, value_name(key), hard_link=True)
                except OSError as exc:
                    if exc.errno not in NO_HARD_LINKS:
                        raise
                    self._hard_links = False
                    logger.info("fs tier %s: no hard links under %s: values are renamed into place", self.label,
                                self.root)  # fmt: skip
            if not self._hard_links:
                placed = place_value(tmp_dir, tmp, shard_fd, value_name(key), hard_link=False)
            return placed
        finally:
            os.close(shard_fd)

    def _sync_shard(self, key: BlockKey) -> None:
        """fsync the shard directory ``key``'s value was just linked into (``fsync``); raises OSError."""
        shard_fd = self._dirs.shard(f"{key[0]:02x}")
        try:
            os.fsync(shard_fd)
        finally:
            os.close(shard_fd)

    def _on_disk(self, key: BlockKey) -> bool:
        """Is a value of ``key`` on disk: a regular file of ours (or the group's) of a value's size,
        not one that failed verification? One ``fstatat``, following no link. I/O threads."""
        return self._value_at(key) is True

    def _value_at(self, key: BlockKey) -> bool | None:
        """What is at ``key``'s name: True a value (as :meth:`_on_disk`), None nothing, False
        anything else (an entry that is not a value of ours, in a shard that may not be one).
        Raises OSError."""
        try:
            shard_fd = self._dirs.shard(f"{key[0]:02x}")
        except UnsafeEntryError:
            return False
        try:
            st = find_value(shard_fd, value_name(key), self.modes, self._value_sizes)
        except (UnsafeEntryError, CorruptValueError):
            return False
        finally:
            os.close(shard_fd)
        if st is None:
            return None
        return not self._checks.rejected(key, st)

    def _make_room(self, need: int, recycle_to: str | None) -> int | None:
        """Evict the ``need`` files the shared budget asked for, and more while it asks for more:
        this engine's least recently used files first, then files found on disk that it did not
        know (:meth:`_scavenge`). The first victim that may be recycled is moved to ``recycle_to``
        and returned open (see :meth:`_unlink_victims`). Raises _NoRoom when nothing more can be
        evicted."""
        recycled: int | None = None
        try:
            while need > 0:
                if self._peers.seen and not self._index.found_files:
                    self._scavenge()  # learn what other engines wrote before choosing the oldest
                victims = self._index.take_victims(need)
                if not victims:
                    if self._scavenge():
                        continue
                    raise _NoRoom
                fd, removed = self._unlink_victims(victims, recycle_to if recycled is None else None, planned=True)
                if fd is not None:
                    recycled = fd
                need -= removed
                if need <= 0:
                    need = self._budget.recheck()
        except BaseException:
            self._budget.cancel(need)
            if recycled is not None and recycle_to is not None:
                os.close(recycled)
                with contextlib.suppress(OSError):
                    os.unlink(recycle_to, dir_fd=self._instance.fd)
            raise
        return recycled

    def _scavenge(self) -> bool:
        """Index files on disk this engine does not know (other engines wrote them) as found
        files, ranked by mtime: eviction candidates. Lists shards round robin until it has
        ``_SCAVENGE_BATCH`` of them or made one full pass; False if it found none (then it
        rests for ``_SCAVENGE_IDLE_SECONDS``)."""
        now = time.monotonic()
        if now < self._scavenge_idle_until:
            return False
        found: list[tuple[float, bytes]] = []
        for _ in SHARDS:
            shard = SHARDS[self._scavenge_next]
            self._scavenge_next = (self._scavenge_next + 1) % len(SHARDS)
            entries, _ = scan_shard(self._dirs, shard, quiet=True)
            found.extend(e for e in entries if e[1] not in self._index)
            if len(found) >= _SCAVENGE_BATCH:
                break
        found.sort()
        if self._index.add_found(found):
            return True
        self._scavenge_idle_until = now + _SCAVENGE_IDLE_SECONDS
        return False

    def _unlink_victims(
        self, victims: list[BlockKey], recycle_to: str | None = None, planned: bool = False
    ) -> tuple[int | None, int]:
        """Delete evicted values; returns the recycled file (or None) and how many files left the
        shards (each counted off the shared budget; ``planned``: as evictions it asked for).

        With ``recycle_to``, the first victim that may be recycled (a regular file of ours that
        no reader holds, in any process) is moved there instead and returned open and
        exclusively locked, for the caller to overwrite: rewriting allocated blocks is about
        twice as fast as filling a fresh file. Entries that are not regular files we may remove
        are left alone (they were never ours); files already gone (another engine evicted them)
        count nothing."""
        recycled: int | None = None
        gone: list[BlockKey] = []
        removed_at: list[float] = []  # each victim's removal, timed before it started
        for victim in victims:
            shard, name = f"{victim[0]:02x}", value_name(victim)
            removed_at.append(time.time())
            try:
                shard_fd = self._dirs.shard(shard)
                try:
                    if recycle_to is not None and recycled is None:
                        recycled = take_for_recycling(
                            shard_fd, name, self._instance.fd, recycle_to, self._direct_flag, self.modes
                        )
                        if recycled is not None:
                            gone.append(victim)
                            continue
                    if remove_value(shard_fd, name, self.modes):
                        gone.append(victim)
                finally:
                    os.close(shard_fd)
            except FileNotFoundError:
                pass
            except UnsafeEntryError as exc:  # its shard is no directory: nothing in it is ours to remove
                self._unsafe_shard(shard, exc)
            except OSError as exc:
                self._io_error(f"evicting {victim.hex()[:16]} failed: {exc.strerror or exc}")
        self._budget.release(len(gone), planned=planned)
        removed_when = dict(zip(victims, removed_at, strict=True))
        for victim in gone:  # timed as their events: a peer orders them against its stores (_apply_journal)
            self._journal.append(REMOVED, [victim], when=removed_when[victim])
        self._index.finish_delete(victims)
        self._count(evictions=len(victims))
        for victim, when in removed_when.items():
            self._emit([victim], removed=True, when=when)
        return recycled, len(gone)

    def _check_keys(self, work: Work) -> None:
        """Check one step's chains of keys the index lacked on disk (live sharing): adopt the
        values found, stop each chain at its first key not there."""
        checked = found = 0
        try:
            for chain in work.payload:
                for key in chain:
                    present = self._probe_key(key)
                    checked += 1
                    if present and self._index.adopt(key):
                        found += 1
                    self._checks.record(key, present)
                    if not present:
                        break
        finally:
            self._checks.finish(work.keys)
            self._count(checks=checked, checks_found=found)

    def _probe_key(self, key: BlockKey) -> bool:
        """One check on disk for :meth:`_check_keys`: is a value of ``key`` there to adopt?"""
        try:
            shard_fd = self._dirs.shard(f"{key[0]:02x}")
            try:
                st = find_value(shard_fd, value_name(key), self.modes, self._value_sizes)
            finally:
                os.close(shard_fd)
        except UnsafeEntryError:
            self._count(unsafe_entries=1)
            return False
        except CorruptValueError:
            return False
        except OSError as exc:
            if not _is_gone(exc):
                self._io_error(f"check of {key.hex()[:16]} failed: {exc.strerror or exc}")
            return False
        return st is not None and not self._checks.rejected(key, st)

    def _forget(self, key: BlockKey, when: float) -> None:
        """Drop a value that is corrupt, vanished or unsafe from the index and answer MISS for it a
        while (its file, if any, was dealt with by the caller: a file is only ever removed when
        proven ours); ``when``: a time before it was found so."""
        self._checks.record(key, False)
        if not self._index.begin_delete(key):
            return
        self._index.finish_delete([key])
        self._emit([key], removed=True, when=when)

    def _maybe_regrow_capacity(self) -> None:
        """After ENOSPC, let the budget grow back once the disk has room again (checked at
        most every ``probe_interval`` seconds, on a write thread)."""
        budget = self._budget
        if budget.capacity >= budget.max_files:
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
        grown = budget.used_files + (free - self.entry_bytes) // self.entry_bytes
        if grown > budget.capacity:
            budget.set_capacity(grown)
            logger.info("fs tier %s: capacity back to %d bytes", self.label, budget.capacity * self.entry_bytes)

    def _housekeeping(self) -> None:
        """Apply the other engines' journals, notice other engines (``miss_checks``), expire
        negative answers, and every ``_LEDGER_SECONDS`` adopt dead instances' ledgers, reread
        the shared file count and delete dead instances' stale journals."""
        now = time.monotonic()
        if now >= self._next_journal_read:
            self._next_journal_read = now + _JOURNAL_SECONDS
            self._journal.flush()  # one append for what every store since the last tick recorded
            self._budget.flush()
            if self._follow is not None:
                self._apply_journal(self._follow.read())
            if not self._peers.seen and self._peers.check():
                logger.info("fs tier %s: another engine uses %s", self.label, self.ns_dir)
            if self.miss_checks and not self._checks_live and self._peers.seen:
                self._checks_live = True
            self._checks.prune()
        if now >= self._next_ledger_check:
            self._next_ledger_check = now + _LEDGER_SECONDS
            if self._budget.adopt_dead():  # an engine died: its temp files go now, not at the next start
                dirs, files = sweep_temp_dirs(self._dirs)
                self.swept_temp_dirs += dirs
                self.swept_temp_files += files
                self.stats.extra["temp_files_swept"] = float(self.swept_temp_files)
            self._budget.refresh()
            if self._follow is not None:
                self._follow.remove_dead()

    def _apply_journal(self, entries: list[Entry]) -> None:
        """What other engines added (present, ranked by its write time) and removed (gone).

        A removal's time and this engine's proof of a file (a store, timed after its link) do
        not order them when they are close: another engine may have unlinked the very file this
        one just linked. So a removal of a key proven here since is checked on disk (one
        ``fstatat``; a rare case: a key evicted and stored again within a journal read), and a
        key gone is dropped with a removal event timed before the look, after this engine's
        own store event (emitted before its commit). A removal of a key busy here (a store or
        load under way) is applied again at the next read, once that is over."""
        added = removed = 0
        again, self._removals_again = self._removals_again, {}
        for op, when, key in [(REMOVED, when, key) for key, when in again.items()] + entries:
            if op == ADDED:
                added += self._index.add_found([(when, key)])
                self._checks.forget(key)
                continue
            verdict = self._index.forget_if_older(key, when)
            if verdict is PeerRemoval.DROPPED:
                removed += 1
            elif verdict is PeerRemoval.BUSY:
                if len(self._removals_again) < _REMOVALS_AGAIN_MAX:
                    self._removals_again[key] = max(when, self._removals_again.get(key, when))
            elif verdict is PeerRemoval.NEWER:
                looked = time.time()
                if not self._still_on_disk(key):
                    self._forget(key, looked)
                    removed += 1
        if added or removed:
            self._count(journal_added=added, journal_removed=removed)

    def _still_on_disk(self, key: BlockKey) -> bool:
        """:meth:`_on_disk` for a key the index holds: an I/O error answers True (kept; a load finds out)."""
        try:
            return self._on_disk(key)
        except OSError as exc:
            return not _is_gone(exc)

    def _unsafe_shard(self, shard: str, exc: UnsafeEntryError) -> None:
        """A shard that is not a real directory (a link, a file...), met by a listing or an
        eviction: counted as an unsafe entry and skipped (never followed nor removed, not an I/O
        error: the breaker is untouched), logged once per shard."""
        self._count(unsafe_entries=1)
        if shard not in self._unsafe_shards:
            self._unsafe_shards.add(shard)
            logger.warning("fs tier %s: shard %s skipped (never followed, never deleted): %s", self.label, shard, exc)

    def _io_error(self, detail: str) -> None:
        logger.warning("fs tier %s: %s", self.label, detail)
        self._count(io_errors=1)
        self._note_failure(detail)

    def _probe(self) -> None:
        """Open a shard, then write, read back and delete a one-page file; raises if any step fails
        (a shard that is not a directory says nothing of the medium: it does not fail the probe)."""
        with contextlib.suppress(UnsafeEntryError):
            os.close(self._dirs.shard(SHARDS[0]))
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
        """Index every value file on disk, shard by shard (ranked for eviction by mtime); then fix the
        shared file count where the scan proves it wrong and evict what is over the budget."""
        t0 = time.perf_counter()
        found: list[tuple[float, bytes]] = []
        try:
            mark = self._budget.mark()
            for i, shard in enumerate(SHARDS):
                if self._stop_scan.is_set():
                    return
                entries, unsafe = scan_shard(self._dirs, shard)
                if unsafe:
                    self._count(unsafe_entries=unsafe)
                entries.sort()
                self._index.add_found(entries)
                self._scanned[i] = 1
                found.extend(entries)
            found.sort()
            self._index.order_found([key for _, key in found])
            change = self._budget.reconcile(len(found), mark)
            if change:
                logger.info("fs tier %s: shared file count corrected by %+d after the scan", self.label, change)
            need = self._budget.recheck()
            if need:
                logger.info("fs tier %s: %d files beyond max_bytes evicted after restart", self.label, need)
                with contextlib.suppress(_NoRoom):
                    self._make_room(need, recycle_to=None)
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
        self._dirs.on_unsafe = None
        self._instance.close(remove=True)  # first: the ledger's owner is dead from now on
        self._budget.close()
        self._journal.close()
        if self._follow is not None:
            self._follow.close()
        self._dirs.close()
