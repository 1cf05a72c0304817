"""The Redis/Valkey secondary tier: KV blocks shared by engines on many hosts.

Configured as ``{"type": "redis", "url": "redis://cache:6379/0", ...}``; the options
(URL forms, key prefix, TTL, threads, timeouts, breaker) are declared once, in
:class:`RedisTierOptions`. Keys are ``<prefix>:<namespace hex>:<block key hex>``.

Threads: every public method except :meth:`drain` and :meth:`shutdown` is
called from the scheduler thread and only touches memory (a lock held for
microseconds, a queue put); the network is used only by the tier's I/O threads.

Values are ``header + payload`` (:mod:`kvtier.tiers.format`). A load reads the
header into a small buffer and the payload straight into the reserved CPU row,
then verifies header and checksum; a missing key (expired, or evicted by Redis
``maxmemory``) is a MISS for that key and is reported removed in the tier's events
(nobody else can report it), a malformed value is a MISS too, is counted in
``stats.corrupt_values`` and is deleted only if it is still the value read (so another
engine's rewrite since is kept; :meth:`RedisTier._delete` says how, at a bounded cost to the
server); a value in another release's format version is a MISS, counted in ``foreign_format`` and kept.

Health: a :class:`~kvtier.tiers.health.CircuitBreaker`. A refused connection
opens it at once; other failures (timeouts, resets, a batch of replies slower than
``min_read_mib_per_second``, a redis-py call (a connection's setup, PING, INFO) past its overall
deadline (:mod:`kvtier.tiers.redis_backend`), error replies by which the server refuses this client:
:func:`refused_by_server`) open it after ``failure_threshold`` in a row. While open,
lookups answer MISS, stores are dropped (``stats.stores_dropped``) and loads fail at
once; after ``open_seconds`` an I/O thread sends PING and a success brings the tier back.
A store batch cut short counts the SETs already answered OK as stored; the SETs whose replies
never came may have landed, and are checked later (:mod:`kvtier.tiers.doubts`,
:meth:`RedisTier._settle_doubts`), so the tier's events announce what the server holds.
"""

from __future__ import annotations

import hashlib
import ipaddress
import itertools
import logging
import os
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar
from urllib.parse import parse_qsl

from pydantic import Field, ValidationInfo, field_serializer, field_validator, model_validator
from redis.connection import parse_url
from redis.exceptions import NoPermissionError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvtier.errors import ConfigError, CorruptValueError, ForeignFormatError, TierError
from kvtier.failures import describe_error, forget_frames, log_failure
from kvtier.keys import BlockKey
from kvtier.tiers.base import (
    FOREIGN_FORMAT_METRIC,
    UPLOADS_FOUND_METRIC,
    WRITES_IN_DOUBT_METRIC,
    ExtraMetric,
    JobResult,
    TierContext,
    TierUsage,
    TransferJob,
)
from kvtier.tiers.doubts import WritesInDoubt
from kvtier.tiers.endpoints import parse_endpoint, redact_url
from kvtier.tiers.format import HEADER_SIZE, PREFIX_SIZE, decode_header, encode_header, foreign_format, verify_payload
from kvtier.tiers.health import CircuitBreaker
from kvtier.tiers.jobs import ALL_LANES, JobState, Lane, ThreadedTier, Work
from kvtier.tiers.options import LifetimeSeconds, QueueLength, Seconds, Threads, TierOptions, tier_options
from kvtier.tiers.redis_backend import CallStopped, ClusterBackend, RedisBackend, StandaloneBackend
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
# Payload bytes of GET replies per pipelined round trip are bounded by the option load_batch_mib:
# the server buffers them all for this client at once (its client-output-buffer-limit for normal
# clients must allow that). Stores need no bound: each SET is applied as it arrives and its reply
# is 5 bytes, so a store job is one pipeline.
_MIB = 1024 * 1024
_EXISTS_BATCH = 512
_CACHE_MAX_ENTRIES = 1 << 20
_MAX_DB = 2**31 - 1
_MAX_QUEUED_TOUCHES = 256
"""Touch batches queued at most: one per engine step, the distinct keys touched in it (an engine's
touches, every CPU-tier load's). A touch is best effort and its lane the last the I/O threads
take, so while stores keep them busy a further step's batch is dropped (counted,
``touches_dropped``) instead of growing the queue without bound."""
_MAX_STEP_TOUCHES = 1 << 16
"""Distinct keys one step's touches collect at most (the rest are dropped and counted)."""
_MAX_DOUBTS = 1 << 16
"""SETs in doubt remembered at most (the oldest is dropped: a lookup's check finds its block)."""
_DOUBTS_PER_TICK = 512
"""SETs in doubt checked per housekeeping tick, in one STRLEN pipeline."""
_CONTROL_REPLY_BYTES = 64 * 1024
"""Bytes the deadline of a redis-py call (a connection's setup, PING, INFO memory, the cluster
topology) allows its replies at ``min_read_mib_per_second``: INFO memory is about 2 KiB."""

# Query options of a Redis URL that redis-py applies to each connection; TLS ones only with rediss://.
_URL_QUERY = frozenset({"db", "username", "password", "socket_read_size", "socket_keepalive"})
_URL_TLS_QUERY = frozenset(
    {"ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_password", "ssl_cert_reqs",
     "ssl_check_hostname", "ssl_min_version", "ssl_ciphers"}
)  # fmt: skip
_URL_FILES = {"ssl_ca_certs": os.path.isfile, "ssl_certfile": os.path.isfile, "ssl_keyfile": os.path.isfile,
              "ssl_ca_path": os.path.isdir}  # fmt: skip
# Query options redis-py reads as a bool (anything but its false words is true), and the words taken.
_BOOL_WORDS = frozenset({"1", "T", "TRUE", "Y", "YES", "0", "F", "FALSE", "N", "NO"})
_URL_BOOLS = {"socket_keepalive": _BOOL_WORDS, "ssl_check_hostname": _BOOL_WORDS}
_MAX_READ_SIZE = 64 * 1024 * 1024
# Query options that would silently override what the tier's own options set.
_URL_OWNED = {
    "socket_timeout": "socket_timeout",
    "socket_connect_timeout": "connect_timeout",
    "timeout": "connect_timeout",
}


