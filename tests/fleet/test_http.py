"""``kvtier fleet serve``'s HTTP answer: prompts by tokens (hashed like vLLM) and by block hashes,
every bad input refused with a 4xx naming the field, bounded sizes and concurrency; and the
command itself: it serves, stops on SIGTERM, refuses bad usage, and a read-only server answers
from the index another process keeps in Redis."""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine_events import ControlRecord, TierInfo
from kvtier.fleet import BlockHasher, FleetIndex, RedisMasks
from kvtier.fleet.http import BadRequest, FleetServer
from kvtier.fleet.records import Kind, WireBatch, WireEvent

TOKENS = 4
TIERS = (TierInfo("0:primary", "cpu", "cpu", "engine"),)


def _fill(index: FleetIndex, keys: Sequence[int]) -> None:
    hello = ControlRecord("hello", "e", "s1", 0, time.time(), TIERS, {"tokens_per_hash": TOKENS})
    index.apply("a", WireBatch(time.time(), [WireEvent(Kind.CONTROL, control=hello),
                                             WireEvent(Kind.STORED, tuple(keys), "CPU")], 0))  # fmt: skip


def _request(url: str, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, Any]:  # fmt: skip
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


def _post(url: str, body: Any) -> tuple[int, Any]:
    data = json.dumps(body).encode()
    return _request(url, "POST", "/v1/prefix", data, {"Content-Type": "application/json"})


