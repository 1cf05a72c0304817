"""The writer of a shared (Redis) index: its writes are fenced by its claim, answers never wait
on its writes, and a batch refused partway still applies its removals from shared stores.
Real redis-server processes, real threads and sockets."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine_events import ControlRecord, TierInfo
from kvtier.fleet import FleetIndex, FleetReader, MemoryMasks, RedisMasks
from kvtier.fleet.http import FleetServer
from kvtier.fleet.masks import StoreUnavailable, WriterConflict
from kvtier.fleet.records import Kind, WireBatch, WireEvent

CPU = TierInfo("0:primary", "cpu", "cpu", "engine")
FS = TierInfo("1:fs", "fs", "disk", "shared", "fs-root")


def _record(op: str, start: str, seq: int, tiers: tuple[TierInfo, ...] = (CPU,), **fields: Any) -> WireEvent:
    rec = ControlRecord(op, "e", start, seq, time.time(), tiers, {"tokens_per_hash": 4}, **fields)
    return WireEvent(Kind.CONTROL, control=ControlRecord.decode(rec.encode()))


def _batch(*events: WireEvent) -> WireBatch:
    return WireBatch(time.time(), list(events), 0)


def _event(kind: Kind, keys: list[int], medium: str | None = "CPU", ownership: str | None = None) -> WireEvent:
    return WireEvent(kind, tuple(keys), medium, ownership)


def _client(url: str, timeout: float = 5.0) -> Any:
    import redis

    return redis.Redis.from_url(url, socket_timeout=timeout)


def _serve(answers: Any) -> FleetServer:
    server = FleetServer(("127.0.0.1", 0), answers, tokens_per_hash=4, request_timeout=5.0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


def _ask(server: FleetServer, method: str, path: str, body: Any = None) -> tuple[int, Any, float]:
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(str(host), port, timeout=30)
    started = time.monotonic()
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"})  # fmt: skip
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read()), time.monotonic() - started
    finally:
        conn.close()


def test_a_displaced_writer_cannot_write_into_the_new_writers_index_and_answers_503(redis_server: Any) -> None:
    url = redis_server.url
    a = FleetIndex(["a"], RedisMasks(_client(url), "p", writer_ttl=1))
    a.apply("a", _batch(_record("hello", "sa", 0), _event(Kind.STORED, [101], medium="GPU")))
    time.sleep(2.2)  # a is paused (GC, SIGSTOP, a VM freeze) past its claim's time to live
    b = FleetIndex(["b"], RedisMasks(_client(url), "p", writer_ttl=1))  # takes the prefix over
    b.apply("b", _batch(_record("hello", "sb", 0)))
    assert a.engine("a").device_bit == b.engine("b").device_bit == 0
    # a resumes with batches queued, before its next keep_writer: the write is refused in Redis itself
    with pytest.raises(WriterConflict):
        a.apply("a", _batch(_record("events", "sa", 1, tiers=()), _event(Kind.STORED, [202], medium="GPU")))
    reader = FleetReader(RedisMasks(_client(url), "p"), meta_ttl=0.0)
    # before the fix: {'a': {'blocks': 1, ..., 'status': 'synced'}}: a's key in b's index, a's table
    assert set(reader.prefix([202])) == {"b"} and reader.prefix([202])["b"]["blocks"] == 0
    assert b.held("b", "GPU") == set()
    assert a.writer_lost is not None
    with pytest.raises(WriterConflict):  # and every later write is refused before it reaches Redis
        a.lost_events("a", "test")
    b.apply("b", _batch(_record("events", "sb", 1, tiers=()), _event(Kind.STORED, [303], medium="GPU")))
    with pytest.raises(StoreUnavailable, match="no longer answers"):
        a.prefix([303])
    server = _serve(a)
    try:
        status, body, _ = _ask(server, "POST", "/v1/prefix", {"block_hashes": [303]})
        assert status == 503 and "another writer" in body["error"]  # before the fix: 200, a holds 303, synced
    finally:
        server.shutdown()
        server.server_close()
    assert reader.prefix([303])["b"]["blocks"] == 1


def test_a_claim_that_ran_out_with_nobody_holding_it_refuses_writes_until_taken_again(redis_server: Any) -> None:
    client = _client(redis_server.url)
    index = FleetIndex(["a"], RedisMasks(client, "p", writer_ttl=1))
    index.apply("a", _batch(_record("hello", "s", 0), _event(Kind.STORED, [1], medium="GPU")))
    client.delete("p:writer")  # (a Redis restarted empty: the claim is gone, nobody else holds it)
    with pytest.raises(Exception, match="ran out"):
        index.apply("a", _batch(_record("events", "s", 1, tiers=()), _event(Kind.STORED, [2], medium="GPU")))
    assert index.writer_lost is None
    index._kept_writer = -1e9
    index.tick()  # taken again: every engine is partial until a snapshot or a clear
    assert index.engine("a").status == "partial" and index.writer_lost is None
    index.apply("a", _batch(_record("events", "s", 2, tiers=()), _event(Kind.STORED, [3], medium="GPU")))
    assert index.held("a", "GPU") == {3}


def test_answers_never_wait_for_the_writers_redis_writes(redis_server: Any) -> None:
    index = FleetIndex(["a"], RedisMasks(_client(redis_server.url, timeout=2.0), "p"))
    index.apply("a", _batch(_record("hello", "s", 0), _event(Kind.STORED, [1], medium="GPU")))
    server = _serve(index)
    stop = threading.Event()

    def subscriber() -> None:  # as FleetSubscriber does: a batch, and on a failure its lost events, again
        seq = 1
        while not stop.is_set():
            try:
                index.apply("a", _batch(_record("events", "s", seq, tiers=()), _event(Kind.STORED, [seq + 10],
                                                                                    medium="GPU")))  # fmt: skip
            except Exception:
                with contextlib.suppress(Exception):
                    index.lost_events("a", "the store failed")
            seq += 1

    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # Redis hangs (not down: every call waits for its timeout)
    thread = threading.Thread(target=subscriber, daemon=True)
    thread.start()
    try:
        time.sleep(0.3)  # the writer is inside a Redis write, holding its lock
        results: dict[str, tuple[int, Any, float]] = {}
        asks = [threading.Thread(target=lambda p=path, m=method, b=body: results.__setitem__(p, _ask(server, m, p, b)))
                for method, path, body in (("GET", "/v1/engines", None),
                                           ("POST", "/v1/prefix", {"block_hashes": [1]}))]  # fmt: skip
        for ask in asks:
            ask.start()
        for ask in asks:
            ask.join(30)
        status, _, took = results["/v1/engines"]
        assert status == 200 and took < 1.0  # before the fix: it waited for the writer's lock (2 s and more)
        status, body, took = results["/v1/prefix"]
        assert status == 503 and "did not answer" in body["error"] and took < 3.5  # its own read's 2 s timeout
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
        stop.set()
        thread.join(10)
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("full", ["max_keys", "locations"])
def test_a_batch_refused_partway_still_applies_its_removals_from_shared_stores(full: str) -> None:
    masks = MemoryMasks(max_keys=3)
    index = FleetIndex(["a", "b"], masks, max_locations=8 if full == "max_keys" else 5)
    index.apply("b", _batch(_record("hello", "sb", 0, (CPU, FS)), _event(Kind.STORED, [1], "STORAGE", "1:fs")))
    index.apply("a", _batch(_record("hello", "sa", 0, (CPU, FS))))
    assert index.prefix([1])["b"]["blocks"] == 1
    if full == "max_keys":  # the shared store evicts 1 to make room for new keys: the index is full
        refused = _batch(_record("events", "sa", 1, tiers=()), _event(Kind.STORED, [7, 8, 9], "STORAGE", "1:fs"),
                         _event(Kind.REMOVED, [1], "STORAGE", "1:fs"))  # fmt: skip
    else:  # a control record names more tiers than there are bits left
        more = tuple(TierInfo(f"{i}:mem", "memory", "cpu", "engine") for i in range(2, 6))
        refused = _batch(_record("events", "sa", 1, (CPU, FS, *more)), _event(Kind.REMOVED, [1], "STORAGE", "1:fs"))
    index.apply("a", refused)
    assert index.engine("a").skipped == 1 and index.engine("a").status == "partial"
    # before the fix: b -> 1 block, synced: the store lost 1 but the index still said b's store held it
    assert index.prefix([1])["b"]["blocks"] == 0 and index.held("b", "1:fs") == set()


REDIS_TIER = TierInfo("1:redis", "redis", "cpu", "shared", "redis-store")


def test_a_claim_taken_again_over_another_writers_index_does_not_adopt_its_bits(redis_server: Any) -> None:
    url = redis_server.url
    a = FleetIndex(["a"], RedisMasks(_client(url), "p", writer_ttl=1))
    a.apply("a", _batch(_record("hello", "sa", 0, (CPU, REDIS_TIER))))
    assert a.engine("a").bits["1:redis"] == 2
    time.sleep(2.2)  # a is paused past its claim; b takes the prefix over
    b = FleetIndex(["b", "c", "d"], RedisMasks(_client(url), "p", writer_ttl=1))
    b.apply("d", _batch(_record("hello", "sd", 0), _event(Kind.STORED, [55], medium="GPU")))
    assert b.engine("d").device_bit == 2
    time.sleep(2.2)  # b dies (kill -9, no release): its claim runs out too
    a._kept_writer = -1e9
    a.tick()  # a resumes and takes the claim again
    assert a.writer_lost is None and a.engine("a").status == "partial"
    # before the fix: b's key at bit 2 read as a's shared store: {'1:redis': 1}, synced after a snapshot
    assert a.prefix([55])["a"]["tiers"]["1:redis"] == 0
    reader = FleetReader(RedisMasks(_client(url), "p"), meta_ttl=0.0)
    assert set(reader.prefix([55])) == {"a"} and reader.prefix([55])["a"]["blocks"] == 0



def test_a_claim_taken_again_is_rebuilt_even_if_the_next_call_to_redis_fails(
    redis_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = redis_server.url
    masks = RedisMasks(_client(url), "p", writer_ttl=1)
    a = FleetIndex(["a"], masks)
    a.apply("a", _batch(_record("hello", "sa", 0, (CPU, REDIS_TIER))))
    time.sleep(2.2)  # a is paused past its claim; b takes the prefix over, writes, dies
    b = FleetIndex(["b", "c", "d"], RedisMasks(_client(url), "p", writer_ttl=1))
    b.apply("d", _batch(_record("hello", "sd", 0), _event(Kind.STORED, [55], medium="GPU")))
    time.sleep(2.2)
    real_run_id = masks._run_id
    calls = []

    def run_id_fails_once() -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("the link dropped right after the claim was taken again")
        return real_run_id()

    monkeypatch.setattr(masks, "_run_id", run_id_fails_once)
    a._kept_writer = -1e9
    with pytest.raises(ConnectionError):
        a.tick()  # a takes the claim again; the INFO that follows fails
    assert a.store_failing() is not None  # /health 503 while the rebuild is due (review 3 #1)
    a._kept_writer = -1e9
    a.tick()  # before the fix: the claim was held, Redis the same: b's index was never deleted
    assert calls and a.engine("a").status == "partial"
    assert a.prefix([55])["a"]["tiers"]["1:redis"] == 0  # b's key at bit 2 not read as a's store

def test_a_redis_restarted_from_an_older_save_is_noticed_and_its_index_rebuilt(redis_server: Any) -> None:
    client = _client(redis_server.url)
    index = FleetIndex(["a"], RedisMasks(client, "p", writer_ttl=15))
    index.apply("a", _batch(_record("hello", "s", 0, (CPU, REDIS_TIER)), _event(Kind.STORED, [1], medium="GPU"),
                            _event(Kind.STORED, [2], "CPU", "1:redis")))  # fmt: skip
    client.save()
    index.apply("a", _batch(_record("events", "s", 1, tiers=()), _event(Kind.REMOVED, [1], medium="GPU"),
                            _event(Kind.REMOVED, [2], "CPU", "1:redis")))  # fmt: skip
    redis_server.kill()  # (SIGKILL) and started again on the same directory: it loads the save, claim and all
    redis_server.start()
    deadline = time.monotonic() + 10
    while True:
        index._kept_writer = -1e9
        try:
            index.tick()
            break
        except Exception:  # (the client's first call after the restart may find its old connection gone)
            assert time.monotonic() < deadline
            time.sleep(0.1)
    reader = FleetReader(RedisMasks(_client(redis_server.url), "p"), meta_ttl=0.0)
    # before the fix: both keys back, 'synced': the claim came back with the save, so nothing was noticed
    for key in (1, 2):
        assert reader.prefix([key])["a"]["blocks"] == 0
    assert reader.prefix([1])["a"]["status"] == "partial"


def test_an_engine_whose_replays_hang_does_not_hold_back_other_engines_events(tmp_path: Path) -> None:
    from wire_publisher import Publisher, batch, control, removed, stored

    from kvtier.fleet.subscriber import EngineEndpoint, FleetSubscriber

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pa, pb = Publisher(tmp_path / "a"), Publisher(tmp_path / "b")
    index = FleetIndex()
    subscriber = FleetSubscriber(index, [EngineEndpoint("a", pa.events, replay=f"ipc://{tmp_path}/a/nobody"),
                                         EngineEndpoint("b", pb.events, replay=pb.replay)], replay_timeout=1.0)
    subscriber.start()
    stop = threading.Event()
    try:
        pa.wait_subscribed()
        pb.wait_subscribed()
        pa.send(batch(control("hello", 0, start="sa")))
        pb.send(batch(control("hello", 0, start="sb"), stored([7], medium="GPU")))
        deadline = time.monotonic() + 10
        while index.prefix([7]).get("b", {}).get("blocks") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)

        def gaps() -> None:  # engine a skips a batch number 5 times a second; its replay endpoint never answers
            seq = 1
            while not stop.is_set():
                seq += 2
                pa.send(batch(control("events", seq, start="sa", tiers=())), seq=seq)
                time.sleep(0.2)

        threading.Thread(target=gaps, daemon=True).start()
        time.sleep(0.5)
        pb.send(batch(control("events", 1, start="sb", tiers=()), removed([7], medium="GPU")))
        sent = time.monotonic()
        while index.prefix([7])["b"]["blocks"] and time.monotonic() - sent < 15:
            time.sleep(0.05)
        # before the fix: b's removal waited behind a's replays (1 s each, 5 a second): 15 s and more
        assert index.prefix([7])["b"]["blocks"] == 0 and time.monotonic() - sent < 5
        assert index.engine("a").gaps >= 1
    finally:
        stop.set()
        subscriber.stop()
        pa.close()
        pb.close()


def test_max_keys_bounds_a_key_in_every_location_not_only_keys() -> None:
    masks = MemoryMasks(max_keys=1000)
    tiers = (CPU, *(TierInfo(f"{i}:mem", "memory", "cpu", "engine") for i in range(1, 10)))
    index = FleetIndex(["a"], masks)
    index.apply("a", _batch(_record("hello", "s", 0, tiers)))
    for tier in tiers:  # the same 200 keys in each of 10 private tiers: 2000 entries
        index.apply("a", _batch(_record("events", "s", index.engine("a").seq + 1, tiers=()),
                                _event(Kind.STORED, list(range(200)), "CPU", tier.label)))  # fmt: skip
    entries = sum(len(index.held("a", t.label)) for t in tiers)
    assert entries <= 1000  # before the fix: 2000 (only the 200 keys were counted)
    assert index.engine("a").status == "partial" and index.engine("a").skipped >= 1
    index.lost_events("a", "test")  # entries dropped are counted out again: room for new ones
    index.apply("a", _batch(_record("hello", "s2", 0, tiers), _event(Kind.STORED, list(range(900)), "CPU", "1:mem")))
    assert len(index.held("a", "1:mem")) == 900


def test_change_times_are_bounded_over_all_shared_stores() -> None:
    stores = tuple(TierInfo(f"{i}:fs", "fs", "disk", "shared", f"store-{i}") for i in range(1, 5))
    index = FleetIndex(["a", "b"], MemoryMasks(max_keys=1000), max_times=1000)
    index.apply("b", _batch(_record("hello", "sb", 0, (CPU, stores[0])), _event(Kind.STORED, [5], "STORAGE", "1:fs")))
    index.apply("a", _batch(_record("hello", "sa", 0, (CPU, *stores))))
    for n, store in enumerate(stores):  # removals of keys nobody holds: only change times are kept
        keys = list(range(10_000 + n * 1000, 11_000 + n * 1000))
        index.apply("a", _batch(_record("events", "sa", n + 1, tiers=()),
                                _event(Kind.REMOVED, keys, "STORAGE", store.label)))  # fmt: skip
    assert sum(len(t) for t in index._times.values()) <= 1000  # before the fix: 4000 (1000 per store)
    assert index.prefix([5])["b"]["blocks"] == 1  # other engines' keys are untouched


def test_an_engine_past_its_shared_stores_still_follows_its_starts_and_device_cache() -> None:
    index = FleetIndex(["a"])
    for i in range(18):  # a legitimate engine whose store id changes with each start (a new model or namespace)
        fs = TierInfo("1:fs", "fs", "disk", "shared", f"fs:/mnt/kv/ns{i:02d}")
        index.apply("a", _batch(_record("hello", f"s{i}", 0, (CPU, fs)), _event(Kind.STORED, [i], medium="GPU")))
    eng = index.engine("a")
    # before the fix: partial for good, start s15, its device cache never counted again
    assert eng.start == "s17" and eng.status == "synced" and index.held("a", "GPU") == {17}
    assert "1:fs" not in eng.tiers and eng.skipped == 2  # the 17th and 18th stores are not followed
    index.apply("a", _batch(_record("events", "s17", 1, (CPU, TierInfo("1:fs", "fs", "disk", "shared",
                                                                         "fs:/mnt/kv/ns17"))),
                            _event(Kind.STORED, [99], "STORAGE", "1:fs")))  # fmt: skip
    assert eng.skipped == 2 and eng.unattributed == 1 and index.prefix([99])["a"]["blocks"] == 0


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _counters_due(client: Any, clock: _Clock) -> FleetIndex:
    """An index with a batch of counters alone applied: its engine table's write is due at the next tick."""
    index = FleetIndex(["a"], RedisMasks(client, "p"), clock=clock)
    index.apply("a", _batch(_record("hello", "s", 0), _event(Kind.STORED, [1], medium="GPU")))
    index.apply("a", _batch(_record("events", "s", 1, tiers=()), _event(Kind.STORED, [2], medium="GPU")))
    assert index._publish_due
    return index


