"""What a router sees of an engine over its lifecycle: killed -9 (and never back, or restarted under
the same name and endpoints, several times), stopped cleanly, restarted with other settings. Real
processes (``kvtier fleet serve``, publishers killed with SIGKILL) on ipc endpoints; no vLLM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("zmq")

from wire_publisher import CPU_TIER, batch, control, stored, wait_for

from kvtier.fleet import FleetIndex, FleetReader, RedisMasks
from kvtier.fleet.masks import MemoryMasks, StoreUnavailable
from kvtier.fleet.subscriber import EngineEndpoint, FleetSubscriber
from kvtier.fleet.wire import decode_batch

# An engine's publisher of its own: binds an XPUB (a SUB's subscription reaches it: batches are sent
# only once the index listens) and sends one batch: hello of START, GPU blocks, CPU-tier blocks. On
# SIGTERM it stops cleanly (closes its socket, exits 0).
_ENGINE = """
import signal, sys, time, zmq
sys.path.insert(0, sys.argv[1])
from wire_publisher import batch, control, stored
events, start, gpu, cpu = sys.argv[2], sys.argv[3], [int(k) for k in sys.argv[4].split(",")], \\
    [int(k) for k in sys.argv[5].split(",")]
ctx = zmq.Context()
pub = ctx.socket(zmq.XPUB)
pub.bind(events)
if not pub.poll(20_000):
    sys.exit("nobody subscribed")
pub.recv()
def stop(*_):
    pub.close(0)
    ctx.term()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)  # (before "sent": a SIGTERM right after it found no handler, exit -15)
pub.send_multipart([b"", (0).to_bytes(8, "big"),
                    batch(control("hello", 0, start=start), stored(gpu, medium="GPU"), stored(cpu))])