@pytest.fixture
def served() -> Iterator[tuple[FleetServer, FleetIndex]]:
    index = FleetIndex(["a", "b"])
    server = FleetServer(("127.0.0.1", 0), index, max_body=4096, max_blocks=64, request_timeout=1.0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server, index
    finally:
        server.shutdown()
        server.server_close()


def test_answers_by_tokens_and_by_block_hashes(served: tuple[FleetServer, FleetIndex]) -> None:
    server, index = served
    tokens = list(range(100, 100 + 6 * TOKENS + 2))
    keys = BlockHasher("sha256", None, TOKENS).event_hashes(tokens)
    assert len(keys) == 6
    status, body = _post(server.url, {"tokens": tokens})
    assert status == 409 and "--tokens-per-hash" in body["error"]  # no engine said its block size yet
    _fill(index, keys[:4])
    status, body = _post(server.url, {"tokens": tokens})
    assert status == 200, body
    assert body["blocks"] == 6 and body["tokens_per_hash"] == TOKENS
    assert body["engines"]["a"] == {"blocks": 4, "tokens": 16, "tiers": {"GPU": 0, "0:primary": 4},
                                    "status": "synced", "start": "s1"}  # fmt: skip
    assert body["engines"]["b"]["blocks"] == 0 and body["engines"]["b"]["status"] == "waiting"
    status, by_hash = _post(server.url, {"block_hashes": [keys[0], f"{keys[1]:x}", keys[2]], "engines": ["a"]})
    assert status == 200 and list(by_hash["engines"]) == ["a"] and by_hash["engines"]["a"]["blocks"] == 3
    status, engines = _request(server.url, "GET", "/v1/engines")
    assert status == 200 and engines["engines"]["a"]["start"] == "s1"
    assert "device_bit" not in engines["engines"]["a"] and "bit" not in engines["engines"]["a"]["tiers"][0]
    assert _request(server.url, "GET", "/health") == (200, {"ok": True})


def test_a_group_asked_by_tokens_is_that_groups_answer(served: tuple[FleetServer, FleetIndex]) -> None:
    """Regression (review r9, 2026-12-03): ``group`` sent with ``tokens`` was ignored, so a router
    asking a hybrid model's group 1 by tokens was told what group 0 holds."""
    server, index = served
    tokens = list(range(100, 100 + 3 * TOKENS))
    keys = BlockHasher("sha256", None, TOKENS).event_hashes(tokens)
    _fill(index, keys[:2])  # group 0's
    assert _post(server.url, {"tokens": tokens})[1]["engines"]["a"]["blocks"] == 2
    assert _post(server.url, {"tokens": tokens, "group": 0})[1]["engines"]["a"]["blocks"] == 2
    status, body = _post(server.url, {"tokens": tokens, "group": 1})
    assert status == 200 and body["engines"]["a"]["blocks"] == 0
    status, by_hash = _post(server.url, {"block_hashes": keys, "group": 1})
    assert status == 200 and by_hash["engines"]["a"]["blocks"] == 0


@pytest.mark.parametrize(
    ("body", "status", "names"),
    [
        ([1, 2], 400, "JSON object"),
        ({"tokens": [1, 2], "block_hashes": [1]}, 400, "exactly one"),
        ({}, 400, "exactly one"),
        ({"tokens": "1 2 3"}, 400, "tokens"),
        ({"tokens": [1, -2]}, 400, "tokens"),
        ({"tokens": [1, 2.5]}, 400, "tokens"),
        ({"tokens": [True]}, 400, "tokens"),
        ({"tokens": list(range(TOKENS * 70))}, 413, "tokens"),
        ({"block_hashes": [1 << 64]}, 400, "block_hashes"),
        ({"block_hashes": ["zz"]}, 400, "block_hashes"),
        ({"block_hashes": [None]}, 400, "block_hashes"),
        ({"block_hashes": [1], "group": -1}, 400, "group"),
        ({"block_hashes": [1], "group": "0"}, 400, "group"),
        ({"tokens": [1, 2], "group": "x"}, 400, "group"),  # review r9: with tokens it was ignored
        ({"block_hashes": list(range(65))}, 413, "block_hashes"),
        ({"block_hashes": [1], "engines": "a"}, 400, "engines"),
        ({"block_hashes": [1], "prompt": "hi"}, 400, "unknown field"),
    ],
)
def test_bad_requests_are_refused_by_name(
    served: tuple[FleetServer, FleetIndex], body: Any, status: int, names: str
) -> None:
    server, index = served
    _fill(index, [])
    got, answer = _post(server.url, body)
    assert got == status and names in answer["error"], answer


def test_transport_level_abuse(served: tuple[FleetServer, FleetIndex]) -> None:
    server, _ = served
    assert _request(server.url, "POST", "/v1/prefix", b"{nope", {"Content-Length": "5"})[0] == 400
    assert _request(server.url, "POST", "/v1/prefix", b"x" * 5000, {"Content-Length": "5000"})[0] == 413
    assert _request(server.url, "GET", "/v1/prefix")[0] == 405
    assert _request(server.url, "POST", "/elsewhere", b"{}", {"Content-Length": "2"})[0] == 404
    host, port = server.server_address[:2]
    # A client that announces a body and never sends it is dropped after request_timeout.
    with socket.create_connection((str(host), port), timeout=5) as sock:
        sock.sendall(b"POST /v1/prefix HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        started = time.monotonic()
        sock.recv(100)
        assert time.monotonic() - started < 4
    # No Content-Length at all.
    with socket.create_connection((str(host), port), timeout=5) as sock:
        sock.sendall(b"POST /v1/prefix HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b" 411 " in sock.recv(200)


def test_an_engine_the_index_does_not_know_is_refused_by_name(served: tuple[FleetServer, FleetIndex]) -> None:
    """Regression (audit, 2026-12-05): ``"engines": ["nope"]`` answered 200 with ``"engines": {}``,
    which a router with a typo read as "no engine holds the prefix". A configured engine nothing
    was heard from yet (``b``, ``waiting``) is known."""
    server, index = served
    _fill(index, [7, 8])
    status, body = _post(server.url, {"block_hashes": [7, 8], "engines": ["nope"]})
    assert status == 400, body  # before the fix: 200 {"engines": {}}
    assert body["error"].startswith("engines names 1 engine(s) the index does not know: 'nope'")
    assert "(it knows 'a', 'b')" in body["error"]
    status, body = _post(server.url, {"tokens": list(range(8)), "engines": ["a", "nope", "nope"]})
    assert status == 400 and "engines" in body["error"] and "'nope'" in body["error"], body
    status, body = _post(server.url, {"block_hashes": [7, 8], "engines": ["b", "a"]})
    assert status == 200 and list(body["engines"]) == ["b", "a"], body
    assert body["engines"]["b"]["status"] == "waiting" and body["engines"]["a"]["blocks"] == 2
    many = [f"typo-{i}-" + "x" * 150 for i in range(20)]  # (the served body is at most 4096 bytes)
    status, body = _post(server.url, {"block_hashes": [7], "engines": many})
    assert status == 400 and "engines names 20 engine(s)" in body["error"] and "and 12 more" in body["error"]
    assert len(body["error"]) < 1200 and "typo-8-" not in body["error"]  # 8 names quoted, each cut short


def _exchange(url: str, method: str, path: str) -> tuple[int, dict[str, str], Any, bool]:
    """One request without a body: the status, headers, JSON body, and whether the server then
    closed the connection."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        length = "Content-Length: 0\r\n" if method == "POST" else ""
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\n{length}\r\n".encode())
        response = http.client.HTTPResponse(sock)
        response.begin()
        body = json.loads(response.read())
        closed = sock.recv(1) == b""
        return response.status, dict(response.getheaders()), body, closed


def test_a_path_asked_with_the_wrong_method_is_405_naming_the_method(served: tuple[FleetServer, FleetIndex]) -> None:
    """Regression (audit, 2026-12-05): ``GET /v1/prefix`` answered 404 "no such path '/v1/prefix':
    use /v1/prefix, ...", contradicting itself. A path of the API asked with another method is 405
    with an ``Allow`` header; an unknown path stays 404."""
    server, _ = served
    for method, path, allowed in (("GET", "/v1/prefix", "POST"), ("POST", "/health", "GET"),
                                  ("POST", "/v1/engines", "GET"), ("PUT", "/v1/prefix", "POST"),
                                  ("DELETE", "/v1/engines", "GET"), ("OPTIONS", "/health", "GET")):  # fmt: skip
        status, headers, body, closed = _exchange(server.url, method, path)
        assert status == 405 and headers["Allow"] == allowed, (method, path, status, body)  # before: 404, no Allow
        assert body == {"error": f"{method} is not answered on {path}: use {allowed} {path}"}
        assert closed
    for method in ("GET", "POST"):
        status, headers, body, _ = _exchange(server.url, method, "/v1/prefixes")
        assert status == 404 and "Allow" not in headers
        assert body["error"] == "no such path '/v1/prefixes': use POST /v1/prefix, GET /v1/engines, GET /health"
    assert _exchange(server.url, "GET", "/health")[:3:2] == (200, {"ok": True})


class _Slow:
    """Answers that wait for a signal: to hold a request in flight."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def prefix(self, keys: Sequence[int], engines: Sequence[str] | None = None) -> dict[str, Any]:
        self.entered.set()
        self.release.wait(10)
        return {}

    def meta(self) -> dict[str, Any]:
        return {}


def test_at_most_max_concurrent_requests_are_answered_at_once() -> None:
    slow = _Slow()
    server = FleetServer(("127.0.0.1", 0), slow, tokens_per_hash=4, max_concurrent=1)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        first: list[tuple[int, Any]] = []
        held = threading.Thread(target=lambda: first.append(_post(server.url, {"block_hashes": [1]})))
        held.start()
        assert slow.entered.wait(10)
        assert _post(server.url, {"block_hashes": [2]})[0] == 503
        slow.release.set()
        held.join(10)
        assert first[0][0] == 200
    finally:
        slow.release.set()
        server.shutdown()
        server.server_close()


def _serve(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "fleet", "serve", "--port", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("kvtier fleet: serving on http://"), (line, proc.stderr.read() if proc.stderr else "")
    return proc, line.rsplit(" ", 1)[1].strip()


def test_the_command_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    pytest.importorskip("zmq")
    proc, url = _serve("--engine", f"a=ipc://{tmp_path}/events", "--replay", f"a=ipc://{tmp_path}/replay")
    try:
        assert _request(url, "GET", "/health") == (200, {"ok": True})
        status, body = _post(url, {"block_hashes": [1, 2]})
        assert status == 200 and body["engines"]["a"]["status"] == "waiting"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


@pytest.mark.parametrize(
    ("args", "names"),
    [
        ((), "--engine"),
        (("--engine", "a=tcp://127.0.0.1:1", "--replay", "b=tcp://127.0.0.1:2"), "no --engine named 'b'"),
        (("--engine", "a=tcp://127.0.0.1:1", "--engine", "a=tcp://127.0.0.1:2"), "unique"),
        (("--engine", "a=http://x"), "events endpoint"),
        (("--engine", "a=tcp://127.0.0.1:1", "--api", "a=ftp://x"), "api endpoint"),
        (("--read-only",), "--redis"),
        (("--engine", "a=tcp://127.0.0.1:1", "--hash", "xxhash"), "PYTHONHASHSEED"),
        # regression: nan/inf timeouts were accepted and failed every connection with a traceback
        *[(("--engine", "a=tcp://127.0.0.1:1", flag, value), flag)
          for flag in ("--request-timeout", "--lag-seconds") for value in ("nan", "inf", "1e400", "-1")],
        (("--engine", "a=tcp://127.0.0.1:1", "--max-body", "99999999999999"), "--max-body"),
        # regression (review, 2026-12-02): a malformed --redis URL reached the catch-all error
        (("--redis", "notaurl", "--read-only"), "--redis is not a Redis URL the index can use: redis url 'notaurl'"),
        # regression (2026-12-04): the password was echoed; a bad port reached redis-py
        (("--redis", "redis://u:pw-s3cr3t@cache:99999/0", "--read-only"), "Port out of range"),
        (("--redis", "redis://cache:1/0?socket_timeout=9", "--read-only"), "the fleet's connections time out"),
        # regression (review, 2026-12-02): a port out of range was accepted; listen errors named no input
        (("--engine", "a=tcp://127.0.0.1:99999"), "needs a port 1-65535"),
        (("--engine", "a=tcp://127.0.0.1:1", "--host", "999.9.9.9"), "cannot listen on 999.9.9.9:0 (--host, --port)"),
    ],
)
def test_bad_usage_is_refused_by_name(args: tuple[str, ...], names: str) -> None:
    done = subprocess.run([sys.executable, "-m", "kvtier.cli", "fleet", "serve", "--port", "0", *args],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and names in done.stderr, done.stderr
    assert "pw-s3cr3t" not in done.stderr


def test_routers_share_an_index_in_redis(tmp_path: Path) -> None:
    from redis_servers import REDIS_SERVER, start_redis

    if REDIS_SERVER is None:
        pytest.skip("redis-server not found on PATH")
    import redis

    server = start_redis(tmp_path / "redis")
    try:
        writer = FleetIndex(["a"], RedisMasks(redis.Redis.from_url(server.url), "fleet-t"))
        tokens = list(range(500, 500 + 5 * TOKENS))
        keys = BlockHasher("sha256", None, TOKENS).event_hashes(tokens)
        _fill(writer, keys[:3])
        proc, url = _serve("--redis", server.url, "--redis-prefix", "fleet-t", "--read-only")
        try:
            status, body = _post(url, {"tokens": tokens})
            assert status == 200 and body["engines"]["a"]["blocks"] == 3
            assert body["engines"]["a"] == writer.prefix(keys)["a"] | {"tokens": 3 * TOKENS}
            # A reader knows the engines of the table the writer last wrote (audit, 2026-12-05: an
            # unknown name answered 200 with no engine), one added since included, once re-read.
            status, body = _post(url, {"tokens": tokens, "engines": ["c"]})
            assert status == 400 and "engines names 1 engine(s) the index does not know: 'c'" in body["error"]
            writer.add_engine("c")
            time.sleep(0.6)  # (a reader re-reads the table at most every 0.5 s)
            status, body = _post(url, {"block_hashes": keys, "engines": ["c"]})
            assert status == 200 and body["engines"]["c"]["status"] == "waiting", body
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0
    finally:
        server.stop()


def test_a_writer_that_finds_the_prefix_held_says_at_once_that_it_waits(tmp_path: Path, redis_server: Any) -> None:
    """Regression (audit, 2026-12-05): ``kvtier fleet serve --redis URL`` while another writer
    held the prefix printed nothing and listened on nothing for 16 s and more, then refused. It
    now says at once (a WARNING line on stderr) that it waits up to 16 s for the other claim to
    end; here the other writer then stops, and it serves."""
    pytest.importorskip("zmq")
    import redis

    holder = FleetIndex(["a"], RedisMasks(redis.Redis.from_url(redis_server.url), "held"))  # a 15 s lease
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "fleet", "serve", "--port", "0", "--redis", redis_server.url,
         "--redis-prefix", "held", "--engine", f"a=ipc://{tmp_path}/events"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stderr is not None and proc.stdout is not None
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr or ()], daemon=True).start()
    try:
        started = time.monotonic()
        line = lines.get(timeout=14)  # before the fix: nothing until the refusal, 16 s and more later
        assert line.startswith("WARNING kvtier.fleet.masks: fleet: another kvtier fleet writer holds the Redis "
                               "prefix 'held' (its claim ends within 1"), line  # fmt: skip
        assert line.rstrip().endswith("s if it is gone): waiting up to 16 s for its claim to end"), line
        assert time.monotonic() - started < 14 and proc.poll() is None
        holder.close()  # the other writer stops (its claim released): this one takes the prefix
        served = proc.stdout.readline()
        assert served.startswith("kvtier fleet: serving on http://"), served
        assert _request(served.rsplit(" ", 1)[1].strip(), "GET", "/health") == (200, {"ok": True})
    finally:
        holder.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


def _hello_with_info(index: FleetIndex, engine: str, info_json: str) -> None:
    """A hello whose info is ``info_json`` as sent on the wire (decoded like the subscriber does)."""
    import msgspec

    from kvtier.engine_events import CONTROL_PREFIX
    from kvtier.fleet.wire import decode_batch

    text = CONTROL_PREFIX + '{"op":"hello","engine":"e","start":"s","seq":0,"time":1.0,"tiers":[{"label":"0:primary",' \
        '"type":"cpu","medium":"cpu","scope":"engine"}],"info":' + info_json + "}"
    events = [{"type": "BlockRemoved", "block_hashes": [1], "medium": "STORAGE", "ownership": text},
              {"type": "BlockStored", "block_hashes": [1, 2], "medium": "GPU"}]  # fmt: skip
    index.apply(engine, decode_batch(msgspec.msgpack.encode([time.time(), events, None])))


@pytest.mark.parametrize("info", ['{"x":' + "[" * 50 + "]" * 50 + "}", '{"x":NaN}', '{"x":{"y":1}}',
                                  '{"tokens_per_hash":[4]}', '{"x":' + "9" * 30 + "}"])  # fmt: skip
def test_an_engines_info_that_is_not_flat_scalars_is_refused_and_the_table_stays_readable(
    served: tuple[FleetServer, FleetIndex], info: str
) -> None:
    server, index = served
    _fill(index, [1, 2])
    _hello_with_info(index, "b", info)
    assert index.engine("b").skipped == 1 and index.engine("b").info == {}  # the record was refused
    status, body = _request(server.url, "GET", "/v1/engines")
    assert status == 200 and set(body["engines"]) == {"a", "b"}  # before the fix: 500 (nested), or NaN in the body
    status, body = _post(server.url, {"tokens": list(range(8))})
    assert status == 200 and body["tokens_per_hash"] == TOKENS


def test_an_engines_odd_tokens_per_hash_is_named_and_does_not_break_other_answers(
    served: tuple[FleetServer, FleetIndex],
) -> None:
    server, index = served
    _fill(index, [1, 2])
    _hello_with_info(index, "b", '{"tokens_per_hash":"4"}')
    status, body = _post(server.url, {"block_hashes": [1, 2]})
    assert status == 200 and body["engines"]["a"]["blocks"] == 2  # before the fix: 500 (sorted([4, "4"]))
    status, body = _post(server.url, {"tokens": list(range(8)), "engines": ["a"]})
    assert status == 200 and body["tokens_per_hash"] == TOKENS and body["engines"]["a"]["blocks"] == 0
    status, body = _post(server.url, {"tokens": list(range(8))})  # b's size is left out
    assert status == 200 and body["tokens_per_hash"] == TOKENS
    status, body = _post(server.url, {"tokens": list(range(8)), "engines": ["b"]})
    assert status == 409 and "'b' reported '4'" in body["error"]


def test_max_blocks_bounds_the_full_blocks_of_tokens(served: tuple[FleetServer, FleetIndex]) -> None:
    server, index = served  # max_blocks=64, 4 tokens per block
    _fill(index, [])
    status, body = _post(server.url, {"tokens": [1] * (64 * TOKENS + TOKENS - 1)})
    assert status == 200 and body["blocks"] == 64
    status, body = _post(server.url, {"tokens": [1] * (65 * TOKENS)})  # before the fix: 65 blocks hashed, 200
    assert status == 413 and "at most 64 blocks (259 ids)" in body["error"]


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"TRACE /v1/prefix HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 501),  # (PUT: 405 now)
        (b"GET /" + b"x" * 70_000 + b" HTTP/1.1\r\n\r\n", 414),
        (b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101)) + b"\r\n", 431),
        (b"GET /health HTTP/1.1\r\nX-Long: " + b"x" * 70_000 + b"\r\n\r\n", 431),
        (b"GET / \"garbage\" HTTP/1.1\r\n\r\n", 400),
        (b"\r\n" * 9 + b"GET /health HTTP/1.1\r\n\r\n", 400),  # empty lines past the 8 skipped
        (b" \r\nGET /health HTTP/1.1\r\n\r\n", 400),  # review 3: a line of blanks got no answer
        (b"\t\r\n", 400),
        (b"\r\r\nGET /health HTTP/1.1\r\n\r\n", 400),
        (b"\r\nGET /" + b"x" * 70_000 + b" HTTP/1.1\r\n\r\n", 414),
        (b"GET /health HTTP/1.1\r\n" + b"X-%d: %s\r\n" % (1, b"x" * 40_000) * 2 + b"\r\n", 431),  # 80 KB in all
    ],
)
def test_transport_level_errors_are_json_too(served: tuple[FleetServer, FleetIndex], request_bytes: bytes,
                                             status: int) -> None:  # fmt: skip
    server, _ = served
    host, port = server.server_address[:2]
    with socket.create_connection((str(host), port), timeout=5) as sock:
        sock.sendall(request_bytes)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.") and f" {status} ".encode() in head.split(b"\r\n")[0]
    assert b"Content-Type: application/json" in head  # before the fix: text/html
    assert json.loads(body)["error"]


