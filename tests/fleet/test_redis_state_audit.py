"""The fleet index's state in a shared Redis, against what others may leave there: an engine table
of another layout or naming tiers answers cannot tell apart, keys of another type under the
index's names, and a writer that could not start. Real redis-server processes."""

from __future__ import annotations

import http.client
import json
import threading
import time
from typing import Any

import pytest

from kvtier.engine_events import ControlRecord, TierInfo
from kvtier.fleet import FleetIndex, FleetReader, RedisMasks
from kvtier.fleet.http import FleetServer
from kvtier.fleet.masks import StoreUnavailable
from kvtier.fleet.records import Kind, WireBatch, WireEvent

CPU = TierInfo("0:primary", "cpu", "cpu", "engine")


def _client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)


def _hello(start: str, device_keys: tuple[int, ...] = ()) -> WireBatch:
    record = ControlRecord("hello", "e", start, 0, time.time(), (CPU,), {"tokens_per_hash": 4})
    events = [WireEvent(Kind.CONTROL, control=ControlRecord.decode(record.encode()))]
    if device_keys:
        events.append(WireEvent(Kind.STORED, device_keys, "GPU", None))
    return WireBatch(time.time(), events, 0)


def _ask(server: FleetServer, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(str(host), port, timeout=30)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body))
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        conn.close()


