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
``maxmemory``) is a MISS for that key and is reported removed in the tier's events
(nobody else can report it), a malformed value is a MISS too, is deleted, and is
counted in ``stats.corrupt_values``.

Health: a :class:`~kvtier.tiers.health.CircuitBreaker`. A refused connection
opens it at once; other failures (timeouts, resets) open it after
``failure_threshold`` in a row. While open, lookups answer MISS, stores are
dropped (``stats.stores_dropped``) and loads fail at once; after
``open_seconds`` an I/O thread sends PING and a success brings the tier back.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvtier.errors import ConfigError, CorruptValueError
from kvtier.keys import BlockKey
from kvtier.tiers.base import JobResult, TierContext, TierUsage, TransferJob
from kvtier.tiers.format import HEADER_SIZE, decode_header, encode_header, verify_payload
from kvtier.tiers.health import CircuitBreaker
from kvtier.tiers.jobs import ALL_LANES, JobState, Lane, ThreadedTier, Work
from kvtier.tiers.jobs import forget_frames as _forget_frames
from kvtier.tiers.jobs import format_exception as _format
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


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


def _is_refused(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            break
        if isinstance(seen, ConnectionRefusedError) or "refused" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class RedisTier(ThreadedTier):
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
        # A running batch is bounded by a connect plus a few socket timeouts.
        super().__init__(
            context,
            breaker=CircuitBreaker(failure_threshold=failure_threshold, open_seconds=open_seconds),
            max_queued_stores=max_queued_stores,
            shutdown_timeout=connect_timeout + 4 * socket_timeout + 2.0,
        )

        self.url = url
        self.cluster = cluster
        self.prefix = prefix
        self.ttl_seconds = ttl_seconds
        self.io_threads = io_threads
        self.socket_timeout = socket_timeout
        self.connect_timeout = connect_timeout
        self.lookup_cache_seconds = lookup_cache_seconds
        self.usage_refresh_seconds = usage_refresh_seconds

        self._value_bytes = HEADER_SIZE + context.block_bytes
        self._ns_digest = context.namespace.digest
        self._key_prefix = f"{prefix}:{context.namespace.hexdigest}:".encode()
        self._px = b"%d" % max(1, round(ttl_seconds * 1000)) if ttl_seconds is not None else None
        self._set_encoder = SetEncoder(self._value_bytes, self._px)
        self._chunk = max(1, _BATCH_BYTES // self._block_bytes)
        # A check that has not answered in this long is treated as a MISS.
        self._check_deadline = socket_timeout + connect_timeout + 0.5

        try:
            self._backend: RedisBackend = (
                ClusterBackend(url, socket_timeout, connect_timeout)
                if cluster
                else StandaloneBackend(url, socket_timeout, connect_timeout)
            )
        except ValueError as exc:
            raise ConfigError(f"redis url {_redact(url)!r} is invalid: {exc}") from exc

        # Existence answers, guarded by _lock (held for dictionary operations only).
        self._known: dict[BlockKey, tuple[bool, float, bool]] = {}
        self._usage = TierUsage(0, None)
        self._usage_at = float("-inf")
        self._need_refresh = False

        # Scheduler-thread only.
        self._pending_checks: dict[BlockKey, None] = {}

        self._start_workers(io_threads, ALL_LANES, "io")

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

    # --- scheduler-thread calls ----------------------------------------------------

    def _lookup(self, key: BlockKey, request: RequestContext | None) -> LookupResult:
        """HIT/MISS from the answer cache, else RETRY while a batched EXISTS is under way.

        Unknown keys are collected and sent to an I/O thread at :meth:`on_schedule_end`.
        """
        now = time.monotonic()
        with self._lock:
            entry = self._known.get(key)
            since = self._checking.get(key)
            if entry is not None and entry[2]:
                # The first lookup after a check uses its answer even if the cache time has passed.
                self._known[key] = entry = (entry[0], max(entry[1], now + 1e-9), False)
        if entry is not None and entry[1] > now:
            return LookupResult.HIT if entry[0] else LookupResult.MISS
        if since is not None and now - since > self._check_deadline:
            return LookupResult.MISS
        if since is None:
            self._pending_checks[key] = None
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
            self._queue_internal(Work(Lane.EXISTS, keys=keys[i : i + _EXISTS_BATCH]))

    def _holds(self, key: BlockKey) -> bool:
        """Stores skip keys known to be held (a fresh positive answer)."""
        with self._lock:
            entry = self._known.get(key)
        return entry is not None and entry[0] and entry[1] > time.monotonic()

    def _plan_store(self, state: JobState, blocks: list[tuple[BlockKey, int]]) -> list[Work]:
        """One pipelined SET batch per job (``max_queued_stores`` counts jobs)."""
        return [Work(Lane.STORE, state, [k for k, _ in blocks], [s for _, s in blocks])]

    def _plan_load(self, state: JobState, blocks: list[tuple[BlockKey, int]]) -> list[Work]:
        """One pipelined GET batch per job."""
        return [Work(Lane.LOAD, state, [k for k, _ in blocks], [s for _, s in blocks])]

    def touch(self, keys: Sequence[BlockKey], request: RequestContext | None) -> None:
        """With a TTL, refresh the expiry of ``keys`` (best effort, on an I/O thread)."""
        if self._px is None or self._closed or not keys or not self._breaker.serving:
            return
        self._queue_internal(Work(Lane.BACKGROUND, keys=list(keys)))

    def usage(self) -> TierUsage:
        """Server memory from ``INFO memory`` (summed over cluster primaries), read by an I/O thread.

        ``used_bytes`` is the server's whole ``used_memory``; ``capacity_bytes``
        is ``maxmemory``, or None when the server has no limit.
        """
        return self._usage

    def store_location(self) -> str:
        """``redis:<host:port/db, no credentials or options>/<prefix>`` (give every engine the same
        URL; in cluster mode the same node)."""
        parts = urlsplit(self.url)
        return f"redis:{parts.netloc.rsplit('@', 1)[-1]}{parts.path}/{self.prefix}"

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

    # --- I/O threads (the platform's hooks) ----------------------------------------

    def _run(self, work: Work, local: Any) -> None:
        if work.lane is Lane.EXISTS:
            self._do_exists(work.keys)
        elif work.lane is Lane.LOAD:
            assert work.job is not None
            self._do_load(work.job.job)
        elif work.lane is Lane.STORE:
            assert work.job is not None
            self._do_store(work.job.job, work.keys)
        else:
            self._do_touch(work.keys)

    def _close(self) -> None:
        self._backend.close()

    def _probe(self) -> None:
        """PING; on success the cached answers are dropped (the server may have lost data)."""
        self._backend.ping()
        with self._lock:
            self._known.clear()

    def _housekeeping(self) -> None:
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
                self._events.append(BlockEvent(tuple(stored), self.label, self.medium, False, time.time()))
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
        asked = time.time()  # a key found missing was gone by then
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
        deleting = time.time()
        if corrupt:
            self._delete(corrupt)
        now = time.monotonic()
        with self._lock:
            for key in loaded:
                self._remember(key, True, now)
            for key in missing + corrupt:
                self._remember(key, False, now)
            if corrupt:
                self._events.append(BlockEvent(tuple(corrupt), self.label, self.medium, True, deleting))
            if missing:  # expired or evicted by Redis itself: nobody else can report it
                self._events.append(BlockEvent(tuple(missing), self.label, self.medium, True, asked))
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
        self._count(stores_dropped=len(job.keys))
        self._finish(JobResult(job.job_id, False, error=f"store dropped: {reason}"))

    def _fail_load(self, job: TransferJob, reason: str, seconds: float) -> None:
        self._count(loads_failed=len(job.keys))
        self._finish(JobResult(job.job_id, False, seconds=seconds, error=reason))
