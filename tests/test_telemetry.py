"""The typed snapshot of TieringManager.stats(): per-tier figures the manager observes, one label scheme."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tier_doubles
from kvtier import LookupResult, Namespace, RequestContext, TieringManager, prefix_keys
from kvtier.metrics import KvtierMetrics
from kvtier.telemetry import (
    LOOKUP_SECONDS_BUCKETS,
    PROMOTION_WAIT_SECONDS_BUCKETS,
    HistogramSnapshot,
    LatencyHistogram,
    ManagerSnapshot,
    TierSnapshot,
    TierTelemetry,
)
from kvtier.tiers.base import ExtraMetric, TierContext
from kvtier.tiers.registry import register_tier
from kvtier.types import PRIMARY_LABEL, tier_label
from test_metrics import samples
from tier_doubles import ScriptedTier

HIT, HIT_PENDING, RETRY, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY, LookupResult.MISS


class _CountingTier(ScriptedTier):
    """A scripted tier that declares one counter and one gauge of its own and reports job bytes."""

    tier_type = "counting"
    extra_metrics = {
        "widgets": ExtraMetric("counter", "Widgets made."),
        "temperature": ExtraMetric("gauge", "How hot it runs."),
    }

    def __init__(self, context: TierContext, **options: Any) -> None:
        super().__init__(context, **options)
        self.stats.extra.update({"widgets": 0.0, "temperature": 0.0, "undeclared": 0.0})

    def complete_all(self, success: bool = True) -> None:
        jobs = list(self.queued)
        super().complete_all(success)
        for job, result in zip(jobs, self.finished[-len(jobs):], strict=True):
            done = len(result.successful_keys or ())
            result.bytes_moved = done * self.context.block_bytes
            result.seconds = 0.25 * len(job.keys)


register_tier("scripted", "tier_doubles:ScriptedTier")
register_tier("counting", "test_telemetry:_CountingTier")


def _exported(snap: ManagerSnapshot) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample kvtier's Prometheus exporter renders for ``snap``: {(name, sorted labels): value}."""
    metrics = KvtierMetrics()
    metrics.update(snap)
    return samples(metrics)


def keys(n: int, seed: int = 0) -> list[bytes]:
    return prefix_keys(np.arange(n * 4) + seed * 100_000, 4)


def store(mgr: TieringManager, ks: list[bytes], req: RequestContext) -> None:
    result = mgr.prepare_store(ks, req)
    assert result is not None
    for slot in result.slots:
        mgr.rows[int(slot), : mgr.block_bytes] = 5
    mgr.complete_store(result.keys_to_store, req)


@pytest.fixture
def mgr(namespace: Namespace, private_shm: Path) -> Any:
    tier_doubles.CALLS.clear()
    manager = TieringManager.create(
        namespace=namespace, num_cpu_blocks=16, shm_dir=private_shm,
        tiers=[{"type": "counting", "name": "a"}, {"type": "scripted", "name": "b"}],
    )
    yield manager
    manager.shutdown()


def test_histogram_buckets_follow_prometheus_le_semantics() -> None:
    hist = LatencyHistogram((1.0, 2.0))
    for value in (0.5, 1.0, 1.5, 2.0, 7.0):
        hist.observe(value)
    snap = hist.snapshot()
    assert snap.counts == (2, 2, 1)
    assert snap.count == 5 and snap.sum == pytest.approx(12.0)
    assert snap.cumulative() == [("1.0", 2), ("2.0", 4), ("+Inf", 5)]
    hist.keep_samples(2)
    for value in (0.1, 0.2, 0.3):
        hist.observe(value)
    assert hist.take_samples() == [0.1, 0.2], "samples are kept up to the limit"
    assert hist.take_samples() == []
    assert hist.snapshot().count == 8, "every observation is counted, kept or not"


