"""RedisTier against a real redis-server on a loopback port (see conftest.py)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import shutil
import socket
import subprocess
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from redis_servers import MuteLink, SlowLink
from tls_certificates import make_test_certificates

from kvtier.errors import ConfigError, TierError
from kvtier.keys import BlockKey, KVGeometry, Namespace, chain_ids
from kvtier.tiers import redis as redis_tier_module
from kvtier.tiers import redis_protocol
from kvtier.tiers.base import HealthState, JobResult, TierContext, TransferJob
from kvtier.tiers.format import HEADER_SIZE
from kvtier.tiers.redis import RedisTier, RedisTierOptions, refused_by_server
from kvtier.tiers.redis_protocol import ErrorReply
from kvtier.tiers.registry import create_tier
from kvtier.types import LookupResult

pytestmark = pytest.mark.redis

BLOCK = 64 * 1024
_job_ids = itertools.count(1)


def namespace(model: str = "model-a", block_bytes: int = BLOCK) -> Namespace:
    return Namespace(model, KVGeometry.from_block_bytes(block_bytes))


def random_rows(num_rows: int, block_bytes: int = BLOCK, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(num_rows, block_bytes), dtype=np.uint8)


def keys_for(ns: Namespace, n: int, start: int = 0) -> list[BlockKey]:
    return chain_ids(range(start, start + n), ns)


def job(keys: list[BlockKey], slots: list[int], promotion: bool) -> TransferJob:
    return TransferJob(next(_job_ids), keys, np.asarray(slots, dtype=np.int64), promotion)


def wait_results(tier: RedisTier, n: int, timeout: float = 10.0) -> list[JobResult]:
    results: list[JobResult] = []
    deadline = time.monotonic() + timeout
    while len(results) < n:
        assert time.monotonic() < deadline, f"only {len(results)} of {n} job results after {timeout}s"
        results.extend(tier.poll_finished())
        time.sleep(0.002)
    return results


def resolve(tier: RedisTier, key: BlockKey, timeout: float = 5.0) -> LookupResult:
    """Ask like the scheduler does, one step at a time, until the answer is not RETRY."""
    deadline = time.monotonic() + timeout
    while True:
        answer = tier.lookup(key, None)
        if answer is not LookupResult.RETRY:
            return answer
        assert time.monotonic() < deadline, "lookup still RETRY"
        tier.on_schedule_end()
        time.sleep(0.002)


@pytest.fixture
def make_tier() -> Iterator[Callable[..., RedisTier]]:
    tiers: list[RedisTier] = []

    def make(url: str, rows: np.ndarray, ns: Namespace | None = None, **options: object) -> RedisTier:
        ctx = TierContext(rows, rows.shape[1], ns or namespace(block_bytes=rows.shape[1]))
        tier = RedisTier(ctx, url=url, **options)  # type: ignore[arg-type]
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.shutdown()


def store(tier: RedisTier, keys: list[BlockKey], slots: list[int]) -> JobResult:
    tier.submit_store(job(keys, slots, False))
    (result,) = wait_results(tier, 1)
    return result


def load(tier: RedisTier, keys: list[BlockKey], slots: list[int]) -> JobResult:
    tier.submit_load(job(keys, slots, True))
    (result,) = wait_results(tier, 1)
    return result


def test_round_trip_is_byte_exact(redis_server: Any, make_tier: Callable[..., RedisTier]) -> None:
    rows = random_rows(16)
    rows[8:] = 0
    ns = namespace()
    tier = make_tier(redis_server.url, rows, ns)
    keys = keys_for(ns, 8)
    result = store(tier, keys, list(range(8)))
    assert result.success and result.error is None
    assert result.bytes_moved == 8 * (HEADER_SIZE + BLOCK)
    for key in keys:
        assert resolve(tier, key) is LookupResult.HIT
    result = load(tier, keys, list(range(8, 16)))
    assert result.success, result.error
    assert np.array_equal(rows[8:16], rows[0:8])
    assert tier.stats.bytes_read == 8 * (HEADER_SIZE + BLOCK)
    events = tier.take_events()
    assert [e.removed for e in events] == [False] and set(events[0].keys) == set(keys)
    assert events[0].medium == "remote" and events[0].tier == tier.label


def test_value_layout_and_key_name(redis_server: Any, make_tier: Callable[..., RedisTier]) -> None:
    rows = random_rows(2)
    ns = namespace()
    tier = make_tier(redis_server.url, rows, ns, prefix="kvt")
    (key,) = keys_for(ns, 1)
    assert store(tier, [key], [0]).success
    name = f"kvt:{ns.hexdigest}:{key.hex()}".encode()
    assert tier.redis_key(key) == name
    raw = redis.Redis.from_url(redis_server.url).get(name)
    assert raw is not None and len(raw) == HEADER_SIZE + BLOCK
    assert raw[HEADER_SIZE:] == rows[0].tobytes()


def test_unknown_key_is_retry_then_miss(redis_server: Any, make_tier: Callable[..., RedisTier]) -> None:
    tier = make_tier(redis_server.url, random_rows(2))
    (key,) = keys_for(namespace(), 1, start=1000)
    assert tier.lookup(key, None) is LookupResult.RETRY
    assert tier.lookup(key, None) is LookupResult.RETRY  # same step: no duplicate check queued
    assert resolve(tier, key) is LookupResult.MISS
    assert tier.stats.lookups_retry >= 2 and tier.stats.lookups_miss == 1


def test_missing_key_fails_only_that_key(redis_server: Any, make_tier: Callable[..., RedisTier]) -> None:
    rows = random_rows(8)
    ns = namespace()
    tier = make_tier(redis_server.url, rows, ns)
    keys = keys_for(ns, 3)
    assert store(tier, keys[:2], [0, 1]).success
    result = load(tier, keys, [4, 5, 6])
    assert not result.success
    assert result.successful_keys == frozenset(keys[:2])
    assert result.error is not None and "missing" in result.error
    assert np.array_equal(rows[4:6], rows[0:2])


def test_store_skips_keys_known_present(redis_server: Any, make_tier: Callable[..., RedisTier]) -> None:
    rows = random_rows(4)
    ns = namespace()
    tier = make_tier(redis_server.url, rows, ns, lookup_cache_seconds=30.0)
    keys = keys_for(ns, 2)
    assert store(tier, keys[:1], [0]).success
    written = tier.stats.bytes_written
    result = store(tier, keys, [0, 1])
    assert result.success
    assert tier.stats.bytes_written - written == HEADER_SIZE + BLOCK


def _two_stored(url: str, make_tier: Callable[..., RedisTier]) -> tuple[RedisTier, np.ndarray, list[BlockKey],
                                                                         redis.Redis, bytes, bytes]:
    """A tier that stored two blocks (rows 0-1; rows 4-7 zeroed for loads), a raw client, and the
    first block's Redis name and value, for tests that tamper with it."""
    rows = random_rows(8)
    rows[4:] = 0
    ns = namespace()
    tier = make_tier(url, rows, ns)
    keys = keys_for(ns, 2)
    assert store(tier, keys, [0, 1]).success
    raw = redis.Redis.from_url(url)
    name = tier.redis_key(keys[0])
    value = raw.get(name)
    assert isinstance(value, bytes)
    return tier, rows, keys, raw, name, value


