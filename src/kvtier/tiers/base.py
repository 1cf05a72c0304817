"""The secondary-tier contract.

A secondary tier (disk, Redis, S3, ...) holds blocks behind the CPU primary
tier. The :class:`~kvtier.manager.TieringManager` owns every tier and calls it
**only from the scheduler thread** (one thread: no two calls of a tier ever
overlap); none of these calls may block on I/O. Bytes move on the tier's own
threads, between its medium and rows of the shared CPU region
(``TierContext.rows``), and completion is reported by polling. The two
exceptions are :meth:`SecondaryTier.drain` and :meth:`SecondaryTier.shutdown`,
which the manager calls from whichever thread resets or stops the engine, and
which may block (bounded by their timeouts).

Every method below states who calls it, from which thread, what it may block
on and what the framework guarantees before the call. In short:

* ``submit_store(job)``: the rows ``job.slots`` hold the blocks ``job.keys``
  and stay pinned (unchanged) until this tier reports the job in
  ``poll_finished``.
* ``submit_load(job)``: the rows ``job.slots`` are reserved for this job; no
  one else reads or writes them until the job is reported.
* A job id is reported exactly once. Reporting success for a key whose bytes
  were not verified is a contract violation: a tier must never hand wrong bytes
  to the CPU tier as a success.

Tier obligations:

* ``lookup`` answers from memory at once: HIT, MISS, or RETRY while an
  asynchronous existence check is under way. While the tier is unhealthy it
  answers MISS.
* ``drain()`` blocks (the one blocking call besides ``shutdown``) until every
  submitted job has finished or failed; it never aborts a copy halfway.
* ``shutdown()`` stops accepting work, finishes or fails queued jobs, joins its
  threads with a timeout and drops every view of the CPU rows. It raises if it
  cannot prove its threads stopped touching the rows.

Writing a tier: subclass :class:`kvtier.tiers.jobs.ThreadedTier` (job
tracking, queues, threads, drain, shutdown and the health breaker are done
there) and copy :mod:`kvtier.tiers.memory`; declare the options as a pydantic
model in ``options_model``; run the conformance suite
(:mod:`kvtier.testing`) against it.
"""

from __future__ import annotations

import abc
import enum
import math
import numbers
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import numpy as np
from pydantic import BaseModel

from kvtier.keys import BlockKey, KVGeometry, Namespace
from kvtier.tiers.format import HEADER_SIZE
from kvtier.tiers.options import Admission, TierOptions, validate_options
from kvtier.types import BlockEvent, LookupResult, OffloadPolicy, RequestContext


@dataclass
class TierContext:
    """What the manager hands a tier at construction.

    ``rows`` is a ``(num_rows, row_stride)`` uint8 view of the shared CPU region;
    block ``slot`` lives in ``rows[slot, :block_bytes]``. The tier must drop
    every reference to ``rows`` (and views derived from it) in ``shutdown()``.
    """

    rows: np.ndarray
    block_bytes: int
    namespace: Namespace
    index: int = 0
    admission: Admission = "all"
    """How the manager admits cascades to this tier (the spec's ``admission`` option, which the
    tier itself never receives; see :class:`~kvtier.tiers.options.CascadeOptions`)."""

    def release_rows(self) -> None:
        """Drop this context's view of the CPU rows (the manager calls it after a tier shut down)."""
        self.rows = np.empty((0, 0), dtype=np.uint8)

    @property
    def geometry(self) -> KVGeometry | None:
        """The namespace's KV layout (``None`` for an engine whose rows are opaque bytes)."""
        return self.namespace.geometry

    @property
    def row_stride(self) -> int:
        return int(self.rows.strides[0])


@dataclass
class TransferJob:
    """One batched transfer between a tier and CPU rows.

    ``is_promotion`` is True for tier -> CPU (a load), False for CPU -> tier (a
    store, also called a cascade). ``slots[i]`` is the row of ``keys[i]``.
    """

    job_id: int
    keys: Sequence[BlockKey]
    slots: np.ndarray
    is_promotion: bool
    request: RequestContext | None = None