def test_snapshot_is_typed_and_labels_follow_one_scheme(mgr: TieringManager) -> None:
    req = RequestContext("r")
    ks = keys(4)
    store(mgr, ks, req)
    mgr.on_schedule_end()
    for key in ks:
        assert mgr.lookup(key, req) is HIT
    events = mgr.take_events()
    snap = mgr.stats()
    assert isinstance(snap, ManagerSnapshot) and all(isinstance(t, TierSnapshot) for t in snap.tiers)
    assert [t.label for t in snap.tiers] == [PRIMARY_LABEL, "1:counting", "2:scripted"]
    assert [t.label for t in snap.tiers] == [mgr.tier_label(i) for i in range(3)]
    assert tier_label(2, "scripted") == "2:scripted"
    assert {e.tier for e in events} <= {t.label for t in snap.tiers}
    assert {e.tier for e in events if e.medium == "cpu"} == {PRIMARY_LABEL}
    assert snap.tier("1:counting") is snap.tiers[1] and snap.cpu is snap.tiers[0]
    with pytest.raises(KeyError, match="no tier labelled"):
        snap.tier("9:nope")

    cpu = snap.cpu
    assert cpu.lookups.hit == 4 and cpu.lookups.queries == 4
    assert cpu.written.blocks == 4 and cpu.written.bytes == 4 * mgr.block_bytes
    assert cpu.entries == 4 and cpu.capacity_bytes == 16 * mgr.region.row_stride
    a = snap.tier("1:counting")
    assert a.written.jobs == 1 and a.written.blocks == 4
    assert a.written.bytes == 4 * mgr.block_bytes and a.written.seconds == pytest.approx(1.0)
    assert a.entries == 4 and a.health == "closed" and a.locality == "local"
    assert a.stores_in_flight == 0 and a.loads_in_flight == 0
    assert a.backpressure is not None and not a.backpressure.active
    # the mapping form is JSON-able and keeps the layout of the untyped stats() of earlier releases
    data = json.loads(json.dumps(snap.as_dict()))
    assert data["primary"]["hits"] == 4 and data["primary"]["capacity_blocks"] == 16
    assert data["tiers"]["1:counting"]["written"]["bytes"] == 4 * mgr.block_bytes
    assert data["manager"]["cascades_succeeded"] == 8
    assert ManagerSnapshot.from_dict(data).tier("1:counting").written == a.written


def test_lookup_latency_histograms_sync_and_async(mgr: TieringManager) -> None:
    req = RequestContext("r")
    a = mgr.tiers[0]
    assert isinstance(a, ScriptedTier)
    missing = keys(64, seed=3)
    for key in missing:
        assert mgr.lookup(key, req) is MISS
    mgr.on_schedule_end()
    # A key first answered RETRY, then (a step later) HIT: the wait is timed.
    pending = keys(1, seed=5)[0]
    a.data[pending] = bytes(mgr.block_bytes)
    a.retry_keys.add(pending)
    assert mgr.lookup(pending, req) is RETRY
    mgr.on_schedule_end()
    time.sleep(0.02)
    a.retry_keys.clear()
    assert mgr.lookup(pending, req) is HIT_PENDING
    snap = mgr.stats()
    every = mgr.lookup_timing_every
    for tier in snap.tiers:
        assert tier.lookup_seconds.count >= 64 // every, tier.label
        assert tier.lookup_seconds.bounds == LOOKUP_SECONDS_BUCKETS
    async_a = snap.tier("1:counting").lookup_async_seconds
    assert async_a.count == 1 and async_a.sum >= 0.02
    assert snap.tier("2:scripted").lookup_async_seconds.count == 0
    assert snap.tier("1:counting").lookups.retry == 0, "the double does not count its own answers"


def test_promotion_wait_is_one_observation_per_job_from_its_queue_to_the_poll(mgr: TieringManager) -> None:
    """The wait a request pays for blocks promoted from a tier: from the lookup that queued the
    job, through the step end that submits it, to the next step's poll that finds it reported."""
    a, b = mgr.tiers
    assert isinstance(a, _CountingTier) and isinstance(b, ScriptedTier)
    a.auto_complete = False
    req = RequestContext("r")
    ks = keys(3, seed=7)
    for key in ks:
        a.data[key] = bytes(mgr.block_bytes)
    assert [mgr.lookup(key, req) for key in ks] == [HIT_PENDING] * 3
    time.sleep(0.02)  # the rest of the step that queued the promotions
    mgr.on_schedule_end()
    assert len(a.queued) == 1, "one job for the request's three blocks"
    time.sleep(0.03)  # the tier reads
    a.complete_all()
    assert mgr.stats().tier("1:counting").promotion_wait_seconds.count == 0, "reported, not yet polled"
    time.sleep(0.01)  # until the next step
    assert mgr.lookup(ks[0], req) is HIT  # the step's poll finds the job done
    snap = mgr.stats()
    wait = snap.tier("1:counting").promotion_wait_seconds
    assert wait.bounds == PROMOTION_WAIT_SECONDS_BUCKETS
    assert wait.count == 1 and 0.06 <= wait.sum < 30, wait
    # the manager's own clock, not the job time the tier reports (this double says 0.25 s a block)
    assert snap.tier("1:counting").read.seconds == pytest.approx(0.75) and wait.sum < 0.75
    assert snap.tier("2:scripted").promotion_wait_seconds.count == 0 and snap.cpu.promotion_wait_seconds.count == 0
    again = ManagerSnapshot.from_dict(json.loads(json.dumps(snap.as_dict())))
    assert again.tier("1:counting").promotion_wait_seconds == wait
    got = _exported(snap)
    assert got[("kvtier_promotion_wait_seconds_count", (("tier", "1:counting"),))] == 1
    assert got[("kvtier_promotion_wait_seconds_sum", (("tier", "1:counting"),))] == pytest.approx(wait.sum)
    assert got[("kvtier_promotion_wait_seconds_bucket", (("le", "0.05"), ("tier", "1:counting")))] == 0
    assert got[("kvtier_promotion_wait_seconds_bucket", (("le", "0.1"), ("tier", "1:counting")))] == (
        1 if wait.sum <= 0.1 else 0
    )


