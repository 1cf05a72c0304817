"""Subscribing to N engines' KV event streams (vLLM's ZMQ publisher) and feeding a :class:`FleetIndex`.

Each engine is an :class:`EngineEndpoint`: vLLM's ``--kv-events-config`` ``endpoint``
(its PUB socket, here a SUB connects to it), optionally its ``replay_endpoint`` (a
ROUTER that resends buffered batches from a sequence number) and its OpenAI API URL
(to ask for a snapshot). One thread (:class:`FleetSubscriber`) polls every socket:

* vLLM numbers its batches 0, 1, 2 ... per publisher start. A jump forward is a gap:
  the missing batches are asked from the replay endpoint (bounded by
  ``replay_timeout``) and applied in order; what cannot be replayed is reported to the
  index as lost (it then drops what the lost batches could have changed). A number
  going back means a new publisher (the engine restarted): the index drops the old
  start's device cache and private tiers, and the new start's batches are replayed
  from 0 where possible.
* Each SUB socket's monitor tells when the connection to the engine's publisher goes down (the
  engine stopped or was killed: its socket closed; or it answered no ZMTP heartbeat for 3 s: its
  process frozen, its host gone; vLLM sends nothing when idle, so silence alone says nothing) and
  when a publisher there is connected again: the index marks the engine ``disconnected``
  meanwhile (:meth:`FleetIndex.engine_connected`).
* When the index wants a snapshot of an engine (it joined mid-start, lost events, or connected
  again: it may have restarted with its hello unheard),
  and the engine's API URL is known, a helper thread sends the engine a one-token
  completion whose ``kv_transfer_params`` ask kvtier for one (``{"kvtier_events":
  "snapshot"}``; at most once per ``snapshot_retry`` seconds per engine, and twice as long
  after each ask while the index still wants one (up to 32 times); each ask bounded
  as a whole by ``http_timeout``, and asked again later whatever went wrong, a helper thread
  that cannot be started included: the subscriber thread carries on).

Every socket has bounded message sizes (``max_message_bytes``, 32 MiB) and a receive queue
of at most ``max_queued_bytes`` (1 GiB) at that size (ZMQ counts messages: batches beyond
are dropped, then replayed); messages that are not KV event batches are counted and
dropped; a replay is bounded in time (``replay_timeout``), in batches (the gap it fills)
and in bytes (``max_queued_bytes``). A batch, gap or publisher restart the index fails to
take (its store, Redis, did not answer) counts as lost events of that engine; the thread
carries on. Should the thread stop on its own all the same (a bug), every
engine is marked partial and :attr:`FleetSubscriber.failure` says why. Needs ``pyzmq`` and
``msgspec`` (``pip install 'kvtier[fleet]'``).
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtier.fleet.index import FleetIndex
from kvtier.fleet.wire import WireError, decode_batch
from kvtier.validation import is_utf8_text

logger = logging.getLogger(__name__)

END_SEQ = -1
_SEQ_BYTES = 8
_DRAIN_SECONDS = 0.25  # one engine's messages handled in a row at most before the other engines' are looked at
# After a replay that took t seconds, the engine is asked for none for _REPLAY_BACKOFF * t seconds (its gaps count as
# lost events at once meanwhile): an engine whose replays hang (down, or hostile) takes at most a fifth of the thread.
_REPLAY_BACKOFF = 4.0
_ASK_BACKOFF_STEPS = 5  # snapshot asks: snapshot_retry, then twice that, ... up to 32 times that
# What a SUB socket's monitor reports: a connection to the engine's publisher up (handshake done) or down.
_CONNECTION_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
# ZMTP heartbeats on each SUB socket (ms): a publisher that answers no PING within the timeout (its
# process frozen, its host gone without closing the connection) is disconnected. An idle SUB sends
# nothing else, and TCP alone (no keepalive by default) would never give such a connection up.
_HEARTBEAT_IVL_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 3000


_MAX_IPC_PATH = 107
"""The longest ``ipc://`` socket path, in bytes (a Unix socket address holds 108, the NUL included)."""


