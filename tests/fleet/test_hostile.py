"""The fleet against hostile or failing surroundings: control records with times or counters no
engine sends, an engine that names more tiers and stores than there are location bits (or
restarts in a loop), a shared Redis whose keys someone else wrote (a malformed engine table,
huge bitmaps, members that are not keys, a previous writer's leftovers, a second writer), a
Redis that dies under the subscriber, and HTTP clients that dribble bytes or send odd lengths."""

from __future__ import annotations

import contextlib
import http.server
import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine_events import CONTROL_PREFIX, ControlRecord, TierInfo
from kvtier.fleet import FleetIndex, FleetReader, MemoryMasks, RedisMasks
from kvtier.fleet.http import FleetServer
from kvtier.fleet.records import Kind, WireBatch, WireEvent

CPU = TierInfo("0:primary", "cpu", "cpu", "engine")


def _record(op: str, start: str, seq: int, tiers: tuple[TierInfo, ...] = (CPU,), **fields: Any) -> WireEvent:
    rec = ControlRecord(op, "e", start, seq, time.time(), tiers, {"tokens_per_hash": 4}, **fields)
    return WireEvent(Kind.CONTROL, control=ControlRecord.decode(rec.encode()))


def _batch(*events: WireEvent) -> WireBatch:
    return WireBatch(time.time(), list(events), 0)


def _stored(keys: list[int], medium: str | None = "CPU", ownership: str | None = None) -> WireEvent:
    return WireEvent(Kind.STORED, tuple(keys), medium, ownership)


# --- control records -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "names"),
    [
        ("time", "NaN", "finite"),
        ("time", "Infinity", "finite"),
        ("time", "-Infinity", "finite"),
        ("time", "1" + "0" * 400, "finite"),
        ("seq", str(1 << 63), "seq"),
        ("seq", "1" + "0" * 1000, "seq"),
    ],
)
def test_control_records_with_times_or_counters_no_engine_sends_are_refused(field: str, value: str, names: str) -> None:
    body = {"op": "hello", "engine": "e", "start": "s", "seq": 0, "time": 1.0}
    text = json.dumps(body).replace(f'"{field}": {json.dumps(body[field])}', f'"{field}": {value}')
    assert value in text
    with pytest.raises(ValueError, match=names):
        ControlRecord.decode(CONTROL_PREFIX + text)


# --- location bits -------------------------------------------------------------------------


def test_an_engine_restarting_in_a_loop_reuses_its_own_bits() -> None:
    tiers = (CPU, TierInfo("1:mem", "memory", "cpu", "engine"), TierInfo("2:mem", "memory", "cpu", "engine"))
    index = FleetIndex(["e", "f"], max_locations=8)
    for start in range(200):  # before the fix: 3 new bits per start, 30 s before any was reused
        index.apply("e", _batch(_record("hello", f"s{start}", 0, tiers), _stored([start])))
        assert index.held("e", "0:primary") == {start}
    assert index.engine("e").restarts == 199 and index.engine("e").skipped == 0
    index.apply("f", _batch(_record("hello", "t", 0), _stored([7])))
    assert index.held("f", "0:primary") == {7}


def test_more_tiers_and_stores_than_location_bits_are_refused_and_other_engines_go_on() -> None:
    index = FleetIndex(["e", "f"], max_locations=16)
    stores = tuple(TierInfo(f"{i}:fs", "fs", "disk", "shared", f"store-{i}") for i in range(1, 40))
    index.apply("e", _batch(_stored([1], medium="GPU"), _record("hello", "s", 0, (CPU, *stores)), _stored([2])))
    eng = index.engine("e")
    # (23 stores past the 16 per engine are counted one by one, then the batch past the bits once)
    assert eng.skipped == 24 and eng.status != "synced" and index.held("e", "0:primary") == set()
    assert index.meta()["stores"] == {}
    index.apply("f", _batch(_record("hello", "t", 0), _stored([3])))
    assert index.held("f", "0:primary") == {3} and index.engine("f").status == "synced"


# --- Redis written by others ---------------------------------------------------------------


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    from redis_servers import REDIS_SERVER, start_redis

    if REDIS_SERVER is None:
        pytest.skip("redis-server not found on PATH")
    server = start_redis(tmp_path / "redis")
    try:
        yield server.url
    finally:
        server.stop()


def _client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url, socket_timeout=5)