def test_a_reader_refuses_an_engine_table_of_another_layout_with_503(redis_server: Any) -> None:
    client = _client(redis_server.url)
    writer = FleetIndex(["a"], RedisMasks(client, "p"))
    try:
        writer.apply("a", _hello("s", (1, 2)))
        reader = FleetReader(RedisMasks(client, "p"), meta_ttl=0.0)
        assert reader.prefix([1, 2])["a"]["blocks"] == 2
        table = json.loads(client.get("p:meta"))
        # Another kvtier's writer (a later layout: its bits need not mean the same) under the same prefix.
        client.set("p:meta", json.dumps(dict(table, version=2)))
        with pytest.raises(StoreUnavailable, match="version 2"):  # before the fix: read as ours, 2 blocks claimed
            reader.prefix([1, 2])
        assert "version 2" in (reader.store_failing() or "")
        served = FleetServer(("127.0.0.1", 0), reader, request_timeout=5.0, health=reader.store_failing)
        threading.Thread(target=served.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        try:
            status, body = _ask(served, "POST", "/v1/prefix", {"block_hashes": [1, 2]})
            assert status == 503 and "version 2" in body["error"]
            status, body = _ask(served, "GET", "/health")
            assert status == 503 and "version" in body["error"]
        finally:
            served.shutdown()
            served.server_close()
        client.set("p:meta", json.dumps({"owner": "app", "engines": table["engines"]}))  # no version at all
        with pytest.raises(StoreUnavailable, match="not one this kvtier reads"):
            reader.prefix([1, 2])
        client.set("p:meta", json.dumps(table))  # the writer's own again: answered
        assert reader.prefix([1, 2])["a"]["blocks"] == 2
    finally:
        writer.close()


@pytest.mark.parametrize("labels", [["GPU"], ["x", "x"]])
def test_a_reader_leaves_out_an_engine_whose_tiers_answers_cannot_tell_apart(redis_server: Any,
                                                                              labels: list[str]) -> None:  # fmt: skip
    client = _client(redis_server.url)
    writer = FleetIndex(["a"], RedisMasks(client, "p"))
    try:
        writer.apply("a", _hello("s"))
        table = json.loads(client.get("p:meta"))
        entry = table["engines"]["a"]
        # A tier of bit 40 held by key 1, named so that the answer would pass it for the device cache
        # (or for the other tier of its name): the engine's device cache holds nothing.
        table["engines"]["odd"] = dict(entry, device_bit=30, tiers=[{"label": label, "bit": 40 + i}
                                                                    for i, label in enumerate(labels)])  # fmt: skip
        client.set("p:meta", json.dumps(table))
        client.setbit("p:k:1", 40, 1)
        answer = FleetReader(RedisMasks(client, "p"), meta_ttl=0.0).prefix([1])
        assert set(answer) == {"a"}  # before the fix: "odd" answered {"GPU": 1}: a device cache block it never held
    finally:
        writer.close()


@pytest.mark.parametrize("foreign", ["list", "hash"])
def test_a_writer_that_cannot_start_gives_its_claim_back(redis_server: Any, foreign: str) -> None:
    client = _client(redis_server.url)
    if foreign == "list":
        client.rpush("p:meta", "someone else's")
    else:
        client.hset("p:meta", "owner", "someone else's")
    with pytest.raises(StoreUnavailable, match="WRONGTYPE"):  # not an index's table: nothing is deleted
        FleetIndex(["a"], RedisMasks(client, "p"))
    assert client.type("p:meta") == foreign.encode()
    # before the fix: the claim stayed for its 15 s lease, and a writer started again was told another held it
    assert not client.exists("p:writer")
    client.delete("p:meta")
    started = time.monotonic()
    FleetIndex(["a"], RedisMasks(client, "p")).close()  # (claim_wait 0: refused at once were the claim still held)
    assert time.monotonic() - started < 5


def test_a_writer_whose_engine_table_write_fails_at_start_gives_its_claim_back(redis_server: Any) -> None:
    client = _client(redis_server.url)
    masks = RedisMasks(client, "p")
    fails = {"left": 1}
    put = masks.put_meta

    def put_meta(meta: dict[str, Any]) -> None:
        if fails["left"]:
            fails["left"] -= 1
            raise ConnectionError("the link dropped")
        put(meta)

    masks.put_meta = put_meta  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        FleetIndex(["a"], masks)
    assert not client.exists("p:writer")  # before the fix: held for 15 s by a writer that never ran
    FleetIndex(["a"], RedisMasks(client, "p")).close()


def test_an_index_in_a_redis_that_evicts_its_keys_is_refused_until_it_no_longer_does(redis_server: Any) -> None:
    import os

    client = _client(redis_server.url)
    # The index shares a Redis with a cache (a KV tier's usual settings): keys without a TTL may go.
    client.config_set("maxmemory", str(4 << 20))
    client.config_set("maxmemory-policy", "allkeys-lru")
    writer = FleetIndex(["a"], RedisMasks(client, "p"))
    try:
        keys = tuple(range(1, 2001))
        writer.apply("a", _hello("s1", keys))
        time.sleep(1.1)  # (LRU clocks tick in seconds: the location's set, written once, is the oldest key)
        foreign = 0
        while client.exists("p:l:0") and foreign < 2000:  # the cache's values push the index's keys out
            pipe = client.pipeline(transaction=False)
            pipe.getrange("p:meta", 0, 0)  # (readers re-read the table every 0.5 s)
            for key in keys[:64]:  # routers keep asking for the first blocks: their bitmaps stay recent
                pipe.getrange(f"p:k:{key:x}", 0, 0)
            pipe.execute()
            writer.keep_writer()
            client.set(f"cache:{foreign}", os.urandom(20000))
            foreign += 1
        assert not client.exists("p:l:0")  # engine a's device-cache keys are no longer listed...
        writer.apply("a", _hello("s2"))  # ...so its restart (an empty device cache) cannot clear their bits
        reader = FleetReader(RedisMasks(client, "p"), meta_ttl=0.0)
        # before the fix: 200 with a's new start holding blocks (16 and 47 in two runs) it never stored
        with pytest.raises(StoreUnavailable, match="maxmemory-policy allkeys-lru"):
            reader.prefix(list(keys[:64]))
        assert "maxmemory-policy" in (writer.store_failing() or "")
        with pytest.raises(StoreUnavailable, match="maxmemory-policy"):
            writer.prefix(list(keys[:64]))
        # The operator gives the index a Redis that keeps its keys: what was left behind is deleted, and
        # the engines are partial until they report again.
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", "0")
        assert writer.keep_writer() is True
        assert writer.store_failing() is None
        answer = reader.prefix(list(keys[:64]))["a"]
        assert answer["blocks"] == 0 and answer["status"] == "partial"
        assert not [name for name in client.scan_iter("p:k:*")]
    finally:
        writer.close()


def test_a_writer_refuses_a_prefix_holding_another_kvtier_versions_index(redis_server: Any) -> None:
    from kvtier.fleet.masks import WriterConflict

    client = _client(redis_server.url)
    other = json.dumps({"version": 2, "engines": {"x": {"bits": [0]}}})  # a later layout: bit 0 is not our bit 0
    client.set("p:meta", other)
    client.set("p:k:5", b"\xff")
    with pytest.raises(WriterConflict, match="another kvtier version"):
        # before the fix: it wrote its own table over the other's and read key 5's bits as its own:
        # engine a's device cache "held" block 5
        FleetIndex(["a"], RedisMasks(client, "p"))
    assert client.get("p:meta") == other.encode() and client.get("p:k:5") == b"\xff"
    assert not client.exists("p:writer")  # (nothing of it left to wait out)


@pytest.mark.parametrize("planted", ["hash", "list set"])
def test_a_key_of_another_type_under_the_prefix_does_not_keep_removed_blocks_claimed(redis_server: Any,
                                                                                     planted: str) -> None:  # fmt: skip
    client = _client(redis_server.url)
    writer = FleetIndex(["a"], RedisMasks(client, "p"))
    try:
        fs = TierInfo("1:fs", "fs", "disk", "shared", "fs-root")
        record = ControlRecord("hello", "e", "s", 0, time.time(), (fs,), {"tokens_per_hash": 4})
        control = WireEvent(Kind.CONTROL, control=ControlRecord.decode(record.encode()))
        writer.apply("a", WireBatch(time.time(), [control, WireEvent(Kind.STORED, (1, 2, 3), "STORAGE", "1:fs")], 0))
        reader = FleetReader(RedisMasks(client, "p"), meta_ttl=0.0)
        assert reader.prefix([1, 3])["a"]["tiers"]["1:fs"] == 2
        bit = writer.engine("a").bits["1:fs"]
        if planted == "hash":
            client.hset("p:k:99", "someone", "else")  # a name of the index's shape, of another type
        else:
            client.delete(f"p:l:{bit}")
            client.rpush(f"p:l:{bit}", "x")  # the store's key set replaced by a list
        later = ControlRecord("events", "e", "s", 1, time.time() + 0.001, (), {})
        events = [WireEvent(Kind.CONTROL, control=ControlRecord.decode(later.encode())),
                  WireEvent(Kind.REMOVED, (1, 0x99, 3), "STORAGE", "1:fs")]  # fmt: skip
        writer.apply("a", WireBatch(time.time(), events, 0))  # before the fix: WRONGTYPE, nothing removed
        # the store no longer holds blocks 1 and 3: no engine is said to find them there
        assert reader.prefix([1, 3])["a"]["tiers"]["1:fs"] == 0
        assert client.type("p:k:99") == (b"hash" if planted == "hash" else b"none")
    finally:
        writer.close()


def test_an_engine_table_of_many_malformed_entries_logs_one_line_per_read(
    redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    client = _client(redis_server.url)
    writer = FleetIndex(["a"], RedisMasks(client, "p"))
    try:
        table = json.loads(client.get("p:meta"))
        table["engines"].update({f"x{i}": {"device_bit": -1} for i in range(5000)})
        client.set("p:meta", json.dumps(table))
        reader = FleetReader(RedisMasks(client, "p"), meta_ttl=0.0)
        with caplog.at_level("WARNING", logger="kvtier.fleet.index"):
            assert set(reader.prefix([1])) == {"a"}
        lines = [r for r in caplog.records if r.name == "kvtier.fleet.index"]
        assert len(lines) == 1, len(lines)  # before the fix: 5000 lines per read (every 0.5 s in a reader)
        assert "5000" in lines[0].getMessage() and "'x0'" in lines[0].getMessage()
    finally:
        writer.close()


@pytest.mark.parametrize("work", ["the deletion of a previous index", "the clear of a large location"])
def test_a_deletion_or_clear_longer_than_the_lease_keeps_the_claim(redis_server: Any, work: str) -> None:
    client = _client(redis_server.url)
    keys = range(1, 200_001)  # (seconds of deleting, whatever the host: several 1 s leases)
    for start in range(0, len(keys), 10_000):
        chunk = keys[start : start + 10_000]
        client.mset({f"p:k:{key:x}": b"\x80" for key in chunk})
        client.sadd("p:l:0", *[f"{key:x}" for key in chunk])
    if work == "the deletion of a previous index":
        client.set("p:meta", json.dumps({"version": 1, "engines": {}, "stores": {}}))
        # before the fix: ClaimLapsed ("Redis restarted, or did not answer"), the writer refused to start
        masks = RedisMasks(client, "p", writer_ttl=1)
        FleetIndex(["a"], masks).close()
    else:
        masks = RedisMasks(client, "p", writer_ttl=1)
        writer = FleetIndex(["a"], masks)  # (no table: nothing is deleted; engine a's device cache is bit 0)
        try:
            masks.clear(0)  # before the fix: ClaimLapsed midway, and the whole index rebuilt at the next tick
            assert masks.claim_failure() is None
        finally:
            writer.close()
    assert not client.keys("p:k:*") and not client.exists("p:l:0") and not client.exists("p:writer")
