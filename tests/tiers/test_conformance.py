"""The tier conformance suite (kvtier.tiers.conformance) over every built-in tier.

Each ``Test*`` class gives the suite a harness: how to build the tier on a
real medium, damage a stored value, and take the medium away.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from kvtier.keys import BlockKey
from kvtier.tiers.base import SecondaryTier
from kvtier.tiers.conformance import TierConformance, TierHarness
from kvtier.tiers.format import HEADER_SIZE
from kvtier.tiers.memory import MemoryTier


class MemoryHarness(TierHarness):
    def spec(self) -> dict[str, Any]:
        return {"type": "memory", "max_bytes": "64MiB"}

    def damage(self, tier: SecondaryTier, key: BlockKey) -> bool:
        assert isinstance(tier, MemoryTier)
        tier._values[key][HEADER_SIZE + 100] ^= 0xFF
        return True


class TestMemoryTier(TierConformance):
    @pytest.fixture
    def harness(self) -> MemoryHarness:
        return MemoryHarness()


class RedisHarness(TierHarness):
    persistent = True

    def __init__(self, server: Any) -> None:
        self.server = server

    def spec(self) -> dict[str, Any]:
        return {"type": "redis", "url": self.server.url, "io_threads": 2}

    def fast_failure_options(self) -> dict[str, Any]:
        return {"socket_timeout": 0.3, "connect_timeout": 0.3, "open_seconds": 0.3, "lookup_cache_seconds": 0.05}

    def damage(self, tier: SecondaryTier, key: BlockKey) -> bool:
        import redis

        from kvtier.tiers.redis import RedisTier

        assert isinstance(tier, RedisTier)
        client = redis.Redis.from_url(self.server.url)
        try:
            name = tier.redis_key(key)
            value = client.getrange(name, HEADER_SIZE + 100, HEADER_SIZE + 100)
            client.setrange(name, HEADER_SIZE + 100, bytes([value[0] ^ 0xFF]))
        finally:
            client.close()
        return True

    @contextlib.contextmanager
    def outage(self) -> Iterator[bool]:
        self.server.kill()
        try:
            yield True
        finally:
            self.server.start()


@pytest.mark.redis
class TestRedisTier(TierConformance):
    @pytest.fixture
    def harness(self, redis_server: Any) -> RedisHarness:
        return RedisHarness(redis_server)
