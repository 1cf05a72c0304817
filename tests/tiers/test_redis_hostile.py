"""The Redis tier against stores that are not what its options say (audit of the redis tier)."""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import redis

from kvtier.keys import KVGeometry, Namespace, chain_ids
from kvtier.testing import run_job
from kvtier.tiers.base import HealthState, TierContext
from kvtier.tiers.format import HEADER_SIZE, MAGIC
from kvtier.tiers.redis import RedisTier

pytestmark = pytest.mark.redis

BLOCK = 4096


def test_a_tier_without_cluster_mode_on_a_cluster_node_says_to_set_it_once(
    redis_cluster: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Audit (redis/s3, hostile store): a tier without ``cluster: true`` whose URL names a Redis
    Cluster node failed the stores and loads of every key another node serves (MOVED), job after
    job, while its health stayed closed and nothing was logged: only each failed job's error
    ("MOVED 10657 127.0.0.1:...") hinted why. One warning now says the server is a cluster node and
    to set ``cluster: true``; the keys the node serves itself still go through."""
    caplog.set_level(logging.WARNING, logger="kvtier.tiers.redis")
    ns = Namespace("model-a", KVGeometry.from_block_bytes(BLOCK))
    rows = np.random.default_rng(0).integers(0, 256, (40, BLOCK), dtype=np.uint8)
    tier = RedisTier(TierContext(rows, BLOCK, ns), url=redis_cluster.url, io_threads=1)
    keys = chain_ids(range(20), ns)
    try:
        stores = [run_job(tier, keys, list(range(20)), False, 10) for _ in range(2)]
        load = run_job(tier, keys, list(range(20, 40)), True, 10)
    finally:
        tier.shutdown()
    for result in (*stores, load):
        served = result.succeeded(keys)
        assert 0 < len(served) < len(keys) and "MOVED" in (result.error or ""), result
    for key in load.succeeded(keys):
        i = keys.index(key)
        assert np.array_equal(rows[20 + i], rows[i])
    hints = [r.getMessage() for r in caplog.records if "set cluster: true" in r.getMessage()]
    assert len(hints) == 1 and "is a Redis Cluster node" in hints[0] and "MOVED" in hints[0], hints
    assert tier.health().state is HealthState.CLOSED  # not a failure of the server: a missing option


def _wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_touch_with_a_ttl_refreshes_our_values_only_and_never_gives_others_an_expiry(redis_server: Any) -> None:
    """Regression (review): with ``ttl_seconds``, touch() sent PEXPIRE to whatever lived under a
    block's key name, so a list or hash of another application, a string of another length, a
    value in another release's format (docs: "a MISS, kept") or a value of the right length that
    is not this key's got an expiry, and Redis deleted them. Now only values proven to be this
    release's, of this namespace and this key, get their TTL refreshed; the others keep none."""
    ns = Namespace("model-a", KVGeometry.from_block_bytes(BLOCK))
    rows = np.random.default_rng(1).integers(0, 256, (2, BLOCK), dtype=np.uint8)
    tier = RedisTier(TierContext(rows, BLOCK, ns), url=redis_server.url, ttl_seconds=100, io_threads=1)
    raw = redis.Redis.from_url(redis_server.url)
    try:
        own = chain_ids(range(2), ns)
        assert run_job(tier, own, [0, 1], False, 10).success
        own_names = [tier.redis_key(k) for k in own]
        for name in own_names:
            raw.pexpire(name, 5000)  # so a refresh shows (back to about 100 s)
        foreign = chain_ids(range(10, 16), ns)
        names = [tier.redis_key(k) for k in foreign]
        value_bytes = HEADER_SIZE + BLOCK
        other_release = MAGIC + struct.pack("<II", 99, HEADER_SIZE)
        raw.rpush(names[0], b"someone else's list")
        raw.hset(names[1], b"field", b"value")
        raw.set(names[2], b"a short string of another application")
        raw.set(names[3], other_release.ljust(value_bytes, b"\x00"))  # another release's, a block's length
        raw.set(names[4], other_release.ljust(5000, b"\x00"))  # another release's, another length
        raw.set(names[5], raw.get(own_names[0]))  # a valid value, but of another key
        tier.touch([*own, *foreign], None)
        tier.on_schedule_end()
        _wait_for(lambda: all(raw.pttl(n) > 50_000 for n in own_names))
        assert [raw.pttl(n) for n in names] == [-1] * len(names)  # no expiry given
        assert all(raw.exists(n) for n in names)
    finally:
        raw.close()
        tier.shutdown()


def test_a_database_the_server_lacks_is_named_not_blamed_on_the_acl(
    redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression (review): a URL naming a database the server does not have (``/99``; 16 by
    default) logged "usage() is unknown: INFO memory is refused (give the URL's ACL user +info):
    ResponseError: DB index is out of range", sending the operator to the ACL. Only a NOPERM
    refusal gets that hint now; this error says what the server answered, which database the URL
    names and that the server has fewer (and so do the failed jobs and the tier's health)."""
    caplog.set_level(logging.WARNING, logger="kvtier.tiers.redis")
    ns = Namespace("model-a", KVGeometry.from_block_bytes(BLOCK))
    rows = np.zeros((1, BLOCK), np.uint8)
    tier = RedisTier(TierContext(rows, BLOCK, ns), url=f"redis://127.0.0.1:{redis_server.port}/99", io_threads=1)
    try:
        _wait_for(lambda: any("usage() is unknown" in r.getMessage() for r in caplog.records))
        result = run_job(tier, chain_ids(range(1), ns), [0], False, 10)
    finally:
        tier.shutdown()
    (usage,) = [r.getMessage() for r in caplog.records if "usage() is unknown" in r.getMessage()]
    assert "+info" not in usage and "ACL" not in usage, usage
    assert "DB index is out of range" in usage and "database 99" in usage and "fewer databases" in usage, usage
    assert not result.success and "database 99" in (result.error or ""), result
    assert "database 99" in tier.health().detail
