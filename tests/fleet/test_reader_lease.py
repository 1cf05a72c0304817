"""A fleet reader answers only while a writer keeps the index (FleetReader, RedisMasks.writer_missing).

Review of 69984a5 (2026-12-05): the reader's cached outcome, a router's minimal ACL, and the log
of the 503s a writer's absence makes routine.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from kvtier.engine_events import ControlRecord, TierInfo
from kvtier.fleet import FleetIndex, FleetReader, RedisMasks
from kvtier.fleet import http as fleet_http
from kvtier.fleet.http import FleetServer
from kvtier.fleet.masks import MemoryMasks, StoreUnavailable
from kvtier.fleet.records import Kind, WireBatch, WireEvent


class _Gated(MemoryMasks):
    """An in-memory index whose writer can go away, and whose check of it can be held."""

    def __init__(self) -> None:
        super().__init__()
        self.gone = False
        self.checks = 0
        self.hold = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def writer_missing(self) -> str | None:
        self.checks += 1
        if self.hold:
            self.entered.set()
            assert self.release.wait(10)
        return "no fleet writer keeps the index (test)" if self.gone else None


def _filled(masks: MemoryMasks) -> FleetIndex:
    index = FleetIndex(["a"], masks)
    tiers = (TierInfo("0:primary", "cpu", "cpu", "engine"),)
    hello = ControlRecord("hello", "e", "s1", 0, time.time(), tiers, {"tokens_per_hash": 4})
    index.apply("a", WireBatch(time.time(), [WireEvent(Kind.CONTROL, control=hello),
                                             WireEvent(Kind.STORED, (1, 2), "CPU")], 0))  # fmt: skip
    return index


def test_every_caller_gets_the_failed_reads_outcome_until_the_next_read() -> None:
    """Before the fix, a failed check left the last good table's time in place: every call read
    Redis again (two round trips per request while failing), and callers arriving while one
    re-read answered from the frozen table (about 9 in 10 answers under 8 concurrent clients)."""
    masks = _Gated()
    _filled(masks)
    now = [0.0]
    reader = FleetReader(masks, meta_ttl=0.5, clock=lambda: now[0])
    assert reader.prefix([1, 2])["a"]["blocks"] == 2
    masks.gone, now[0] = True, 1.0
    with pytest.raises(StoreUnavailable, match="no fleet writer"):
        reader.meta()
    checks = masks.checks
    now[0] = 1.2  # within meta_ttl of the failed read: its outcome, no read
    with pytest.raises(StoreUnavailable, match="no fleet writer"):
        reader.prefix([1, 2])
    assert masks.checks == checks
    assert reader.store_failing() == "no fleet writer keeps the index (test)"
    # Past meta_ttl: one caller reads again (held here); one arriving meanwhile takes the last outcome.
    masks.hold, now[0] = True, 2.0
    refused: list[BaseException] = []

    def read() -> None:
        try:
            reader.meta()
        except StoreUnavailable as exc:
            refused.append(exc)

    first = threading.Thread(target=read)
    first.start()
    assert masks.entered.wait(10)
    with pytest.raises(StoreUnavailable, match="no fleet writer"):
        reader.prefix([1, 2])  # before the fix: the frozen table's answer
    masks.release.set()
    first.join(10)
    assert len(refused) == 1
    masks.hold = masks.gone = False
    now[0] = 3.0  # a writer keeps the index again: answers at the next read
    assert reader.prefix([1, 2])["a"]["blocks"] == 2 and reader.store_failing() is None


def test_a_router_allowed_only_getrange_reads_the_writers_lease(redis_server: Any) -> None:
    """Before the fix the lease was read with EXISTS: a router whose ACL allowed only GETRANGE
    on the prefix (all a reader needed before) was refused every request, as "did not answer"."""
    import redis

    admin = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    writer = _filled(RedisMasks(redis.Redis.from_url(redis_server.url, socket_timeout=5), "p"))
    try:
        admin.acl_setuser("router", enabled=True, passwords=["+pw"], commands=["+getrange"], keys=["p:*"],
                          reset=True)  # fmt: skip
        host, port = redis_server.url.removeprefix("redis://").split("/")[0].split(":")
        router = redis.Redis(host=host, port=int(port), username="router", password="pw", socket_timeout=5)
        assert FleetReader(RedisMasks(router, "p"), meta_ttl=0.0).prefix([1, 2])["a"]["blocks"] == 2
        admin.acl_setuser("router", enabled=True, passwords=["+pw"], commands=["+exists"], keys=["p:*"], reset=True)
        with pytest.raises(StoreUnavailable, match="the index's Redis refused the read") as refused:
            FleetReader(RedisMasks(router, "p"), meta_ttl=0.0).meta()
        assert "NoPermissionError" in str(refused.value)
    finally:
        writer.close()


def test_the_503s_of_a_missing_writer_are_logged_once_per_interval(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer away (a restart, a crash) makes every answer a 503: one line per request flooded
    the log (about 250 lines a second under 8 clients). Now the first at once, then one line per
    reason and interval saying how many more were answered."""
    monkeypatch.setattr(fleet_http, "_UNAVAILABLE_LOG_EVERY", 0.5)
    masks = _Gated()
    _filled(masks)
    masks.gone = True
    server = FleetServer(("127.0.0.1", 0), FleetReader(masks, meta_ttl=0.0), tokens_per_hash=4)
    serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    serving.start()

    def ask() -> int:
        request = urllib.request.Request(server.url + "/v1/prefix", data=json.dumps({"block_hashes": [1, 2]}).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.fleet.http"):
            assert [ask() for _ in range(20)] == [503] * 20
            time.sleep(0.6)
            assert ask() == 503
        lines = [r.getMessage() for r in caplog.records if "answered 503" in r.getMessage()]
        assert len(lines) == 2, lines  # before the fix: 21
        assert "no fleet writer keeps the index (test)" in lines[0] and "more such" not in lines[0]
        assert "(19 more such answers since the last line)" in lines[1], lines[1]
    finally:
        server.shutdown()
        server.server_close()
