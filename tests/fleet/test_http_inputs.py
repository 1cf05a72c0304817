"""``kvtier fleet serve``'s HTTP answer to odd but well-defined input, over real sockets: a request
line without a version (HTTP/0.9), a body the client cuts short, ``Content-Length`` values with
whitespace or leading zeros, and block hashes given as strings that are not plain hex digits."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvtier.engine_events import ControlRecord, TierInfo
from kvtier.fleet import FleetIndex
from kvtier.fleet.http import FleetServer
from kvtier.fleet.records import Kind, WireBatch, WireEvent

TIMEOUT = 3.0  # the server's request_timeout: an answer well before it was not a timeout's
BODY = b'{"block_hashes":[1]}'  # 20 bytes


@pytest.fixture
def server() -> Iterator[FleetServer]:
    index = FleetIndex(["a"])
    hello = ControlRecord("hello", "e", "s1", 0, time.time(), (TierInfo("0:primary", "cpu", "cpu", "engine"),),
                          {"tokens_per_hash": 4})  # fmt: skip
    stored = WireEvent(Kind.STORED, (0x1, 0xFF, 0x10, 0xFFFFFFFFFFFFFFFF), "CPU")
    index.apply("a", WireBatch(time.time(), [WireEvent(Kind.CONTROL, control=hello), stored], 0))
    served = FleetServer(("127.0.0.1", 0), index, max_body=4096, max_blocks=64, request_timeout=TIMEOUT)
    threading.Thread(target=served.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield served
    finally:
        served.shutdown()
        served.server_close()


def _exchange(server: FleetServer, data: bytes, half_close: bool = False) -> tuple[bytes, float]:
    """Send ``data`` (then end the client's side: ``half_close``) and read until the server closes;
    the bytes answered and the seconds that took."""
    host, port = server.server_address[:2]
    with socket.create_connection((str(host), port), timeout=2 * TIMEOUT + 5) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        started = time.monotonic()
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer, time.monotonic() - started


def _answer(raw: bytes) -> tuple[int, dict[str, str], Any]:
    """The status, headers and JSON body of one HTTP/1.1 answer (AssertionError if it is not one)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 "), raw[:200]
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert headers["Content-Type"] == "application/json" and int(headers["Content-Length"]) == len(body), raw[:300]
    return int(lines[0].split()[1]), headers, json.loads(body)


def _post(server: FleetServer, length: str, body: bytes, half_close: bool = False) -> tuple[int, Any]:
    request = b"POST /v1/prefix HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %s\r\n\r\n%s"
    status, _, answer = _answer(_exchange(server, request % (length.encode(), body), half_close)[0])
    return status, answer


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /v1/prefix\r\n\r\n",  # a 405 with no status line nor headers, the bare JSON body
        b"GET /nope\r\n\r\n",  # the same, a 404
        b"GET /health?x=1\r\n\r\n",  # the same, a 400
        b"GET /health\r\n\r\n",  # a bare 200 body
        b"GET /health\r\n",  # a true HTTP/0.9 request: no answer, closed after request_timeout
        b"GET /health\r\nHost: x\r\n\r\n",
        b"POST /v1/prefix\r\nContent-Length: 2\r\n\r\n{}",
        b"\r\nGET /health\r\n",  # after an empty line skipped
    ],
)
def test_a_request_line_without_a_version_is_a_full_http11_400_at_once(server: FleetServer,
                                                                        request_bytes: bytes) -> None:  # fmt: skip
    """Review (HTTP/0.9 errors): docs/fleet.md says every error is an HTTP/1.1 answer with a JSON
    body; a request line of a method and a target alone got the answer's body without a status
    line or headers, or, with no header block after it, nothing until request_timeout."""
    raw, seconds = _exchange(server, request_bytes)
    assert seconds < TIMEOUT / 2, (raw[:100], seconds)  # before: 3 s and b"" for b"GET /health\r\n"
    status, headers, body = _answer(raw)  # before: b'{"error": ...}' alone
    assert status == 400 and headers["Connection"] == "close", raw[:300]
    assert "without an HTTP version" in body["error"] and "HTTP/0.9" in body["error"], body
    assert request_bytes.split()[1].decode() in body["error"]  # (the target quoted, cut short)


def test_a_request_with_a_version_is_still_answered_on_a_kept_alive_connection(server: FleetServer) -> None:
    raw, _ = _exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.0\r\n\r\n")
    assert raw.count(b"HTTP/1.1 200 OK\r\n") == 2 and raw.endswith(b'{"ok":true}'), raw