def test_a_promotion_reported_after_it_became_overdue_is_no_wait(namespace: Namespace, private_shm: Path) -> None:
    """Regression (review, 2026-12-04): past the wait deadline the lookups answer MISS and the engine
    recomputes; the job's late report is no request's wait (it counts ``job_overdue``)."""
    manager = TieringManager.create(namespace=namespace, num_cpu_blocks=16, shm_dir=private_shm,
                                    tiers=[{"type": "scripted", "name": "a"}], wait_timeout=0.05)  # fmt: skip
    try:
        (a,) = manager.tiers
        assert isinstance(a, ScriptedTier)
        a.auto_complete = False
        req = RequestContext("r")
        late, in_time = keys(2, seed=9)
        a.data[late] = a.data[in_time] = bytes(manager.block_bytes)
        assert manager.lookup(late, req) is HIT_PENDING
        manager.on_schedule_end()
        time.sleep(0.1)
        assert manager.lookup(late, req) is MISS, "waited past the deadline"
        manager.on_schedule_end()
        a.complete_all()
        assert manager.lookup(in_time, req) is HIT_PENDING  # this step's poll reports the late job
        manager.on_schedule_end()
        a.complete_all()
        assert manager.lookup(in_time, req) is HIT
        tier = manager.stats().tier("1:scripted")
        assert tier.failures.get("job_overdue") == 1
        assert tier.read.jobs == 2 and tier.promotion_wait_seconds.count == 1, tier.promotion_wait_seconds
        assert tier.promotion_wait_seconds.sum < 0.1
    finally:
        manager.shutdown()


def test_step_end_folds_a_full_histogram_of_every_kind() -> None:
    """Pending observations are folded at step end once FOLD_AT are pending, whatever histogram holds
    them, so a manager whose stats are never read keeps no growing list."""
    telemetry = TierTelemetry()
    histograms = (telemetry.lookup_seconds, telemetry.lookup_async_seconds, telemetry.promotion_wait_seconds)
    for histogram in histograms:
        histogram.pending.extend([0.001] * (LatencyHistogram.FOLD_AT - 1))
    telemetry.fold_full()
    assert [len(h.pending) for h in histograms] == [LatencyHistogram.FOLD_AT - 1] * 3
    assert [h.count for h in histograms] == [0, 0, 0]
    for histogram in histograms:
        histogram.pending.append(0.001)
    telemetry.fold_full()
    assert [len(h.pending) for h in histograms] == [0, 0, 0]
    assert [h.count for h in histograms] == [LatencyHistogram.FOLD_AT] * 3


