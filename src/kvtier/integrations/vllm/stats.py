"""kvtier's figures in vLLM's own metrics, through vLLM 0.32's connector stats.

How vLLM carries them: its OffloadingConnector asks the scheduler-side
manager for ``get_stats()`` after every engine step (in the EngineCore
process) and ships the result, an ``OffloadingConnectorStats`` of named
counters, gauges and histogram samples, with the step's output to the API
server process. There ``OffloadPromMetrics`` turns every name into a
Prometheus metric that the spec declared in ``build_metric_definitions`` (a
classmethod, evaluated in the API server process), and vLLM's stat logger
prints them. So the definitions here must cover every name the reporter sends
(vLLM asserts it), and counters travel as increments.

* :data:`METRICS` declares the metrics: names ``vllm:kvtier_*``, label ``tier``
  (``0:primary``, ``1:fs``, ...) plus ``result``/``direction``/``kind``/
  ``state``/``name`` where they apply; vLLM adds its own ``model_name`` and
  ``engine`` labels. Counters appear with the ``_total`` suffix.
* :class:`VllmStatsReporter` turns manager snapshots into those stats: counter
  increments over the highest value it sent (a dip is never sent twice), current
  gauge values (a series sent before and no longer reported: 0 for a health state,
  NaN for a figure kvtier cannot tell now, as vLLM keeps every series), and the raw
  lookup latencies observed since then as histogram samples.

Scheduler thread only (vLLM's scheduler calls ``get_stats`` there).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)

from kvtier.manager import TieringManager
from kvtier.metrics import HEALTH_STATES
from kvtier.telemetry import (
    ASYNC_LOOKUP_SECONDS_BUCKETS,
    LOOKUP_SECONDS_BUCKETS,
    PROMOTION_WAIT_SECONDS_BUCKETS,
    ManagerSnapshot,
)

PREFIX = "vllm:kvtier_"

_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "lookups": ("Block lookups by tier and result (hit, hit_pending, retry, miss).", ("tier", "result")),
    "bytes": ("Bytes moved by completed jobs, by tier and direction (write: into the tier).", ("tier", "direction")),
    "transfer_seconds": ("Seconds of completed jobs by tier and direction (jobs may overlap).", ("tier", "direction")),
    "jobs": ("Completed jobs by tier and direction.", ("tier", "direction")),
    "failures": ("Failures by tier and kind (failed jobs, dropped or rejected stores, ...).", ("tier", "kind")),
    "evictions": ("Blocks evicted by tier.", ("tier",)),
    "promotions": ("Blocks promoted into the CPU tier (started, succeeded, failed).", ("result",)),
    "cascades": ("Blocks cascaded from the CPU tier (succeeded, failed, skipped: declined by a tier's "
                 "admission, backpressure or learned).", ("result",)),
    "backpressure_skipped_jobs": ("Cascade jobs skipped because the tier's store latency was high.", ("tier",)),
    "backpressure_skipped_blocks": ("Blocks not cascaded because the tier's store latency was high.", ("tier",)),
    "tier_extra_counter": ("Counters a tier declares itself, by name.", ("tier", "name")),
    "request_control_problems": ("Malformed per-request settings, by key and kind (each fell back to its "
                                 "default).", ("key", "kind")),
}  # fmt: skip
_GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "capacity_used_bytes": ("Bytes held by the tier.", ("tier",)),
    "capacity_bytes": ("Byte capacity of the tier.", ("tier",)),
    "entries": ("Blocks held by the tier.", ("tier",)),
    "active_jobs": ("Jobs submitted and not yet reported, by tier and direction.", ("tier", "direction")),
    "health_state": ("1 for the tier's current circuit-breaker state.", ("tier", "state")),
    "backpressure_active": ("1 while cascades to the tier are skipped for its store latency.", ("tier",)),
    "store_latency_avg_seconds": ("Moving average of the tier's store job latency.", ("tier",)),
    "tier_extra_gauge": ("Gauges a tier declares itself, by name.", ("tier", "name")),
}  # fmt: skip
_HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "lookup_seconds": ("Scheduler-side time of one tier's lookup call.", LOOKUP_SECONDS_BUCKETS),
    "lookup_async_seconds": (
        "From a tier's first RETRY for a block until it answered HIT or MISS.", ASYNC_LOOKUP_SECONDS_BUCKETS,
    ),
    "promotion_wait_seconds": (
        "A promotion job from this tier, from the lookup that queued it until kvtier found it reported.",
        PROMOTION_WAIT_SECONDS_BUCKETS,
    ),
}  # fmt: skip

METRICS: dict[str, OffloadingMetricMetadata] = {
    **{PREFIX + n: OffloadingCounterMetadata(documentation=d, labelnames=ln) for n, (d, ln) in _COUNTERS.items()},
    **{PREFIX + n: OffloadingGaugeMetadata(documentation=d, labelnames=ln) for n, (d, ln) in _GAUGES.items()},
    **{
        PREFIX + n: OffloadingHistogramMetadata(documentation=d, labelnames=("tier",), buckets=b)
        for n, (d, b) in _HISTOGRAMS.items()
    },
}
"""Every metric the reporter sends, as ``build_metric_definitions`` returns them to vLLM."""

_Key = tuple[str, tuple[str, ...]]

DEFAULT_SAMPLE_LIMIT = 50_000
"""Latencies (lookups, promotion waits) kept per tier and histogram between two reports (beyond:
counted in kvtier's own histograms, not sent to vLLM)."""


def _flatten(snap: ManagerSnapshot) -> tuple[dict[_Key, float], dict[_Key, float]]:
    """Counters and gauges of one snapshot, keyed by (metric name, label values)."""
    counters: dict[_Key, float] = {}
    gauges: dict[_Key, float] = {}
    p = PREFIX
    for t in snap.tiers:
        label = t.label
        for result in ("hit", "hit_pending", "retry", "miss"):
            counters[(p + "lookups", (label, result))] = getattr(t.lookups, result)
        for direction, totals in (("write", t.written), ("read", t.read)):
            counters[(p + "bytes", (label, direction))] = totals.bytes
            counters[(p + "transfer_seconds", (label, direction))] = totals.seconds
            counters[(p + "jobs", (label, direction))] = totals.jobs
        gauges[(p + "active_jobs", (label, "write"))] = t.stores_in_flight
        gauges[(p + "active_jobs", (label, "read"))] = t.loads_in_flight
        for kind, count in t.failures.items():
            counters[(p + "failures", (label, kind))] = count
        counters[(p + "evictions", (label,))] = t.evictions
        if t.used_bytes is not None:
            gauges[(p + "capacity_used_bytes", (label,))] = t.used_bytes
        if t.capacity_bytes is not None:
            gauges[(p + "capacity_bytes", (label,))] = t.capacity_bytes
        if t.entries is not None:
            gauges[(p + "entries", (label,))] = t.entries
        for state in {*HEALTH_STATES, t.health}:
            gauges[(p + "health_state", (label, state))] = 1.0 if state == t.health else 0.0
        bp = t.backpressure
        if bp is not None:
            gauges[(p + "backpressure_active", (label,))] = 1.0 if bp.active else 0.0
            if bp.store_latency_avg is not None:
                gauges[(p + "store_latency_avg_seconds", (label,))] = bp.store_latency_avg
            counters[(p + "backpressure_skipped_jobs", (label,))] = bp.skipped_jobs
            counters[(p + "backpressure_skipped_blocks", (label,))] = bp.skipped_blocks
        for name, value in t.extra.items():
            kind = "tier_extra_counter" if t.extra_kinds.get(name) == "counter" else "tier_extra_gauge"
            (counters if kind == "tier_extra_counter" else gauges)[(p + kind, (label, name))] = value
    m = snap.manager
    for result, value in (("started", m.promotions_started), ("succeeded", m.promotions_succeeded),
                          ("failed", m.promotions_failed)):
        counters[(p + "promotions", (result,))] = value
    for result, value in (("succeeded", m.cascades_succeeded), ("failed", m.cascades_failed),
                          ("skipped", m.cascades_skipped)):
        counters[(p + "cascades", (result,))] = value
    for name, count in m.request_control_problems.items():
        key, _, kind = name.partition(":")
        counters[(p + "request_control_problems", (key, kind))] = count
    return counters, gauges


class VllmStatsReporter:
    """Builds vLLM connector stats from a :class:`TieringManager`; see the module docstring.

    :meth:`report` is called from vLLM's scheduler thread after every step. It
    sends at most every ``interval`` seconds, and once more when the manager goes
    idle (no request, no job in flight), so the last figures of a burst of
    traffic are not held back until the next request.
    """

    def __init__(
        self, manager: TieringManager, *, interval: float = 1.0, sample_limit: int = DEFAULT_SAMPLE_LIMIT,
        snapshot: Callable[[], ManagerSnapshot] | None = None,
    ) -> None:
        """``snapshot``: what to report (default ``manager.stats``; the adapter adds its own counts)."""
        self.manager = manager
        self._snapshot = manager.stats if snapshot is None else snapshot
        self.interval = interval
        self._due = 0.0
        self._flushed_idle = False
        self._last: dict[_Key, float] = {}
        """Each counter's highest value sent (what vLLM's counter holds)."""
        self._gauges_sent: set[_Key] = set()
        for telemetry in manager.telemetry:
            for name in _HISTOGRAMS:  # each is the TierTelemetry attribute of that name
                getattr(telemetry, name).keep_samples(sample_limit)

    def report(self, *, force: bool = False) -> OffloadingConnectorStats | None:
        """The stats to hand to vLLM now, or None when it is not time yet (or nothing changed)."""
        now = time.monotonic()
        idle = self.manager.is_idle
        if not idle:
            self._flushed_idle = False
        if not force and now < self._due and (not idle or self._flushed_idle):
            return None
        self._due = now + self.interval
        self._flushed_idle = idle
        return self._build(self._snapshot())

    def _build(self, snap: ManagerSnapshot) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        counters, gauges = _flatten(snap)
        last = self._last
        for key, value in counters.items():
            before = last.get(key)
            if before is None or value > before:  # a series first seen is sent even at 0, so it exists
                stats.increase_counter(key[0], value - (before or 0), key[1])
                last[key] = value  # (never lowered: a dip is not sent again when the figure recovers)
        # vLLM keeps every gauge series it was sent: one kvtier no longer reports is set, not left
        # at its last value (a health state no longer current to 0, a figure it cannot tell to NaN).
        for key in self._gauges_sent.difference(gauges):
            gauges[key] = 0.0 if key[0] == PREFIX + "health_state" else math.nan
        self._gauges_sent.update(gauges)
        for (name, labels), value in gauges.items():
            stats.set_gauge(name, value, labels)
        for tier, telemetry in zip(snap.tiers, self.manager.telemetry, strict=False):
            for name in _HISTOGRAMS:
                for sample in getattr(telemetry, name).take_samples():
                    stats.observe_histogram(PREFIX + name, sample, (tier.label,))
        return None if stats.is_empty() else stats


def metric_definitions(extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
    """What ``KvtierOffloadingSpec.build_metric_definitions`` returns (the same for every config)."""
    return dict(METRICS)


__all__ = ["METRICS", "PREFIX", "VllmStatsReporter", "metric_definitions"]
