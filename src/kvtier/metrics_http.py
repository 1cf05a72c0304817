"""The HTTP server behind ``metrics_port``: ``GET /metrics`` in the Prometheus text format, bounded.

It runs inside the engine's scheduler process and any local user can connect to it, so it bounds
what a client can hold: each request must arrive whole within :data:`REQUEST_TIMEOUT` seconds (a
client that sends half a request and waits, or trickles it a byte at a time, is dropped), each
write of the answer gets as long, at most :data:`MAX_CONNECTIONS`
connections are served at once (more are closed at once, unanswered), and :meth:`close` shuts down
the connections still open, so no thread or socket outlives it. A client that goes away before its
answer is written (a scrape that timed out) is logged at debug level, and any other failure of a
connection as one warning line: nothing is printed to the engine's stderr. (prometheus-client's own
``start_http_server`` has no per-connection timeout and no cap: a client holding connections open
added a thread and a socket each, which outlived the server.) Threads: one accepting, one per
connection, all daemons.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvtier.failures import log_failure
from kvtier.http_server import BoundedHTTPServer, DeadlineRequestHandler

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT = 10.0
"""Seconds a request may take to arrive whole, and each write of its answer, before the connection is dropped."""

MAX_CONNECTIONS = 16
"""Connections served at once; one more is closed unanswered."""


class MetricsServer(BoundedHTTPServer):
    """Serves ``render()`` on ``GET`` of any path (as prometheus-client's server does)."""

    log = logger
    label = "metrics"

    def __init__(self, address: tuple[str, int], render: Callable[[], bytes]) -> None:
        self.render = render
        super().__init__(address, _Handler, MAX_CONNECTIONS)

    def close(self) -> None:
        """Stop accepting, and end the connections still open (their threads then finish)."""
        self.shutdown()
        self.server_close()


class _Handler(DeadlineRequestHandler):
    timeout = REQUEST_TIMEOUT  # (the request's deadline too: request_seconds)
    server: MetricsServer

    def do_GET(self) -> None:
        self.connection.settimeout(self.timeout)  # the answer's writes: their own timeout each
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
