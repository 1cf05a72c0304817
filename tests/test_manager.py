"""TieringManager's per-step contract (DESIGN.md section 5) with scripted secondary tiers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tier_doubles
from kvtier import LookupResult, Namespace, OffloadPolicy, RequestContext, TieringManager, prefix_keys
from kvtier.errors import ConfigError, KvtierError
from kvtier.primary import PrimaryTier
from kvtier.region import SharedRegion
from kvtier.tiers.registry import register_tier
from tier_doubles import RecordingLRU, ScriptedTier

pytestmark = pytest.mark.usefixtures("shm_leak_check")
register_tier("scripted", "tier_doubles:ScriptedTier")

HIT, HIT_PENDING, RETRY, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY, LookupResult.MISS


@pytest.fixture(autouse=True)
def _clear_calls() -> Iterator[None]:
    tier_doubles.CALLS.clear()
    yield


@pytest.fixture
def make(namespace: Namespace) -> Iterator[Any]:
    built: list[TieringManager] = []

    def factory(blocks: int = 8, *tier_options: dict[str, Any], policy: str = "lru") -> TieringManager:
        specs = [{"type": "scripted", "name": f"t{i}", **o} for i, o in enumerate(tier_options, start=1)]
        mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=blocks, tiers=specs, policy=policy)
        built.append(mgr)
        return mgr

    yield factory
    for mgr in built:
        for tier in mgr.tiers:
            if isinstance(tier, ScriptedTier):
                tier.shutdown_error = None
        mgr.shutdown()


def keys(n: int, seed: int = 0) -> list[bytes]:
    return prefix_keys(np.arange(n * 4) + seed * 100_000, 4)


def payload(key: bytes, size: int) -> np.ndarray:
    """Deterministic bytes for a key (what the 'device' computed)."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 256, size, dtype=np.uint8)


def store(mgr: TieringManager, ks: list[bytes], req: RequestContext, success: bool = True) -> None:
    result = mgr.prepare_store(ks, req)
    assert result is not None
    rows = mgr.rows
    for key, slot in zip(result.keys_to_store, result.slots, strict=True):
        rows[slot, : mgr.block_bytes] = payload(key, mgr.block_bytes)
    del rows
    mgr.complete_store(result.keys_to_store, req, success=success)


def tiers(mgr: TieringManager) -> list[ScriptedTier]:
    return [t for t in mgr.tiers if isinstance(t, ScriptedTier)]


def test_store_then_hit_without_tiers(make: Any) -> None:
    mgr = make(4)
    req = RequestContext("r1")
    ks = keys(3)
    assert mgr.lookup(ks[0], req) is MISS
    result = mgr.prepare_store(ks, req)
    assert result is not None and result.keys_to_store == ks and result.evicted_keys == []
    assert mgr.lookup(ks[0], req) is HIT_PENDING
    mgr.complete_store(ks, req)
    assert [mgr.lookup(k, req) for k in ks] == [HIT, HIT, HIT]
    again = mgr.prepare_store(ks, req)
    assert again is not None and again.keys_to_store == [], "present keys are skipped"


def test_cascade_pins_once_per_tier_until_each_reports(make: Any) -> None:
    mgr = make(8, {"auto_complete": False}, {"auto_complete": False})
    req = RequestContext("r1")
    ks = keys(2)
    store(mgr, ks, req)
    t1, t2 = tiers(mgr)
    assert len(t1.queued) == 1 and len(t2.queued) == 1
    assert [mgr.primary.ref_count(k) for k in ks] == [2, 2]
    t1.complete_all()
    mgr.on_schedule_end()  # this step already polled (in prepare_store): the pin survives the step end
    assert [mgr.primary.ref_count(k) for k in ks] == [2, 2]
    mgr.on_schedule_end()  # a step whose first poll sees tier 1's report
    assert [mgr.primary.ref_count(k) for k in ks] == [1, 1]
    t2.complete_all()
    mgr.on_schedule_end()
    assert [mgr.primary.ref_count(k) for k in ks] == [0, 0]
    assert set(t1.data) == set(ks) == set(t2.data)