@pytest.mark.parametrize("later", [0.6, 2.5])  # the table's write due alone, or with the claim's refresh
def test_a_tick_takes_a_lapsed_claim_again_even_with_the_engine_table_due(redis_server: Any, later: float) -> None:
    """Review fleet3 #1: tick wrote the due table before keeping the claim; after Redis restarted
    empty the write was refused (ClaimLapsed) at every tick, so the claim was never taken again
    until an engine sent a batch: nothing rebuilt, the writer 'synced', /health 200."""
    client = _client(redis_server.url, timeout=1.0)
    clock = _Clock()
    index = _counters_due(client, clock)
    redis_server.kill()
    redis_server.start()  # empty, on the same port: the claim, the table and the keys are gone
    clock.now += later
    failures = 0
    while True:
        try:
            index.tick()
            break
        except Exception:  # (the client's first call after the restart may find its old connection gone)
            failures += 1
            assert failures < 3  # before the fix: ClaimLapsed at every tick, for good
    assert client.get("p:writer") is not None and index.writer_lost is None
    assert index.engine("a").status == "partial" and index.store_failing() is None
    reader = FleetReader(RedisMasks(_client(redis_server.url), "p"), meta_ttl=0.0)
    assert reader.prefix([1, 2]) == {"a": {"blocks": 0, "tiers": {"GPU": 0, "0:primary": 0}, "status": "partial",
                                           "start": "s"}}  # fmt: skip


