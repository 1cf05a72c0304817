"""The subscriber against hostile engines and a failing Redis, over real sockets: a publisher
stand-in (``wire_publisher``) on ipc endpoints sends what vLLM never would, a real redis-server is
paused or restarted under the writer, and the subscriber thread must carry on and count."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

pytest.importorskip("zmq")

from wire_publisher import Publisher, batch, control, stored, wait_for

from kvtier.fleet import FleetIndex, RedisMasks
from kvtier.fleet.subscriber import EngineEndpoint, FleetSubscriber
from kvtier.fleet.wire import WireError, decode_batch

# A batch whose events list holds one value nested 100,000 deep: ~100 KB (1000 deep is enough).
DEEP = b"\x93" + msgspec.msgpack.encode(1.0) + b"\x91" + b"\x91" * 100_000 + b"\xc0" + b"\xc0"


@pytest.fixture
def publisher(tmp_path: Path) -> Iterator[Publisher]:
    pub = Publisher(tmp_path)
    try:
        yield pub
    finally:
        pub.close()


def _subscribe(index: FleetIndex, pub: Publisher, **options: Any) -> FleetSubscriber:
    subscriber = FleetSubscriber(index, [EngineEndpoint("e", pub.events, replay=pub.replay)], **options)
    subscriber.start()
    pub.wait_subscribed()
    return subscriber


def test_deeply_nested_msgpack_is_refused_as_a_malformed_batch() -> None:
    with pytest.raises(WireError, match="nested too deep"):  # before the fix: RecursionError
        decode_batch(DEEP)


def test_a_deeply_nested_message_is_dropped_and_the_subscriber_carries_on(publisher: Publisher) -> None:
    index = FleetIndex(["e"])
    subscriber = _subscribe(index, publisher)
    try:
        publisher.send(batch(control("hello", 0), stored([1])))
        wait_for(lambda: index.held("e", "0:primary") == {1}, "the first batch")
        publisher.send(DEEP)
        publisher.send(batch(control("events", 1, tiers=()), stored([2])))
        # before the fix the subscriber thread died on the deep message: the second batch never came
        wait_for(lambda: index.held("e", "0:primary") == {1, 2}, "the batch after the deep one")
        assert subscriber.stats()["e"]["dropped"] == 1 and subscriber.failure is None
        assert index.engine("e").status == "synced"
    finally:
        subscriber.stop()


@pytest.mark.parametrize("jump", ["gap", "restart"])
def test_a_redis_that_does_not_answer_during_a_gap_or_a_restart_does_not_stop_the_subscriber(
    publisher: Publisher, redis_server: Any, jump: str
) -> None:
    import redis

    client = redis.Redis.from_url(redis_server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    index = FleetIndex(["e"], RedisMasks(client, "p"))
    subscriber = _subscribe(index, publisher)
    try:
        publisher.send(batch(control("hello", 0), stored([1])))
        wait_for(lambda: index.held("e", "0:primary") == {1}, "the first batch")
        publisher.send(batch(control("events", 1, tiers=()), stored([2])))
        wait_for(lambda: index.held("e", "0:primary") == {1, 2}, "the second batch")
        redis_server.pause()
        try:
            if jump == "gap":  # batches 2..4 lost and not replayable: index.lost_events meets the paused Redis
                publisher.send(batch(control("events", 2, tiers=()), stored([3])), seq=5)
            else:  # the engine restarted: index.publisher_restarted meets the paused Redis
                publisher.send(batch(control("hello", 0, start="s2"), stored([3])), seq=0)
            wait_for(lambda: subscriber.stats()["e"]["failed"] >= 2, "the store's failures to be counted")
        finally:
            redis_server.resume()
        start = "s" if jump == "gap" else "s2"
        # (a start first heard from a record without tiers could not place its CPU events)
        publisher.send(batch(control("events", 3 if jump == "gap" else 1, start=start), stored([4])))
        # before the fix the subscriber thread died on Redis's TimeoutError: nothing was applied again
        wait_for(lambda: 4 in index.held("e", "0:primary"), "a batch after Redis answered again")
        assert subscriber._thread is not None and subscriber._thread.is_alive() and subscriber.failure is None
        eng = index.engine("e")
        assert eng.status == "partial" and not eng.dirty and eng.start == start
        assert index.held("e", "0:primary") == {4}  # what the lost or restarted events could have changed is gone
    finally:
        subscriber.stop()
        index.close()


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_writer_takes_its_claim_again_after_redis_restarts_empty(tmp_path: Path) -> None:
    import redis
    from redis_servers import REDIS_SERVER, RedisServer

    from kvtier.fleet import FleetReader

    if REDIS_SERVER is None:
        pytest.skip("redis-server not found on PATH")
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        client = redis.Redis.from_url(server.url, socket_timeout=1, socket_connect_timeout=1)
        clock = _Clock()
        index = FleetIndex(["a"], RedisMasks(client, "p"), clock=clock)
        index.apply("a", _decoded(control("hello", 0), stored([1, 2])))
        server.kill()
        server.start()  # empty, on the same port: the claim, the table and the keys are gone
        clock.now += 10
        index.tick()  # before the fix: WriterConflict, and every later write refused for good
        eng = index.engine("a")
        assert eng.status == "partial" and eng.needs_snapshot and index.writer_lost is None
        assert client.get("p:writer") is not None
        index.apply("a", _decoded(control("events", 1, tiers=()), stored([3])))
        answer = FleetReader(RedisMasks(client, "p"), meta_ttl=0.0).prefix([3])
        assert answer["a"]["tiers"]["0:primary"] == 1 and answer["a"]["status"] == "partial"
        index.close()
    finally:
        server.stop()


def test_health_fails_once_another_writer_took_the_prefix(redis_server: Any) -> None:
    import http.client
    import threading

    import redis

    from kvtier.fleet.http import FleetServer
    from kvtier.fleet.masks import WriterConflict

    client = redis.Redis.from_url(redis_server.url, socket_timeout=1)
    clock = _Clock()
    index = FleetIndex(["a"], RedisMasks(client, "p"), clock=clock)
    served = FleetServer(("127.0.0.1", 0), index, health=lambda: index.writer_lost)
    threading.Thread(target=served.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def health() -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(*served.server_address[:2], timeout=5)
        conn.request("GET", "/health")
        response = conn.getresponse()
        return response.status, response.read()

    try:
        assert health() == (200, b'{"ok":true}')
        client.set("p:writer", "another writer's token")
        clock.now += 10
        with pytest.raises(WriterConflict, match="another writer"):
            index.tick()
        status, body = health()
        assert status == 503 and b"lost its claim" in body  # before the fix: 200 {"ok":true}
    finally:
        served.shutdown()
        served.server_close()


def _decoded(*events: dict[str, Any]) -> Any:
    return decode_batch(batch(*events))


def test_a_subscriber_thread_that_stops_on_a_bug_marks_every_engine_partial(publisher: Publisher) -> None:
    class Buggy(FleetIndex):
        def take_snapshot_wanted(self, name: str) -> bool:
            raise RuntimeError("a bug")

    index = Buggy(["e"])
    index.apply("e", _decoded(control("hello", 0), stored([1])))
    assert index.engine("e").status == "synced"
    endpoint = EngineEndpoint("e", publisher.events, api="http://127.0.0.1:9")
    subscriber = FleetSubscriber(index, [endpoint])
    subscriber.start()
    try:
        wait_for(lambda: subscriber.failure is not None, "the thread to record why it stopped")
        assert "RuntimeError: a bug" in subscriber.failure
        assert index.engine("e").status == "partial"  # before the fix: still synced, frozen for good
    finally:
        subscriber.stop()


def test_a_reader_whose_redis_hangs_answers_503_naming_it_and_never_queues_requests(redis_server: Any) -> None:
    import http.client
    import json
    import threading

    import redis

    from kvtier.fleet import FleetReader
    from kvtier.fleet.http import FleetServer

    writer = FleetIndex(["a"], RedisMasks(redis.Redis.from_url(redis_server.url, socket_timeout=5), "p"))
    writer.apply("a", _decoded(control("hello", 0), stored([1, 2])))
    client = redis.Redis.from_url(redis_server.url, socket_timeout=1, socket_connect_timeout=1)
    served = FleetServer(("127.0.0.1", 0), FleetReader(RedisMasks(client, "p"), meta_ttl=0.0))
    threading.Thread(target=served.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    results: list[tuple[int, str]] = []

    def ask() -> None:
        conn = http.client.HTTPConnection(*served.server_address[:2], timeout=30)
        conn.request("POST", "/v1/prefix", body=b'{"block_hashes":[1,2]}')
        response = conn.getresponse()
        results.append((response.status, json.loads(response.read())["error"]))

    try:
        ask_ok = http.client.HTTPConnection(*served.server_address[:2], timeout=30)
        ask_ok.request("POST", "/v1/prefix", body=b'{"block_hashes":[1,2]}')
        assert ask_ok.getresponse().status == 200
        redis_server.pause()
        try:
            started = time.monotonic()
            threads = [threading.Thread(target=ask) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            elapsed = time.monotonic() - started
        finally:
            redis_server.resume()
        # before the fix: one after the other behind the reader's lock (8 s), each a 500 "internal error"
        assert len(results) == 8 and elapsed < 4.0, (elapsed, results)
        assert all(status == 503 and "the index's Redis did not answer" in error for status, error in results)
    finally:
        served.shutdown()
        served.server_close()
        writer.close()


def test_the_receive_queue_is_bounded_in_bytes(publisher: Publisher) -> None:
    import zmq

    index = FleetIndex(["e"])
    subscriber = _subscribe(index, publisher)
    try:
        (link,) = subscriber._links.values()
        queued = link.sub.getsockopt(zmq.RCVHWM) * link.sub.getsockopt(zmq.MAXMSGSIZE)
        assert queued <= 1 << 30  # before the fix: 100,000 messages of up to 256 MiB each
    finally:
        subscriber.stop()


def test_a_replay_that_never_fills_the_gap_is_given_up_at_its_byte_budget(tmp_path: Path) -> None:
    import threading

    import zmq

    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind(f"ipc://{tmp_path}/events")
    router.bind(f"ipc://{tmp_path}/replay")
    stop = threading.Event()
    sent = [0]

    def flood() -> None:  # answers a replay request with 200 KB batches that never reach the end of the gap
        while not stop.is_set():
            if not router.poll(20):
                continue
            peer = router.recv_multipart()[0]
            seq = 0
            while not stop.is_set() and seq < 2000:
                with contextlib.suppress(zmq.Again):
                    router.send_multipart([peer, b"", b"", seq.to_bytes(8, "big"), b"\x00" * 200_000], zmq.NOBLOCK)
                    sent[0] += 1
                    seq += 1

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    index = FleetIndex(["e"])
    endpoint = EngineEndpoint("e", f"ipc://{tmp_path}/events", replay=f"ipc://{tmp_path}/replay")
    subscriber = FleetSubscriber(index, [endpoint], replay_timeout=30.0, max_queued_bytes=4 << 20)
    subscriber.start()
    try:
        time.sleep(0.3)
        started = time.monotonic()
        # a first batch numbered 2**40 asks for everything before it
        pub.send_multipart([b"", (1 << 40).to_bytes(8, "big"), batch(control("hello", 0), stored([1]))])
        wait_for(lambda: index.held("e", "0:primary") == {1}, "the batch after the replay", timeout=25)
        # before the fix the replay held every payload for replay_timeout (30 s here)
        assert time.monotonic() - started < 10
        assert subscriber.stats()["e"]["replayed"] == 0
    finally:
        stop.set()
        thread.join(5)
        subscriber.stop()
        pub.close(0)
        router.close(0)
        ctx.term()


def test_an_engine_flooding_the_index_with_keys_meets_max_keys(publisher: Publisher) -> None:
    from kvtier.fleet import MemoryMasks

    masks = MemoryMasks(max_keys=1000)
    index = FleetIndex(["e"], masks)
    subscriber = _subscribe(index, publisher)
    try:
        publisher.send(batch(control("hello", 0), stored([1])))
        for n in range(1, 6):  # device-cache stores need no control record: 400 new keys a batch
            publisher.send(batch(stored(list(range(n * 1000, n * 1000 + 400)), medium="GPU")))
        # the refused batch is counted as skipped (like a batch past the location bits)
        wait_for(lambda: index.engine("e").skipped >= 1, "the batch past max_keys to be counted")
        assert len(masks) <= 1000  # before the fix: every key any engine reports, without bound
        assert index.engine("e").status == "partial" and subscriber.failure is None
    finally:
        subscriber.stop()


def test_an_engine_on_ipv6_is_heard_and_the_server_listens_on_ipv6() -> None:
    import http.client
    import threading

    import zmq

    from kvtier.fleet.http import FleetServer

    index = FleetIndex(["e"])
    served = FleetServer(("::1", 0), index)  # before the fix: "Address family for hostname not supported"
    threading.Thread(target=served.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.IPV6, 1)
    port = pub.bind_to_random_port("tcp://[::1]")
    subscriber = FleetSubscriber(index, [EngineEndpoint("e", f"tcp://[::1]:{port}")])
    subscriber.start()
    try:
        deadline = time.monotonic() + 20
        while index.held("e", "0:primary") != {1}:  # before the fix: never connected, nothing logged
            assert time.monotonic() < deadline, "the engine on [::1] was never heard"
            pub.send_multipart([b"", (0).to_bytes(8, "big"), batch(control("hello", 0), stored([1]))])
            time.sleep(0.1)
        assert served.url.startswith("http://[::1]:")
        conn = http.client.HTTPConnection("::1", served.server_address[1], timeout=5)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
    finally:
        served.shutdown()
        served.server_close()
        subscriber.stop()
        pub.close(0)
        ctx.term()


@pytest.mark.parametrize(("url", "names"), [("inproc://x", "must start with one of"),
                                            ("tcp://:5", "needs the engine's host"),
                                            ("tcp://*:5", "needs the engine's host"),
                                            ("ipc://", "needs a socket path of 1-107 bytes"),  # review r9
                                            ("ipc:///tmp/" + "x" * 200, "socket path of 1-107")])  # fmt: skip
def test_endpoints_that_can_never_connect_are_refused(url: str, names: str) -> None:
    with pytest.raises(ValueError, match=names):  # before the fix: accepted, the engine "waiting" for good
        EngineEndpoint("e", url)


@pytest.mark.parametrize(("fields", "names"), [
    ({"topic": "\udcff"}, "topic"), ({"topic": "t" * 256}, "topic"),
    ({"api": "http://h:99999"}, "api URL .* needs the engine's host and a port"),
    ({"api": "http://"}, "api URL .* needs the engine's host"),
    ({"api": "http://:8000"}, "api URL .* needs the engine's host"),
])  # fmt: skip
def test_a_topic_or_api_url_that_can_never_work_is_refused_by_name(fields: dict[str, str], names: str) -> None:
    """Regression (review r9, 2026-12-03): an undecodable topic passed, and wedged ``kvtier fleet
    serve`` (below); an API URL without a host or with a port out of range passed, and every
    snapshot ask failed at run time."""
    with pytest.raises(ValueError, match=names):
        EngineEndpoint("e", "tcp://127.0.0.1:5", **fields)


def test_an_endpoint_zmq_refuses_fails_start_by_name_and_stop_still_ends() -> None:
    """Regression (review r9, 2026-12-03): a SUB socket whose connect ZMQ refused was never closed,
    and ``stop()`` (the CLI's ``finally``) then waited for it for ever in the context's term():
    ``kvtier fleet serve`` hung without a word."""
    subscriber = FleetSubscriber(FleetIndex(["e"]), [EngineEndpoint("e", "tcp://a b:5")])
    with pytest.raises(ValueError, match="engine e: cannot subscribe to 'tcp://a b:5'"):
        subscriber.start()
    stopper = threading.Thread(target=subscriber.stop, daemon=True)
    stopper.start()
    stopper.join(10)
    assert not stopper.is_alive(), "stop() is blocked"


def test_kvtier_fleet_serve_with_an_endpoint_zmq_refuses_exits_with_the_error() -> None:
    cli = [sys.executable, "-m", "kvtier.cli", "fleet", "serve", "--port", "0", "--engine", "a=tcp://a b:5"]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0 and "tcp://a b:5" in done.stderr, (done.returncode, done.stderr[-2000:])


def test_the_engine_table_is_not_rewritten_to_redis_with_every_batch(redis_server: Any) -> None:
    import json

    import redis

    from kvtier.fleet import FleetReader

    client = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    clock = _Clock()
    index = FleetIndex(["a"], RedisMasks(client, "p"), clock=clock)

    def sets() -> int:
        return int(client.info("commandstats").get("cmdstat_set", {}).get("calls", 0))

    index.apply("a", _decoded(control("hello", 0), stored([1])))
    before = sets()
    for seq in range(1, 51):
        index.apply("a", _decoded(control("events", seq, tiers=()), stored([seq + 1])))
    assert sets() - before == 0  # before the fix: 50 writes of the whole table, one per batch
    reader = FleetReader(RedisMasks(client, "p"), meta_ttl=0.0)
    assert reader.prefix([1, 2, 51])["a"]["blocks"] == 3  # the keys are there at once
    clock.now += 1.0
    index.tick()  # counters follow within half a second
    assert json.loads(client.get("p:meta"))["engines"]["a"]["batches"] == 51
    index.apply("a", _decoded(control("hello", 0, start="s2"), stored([7])))  # a restart: written at once
    assert json.loads(client.get("p:meta"))["engines"]["a"]["start"] == "s2"
    index.close()


class _SnapshotApi:
    """An engine's OpenAI API as far as a snapshot ask needs it; counts the completions asked."""

    def __init__(self) -> None:
        import http.server
        import threading

        asked = self.asked = [0]

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._answer(b'{"data": [{"id": "m"}]}')

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                asked[0] += 1
                self._answer(b'{"choices": []}')

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_snapshot_ask_thread_that_cannot_start_leaves_the_subscriber_running_and_is_asked_again(
    publisher: Publisher, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Review harden #1: ``RuntimeError: can't start new thread`` for a snapshot ask ended the
    subscriber thread (every engine then partial for good); it is logged, and asked again later."""
    import threading

    real_start = threading.Thread.start
    refused: list[str] = []

    def start(thread: threading.Thread) -> None:
        if thread.name.startswith("kvtier-fleet-ask-") and not refused:
            refused.append(thread.name)
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    api = _SnapshotApi()
    index = FleetIndex(["e"])
    index.apply("e", _decoded(control("hello", 3)))  # joined mid-start: a snapshot is wanted
    subscriber = FleetSubscriber(index, [EngineEndpoint("e", publisher.events, api=api.url)], snapshot_retry=0.2)
    subscriber.start()
    try:
        wait_for(lambda: bool(refused), "the refused start of the ask thread")
        # before the fix: the subscriber thread died here and no snapshot was ever asked
        wait_for(lambda: api.asked[0] >= 1, "the snapshot asked again")
        assert subscriber._thread is not None and subscriber._thread.is_alive() and subscriber.failure is None
        assert "could not start a thread to ask engine e for a snapshot" in caplog.text
        publisher.send(batch(control("events", 4), stored([5])))  # and batches are still applied
        wait_for(lambda: 5 in index.held("e", "0:primary"), "a batch after the refused ask")
    finally:
        subscriber.stop()
        api.close()


def test_a_writers_health_fails_while_its_redis_fails_every_write_and_recovers(
    publisher: Publisher, redis_server: Any
) -> None:
    """Review harden #2: while the index's Redis hung, every batch failed and every engine turned
    partial, but ``/health`` stayed ``{"ok": true}``. Now it answers 503 naming Redis once its
    writes have failed for the grace period with none going through, and 200 again after."""
    import http.client
    import json
    import threading

    import redis

    from kvtier.fleet.cli import _writer_health
    from kvtier.fleet.http import FleetServer

    client = redis.Redis.from_url(redis_server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    index = FleetIndex(["e"], RedisMasks(client, "p"))
    subscriber = _subscribe(index, publisher)
    served = FleetServer(("127.0.0.1", 0), index, health=_writer_health(subscriber))
    threading.Thread(target=served.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def health() -> tuple[int, dict[str, Any]]:
        conn = http.client.HTTPConnection(*served.server_address[:2], timeout=5)
        conn.request("GET", "/health")
        response = conn.getresponse()
        return response.status, json.loads(response.read())

    try:
        publisher.send(batch(control("hello", 0), stored([1])))
        wait_for(lambda: index.held("e", "0:primary") == {1}, "the first batch")
        assert health() == (200, {"ok": True})
        redis_server.pause()
        try:
            publisher.send(batch(control("events", 1, tiers=()), stored([2])))
            wait_for(lambda: health()[0] == 503, "/health to fail while Redis does not answer")  # before: 200
            assert "Redis" in health()[1]["error"] and subscriber.failure is None
        finally:
            redis_server.resume()
        wait_for(lambda: health() == (200, {"ok": True}), "/health to recover once Redis answers")
    finally:
        served.shutdown()
        served.server_close()
        subscriber.stop()
        index.close()


def test_one_failed_write_alone_never_reports_the_store_failing(redis_server: Any) -> None:
    """Review harden #2, the rule: the store is reported failing only once every write has failed
    for ``failing_writes_grace`` seconds; one that goes through clears it at once."""
    import redis

    client = redis.Redis.from_url(redis_server.url, socket_timeout=0.3, socket_connect_timeout=0.3)
    clock = _Clock()
    index = FleetIndex(["a"], RedisMasks(client, "p"), clock=clock, failing_writes_grace=60.0)
    try:
        redis_server.pause()
        try:
            clock.now += 10
            with pytest.raises(redis.RedisError):
                index.tick()  # the claim's refresh times out
        finally:
            redis_server.resume()
        assert index.store_failing() is None  # one timeout, within the grace period
        index.failing_writes_grace = 0.0
        failing = index.store_failing()
        assert failing is not None and "Redis has failed every write" in failing and "Timeout" in failing
        clock.now += 10
        index.tick()  # goes through
        assert index.store_failing() is None
    finally:
        index.close()
