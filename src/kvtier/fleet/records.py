"""The decoded form of KV events, as the fleet index reads them (no wire library needed)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.engine_events import ControlRecord
from kvtier.fleet.hashing import event_hash

MAX_GROUP = (1 << 32) - 1
"""The largest KV-cache group index (vLLM's OffloadKey suffix is 4 bytes)."""


class Kind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"
    CONTROL = "control"


@dataclass(frozen=True)
class WireEvent:
    """One decoded event: ``keys`` are block keys (``group << 64 | hash``); ``medium`` is
    vLLM's (``GPU``, ``CPU``, ``STORAGE``; None: the device); ``ownership`` names a kvtier
    secondary tier; ``control`` is set for kvtier control records."""

    kind: Kind
    keys: tuple[int, ...] = ()
    medium: str | None = None
    ownership: str | None = None
    control: ControlRecord | None = None


@dataclass(frozen=True)
class WireBatch:
    ts: float
    events: list[WireEvent]
    skipped: int
    """Events not understood (an unknown type, a malformed field or control record)."""


def block_key(raw_hash: int | bytes, group: int | None) -> int:
    """The fleet's key of a block: its event hash (lower 64 bits) and KV-cache group."""
    return ((group or 0) << 64) | event_hash(raw_hash)
