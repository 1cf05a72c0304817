"""Real redis-server processes for the tests, on free loopback ports (no persistence).

``RedisServer`` can be killed with SIGKILL and restarted on the same port; ``start_redis``
starts one on a fresh free port (retrying when the port was taken meanwhile). Used by
the fixtures of ``tests/tiers/conftest.py`` and by other test folders that need a Redis.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

from server_process import ServerProcess, start_on_a_free_port

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
_SKIP_REASON = "redis-server not found on PATH; install it with: apt-get install -y redis-server"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


class RedisServer(ServerProcess):
    """One redis-server process on 127.0.0.1; ``kill()`` sends SIGKILL, ``start()`` restarts it."""

    def __init__(self, workdir: Path, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        assert REDIS_SERVER is not None
        self.workdir = workdir
        self.port = port or _free_port()
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        assert REDIS_SERVER is not None
        return [
            REDIS_SERVER,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--protected-mode",
            "no",
            "--logfile",
            str(self.workdir / f"redis-{self.port}.log"),
            *self.extra_args,
        ]

    def start(self, timeout: float = 10.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited with {self.proc.returncode}")
            if _ping(self.port):
                return
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING within {timeout}s")


def _start_server(workdir: Path, extra_args: tuple[str, ...] = ()) -> RedisServer:
    return start_on_a_free_port(lambda: RedisServer(workdir, extra_args=extra_args), "redis-server")


def start_redis(workdir: Path, extra_args: tuple[str, ...] = ()) -> RedisServer:
    """A redis-server on a fresh free port (RuntimeError if none starts)."""
    return _start_server(workdir, extra_args)


class TcpLink:
    """A TCP proxy to a local port: each connection it accepts is joined to one of its own to
    the port, and the two sockets handed to :meth:`_relay` (a subclass's pipes); ``close()``
    stops it. A subclass sets its own attributes before calling ``__init__`` (it starts
    accepting)."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._admit():
                client.close()
                continue
            server = socket.create_connection(("127.0.0.1", self._upstream))
            self._sockets += [client, server]
            self._relay(client, server)

    def _admit(self) -> bool:
        """Whether a new connection is taken (else it is closed at once)."""
        return True

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        raise NotImplementedError

    @staticmethod
    def _shut(*sockets: socket.socket) -> None:
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        for s in self._sockets:
            with contextlib.suppress(OSError):
                s.close()


class SlowLink(TcpLink):
    """A TCP proxy to a local port that passes server-to-client bytes at ``bytes_per_second``
    (a congested link); client-to-server bytes pass as they come. With ``uplink``, the other way
    round: client-to-server bytes are slow (a congested uplink). ``close()`` stops it."""

    def __init__(self, upstream_port: int, bytes_per_second: int, uplink: bool = False) -> None:
        self._rate = bytes_per_second
        self._uplink = uplink
        super().__init__(upstream_port)

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        threading.Thread(target=self._pipe, args=(client, server, self._uplink), daemon=True).start()
        threading.Thread(target=self._pipe, args=(server, client, not self._uplink), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, slow: bool) -> None:
        try:
            while data := src.recv(1024 if slow and not self._uplink else 65536):
                if slow:
                    time.sleep(len(data) / self._rate)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._shut(src, dst)


class MuteLink(TcpLink):
    """A TCP proxy to a local port that passes every byte, except that while :attr:`muted` is set
    the server's replies are read and thrown away: the commands reach the server and run, and
    the client never hears of them (a reply lost on the way). ``close()`` stops it."""

    def __init__(self, upstream_port: int) -> None:
        self.muted = threading.Event()
        super().__init__(upstream_port)

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
        threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while data := src.recv(65536):
                if not (replies and self.muted.is_set()):
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            self._shut(src, dst)


class TrickleServer:
    """A fake 'Redis' on a loopback port that never finishes a reply: each connection it accepts
    gets, after the client's first bytes, ``opening`` and then one ``filler`` byte every
    ``interval`` seconds for as long as the client stays (so every receive of the client gets a
    byte within any socket timeout). ``opening``: ``b"+"`` (a simple-string reply line never
    ended) or ``b"$100000000\r\n"`` (a bulk reply that never comes). With ``tls`` (a server
    context), the connection is TLS: the handshake completes, then the bytes trickle in TLS
    records of one byte each. With ``trickle_on`` (e.g. ``(b"INFO", b"PING")``), commands are
    answered ``+OK`` (a connection's setup completes) until one naming any of those words comes:
    its reply is the one that trickles. ``close()`` stops it."""

    def __init__(
        self, opening: bytes, filler: bytes = b"O", interval: float = 0.2, tls: ssl.SSLContext | None = None,
        trickle_on: tuple[bytes, ...] = (),
    ) -> None:
        self._opening, self._filler, self._interval, self._tls = opening, filler, interval, tls
        self._trickle_on = trickle_on
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._sockets: list[socket.socket] = [self._listener]
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._sockets.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self._tls is not None:
                conn.settimeout(10.0)
                conn = self._tls.wrap_socket(conn, server_side=True)
                self._sockets.append(conn)
            data = conn.recv(65536)
            while self._trickle_on and not any(word in data for word in self._trickle_on):
                conn.sendall(b"+OK\r\n" * data.count(b"*"))  # (one '*' per command: none in their arguments)
                data = conn.recv(65536)
            conn.sendall(self._opening)
            while not self._closed.wait(self._interval):
                conn.sendall(self._filler)
        except OSError:
            pass

    def close(self) -> None:
        self._closed.set()
        TcpLink._shut(*self._sockets)
        for s in self._sockets:
            with contextlib.suppress(OSError):
                s.close()