def test_a_writer_that_lost_its_claim_is_unhealthy_until_it_takes_it_again(redis_server: Any) -> None:
    """Review fleet3 #1: a write refused because the claim ran out counted as gone through, so
    /health stayed 200 while the writer held no claim (what is under the prefix may be an older save)."""
    client = _client(redis_server.url)
    index = FleetIndex(["a"], RedisMasks(client, "p"))
    index.apply("a", _batch(_record("hello", "s", 0), _event(Kind.STORED, [1], medium="GPU")))
    assert index.store_failing() is None
    client.delete("p:writer")  # (a Redis restarted empty: the claim is gone, nobody else holds it)
    with pytest.raises(Exception, match="ran out"):
        index.apply("a", _batch(_record("events", "s", 1, tiers=()), _event(Kind.STORED, [2], medium="GPU")))
    failing = index.store_failing()  # at once, not after failing_writes_grace: before the fix, None
    assert failing is not None and "does not hold its claim" in failing
    assert index.keep_writer() and index.store_failing() is None


def test_another_writer_found_by_a_ticks_table_write_makes_the_writer_answer_503(redis_server: Any) -> None:
    """Review fleet3 #2: tick's write of the due engine table was refused by the other writer's
    claim (WriterConflict) but writer_lost was not set: the superseded writer kept answering 200
    from the other writer's bitmaps with its own bit layout (blocks of the wrong engine)."""
    url = redis_server.url
    clock = _Clock()
    a = _counters_due(_client(url), clock)
    _client(url).delete("p:writer")  # a paused past its claim (GC, a VM freeze); b takes the prefix over
    b = FleetIndex(["x", "a"], RedisMasks(_client(url), "p"))
    b.apply("x", _batch(_record("hello", "x1", 0), _event(Kind.STORED, [100], medium="GPU")))
    clock.now += 0.6  # a resumes: the table's write is due, the claim's refresh not yet
    with pytest.raises(WriterConflict):
        a.tick()
    assert a.writer_lost is not None  # before the fix: None, and a answered {'a': {'blocks': 1, ...}} for 100
    with pytest.raises(StoreUnavailable, match="no longer answers"):
        a.prefix([100])