@pytest.mark.parametrize(
    "damage",
    ["flip_payload", "truncate", "header_junk", "short", "wrong_key", "empty"],
)
def test_corrupt_values_are_miss_deleted_and_counted(
    redis_server: Any, make_tier: Callable[..., RedisTier], damage: str
) -> None:
    tier, rows, keys, raw, name, value = _two_stored(redis_server.url, make_tier)
    if damage == "flip_payload":
        raw.setrange(name, HEADER_SIZE + 1234, bytes([value[HEADER_SIZE + 1234] ^ 0xFF]))
    elif damage == "truncate":
        raw.set(name, value[:-10])
    elif damage == "header_junk":
        raw.setrange(name, 40, b"\x00junk\x00")
    elif damage == "short":
        raw.set(name, value[:50])
    elif damage == "wrong_key":
        raw.set(name, raw.get(tier.redis_key(keys[1])))
    elif damage == "empty":
        raw.set(name, b"")

    result = load(tier, keys, [4, 5])
    assert not result.success
    assert result.successful_keys == frozenset([keys[1]])
    assert tier.stats.corrupt_values == 1
    assert raw.exists(name) == 0, "a corrupt value must be deleted"
    assert raw.exists(tier.redis_key(keys[1])) == 1
    assert np.array_equal(rows[5], rows[1])
    assert resolve(tier, keys[0]) is LookupResult.MISS
    assert any(e.removed and e.keys == (keys[0],) for e in tier.take_events())
    assert tier.health().state is HealthState.CLOSED


@pytest.mark.parametrize("resized", [False, True])
def test_a_value_of_another_releases_format_is_a_miss_and_kept(
    redis_server: Any, make_tier: Callable[..., RedisTier], resized: bool
) -> None:
    """Regression (review, 2026-12-02): a value in a newer release's format version was deleted as corrupt."""
    tier, rows, keys, raw, name, stored = _two_stored(redis_server.url, make_tier)
    tier.take_events()
    value = bytearray(stored)
    value[8:12] = (3).to_bytes(4, "little")
    newer = bytes(value) + (b"\x00" * 100 if resized else b"")
    raw.set(name, newer)
    result = load(tier, keys, [4, 5])
    assert result.successful_keys == frozenset([keys[1]])
    assert np.array_equal(rows[5], rows[1])
    assert raw.get(name) == newer, "another release's value must be left in place"
    assert tier.stats.corrupt_values == 0 and tier.stats.extra.get("foreign_format") == 1
    assert resolve(tier, keys[0]) is LookupResult.MISS
    assert not any(e.removed and keys[0] in e.keys for e in tier.take_events())
    assert tier.health().state is HealthState.CLOSED


def test_value_of_other_namespace_is_never_served(redis_server: Any, make_tier: Callable[..., RedisTier]) -> None:
    rows_a, rows_b = random_rows(2, seed=1), np.zeros((2, BLOCK), dtype=np.uint8)
    ns_a, ns_b = namespace("model-a"), namespace("model-b")
    tier_a = make_tier(redis_server.url, rows_a, ns_a)
    tier_b = make_tier(redis_server.url, rows_b, ns_b)
    keys = keys_for(ns_a, 1)
    assert store(tier_a, keys, [0]).success
    # Same block key, other namespace: a different Redis key, so B never sees it...
    assert resolve(tier_b, keys[0]) is LookupResult.MISS
    # ...and a value copied under B's name fails B's namespace check.
    raw = redis.Redis.from_url(redis_server.url)
    raw.set(tier_b.redis_key(keys[0]), raw.get(tier_a.redis_key(keys[0])))
    result = load(tier_b, keys, [0])
    assert not result.success and tier_b.stats.corrupt_values == 1
    assert raw.exists(tier_b.redis_key(keys[0])) == 0


def test_ttl_expired_key_is_miss(redis_server: Any, make_tier: Callable[..., RedisTier]) -> None:
    rows = random_rows(4)
    ns = namespace()
    tier = make_tier(redis_server.url, rows, ns, ttl_seconds=0.3, lookup_cache_seconds=0.05)
    keys = keys_for(ns, 2)
    assert store(tier, keys, [0, 1]).success
    raw = redis.Redis.from_url(redis_server.url)
    assert 0 < raw.pttl(tier.redis_key(keys[0])) <= 300
    time.sleep(0.5)
    assert resolve(tier, keys[0]) is LookupResult.MISS
    result = load(tier, keys, [2, 3])
    assert not result.success and result.successful_keys is None
    assert tier.stats.corrupt_values == 0


def test_touch_refreshes_ttl(redis_server: Any, make_tier: Callable[..., RedisTier]) -> None:
    rows = random_rows(2)
    ns = namespace()
    tier = make_tier(redis_server.url, rows, ns, ttl_seconds=100.0)
    keys = keys_for(ns, 1)
    assert store(tier, keys, [0]).success
    raw = redis.Redis.from_url(redis_server.url)
    raw.pexpire(tier.redis_key(keys[0]), 5000)
    tier.touch(keys, None)
    tier.on_schedule_end()  # a step's touches go out at its end
    deadline = time.monotonic() + 5
    while raw.pttl(tier.redis_key(keys[0])) < 50_000:
        assert time.monotonic() < deadline, "touch did not refresh the TTL"
        time.sleep(0.01)


def test_touches_queued_behind_a_hung_server_are_bounded(
    redis_server: Any, make_tier: Callable[..., RedisTier]
) -> None:
    """Every CPU-tier load touches the tier (its TTL): while the server hangs, the touches queued
    stay bounded, one batch per step (the rest are dropped and counted), and the tier works once
    the server is back."""
    from kvtier.tiers.jobs import Lane
    from kvtier.tiers.redis import _MAX_QUEUED_TOUCHES, _MAX_STEP_TOUCHES

    rows = random_rows(4)
    ns = namespace()
    tier = make_tier(redis_server.url, rows, ns, ttl_seconds=100.0, io_threads=1, socket_timeout=2.0)
    keys = keys_for(ns, 2)
    assert store(tier, keys[:1], [0]).success
    redis_server.pause()
    try:
        steps = 4 * _MAX_QUEUED_TOUCHES
        for _ in range(steps):
            for _ in range(3):  # three loads of the same block in a step: one key sent
                tier.touch(keys[:1], None)
            tier.on_schedule_end()
        queued = tier._queue.queued(Lane.BACKGROUND)
        assert queued <= _MAX_QUEUED_TOUCHES, f"{queued} touches queued behind a hung server"
        dropped = tier.stats.extra.get("touches_dropped", 0)
        assert steps - _MAX_QUEUED_TOUCHES - 1 <= dropped <= steps - _MAX_QUEUED_TOUCHES
        # One step touching more distinct keys than a step collects: the excess is dropped.
        many = [b"k%d" % i for i in range(_MAX_STEP_TOUCHES + 10)]
        tier.touch(many, None)
        assert len(tier._touched) == _MAX_STEP_TOUCHES
        assert tier.stats.extra["touches_dropped"] == dropped + 10
    finally:
        redis_server.resume()
    deadline = time.monotonic() + 10
    while True:  # the timed-out touch may have opened the breaker: a store once it serves again
        if tier.health().state is HealthState.CLOSED:
            result = store(tier, keys[1:], [1])
            if result.success:
                break
        assert time.monotonic() < deadline, "the tier did not serve again after the server resumed"
        tier.on_schedule_end()
        time.sleep(0.05)


