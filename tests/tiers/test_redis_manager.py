"""Acceptance: TieringManagers with separate CPU regions share blocks through one Redis."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvtier import TieringManager
from kvtier.keys import BlockKey, KVGeometry, Namespace, chain_ids
from kvtier.tiers.base import HealthState
from kvtier.tiers.redis import RedisTier
from kvtier.types import LookupResult, RequestContext

pytestmark = pytest.mark.redis

BLOCK = 32 * 1024


def namespace(model: str = "model-a") -> Namespace:
    return Namespace(model, KVGeometry.from_block_bytes(BLOCK))


@pytest.fixture
def make_manager(shm_leak_check: None) -> Iterator[Callable[..., TieringManager]]:
    built: list[TieringManager] = []

    def make(url: str, ns: Namespace, blocks: int = 32, **options: Any) -> TieringManager:
        spec = {"type": "redis", "url": url, "lookup_cache_seconds": 0.05, **options}
        mgr = TieringManager.create(namespace=ns, num_cpu_blocks=blocks, tiers=[spec])
        built.append(mgr)
        return mgr

    yield make
    for mgr in built:
        mgr.shutdown()


def step(mgr: TieringManager) -> None:
    mgr.on_schedule_end()
    time.sleep(0.002)


def store_blocks(mgr: TieringManager, keys: list[BlockKey], seed: int) -> np.ndarray:
    """Device -> CPU store of random blocks (the test plays the worker); returns the bytes."""
    req = RequestContext(f"store-{seed}")
    mgr.on_new_request(req)
    prepared = mgr.prepare_store(keys, req)
    assert prepared is not None and prepared.keys_to_store == keys
    data = np.random.default_rng(seed).integers(0, 256, (len(keys), BLOCK), dtype=np.uint8)
    for i, slot in enumerate(prepared.slots):
        mgr.rows[slot, :BLOCK] = data[i]
    mgr.complete_store(keys, req)
    mgr.on_request_finished(req)
    return data


def settle(mgr: TieringManager, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while mgr.has_pending_work():
        assert time.monotonic() < deadline, "manager still has pending work"
        step(mgr)
    step(mgr)


def lookup_prefix(mgr: TieringManager, keys: list[BlockKey], req: RequestContext, timeout: float = 10.0) -> int:
    """Step like an engine until every key is HIT or one is MISS; returns the HIT prefix length."""
    deadline = time.monotonic() + timeout
    while True:
        hits = 0
        waiting = False
        for key in keys:
            answer = mgr.lookup(key, req)
            if answer is LookupResult.HIT:
                hits += 1
                continue
            if answer is LookupResult.MISS:
                break
            waiting = True
        if not waiting:
            return hits
        assert time.monotonic() < deadline, "lookups did not settle"
        step(mgr)


def load_blocks(mgr: TieringManager, keys: list[BlockKey], req: RequestContext) -> np.ndarray:
    slots = mgr.prepare_load(keys, req)
    out = np.stack([mgr.rows[s, :BLOCK].copy() for s in slots])
    mgr.complete_load(keys, req)
    return out


def test_two_managers_share_blocks_through_one_redis(
    redis_server: Any, make_manager: Callable[..., TieringManager]
) -> None:
    ns = namespace()
    a = make_manager(redis_server.url, ns)
    b = make_manager(redis_server.url, ns)
    assert a.region.rows is not b.region.rows
    keys = chain_ids(range(8), ns)
    data = store_blocks(a, keys, seed=1)
    settle(a)
    assert a.tiers[0].stats.bytes_written > 0

    req = RequestContext("reader")
    b.on_new_request(req)
    assert lookup_prefix(b, keys, req) == len(keys)
    assert np.array_equal(load_blocks(b, keys, req), data)
    b.on_request_finished(req)
    tier_b = b.tiers[0]
    assert isinstance(tier_b, RedisTier) and tier_b.stats.bytes_read == 8 * tier_b._value_bytes


def test_different_namespaces_never_share(redis_server: Any, make_manager: Callable[..., TieringManager]) -> None:
    ns_a = namespace("model-a")
    ns_b = Namespace("model-a", KVGeometry.from_block_bytes(BLOCK), model_revision="v2")
    assert ns_a.digest != ns_b.digest
    a = make_manager(redis_server.url, ns_a)
    b = make_manager(redis_server.url, ns_b)
    keys = chain_ids(range(4), ns_a)
    store_blocks(a, keys, seed=2)
    settle(a)
    req = RequestContext("reader")
    b.on_new_request(req)
    assert lookup_prefix(b, keys, req) == 0
    assert b.tiers[0].stats.bytes_read == 0
    # The same namespace does see them (the keys really are there).
    c = make_manager(redis_server.url, ns_a)
    req_c = RequestContext("reader-c")
    c.on_new_request(req_c)
    assert lookup_prefix(c, keys, req_c) == len(keys)


def test_cluster_two_managers_share(redis_cluster: Any, make_manager: Callable[..., TieringManager]) -> None:
    ns = namespace("cluster-model")
    a = make_manager(redis_cluster.url, ns, cluster=True)
    b = make_manager(redis_cluster.url, ns, cluster=True)
    keys = chain_ids(range(16), ns)
    data = store_blocks(a, keys, seed=3)
    settle(a)
    req = RequestContext("reader")
    b.on_new_request(req)
    assert lookup_prefix(b, keys, req) == len(keys)
    assert np.array_equal(load_blocks(b, keys, req), data)


@pytest.mark.slow
def test_step_loop_survives_sigkill_and_recovers(
    redis_server: Any, make_manager: Callable[..., TieringManager]
) -> None:
    ns = namespace()
    options = {"open_seconds": 0.5, "socket_timeout": 0.5, "connect_timeout": 0.5}
    a = make_manager(redis_server.url, ns, blocks=64, **options)
    b = make_manager(redis_server.url, ns, blocks=64, **options)
    shared = chain_ids(range(4), ns)
    store_blocks(a, shared, seed=4)
    settle(a)
    worst = 0.0
    batch = iter(range(1000, 10**6))

    def engine_step() -> int:
        """One step of both engines: A stores new blocks, B looks up the shared prefix."""
        nonlocal worst
        t0 = time.perf_counter()
        first = next(batch) * 4
        store_blocks(a, chain_ids(range(first, first + 4), ns), seed=first)
        req = RequestContext(f"r{first}")
        b.on_new_request(req)
        hits = 0
        for key in shared:
            answer = b.lookup(key, req)
            if answer is LookupResult.MISS:
                break
            hits += answer is LookupResult.HIT
        if hits == len(shared):
            load_blocks(b, shared, req)
        b.on_request_finished(req)
        a.on_schedule_end()
        b.on_schedule_end()
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.005)
        return hits

    for _ in range(10):
        engine_step()
    redis_server.kill()
    killed = time.monotonic()
    tier_b = b.tiers[0]
    probe = chain_ids([10**7], ns)[0]  # never stored: B must ask Redis about it
    while True:
        t0 = time.perf_counter()
        answer = b.lookup(probe)
        worst = max(worst, time.perf_counter() - t0)
        if answer is LookupResult.MISS and tier_b.health().state is not HealthState.CLOSED:
            break
        assert time.monotonic() - killed < 2.0, "lookups did not answer MISS within 2 s"
        engine_step()
    for _ in range(20):
        engine_step()
    assert worst < 0.05, f"an engine step took {worst * 1000:.1f} ms"
    assert a.tiers[0].stats.stores_dropped > 0

    redis_server.start()
    deadline = time.monotonic() + 10
    while a.tiers[0].health().state is not HealthState.CLOSED:
        assert time.monotonic() < deadline, "tier did not recover after restart"
        engine_step()
    fresh = chain_ids(range(5 * 10**6, 5 * 10**6 + 4), ns)
    data = store_blocks(a, fresh, seed=5)
    settle(a)
    req = RequestContext("after-restart")
    b.on_new_request(req)
    assert lookup_prefix(b, fresh, req) == len(fresh)
    assert np.array_equal(load_blocks(b, fresh, req), data)
    settle(a)
    settle(b)


def test_corrupt_value_warning_keeps_no_cpu_row_alive(
    redis_server: Any, make_manager: Callable[..., TieringManager], caplog: pytest.LogCaptureFixture
) -> None:
    """A handler that keeps log records (caplog, log shippers) must not pin a CPU row:
    shutdown after a corrupt-value warning releases the region (regression: RegionBusyError)."""
    import redis as redis_py

    ns = namespace()
    a = make_manager(redis_server.url, ns)
    keys = chain_ids(range(2), ns)
    store_blocks(a, keys, seed=5)
    settle(a)
    raw = redis_py.Redis.from_url(redis_server.url)
    tier_a = a.tiers[0]
    assert isinstance(tier_a, RedisTier)
    name = tier_a.redis_key(keys[0])
    value = raw.get(name)
    assert value is not None
    raw.setrange(name, len(value) - 1, bytes([value[-1] ^ 0xFF]))

    b = TieringManager.create(namespace=ns, num_cpu_blocks=8, tiers=[
        {"type": "redis", "url": redis_server.url, "lookup_cache_seconds": 0.05}
    ])
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.redis"):
            req = RequestContext("reader")
            b.on_new_request(req)
            assert lookup_prefix(b, keys[:1], req) == 0
            settle(b)
        assert b.tiers[0].stats.corrupt_values == 1
        assert any("corrupt" in r.getMessage() for r in caplog.records), "the warning is still logged"
        b.shutdown()  # the records are still held by caplog
        assert b.is_shut_down and b.region.closed
    finally:
        if not b.is_shut_down:
            caplog.clear()
            b.shutdown()


def test_keys_up_to_the_maximum_length_round_trip_through_redis(
    redis_server: Any, make_manager: Callable[..., TieringManager]
) -> None:
    """A 40-byte key used to raise inside the Redis pipeline, count as a server failure, open the
    breaker and drop valid stores; keys up to MAX_KEY_BYTES are now stored as they are."""
    from kvtier.tiers.format import MAX_KEY_BYTES

    ns = namespace()
    a = make_manager(redis_server.url, ns)
    b = make_manager(redis_server.url, ns)
    keys = [bytes([i]) * n for i, n in enumerate((36, 40, MAX_KEY_BYTES, 32), start=1)]
    data = store_blocks(a, keys, seed=7)
    settle(a)
    tier_a = a.tiers[0]
    assert isinstance(tier_a, RedisTier)
    assert tier_a.stats.stores_failed == 0 and tier_a.health().state is HealthState.CLOSED
    req = RequestContext("reader")
    b.on_new_request(req)
    assert lookup_prefix(b, keys, req) == len(keys)
    assert np.array_equal(load_blocks(b, keys, req), data)


def test_a_refusing_server_costs_a_request_one_step_not_the_wait_timeout(
    redis_server: Any, make_manager: Callable[..., TieringManager]
) -> None:
    """Regression (review, 2026-12-03): with an ACL user whose keys do not cover the prefix (NOPERM),
    each new request sat deferred for the whole wait_timeout (10 s) before its MISS."""
    import redis

    redis.Redis.from_url(redis_server.url).execute_command("ACL", "SETUSER", "kv", "on", ">pw", "~other:*", "+@all")
    ns = namespace()
    mgr = make_manager(f"redis://kv:pw@127.0.0.1:{redis_server.port}/0", ns)
    for n in range(3):
        req = RequestContext(f"r{n}")
        mgr.on_new_request(req)
        started = time.monotonic()
        assert lookup_prefix(mgr, chain_ids(range(10 * n, 10 * n + 4), ns), req, timeout=5.0) == 0
        assert time.monotonic() - started < 1.0
        mgr.on_request_finished(req)
