"""Prometheus metrics for the CPU tier, every secondary tier and the manager.

Threading: the manager may only be called from the scheduler thread, while a
Prometheus scrape runs on the HTTP server's thread. So the scheduler thread
calls :meth:`KvtierMetrics.update` (one ``manager.stats()`` snapshot, every
step or every few steps) and scrapes read the latest snapshot under a lock.
The caller-fed histograms (:meth:`observe_lookup`, :meth:`observe_step`) may be
fed from any thread.

Every metric lives in the :class:`CollectorRegistry` given to (or created by)
the constructor; nothing is registered globally. One registry holds the metrics
of one manager: a second :class:`KvtierMetrics` on a registry that already has
kvtier's metrics raises :class:`~kvtier.errors.ConfigError` (its series would
collide), so several managers in one process each take their own (the default:
``KvtierMetrics()`` creates a private registry).

Metric names (all prefixed ``kvtier_``; ``tier`` is ``0:primary`` for the CPU
tier or ``<n>:<type>`` for secondary tier n, as in events and logs):

* ``lookups_total{tier,result}``: hit / hit_pending / miss / retry
* ``tier_lookup_seconds{tier}``: histogram of one tier's lookup call, as the
  manager timed it on the scheduler thread; ``tier_lookup_async_seconds{tier}``:
  from a tier's first RETRY for a key until it answered HIT or MISS;
  ``promotion_wait_seconds{tier}``: a promotion job from that tier, from the lookup
  that queued it until the manager found it reported (what a request waits for its blocks)
* ``bytes_total{tier,direction}``, ``transfer_seconds_total{tier,direction}``,
  ``jobs_total{tier,direction}``: completed jobs, direction ``write`` (into the
  tier) or ``read`` (out of it); ``tier="device"`` for device copies a caller reports
* ``active_jobs{tier,direction}``: jobs submitted and not yet reported;
  ``jobs_in_flight``: all of them
* ``failures_total{tier,kind}``: see :class:`~kvtier.telemetry.TierSnapshot` for the kinds
  (among them the waits that reached their deadline: ``retry_expired``, ``load_expired``,
  ``store_expired``, ``job_overdue``, ``cascade_expired``, and ``withheld`` answers)
* ``evictions_total{tier}``, ``capacity_used_bytes{tier}``, ``capacity_bytes{tier}``, ``entries{tier}``
* ``health_state{tier,state}``: 1 for the tier's current state (closed/open/half_open/down/unknown)
* ``promotions_total{result}``, ``cascades_total{result}`` (blocks; ``result="skipped"``:
  declined by a tier's admission, backpressure or ``admission: learned``)
* ``request_control_problems_total{key,kind}``: malformed per-request settings (a request's
  ``kv_transfer_params``), by key and kind of problem; each fell back to its default
* ``backpressure_active{tier}``, ``store_latency_avg_seconds{tier}``,
  ``backpressure_skipped_jobs_total{tier}``, ``backpressure_skipped_blocks_total{tier}``
* ``admission_blocks_total{tier,rule,decision}``: stored blocks a secondary tier's cascade
  admission (``rule``: ``all`` or ``learned``) admitted (``decision="admitted"``) or declined
  (``"declined_learned"``: predicted not worth the write; ``"declined_backpressure"``)
* the measured guard of ``admission: learned`` (:mod:`kvtier.manager.admission_guard`):
  ``admission_guard_state{tier,state}`` 1 for its state (``learning``, ``judging``,
  ``fallen_back``), ``admission_guard_hits{tier,effect}`` (``effect="gained"`` / ``"lost"``: hits
  the rule gained and lost against writing every store, estimated), ``admission_guard_fallbacks_total{tier}``
  and ``admission_overridden_blocks_total{tier}`` (blocks the rule would have declined, written
  while the guard was fallen back)
* ``tier_extra_counter_total{tier,name}`` and ``tier_extra_gauge{tier,name}``:
  the metrics a tier declares itself (``SecondaryTier.extra_metrics``)
* ``lookup_seconds`` and ``scheduler_step_seconds``: histograms the caller feeds
  (a whole ``lookup`` per block, kvtier's time per engine step)
* the CPU tier's eviction policy (what its ``stats()`` reports):
  ``policy_state{tier,policy,state}`` 1 for its current state (``return-time``:
  ``learning``, ``ahead`` or ``fallen_back``), ``policy_sampled_hit_ratio{tier,policy,cache}``
  (``cache="lru"`` / ``"learned"``: the prefix-hit ratios of the guard's two miniature
  caches), ``policy_fallbacks_total{tier,policy}``, and ``policy_value{tier,policy,name}``
  for every other number it reports
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.errors import ConfigError, KvtierError
from kvtier.telemetry import ManagerSnapshot
from kvtier.types import PRIMARY_LABEL
from kvtier.validation import is_utf8_text

if TYPE_CHECKING:
    from kvtier.manager import TieringManager
    from kvtier.metrics_http import MetricsServer

logger = logging.getLogger(__name__)

HEALTH_STATES = ("closed", "open", "half_open")
_LOOKUP_BUCKETS = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 1e-3, 1e-2)
_STEP_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1)


class _SnapshotCollector(Collector):
    """Builds metric families from the latest :class:`ManagerSnapshot`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snapshot: ManagerSnapshot | None = None
        self._transfer: dict[str, tuple[int, float]] = {}

    def set(self, snapshot: ManagerSnapshot, transfer: Mapping[str, tuple[int, float]] | None) -> None:
        with self._lock:
            self._snapshot = snapshot
            if transfer is not None:
                self._transfer = dict(transfer)

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            snap = self._snapshot
            transfer = dict(self._transfer)
        return _families(snap, transfer) if snap is not None else []