@dataclass
class JobResult:
    """The outcome of one job, reported once by ``poll_finished``.

    ``successful_keys`` allows partial success: when it is None, ``success``
    applies to every key of the job; otherwise exactly those keys succeeded.
    """

    job_id: int
    success: bool
    successful_keys: frozenset[BlockKey] | None = None
    bytes_moved: int = 0
    seconds: float = 0.0
    error: str | None = None

    def succeeded(self, keys: Iterable[BlockKey]) -> list[BlockKey]:
        """The subset of ``keys`` that this result reports as transferred."""
        if self.successful_keys is None:
            return list(keys) if self.success else []
        return [k for k in keys if k in self.successful_keys]


def checked_answers(answer: object, kind: type[Any], what: str) -> tuple[list[Any], str | None]:
    """A tier's answer that should be a list (or another iterable) of ``kind``: the items that
    are (a JobResult of odd field types normalized, see :func:`_usable`), and a problem to report
    if the answer or some items were not (None if none). The manager calls a tier through this,
    so a wrong type costs the tier's own answer, never the scheduler (iterating the answer may
    raise: the caller guards it like the call)."""
    if isinstance(answer, (str, bytes)) or not isinstance(answer, Iterable):
        return [], f"{what} returned {type(answer).__name__}, not a list of {kind.__name__}"
    good: list[Any] = []
    odd = 0
    for item in answer:
        usable = _usable(item, kind)
        if usable is not None:
            good.append(usable)
        odd += usable is not item
    if not odd:
        return good, None
    return good, f"{what} returned {odd} item(s) that are not well-formed {kind.__name__}s (normalized, or ignored)"


NOTHING_POLLED: tuple[list[JobResult], str | None] = ([], None)
"""What :func:`polled_results` stands for when the tier's call raised."""


def polled_results(tier: SecondaryTier) -> tuple[list[JobResult], str | None]:
    """``tier.poll_finished()`` through :func:`checked_answers`: its well-formed results, and what
    was wrong with the rest (None if nothing)."""
    return checked_answers(tier.poll_finished(), JobResult, "poll_finished()")


def _usable(item: object, kind: type[Any]) -> Any:
    """``item`` if it is a well-formed ``kind``; a JobResult with odd field types (a numpy int,
    ``seconds=None``) normalized, anything doubtful about what succeeded taken as a failure
    (never as a success: the rows would be served); None if unusable (not a ``kind``, or a job
    id that is no integer)."""
    if not isinstance(item, kind):
        return None
    if not isinstance(item, JobResult):
        return item
    keys, success = item.successful_keys, cast(object, item.success)  # a tier's, whatever its annotation says
    if (type(item.job_id) is int and type(success) is bool and _finite(item.seconds) and type(item.bytes_moved) is int
            and (keys is None or isinstance(keys, (set, frozenset)))):  # fmt: skip
        return item
    try:
        job_id = operator.index(item.job_id)
    except TypeError:
        return None
    if not isinstance(success, (bool, np.bool_)):
        success = False
    try:
        keys = None if keys is None else frozenset(keys)
    except TypeError:
        keys, success = frozenset(), False
    try:
        moved = operator.index(item.bytes_moved)
    except TypeError:
        moved = 0
    seconds = float(item.seconds) if _finite(item.seconds) else 0.0
    return JobResult(job_id, bool(success), keys, moved, seconds, item.error if isinstance(item.error, str) else None)


def _finite(value: object) -> bool:
    """A finite real number, not a bool."""
    if type(value) is bool or not isinstance(value, numbers.Real):
        return False
    return math.isfinite(value)


