"""What the manager observes about every tier, and the typed snapshot it reports.

Two halves:

* **Accumulators** (:class:`LatencyHistogram`, :class:`TierTelemetry`): fed by
  the :class:`~kvtier.manager.TieringManager` on its scheduler thread only (no
  locks): lookup latencies per tier, jobs submitted and finished (bytes and
  seconds from each :class:`~kvtier.tiers.base.JobResult`), failures by kind,
  jobs in flight. Cheap: a histogram observation is a bisect over a dozen
  bounds and three additions.
* **Snapshots** (:class:`ManagerSnapshot`, :class:`TierSnapshot`, ...): frozen
  dataclasses that :meth:`TieringManager.stats` builds from the accumulators,
  the CPU tier's counters and each secondary tier's own counters, usage and
  health. Every consumer reads these: the Prometheus exporter
  (:mod:`kvtier.metrics`), ``kvtier bench`` and vLLM's connector stats. A
  snapshot is immutable and may be handed to any thread.

Tier labels follow one scheme everywhere (:func:`kvtier.types.tier_label`):
``"0:primary"`` for the CPU tier, ``"<n>:<type>"`` for secondary tier n.
``ManagerSnapshot.tiers[0]`` is the CPU tier, ``tiers[n]`` secondary tier n.

For the CPU tier, ``written`` counts blocks that became readable in it (device
stores and promotions) and ``read`` counts blocks pinned for device loads;
their seconds are 0 (engine workers time device copies; vLLM reports those
itself). For a secondary tier, ``written`` sums its completed cascade (store)
jobs and ``read`` its completed promotion (load) jobs, with the bytes and
seconds each job reported (seconds measured by the manager, submit to poll,
when the tier reports none).

:meth:`ManagerSnapshot.as_dict` gives the JSON-able mapping that ``stats()``
returned before it was typed (``as_dict()["tiers"]["1:fs"]["bytes_written"]``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from kvtier.types import LookupResult

logger = logging.getLogger(__name__)

LOOKUP_SECONDS_BUCKETS: tuple[float, ...] = (
    1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 5e-4, 1e-3, 1e-2, 0.1,
)  # fmt: skip
"""Upper bounds of the scheduler-side lookup latency histograms (one tier's ``lookup`` call)."""

ASYNC_LOOKUP_SECONDS_BUCKETS: tuple[float, ...] = (
    1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds of the asynchronous lookup histograms (first RETRY until the tier answers HIT or MISS)."""

PROMOTION_WAIT_SECONDS_BUCKETS: tuple[float, ...] = (
    1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds of the promotion wait histograms (a promotion job queued until the manager found
it reported; see :attr:`TierTelemetry.promotion_wait_seconds`)."""


class LatencyHistogram:
    """Counts of observations per bucket (Prometheus ``le`` semantics), their sum and count.

    Scheduler thread only. Observing is appending to :attr:`pending` (the hot
    path does it inline: tens of nanoseconds); :meth:`fold` sorts the pending
    observations into the buckets, in one vectorized pass. The manager folds once
    per engine step when enough are pending, and before every snapshot. With
    :meth:`keep_samples`, folded observations are also kept raw (up to a limit)
    until :meth:`take_samples`, for exporters that need samples rather than
    buckets (vLLM's connector stats).
    """

    __slots__ = ("_bounds_array", "_max_samples", "_samples", "bounds", "count", "counts", "pending", "total")

    FOLD_AT = 1024
    """Pending observations beyond which the manager folds at the end of a step."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self._bounds_array = np.asarray(bounds, dtype=np.float64)
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.count = 0
        self.pending: list[float] = []
        self._samples: list[float] | None = None
        self._max_samples = 0

    def observe(self, seconds: float) -> None:
        """One observation (same as ``pending.append``; folded later)."""
        self.pending.append(seconds)

    def fold(self) -> None:
        """Sort the pending observations into the buckets (and the kept samples)."""
        pending = self.pending
        if not pending:
            return
        values = np.asarray(pending, dtype=np.float64)
        per_bucket = np.bincount(np.searchsorted(self._bounds_array, values, side="left"), minlength=len(self.counts))
        counts = self.counts
        for i, n in enumerate(per_bucket.tolist()):
            counts[i] += n
        self.total += float(values.sum())
        self.count += len(pending)
        samples = self._samples
        if samples is not None and len(samples) < self._max_samples:
            samples.extend(pending[: self._max_samples - len(samples)])
        pending.clear()  # in place: the manager holds this list

    def keep_samples(self, limit: int) -> None:
        """Keep up to ``limit`` raw observations between two :meth:`take_samples` (0: stop)."""
        self._max_samples = limit
        self._samples = [] if limit > 0 else None

    def take_samples(self) -> list[float]:
        """The observations kept since the last call (empty unless :meth:`keep_samples` was called)."""
        self.fold()
        if not self._samples:
            return []
        out, self._samples = self._samples, []
        return out

    def snapshot(self) -> HistogramSnapshot:
        self.fold()
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.total, self.count)


@dataclass
class TransferCounter:
    """Completed jobs of one direction of one tier: jobs, blocks, bytes, seconds."""

    jobs: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, blocks: int, nbytes: int, seconds: float) -> None:
        self.jobs += 1
        self.blocks += blocks
        self.bytes += nbytes
        self.seconds += seconds


class TierTelemetry:
    """What the manager observes about one tier. Scheduler thread only."""

    __slots__ = (
        "admitted_blocks",
        "declined_blocks",
        "failures",
        "last_error",
        "loads_in_flight",
        "lookup_async_seconds",
        "lookup_seconds",
        "promotion_wait_seconds",
        "read",
        "stores_in_flight",
        "written",
    )  # fmt: skip

    def __init__(self) -> None:
        self.lookup_seconds = LatencyHistogram(LOOKUP_SECONDS_BUCKETS)
        self.lookup_async_seconds = LatencyHistogram(ASYNC_LOOKUP_SECONDS_BUCKETS)
        self.promotion_wait_seconds = LatencyHistogram(PROMOTION_WAIT_SECONDS_BUCKETS)
        """One observation per promotion job from this tier, when the manager finds it reported
        (the poll of the step after it ended): seconds since its first block was queued (the
        lookup that started it). The request waited that long for the blocks to be loadable:
        the step end that submits the job, the tier's read (``read.seconds``), and the time
        until the next step's poll. Not observed: a job the tier refused, and one reported after
        it became overdue (its blocks were answered MISS by then, counted ``job_overdue``). A
        tier's RETRYs before the promotion are ``lookup_async_seconds``."""
        self.written = TransferCounter()
        self.read = TransferCounter()
        self.failures: dict[str, int] = {}
        self.last_error: str | None = None
        """The tier's own words for its latest failed job (at most 300 characters), for reports."""
        self.stores_in_flight = 0
        self.loads_in_flight = 0
        self.admitted_blocks = 0  # stored blocks the tier's cascade admission took (secondary tiers)
        self.declined_blocks = 0  # ... and declined (backpressure or a learned admission)

    def fold_full(self) -> None:
        """Fold each latency histogram holding at least ``FOLD_AT`` pending observations (step end:
        written out, for a step's cost)."""
        at = LatencyHistogram.FOLD_AT
        if len(self.lookup_seconds.pending) >= at:
            self.lookup_seconds.fold()
        if len(self.lookup_async_seconds.pending) >= at:
            self.lookup_async_seconds.fold()
        if len(self.promotion_wait_seconds.pending) >= at:
            self.promotion_wait_seconds.fold()

    def fail(self, kind: str, count: int = 1, error: str | None = None) -> int:
        """Count ``count`` failures of ``kind`` (``error``: the tier's words, kept as ``last_error``);
        returns how many of ``kind`` there have been."""
        self.failures[kind] = n = self.failures.get(kind, 0) + count
        if error:
            self.last_error = error[:300]
        return n


# --------------------------------------------------------------------------- snapshots


@dataclass(frozen=True)
class HistogramSnapshot:
    """A histogram at one moment: ``counts[i]`` observations were ``<= bounds[i]`` (and above
    the bound before); ``counts[-1]`` were above every bound."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float = 0.0
    count: int = 0

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> HistogramSnapshot:
        return cls(bounds, (0,) * (len(bounds) + 1))

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(upper bound as text, observations <= it), ..., ("+Inf", count)]`` (Prometheus buckets)."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            out.append((repr(float(bound)), running))
        out.append(("+Inf", running + self.counts[-1]))
        return out


@dataclass(frozen=True)
class LookupCounts:
    """Lookup answers of one tier (for a secondary tier, as it counted them)."""

    hit: int = 0
    hit_pending: int = 0
    retry: int = 0
    miss: int = 0

    @property
    def queries(self) -> int:
        return self.hit + self.hit_pending + self.retry + self.miss


@dataclass(frozen=True)
class TransferTotals:
    """Completed jobs of one direction: jobs, blocks that succeeded, bytes moved, job seconds."""

    jobs: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class BackpressureSnapshot:
    """The store-latency signal of one secondary tier (see :mod:`kvtier.backpressure`).

    ``store_latency_avg`` is None during warm-up. ``skipped_jobs``/``skipped_blocks``
    count cascades not submitted while ``active``.
    """

    active: bool
    store_latency_avg: float | None
    samples: int
    activations: int
    skipped_jobs: int
    skipped_blocks: int
    high_seconds: float
    low_seconds: float


@dataclass(frozen=True)
class AdmissionSnapshot:
    """How the manager admits cascades to one secondary tier: its rule (``all`` or ``learned``,
    the tier spec's ``admission`` option) and the stored blocks it admitted and declined
    (declined for any reason: backpressure or the learned rule; ``learned_declined`` counts the
    learned rule's alone).

    With ``learned``, its measured guard (:mod:`kvtier.manager.admission_guard`): ``guard``
    (``learning``, ``judging`` or ``fallen_back``), the hits the rule gained and lost against
    writing every store (estimated from its sample, recent ones weighing most), how often it
    fell back, and the blocks the rule declines that were written because it had
    (``overridden_blocks``)."""

    rule: str
    admitted_blocks: int
    declined_blocks: int
    learned_declined: int = 0
    guard: str | None = None
    hits_gained: float = 0.0
    hits_lost: float = 0.0
    guard_fallbacks: int = 0
    overridden_blocks: int = 0


@dataclass(frozen=True)
class PolicySnapshot:
    """What a tier's eviction policy reports about itself (:meth:`EvictionPolicy.stats`).

    ``state``: its word for its state, if any (``return-time``: ``learning``,
    ``ahead`` or ``fallen_back``); ``values``: its numbers (``return-time``:
    ``sampled_hit_rate_lru`` and ``sampled_hit_rate_learned``, the prefix-hit
    rates of its guard's two miniature caches, ``fallbacks``, ...).
    """

    name: str
    state: str | None = None
    values: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, policy: Any) -> PolicySnapshot | None:
        """The snapshot of ``policy`` (an :class:`~kvtier.policies.base.EvictionPolicy`), or None
        if its ``stats()`` raised (logged) or returned something that is not a mapping."""
        try:
            reported = policy.stats()
            state = reported.get("state")
            values = {
                str(k): float(v) for k, v in reported.items() if k != "state" and isinstance(v, int | float)
            }
        except Exception:
            logger.warning("eviction policy %r: stats() failed; its snapshot is left out", policy, exc_info=True)
            return None
        return cls(str(getattr(policy, "name", type(policy).__name__)), None if state is None else str(state), values)


@dataclass(frozen=True)
class TierSnapshot:
    """One tier at one moment. ``used_bytes``/``capacity_bytes``/``entries`` are None when the
    tier cannot say (or its ``usage()`` failed); ``health`` is ``closed``/``open``/``half_open``,
    ``down`` after shutdown, ``unknown`` if ``health()`` failed.

    ``failures`` maps a kind to a count. Kinds: ``cascade_job_failed`` and
    ``promotion_job_failed`` (jobs the tier reported failed, partly or wholly),
    ``submit_error`` (the tier refused a job), ``call_error`` (a scheduler-side
    call raised), and the tier's own block counts ``store_failed``,
    ``load_failed``, ``store_dropped`` (shed before any write: out of service, queue
    full, or no room while every evictable value is being read) and
    ``corrupt_value``; for the CPU tier ``store_failed`` (device stores reported
    failed), ``store_rejected`` (no room) and ``promotion_alloc_failed``.

    ``counters`` are the tier's own counters (:class:`~kvtier.tiers.base.TierStats`
    or the CPU tier's ``PrimaryStats``); ``extra`` its declared extra metrics,
    ``extra_kinds`` whether each is a ``counter`` or a ``gauge``.
    """

    index: int
    label: str
    tier_type: str
    medium: str
    locality: str
    implementation: str
    lookups: LookupCounts
    lookup_seconds: HistogramSnapshot
    lookup_async_seconds: HistogramSnapshot
    written: TransferTotals
    read: TransferTotals
    failures: Mapping[str, int]
    stores_in_flight: int
    loads_in_flight: int
    used_bytes: int | None
    capacity_bytes: int | None
    entries: int | None
    evictions: int
    health: str
    backpressure: BackpressureSnapshot | None = None
    admission: AdmissionSnapshot | None = None
    counters: Mapping[str, float] = field(default_factory=dict)
    extra: Mapping[str, float] = field(default_factory=dict)
    extra_kinds: Mapping[str, str] = field(default_factory=dict)
    policy: PolicySnapshot | None = None
    promotion_wait_seconds: HistogramSnapshot = field(
        default_factory=lambda: HistogramSnapshot.empty(PROMOTION_WAIT_SECONDS_BUCKETS)
    )
    """Promotion jobs from this tier, queued until found reported (empty for the CPU tier)."""

    @property
    def is_primary(self) -> bool:
        return self.index == 0

    @property
    def active_jobs(self) -> int:
        return self.stores_in_flight + self.loads_in_flight

    def as_dict(self) -> dict[str, Any]:
        """JSON-able: the tier's own counters at the top level (the layout ``stats()`` had
        before it was typed), then the manager's view; usage and health only when known."""
        if self.is_primary:
            out: dict[str, Any] = {**self.counters, "extra": dict(self.extra)}
        else:
            out = {"class": self.implementation, **self.counters, "extra": dict(self.extra)}
        if self.used_bytes is not None:
            out.update(used_bytes=self.used_bytes, capacity_bytes=self.capacity_bytes, entries=self.entries)
        if self.health != "unknown":
            out["health"] = self.health
        out.update(
            label=self.label,
            tier_type=self.tier_type,
            medium=self.medium,
            locality=self.locality,
            lookups={**dataclasses.asdict(self.lookups), "queries": self.lookups.queries},
            lookup_seconds=dataclasses.asdict(self.lookup_seconds),
            lookup_async_seconds=dataclasses.asdict(self.lookup_async_seconds),
            promotion_wait_seconds=dataclasses.asdict(self.promotion_wait_seconds),
            written=dataclasses.asdict(self.written),
            read=dataclasses.asdict(self.read),
            failures=dict(self.failures),
            stores_in_flight=self.stores_in_flight,
            loads_in_flight=self.loads_in_flight,
            backpressure=None if self.backpressure is None else dataclasses.asdict(self.backpressure),
            extra_kinds=dict(self.extra_kinds),
        )
        if self.admission is not None:
            out["admission"] = dataclasses.asdict(self.admission)
        if self.policy is not None:
            out["policy"] = {"name": self.policy.name, "state": self.policy.state, **self.policy.values}
        return out


def _zero_lookups() -> dict[str, int]:
    return {r.value: 0 for r in LookupResult}


@dataclass
class ManagerCounters:
    """The manager's own counters (blocks, unless the name says jobs).

    The manager keeps one and updates it on its scheduler thread; every snapshot
    holds a copy, with ``jobs_in_flight`` and ``active_requests`` filled in.
    """

    lookups: dict[str, int] = field(default_factory=_zero_lookups)
    promotions_started: int = 0
    promotion_jobs: int = 0
    promotions_succeeded: int = 0
    promotions_failed: int = 0
    promotion_alloc_failures: int = 0
    cascade_jobs: int = 0
    cascades_succeeded: int = 0
    cascades_failed: int = 0
    cascades_skipped: int = 0
    """Blocks not cascaded to a tier because its admission declined them: backpressure or the
    learned rule (one count per tier skipped; ``TierSnapshot.admission`` tells them apart)."""
    submit_errors: int = 0
    unknown_job_results: int = 0
    store_rejections: int = 0
    stores_declined: int = 0
    """Blocks a request asked not to store (``kvtier_store: false``)."""
    tier_call_errors: int = 0
    jobs_in_flight: int = 0
    active_requests: int = 0
    request_control_problems: dict[str, int] = field(default_factory=dict)
    """Malformed per-request settings (``kv_transfer_params``) by ``"<key>:<kind>"``, e.g.
    ``"kvtier_load_tiers:too_long"``: counts only, nothing of what a client sent."""


@dataclass(frozen=True)
class ManagerSnapshot:
    """The whole of :meth:`~kvtier.manager.TieringManager.stats` at one moment.

    ``tiers[0]`` is the CPU tier, ``tiers[n]`` secondary tier n; :meth:`as_dict` is
    the JSON-able form.
    """

    taken_at: float
    block_bytes: int
    row_stride: int
    cpu_blocks: int
    manager: ManagerCounters
    tiers: tuple[TierSnapshot, ...]

    @property
    def cpu(self) -> TierSnapshot:
        return self.tiers[0]

    @property
    def secondary(self) -> tuple[TierSnapshot, ...]:
        return self.tiers[1:]

    def tier(self, label: str) -> TierSnapshot:
        """The tier labelled ``label`` (``"0:primary"``, ``"1:fs"``); KeyError if none."""
        for tier in self.tiers:
            if tier.label == label:
                return tier
        raise KeyError(f"no tier labelled {label!r}: the tiers are {[t.label for t in self.tiers]}")

    @cached_property
    def _dict(self) -> dict[str, Any]:
        cpu = self.cpu
        primary = {
            **cpu.as_dict(),
            "blocks": cpu.entries,
            "capacity_blocks": self.cpu_blocks,
            "block_bytes": self.block_bytes,
            "row_stride": self.row_stride,
        }
        manager = {k: v for k, v in dataclasses.asdict(self.manager).items()}
        return {
            "manager": manager,
            "primary": primary,
            "tiers": {t.label: t.as_dict() for t in self.secondary},
        }

    def as_dict(self) -> dict[str, Any]:
        """JSON-able: ``{"manager": {...}, "primary": {...}, "tiers": {label: {...}}}``.

        ``primary`` holds the CPU tier's counters (``hits``, ``blocks_stored``,
        ``evictions`` ...) and sizes (``blocks``, ``capacity_blocks``,
        ``used_bytes``, ``capacity_bytes``, ``block_bytes``); each secondary entry
        holds the tier's own counters (``lookups_hit``, ``bytes_written``,
        ``stores_dropped`` ...), its usage and health, and the manager's view of it
        (``written``, ``read``, ``failures``, ``lookup_seconds``, ``backpressure`` ...).
        """
        return self._dict

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ManagerSnapshot:
        """A snapshot from the mapping form (:meth:`as_dict`, or the untyped ``stats()`` dict
        of earlier releases); missing entries take their zero defaults."""
        manager = dict(data.get("manager", {}))
        names = {f.name for f in dataclasses.fields(ManagerCounters)}
        counters = ManagerCounters(**{k: v for k, v in manager.items() if k in names})
        counters.lookups = {**_zero_lookups(), **counters.lookups}
        primary = dict(data.get("primary", {}))
        block_bytes = int(primary.get("block_bytes", 0))
        tiers = [_cpu_from_dict(primary, block_bytes, counters)]
        for index, (label, entry) in enumerate(dict(data.get("tiers", {})).items(), start=1):
            tiers.append(_tier_from_dict(index, str(label), dict(entry)))
        return cls(
            taken_at=0.0,
            block_bytes=block_bytes,
            row_stride=int(primary.get("row_stride", block_bytes)),
            cpu_blocks=int(primary.get("capacity_blocks", 0)),
            manager=counters,
            tiers=tuple(tiers),
        )


def _totals(entry: Mapping[str, Any], key: str, nbytes: str, seconds: str) -> TransferTotals:
    given = entry.get(key)
    if isinstance(given, Mapping):
        return TransferTotals(**{k: given[k] for k in ("jobs", "blocks", "bytes", "seconds") if k in given})
    return TransferTotals(bytes=int(entry.get(nbytes, 0)), seconds=float(entry.get(seconds, 0.0)))


def _histogram(entry: Mapping[str, Any], key: str, bounds: tuple[float, ...]) -> HistogramSnapshot:
    given = entry.get(key)
    if isinstance(given, Mapping) and "counts" in given:
        return HistogramSnapshot(
            tuple(given.get("bounds", bounds)), tuple(given["counts"]), float(given.get("sum", 0.0)),
            int(given.get("count", 0)),
        )
    return HistogramSnapshot.empty(bounds)


def _cpu_from_dict(primary: Mapping[str, Any], block_bytes: int, counters: ManagerCounters) -> TierSnapshot:
    return TierSnapshot(
        index=0,
        label="0:primary",
        tier_type="primary",
        medium="cpu",
        locality="local",
        implementation="PrimaryTier",
        lookups=LookupCounts(
            hit=int(primary.get("hits", 0)), hit_pending=int(primary.get("hits_pending", 0)),
            miss=int(primary.get("misses", 0)),
        ),
        lookup_seconds=_histogram(primary, "lookup_seconds", LOOKUP_SECONDS_BUCKETS),
        lookup_async_seconds=_histogram(primary, "lookup_async_seconds", ASYNC_LOOKUP_SECONDS_BUCKETS),
        written=TransferTotals(
            blocks=int(primary.get("blocks_stored", 0)), bytes=int(primary.get("blocks_stored", 0)) * block_bytes
        ),
        read=_totals(primary, "read", "", ""),
        failures={
            "store_failed": int(primary.get("store_failures", 0)),
            "store_rejected": int(primary.get("store_rejections", 0)),
            "stray_load_completion": int(primary.get("stray_load_completions", 0)),
            "promotion_alloc_failed": counters.promotion_alloc_failures,
            **dict(primary.get("failures", {})),
        },
        stores_in_flight=0,
        loads_in_flight=0,
        used_bytes=int(primary.get("used_bytes", 0)),
        capacity_bytes=int(primary.get("capacity_bytes", 0)),
        entries=int(primary.get("blocks", 0)),
        evictions=int(primary.get("evictions", 0)),
        health=str(primary.get("health", "closed")),
        counters={k: v for k, v in primary.items() if isinstance(v, int | float) and not isinstance(v, bool)},
        policy=_policy_from_dict(primary.get("policy")),
        extra={str(k): float(v) for k, v in dict(primary.get("extra", {})).items()},
        extra_kinds={str(k): "gauge" for k in dict(primary.get("extra", {}))},
    )


def _policy_from_dict(entry: Any) -> PolicySnapshot | None:
    if not isinstance(entry, Mapping):
        return None
    values = {str(k): float(v) for k, v in entry.items() if k not in ("name", "state") and isinstance(v, int | float)}
    state = entry.get("state")
    return PolicySnapshot(str(entry.get("name", "")), None if state is None else str(state), values)


def _tier_from_dict(index: int, label: str, entry: Mapping[str, Any]) -> TierSnapshot:
    failures = {
        "store_failed": int(entry.get("stores_failed", 0)),
        "load_failed": int(entry.get("loads_failed", 0)),
        "store_dropped": int(entry.get("stores_dropped", 0)),
        "corrupt_value": int(entry.get("corrupt_values", 0)),
        **dict(entry.get("failures", {})),
    }
    bp = entry.get("backpressure")
    adm = entry.get("admission")
    tier_type = label.partition(":")[2] or label
    return TierSnapshot(
        index=index,
        label=label,
        tier_type=str(entry.get("tier_type", tier_type)),
        medium=str(entry.get("medium", "storage")),
        locality=str(entry.get("locality", "local")),
        implementation=str(entry.get("class", "")),
        lookups=LookupCounts(
            hit=int(entry.get("lookups_hit", 0)), retry=int(entry.get("lookups_retry", 0)),
            miss=int(entry.get("lookups_miss", 0)),
        ),
        lookup_seconds=_histogram(entry, "lookup_seconds", LOOKUP_SECONDS_BUCKETS),
        lookup_async_seconds=_histogram(entry, "lookup_async_seconds", ASYNC_LOOKUP_SECONDS_BUCKETS),
        promotion_wait_seconds=_histogram(entry, "promotion_wait_seconds", PROMOTION_WAIT_SECONDS_BUCKETS),
        written=_totals(entry, "written", "bytes_written", "seconds_writing"),
        read=_totals(entry, "read", "bytes_read", "seconds_reading"),
        failures=failures,
        stores_in_flight=int(entry.get("stores_in_flight", 0)),
        loads_in_flight=int(entry.get("loads_in_flight", 0)),
        used_bytes=entry.get("used_bytes"),
        capacity_bytes=entry.get("capacity_bytes"),
        entries=entry.get("entries"),
        evictions=int(entry.get("evictions", 0)),
        health=str(entry.get("health", "unknown")),
        backpressure=BackpressureSnapshot(**bp) if isinstance(bp, Mapping) else None,
        admission=AdmissionSnapshot(**adm) if isinstance(adm, Mapping) else None,
        counters={k: v for k, v in entry.items() if isinstance(v, int | float) and not isinstance(v, bool)},
        extra={str(k): float(v) for k, v in dict(entry.get("extra", {})).items()},
        extra_kinds={str(k): str(v) for k, v in dict(entry.get("extra_kinds", {})).items()},
        policy=_policy_from_dict(entry.get("policy")),
    )


__all__ = [
    "ASYNC_LOOKUP_SECONDS_BUCKETS",
    "LOOKUP_SECONDS_BUCKETS",
    "PROMOTION_WAIT_SECONDS_BUCKETS",
    "AdmissionSnapshot",
    "BackpressureSnapshot",
    "HistogramSnapshot",
    "LatencyHistogram",
    "LookupCounts",
    "ManagerCounters",
    "ManagerSnapshot",
    "TierSnapshot",
    "TierTelemetry",
    "TransferCounter",
    "TransferTotals",
]
