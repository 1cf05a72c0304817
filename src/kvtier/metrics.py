"""Prometheus metrics for the CPU tier, every secondary tier and the manager.

Threading: the manager may only be called from the scheduler thread, while a
Prometheus scrape runs on the HTTP server's thread. So the scheduler thread
calls :meth:`KvtierMetrics.update` (cheap: one ``manager.stats()`` snapshot,
every step or every few steps) and scrapes read the latest snapshot under a
lock. Histograms (:meth:`observe_lookup`, :meth:`observe_step`) may be fed from
any thread.

Every metric lives in the :class:`CollectorRegistry` given to (or created by)
the constructor; nothing is registered globally, so several managers (or
tests) in one process never collide.

Metric names (all prefixed ``kvtier_``; ``tier`` is ``0:primary`` for the CPU
tier or ``<n>:<type>`` for secondary tier n):

* ``lookups_total{tier,result}``: hit / hit_pending / miss / retry
* ``bytes_total{tier,direction}`` and ``transfer_seconds_total{tier,direction}``:
  direction ``write`` (into the tier) or ``read`` (out of it)
* ``jobs_in_flight`` (manager), ``promotions_total{result}``, ``cascades_total{result}``
* ``failures_total{tier,kind}``: store_failed, load_failed, store_dropped, corrupt_value,
  submit_error, promotion_failed, cascade_failed, store_rejected
* ``evictions_total{tier}``
* ``capacity_used_bytes{tier}``, ``capacity_bytes{tier}``, ``entries{tier}``
* ``health_state{tier,state}``: 1 for the tier's current state (closed/open/half_open)
* ``lookup_seconds`` and ``scheduler_step_seconds`` histograms
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from kvtier.errors import KvtierError

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from kvtier.manager import TieringManager

logger = logging.getLogger(__name__)

PRIMARY_LABEL = "0:primary"
_HEALTH_STATES = ("closed", "open", "half_open")
_LOOKUP_BUCKETS = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 1e-3, 1e-2)
_STEP_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1)


class _SnapshotCollector(Collector):
    """Builds metric families from the latest ``TieringManager.stats()`` snapshot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snapshot: dict[str, Any] | None = None
        self._transfer: dict[str, tuple[int, float]] = {}

    def set(self, snapshot: dict[str, Any], transfer: Mapping[str, tuple[int, float]] | None) -> None:
        with self._lock:
            self._snapshot = snapshot
            if transfer is not None:
                self._transfer = dict(transfer)

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            snap = self._snapshot
            transfer = dict(self._transfer)
        return _families(snap, transfer) if snap is not None else []


