"""Connections for the Redis tier: standalone Redis/Valkey or a Redis Cluster.

A backend maps Redis keys to the connection pools that serve them and runs the
few control commands the tier needs (PING, INFO memory, topology refresh).
redis-py does the connecting: URL parsing, TLS (``rediss://``), password or
ACL user, database selection. Every socket operation has a timeout and redis-py
retries are disabled, so a dead server costs one timeout, never a retry loop.

redis-py's ``socket_timeout`` bounds each receive only: a server (or a proxy in front of
it) that sends a byte within every socket timeout would keep a connection's setup (TLS
handshake, ``AUTH``/``HELLO``, ``CLIENT SETNAME``, ``SELECT``) or a control command's reply
going for ever. So every call here that may set up a connection or read a redis-py reply
runs under an overall deadline (:class:`CallDeadlines`): when it passes, the connection's
socket is shut down, the blocked receive returns, and the call raises
:class:`DeadlineExceeded` (a ``TimeoutError``: the tier counts it as a timeout).

Every method here blocks on the network and is called from the tier's I/O
threads only, never from the scheduler thread (:meth:`RedisBackend.stop` and
:meth:`RedisBackend.close`: from the thread that shuts the tier down).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import AbstractConnection, Connection, SSLConnection, UnixDomainSocketConnection, parse_url
from redis.retry import Retry


class DeadlineExceeded(TimeoutError):
    """A redis-py call (a connection's setup, a control command) overran its overall deadline;
    its connection was shut down. The tier treats it as any other timeout."""


class CallStopped(ConnectionError):
    """A redis-py call cut short, or refused, because the tier is shutting down (no failure of the server)."""


class _Watch:
    """One armed deadline: the connections a call used while it was armed (cut when it passes)."""

    __slots__ = ("conns", "deadline", "fired", "lock", "stopped")

    def __init__(self, deadline: float, lock: threading.Condition) -> None:
        self.deadline = deadline
        self.lock = lock
        self.conns: list[_DeadlineBound] = []
        self.fired = False
        self.stopped = False

    def cut(self) -> None:
        # Caller holds self.lock.
        self.fired = True
        for conn in self.conns:
            conn._kvtier_cut()


_current = threading.local()
"""``watch``: the :class:`_Watch` armed by the calling thread, if any (read by the connections)."""


def _register(conn: _DeadlineBound) -> None:
    """``conn`` is being checked out or set up by the calling thread: bound by the deadline that
    thread armed, if any (cut at once if that already passed)."""
    watch: _Watch | None = getattr(_current, "watch", None)
    if watch is None:
        return
    with watch.lock:
        if conn not in watch.conns:
            watch.conns.append(conn)
        if watch.fired:
            conn._kvtier_cut()


class CallDeadlines:
    """Overall deadlines for the redis-py calls of one backend, kept by one watchdog thread.

    :meth:`watch` arms a deadline for the calling thread; every connection that thread checks
    out of a pool (or sets up) meanwhile registers itself with it (:class:`_DeadlineBound`).
    When the deadline passes first, the watchdog shuts those connections' sockets down
    (``shutdown(2)``: safe while another thread is blocked on them, and it wakes that thread),
    and the call raises :class:`DeadlineExceeded`. A cut connection is never used again: it
    reconnects at its next checkout.

    Cost to a call: two short lock holds and a thread-local store; the watchdog sleeps on a
    condition until the earliest armed deadline (no wake-ups while nothing is armed) and is
    started at the first :meth:`watch`. :meth:`stop` (shutdown) cuts every armed call at once
    and refuses new ones (:class:`CallStopped`), then the watchdog exits.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._armed: dict[_Watch, None] = {}
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._next_wake: float | None = None  # when the watchdog wakes next (None: when notified)

    @contextlib.contextmanager
    def watch(self, seconds: float, what: str) -> Iterator[None]:
        """Run the ``with`` body (on the calling I/O thread) under a deadline of ``seconds``;
        ``what`` names the call in the :class:`DeadlineExceeded` raised when it passes (also
        when the body returned meanwhile: its connection was shut down)."""
        watch = _Watch(time.monotonic() + seconds, self._cond)
        with self._cond:
            if self._stopped:
                raise CallStopped(f"redis tier is shutting down: {what} not started")
            self._armed[watch] = None
            if self._thread is None:
                self._thread = threading.Thread(target=self._watchdog, name=f"{self._name}-deadlines", daemon=True)
                self._thread.start()
            if self._next_wake is None or watch.deadline < self._next_wake:
                self._cond.notify()  # (else it wakes in time anyway: no wake-up per call)
        outer = getattr(_current, "watch", None)
        _current.watch = watch
        try:
            yield
        except BaseException as exc:
            self._disarm(watch)
            if watch.fired:
                raise self._overran(watch, seconds, what) from exc
            raise
        finally:
            _current.watch = outer
        self._disarm(watch)
        if watch.fired:
            raise self._overran(watch, seconds, what)

    @staticmethod
    def _overran(watch: _Watch, seconds: float, what: str) -> Exception:
        if watch.stopped:
            return CallStopped(f"redis tier is shutting down: {what} cut short")
        return DeadlineExceeded(
            f"{what} took longer than its deadline of {seconds:.2f}s (connect_timeout plus socket timeouts: a server "
            "or link that trickles its replies); the connection was shut down"
        )

    def _disarm(self, watch: _Watch) -> None:
        with self._cond:
            self._armed.pop(watch, None)

    def stop(self) -> None:
        """Shutdown: cut every armed call now and refuse new ones; the watchdog exits."""
        with self._cond:
            self._stopped = True
            for watch in self._armed:
                watch.stopped = True
                watch.cut()
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(1.0)

    def _watchdog(self) -> None:
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                wait: float | None = None
                for watch in self._armed:
                    if watch.fired:
                        continue
                    if watch.deadline <= now:
                        watch.cut()
                    else:
                        wait = watch.deadline - now if wait is None else min(wait, watch.deadline - now)
                self._next_wake = None if wait is None else now + wait
                self._cond.wait(wait)


if TYPE_CHECKING:
    _ConnectionBase = AbstractConnection
else:
    _ConnectionBase = object


class _DeadlineBound(_ConnectionBase):
    """What the tier's redis-py connection classes add: a connection checked out or set up
    under a :meth:`CallDeadlines.watch` registers with it, and can be cut from the watchdog
    thread (:meth:`_kvtier_cut`).

    While a new socket is being set up (TCP connect, TLS handshake, the setup commands) a
    duplicate of its descriptor (one ``dup`` per new connection, closed when the setup ends) is
    what a cut shuts down: TLS takes the descriptor over from the plain socket, and the
    connection has no socket of its own until the setup is done. Afterwards a cut shuts down
    the connection's socket. Both under a lock that :meth:`disconnect` holds too, so a cut never
    touches a descriptor that was closed (and perhaps reused). A cut connection is disconnected
    at its next checkout instead of being used.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._kvtier_lock = threading.RLock()
        self._kvtier_guard: socket.socket | None = None
        self._kvtier_was_cut = False
        super().__init__(*args, **kwargs)

    def connect(self) -> None:
        """Every checkout from a pool calls this (on the thread checking it out)."""
        if self._kvtier_was_cut:
            self.disconnect()
        _register(self)
        try:
            super().connect()  # type: ignore[no-untyped-call]
        finally:
            with self._kvtier_lock:
                guard, self._kvtier_guard = self._kvtier_guard, None
            if guard is not None:
                guard.close()

    def _connect(self) -> socket.socket:
        sock: socket.socket = super()._connect()  # type: ignore[no-untyped-call,safe-super]  # (TLS wraps it after)
        with self._kvtier_lock:
            self._kvtier_guard = guard = sock.dup()
            if self._kvtier_was_cut:  # cut while it was connecting
                with contextlib.suppress(OSError):
                    guard.shutdown(socket.SHUT_RDWR)
        return sock

    def disconnect(self, *args: Any, **kwargs: Any) -> None:
        with self._kvtier_lock:
            self._kvtier_was_cut = False
            super().disconnect(*args, **kwargs)  # type: ignore[no-untyped-call]

    def _kvtier_cut(self) -> None:
        """Shut the socket down (watchdog thread): a receive blocked on it returns at once."""
        with self._kvtier_lock:
            self._kvtier_was_cut = True
            target = self._kvtier_guard or self._sock
            if target is not None:
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(target, socket.SHUT_RDWR)  # (not SSLSocket's: no TLS state touched)


class _TcpConnection(_DeadlineBound, Connection):
    """``redis://``."""


class _TlsConnection(SSLConnection, _TcpConnection):
    """``rediss://``: SSLConnection wraps the socket _TcpConnection's setup registered."""


class _UnixConnection(_DeadlineBound, UnixDomainSocketConnection):
    """``unix://``."""


def _connection_class(url: str) -> type[AbstractConnection]:
    scheme = url.split(":", 1)[0].lower()
    return {"rediss": _TlsConnection, "unix": _UnixConnection}.get(scheme, _TcpConnection)


class RedisBackend(Protocol):
    def groups(self, keys: Sequence[bytes]) -> list[tuple[Any, list[int]]]:
        """Split ``keys`` by the connection pool that serves them: ``[(pool, indexes)]``."""

    def connection(self, pool: Any) -> Any:
        """A connection of ``pool`` (from :meth:`groups`), set up within the call deadline; the
        caller gives it back with ``pool.release`` (after ``disconnect()`` unless it is clean)."""

    def ping(self) -> None:
        """Raise unless every server answers PING."""

    def info_memory(self) -> tuple[int, int | None]:
        """``(used_memory, maxmemory or None)`` summed over the servers."""

    def refresh(self) -> None:
        """Re-read the cluster topology (after MOVED/ASK); no-op for a standalone server."""

    def stop(self) -> None:
        """Shutdown: cut the calls under way, refuse new ones (:class:`CallStopped`)."""

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
    """One Redis or Valkey server (or a proxy that speaks its protocol).

    ``call_seconds``: the overall deadline of each call that may set up a connection or wait
    for a redis-py reply (see :class:`CallDeadlines`)."""

    def __init__(self, url: str, socket_timeout: float, connect_timeout: float, call_seconds: float) -> None:
        self._seconds = call_seconds
        self._deadlines = CallDeadlines("kvtier-redis")
        self.client = redis.Redis.from_url(
            url, connection_class=_connection_class(url), **_client_options(socket_timeout, connect_timeout)
        )
        self._pool = self.client.connection_pool

    def groups(self, keys: Sequence[bytes]) -> list[tuple[Any, list[int]]]:
        return [(self._pool, list(range(len(keys))))] if keys else []

    def connection(self, pool: Any) -> Any:
        return _checkout(self._deadlines, self._seconds, pool)

    def ping(self) -> None:
        with self._deadlines.watch(self._seconds, "PING"):
            self.client.ping()

    def info_memory(self) -> tuple[int, int | None]:
        with self._deadlines.watch(self._seconds, "INFO memory"):
            used, cap = _memory(self.client.info("memory"))
        return used, cap or None

    def refresh(self) -> None:
        return None

    def stop(self) -> None:
        self._deadlines.stop()

    def close(self) -> None:
        self._deadlines.stop()
        self.client.close()
        self._pool.disconnect()


def _checkout(deadlines: CallDeadlines, seconds: float, pool: Any) -> Any:
    """``pool.get_connection()`` under a deadline; a connection cut by it is dropped, not handed out."""
    conn = None
    try:
        with deadlines.watch(seconds, "setting up a connection to Redis"):
            conn = pool.get_connection()
    except BaseException:
        if conn is not None:  # set up, then cut as the deadline passed: its socket is shut
            conn.disconnect()
            pool.release(conn)
        raise
    return conn


class ClusterBackend:
    """A Redis Cluster; the topology is read lazily, so construction never touches the network.

    ``call_seconds`` as for :class:`StandaloneBackend`; reading the topology (at the first call,
    and :meth:`refresh`) has that deadline too."""

    def __init__(self, url: str, socket_timeout: float, connect_timeout: float, call_seconds: float) -> None:
        # Built from the URL's parts (not RedisCluster.from_url, which would put redis-py's own
        # TLS connection class back), with the tier's connection class.
        self._seconds = call_seconds
        self._deadlines = CallDeadlines("kvtier-redis-cluster")
        self._options: dict[str, Any] = parse_url(url)  # type: ignore[no-untyped-call]
        self._options.pop("db", None)  # (0: the options refuse any other for a cluster)
        self._options["connection_class"] = _connection_class(url)
        self._options.update(_client_options(socket_timeout, connect_timeout))
        self._lock = threading.Lock()
        self._cluster: Any = None

    def _client(self) -> Any:
        with self._lock:
            if self._cluster is None:
                with self._deadlines.watch(self._seconds, "reading the cluster topology"):
                    self._cluster = RedisCluster(**self._options)
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

    def connection(self, pool: Any) -> Any:
        return _checkout(self._deadlines, self._seconds, pool)

    def ping(self) -> None:
        cluster = self._client()
        for node in cluster.get_primaries():
            with self._deadlines.watch(self._seconds, f"PING to {node.name}"):
                cluster.get_redis_connection(node).ping()

    def info_memory(self) -> tuple[int, int | None]:
        cluster = self._client()
        used_total, cap_total, unbounded = 0, 0, False
        for node in cluster.get_primaries():
            with self._deadlines.watch(self._seconds, f"INFO memory of {node.name}"):
                used, cap = _memory(cluster.get_redis_connection(node).info("memory"))
            used_total += used
            cap_total += cap
            unbounded = unbounded or cap == 0
        return used_total, None if unbounded else cap_total

    def refresh(self) -> None:
        cluster = self._client()
        with self._deadlines.watch(self._seconds, "reading the cluster topology"):
            cluster.nodes_manager.initialize()

    def stop(self) -> None:
        self._deadlines.stop()

    def close(self) -> None:
        self._deadlines.stop()
        with self._lock:
            cluster, self._cluster = self._cluster, None
        if cluster is not None:
            cluster.close()
