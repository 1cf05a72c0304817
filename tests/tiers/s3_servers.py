"""S3 servers for the tests: moto in its own process, and a small stdlib stub that injects faults.

* :class:`MotoServer` runs ``python -m moto.server`` on a free loopback port as a
  separate process (it must not share the GIL with the tier under test);
  ``kill()`` sends SIGKILL and ``start()`` brings it back on the same port,
  empty, like a store that lost everything.
* :class:`S3Stub` is an in-process ``http.server`` speaking just enough S3
  (path-style PUT/GET/HEAD/DELETE, ranged GETs, bulk delete, ``If-None-Match: *``) to inject what moto
  cannot: 503 SlowDown, a hanging server, a truncated body, a wrong length, a
  wrong header. It records every request.
"""

from __future__ import annotations

import contextlib
import email.utils
import hashlib
import html
import http.server
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from server_process import ServerProcess, start_on_a_free_port


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def moto_available() -> bool:
    try:
        import flask  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError:
        return False
    return True


class MotoServer(ServerProcess):
    """``moto.server`` on 127.0.0.1:port in a child process."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / f"moto-{self.port}.log", "ab")  # noqa: SIM115 - closed by the child's exit
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=log,
            stderr=log,
            env={**os.environ, "MOTO_CALL_RESET_API": "true"},
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server on port {self.port} exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=0.5):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        raise RuntimeError(f"moto_server on port {self.port} did not answer within {timeout}s")

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"kvt-{uuid.uuid4().hex[:16]}"
        request = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        with urllib.request.urlopen(request, timeout=10):
            pass
        return name


def start_moto(workdir: Path) -> MotoServer:
    return start_on_a_free_port(lambda: MotoServer(workdir), "moto", attempts=3)


def s3_options(endpoint: str, bucket: str, **extra: Any) -> dict[str, Any]:
    """Tier options for a local test server (path-style, http, fixed test credentials)."""
    return {
        "type": "s3",
        "bucket": bucket,
        "endpoint": endpoint,
        "allow_http": True,
        "access_key_id": "testing",
        "secret_access_key": "testing",
        **extra,
    }


FAST_FAILURE: dict[str, Any] = {
    "request_timeout": 0.5,
    "connect_timeout": 0.3,
    "job_timeout": 1.5,
    "max_retries": 1,
    "check_timeout": 0.3,
    "open_seconds": 0.3,
    "failure_threshold": 2,
    "miss_seconds": 0.5,
}
"""S3 tier options under which an outage surfaces within about a second."""


def raw_client(endpoint: str, bucket: str, **extra: Any) -> Any:
    """A plain obstore client of the bucket (to look at or damage what a tier wrote)."""
    from kvtier.tiers.s3_store import S3TierOptions, open_store

    options = {k: v for k, v in s3_options(endpoint, bucket, **extra).items() if k != "type"}
    return open_store(S3TierOptions(**options))


def put_plain(endpoint: str, bucket: str, key: str, body: bytes = b"x") -> None:
    """PUT an object with a bare HTTP request (unsigned, as moto allows): for names obstore refuses
    to write (``a//b``, ``a/./b``) but another application in a shared bucket may."""
    request = urllib.request.Request(f"{endpoint}/{bucket}/{key}", data=body, method="PUT")
    with urllib.request.urlopen(request, timeout=10):
        pass


class _StubHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _StubHTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _stub(self) -> S3Stub:
        return self.server.stub

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, head: bool = False) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and not head:
            self.wfile.write(body)

    def _error(self, status: int, code: str, head: bool = False) -> None:
        body = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>{code}</Message></Error>".encode()
        self._send(status, body, {"Content-Type": "application/xml"}, head=head)

    def _stall(self, seconds: float) -> None:
        """No answer until the stub is released (or ``seconds`` pass), then the connection drops:
        a server that went quiet, as the client sees it."""
        self._stub().released.wait(seconds)
        self.close_connection = True

    def _before(self) -> bool:
        """Record the request, apply hang and SlowDown faults; False if a fault answered it."""
        stub = self._stub()
        credential = re.search(r"Credential=([^/,\s]+)/", self.headers.get("Authorization", ""))
        with stub.lock:
            stub.requests.append((self.command, self.path))
            if credential:
                stub.access_keys.add(credential.group(1))
            slowdown = stub.slowdowns > 0
            if slowdown:
                stub.slowdowns -= 1
            delay = stub.delays.get(self.command, 0.0)
        if delay:
            time.sleep(delay)
        if stub.hanging.is_set():
            self._stall(60)
            return False
        if slowdown:
            self._error(503, "SlowDown", head=self.command == "HEAD")
            return False
        return True

    def _key(self) -> str:
        return self.path.split("?", 1)[0].strip("/")

    def do_PUT(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(length) if length else b""
        if not self._before():
            return
        stub, key = self._stub(), self._key()
        if self.headers.get("If-None-Match") is not None and not stub.conditional_writes:
            self._error(501, "NotImplemented")  # as a store without conditional writes answers
            return
        if self.headers.get("If-Match") is not None and stub.if_match_refused is not None:
            status, code = stub.if_match_refused
            self._error(status, code)
            return
        with stub.lock:
            stall = stub.faults.get(key) in ("stall", "stall_after_write") and stub.faults.pop(key)
            if stall == "stall":
                exists = False
            elif self.headers.get("If-None-Match") == "*" and key in stub.objects:
                exists = True
            else:
                exists = False
                stub.objects[key] = body
        if stall:  # (written first for stall_after_write)
            self._stall(30)
            return
        if exists:
            self._error(412, "PreconditionFailed")
            return
        self._send(200, headers={"ETag": f'"{hashlib.md5(body).hexdigest()}"'})

    def _object(self, head: bool) -> None:
        if not self._before():
            return
        stub, key = self._stub(), self._key()
        with stub.lock:
            body = stub.objects.get(key)
            fault = stub.faults.pop(key, None) if not head else stub.faults.get(key)
            if head and fault == "stall_head":
                del stub.faults[key]
        if (fault == "stall" and not head) or (fault in ("stall_head", "stall_heads") and head):
            self._stall(30)
            return
        if body is None:
            self._error(404, "NoSuchKey", head=head)
            return
        headers = {
            "ETag": f'"{hashlib.md5(body).hexdigest()}"',
            "Last-Modified": email.utils.formatdate(usegmt=True),
            "Content-Type": "application/octet-stream",
        }
        if fault == "wrong_length":
            body = body[: len(body) // 2]
        elif fault == "wrong_header":
            body = body[:40] + bytes([body[40] ^ 0xFF]) + body[41:]
        if fault == "truncate" and not head:
            self.send_response(200)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            return
        asked = None if head else self.headers.get("Range")
        if asked is not None:
            with stub.lock:
                stub.ranged_gets.append(asked)
        span = re.fullmatch(r"bytes=(\d+)-(\d*)", asked or "")
        if span is not None and span.group(2) and int(span.group(2)) < int(span.group(1)):
            span = None  # an invalid range is ignored (RFC 9110): the whole object
        if span is not None and stub.ranges:
            start, end = int(span.group(1)), min(int(span.group(2) or len(body) - 1), len(body) - 1)
            if start >= len(body):
                error = b"<?xml version='1.0'?><Error><Code>InvalidRange</Code><Message>InvalidRange</Message></Error>"
                self._send(416, error, {"Content-Type": "application/xml", "Content-Range": f"bytes */{len(body)}"})
                return
            headers["Content-Range"] = f"bytes {start}-{end}/{len(body)}"
            self._send(206, body[start : end + 1], headers)
            return
        self._send(200, body, headers, head=head)

    def do_GET(self) -> None:
        self._object(head=False)

    def do_HEAD(self) -> None:
        self._object(head=True)

    def do_DELETE(self) -> None:
        if not self._before():
            return
        stub = self._stub()
        with stub.lock:
            stub.objects.pop(self._key(), None)
        self._send(204)

    def do_POST(self) -> None:
        """``POST /bucket?delete``: the bulk delete obstore uses even for one object."""
        length = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(length).decode() if length else ""
        if not self._before():
            return
        if not self.path.endswith("?delete"):
            self._error(501, "NotImplemented")
            return
        bucket = self._key()
        names = re.findall(r"<Key>(.*?)</Key>", body)
        stub = self._stub()
        with stub.lock:
            for name in names:
                stub.objects.pop(f"{bucket}/{html.unescape(name)}", None)
        deleted = "".join(f"<Deleted><Key>{name}</Key></Deleted>" for name in names)
        reply = f'<?xml version="1.0" encoding="UTF-8"?><DeleteResult>{deleted}</DeleteResult>'.encode()
        self._send(200, reply, {"Content-Type": "application/xml"})


class _StubHTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    stub: S3Stub


class S3Stub:
    """A fault-injecting S3 stub on a free loopback port (bucket name: ``stub``)."""

    bucket = "stub"

    def __init__(self, tls: tuple[Path, Path] | None = None) -> None:
        """``tls``: ``(certificate, key)`` to serve https instead of http."""
        self.lock = threading.Lock()
        self.objects: dict[str, bytes] = {}
        self.access_keys: set[str] = set()
        self.requests: list[tuple[str, str]] = []
        self.faults: dict[str, str] = {}
        self.slowdowns = 0
        self.delays: dict[str, float] = {}
        self.conditional_writes = True
        """False: a PUT with ``If-None-Match`` is answered 501 NotImplemented."""
        self.if_match_refused: tuple[int, str] | None = None
        """``(status, code)``: a PUT with ``If-Match`` is answered with it (a store, or a bucket
        policy, that refuses the header); None: the header is ignored, as this stub always did."""
        self.ranges = True
        """False: a GET's ``Range`` header is ignored (the whole object, 200), as some stores do."""
        self.ranged_gets: list[str] = []
        """The ``Range`` header of every GET that had one, in order."""
        self.hanging = threading.Event()
        self.released = threading.Event()
        self._server = _StubHTTPServer(("127.0.0.1", 0), _StubHandler)
        self._server.stub = self
        self.scheme = "http"
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(tls[0]), str(tls[1]))
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
            self.scheme = "https"
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-stub", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self._server.server_address[1]}"

    def object_key(self, path: str) -> str:
        """The stub's key of a tier object path."""
        return f"{self.bucket}/{path}"

    def fault(self, path: str, kind: str) -> None:
        """Serve the next GET of ``path`` with ``kind``: truncate, wrong_length, wrong_header or stall
        (no answer until :meth:`release`, as a dropped connection the client never hears of); or
        the next PUT with stall (nothing written) or stall_after_write (the object written); or the
        next HEAD with stall_head (no answer until released; the HEAD after it is answered), or
        every HEAD with stall_heads."""
        with self.lock:
            self.faults[self.object_key(path)] = kind

    def count(self, method: str) -> int:
        with self.lock:
            return sum(1 for m, _ in self.requests if m == method)

    def hang(self) -> None:
        self.released.clear()
        self.hanging.set()

    def release(self) -> None:
        self.hanging.clear()
        self.released.set()

    def close(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
