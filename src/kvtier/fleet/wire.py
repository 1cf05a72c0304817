"""vLLM's KV event wire format, read: one ZMQ message is ``[topic, seq, payload]``.

``seq`` is 8 bytes big-endian, counting the publisher's batches from 0 at its start;
``payload`` is a msgpack ``KVEventBatch``: an array ``[ts, events, data_parallel_rank]``
whose events are maps tagged by ``"type"``: ``BlockStored`` (``block_hashes``,
``parent_block_hash``, ``token_ids``, ``block_size``, ``medium``, ``group_idx``,
``ownership`` ...), ``BlockRemoved`` (``block_hashes``, ``medium``, ``group_idx``,
``ownership``) and ``AllBlocksCleared``. kvtier's control records travel as
``BlockRemoved`` events whose ``ownership`` is the record
(:mod:`kvtier.engine_events`).

Everything here comes from the network: the payload is decoded into typed structs
(wrong types are refused), events of types this release does not know are skipped
and counted, and hashes and groups are range-checked; a payload nested too deep to
decode is refused like any other malformed one. Decoding never evaluates
anything. Needs ``msgspec`` (``pip install 'kvtier[fleet]'``; vLLM brings it).
"""

from __future__ import annotations

import msgspec

from kvtier.engine_events import ControlRecord
from kvtier.fleet.records import MAX_GROUP, Kind, WireBatch, WireEvent, block_key

_MAX_HASH_BYTES = 64


class _BlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None
    ownership: str | None = None


class _BlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None
    ownership: str | None = None


class _AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class WireError(ValueError):
    """A message that is not a KV event batch at all."""


_BATCH = msgspec.msgpack.Decoder(_Batch)
_EVENT = msgspec.msgpack.Decoder(_BlockStored | _BlockRemoved | _AllBlocksCleared)


def _keys(hashes: list[int | bytes], group: int | None) -> tuple[int, ...]:
    if group is not None and not 0 <= group <= MAX_GROUP:
        raise ValueError(f"group_idx {group} out of range")
    for h in hashes:
        if isinstance(h, bytes) and len(h) > _MAX_HASH_BYTES:
            raise ValueError(f"a block hash of {len(h)} bytes")
        if isinstance(h, int) and h < 0:
            raise ValueError("a negative block hash")
    return tuple(block_key(h, group) for h in hashes)


def decode_batch(payload: bytes) -> WireBatch:
    """Decode one ``KVEventBatch``; raises :class:`WireError` if the payload is not one."""
    try:
        batch = _BATCH.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"not a KV event batch: {exc}") from None
    except RecursionError:  # nesting a thousand deep takes a ~1 KB message
        raise WireError("not a KV event batch: nested too deep") from None
    events: list[WireEvent] = []
    skipped = 0
    for raw in batch.events:
        try:
            event = _EVENT.decode(raw)
            if isinstance(event, _AllBlocksCleared):
                events.append(WireEvent(Kind.CLEARED))
                continue
            if isinstance(event, _BlockRemoved):
                control = ControlRecord.decode(event.ownership) if event.ownership else None
                if control is not None:
                    events.append(WireEvent(Kind.CONTROL, control=control))
                    continue
            kind = Kind.STORED if isinstance(event, _BlockStored) else Kind.REMOVED
            events.append(WireEvent(kind, _keys(event.block_hashes, event.group_idx), event.medium, event.ownership))
        except (msgspec.DecodeError, ValueError, RecursionError):
            skipped += 1
    return WireBatch(batch.ts, events, skipped)
