"""A conformance suite for secondary tiers: every tier, in-tree or not, must pass it.

It checks the contract of :mod:`kvtier.tiers.base` with real bytes: store and
load byte-exact through a real :class:`~kvtier.manager.TieringManager` (a real
region in /dev/shm), partial success, corrupt values (MISS, counted, dropped),
namespace isolation, lookup answers and RETRY semantics, drain with a
deadline, results reported exactly once, shutdown idempotence and thread
cleanup, health transitions during an outage of the medium (scheduler calls
stay under 50 ms), usage, events, warm restart for persistent tiers, and that
failures logged while a handler keeps every record (a corrupt value, an
outage) leave no view of the CPU rows behind: the manager still releases its
region at shutdown.

Use it from pytest (``pip install 'kvtier[test]'``) with a :class:`TierHarness`
that says how to build your tier and, optionally, how to damage a stored
value and take the medium away::

    import pytest
    from kvtier.testing import TierConformance, TierHarness

    class MyHarness(TierHarness):
        def spec(self):
            return {"type": "mypkg.tiers:MyTier", "endpoint": "..."}

    class TestMyTier(TierConformance):
        @pytest.fixture
        def harness(self):
            return MyHarness()

Tests that need a capability the harness does not offer (``damage``,
``outage``, ``persistent``) are skipped, with the reason. The helpers of this
module (:func:`resolve`, :func:`run_job`, :class:`TierFactory`) are public for
tier-specific tests too.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import logging.handlers
import mmap
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.errors import TierDrainTimeout, TierError
from kvtier.keys import BlockKey, KVGeometry, Namespace, chain_ids
from kvtier.manager import TieringManager
from kvtier.tiers.base import HealthState, JobResult, SecondaryTier, TierContext, TransferJob
from kvtier.tiers.registry import create_tier
from kvtier.types import LookupResult, RequestContext

SCHEDULER_CALL_LIMIT = 0.05
"""Seconds any scheduler-thread call of a tier may take, even while its medium hangs or is gone."""

_job_ids = itertools.count(1)


class TierHarness:
    """How the suite builds and disturbs one kind of tier. Subclass it; override what you can.

    ``block_bytes`` is the block size of the tests (keep it small for slow
    media); ``wait_seconds`` bounds every wait for asynchronous work;
    ``persistent`` says a new tier with the same options finds what an earlier
    one stored (a shared or durable medium).
    """

    block_bytes: int = 64 * 1024
    wait_seconds: float = 20.0
    persistent: bool = False

    def spec(self) -> dict[str, Any]:
        """``{"type": name_or_import_path, **options}`` as in a config file's ``tiers:`` list."""
        raise NotImplementedError

    def fast_failure_options(self) -> dict[str, Any]:
        """Options that make an outage surface within a few seconds (short timeouts, low thresholds)."""
        return {}

    def make(self, context: TierContext, **overrides: Any) -> SecondaryTier:
        """Build the tier as the manager would: through the registry."""
        return create_tier({**self.spec(), **overrides}, context)

    def damage(self, tier: SecondaryTier, key: BlockKey) -> bool:
        """Corrupt the stored value of ``key`` in the medium (flip payload bytes); False if unsupported."""
        return False

    @contextlib.contextmanager
    def outage(self) -> Iterator[bool]:
        """While inside, the medium is unreachable (yield True) or hangs; yield False if unsupported.

        On exit the medium must be back (possibly empty) and usable by the tier.
        """
        yield False


def make_namespace(block_bytes: int, model: str | None = None) -> Namespace:
    """A fresh namespace (a unique model id), so tests never see each other's blocks on a shared medium."""
    return Namespace(model or f"conformance-{uuid.uuid4().hex[:12]}", KVGeometry.from_block_bytes(block_bytes))


