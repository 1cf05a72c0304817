"""Regression tests for bugs found in the core (by the stateful test or by reading).

Each test is minimal and states the contract it checks, and stays as a guard
once the bug is fixed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from kvtier import KVGeometry, LookupResult, Namespace, RequestContext, TieringManager, chain_ids
from kvtier.keys import BlockKey
from kvtier.tiers.base import JobResult, SecondaryTier, TierUsage, TransferJob
from kvtier.tiers.registry import register_tier

pytestmark = pytest.mark.usefixtures("shm_leak_check")


class HoldingTier(SecondaryTier):
    """A collaborator double: holds a fixed set of blocks, loads them when told."""

    tier_type: ClassVar[str] = "regression-holding"
    medium: ClassVar[str] = "memory"

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.data: dict[BlockKey, bytes] = {}
        self.queued: list[TransferJob] = []
        self.calls: list[str] = []

    def lookup(self, key: BlockKey, request: RequestContext | None) -> LookupResult:
        return LookupResult.HIT if key in self.data else LookupResult.MISS

    def submit_store(self, job: TransferJob) -> None:
        self.calls.append(f"store:{job.request.req_id if job.request else None}")
        self.queued.append(job)

    def submit_load(self, job: TransferJob) -> None:
        self.calls.append(f"load:{job.request.req_id if job.request else None}")
        self.queued.append(job)

    def on_request_finished(self, request: RequestContext) -> None:
        self.calls.append(f"finished:{request.req_id}")

    def poll_finished(self) -> list[JobResult]:
        rows, n = self.context.rows, self.context.block_bytes
        done = []
        for job in self.queued:
            for key, slot in zip(job.keys, job.slots, strict=True):
                if job.is_promotion:
                    rows[slot, :n] = np.frombuffer(self.data[key], dtype=np.uint8)
                else:
                    self.data[key] = rows[slot, :n].tobytes()
            done.append(JobResult(job.job_id, True))
        self.queued.clear()
        return done

    def has_pending_work(self) -> bool:
        return bool(self.queued)

    def usage(self) -> TierUsage:
        return TierUsage(0, None)

    def drain(self, timeout: float | None = None) -> None:
        pass

    def shutdown(self) -> None:
        self.queued.clear()


register_tier("regression-holding", f"{__name__}:HoldingTier")


@pytest.fixture
def make(namespace: Namespace) -> Iterator[Any]:
    built: list[TieringManager] = []

    def factory(blocks: int, tiers: int = 0) -> TieringManager:
        specs = [{"type": "regression-holding"}] * tiers
        mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=blocks, tiers=specs, sweep_stale=False)
        built.append(mgr)
        return mgr

    yield factory
    for mgr in built:
        mgr.shutdown()


def fill(mgr: TieringManager, key: BlockKey, value: int) -> None:
    """Store ``key`` through the device path with every byte set to ``value``."""
    result = mgr.prepare_store([key])
    assert result is not None and list(result.keys_to_store) == [key]
    rows = mgr.primary.rows
    assert rows is not None
    rows[result.slots[0], : mgr.block_bytes] = value
    del rows
    mgr.complete_store([key])


def test_a_hit_stays_loadable_after_later_lookups_of_the_same_step(make: Any, namespace: Namespace) -> None:
    mgr = make(1, tiers=1)
    a, b = chain_ids([1, 2], namespace)
    fill(mgr, a, 7)
    mgr.on_schedule_end()
    mgr.tiers[0].data[b] = bytes(mgr.block_bytes)  # the tier holds the next block of the prefix
    req = RequestContext("r1")
    # The engine scans a request's prefix, then loads the HIT prefix in the same step.
    assert mgr.lookup(a, req) is LookupResult.HIT
    mgr.lookup(b, req)  # no room for b without evicting a: must not evict a (MISS is the right answer)
    slots = mgr.prepare_load([a], req)
    rows = mgr.primary.rows
    assert rows is not None
    assert (rows[slots[0], : mgr.block_bytes] == 7).all()
    del rows
    mgr.complete_load([a], req)


def test_finished_hook_waits_for_the_requests_promotions(make: Any, namespace: Namespace) -> None:
    mgr = make(4, tiers=1)
    (a,) = chain_ids([1], namespace)
    tier = mgr.tiers[0]
    tier.data[a] = bytes(mgr.block_bytes)
    req = RequestContext("r1")
    mgr.on_new_request(req)
    assert mgr.lookup(a, req) is LookupResult.HIT_PENDING
    mgr.on_request_finished(req)  # e.g. aborted before the step ended
    mgr.on_schedule_end()
    assert "load:r1" in tier.calls
    assert tier.calls.index("load:r1") < tier.calls.index("finished:r1"), tier.calls


def test_a_cascade_is_released_by_the_managers_record_of_its_rows(make: Any, namespace: Namespace) -> None:
    """A cascade's pins are released by the rows the manager recorded for its keys: a tier that
    rewrites its job's key list in place (it owns that list) cannot pair a key with another's row."""
    mgr = make(4, tiers=1)
    keys = chain_ids([1, 2, 3], namespace)
    req = RequestContext("r1")
    mgr.on_new_request(req)
    result = mgr.prepare_store(keys, req)
    assert result is not None
    mgr.complete_store(result.keys_to_store, req)
    (job,) = mgr.tiers[0].queued
    assert isinstance(job.keys, list)
    job.keys.reverse()
    assert [mgr.primary.ref_count(k) for k in keys] == [1, 1, 1]
    mgr.on_schedule_end()
    mgr.on_schedule_end()  # the next step polls: the tier reports the job
    assert [mgr.primary.ref_count(k) for k in keys] == [0, 0, 0]
    assert mgr.primary.policy.evictable_count() == 3
    evicting = mgr.prepare_store(chain_ids([7, 8, 9, 10], namespace))
    assert evicting is not None and sorted(evicting.evicted_keys) == sorted(keys)
    mgr.complete_store(evicting.keys_to_store)


class MalformedAnswersTier(HoldingTier):
    """A collaborator double whose ``poll_finished`` / ``take_events`` answer in a wrong shape
    (``mode``), after the first step's well-formed answers are mixed in."""

    tier_type: ClassVar[str] = "regression-malformed"
    mode = "none"

    def poll_finished(self) -> Any:
        done = super().poll_finished()
        mode = type(self).mode
        if mode == "none":
            return None
        if mode == "objects":
            return [object(), *done]  # the good results still count
        if mode == "seconds_none":
            return [JobResult(r.job_id, r.success, seconds=None) for r in done]  # type: ignore[arg-type]
        if mode == "numpy_fields":  # worked before the answers were checked: must still count
            return [JobResult(np.int64(r.job_id), np.bool_(True), None, np.int64(4096), np.float64(0.01))  # type: ignore[arg-type]
                    for r in done]  # fmt: skip
        if mode == "keys_a_list":  # successful_keys as a list: normalized, not dropped
            return [JobResult(r.job_id, False, list(r.successful_keys or ())) for r in done]  # type: ignore[arg-type]
        if mode == "generator":

            def failing() -> Iterator[JobResult]:
                yield from done
                raise RuntimeError("a broken generator")

            return failing()
        return done

    def take_events(self) -> Any:
        return None if type(self).mode == "events_none" else ["not an event"]