def test_maxmemory_eviction_is_miss_never_error(
    redis_server_factory: Callable[..., Any], make_tier: Callable[..., RedisTier]
) -> None:
    server = redis_server_factory("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    n = 64  # 64 x 64 KiB = 4 MiB of payload, plus overhead: Redis must evict
    rows = random_rows(2 * n)
    ns = namespace()
    tier = make_tier(server.url, rows, ns, lookup_cache_seconds=0.0)
    keys = keys_for(ns, n)
    for i in range(0, n, 8):
        result = store(tier, keys[i : i + 8], list(range(i, i + 8)))
        assert result.success, result.error
    answers = [resolve(tier, k) for k in keys]
    assert set(answers) <= {LookupResult.HIT, LookupResult.MISS}
    assert LookupResult.MISS in answers, "the test needs Redis to have evicted something"
    result = load(tier, keys, list(range(n, 2 * n)))
    loaded = result.succeeded(keys)
    assert 0 < len(loaded) < n
    for key in loaded:
        i = keys.index(key)
        assert np.array_equal(rows[n + i], rows[i])
    assert tier.stats.corrupt_values == 0
    assert tier.health().state is HealthState.CLOSED
    deadline = time.monotonic() + 10
    while tier.usage().capacity_bytes is None:
        assert time.monotonic() < deadline, "usage() never picked up maxmemory"
        time.sleep(0.05)
    usage = tier.usage()
    assert usage.capacity_bytes == 4 * 1024 * 1024 and usage.used_bytes > 0


def _timed(call: Callable[[], object], worst: list[float]) -> object:
    t0 = time.perf_counter()
    out = call()
    worst[0] = max(worst[0], time.perf_counter() - t0)
    return out


@pytest.mark.slow
def test_sigkill_mid_run_opens_fast_and_recovers(redis_server: Any, make_tier: Callable[..., RedisTier]) -> None:
    rows = random_rows(64)
    ns = namespace()
    tier = make_tier(
        redis_server.url, rows, ns, open_seconds=0.5, socket_timeout=0.5, connect_timeout=0.5, lookup_cache_seconds=0.05
    )
    keys = keys_for(ns, 32)
    assert store(tier, keys[:16], list(range(16))).success
    worst = [0.0]
    submitted = 0
    results: list[JobResult] = []

    def step(i: int) -> list[LookupResult]:
        nonlocal submitted
        answers = [_timed(lambda k=k: tier.lookup(k, None), worst) for k in keys[:4]]  # type: ignore[misc]
        _timed(lambda: tier.submit_load(job(keys[:16], list(range(32, 48)), True)), worst)
        _timed(lambda: tier.submit_store(job(keys[16:], list(range(16, 32)), False)), worst)
        submitted += 2
        _timed(tier.on_schedule_end, worst)
        results.extend(_timed(tier.poll_finished, worst))  # type: ignore[arg-type]
        return answers  # type: ignore[return-value]

    for i in range(5):  # jobs in flight when the server dies
        step(i)
    redis_server.kill()
    killed_at = time.monotonic()
    miss_at = None
    while time.monotonic() - killed_at < 3.0:
        answers = step(0)
        if miss_at is None and all(a is LookupResult.MISS for a in answers):
            miss_at = time.monotonic() - killed_at
        time.sleep(0.01)
    assert miss_at is not None and miss_at < 2.0, f"lookups answered MISS only after {miss_at}s"
    assert tier.health().state is not HealthState.CLOSED
    assert tier.stats.stores_dropped > 0
    assert worst[0] < 0.05, f"a scheduler-thread call took {worst[0] * 1000:.1f} ms"
    results.extend(wait_results(tier, submitted - len(results), timeout=10))
    assert sorted(r.job_id for r in results) == sorted(set(r.job_id for r in results))
    assert any(not r.success for r in results)
    for r in results:  # failed jobs carry a reason
        assert r.success or r.error

    redis_server.start()  # same port, empty (no persistence)
    deadline = time.monotonic() + 10
    while tier.health().state is not HealthState.CLOSED:
        assert time.monotonic() < deadline, f"tier did not recover: {tier.health()}"
        tier.lookup(keys[0], None)
        tier.on_schedule_end()
        time.sleep(0.02)
    assert store(tier, keys[:4], [0, 1, 2, 3]).success
    rows[60:64] = 0
    result = load(tier, keys[:4], [60, 61, 62, 63])
    assert result.success, result.error
    assert np.array_equal(rows[60:64], rows[0:4])


def test_server_down_from_the_start(make_tier: Callable[..., RedisTier]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rows = random_rows(4)
    ns = namespace()
    tier = make_tier(f"redis://127.0.0.1:{port}/0", rows, ns, open_seconds=30.0)
    (key,) = keys_for(ns, 1)
    deadline = time.monotonic() + 2
    while resolve(tier, key) is not LookupResult.MISS or tier.health().serving:
        assert time.monotonic() < deadline
    t0 = time.perf_counter()
    tier.submit_store(job([key], [0], False))
    tier.submit_load(job([key], [1], True))
    assert time.perf_counter() - t0 < 0.05
    results = wait_results(tier, 2)
    assert not any(r.success for r in results)
    assert tier.stats.stores_dropped == 1 and tier.stats.loads_failed == 1
    assert "refused" in tier.health().detail.lower()


def test_shutdown_stops_threads_and_releases_rows(redis_server: Any, make_tier: Callable[..., RedisTier]) -> None:
    rows = random_rows(4)
    tier = make_tier(redis_server.url, rows)
    before = threading.active_count()
    tier.shutdown()
    assert threading.active_count() == before - tier.options.io_threads
    assert tier.context.rows.size == 0
    with pytest.raises(TierError, match="shut down"):
        tier.submit_store(job(keys_for(namespace(), 1), [0], False))
    assert tier.lookup(keys_for(namespace(), 1)[0], None) is LookupResult.MISS
    tier.shutdown()  # idempotent


def test_drain_waits_for_jobs(redis_server: Any, make_tier: Callable[..., RedisTier]) -> None:
    rows = random_rows(32)
    ns = namespace()
    tier = make_tier(redis_server.url, rows, ns)
    keys = keys_for(ns, 32)
    for i in range(0, 32, 4):
        tier.submit_store(job(keys[i : i + 4], list(range(i, i + 4)), False))
    assert tier.has_pending_work()
    tier.drain(timeout=10)
    results = tier.poll_finished()
    assert len(results) == 8 and all(r.success for r in results)
    assert not tier.has_pending_work()


def test_registry_and_config_errors(redis_server: Any) -> None:
    rows = random_rows(2)
    ctx = TierContext(rows, BLOCK, namespace())
    tier = create_tier({"type": "redis", "url": redis_server.url, "prefix": "x", "io_threads": 1}, ctx)
    try:
        assert isinstance(tier, RedisTier)
        assert tier.describe()["key_prefix"] == f"x:{namespace().hexdigest}:"
    finally:
        tier.shutdown()
    with pytest.raises(ConfigError, match="scheme 'http'"):
        RedisTier(ctx, url="http://localhost:6379")
    with pytest.raises(ConfigError, match="ttl_seconds"):
        RedisTier(ctx, url=redis_server.url, ttl_seconds=0)
    with pytest.raises(ConfigError, match="bad options"):
        create_tier({"type": "redis", "hostname": "x"}, ctx)
    secret = RedisTier(ctx, url="redis://user:hunter2@127.0.0.1:1/0", io_threads=1)
    try:
        assert "hunter2" not in str(secret.describe())
    finally:
        secret.shutdown()


def test_password_in_url(redis_server_factory: Callable[..., Any], make_tier: Callable[..., RedisTier]) -> None:
    server = redis_server_factory("--requirepass", "s3cret")
    rows = random_rows(4)
    ns = namespace()
    keys = keys_for(ns, 2)
    bad = make_tier(f"redis://:wrong@127.0.0.1:{server.port}/0", rows, ns, failure_threshold=1)
    assert resolve(bad, keys[0]) is LookupResult.MISS
    tier = make_tier(f"redis://:s3cret@127.0.0.1:{server.port}/0", rows, ns)
    assert store(tier, keys, [0, 1]).success
    assert load(tier, keys, [2, 3]).success
    assert np.array_equal(rows[2:4], rows[0:2])


def test_cluster_round_trip(redis_cluster: object, make_tier: Callable[..., RedisTier]) -> None:
    from redis.cluster import RedisCluster

    url = redis_cluster.url  # type: ignore[attr-defined]
    rows = random_rows(64)
    rows[32:] = 0
    ns = namespace()
    tier = make_tier(url, rows, ns, cluster=True)
    keys = keys_for(ns, 32)
    result = store(tier, keys, list(range(32)))
    assert result.success, result.error
    client = RedisCluster.from_url(url)
    try:
        nodes = {client.get_node_from_key(tier.redis_key(k)).name for k in keys}
        assert len(nodes) == 3, "32 keys should land on all three nodes"
        assert all(client.exists(tier.redis_key(k)) for k in keys)
    finally:
        client.close()
    assert all(resolve(tier, k) is LookupResult.HIT for k in keys)
    result = load(tier, keys, list(range(32, 64)))
    assert result.success, result.error
    assert np.array_equal(rows[32:], rows[:32])
    deadline = time.monotonic() + 10
    while tier.usage().used_bytes == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_failed_jobs_leave_no_view_of_the_rows_after_shutdown(redis_server: Any) -> None:
    """Regression: a traceback cycle kept an I/O frame (and its view of the rows) alive,
    so the shared region could not be closed after Redis died mid-job."""
    import gc
    import mmap

    ns = namespace()
    n = 64
    mm = mmap.mmap(-1, n * BLOCK)
    gc.disable()
    try:
        rows = np.frombuffer(mm, dtype=np.uint8).reshape(n, BLOCK)
        rows[:] = 7
        tier = RedisTier(TierContext(rows, BLOCK, ns), url=redis_server.url, socket_timeout=0.5, connect_timeout=0.5)
        del rows
        keys = keys_for(ns, n)
        for i in range(0, n, 8):
            tier.submit_store(job(keys[i : i + 8], list(range(i, i + 8)), False))
            tier.submit_load(job(keys[i : i + 8], list(range(i, i + 8)), True))
        redis_server.kill()
        results = wait_results(tier, 16)
        assert any(not r.success for r in results)
        tier.shutdown()
        del tier
        mm.close()  # BufferError if any view of the rows survived
    finally:
        gc.enable()


@pytest.mark.slow
def test_hung_server_times_out_opens_and_recovers(redis_server: Any, make_tier: Callable[..., RedisTier]) -> None:
    rows = random_rows(16)
    ns = namespace()
    tier = make_tier(
        redis_server.url,
        rows,
        ns,
        socket_timeout=0.3,
        connect_timeout=0.3,
        failure_threshold=2,
        open_seconds=0.5,
        lookup_cache_seconds=0.0,
    )
    keys = keys_for(ns, 8)
    assert store(tier, keys[:4], [0, 1, 2, 3]).success
    redis_server.pause()
    try:
        worst = [0.0]
        paused_at = time.monotonic()
        tier.submit_load(job(keys[:4], [8, 9, 10, 11], True))
        results: list[JobResult] = []
        miss_at = None
        while time.monotonic() - paused_at < 4.0 and (miss_at is None or not results):
            answer = _timed(lambda: tier.lookup(keys[5], None), worst)
            if answer is LookupResult.MISS and miss_at is None:
                miss_at = time.monotonic() - paused_at
            _timed(tier.on_schedule_end, worst)
            results.extend(_timed(tier.poll_finished, worst))  # type: ignore[arg-type]
            time.sleep(0.01)
        assert miss_at is not None and miss_at < 3.0, f"lookups answered MISS only after {miss_at}s"
        assert worst[0] < 0.05, f"a scheduler-thread call took {worst[0] * 1000:.1f} ms"
        assert len(results) == 1 and not results[0].success
        assert results[0].error is not None and "Timeout" in results[0].error
        deadline = time.monotonic() + 5
        while tier.health().state is HealthState.CLOSED:
            assert time.monotonic() < deadline, "a hung server must take the tier out of service"
            tier.lookup(keys[6], None)
            tier.on_schedule_end()
            time.sleep(0.01)
    finally:
        redis_server.resume()
    deadline = time.monotonic() + 10
    while tier.health().state is not HealthState.CLOSED:
        assert time.monotonic() < deadline, f"tier did not recover: {tier.health()}"
        time.sleep(0.02)
    rows[12:16] = 0
    result = load(tier, keys[:4], [12, 13, 14, 15])
    assert result.success, result.error
    assert np.array_equal(rows[12:16], rows[0:4])


def test_tls_round_trip(redis_tls_server: Any, make_tier: Callable[..., RedisTier]) -> None:
    _, url = redis_tls_server
    rows = random_rows(16, block_bytes=256 * 1024)
    rows[8:] = 0
    ns = namespace(block_bytes=256 * 1024)
    tier = make_tier(url, rows, ns)
    keys = keys_for(ns, 8)
    result = store(tier, keys, list(range(8)))
    assert result.success, result.error
    assert resolve(tier, keys[0]) is LookupResult.HIT
    result = load(tier, keys, list(range(8, 16)))
    assert result.success, result.error
    assert np.array_equal(rows[8:], rows[:8])


def test_acl_user_in_url(redis_server: Any, make_tier: Callable[..., RedisTier]) -> None:
    raw = redis.Redis.from_url(redis_server.url)
    raw.acl_setuser("engine", enabled=True, passwords=["+pw1"], keys=["kvtier:*"], commands=["+@all"])
    rows = random_rows(4)
    ns = namespace()
    keys = keys_for(ns, 2)
    tier = make_tier(f"redis://engine:pw1@127.0.0.1:{redis_server.port}/0", rows, ns)
    assert store(tier, keys, [0, 1]).success
    assert load(tier, keys, [2, 3]).success
    assert np.array_equal(rows[2:4], rows[0:2])
    # The ACL really applies: this user may not touch keys outside its prefix.
    other = make_tier(f"redis://engine:pw1@127.0.0.1:{redis_server.port}/0", rows, ns, prefix="other")
    result = store(other, keys, [0, 1])
    assert not result.success and result.error is not None and "NOPERM" in result.error
    assert other.health().state is HealthState.CLOSED


def _acl_url(redis_server: Any, user: str, *rules: str) -> str:
    raw = redis.Redis.from_url(redis_server.url)
    raw.execute_command("ACL", "SETUSER", user, "on", ">pw", *rules)
    return f"redis://{user}:pw@127.0.0.1:{redis_server.port}/0"


def test_an_acl_refusal_is_a_miss_a_breaker_failure_and_logged_once(
    redis_server: Any, make_tier: Callable[..., RedisTier], caplog: pytest.LogCaptureFixture
) -> None:
    """Regression (review, 2026-12-03): a NOPERM reply to EXISTS left the lookup at RETRY every step
    (the engine waited its whole wait_timeout), counted as a breaker success and logged nothing."""
    url = _acl_url(redis_server, "kv", "~other:*", "+@all")
    ns = namespace()
    tier = make_tier(url, random_rows(4), ns, failure_threshold=3, open_seconds=30.0)
    keys = keys_for(ns, 3)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.redis"):
        started = time.monotonic()
        assert resolve(tier, keys[0]) is LookupResult.MISS
        assert time.monotonic() - started < 1.0
        assert tier.health().state is HealthState.CLOSED and tier.health().consecutive_failures == 1
        assert "NOPERM" in tier.health().detail
        result = store(tier, keys[1:2], [1])
        assert not result.success and result.error is not None and "NOPERM" in result.error
        assert resolve(tier, keys[2]) is LookupResult.MISS
    assert tier.health().state is HealthState.OPEN, "three refusals in a row take the tier out of service"
    refusals = [r for r in caplog.records if "NOPERM" in r.getMessage() and "ACL user" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in caplog.records]


def test_a_busy_server_is_a_miss_and_opens_the_breaker(
    redis_server_factory: Callable[..., Any], make_tier: Callable[..., RedisTier]
) -> None:
    """Regression (review, 2026-12-03): while another client's script ran (-BUSY) every lookup
    answered RETRY and the breaker stayed closed."""
    server = redis_server_factory("--busy-reply-threshold", "50")
    ns = namespace()
    tier = make_tier(server.url, random_rows(4), ns, io_threads=1, failure_threshold=2, open_seconds=30.0)
    keys = keys_for(ns, 4)
    assert resolve(tier, keys[3]) is LookupResult.MISS  # connected before the server gets busy

    def run_script() -> None:
        with contextlib.suppress(redis.exceptions.ResponseError):  # "Script killed by user"
            redis.Redis.from_url(server.url).eval("while true do end", 0)

    runner = threading.Thread(target=run_script, daemon=True)
    runner.start()
    admin = redis.Redis.from_url(server.url)
    try:
        deadline = time.monotonic() + 5
        while True:  # wait until the server answers BUSY
            try:
                admin.ping()
            except redis.exceptions.BusyLoadingError:
                break
            except redis.exceptions.ResponseError as exc:
                if "BUSY" in str(exc):
                    break
                raise
            assert time.monotonic() < deadline, "the script never made the server busy"
            time.sleep(0.02)
        for key in keys[:2]:
            assert resolve(tier, key, timeout=2.0) is LookupResult.MISS
        assert tier.health().state is HealthState.OPEN and "BUSY" in tier.health().detail
    finally:
        admin.script_kill()
        runner.join(5)


def _refuse_writes(raw: redis.Redis, how: str) -> None:
    """Make the server refuse writes only: ``misconf`` (a failed RDB snapshot with
    stop-writes-on-bgsave-error) or ``noreplicas`` (min-replicas-to-write without a replica)."""
    if how == "noreplicas":
        raw.config_set("min-replicas-to-write", 1)
        return
    raw.config_set("dir", "/proc/self")  # the snapshot cannot be written there
    raw.bgsave()
    deadline = time.monotonic() + 10
    while raw.info("persistence")["rdb_last_bgsave_status"] != "err":
        assert time.monotonic() < deadline, "the failing BGSAVE did not end"
        time.sleep(0.02)
    raw.config_set("save", "3600 1000000")  # with a save point, the failed snapshot stops writes


@pytest.mark.parametrize("how", ["misconf", "noreplicas"])
def test_a_server_that_refuses_only_writes_fails_the_stores_and_keeps_serving_reads(
    redis_server_factory: Callable[..., Any], make_tier: Callable[..., RedisTier], caplog: pytest.LogCaptureFixture,
    how: str,
) -> None:
    """Regression (review, 2026-12-03, D4): MISCONF (a failed RDB snapshot) and NOREPLICAS refuse writes
    only, but counted as breaker failures: three refused stores took the whole tier out of service,
    and blocks the server still served became MISS."""
    server = redis_server_factory("--enable-protected-configs", "yes")
    rows = random_rows(8)
    ns = namespace()
    tier = make_tier(server.url, rows, ns, io_threads=1, failure_threshold=2, open_seconds=30.0)
    keys = keys_for(ns, 8)
    assert store(tier, keys[:2], [0, 1]).success
    raw = redis.Redis.from_url(server.url)
    try:
        _refuse_writes(raw, how)
        code = how.upper()
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.redis"):
            for i in range(2, 6):
                result = store(tier, keys[i : i + 1], [i])
                assert not result.success and result.error is not None and code in result.error
        assert tier.health().state is HealthState.CLOSED and tier.health().consecutive_failures == 0
        assert tier.stats.stores_failed == 4
        assert resolve(tier, keys[0]) is LookupResult.HIT
        assert load(tier, keys[:2], [6, 7]).success
        assert np.array_equal(rows[6:8], rows[0:2])
        logged = [r.getMessage() for r in caplog.records if code in r.getMessage()]
        assert len(logged) == 1 and "reads go on" in logged[0], logged
    finally:
        raw.config_set("save", "")
        raw.config_set("min-replicas-to-write", 0)


@pytest.mark.parametrize(
    ("message", "writing", "refused"),
    [
        ("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist", True, False),
        ("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist", False, True),
        ("NOREPLICAS Not enough good replicas to write.", True, False),
        ("NOPERM this user has no permissions", False, True),
        ("LOADING Redis is loading the dataset in memory", False, True),
        ("BUSY Redis is busy running a script", True, True),
        ("MASTERDOWN Link with MASTER is down", False, True),
        ("OOM command not allowed when used memory > 'maxmemory'.", False, True),
        ("OOM command not allowed when used memory > 'maxmemory'.", True, False),
        ("MOVED 3999 127.0.0.1:6381", False, False),
        ("WRONGTYPE Operation against a key holding the wrong kind of value", False, False),
    ],
)
def test_which_error_replies_count_against_the_server(message: str, writing: bool, refused: bool) -> None:
    assert refused_by_server(ErrorReply(message), writing) is refused


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "header_junk"])
def test_a_corrupt_value_rewritten_before_its_delete_is_kept(
    redis_server: Any, make_tier: Callable[..., RedisTier], damage: str
) -> None:
    """Regression (review, 2026-12-03): a corrupt value was removed by a plain DEL after the GET, so a
    valid value another engine wrote in between was deleted too. A flipped payload keeps the header,
    so comparing the header alone would not do: the whole value is compared."""
    tier, rows, keys, raw, name, value = _two_stored(redis_server.url, make_tier)
    if damage == "flip_payload":
        raw.setrange(name, HEADER_SIZE + 7, bytes([value[HEADER_SIZE + 7] ^ 0xFF]))
    elif damage == "header_junk":
        raw.setrange(name, 40, b"\x00junk\x00")
    else:
        raw.set(name, value[:-10])
    other = make_tier(redis_server.url, rows, namespace(), lookup_cache_seconds=0.0)
    delete = tier._delete

    def another_engine_rewrites_first(*args: Any) -> Any:
        assert store(other, keys[:1], [0]).success  # the valid value, acknowledged
        return delete(*args)

    tier._delete = another_engine_rewrites_first  # type: ignore[method-assign,assignment]
    result = load(tier, keys, [4, 5])
    assert result.successful_keys == frozenset([keys[1]])
    assert result.error is not None and "1 rewritten since" in result.error
    assert raw.get(name) == value, "the value another engine wrote after the read must stay"
    assert tier.stats.corrupt_values == 1
    assert not any(e.removed and keys[0] in e.keys for e in tier.take_events())
    assert resolve(tier, keys[0]) is LookupResult.HIT