def test_a_reader_leaves_out_malformed_engine_entries(redis_url: str) -> None:
    client = _client(redis_url)
    writer = FleetIndex(["a"], RedisMasks(client, "p"))
    writer.apply("a", _batch(_record("hello", "s", 0), _stored([1, 2])))
    meta = json.loads(client.get("p:meta"))
    meta["engines"]["huge"] = dict(meta["engines"]["a"], device_bit=10**12)  # 1 << 10**12: 125 GB
    meta["engines"]["negative"] = dict(meta["engines"]["a"], device_bit=-1)
    meta["engines"]["tiers"] = dict(meta["engines"]["a"], tiers=[{"label": "x", "bit": "0"}])
    meta["engines"]["info"] = dict(meta["engines"]["a"], info=[1])
    meta["engines"]["nested-info"] = dict(meta["engines"]["a"], info={"tokens_per_hash": [4]})  # (500s, review D7)
    meta["engines"]["list"] = [1, 2]
    client.set("p:meta", json.dumps(meta))
    reader = FleetReader(RedisMasks(client, "p"), meta_ttl=0.0)
    answer = reader.prefix([1, 2, 3])
    assert set(answer) == {"a"} and answer["a"]["blocks"] == 2
    for garbage in (b"{not json", b"[1, 2]", b"[" * 100_000):
        client.set("p:meta", garbage)
        assert reader.prefix([1, 2]) == {}


def test_a_reader_reads_only_the_bytes_of_its_locations(redis_url: str) -> None:
    client = _client(redis_url)
    writer = FleetIndex(["a"], RedisMasks(client, "p"))
    writer.apply("a", _batch(_record("hello", "s", 0), _stored([1, 2])))
    client.setrange("p:k:1", 32 << 20, b"\x01")  # someone else grew the bitmap to 32 MiB
    reader = FleetReader(RedisMasks(client, "p"), meta_ttl=0.0)

    def sent() -> int:
        return int(client.info("stats")["total_net_output_bytes"])

    before = sent()
    answer = reader.prefix([1, 2, 3])
    assert answer["a"]["blocks"] == 2 and answer["a"]["tiers"]["0:primary"] == 2
    assert sent() - before < 64 << 10  # before the fix: the whole 32 MiB value, parsed bit by bit


def test_members_that_are_not_keys_are_skipped(redis_url: str) -> None:
    client = _client(redis_url)
    index = FleetIndex(["a"], RedisMasks(client, "p"))
    index.apply("a", _batch(_record("hello", "s", 0), _stored([1, 2])))
    bit = index.engine("a").bits["0:primary"]
    client.sadd(f"p:l:{bit}", "not-hex", "0x10", "-5", "f" * 40)
    assert index.held("a", "0:primary") == {1, 2}
    # a restart clears the old start's CPU tier through that set (before the fix: ValueError)
    index.apply("a", _batch(_record("hello", "s2", 0), _stored([3])))
    assert index.held("a", "0:primary") == {3} and index.engine("a").restarts == 1


def test_one_writer_per_prefix_and_a_new_writer_drops_the_old_ones_index(redis_url: str) -> None:
    from kvtier.fleet.masks import WriterConflict

    client = _client(redis_url)
    first = FleetIndex(["a", "b"], RedisMasks(client, "p", writer_ttl=1))
    first.apply("a", _batch(_record("hello", "s", 0), _stored([1, 2], medium="GPU"), _stored([1, 2])))
    client.set("p:notes", "someone else's")
    with pytest.raises(WriterConflict, match="another kvtier fleet writer"):
        FleetIndex(["b", "a"], RedisMasks(client, "p"))
    # The first writer dies without a word (kill -9): its claim runs out, the next one takes over.
    second = FleetIndex(["b", "a"], RedisMasks(client, "p", claim_wait=5.0))
    reader = FleetReader(RedisMasks(client, "p"), meta_ttl=0.0)
    # before the fix b's device bit was a's old one: b held blocks it never reported
    answer = reader.prefix([1, 2])
    assert answer["b"]["blocks"] == 0 and answer["a"]["blocks"] == 0
    assert client.get("p:notes") == b"someone else's"  # not an index's key: not deleted
    first._kept_writer = -1e9  # the first writer, were it alive, learns at its next tick that it lost the prefix
    with pytest.raises(WriterConflict, match="lost its claim"):
        first.tick()
    with pytest.raises(WriterConflict, match="no longer writes"):  # and it leaves the new writer's index alone
        first.apply("a", _batch(_stored([5], medium="GPU")))
    assert reader.prefix([5])["a"]["tiers"]["GPU"] == 0
    second.close()
    third = FleetIndex(["a"], RedisMasks(client, "p"))  # a closed writer's prefix is free at once
    third.close()