def check_redis_url(url: str, owned_fix: str = "use the tier option {option!r} instead") -> str:
    """``url`` with its scheme in lower case if the tier can use it; else ValueError naming the
    part that is wrong and the fix.

    Scheme ``redis://``, ``rediss://`` (TLS) or ``unix://``, in any case (RFC 3986: ``REDIS://``
    is ``redis://``; it is returned in lower case, since redis-py before 8.2 refuses any other);
    a valid host and port (1-65535); a database number as the path; only query options redis-py
    applies to a connection (TLS ones with ``rediss://``; TLS files must exist), not a timeout
    (the caller sets those: ``owned_fix`` says how, ``{option}`` naming the tier's option). The
    URL is shown without its password.
    """
    ep = parse_endpoint(url, "redis url", _SCHEMES, needs_host=not url.lower().startswith("unix:"))
    where = f"redis url {redact_url(url)!r}"
    if ep.scheme == "unix":
        if ep.host or not ep.path.startswith("/") or ep.path == "/":
            raise ValueError(f"{where} must name a socket file: unix:///path/to/redis.sock")
    elif ep.path not in ("", "/"):
        db = ep.path[1:]
        if not db.isdigit() or int(db) > _MAX_DB:
            raise ValueError(f"{where}: the path is the database number, got {db!r}: use e.g. /0")
    path_db = None if ep.scheme == "unix" or ep.path in ("", "/") else int(ep.path[1:])
    keys: set[str] = set()
    try:
        pairs = parse_qsl(ep.query, keep_blank_values=True, strict_parsing=bool(ep.query))
    except ValueError:
        raise ValueError(f"{where} has a malformed query: use ?name=value&name=value") from None
    for name, value in pairs:
        if name in keys:
            raise ValueError(f"{where} gives {name!r} twice")
        keys.add(name)
        if name in _URL_OWNED:
            raise ValueError(f"{where} sets {name!r}: " + owned_fix.format(option=_URL_OWNED[name]))
        if name in _URL_TLS_QUERY and ep.scheme != "rediss":
            raise ValueError(f"{where} sets {name!r}, a TLS option: use rediss:// for TLS")
        if name not in _URL_QUERY | _URL_TLS_QUERY:
            known = sorted(_URL_QUERY | (_URL_TLS_QUERY if ep.scheme == "rediss" else frozenset()))
            raise ValueError(f"{where} has query option {name!r}, which the tier does not take: known are {known}")
        if name == "db":
            if not value.isdigit() or int(value) > _MAX_DB:
                raise ValueError(f"{where}: db must be a database number from 0 to {_MAX_DB}, got {value!r:.40}")
            if path_db is not None and int(value) != path_db:
                raise ValueError(f"{where}: the path says database {path_db} and ?db= says {value}: give it once")
        if name in _URL_FILES and not _URL_FILES[name](value):
            raise ValueError(f"{where}: {name} {value!r} does not exist")
        if name == "ssl_cert_reqs" and value.lower() not in ("none", "optional", "required"):
            raise ValueError(f"{where}: ssl_cert_reqs must be none, optional or required, got {value!r}")
        if name in _URL_BOOLS and value.upper() not in _URL_BOOLS[name]:
            raise ValueError(f"{where}: {name} must be true or false (or 1/0, yes/no), got {value!r:.40}")
        if name == "socket_read_size" and not (value.isdigit() and 1 <= int(value) <= _MAX_READ_SIZE):
            raise ValueError(f"{where}: socket_read_size must be a number of bytes from 1 to {_MAX_READ_SIZE}, "
                             f"got {value!r:.40}")  # fmt: skip
    url = ep.scheme + url[len(ep.scheme) :]  # the scheme is the URL's first characters (no space is let through)
    try:
        parsed = parse_url(url)  # type: ignore[no-untyped-call]
    except ValueError as exc:  # what redis-py itself refuses (a bad number in the query...)
        raise ValueError(f"{where}: {exc}") from None
    if ep.scheme == "rediss":
        _check_tls_options(parsed, where)
    return url


def _check_tls_options(parsed: dict[str, Any], where: str) -> None:
    """ValueError unless the TLS context a ``rediss://`` URL's options describe can be built
    (``parsed``: what redis-py's ``parse_url`` made of them). redis-py builds it at every connect
    from the same options, so a TLS version number or cipher list OpenSSL refuses, or a
    certificate, key or CA file that holds none, would fail every connection (a ValueError or
    TypeError logged with its traceback each time). Built once here the way redis-py builds it;
    a key that needs a password never prompts on a terminal (OpenSSL's default, which blocked an
    I/O thread for good): without ``ssl_password`` an empty one is tried, and refused."""
    context = ssl.create_default_context()
    certfile, keyfile, password = (parsed.get(k) for k in ("ssl_certfile", "ssl_keyfile", "ssl_password"))
    cafile, capath = parsed.get("ssl_ca_certs"), parsed.get("ssl_ca_path")
    try:
        if keyfile and not certfile:
            raise ValueError("ssl_keyfile without ssl_certfile")
        if certfile:
            context.load_cert_chain(certfile, keyfile, password=password if password is not None else lambda: b"")
        if cafile is not None or capath is not None:
            context.load_verify_locations(cafile=cafile, capath=capath)
        if parsed.get("ssl_min_version") is not None:
            context.minimum_version = parsed["ssl_min_version"]
        if parsed.get("ssl_ciphers"):
            context.set_ciphers(parsed["ssl_ciphers"])
    except (OSError, ValueError, TypeError) as exc:  # (ssl.SSLError is an OSError)
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ValueError(
            f"{where}: its TLS options cannot make a TLS context ({reason}): check ssl_min_version (a TLS "
            "version number: 771 for TLS 1.2, 772 for TLS 1.3), ssl_ciphers, ssl_certfile with ssl_keyfile "
            "(and ssl_password for an encrypted key) and ssl_ca_certs/ssl_ca_path (PEM files)"
        ) from None


_LOCAL_NAMES = frozenset({"localhost", "localhost6", "ip6-localhost", "ip6-loopback", "localhost.localdomain"})


def host_local(host: str) -> bool:
    """Does ``host`` (a URL's host name, as :func:`~kvtier.tiers.endpoints.parse_endpoint` gives
    it) reach a server on this machine only: a loopback or unspecified address (IPv4-mapped and
    the resolver's short forms such as ``127.1`` included), ``localhost`` (and ``*.localhost``,
    the usual ``/etc/hosts`` aliases), or no host (redis-py then connects to localhost)?"""
    name = host.lower().rstrip(".")
    if not name or name in _LOCAL_NAMES or name.endswith(".localhost"):
        return True
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        try:
            address = ipaddress.IPv4Address(socket.inet_aton(name))  # 127.1, 0x7f.1: a resolver reads them so
        except OSError:
            return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback or address.is_unspecified


def url_database(url: str) -> int:
    """The database a checked Redis URL (:func:`check_redis_url`) selects: its ``?db=``, else its
    path's number, else 0."""
    ep = parse_endpoint(url, "redis url", _SCHEMES, needs_host=False)
    query_db = dict(parse_qsl(ep.query)).get("db")
    if query_db is not None:
        return int(query_db)
    if ep.scheme != "unix" and ep.path not in ("", "/"):
        return int(ep.path[1:])
    return 0