register_tier("regression-malformed", f"{__name__}:MalformedAnswersTier")


@pytest.mark.parametrize("mode", ["none", "objects", "seconds_none", "generator", "events_none", "numpy_fields",
                                  "keys_a_list"])
def test_a_tier_answering_in_a_wrong_shape_never_crashes_the_scheduler(namespace: Namespace, mode: str) -> None:
    """Regression (review, 2026-12-02): only tier calls that raised were guarded; a wrong return
    value (None, foreign objects, a JobResult with seconds=None, a generator that raises) made
    every later scheduler call raise."""
    MalformedAnswersTier.mode = mode
    mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=8, tiers=[{"type": "regression-malformed"}],
                                sweep_stale=False)  # fmt: skip
    try:
        keys = chain_ids(range(3), namespace)
        req = RequestContext("r")
        for step in range(3):
            result = mgr.prepare_store(keys[step : step + 1], req)
            assert result is not None
            mgr.complete_store(result.keys_to_store, req)
            mgr.on_schedule_end()
            assert isinstance(mgr.take_events(), list)
            mgr.lookup(keys[0], req)
        snapshot = mgr.stats()
        if mode != "numpy_fields":
            assert snapshot.manager.tier_call_errors >= 1
        if mode in ("objects", "seconds_none", "numpy_fields", "keys_a_list"):  # applied: no pin left behind
            assert mgr.primary.pinned_count() == 0 and mgr.jobs_in_flight() == 0
    finally:
        mgr.shutdown()