def test_a_hung_redis_counts_as_failing_from_when_the_write_was_sent(redis_server: Any) -> None:
    """Review fleet3 #3: a failure was dated from when the first failed call returned (after the
    client's socket timeout), so with the CLI's 5 s timeout /health turned 503 ~10 s after Redis
    hung, not the documented 5 s."""
    import redis

    client = _client(redis_server.url, timeout=1.0)
    clock = _Clock()
    index = FleetIndex(["a"], RedisMasks(client, "p"), clock=clock)
    redis_server.pause()
    try:
        clock.now += 2.5
        sent = time.monotonic()
        with pytest.raises(redis.RedisError):
            index.tick()  # the claim's refresh times out after 1 s
    finally:
        redis_server.resume()
    failure = index.masks.write_failure()
    assert failure is not None and failure[0] - sent < 0.5  # before the fix: about 1 s (the timeout) after
    index.close()


def test_a_batch_that_finds_the_claim_run_out_is_applied_once_it_is_taken_again(redis_server: Any) -> None:
    """A batch refused because the claim ran out (Redis restarted empty since the last tick) is
    not lost: the subscriber's path (FleetIndex.retaking) takes the claim again, rebuilds, and
    applies the batch on the rebuilt index."""
    client = _client(redis_server.url)
    index = FleetIndex(["a"], RedisMasks(client, "p"))
    index.apply("a", _batch(_record("hello", "s", 0), _event(Kind.STORED, [1], medium="GPU")))
    client.delete("p:writer")  # (nobody holds the claim any more)
    batch = _batch(_record("events", "s", 1, tiers=()), _event(Kind.STORED, [2], medium="GPU"))
    with pytest.raises(Exception, match="ran out"):
        index.apply("a", batch)  # (apply alone does not take the claim again)
    index.retaking(lambda: index.apply("a", batch))
    assert client.get("p:writer") is not None and index.store_failing() is None
    reader = FleetReader(RedisMasks(_client(redis_server.url), "p"), meta_ttl=0.0)
    answer = reader.prefix([2])["a"]
    assert answer["blocks"] == 1 and answer["status"] == "partial"  # key 1 was dropped with the rebuild
    assert reader.prefix([1])["a"]["blocks"] == 0


def test_a_writer_waiting_for_anothers_claim_says_so_at_once_then_refuses(
    redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression (audit, 2026-12-05): a second writer waited out ``claim_wait`` without a word
    (``kvtier fleet serve``: 16 s with no output and no listener), then refused. One warning now
    says at once that it waits, for how long, and when the other claim ends; the refusal follows."""
    holder = FleetIndex(["a"], RedisMasks(_client(redis_server.url), "p"))
    try:
        started = time.time()
        with caplog.at_level("WARNING", logger="kvtier.fleet.masks"), pytest.raises(WriterConflict) as refused:
            FleetIndex(["b"], RedisMasks(_client(redis_server.url), "p", claim_wait=1.0))
        waits = [r for r in caplog.records if "waiting up to 1 s for its claim to end" in r.getMessage()]
        assert len(waits) == 1, caplog.text  # before the fix: none
        assert "holds the Redis prefix 'p' (its claim ends within 1" in waits[0].getMessage()  # (a 15 s lease)
        assert waits[0].created - started < 0.5  # at once, not when the wait is over
        assert "its claim ends within" in str(refused.value) and "--redis-prefix" in str(refused.value)
        assert time.time() - started >= 1.0
    finally:
        holder.close()
