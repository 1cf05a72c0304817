"""The Redis tier against stores that are not what its options say (audit of the redis tier)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from kvtier.keys import KVGeometry, Namespace, chain_ids
from kvtier.testing import run_job
from kvtier.tiers.base import HealthState, TierContext
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