def test_tier_label_names_only_tiers_that_exist(make: Any) -> None:
    """Regression (review, 2026-12-02): tier_label(-1) made a label for no tier ("-1:..."), and
    tier_label(5) raised a bare IndexError."""
    mgr = make(4, tiers=2)
    assert [mgr.tier_label(i) for i in range(3)] == ["0:primary", "1:regression-holding", "2:regression-holding"]
    for bad in (-1, 3, True, "1"):
        with pytest.raises(IndexError, match=r"0 \(the CPU tier\) to 2"):
            mgr.tier_label(bad)


class RepeatingTier(HoldingTier):
    """A collaborator double that reports the same unknown job at every poll."""

    tier_type: ClassVar[str] = "regression-repeating"

    def poll_finished(self) -> list[JobResult]:
        return [JobResult(987_654, True)]


register_tier("regression-repeating", f"{__name__}:RepeatingTier")


def test_a_tier_repeating_an_unknown_job_never_fills_the_log(
    namespace: Namespace, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression (review, 2026-12-02): every report of an unknown job was logged at ERROR."""
    mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=4, tiers=[{"type": "regression-repeating"}],
                                sweep_stale=False)  # fmt: skip
    try:
        for _ in range(150):
            mgr.on_schedule_end()
            mgr.lookup(b"u" * 32)
        reported = mgr.stats().manager.unknown_job_results
        assert 150 <= reported < 1000
        logged = [r for r in caplog.records if "unknown job" in r.getMessage()]
        assert len(logged) == 3  # the 1st, 10th and 100th
    finally:
        mgr.shutdown()


class DrainFailingTier(HoldingTier):
    """A collaborator double whose ``drain`` raises a plain error."""

    tier_type: ClassVar[str] = "regression-drain-failing"

    def drain(self, timeout: float | None = None) -> None:
        raise RuntimeError("drain boom")


register_tier("regression-drain-failing", f"{__name__}:DrainFailingTier")


def test_a_tier_failing_to_drain_is_named_in_a_tier_error(namespace: Namespace) -> None:
    """Regression (review, 2026-12-02): reset_cache passed a tier's plain drain() error through raw,
    naming no tier (its docstring promises a TierError)."""
    from kvtier.errors import TierError

    specs = [{"type": "regression-holding"}, {"type": "regression-drain-failing"}]
    mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=4, sweep_stale=False, tiers=specs)
    try:
        with pytest.raises(TierError, match=r"secondary tier #2 \(type=regression-drain-failing\)") as caught:
            mgr.reset_cache()
        assert isinstance(caught.value.__cause__, RuntimeError)
    finally:
        mgr.shutdown()


def test_a_reset_with_engine_copies_in_flight_gives_their_rows_back_after_a_few_steps(private_shm: Path) -> None:
    """Regression (review, 2026-12-03): rows a reset held out (a device store or load still
    running) came back only through the vLLM adapter: a direct user lost them for good."""
    ns = Namespace("held", KVGeometry.from_block_bytes(4096))
    mgr = TieringManager.create(namespace=ns, num_cpu_blocks=8, shm_dir=private_shm)
    try:
        for round_ in range(3):
            keys = [bytes([round_, i]) * 16 for i in range(4)]
            req = RequestContext(f"r{round_}")
            assert mgr.prepare_store(keys, req) is not None  # the engine's device store is running...
            mgr.reset_cache()  # ...at the reset; the engine drops its completion
            cpu = mgr.stats().cpu
            assert cpu.extra["held_rows"] == 4 and cpu.used_bytes == 4 * mgr.primary.region.row_stride
            mgr.on_request_finished(req)
            for _ in range(mgr.primary.reset_hold_steps):
                assert mgr.primary.free_slots == 4
                mgr.on_schedule_end()
            assert mgr.primary.free_slots == 8 and mgr.stats().cpu.extra["held_rows"] == 0
        assert mgr.prepare_store([bytes([9, i]) * 16 for i in range(8)], RequestContext("all")) is not None
    finally:
        mgr.shutdown()


def _keys(tag: str, n: int) -> list[BlockKey]:
    return [hashlib.sha256(f"{tag}{i}".encode()).digest() for i in range(n)]


@pytest.mark.parametrize("policy", ["lru", "arc", "return-time"])
def test_a_store_larger_than_what_can_be_evicted_is_refused_changing_nothing(private_shm: Path, policy: str) -> None:
    """Review r5: on a 3-row tier, after stores that open a request piece by piece, a 4-block store
    made return-time's eviction take one block twice: prepare_store raised KeyError(b'') halfway
    (a block already dropped) and a row was lost for good. It must answer None, and the tier then
    takes a 3-block store."""
    k = _keys("r5-", 6)
    mgr = TieringManager.create(namespace=Namespace("r5", KVGeometry.from_block_bytes(4096)), num_cpu_blocks=3,
                                policy=policy, shm_dir=str(private_shm), sweep_stale=False)
    a, b, c, d = (RequestContext(r) for r in "abcd")

    def store(keys: list[BlockKey], req: RequestContext, order: list[BlockKey] | None = None) -> bool:
        res = mgr.prepare_store(keys, req)
        if res is None:
            return False
        done = [x for x in order if x in res.keys_to_store] if order is not None else list(res.keys_to_store)
        if done:
            mgr.complete_store(done, req)
        return True

    try:
        assert store([k[0]], a)
        assert store([k[1], k[0]], b)
        assert store([k[2], k[3], k[4]], c, [k[3], k[4], k[2]])
        assert store([k[1], k[0]], b, [k[0], k[1]])
        assert not store([k[2], k[3], k[4], k[5]], d)
        for req in (a, b, c, d):
            mgr.on_request_finished(req)
        mgr.on_schedule_end()
        assert mgr.primary.policy.evictable_count() == len(mgr.primary) == 3
        fresh = _keys("r5-fresh-", 3)
        result = mgr.prepare_store(fresh)
        assert result is not None and len(result.keys_to_store) == 3
        mgr.complete_store(result.keys_to_store)
    finally:
        mgr.shutdown()


@pytest.mark.parametrize("policy", ["lru", "arc", "return-time"])
def test_an_idle_tier_takes_a_store_that_fits_after_a_reset(private_shm: Path, policy: str) -> None:
    """Review r5: a request settled after its last store's wheel bucket went by had its ancestors
    raised into that past bucket's list, which eviction scans as the farthest future: a 6-row tier
    holding 4 ready blocks and 2 free rows refused a 6-block store once (and kept stale blocks
    longest). Every ready block is evictable: the store fits."""
    k = _keys("r5b-", 4)
    mgr = TieringManager.create(namespace=Namespace("r5", KVGeometry.from_block_bytes(4096)), num_cpu_blocks=6,
                                policy=policy, shm_dir=str(private_shm), sweep_stale=False)
    a, b, c = RequestContext("a"), RequestContext("b"), RequestContext("c")
    try:
        mgr.prepare_store([k[0], k[1]], a)  # in flight when the cache is reset (the engine drops it)
        mgr.reset_cache()
        res = mgr.prepare_store([k[2]], b)
        assert res is not None
        mgr.complete_store(res.keys_to_store, b)
        res = mgr.prepare_store([k[0], k[1]], c)
        res_a = mgr.prepare_store([k[3]], a)
        assert res is not None and res_a is not None
        mgr.complete_store(res.keys_to_store, c)
        assert len(mgr.prepare_load([k[0]], b)) == 1
        mgr.complete_store(res_a.keys_to_store, a)
        mgr.on_request_finished(a)
        mgr.complete_load([k[0]], b)
        for req in (b, c):
            mgr.on_request_finished(req)
        for _ in range(5):  # the rows the reset held come back
            mgr.on_schedule_end()
        assert mgr.primary.held_count == 0 and mgr.primary.policy.evictable_count() == len(mgr.primary) == 4
        result = mgr.prepare_store(_keys("r5b-fresh-", 6))
        assert result is not None
        mgr.complete_store(result.keys_to_store, success=False)
    finally:
        mgr.shutdown()


class WrongAnswerTier(HoldingTier):
    """A collaborator double whose ``lookup`` and ``on_new_request`` answer with values of the
    wrong type (the string "HIT", None)."""

    tier_type: ClassVar[str] = "regression-wrong-answer"

    def lookup(self, key: BlockKey, request: RequestContext | None) -> Any:
        return "HIT"

    def on_new_request(self, request: RequestContext) -> Any:
        return "request-level"


register_tier("regression-wrong-answer", f"{__name__}:WrongAnswerTier")


class RetryThenWrongTier(HoldingTier):
    """A collaborator double whose ``lookup`` answers RETRY, then a value of the wrong type."""

    tier_type: ClassVar[str] = "regression-retry-then-wrong"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked = 0

    def lookup(self, key: BlockKey, request: RequestContext | None) -> Any:
        self.asked += 1
        return LookupResult.RETRY if self.asked == 1 else "HIT"


register_tier("regression-retry-then-wrong", f"{__name__}:RetryThenWrongTier")


def test_a_wrong_typed_answer_after_a_retry_ends_the_wait_like_a_miss(namespace: Namespace) -> None:
    """Regression (review, 2026-12-06): a wrong-typed answer was taken as a MISS but left the
    key's RETRY clock running (a later wait deadline could withhold the key from that tier)."""
    mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=4,
                                tiers=[{"type": "regression-retry-then-wrong"}], sweep_stale=False)  # fmt: skip
    try:
        key, req = chain_ids(range(1), namespace)[0], RequestContext("r")
        assert mgr.lookup(key, req) is LookupResult.RETRY
        assert key in mgr._tiers.handles[0].retry_since
        assert mgr.lookup(key, req) is LookupResult.MISS
        assert key not in mgr._tiers.handles[0].retry_since
        assert mgr.stats().manager.tier_call_errors == 1
    finally:
        mgr.shutdown()


def test_a_tier_answering_lookups_with_a_wrong_type_is_counted_and_logged_once(
    namespace: Namespace, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression (review, 2026-12-06): a tier whose lookup() answered a value that is no
    LookupResult (or whose on_new_request() answered no OffloadPolicy) was taken as a MISS (as
    block-level) without a count or a log line: a broken tier looked like an empty one."""
    mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=4, tiers=[{"type": "regression-wrong-answer"}],
                                sweep_stale=False)  # fmt: skip
    try:
        req = RequestContext("r")
        mgr.on_new_request(req)
        for key in chain_ids(range(5), namespace):
            assert mgr.lookup(key, req) is LookupResult.MISS
        snapshot = mgr.stats()
        assert snapshot.manager.tier_call_errors == 6  # five lookups and one on_new_request
        logged = [r.getMessage() for r in caplog.records if "regression-wrong-answer" in r.getMessage()]
        assert len(logged) == 2, logged  # once per call
        assert any("lookup() answered 'HIT', not LookupResult HIT, MISS or RETRY" in m for m in logged)
        assert any("on_new_request() answered 'request-level', not an OffloadPolicy" in m for m in logged)
    finally:
        mgr.shutdown()
