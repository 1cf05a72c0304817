"""The S3 tier: KV blocks in an S3-compatible object store, shared by a fleet of engines.

Configured as ``{"type": "s3", "bucket": "kv", "endpoint": "https://minio:9000", ...}``;
the options, their defaults and the bucket layout are in :mod:`kvtier.tiers.s3_store`
(:class:`~kvtier.tiers.s3_store.S3TierOptions`). Client: obstore.

* **Stores**: one plain PUT per block, straight from the pinned CPU row (the
  128-byte header and a view of the row as one body: no join, no multipart),
  up to ``max_in_flight`` at once. Stores queue behind loads and are shed
  (``stats.stores_dropped``) beyond ``max_queued_stores`` or while out of
  service; a quarter of the threads never take stores, so reads do not wait
  behind a slow upload. An upload failure fails the job; it never raises into
  the engine. An upload whose outcome is unknown (timed out, a server error)
  may have landed: housekeeping HEADs it (:mod:`kvtier.tiers.doubts`), and one
  found there, or found by a lookup or a load first, is announced in the tier's
  events then (``uploads_found``), so a fleet index holds what the bucket holds.
* **Loads**: concurrent GETs streamed into the reserved row (header split from
  the payload), then header and xxh3 checksum verified before the key counts
  as loaded. A 404 is a MISS for that key (it drops the key from the index and is
  reported removed in the tier's events: a lifecycle rule deleted it);
  a wrong length, header or checksum is a MISS too, is counted in
  ``stats.corrupt_values``, and the object is deleted (obstore sends a
  multi-object delete, ``POST ?delete``, naming it); an object in a format
  version of another release (kvtier's magic, a version this one cannot read)
  is a MISS counted in ``foreign_format`` and left in place.
* **Existence**: answered from an in-memory index of what this process stored,
  loaded or checked: present keys answer HIT for ``hit_seconds``, absent keys
  MISS for ``miss_seconds`` (other engines write too). Unknown keys answer
  RETRY and go out at step end as one batch of concurrent HEADs with a
  deadline (``check_timeout``), stopping a request's chain of keys at its
  first 404; a HEAD still unanswered 40 % of the deadline after its window of
  HEADs went out is sent a second time if a HEAD thread is idle (a hedge: the
  first answer wins, so one lost request costs that long, not the deadline);
  a check that fails or misses its deadline counts as absent. At most
  half the I/O threads run batches (later steps' keys join one deferred batch),
  and keys whose lookups already answered MISS are dropped unchecked, so slow
  HEADs never pile up ahead of loads. With ``max_in_flight`` 1 the one I/O
  thread serves both: a batch then goes out only while no load is queued (it
  waits as the deferred batch, sent at a later step end or batch end).
  ``warm_start`` fills the index by listing the namespace in the background.
* **Manifest**: ``<prefix>/<namespace>/manifest.json`` is created or checked
  before the tier serves (a manifest of another layout or block size keeps it
  out of service, with the reason in ``health().detail``); until then lookups
  answer RETRY for about ``check_timeout`` seconds, then MISS.
* **Failures**: the data client retries with backoff and jitter within the time
  the job has left less ``request_timeout`` (work started late gets a client with
  a smaller retry budget, the last one attempt only, ending at most
  ``request_timeout`` past the deadline); refused connections open the breaker at
  once, timeouts, 5xx and SlowDown storms after ``failure_threshold`` in a
  row. While open, lookups answer MISS, stores are dropped, loads fail at once;
  a probe (the manifest check) brings the tier back, with a fresh index.
* **Usage**: the bytes this process uploaded (the bucket's total is not known;
  capacity is unbounded). Expire old objects with a bucket lifecycle rule.

Threads: scheduler-side calls touch only memory (a lock held for microseconds
and a queue); every request runs on the tier's worker threads, a step's HEADs
on ``max_in_flight`` HEAD threads (:mod:`kvtier.tiers.s3_checks`: blocking
calls, so no obstore thread ever calls back into Python, and none can at exit).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import numpy as np

from kvtier.errors import ConfigError, CorruptValueError, ForeignFormatError, TierError
from kvtier.failures import forget_frames, log_failure
from kvtier.keys import BlockKey
from kvtier.tiers.base import (
    FOREIGN_FORMAT_METRIC,
    UPLOADS_FOUND_METRIC,
    WRITES_IN_DOUBT_METRIC,
    ExtraMetric,
    TierContext,
    TierUsage,
)
from kvtier.tiers.doubts import WritesInDoubt
from kvtier.tiers.format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    PREFIX_SIZE,
    decode_header,
    encode_header,
    foreign_format,
    older_readable_format,
    payload_hasher,
    verify_digest,
)
from kvtier.tiers.health import CircuitBreaker
from kvtier.tiers.jobs import ALL_LANES, READ_LANES, Lane, ThreadedTier, Work
from kvtier.tiers.options import tier_options
from kvtier.tiers.s3_checks import HEDGE_FRACTION, HeadFanout
from kvtier.tiers.s3_store import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    OUTCOME_UNKNOWN,
    TRIPPING,
    S3TierOptions,
    bounded_body,
    classify_error,
    conditional_write_unsupported,
    key_of_path,
    list_objects,
    manifest_dict,
    manifest_mismatch,
    namespace_prefix,
    object_path,
    open_store,
    parse_manifest,
    range_refused,
    short_error,
)
from kvtier.types import LookupResult, RequestContext

if TYPE_CHECKING:
    from obstore.store import S3Store

logger = logging.getLogger(__name__)

_STREAM_CHUNK = 1024 * 1024
_PRUNE_PER_TICK = 10_000
_MAX_DOUBTS = 4096
"""Uploads in doubt remembered at most (the oldest is dropped: its block is found by a lookup's HEAD)."""
_DOUBTS_PER_TICK = 8
"""Uploads in doubt HEADed per housekeeping tick, one after another."""


class S3Tier(ThreadedTier):
    """Blocks in an S3-compatible bucket; see the module docstring and :class:`S3TierOptions`."""

    tier_type = "s3"
    medium = "remote"
    options_model = S3TierOptions
    extra_metrics: ClassVar[Mapping[str, ExtraMetric]] = {
        **ThreadedTier.extra_metrics,
        "objects_written": ExtraMetric("counter", "Objects PUT into the bucket."),
        "create_conflicts": ExtraMetric(
            "counter", "create_only stores refused by an object under the block's name that is not the block (kept)."
        ),
        "checks": ExtraMetric("counter", "Existence checks (HEAD) of unknown keys."),
        "checks_failed": ExtraMetric("counter", "Existence checks that failed (counted against the breaker)."),
        "heads_hedged": ExtraMetric(
            "counter", "Existence checks (HEAD) sent a second time, unanswered 40 % of check_timeout after going out."
        ),
        "missing": ExtraMetric("counter", "Objects gone from the bucket when read."),
        "requests_retried": ExtraMetric(
            "counter", "GETs and PUTs that timed out and were sent again by the tier within their job's deadline."
        ),
        "warm_start_blocks": ExtraMetric("counter", "Blocks indexed from the manifest at start."),
        "uploads_found": UPLOADS_FOUND_METRIC,
        "writes_in_doubt": WRITES_IN_DOUBT_METRIC,
        "foreign_format": FOREIGN_FORMAT_METRIC,
    }

    def __init__(self, context: TierContext, options: S3TierOptions | None = None, /, **fields: Any) -> None:
        """Check the options (:class:`S3TierOptions`), open the clients, start the I/O threads
        (the manifest is checked on one of them)."""
        self.options = opts = tier_options(S3TierOptions, self.tier_type, options, fields)
        super().__init__(
            context,
            breaker=CircuitBreaker(failure_threshold=opts.failure_threshold, open_seconds=opts.open_seconds),
            max_queued_stores=opts.max_queued_stores,
            # A data worker may be inside one request with its retries (bounded by the job deadline),
            # a HEAD thread or a deletion inside one existence-check request (check_timeout).
            shutdown_timeout=max(opts.job_timeout + opts.request_timeout, opts.check_timeout) + 2.0,
            job_timeout=opts.job_timeout,
        )
        self._store: S3Store = open_store(opts)
        # Data clients by retry budget, largest first: work started late in its job's life gets one
        # whose retries still end by the deadline (the last, one attempt, ends within request_timeout).
        full = opts.job_timeout - opts.request_timeout
        self._by_budget: list[tuple[float, S3Store]] = [(full, self._store)] + [
            (budget, open_store(opts, retry_seconds=budget)) for budget in (full / 2, full / 4, 0.0)
        ]
        # Before, work taken up at once had a hair less than the full budget left and got half of it:
        # a request that timed out at request_timeout was never retried (defaults: 10 s of 10 s).
        self._start_grace = min(0.05 * full, opts.request_timeout)
        self._quick: S3Store = open_store(opts, quick=True)
        self._value_bytes = HEADER_SIZE + context.block_bytes
        self._digest = context.namespace.digest
        self._ns_prefix = namespace_prefix(opts.prefix, context.namespace.hexdigest)
        self._manifest_path = f"{self._ns_prefix}/{MANIFEST}"
        self._manifest = manifest_dict(self._digest, context.namespace.canonical(), context.block_bytes)
        self._ready = threading.Event()
        self._born = time.monotonic()
        self._manifest_lock = threading.Lock()
        self._manifest_checks = 0  # checks done (under _manifest_lock): a waiter takes the last one's result
        self._manifest_failed_at = float("-inf")  # a failed check is not redone for open_seconds (probes excepted)
        self._manifest_error: str | None = None
        self._warmed = False
        self._warm_done = threading.Event()  # the warm-start listing ended (however it ended)

        # The existence index, guarded by _lock: expiry times, each dict in expiry order.
        self._present: dict[BlockKey, float] = {}
        self._absent: dict[BlockKey, float] = {}
        # Scheduler thread only: this step's unknown keys, per request chain, in lookup order.
        self._chains: dict[object, list[BlockKey]] = {}
        self._pending: set[BlockKey] = set()
        # Existence batches out (queued or running), guarded by _lock: at most half the I/O threads,
        # so loads always find one; keys of steps that end meanwhile join one deferred batch. With a
        # single I/O thread (max_in_flight 1) that thread is the one loads need too: a batch then goes
        # out only while no load is queued, else it waits as the deferred batch (see _may_send_checks).
        self._checks_out = 0
        self._max_checks_out = max(1, opts.max_in_flight // 2)
        self._checks_may_fill_pool = self._max_checks_out >= opts.max_in_flight
        self._deferred: Work | None = None
        # Uploads that failed with their outcome unknown, guarded by _lock: a timed-out PUT may have
        # landed. Housekeeping HEADs them (see _settle_doubts).
        self._doubts: WritesInDoubt = self._keep_doubts(_MAX_DOUBTS, settle_after=opts.request_timeout)
        self.stats.extra.update({"objects_written": 0, "checks": 0, "checks_failed": 0, "missing": 0,
                                 "requests_retried": 0, "heads_hedged": 0, "uploads_found": 0})  # fmt: skip

        # The endpoint in use, read once: the client was built with it, whatever the environment says later.
        self._endpoint_setting = endpoint, source = opts.endpoint_setting()
        self._heads = HeadFanout(self._head, self._stopping)
        try:
            self._heads.start(opts.max_in_flight, self._start_thread)
            readers = opts.max_in_flight // 4 if opts.max_in_flight > 1 else 0
            if readers:
                self._start_workers(readers, READ_LANES, "read")
            self._start_workers(opts.max_in_flight - readers, ALL_LANES, "io")
        except BaseException:  # the threads already started are joined, not left running
            self._shut_after_failed_start()
            raise
        where = f"{endpoint} (from {source})" if endpoint else f"AWS {opts.region or '(region from AWS_REGION)'}"
        logger.info(
            "s3 tier %s: %s/%s via %s, %d requests in flight",
            self.label, opts.url(), context.namespace.hexdigest, where, opts.max_in_flight,
        )  # fmt: skip

    def object_path(self, key: BlockKey) -> str:
        """The object of a block: ``<prefix>/<namespace hex>/<2 hex>/<key hex>``."""
        return object_path(self._ns_prefix, key)

    # --- the existence index (any thread; callers hold no lock) --------------------------------

    def _remember(self, key: BlockKey, present: bool, now: float) -> bool:
        with self._lock:
            return self._remember_locked(key, present, now)

    def _remember_locked(self, key: BlockKey, present: bool, now: float) -> bool:
        """Remember ``key`` present or absent until ``now`` plus ``hit_seconds``/``miss_seconds``;
        True if its upload was in doubt (a caller that found it present and does not announce
        it itself announces it: :meth:`_announce_found`). Caller holds _lock."""
        # Also ends a check of the key under way, and a doubt about its upload: what a PUT or GET
        # just learned is newer.
        self._checking.pop(key, None)
        doubted = self._doubts.discard(key)
        self._present.pop(key, None)
        self._absent.pop(key, None)
        if present:
            self._present[key] = now + self.options.hit_seconds
        else:
            self._absent[key] = now + self.options.miss_seconds
        return doubted

    def _unverify_locked(self, keys: Iterable[BlockKey]) -> None:
        # A GET that failed (timeout, dropped connection, no bucket) says nothing about the
        # object: its HIT is no longer believed; the next lookup checks it again with a HEAD.
        # A missing or corrupt object was already remembered as absent.
        for key in keys:
            self._present.pop(key, None)

    def _answer(self, key: BlockKey, now: float) -> bool | None:
        """Caller holds _lock: True/False while an answer is fresh, else None."""
        until = self._present.get(key)
        if until is not None and until > now:
            return True
        until = self._absent.get(key)
        if until is not None and until > now:
            return False
        return None

    # --- scheduler thread ----------------------------------------------------------------------------

    def _lookup(self, key: BlockKey, request: RequestContext | None) -> LookupResult:
        """HIT/MISS from the index; RETRY for unknown keys (checked at step end) and before the manifest check."""
        now = time.monotonic()
        if not self._ready.is_set():
            # Before the manifest check: wait a little for it, then recompute rather than wait.
            return LookupResult.RETRY if now - self._born < self.options.check_timeout + 1.0 else LookupResult.MISS
        with self._lock:
            answer = self._answer(key, now)
            since = self._checking.get(key)
        if answer is not None:
            return LookupResult.HIT if answer else LookupResult.MISS
        if since is not None:
            return LookupResult.MISS if now - since > self.options.check_timeout + 1.0 else LookupResult.RETRY
        if key not in self._pending:
            self._pending.add(key)
            chain = request.req_id if request is not None else object()
            self._chains.setdefault(chain, []).append(key)
        return LookupResult.RETRY

    def on_schedule_end(self) -> None:
        """Send this step's unknown keys to an I/O thread as one batch of concurrent HEADs (with the
        deferred batch's, if any), or add them to the deferred batch while no batch may go out."""
        if not self._chains and self._deferred is None:
            return
        chains = list(self._chains.values())
        self._chains = {}
        self._pending = set()
        if self._closed or not self._breaker.serving:
            return
        keys = [k for chain in chains for k in chain]
        now = time.monotonic()
        with self._lock:
            for key in keys:
                self._checking[key] = now
            if self._deferred is not None:  # a batch already waits for a free slot: these keys join it
                self._deferred.keys.extend(keys)
                self._deferred.payload.extend(chains)
            elif keys:
                self._deferred = Work(Lane.EXISTS, keys=keys, payload=chains)
            if self._deferred is None or not self._may_send_checks():
                return
            work, self._deferred = self._deferred, None
            self._checks_out += 1
        self._send_checks(work)

    def _may_send_checks(self) -> bool:
        """Whether a batch may go out now (under _lock): a slot is free and, where batches could
        take every I/O thread, no load waits (``WorkQueue`` serves checks first, so a batch queued
        beside a load would run before it, and with new keys every step the load never would)."""
        if self._checks_out >= self._max_checks_out:
            return False
        return not (self._checks_may_fill_pool and self._queue.queued(Lane.LOAD))

    def _send_checks(self, work: Work) -> None:
        """Queue a batch of existence checks already counted in ``_checks_out``."""
        if not self._queue_internal(work):
            self._forget_checks(work.keys)
            with self._lock:
                self._checks_out -= 1

    def _holds(self, key: BlockKey) -> bool:
        with self._lock:
            return self._answer(key, time.monotonic()) is True

    # --- what this engine knows the bucket holds, for its event stream (kvtier.engine_events) ---------

    lists_holdings = True

    def held_keys(self) -> list[BlockKey] | None:
        """The keys the existence index answers HIT for: what this engine stored, loaded or
        found by a HEAD within ``hit_seconds``, and what a ``warm_start`` listed (None while that
        listing is under way). Never the whole bucket (:meth:`holdings_complete` is False): a
        fleet index that lost this engine's events gets its stores back from a snapshot. A copy
        under the lock; scheduler thread."""
        if self.options.warm_start and not self._warm_done.is_set():
            return None
        now = time.monotonic()
        with self._lock:
            return [key for key, until in self._present.items() if until > now]

    def holds(self, key: BlockKey) -> bool:
        return self._holds(key)

    def usage(self) -> TierUsage:
        """The bytes this process uploaded (the bucket's total is unknown; capacity unbounded)."""
        return TierUsage(self.stats.bytes_written, None, int(self.stats.extra["objects_written"]))

    def store_location(self) -> str:
        """``s3:<endpoint in use, or aws>/<bucket>/<prefix>``: the same for every engine that reaches
        the store, whether its endpoint comes from the option or from ``AWS_ENDPOINT_URL*``."""
        return f"s3:{self._endpoint_setting[0] or 'aws'}/{self.options.bucket}/{self.options.prefix}"

    def describe(self) -> dict[str, Any]:
        return {
            "type": self.tier_type,
            "medium": self.medium,
            **self.options.model_dump(mode="json"),
            "endpoint": self._endpoint_setting[0],
            "endpoint_from": self._endpoint_setting[1],
            "namespace_prefix": self._ns_prefix,
            "path_style": self.options.uses_path_style,
            "allow_http": self.options.uses_http,
            "ready": self._ready.is_set(),
            "health": self._breaker.state.value,
        }

    # --- worker threads ---------------------------------------------------------------------------

    def _run(self, work: Work, local: Any) -> None:
        if work.lane is Lane.EXISTS:
            self._check(work)
        elif work.lane is Lane.LOAD:
            self._load(work)
        elif work.lane is Lane.STORE:
            self._put(work)
        else:
            self._warm_start()

    def _stop(self) -> None:
        self._heads.stop()

    def _forget_checks(self, keys: list[BlockKey]) -> None:
        with self._lock:
            for key in keys:
                self._checking.pop(key, None)

    def _io_failure(self, exc: BaseException) -> str:
        """Feed a request failure to the breaker (one that retrying soon cannot help, such as a
        refused connection or a missing bucket, opens it at once); returns its one-line text."""
        kind = classify_error(exc)
        detail = short_error(exc)
        self._note_failure(detail, trip=kind in TRIPPING)
        forget_frames(exc)
        return detail

    def _put(self, work: Work) -> None:
        import obstore as obs
        from obstore.exceptions import AlreadyExistsError

        key = work.keys[0]
        if not self._ensure_ready():
            self._complete(work, error=f"not in service: {self._breaker.health().detail}", dropped=True)
            return
        row = self._row(work.slots[0])
        existing = in_doubt = False  # in_doubt: an attempt failed with its outcome unknown (it may have landed)
        try:
            header = encode_header(self._digest, key, row)
            while True:
                try:
                    obs.put(
                        self._data_client(work),
                        self.object_path(key),
                        [header, row],
                        use_multipart=False,
                        mode="create" if self.options.create_only else "overwrite",
                    )
                    break
                except AlreadyExistsError as exc:  # create_only: another engine stored it, or something else is there
                    forget_frames(exc)
                    existing = True  # (also where an upload that timed out had landed: then it is ours)
                    break
                except Exception as exc:
                    in_doubt = in_doubt or classify_error(exc) in OUTCOME_UNKNOWN
                    if self._tried_again(work, exc):
                        continue
                    if in_doubt:  # (an earlier attempt's too: a retry refused after a timeout proves nothing)
                        with self._lock:
                            self._doubts.add([key], time.monotonic())
                    self._complete(work, error=f"upload of {key.hex()[:16]} failed: {self._io_failure(exc)}")
                    return
        finally:
            row.release()
        if existing:  # (the row is no longer pinned while the object there is read)
            self._put_found_existing(work, key)
            return
        self._breaker.record_success()
        self._remember(key, True, time.monotonic())
        self._count(objects_written=1)
        self._emit([key], removed=False)
        self._complete(work, ok=[key], nbytes=self._value_bytes)

    def _load(self, work: Work) -> None:
        key = work.keys[0]
        path = self.object_path(key)
        header = bytearray(HEADER_SIZE)
        rows = self._rows
        if rows is None:
            raise TierError(f"s3 tier {self.label}: CPU rows were released")
        row = rows[work.slots[0], : self._block_bytes]
        asked = time.time()  # a key found missing was gone by then
        try:
            while True:
                try:
                    self._get_into(self._data_client(work), path, key, header, row)
                    break
                except (FileNotFoundError, CorruptValueError):
                    raise
                except Exception as exc:
                    if not self._tried_again(work, exc):
                        raise
        except FileNotFoundError as exc:
            if classify_error(exc) == "no_bucket":  # the bucket went away: a failure, not a missing block
                self._complete(work, error=f"download of {key.hex()[:16]} failed: {self._io_failure(exc)}")
                return
            forget_frames(exc)
            self._breaker.record_success()
            self._remember(key, False, time.monotonic())
            self._count(missing=1)
            self._emit([key], removed=True, when=asked)  # deleted by a lifecycle rule or by hand
            self._complete(work, error="object missing (deleted, expired or never stored)")
            return
        except ForeignFormatError as exc:  # another release's object: not served, never deleted
            self._breaker.record_success()
            log_failure(logger, logging.WARNING, f"s3 tier {self.label}: object {path} is not served; left in place",
                        exc)  # fmt: skip
            self._count(foreign_format=1)
            self._remember(key, False, time.monotonic())
            self._complete(work, error=f"object {key.hex()[:16]} not served: {exc}")
            return
        except CorruptValueError as exc:
            self._breaker.record_success()
            keep = self.options.create_only  # never overwrites, nor deletes, an object it may not have written
            fate = "left in place (create_only)" if keep else "deleting it"
            log_failure(logger, logging.WARNING, f"s3 tier {self.label}: object {path} is corrupt; {fate}", exc)
            self._count(corrupt_values=1)
            self._remember(key, False, time.monotonic())
            deleting = time.time()
            if not keep:
                self._delete(path)
            self._emit([key], removed=True, when=deleting)
            self._complete(work, error=f"corrupt object {key.hex()[:16]}: {exc}")
            return
        except Exception as exc:
            self._complete(work, error=f"download of {key.hex()[:16]} failed: {self._io_failure(exc)}")
            return
        finally:
            del row
        self._breaker.record_success()
        if self._remember(key, True, time.monotonic()):
            self._announce_found([key])
        self._complete(work, ok=[key], nbytes=self._value_bytes)

    def _put_found_existing(self, work: Work, key: BlockKey) -> None:
        """A ``create_only`` PUT found an object under ``key``'s name: the block counts as stored
        only if that object is one (a block's size, and a header of this format, namespace, key and
        length: another engine stored it); anything else there (another release's value, a
        stranger's object) is left in place and the store fails, so this tier never reports a
        block it cannot serve (and a load under ``create_only`` never deletes a corrupt object
        either). One GET of the header's bytes (the object's size comes with them); where the
        range is refused (:func:`range_refused`: a store that ignores ranges, an empty object's
        416) a plain GET, of which only the header is read. I/O thread; the GETs have the job's
        deadline."""
        import obstore as obs

        path = self.object_path(key)
        try:
            try:
                result = obs.get(self._data_client(work), path, options={"range": (0, HEADER_SIZE)})
            except Exception as exc:
                if not range_refused(exc):
                    raise
                forget_frames(exc)  # (one answer, no retries: the job's time is still there)
                result = obs.get(self._data_client(work), path)
            size = int(result.meta["size"])
            problem = None
            if size != self._value_bytes:
                problem = f"an object of {size} bytes, not a block of {self._value_bytes}"
            else:
                header = bytearray()
                for chunk in result.stream(min_chunk_size=HEADER_SIZE):
                    header += memoryview(chunk)[: HEADER_SIZE - len(header)]
                    if len(header) >= HEADER_SIZE:
                        break
                decode_header(header, namespace=self._digest, key=key, payload_len=self._block_bytes)
        except CorruptValueError as exc:  # (another release's value too: ForeignFormatError)
            problem = f"an object that is not this block ({exc})"
        except FileNotFoundError as exc:  # gone since the PUT was refused (a lifecycle rule), or no bucket
            if classify_error(exc) == "no_bucket":
                self._complete(work, error=f"upload of {key.hex()[:16]} failed: {self._io_failure(exc)}")
                return
            forget_frames(exc)
            self._breaker.record_success()
            self._complete(work, error=f"upload of {key.hex()[:16]} refused by an object that went away since")
            return
        except Exception as exc:
            failure = self._io_failure(exc)
            self._complete(work, error=f"upload of {key.hex()[:16]} refused, and its check failed: {failure}")
            return
        self._breaker.record_success()
        if problem is not None:
            self._count(create_conflicts=1)
            self._remember(key, False, time.monotonic())
            self._complete(work, error=f"create_only: {path} already holds {problem}; left in place, not stored")
            return
        self._remember(key, True, time.monotonic())
        self._emit([key], removed=False)
        self._complete(work, ok=[key], nbytes=0)

    def _tried_again(self, work: Work, exc: BaseException) -> bool:
        """Whether ``work``'s request that failed with ``exc`` is sent again: it timed out (a
        client's own retries rarely cover that: one timed-out attempt uses up a budget of about
        ``request_timeout``), the tier is still in service, and the job has a whole
        ``request_timeout`` left, so the new attempt ends by its deadline. If so ``exc`` is let
        go of (the breaker hears of the work's last failure only, as of the client's own
        retries); if not, nothing is done (the caller reports it). A create_only upload sent
        again after one that landed finds its own object and counts as stored
        (:meth:`_put_found_existing`). I/O thread."""
        deadline = work.job.deadline if work.job is not None else None
        if deadline is None or self._stopping.is_set() or not self._breaker.serving:
            return False
        if classify_error(exc) != "timeout":
            return False
        if deadline - time.monotonic() < self.options.request_timeout:
            return False
        forget_frames(exc)
        self._count(requests_retried=1)
        return True

    def _data_client(self, work: Work) -> S3Store:
        """The client whose retries end by the deadline of ``work``'s job, given the time it has left
        (work is only started before its deadline; see :class:`ThreadedTier`): the largest retry
        budget within that time, give or take ``_start_grace`` (work started right after its
        job was submitted has a hair less than the full budget left, and gets it: its last
        attempt ends at most that grace past the deadline)."""
        deadline = work.job.deadline if work.job is not None else None
        if deadline is None:
            return self._store
        left = deadline - time.monotonic() - self.options.request_timeout + self._start_grace
        return next((store for budget, store in self._by_budget if budget <= left), self._by_budget[-1][1])

    def _get_into(self, store: S3Store, path: str, key: BlockKey, header: bytearray, row: np.ndarray) -> None:
        """GET ``path``: the first 128 bytes into ``header``, the rest into ``row``; then verify both.

        Each payload chunk is copied into the row and hashed there as it
        arrives (numpy and xxhash release the GIL), so the checksum of the
        bytes that reached the row is ready when the body ends. Raises
        FileNotFoundError (404), CorruptValueError (wrong size, header or
        checksum; ForeignFormatError for another release's format) or the client's error.
        """
        import obstore as obs

        result = obs.get(store, path)
        size = int(result.meta["size"])
        if size != self._value_bytes:
            first = next(iter(result.stream(min_chunk_size=PREFIX_SIZE)), b"")
            version = foreign_format(memoryview(first)[:PREFIX_SIZE])
            if version is not None:  # another release's layout may have another size
                raise ForeignFormatError(f"object: unsupported value format version {version}, another release's")
            raise CorruptValueError(f"object has {size} bytes, expected {self._value_bytes}")
        hasher = payload_hasher()
        filled = 0
        for chunk in result.stream(min_chunk_size=_STREAM_CHUNK):
            data = np.frombuffer(chunk, dtype=np.uint8)
            n = len(data)
            if filled + n > self._value_bytes:
                raise CorruptValueError(f"object body is longer than its {self._value_bytes} bytes")
            take = max(0, min(n, HEADER_SIZE - filled))
            if take:
                header[filled : filled + take] = data[:take].tobytes()
            start = filled + take - HEADER_SIZE
            dst = row[start : start + n - take]
            np.copyto(dst, data[take:])
            hasher.update(dst.data)
            filled += n
        if filled != self._value_bytes:
            raise CorruptValueError(f"object body truncated: {filled} of {self._value_bytes} bytes")
        parsed = decode_header(header, namespace=self._digest, key=key, payload_len=self._block_bytes)
        verify_digest(parsed, filled - HEADER_SIZE, hasher.intdigest())

    def _delete(self, path: str) -> None:
        import obstore as obs

        try:
            obs.delete(self._quick, path)
        except Exception as exc:
            logger.info("s3 tier %s: could not delete %s: %s", self.label, path, short_error(exc))
            forget_frames(exc)

    # --- existence checks -------------------------------------------------------------------------

    def _check(self, work: Work) -> None:
        """Run a batch of existence checks, then send the deferred batch, if any."""
        try:
            self._check_batch(work)
        finally:
            with self._lock:
                self._checks_out -= 1
                deferred = None
                if self._deferred is not None and self._may_send_checks():
                    deferred, self._deferred = self._deferred, None
                    self._checks_out += 1
            if deferred is not None:
                self._send_checks(deferred)

    def _check_batch(self, work: Work) -> None:
        """Run a batch's HEADs concurrently on the HEAD threads, within ``check_timeout``. Keys whose
        lookups already gave up (answered MISS), or all of them while out of service, are dropped
        unchecked: a backlog of stale checks must not keep HEADs going."""
        given_up = time.monotonic() - self.options.check_timeout - 1.0
        serving = self._breaker.serving and not self._stopping.is_set()
        with self._lock:
            live = {k for k in work.keys if serving and self._checking.get(k, given_up) > given_up}
            for key in work.keys:
                if key not in live:
                    self._checking.pop(key, None)
        chains = [kept for kept in ([k for k in chain if k in live] for chain in work.payload) if kept]
        if not chains:
            return
        timeout = self.options.check_timeout
        answers, errors, hedged = self._heads.check(chains, timeout, hedge_after=HEDGE_FRACTION * timeout)
        now = time.monotonic()
        found: list[BlockKey] = []
        with self._lock:
            for key, present in answers.items():
                # (else a PUT or GET answered meanwhile, and is newer)
                if key in self._checking and self._remember_locked(key, present, now) and present:
                    found.append(key)
            for key in work.keys:
                self._checking.pop(key, None)
        self._announce_found(found)
        self._count(checks=len(answers), checks_failed=len(errors), heads_hedged=hedged)
        if errors:
            self._io_failure(errors[0])
            for error in errors[1:]:
                forget_frames(error)
        elif answers:
            self._breaker.record_success()

    def _head(self, key: BlockKey) -> bool:
        """HEAD thread: does the bucket hold a well-sized object for ``key``? Raises on a failed request."""
        import obstore as obs

        try:
            meta = obs.head(self._quick, self.object_path(key))
        except FileNotFoundError:
            return False
        return int(meta["size"]) == self._value_bytes

    # --- manifest, probe, warm start, upkeep ----------------------------------------------------------

    def _ensure_manifest(self) -> None:
        """Create the namespace's manifest, or check the one there; raises on a mismatch or an error.

        A manifest that differs only in naming an older value format this release reads (format 1)
        is taken, and rewritten once to name :data:`FORMAT_VERSION` where that is safe (see
        :meth:`_rewrite_manifest`), as the fs tier does: its values stay servable, and a release
        that reads only format 1 then refuses the namespace instead of taking this release's
        values for corrupt ones."""
        import obstore as obs
        from obstore.exceptions import AlreadyExistsError

        expected = json.dumps(self._manifest, indent=2, sort_keys=True).encode()
        rewritten = False
        for _ in range(3):
            try:
                result = obs.get(self._store, self._manifest_path)
            except FileNotFoundError:
                try:
                    obs.put(self._store, self._manifest_path, expected, mode="create", use_multipart=False)
                except AlreadyExistsError:
                    continue  # another engine created it just now: read theirs
                except Exception as exc:
                    if not conditional_write_unsupported(exc):
                        raise
                    # A store without conditional writes: a plain upload, then read back like one
                    # another engine made (one of another block size racing this one may have won).
                    forget_frames(exc)
                    obs.put(self._store, self._manifest_path, expected, use_multipart=False)
                    continue
                self._manifest_ready()
                return
            body = bounded_body(result, MAX_MANIFEST_BYTES)  # (a shared bucket: any size, whatever it says)
            if isinstance(body, str):
                self._manifest_rejected(f"{body}, more than a manifest holds")
            try:
                found = parse_manifest(bytes(body))
            except ValueError as exc:
                self._manifest_rejected(f"unreadable ({exc})")
            older = found.get("value_format_version")
            if older_readable_format(older):
                upgraded = dict(found, value_format_version=FORMAT_VERSION)
                problem = manifest_mismatch(upgraded, self._manifest)  # (what else differs is the reason)
                if problem is None:  # the same namespace, blocks and layout: rewritten once, if it may be
                    if not rewritten and self._rewrite_manifest(upgraded, result.meta.get("e_tag"), older):
                        rewritten = True
                        continue  # read back, as another engine's would be
                    self._manifest_ready()  # taken as it is (see _rewrite_manifest)
                    return
            else:
                problem = manifest_mismatch(found, self._manifest)
            if problem is not None:
                self._manifest_rejected(f"holds {problem}")
            self._manifest_ready()
            return
        raise ConfigError(f"manifest {self._manifest_path} appeared and vanished; retrying later")

    def _rewrite_manifest(self, upgraded: dict[str, Any], e_tag: str | None, older: int) -> bool:
        """Replace the manifest just read (naming value format ``older``) by ``upgraded``, only if it
        is still the object read (``If-Match`` its ETag); True if the manifest must be read again
        (rewritten, or changed since it was read), False to take it as it is: ``create_only``
        (never overwrite), no ETag, or the rewrite refused or failed (it is optional: a store
        without conditional writes, one that denies the PUT, a failed request). A store that
        ignores ``If-Match`` overwrites whatever is there by then."""
        import obstore as obs
        from obstore.exceptions import PreconditionError

        if self.options.create_only or not e_tag:
            why = "create_only" if self.options.create_only else "no ETag to rewrite it safely"
            logger.info("s3 tier %s: manifest %s names value format %s; taken as it is (%s)", self.label,
                        self._manifest_path, older, why)  # fmt: skip
            return False
        body = json.dumps(upgraded, indent=2, sort_keys=True).encode()
        try:
            obs.put(self._store, self._manifest_path, body, mode={"e_tag": e_tag}, use_multipart=False)
        except PreconditionError as exc:  # changed since it was read: read it again
            forget_frames(exc)
            return True
        except Exception as exc:  # the rewrite is optional: refused (no conditional writes, denied) or failed
            why = "the store has no conditional writes" if conditional_write_unsupported(exc) else short_error(exc)
            forget_frames(exc)
            logger.info("s3 tier %s: manifest %s names value format %s; taken as it is (its rewrite: %s)",
                        self.label, self._manifest_path, older, why)  # fmt: skip
            return False
        logger.info("s3 tier %s: manifest %s named value format %s; rewritten to name %s", self.label,
                    self._manifest_path, older, FORMAT_VERSION)  # fmt: skip
        return True

    def _manifest_ready(self) -> None:
        self._manifest_error = None
        if not self._ready.is_set():
            self._ready.set()
            if self.options.warm_start and not self._warmed:
                self._warmed = True
                self._queue_internal(Work(Lane.BACKGROUND))

    def _manifest_rejected(self, why: str) -> NoReturn:
        message = (
            f"s3 manifest s3://{self.options.bucket}/{self._manifest_path} {why}; this namespace's objects "
            "will not be read or written. Use another 'prefix' or remove that namespace's objects"
        )
        if self._manifest_error != message:
            logger.error("s3 tier %s: %s", self.label, message)
        self._manifest_error = message
        raise ConfigError(message)

    def _probe(self) -> None:
        """The manifest check (it also proves the bucket is there and writable); a fresh index after.
        A failed request raises TierError with its one line (:func:`short_error`: the health
        detail never holds the client's dump or the server's XML body)."""
        with self._manifest_lock:
            try:
                self._ensure_manifest()
            except ConfigError:
                raise
            except Exception as exc:
                detail = short_error(exc)
                forget_frames(exc)
                raise TierError(detail) from None
            finally:
                self._manifest_checks += 1
        with self._lock:
            self._present.clear()
            self._absent.clear()

    def _ensure_ready(self, wait: bool = True) -> bool:
        """Check the manifest once before the first request (I/O thread); True once it passed.

        A failure takes the tier out of service at once (probes retry). A thread that waited
        while another checked takes that check's result rather than running one more with full
        retries (against a stalled server, one after another, they outlasted job deadlines and
        shutdown); a failed check is not redone for ``open_seconds`` (a probe may redo it); a
        waiter gives up once the tier is stopping. ``wait=False`` returns at once if
        another thread is checking.
        """
        if self._ready.is_set():
            return True
        checks = self._manifest_checks
        if wait:
            while not self._manifest_lock.acquire(timeout=0.05):
                if self._stopping.is_set():
                    return False
        elif not self._manifest_lock.acquire(blocking=False):
            return False
        try:
            if (
                not self._ready.is_set()
                and self._breaker.serving
                and checks == self._manifest_checks
                and time.monotonic() - self._manifest_failed_at >= self.options.open_seconds
                and not self._stopping.is_set()
            ):
                try:
                    self._ensure_manifest()
                except ConfigError as exc:  # a foreign manifest: out of service until it changes
                    self._manifest_failed_at = time.monotonic()
                    self._note_failure(str(exc), trip=True)
                except Exception as exc:  # the store failed: retried at the next tick or probe
                    self._manifest_failed_at = time.monotonic()
                    self._io_failure(exc)
                finally:
                    self._manifest_checks += 1
        finally:
            self._manifest_lock.release()
        return self._ready.is_set()

    def _settle_doubts(self, idle: bool) -> None:
        """HEAD the uploads in doubt that are due (:class:`~kvtier.tiers.doubts.WritesInDoubt`):
        while the store answers, up to :data:`_DOUBTS_PER_TICK` from an ``idle`` worker (no work
        in hand, none queued: :meth:`_idle_upkeep`) and one from a tick (its worker may hold a
        work item); else one now and then from an idle worker. One that landed is remembered
        present and announced stored, so a fleet index holds what the bucket holds; one not
        there is forgotten. A failed HEAD counts against the breaker and leaves the rest for a
        later tick. A doubt a PUT, GET or check settled meanwhile is not announced again.
        Housekeeping (I/O thread); each HEAD is bounded by ``check_timeout``."""
        if not self._ready.is_set() or not self._breaker.serving:
            return
        answering, now = self._breaker.answering, time.monotonic()
        with self._lock:  # (one HEAD from a tick: its worker may hold a work item, which waits for it)
            keys = self._doubts.due(now, _DOUBTS_PER_TICK if answering and idle else 1)
            if not keys or not self._doubts.may_check(answering, idle, now):
                return
        found: list[BlockKey] = []
        for key in keys:
            if self._stopping.is_set():
                break
            try:
                present = self._head(key)
            except Exception as exc:
                self._count(checks_failed=1)
                self._io_failure(exc)
                break
            self._breaker.record_success()
            with self._lock:
                if key in self._doubts and self._remember_locked(key, present, time.monotonic()) and present:
                    found.append(key)
        self._announce_found(found)

    def _housekeeping(self) -> None:
        self._ensure_ready(wait=False)
        if self._doubts:
            self._settle_doubts(idle=False)
        now = time.monotonic()
        with self._lock:
            for index in (self._present, self._absent):
                for _ in range(_PRUNE_PER_TICK):
                    first = next(iter(index), None)
                    if first is None or index[first] > now:
                        break
                    del index[first]
            while len(self._present) > self.options.max_index_entries:
                del self._present[next(iter(self._present))]

    def _warm_start(self) -> None:
        """List the namespace and remember every well-sized block object as present."""
        try:
            self._list_namespace()
        finally:
            self._warm_done.set()

    def _list_namespace(self) -> None:
        found = 0
        unlisted: list[str] = []
        try:
            for batch in list_objects(self._store, self._ns_prefix + "/", unlisted):
                if self._stopping.is_set():
                    return
                now = time.monotonic()
                with self._lock:
                    for meta in batch:
                        key = key_of_path(self._ns_prefix, meta["path"])
                        if key is None or int(meta["size"]) != self._value_bytes:
                            continue
                        if key not in self._present:
                            self._present[key] = now + self.options.hit_seconds
                            found += 1
        except Exception as exc:
            logger.warning("s3 tier %s: warm-start listing stopped: %s", self.label, self._io_failure(exc))
        if unlisted:
            logger.warning("s3 tier %s: warm start skipped %d foreign object(s) whose names the S3 client cannot "
                           "parse, e.g. %r", self.label, len(unlisted), unlisted[0])  # fmt: skip
        logger.info("s3 tier %s: warm start found %d block(s)", self.label, found)
        self._count(warm_start_blocks=found)


__all__ = ["S3Tier", "S3TierOptions"]
