"""The tier platform (kvtier.tiers.jobs): queues, shedding, deadlines, drain, shutdown, probes.

The platform is exercised through a minimal backend whose "medium" is a dict
and whose I/O can be held at a gate, so ordering and timing are under the
test's control; the tiers built on the platform are covered by the
conformance suite.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvtier.errors import TierDrainTimeout, TierError
from kvtier.keys import BlockKey, KVGeometry, Namespace, chain_ids
from kvtier.testing import new_job, wait_results
from kvtier.tiers.base import HealthState, TierContext, TierUsage
from kvtier.tiers.health import CircuitBreaker
from kvtier.tiers.jobs import ALL_LANES, READ_LANES, Lane, ThreadedTier, Work, WorkQueue
from kvtier.types import LookupResult, RequestContext

BLOCK = 4096
NS = Namespace("jobs-test", KVGeometry.from_block_bytes(BLOCK))


class GatedTier(ThreadedTier):
    """Blocks in a dict; every I/O waits at ``gate`` (set = open) and is logged in ``ran``."""

    tier_type = "gated"
    medium = "memory"

    def __init__(self, context: TierContext, *, readers: int = 0, writers: int = 1, **kwargs: Any) -> None:
        kwargs.setdefault("max_queued_stores", 100)
        kwargs.setdefault("shutdown_timeout", 5.0)
        kwargs.setdefault("breaker", CircuitBreaker(failure_threshold=2, open_seconds=0.2))
        super().__init__(context, **kwargs)
        self.data: dict[BlockKey, bytes] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.ran: list[tuple[Lane, BlockKey]] = []
        self.fail_next: str | None = None
        self.crash_next = False
        self.probe_ok = True
        self.probes = 0
        self.abandoned: list[Work] = []
        if readers:
            self._start_workers(readers, READ_LANES, "read")
        self._start_workers(writers, ALL_LANES, "io")

    def _lookup(self, key: BlockKey, request: RequestContext | None) -> LookupResult:
        return LookupResult.HIT if key in self.data else LookupResult.MISS

    def _holds(self, key: BlockKey) -> bool:
        return key in self.data

    def _admit_load(self, key: BlockKey) -> bool:
        return key in self.data

    def _abandon(self, work: Work) -> None:
        self.abandoned.append(work)

    def _probe(self) -> None:
        self.probes += 1
        if not self.probe_ok:
            raise OSError("still down")

    def _run(self, work: Work, local: Any) -> None:
        assert self.gate.wait(10), "gate never opened"
        key, slot = work.keys[0], work.slots[0]
        self.ran.append((work.lane, key))
        if self.crash_next:
            self.crash_next = False
            raise RuntimeError("bug in the backend")
        if self.fail_next is not None:
            detail, self.fail_next = self.fail_next, None
            self._note_failure(detail)
            self._complete(work, error=detail)
            return
        row = self._row(slot)
        try:
            if work.lane is Lane.STORE:
                self.data[key] = bytes(row)
                self._emit([key], removed=False)
            else:
                row[:] = self.data[key]
        finally:
            row.release()
        self._breaker.record_success()
        self._complete(work, ok=[key], nbytes=BLOCK)

    def usage(self) -> TierUsage:
        return TierUsage(len(self.data) * BLOCK, None, len(self.data))


@pytest.fixture
def make() -> Iterator[Any]:
    made: list[GatedTier] = []

    def build(num_rows: int = 32, **kwargs: Any) -> tuple[GatedTier, np.ndarray]:
        rows = np.random.default_rng(len(made)).integers(0, 256, (num_rows, BLOCK), dtype=np.uint8)
        tier = GatedTier(TierContext(rows, BLOCK, NS), **kwargs)
        made.append(tier)
        return tier, rows

    yield build
    for tier in made:
        tier.gate.set()
        tier.shutdown()


def test_queue_serves_lanes_in_priority_order() -> None:
    queue = WorkQueue()
    works = [Work(Lane.BACKGROUND), Work(Lane.STORE), Work(Lane.LOAD), Work(Lane.EXISTS), Work(Lane.LOAD)]
    queue.put(works)
    assert queue.get(READ_LANES, 0.0) is works[3]
    assert queue.get(frozenset({Lane.STORE}), 0.0) is works[1]
    order = [queue.get(ALL_LANES, 0.0) for _ in range(3)]
    assert order == [works[2], works[4], works[0]]
    assert queue.get(ALL_LANES, 0.01) is None
    queue.put([Work(Lane.STORE)])
    assert len(queue.close()) == 1 and queue.closed
    assert queue.get(ALL_LANES, 1.0) is None
    with pytest.raises(TierError):
        queue.put([Work(Lane.LOAD)])


def test_loads_run_before_queued_stores(make: Any) -> None:
    tier, _ = make()
    keys = chain_ids(range(6), NS)
    tier.data[keys[5]] = b"\x01" * BLOCK
    tier.gate.clear()
    tier.submit_store(new_job(keys[:1], [0], False))  # taken by the only thread, held at the gate
    time.sleep(0.05)
    tier.submit_store(new_job(keys[1:4], [1, 2, 3], False))
    tier.submit_load(new_job([keys[5]], [10], True))
    tier.gate.set()
    tier.drain(5)
    lanes = [lane for lane, _ in tier.ran]
    assert lanes == [Lane.STORE, Lane.LOAD, Lane.STORE, Lane.STORE, Lane.STORE]


def test_read_threads_never_take_stores(make: Any) -> None:
    tier, _ = make(readers=2, writers=1)
    keys = chain_ids(range(4), NS)
    tier.data[keys[3]] = bytes(BLOCK)
    tier.gate.clear()
    tier.submit_store(new_job(keys[:2], [0, 1], False))
    time.sleep(0.05)
    # the writer holds one store; the other waits for it although two read threads are idle
    assert tier._queue.queued(Lane.STORE) == 1
    tier.submit_load(new_job([keys[3]], [9], True))
    time.sleep(0.05)
    assert tier._queue.queued(Lane.LOAD) == 0, "an idle read thread must take the load at once"
    tier.gate.set()
    tier.drain(5)


def test_stores_are_shed_when_the_queue_is_full(make: Any) -> None:
    tier, _ = make(max_queued_stores=2)
    keys = chain_ids(range(5), NS)
    tier.gate.clear()
    first = new_job(keys[:1], [0], False)
    tier.submit_store(first)
    time.sleep(0.05)  # the thread holds it; the queue is empty
    fill = new_job(keys[1:3], [1, 2], False)
    shed = new_job(keys[3:5], [3, 4], False)
    tier.submit_store(fill)
    tier.submit_store(shed)
    tier.gate.set()
    results = wait_results(tier, {first.job_id, fill.job_id, shed.job_id}, 5)
    assert results[first.job_id].success and results[fill.job_id].success
    assert not results[shed.job_id].success and "write queue full" in (results[shed.job_id].error or "")
    assert tier.stats.stores_dropped == 2 and tier.stats.stores_failed == 0
    assert tier.stats.stores_submitted == 5


def test_held_keys_are_skipped_and_reported_as_stored(make: Any) -> None:
    tier, _ = make()
    keys = chain_ids(range(2), NS)
    tier.data[keys[0]] = bytes(BLOCK)
    job = new_job(keys, [0, 1], False)
    tier.submit_store(job)
    result = wait_results(tier, {job.job_id}, 5)[job.job_id]
    assert result.success and [k for _, k in tier.ran] == [keys[1]]
    assert tier.stats.extra["stores_skipped"] == 1


def test_job_deadline_fails_work_still_queued(make: Any) -> None:
    tier, _rows = make(job_timeout=0.1)
    keys = chain_ids(range(3), NS)
    for key in keys:
        tier.data[key] = bytes(BLOCK)
    tier.gate.clear()
    job = new_job(keys, [0, 1, 2], True)
    tier.submit_load(job)
    time.sleep(0.3)
    tier.gate.set()
    result = wait_results(tier, {job.job_id}, 5)[job.job_id]
    assert result.succeeded(keys) == [keys[0]], "only the block already running may finish"
    assert "deadline" in (result.error or "")
    assert len(tier.abandoned) == 2 and tier.stats.loads_failed == 2


def test_drain_raises_after_its_deadline_and_keeps_results(make: Any) -> None:
    tier, _ = make()
    keys = chain_ids(range(1), NS)
    tier.gate.clear()
    job = new_job(keys, [0], False)
    tier.submit_store(job)
    t0 = time.monotonic()
    with pytest.raises(TierDrainTimeout, match="1 job"):
        tier.drain(0.2)
    assert 0.15 < time.monotonic() - t0 < 2.0
    assert tier.has_pending_work()
    tier.gate.set()
    tier.drain(5)
    assert [r.job_id for r in tier.poll_finished()] == [job.job_id]
    assert not tier.has_pending_work()


def test_duplicate_job_id_in_flight_is_refused(make: Any) -> None:
    tier, _ = make()
    keys = chain_ids(range(2), NS)
    tier.gate.clear()
    job = new_job(keys[:1], [0], False)
    tier.submit_store(job)
    with pytest.raises(TierError, match="already in flight"):
        tier.submit_store(job)
    with pytest.raises(TierError, match="keys but"):
        tier.submit_store(new_job(keys, [0], False))
    tier.gate.set()
    assert wait_results(tier, {job.job_id}, 5)[job.job_id].success


def test_a_backend_bug_fails_the_job_and_the_thread_keeps_serving(make: Any, caplog: Any) -> None:
    tier, _ = make()
    keys = chain_ids(range(2), NS)
    tier.crash_next = True
    bad = new_job(keys[:1], [0], False)
    tier.submit_store(bad)
    result = wait_results(tier, {bad.job_id}, 5)[bad.job_id]
    assert not result.success and "RuntimeError: bug in the backend" in (result.error or "")
    assert "bug in the backend" in caplog.text
    good = new_job(keys[1:], [1], False)
    tier.submit_store(good)
    assert wait_results(tier, {good.job_id}, 5)[good.job_id].success


def test_breaker_sheds_then_a_probe_brings_the_tier_back(make: Any) -> None:
    tier, _ = make()
    keys = chain_ids(range(4), NS)
    tier.data[keys[3]] = bytes(BLOCK)
    for i in range(2):
        tier.fail_next = "medium down"
        job = new_job([keys[i]], [i], False)
        tier.submit_store(job)
        wait_results(tier, {job.job_id}, 5)
    assert tier.health().state is HealthState.OPEN
    assert tier.lookup(keys[3], None) is LookupResult.MISS
    store, load = new_job([keys[2]], [2], False), new_job([keys[3]], [3], True)
    tier.probe_ok = False
    tier.submit_store(store)
    tier.submit_load(load)
    results = wait_results(tier, {store.job_id, load.job_id}, 5)
    assert "out of service" in (results[store.job_id].error or "")
    assert not results[load.job_id].success
    assert tier.stats.stores_dropped == 1 and tier.stats.loads_failed == 1
    deadline = time.monotonic() + 5
    while tier.probes < 1:
        assert time.monotonic() < deadline, "no probe while half-open"
        time.sleep(0.01)
    assert tier.health().state is not HealthState.CLOSED
    tier.probe_ok = True
    while tier.health().state is not HealthState.CLOSED:
        assert time.monotonic() < deadline, "a successful probe must close the breaker"
        time.sleep(0.01)
    assert tier.lookup(keys[3], None) is LookupResult.HIT


def test_shutdown_fails_queued_work_joins_threads_and_is_idempotent(make: Any) -> None:
    tier, _ = make(readers=1, writers=1)
    keys = chain_ids(range(3), NS)
    tier.gate.clear()
    running = new_job(keys[:1], [0], False)
    tier.submit_store(running)
    time.sleep(0.05)
    queued = new_job(keys[1:], [1, 2], False)
    tier.submit_store(queued)
    names = [t.name for t in tier._threads]
    assert names == ["kvtier-gated-0-read-0", "kvtier-gated-0-io-0"]
    opener = threading.Timer(0.2, tier.gate.set)
    opener.start()
    tier.shutdown()
    opener.join()
    results = {r.job_id: r for r in tier.poll_finished()}
    assert results[running.job_id].success, "a running job finishes"
    assert "shut down" in (results[queued.job_id].error or "")
    assert len(tier.abandoned) == 2
    assert not any(t.name.startswith("kvtier-gated-0") for t in threading.enumerate())
    assert tier.context.rows.size == 0
    tier.shutdown()
    with pytest.raises(TierError, match="shut down"):
        tier.submit_load(new_job(keys[:1], [0], True))
    assert tier.lookup(keys[0], None) is LookupResult.MISS


def test_shutdown_raises_while_a_thread_is_stuck_and_retries(make: Any) -> None:
    tier, _ = make(shutdown_timeout=0.2)
    keys = chain_ids(range(1), NS)
    tier.gate.clear()
    tier.submit_store(new_job(keys, [0], False))
    time.sleep(0.05)
    with pytest.raises(TierError, match="did not stop"):
        tier.shutdown()
    assert tier.context.rows.size > 0, "rows must stay while a thread may still use them"
    tier.gate.set()
    tier.shutdown()
    assert tier.context.rows.size == 0
