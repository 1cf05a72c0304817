"""Connections for the Redis tier: standalone Redis/Valkey or a Redis Cluster.

A backend maps Redis keys to the connection pools that serve them and runs the
few control commands the tier needs (PING, INFO memory, topology refresh).
redis-py does the connecting: URL parsing, TLS (``rediss://``), password or
ACL user, database selection. Every socket operation has a timeout and redis-py
retries are disabled, so a dead server costs one timeout, never a retry loop.

Every method here blocks on the network and is called from the tier's I/O
threads only, never from the scheduler thread.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry


class RedisBackend(Protocol):
    def groups(self, keys: Sequence[bytes]) -> list[tuple[Any, list[int]]]:
        """Split ``keys`` by the connection pool that serves them: ``[(pool, indexes)]``."""

    def ping(self) -> None:
        """Raise unless every server answers PING."""

    def info_memory(self) -> tuple[int, int | None]:
        """``(used_memory, maxmemory or None)`` summed over the servers."""

    def refresh(self) -> None:
        """Re-read the cluster topology (after MOVED/ASK); no-op for a standalone server."""

    def close(self) -> None:
        """Close every connection."""


def _client_options(socket_timeout: float, connect_timeout: float) -> dict[str, Any]:
    return {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": connect_timeout,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
        "client_name": "kvtier",
        # The fast path parses RESP2; RESP3 push messages could interleave with replies.
        "protocol": 2,
    }


def _memory(info: dict[str, Any]) -> tuple[int, int]:
    return int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))


class StandaloneBackend:
    """One Redis or Valkey server (or a proxy that speaks its protocol)."""

    def __init__(self, url: str, socket_timeout: float, connect_timeout: float) -> None:
        self.client = redis.Redis.from_url(url, **_client_options(socket_timeout, connect_timeout))
        self._pool = self.client.connection_pool

    def groups(self, keys: Sequence[bytes]) -> list[tuple[Any, list[int]]]:
        return [(self._pool, list(range(len(keys))))] if keys else []

    def ping(self) -> None:
        self.client.ping()

    def info_memory(self) -> tuple[int, int | None]:
        used, cap = _memory(self.client.info("memory"))
        return used, cap or None

    def refresh(self) -> None:
        return None

    def close(self) -> None:
        self.client.close()
        self._pool.disconnect()


class ClusterBackend:
    """A Redis Cluster; the topology is read lazily, so construction never touches the network."""

    def __init__(self, url: str, socket_timeout: float, connect_timeout: float) -> None:
        self._url = url
        self._options = _client_options(socket_timeout, connect_timeout)
        self._lock = threading.Lock()
        self._cluster: Any = None

    def _client(self) -> Any:
        with self._lock:
            if self._cluster is None:
                self._cluster = RedisCluster.from_url(self._url, **self._options)
            return self._cluster

    def groups(self, keys: Sequence[bytes]) -> list[tuple[Any, list[int]]]:
        cluster = self._client()
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for i, key in enumerate(keys):
            node = cluster.get_node_from_key(key)
            entry = by_node.get(node.name)
            if entry is None:
                pool = cluster.get_redis_connection(node).connection_pool
                entry = by_node[node.name] = (pool, [])
            entry[1].append(i)
        return list(by_node.values())

    def ping(self) -> None:
        cluster = self._client()
        for node in cluster.get_primaries():
            cluster.get_redis_connection(node).ping()

    def info_memory(self) -> tuple[int, int | None]:
        cluster = self._client()
        used_total, cap_total, unbounded = 0, 0, False
        for node in cluster.get_primaries():
            used, cap = _memory(cluster.get_redis_connection(node).info("memory"))
            used_total += used
            cap_total += cap
            unbounded = unbounded or cap == 0
        return used_total, None if unbounded else cap_total

    def refresh(self) -> None:
        cluster = self._client()
        cluster.nodes_manager.initialize()

    def close(self) -> None:
        with self._lock:
            cluster, self._cluster = self._cluster, None
        if cluster is not None:
            cluster.close()
