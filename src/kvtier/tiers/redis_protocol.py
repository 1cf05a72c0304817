"""A minimal RESP2 fast path for the Redis tier's bulk transfers.

redis-py handles connecting (URL, TLS, AUTH/ACL user, SELECT, cluster
topology); this module moves the bytes over a connection redis-py has already
set up, because redis-py's reply parser copies every value through a
``BytesIO`` and returns ``bytes`` that would then be copied again into the CPU
row. Here:

* commands are sent as a list of pieces: small pieces are joined, large values
  (the CPU-row payload) are passed as memoryviews, so nothing is concatenated;
  a command goes out in one scatter-gather ``sendmsg`` (one system call per
  stored value, where redis-py makes two);
* replies are read by :class:`RespReader`, which reads bulk strings straight
  into a caller's buffer with ``recv_into`` (the CPU row of a load).

Only the reply types the tier uses are parsed: simple strings, errors,
integers and bulk strings (including null); arrays of those only where one is
expected (:meth:`RespReader.read_array`, ``EXEC``'s reply), else they raise
:class:`RespProtocolError`. Nothing read is ever evaluated.

All functions run on the tier's I/O threads and block on the socket, bounded
by the socket timeout redis-py configured on it; a :class:`RespReader` given a
``timeout`` also bounds the whole batch of replies it reads (a slow link that
delivers a little within every socket timeout cannot keep a read going).
"""

from __future__ import annotations

import os
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

_CRLF = b"\r\n"
_JOIN_LIMIT = 16 * 1024
_IOV_MAX = max(16, min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024))

Piece = bytes | memoryview


class RespProtocolError(ConnectionError):
    """The server sent something this reader does not expect; the connection is unusable."""


@dataclass(frozen=True)
class ErrorReply:
    """A ``-ERR ...`` reply (e.g. ``MOVED``, ``OOM``); the connection stays usable."""

    message: str

    @property
    def is_redirect(self) -> bool:
        return self.message.startswith(("MOVED ", "ASK ", "CLUSTERDOWN", "TRYAGAIN"))


def pack_command(out: list[Piece], *args: bytes | memoryview) -> None:
    """Append the RESP encoding of one command to ``out``.

    Arguments longer than a few KiB (payloads) are appended as-is, so a
    memoryview of a CPU row is sent without a copy; the rest is joined.
    """
    parts: list[bytes] = [b"*%d\r\n" % len(args)]
    for arg in args:
        n = arg.nbytes if isinstance(arg, memoryview) else len(arg)
        if n > _JOIN_LIMIT:
            parts.append(b"$%d\r\n" % n)
            out.append(b"".join(parts))
            out.append(arg)
            parts = [_CRLF]
        else:
            parts.append(b"$%d\r\n" % n)
            parts.append(bytes(arg))
            parts.append(_CRLF)
    out.append(b"".join(parts))


class SetEncoder:
    """RESP of ``SET <key> <header + payload> [PX <ms>]`` for values of one fixed length.

    The store path's per-value encoding: the parts that never change (argument
    count, value length, the ``PX`` tail) are built once, so a value costs one
    small ``bytes`` formatting and three list appends; the payload (a
    memoryview of a CPU row) is appended as-is, never copied.
    """

    def __init__(self, value_len: int, px: bytes | None = None) -> None:
        self.value_len = value_len
        self._head = b"*%d\r\n$3\r\nSET\r\n" % (5 if px is not None else 3)
        self._value_head = b"$%d\r\n" % value_len
        self._tail = _CRLF if px is None else b"\r\n$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(px), px)

    def pack(self, out: list[Piece], key: bytes, header: bytes, payload: memoryview) -> None:
        """Append the command for ``key`` = ``header + payload``; raises ValueError on another length."""
        if len(header) + payload.nbytes != self.value_len:
            raise ValueError(f"value of {len(header) + payload.nbytes} bytes, this encoder packs {self.value_len}")
        out.append(b"%s$%d\r\n%s\r\n%s%s" % (self._head, len(key), key, self._value_head, header))
        out.append(payload)
        out.append(self._tail)


def coalesce(pieces: list[Piece]) -> list[Piece]:
    """Join consecutive small pieces so each ``sendall`` moves a useful amount."""
    out: list[Piece] = []
    pending: list[bytes] = []
    size = 0
    for piece in pieces:
        if isinstance(piece, memoryview) and piece.nbytes > _JOIN_LIMIT:
            if pending:
                out.append(b"".join(pending))
                pending, size = [], 0
            out.append(piece)
        else:
            b = bytes(piece)
            pending.append(b)
            size += len(b)
            if size >= 64 * 1024:
                out.append(b"".join(pending))
                pending, size = [], 0
    if pending:
        out.append(b"".join(pending))
    return out