def _families(snap: Mapping[str, Any], transfer: Mapping[str, tuple[int, float]]) -> list[Metric]:
    lookups = CounterMetricFamily("kvtier_lookups", "Block lookups by tier and result.", labels=["tier", "result"])
    nbytes = CounterMetricFamily("kvtier_bytes", "Bytes moved by tier and direction.", labels=["tier", "direction"])
    seconds = CounterMetricFamily(
        "kvtier_transfer_seconds",
        "Seconds spent in transfer jobs by tier and direction (jobs may overlap).",
        labels=["tier", "direction"],
    )
    failures = CounterMetricFamily("kvtier_failures", "Failures by tier and kind.", labels=["tier", "kind"])
    evictions = CounterMetricFamily("kvtier_evictions", "Blocks evicted by tier.", labels=["tier"])
    used = GaugeMetricFamily("kvtier_capacity_used_bytes", "Bytes held by the tier.", labels=["tier"])
    total = GaugeMetricFamily("kvtier_capacity_bytes", "Byte capacity of the tier.", labels=["tier"])
    entries = GaugeMetricFamily("kvtier_entries", "Blocks held by the tier.", labels=["tier"])
    health = GaugeMetricFamily(
        "kvtier_health_state", "1 for the tier's current circuit-breaker state.", labels=["tier", "state"]
    )
    in_flight = GaugeMetricFamily("kvtier_jobs_in_flight", "Secondary-tier jobs submitted and not yet reported.")
    promotions = CounterMetricFamily("kvtier_promotions", "Blocks promoted to the CPU tier.", labels=["result"])
    cascades = CounterMetricFamily("kvtier_cascades", "Blocks cascaded to secondary tiers.", labels=["result"])

    manager = snap.get("manager", {})
    primary = snap.get("primary", {})
    lookups.add_metric([PRIMARY_LABEL, "hit"], primary.get("hits", 0))
    lookups.add_metric([PRIMARY_LABEL, "hit_pending"], primary.get("hits_pending", 0))
    lookups.add_metric([PRIMARY_LABEL, "miss"], primary.get("misses", 0))
    block_bytes = int(primary.get("block_bytes", 0))
    nbytes.add_metric([PRIMARY_LABEL, "write"], int(primary.get("blocks_stored", 0)) * block_bytes)
    failures.add_metric([PRIMARY_LABEL, "store_failed"], primary.get("store_failures", 0))
    failures.add_metric([PRIMARY_LABEL, "store_rejected"], primary.get("store_rejections", 0))
    evictions.add_metric([PRIMARY_LABEL], primary.get("evictions", 0))
    used.add_metric([PRIMARY_LABEL], primary.get("used_bytes", 0))
    total.add_metric([PRIMARY_LABEL], primary.get("capacity_bytes", 0))
    entries.add_metric([PRIMARY_LABEL], primary.get("blocks", 0))
    for state in _HEALTH_STATES:
        health.add_metric([PRIMARY_LABEL, state], 1.0 if state == "closed" else 0.0)
    for direction, (moved, secs) in transfer.items():
        nbytes.add_metric(["device", direction], moved)
        seconds.add_metric(["device", direction], secs)

    for label, tier in snap.get("tiers", {}).items():
        lookups.add_metric([label, "hit"], tier.get("lookups_hit", 0))
        lookups.add_metric([label, "miss"], tier.get("lookups_miss", 0))
        lookups.add_metric([label, "retry"], tier.get("lookups_retry", 0))
        nbytes.add_metric([label, "write"], tier.get("bytes_written", 0))
        nbytes.add_metric([label, "read"], tier.get("bytes_read", 0))
        seconds.add_metric([label, "write"], tier.get("seconds_writing", 0.0))
        seconds.add_metric([label, "read"], tier.get("seconds_reading", 0.0))
        failures.add_metric([label, "store_failed"], tier.get("stores_failed", 0))
        failures.add_metric([label, "load_failed"], tier.get("loads_failed", 0))
        failures.add_metric([label, "store_dropped"], tier.get("stores_dropped", 0))
        failures.add_metric([label, "corrupt_value"], tier.get("corrupt_values", 0))
        evictions.add_metric([label], tier.get("evictions", 0))
        if "used_bytes" in tier:
            used.add_metric([label], tier.get("used_bytes") or 0)
            if tier.get("capacity_bytes") is not None:
                total.add_metric([label], tier["capacity_bytes"])
            if tier.get("entries") is not None:
                entries.add_metric([label], tier["entries"])
        state_now = tier.get("health", "down")
        for state in _HEALTH_STATES:
            health.add_metric([label, state], 1.0 if state == state_now else 0.0)

    in_flight.add_metric([], manager.get("jobs_in_flight", 0))
    promotions.add_metric(["started"], manager.get("promotions_started", 0))
    promotions.add_metric(["succeeded"], manager.get("promotions_succeeded", 0))
    promotions.add_metric(["failed"], manager.get("promotions_failed", 0))
    cascades.add_metric(["succeeded"], manager.get("cascades_succeeded", 0))
    cascades.add_metric(["failed"], manager.get("cascades_failed", 0))
    failures.add_metric(["manager", "submit_error"], manager.get("submit_errors", 0))
    failures.add_metric(["manager", "promotion_alloc_failed"], manager.get("promotion_alloc_failures", 0))
    return [lookups, nbytes, seconds, failures, evictions, used, total, entries, health, in_flight,
            promotions, cascades]  # fmt: skip


class KvtierMetrics:
    """Prometheus metrics of one :class:`~kvtier.manager.TieringManager`.

    ``update(manager)`` is called from the scheduler thread; ``render()`` and the
    HTTP server started by ``serve()`` may run on any thread. ``close()`` stops
    the server (joining its thread with a timeout).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._collector = _SnapshotCollector()
        self.registry.register(self._collector)
        self.lookup_seconds = Histogram(
            "kvtier_lookup_seconds",
            "Scheduler-side latency of one block lookup.",
            buckets=_LOOKUP_BUCKETS,
            registry=self.registry,
        )
        self.step_seconds = Histogram(
            "kvtier_scheduler_step_seconds",
            "Scheduler-side time spent in kvtier per engine step.",
            buckets=_STEP_BUCKETS,
            registry=self.registry,
        )
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def update(
        self,
        manager: TieringManager | Mapping[str, Any],
        transfer: Mapping[str, tuple[int, float]] | None = None,
    ) -> None:
        """Take a snapshot of ``manager.stats()`` (or a stats mapping) for the next scrape.

        ``transfer`` optionally adds device <-> CPU copy totals as
        ``{"device_to_cpu": (bytes, seconds), "cpu_to_device": (...)}``.
        Call from the scheduler thread.
        """
        snapshot = dict(manager) if isinstance(manager, Mapping) else manager.stats()
        self._collector.set(snapshot, transfer)

    def observe_lookup(self, seconds: float) -> None:
        self.lookup_seconds.observe(seconds)

    def observe_step(self, seconds: float) -> None:
        self.step_seconds.observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread; returns the bound port.

        ``port=0`` picks a free port. Raises :class:`KvtierError` if the port is taken.
        """
        if self._server is not None:
            raise KvtierError("metrics server already running; call close() first")
        try:
            server, thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            raise KvtierError(
                f"cannot serve metrics on {addr}:{port} ({exc.strerror or exc}): pick a free --metrics-port"
            ) from None
        self._server, self._thread = server, thread
        return int(server.server_port)

    @property
    def port(self) -> int | None:
        """The port ``/metrics`` is served on, or None when not serving."""
        return None if self._server is None else int(self._server.server_port)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the HTTP server, if any, and join its thread."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise KvtierError(f"metrics server thread did not stop within {timeout}s")

    def __enter__(self) -> KvtierMetrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["PRIMARY_LABEL", "KvtierMetrics"]
