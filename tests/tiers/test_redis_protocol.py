"""The RESP fast path of the Redis tier, over a real socket pair (byte-level edge cases)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvtier.tiers.redis_protocol import (
    ErrorReply,
    Piece,
    RespProtocolError,
    RespReader,
    SetEncoder,
    pack_command,
    send_pieces,
)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.settimeout(2.0)
    b.settimeout(2.0)
    yield a, b
    a.close()
    b.close()


def feed(sock: socket.socket, data: bytes, chunk: int = 7) -> threading.Thread:
    """Send ``data`` in tiny pieces from another thread, to exercise partial reads."""

    def run() -> None:
        for i in range(0, len(data), chunk):
            sock.sendall(data[i : i + chunk])

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_pack_command_and_bulk_value_are_valid_resp() -> None:
    out: list[Piece] = []
    pack_command(out, b"GET", b"k1")
    assert b"".join(bytes(p) for p in out) == b"*2\r\n$3\r\nGET\r\n$2\r\nk1\r\n"
    payload = memoryview(bytes(range(256)) * 100)  # large: must be passed through, not copied
    value = b"HEAD" + bytes(payload)
    for px, tail in ((b"1000", b"$2\r\nPX\r\n$4\r\n1000\r\n"), (None, b"")):
        out = []
        SetEncoder(len(value), px).pack(out, b"key", b"HEAD", payload)
        assert any(p is payload for p in out)
        wire = b"".join(bytes(p) for p in out)
        argc = 5 if px else 3
        assert wire == b"*%d\r\n$3\r\nSET\r\n$3\r\nkey\r\n$%d\r\n%s\r\n%s" % (argc, len(value), value, tail)
    with pytest.raises(ValueError, match="this encoder packs"):
        SetEncoder(len(value) + 1).pack([], b"key", b"HEAD", payload)


def test_reader_parses_scalar_replies_across_partial_reads(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    thread = feed(a, b"+OK\r\n:42\r\n-ERR bad thing\r\n$-1\r\n_\r\n$5\r\nhello\r\n$0\r\n\r\n")
    reader = RespReader(b, bufsize=16)
    assert reader.read_reply() == b"OK"
    assert reader.read_reply() == 42
    assert reader.read_reply() == ErrorReply("ERR bad thing")
    assert reader.read_reply() is None
    assert reader.read_reply() is None
    assert reader.read_reply() == b"hello"
    assert reader.read_reply() == b""
    thread.join()


def test_bulk_split_reads_into_buffers_and_flags_other_lengths(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    good = bytes(range(10)) + bytes(range(100, 200))
    short = b"xyz"
    thread = feed(a, b"$%d\r\n%s\r\n$3\r\n%s\r\n$-1\r\n-MOVED 12 127.0.0.1:1\r\n" % (len(good), good, short), 13)
    reader = RespReader(b, bufsize=32)
    head, body = bytearray(10), bytearray(100)
    assert reader.read_bulk_split(memoryview(head), memoryview(body)) == len(good)
    assert bytes(head) + bytes(body) == good
    head2, body2 = bytearray(10), bytearray(100)
    assert reader.read_bulk_split(memoryview(head2), memoryview(body2)) == 3
    assert body2 == bytearray(100), "a value of the wrong length must not be written into the row"
    assert reader.read_bulk_split(memoryview(head2), memoryview(body2)) is None
    reply = reader.read_bulk_split(memoryview(head2), memoryview(body2))
    assert isinstance(reply, ErrorReply) and reply.is_redirect
    thread.join()


def test_reader_rejects_malformed_streams(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(b"*1\r\n")
    with pytest.raises(RespProtocolError, match="unexpected RESP reply type"):
        RespReader(b).read_reply()
    a.sendall(b"$3\r\nabcXY")
    with pytest.raises(RespProtocolError, match="CRLF"):
        RespReader(b).read_reply()


def test_reader_reports_a_closed_connection(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(b"$10\r\nabc")
    a.close()
    with pytest.raises(ConnectionError):
        RespReader(b).read_reply()


def test_send_pieces_sends_everything(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    big = memoryview(bytes(range(256)) * 4096)  # 1 MiB, more than the socket buffer
    pieces: list[Piece] = [b"a", b"b", big, b"c"]
    received = bytearray()

    def drain() -> None:
        while len(received) < 3 + big.nbytes:
            received.extend(b.recv(1 << 16))

    thread = threading.Thread(target=drain)
    thread.start()
    send_pieces(a, pieces)
    thread.join(5)
    assert bytes(received) == b"ab" + bytes(big) + b"c"


def test_send_pieces_gathers_more_pieces_than_one_sendmsg_takes(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    pieces: list[Piece] = [bytes([i % 251]) * (i % 5) for i in range(3000)]  # > IOV_MAX, some empty
    pieces.insert(1500, memoryview(b"x" * 300_000))
    expected = b"".join(bytes(p) for p in pieces)
    received = bytearray()

    def drain() -> None:
        while len(received) < len(expected):
            received.extend(b.recv(1 << 16))

    thread = threading.Thread(target=drain)
    thread.start()
    send_pieces(a, pieces)
    thread.join(5)
    assert bytes(received) == expected


def test_send_pieces_gives_up_after_the_socket_timeout_when_the_peer_stops_reading(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, _ = pair
    a.settimeout(0.2)
    big = memoryview(bytes(16 << 20))  # far more than the socket buffers hold
    with pytest.raises(TimeoutError):
        send_pieces(a, [b"head", big])


def test_reader_bounds_the_whole_batch_when_every_receive_is_within_the_socket_timeout(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """Regression (review, 2026-12-03): a peer that sent a little within each socket timeout kept a
    bulk read going without limit."""
    a, b = pair
    stop = threading.Event()

    def trickle() -> None:
        b.sendall(b"$100000\r\n")
        while not stop.is_set():
            b.sendall(b"x" * 100)
            time.sleep(0.01)

    thread = threading.Thread(target=trickle)
    thread.start()
    try:
        reader = RespReader(a, timeout=0.2, bytes_per_second=1e6)  # 0.2 s + 0.1 s for the value
        head, body = bytearray(10), bytearray(100000 - 10)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"took longer than 0\.30s"):
            reader.read_bulk_split(memoryview(head), memoryview(body))
        assert time.monotonic() - started < 1.0
    finally:
        stop.set()
        thread.join()


def test_a_reader_after_sending_values_gives_them_time_and_names_the_direction_when_late(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """Regression (review, 2026-12-03, D6): a store's replies had no time for the values still on
    their way to the server, and a late acknowledgement was blamed on reading replies."""
    a, b = pair
    late = threading.Timer(0.25, b.sendall, (b"+OK\r\n",))
    late.start()
    try:
        reader = RespReader(a, timeout=0.1, bytes_per_second=1e6, sent=300_000)  # 0.1 s + 0.3 s
        assert reader.read_reply() == b"OK"
    finally:
        late.join()
    late = threading.Timer(0.25, b.sendall, (b"+OK\r\n",))
    late.start()
    try:
        reader = RespReader(a, timeout=0.1, bytes_per_second=1e6, sent=50_000)  # 0.1 s + 0.05 s
        with pytest.raises(TimeoutError, match=r"had not acknowledged the 50000 bytes sent to it within 0\.15s"):
            reader.read_reply()
    finally:
        late.join()


def test_reader_parses_exec_arrays_and_streams_bulk_replies_in_pieces(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """The delete of a corrupt value reads EXEC's array (null when a WATCH aborted it) and compares
    a GET reply piece by piece instead of keeping it whole."""
    a, b = pair
    big = bytes(range(256)) * 5000  # over 1 MiB: two pieces
    thread = feed(a, b"*1\r\n:1\r\n*-1\r\n*0\r\n-EXECABORT x\r\n$%d\r\n%s\r\n$-1\r\n-NOPERM no\r\n" % (len(big), big),
                  chunk=65536)  # fmt: skip
    reader = RespReader(b, bufsize=16)
    assert reader.read_array() == [1]
    assert reader.read_array() is None
    assert reader.read_array() == []
    assert reader.read_array() == ErrorReply("EXECABORT x")
    pieces: list[bytes] = []
    assert reader.read_bulk_chunks(lambda view: pieces.append(bytes(view))) == len(big)
    assert b"".join(pieces) == big and len(pieces) == 2
    assert reader.read_bulk_chunks(pieces.append) is None
    assert reader.read_bulk_chunks(pieces.append) == ErrorReply("NOPERM no")
    thread.join()