def test_polling_is_once_per_step_and_before_eviction(make: Any) -> None:
    mgr = make(2, {"auto_complete": False})
    req = RequestContext("r1")
    a = keys(2, seed=1)
    store(mgr, a, req)
    (t1,) = tiers(mgr)
    mgr.on_schedule_end()
    # both rows pinned by the cascade: no room for new blocks
    assert mgr.prepare_store(keys(1, seed=2), req) is None
    t1.complete_all()
    # same step: already polled, so the pins still count
    assert mgr.prepare_store(keys(1, seed=2), req) is None
    mgr.on_schedule_end()  # this step's poll already happened before the tier finished
    # next step: the first call polls before deciding evictions, so the freed pins count
    result = mgr.prepare_store(keys(1, seed=2), req)
    assert result is not None and len(result.evicted_keys) == 1


def test_failed_store_cascades_nothing_and_frees_rows(make: Any) -> None:
    mgr = make(4, {})
    req = RequestContext("r1")
    ks = keys(2)
    store(mgr, ks, req, success=False)
    (t1,) = tiers(mgr)
    assert t1.data == {} and tier_doubles.CALLS == []
    assert [mgr.lookup(k, req) for k in ks] == [MISS, MISS]
    assert mgr.primary.free_slots == 4


def test_promotion_round_trip_is_byte_exact(make: Any) -> None:
    mgr = make(4, {})
    req = RequestContext("r1")
    ks = keys(3)
    store(mgr, ks, req)
    mgr.on_schedule_end()
    mgr.reset_cache()
    assert len(mgr.primary) == 0
    assert [mgr.lookup(k, req) for k in ks] == [HIT_PENDING] * 3
    assert tier_doubles.CALLS.count(("t1", "submit_load")) == 0, "loads are submitted at step end"
    mgr.on_schedule_end()
    assert tier_doubles.CALLS.count(("t1", "submit_load")) == 1, "one batched job per (tier, request)"
    assert [mgr.lookup(k, req) for k in ks] == [HIT] * 3
    slots = mgr.prepare_load(ks, req)
    rows = mgr.rows
    for key, slot in zip(ks, slots, strict=True):
        assert np.array_equal(rows[slot, : mgr.block_bytes], payload(key, mgr.block_bytes))
    del rows
    mgr.complete_load(ks, req)


def test_same_key_from_two_requests_promotes_once(make: Any) -> None:
    mgr = make(4, {"auto_complete": False})
    ks = keys(1)
    (t1,) = tiers(mgr)
    t1.data[ks[0]] = payload(ks[0], mgr.block_bytes).tobytes()
    assert mgr.lookup(ks[0], RequestContext("a")) is HIT_PENDING
    assert mgr.lookup(ks[0], RequestContext("b")) is HIT_PENDING
    mgr.on_schedule_end()
    assert len(t1.queued) == 1 and list(t1.queued[0].keys) == ks
    assert t1.queued[0].request is not None and t1.queued[0].request.req_id == "a"


def test_promotion_batches_per_tier_and_request(make: Any) -> None:
    mgr = make(8, {"auto_complete": False}, {"auto_complete": False})
    t1, t2 = tiers(mgr)
    a, b = keys(2, seed=1), keys(2, seed=2)
    for k in a:
        t1.data[k] = b"x" * mgr.block_bytes
    for k in b:
        t2.data[k] = b"y" * mgr.block_bytes
    for k in a + b:
        assert mgr.lookup(k, RequestContext("r1")) is HIT_PENDING
    for k in keys(1, seed=3):
        t1.data[k] = b"z" * mgr.block_bytes
        assert mgr.lookup(k, RequestContext("r2")) is HIT_PENDING
    mgr.on_schedule_end()
    assert sorted(len(j.keys) for j in t1.queued) == [1, 2]
    assert [len(j.keys) for j in t2.queued] == [2]
    assert all(j.is_promotion for j in t1.queued + t2.queued)


