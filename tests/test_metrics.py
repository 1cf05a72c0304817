"""Prometheus metrics built from a real TieringManager's stats."""

from __future__ import annotations

import socket
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.config import build_manager, load_config
from kvtier.errors import ConfigError, KvtierError
from kvtier.keys import chain_ids
from kvtier.metrics import KvtierMetrics
from kvtier.types import LookupResult, RequestContext


def samples(metrics: KvtierMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out



def test_metrics_follow_a_real_manager(tmp_path: Path, private_shm: Path) -> None:
    config = load_config(
        env={},
        cli={
            "model": "tiny",
            "shm_dir": str(private_shm),
            "num_cpu_blocks": 4,
            "tiers": [{"type": "fs", "root": str(tmp_path), "scan_in_background": False}],
        },
    )
    manager = build_manager(config)
    metrics = KvtierMetrics()
    try:
        req = RequestContext("r1")
        keys = chain_ids(range(6))
        prepared = manager.prepare_store(keys[:4], req)
        assert prepared is not None
        for slot in prepared.slots:
            manager.rows[int(slot), : manager.block_bytes] = 7
        manager.complete_store(prepared.keys_to_store, req)
        manager.on_request_finished(req)
        deadline = time.monotonic() + 10
        while manager.has_pending_work() and time.monotonic() < deadline:
            manager.on_schedule_end()
            time.sleep(0.005)
        assert manager.lookup(keys[0], req) is LookupResult.HIT
        assert manager.lookup(keys[5], req) is LookupResult.MISS
        metrics.update(manager, {"device_to_cpu": (123, 0.5)})
        got = samples(metrics)
    finally:
        manager.shutdown()
    stats_bytes = 4 * config.block_bytes
    assert got[("kvtier_lookups_total", (("result", "hit"), ("tier", "0:primary")))] == 1
    assert got[("kvtier_lookups_total", (("result", "miss"), ("tier", "0:primary")))] == 1
    assert got[("kvtier_lookups_total", (("result", "miss"), ("tier", "1:fs")))] == 1
    assert got[("kvtier_bytes_total", (("direction", "write"), ("tier", "0:primary")))] == stats_bytes
    assert got[("kvtier_bytes_total", (("direction", "write"), ("tier", "1:fs")))] == stats_bytes
    assert got[("kvtier_bytes_total", (("direction", "device_to_cpu"), ("tier", "device")))] == 123
    assert got[("kvtier_cascades_total", (("result", "succeeded"),))] == 4
    assert got[("kvtier_entries", (("tier", "0:primary"),))] == 4
    assert got[("kvtier_entries", (("tier", "1:fs"),))] == 4
    assert got[("kvtier_capacity_bytes", (("tier", "0:primary"),))] == 4 * manager.region.row_stride
    assert got[("kvtier_health_state", (("state", "closed"), ("tier", "1:fs")))] == 1
    assert got[("kvtier_health_state", (("state", "open"), ("tier", "1:fs")))] == 0
    assert got[("kvtier_jobs_in_flight", ())] == 0
    assert got[("kvtier_jobs_total", (("direction", "write"), ("tier", "1:fs")))] == 1
    assert got[("kvtier_transfer_seconds_total", (("direction", "write"), ("tier", "1:fs")))] > 0
    assert got[("kvtier_active_jobs", (("direction", "write"), ("tier", "1:fs")))] == 0
    assert got[("kvtier_tier_lookup_seconds_count", (("tier", "0:primary"),))] >= 1
    assert ("kvtier_tier_lookup_seconds_bucket", (("le", "+Inf"), ("tier", "1:fs"))) in got
    assert got[("kvtier_backpressure_active", (("tier", "1:fs"),))] == 0
    assert got[("kvtier_cascades_total", (("result", "skipped"),))] == 0
    # the fs tier's declared extras: counters as counters, gauges as gauges
    assert got[("kvtier_tier_extra_counter_total", (("name", "stores_skipped"), ("tier", "1:fs")))] == 0
    assert got[("kvtier_tier_extra_gauge", (("name", "scan_entries"), ("tier", "1:fs")))] == 0


def test_health_and_failures_from_a_snapshot() -> None:
    metrics = KvtierMetrics()
    metrics.update(
        {
            "manager": {"jobs_in_flight": 3, "promotions_failed": 2},
            "primary": {"hits": 5, "block_bytes": 10, "blocks_stored": 2},
            "tiers": {"1:redis": {"health": "open", "stores_failed": 4, "corrupt_values": 1, "used_bytes": 9}},
        }
    )
    metrics.observe_lookup(2e-6)
    metrics.observe_step(3e-4)
    got = samples(metrics)
    assert got[("kvtier_health_state", (("state", "open"), ("tier", "1:redis")))] == 1
    assert got[("kvtier_failures_total", (("kind", "store_failed"), ("tier", "1:redis")))] == 4
    assert got[("kvtier_failures_total", (("kind", "corrupt_value"), ("tier", "1:redis")))] == 1
    assert got[("kvtier_promotions_total", (("result", "failed"),))] == 2
    assert got[("kvtier_jobs_in_flight", ())] == 3
    assert got[("kvtier_bytes_total", (("direction", "write"), ("tier", "0:primary")))] == 20
    assert got[("kvtier_lookup_seconds_count", ())] == 1
    assert got[("kvtier_scheduler_step_seconds_count", ())] == 1


def test_registries_are_private() -> None:
    a, b = KvtierMetrics(), KvtierMetrics()  # a global registry would refuse the second
    a.observe_lookup(1e-6)
    assert samples(b)[("kvtier_lookup_seconds_count", ())] == 0
    assert not any(name.startswith("kvtier_lookups") for name, _ in samples(b))  # no snapshot yet


def test_serve_and_close() -> None:
    metrics = KvtierMetrics()
    metrics.update({"manager": {}, "primary": {"hits": 11}, "tiers": {}})
    port = metrics.serve(0)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'kvtier_lookups_total{result="hit",tier="0:primary"} 11.0' in body
        with pytest.raises(KvtierError, match="already running"):
            metrics.serve(0)
    finally:
        metrics.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_port_in_use_is_explained() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(KvtierError, match="pick a free --metrics-port"):
            KvtierMetrics().serve(port)


def test_an_address_that_is_not_this_machines_is_named_as_the_problem() -> None:
    """Regression (review, 2026-12-02): a bad --metrics-addr was answered 'pick a free --metrics-port'."""
    with pytest.raises(KvtierError, match="give an address of this machine"):
        KvtierMetrics().serve(0, addr="999.1.1.1")


def test_the_metrics_server_bounds_what_clients_hold_and_close_ends_it_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (review, 2026-12-05): prometheus-client's server gave every connection a thread
    with no timeout and no cap, so a local client holding half-sent requests open added a thread
    and a socket each to the engine's scheduler process, and they outlived close()."""
    import threading
    import time

    from kvtier import metrics_http

    monkeypatch.setattr(metrics_http._Handler, "timeout", 1.0)
    baseline = threading.active_count()
    metrics = KvtierMetrics()
    port = metrics.serve(0)
    held: list[socket.socket] = []
    try:
        for _ in range(3 * metrics_http.MAX_CONNECTIONS):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nX-a: ")  # never finished
            held.append(sock)
        time.sleep(0.3)
        assert threading.active_count() <= baseline + 1 + metrics_http.MAX_CONNECTIONS
        held[0].settimeout(5)
        assert held[0].recv(1) == b"", "a half-sent request is dropped after the timeout"
        deadline = time.monotonic() + 5
        while True:  # every held connection's time runs out: a scrape is served again
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert b"kvtier_lookup_seconds" in body
        more = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
        held += more
        for sock in more:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nX-a: ")
        time.sleep(0.2)
    finally:
        metrics.close()
    deadline = time.monotonic() + 5
    while threading.active_count() > baseline:  # close() ended the connections still open
        assert time.monotonic() < deadline, threading.enumerate()
        time.sleep(0.05)
    for sock in held:
        sock.close()


def test_a_request_trickled_a_byte_at_a_time_is_dropped_at_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (review, 2026-12-06): the timeout bounded each read only, so a client sending a
    header byte every few seconds was never dropped: 16 such connections kept every scrape out."""
    import time

    from kvtier import metrics_http

    monkeypatch.setattr(metrics_http._Handler, "timeout", 1.0)
    metrics = KvtierMetrics()
    port = metrics.serve(0)
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(b"GET /metrics HTTP/1.1\r\n")
        start, dropped = time.monotonic(), False
        while time.monotonic() - start < 4:  # a byte every 0.3 s: each read well within 1 s
            try:
                sock.sendall(b"X")
            except OSError:
                dropped = True
                break
            sock.settimeout(0.3)
            try:
                if sock.recv(1) == b"":
                    dropped = True
                    break
            except TimeoutError:
                continue
            except OSError:
                dropped = True
                break
        elapsed = time.monotonic() - start
        assert dropped and elapsed < 2.5, f"dropped={dropped} after {elapsed:.1f}s"
        sock.close()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert b"kvtier_lookup_seconds" in body  # a well-behaved scrape is served as before
    finally:
        metrics.close()


@pytest.mark.parametrize("addr", ["", "  ", None, 127])
def test_serving_on_no_address_is_refused(addr: object) -> None:
    """Regression (2026-12-06, review): ``serve(port, "")`` listened on every interface (the docs
    say 127.0.0.1 unless told otherwise), and ``None`` raised AttributeError."""
    metrics = KvtierMetrics()
    with pytest.raises(ConfigError, match="metrics address must be an address or host name"):
        metrics.serve(0, addr)  # type: ignore[arg-type]
    assert metrics.port is None
