"""The HTTP server behind ``metrics_port``: ``GET /metrics`` in the Prometheus text format, bounded.

It runs inside the engine's scheduler process and any local user can connect to it, so it bounds
what a client can hold: each connection gets :data:`REQUEST_TIMEOUT` seconds for each read and
write (a client that sends half a request and waits is dropped), at most :data:`MAX_CONNECTIONS`
connections are served at once (more are closed at once, unanswered), and :meth:`close` shuts down
the connections still open, so no thread or socket outlives it. A client that goes away before its
answer is written (a scrape that timed out) is logged at debug level, and any other failure of a
connection as one warning line: nothing is printed to the engine's stderr. (prometheus-client's own
``start_http_server`` has no per-connection timeout and no cap: a client holding connections open
added a thread and a socket each, which outlived the server.) Threads: one accepting, one per
connection, all daemons.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvtier.failures import log_failure

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT = 10.0
"""Seconds a connection may take for each read or write before it is dropped."""

MAX_CONNECTIONS = 16
"""Connections served at once; one more is closed unanswered."""


class MetricsServer(ThreadingHTTPServer):
    """Serves ``render()`` on ``GET`` of any path (as prometheus-client's server does)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], render: Callable[[], bytes]) -> None:
        self.render = render
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # at the cap: closed unanswered
            self.shutdown_request(request)
            return
        with self._open_lock:
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

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection failed (called from its thread, in its ``except``): logged, never printed.

        socketserver's default prints a traceback to stderr, which under vLLM is the engine's log: one
        for every scraper that hung up before reading its answer. Such disconnects (and timeouts) are
        debug-level; anything else is one warning with the error's own words."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # the client went away or timed out (BrokenPipe, reset, timeout)
            logger.debug("metrics: connection from %s ended early: %s", client_address, exc)
            return
        if exc is not None:
            log_failure(logger, logging.WARNING, f"metrics: serving {client_address} failed", exc)

    def _forget(self, request: Any) -> None:
        with self._open_lock:
            if request in self._open:
                self._open.discard(request)
                self._slots.release()

    def close(self) -> None:
        """Stop accepting, and end the connections still open (their threads then finish)."""
        self.shutdown()
        self.server_close()
        with self._open_lock:
            open_now = list(self._open)
        for sock in open_now:
            with contextlib.suppress(OSError):  # (closed meanwhile)
                sock.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    timeout = REQUEST_TIMEOUT
    server: MetricsServer

    def do_GET(self) -> None:
        try:
            body = self.server.render()
        except Exception as exc:  # a collector failed: the scrape fails, the engine goes on
            log_failure(logger, logging.WARNING, "metrics: rendering the exposition failed", exc)
            self.send_error(500)
            return
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("metrics %s " + format, self.address_string(), *args)


__all__ = ["MAX_CONNECTIONS", "REQUEST_TIMEOUT", "MetricsServer"]