def test_interleaved_promotions_batch_per_tier_and_request_step_after_step(make: Any) -> None:
    """The manager remembers the last promotion's batch: interleaving requests and tiers, a new
    step and a reset must still give one job per (tier, request) with exactly that step's keys."""
    mgr = make(16, {"auto_complete": False}, {"auto_complete": False})
    t1, t2 = tiers(mgr)
    r1, r2 = RequestContext("r1"), RequestContext("r2")
    mgr.on_new_request(r1)
    mgr.on_new_request(r2)
    ks = keys(10, seed=4)
    for i, k in enumerate(ks):
        (t2 if i == 4 else t1).data[k] = bytes([i]) * mgr.block_bytes
    for i, req in zip([0, 1, 2, 3, 4, 5], [r1, r1, r2, r1, r1, r1], strict=True):
        assert mgr.lookup(ks[i], req) is HIT_PENDING
    mgr.on_schedule_end()
    jobs = {(tier.name, job.request.req_id if job.request else None): list(job.keys)
            for tier in (t1, t2) for job in tier.queued}
    assert jobs == {("t1", "r1"): [ks[0], ks[1], ks[3], ks[5]], ("t1", "r2"): [ks[2]], ("t2", "r1"): [ks[4]]}
    t1.complete_all()
    t2.complete_all()
    assert mgr.lookup(ks[6], r1) is HIT_PENDING  # the next step: a new batch
    mgr.on_schedule_end()
    assert [list(job.keys) for job in t1.queued] == [[ks[6]]]
    t1.complete_all()
    assert mgr.lookup(ks[7], r1) is HIT_PENDING
    mgr.reset_cache()  # drops the unsubmitted promotion of ks[7]
    assert mgr.lookup(ks[8], r1) is HIT_PENDING
    mgr.on_schedule_end()
    assert [list(job.keys) for job in t1.queued] == [[ks[8]]]
    t1.complete_all()
    mgr.on_schedule_end()
    assert mgr.lookup(ks[8], r1) is HIT and mgr.primary.in_flight_count() == 0
    mgr.on_request_finished(r1)
    mgr.on_request_finished(r2)
    assert t1.finished_requests == ["r1", "r2"] and mgr.is_idle


def test_promotion_without_room_is_a_miss(make: Any) -> None:
    mgr = make(2, {})
    req = RequestContext("r1")
    pinned = keys(2, seed=1)
    store(mgr, pinned, req)
    mgr.on_schedule_end()
    mgr.prepare_load(pinned, req)  # every row pinned
    (t1,) = tiers(mgr)
    other = keys(1, seed=2)[0]
    t1.data[other] = b"q" * mgr.block_bytes
    assert mgr.lookup(other, req) is MISS
    assert mgr.stats().as_dict()["manager"]["promotion_alloc_failures"] == 1
    mgr.complete_load(pinned, req)


def test_failed_and_partial_promotions_end_as_miss(make: Any) -> None:
    mgr = make(4, {})
    req = RequestContext("r1")
    ks = keys(3)
    store(mgr, ks, req)
    mgr.on_schedule_end()
    mgr.reset_cache()
    (t1,) = tiers(mgr)
    t1.fail_keys = {ks[1]}
    assert [mgr.lookup(k, req) for k in ks] == [HIT_PENDING] * 3
    mgr.on_schedule_end()
    t1.fail_keys = set()
    del t1.data[ks[1]]
    assert [mgr.lookup(k, req) for k in ks] == [HIT, MISS, HIT]
    assert mgr.primary.in_flight_count() == 0


def test_retry_from_a_tier_is_passed_on(make: Any) -> None:
    mgr = make(4, {}, {})
    t1, t2 = tiers(mgr)
    k = keys(1)[0]
    t1.retry_keys = {k}
    assert mgr.lookup(k, RequestContext("r")) is RETRY
    t2.data[k] = b"w" * mgr.block_bytes
    assert mgr.lookup(k, RequestContext("r")) is HIT_PENDING, "a later tier's HIT wins over an earlier RETRY"