def test_a_corrupt_value_rewritten_while_its_delete_compares_it_is_kept(
    redis_server: Any, make_tier: Callable[..., RedisTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (review, 2026-12-03, D5): the delete no longer hashes the whole value in one script;
    the value is compared on the client between WATCH and EXEC, so another engine's valid rewrite that
    lands after the value was compared (here: a single payload byte apart, the same header) is kept."""
    tier, _rows, keys, raw, name, value = _two_stored(redis_server.url, make_tier)
    raw.setrange(name, HEADER_SIZE + 7, bytes([value[HEADER_SIZE + 7] ^ 0xFF]))

    class RewriteAfterTheCompare(redis_protocol.RespReader):
        def read_bulk_chunks(self, consume: Callable[[memoryview], None]) -> Any:
            got = super().read_bulk_chunks(consume)
            raw.set(name, value)  # another engine's valid value, between the GET and the EXEC
            return got

    monkeypatch.setattr(redis_tier_module, "RespReader", RewriteAfterTheCompare)
    result = load(tier, keys, [4, 5])
    assert result.successful_keys == frozenset([keys[1]])
    assert result.error is not None and "1 rewritten since" in result.error
    assert raw.get(name) == value, "the value another engine wrote after the compare must stay"
    assert tier.stats.corrupt_values == 1
    assert not any(e.removed and keys[0] in e.keys for e in tier.take_events())
    assert tier.health().state is HealthState.CLOSED and tier.health().consecutive_failures == 0


@pytest.mark.parametrize("denied", ["watch", "multi", "exec"])
def test_an_acl_without_the_delete_commands_leaves_a_corrupt_value_in_place(
    redis_server: Any, make_tier: Callable[..., RedisTier], caplog: pytest.LogCaptureFixture, denied: str
) -> None:
    """The delete of a value with a valid header needs WATCH, MULTI and EXEC: without one of them the
    value is left in place and the refusal logged; never deleted unguarded (a DEL after a refused
    MULTI would run at once), and no tier failure."""
    url = _acl_url(redis_server, "kv", "~kvtier:*", "+@all", f"-{denied}")
    tier, _rows, keys, raw, name, value = _two_stored(url, make_tier)
    raw = redis.Redis.from_url(redis_server.url)
    raw.setrange(name, HEADER_SIZE + 7, bytes([value[HEADER_SIZE + 7] ^ 0xFF]))
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.redis"):
        result = load(tier, keys, [4, 5])
    assert result.successful_keys == frozenset([keys[1]])
    assert result.error is not None and "1 corrupt value(s) not deleted (0 rewritten since)" in result.error
    assert raw.exists(name) == 1
    assert any("left in place" in r.getMessage() and "NOPERM" in r.getMessage() for r in caplog.records)
    assert tier.health().state is HealthState.CLOSED and tier.health().consecutive_failures == 0
    assert load(tier, keys[1:], [5]).success, "the connection is still usable"


def test_deleting_many_large_corrupt_values_is_cheap_for_the_server_and_within_the_deadline(
    redis_server: Any, make_tier: Callable[..., RedisTier]
) -> None:
    """Regression (review, 2026-12-03, D5): the compare-and-delete script hashed each whole value on
    the server (tens of ms per value of a few MiB, blocking every other client of a shared Redis),
    and a burst of them, pipelined, outran the replies' deadline: a false breaker failure and a
    false "not deleted" although every value was gone."""
    block = 8 * 1024 * 1024
    n = 8  # the whole-value script took >= 25 ms per value here: 8 of them outran socket_timeout
    rows = random_rows(2 * n, block_bytes=block)
    ns = namespace(block_bytes=block)
    keys = keys_for(ns, n)
    tier = make_tier(redis_server.url, rows, ns, io_threads=1, socket_timeout=0.15)
    assert store(tier, keys, list(range(n))).success
    raw = redis.Redis.from_url(redis_server.url)
    for key in keys:  # one payload byte flipped: the header stays valid
        name = tier.redis_key(key)
        raw.setrange(name, HEADER_SIZE + 99, bytes([raw.getrange(name, HEADER_SIZE + 99, HEADER_SIZE + 99)[0] ^ 1]))
    raw.config_set("slowlog-log-slower-than", 15_000)  # microseconds
    raw.slowlog_reset()
    result = load(tier, keys, list(range(n, 2 * n)))
    assert not result.success and tier.stats.corrupt_values == n
    assert result.error is not None and f"{n} corrupt value(s) deleted" in result.error, result.error
    assert not any(raw.exists(tier.redis_key(k)) for k in keys)
    assert tier.health().state is HealthState.CLOSED and tier.health().consecutive_failures == 0
    slow = [(e["command"], e["duration"]) for e in raw.slowlog_get(128)]
    assert not [c for c in slow if b"EVAL" in c[0] or b"WATCH" in c[0] or b"EXEC" in c[0]], slow


def test_a_key_of_another_type_or_length_is_a_miss_and_left_alone(
    redis_server: Any, make_tier: Callable[..., RedisTier]
) -> None:
    """Regression (review, 2026-12-03): EXISTS answered HIT for a list, hash, stream or set under a
    block's key (and for a value of any length), so promotions kept failing with WRONGTYPE."""
    ns = namespace()
    tier = make_tier(redis_server.url, random_rows(2), ns)
    raw = redis.Redis.from_url(redis_server.url)
    keys = keys_for(ns, 6)
    names = [tier.redis_key(k) for k in keys]
    raw.rpush(names[0], b"x")
    raw.hset(names[1], b"f", b"v")
    raw.xadd(names[2], {b"f": b"v"})
    raw.sadd(names[3], b"m")
    raw.set(names[4], b"short")
    raw.set(names[5], b"x" * (HEADER_SIZE + BLOCK + 1))
    assert [resolve(tier, k) for k in keys] == [LookupResult.MISS] * 6
    assert all(raw.exists(n) for n in names), "values of others are never deleted by a lookup"
    assert tier.health().state is HealthState.CLOSED and tier.health().consecutive_failures == 0


@pytest.mark.parametrize("found_by", ["housekeeping", "lookup"])
def test_a_set_whose_reply_was_lost_is_found_and_announced(
    redis_server: Any, make_tier: Callable[..., RedisTier], found_by: str
) -> None:
    """Regression (CI of 042910e, the fleet test on S3; the same gap here): a SET whose reply
    never came (a timeout, a dropped connection) failed its block, and a batch that failed part
    way dropped even the SETs already answered OK, though the server held them: the fleet index
    lacked blocks the store held. Answered SETs now count stored; unanswered ones are checked,
    by housekeeping on its own (the tier idle, its last request failed) or first by a lookup's
    check (review: that settled the doubt without announcing it): one that landed is announced
    once, one that is not there is forgotten."""
    rows = random_rows(8)
    ns = namespace()
    keys, first = keys_for(ns, 3), keys_for(ns, 1, start=10)
    link = MuteLink(redis_server.port)
    try:
        tier = make_tier(link.url, rows, ns, io_threads=1, socket_timeout=0.5, failure_threshold=1000)
        assert store(tier, first, [7]).success  # (the connection is set up while replies pass)
        tier.take_events()
        link.muted.set()
        result = store(tier, keys, [0, 1, 2])
        assert not result.success and result.succeeded(keys) == [], result
        assert tier.take_events() == [] and tier.stats.extra["writes_in_doubt"] == 3
        server = redis.Redis.from_url(redis_server.url)
        assert server.exists(*(tier.redis_key(k) for k in keys)) == 3
        server.delete(tier.redis_key(keys[2]))  # (as an eviction would)
        link.muted.clear()
        if found_by == "lookup":  # (at once: housekeeping checks a doubt socket_timeout after it arose)
            assert resolve(tier, keys[0]) is LookupResult.HIT
        deadline = time.monotonic() + 10
        while tier.stats.extra.get("uploads_found", 0) < 2:
            assert time.monotonic() < deadline, f"the SETs in doubt were not checked: {tier.health()}"
            time.sleep(0.02)
        time.sleep(1.2)  # (a further tick would announce again)
        announced = [key for event in tier.take_events() if not event.removed for key in event.keys]
        assert sorted(announced) == sorted(keys[:2]) and tier.stats.extra["uploads_found"] == 2
        assert tier.stats.extra["writes_in_doubt"] == 0
        assert [resolve(tier, key) for key in keys] == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
        assert load(tier, keys[:2], [4, 5]).success
        assert np.array_equal(rows[4:6], rows[0:2])
    finally:
        link.close()


def test_a_slow_link_times_a_load_out_and_takes_the_tier_out_of_service(
    redis_server: Any, make_tier: Callable[..., RedisTier]
) -> None:
    """Regression (review, 2026-12-03): socket_timeout bounded each receive, not the replies, so a
    link that delivered a little within every timeout kept a load running without end, the breaker
    never opened and shutdown() failed to join the I/O thread."""
    rows = random_rows(32)
    ns = namespace()
    keys = keys_for(ns, 16)
    assert store(make_tier(redis_server.url, rows, ns), keys, list(range(16))).success
    link = SlowLink(redis_server.port, 64 * 1024)  # 1 MiB of replies would take 16 s
    try:
        tier = RedisTier(
            TierContext(rows, BLOCK, ns), url=f"redis://127.0.0.1:{link.port}/0", io_threads=1,
            socket_timeout=0.5, failure_threshold=1, open_seconds=30.0,
        )  # fmt: skip
        try:
            started = time.monotonic()
            tier.submit_load(job(keys, list(range(16, 32)), True))
            (result,) = wait_results(tier, 1, timeout=5.0)
            assert time.monotonic() - started < 2.5
            assert not result.success and result.error is not None and "min_read_mib_per_second" in result.error
            assert tier.health().state is HealthState.OPEN
        finally:
            started = time.monotonic()
            tier.shutdown()
            assert time.monotonic() - started < 2.0
    finally:
        link.close()


def test_a_store_over_a_slow_uplink_gets_time_for_the_bytes_it_sent(
    redis_server: Any, make_tier: Callable[..., RedisTier]
) -> None:
    """Regression (review, 2026-12-03, D6): the replies' deadline started once the last SET was
    handed to the kernel and gave nothing for the values still on their way to the server, so a
    store over an uplink at the accepted rate timed out, blaming the reading of replies."""
    rows = random_rows(32, block_bytes=512 * 1024)
    ns = namespace(block_bytes=512 * 1024)
    keys = keys_for(ns, 16)
    link = SlowLink(redis_server.port, 2 * 1024 * 1024, uplink=True)  # 8 MiB take 4 s to reach the server
    try:
        # The link is faster than the floor given (1 MiB/s): the store must succeed, however much of
        # it the kernel still buffers when the last SET is handed over.
        tier = make_tier(f"redis://127.0.0.1:{link.port}/0", rows, ns, io_threads=1, socket_timeout=1.0,
                         min_read_mib_per_second=1.0, failure_threshold=1, open_seconds=30.0)  # fmt: skip
        tier.submit_store(job(keys, list(range(16)), False))
        (result,) = wait_results(tier, 1, timeout=20.0)
        assert result.success, result.error
        assert tier.health().state is HealthState.CLOSED
        assert load(tier, keys, list(range(16, 32))).success
        assert np.array_equal(rows[16:32], rows[0:16])
    finally:
        link.close()


def test_a_store_over_an_uplink_slower_than_the_floor_is_cut_off_in_time_and_shutdown_stops_it(
    redis_server: Any, make_tier: Callable[..., RedisTier]
) -> None:
    """Regression (review, 2026-12-05): each value's send had its own socket timeout, so a link that
    took one value within every timeout, slower than min_read_mib_per_second, held the I/O thread
    for the whole job (60 values of 256 KiB at 1 MiB/s: 15 s), and a shutdown meanwhile failed
    (TierShutdownError, the CPU rows kept mapped). The batch's sends now share one deadline (the
    socket timeout plus the bytes at the floor), and shutdown stops a batch between sends."""
    rows = random_rows(64, block_bytes=256 * 1024)
    ns = namespace(block_bytes=256 * 1024)
    keys = keys_for(ns, 60)
    link = SlowLink(redis_server.port, 1024 * 1024, uplink=True)  # 15 MiB take 15 s; the floor allows ~2 s
    try:
        tier = make_tier(f"redis://127.0.0.1:{link.port}/0", rows, ns, io_threads=1, socket_timeout=1.0,
                         min_read_mib_per_second=8.0)  # fmt: skip
        started = time.monotonic()
        tier.submit_store(job(keys, list(range(60)), False))
        (result,) = wait_results(tier, 1, timeout=30.0)
        took = time.monotonic() - started
        assert not result.success and took < 9.0, (took, result.error)
        assert "deadline" in (result.error or ""), result.error
        # A shutdown while such a store runs: it stops the batch between sends, within its budget.
        other = make_tier(f"redis://127.0.0.1:{link.port}/0", rows, ns, io_threads=1, socket_timeout=1.0,
                          min_read_mib_per_second=8.0)  # fmt: skip
        other.submit_store(job(keys_for(ns, 60, start=100), list(range(60)), False))
        time.sleep(0.5)
        started = time.monotonic()
        other.shutdown()
        assert time.monotonic() - started < 4.0
    finally:
        link.close()


@pytest.mark.parametrize(("rate", "batch"), [(1e-7, 32), (1e-300, 1), (0.5, 4096)])
def test_a_batch_that_could_take_longer_than_an_hour_is_refused(
    redis_server: Any, make_tier: Callable[..., RedisTier], rate: float, batch: int
) -> None:
    """Regression (review, 2026-12-05): min_read_mib_per_second=1e-7 with a large load_batch_mib
    made the tier's shutdown budget about 4e10 s, past what a thread join takes: every shutdown
    raised OverflowError and the CPU rows were never released."""
    with pytest.raises(ConfigError, match="load_batch_mib / min_read_mib_per_second"):
        make_tier(f"redis://127.0.0.1:{redis_server.port}/0", random_rows(2), min_read_mib_per_second=rate,
                  load_batch_mib=batch)  # fmt: skip


def test_an_acl_user_without_info_leaves_usage_unknown_and_the_tier_serving(
    redis_server: Any, make_tier: Callable[..., RedisTier], caplog: pytest.LogCaptureFixture
) -> None:
    """Regression (review, 2026-12-03): a least-privilege user without INFO took an idle tier out
    of service every few usage refreshes (each refused INFO counted as a failure)."""
    url = _acl_url(redis_server, "kv", "~kvtier:*", "+@read", "+@write", "+@connection", "+@scripting",
                   "-@dangerous")  # fmt: skip
    rows = random_rows(4)
    ns = namespace()
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.redis"):
        tier = make_tier(url, rows, ns, usage_refresh_seconds=0.02, failure_threshold=2)
        time.sleep(0.5)  # many refused INFOs (housekeeping runs about every 0.1 s)
        assert tier.health().state is HealthState.CLOSED and tier.health().consecutive_failures == 0
        assert tier.usage().capacity_bytes is None
        keys = keys_for(ns, 2)
        assert store(tier, keys, [0, 1]).success
        assert load(tier, keys, [2, 3]).success
    refused = [r for r in caplog.records if "INFO memory" in r.getMessage()]
    assert len(refused) == 1 and "+info" in refused[0].getMessage()


@pytest.mark.parametrize(
    ("query", "named"),
    [("socket_read_size=0", "socket_read_size"), ("socket_read_size=-5", "socket_read_size"),
     ("socket_read_size=1e3", "socket_read_size"), ("socket_keepalive=maybe", "socket_keepalive"),
     ("socket_keepalive=", "socket_keepalive")],
)  # fmt: skip
def test_url_options_that_would_break_every_connection_are_refused(query: str, named: str) -> None:
    """Regression (review, 2026-12-03): ?socket_read_size=0 passed validation and made the tier
    permanently out of service ("Connection closed by server"); ?socket_keepalive=maybe was taken."""
    rows = random_rows(1)
    ctx = TierContext(rows, BLOCK, namespace())
    with pytest.raises(ConfigError, match=f"{named} must be"):
        RedisTier(ctx, url=f"redis://127.0.0.1:1/0?{query}")
    for good in ("socket_read_size=65536", "socket_keepalive=true", "socket_keepalive=0"):
        RedisTier(ctx, url=f"redis://127.0.0.1:1/0?{good}", io_threads=1).shutdown()


def test_store_location_names_the_database_really_used_once_per_database(redis_server: Any) -> None:
    """Regression (review, 2026-12-03): store_location() ignored ?db= (db 0 and db 3 announced one
    store) and kept the path as written (three spellings of db 0, three stores)."""
    rows = random_rows(1)
    ctx = TierContext(rows, BLOCK, namespace())
    base = f"redis://127.0.0.1:{redis_server.port}"

    def location(url: str) -> str:
        tier = RedisTier(ctx, url=url, io_threads=1)
        try:
            return tier.store_location()
        finally:
            tier.shutdown()

    db0 = {location(base + suffix) for suffix in ("/0", "", "/", "?db=0", "/0?db=0")}
    db3 = {location(base + suffix) for suffix in ("/3", "?db=3", "/3?db=3")}
    here = f"#host={socket.gethostname()}"  # a loopback server is this host's own (another host's differs)
    assert db0 == {f"redis:redis://127.0.0.1:{redis_server.port}/0/kvtier{here}"}
    assert db3 == {f"redis:redis://127.0.0.1:{redis_server.port}/3/kvtier{here}"}
    # The default port, spelled out (no tier built: nothing may connect to a real port 6379 here).
    unbuilt = types.SimpleNamespace(options=RedisTierOptions(url="redis://[::1]/0", prefix="p"))
    assert RedisTier.store_location(unbuilt) == f"redis:redis://[::1]:6379/0/p{here}"  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="the path says database 0 and"):
        RedisTier(ctx, url=base + "/0?db=3")
    with pytest.raises(ConfigError, match="db must be a database number"):
        RedisTier(ctx, url=base + "?db=x")


def test_loads_fit_a_client_output_buffer_limit_with_load_batch_mib(
    redis_server_factory: Callable[..., Any], make_tier: Callable[..., RedisTier]
) -> None:
    """Regression (review, 2026-12-03): a load pipelined 32 MiB of GETs; a server with a
    client-output-buffer-limit for normal clients below that closed the connection on every
    multi-block load ("Redis closed the connection", no hint) and the tier flapped."""
    server = redis_server_factory("--client-output-buffer-limit", "normal 4mb 2mb 10")
    block = 1024 * 1024
    rows = random_rows(32, block_bytes=block)
    ns = namespace(block_bytes=block)
    keys = keys_for(ns, 16)
    tier = make_tier(server.url, rows, ns, failure_threshold=100)
    assert store(tier, keys, list(range(16))).success
    result = load(tier, keys, list(range(16, 32)))
    assert not result.success and result.error is not None
    assert "client-output-buffer-limit" in result.error and "load_batch_mib (32 MiB)" in result.error
    batched = make_tier(server.url, rows, ns, load_batch_mib=2)
    result = load(batched, keys, list(range(16, 32)))
    assert result.success, result.error
    assert np.array_equal(rows[16:], rows[:16])


def test_cluster_mode_refuses_a_database_other_than_0_at_validation() -> None:
    """Audit (redis/s3, hostile store): ``cluster: true`` with ``redis://node/3`` (or ``?db=3``) was
    accepted, then every call failed at run time (redis-py: "A db querystring option can only be 0
    in cluster mode") while store_location() announced database 3. A Redis Cluster has database 0
    only: refused when the options are checked, with the fix and without the password; database 0,
    however spelled, is taken."""
    rows = random_rows(1)
    ctx = TierContext(rows, BLOCK, namespace())
    for url in ("redis://:hunter2@127.0.0.1:1/3", "redis://:hunter2@127.0.0.1:1?db=3", "rediss://:hunter2@h:1/3?db=3"):
        with pytest.raises(ConfigError, match="database 3: a Redis Cluster has database 0 only") as refused:
            RedisTier(ctx, url=url, cluster=True)
        assert "hunter2" not in str(refused.value)
        with pytest.raises(ConfigError, match="drop the database from the url"):
            create_tier({"type": "redis", "url": url, "cluster": True}, ctx)
    for url in ("redis://127.0.0.1:1", "redis://127.0.0.1:1/0", "redis://127.0.0.1:1/?db=0"):
        assert RedisTierOptions(url=url, cluster=True).cluster  # (nothing built: no connection)
    assert RedisTierOptions(url="redis://127.0.0.1:1/3").url.endswith("/3")  # standalone: any database


def test_tls_options_that_cannot_make_a_tls_context_are_refused_at_validation(tmp_path: Path) -> None:
    """Audit (redis/s3, hostile store): a rediss:// URL whose TLS options redis-py cannot build a
    context from (?ssl_min_version=2, ?ssl_ciphers=NOPE, a CA or certificate file holding no PEM,
    a key without its certificate, an encrypted key without ssl_password) passed validation; the
    tier then failed every connection, a ValueError/TypeError logged with its traceback each time
    (an encrypted key without a password made OpenSSL prompt on the terminal at each connect).
    Refused when the options are checked; working TLS options are taken."""
    ca, crt, key = make_test_certificates(tmp_path / "certs")
    openssl = shutil.which("openssl")
    assert openssl is not None
    locked = tmp_path / "locked.key"
    subprocess.run([openssl, "pkey", "-in", str(key), "-aes256", "-passout", "pass:pw", "-out", str(locked)],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    junk, both = tmp_path / "junk.pem", tmp_path / "both.pem"
    junk.write_text("not a certificate\n")
    both.write_bytes(crt.read_bytes() + key.read_bytes())  # a certificate file holding its key too
    rows = random_rows(1)
    ctx = TierContext(rows, BLOCK, namespace())
    base = "rediss://:hunter2@127.0.0.1:1/0?"
    for query in ("ssl_min_version=2", "ssl_ciphers=NOPE", f"ssl_ca_certs={junk}", f"ssl_certfile={junk}",
                  f"ssl_certfile={crt}",
                  f"ssl_keyfile={key}", f"ssl_certfile={crt}&ssl_keyfile={junk}",
                  f"ssl_certfile={crt}&ssl_keyfile={locked}",
                  f"ssl_certfile={crt}&ssl_keyfile={locked}&ssl_password=no"):  # fmt: skip
        with pytest.raises(ConfigError, match="its TLS options cannot make a TLS context") as refused:
            RedisTier(ctx, url=base + query)
        assert "hunter2" not in str(refused.value), query
    for query in ("ssl_min_version=771", "ssl_min_version=772", f"ssl_ca_certs={ca}", f"ssl_ca_path={tmp_path}",
                  "ssl_ciphers=ECDHE+AESGCM", f"ssl_certfile={crt}&ssl_keyfile={key}", f"ssl_certfile={both}",
                  f"ssl_certfile={crt}&ssl_keyfile={locked}&ssl_password=pw", "ssl_cert_reqs=none"):  # fmt: skip
        assert RedisTierOptions(url=base + query).url == base + query  # (nothing built: no connection)


def test_a_cluster_redirect_of_a_lookups_check_keeps_a_write_in_doubt(
    redis_cluster: object, make_tier: Callable[..., RedisTier]
) -> None:
    """Regression (lead of 2026-12-05): a SET in doubt (its reply lost) whose key's slot then moved
    to another node: the lookup's check (STRLEN) was answered MOVED, and that MISS settled the
    doubt, so the value there was never announced (a fleet index lacked what the cluster held).
    A redirected check now leaves the doubt for housekeeping, which asks again after the topology
    refresh, finds the value on its new node and announces it once."""
    from redis.cluster import RedisCluster

    url = redis_cluster.url  # type: ignore[attr-defined]
    nodes = redis_cluster.nodes  # type: ignore[attr-defined]
    rows = random_rows(4)
    ns = namespace()
    # socket_timeout 3 s: the SET fails after 3 s, and housekeeping checks the doubt 3 s after that;
    # the steps below take well under that, so the lookup's check is the first.
    tier = make_tier(url, rows, ns, cluster=True, io_threads=1, socket_timeout=3.0, failure_threshold=1000)
    assert store(tier, keys_for(ns, 1, start=50), [3]).success  # (connections and topology set up)
    tier.take_events()
    key = keys_for(ns, 1, start=60)[0]
    name = tier.redis_key(key)
    client = RedisCluster.from_url(url)
    try:
        slot = client.keyslot(name)
        owner = client.get_node_from_key(name)
        source = redis.Redis(host="127.0.0.1", port=owner.port)
        target_port = next(n.port for n in nodes if n.port != owner.port)
        target = redis.Redis(host="127.0.0.1", port=target_port)
        source.execute_command("CLIENT", "PAUSE", 3600, "WRITE")  # the SET's reply does not come in time
        result = store(tier, [key], [0])
        assert not result.success and tier.stats.extra["writes_in_doubt"] == 1, result
        source.execute_command("CLIENT", "UNPAUSE")
        # The paused SET is dropped with its connection; the value that "landed" is written as the
        # same engine's SET would have written it (another engine's store of the block's rows).
        other = make_tier(url, rows, ns, cluster=True)
        assert store(other, [key], [0]).success and source.strlen(name) == HEADER_SIZE + rows.shape[1]
        # Move the key's slot to another node (as a resharding does) before anyone checks the doubt.
        source_id, target_id = source.execute_command("CLUSTER", "MYID"), target.execute_command("CLUSTER", "MYID")
        target.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        source.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        source.execute_command("MIGRATE", "127.0.0.1", target_port, name, 0, 5000)
        for node in nodes:
            redis.Redis(host="127.0.0.1", port=node.port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        assert target.strlen(name) == HEADER_SIZE + rows.shape[1]
        resolve(tier, key)  # the check goes to the old node: MOVED
        deadline = time.monotonic() + 10
        while tier.stats.extra.get("uploads_found", 0) < 1:
            assert time.monotonic() < deadline, f"the SET in doubt was dropped, not announced: {tier.stats.extra}"
            time.sleep(0.02)
        announced = [k for event in tier.take_events() if not event.removed for k in event.keys]
        assert announced == [key] and tier.stats.extra["writes_in_doubt"] == 0
        assert resolve(tier, key) is LookupResult.HIT
        assert load(tier, [key], [1]).success
        assert np.array_equal(rows[1], rows[0])
    finally:
        client.close()