@pytest.mark.parametrize(
    ("length", "body", "names"),
    [
        ("100", BODY, "the body ended after 20 of 100 bytes"),  # before: 200, answered as if whole
        ("30", BODY[:15], "the body ended after 15 of 30 bytes"),  # before: 400 blaming the JSON
        ("0030", BODY[:15], "the body ended after 15 of 30 bytes"),
        ("5", b"", "the body ended after 0 of 5 bytes"),
    ],
)
def test_a_body_the_client_cuts_short_is_a_400_saying_so(server: FleetServer, length: str, body: bytes,
                                                         names: str) -> None:  # fmt: skip
    """Review (Content-Length): a client that ended its side (shutdown(SHUT_WR)) before sending all
    of its declared body was answered from the bytes that came."""
    started = time.monotonic()
    status, answer = _post(server, length, body, half_close=True)
    assert (status, answer["error"].split(" (")[0]) == (400, names), answer
    assert "Content-Length" in answer["error"] and time.monotonic() - started < TIMEOUT / 2


@pytest.mark.parametrize(
    "length",
    [
        "20 ",  # before: 411 "a Content-Length header of decimal digits is required"
        "20\t",
        " 20  ",
        "0000000000000000000020",  # before: 413 "body of 0000000000000000000020 bytes"
        "0" * 1000 + "20",
    ],
)
def test_a_content_length_is_judged_by_value(server: FleetServer, length: str) -> None:
    """Review (Content-Length): optional whitespace around the value (RFC 9110 section 5.5) was
    refused as not digits, and leading zeros as too large a body."""
    assert _post(server, "20", BODY) == _post(server, length, BODY)
    status, answer = _post(server, length, BODY)
    assert status == 200 and answer["blocks"] == 1 and answer["engines"]["a"]["blocks"] == 1, answer


def test_content_lengths_of_one_value_agree_and_still_bound_the_body(server: FleetServer) -> None:
    request = b"POST /v1/prefix HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\nContent-Length: 020 \r\n\r\n" + BODY
    status, _, answer = _answer(_exchange(server, request, half_close=True)[0])
    assert status == 200 and answer["blocks"] == 1, answer  # before: 400 "Content-Length headers disagree"
    request = b"POST /v1/prefix HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\nContent-Length: 21\r\n\r\n" + BODY
    status, _, answer = _answer(_exchange(server, request)[0])
    assert status == 400 and "disagree" in answer["error"], answer
    status, answer = _post(server, "0004097", b"")
    assert (status, answer["error"]) == (413, "body of 4097 bytes; at most 4096")
    digits = "00" + "9" * 60_000  # (a header line under 64 KiB: refused by its number of digits, not by int())
    status, answer = _post(server, digits, b"")
    assert status == 413 and answer["error"] == f"body of {'9' * 20}... (60000 digits) bytes; at most 4096"
    for bad in ("2 0", "+20", "-0", "20,20", "\u00b2", "\u0662\u0660", "0x14"):
        status, answer = _post(server, bad, BODY)
        assert status == 411 and "decimal digits" in answer["error"], (bad, answer)


def test_a_get_with_a_zero_content_length_keeps_the_connection(server: FleetServer) -> None:
    """A GET's ``Content-Length: 00`` (no body) was taken for a body left unread: the connection
    was closed after the first answer and the next request on it lost."""
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 00 \r\n"
    raw, _ = _exchange(server, request + b"\r\n" + request + b"Connection: close\r\n\r\n")
    assert raw.count(b"HTTP/1.1 200 OK\r\n") == 2, raw


@pytest.mark.parametrize("text", ["0x1", " 1 ", "1 ", "1_0", "+f", "-0", "\uff11", "\u0661", "", "1" * 17,
                                  "zz", "g", "1\n", "0X1", "f\u0301"])  # fmt: skip
def test_block_hashes_as_strings_are_hex_digits_only(server: FleetServer, text: str) -> None:
    """Review (hex leniency): ``int(s, 16)`` took ``0x1``, blanks, ``1_0`` (as 0x10), a sign, and
    non-ASCII digits (fullwidth, Arabic-Indic) as hashes: each answered 200."""
    body = json.dumps({"block_hashes": ["ff", text]}).encode()
    status, answer = _post(server, str(len(body)), body)
    assert status == 400, (text, answer)  # before: 200 for all but "zz", "g", "" and 17 digits
    assert answer["error"].startswith("block_hashes[1] must be an integer in [0, 2**64) or a string of 1 to 16 hex "
                                      "digits [0-9a-fA-F], got "), answer  # fmt: skip


def test_block_hashes_as_hex_digits_are_read_as_their_integers(server: FleetServer) -> None:
    for given in (["1", "ff", "10", "ffffffffffffffff"], ["0000000000000001", "FF", "0010", "FFFFFFFFFFFFFFFF"],
                  [1, 255, 16, (1 << 64) - 1], ["1", 255, "F", "0"]):  # fmt: skip
        body = json.dumps({"block_hashes": given}).encode()
        status, answer = _post(server, str(len(body)), body)
        expected = 2 if given[2] == "F" else 4  # (0xF and 0 are not held)
        assert status == 200 and answer["engines"]["a"]["blocks"] == expected, (given, answer)