def _nbytes(piece: Piece) -> int:
    return piece.nbytes if isinstance(piece, memoryview) else len(piece)


def send_pieces(sock: socket.socket, pieces: list[Piece], *, deadline: float | None = None) -> None:
    """Send every piece, in order, with as few system calls as the socket allows.

    On a plain TCP or Unix socket the pieces go out as one scatter-gather
    ``sendmsg`` (a command's head, its value header and the CPU-row payload in
    one call, nothing joined or copied in Python), repeated only for what the
    kernel did not take. TLS sockets cannot ``sendmsg``: they get one
    ``sendall`` per coalesced piece. Bounded like ``sendall``: the whole call
    may take at most the socket's timeout (or, given ``deadline``, a
    ``time.monotonic()`` instant: a batch's), else ``TimeoutError``, raised
    before a send that would start past it (so it overruns by one send, one
    socket timeout at most); other failures raise ``OSError`` from the socket.
    """
    timeout = sock.gettimeout()
    if deadline is None and timeout is not None:
        deadline = time.monotonic() + timeout
    if isinstance(sock, ssl.SSLSocket):
        for piece in coalesce(pieces):
            _check_send_deadline(deadline)
            sock.sendall(piece)
        return
    bufs: list[Piece] = [p for p in pieces if _nbytes(p)]
    start = 0
    while start < len(bufs):
        # Checked before each send, not only after a partial one: a kernel that takes each
        # call's bytes whole, after waiting for room, would otherwise never be found late.
        _check_send_deadline(deadline)
        sent = sock.sendmsg(bufs[start : start + _IOV_MAX])
        while sent:
            n = _nbytes(bufs[start])
            if sent >= n:
                sent -= n
                start += 1
            else:
                bufs[start] = memoryview(bufs[start])[sent:]
                sent = 0