def test_a_writer_never_deletes_under_a_prefix_that_holds_no_index(redis_url: str) -> None:
    client = _client(redis_url)
    client.set("app:k:abc", "the app's")
    client.set("app:meta", json.dumps({"owner": "app"}))
    FleetIndex(["a"], RedisMasks(client, "app")).close()
    assert client.get("app:k:abc") == b"the app's"


def test_the_subscriber_outlives_a_redis_that_dies(tmp_path: Path) -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM's publisher is the reference")
    pytest.importorskip("zmq")
    import redis
    from redis_servers import REDIS_SERVER, RedisServer

    from kvtier.fleet.subscriber import EngineEndpoint, FleetSubscriber

    if REDIS_SERVER is None:
        pytest.skip("redis-server not found on PATH")
    server = RedisServer(tmp_path / "redis")
    server.start()
    client = redis.Redis.from_url(server.url, socket_timeout=1, socket_connect_timeout=1)
    index = FleetIndex(["e"], RedisMasks(client, "p"))
    publisher = kv_events.ZmqEventPublisher(0, endpoint=f"ipc://{tmp_path}/events",
                                            replay_endpoint=f"ipc://{tmp_path}/replay")  # fmt: skip
    subscriber = FleetSubscriber(index, [EngineEndpoint("e", f"ipc://{tmp_path}/events",
                                                        replay=f"ipc://{tmp_path}/replay")])  # fmt: skip

    def control(seq: int) -> Any:
        rec = ControlRecord("hello" if seq == 0 else "events", "e", "s", seq, time.time(), (CPU,), {})
        return kv_events.BlockRemoved(block_hashes=[1], medium="STORAGE", ownership=rec.encode())

    def stored(key: int) -> Any:
        return kv_events.BlockStored(block_hashes=[key], parent_block_hash=None, token_ids=[], block_size=0,
                                     lora_id=None, medium="CPU", lora_name=None)  # fmt: skip

    def wait(check: Any, what: str) -> None:
        deadline = time.monotonic() + 30
        while not check():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    try:
        subscriber.start()
        time.sleep(0.3)
        publisher.publish(kv_events.KVEventBatch(ts=time.time(), events=[control(0), stored(1)]))
        wait(lambda: index.held("e", "0:primary") == {1}, "the first batch")
        server.kill()
        publisher.publish(kv_events.KVEventBatch(ts=time.time(), events=[control(1), stored(2)]))
        wait(lambda: subscriber.stats()["e"]["failed"] >= 1, "the batch that found Redis gone")
        assert subscriber._thread is not None and subscriber._thread.is_alive()  # before the fix: it died
        server.start()  # an empty Redis on the same port
        publisher.publish(kv_events.KVEventBatch(ts=time.time(), events=[control(2), stored(3)]))
        wait(lambda: index.held("e", "0:primary") == {3}, "a batch after Redis came back")
        eng = index.engine("e")
        assert eng.gaps >= 1 and eng.status == "partial" and not eng.dirty
    finally:
        subscriber.stop()
        publisher.shutdown()
        server.stop()