def _histogram_family(name: str, doc: str, snap: ManagerSnapshot, attr: str) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["tier"])
    for tier in snap.tiers:
        hist = getattr(tier, attr)
        family.add_metric([tier.label], hist.cumulative(), hist.sum)
    return family


def _families(snap: ManagerSnapshot, transfer: Mapping[str, tuple[int, float]]) -> list[Metric]:
    """Every family of one snapshot. Long because it is one flat table of metrics."""
    lookups = CounterMetricFamily("kvtier_lookups", "Block lookups by tier and result.", labels=["tier", "result"])
    nbytes = CounterMetricFamily(
        "kvtier_bytes", "Bytes moved by completed jobs, by tier and direction.", labels=["tier", "direction"]
    )
    seconds = CounterMetricFamily(
        "kvtier_transfer_seconds",
        "Seconds spent in completed jobs by tier and direction (jobs may overlap).",
        labels=["tier", "direction"],
    )
    jobs = CounterMetricFamily("kvtier_jobs", "Completed jobs by tier and direction.", labels=["tier", "direction"])
    active = GaugeMetricFamily(
        "kvtier_active_jobs", "Jobs submitted and not yet reported, by tier and direction.",
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
    pressure = GaugeMetricFamily(
        "kvtier_backpressure_active", "1 while cascades to the tier are skipped for its store latency.",
        labels=["tier"],
    )
    latency = GaugeMetricFamily(
        "kvtier_store_latency_avg_seconds", "Moving average of the tier's store job latency.", labels=["tier"]
    )
    skipped_jobs = CounterMetricFamily(
        "kvtier_backpressure_skipped_jobs", "Cascade jobs skipped under backpressure.", labels=["tier"]
    )
    skipped_blocks = CounterMetricFamily(
        "kvtier_backpressure_skipped_blocks", "Blocks not cascaded under backpressure.", labels=["tier"]
    )
    admission = CounterMetricFamily(
        "kvtier_admission_blocks",
        "Stored blocks a secondary tier's cascade admission admitted or declined (reason: backpressure or "
        "learned).", labels=["tier", "rule", "decision"],
    )
    extra_counters = CounterMetricFamily(
        "kvtier_tier_extra_counter", "Counters a tier declares itself.", labels=["tier", "name"]
    )
    extra_gauges = GaugeMetricFamily(
        "kvtier_tier_extra_gauge", "Gauges a tier declares itself.", labels=["tier", "name"]
    )
    in_flight = GaugeMetricFamily("kvtier_jobs_in_flight", "Secondary-tier jobs submitted and not yet reported.")
    promotions = CounterMetricFamily("kvtier_promotions", "Blocks promoted to the CPU tier.", labels=["result"])
    cascades = CounterMetricFamily("kvtier_cascades", "Blocks cascaded to secondary tiers.", labels=["result"])
    problems = CounterMetricFamily(
        "kvtier_request_control_problems", "Malformed per-request settings, by key and kind (each fell back "
        "to its default).", labels=["key", "kind"],
    )

    for tier in snap.tiers:
        label = tier.label
        lookups.add_metric([label, "hit"], tier.lookups.hit)
        if tier.is_primary:
            lookups.add_metric([label, "hit_pending"], tier.lookups.hit_pending)
        else:
            lookups.add_metric([label, "retry"], tier.lookups.retry)
        lookups.add_metric([label, "miss"], tier.lookups.miss)
        for direction, totals in (("write", tier.written), ("read", tier.read)):
            nbytes.add_metric([label, direction], totals.bytes)
            seconds.add_metric([label, direction], totals.seconds)
            jobs.add_metric([label, direction], totals.jobs)
        active.add_metric([label, "write"], tier.stores_in_flight)
        active.add_metric([label, "read"], tier.loads_in_flight)
        for kind, count in sorted(tier.failures.items()):
            failures.add_metric([label, kind], count)
        evictions.add_metric([label], tier.evictions)
        if tier.used_bytes is not None:
            used.add_metric([label], tier.used_bytes)
        if tier.capacity_bytes is not None:
            total.add_metric([label], tier.capacity_bytes)
        if tier.entries is not None:
            entries.add_metric([label], tier.entries)
        states = HEALTH_STATES if tier.health in HEALTH_STATES else (*HEALTH_STATES, tier.health)
        for state in states:
            health.add_metric([label, state], 1.0 if state == tier.health else 0.0)
        bp = tier.backpressure
        if bp is not None:
            pressure.add_metric([label], 1.0 if bp.active else 0.0)
            if bp.store_latency_avg is not None:
                latency.add_metric([label], bp.store_latency_avg)
            skipped_jobs.add_metric([label], bp.skipped_jobs)
            skipped_blocks.add_metric([label], bp.skipped_blocks)
        adm = tier.admission
        if adm is not None:
            admission.add_metric([label, adm.rule, "admitted"], adm.admitted_blocks)
            admission.add_metric([label, adm.rule, "declined_learned"], adm.learned_declined)
            admission.add_metric([label, adm.rule, "declined_backpressure"], adm.declined_blocks - adm.learned_declined)
        for name, value in sorted(tier.extra.items()):
            family = extra_counters if tier.extra_kinds.get(name) == "counter" else extra_gauges
            family.add_metric([label, name], value)
    for direction, (moved, secs) in transfer.items():
        nbytes.add_metric(["device", direction], moved)
        seconds.add_metric(["device", direction], secs)

    policy_families = [*_policy_families(snap), *_admission_guard_families(snap)]
    m = snap.manager
    in_flight.add_metric([], m.jobs_in_flight)
    promotions.add_metric(["started"], m.promotions_started)
    promotions.add_metric(["succeeded"], m.promotions_succeeded)
    promotions.add_metric(["failed"], m.promotions_failed)
    cascades.add_metric(["succeeded"], m.cascades_succeeded)
    cascades.add_metric(["failed"], m.cascades_failed)
    cascades.add_metric(["skipped"], m.cascades_skipped)
    for name, count in sorted(m.request_control_problems.items()):
        key, _, kind = name.partition(":")
        problems.add_metric([key, kind], count)
    sync = _histogram_family(
        "kvtier_tier_lookup_seconds", "Scheduler-side time of one tier's lookup call.", snap, "lookup_seconds"
    )
    deferred = _histogram_family(
        "kvtier_tier_lookup_async_seconds",
        "From a tier's first RETRY for a key until it answered HIT or MISS.",
        snap,
        "lookup_async_seconds",
    )
    promotion_wait = _histogram_family(
        "kvtier_promotion_wait_seconds",
        "A promotion job from this tier, from the lookup that queued it until the manager found it reported.",
        snap,
        "promotion_wait_seconds",
    )
    return [lookups, sync, deferred, promotion_wait, nbytes, seconds, jobs, active, failures, evictions, used, total,
            entries, health, pressure, latency, skipped_jobs, skipped_blocks, admission, extra_counters, extra_gauges,
            in_flight, promotions, cascades, problems, *policy_families]  # fmt: skip


def _admission_guard_families(snap: ManagerSnapshot) -> list[Metric]:
    """The families of each ``admission: learned`` tier's measured guard."""
    state = GaugeMetricFamily(
        "kvtier_admission_guard_state", "1 for the learned admission guard's current state.", labels=["tier", "state"]
    )
    hits = GaugeMetricFamily(
        "kvtier_admission_guard_hits",
        "Hits a learned admission's rule gained or lost against writing every store (estimated from its guard's "
        "sample, recent ones weighing most).", labels=["tier", "effect"],
    )  # fmt: skip
    fallbacks = CounterMetricFamily(
        "kvtier_admission_guard_fallbacks", "Times the learned admission's guard fell back to writing every store.",
        labels=["tier"],
    )  # fmt: skip
    overridden = CounterMetricFamily(
        "kvtier_admission_overridden_blocks",
        "Blocks a learned admission would have declined, written while its guard was fallen back.", labels=["tier"],
    )  # fmt: skip
    for tier in snap.tiers:
        adm = tier.admission
        if adm is None or adm.guard is None:
            continue
        for name in ADMISSION_GUARD_STATES:
            state.add_metric([tier.label, name], 1.0 if name == adm.guard else 0.0)
        hits.add_metric([tier.label, "gained"], adm.hits_gained)
        hits.add_metric([tier.label, "lost"], adm.hits_lost)
        fallbacks.add_metric([tier.label], adm.guard_fallbacks)
        overridden.add_metric([tier.label], adm.overridden_blocks)
    return [state, hits, fallbacks, overridden]


ADMISSION_GUARD_STATES = ("learning", "judging", "fallen_back")
"""The states of a learned admission's guard (:attr:`~kvtier.manager.admission_guard.ReturnWatch.state`)."""

POLICY_STATES = ("learning", "ahead", "fallen_back")
"""The states ``return-time`` reports; another policy's own state is exported beside them."""


def _policy_families(snap: ManagerSnapshot) -> list[Metric]:
    """The eviction policies' families: state, the guard's sampled hit ratios, fallbacks, other numbers."""
    state = GaugeMetricFamily(
        "kvtier_policy_state", "1 for the eviction policy's current state.", labels=["tier", "policy", "state"]
    )
    ratio = GaugeMetricFamily(
        "kvtier_policy_sampled_hit_ratio",
        "Prefix-hit ratio of the policy guard's miniature caches on the sampled keys (cache: lru, learned).",
        labels=["tier", "policy", "cache"],
    )
    fallbacks = CounterMetricFamily(
        "kvtier_policy_fallbacks", "Times the policy's guard left its learned holds for LRU order.",
        labels=["tier", "policy"],
    )  # fmt: skip
    other = GaugeMetricFamily(
        "kvtier_policy_value", "Other numbers the eviction policy reports.", labels=["tier", "policy", "name"]
    )
    named = {"sampled_hit_rate_lru": "lru", "sampled_hit_rate_learned": "learned"}
    for tier in snap.tiers:
        policy = tier.policy
        if policy is None:
            continue
        labels = [tier.label, policy.name]
        if policy.state is not None:
            states = POLICY_STATES if policy.state in POLICY_STATES else (*POLICY_STATES, policy.state)
            for name in states:
                state.add_metric([*labels, name], 1.0 if name == policy.state else 0.0)
        for name, value in sorted(policy.values.items()):
            if name in named:
                ratio.add_metric([*labels, named[name]], value)
            elif name == "fallbacks":
                fallbacks.add_metric(labels, value)
            else:
                other.add_metric([*labels, name], value)
    return [state, ratio, fallbacks, other]


class KvtierMetrics:
    """Prometheus metrics of one :class:`~kvtier.manager.TieringManager`.

    ``update(manager)`` is called from the scheduler thread; ``render()`` and the
    HTTP server started by ``serve()`` may run on any thread. ``close()`` stops
    the server (joining its thread with a timeout).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        """``registry``: where the metrics live (default: a new private one). Raises
        :class:`ConfigError` if it holds kvtier's metrics already (one registry per manager)."""
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._collector = _SnapshotCollector()
        self.lookup_seconds = Histogram(
            "kvtier_lookup_seconds", "Scheduler-side latency of one block lookup.", buckets=_LOOKUP_BUCKETS,
            registry=None,
        )  # fmt: skip
        self.step_seconds = Histogram(
            "kvtier_scheduler_step_seconds", "Scheduler-side time spent in kvtier per engine step.",
            buckets=_STEP_BUCKETS, registry=None,
        )  # fmt: skip
        # The histograms first: their names are known before any snapshot, so a registry that holds
        # kvtier's metrics already refuses them (the snapshot collector's names come with a snapshot).
        collectors: tuple[Collector, ...] = (self.lookup_seconds, self.step_seconds, self._collector)
        registered: list[Collector] = []
        try:
            for collector in collectors:
                self.registry.register(collector)
                registered.append(collector)
        except ValueError as exc:  # prometheus-client: "Duplicated timeseries in CollectorRegistry: {...}"
            for collector in registered:
                self.registry.unregister(collector)
            raise ConfigError(
                f"this registry already holds kvtier's metrics ({exc}): a KvtierMetrics exports one manager, "
                "and each needs a registry of its own: pass none (KvtierMetrics() creates a private one) or "
                "a new CollectorRegistry(), and serve or render each one"
            ) from None
        self._server: MetricsServer | None = None
        self._thread: threading.Thread | None = None

    def update(
        self,
        manager: TieringManager | ManagerSnapshot | Mapping[str, Any],
        transfer: Mapping[str, tuple[int, float]] | None = None,
    ) -> None:
        """Take ``manager.stats()`` (or a snapshot, or its mapping form) for the next scrape.

        ``transfer`` optionally adds device <-> CPU copy totals as
        ``{"device_to_cpu": (bytes, seconds), "cpu_to_device": (...)}``.
        Call from the scheduler thread (a manager's ``stats()`` is read there).
        """
        if isinstance(manager, ManagerSnapshot):
            snapshot = manager
        elif isinstance(manager, Mapping):
            snapshot = ManagerSnapshot.from_dict(manager)
        else:
            snapshot = manager.stats()
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

        ``port=0`` picks a free port; ``addr`` is an IPv4 or IPv6 address (``::1``, also
        bracketed: ``[::1]``) or a host name. Raises :class:`ConfigError` (a ``ValueError``)
        for a port that is not an int in [0, 65535] or an address that is not a non-empty string
        (``""`` would mean every interface: say ``"0.0.0.0"``), and :class:`KvtierError` if the
        port is taken or the address is not one of this machine.
        """
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(f"metrics port must be a TCP port in [0, 65535] (0 = any free port), got {port!r:.40}")
        if not isinstance(addr, str) or not addr.strip():
            # ('' would bind every interface: serving the metrics beyond this machine is a choice, '0.0.0.0')
            raise ConfigError(
                f"metrics address must be an address or host name of this machine (e.g. '127.0.0.1'; '0.0.0.0' "
                f"for every interface), got {addr!r:.40}"
            )
        if self._server is not None:
            raise KvtierError("metrics server already running; call close() first")
        from kvtier.metrics_http import MetricsServer

        host = addr[1:-1] if addr.startswith("[") and addr.endswith("]") else addr
        if not is_utf8_text(host):
            raise KvtierError(
                f"cannot serve metrics on {addr!r:.80}: not text (bytes that are not UTF-8): "
                "give an address of this machine (--metrics-addr)"
            )
        try:
            server = MetricsServer((host, port), self.render)
        except UnicodeError:  # a host name no DNS label can hold (too long, an empty label)
            raise KvtierError(
                f"cannot serve metrics on {addr!r:.80}: not a host name: "
                "give an address of this machine (--metrics-addr)"
            ) from None
        except OSError as exc:
            busy = exc.errno in (errno.EADDRINUSE, errno.EACCES)  # else the address is the problem
            fix = "pick a free --metrics-port" if busy else "give an address of this machine (--metrics-addr)"
            where = f"[{host}]" if ":" in host else host  # an IPv6 address
            if len(where) > 80:
                where = f"{where[:60]}... ({len(where)} characters)"
            raise KvtierError(f"cannot serve metrics on {where}:{port} ({exc.strerror or exc}): {fix}") from None
        thread = threading.Thread(target=server.serve_forever, name="kvtier-metrics-http", daemon=True)
        thread.start()
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
            server.close()
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise KvtierError(f"metrics server thread did not stop within {timeout}s")

    def __enter__(self) -> KvtierMetrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["HEALTH_STATES", "PRIMARY_LABEL", "KvtierMetrics"]
