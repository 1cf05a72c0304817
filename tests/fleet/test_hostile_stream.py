"""The subscriber against hostile engines and a failing Redis, over real sockets: a publisher
stand-in (``wire_publisher``) on ipc endpoints sends what vLLM never would, a real redis-server is
paused or restarted under the writer, and the subscriber thread must carry on and count."""

from __future__ import annotations

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
    time.sleep(0.3)  # the SUB socket's subscription reaches the publisher
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


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Any]:
    from redis_servers import REDIS_SERVER, start_redis

    if REDIS_SERVER is None:
        pytest.skip("redis-server not found on PATH")
    server = start_redis(tmp_path / "redis")
    try:
        yield server
    finally:
        server.stop()


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