class RedisTierOptions(TierOptions):
    """Redis / Valkey tier (``type: redis``), standalone or cluster: the options of :class:`RedisTier`."""

    url: str = Field(
        description="redis://[user:pass@]host:port[/db], rediss:// for TLS (TLS options as query: "
        "?ssl_ca_certs=/path/ca.pem), unix:///path; in cluster mode any node. Shown without its password."
    )
    cluster: bool = Field(default=False, description="Talk to a Redis Cluster (keys spread over its slots).")
    prefix: str = Field(
        default="kvtier",
        min_length=1,
        max_length=256,
        pattern=r"^[\x21-\x7e]+$",
        description="Key prefix in front of the namespace digest (printable, no spaces).",
    )
    ttl_seconds: LifetimeSeconds | None = Field(
        default=None, gt=0, description="Expire values this many seconds after store/touch; none by default."
    )
    io_threads: Threads = Field(default=2, description="I/O threads, each with its own connection.")
    socket_timeout: Seconds = Field(default=1.0, gt=0, description="Seconds for every read/write on a connection.")
    connect_timeout: Seconds = Field(default=1.0, gt=0, description="Seconds for every connect.")
    failure_threshold: int = Field(
        default=3, ge=1, le=1_000_000, description="Consecutive failures that take the tier out of service."
    )
    open_seconds: Seconds = Field(default=2.0, gt=0, description="Seconds out of service before a PING probe.")
    lookup_cache_seconds: Seconds = Field(default=1.0, ge=0, description="How long an existence answer is trusted.")
    max_queued_stores: QueueLength = Field(
        default=64, description="Store jobs allowed to wait; beyond that stores are shed."
    )
    usage_refresh_seconds: Seconds = Field(
        default=5.0, gt=0, description="How often INFO memory is read for usage()."
    )
    load_batch_mib: int = Field(
        default=32, ge=1, le=4096,
        description="MiB of values a load asks for per round trip (at least one value): the server buffers "
        "their replies at once, so keep it under its client-output-buffer-limit for normal clients.",
    )
    min_read_mib_per_second: float = Field(
        default=8.0, gt=0, le=1_000_000, allow_inf_nan=False,
        description="Slowest link accepted, both ways: a batch of replies may take socket_timeout plus its MiB "
        "(and a store's, the MiB it sent) divided by this, else it times out (a breaker failure), so a slow "
        "link takes the tier out of service.",
    )

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        return check_redis_url(url)

    @field_validator("cluster")
    @classmethod
    def _cluster_url(cls, cluster: bool, info: ValidationInfo) -> bool:
        """A cluster is reached by a redis:// or rediss:// node, in database 0: Redis Cluster has
        no other (redis-py refuses any other at the first call, so every call would fail)."""
        url = info.data.get("url")
        if not cluster or url is None:
            return cluster
        if str(url).lower().startswith("unix:"):
            raise ValueError("cluster mode needs a redis:// or rediss:// url of one node, not unix://")
        db = url_database(str(url))
        if db != 0:
            raise ValueError(
                f"redis url {redact_url(str(url))!r} names database {db}: a Redis Cluster has database 0 only "
                "(no SELECT); drop the database from the url (or give /0)"
            )
        return cluster

    @field_serializer("url", when_used="json")
    def _shown_url(self, url: str) -> str:
        return redact_url(url)

    @model_validator(mode="after")
    def _batch_time(self) -> RedisTierOptions:
        # A batch of replies may take load_batch_mib at the slowest rate accepted, and shutdown waits
        # as long: an hour at most (1e-7 MiB/s made it 4e10 s, past what a thread join takes).
        seconds = self.load_batch_mib / self.min_read_mib_per_second
        if seconds > MAX_BATCH_SECONDS:
            raise ValueError(
                f"load_batch_mib / min_read_mib_per_second is {seconds:.3g} s, the time a batch (and shutdown) "
                f"may then wait for one batch of values: at most {MAX_BATCH_SECONDS:.0f} s; raise "
                "min_read_mib_per_second or lower load_batch_mib"
            )
        return self


class _Stopped(TierError):
    """A batch cut short because the tier is shutting down (no failure of the server)."""


MAX_BATCH_SECONDS = 3600.0
"""The longest one batch of values may take at ``min_read_mib_per_second`` (see :class:`RedisTierOptions`)."""

# Error replies that say the server will not serve this client now (an ACL without the tier's
# keys or commands, a script running, a data set loading, a replica without its primary...) are
# tier failures; only these few are about the one key: a redirect (the topology moved) and a value
# of another type. To a write, the refusals of writes only are too (the server still serves reads):
# each fails its store, is logged with its hint at most once a minute, and is no tier failure.
_KEY_ERRORS = ("MOVED", "ASK", "WRONGTYPE")
_WRITE_REFUSAL_HINTS = {
    "OOM": "the server is full (maxmemory) and refuses writes; stores fail, reads go on",
    "MISCONF": "the server refuses writes since its last RDB snapshot failed (stop-writes-on-bgsave-error): "
               "fix its disk or dir; stores fail, reads go on",
    "NOREPLICAS": "the server refuses writes: fewer replicas than its min-replicas-to-write are connected; "
                  "stores fail, reads go on",
}  # fmt: skip
_REFUSAL_LOG_SECONDS = 60.0
_REFUSAL_HINTS = {
    "NOPERM": "give the URL's ACL user the keys <prefix>:* and the commands STRLEN GET SET EVAL GETRANGE "
              "DEL WATCH MULTI EXEC PEXPIRE PING INFO (docs/tiers.md); counted as a tier failure",
    "NOAUTH": "the URL's password or ACL user is wrong or missing; counted as a tier failure",
    "BUSY": "a long script blocks the server; counted as a tier failure",
    "LOADING": "the server is loading its data set; counted as a tier failure",
    "MASTERDOWN": "the replica has lost its primary; counted as a tier failure",
    "READONLY": "the URL names a read-only replica: give the primary; counted as a tier failure",
}  # fmt: skip


# Deletes KEYS[1] only if it still has length ARGV[1] and starts with the bytes ARGV[2] (a value's
# first bytes, at most its header: HEADER_SIZE). 1: deleted, 0: not. Reads at most #ARGV[2] bytes of
# the value, so its cost on the server does not grow with the value (see RedisTier._delete).
_DELETE_IF_UNCHANGED = b"""local n = redis.call('strlen', KEYS[1])
if n ~= tonumber(ARGV[1]) then return 0 end
if n > 0 and (#ARGV[2] == 0 or redis.call('getrange', KEYS[1], 0, #ARGV[2] - 1) ~= ARGV[2]) then return 0 end
return redis.call('del', KEYS[1])"""


def refused_by_server(reply: ErrorReply, writing: bool = False) -> bool:
    """Whether ``reply`` says the server refuses this client (a tier failure), not one key (a
    MISS or failed key only): everything but a redirect, WRONGTYPE and, for a write, a refusal of
    writes only (``OOM``, ``MISCONF``, ``NOREPLICAS``: the server still serves reads)."""
    code = reply.message.split(" ", 1)[0]
    return code not in _KEY_ERRORS and not (writing and code in _WRITE_REFUSAL_HINTS)


