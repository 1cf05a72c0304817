"""Small value types shared by the manager, the primary tier and the secondary tiers."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvtier.keys import BlockKey


class LookupResult(enum.Enum):
    """The answer of a lookup for one block key.

    * ``HIT``: ready in the CPU tier; the engine may load it now.
    * ``HIT_PENDING``: present, but a write into the CPU tier is in flight (a
      device store or a promotion from a secondary tier). Count it and ask again
      next step.
    * ``RETRY``: not known yet (an asynchronous lookup is under way); ask again
      next step and keep scanning the following keys.
    * ``MISS``: nowhere; stop scanning the prefix here.
    """

    HIT = "hit"
    HIT_PENDING = "hit_pending"
    RETRY = "retry"
    MISS = "miss"


class OffloadPolicy(enum.Enum):
    """Which blocks of a request are stored.

    ``BLOCK_LEVEL`` stores only newly computed blocks. ``REQUEST_LEVEL`` also
    cascades blocks that were already in the CPU tier (prefix hits) to the tiers
    that asked for it, so a request's whole prefix reaches them.
    """

    BLOCK_LEVEL = "block_level"
    REQUEST_LEVEL = "request_level"


@dataclass
class RequestContext:
    """Identifies one engine request in every manager and tier call."""

    req_id: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BlockEvent:
    """Blocks that were stored in, or removed from, one tier.

    ``tier`` is ``"primary"`` for the CPU tier or the secondary tier's label
    (``"<index>:<type>"``); ``medium`` is ``"cpu"``, ``"disk"``, ``"remote"``...
    """

    keys: tuple[BlockKey, ...]
    tier: str
    medium: str
    removed: bool
