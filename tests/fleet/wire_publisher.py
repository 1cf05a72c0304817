"""A stand-in for vLLM's ``ZmqEventPublisher`` that can also send what vLLM never would: a PUB
socket sending ``[topic, seq, payload]`` and a ROUTER answering replay requests from what it sent,
on ipc endpoints, with msgpack built from plain lists and dicts (no vLLM needed)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvtier.engine_events import CONTROL_PREFIX

CPU_TIER = {"label": "0:primary", "type": "cpu", "medium": "cpu", "scope": "engine"}


def control(op: str, seq: int, start: str = "s", tiers: tuple[dict[str, Any], ...] = (CPU_TIER,),
            when: float | None = None, **fields: Any) -> dict[str, Any]:  # fmt: skip
    """A kvtier control record as the BlockRemoved event that carries it."""
    body = {"op": op, "engine": "e", "start": start, "seq": seq, "time": time.time() if when is None else when,
            "tiers": list(tiers), **fields}  # fmt: skip
    return {"type": "BlockRemoved", "block_hashes": [1], "medium": "STORAGE",
            "ownership": CONTROL_PREFIX + json.dumps(body)}  # fmt: skip


def stored(keys: list[int], medium: str | None = "CPU", ownership: str | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "BlockStored", "block_hashes": keys, "parent_block_hash": None,
                             "token_ids": [], "block_size": 0, "medium": medium}  # fmt: skip
    if ownership is not None:
        event["ownership"] = ownership
    return event


def removed(keys: list[int], medium: str | None = "CPU", ownership: str | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": keys, "medium": medium}
    if ownership is not None:
        event["ownership"] = ownership
    return event


def batch(*events: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode([time.time(), list(events), None])


class Publisher:
    """Binds ``ipc://<dir>/events`` and ``ipc://<dir>/replay``; ``send`` publishes the next batch
    (or the given ``seq``) and keeps it for replays; ``wait_subscribed`` returns once a subscriber's
    subscription has reached the publisher (an XPUB socket hears it), so a batch sent after it is
    not dropped as one sent to nobody (ZeroMQ's slow joiner)."""

    def __init__(self, directory: Path) -> None:
        self.events = f"ipc://{directory}/events"
        self.replay = f"ipc://{directory}/replay"
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not only the first
        self._pub.bind(self.events)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(self.replay)
        self.seq = 0
        self._sent: list[tuple[int, bytes]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replays, daemon=True)
        self._thread.start()

    def send(self, payload: bytes, seq: int | None = None) -> None:
        with self._lock:
            self.seq = self.seq if seq is None else seq
            self._sent.append((self.seq, payload))
            self._pub.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
            self.seq += 1

    def wait_subscribed(self, timeout: float = 20.0) -> None:
        """Block until the next subscription reaches the publisher (called from the thread that sends)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._pub.poll(int(left * 1000)):
                raise AssertionError(f"no subscriber joined {self.events} within {timeout} s")
            if self._pub.recv()[:1] == b"\x01":  # a subscription (b"\x00": an unsubscription)
                return

    def _serve_replays(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(20):
                continue
            frames = self._router.recv_multipart()
            if len(frames) != 3:
                continue
            start = int.from_bytes(frames[2], "big")
            with self._lock:
                for seq, payload in self._sent:
                    if seq >= start:
                        self._router.send_multipart([frames[0], b"", b"", seq.to_bytes(8, "big"), payload])
                self._router.send_multipart([frames[0], b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pub.close(0)
        self._router.close(0)
        self._ctx.term()


def wait_for(check: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
