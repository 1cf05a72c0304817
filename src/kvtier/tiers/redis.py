"""The Redis/Valkey secondary tier: KV blocks shared by engines on many hosts.

Configuration (``{"type": "redis", ...}`` maps straight to the keyword
arguments of :class:`RedisTier`)::

    url                   redis://[user:password@]host:port/db, rediss:// for TLS
                          (redis-py query options pass through, e.g.
                          ?ssl_ca_certs=/path/ca.pem); in cluster mode, any node
    cluster               True for a Redis Cluster (keys spread over its slots)
    prefix                first part of every key: <prefix>:<namespace hex>:<block key hex>
    ttl_seconds           per-key expiry (PX) set on store and refreshed by touch; None = none
    io_threads            I/O threads (each uses its own connection)
    socket_timeout        seconds, for every read/write on a connection
    connect_timeout       seconds, for every connect
    failure_threshold     consecutive failures that take the tier out of service
    open_seconds          how long it stays out of service before a probe (PING)
    lookup_cache_seconds  how long an existence answer is trusted
    max_queued_stores     store jobs allowed to wait; beyond that stores are shed
    usage_refresh_seconds how often INFO memory is read for usage()

Threads: every public method except :meth:`drain` and :meth:`shutdown` is
called from the scheduler thread and only touches memory (a lock held for
microseconds, a queue put); the network is used only by the tier's I/O threads.

Values are ``header + payload`` (:mod:`kvtier.tiers.format`). A load reads the
header into a small buffer and the payload straight into the reserved CPU row,
then verifies header and checksum; a missing key (expired, or evicted by Redis
``maxmemory``) is a MISS for that key, a malformed value is a MISS too, is
deleted, and is counted in ``stats.corrupt_values``.

Health: a :class:`~kvtier.tiers.health.CircuitBreaker`. A refused connection
opens it at once; other failures (timeouts, resets) open it after
``failure_threshold`` in a row. While open, lookups answer MISS, stores are
dropped (``stats.stores_dropped``) and loads fail at once; after
``open_seconds`` an I/O thread sends PING and a success brings the tier back.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import ssl
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvtier.errors import ConfigError, CorruptValueError, TierDrainTimeout, TierError
from kvtier.keys import BlockKey
from kvtier.tiers.base import (
    JobResult,
    SecondaryTier,
    TierContext,
    TierHealth,
    TierUsage,
    TransferJob,
)
from kvtier.tiers.format import HEADER_SIZE, decode_header, encode_header, verify_payload
from kvtier.tiers.health import CircuitBreaker
from kvtier.tiers.redis_backend import ClusterBackend, RedisBackend, StandaloneBackend
from kvtier.tiers.redis_protocol import (
    ErrorReply,
    Piece,
    RespReader,
    SetEncoder,
    pack_command,
    send_pieces,
)
from kvtier.types import BlockEvent, LookupResult, RequestContext

logger = logging.getLogger(__name__)

_SCHEMES = ("redis", "rediss", "unix")
# Payload bytes of GET replies per pipelined round trip: bounds what the server buffers for
# this client while the replies are read (16 blocks of 2 MiB). Stores need no bound: each SET
# is applied as it arrives and its reply is 5 bytes, so a store job is one pipeline.
_BATCH_BYTES = 32 * 1024 * 1024
_EXISTS_BATCH = 512
_CACHE_MAX_ENTRIES = 1 << 20

# Work priorities: existence checks before loads before stores, so writes to a
# slow server queue up (and are shed) before reads suffer.
_P_EXISTS, _P_LOAD, _P_STORE, _P_TOUCH, _P_STOP = 0, 1, 2, 3, 9


class RedisTierOptions(BaseModel):
    """Redis / Valkey tier (``type: redis``), standalone or cluster: the keyword options of :class:`RedisTier`."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        description="redis://[user:pass@]host:port[/db], rediss:// for TLS, unix:///path; in cluster mode any node."
    )
    cluster: bool = Field(default=False, description="Talk to a Redis Cluster (keys spread over its slots).")
    prefix: str = Field(default="kvtier", description="Key prefix in front of the namespace digest.")
    ttl_seconds: float | None = Field(
        default=None, gt=0, description="Expire values this many seconds after store/touch; none by default."
    )
    io_threads: int = Field(default=2, ge=1, description="I/O threads, each with its own connection.")
    socket_timeout: float = Field(default=1.0, gt=0, description="Seconds for every read/write on a connection.")
    connect_timeout: float = Field(default=1.0, gt=0, description="Seconds for every connect.")
    failure_threshold: int = Field(
        default=3, ge=1, description="Consecutive failures that take the tier out of service."
    )
    open_seconds: float = Field(default=2.0, gt=0, description="Seconds out of service before a PING probe.")
    lookup_cache_seconds: float = Field(default=1.0, ge=0, description="How long an existence answer is trusted.")
    max_queued_stores: int = Field(
        default=64, ge=1, description="Store jobs allowed to wait; beyond that stores are shed."
    )
    usage_refresh_seconds: float = Field(default=5.0, gt=0, description="How often INFO memory is read for usage().")

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if urlsplit(value).scheme not in _SCHEMES:
            raise ValueError(f"url {_redact(value)!r} must start with redis://, rediss:// (TLS) or unix://")
        return value


