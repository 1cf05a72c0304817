"""A threading HTTP server that bounds and owns its connections: the base of kvtier's servers.

kvtier's HTTP servers (the metrics server inside an engine's scheduler process, the fleet's
prefix server) are reachable by any local user, so a client must not be able to hold more than
a bounded share of them, nor outlive them:

* at most ``max_connections`` connections are served at once, each on its own daemon thread;
  one more is closed at once, unanswered;
* :meth:`BoundedHTTPServer.server_close` stops listening and cuts every connection still open
  (an answer being written is cut short), so no thread or socket outlives the server, and a
  kept-alive client is answered no more;
* a connection that ends badly is logged, never printed: a client that went away or timed out
  (an ``OSError``) at debug level, anything else as one warning line. socketserver's default
  prints a traceback to stderr for each, which under vLLM is the engine's log.

Threads: one accepting (``serve_forever``), one per connection; the bookkeeping is locked.
"""

from __future__ import annotations

import contextlib
import io
import logging
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

from kvtier.failures import log_failure


class BoundedHTTPServer(ThreadingHTTPServer):
    """:class:`ThreadingHTTPServer` with a cap on connections and connections cut at close (see
    the module docstring). Subclasses name their ``log`` and the ``label`` of its lines."""

    daemon_threads = True
    log: ClassVar[logging.Logger] = logging.getLogger(__name__)
    label: ClassVar[str] = "http"

    def __init__(
        self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int
    ) -> None:
        self._connections = threading.BoundedSemaphore(max_connections)
        self._open: set[socket.socket] = set()  # the connections being served (cut by server_close)
        self._open_lock = threading.Lock()
        self._closed = False
        if ":" in str(address[0]):
            self.address_family = socket.AF_INET6  # an IPv6 address (::1): only they hold a ':'
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._connections.acquire(blocking=False):  # at the cap: closed unanswered
            self.shutdown_request(request)
            return
        with self._open_lock:
            if self._closed:
                self._connections.release()
                self.shutdown_request(request)
                return
            self._open.add(request)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request: Any) -> None:
        with self._open_lock:
            if request in self._open:
                self._open.discard(request)
                self._connections.release()

    def server_close(self) -> None:
        """Stop listening and cut every open connection (their threads then finish)."""
        super().server_close()
        with self._open_lock:
            self._closed = True
            open_now = list(self._open)
        for request in open_now:
            with contextlib.suppress(OSError):  # (the client went away already)
                request.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection failed (called from its thread, in its ``except``): logged, never printed."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # the client went away or timed out (BrokenPipe, reset, timeout)
            self.log.debug("%s: connection from %s ended early: %s", self.label, client_address, exc)
        elif exc is not None:
            log_failure(self.log, logging.WARNING, f"{self.label}: serving {client_address} failed", exc)


class DeadlineReader(io.RawIOBase):
    """A connection's bytes, each read bounded by what is left of one deadline for the whole
    request (``deadline``: a :func:`time.monotonic` time, which the handler sets per request), so
    a client sending a byte now and then (slowloris) is dropped like a silent one: a socket
    timeout alone restarts with every byte. Raises :class:`TimeoutError` once it has passed.
    Wrap it in :class:`io.BufferedReader` as the handler's ``rfile``; the connection's thread only."""

    def __init__(self, sock: socket.socket, timeout: float, limit: str = "its deadline") -> None:
        super().__init__()
        self.sock = sock
        self.limit = limit  # what the TimeoutError names as the bound (a setting's name, say)
        self.deadline = time.monotonic() + timeout

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the request did not arrive within {self.limit}")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class DeadlineRequestHandler(BaseHTTPRequestHandler):
    """A request handler whose every request (its line, headers and body) must arrive within
    :meth:`request_seconds` of its first byte, or of the previous answer on a kept-alive
    connection: its ``rfile`` reads through a :class:`DeadlineReader` (whose errors name
    ``deadline_name``). The connection's thread only."""

    deadline_name: ClassVar[str] = "its deadline"

    def request_seconds(self) -> float:
        """The seconds a request may take to arrive whole: by default the handler's ``timeout``,
        which a subclass then sets (or it gives its own)."""
        if self.timeout is None:
            raise TypeError(f"{type(self).__name__} needs a timeout, or a request_seconds() of its own")
        return float(self.timeout)

    def setup(self) -> None:
        super().setup()
        plain, self._reader = self.rfile, DeadlineReader(self.connection, self.request_seconds(), self.deadline_name)
        self.rfile = io.BufferedReader(self._reader)
        plain.close()  # (the socket's own reader, unused: the deadline's reads the requests)

    def handle_one_request(self) -> None:
        # One deadline per request, from when the previous answer went out: a client that
        # sends a byte now and then (slowloris) is dropped like a silent one.
        self._reader.deadline = time.monotonic() + self.request_seconds()
        super().handle_one_request()


__all__ = ["BoundedHTTPServer", "DeadlineReader", "DeadlineRequestHandler"]