class HealthState(enum.Enum):
    """Circuit-breaker state of a tier: CLOSED serves, OPEN sheds, HALF_OPEN probes."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class TierHealth:
    state: HealthState
    consecutive_failures: int = 0
    detail: str = ""

    @property
    def serving(self) -> bool:
        return self.state is not HealthState.OPEN


@dataclass(frozen=True)
class TierUsage:
    """Bytes used and total capacity (``None`` when the medium cannot say)."""

    used_bytes: int
    capacity_bytes: int | None
    entries: int | None = None


@dataclass(frozen=True)
class ExtraMetric:
    """A metric a tier keeps beyond the standard ones, in ``stats.extra[name]``.

    ``kind`` is ``"counter"`` (only grows) or ``"gauge"``. Declared in the tier
    class's ``extra_metrics``; such values reach Prometheus (kvtier's exporter and
    vLLM's ``/metrics``) labelled with the tier and the name. Undeclared extras are
    exported as gauges.
    """

    kind: str
    documentation: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("counter", "gauge"):
            raise ValueError(f"ExtraMetric kind must be 'counter' or 'gauge', got {self.kind!r}")


FOREIGN_FORMAT_METRIC = ExtraMetric(
    "counter", "Values in a format version this release cannot read (another release's): not served, kept."
)
"""``foreign_format``, which every tier that reads kvtier's value format counts (see
:class:`~kvtier.errors.ForeignFormatError`)."""
UPLOADS_FOUND_METRIC = ExtraMetric(
    "counter", "Writes that failed with their outcome unknown (a timeout, a lost reply) and a later check, "
    "lookup or load found landed: announced stored then."
)
"""``uploads_found``, which the shared-store tiers count (see :mod:`kvtier.tiers.doubts`)."""
WRITES_IN_DOUBT_METRIC = ExtraMetric(
    "gauge", "Writes that failed with their outcome unknown, not yet checked (a store's events may "
    "still announce them): 0 once every one was found, found missing, or dropped unchecked (the oldest, "
    "beyond the most a tier keeps)."
)
"""``writes_in_doubt``, which the shared-store tiers keep (see :mod:`kvtier.tiers.doubts`)."""


@dataclass
class TierStats:
    """Counters every tier keeps; read by metrics and ``kvtier bench``."""

    lookups_hit: int = 0
    lookups_miss: int = 0
    lookups_retry: int = 0
    stores_submitted: int = 0
    stores_failed: int = 0
    stores_dropped: int = 0
    loads_submitted: int = 0
    loads_failed: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    seconds_writing: float = 0.0
    seconds_reading: float = 0.0
    corrupt_values: int = 0
    evictions: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class SecondaryTier(abc.ABC):
    """Base class of every secondary tier. See the module docstring for the contract.

    Subclasses set ``tier_type`` (the registry name) and ``medium``, and take
    their options as keyword arguments after ``context`` (the registry builds a
    tier as ``cls(context, **options)``). A subclass declares those options once,
    as a pydantic model in ``options_model`` (``extra="forbid"``; each field's
    type, default, bounds and ``description``, which is its line in
    ``docs/configuration.md``): the registry validates every ``{"type": ...,
    **options}`` spec through it before any tier is built, so configuration
    errors surface when the config is loaded, and the constructor validates what
    it gets through the same model (:func:`kvtier.tiers.options.tier_options`
    also accepts a ready instance of the model). Without a model, options are
    checked against the constructor's keyword parameters. Sizing before a tier
    exists asks the class: :meth:`bytes_per_block` and :meth:`capacity_bytes`.

    Construction: the manager builds tiers in order from the thread that calls
    :meth:`~kvtier.manager.TieringManager.create`. The constructor may block on
    its medium (bounded by its timeouts) and may start threads; if it raises,
    it must have stopped them. The manager guarantees ``context.rows`` stays
    mapped until this tier's ``shutdown()`` returned without raising.
    """

    tier_type: ClassVar[str] = "abstract"
    medium: ClassVar[str] = "storage"
    options_model: ClassVar[type[BaseModel] | None] = None
    extra_metrics: ClassVar[Mapping[str, ExtraMetric]] = {}
    """The names this tier keeps in ``stats.extra``, declared for metrics (see :class:`ExtraMetric`)."""

    def __init__(self, context: TierContext) -> None:
        self.context = context
        self.stats = TierStats()

    # --- sizing before the tier exists (``kvtier config show``); any thread --------------

    @classmethod
    def bytes_per_block(cls, block_bytes: int) -> int:
        """Bytes a block of ``block_bytes`` takes in this tier's medium (value header, padding).

        Default: the value header (:data:`~kvtier.tiers.format.HEADER_SIZE`) plus the block.
        """
        return HEADER_SIZE + block_bytes

    @classmethod
    def capacity_bytes(cls, options: Mapping[str, Any]) -> int | None:
        """The byte capacity ``options`` give this tier; None when the medium sets it (a server's
        memory, a bucket, the free disk space found at start) or the tier cannot say.

        Default: what the ``options_model`` instance says (:meth:`TierOptions.capacity
        <kvtier.tiers.options.TierOptions.capacity>`). Raises :class:`~kvtier.errors.ConfigError`
        for invalid options.
        """
        model = cls.options_model
        if model is None:
            return None
        validated = validate_options(model, cls.tier_type, options)
        return validated.capacity() if isinstance(validated, TierOptions) else None

    @property
    def label(self) -> str:
        """``"<index>:<type>"``, used in logs, events and metric labels."""
        return f"{self.context.index}:{self.tier_type}"

    # --- scheduler-thread calls; none may block ---------------------------------

    @abc.abstractmethod
    def lookup(self, key: BlockKey, request: RequestContext | None) -> LookupResult:
        """HIT, MISS or RETRY for one key, answered from memory.

        Caller: the manager, on the scheduler thread, when the CPU tier missed
        ``key`` (every earlier tier of the cascade answered MISS or RETRY). Must
        not block: no I/O, locks held for microseconds only. HIT promises the
        key can probably be loaded (a later load may still fail it: the medium
        is shared); RETRY means "ask again next step" (an existence check is
        under way) and must turn into HIT or MISS within a bounded number of
        steps; MISS is final for this step. While shut down or out of service:
        MISS. On HIT the manager reserves a CPU row and submits a load at step
        end.
        """

    @abc.abstractmethod
    def submit_store(self, job: TransferJob) -> None:
        """Enqueue a CPU -> tier copy of ``job.slots``; keys already held are skipped.

        Caller: the manager, on the scheduler thread, after a device -> CPU store
        completed (a cascade). Must not block: enqueue only. Guarantees: the rows
        ``job.slots`` hold ``job.keys`` and stay pinned (unchanged) until this
        job is reported by :meth:`poll_finished`; ``job.job_id`` is unique among
        jobs in flight. The tier may shed the job (report it failed) instead of
        queueing it. Raises :class:`~kvtier.errors.TierError` only after
        :meth:`shutdown`.
        """

    @abc.abstractmethod
    def submit_load(self, job: TransferJob) -> None:
        """Enqueue a tier -> CPU copy into the reserved ``job.slots``.

        Caller: the manager, on the scheduler thread, at step end, batching the
        keys this tier answered HIT for one request. Must not block. Guarantees:
        the rows ``job.slots`` are reserved for this job (nobody else reads or
        writes them) until it is reported; only bytes verified against the value
        header may be reported as loaded (per-key partial success allowed).
        """

    @abc.abstractmethod
    def poll_finished(self) -> list[JobResult]:
        """Results of jobs finished since the last call, each reported once.

        Caller: the manager, on the scheduler thread, at most once per step and
        before any eviction decision. Must not block. After a job is reported
        the tier holds no reference to its rows.
        """

    def touch(self, keys: Sequence[BlockKey], request: RequestContext | None) -> None:  # noqa: B027
        """Recency hint for ``keys`` (they were used). Default: ignored.

        Caller: the manager, on the scheduler thread, for the blocks the engine
        touches and for every block loaded from the CPU tier to the device (one call
        per ``prepare_load``). Must not block; I/O (e.g. refreshing a TTL) is queued.
        """

    def on_new_request(self, request: RequestContext) -> OffloadPolicy:
        """The policy this tier wants for ``request``. Default: BLOCK_LEVEL.

        Caller: the manager, on the scheduler thread, once per request before any
        store of it. Must not block.
        """
        return OffloadPolicy.BLOCK_LEVEL

    def on_request_finished(self, request: RequestContext) -> None:  # noqa: B027
        """No more submits will come for ``request`` (jobs may still be in flight).

        Caller: the manager, on the scheduler thread, once every device store of
        the request completed. Must not block.
        """

    def on_schedule_end(self) -> None:  # noqa: B027
        """Called once per engine step, after the manager submitted this step's jobs.

        Caller: the manager, on the scheduler thread. Must not block: the place
        to hand this step's batched existence checks to I/O threads.
        """

    def has_pending_work(self) -> bool:
        """True while jobs are queued, running or unreported (the engine keeps stepping).

        Caller: the manager, on the scheduler thread, every step. Must not block.
        """
        return False

    def take_events(self) -> list[BlockEvent]:
        """Stored/removed events since the last call.

        Caller: the manager, on the scheduler thread (for KV-aware routing). Must
        not block.
        """
        return []

    # --- what the tier holds, for engine event streams (kvtier.engine_events) ----------

    lists_holdings: ClassVar[bool] = False
    """True when :meth:`held_keys` lists what the tier holds (once its start-up scan, if any, is done)."""

    def store_location(self) -> str | None:
        """Where the blocks live, spelled the same by every engine configured to share them
        (an fs root's real path and its directory's identity, a Redis URL without credentials and its
        prefix (and this host's name for a loopback or unix-socket server), an S3
        endpoint, bucket and prefix); None: the blocks are private to this engine start and
        gone with it (the default). Engines whose tiers give the same location and namespace
        share one store in a fleet's index. Caller: the event stream, once. Must not block."""
        return None

    def held_keys(self) -> list[BlockKey] | None:
        """A copy of the keys this tier holds as far as it knows from memory (what a start-up
        scan found, what this engine stored, what it learned from other engines), or None when
        it cannot list them, or not yet (a scan is under way: ask again later). Caller: the
        event stream, on the scheduler thread, for start-up announcements and snapshots. Must
        not block on I/O (a copy of an in-memory index)."""
        return None

    def holdings_complete(self) -> bool:
        """True when :meth:`held_keys` lists everything in the store, other engines' blocks
        included (a consumer may then drop what it believes the store holds beyond them);
        False when it lists only part (e.g. what this engine found at start and wrote). Must
        not block."""
        return False

    def holds(self, key: BlockKey) -> bool:
        """Whether :meth:`held_keys` would list ``key`` now. Caller: the event stream, on the
        scheduler thread, re-checking a snapshot's keys as it sends them. Must not block."""
        return False

    def health(self) -> TierHealth:
        """The circuit-breaker state. Caller: manager and metrics, scheduler thread; must not block."""
        return TierHealth(HealthState.CLOSED)

    @abc.abstractmethod
    def usage(self) -> TierUsage:
        """Bytes used and capacity (None: unbounded or unknown).

        Caller: the manager's ``stats()`` on the scheduler thread. Must not block
        on remote I/O: answer from what the I/O threads last learned.
        """

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary of the tier's configuration (secrets redacted). Must not block."""
        return {"type": self.tier_type, "medium": self.medium}

    # --- blocking calls ----------------------------------------------------------

    @abc.abstractmethod
    def drain(self, timeout: float | None = None) -> None:
        """Block until every submitted job finished or failed; never abort a copy halfway.

        Caller: the manager's ``reset_cache`` (any thread, while the scheduler is
        not stepping). May block on the medium for up to ``timeout`` seconds,
        then raises :class:`~kvtier.errors.TierDrainTimeout`. The results stay
        available to :meth:`poll_finished`.
        """

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop, join threads, release every view of the CPU rows. Raise on failure.

        Caller: the manager's ``shutdown`` (any thread, while the scheduler is not
        stepping), also after a failed construction of a later tier. May block
        for the tier's own bounded timeouts. Must stop accepting work, finish or
        fail queued jobs, join its threads, and drop ``context.rows`` and every
        view of it; if it cannot prove its threads stopped it raises (the manager
        then keeps the region mapped and calls it again later). Idempotent once
        it succeeded.
        """