def _check_send_deadline(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError("sending to Redis overran its deadline (the socket timeout, plus the bytes sent at "
                           "the tier's min_read_mib_per_second)")  # fmt: skip


class RespReader:
    """Reads RESP2 replies from a socket, bulk payloads straight into caller buffers.

    One reader per connection per batch; it must consume exactly the replies
    of the commands sent, so the connection can go back to its pool clean.

    With ``timeout``, the whole batch has a deadline: ``timeout`` seconds from the
    reader's creation for the replies to start, plus ``sent / bytes_per_second`` for the
    values just sent (``sent``: bytes the kernel may still be passing to the server, which
    replies only once it has them all), plus ``length / bytes_per_second`` for each bulk
    reply as its length is announced, plus what :meth:`allow` adds. A receive that returns
    past the deadline raises ``TimeoutError`` (so a read overruns it by one socket timeout
    at most), naming the direction that was slow; the connection is then unusable.
    """

    def __init__(
        self,
        sock: socket.socket,
        bufsize: int = 64 * 1024,
        *,
        timeout: float | None = None,
        bytes_per_second: float = float("inf"),
        sent: int = 0,
    ) -> None:
        self._sock = sock
        self._buf = bytearray(bufsize)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._budget = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._rate = bytes_per_second
        self._sent = sent
        self._received = 0
        self._allow(sent)

    def _allow(self, nbytes: int) -> None:
        # ``nbytes`` more to move (a bulk reply announced, values sent): the deadline grows.
        if self._deadline is not None and self._budget is not None and nbytes > 0:
            self._budget += nbytes / self._rate
            self._deadline += nbytes / self._rate

    def allow(self, nbytes: int) -> None:
        """Give the batch ``nbytes / bytes_per_second`` more seconds: work the server does before
        it replies that its replies' sizes do not show (e.g. a value it reads for a script)."""
        self._allow(nbytes)

    def _recv_into(self, view: memoryview) -> int:
        got = self._sock.recv_into(view)
        if got == 0:
            raise ConnectionResetError("Redis closed the connection")
        self._received += got
        if self._deadline is not None and time.monotonic() > self._deadline:
            if self._sent and self._received == got:
                raise TimeoutError(
                    f"Redis had not acknowledged the {self._sent} bytes sent to it within {self._budget:.2f}s "
                    "(a link, to the server or back, slower than the tier's min_read_mib_per_second, which "
                    "bounds stores too)"
                )
            raise TimeoutError(
                f"reading replies from Redis took longer than {self._budget:.2f}s "
                "(a link slower than the tier's min_read_mib_per_second)"
            )
        return got

    def _fill(self, max_bytes: int) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end + max_bytes > len(self._buf):
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
        room = min(max_bytes, len(self._buf) - self._end)
        self._end += self._recv_into(self._view[self._end : self._end + room])

    def _read_line(self, max_fill: int) -> bytes:
        while True:
            i = self._buf.find(_CRLF, self._start, self._end)
            if i >= 0:
                line = bytes(self._buf[self._start : i])
                self._start = i + 2
                return line
            if self._end - self._start >= len(self._buf) - 1:
                raise RespProtocolError("reply line longer than the read buffer")
            self._fill(max_fill)

    def read_into(self, dest: memoryview) -> None:
        """Fill ``dest`` exactly with the next bytes of the stream."""
        n = dest.nbytes
        got = min(n, self._end - self._start)
        if got:
            dest[:got] = self._view[self._start : self._start + got]
            self._start += got
        while got < n:
            got += self._recv_into(dest[got:])

    def _skip_crlf(self) -> None:
        crlf = bytearray(2)
        self.read_into(memoryview(crlf))
        if crlf != _CRLF:
            raise RespProtocolError("bulk string not terminated by CRLF")

    def read_reply(self) -> bytes | int | ErrorReply | None:
        """One reply: simple/bulk string as bytes, integer, None (null) or :class:`ErrorReply`."""
        line = self._read_line(len(self._buf))
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b":":
            return int(rest)
        if kind == b"-":
            return ErrorReply(rest.decode("utf-8", "replace"))
        if kind == b"_":  # RESP3 null
            return None
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            self._allow(n)
            data = bytearray(n)
            self.read_into(memoryview(data))
            self._skip_crlf()
            return bytes(data)
        raise RespProtocolError(f"unexpected RESP reply type {kind!r}")

    def read_array(self) -> list[bytes | int | ErrorReply | None] | ErrorReply | None:
        """One array reply of scalar replies (``EXEC``'s), None for a null array (an ``EXEC``
        aborted by ``WATCH``), or :class:`ErrorReply`."""
        n = self._reply_header(b"*", "an array", len(self._buf))
        if n is None or isinstance(n, ErrorReply):
            return n
        return [self.read_reply() for _ in range(n)]

    def _bulk_length(self, line_limit: int) -> int | ErrorReply | None:
        """The header of a bulk-string reply: its length (checked against the reply budget),
        None for a null reply, or :class:`ErrorReply`; any other reply type is a protocol error."""
        n = self._reply_header(b"$", "a bulk string", line_limit)
        if isinstance(n, int):
            self._allow(n)
        return n

    def _reply_header(self, kind: bytes, what: str, line_limit: int) -> int | ErrorReply | None:
        """The header line of a reply expected to be of type ``kind`` (``what``, for the error):
        its count, None for a null reply (RESP3's ``_`` or a negative count), or :class:`ErrorReply`;
        any other reply type is a protocol error."""
        line = self._read_line(line_limit)
        got, rest = line[:1], line[1:]
        if got == b"-":
            return ErrorReply(rest.decode("utf-8", "replace"))
        if got == b"_":  # RESP3 null
            return None
        if got != kind:
            raise RespProtocolError(f"expected {what}, got reply type {got!r}")
        n = int(rest)
        return None if n < 0 else n

    def read_bulk_chunks(self, consume: Callable[[memoryview], None]) -> int | ErrorReply | None:
        """One bulk-string reply, handed to ``consume`` piece by piece (at most 1 MiB each, into
        a scratch buffer reused: ``consume`` must not keep the view) instead of kept whole.
        Returns its length, None for a null reply, or :class:`ErrorReply`."""
        n = self._bulk_length(len(self._buf))
        if n is None or isinstance(n, ErrorReply):
            return n
        scratch = memoryview(bytearray(min(n, 1 << 20) or 1))
        left = n
        while left > 0:
            step = min(left, scratch.nbytes)
            self.read_into(scratch[:step])
            consume(scratch[:step])
            left -= step
        self._skip_crlf()
        return n

    def read_bulk_split(self, head: memoryview, body: memoryview) -> int | ErrorReply | None:
        """Read one bulk-string reply expected to be ``len(head) + len(body)`` bytes long.

        On that exact length the first bytes land in ``head`` and the rest in
        ``body`` (zero extra copies for the body) and the length is returned.
        Any other length is consumed (its first bytes, as many as ``head`` holds,
        land in ``head``; the rest is discarded) and its length returned, so the
        caller can tell a truncated value from another release's; None is a null reply
        (missing key); an error reply is returned as :class:`ErrorReply`.
        """
        n = self._bulk_length(64 + head.nbytes)
        if n is None or isinstance(n, ErrorReply):
            return n
        if n == head.nbytes + body.nbytes:
            self.read_into(head)
            self.read_into(body)
        else:
            first = min(n, head.nbytes)
            self.read_into(head[:first])
            self.discard(n - first)
        self._skip_crlf()
        return n

    def discard(self, n: int) -> None:
        """Consume ``n`` bytes without keeping them."""
        scratch = memoryview(bytearray(min(n, 1 << 20) or 1))
        while n > 0:
            step = min(n, scratch.nbytes)
            self.read_into(scratch[:step])
            n -= step