def test_job_failures_by_kind_and_active_jobs(mgr: TieringManager) -> None:
    a, b = mgr.tiers
    assert isinstance(a, ScriptedTier) and isinstance(b, ScriptedTier)
    a.auto_complete = b.auto_complete = False
    req = RequestContext("r")
    ks = keys(3)
    store(mgr, ks, req)
    snap = mgr.stats()
    assert [t.stores_in_flight for t in snap.secondary] == [1, 1]
    assert snap.manager.jobs_in_flight == 2
    a.complete_all(success=False)
    b.complete_all()
    mgr.on_schedule_end()
    mgr.on_schedule_end()  # results are polled once per step: the next step picks them up
    snap = mgr.stats()
    assert [t.stores_in_flight for t in snap.secondary] == [0, 0]
    assert snap.tier("1:counting").failures["cascade_job_failed"] == 1
    assert snap.tier("2:scripted").failures.get("cascade_job_failed", 0) == 0

    # a promotion job that fails
    b.data.clear()
    other = keys(2, seed=9)
    a.data.update({k: bytes(mgr.block_bytes) for k in other})
    a.fail_keys.update(other)
    assert mgr.lookup(other[0], req) is HIT_PENDING
    mgr.on_schedule_end()
    assert mgr.stats().tier("1:counting").loads_in_flight == 1
    a.complete_all()
    mgr.on_schedule_end()
    snap = mgr.stats()
    assert snap.tier("1:counting").failures["promotion_job_failed"] == 1
    assert snap.manager.promotions_failed == 1
    assert snap.tier("1:counting").loads_in_flight == 0

    # a tier that refuses a job, and one whose scheduler-side call raises
    def refuse(job: Any) -> None:
        raise RuntimeError("queue gone")

    b.submit_store = refuse  # type: ignore[method-assign]
    store(mgr, keys(1, seed=11), req)

    def broken(key: bytes, request: Any) -> LookupResult:
        raise RuntimeError("index gone")

    b.lookup = broken  # type: ignore[method-assign]
    assert mgr.lookup(keys(1, seed=12)[0], req) is MISS
    snap = mgr.stats()
    assert snap.tier("2:scripted").failures["submit_error"] == 1
    assert snap.tier("2:scripted").failures["call_error"] == 1
    assert snap.manager.tier_call_errors == 1


def test_tier_declared_extra_metrics_reach_prometheus(mgr: TieringManager) -> None:
    a = mgr.tiers[0]
    a.stats.extra.update(widgets=7.0, temperature=41.5, undeclared=3.0)
    snap = mgr.stats()
    assert snap.tier("1:counting").extra_kinds == {"widgets": "counter", "temperature": "gauge", "undeclared": "gauge"}
    got = _exported(snap)
    assert got[("kvtier_tier_extra_counter_total", (("name", "widgets"), ("tier", "1:counting")))] == 7.0
    assert got[("kvtier_tier_extra_gauge", (("name", "temperature"), ("tier", "1:counting")))] == 41.5
    assert got[("kvtier_tier_extra_gauge", (("name", "undeclared"), ("tier", "1:counting")))] == 3.0


def test_extra_metric_kind_is_checked() -> None:
    with pytest.raises(ValueError, match="counter"):
        ExtraMetric("histogram")


def test_histogram_snapshot_empty_has_a_bucket_past_the_last_bound() -> None:
    snap = HistogramSnapshot.empty((1.0, 2.0))
    assert snap.counts == (0, 0, 0) and snap.cumulative()[-1] == ("+Inf", 0)


def test_a_tier_adding_extra_metrics_while_stats_are_read_is_no_call_error(mgr: TieringManager) -> None:
    """Review (2026-12-05): the S3 and Redis tiers create some declared extras on first count, on
    their I/O threads (uploads_found, foreign_format, create_conflicts, ...); a snapshot iterating
    ``stats.extra`` meanwhile raised "dictionary changed size during iteration", counted as the
    tier's call_error with a traceback in the log. The snapshot copies the dict in one step."""
    import sys
    import threading

    extra = mgr.tiers[0].stats.extra
    stop = threading.Event()

    def churn() -> None:  # (as I/O threads counting new names would)
        i = 0
        while not stop.is_set():
            extra[f"new_{i % 64}"] = 1.0
            if i % 64 == 63:
                for j in range(64):
                    extra.pop(f"new_{j}", None)
            i += 1

    extra.update({f"steady_{i}": float(i) for i in range(2000)})
    worker = threading.Thread(target=churn, daemon=True)
    switching = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # (threads take turns often: the race shows within a few snapshots)
    worker.start()
    try:
        for _ in range(30):
            snap = mgr.stats()
            assert snap.tier("1:counting").extra.get("steady_1999") == 1999.0, snap.tier("1:counting").failures
    finally:
        sys.setswitchinterval(switching)
        stop.set()
        worker.join(10)
    assert mgr.stats().tier("1:counting").failures.get("call_error", 0) == 0
