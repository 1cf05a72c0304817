"""``kvtier fleet serve``'s HTTP/JSON answer for routers (the standard library's HTTP server).

Endpoints:

* ``POST /v1/prefix`` with ``{"tokens": [..]}`` (a prompt's token ids; hashed as the
  engines hash them, :mod:`kvtier.fleet.hashing`) or ``{"block_hashes": [..]}`` (the
  blocks' hashes as KV events carry them: integers in [0, 2**64), or strings of 1 to 16 ASCII
  hex digits, ``[0-9a-fA-F]``, nothing else: no ``0x``, sign, blank or ``_``), optionally
  ``"engines": [names]`` (each one the index knows: its engine table lists it, nothing heard from
  it yet or not; else 400 naming them) and ``"group"`` (the KV-cache group, default 0).
  Answer: ``{"blocks": n, "tokens_per_hash": t, "engines": {name: {"blocks": b, "tokens":
  b*t, "tiers": {"GPU": ., "0:primary": ., "1:fs": .}, "status": ., "start": .}}}``:
  per engine the leading blocks held by any of its tiers and by each tier.
* ``GET /v1/engines``: each engine's start, status (``synced``: the index has every
  event of its start; ``partial``: some were lost and its device cache or private tiers
  are incomplete until a snapshot or a clear; ``waiting``: nothing heard yet;
  ``disconnected``: the connection to its events endpoint is down, the engine stopped or was
  killed), tiers, counters and the last markers it sent.
* ``GET /health``: ``{"ok": true}``, or 503 with an ``error`` when the index no longer
  follows the engines (``health``; ``kvtier fleet serve``'s writer: the subscriber thread
  stopped, another writer took the Redis prefix over, the writer does not hold its claim on the
  prefix (it ran out and is not yet taken again, the index under it rebuilt), or every write to
  the index's Redis has failed for ``failing_writes_grace`` seconds, 5 by default, counted from
  when the first failed write was sent, with none going through since: 200 again once one does,
  within about 2 s of Redis answering again; a ``--read-only`` reader: its last read of the
  engine table from Redis failed, or found no writer holding its claim on the prefix). It
  takes none of the ``max_concurrent`` answer slots: a server busy answering is not unhealthy.

A path of these asked with another method (PUT, DELETE, PATCH and OPTIONS too) is answered 405
with an ``Allow`` header naming the method to use; any other path 404; a path of these with a
query string 400 naming it (the API takes no parameters there); the connection is closed after
each. HEAD and other methods get the standard library's 501.

It is a network service and its input is untrusted: a request line must stay under 64 KiB
(else 414) and name its HTTP version (an HTTP/0.9 request line, ``GET /health`` alone, is a 400
at once, answered as HTTP/1.1 like every error: a status line, headers and a JSON body), its
header lines under 64 KiB in all (else 431), a request body must declare its length (one
``Content-Length`` of decimal digits, judged by value: whitespace around them and leading zeros
are allowed; a ``Transfer-Encoding`` is 411, lengths that disagree 400), stay under ``max_body``
bytes and arrive whole (a body the client ends early, closing its side, is a 400 saying how many
of its bytes came), a prompt under ``max_blocks`` blocks; every
field is type- and range-checked (errors are 4xx with a JSON ``error`` naming the
field); a request (its line, headers and body) must arrive within ``request_timeout``
seconds of its first byte, or of the previous answer on a kept-alive connection, else
the connection is closed (a client that sends a byte now and then holds no thread); a
connection's answers may wait for the client to read them ``request_timeout`` seconds in
all (whole again whenever the client has taken everything sent before), and no answer slot is
held while they wait, nor while a request's body arrives (a client that reads at a trickle is
dropped too); at
most ``max_concurrent`` requests are answered at once (more get 503 at once) and at most
four times that many connections are open (more are closed at once). Up to 8 empty lines
before a request line are skipped (RFC 9112 section 2.2). Bind it to a private address: it has
no authentication.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import Any, Protocol, cast

from kvtier.errors import ConfigError
from kvtier.fleet.hashing import BlockHasher
from kvtier.fleet.masks import StoreUnavailable
from kvtier.fleet.records import MAX_GROUP, block_key
from kvtier.http_server import BoundedHTTPServer, DeadlineRequestHandler

logger = logging.getLogger(__name__)

_MAX_TOKEN = (1 << 31) - 1
_MAX_HASH = (1 << 64) - 1
_MAX_HASHERS = 8  # block sizes whose hashers are kept (the engines' info names the size)
_EMPTY_LINES = 8  # empty lines skipped before a request line (RFC 9112 2.2: a server SHOULD ignore one at least)
_MAX_LINE = 65536  # the standard library's bound on a request line
_MAX_HEADER_BYTES = 64 << 10  # a request's header lines in all (the standard library bounds each, and how many)
_UNAVAILABLE_LOG_EVERY = 60.0
"""Seconds between log lines of 503 answers for one reason (see :meth:`FleetServer.log_unavailable`)."""
_MAX_UNAVAILABLE_REASONS = 64
"""Reasons remembered for that (forgotten all at once beyond it: a reason naming a changing detail)."""
_ROUTES = {"/v1/prefix": "POST", "/v1/engines": "GET", "/health": "GET"}  # path -> the one method it answers
_QUOTED = 8  # names an error quotes (an unknown engine's, the known ones), the rest counted
_HEX_HASH = re.compile(r"[0-9a-fA-F]{1,16}")
"""A block hash given as a string (``int(s, 16)`` alone took ``0x1``, `` 1 ``, ``1_0``, ``+f`` and
non-ASCII digits such as ``"\\u0661"``)."""
_MAX_LENGTH_DIGITS = 18  # a Content-Length's digits (leading zeros aside) judged by value; more is too large

try:  # Linux: the bytes a socket sent that its peer has not taken yet (SIOCOUTQ)
    import fcntl
    import termios

    _OUTQ: int | None = termios.TIOCOUTQ
except (ImportError, AttributeError):  # pragma: no cover (not Linux)
    _OUTQ = None


def _unsent(sock: socket.socket) -> int | None:
    """How many bytes written to ``sock`` its peer has not acknowledged yet (None: not known here)."""
    if _OUTQ is None:
        return None
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"))[0])
    except OSError:
        return None


class PrefixAnswers(Protocol):
    """What the server asks: a :class:`~kvtier.fleet.index.FleetIndex` or a :class:`~kvtier.fleet.index.FleetReader`."""

    def prefix(self, keys: Sequence[int], engines: Sequence[str] | None = None) -> dict[str, Any]: ...

    def meta(self) -> dict[str, Any]: ...


class BadRequest(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class FleetServer(BoundedHTTPServer):
    """The HTTP server (see the module docstring). ``hashing``: (algorithm, seed) of the
    engines' block hashes; ``tokens_per_hash``: their block size (None: taken from the
    engines' events, which must agree); ``health()``: None while the index is sound, else why
    not (``GET /health`` answers 503 with it). ``max_body``, ``max_blocks`` and
    ``max_concurrent`` are integers >= 1 and ``request_timeout`` a finite number of seconds > 0,
    else :class:`~kvtier.errors.ConfigError` naming it (``max_concurrent=0`` made a server that
    closed every connection unanswered, ``/health`` included). Serve with ``serve_forever()``;
    stop with ``shutdown()`` then ``server_close()``."""

    allow_reuse_address = True
    log = logger
    label = "fleet"

    def __init__(
        self,
        address: tuple[str, int],
        answers: PrefixAnswers,
        *,
        hashing: tuple[str, str | None] = ("sha256", None),
        tokens_per_hash: int | None = None,
        max_body: int = 1 << 20,
        max_blocks: int = 16384,
        request_timeout: float = 5.0,
        max_concurrent: int = 32,
        health: Callable[[], str | None] | None = None,
    ) -> None:
        for name, value in (("max_body", max_body), ("max_blocks", max_blocks), ("max_concurrent", max_concurrent)):
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r:.40}")
        if isinstance(request_timeout, bool) or not isinstance(request_timeout, int | float) or not (
            0 < request_timeout < math.inf
        ):
            raise ConfigError(f"request_timeout must be a finite number of seconds > 0, got {request_timeout!r:.40}")
        self.answers = answers
        self.health = health
        self.hashing = hashing
        self.tokens_per_hash = tokens_per_hash
        self.max_body = max_body
        self.max_blocks = max_blocks
        self.request_timeout = request_timeout
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._unavailable_lock = threading.Lock()
        self._unavailable: dict[str, tuple[float, int]] = {}  # 503 reason -> (last logged, answers since)
        self._hashers: dict[int, BlockHasher] = {}
        if tokens_per_hash is not None:
            self._hasher(tokens_per_hash)  # check the hashing settings now
        # socketserver's listen backlog is 5: a burst of connections waited for SYN retransmits (1 s and more)
        self.request_queue_size = max(socket.SOMAXCONN, 4 * max_concurrent)
        super().__init__(address, _Handler, 4 * max_concurrent)  # (each open connection has a thread)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = host if isinstance(host, str) else host.decode()
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def log_unavailable(self, path: str, reason: str) -> None:
        """Log a 503 answered for ``reason``: the first at once, then at most one line per reason
        every :data:`_UNAVAILABLE_LOG_EVERY` seconds saying how many more were answered (a Redis
        down or a writer gone makes every request one). Request threads."""
        now = time.monotonic()
        with self._unavailable_lock:
            logged, since = self._unavailable.get(reason, (-math.inf, 0))
            if now - logged < _UNAVAILABLE_LOG_EVERY:
                self._unavailable[reason] = (logged, since + 1)
                return
            if len(self._unavailable) >= _MAX_UNAVAILABLE_REASONS:
                self._unavailable.clear()
            self._unavailable[reason] = (now, 0)
        more = f" ({since} more such answers since the last line)" if since else ""
        logger.warning("fleet: request %s: answered 503: %s%s", path[:100], reason, more)

    def _hasher(self, tokens_per_hash: int) -> BlockHasher:
        hasher = self._hashers.get(tokens_per_hash)
        if hasher is None:
            if len(self._hashers) >= _MAX_HASHERS:
                self._hashers.clear()
            hasher = self._hashers[tokens_per_hash] = BlockHasher(*self.hashing, tokens_per_hash=tokens_per_hash)
        return hasher

    def engines_tokens_per_hash(self, engines: Sequence[str] | None = None) -> int:
        """``--tokens-per-hash``, else the block size the engines (those named, or all) report;
        an engine reporting anything but a positive integer is left out (and named if no size is
        left), and so is a ``disconnected`` one while any connected engine reports a size (a dead
        engine of another block size made every ``tokens`` request a 409 for good)."""
        if self.tokens_per_hash is not None:
            return self.tokens_per_hash
        known = self.answers.meta().get("engines", {})
        sizes: set[int] = set()
        gone: set[int] = set()  # sizes only disconnected engines report
        odd: list[str] = []
        for name in known if engines is None else [e for e in engines if e in known]:
            info = known[name].get("info")
            size = info.get("tokens_per_hash") if isinstance(info, dict) else None
            if type(size) is int and size >= 1:
                (gone if known[name].get("status") == "disconnected" else sizes).add(size)
            elif size is not None:
                odd.append(f"{name!r:.80} reported {size!r:.40}")
        sizes = sizes or gone
        if len(sizes) != 1:
            raise BadRequest(
                HTTPStatus.CONFLICT,
                "the engines' tokens per block is not known yet or differs between them "
                f"({sorted(sizes)}{'; ' if odd else ''}{', '.join(odd[:4])}): start the server with "
                "--tokens-per-hash, or ask by block_hashes",
            )
        return sizes.pop()

    def answer_prefix(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise BadRequest(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
        unknown = set(body) - {"tokens", "block_hashes", "engines", "group"}
        if unknown:
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"unknown field(s) {sorted(unknown)}: use tokens or "
                             "block_hashes, and optionally engines and group")  # fmt: skip
        engines = body.get("engines")
        if engines is not None and (
            not isinstance(engines, list) or len(engines) > 1024 or not all(isinstance(e, str) for e in engines)
        ):
            raise BadRequest(HTTPStatus.BAD_REQUEST, "engines must be a list of engine names")
        if ("tokens" in body) == ("block_hashes" in body):
            raise BadRequest(HTTPStatus.BAD_REQUEST, "give exactly one of tokens and block_hashes")
        group = body.get("group", 0)
        if type(group) is not int or not 0 <= group <= MAX_GROUP:
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"group must be an integer in [0, {MAX_GROUP}], got {group!r:.40}")
        if engines is not None:
            self._check_engines(engines)
        size: int | None
        if "tokens" in body:
            size = self.engines_tokens_per_hash(engines)
            hashes = self._hasher(size).event_hashes(self._tokens(body["tokens"], size))
            keys = [block_key(h, group) for h in hashes] if group else hashes
        else:
            keys = self._keys(body["block_hashes"], group)
            try:
                size = self.engines_tokens_per_hash(engines)
            except BadRequest:
                size = None
        found = self.answers.prefix(keys, engines)
        for answer in found.values():
            answer["tokens"] = answer["blocks"] * size if size else None
        return {"blocks": len(keys), "tokens_per_hash": size, "engines": found}

    def _check_engines(self, engines: list[str]) -> None:
        """Refuse (400, naming the field ``engines``) a name the index does not know: one its engine
        table lacks, so that a typo is not read as "no engine holds the prefix". Known are the
        engines the table lists, those nothing was heard from yet (``waiting``) included: a
        writer's configured engines (``--engine``), a reader's as the writer last wrote them to
        Redis. At most 8 unknown and 8 known names are quoted, each cut at 80 characters."""
        known = self.answers.meta().get("engines", {})
        unknown = list(dict.fromkeys(e for e in engines if e not in known))
        if not unknown:
            return
        raise BadRequest(
            HTTPStatus.BAD_REQUEST,
            f"engines names {len(unknown)} engine(s) the index does not know: {_quoted(unknown)} (it knows "
            f"{_quoted(list(known)) or 'none yet'}): give names from GET /v1/engines, or leave engines out to ask "
            "every engine",
        )

    def _tokens(self, tokens: Any, size: int) -> list[int]:
        if not isinstance(tokens, list):
            raise BadRequest(HTTPStatus.BAD_REQUEST, "tokens must be a list of token ids")
        if len(tokens) // size > self.max_blocks:  # (a last, partial block is not hashed)
            limit = (self.max_blocks + 1) * size - 1
            message = f"tokens has {len(tokens)} ids, {len(tokens) // size} blocks of {size}; at most " \
                f"{self.max_blocks} blocks ({limit} ids)"
            raise BadRequest(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, message)
        if not all(type(t) is int and 0 <= t <= _MAX_TOKEN for t in tokens):
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"tokens must be integers in [0, {_MAX_TOKEN}]")
        return tokens

    def _keys(self, hashes: Any, group: int) -> list[int]:
        if not isinstance(hashes, list):
            raise BadRequest(HTTPStatus.BAD_REQUEST, "block_hashes must be a list")
        if len(hashes) > self.max_blocks:
            raise BadRequest(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                             f"block_hashes has {len(hashes)} entries; at most {self.max_blocks}")  # fmt: skip
        keys = []
        for i, raw in enumerate(hashes):
            value = int(raw, 16) if type(raw) is str and _HEX_HASH.fullmatch(raw) else raw
            if type(value) is not int or not 0 <= value <= _MAX_HASH:
                message = f"block_hashes[{i}] must be an integer in [0, 2**64) or a string of 1 to 16 hex " \
                    f"digits [0-9a-fA-F], got {raw!r:.40}"
                raise BadRequest(HTTPStatus.BAD_REQUEST, message)
            keys.append(block_key(value, group))
        return keys


def _quoted(names: Sequence[str]) -> str:
    """The first ``_QUOTED`` of ``names`` as Python literals cut at 80 characters each, and how many more."""
    text = ", ".join(f"{name!r:.80}" for name in names[:_QUOTED])
    return f"{text} and {len(names) - _QUOTED} more" if len(names) > _QUOTED else text


def _length_digits(value: str) -> str | None:
    """A ``Content-Length`` field value's digits without the optional whitespace around them (RFC
    9110 section 5.5: not part of the value) and without leading zeros (``"0"`` for zero); None
    where it is not ASCII decimal digits (``"²".isdigit()`` is True)."""
    digits = value.strip(" \t")
    if not (digits.isascii() and digits.isdigit()):
        return None
    return digits.lstrip("0") or "0"


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()  # (strict JSON: no NaN)


class _HeaderBudget:
    """A request's reader while the standard library reads its header lines: at most ``budget``
    bytes of them in all, else :class:`http.client.HTTPException` (the standard library answers
    431). Its own bounds (100 lines of 64 KiB each) let a connection hold 6.25 MiB for request_timeout."""

    def __init__(self, rfile: Any, budget: int) -> None:
        self.rfile = rfile
        self.left = budget

    def readline(self, limit: int = -1) -> bytes:
        want = self.left + 1 if limit < 0 else min(limit, self.left + 1)
        line: bytes = self.rfile.readline(want)
        self.left -= len(line)
        if self.left < 0:
            raise http.client.HTTPException(f"the header lines are over {_MAX_HEADER_BYTES} bytes in all")
        return line


class _Handler(DeadlineRequestHandler):
    server: FleetServer
    raw_requestline: bytes
    protocol_version = "HTTP/1.1"
    server_version = "kvtier-fleet"
    deadline_name = "request_timeout"

    def request_seconds(self) -> float:
        return self.server.request_timeout

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.request_timeout)
        self._write_budget = self.server.request_timeout

    def parse_request(self) -> bool:
        """The standard library's, after skipping up to 8 empty lines before the request line (RFC
        9112 section 2.2; a client's CRLF after a body, say): it took an empty line for a request
        and closed the connection without an answer. A request line that never comes is a 400;
        so is one of two words, a method and a target without an HTTP version (HTTP/0.9), at once
        and before any header is read: the standard library waited for header lines an HTTP/0.9
        client never sends (no answer until request_timeout), and the answers written for such a
        request had no status line nor headers, only the JSON body."""
        empty = (b"\r\n", b"\n")
        for _ in range(_EMPTY_LINES):
            if self.raw_requestline not in empty:
                break
            self.raw_requestline = self.rfile.readline(_MAX_LINE + 1)
        if not self.raw_requestline:  # (the client closed after empty lines alone)
            self.close_connection = True
            return False
        if len(self.raw_requestline) > _MAX_LINE or not self.raw_requestline.strip():
            self.requestline = self.request_version = self.command = ""
            if len(self.raw_requestline) > _MAX_LINE:
                self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG)
            elif self.raw_requestline in empty:
                self.send_error(HTTPStatus.BAD_REQUEST, f"no request line after {_EMPTY_LINES} empty lines")
            else:  # (the standard library took a line of blanks for no request: closed, no answer)
                self.send_error(HTTPStatus.BAD_REQUEST, "a request line of blanks only")
            return False
        requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        if len(requestline.split()) == 2:  # (split as the standard library splits it)
            self.requestline, self.request_version, self.command = requestline, "HTTP/1.1", ""
            self.send_error(HTTPStatus.BAD_REQUEST, f"a request line without an HTTP version ({requestline[:100]!r}; "
                            "HTTP/0.9) is not served: end it with HTTP/1.1")  # fmt: skip
            return False
        rfile = self.rfile
        self.rfile = cast(Any, _HeaderBudget(rfile, _MAX_HEADER_BYTES))  # (what the headers are read from)
        try:
            return super().parse_request()
        finally:
            self.rfile = rfile

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's own refusals (a bad request line, too long a line, too many
        headers, an unknown method) as JSON like every other error, never HTML."""
        short, long = self.responses.get(code, ("Error", ""))
        text = f"{message or short}: {explain or long}".rstrip(": ")
        self.log_error("code %d, message %s", code, text)
        self.close_connection = True
        if self.request_version == "HTTP/0.9":  # (the request line was not parsed: still answer with a status line)
            self.request_version = "HTTP/1.1"
        data = json.dumps({"error": text[:1000]}).encode()
        self.send_response(code, short)  # (the message may quote the client's bytes: not in the status line)
        self.send_header("Connection", "close")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)

    def _send(self, status: HTTPStatus, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        self._write(status, _encode(body), headers)

    def _write(self, status: HTTPStatus, data: bytes, headers: dict[str, str] | None = None) -> None:
        """Send one answer. The connection's answers share one write budget of
        ``request_timeout`` seconds: a client that reads them slowly (a byte now and then, or
        thousands of pipelined requests read at a trickle) is dropped once its writes have
        waited that long in all. The budget is whole again whenever the client has taken every
        byte sent before (a client that reads each answer before its next request is never dropped)."""
        if _unsent(self.connection) == 0:
            self._write_budget = self.server.request_timeout
        if self._write_budget <= 0:
            raise TimeoutError("the client did not read its answers within request_timeout")
        self.connection.settimeout(self._write_budget)
        started = time.monotonic()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
        finally:
            self._write_budget -= time.monotonic() - started

    def _guarded(self, handle: Any, slot: bool = True) -> None:
        """Answer ``handle()`` in one of the ``max_concurrent`` slots (``slot``; ``/health`` takes
        none: a server busy answering is not unhealthy); the slot is given back before the answer
        is written (a slow reader must not hold it)."""
        if slot and not self.server._slots.acquire(blocking=False):
            self.close_connection = True
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, {"error": "too many requests at once; retry"})
            return
        status = HTTPStatus.OK
        try:
            data = _encode(handle())  # (what cannot be sent fails here, as an internal error)
        except BadRequest as exc:
            status, data = exc.status, _encode({"error": str(exc)})
        except StoreUnavailable as exc:
            self.server.log_unavailable(self.path, str(exc))
            status, data = HTTPStatus.SERVICE_UNAVAILABLE, _encode({"error": str(exc)})
        except Exception:
            logger.exception("fleet: request %s failed", self.path[:100])
            status, data = HTTPStatus.INTERNAL_SERVER_ERROR, _encode({"error": "internal error (see the server's log)"})
        finally:
            if slot:
                self.server._slots.release()
        if status != HTTPStatus.OK:
            self.close_connection = True
        self._write(status, data)

    def _misrouted(self) -> bool:
        """Answer a request this method has no answer for, and say so (True); the connection is
        closed after it (a body is left unread). A path of the API with a query string (``GET
        /health?x=1``): 400 naming it (the API takes none, and a parameter silently ignored would
        be misread: ``?engines=a``); asked with another method: 405 with an ``Allow`` header and an
        error naming the method to use; any other path: 404 naming the API's paths."""
        path, mark, query = self.path.partition("?")
        method = _ROUTES.get(path)
        if method == self.command and not mark:
            return False
        self.close_connection = True
        if method is not None and mark:  # (a parameter read as ignored would be worse: engines=a asks every engine)
            error = f"{path} takes no query string, got {query[:100]!r}: give engines and group in the JSON body " \
                "of POST /v1/prefix"
            self._send(HTTPStatus.BAD_REQUEST, {"error": error})
        elif method is None:
            paths = ", ".join(f"{m} {path}" for path, m in _ROUTES.items())
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path[:100]!r}: use {paths}"})
        else:
            self._send(HTTPStatus.METHOD_NOT_ALLOWED,
                       {"error": f"{self.command} is not answered on {path}: use {method} {path}"},
                       {"Allow": method})  # fmt: skip
        return True

    def do_GET(self) -> None:
        if self._misrouted():
            return
        if self.headers.get("Transfer-Encoding") is not None or any(
            _length_digits(length) != "0" for length in self.headers.get_all("Content-Length") or ()
        ):
            self.close_connection = True  # a body a GET never reads: what follows it is no request
        if self.path == "/health":
            self._guarded(self._health, slot=False)
        else:
            self._guarded(self._engines)

    def _health(self) -> dict[str, Any]:
        problem = self.server.health() if self.server.health is not None else None
        if problem is not None:
            raise BadRequest(HTTPStatus.SERVICE_UNAVAILABLE, problem)
        return {"ok": True}

    def _engines(self) -> dict[str, Any]:
        engines = self.server.answers.meta().get("engines", {})
        out = {}
        for name, eng in engines.items():
            view = {k: v for k, v in eng.items() if k not in ("device_bit",)}
            view["tiers"] = [{k: v for k, v in t.items() if k != "bit"} for t in eng.get("tiers", ())]
            out[name] = view
        return {"engines": out}

    def _no_such_method(self) -> None:
        """PUT, DELETE, PATCH, OPTIONS: no path of the API answers them (405 on one, else 404)."""
        self._misrouted()

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _no_such_method

    def do_POST(self) -> None:
        if self._misrouted():
            return
        try:  # the body is read before an answer slot is taken: a client sending it slowly holds none
            raw = self._body()
        except BadRequest as exc:
            self.close_connection = True
            self._send(exc.status, {"error": str(exc)})
            return
        self._guarded(lambda: self._prefix(raw))

    def _body(self) -> bytes:
        """The request's body, by its one ``Content-Length``: ASCII decimal digits, judged by
        value (whitespace around them and leading zeros allowed, :func:`_length_digits`), else 411;
        over ``max_body`` 413. A ``Transfer-Encoding`` is refused (411), with or without a length
        (RFC 9112 section 6.1: read by the length, what followed a chunked body would be taken for
        the next request); so are ``Content-Length`` headers whose values disagree (400, at once:
        not a wait for bytes that never come). A body that ends before its length (the client
        closed its side) is a 400 saying how many bytes came (it was answered as if whole), one
        not all there within request_timeout a 408."""
        if self.headers.get("Transfer-Encoding") is not None:
            raise BadRequest(HTTPStatus.LENGTH_REQUIRED, "Transfer-Encoding is not supported: send the body with a "
                                                         "Content-Length header of decimal digits")  # fmt: skip
        given = self.headers.get_all("Content-Length") or ()
        lengths = {_length_digits(value) for value in given}
        if not given or None in lengths:
            raise BadRequest(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header of decimal digits is required")
        if len(lengths) > 1:
            quoted = f"{sorted(set(given))[:4]!r:.100}"
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"Content-Length headers disagree ({quoted})")
        digits = cast(str, lengths.pop())
        if len(digits) > _MAX_LENGTH_DIGITS or int(digits) > self.server.max_body:
            shown = digits if len(digits) <= 40 else f"{digits[:20]}... ({len(digits)} digits)"
            raise BadRequest(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                             f"body of {shown} bytes; at most {self.server.max_body}")  # fmt: skip
        length = int(digits)
        try:
            raw = self.rfile.read(length)
        except TimeoutError:
            raise BadRequest(HTTPStatus.REQUEST_TIMEOUT, "the body did not arrive within request_timeout") from None
        if len(raw) < length:  # (read() is short only at the end of the stream)
            message = f"the body ended after {len(raw)} of {length} bytes (Content-Length): the client " \
                "closed its side before the rest"
            raise BadRequest(HTTPStatus.BAD_REQUEST, message)
        return raw

    def _prefix(self, raw: bytes) -> dict[str, Any]:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"the body is not JSON: {exc}") from None
        return self.server.answer_prefix(body)
