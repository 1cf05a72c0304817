"""The secondary-tier contract.

A secondary tier (disk, Redis, S3, ...) holds blocks behind the CPU primary
tier. The :class:`~kvtier.manager.TieringManager` owns every tier and calls it
**only from the scheduler thread**; none of these calls may block on I/O.
Bytes move on the tier's own threads, between its medium and rows of the shared
CPU region (``TierContext.rows``), and completion is reported by polling.

Framework guarantees (preconditions a tier may rely on):

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
* ``drain()`` blocks (the one blocking call) until every submitted job has
  finished or failed; it never aborts a copy halfway.
* ``shutdown()`` stops accepting work, finishes or fails queued jobs, joins its
  threads with a timeout and drops every view of the CPU rows. It raises if it
  cannot prove its threads stopped touching the rows.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel

from kvtier.keys import BlockKey, KVGeometry, Namespace
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
    their options as keyword arguments after ``context``. A subclass declares
    those options as a pydantic model in ``options_model`` (``extra="forbid"``;
    each field's ``description`` is its line in ``docs/configuration.md``): the
    registry validates every ``{"type": ..., **options}`` spec through it before
    the constructor runs, so configuration errors surface when the config is
    loaded. Without a model, options are checked against the constructor's
    keyword parameters.
    """

    tier_type: ClassVar[str] = "abstract"
    medium: ClassVar[str] = "storage"
    options_model: ClassVar[type[BaseModel] | None] = None
    extra_metrics: ClassVar[Mapping[str, ExtraMetric]] = {}
    """The names this tier keeps in ``stats.extra``, declared for metrics (see :class:`ExtraMetric`)."""

    def __init__(self, context: TierContext) -> None:
        self.context = context
        self.stats = TierStats()

    @property
    def label(self) -> str:
        """``"<index>:<type>"``, used in logs, events and metric labels."""
        return f"{self.context.index}:{self.tier_type}"

    # --- scheduler-thread calls; none may block ---------------------------------

    @abc.abstractmethod
    def lookup(self, key: BlockKey, request: RequestContext | None) -> LookupResult:
        """HIT, MISS or RETRY for one key, answered from memory."""

    @abc.abstractmethod
    def submit_store(self, job: TransferJob) -> None:
        """Enqueue a CPU -> tier copy of ``job.slots``; keys already held are skipped."""

    @abc.abstractmethod
    def submit_load(self, job: TransferJob) -> None:
        """Enqueue a tier -> CPU copy into the reserved ``job.slots``."""

    @abc.abstractmethod
    def poll_finished(self) -> list[JobResult]:
        """Results of jobs finished since the last call, each reported once."""

    def touch(self, keys: Sequence[BlockKey], request: RequestContext | None) -> None:  # noqa: B027
        """Recency hint for ``keys``. Default: ignored."""

    def on_new_request(self, request: RequestContext) -> OffloadPolicy:
        """The policy this tier wants for ``request``. Default: BLOCK_LEVEL."""
        return OffloadPolicy.BLOCK_LEVEL

    def on_request_finished(self, request: RequestContext) -> None:  # noqa: B027
        """No more submits will come for ``request`` (jobs may still be in flight)."""

    def on_schedule_end(self) -> None:  # noqa: B027
        """Called once per engine step, after the manager submitted this step's jobs."""

    def has_pending_work(self) -> bool:
        """True while jobs are queued or running (the engine keeps stepping)."""
        return False

    def take_events(self) -> list[BlockEvent]:
        """Stored/removed events since the last call."""
        return []

    def health(self) -> TierHealth:
        return TierHealth(HealthState.CLOSED)

    @abc.abstractmethod
    def usage(self) -> TierUsage:
        """Bytes used and capacity; must not block on remote I/O."""

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary of the tier's configuration."""
        return {"type": self.tier_type, "medium": self.medium}

    # --- blocking calls ----------------------------------------------------------

    @abc.abstractmethod
    def drain(self, timeout: float | None = None) -> None:
        """Block until every submitted job finished or failed.

        Raises :class:`~kvtier.errors.TierDrainTimeout` after ``timeout`` seconds.
        """

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop, join threads, release every view of the CPU rows. Raise on failure."""
