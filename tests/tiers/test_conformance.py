"""The tier conformance suite (kvtier.testing) over every built-in tier.

Each ``Test*`` class gives the suite a harness: how to build the tier on a
real medium, damage a stored value, and take the medium away.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from s3_servers import FAST_FAILURE, MotoServer, raw_client, s3_options

from kvtier.keys import BlockKey
from kvtier.testing import TierConformance, TierHarness
from kvtier.tiers.base import SecondaryTier
from kvtier.tiers.format import HEADER_SIZE
from kvtier.tiers.memory import MemoryTier


@contextlib.contextmanager
def server_down(server: Any, on_restart: Callable[[], object] = lambda: None) -> Iterator[bool]:
    """SIGKILL ``server``; on exit start it again, empty, on the same port, then ``on_restart()``."""
    server.kill()
    try:
        yield True
    finally:
        server.start()
        on_restart()


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


class FsHarness(TierHarness):
    persistent = True

    def __init__(self, root: Path) -> None:
        self.root = root
        self._away: list[Path] = []

    def spec(self) -> dict[str, Any]:
        return {
            "type": "fs", "root": str(self.root), "max_bytes": "64MiB", "read_threads": 2, "write_threads": 1,
            "scan_in_background": False,
        }  # fmt: skip

    def fast_failure_options(self) -> dict[str, Any]:
        return {"failure_threshold": 1, "probe_interval": 0.2, "shutdown_timeout": 5.0}

    def damage(self, tier: SecondaryTier, key: BlockKey) -> bool:
        from kvtier.tiers.fs import FilesystemTier
        from kvtier.tiers.fs_layout import value_path

        assert isinstance(tier, FilesystemTier)
        path = value_path(tier.ns_dir, key)
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
        return True

    @contextlib.contextmanager
    def outage(self) -> Iterator[bool]:
        """Every shard directory becomes a regular file, so each open and rename in one fails with
        ENOTDIR (even as root; the tier holds the namespace directory itself open)."""
        from kvtier.tiers.fs_layout import SHARDS

        moved = []
        for ns_dir in [p for p in self.root.iterdir() if p.is_dir()]:
            for shard in SHARDS:
                path = ns_dir / shard
                path.rename(ns_dir / f"{shard}.away")
                path.write_bytes(b"")
                moved.append(path)
        try:
            yield True
        finally:
            for path in moved:
                path.unlink()
                path.with_name(f"{path.name}.away").rename(path)


class TestFsTier(TierConformance):
    @pytest.fixture
    def harness(self, tmp_path: Path) -> FsHarness:
        return FsHarness(tmp_path / "fs-root")


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

    def outage(self) -> contextlib.AbstractContextManager[bool]:
        return server_down(self.server)


@pytest.mark.redis
class TestRedisTier(TierConformance):
    @pytest.fixture
    def harness(self, redis_server: Any) -> RedisHarness:
        return RedisHarness(redis_server)


class S3Harness(TierHarness):
    persistent = True

    def __init__(self, server: MotoServer, bucket: str) -> None:
        self.server = server
        self.bucket = bucket

    def spec(self) -> dict[str, Any]:
        return s3_options(self.server.endpoint, self.bucket, max_in_flight=4)

    def fast_failure_options(self) -> dict[str, Any]:
        return FAST_FAILURE

    def damage(self, tier: SecondaryTier, key: BlockKey) -> bool:
        import obstore as obs

        from kvtier.tiers.s3 import S3Tier

        assert isinstance(tier, S3Tier)
        raw = raw_client(self.server.endpoint, self.bucket)
        path = tier.object_path(key)
        value = bytearray(obs.get(raw, path).bytes())
        value[HEADER_SIZE + 100] ^= 0xFF
        obs.put(raw, path, bytes(value))
        return True

    def outage(self) -> contextlib.AbstractContextManager[bool]:
        return server_down(self.server, lambda: self.server.create_bucket(self.bucket))


@pytest.mark.s3
class TestS3Tier(TierConformance):
    @pytest.fixture
    def harness(self, s3_bucket: tuple[MotoServer, str]) -> S3Harness:
        return S3Harness(*s3_bucket)
