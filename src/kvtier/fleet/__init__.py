"""``kvtier.fleet``: a reference consumer of N engines' KV events, for KV-aware routing.

It subscribes to each engine's KV event stream (vLLM's ZMQ publisher, carrying
kvtier's stamped events: :mod:`kvtier.engine_events`), keeps a prefix index of which
engine holds which block in which tier (device cache, CPU tier, fs root, Redis, S3),
and answers "the longest cached prefix per engine and tier" for a prompt's tokens or
block hashes in time linear in the prompt. ``kvtier fleet serve`` exposes the answer
over HTTP/JSON (:mod:`kvtier.fleet.http`); several routers share one index by keeping
it in Redis (:class:`~kvtier.fleet.masks.RedisMasks`, one writer, :class:`FleetReader`
for readers).

Parts: :mod:`~kvtier.fleet.wire` (the wire format), :mod:`~kvtier.fleet.index` (the
index and its trust rules), :mod:`~kvtier.fleet.masks` (where the key bitmaps live),
:mod:`~kvtier.fleet.subscriber` (ZMQ, replay, snapshot requests),
:mod:`~kvtier.fleet.hashing` (vLLM's block hashes from tokens). The index, masks and
hashing need nothing beyond kvtier; the wire and the subscriber need ``pyzmq`` and
``msgspec`` (``pip install 'kvtier[fleet]'``; vLLM brings both), imported on first use.

Example::

    from kvtier.fleet import EngineEndpoint, FleetIndex, FleetSubscriber

    index = FleetIndex()
    with FleetSubscriber(index, [EngineEndpoint("a", "tcp://10.0.0.1:5557", replay="tcp://10.0.0.1:5558")]):
        ...
        index.prefix(keys)  # {"a": {"blocks": 12, "tiers": {"GPU": 4, "0:primary": 12, "1:fs": 8}, ...}}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.fleet.hashing import BlockHasher, event_hash
from kvtier.fleet.index import DEVICE, FleetIndex, FleetReader, longest_prefix
from kvtier.fleet.masks import LocationMasks, MemoryMasks, RedisMasks

if TYPE_CHECKING:
    from kvtier.fleet.subscriber import EngineEndpoint, FleetSubscriber

__all__ = [
    "DEVICE",
    "BlockHasher",
    "EngineEndpoint",
    "FleetIndex",
    "FleetReader",
    "FleetSubscriber",
    "LocationMasks",
    "MemoryMasks",
    "RedisMasks",
    "event_hash",
    "longest_prefix",
]


def __getattr__(name: str) -> Any:
    # The subscriber needs pyzmq and msgspec: import it only when asked for.
    if name in ("EngineEndpoint", "FleetSubscriber"):
        from kvtier.fleet import subscriber

        return getattr(subscriber, name)
    raise AttributeError(f"module 'kvtier.fleet' has no attribute {name!r}")