def test_request_finished_hook_waits_for_outstanding_stores(make: Any) -> None:
    mgr = make(8, {})
    req = RequestContext("late")
    ks = keys(2)
    result = mgr.prepare_store(ks, req)
    assert result is not None
    mgr.on_request_finished(req)
    (t1,) = tiers(mgr)
    assert t1.finished_requests == [], "a store is outstanding: more cascades can still come"
    mgr.complete_store(ks, req)
    assert tier_doubles.CALLS == [("t1", "submit_store"), ("t1", "finished:late")]


def test_request_with_failed_or_no_store_is_finalized(make: Any) -> None:
    mgr = make(8, {})
    (t1,) = tiers(mgr)
    failed = RequestContext("failed")
    result = mgr.prepare_store(keys(1), failed)
    assert result is not None
    mgr.on_request_finished(failed)
    mgr.complete_store(result.keys_to_store, failed, success=False)
    idle = RequestContext("idle")
    mgr.on_new_request(idle)
    mgr.on_request_finished(idle)
    assert t1.finished_requests == ["failed", "idle"]


def test_request_level_policy_cascades_existing_blocks(make: Any) -> None:
    mgr = make(8, {}, {"request_level": True})
    t1, t2 = tiers(mgr)
    ks = keys(3)
    store(mgr, ks[:2], RequestContext("first"))
    t2.data.clear()
    req = RequestContext("second")
    assert mgr.on_new_request(req) is OffloadPolicy.REQUEST_LEVEL
    store(mgr, ks, req)
    assert set(t2.data) == set(ks), "prefix-hit blocks reach request-level tiers too"
    assert set(t1.data) == set(ks)


def test_request_level_parks_blocks_still_in_flight(make: Any) -> None:
    mgr = make(8, {"request_level": True})
    (t1,) = tiers(mgr)
    ks = keys(2)
    writer = RequestContext("writer")
    pending = mgr.prepare_store(ks[:1], writer)
    assert pending is not None
    req = RequestContext("reader")
    mgr.on_new_request(req)
    result = mgr.prepare_store(ks, req)
    assert result is not None and result.keys_to_store == ks[1:]
    assert mgr.has_pending_work(), "a parked cascade is pending work"
    mgr.complete_store(ks[1:], req)
    mgr.complete_store(ks[:1], writer)
    t1.data.pop(ks[0], None)
    mgr.on_schedule_end()
    assert ks[0] in t1.data


def test_touch_reaches_every_tier(make: Any) -> None:
    mgr = make(4, {}, {})
    ks = keys(2)
    mgr.touch(ks, RequestContext("r"))
    assert [t.touched for t in tiers(mgr)] == [ks, ks]


def test_reset_drains_drops_unsubmitted_promotions_and_keeps_active_requests(make: Any) -> None:
    mgr = make(4, {"auto_complete": False})
    (t1,) = tiers(mgr)
    active, done = RequestContext("active"), RequestContext("done")
    store(mgr, keys(1, seed=1), active)
    store(mgr, keys(1, seed=2), done)
    mgr.on_request_finished(done)
    promo = keys(1, seed=3)[0]
    t1.data[promo] = b"p" * mgr.block_bytes
    assert mgr.lookup(promo, active) is HIT_PENDING
    assert mgr.has_pending_work()
    mgr.reset_cache()
    assert t1.drains == 1
    assert not mgr.has_pending_work()
    assert len(mgr.primary) == 0 and mgr.primary.in_flight_count() == 0
    assert tier_doubles.CALLS.count(("t1", "submit_load")) == 0, "unsubmitted promotions are dropped"
    assert "done" in t1.finished_requests and "active" not in t1.finished_requests
    assert set(t1.data) >= set(keys(1, seed=1) + keys(1, seed=2)), "persistent tiers keep their data"
    mgr.on_request_finished(active)
    assert "active" in t1.finished_requests


def test_events_report_primary_and_evictions(make: Any) -> None:
    mgr = make(2)
    req = RequestContext("r")
    store(mgr, keys(2, seed=1), req)
    store(mgr, keys(1, seed=2), req)
    events = mgr.take_events()
    stored = [e for e in events if not e.removed]
    removed = [e for e in events if e.removed]
    assert sum(len(e.keys) for e in stored) == 3
    assert [len(e.keys) for e in removed] == [1] and removed[0].tier == "0:primary" and removed[0].medium == "cpu"
    assert mgr.take_events() == []