def _usable_tcp_host(host: str) -> bool:
    """A ``tcp://`` endpoint's host: a name or address without brackets, or an IPv6 address in one
    pair of brackets (``[::1]``). ZMQ takes a malformed one (``[::1``, ``[::1]]``) and never
    connects: the engine would wait silently for good. (What else ZMQ refuses, start() reports.)"""
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            return False
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:  # (brackets inside, an IPv4 address or a name in brackets)
            return False
        return True
    return "[" not in host and "]" not in host


def _check_api_url(name: str, url: str) -> None:
    """An engine's OpenAI API base URL: a host and, if given, a port 1-65535 (ValueError names it)."""
    try:
        parts = urllib.parse.urlsplit(url)
        usable = bool(parts.hostname) and parts.port != 0 and is_utf8_text(url)
    except ValueError:  # a port out of range or not a number
        usable = False
    if not usable:
        raise ValueError(f"engine {name}: api URL {url!r:.160} needs the engine's host and a port 1-65535 "
                         "(http://host:port)")  # fmt: skip


@dataclass(frozen=True)
class EngineEndpoint:
    """One engine: a name (used in answers), its events endpoint (``tcp://host:port``),
    optionally its replay endpoint, its OpenAI API base URL and the topic it publishes on."""

    name: str
    events: str
    replay: str | None = None
    api: str | None = None
    topic: str = ""

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > 128 or any(c.isspace() for c in self.name):
            raise ValueError(f"engine name must be 1-128 characters without spaces, got {self.name!r}")
        if not is_utf8_text(self.topic) or len(self.topic.encode()) > 255:
            raise ValueError(f"engine {self.name}: topic {self.topic!r:.80} must be text of at most 255 bytes")
        # (inproc:// is refused: it reaches only sockets of the subscriber's own ZMQ context)
        for what, url, schemes in (("events", self.events, ("tcp://", "ipc://")),
                                   ("replay", self.replay, ("tcp://", "ipc://")),
                                   ("api", self.api, ("http://", "https://"))):  # fmt: skip
            if url is not None and not url.startswith(schemes):
                raise ValueError(f"engine {self.name}: {what} endpoint {url!r} must start with one of {schemes}")
            if url is not None and url.startswith("ipc://"):
                path = url.removeprefix("ipc://")
                if not path or not is_utf8_text(path) or len(path.encode()) > _MAX_IPC_PATH:
                    raise ValueError(f"engine {self.name}: {what} endpoint {url!r:.160} needs a socket path of "
                                     f"1-{_MAX_IPC_PATH} bytes (ipc:///path)")  # fmt: skip
            if url is not None and url.startswith(("http://", "https://")):
                _check_api_url(self.name, url)
            if url is None or not url.startswith("tcp://"):
                continue
            host, _, port = url.removeprefix("tcp://").rpartition(":")
            if port != "*" and not (port.isdigit() and 0 < int(port) < 65536):
                raise ValueError(f"engine {self.name}: {what} endpoint {url!r} needs a port 1-65535")
            if not host or host == "*":
                raise ValueError(f"engine {self.name}: {what} endpoint {url!r} needs the engine's host "
                                 "(tcp://host:port; IPv6: tcp://[::1]:port)")  # fmt: skip
            if not _usable_tcp_host(host):
                raise ValueError(f"engine {self.name}: {what} endpoint {url!r:.160} has a malformed host {host!r:.80}: "
                                 "a name or address without brackets, or an IPv6 address in one pair of brackets "
                                 "(tcp://[::1]:port)")  # fmt: skip


@dataclass
class _Link:
    endpoint: EngineEndpoint
    sub: Any
    expected: int | None = None
    dropped: int = 0
    replayed: int = 0
    failed: int = 0
    last_snapshot_ask: float = -float("inf")
    asks: int = 0  # snapshot asks since the index last wanted none
    replay_after: float = -float("inf")  # no replay is asked of the engine before then (monotonic)
    model: str | None = None
    pending: list[tuple[int, bytes]] = field(default_factory=list)
    monitor: Any = None  # the SUB socket's monitor (connection up and down, _CONNECTION_EVENTS)
    connected: bool = False