@dataclass(order=True)
class _Work:
    priority: int
    seq: int
    kind: str = field(compare=False)
    keys: list[BlockKey] = field(compare=False, default_factory=list)
    job: TransferJob | None = field(compare=False, default=None)
    submitted: float = field(compare=False, default=0.0)


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


def _forget_frames(exc: BaseException) -> None:
    """Drop the tracebacks of ``exc`` and its chain, clearing the finished frames.

    Those frames hold views of the CPU rows (payload and destination
    memoryviews); redis-py's exception chains can form reference cycles that
    would keep them alive until a garbage collection, and the shared region
    cannot be unmapped while any view exists.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
            e.__traceback__ = None
        pending.extend((e.__cause__, e.__context__))


def _format(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def _is_refused(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            break
        if isinstance(seen, ConnectionRefusedError) or "refused" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class RedisTier(SecondaryTier):
    """Blocks in Redis or Valkey (standalone or Cluster), shared by every engine of a namespace.

    See the module docstring for the options, the threads and the health rules.
    """

    tier_type = "redis"
    medium = "remote"
    options_model = RedisTierOptions

    def __init__(
        self,
        context: TierContext,
        *,
        url: str = "redis://127.0.0.1:6379/0",
        cluster: bool = False,
        prefix: str = "kvtier",
        ttl_seconds: float | None = None,
        io_threads: int = 2,
        socket_timeout: float = 1.0,
        connect_timeout: float = 1.0,
        failure_threshold: int = 3,
        open_seconds: float = 2.0,
        lookup_cache_seconds: float = 1.0,
        max_queued_stores: int = 64,
        usage_refresh_seconds: float = 5.0,
    ) -> None:
        """Check the options, build the backend, start the I/O threads.

        Long because every option is checked here, one or two lines each, before any
        thread starts; the options model repeats the checks for configuration files.
        """
        super().__init__(context)
        scheme = urlsplit(url).scheme
        if scheme not in _SCHEMES:
            raise ConfigError(
                f"redis url {_redact(url)!r} has scheme {scheme!r}: use redis://host:port/db, "
                "rediss:// for TLS or unix:///path/to/socket"
            )
        if cluster and scheme == "unix":
            raise ConfigError("redis cluster mode needs a redis:// or rediss:// url of one node, not unix://")
        if not prefix or any(c in prefix for c in " \r\n"):
            raise ConfigError(f"redis prefix {prefix!r} must be non-empty without spaces or newlines")
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ConfigError(f"redis ttl_seconds must be > 0 or None (no expiry), got {ttl_seconds}")
        if io_threads < 1:
            raise ConfigError(f"redis io_threads must be >= 1, got {io_threads}")
        for name, value in (
            ("socket_timeout", socket_timeout),
            ("connect_timeout", connect_timeout),
            ("open_seconds", open_seconds),
            ("usage_refresh_seconds", usage_refresh_seconds),
        ):
            if value <= 0:
                raise ConfigError(f"redis {name} must be > 0 seconds, got {value}")
        if lookup_cache_seconds < 0:
            raise ConfigError(f"redis lookup_cache_seconds must be >= 0, got {lookup_cache_seconds}")
        if failure_threshold < 1:
            raise ConfigError(f"redis failure_threshold must be >= 1, got {failure_threshold}")
        if max_queued_stores < 0:
            raise ConfigError(f"redis max_queued_stores must be >= 0, got {max_queued_stores}")
        if context.block_bytes <= 0:
            raise ConfigError(f"block_bytes must be > 0, got {context.block_bytes}")

        self.url = url
        self.cluster = cluster
        self.prefix = prefix
        self.ttl_seconds = ttl_seconds
        self.io_threads = io_threads
        self.socket_timeout = socket_timeout
        self.connect_timeout = connect_timeout
        self.lookup_cache_seconds = lookup_cache_seconds
        self.max_queued_stores = max_queued_stores
        self.usage_refresh_seconds = usage_refresh_seconds

        self._rows: np.ndarray | None = context.rows
        self._block_bytes = context.block_bytes
        self._value_bytes = HEADER_SIZE + context.block_bytes
        self._ns_digest = context.namespace.digest
        self._key_prefix = f"{prefix}:{context.namespace.hexdigest}:".encode()
        self._px = b"%d" % max(1, round(ttl_seconds * 1000)) if ttl_seconds is not None else None
        self._set_encoder = SetEncoder(self._value_bytes, self._px)
        self._chunk = max(1, _BATCH_BYTES // self._block_bytes)
        # A check that has not answered in this long is treated as a MISS.
        self._check_deadline = socket_timeout + connect_timeout + 0.5

        self._breaker = CircuitBreaker(failure_threshold=failure_threshold, open_seconds=open_seconds)
        try:
            self._backend: RedisBackend = (
                ClusterBackend(url, socket_timeout, connect_timeout)
                if cluster
                else StandaloneBackend(url, socket_timeout, connect_timeout)
            )
        except ValueError as exc:
            raise ConfigError(f"redis url {_redact(url)!r} is invalid: {exc}") from exc

        # Shared state, guarded by _lock (held for dictionary operations only).
        self._lock = threading.Lock()
        self._work_ready = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._heap: list[_Work] = []
        self._seq = itertools.count()
        self._queued_stores = 0
        self._inflight_jobs = 0
        self._known: dict[BlockKey, tuple[bool, float, bool]] = {}
        self._checking: dict[BlockKey, float] = {}
        self._results: deque[JobResult] = deque()
        self._events: deque[BlockEvent] = deque()
        self._usage = TierUsage(0, None)
        self._usage_at = float("-inf")
        self._need_refresh = False
        self._stats_lock = threading.Lock()
        self._house_lock = threading.Lock()

        # Scheduler-thread only.
        self._pending_checks: dict[BlockKey, None] = {}
        self._closed = False
        self._stopping = False
        self._shut_down = False

        self._threads = [
            threading.Thread(target=self._worker, name=f"kvtier-redis-{context.index}-{i}", daemon=True)
            for i in range(io_threads)
        ]
        for thread in self._threads:
            thread.start()

    # --- helpers -------------------------------------------------------------------

    def redis_key(self, key: BlockKey) -> bytes:
        """The Redis key of a block: ``<prefix>:<namespace hex>:<block key hex>``."""
        return self._key_prefix + key.hex().encode()

    def _remember(self, key: BlockKey, present: bool, now: float, answer: bool = False) -> None:
        # Caller holds _lock. Re-inserting keeps the dict ordered by expiry. ``answer``
        # marks the reply to a lookup's check, which that lookup consumes once.
        self._known.pop(key, None)
        self._known[key] = (present, now + self.lookup_cache_seconds, answer)

    def _prune_known(self, now: float) -> None:
        # Caller holds _lock.
        known = self._known
        while known:
            first = next(iter(known))
            if known[first][1] + self._check_deadline > now and len(known) <= _CACHE_MAX_ENTRIES:
                break
            del known[first]

    def _push(self, work: _Work) -> None:
        # Caller holds _lock.
        heapq.heappush(self._heap, work)
        self._work_ready.notify()

    def _finish(self, result: JobResult) -> None:
        with self._lock:
            self._results.append(result)
            self._inflight_jobs -= 1
            if self._inflight_jobs == 0:
                self._idle.notify_all()

    # --- scheduler-thread calls ----------------------------------------------------

    def lookup(self, key: BlockKey, request: RequestContext | None) -> LookupResult:
        """HIT/MISS from the answer cache, else RETRY while a batched EXISTS is under way.

        Unknown keys are collected and sent to an I/O thread at :meth:`on_schedule_end`.
        Answers MISS at once while the tier is out of service.
        """
        if self._closed or not self._breaker.serving:
            self.stats.lookups_miss += 1
            return LookupResult.MISS
        now = time.monotonic()
        with self._lock:
            entry = self._known.get(key)
            since = self._checking.get(key)
            if entry is not None and entry[2]:
                # The first lookup after a check uses its answer even if the cache time has passed.
                self._known[key] = entry = (entry[0], max(entry[1], now + 1e-9), False)
        if entry is not None and entry[1] > now:
            if entry[0]:
                self.stats.lookups_hit += 1
                return LookupResult.HIT
            self.stats.lookups_miss += 1
            return LookupResult.MISS
        if since is not None and now - since > self._check_deadline:
            self.stats.lookups_miss += 1
            return LookupResult.MISS
        if since is None:
            self._pending_checks[key] = None
        self.stats.lookups_retry += 1
        return LookupResult.RETRY

    def on_schedule_end(self) -> None:
        """Hand this step's unknown keys to the I/O threads as batched EXISTS checks."""
        if not self._pending_checks:
            return
        keys = list(self._pending_checks)
        self._pending_checks.clear()
        if self._closed or not self._breaker.serving:
            return
        now = time.monotonic()
        with self._lock:
            for key in keys:
                self._checking[key] = now
            for i in range(0, len(keys), _EXISTS_BATCH):
                self._push(_Work(_P_EXISTS, next(self._seq), "exists", keys[i : i + _EXISTS_BATCH]))

    def submit_store(self, job: TransferJob) -> None:
        """Queue a SET of every key not known to be held; dropped (and counted) while out of service."""
        self._check_open()
        with self._stats_lock:
            self.stats.stores_submitted += len(job.keys)
        now = time.monotonic()
        with self._lock:
            self._inflight_jobs += 1
            shed = not self._breaker.serving or self._queued_stores >= self.max_queued_stores
            if not shed:
                keys = []
                for key in job.keys:
                    entry = self._known.get(key)
                    if not (entry is not None and entry[0] and entry[1] > now):
                        keys.append(key)
                self._queued_stores += 1
                self._push(_Work(_P_STORE, next(self._seq), "store", keys, job, now))
                return
        reason = "out of service" if not self._breaker.serving else "too many stores queued"
        self._drop_store(job, reason)

    def submit_load(self, job: TransferJob) -> None:
        """Queue a pipelined GET of ``job.keys`` into ``job.slots``; fails at once while out of service."""
        self._check_open()
        with self._stats_lock:
            self.stats.loads_submitted += len(job.keys)
        with self._lock:
            self._inflight_jobs += 1
            if self._breaker.serving:
                self._push(_Work(_P_LOAD, next(self._seq), "load", list(job.keys), job, time.monotonic()))
                return
        self._fail_load(job, "redis tier is out of service", 0.0)

    def poll_finished(self) -> list[JobResult]:
        with self._lock:
            results = list(self._results)
            self._results.clear()
        return results

    def touch(self, keys: Sequence[BlockKey], request: RequestContext | None) -> None:
        """With a TTL, refresh the expiry of ``keys`` (best effort, on an I/O thread)."""
        if self._px is None or self._closed or not keys or not self._breaker.serving:
            return
        with self._lock:
            self._push(_Work(_P_TOUCH, next(self._seq), "touch", list(keys)))

    def has_pending_work(self) -> bool:
        with self._lock:
            return self._inflight_jobs > 0 or bool(self._results) or bool(self._checking)

    def take_events(self) -> list[BlockEvent]:
        with self._lock:
            events = list(self._events)
            self._events.clear()
        return events

    def health(self) -> TierHealth:
        return self._breaker.health()

    def usage(self) -> TierUsage:
        """Server memory from ``INFO memory`` (summed over cluster primaries), read by an I/O thread.

        ``used_bytes`` is the server's whole ``used_memory``; ``capacity_bytes``
        is ``maxmemory``, or None when the server has no limit.
        """
        return self._usage

    def describe(self) -> dict[str, Any]:
        return {
            "type": self.tier_type,
            "medium": self.medium,
            "url": _redact(self.url),
            "cluster": self.cluster,
            "prefix": self.prefix,
            "key_prefix": self._key_prefix.decode(),
            "ttl_seconds": self.ttl_seconds,
            "io_threads": self.io_threads,
            "socket_timeout": self.socket_timeout,
            "connect_timeout": self.connect_timeout,
            "failure_threshold": self._breaker.failure_threshold,
            "open_seconds": self._breaker.open_seconds,
            "lookup_cache_seconds": self.lookup_cache_seconds,
            "max_queued_stores": self.max_queued_stores,
            "health": self._breaker.state.value,
        }

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"redis tier {self.label} is shut down; no more jobs can be submitted")

    # --- blocking calls --------------------------------------------------------------

    def drain(self, timeout: float | None = None) -> None:
        """Block until every submitted job finished or failed (each job is bounded by timeouts)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._inflight_jobs > 0:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TierDrainTimeout(
                        f"redis tier {self.label}: {self._inflight_jobs} job(s) still running after "
                        f"{timeout}s; raise the drain timeout or check the server at {_redact(self.url)}"
                    )
                self._idle.wait(left)

    def shutdown(self) -> None:
        """Fail queued jobs, let running ones finish (bounded by socket timeouts), join the threads.

        Raises :class:`TierError` if an I/O thread does not stop; the CPU rows
        are released only once every thread is proven stopped.
        """
        if self._shut_down:
            return
        self._closed = True
        with self._lock:
            queued = [w for w in self._heap if w.job is not None]
            self._heap = [w for w in self._heap if w.job is None and w.kind == "stop"]
            self._checking.clear()
            self._queued_stores = 0
            if not self._stopping:
                for _ in self._threads:
                    self._push(_Work(_P_STOP, next(self._seq), "stop"))
                self._stopping = True
            self._work_ready.notify_all()
        for work in queued:
            assert work.job is not None
            if work.kind == "store":
                self._drop_store(work.job, "tier shut down")
            else:
                self._fail_load(work.job, "tier shut down", 0.0)
        # A running batch is bounded by a connect plus a few socket timeouts.
        join_timeout = self.connect_timeout + 4 * self.socket_timeout + 2.0
        deadline = time.monotonic() + join_timeout
        alive = []
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                alive.append(thread.name)
        if alive:
            raise TierError(
                f"redis tier {self.label}: I/O thread(s) {alive} did not stop within {join_timeout:.1f}s; "
                "the CPU rows may still be in use, so they were not released"
            )
        try:
            self._backend.close()
        except Exception as exc:  # closing sockets must not keep the rows pinned
            logger.warning("redis tier %s: closing connections failed: %s", self.label, exc)
        self._rows = None
        self._shut_down = True
        self.context = dataclasses.replace(self.context, rows=np.empty((0, self.context.row_stride), dtype=np.uint8))

    # --- I/O threads -----------------------------------------------------------------

    def _worker(self) -> None:
        while True:
            with self._lock:
                if not self._heap:
                    self._work_ready.wait(0.1)
                work = heapq.heappop(self._heap) if self._heap else None
                if work is not None and work.kind == "store":
                    self._queued_stores = max(0, self._queued_stores - 1)
            if work is not None and work.kind == "stop":
                return
            self._housekeeping()
            if work is None:
                continue
            try:
                self._run(work)
            except Exception as exc:  # a bug must fail the job, not kill the thread
                logger.error("redis tier %s: unexpected error in %s work:\n%s", self.label, work.kind, _format(exc))
                _forget_frames(exc)
                if work.job is not None:
                    if work.kind == "store":
                        self._fail_store(work.job, "internal error (see log)", 0.0)
                    else:
                        self._fail_load(work.job, "internal error (see log)", 0.0)

    def _run(self, work: _Work) -> None:
        if work.kind == "exists":
            self._do_exists(work.keys)
        elif work.kind == "load":
            assert work.job is not None
            self._do_load(work.job)
        elif work.kind == "store":
            assert work.job is not None
            self._do_store(work.job, work.keys)
        elif work.kind == "touch":
            self._do_touch(work.keys)

    def _housekeeping(self) -> None:
        if not self._house_lock.acquire(blocking=False):
            return
        try:
            if self._stopping:
                return
            if self._breaker.probe_due():
                try:
                    self._backend.ping()
                except Exception as exc:
                    self._breaker.record_failure(f"probe failed: {exc}")
                    logger.debug("redis tier %s: probe failed: %s", self.label, exc)
                else:
                    with self._lock:
                        self._known.clear()
                    self._breaker.record_success()
                    logger.info("redis tier %s: server answers again; back in service", self.label)
            if not self._breaker.serving:
                return
            if self._need_refresh:
                self._need_refresh = False
                self._guarded(self._backend.refresh)
            now = time.monotonic()
            if now - self._usage_at >= self.usage_refresh_seconds:
                self._usage_at = now
                memory = self._guarded(self._backend.info_memory)
                if memory is not None:
                    self._usage = TierUsage(memory[0], memory[1])
            with self._lock:
                self._prune_known(now)
        finally:
            self._house_lock.release()

    def _guarded(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as exc:
            self._record_error(exc)
            return None

    def _record_error(self, exc: BaseException) -> str:
        """Feed ``exc`` to the circuit breaker; called from ``except`` blocks on I/O threads."""
        detail = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, (TimeoutError, RedisTimeoutError)):
            self._breaker.record_failure(detail)
        elif _is_refused(exc):
            self._breaker.trip(detail)
        elif isinstance(exc, (OSError, RedisError, RedisClusterException)):
            self._breaker.record_failure(detail)
        else:
            self._breaker.record_failure(detail)
            # Formatted here: a LogRecord holding the traceback would keep row views alive.
            logger.error("redis tier %s: unexpected error:\n%s", self.label, _format(exc))
        _forget_frames(exc)
        if not self._breaker.serving:
            logger.warning("redis tier %s out of service: %s", self.label, detail)
        return detail

    def _pipeline(
        self,
        rkeys: Sequence[bytes],
        send: Callable[[list[Piece], int], None],
        receive: Callable[[RespReader, int], None],
    ) -> None:
        """Send one command per key (grouped by server), then read the replies in order.

        A command carrying a payload is sent as soon as it is packed (one
        ``sendmsg`` for its head, value header, payload and tail), so the server
        processes value ``i`` while the next header and checksum are computed.
        """
        for pool, indexes in self._backend.groups(rkeys):
            conn = pool.get_connection()
            clean = False
            try:
                sock = conn._sock
                # A TLS socket cannot gather pieces in one call: there the small tail waits to be
                # joined with the next command's head instead of costing a TLS record of its own.
                keep_tail = isinstance(sock, ssl.SSLSocket)
                pieces: list[Piece] = []
                for i in indexes:
                    send(pieces, i)
                    if len(pieces) >= 256 or any(isinstance(p, memoryview) for p in pieces[-3:]):
                        if keep_tail:
                            send_pieces(sock, pieces[:-1])
                            del pieces[:-1]
                        else:
                            send_pieces(sock, pieces)
                            pieces.clear()
                send_pieces(sock, pieces)
                reader = RespReader(sock)
                for i in indexes:
                    receive(reader, i)
                clean = True
            finally:
                if not clean:
                    conn.disconnect()
                pool.release(conn)

    def _note_reply_error(self, reply: ErrorReply) -> None:
        if reply.is_redirect:
            self._need_refresh = True

    def _do_exists(self, keys: list[BlockKey]) -> None:
        if not self._breaker.serving:
            with self._lock:
                for key in keys:
                    self._checking.pop(key, None)
            return
        rkeys = [self.redis_key(k) for k in keys]
        answers: dict[int, bool] = {}

        def send(out: list[Piece], i: int) -> None:
            pack_command(out, b"EXISTS", rkeys[i])

        def receive(reader: RespReader, i: int) -> None:
            reply = reader.read_reply()
            if isinstance(reply, int):
                answers[i] = reply > 0
            elif isinstance(reply, ErrorReply):
                self._note_reply_error(reply)

        try:
            self._pipeline(rkeys, send, receive)
        except Exception as exc:
            self._record_error(exc)
        else:
            self._breaker.record_success()
        now = time.monotonic()
        with self._lock:
            for i, key in enumerate(keys):
                self._checking.pop(key, None)
                if i in answers:
                    self._remember(key, answers[i], now, answer=True)

    def _do_store(self, job: TransferJob, keys: list[BlockKey]) -> None:
        if not self._breaker.serving:
            self._drop_store(job, "redis tier is out of service")
            return
        rows = self._rows
        assert rows is not None
        slot_of = {k: int(s) for k, s in zip(job.keys, job.slots, strict=True)}
        wanted = set(keys)
        skipped = [k for k in job.keys if k not in wanted]
        stored: list[BlockKey] = []
        errors: list[str] = []
        started = time.perf_counter()
        if keys:
            rkeys = [self.redis_key(k) for k in keys]
            ok: list[bool] = [False] * len(keys)

            encoder, block_bytes, ns_digest = self._set_encoder, self._block_bytes, self._ns_digest

            def send(out: list[Piece], i: int) -> None:
                payload = rows[slot_of[keys[i]], :block_bytes].data
                encoder.pack(out, rkeys[i], encode_header(ns_digest, keys[i], payload), payload)

            def receive(reader: RespReader, i: int) -> None:
                reply = reader.read_reply()
                if isinstance(reply, ErrorReply):
                    self._note_reply_error(reply)
                    errors.append(reply.message)
                else:
                    ok[i] = True

            try:
                self._pipeline(rkeys, send, receive)
            except Exception as exc:
                errors.append(self._record_error(exc))
            else:
                self._breaker.record_success()
                stored.extend(k for k, good in zip(keys, ok, strict=True) if good)
        seconds = time.perf_counter() - started
        now = time.monotonic()
        with self._lock:
            for key in stored:
                self._remember(key, True, now)
            if stored:
                self._events.append(BlockEvent(tuple(stored), self.label, self.medium, removed=False))
        done = stored + skipped
        failed = len(job.keys) - len(done)
        with self._stats_lock:
            self.stats.bytes_written += len(stored) * self._value_bytes
            self.stats.seconds_writing += seconds
            self.stats.stores_failed += failed
        self._finish(self._result(job, done, len(stored) * self._value_bytes, seconds, errors))

    def _do_load(self, job: TransferJob) -> None:
        """Read a load job's values straight into its CPU rows and verify each before success (I/O thread).

        Long because the header read, the payload read into the row and the per-key
        verification share one connection and one error path (the hot read path).
        """
        if not self._breaker.serving:
            self._fail_load(job, "redis tier is out of service", 0.0)
            return
        rows = self._rows
        assert rows is not None
        keys = list(job.keys)
        slots = [int(s) for s in job.slots]
        loaded: list[BlockKey] = []
        missing: list[BlockKey] = []
        corrupt: list[BlockKey] = []
        errors: list[str] = []
        header = bytearray(HEADER_SIZE)
        head_view = memoryview(header)
        started = time.perf_counter()
        for base in range(0, len(keys), self._chunk):
            chunk = keys[base : base + self._chunk]
            chunk_slots = slots[base : base + self._chunk]
            rkeys = [self.redis_key(k) for k in chunk]

            def send(out: list[Piece], i: int, rkeys: list[bytes] = rkeys) -> None:
                pack_command(out, b"GET", rkeys[i])

            def receive(
                reader: RespReader, i: int, chunk: list[BlockKey] = chunk, chunk_slots: list[int] = chunk_slots
            ) -> None:
                body = rows[chunk_slots[i], : self._block_bytes].data
                reply = reader.read_bulk_split(head_view, body)
                key = chunk[i]
                if reply is None:
                    missing.append(key)
                elif isinstance(reply, ErrorReply):
                    self._note_reply_error(reply)
                    errors.append(reply.message)
                elif reply != self._value_bytes:
                    logger.warning(
                        "redis tier %s: value of %s has %d bytes, expected %d; deleting it",
                        self.label,
                        key.hex(),
                        reply,
                        self._value_bytes,
                    )
                    corrupt.append(key)
                else:
                    try:
                        parsed = decode_header(
                            head_view, namespace=self._ns_digest, key=key, payload_len=self._block_bytes
                        )
                        verify_payload(parsed, body)
                    except CorruptValueError as exc:
                        # str(exc), never exc: a handler that keeps records (caplog, log shippers) would
                        # keep its traceback, whose frame holds ``body``, a view of a CPU row.
                        logger.warning(
                            "redis tier %s: value of %s is corrupt (%s); deleting it", self.label, key.hex(), str(exc)
                        )
                        corrupt.append(key)
                    else:
                        loaded.append(key)

            try:
                self._pipeline(rkeys, send, receive)
            except Exception as exc:
                errors.append(self._record_error(exc))
                break
            self._breaker.record_success()
        seconds = time.perf_counter() - started
        if corrupt:
            self._delete(corrupt)
        now = time.monotonic()
        with self._lock:
            for key in loaded:
                self._remember(key, True, now)
            for key in missing + corrupt:
                self._remember(key, False, now)
            if corrupt:
                self._events.append(BlockEvent(tuple(corrupt), self.label, self.medium, removed=True))
        if missing:
            errors.append(f"{len(missing)} key(s) missing (expired or evicted)")
        if corrupt:
            errors.append(f"{len(corrupt)} corrupt value(s) deleted")
        with self._stats_lock:
            self.stats.bytes_read += len(loaded) * self._value_bytes
            self.stats.seconds_reading += seconds
            self.stats.corrupt_values += len(corrupt)
            self.stats.loads_failed += len(keys) - len(loaded)
        self._finish(self._result(job, loaded, len(loaded) * self._value_bytes, seconds, errors))

    def _delete(self, keys: list[BlockKey]) -> None:
        self._best_effort(b"DEL", keys)

    def _do_touch(self, keys: list[BlockKey]) -> None:
        if self._px is not None and self._breaker.serving:
            self._best_effort(b"PEXPIRE", keys, self._px)

    def _best_effort(self, command: bytes, keys: list[BlockKey], *args: bytes) -> None:
        """``<command> <key> <args...>`` for every key, pipelined; replies are not inspected."""
        rkeys = [self.redis_key(k) for k in keys]

        def send(out: list[Piece], i: int) -> None:
            pack_command(out, command, rkeys[i], *args)

        def receive(reader: RespReader, i: int) -> None:
            reader.read_reply()

        try:
            self._pipeline(rkeys, send, receive)
        except Exception as exc:
            self._record_error(exc)

    # --- results -----------------------------------------------------------------------

    @staticmethod
    def _result(job: TransferJob, done: list[BlockKey], nbytes: int, seconds: float, errors: list[str]) -> JobResult:
        success = len(done) == len(job.keys)
        return JobResult(
            job_id=job.job_id,
            success=success,
            successful_keys=None if success or not done else frozenset(done),
            bytes_moved=nbytes,
            seconds=seconds,
            error=None if success else ("; ".join(dict.fromkeys(errors)) or "failed"),
        )

    def _drop_store(self, job: TransferJob, reason: str) -> None:
        with self._stats_lock:
            self.stats.stores_dropped += len(job.keys)
        self._finish(JobResult(job.job_id, False, error=f"store dropped: {reason}"))

    def _fail_store(self, job: TransferJob, reason: str, seconds: float) -> None:
        with self._stats_lock:
            self.stats.stores_failed += len(job.keys)
        self._finish(JobResult(job.job_id, False, seconds=seconds, error=reason))

    def _fail_load(self, job: TransferJob, reason: str, seconds: float) -> None:
        with self._stats_lock:
            self.stats.loads_failed += len(job.keys)
        self._finish(JobResult(job.job_id, False, seconds=seconds, error=reason))