# --- HTTP ----------------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[FleetServer]:
    served = FleetServer(("127.0.0.1", 0), FleetIndex(["a"], MemoryMasks()), tokens_per_hash=4, request_timeout=1.0)
    thread = threading.Thread(target=served.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield served
    finally:
        served.shutdown()
        served.server_close()


def _exchange(server: FleetServer, data: bytes) -> bytes:
    host, port = server.server_address[:2]
    with socket.create_connection((str(host), port), timeout=5) as sock:
        sock.sendall(data)
        return sock.recv(1000)


def test_a_client_that_dribbles_bytes_is_dropped_at_the_request_deadline(server: FleetServer) -> None:
    host, port = server.server_address[:2]
    request = b"POST /v1/prefix HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n\r\n" + b'{"block_hashes":[1]}'
    with socket.create_connection((str(host), port), timeout=5) as sock:
        started = time.monotonic()
        closed_at = None
        for byte in request:  # one byte every 0.2 s: each read well inside request_timeout
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed_at = time.monotonic()
                break
            sock.settimeout(0.2)
            try:
                if sock.recv(1000) == b"":
                    closed_at = time.monotonic()
                    break
            except TimeoutError:
                pass
        assert closed_at is not None, "the server kept a dribbling client for the whole request"
        assert closed_at - started < 3.0  # before the fix: ~16 s, the whole dribble, then an answer


@pytest.mark.parametrize(
    ("length", "status"),
    [("\u00b2", b" 411 "), ("1" * 30, b" 413 "), ("-1", b" 411 "), ("0x10", b" 411 ")],
)
def test_odd_content_lengths_are_client_errors(server: FleetServer, length: str, status: bytes) -> None:
    head = f"POST /v1/prefix HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode("latin-1")
    assert status in _exchange(server, head + b"{}")  # before the fix: "\u00b2" (isdigit) gave 500


class _EngineAPI(http.server.BaseHTTPRequestHandler):
    """An engine's OpenAI API, as much as a snapshot ask uses: GET answers ``models``, a POST
    (the ask) is noted in ``posts`` and answered."""

    models = b'{"data": [{"id": "m"}]}'
    posts: list[float] = []

    def do_GET(self) -> None:
        self._answer(self.models)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.posts.append(time.monotonic())
        self._answer(b'{"choices": []}')

    def _answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_snapshot_ask_survives_an_api_that_answers_nonsense() -> None:
    pytest.importorskip("zmq")

    from kvtier.fleet.subscriber import EngineEndpoint, FleetSubscriber, _Link

    class Nonsense(_EngineAPI):
        models = b"[1, 2]"  # /v1/models as a list, not an object

    api = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Nonsense)
    threading.Thread(target=api.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        index = FleetIndex(["e"])
        index.apply("e", _batch(_record("hello", "s", 3)))  # joined mid-start: wants a snapshot
        assert index.take_snapshot_wanted("e")
        endpoint = EngineEndpoint("e", "ipc:///nonexistent", api=f"http://127.0.0.1:{api.server_address[1]}")
        subscriber = FleetSubscriber(index, [endpoint], http_timeout=5)
        subscriber._ask_snapshot(_Link(endpoint, None))  # before the fix: TypeError, the ask thread died
        assert index.engine("e").needs_snapshot  # asked again later
    finally:
        api.shutdown()
        api.server_close()


def test_an_engine_naming_ever_new_stores_is_refused_past_its_share_of_location_bits() -> None:
    index = FleetIndex(["e", "f"], max_stores_per_engine=4)
    for start in range(50):  # before the fix: 2 new store bits per start, 100 in all, the engine table growing
        stores = tuple(TierInfo(f"{i}:redis", "redis", "cpu", "shared", f"store-{start}-{i}") for i in (1, 2))
        index.apply("e", _batch(_record("hello", f"s{start}", 0, (CPU, *stores)), _stored([1])))
    assert len(index.meta()["stores"]) == 4 and index._next_bit <= 2 + 1 + 4
    # past its stores, a start's new stores are not followed (2 tiers of 48 starts), the start itself is
    assert index.engine("e").status == "synced" and index.engine("e").skipped == 96
    assert index.engine("e").start == "s49" and index.held("e", "0:primary") == {1}
    shared = TierInfo("1:redis", "redis", "cpu", "shared", "store-0-1")
    index.apply("f", _batch(_record("hello", "t", 0, (CPU, shared)), _stored([7])))
    assert index.held("f", "0:primary") == {7} and index.engine("f").status == "synced"


@pytest.mark.parametrize("answer", ["drip", "deep-json"])
def test_a_snapshot_ask_is_bounded_as_a_whole_and_retried_whatever_the_api_answers(answer: str) -> None:
    pytest.importorskip("zmq")

    from kvtier.fleet.subscriber import EngineEndpoint, FleetSubscriber, _Link

    stop = threading.Event()

    class Hostile(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"[" * 100_000 if answer == "deep-json" else b"x" * 1000
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if answer == "deep-json":
                self.wfile.write(body)
                return
            for byte in body:  # one byte every 0.2 s: each read well inside the timeout
                if stop.wait(0.2):
                    return
                self.wfile.write(bytes([byte]))
                self.wfile.flush()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    api = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    api.daemon_threads = True
    threading.Thread(target=api.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        index = FleetIndex(["e"])
        index.apply("e", _batch(_record("hello", "s", 3)))  # joined mid-start: wants a snapshot
        assert index.take_snapshot_wanted("e")
        endpoint = EngineEndpoint("e", "ipc:///nonexistent", api=f"http://127.0.0.1:{api.server_address[1]}")
        subscriber = FleetSubscriber(index, [endpoint], http_timeout=1.0)
        ask = threading.Thread(target=subscriber._ask_snapshot, args=(_Link(endpoint, None),), daemon=True)
        started = time.monotonic()
        ask.start()
        ask.join(10)
        # before the fix: the drip went on for 200 s; the deep JSON killed the ask with a RecursionError
        assert not ask.is_alive() and time.monotonic() - started < 5
        assert index.engine("e").needs_snapshot  # asked again later
    finally:
        stop.set()
        api.shutdown()
        api.server_close()


def test_a_client_that_reads_its_answers_at_a_trickle_holds_no_slot_and_is_dropped() -> None:
    served = FleetServer(("127.0.0.1", 0), FleetIndex(["a"], MemoryMasks()), tokens_per_hash=4, request_timeout=1.0,
                         max_concurrent=1)  # fmt: skip
    threading.Thread(target=served.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    host, port = served.server_address[:2]
    attacker = socket.socket()
    attacker.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    attacker.connect((str(host), port))
    stop = threading.Event()
    closed_at: list[float] = []

    def pipeline() -> None:
        with contextlib.suppress(OSError):
            attacker.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 100_000)

    def trickle() -> None:  # ~20 KB/s: each answer's write completes, but only just
        while not stop.is_set():
            try:
                if attacker.recv(2048) == b"":
                    closed_at.append(time.monotonic())
                    return
            except OSError:
                closed_at.append(time.monotonic())
                return
            time.sleep(0.1)

    started = time.monotonic()
    threads = [threading.Thread(target=pipeline, daemon=True), threading.Thread(target=trickle, daemon=True)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.5)
        statuses = []
        for _ in range(5):
            with socket.create_connection((str(host), port), timeout=5) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                statuses.append(sock.recv(100).split(b" ")[1])
            time.sleep(0.1)
        assert statuses == [b"200"] * 5  # before the fix: mostly 503, the slot held while writing to the attacker
        threads[1].join(10)
        assert closed_at and closed_at[0] - started < 8  # before the fix: held for as long as it kept reading
    finally:
        stop.set()
        attacker.close()
        served.shutdown()
        served.server_close()


def test_snapshot_asks_repeat_while_wanted_and_back_off() -> None:
    """Review r9 (2026-12-03): an ask the engine refused was never repeated (the engine stayed
    partial for good); asked again while the index wants a snapshot, each wait twice the last."""
    pytest.importorskip("zmq")

    from kvtier.fleet.subscriber import EngineEndpoint, FleetSubscriber, _Link

    asks: list[float] = []

    class Refusing(_EngineAPI):  # an engine that answers every ask and sends no snapshot
        posts = asks

    api = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=api.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        index = FleetIndex(["e"])
        index.apply("e", _batch(_record("hello", "s", 3)))  # joined mid-start: wants a snapshot
        endpoint = EngineEndpoint("e", "ipc:///nonexistent", api=f"http://127.0.0.1:{api.server_address[1]}")
        subscriber = FleetSubscriber(index, [endpoint], snapshot_retry=0.05, http_timeout=5)
        link = _Link(endpoint, None)
        asked: list[float] = []
        end = time.monotonic() + 1.6
        while time.monotonic() < end:
            subscriber._maybe_ask_snapshot(link)
            if link.last_snapshot_ask not in asked:
                asked.append(link.last_snapshot_ask)
            time.sleep(0.005)
        for thread in subscriber._asks:
            thread.join(5)
        # at least 0.05, 0.1, 0.2, 0.4, 0.8 s apart: at most 6 asks in 1.6 s (every 0.05 s: 32)
        assert 3 <= len(asked) <= 6, asked
        waits = [b - a for a, b in itertools.pairwise(asked)]
        assert all(wait >= 0.05 * 2**i for i, wait in enumerate(waits)), waits
        assert len(asks) == len(asked) == link.asks and index.take_snapshot_wanted("e")
    finally:
        api.shutdown()
        api.server_close()