print("sent", flush=True)
time.sleep(600)
"""


def _engine(events: str, start: str, gpu: list[int], cpu: list[int]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _ENGINE, str(Path(__file__).parent), events, start, ",".join(map(str, gpu)),
         ",".join(map(str, cpu))], stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "sent\n"
    return proc


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def _serve(*args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "fleet", "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("kvtier fleet: serving on http://"), line
    return proc, line.rsplit(" ", 1)[1].strip()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _prefix(url: str, keys: list[int]) -> dict[str, Any]:
    body = json.dumps({"block_hashes": keys}).encode()
    with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/prefix", data=body), timeout=10) as response:
        answer: dict[str, Any] = json.loads(response.read())["engines"]["a"]
    return answer


def test_a_killed_engine_is_disconnected_not_synced_and_each_restart_replaces_it(tmp_path: Path) -> None:
    events = f"ipc://{tmp_path}/events"
    server, url = _serve("--engine", f"a={events}")
    engine = None
    try:
        for n in range(4):  # killed -9 and restarted under the same name and endpoint, quickly, again and again
            engine = _engine(events, f"s{n}", gpu=[10 * n + 1], cpu=[10 * n + 1, 10 * n + 2])
            wait_for(lambda n=n: _prefix(url, [10 * n + 1, 10 * n + 2])["start"] == f"s{n}", f"start s{n}")
            answer = _prefix(url, [10 * n + 1, 10 * n + 2])
            assert answer["status"] == "synced" and answer["blocks"] == 2 and answer["tiers"]["GPU"] == 1
            if n:  # what the killed start held is gone with it
                assert _prefix(url, [10 * n - 9, 10 * n - 8])["blocks"] == 0
            _kill(engine)
            # before the fix: 'synced' for good, claiming the dead engine's device cache and CPU tier
            wait_for(lambda: _prefix(url, [1])["status"] == "disconnected", "the killed engine disconnected")
            table = _get(f"{url}/v1/engines")["engines"]["a"]
            assert table["status"] == "disconnected" and table["start"] == f"s{n}" and table["restarts"] == n
        assert _get(f"{url}/health") == {"ok": True}  # (the index itself follows its engines)
    finally:
        if engine is not None and engine.poll() is None:
            _kill(engine)
        server.send_signal(signal.SIGTERM)
        assert server.wait(20) == 0


def test_a_cleanly_stopped_engine_is_disconnected_for_a_reader_of_the_index_in_redis(
    tmp_path: Path, redis_server: Any
) -> None:
    import redis

    events = f"ipc://{tmp_path}/events"
    client = redis.Redis.from_url(redis_server.url, socket_timeout=5.0)
    index = FleetIndex(["a"], RedisMasks(client, "life"))
    reader = FleetReader(RedisMasks(client, "life"), meta_ttl=0.0)
    subscriber = FleetSubscriber(index, [EngineEndpoint("a", events)])
    subscriber.start()
    engine = _engine(events, "s1", gpu=[5], cpu=[5])
    try:
        wait_for(lambda: reader.prefix([5])["a"]["status"] == "synced", "the engine synced")
        assert reader.prefix([5])["a"]["blocks"] == 1
        engine.terminate()  # a clean stop: vLLM's publisher sends nothing on the way out either
        assert engine.wait(10) == 0
        # before the fix: 'synced' for good, the stopped engine's blocks claimed
        wait_for(lambda: reader.prefix([5])["a"]["status"] == "disconnected", "the reader told")
        assert index.engine("a").status == "disconnected"
    finally:
        if engine.poll() is None:
            _kill(engine)
        subscriber.stop()
        index.close()


def test_a_restarts_info_replaces_the_previous_starts_once_a_record_carries_it() -> None:
    """Pins the rule (2026-12-05): a restart first heard mid-stream keeps the last start's info
    until a record of the new start carries one. An audit dropped it at the restart instead;
    review found that, as an "events" record carries no info, answers by tokens were then a 409
    (block size unknown) and tier prefixes counted in chunks of 1 until a mark or a hello came."""
    index = FleetIndex(["a"])
    index.apply("a", decode_batch(batch(control("hello", 0, start="s1", info={"tokens_per_hash": 16}), stored([1]))))
    assert index.meta()["engines"]["a"]["info"] == {"tokens_per_hash": 16}
    # The restarted engine's hello was missed: its first record heard is an "events" one (no tiers, no info).
    index.apply("a", decode_batch(batch(control("events", 7, start="s2", tiers=()), stored([2]))))
    entry = index.meta()["engines"]["a"]
    assert entry["start"] == "s2" and entry["status"] == "partial"
    assert entry["info"] == {"tokens_per_hash": 16}  # (an engine restarted keeps its block size, as a rule)
    index.apply("a", decode_batch(batch(control("mark", 8, start="s2", tiers=(CPU_TIER,),
                                                info={"tokens_per_hash": 32}, marker="m"))))  # fmt: skip
    assert index.meta()["engines"]["a"]["info"] == {"tokens_per_hash": 32}
    # A restart whose first record heard carries info takes it at once.
    index.apply("a", decode_batch(batch(control("hello", 0, start="s3", info={"tokens_per_hash": 64}), stored([3]))))
    assert index.meta()["engines"]["a"]["info"] == {"tokens_per_hash": 64}


def test_no_thread_or_socket_is_left_behind_by_engines_killed_again_and_again(tmp_path: Path) -> None:
    events = f"ipc://{tmp_path}/events"
    index = FleetIndex(["a"])
    subscriber = FleetSubscriber(index, [EngineEndpoint("a", events)])
    subscriber.start()
    counts = []
    try:
        for n in range(6):
            engine = _engine(events, f"s{n}", gpu=[n], cpu=[n])
            try:
                wait_for(lambda n=n: index.engine("a").start == f"s{n}", f"start s{n}")
            finally:
                _kill(engine)
            wait_for(lambda: index.engine("a").status == "disconnected", "the killed engine disconnected")
            assert index.held("a", "0:primary") == {n}  # (kept: an engine cut off for a moment comes back)
            ours = sum(t.name.startswith("kvtier-fleet") for t in threading.enumerate())
            counts.append((len(os.listdir("/proc/self/fd")), ours))
        # (a socket or thread left per restart would show 4 times over; the rest of the process may move by one)
        assert counts[-1][1] == counts[1][1] == 1 and counts[-1][0] - counts[1][0] < 4, counts
    finally:
        subscriber.stop()


def test_stop_keeps_to_its_timeout_however_many_snapshot_asks_hang_on_dead_engines(tmp_path: Path) -> None:
    hole = socket.socket()  # an engine API that takes connections (the kernel's backlog) and never answers
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    names = [f"e{i}" for i in range(12)]
    index = FleetIndex(names)
    for name in names:  # each heard in the middle of its start: a snapshot is wanted of every one
        index.apply(name, decode_batch(batch(control("events", 5, tiers=()), stored([1]))))
    api = f"http://127.0.0.1:{hole.getsockname()[1]}"
    endpoints = [EngineEndpoint(name, f"ipc://{tmp_path}/{name}", api=api) for name in names]
    subscriber = FleetSubscriber(index, endpoints, snapshot_retry=0.05, http_timeout=60.0)
    subscriber.start()
    try:
        wait_for(lambda: sum(t.name.startswith("kvtier-fleet-ask-") for t in threading.enumerate()) == len(names),
                 "a snapshot ask hanging on each engine's API")  # fmt: skip
        began = time.monotonic()
        subscriber.stop(join_timeout=1.0)
        took = time.monotonic() - began
        assert took < 2.0, took  # before the fix: 1 s, then 0.25 s per hanging ask (4 s for 12 engines)
    finally:
        hole.close()  # (the connections it never accepted are reset: the asks end)
        subscriber.stop()


class _FailingTable(MemoryMasks):
    """The index's store (a collaborator here): its next ``failures`` table writes fail, as a
    Redis that did not answer would."""

    failures = 0

    def put_meta(self, meta: dict[str, Any]) -> None:
        if self.failures:
            self.failures -= 1
            raise StoreUnavailable("the index's Redis did not answer (test)")
        super().put_meta(meta)


def test_a_status_whose_table_write_failed_is_written_by_the_next_tick() -> None:
    """Review (2026-12-05): the one table write of an engine's disconnect failed (Redis did not
    answer), and nothing wrote it again: the next write came with a batch, which a dead engine
    never sends, so readers saw it `synced` for good. A failed table write is now due again."""
    masks = _FailingTable()
    now = [0.0]
    index = FleetIndex(["a"], masks, clock=lambda: now[0])
    index.apply("a", decode_batch(batch(control("hello", 0, start="s1"), stored([1]))))
    assert masks.get_meta()["engines"]["a"]["status"] == "synced"
    masks.failures = 1
    with pytest.raises(StoreUnavailable):
        index.engine_connected("a", False)
    assert index.engine("a").status == "disconnected"
    assert masks.get_meta()["engines"]["a"]["status"] == "synced"  # (the write failed)
    now[0] = 1.0  # (tick writes a due table at most every 0.5 s)
    index.tick()
    assert masks.get_meta()["engines"]["a"]["status"] == "disconnected"  # before the fix: 'synced' for good


def test_a_frozen_engine_is_disconnected_by_the_heartbeat_and_back_when_it_answers(tmp_path: Path) -> None:
    """Review (2026-12-05): an engine frozen (SIGSTOP; a host gone without closing its connections
    behaves alike) stayed `synced`: its connection never closed, an idle SUB sends nothing, and
    TCP without keepalive never gives it up. The subscriber now pings each publisher (ZMTP
    heartbeats): no answer for 3 s is a disconnect; answering again is a reconnect."""
    events = f"tcp://127.0.0.1:{_free_port()}"
    server, url = _serve("--engine", f"a={events}")
    engine = _engine(events, "s0", gpu=[1], cpu=[1, 2])
    try:
        wait_for(lambda: _prefix(url, [1, 2])["status"] == "synced", "engine a synced")
        engine.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        # before the fix: 'synced' for as long as it stayed frozen
        wait_for(lambda: _prefix(url, [1, 2])["status"] == "disconnected", "the frozen engine disconnected", 15)
        assert time.monotonic() - started < 10
        engine.send_signal(signal.SIGCONT)
        wait_for(lambda: _prefix(url, [1, 2])["status"] == "synced", "the engine back", 15)
        assert _prefix(url, [1, 2])["blocks"] == 2
    finally:
        engine.send_signal(signal.SIGCONT)
        _kill(engine)
        server.send_signal(signal.SIGTERM)
        assert server.wait(20) == 0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port