class AlignedRows:
    """Page-aligned CPU rows in anonymous memory (like the shared region's), filled with random bytes."""

    def __init__(self, num_rows: int, block_bytes: int, seed: int = 0) -> None:
        page = mmap.PAGESIZE
        self.stride = -(-block_bytes // page) * page
        self._mm = mmap.mmap(-1, num_rows * self.stride)
        self.rows = np.frombuffer(self._mm, dtype=np.uint8).reshape(num_rows, self.stride)
        self.rows[:, :block_bytes] = np.random.default_rng(seed).integers(
            0, 256, (num_rows, block_bytes), dtype=np.uint8
        )

    def close(self) -> None:
        del self.rows
        with contextlib.suppress(BufferError):  # a tier that kept a view fails its own test
            self._mm.close()


class TierFactory:
    """Builds tiers over private rows and shuts every one down at the end of the test."""

    def __init__(self, harness: TierHarness) -> None:
        self.harness = harness
        self._made: list[tuple[SecondaryTier, AlignedRows]] = []

    def __call__(
        self, namespace: Namespace | None = None, num_rows: int = 16, seed: int = 0, **overrides: Any
    ) -> tuple[SecondaryTier, np.ndarray]:
        bb = self.harness.block_bytes
        rows = AlignedRows(num_rows, bb, seed)
        context = TierContext(rows.rows, bb, namespace or make_namespace(bb), index=1)
        try:
            tier = self.harness.make(context, **overrides)
        except BaseException:
            rows.close()
            raise
        self._made.append((tier, rows))
        return tier, rows.rows

    def close(self) -> None:
        errors = []
        for tier, rows in reversed(self._made):
            try:
                tier.shutdown()
            except Exception as exc:
                errors.append(exc)
            rows.close()
        self._made.clear()
        if errors:
            raise errors[-1]


def new_job(keys: list[BlockKey], slots: list[int], promotion: bool) -> TransferJob:
    return TransferJob(next(_job_ids), list(keys), np.asarray(slots, dtype=np.int64), promotion)


def wait_results(tier: SecondaryTier, job_ids: set[int], timeout: float) -> dict[int, JobResult]:
    """Poll like the scheduler (one ``poll_finished`` + ``on_schedule_end`` per step) until every job reported.

    Fails on a job reported twice or a result for a job never submitted.
    """
    got: dict[int, JobResult] = {}
    deadline = time.monotonic() + timeout
    while set(got) != job_ids:
        assert time.monotonic() < deadline, f"jobs {sorted(job_ids - set(got))} not reported within {timeout}s"
        for result in tier.poll_finished():
            assert result.job_id in job_ids, f"result for unknown job {result.job_id}"
            assert result.job_id not in got, f"job {result.job_id} reported twice"
            got[result.job_id] = result
        tier.on_schedule_end()
        time.sleep(0.002)
    return got


def run_job(tier: SecondaryTier, keys: list[BlockKey], slots: list[int], promotion: bool, timeout: float) -> JobResult:
    """Submit one store (``promotion`` False) or load job and wait for its result."""
    job = new_job(keys, slots, promotion)
    if promotion:
        tier.submit_load(job)
    else:
        tier.submit_store(job)
    return wait_results(tier, {job.job_id}, timeout)[job.job_id]


def resolve(tier: SecondaryTier, key: BlockKey, timeout: float) -> LookupResult:
    """Ask like the scheduler, one step at a time, until the answer is not RETRY (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        answer = tier.lookup(key, None)
        if answer is not LookupResult.RETRY:
            return answer
        assert time.monotonic() < deadline, f"lookup of {key.hex()[:16]} still RETRY after {timeout}s"
        tier.on_schedule_end()
        time.sleep(0.002)


def wait_for(
    condition: Callable[[], bool], timeout: float, what: str, step: Callable[[], object] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout}s"
        if step is not None:
            step()
        time.sleep(0.005)


def _store_through(mgr: TieringManager, keys: list[BlockKey], harness: TierHarness, wait: bool = True) -> None:
    """Store ``keys`` (random bytes) through the manager, then (``wait``) until every cascade ended."""
    req = RequestContext(f"conformance-store-{uuid.uuid4().hex[:8]}")
    mgr.on_new_request(req)
    plan = mgr.prepare_store(keys, req)
    if plan is not None:
        rng = np.random.default_rng(len(keys))
        for slot in plan.slots:
            mgr.rows[slot, : harness.block_bytes] = rng.integers(0, 256, harness.block_bytes, dtype=np.uint8)
        mgr.complete_store(list(plan.keys_to_store), req)
    mgr.on_request_finished(req)
    mgr.on_schedule_end()
    if wait:
        wait_for(lambda: not mgr.has_pending_work(), harness.wait_seconds, "cascades finished", mgr.on_schedule_end)


def _promote_through(
    mgr: TieringManager, keys: list[BlockKey], harness: TierHarness, wait: bool = True
) -> list[LookupResult]:
    """Look ``keys`` up step by step (promotions run) until each answer is final: HIT or MISS."""
    req = RequestContext(f"conformance-load-{uuid.uuid4().hex[:8]}")
    mgr.on_new_request(req)
    deadline = time.monotonic() + harness.wait_seconds
    while True:
        answers = [mgr.lookup(k, req) for k in keys]
        mgr.on_schedule_end()
        final = all(a in (LookupResult.HIT, LookupResult.MISS) for a in answers) and not mgr.has_pending_work()
        if final or not wait:
            break
        assert time.monotonic() < deadline, f"lookups not final within {harness.wait_seconds}s: {answers}"
        time.sleep(0.002)
    mgr.on_request_finished(req)
    mgr.on_schedule_end()
    return answers


class _Timed:
    """Wraps scheduler-thread calls and remembers the slowest one."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.worst_call = ""

    def __call__(self, name: str, call: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return call(*args)
        finally:
            took = time.perf_counter() - t0
            if took > self.worst:
                self.worst, self.worst_call = took, name


@contextlib.contextmanager
def keeping_every_record() -> Iterator[logging.handlers.MemoryHandler]:
    """A handler on the root logger that keeps every record at any level (as a log shipper or
    pytest's capture does) while inside; on exit it checks that no record holds an exception
    object (in ``exc_info`` or its arguments), which would keep its frames alive."""
    keeper = logging.handlers.MemoryHandler(capacity=1 << 30, flushLevel=logging.CRITICAL + 1)
    root = logging.getLogger()
    level = root.level
    root.addHandler(keeper)
    root.setLevel(logging.DEBUG)
    try:
        yield keeper
    finally:
        root.removeHandler(keeper)
        root.setLevel(level)
    for record in keeper.buffer:
        holders = [record.exc_info, *(record.args if isinstance(record.args, tuple) else ())]
        assert not any(isinstance(h, BaseException | tuple) for h in holders), (
            f"log record {record.getMessage()[:200]!r} ({record.name}) keeps an exception and its frames"
        )
    keeper.close()


class TierConformance:
    """The conformance tests. Subclass as ``Test<YourTier>`` and provide a ``harness`` fixture."""

    @pytest.fixture
    def tiers(self, harness: TierHarness) -> Iterator[TierFactory]:
        factory = TierFactory(harness)
        yield factory
        factory.close()

    @pytest.fixture
    def shm_dir(self) -> Iterator[Path]:
        path = Path(tempfile.mkdtemp(prefix="kvtier-conformance-", dir="/dev/shm"))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    # --- through a real manager -------------------------------------------------------------

    def test_round_trip_through_manager_is_byte_exact(self, harness: TierHarness, shm_dir: Path) -> None:
        bb = harness.block_bytes
        ns = make_namespace(bb)
        rng = np.random.default_rng(7)
        keys = chain_ids(range(6), ns)
        device = rng.integers(0, 256, (len(keys), bb), dtype=np.uint8)
        mgr = TieringManager.create(namespace=ns, num_cpu_blocks=8, tiers=[harness.spec()], shm_dir=shm_dir)
        try:
            req = RequestContext("conformance-store")
            mgr.on_new_request(req)
            plan = mgr.prepare_store(keys, req)
            assert plan is not None and list(plan.keys_to_store) == keys
            for i, slot in enumerate(plan.slots):
                mgr.rows[slot, :bb] = device[i]
            mgr.complete_store(keys, req)
            mgr.on_request_finished(req)
            wait_for(lambda: not mgr.has_pending_work(), harness.wait_seconds, "cascades finished", mgr.on_schedule_end)
            mgr.on_schedule_end()
            assert mgr.stats().manager.cascades_succeeded == len(keys)

            mgr.reset_cache()
            mgr.rows[:] = 0  # nothing left in the CPU tier to cheat with
            req2 = RequestContext("conformance-load")
            mgr.on_new_request(req2)
            deadline = time.monotonic() + harness.wait_seconds
            while True:
                answers = [mgr.lookup(k, req2) for k in keys]
                if all(a is LookupResult.HIT for a in answers):
                    break
                assert LookupResult.MISS not in answers, answers
                assert time.monotonic() < deadline, f"promotions unfinished: {answers}"
                mgr.on_schedule_end()
                time.sleep(0.002)
            slots = mgr.prepare_load(keys, req2)
            back = np.stack([mgr.rows[s, :bb].copy() for s in slots])
            mgr.complete_load(keys, req2)
            mgr.on_request_finished(req2)
            mgr.on_schedule_end()
            assert np.array_equal(back, device), "promoted blocks differ from what was stored"
            stats = mgr.stats()
            assert stats.manager.promotions_succeeded == len(keys)
            assert stats.secondary[0].counters["corrupt_values"] == 0
        finally:
            mgr.shutdown()

    def test_logged_corrupt_value_pins_no_cpu_row(self, harness: TierHarness, shm_dir: Path) -> None:
        """A corrupt value is read (and logged) while a handler keeps every record: the manager
        then shuts down and releases its region; no record holds an exception (whose frames
        would hold views of the rows and make the release fail with RegionBusyError)."""
        bb = harness.block_bytes
        ns = make_namespace(bb)
        keys = chain_ids(range(4), ns)
        with keeping_every_record():
            mgr = TieringManager.create(namespace=ns, num_cpu_blocks=8, tiers=[harness.spec()], shm_dir=shm_dir)
            try:
                _store_through(mgr, keys, harness)
                if not harness.damage(mgr.tiers[0], keys[1]):
                    pytest.skip("the harness cannot damage a stored value")
                mgr.reset_cache()
                answers = _promote_through(mgr, keys, harness)
                assert answers[1] is LookupResult.MISS and answers[0] is LookupResult.HIT, answers
                assert mgr.stats().secondary[0].counters["corrupt_values"] == 1
            finally:
                mgr.shutdown()
            assert mgr.region.closed, "the region was not released"

    def test_logged_outage_pins_no_cpu_row(self, harness: TierHarness, shm_dir: Path) -> None:
        """Stores and loads fail during an outage of the medium (and are logged) while a handler
        keeps every record: the manager still shuts down and releases its region."""
        bb = harness.block_bytes
        ns = make_namespace(bb)
        keys = chain_ids(range(6), ns)
        spec = {**harness.spec(), **harness.fast_failure_options()}
        with keeping_every_record():
            mgr = TieringManager.create(namespace=ns, num_cpu_blocks=12, tiers=[spec], shm_dir=shm_dir)
            try:
                _store_through(mgr, keys[:3], harness)
                mgr.reset_cache()
                with harness.outage() as supported:
                    if not supported:
                        pytest.skip("the harness cannot take the medium away")
                    tier = mgr.tiers[0]
                    deadline = time.monotonic() + harness.wait_seconds
                    while tier.health().state is HealthState.CLOSED and time.monotonic() < deadline:
                        _store_through(mgr, keys[3:], harness, wait=False)
                        _promote_through(mgr, keys[:3], harness, wait=False)
                        time.sleep(0.05)
                    wait_for(lambda: not mgr.has_pending_work(), harness.wait_seconds, "jobs reported",
                             mgr.on_schedule_end)  # fmt: skip
            finally:
                mgr.shutdown()
            assert mgr.region.closed, "the region was not released"

    # --- jobs ---------------------------------------------------------------------------------

    def test_store_then_load_is_byte_exact(self, harness: TierHarness, tiers: TierFactory) -> None:
        tier, rows = tiers()
        bb = harness.block_bytes
        keys = chain_ids(range(4), tier.context.namespace)
        result = run_job(tier, keys, [0, 1, 2, 3], False, harness.wait_seconds)
        assert result.success and result.error is None, result.error
        assert result.succeeded(keys) == keys
        for key in keys:
            assert resolve(tier, key, harness.wait_seconds) is LookupResult.HIT
        result = run_job(tier, keys, [8, 9, 10, 11], True, harness.wait_seconds)
        assert result.success, result.error
        assert np.array_equal(rows[8:12, :bb], rows[0:4, :bb])
        assert tier.stats.loads_failed == 0 and tier.stats.stores_failed == 0
        assert tier.stats.bytes_read > 0 and tier.stats.bytes_written > 0

    def test_keys_of_every_accepted_length_round_trip(self, harness: TierHarness, tiers: TierFactory) -> None:
        from kvtier.tiers.format import MAX_KEY_BYTES

        tier, rows = tiers()
        bb = harness.block_bytes
        rng = np.random.default_rng()
        keys = [rng.bytes(n) for n in (16, 36, MAX_KEY_BYTES)]  # vLLM's offload keys are 36 bytes
        assert run_job(tier, keys, [0, 1, 2], False, harness.wait_seconds).success
        for key in keys:
            assert resolve(tier, key, harness.wait_seconds) is LookupResult.HIT
        result = run_job(tier, keys, [4, 5, 6], True, harness.wait_seconds)
        assert result.success, result.error
        assert np.array_equal(rows[4:7, :bb], rows[0:3, :bb])

    def test_storing_held_keys_again_succeeds(self, harness: TierHarness, tiers: TierFactory) -> None:
        tier, rows = tiers()
        keys = chain_ids(range(2), tier.context.namespace)
        assert run_job(tier, keys, [0, 1], False, harness.wait_seconds).success
        assert run_job(tier, keys, [0, 1], False, harness.wait_seconds).success
        assert run_job(tier, keys, [4, 5], True, harness.wait_seconds).success
        assert np.array_equal(rows[4:6, : harness.block_bytes], rows[0:2, : harness.block_bytes])

    def test_partial_success_names_the_loaded_keys(self, harness: TierHarness, tiers: TierFactory) -> None:
        tier, rows = tiers()
        bb = harness.block_bytes
        keys = chain_ids(range(3), tier.context.namespace)
        assert run_job(tier, keys[:2], [0, 1], False, harness.wait_seconds).success
        result = run_job(tier, keys, [8, 9, 10], True, harness.wait_seconds)
        assert not result.success and result.error, "a job with a missing key must not succeed"
        assert set(result.succeeded(keys)) == set(keys[:2])
        assert np.array_equal(rows[8:10, :bb], rows[0:2, :bb])
        assert tier.stats.loads_failed >= 1

    def test_corrupt_value_is_a_miss_counted_and_dropped(self, harness: TierHarness, tiers: TierFactory) -> None:
        tier, rows = tiers()
        bb = harness.block_bytes
        keys = chain_ids(range(2), tier.context.namespace)
        assert run_job(tier, keys, [0, 1], False, harness.wait_seconds).success
        tier.take_events()
        if not harness.damage(tier, keys[0]):
            pytest.skip("the harness cannot damage a stored value")
        result = run_job(tier, keys, [4, 5], True, harness.wait_seconds)
        assert result.succeeded(keys) == [keys[1]], "a corrupt value must fail its key only"
        assert np.array_equal(rows[5, :bb], rows[1, :bb])
        assert tier.stats.corrupt_values == 1
        assert tier.health().state is HealthState.CLOSED, "corrupt data is not a health failure"
        assert resolve(tier, keys[0], harness.wait_seconds) is LookupResult.MISS
        assert any(e.removed and keys[0] in e.keys for e in tier.take_events())
        again = run_job(tier, [keys[0]], [6], True, harness.wait_seconds)
        assert not again.success

    def test_namespaces_never_share_blocks(self, harness: TierHarness, tiers: TierFactory) -> None:
        bb = harness.block_bytes
        tier_a, _ = tiers(make_namespace(bb))
        tier_b, _ = tiers(make_namespace(bb), seed=1)
        keys = chain_ids(range(2), tier_a.context.namespace)
        assert run_job(tier_a, keys, [0, 1], False, harness.wait_seconds).success
        for key in keys:
            assert resolve(tier_b, key, harness.wait_seconds) is LookupResult.MISS
        result = run_job(tier_b, keys, [4, 5], True, harness.wait_seconds)
        assert not result.success and result.succeeded(keys) == []

    def test_lookup_answers_and_retry_resolves(self, harness: TierHarness, tiers: TierFactory) -> None:
        tier, _ = tiers()
        stored, unknown = chain_ids(range(2), tier.context.namespace)
        assert run_job(tier, [stored], [0], False, harness.wait_seconds).success
        first = tier.lookup(unknown, None)
        assert first in (LookupResult.MISS, LookupResult.RETRY)
        assert tier.lookup(unknown, None) in (LookupResult.MISS, LookupResult.RETRY)
        assert resolve(tier, unknown, harness.wait_seconds) is LookupResult.MISS
        assert resolve(tier, stored, harness.wait_seconds) is LookupResult.HIT
        stats = tier.stats
        assert stats.lookups_hit >= 1 and stats.lookups_miss >= 1

    def test_drain_waits_and_results_are_reported_once(self, harness: TierHarness, tiers: TierFactory) -> None:
        tier, _rows = tiers(num_rows=16)
        keys = chain_ids(range(8), tier.context.namespace)
        jobs = [new_job(keys[i : i + 2], [i, i + 1], False) for i in range(0, 8, 2)]
        for job in jobs:
            tier.submit_store(job)
        tier.drain(harness.wait_seconds)
        results = tier.poll_finished()
        assert sorted(r.job_id for r in results) == sorted(j.job_id for j in jobs)
        assert all(r.success for r in results), [r.error for r in results]
        assert tier.poll_finished() == []
        assert not tier.has_pending_work()
        t0 = time.monotonic()
        tier.drain(0.001)  # idle: returns at once
        assert time.monotonic() - t0 < 0.5

    def test_drain_deadline_raises_while_the_medium_hangs(self, harness: TierHarness, tiers: TierFactory) -> None:
        tier, _ = tiers(**harness.fast_failure_options())
        keys = chain_ids(range(2), tier.context.namespace)
        with harness.outage() as supported:
            if not supported:
                pytest.skip("the harness cannot take the medium away")
            job = new_job(keys, [0, 1], False)
            tier.submit_store(job)
            t0 = time.monotonic()
            with contextlib.suppress(TierDrainTimeout):
                tier.drain(0.0)
            assert time.monotonic() - t0 < 1.0, "drain(0) must return or raise at once"
        tier.drain(harness.wait_seconds)
        results = tier.poll_finished()
        assert [r.job_id for r in results] == [job.job_id]

    # --- lifecycle ------------------------------------------------------------------------------

    def test_shutdown_is_idempotent_and_releases_everything(self, harness: TierHarness, tiers: TierFactory) -> None:
        before = set(threading.enumerate())
        tier, _ = tiers()
        keys = chain_ids(range(2), tier.context.namespace)
        assert run_job(tier, keys, [0, 1], False, harness.wait_seconds).success
        tier.submit_store(new_job(keys, [0, 1], False))
        tier.shutdown()
        tier.shutdown()
        leftover = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
        assert not leftover, f"threads still running after shutdown: {leftover}"
        context = getattr(tier, "context", None)  # (a tier may drop its context: the manager keeps its own)
        assert context is None or context.rows.size == 0, "the tier's context still holds the CPU rows"
        assert tier.lookup(keys[0], None) is LookupResult.MISS
        with pytest.raises(TierError):
            tier.submit_store(new_job(keys, [0, 1], False))
        with pytest.raises(TierError):
            tier.submit_load(new_job(keys, [2, 3], True))

    def test_usage_and_describe(self, harness: TierHarness, tiers: TierFactory) -> None:
        tier, _ = tiers()
        keys = chain_ids(range(2), tier.context.namespace)
        assert run_job(tier, keys, [0, 1], False, harness.wait_seconds).success
        timed = _Timed()

        def used() -> bool:
            usage = timed("usage", tier.usage)
            assert usage.used_bytes >= 0
            assert usage.capacity_bytes is None or usage.capacity_bytes >= usage.used_bytes
            return bool(usage.used_bytes > 0)

        wait_for(used, harness.wait_seconds, "usage() reports the stored bytes")
        assert timed.worst < SCHEDULER_CALL_LIMIT, f"usage() took {timed.worst * 1000:.1f} ms"
        info = tier.describe()
        assert info["type"] == tier.tier_type

    def test_events_name_stored_keys(self, harness: TierHarness, tiers: TierFactory) -> None:
        tier, _ = tiers()
        keys = chain_ids(range(3), tier.context.namespace)
        assert run_job(tier, keys, [0, 1, 2], False, harness.wait_seconds).success
        events = tier.take_events()
        stored = {k for e in events if not e.removed for k in e.keys}
        assert stored >= set(keys)
        assert all(e.tier == tier.label and e.medium == tier.medium for e in events)
        assert tier.take_events() == []

    def test_warm_restart_finds_blocks(self, harness: TierHarness, tiers: TierFactory) -> None:
        if not harness.persistent:
            pytest.skip("the tier is not persistent")
        bb = harness.block_bytes
        ns = make_namespace(bb)
        first, rows = tiers(ns)
        keys = chain_ids(range(3), ns)
        assert run_job(first, keys, [0, 1, 2], False, harness.wait_seconds).success
        expected = rows[0:3, :bb].copy()
        first.shutdown()
        second, rows2 = tiers(ns, seed=5)
        for key in keys:
            assert resolve(second, key, harness.wait_seconds) is LookupResult.HIT
        result = run_job(second, keys, [4, 5, 6], True, harness.wait_seconds)
        assert result.success, result.error
        assert np.array_equal(rows2[4:7, :bb], expected)

    # --- health -----------------------------------------------------------------------------------

    def test_outage_opens_the_breaker_without_blocking_and_recovers(
        self, harness: TierHarness, tiers: TierFactory
    ) -> None:
        tier, rows = tiers(num_rows=32, **harness.fast_failure_options())
        bb = harness.block_bytes
        keys = chain_ids(range(8), tier.context.namespace)
        assert run_job(tier, keys[:4], [0, 1, 2, 3], False, harness.wait_seconds).success
        timed = _Timed()
        submitted: set[int] = set()
        results: dict[int, JobResult] = {}

        def step() -> list[LookupResult]:
            answers = [timed("lookup", tier.lookup, k, None) for k in keys[4:6]]
            load = new_job(keys[:2], [16, 17], True)
            store = new_job(keys[6:8], [6, 7], False)
            timed("submit_load", tier.submit_load, load)
            timed("submit_store", tier.submit_store, store)
            submitted.update((load.job_id, store.job_id))
            timed("on_schedule_end", tier.on_schedule_end)
            for r in timed("poll_finished", tier.poll_finished):
                assert r.job_id not in results, f"job {r.job_id} reported twice"
                results[r.job_id] = r
            timed("health", tier.health)
            timed("has_pending_work", tier.has_pending_work)
            return answers

        with harness.outage() as supported:
            if not supported:
                pytest.skip("the harness cannot take the medium away")
            deadline = time.monotonic() + harness.wait_seconds
            while True:
                answers = step()
                if tier.health().state is not HealthState.CLOSED and answers == [LookupResult.MISS] * 2:
                    break
                assert time.monotonic() < deadline, f"breaker still {tier.health()} during the outage"
                time.sleep(0.01)
            for _ in range(10):
                assert step() == [LookupResult.MISS] * 2, "lookups must answer MISS while out of service"
                time.sleep(0.01)
        assert timed.worst < SCHEDULER_CALL_LIMIT, (
            f"scheduler call {timed.worst_call} took {timed.worst * 1000:.1f} ms during the outage"
        )
        results.update(wait_results(tier, submitted - set(results), harness.wait_seconds))
        assert any(not r.success for r in results.values()), "no job failed during the outage"
        assert all(r.success or r.error for r in results.values()), "a failed job must say why"

        def recovered() -> bool:
            tier.lookup(keys[0], None)
            tier.on_schedule_end()
            return tier.health().state is HealthState.CLOSED

        wait_for(recovered, harness.wait_seconds, "the tier is back in service after the outage")
        rows[20:24, :bb] = 0
        assert run_job(tier, keys[:4], [0, 1, 2, 3], False, harness.wait_seconds).success
        result = run_job(tier, keys[:4], [20, 21, 22, 23], True, harness.wait_seconds)
        assert result.success, result.error
        assert np.array_equal(rows[20:24, :bb], rows[0:4, :bb])


__all__ = [
    "SCHEDULER_CALL_LIMIT",
    "AlignedRows",
    "TierConformance",
    "TierFactory",
    "TierHarness",
    "keeping_every_record",
    "make_namespace",
    "new_job",
    "resolve",
    "run_job",
    "wait_for",
    "wait_results",
]