def test_prepare_load_of_non_hit_raises_and_pins_nothing(make: Any) -> None:
    mgr = make(4)
    req = RequestContext("r")
    ks = keys(2)
    store(mgr, ks[:1], req)
    with pytest.raises(KvtierError, match="absent"):
        mgr.prepare_load(ks, req)
    assert mgr.primary.ref_count(ks[0]) == 0


def test_stale_complete_store_after_reset_is_ignored(make: Any) -> None:
    mgr = make(4, {})
    req = RequestContext("r")
    ks = keys(1)
    result = mgr.prepare_store(ks, req)
    assert result is not None
    mgr.reset_cache()
    mgr.complete_store(ks, req)
    assert mgr.lookup(ks[0], req) is MISS
    assert tiers(mgr)[0].data == {}


def test_arc_policy_and_unknown_policy(make: Any, namespace: Namespace) -> None:
    mgr = make(4, policy="arc")
    store(mgr, keys(4), RequestContext("r"))
    store(mgr, keys(2, seed=9), RequestContext("r"))
    assert len(mgr.primary) == 4
    with pytest.raises(ConfigError, match="unknown eviction policy"):
        TieringManager.create(namespace=namespace, num_cpu_blocks=4, policy="fifo-ish")


def test_size_from_cpu_bytes_and_errors(namespace: Namespace) -> None:
    mgr = TieringManager.create(namespace=namespace, cpu_bytes=5 * 8192 + 100)
    assert mgr.primary.num_blocks == 5
    mgr.shutdown()
    with pytest.raises(ConfigError, match="cpu_bytes"):
        TieringManager.create(namespace=namespace, cpu_bytes=100)
    with pytest.raises(ConfigError, match="num_cpu_blocks or cpu_bytes"):
        TieringManager.create(namespace=namespace)


def test_stats_snapshot(make: Any) -> None:
    mgr = make(4, {})
    req = RequestContext("r")
    store(mgr, keys(2), req)
    mgr.lookup(keys(1, seed=5)[0], req)
    stats = mgr.stats().as_dict()
    assert stats["primary"]["blocks"] == 2 and stats["primary"]["capacity_blocks"] == 4
    assert stats["manager"]["lookups"]["miss"] == 1
    assert stats["tiers"]["1:scripted"]["entries"] == 2


def test_finished_hook_waits_for_promotions_on_every_tier(make: Any) -> None:
    # regression: finalizing right after the first tier's promotion job was submitted let
    # the second tier's submit_load arrive after its on_request_finished hook
    mgr = make(8, {"auto_complete": False}, {"auto_complete": False})
    t1, t2 = tiers(mgr)
    a, b = keys(1, seed=1)[0], keys(1, seed=2)[0]
    t1.data[a] = b"1" * mgr.block_bytes
    t2.data[b] = b"2" * mgr.block_bytes
    req = RequestContext("both")
    assert mgr.lookup(a, req) is HIT_PENDING and mgr.lookup(b, req) is HIT_PENDING
    mgr.on_request_finished(req)
    assert t1.finished_requests == [] and t2.finished_requests == [], "promotions are not submitted yet"
    mgr.on_schedule_end()
    for name in ("t1", "t2"):
        calls = [c for tier, c in tier_doubles.CALLS if tier == name]
        assert calls == ["submit_load", "finished:both"], (name, calls)


def test_a_hit_is_protected_from_eviction_until_the_step_ends(make: Any) -> None:
    mgr = make(1)
    req = RequestContext("r")
    a = keys(1, seed=1)
    store(mgr, a, req)
    mgr.on_schedule_end()
    assert mgr.lookup(a[0], req) is HIT
    assert mgr.prepare_store(keys(1, seed=2), RequestContext("other")) is None, "the HIT may still be loaded"
    mgr.prepare_load(a, req)
    mgr.complete_load(a, req)
    mgr.on_schedule_end()
    assert mgr.prepare_store(keys(1, seed=2), RequestContext("other")) is not None


