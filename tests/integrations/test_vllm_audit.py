"""Outside-tester findings on the vLLM integration's edges (audit, 2026-12-05).

No vLLM needed: kvtier's own metrics server (``metrics_port``) driven with real sockets.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvtier.metrics_http import MetricsServer

BODY = b"kvtier_test_metric 1\n" * 1_600_000  # 34 MB: more than the socket buffers hold


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    srv = MetricsServer(("127.0.0.1", 0), lambda: BODY)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.close()
    thread.join(10)
    assert not thread.is_alive()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def records() -> Iterator[_Records]:
    """The metrics server's log records, whatever another test did to the ``kvtier`` logger."""
    log = logging.getLogger("kvtier.metrics_http")
    handler, level = _Records(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    yield handler
    log.removeHandler(handler)
    log.setLevel(level)


def _ended_early(srv: MetricsServer, records: _Records, count: int, timeout: float = 20.0) -> None:
    """Until ``count`` connections were logged as ended early and the server holds none."""
    deadline = time.monotonic() + timeout
    while True:
        with srv._open_lock:
            idle = not srv._open
        if idle and sum("ended early" in m for m in records.messages) >= count:
            return
        if time.monotonic() > deadline:
            return  # (the assertions below say what is missing)
        time.sleep(0.01)


def test_a_scraper_that_hangs_up_early_prints_no_traceback(
    server: MetricsServer, capfd: pytest.CaptureFixture[str], records: _Records
) -> None:
    """Regression (audit, 2026-12-05): every client that closed its connection before reading the
    answer (a scrape that timed out) made socketserver print "Exception occurred during processing
    of request" and a BrokenPipeError traceback to stderr, which under vLLM is the engine's log. Such
    a disconnect is a debug record now, and the server goes on serving."""
    port = server.server_address[1]
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
    _ended_early(server, records, 3)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err[-2000:]
    assert sum("ended early" in m for m in records.messages) == 3, records.messages
    with socket.create_connection(("127.0.0.1", port)) as sock:  # still serving, whole answers
        sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        got = b""
        while chunk := sock.recv(1 << 20):
            got += chunk
    assert got.startswith(b"HTTP/1.0 200") and got.endswith(BODY)
