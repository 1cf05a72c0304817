"""TieringManager.lookup_prefix: a request's prefix scan in one call, exactly as lookup per key."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import tier_doubles
from kvtier import LookupResult, Namespace, PrefixLookup, RequestContext, TieringManager, prefix_keys
from kvtier.errors import InvalidKeyError, ManagerClosedError
from kvtier.tiers.registry import register_tier
from tier_doubles import ScriptedTier

pytestmark = pytest.mark.usefixtures("shm_leak_check")
register_tier("scripted", "tier_doubles:ScriptedTier")

HIT, HIT_PENDING, RETRY, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY, LookupResult.MISS


@pytest.fixture
def make(namespace: Namespace) -> Iterator[Any]:
    built: list[TieringManager] = []

    def factory(blocks: int = 8, tiers: int = 1, **options: Any) -> TieringManager:
        specs = [{"type": "scripted", "name": f"t{i}", "auto_complete": True} for i in range(1, tiers + 1)]
        mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=blocks, tiers=specs, policy="lru")
        for name, value in options.items():
            setattr(mgr, name, value)
        built.append(mgr)
        return mgr

    tier_doubles.CALLS.clear()
    yield factory
    for mgr in built:
        mgr.shutdown()
    tier_doubles.CALLS.clear()


def keys(n: int, seed: int = 0) -> list[bytes]:
    return prefix_keys(np.arange(n * 4) + seed * 100_000, 4)


def store(mgr: TieringManager, ks: list[bytes], req: RequestContext | None = None) -> None:
    result = mgr.prepare_store(ks, req)
    assert result is not None
    mgr.complete_store(result.keys_to_store, req)


def scripted(mgr: TieringManager) -> list[ScriptedTier]:
    return [t for t in mgr.tiers if isinstance(t, ScriptedTier)]


def test_a_run_of_cpu_hits_is_ready_and_counted(make: Any) -> None:
    mgr = make(8, tiers=0)
    ks = keys(5)
    store(mgr, ks)
    mgr.on_schedule_end()
    result = mgr.lookup_prefix(ks, RequestContext("r"))
    assert result == PrefixLookup([HIT] * 5, ready=5, found=5, deferred=False)
    snap = mgr.stats()
    assert snap.cpu.lookups.hit == 5 and snap.manager.lookups["hit"] == 5
    assert mgr.lookup_prefix([]) == PrefixLookup([], 0, 0, False)


def test_answers_stop_after_the_first_miss_and_say_what_is_ready(make: Any) -> None:
    mgr = make(8, tiers=1)
    (t1,) = scripted(mgr)
    hits = keys(2, seed=1)
    promoted, retried, later, missing, after = (keys(1, seed=s) for s in range(2, 7))
    store(mgr, hits + later)
    mgr.on_schedule_end()
    mgr.on_schedule_end()  # the cascades are polled: the tier holds hits + later now
    t1.data.clear()
    t1.data[promoted[0]] = b"p" * mgr.block_bytes
    t1.data[after[0]] = b"a" * mgr.block_bytes
    t1.retry_keys = set(retried)
    tier_doubles.CALLS.clear()
    scan = hits + promoted + retried + later + missing + after
    result = mgr.lookup_prefix(scan, RequestContext("r"))
    assert result.answers == [HIT, HIT, HIT_PENDING, RETRY, HIT, MISS]
    assert (result.ready, result.found, result.deferred) == (2, 4, True)
    assert mgr.primary.ref_count(after[0]) is None, "nothing after the first MISS is asked, or promoted"
    assert mgr.promoted_from == 0 or mgr.promoted_from == 1
    mgr.on_schedule_end()
    mgr.on_schedule_end()
    t1.retry_keys = set()
    assert mgr.lookup_prefix(hits + promoted, RequestContext("r")) == PrefixLookup([HIT] * 3, 3, 3, False)


def test_hits_of_a_prefix_are_protected_until_the_step_ends(make: Any) -> None:
    mgr = make(2, tiers=0)
    a = keys(2, seed=1)
    store(mgr, a)
    mgr.on_schedule_end()
    assert mgr.lookup_prefix(a).ready == 2
    assert mgr.prepare_store(keys(1, seed=2), RequestContext("other")) is None, "both HITs may still be loaded"
    mgr.on_schedule_end()
    assert mgr.prepare_store(keys(1, seed=2), RequestContext("other")) is not None


def test_every_lookup_of_a_prefix_is_timed_when_asked_to(make: Any) -> None:
    mgr = make(8, tiers=0, lookup_timing_every=1)
    ks = keys(6)
    store(mgr, ks)
    mgr.on_schedule_end()
    mgr.lookup_prefix(ks)
    assert mgr.stats().cpu.lookup_seconds.count == 6


def test_a_request_that_may_not_load_misses_at_once(make: Any) -> None:
    mgr = make(8, tiers=1)
    ks = keys(3)
    store(mgr, ks)
    mgr.on_schedule_end()
    req = RequestContext("r", {"kvtier_load_tiers": ["1:scripted"]})
    result = mgr.lookup_prefix(ks, req)
    assert result == PrefixLookup([MISS], 0, 0, False)


def test_a_bad_key_raises_after_the_keys_before_it(make: Any) -> None:
    mgr = make(8, tiers=1)
    ks = keys(2)
    store(mgr, ks)
    mgr.on_schedule_end()
    tier_doubles.CALLS.clear()
    with pytest.raises(InvalidKeyError, match="key"):
        mgr.lookup_prefix([ks[0], "not-bytes", ks[1]])  # type: ignore[list-item]
    with pytest.raises(InvalidKeyError, match="key"):
        mgr.lookup_prefix([ks[0], b""])
    assert mgr.stats().cpu.lookups.hit == 2, "the key before each bad one was looked up"
    assert not any(call == "lookup" for _, call in tier_doubles.CALLS), "no bad key reached a tier"
    mgr.shutdown()
    with pytest.raises(ManagerClosedError, match=r"lookup_prefix\(\) called after shutdown"):
        mgr.lookup_prefix(ks)


def test_a_generator_of_keys_is_accepted(make: Any) -> None:
    mgr = make(8, tiers=0)
    ks = keys(3)
    store(mgr, ks)
    assert mgr.lookup_prefix(k for k in ks).answers == [HIT] * 3


def _scenario(mgr: TieringManager, rng: random.Random, pool: list[bytes]) -> None:
    """The same random history on any manager: stores, tier contents, retries, loads, steps."""
    (t1, t2) = scripted(mgr)
    for k in rng.sample(pool, 10):
        (t1 if rng.random() < 0.5 else t2).data[k] = b"d" * mgr.block_bytes
    t2.retry_keys = set(rng.sample(pool, 3))
    store(mgr, rng.sample(pool, 5), RequestContext("seed"))


@pytest.mark.parametrize("seed", range(12))
def test_a_prefix_lookup_is_the_per_key_scan(make: Any, seed: int) -> None:
    """Two managers, one history: lookup_prefix and lookup-per-key-until-MISS give the same
    answers, counters, promotions, evictions and tier calls, step after step."""
    pool = keys(24, seed=7)
    batched, per_key = make(6, tiers=2), make(6, tiers=2)
    for mgr in (batched, per_key):
        _scenario(mgr, random.Random(seed), pool)
    rng = random.Random(1000 + seed)
    for step in range(8):
        req = RequestContext(f"r{step % 3}")
        start = rng.randrange(len(pool) - 8)
        scan = pool[start : start + rng.randrange(1, 9)]
        tier_doubles.CALLS.clear()
        got = batched.lookup_prefix(scan, req)
        calls_batched = list(tier_doubles.CALLS)
        tier_doubles.CALLS.clear()
        want: list[LookupResult] = []
        for k in scan:
            want.append(per_key.lookup(k, req))
            if want[-1] is MISS:
                break
        assert got.answers == want, f"step {step}"
        assert calls_batched == tier_doubles.CALLS
        ready = next((i for i, a in enumerate(want) if a is not HIT), len(want))
        assert (got.ready, got.found) == (ready, sum(a in (HIT, HIT_PENDING) for a in want))
        assert got.deferred == any(a in (HIT_PENDING, RETRY) for a in want)
        if got.ready and rng.random() < 0.5:
            for mgr in (batched, per_key):
                mgr.prepare_load(scan[: got.ready], req)
                mgr.complete_load(scan[: got.ready], req)
        if rng.random() < 0.3:
            fresh = keys(2, seed=100 + 10 * seed + step)
            plans = [mgr.prepare_store(fresh, req) for mgr in (batched, per_key)]
            assert [None if p is None else (p.keys_to_store, p.evicted_keys) for p in plans] == [
                None if p is None else (p.keys_to_store, p.evicted_keys) for p in plans[::-1]
            ], "the same HITs protected, the same blocks evicted"
            for mgr, plan in zip((batched, per_key), plans, strict=True):
                if plan is not None:
                    mgr.complete_store(plan.keys_to_store, req)
        for mgr in (batched, per_key):
            mgr.on_schedule_end()
        assert {k: batched.primary.ref_count(k) for k in pool} == {k: per_key.primary.ref_count(k) for k in pool}
        assert batched.take_events() == per_key.take_events()
        one, two = batched.stats(), per_key.stats()
        assert one.manager.lookups == two.manager.lookups
        assert one.cpu.lookups == two.cpu.lookups
        assert [t.lookup_seconds.count for t in one.tiers] == [t.lookup_seconds.count for t in two.tiers], (
            "the same lookups timed"
        )
        assert one.manager.promotions_started == two.manager.promotions_started


@pytest.mark.parametrize("timed", [True, False])
@pytest.mark.parametrize("stop", [0, 1, 63, 64, 65, 128, 129, None])
@pytest.mark.parametrize("kind", ["miss", "in_flight", "bytes_subclass", "not_bytes"])
def test_a_long_run_is_the_per_key_scan_across_chunks(make: Any, stop: int | None, kind: str, timed: bool) -> None:
    """lookup_prefix answers runs of CPU hits in chunks of 64 keys (kvtier.manager.scan): whatever
    ends the run (a MISS, a block being written, a key of another type) at a chunk's edge or
    inside one, the answers, counts and timed lookups are those of a lookup per key, in a step
    whose lookups are timed (the first with lookups) and in one that takes the fast paths."""

    class Key(bytes):
        pass

    ks = keys(150, seed=3)
    managers = make(200, tiers=0, lookup_timing_every=8), make(200, tiers=0, lookup_timing_every=8)
    scan = list(ks)
    for mgr in managers:
        store(mgr, ks[:140])
        if kind == "in_flight" and stop is not None:
            assert mgr.prepare_store([ks[stop]]) is not None  # stored, not completed: HIT_PENDING
        mgr.on_schedule_end()
        if not timed:  # the first step with lookups is timed, the next one of 8 is not
            mgr.lookup(b"warm", None)
            mgr.on_schedule_end()
        mgr.lookup(b"warm", None)  # the step is polled (and timed or not): the fast paths are taken
    if stop is not None and kind in ("bytes_subclass", "not_bytes"):
        scan[stop] = Key(ks[stop]) if kind == "bytes_subclass" else ks[stop].hex()  # type: ignore[call-overload]
    elif stop is not None and kind == "miss":
        scan[stop] = b"absent" + ks[stop]
    batched, per_key = managers
    if kind == "not_bytes" and stop is not None:
        with pytest.raises(InvalidKeyError):
            batched.lookup_prefix(scan)
        with pytest.raises(InvalidKeyError):
            for k in scan:
                per_key.lookup(k)
    else:
        got = batched.lookup_prefix(scan)
        want: list[LookupResult] = []
        for k in scan:
            want.append(per_key.lookup(k))
            if want[-1] is MISS:
                break
        assert got.answers == want
    a, b = batched.stats().cpu, per_key.stats().cpu
    assert (a.lookups, a.lookup_seconds.count) == (b.lookups, b.lookup_seconds.count)
    assert batched._hits.protected() == per_key._hits.protected()