class _Raising(ScriptedTier):
    tier_type = "raising"

    def lookup(self, key: bytes, request: RequestContext | None) -> LookupResult:
        raise RuntimeError("lookup exploded")

    def poll_finished(self) -> list[Any]:
        raise RuntimeError("poll exploded")

    def touch(self, keys: Any, request: RequestContext | None) -> None:
        raise RuntimeError("touch exploded")

    def on_request_finished(self, request: RequestContext) -> None:
        raise RuntimeError("hook exploded")


register_tier("raising", f"{__name__}:_Raising")


def test_a_tier_raising_from_scheduler_calls_never_crashes_the_scheduler(
    namespace: Namespace, caplog: pytest.LogCaptureFixture
) -> None:
    mgr = TieringManager.create(
        namespace=namespace, num_cpu_blocks=4, tiers=[{"type": "raising"}, {"type": "scripted", "name": "ok"}]
    )
    try:
        req = RequestContext("r")
        k = keys(1)[0]
        ok = tiers(mgr)[1]
        ok.data[k] = b"v" * mgr.block_bytes
        with caplog.at_level("ERROR", logger="kvtier.manager"):
            assert mgr.lookup(k, req) is HIT_PENDING, "the healthy tier behind the raising one still serves"
            assert mgr.lookup(keys(1, seed=4)[0], req) is MISS
            mgr.touch([k], req)
            mgr.on_schedule_end()
            mgr.on_request_finished(req)
        logged = [r.getMessage() for r in caplog.records if "raised from" in r.getMessage()]
        assert any("lookup()" in m and "#1" in m and "type=raising" in m for m in logged)
        assert sum("lookup()" in m for m in logged) == 1, "logged once per (tier, call), then counted"
        assert mgr.stats().as_dict()["manager"]["tier_call_errors"] >= 4
        assert mgr.lookup(k, req) is HIT
    finally:
        mgr.shutdown()


class _StepCounting(ScriptedTier):
    """A tier with its own step-end work (counts the calls); the second raises from it."""

    tier_type = "step-counting"

    def __init__(self, context: Any, **options: Any) -> None:
        super().__init__(context, **options)
        self.step_ends = 0

    def on_schedule_end(self) -> None:
        self.step_ends += 1
        if self.name == "raising":
            raise RuntimeError("step end exploded")


register_tier("step-counting", f"{__name__}:_StepCounting")


def test_every_tier_with_step_end_work_is_called_once_per_step(namespace: Namespace) -> None:
    """The manager skips the base class's on_schedule_end (it does nothing) but calls every tier
    that has step-end work, every step, a raising one included (counted)."""
    specs = [{"type": "scripted", "name": "plain"}, {"type": "step-counting", "name": "counting"},
             {"type": "step-counting", "name": "raising"}]  # fmt: skip
    mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=4, tiers=specs)
    plain, counting, raising = mgr.tiers
    assert isinstance(counting, _StepCounting) and isinstance(raising, _StepCounting)
    try:
        for _ in range(3):
            mgr.on_schedule_end()
        assert (counting.step_ends, raising.step_ends) == (3, 3)
        assert mgr.stats().manager.tier_call_errors == 3
        assert isinstance(plain, ScriptedTier)
    finally:
        mgr.shutdown()


def test_complete_store_never_completes_a_promotion_in_flight(make: Any) -> None:
    # regression: an anonymous complete_store (no request) of a key whose row a promotion is
    # still writing marked that row readable before its bytes arrived
    mgr = make(4, {"auto_complete": False})
    (t1,) = tiers(mgr)
    k = keys(1)[0]
    t1.data[k] = payload(k, mgr.block_bytes).tobytes()
    assert mgr.lookup(k, RequestContext("r")) is HIT_PENDING
    mgr.complete_store([k])
    mgr.complete_store([k], RequestContext("other"))
    assert mgr.primary.ref_count(k) == -1 and mgr.lookup(k, RequestContext("r")) is HIT_PENDING
    mgr.on_schedule_end()
    t1.complete_all()
    mgr.on_schedule_end()
    assert mgr.lookup(k, RequestContext("r")) is HIT
    rows = mgr.rows
    assert np.array_equal(rows[mgr.primary.slot_of(k), : mgr.block_bytes], payload(k, mgr.block_bytes))
    del rows