def test_the_listen_backlog_takes_a_burst_of_connections(served: tuple[FleetServer, FleetIndex]) -> None:
    server, _ = served
    port = server.server_address[1]
    listing = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, timeout=10)
    if listing.returncode != 0 or not listing.stdout.strip():
        pytest.skip("ss cannot list listening sockets here")
    backlog = int(listing.stdout.split()[2])  # State Recv-Q Send-Q(backlog) ...
    assert backlog >= 128  # before the fix: 5, and a burst of connections waited a second for SYN retransmits


def test_the_request_timeout_help_says_what_the_code_does() -> None:
    done = subprocess.run([sys.executable, "-m", "kvtier.cli", "fleet", "serve", "--help"], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert "a whole request" in " ".join(done.stdout.split())  # before the fix: "may send or read nothing"


def test_empty_lines_before_a_request_line_are_skipped(served: tuple[FleetServer, FleetIndex]) -> None:
    """Review fleet3 #4 (RFC 9112 section 2.2): a request after an empty line (a client's CRLF after
    a body) got no answer at all, and on a kept-alive connection the request after it was lost."""
    server, _ = served
    host, port = server.server_address[:2]
    body = b'{"block_hashes": ["1f"]}'
    request = b"POST /v1/prefix HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    with socket.create_connection((str(host), port), timeout=5) as sock:
        sock.sendall(b"\r\n" + request + b"\r\n\n" + request)
        answer = b""
        while chunk := sock.recv(65536):  # (closed after request_timeout without another request)
            answer += chunk
    assert answer.count(b"HTTP/1.1 200 OK\r\n") == 2 and answer.startswith(b"HTTP/1.1 200")  # before: b""


def test_header_lines_under_64_kib_in_all_are_read(served: tuple[FleetServer, FleetIndex]) -> None:
    """Review fleet3 #5: header lines are bounded in all (64 KiB: a 431 past it, above), not only
    each and their number, which let a connection hold 6.25 MiB; less than that is still read."""
    server, _ = served
    headers = {f"X-{i}": "x" * 20_000 for i in range(3)}
    assert _request(server.url, "GET", "/health", headers=headers) == (200, {"ok": True})


def test_a_read_only_servers_health_follows_its_redis(tmp_path: Path) -> None:
    """Review fleet3: a --read-only reader's /health said {"ok": true} while its Redis was down
    and every answer was a 503: a load balancer kept sending it traffic. Now 503 naming Redis
    while it does not answer, 200 again once it does."""
    from redis_servers import REDIS_SERVER, start_redis

    if REDIS_SERVER is None:
        pytest.skip("redis-server not found on PATH")
    import redis

    server = start_redis(tmp_path / "redis")
    try:
        writer = FleetIndex(["a"], RedisMasks(redis.Redis.from_url(server.url), "fleet-t"))
        _fill(writer, [1, 2])
        proc, url = _serve("--redis", server.url, "--redis-prefix", "fleet-t", "--read-only")
        try:
            assert _request(url, "GET", "/health") == (200, {"ok": True})
            server.kill()
            time.sleep(0.6)  # (past the engine table's re-read interval)
            status, body = _request(url, "GET", "/health")
            assert status == 503 and "Redis did not answer" in body["error"], body  # before the fix: 200
            assert _post(url, {"block_hashes": [1, 2]})[0] == 503
            server.start()
            writer.keep_writer()  # (a running writer takes its lease again within 2 s: a reader wants one)
            time.sleep(0.6)
            assert _request(url, "GET", "/health") == (200, {"ok": True})
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0
    finally:
        server.stop()


def test_health_answers_while_every_answer_slot_is_taken() -> None:
    """Review fleet3: /health took one of the max_concurrent answer slots, so a server busy with
    slow prefix answers told a liveness probe 503 ("too many requests") and was restarted."""
    release = threading.Event()
    entered = threading.Event()

    class SlowAnswers:  # (a collaborator: the answers; the server under test is real)
        def prefix(self, keys: Sequence[int], engines: Sequence[str] | None = None) -> dict[str, Any]:
            entered.set()
            release.wait(10)
            return {}

        def meta(self) -> dict[str, Any]:
            return {"engines": {}}

    server = FleetServer(("127.0.0.1", 0), SlowAnswers(), tokens_per_hash=TOKENS, max_concurrent=1)  # type: ignore[arg-type]
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        busy = threading.Thread(target=_post, args=(server.url, {"block_hashes": [1]}), daemon=True)
        busy.start()
        assert entered.wait(5)
        assert _post(server.url, {"block_hashes": [2]})[0] == 503  # the one slot is taken
        assert _request(server.url, "GET", "/health") == (200, {"ok": True})  # before the fix: 503
        release.set()
        busy.join(10)
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def test_a_reader_does_not_answer_from_an_index_no_writer_keeps(tmp_path: Path) -> None:
    """Audit lead (2026-12-05): once the writer stopped (or was killed and its lease ran out),
    readers went on answering 200 from the index it left, frozen while the engines evicted and
    restarted, and reported each engine "synced". A reader now checks the writer's lease with
    each re-read of the engine table: 503 naming it while no writer holds one, 200 again once a
    writer (the same one restarted) keeps the index."""
    pytest.importorskip("zmq")
    from redis_servers import REDIS_SERVER, start_redis

    if REDIS_SERVER is None:
        pytest.skip("redis-server not found on PATH")
    import redis

    server = start_redis(tmp_path / "redis")
    engine = ("--engine", f"a=ipc://{tmp_path}/events", "--replay", f"a=ipc://{tmp_path}/replay")
    shared = ("--redis", server.url, "--redis-prefix", "fleet-t")
    procs: list[subprocess.Popen[str]] = []
    try:
        writer, _ = _serve(*shared, *engine)
        procs.append(writer)
        reader, url = _serve(*shared, "--read-only")
        procs.append(reader)
        assert _request(url, "GET", "/health") == (200, {"ok": True})
        status, body = _post(url, {"block_hashes": [1, 2]})
        assert status == 200 and body["engines"]["a"]["status"] == "waiting", body
        writer.send_signal(signal.SIGTERM)  # a clean stop gives the lease back at once
        assert writer.wait(20) == 0
        time.sleep(0.6)  # (a reader re-reads the table at most every 0.5 s)
        status, body = _request(url, "GET", "/health")
        assert status == 503 and "no fleet writer keeps the index under Redis prefix 'fleet-t'" in body["error"], body
        status, body = _post(url, {"block_hashes": [1, 2]})
        assert status == 503 and "fleet-t:writer" in body["error"], body  # before: 200, "a" still listed
        assert _request(url, "GET", "/v1/engines")[0] == 503
        writer, _ = _serve(*shared, *engine)  # the writer again: it claims the prefix, rebuilds the index
        procs.append(writer)
        time.sleep(0.6)
        assert _request(url, "GET", "/health") == (200, {"ok": True})
        assert _post(url, {"block_hashes": [1, 2]})[0] == 200
        # A writer that stops renewing its lease (killed -9, frozen, cut off from Redis): its lease
        # runs out, and readers then refuse (in-process here, with a 1 s lease for the test's sake).
        writer.send_signal(signal.SIGTERM)
        assert writer.wait(20) == 0
        frozen = FleetIndex(["a"], RedisMasks(redis.Redis.from_url(server.url), "fleet-t", writer_ttl=1))
        _fill(frozen, [1, 2])
        time.sleep(0.6)
        status, body = _post(url, {"block_hashes": [1, 2]})
        assert status == 200 and body["engines"]["a"]["blocks"] == 2, body
        time.sleep(1.5)  # (never renewed: the lease ran out)
        assert _request(url, "GET", "/health")[0] == 503
        assert _post(url, {"block_hashes": [1, 2]})[0] == 503
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(20) == 0
        server.stop()


def test_a_disconnected_engine_of_another_block_size_does_not_stop_answers_by_tokens() -> None:
    """Follow-up of the fleet audit (2026-12-05): with the new `disconnected` status, a dead engine
    of another block size (an old deployment, never restarted) still counted in the engines'
    block size, so every `tokens` request was a 409 for good. A disconnected engine's size counts
    only while no connected engine reports one."""
    index = FleetIndex(["a", "b"])
    for name, size in (("a", 16), ("b", 4)):
        hello = ControlRecord("hello", name, f"s-{name}", 0, time.time(), TIERS, {"tokens_per_hash": size})
        index.apply(name, WireBatch(time.time(), [WireEvent(Kind.CONTROL, control=hello)], 0))
    server = FleetServer(("127.0.0.1", 0), index)
    try:
        with pytest.raises(BadRequest, match=r"differs between them \(\[4, 16\]\)"):
            server.engines_tokens_per_hash()
        index.engine_connected("b", False)
        assert index.engine("b").status == "disconnected"
        assert server.engines_tokens_per_hash() == 16  # before: 409
        assert server.engines_tokens_per_hash(["b"]) == 4  # (asked about it alone: its own size)
        index.engine_connected("a", False)
        with pytest.raises(BadRequest, match="differs"):
            server.engines_tokens_per_hash()
        index.engine_connected("b", True)
        assert server.engines_tokens_per_hash() == 4
    finally:
        server.server_close()
