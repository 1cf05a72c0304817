"""The fleet tests use the test servers of ``tests/tiers`` (redis-server, moto)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tiers"))


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Any]:
    """A redis-server of its own on a free loopback port (skips where there is none); stopped
    after the test, paused (SIGSTOP) or not."""
    from redis_servers import REDIS_SERVER, start_redis

    if REDIS_SERVER is None:
        pytest.skip("redis-server not found on PATH")
    server = start_redis(tmp_path / "redis")
    try:
        yield server
    finally:
        server.stop()