def test_anonymous_store_round_trip(make: Any) -> None:
    mgr = make(4, {})
    ks = keys(2)
    result = mgr.prepare_store(ks)
    assert result is not None
    mgr.complete_store(ks)
    assert [mgr.lookup(k) for k in ks] == [HIT, HIT]
    assert set(tiers(mgr)[0].data) == set(ks)


def test_late_completion_does_not_resurrect_a_finished_request(make: Any) -> None:
    # regression: complete_store after reset_cache re-created the request's state, which
    # nothing would ever finish (a slow leak per request)
    mgr = make(4, {})
    req = RequestContext("gone")
    ks = keys(1)
    assert mgr.prepare_store(ks, req) is not None
    mgr.on_request_finished(req)
    mgr.reset_cache()
    assert mgr.stats().as_dict()["manager"]["active_requests"] == 0
    mgr.complete_store(ks, req)
    assert mgr.stats().as_dict()["manager"]["active_requests"] == 0
    assert mgr.lookup(ks[0], req) is MISS


def test_a_request_chains_its_store_after_its_load(namespace: Namespace, private_shm: Path) -> None:
    region = SharedRegion("mgr-chains", 8, namespace.geometry.bytes_per_block, shm_dir=private_shm)
    policy = RecordingLRU(8)
    mgr = TieringManager(PrimaryTier(region, namespace.geometry.bytes_per_block, policy))
    try:
        ks = keys(6)
        first, second, other = RequestContext("a"), RequestContext("b"), RequestContext("c")
        for req in (first, second, other):
            mgr.on_new_request(req)
        store(mgr, ks[:3], first)
        mgr.prepare_load(ks[:3], second)  # the next turn hits the first three ...
        mgr.complete_load(ks[:3], second)
        store(mgr, ks[3:5], second)  # ... and stores two more, chained after them
        store(mgr, ks[5:], second)  # a later store of the same request chains on
        store(mgr, [keys(1, seed=9)[0]], other)  # another request's store starts a chain
        slot = mgr.primary.slot_of
        assert [(c[0], c[2], c[3]) for c in policy.chains] == [
            (ks[:3], -1, False),
            (ks[:3], -1, True),
            (ks[3:5], slot(ks[2]), False),
            (ks[5:], slot(ks[4]), False),
            ([keys(1, seed=9)[0]], -1, False),
        ]
        # Only the store after the same request's store continues it (not the one after its load).
        assert policy.continued == [3]
        mgr.prepare_load(ks[:2], other)  # a load in between: the next store starts after the load
        mgr.complete_load(ks[:2], other)
        store(mgr, keys(2, seed=8), other)
        store(mgr, keys(2, seed=7), other)
        assert policy.continued == [3, 7]
        # A finished request that stored blocks names the tail of its last store; one that
        # only loaded, or whose tail has left the tier, names nothing.
        assert policy.ended == []
        mgr.on_request_finished(second)
        assert policy.ended == [slot(ks[5])]
        assert slot(ks[2]) is None, "the 8-block tier evicted the first request's tail"
        mgr.on_request_finished(first)
        assert policy.ended == [slot(ks[5])]
        mgr.on_request_finished(other)
        assert policy.ended == [slot(ks[5]), slot(keys(2, seed=7)[1])]
        loader = RequestContext("d")
        mgr.on_new_request(loader)
        mgr.prepare_load(ks[:1], loader)
        mgr.complete_load(ks[:1], loader)
        mgr.on_request_finished(loader)
        assert len(policy.ended) == 2
    finally:
        mgr.shutdown()