class FleetSubscriber:
    """The subscriber thread (see the module docstring). ``start()`` connects and starts it;
    ``stop()`` stops it and closes every socket (joins within ``join_timeout``)."""

    def __init__(
        self,
        index: FleetIndex,
        endpoints: Sequence[EngineEndpoint],
        *,
        replay_timeout: float = 2.0,
        max_message_bytes: int = 32 << 20,
        max_queued_bytes: int = 1 << 30,
        rcvhwm: int | None = None,
        snapshot_retry: float = 10.0,
        http_timeout: float = 30.0,
        poll_ms: int = 100,
    ) -> None:
        names = [e.name for e in endpoints]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        self.index = index
        self.endpoints = list(endpoints)
        for endpoint in self.endpoints:
            if endpoint.name not in index.engine_names:
                index.add_engine(endpoint.name)
        self.replay_timeout = replay_timeout
        self.max_message_bytes = max_message_bytes
        self.max_queued_bytes = max_queued_bytes
        # ZMQ bounds a queue in messages: as many as fit the byte budget at the largest size.
        self.rcvhwm = rcvhwm if rcvhwm is not None else max(8, min(100_000, max_queued_bytes // max_message_bytes))
        self.snapshot_retry = snapshot_retry
        self.http_timeout = http_timeout
        self.poll_ms = poll_ms
        self._ctx = zmq.Context()
        self._links: dict[Any, _Link] = {}
        self._monitors: dict[Any, _Link] = {}  # each SUB socket's monitor socket -> its link
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._asks: list[threading.Thread] = []
        self.failure: str | None = None
        """Why the subscriber thread stopped on its own (a bug); None while it runs as it should."""

    def start(self) -> None:
        """Connect to every engine and start the thread; ValueError names an endpoint ZMQ refused
        (its socket closed: ``stop()`` still ends at once). Once only: a second call (a second
        thread would poll the same sockets, which ZMQ does not allow) or one after ``stop()`` (its
        sockets are gone) raises RuntimeError; make a new subscriber instead."""
        if self._thread is not None or self._stop.is_set() or self._links:
            raise RuntimeError("a FleetSubscriber starts once: this one was started (or stopped) already; make a new "
                               "one")  # fmt: skip
        for endpoint in self.endpoints:
            sub = self._ctx.socket(zmq.SUB)
            monitor = None
            try:
                sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
                sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.IPV6, 1)  # (without it a tcp://[::1]:port endpoint never connects, silently)
                sub.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
                sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
                sub.setsockopt(zmq.SUBSCRIBE, endpoint.topic.encode())
                monitor = sub.get_monitor_socket(_CONNECTION_EVENTS)  # (before connecting: no event missed)
                sub.connect(endpoint.events)
            except (zmq.ZMQError, UnicodeError) as exc:
                sub.close(linger=0)
                if monitor is not None:
                    monitor.close(linger=0)
                why = f"engine {endpoint.name}: cannot subscribe to {endpoint.events!r:.160}: {exc}"
                raise ValueError(why) from None
            self._links[sub] = self._monitors[monitor] = _Link(endpoint, sub, monitor=monitor)
        self._thread = threading.Thread(target=self._run, name="kvtier-fleet-subscriber", daemon=True)
        self._thread.start()

    def stop(self, join_timeout: float = 5.0) -> None:
        """Stop the thread and close every socket, within ``join_timeout`` seconds in all: the
        snapshot asks still waiting on engines' APIs (daemon threads, each bounded by
        ``http_timeout``) share what the subscriber thread left of it, however many engines there are."""
        deadline = time.monotonic() + join_timeout
        self._stop.set()
        if self._thread is not None:
            self._thread.join(join_timeout)
            if self._thread.is_alive():
                logger.warning("fleet: the subscriber thread did not stop within %.1f s", join_timeout)
        for thread in self._asks:
            thread.join(max(0.0, deadline - time.monotonic()))
        for link in self._links.values():
            link.sub.close(linger=0)
            link.monitor.close(linger=0)
        self._ctx.destroy(linger=0)  # (closes any socket still open, so it never waits on one)

    def __enter__(self) -> FleetSubscriber:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stats(self) -> dict[str, dict[str, int]]:
        return {link.endpoint.name: {"dropped": link.dropped, "replayed": link.replayed, "failed": link.failed}
                for link in self._links.values()}  # fmt: skip

    # --- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # a bug: without this thread nothing is applied again
            failure = f"the subscriber thread stopped: {type(exc).__name__}: {exc}"
            logger.critical("fleet: %s; every engine is marked partial", failure, exc_info=True)
            for link in self._links.values():
                self._tell_index(link, "marking it partial", self.index.lost_events, failure)
            self.failure = failure

    def _loop(self) -> None:
        poller = zmq.Poller()
        for sub in [*self._links, *self._monitors]:
            poller.register(sub, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(self.poll_ms))
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            for monitor in [m for m in ready if m in self._monitors]:  # (before the batches a connection brought)
                self._connection_changed(self._monitors[monitor])
            for sub in [s for s in ready if s in self._links]:
                link = self._links[sub]
                drain_until = time.monotonic() + _DRAIN_SECONDS
                for _ in range(1000):  # drain, but let other engines in (after 1000 messages or _DRAIN_SECONDS)
                    if time.monotonic() > drain_until:
                        break
                    try:
                        frames = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._receive(link, frames)
                    except Exception as exc:  # whatever one message does, the others are still applied
                        link.dropped += 1
                        logger.exception("fleet: engine %s: a message could not be handled; dropped",
                                         link.endpoint.name)  # fmt: skip
                        self._tell_index(link, "dropping what the message could have changed", self.index.lost_events,
                                         f"a message could not be handled ({type(exc).__name__})")  # fmt: skip
            try:
                self.index.tick()
            except Exception:
                logger.exception("fleet: the index's store failed")
                self._stop.wait(1.0)  # do not spin on a store that is down
            for link in self._links.values():
                self._maybe_ask_snapshot(link)

    def _connection_changed(self, link: _Link) -> None:
        """Read the engine's SUB socket monitor: the index learns when the connection to its
        publisher went down (the engine stopped, was killed, or cannot be reached: its status is
        ``disconnected``) and when it is up again (a handshake with a publisher there)."""
        connected = link.connected
        while True:
            try:
                event = recv_monitor_message(link.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                connected = False
        if connected != link.connected:
            link.connected = connected
            self._tell_index(link, "telling its connection " + ("up" if connected else "down"),
                             self.index.engine_connected, connected)  # fmt: skip

    def _tell_index(self, link: _Link, what: str, call: Callable[..., None], *args: Any) -> None:
        """``call(engine name, *args)`` on the index. A failure of its store (Redis) is logged and
        counted, never raised: the index left the engine incomplete and marked for its next batch
        to finish dropping what it could not."""
        name = link.endpoint.name
        try:
            call(name, *args)
        except Exception as exc:
            link.failed += 1
            logger.warning("fleet: engine %s: %s failed (%s: %s); retried with its next batch", name, what,
                           type(exc).__name__, exc)  # fmt: skip

    def _receive(self, link: _Link, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != _SEQ_BYTES:
            link.dropped += 1
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq < 0:
            link.dropped += 1
            return
        name = link.endpoint.name
        if link.expected is not None and seq < link.expected:
            logger.info("fleet: engine %s publisher started over (batch %d after %d)", name, seq, link.expected - 1)
            link.expected = None
            self._tell_index(link, "dropping its old start", self.index.publisher_restarted)
        if link.expected is None:
            # First batch heard from this publisher: fetch what it still buffers before it. If
            # that does not reach back to its start, the index learns so from the control
            # records' seq and asks for a snapshot.
            for batch_seq, payload in self._replay(link, 0, seq, from_start=False):
                self._apply(link, batch_seq, payload)
        elif seq > link.expected:
            replayed = self._replay(link, link.expected, seq, from_start=True)
            missing = seq - link.expected - len(replayed)
            for batch_seq, payload in replayed:
                self._apply(link, batch_seq, payload)
            if missing:
                why = f"{missing} batch(es) before {seq} could not be replayed"
                self._tell_index(link, "dropping what lost batches could have changed", self.index.lost_events, why)
        self._apply(link, seq, frames[2])

    def _apply(self, link: _Link, seq: int, payload: bytes) -> None:
        link.expected = seq + 1
        try:
            batch = decode_batch(payload)
        except WireError as exc:
            link.dropped += 1
            logger.debug("fleet: engine %s batch %d dropped: %s", link.endpoint.name, seq, exc)
            return
        name = link.endpoint.name
        try:
            self.index.retaking(lambda: self.index.apply(name, batch))  # (then it counts as two batches)
        except Exception as exc:  # the index's store (Redis) failed: this batch's changes are lost
            link.failed += 1
            logger.warning("fleet: engine %s batch %d could not be applied: %s", name, seq, exc)
            self._tell_index(link, "dropping what the lost batch could have changed", self.index.lost_events,
                             f"batch {seq} could not be applied ({type(exc).__name__})")

    def _replay(self, link: _Link, start: int, stop: int, from_start: bool) -> list[tuple[int, bytes]]:
        """An unbroken run of batches ending at ``stop - 1`` from the engine's replay endpoint,
        beginning at ``start`` (``from_start``) or wherever its buffer begins; else none."""
        if link.endpoint.replay is None or stop <= start:
            return []
        asked = time.monotonic()
        if asked < link.replay_after:  # its replays took their share of the one thread every engine shares
            logger.debug("fleet: engine %s: no replay of batches %d..%d (its last replays took too long)",
                         link.endpoint.name, start, stop - 1)  # fmt: skip
            return []
        try:
            return self._replay_now(link, start, stop, from_start)
        finally:
            took = time.monotonic() - asked
            link.replay_after = time.monotonic() + _REPLAY_BACKOFF * took

    def _replay_now(self, link: _Link, start: int, stop: int, from_start: bool) -> list[tuple[int, bytes]]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        out: list[tuple[int, bytes]] = []
        held = 0  # bytes of the payloads in out
        try:
            sock.connect(link.endpoint.replay or "")
            sock.send_multipart([b"", start.to_bytes(_SEQ_BYTES, "big")])
            deadline = time.monotonic() + self.replay_timeout
            while (left := deadline - time.monotonic()) > 0:
                if not sock.poll(int(left * 1000) + 1):
                    break
                frames = sock.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != _SEQ_BYTES:
                    link.dropped += 1
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    break
                if start <= seq < stop:
                    if out and seq != out[-1][0] + 1:
                        out, held = [], 0  # a hole: keep only the run after it
                    out.append((seq, frames[3]))
                    held += len(frames[3])
                    if held > self.max_queued_bytes:
                        logger.warning("fleet: engine %s replay of batches %d..%d holds over %d bytes; given up",
                                       link.endpoint.name, start, stop - 1, self.max_queued_bytes)  # fmt: skip
                        out = []
                        break
                    if seq == stop - 1:
                        break  # the gap is filled: whatever else the endpoint sends is not needed
            else:
                logger.warning("fleet: engine %s replay of batches %d..%d timed out", link.endpoint.name, start,
                               stop - 1)  # fmt: skip
        except zmq.ZMQError as exc:
            logger.warning("fleet: engine %s replay failed: %s", link.endpoint.name, exc)
        finally:
            sock.close(linger=0)
        if out and (out[-1][0] != stop - 1 or (from_start and out[0][0] != start)):
            out = []
        link.replayed += len(out)
        return out

    # --- snapshots --------------------------------------------------------------------------

    def _maybe_ask_snapshot(self, link: _Link) -> None:
        """Ask the engine for a snapshot while the index wants one: ``snapshot_retry`` after the
        last ask, doubling with each ask the engine leaves unanswered (up to 32 times that), so an
        engine that never sends one (or an API that fails) is not asked forever at that pace."""
        name = link.endpoint.name
        since = time.monotonic() - link.last_snapshot_ask
        if link.endpoint.api is None or since < self.snapshot_retry:
            return
        if not self.index.take_snapshot_wanted(name):
            link.asks = 0
            return
        if since < self.snapshot_retry * 2 ** min(link.asks, _ASK_BACKOFF_STEPS):
            return
        link.asks += 1
        link.last_snapshot_ask = time.monotonic()
        self._asks = [t for t in self._asks if t.is_alive()]
        thread = threading.Thread(target=self._ask_snapshot, args=(link,), name=f"kvtier-fleet-ask-{name}", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:  # "can't start new thread" (out of threads or memory): this thread carries on
            # (logged at most once per snapshot_retry per engine: last_snapshot_ask gates the next try)
            logger.warning("fleet: could not start a thread to ask engine %s for a snapshot (%s); asked again in "
                           "%.0f s", name, exc, self.snapshot_retry)  # fmt: skip
            self._want_snapshot_again(link)
            return
        self._asks.append(thread)

    def _ask_snapshot(self, link: _Link) -> None:
        api = link.endpoint.api
        assert api is not None
        try:
            if link.model is None:
                models = json.loads(self._call(api.rstrip("/") + "/v1/models", None))
                link.model = str(models["data"][0]["id"])
            body = {"model": link.model, "prompt": "kvtier", "max_tokens": 1,
                    "kv_transfer_params": {"kvtier_events": "snapshot"}}  # fmt: skip
            self._call(api.rstrip("/") + "/v1/completions", json.dumps(body).encode())
            logger.info("fleet: asked engine %s for a snapshot", link.endpoint.name)
        except Exception as exc:  # whatever the API answers (JSON nested too deep included), ask again later
            logger.warning("fleet: could not ask engine %s for a snapshot: %s: %.200s", link.endpoint.name,
                           type(exc).__name__, exc)  # fmt: skip
            self._want_snapshot_again(link)

    def _want_snapshot_again(self, link: _Link) -> None:
        """The engine still needs the snapshot an ask was meant for: asked again after ``snapshot_retry``."""
        with contextlib.suppress(KeyError):
            self.index.engine(link.endpoint.name).needs_snapshot = True

    def _call(self, url: str, body: bytes | None) -> bytes:
        """One request to an engine's API (POST ``body`` as JSON, or GET), its first MiB of answer.
        ``http_timeout`` bounds the whole call, not each read: an API that sends a byte now and
        then is cut off at the deadline."""
        parts = urllib.parse.urlsplit(url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        deadline = time.monotonic() + self.http_timeout
        conn = kind(parts.hostname or "", parts.port, timeout=self.http_timeout)
        conn.connect()
        # (the connection's own reference goes when an HTTP/1.0 answer arrives: keep the socket's)
        cut = threading.Event()
        watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), _cut, args=(conn.sock, cut))
        watchdog.daemon = True
        watchdog.start()
        try:
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            headers = {"Content-Type": "application/json"} if body is not None else {}
            try:
                conn.request("GET" if body is None else "POST", target, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read(1 << 20)
            except (OSError, http.client.HTTPException):
                if not cut.is_set():
                    raise
            if cut.is_set():
                raise TimeoutError(f"{url} did not answer within {self.http_timeout} s")
            if response.status >= 400:
                raise OSError(f"{url} answered HTTP {response.status}")
            return data
        finally:
            watchdog.cancel()
            conn.close()


def _cut(sock: socket.socket, cut: threading.Event) -> None:
    """Shut a connection's socket: a read blocked on it returns at once."""
    cut.set()
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