def _size(pieces: Sequence[Piece]) -> int:
    return sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in pieces)


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
    extra_metrics: ClassVar[Mapping[str, ExtraMetric]] = {
        **ThreadedTier.extra_metrics,
        "touches_dropped": ExtraMetric(
            "counter", "Keys whose TTL refresh was dropped: too many touches queued, or a step's over its cap."
        ),
        "uploads_found": UPLOADS_FOUND_METRIC,
        "writes_in_doubt": WRITES_IN_DOUBT_METRIC,
        "foreign_format": FOREIGN_FORMAT_METRIC,
    }

    def __init__(self, context: TierContext, options: RedisTierOptions | None = None, /, **fields: Any) -> None:
        """Check the options (:class:`RedisTierOptions`), build the backend, start the I/O threads."""
        self.options = opts = tier_options(RedisTierOptions, self.tier_type, options, fields)
        self._read_rate = opts.min_read_mib_per_second * _MIB
        # A running batch is bounded by a connect, a few socket timeouts and one batch of replies
        # at the slowest read rate accepted (a load checks for shutdown between batches).
        super().__init__(
            context,
            breaker=CircuitBreaker(failure_threshold=opts.failure_threshold, open_seconds=opts.open_seconds),
            max_queued_stores=opts.max_queued_stores,
            shutdown_timeout=opts.connect_timeout + 4 * opts.socket_timeout + 2.0
            + opts.load_batch_mib * _MIB / self._read_rate,
        )
        self._value_bytes = HEADER_SIZE + context.block_bytes
        self._ns_digest = context.namespace.digest
        self._key_prefix = f"{opts.prefix}:{context.namespace.hexdigest}:".encode()
        self._px = b"%d" % max(1, round(opts.ttl_seconds * 1000)) if opts.ttl_seconds is not None else None
        self._set_encoder = SetEncoder(self._value_bytes, self._px)
        self._chunk = max(1, opts.load_batch_mib * _MIB // self._block_bytes)
        self._lookup_cache_seconds = opts.lookup_cache_seconds
        # A check that has not answered in this long is treated as a MISS.
        self._check_deadline = opts.socket_timeout + opts.connect_timeout + 0.5
        # The overall deadline of each redis-py call (a connection's setup: TCP connect, TLS
        # handshake, AUTH/SELECT/CLIENT SETNAME; PING; INFO memory; the cluster topology): a
        # connect, a socket timeout for the setup's replies and one for the command's, plus the
        # replies' bytes at the slowest rate accepted (socket_timeout bounds each receive only).
        self._call_seconds = opts.connect_timeout + 2 * opts.socket_timeout + _CONTROL_REPLY_BYTES / self._read_rate
        backend = ClusterBackend if opts.cluster else StandaloneBackend
        try:
            self._backend: RedisBackend = backend(
                opts.url, opts.socket_timeout, opts.connect_timeout, self._call_seconds
            )
        except ValueError as exc:
            raise ConfigError(f"redis url {redact_url(opts.url)!r} is invalid: {redact_url(str(exc))}") from None

        # Existence answers, guarded by _lock (held for dictionary operations only).
        self._known: dict[BlockKey, tuple[bool, float, bool]] = {}
        # SETs sent whose replies were never read, guarded by _lock: they may have landed.
        # Housekeeping checks them (see _settle_doubts).
        self._doubts: WritesInDoubt = self._keep_doubts(_MAX_DOUBTS, settle_after=opts.socket_timeout)
        self._usage = TierUsage(0, None)
        self._usage_at = float("-inf")
        self._need_refresh = False
        self._refusals_logged: dict[str, float] = {}  # error code -> when it was last logged
        self._usage_refused = False  # INFO refused (logged once)
        self._moved_logged = False  # a standalone tier answered MOVED/ASK: a cluster node (logged once)

        # Scheduler-thread only.
        self._pending_checks: dict[BlockKey, None] = {}
        self._touched: dict[BlockKey, None] = {}  # this step's touches, sent at its end

        try:
            self._start_workers(opts.io_threads, ALL_LANES, "io")
        except BaseException:  # the threads already started are joined, not left running
            self._shut_after_failed_start()
            raise

    # --- helpers -------------------------------------------------------------------

    def redis_key(self, key: BlockKey) -> bytes:
        """The Redis key of a block: ``<prefix>:<namespace hex>:<block key hex>``."""
        return self._key_prefix + key.hex().encode()

    def _remember(
        self, key: BlockKey, present: bool, now: float, answer: bool = False, settles: bool = True
    ) -> bool:
        """Cache ``key``'s existence; True if its SET was in doubt (a caller that found it present
        and does not announce it itself announces it: :meth:`_announce_found`). Caller holds
        _lock. Re-inserting keeps the dict ordered by expiry; ``answer`` marks the reply to a
        lookup's check, which that lookup consumes once; ``settles`` False: the answer says
        nothing of the key (a cluster's redirect), and a doubt of it stays."""
        doubted = settles and self._doubts.discard(key)  # (what was just learned is newer than the doubt)
        self._known.pop(key, None)
        self._known[key] = (present, now + self._lookup_cache_seconds, answer)
        return doubted

    def _unverify_locked(self, keys: Iterable[BlockKey]) -> None:
        # A GET that failed (timeout, dropped connection) says nothing about the value: its
        # cached HIT is dropped, so the next lookup checks it again (STRLEN). A missing or
        # corrupt value stays remembered as absent.
        known = self._known
        for key in keys:
            entry = known.get(key)
            if entry is not None and entry[0]:
                del known[key]

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
        """HIT/MISS from the answer cache, else RETRY while a batched STRLEN check is under way.

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
        """Hand this step's unknown keys to the I/O threads as batched STRLEN checks, and its
        touched keys as one batch of TTL refreshes."""
        if self._touched:
            self._send_touches()
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
        """With a TTL, refresh the expiry of ``keys`` (best effort): collected for the step, whose
        end sends each distinct key once, on an I/O thread."""
        if self._px is None or self._closed or not keys or not self._breaker.serving:
            return
        touched = self._touched
        touched.update(dict.fromkeys(keys))
        if len(touched) > _MAX_STEP_TOUCHES:
            over = len(touched) - _MAX_STEP_TOUCHES
            for key in list(itertools.islice(reversed(touched), over)):
                del touched[key]
            self._count(touches_dropped=over)

    def _send_touches(self) -> None:
        keys = list(self._touched)
        self._touched.clear()
        if self._closed or not self._breaker.serving:
            return
        if self._queue.queued(Lane.BACKGROUND) >= _MAX_QUEUED_TOUCHES:
            self._count(touches_dropped=len(keys))
            return
        self._queue_internal(Work(Lane.BACKGROUND, keys=keys))

    def usage(self) -> TierUsage:
        """Server memory from ``INFO memory`` (summed over cluster primaries), read by an I/O thread.

        ``used_bytes`` is the server's whole ``used_memory``; ``capacity_bytes``
        is ``maxmemory``, or None when the server has no limit. ``TierUsage(0, None)`` (unknown)
        when the server refuses ``INFO`` (an ACL user without it): not a tier failure.
        """
        return self._usage

    def store_location(self) -> str:
        """``redis:<scheme>://<host>:<port>/<db>/<prefix>`` (``redis:unix://<socket>/<db>/<prefix>``):
        no credentials or options; the database actually used (the path's or ``?db=``'s, 0 by
        default) and the port (6379 by default) always spelled out, so every spelling of one
        database gives one location. Give every engine the same host (in cluster mode the same node).

        A server only this machine reaches by that URL (a unix socket; a loopback or unspecified
        address, ``127.0.0.0/8``, ``::1``, ``0.0.0.0``, ``::``; ``localhost`` or no host) is each
        host's own: ``#host=<socket.gethostname()>`` is appended, so engines on two hosts each
        with a Redis at ``redis://127.0.0.1:6379`` are two stores, and one host's engines, one.
        (Engines of one host whose host names differ, containers sharing the host's network, are
        then told apart too: name the server by an address they share to make them one store.)"""
        ep = parse_endpoint(self.options.url, "redis url", _SCHEMES, needs_host=False)
        db = url_database(self.options.url)
        if ep.scheme == "unix":
            server = f"unix://{ep.path}"
        else:
            host = f"[{ep.host}]" if ":" in ep.host else ep.host
            server = f"{ep.scheme}://{host}:{ep.port or 6379}"
        location = f"redis:{server}/{db}/{self.options.prefix}"
        if ep.scheme == "unix" or host_local(ep.host):
            location += f"#host={socket.gethostname()}"
        return location

    def describe(self) -> dict[str, Any]:
        return {
            "type": self.tier_type,
            "medium": self.medium,
            **self.options.model_dump(mode="json"),
            "key_prefix": self._key_prefix.decode(),
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

    def _stop(self) -> None:
        """Shutdown (the thread calling it): cut the redis-py calls under way (a connection being
        set up, PING, INFO), so the I/O threads stop without waiting out their deadlines."""
        self._backend.stop()

    def _close(self) -> None:
        self._backend.close()

    def _probe(self) -> None:
        """PING; on success the cached answers are dropped (the server may have lost data)."""
        self._backend.ping()
        with self._lock:
            self._known.clear()

    def _settle_doubts(self, idle: bool) -> None:
        """One STRLEN pipeline over the SETs in doubt that are due
        (:class:`~kvtier.tiers.doubts.WritesInDoubt`: up to ``_DOUBTS_PER_TICK`` while the server
        answers, else one now and then from an ``idle`` worker, with no work in hand and none
        queued: :meth:`_idle_upkeep`): a value of a block's size there is remembered present and
        announced stored, so a fleet index holds what the server holds; anything else (no value,
        another size, an error reply) is forgotten. Keys a failed pipeline left unanswered, or a
        cluster redirected (asked again after the topology refresh), stay in doubt for a later
        tick; a doubt a SET, GET or check settled meanwhile is not announced again. Housekeeping
        (I/O thread); bounded by the pipeline's socket timeouts."""
        answering, now = self._breaker.answering, time.monotonic()
        with self._lock:
            keys = self._doubts.due(now, _DOUBTS_PER_TICK if answering else 1)
            if not keys or not self._doubts.may_check(answering, idle, now):
                return
        answers, redirected = self._sizes_match(keys)
        found: list[BlockKey] = []
        now = time.monotonic()
        with self._lock:
            for i, key in enumerate(keys):
                if i not in answers or key not in self._doubts:
                    continue
                if i in redirected and self.options.cluster:  # asked again after the topology refresh
                    self._doubts.add([key], now)  # (a standalone tier never follows one: absent, never re-sent)
                elif self._remember(key, answers[i], now) and answers[i]:
                    found.append(key)
        self._announce_found(found)

    def _housekeeping(self) -> None:
        if not self._breaker.serving:
            return
        if self._doubts:
            self._settle_doubts(idle=False)
        if self._need_refresh:
            self._need_refresh = False
            self._guarded(self._backend.refresh)
        now = time.monotonic()
        if now - self._usage_at >= self.options.usage_refresh_seconds:
            self._usage_at = now
            memory = self._guarded(self._read_usage)
            if memory is not None:
                self._usage = TierUsage(memory[0], memory[1])
        with self._lock:
            self._prune_known(now)

    def _read_usage(self) -> tuple[int, int | None] | None:
        """``INFO memory``, or None when the server answers it with an error: usage is optional, so
        that is logged once and leaves the capacity unknown, never a tier failure. Only an ACL
        refusal (``NOPERM``: a user without ``INFO``) gets the hint to grant ``+info``; any other
        error says what the server answered (and, for a database it does not have, which one the
        URL names: :meth:`_response_hint`). Housekeeping (I/O thread); bounded by the call deadline."""
        try:
            memory = self._backend.info_memory()
        except ResponseError as exc:
            self._usage = TierUsage(0, None)
            if self._usage_refused:
                forget_frames(exc)
            else:
                self._usage_refused = True
                if isinstance(exc, NoPermissionError) or str(exc).startswith("NOPERM"):
                    what = "INFO memory is refused (give the URL's ACL user +info)"
                else:
                    what = "INFO memory failed" + self._response_hint(exc)
                log_failure(logger, logging.WARNING, f"redis tier {self.label}: usage() is unknown: {what}", exc)
            return None
        self._usage_refused = False
        return memory

    def _response_hint(self, exc: BaseException) -> str:
        """What to do about an error reply redis-py raised that the server's words leave unclear:
        for ``DB index is out of range`` (a ``SELECT`` at connection setup), the database the URL
        names and that the server has fewer; else an empty string."""
        if isinstance(exc, ResponseError) and "DB index is out of range" in str(exc):
            db = url_database(self.options.url)
            return (f" (the URL names database {db}, and the server has fewer databases: its 'databases' "
                    f"setting, 16 by default, must exceed {db}, or name a lower database)")  # fmt: skip
        return ""

    def _guarded(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as exc:
            self._record_error(exc)
            return None

    def _record_error(self, exc: BaseException) -> str:
        """Feed ``exc`` to the circuit breaker; called from ``except`` blocks on I/O threads."""
        if isinstance(exc, (_Stopped, CallStopped)):  # shutdown cut the batch short: nothing the server did
            return str(exc)
        detail = describe_error(exc) + self._response_hint(exc)
        if isinstance(exc, (TimeoutError, RedisTimeoutError)):
            self._breaker.record_failure(detail)
        elif _is_refused(exc):
            self._breaker.trip(detail)
        elif isinstance(exc, (OSError, RedisError, RedisClusterException)):
            self._breaker.record_failure(detail)
        else:
            self._breaker.record_failure(detail)
            log_failure(logger, logging.ERROR, f"redis tier {self.label}: unexpected error", exc, with_traceback=True)
        forget_frames(exc)
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
        rate, stopping = self._read_rate, self._stopping
        for pool, indexes in self._backend.groups(rkeys):
            conn = self._backend.connection(pool)  # (set up within the call deadline)
            clean = False
            try:
                sock = conn._sock
                # A TLS socket cannot gather pieces in one call: there the small tail waits to be
                # joined with the next command's head instead of costing a TLS record of its own.
                keep_tail = isinstance(sock, ssl.SSLSocket)
                pieces: list[Piece] = []
                sent = 0
                # One deadline for the batch's sends, as for its replies: a socket timeout, plus each
                # value's bytes at the slowest rate accepted (a link that takes a value within every
                # socket timeout, but slower than that, no longer holds the thread for as long as
                # the job has values); shutdown stops it between sends.
                deadline = time.monotonic() + self.options.socket_timeout
                for i in indexes:
                    send(pieces, i)
                    if len(pieces) >= 256 or any(isinstance(p, memoryview) for p in pieces[-3:]):
                        if stopping.is_set():
                            raise _Stopped("redis tier is shutting down")
                        out = pieces[:-1] if keep_tail else pieces
                        size = _size(out)
                        sent += size
                        deadline += size / rate
                        send_pieces(sock, out, deadline=deadline)
                        del pieces[: len(out)]
                size = _size(pieces)
                sent += size
                send_pieces(sock, pieces, deadline=deadline + size / rate)
                # The kernel may still be passing what was sent to the server (a slow uplink):
                # the replies' deadline gives those bytes their time too (RespReader's sent). What
                # can still be on its way is bounded by the socket buffers (a few MiB), so the
                # allowance is capped at load_batch_mib, which shutdown_timeout already counts.
                reader = RespReader(
                    sock, timeout=self.options.socket_timeout, bytes_per_second=self._read_rate,
                    sent=min(sent, self.options.load_batch_mib * _MIB),
                )  # fmt: skip
                for i in indexes:
                    receive(reader, i)
                clean = True
            finally:
                if not clean:
                    conn.disconnect()
                pool.release(conn)

    def _note_reply_error(self, reply: ErrorReply, refusals: list[str], writing: bool = False) -> None:
        """A redirect asks for a topology refresh (and, to a tier not in cluster mode, which never
        follows one, is logged once: the server is a cluster node, so ``cluster: true`` is missing);
        an error reply that is not about the one key (see :func:`refused_by_server`) is added to
        ``refusals``."""
        if reply.is_redirect:
            self._need_refresh = True
            if not self.options.cluster and not self._moved_logged and reply.message.startswith(("MOVED ", "ASK ")):
                # A standalone tier never follows a redirect: the keys other nodes serve fail, every time.
                self._moved_logged = True
                logger.warning("redis tier %s: the server answered %r: it is a Redis Cluster node, and the keys "
                               "other nodes serve fail to store and load; set cluster: true", self.label,
                               reply.message)  # fmt: skip
        if refused_by_server(reply, writing):
            refusals.append(reply.message)

    def _record_outcome(self, refusals: list[str], command: str) -> None:
        """After a pipeline that did not raise: a breaker failure if the server refused a command
        (each error code logged at most once a minute), else a success."""
        if not refusals:
            self._breaker.record_success()
            return
        detail = f"{command} answered {refusals[0]!r}"
        self._breaker.record_failure(detail)
        code, now = refusals[0].split(" ", 1)[0], time.monotonic()
        if now - self._refusals_logged.get(code, -_REFUSAL_LOG_SECONDS) >= _REFUSAL_LOG_SECONDS:
            self._refusals_logged[code] = now
            hint = _REFUSAL_HINTS.get(code, "the server refuses this client; counted as a tier failure")
            logger.warning("redis tier %s: %s (%s)", self.label, detail, hint)
        if not self._breaker.serving:
            logger.warning("redis tier %s out of service: %s", self.label, detail)

    def _note_write_refusal(self, reply: ErrorReply) -> None:
        """A store refused by a server that refuses writes only (see :data:`_WRITE_REFUSAL_HINTS`):
        the store fails (``stores_failed``), the tier keeps serving; logged once a minute per code."""
        code = reply.message.split(" ", 1)[0]
        hint = _WRITE_REFUSAL_HINTS.get(code)
        if hint is None:
            return
        now, logged = time.monotonic(), f"SET {code}"
        with self._lock:
            if now - self._refusals_logged.get(logged, -_REFUSAL_LOG_SECONDS) < _REFUSAL_LOG_SECONDS:
                return
            self._refusals_logged[logged] = now
        logger.warning("redis tier %s: SET answered %r (%s)", self.label, reply.message, hint)

    def _sizes_match(self, keys: list[BlockKey]) -> tuple[dict[int, bool], set[int]]:
        """One STRLEN pipeline: for each answered position of ``keys``, whether the server holds a
        value of a block's exact size there (0 for a missing key; another type is a WRONGTYPE
        error reply: False, never deleted; every error reply is False), and the positions
        answered with a redirect. A failed pipeline counts against the breaker and leaves the
        rest unanswered. I/O thread."""
        rkeys = [self.redis_key(k) for k in keys]
        answers: dict[int, bool] = {}
        redirected: set[int] = set()
        refusals: list[str] = []

        def send(out: list[Piece], i: int) -> None:
            pack_command(out, b"STRLEN", rkeys[i])

        def receive(reader: RespReader, i: int) -> None:
            reply = reader.read_reply()
            if isinstance(reply, ErrorReply):
                self._note_reply_error(reply, refusals)
                if reply.is_redirect:
                    redirected.add(i)
            answers[i] = isinstance(reply, int) and reply == self._value_bytes

        try:
            self._pipeline(rkeys, send, receive)
        except Exception as exc:
            self._record_error(exc)
        else:
            self._record_outcome(refusals, "STRLEN")
        return answers, redirected

    def _do_exists(self, keys: list[BlockKey]) -> None:
        if not self._breaker.serving:
            with self._lock:
                for key in keys:
                    self._checking.pop(key, None)
            return
        answers, redirected = self._sizes_match(keys)
        now = time.monotonic()
        found: list[BlockKey] = []
        with self._lock:
            for i, key in enumerate(keys):
                self._checking.pop(key, None)
                if i in answers:  # (an error reply is a MISS: the lookup gets its answer, not RETRY forever)
                    # A redirected key is asked again after the topology refresh: its MISS is not
                    # cached, and a write of it in doubt stays in doubt (_settle_doubts asks again).
                    moved = i in redirected
                    at = now - self._lookup_cache_seconds if moved else now
                    settles = not (moved and self.options.cluster)  # (as in _settle_doubts)
                    if self._remember(key, answers[i], at, answer=True, settles=settles) and answers[i]:
                        found.append(key)
        self._announce_found(found)

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

            answered = [False] * len(keys)

            def receive(reader: RespReader, i: int) -> None:
                reply = reader.read_reply()
                answered[i] = True
                if isinstance(reply, ErrorReply):
                    self._note_reply_error(reply, refusals, writing=True)
                    self._note_write_refusal(reply)
                    errors.append(reply.message)
                else:
                    ok[i] = True

            refusals: list[str] = []
            try:
                self._pipeline(rkeys, send, receive)
            except Exception as exc:
                errors.append(self._record_error(exc))
                # A SET whose reply was never read may have landed (or another server group's
                # batch may have ended before this one): checked later, by _settle_doubts.
                with self._lock:
                    self._doubts.add((k for k, seen in zip(keys, answered, strict=True) if not seen), time.monotonic())
            else:
                self._record_outcome(refusals, "SET")
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
        corrupt: dict[BlockKey, tuple[int, bytes, bytes]] = {}  # what was read: see _delete
        foreign: list[BlockKey] = []  # another release's values: not served, never deleted
        errors: list[str] = []
        refusals: list[str] = []  # a chunk's error replies that count against the server
        header = bytearray(HEADER_SIZE)
        head_view = memoryview(header)
        asked = time.time()  # a key found missing was gone by then
        started = time.perf_counter()
        for base in range(0, len(keys), self._chunk):
            if self._stopping.is_set():
                errors.append("redis tier is shutting down")
                break
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
                    self._note_reply_error(reply, refusals)
                    errors.append(reply.message)
                elif reply != self._value_bytes:
                    version = foreign_format(head_view[: min(reply, PREFIX_SIZE)])
                    if version is not None:  # another release's layout may have another size
                        logger.warning("redis tier %s: value of %s is in format version %s of another release; "
                                       "left in place", self.label, key.hex(), version)  # fmt: skip
                        foreign.append(key)
                    else:
                        logger.warning("redis tier %s: value of %s has %d bytes, expected %d; deleting it",
                                       self.label, key.hex(), reply, self._value_bytes)  # fmt: skip
                        corrupt[key] = (reply, b"", bytes(head_view[: min(reply, HEADER_SIZE)]))
                else:
                    what = f"redis tier {self.label}: value of {key.hex()} is corrupt; deleting it"
                    try:
                        parsed = decode_header(
                            head_view, namespace=self._ns_digest, key=key, payload_len=self._block_bytes
                        )
                    except ForeignFormatError as exc:
                        what = f"redis tier {self.label}: value of {key.hex()} is not served; left in place"
                        log_failure(logger, logging.WARNING, what, exc)
                        foreign.append(key)
                        return
                    except CorruptValueError as exc:  # the header alone condemns it: see _delete
                        log_failure(logger, logging.WARNING, what, exc)
                        corrupt[key] = (reply, b"", bytes(head_view))
                        return
                    try:
                        verify_payload(parsed, body)
                    except CorruptValueError as exc:  # only the whole value identifies it: see _delete
                        log_failure(logger, logging.WARNING, what, exc)
                        digest = hashlib.sha1(head_view, usedforsecurity=False)
                        digest.update(body)
                        corrupt[key] = (reply, digest.digest(), b"")
                    else:
                        loaded.append(key)

            try:
                self._pipeline(rkeys, send, receive)
            except Exception as exc:
                closed = isinstance(exc, ConnectionResetError) and len(chunk) > 1
                errors.append(self._record_error(exc))
                if closed:  # the usual cause when it happens on every multi-value load
                    limit = self.options.load_batch_mib
                    errors.append(f"if the server sets a client-output-buffer-limit for normal clients, "
                                  f"it must exceed load_batch_mib ({limit} MiB), or lower that")  # fmt: skip
                break
            self._record_outcome(refusals, "GET")
            refusals.clear()
        seconds = time.perf_counter() - started
        deleting = time.time()
        deleted, rewritten = self._delete(corrupt) if corrupt else ([], [])
        kept = set(rewritten)
        gone = [key for key in corrupt if key not in kept]  # deleted, or left but never servable
        now = time.monotonic()
        with self._lock:
            found = [key for key in loaded if self._remember(key, True, now)]
            for key in missing + gone + foreign:
                self._remember(key, False, now)
            for key in rewritten:  # another engine's value now: asked again
                self._known.pop(key, None)
            if gone:
                self._events.append(BlockEvent(tuple(gone), self.label, self.medium, True, deleting))
            if missing:  # expired or evicted by Redis itself: nobody else can report it
                self._events.append(BlockEvent(tuple(missing), self.label, self.medium, True, asked))
        self._announce_found(found)
        if missing:
            errors.append(f"{len(missing)} key(s) missing (expired or evicted)")
        if deleted:
            errors.append(f"{len(deleted)} corrupt value(s) deleted")
        if len(deleted) < len(corrupt):
            left = len(corrupt) - len(deleted)
            errors.append(f"{left} corrupt value(s) not deleted ({len(rewritten)} rewritten since)")
        if foreign:
            errors.append(f"{len(foreign)} value(s) in another release's format (kept)")
        with self._stats_lock:
            self.stats.bytes_read += len(loaded) * self._value_bytes
            self.stats.seconds_reading += seconds
            self.stats.corrupt_values += len(corrupt)
            if foreign:
                self.stats.extra["foreign_format"] = self.stats.extra.get("foreign_format", 0) + len(foreign)
            self.stats.loads_failed += len(keys) - len(loaded)
        self._finish(self._result(job, loaded, len(loaded) * self._value_bytes, seconds, errors))

    def _delete(self, corrupt: Mapping[BlockKey, tuple[int, bytes, bytes]]) -> tuple[list[BlockKey], list[BlockKey]]:
        """Delete each corrupt value only if it is still the one read, so a valid value another engine
        wrote since is never removed, at a cost to the server that does not grow with the value.

        ``corrupt`` maps a key to ``(length, b"", first bytes)`` when the value is condemned by its
        length or its header, else ``(length, SHA-1 of the whole value, b"")`` (its header is valid,
        its payload does not match the header's checksum). Returns ``(deleted, rewritten since)``;
        a key in neither is left by an error (logged), e.g. an ACL without EVAL, WATCH, MULTI or
        EXEC. Best effort: a failure is a breaker failure, not raised.

        Why each rule is safe (whether a value is valid depends on its bytes alone: a valid value is
        ``HEADER_SIZE + block_bytes`` long, its header is valid for this tier's namespace, this key
        and that payload length, and its payload matches the header's checksum):

        * Another length, or an invalid header: one script (:data:`_DELETE_IF_UNCHANGED`) deletes the
          key if it still has that length and starts with the same bytes (all the bytes kept, up to
          the header). A value of another length is never valid, and its first bytes (they include
          the format prefix) show it is not another release's either; a header judged invalid (or
          corrupt, not foreign) is judged so by its bytes alone, and every value starting with the
          same header bytes is judged the same. So whatever value the script finds then is invalid
          too, and the script is atomic. It reads at most ``HEADER_SIZE`` bytes of the value.
        * A valid header and a payload that does not match it: a valid value of the same key (another
          engine's rewrite) may have this very header and differ in a single payload byte, so no
          bounded part of the value tells them apart: only the whole value does. It is compared on the
          client, never hashed by the server: ``WATCH key`` / ``GET key`` / ``MULTI``, then, if the GET
          returned the very bytes read (same length and SHA-1), ``DEL key`` / ``EXEC``, else an empty
          ``EXEC``. ``EXEC`` runs the DEL only if nothing wrote the key since the ``WATCH`` (else it
          is aborted: rewritten), so the value deleted is the one the GET returned, which is the
          corrupt one read. The server's work per command is a GET (what a load does) or O(1):
          no script copies or hashes the value, and other clients are served between commands.
          ``DEL`` is sent only after ``MULTI`` was answered OK (a refused MULTI would run it at once).

        Each round trip has the deadline of a batch of replies: ``socket_timeout`` plus the bytes the
        server sends back at ``min_read_mib_per_second``; the values are taken one at a time and the
        loop stops when the tier shuts down.
        """
        keys = list(corrupt)
        rkeys = [self.redis_key(k) for k in keys]
        replies: dict[int, object] = {}
        by_prefix = [i for i, k in enumerate(keys) if not corrupt[k][1]]
        whole = [i for i, k in enumerate(keys) if corrupt[k][1]]

        def send(out: list[Piece], j: int) -> None:
            i = by_prefix[j]
            length, _, head = corrupt[keys[i]]
            pack_command(out, b"EVAL", _DELETE_IF_UNCHANGED, b"1", rkeys[i], b"%d" % length, head)

        def receive(reader: RespReader, j: int) -> None:
            replies[by_prefix[j]] = reader.read_reply()

        try:
            if by_prefix:
                self._pipeline([rkeys[i] for i in by_prefix], send, receive)
            if whole:
                self._delete_whole([rkeys[i] for i in whole], [corrupt[keys[i]] for i in whole],
                                   lambda j, reply: replies.__setitem__(whole[j], reply))  # fmt: skip
        except Exception as exc:
            self._record_error(exc)
        deleted = [k for i, k in enumerate(keys) if replies.get(i) == 1]
        rewritten = [k for i, k in enumerate(keys) if replies.get(i) == 0]
        refused = [r.message for r in replies.values() if isinstance(r, ErrorReply)]
        if refused:
            logger.warning("redis tier %s: %d corrupt value(s) left in place: the server answered %r (the "
                           "delete needs EVAL GETRANGE DEL WATCH MULTI EXEC)", self.label, len(refused),
                           refused[0])  # fmt: skip
        return deleted, rewritten

    def _delete_whole(
        self, rkeys: list[bytes], read: list[tuple[int, bytes, bytes]], answer: Callable[[int, object], None]
    ) -> None:
        """The WATCH/GET/MULTI/EXEC rule of :meth:`_delete`, one value at a time: ``answer(j, 1)``
        deleted, ``answer(j, 0)`` not (rewritten or gone since), ``answer(j, ErrorReply)`` refused."""
        timeout, rate = self.options.socket_timeout, self._read_rate
        for pool, indexes in self._backend.groups(rkeys):
            conn = self._backend.connection(pool)  # (set up within the call deadline)
            clean = False
            try:
                sock = conn._sock
                for j in indexes:
                    if self._stopping.is_set():
                        break
                    length, digest, _ = read[j]
                    out: list[Piece] = []
                    pack_command(out, b"WATCH", rkeys[j])
                    pack_command(out, b"GET", rkeys[j])
                    pack_command(out, b"MULTI")
                    send_pieces(sock, out)
                    reader = RespReader(sock, timeout=timeout, bytes_per_second=rate)
                    watched = reader.read_reply()
                    hasher = hashlib.sha1(usedforsecurity=False)
                    got = reader.read_bulk_chunks(hasher.update)
                    multi = reader.read_reply()
                    errors = [r for r in (watched, got, multi) if isinstance(r, ErrorReply)]
                    if any(r.is_redirect for r in errors):
                        self._need_refresh = True
                    if isinstance(multi, ErrorReply):
                        answer(j, multi)
                        if not isinstance(watched, ErrorReply):
                            return  # the connection keeps a WATCH: dropped below, not pooled
                        continue
                    same = not errors and got == length and hasher.digest() == digest
                    out = []
                    if same:
                        pack_command(out, b"DEL", rkeys[j])
                    pack_command(out, b"EXEC")
                    send_pieces(sock, out)
                    reader = RespReader(sock, timeout=timeout, bytes_per_second=rate)
                    queued = reader.read_reply() if same else None
                    done = reader.read_array()
                    if errors:
                        answer(j, errors[0])
                    elif isinstance(queued, ErrorReply):
                        answer(j, queued)
                    elif isinstance(done, ErrorReply):
                        answer(j, done)
                    else:  # not the value read, aborted by a write since the WATCH, or deleted
                        answer(j, 1 if same and done == [1] else 0)
                clean = True
            finally:
                if not clean:
                    conn.disconnect()
                pool.release(conn)

    def _do_touch(self, keys: list[BlockKey]) -> None:
        """Refresh the TTL of a step's touched keys, but only of values proven to be this tier's:
        best effort (I/O thread, the background lane; a failure counts against the breaker and
        is not retried).

        ``PEXPIRE`` alone would give an expiry to whatever lives under a block's key name: a
        list or hash of another application, a string of another length, a value in another
        release's format, all of which the tier leaves alone (a MISS, never deleted), and Redis
        would then delete them. So a first pipelined round trip asks ``STRLEN`` and ``GETRANGE
        key 0 127`` (the header) of each key, and a second sends ``PEXPIRE`` to those whose value
        has a block's length and a header :func:`~kvtier.tiers.format.decode_header` accepts for
        this namespace, this key and a block's payload (a format version this release reads).
        Cost per key: two O(1) commands and 128 bytes back (no value is read whole, no script
        runs, so no ACL for ``EVAL`` is needed), one header check on this thread, then one
        ``PEXPIRE``: two round trips per batch. A value another client replaces between the two
        round trips (a few milliseconds) would get the expiry: values written under the tier's
        key names by others are not expected there."""
        if self._px is None or not self._breaker.serving:
            return
        ours = self._own_values(keys)
        if ours and self._breaker.serving:
            self._best_effort(b"PEXPIRE", ours, self._px)

    def _own_values(self, keys: list[BlockKey]) -> list[BlockKey]:
        """The keys whose value is this tier's (a block's length, a header valid for this
        namespace and key): one ``STRLEN`` + ``GETRANGE`` pipeline (see :meth:`_do_touch`); an
        error reply (``WRONGTYPE`` for another type) is not ours, and a refusal of the client
        counts against the breaker, as a failed pipeline does (nothing is ours then). I/O thread."""
        rkeys = [self.redis_key(k) for k in keys]
        last = b"%d" % (HEADER_SIZE - 1)
        ours: list[BlockKey] = []
        refusals: list[str] = []

        def send(out: list[Piece], i: int) -> None:
            pack_command(out, b"STRLEN", rkeys[i])
            pack_command(out, b"GETRANGE", rkeys[i], b"0", last)

        def receive(reader: RespReader, i: int) -> None:
            length, head = reader.read_reply(), reader.read_reply()
            for reply in (length, head):
                if isinstance(reply, ErrorReply):
                    self._note_reply_error(reply, refusals)
            if isinstance(length, int) and length == self._value_bytes and isinstance(head, bytes):
                try:
                    decode_header(head, namespace=self._ns_digest, key=keys[i], payload_len=self._block_bytes)
                except (CorruptValueError, ForeignFormatError):
                    return
                ours.append(keys[i])

        try:
            self._pipeline(rkeys, send, receive)
        except Exception as exc:
            self._record_error(exc)
            return []
        self._record_outcome(refusals, "GETRANGE")
        return ours

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