def test_a_stray_complete_load_never_releases_a_cascades_pin(make: Any) -> None:
    """Regression (review, 2026-12-02): a complete_load with no load outstanding took away the pin
    an in-flight cascade held; the row was evicted and rewritten while the tier was still to copy
    it, and the tier then served another block's bytes under the old key (wrong KV)."""
    mgr = make(2, {"auto_complete": False})
    (tier,) = tiers(mgr)
    a, b, c = keys(3)
    req = RequestContext("r")
    store(mgr, [a], req)  # cascaded: a's row is pinned until the tier reports the job
    mgr.complete_load([a], req)  # stray: no prepare_load of a
    mgr.complete_load([a, a], req)  # and a duplicate
    assert mgr.stats().tiers[0].failures["stray_load_completion"] == 3
    store(mgr, [b], req)
    assert mgr.prepare_store([c], req) is None, "a's row is still being copied: nothing may evict it"
    tier.complete_all()
    mgr.on_schedule_end()
    assert tier.data[a] == payload(a, mgr.block_bytes).tobytes()
    # A real load's pin is still released by its complete_load, once.
    rows = mgr.prepare_load([b], req)
    assert len(rows) == 1
    mgr.complete_load([b], req)
    store(mgr, [c], req)  # evicts a or b: both are free again
    assert mgr.stats().tiers[0].failures["stray_load_completion"] == 3


def test_a_duplicate_complete_load_never_releases_another_requests_load(make: Any) -> None:
    """Regression (transfer audit, 2026-12-05): loads were counted by row, not by request, so a
    request completing its load twice took away another request's pin on the same row; the row
    was then evicted and rewritten while that request's device copy was still to read it (wrong
    KV), and that request's own completion was counted as stray."""
    mgr = make(2)
    a, b, c = keys(3)
    writer, first, second = RequestContext("w"), RequestContext("b"), RequestContext("c")
    store(mgr, [a, b], writer)
    row_a = mgr.primary.slot_of(a)
    mgr.prepare_load([a], first)
    mgr.prepare_load([a], second)
    mgr.complete_load([a], first)
    mgr.complete_load([a], first)  # a duplicate: the first request has no load of a left
    assert mgr.stats().tiers[0].failures["stray_load_completion"] == 1
    mgr.on_schedule_end()
    assert mgr.prepare_store([c], writer) is not None  # b is the only block free to go
    mgr.complete_store([c], writer)
    assert mgr.primary.slot_of(a) == row_a and mgr.lookup(a, second) is LookupResult.HIT, (
        "the second request's load still holds a's row")
    mgr.complete_load([a], second)  # its own completion releases its own pin, not counted stray
    assert mgr.stats().tiers[0].failures["stray_load_completion"] == 1
    # A completion naming no request still releases a load it did not name (the caller gave none),
    # and one naming a request releases a load taken without one.
    mgr.prepare_load([a], first)
    mgr.complete_load([a])
    mgr.prepare_load([a])
    mgr.complete_load([a], second)
    assert mgr.stats().tiers[0].failures["stray_load_completion"] == 1
    mgr.on_schedule_end()
    assert mgr.prepare_store(keys(2, seed=5), writer) is not None, "every load is released: both rows go"


def test_tiers_hear_a_request_finish_once(make: Any) -> None:
    """Regression (review, 2026-12-02): a second on_request_finished (or one for a request the
    manager never saw, repeated) called every tier's on_request_finished hook again."""
    mgr = make(4, {})
    (tier,) = tiers(mgr)
    req = RequestContext("once")
    mgr.on_new_request(req)
    store(mgr, keys(1), req)
    mgr.on_schedule_end()
    mgr.on_request_finished(req)
    mgr.on_schedule_end()
    mgr.on_request_finished(req)
    stranger = RequestContext("never-seen")
    mgr.on_request_finished(stranger)
    mgr.on_request_finished(stranger)
    assert tier.finished_requests == ["once", "never-seen"]
    again = RequestContext("once")  # an id used again is a new request
    mgr.on_new_request(again)
    mgr.on_request_finished(again)
    assert tier.finished_requests == ["once", "never-seen", "once"]
