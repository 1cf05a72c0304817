"""The Redis tier against a server that trickles bytes: every redis-py call has an overall
deadline (a connection's setup, PING, INFO), not only a timeout per receive.

The fake server is a real socket (:class:`redis_servers.TrickleServer`); no redis-server is needed.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from redis_servers import TrickleServer
from tls_certificates import make_test_certificates

from kvtier.keys import KVGeometry, Namespace, chain_ids
from kvtier.tiers.base import JobResult, TierContext, TransferJob
from kvtier.tiers.redis import RedisTier

BLOCK = 4096

OPENINGS = {
    "reply line": (b"+", b"O", False),
    "bulk reply": (b"$100000000\r\n", b"x", False),
    "reply line over tls": (b"+", b"O", True),  # a TLS connection: its socket is wrapped after the setup began
}


def _server_tls(tmp_path: Path, tls: bool) -> tuple[ssl.SSLContext | None, str]:
    """The fake server's TLS context (None: plain TCP) and the URL template (``{port}``) the tier is given."""
    if not tls:
        return None, "redis://127.0.0.1:{port}/0"
    ca, crt, key = make_test_certificates(tmp_path / "certs")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(crt, key)
    return context, f"rediss://127.0.0.1:{{port}}/0?ssl_ca_certs={ca}&ssl_cert_reqs=required"


@pytest.fixture(params=sorted(OPENINGS))
def trickle(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[TrickleServer, str]]:
    """A trickling server and the URL the tier is given for it."""
    opening, filler, tls = OPENINGS[request.param]
    context, url = _server_tls(tmp_path, tls)
    server = TrickleServer(opening, filler, tls=context)
    try:
        yield server, url.format(port=server.port)
    finally:
        server.close()


def _tier(url: str, **options: object) -> RedisTier:
    ns = Namespace("m", KVGeometry.from_block_bytes(BLOCK))
    rows = np.zeros((4, BLOCK), np.uint8)
    return RedisTier(TierContext(rows, BLOCK, ns), url=url, io_threads=1, **options)  # type: ignore[arg-type]


def _load(tier: RedisTier) -> TransferJob:
    keys = chain_ids(range(2), tier.context.namespace)
    job = TransferJob(1, keys, np.asarray([0, 1]), True)
    tier.submit_load(job)
    return job


def _wait_result(tier: RedisTier, timeout: float) -> JobResult | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = tier.poll_finished()
        if done:
            return done[0]
        time.sleep(0.02)
    return None


def test_a_server_that_trickles_during_connection_setup_fails_the_load_and_shutdown_finishes(
    trickle: tuple[TrickleServer, str],
) -> None:
    """Regression (review): a server that sent one byte every 0.2 s during connection setup kept
    the I/O thread in redis-py's setup (a reply line to CLIENT SETNAME that never ends, a bulk
    reply that never comes, a TLS handshake record that never completes) for ever: socket_timeout
    bounds each receive only. The load never finished and shutdown() raised "threads ... did not
    stop". Now the setup has an overall deadline (connect_timeout + 2 socket timeouts + a little):
    the connection is shut down when it passes, the load fails as a timed-out server's would (a
    breaker failure), and shutdown finishes."""
    _, url = trickle
    tier = _tier(url, socket_timeout=0.5, connect_timeout=0.5)
    try:
        started = time.monotonic()
        _load(tier)
        # The tier's first INFO (housekeeping, the same thread) may take one deadline (~1.5 s) first.
        result = _wait_result(tier, 8.0)
        took = time.monotonic() - started
        assert result is not None, "the load did not finish: the I/O thread is stuck in connection setup"
        assert not result.success and "DeadlineExceeded" in (result.error or ""), result
        assert took < 5.0, took
        health = tier.health()
        assert health.consecutive_failures >= 1 and "deadline" in health.detail, health  # counted as a timeout
    finally:
        t0 = time.monotonic()
        tier.shutdown()  # raised TierError ("did not stop") before the fix
    assert time.monotonic() - t0 < 3.0


def test_shutdown_cuts_a_connection_setup_short_instead_of_waiting_for_its_deadline(
    trickle: tuple[TrickleServer, str],
) -> None:
    """With long timeouts (a deadline of 15 s), shutdown() during a trickling setup does not wait
    for the deadline: it cuts the setup, the load fails as shut down, and the threads stop at once."""
    _, url = trickle
    tier = _tier(url, socket_timeout=5.0, connect_timeout=5.0)
    _load(tier)
    time.sleep(0.5)  # the I/O thread is in the setup now (INFO's, then the load's)
    t0 = time.monotonic()
    tier.shutdown()
    assert time.monotonic() - t0 < 2.0
    result = _wait_result(tier, 1.0)
    assert result is not None and not result.success, result


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_a_control_command_whose_reply_trickles_is_cut_at_its_deadline(tls: bool, tmp_path: Path) -> None:
    """Regression (review): once set up, a connection's INFO memory (usage, every few seconds) and
    PING (the breaker's probe) wait on redis-py's reply reader, which a server sending a byte within
    every socket timeout kept going for ever (and shutdown then failed). They have the overall
    deadline too: the established connection's socket (a TLS one as well) is shut down, the call
    fails as a timeout, the connection is not used again, and shutdown finishes."""
    context, url = _server_tls(tmp_path, tls)
    server = TrickleServer(b"$100000000\r\n", b"x", tls=context, trickle_on=(b"INFO", b"PING"))
    tier = _tier(url.format(port=server.port), socket_timeout=0.5, connect_timeout=0.5, failure_threshold=1)
    try:
        deadline = time.monotonic() + 5.0
        while "INFO memory took longer than its deadline" not in tier.health().detail:
            assert time.monotonic() < deadline, tier.health()
            time.sleep(0.05)
        assert not tier.health().serving  # a timeout: with failure_threshold 1, out of service
    finally:
        t0 = time.monotonic()
        tier.shutdown()
        server.close()
    assert time.monotonic() - t0 < 3.0
