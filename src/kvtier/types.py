"""Small value types shared by the manager, the primary tier and the secondary tiers."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvtier.keys import BlockKey

PRIMARY_LABEL = "0:primary"
"""The label of the CPU tier in events, stats, metrics and logs; secondary tier n is ``"<n>:<type>"``."""


def tier_label(index: int, tier_type: str) -> str:
    """The one label scheme used everywhere: ``"0:primary"`` or ``"<n>:<type>"`` for secondary tier n.

    ``index`` is 0 (the CPU tier, whose ``tier_type`` is ``"primary"``) or n >= 1 (the n-th
    secondary tier, whose ``tier_type`` is its registry name or import path, never empty
    and never ``"primary"``). Anything else names no tier: ValueError, naming the value.
    """
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(
            f"tier index {index!r} names no tier: give 0 (the CPU tier) or n >= 1 (the n-th secondary tier)"
        )
    if not isinstance(tier_type, str) or not tier_type.strip():
        raise ValueError(f"tier type {tier_type!r} is empty or not a string: give the tier's type, e.g. 'fs'")
    if (index == 0) != (tier_type == "primary"):
        raise ValueError(
            f"tier {index} of type {tier_type!r} is no tier: index 0 is the CPU tier (type 'primary') "
            "and only it has that type"
        )
    return PRIMARY_LABEL if index == 0 else f"{index}:{tier_type}"


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


class PrefixLookup(NamedTuple):
    """The answer of :meth:`~kvtier.manager.TieringManager.lookup_prefix` for a request's keys
    in prefix order.

    * ``answers``: one :class:`LookupResult` per key asked, in order. The scan
      stops after the first MISS, so fewer answers than keys means the last one
      is MISS.
    * ``ready``: how many leading keys answered HIT: ``keys[:ready]`` can be
      loaded now (``prepare_load``).
    * ``found``: how many keys answered HIT or HIT_PENDING (what vLLM's prefix
      scan counts as hits).
    * ``deferred``: some key answered HIT_PENDING or RETRY: ask again next step
      (vLLM then defers the request; with ``deferred`` False, ``ready == found``
      and every key before the first MISS is ready).
    """

    answers: list[LookupResult]
    ready: int
    found: int
    deferred: bool


class OffloadPolicy(enum.Enum):
    """Which blocks of a request are stored.

    ``BLOCK_LEVEL`` stores only newly computed blocks. ``REQUEST_LEVEL`` also
    cascades blocks that were already in the CPU tier (prefix hits) to the tiers
    that asked for it, so a request's whole prefix reaches them.
    """

    BLOCK_LEVEL = "block_level"
    REQUEST_LEVEL = "request_level"


@dataclass(frozen=True)
class RequestHints:
    """Application hints of one request (see :mod:`kvtier.request_control`): its
    conversation's id, whether the conversation ended with it, and when the client
    expects to send the conversation's next request (seconds after this one)."""

    session: str | None = None
    session_end: bool = False
    expected_return_s: float | None = None


@dataclass(frozen=True)
class RequestControl:
    """What one request allows kvtier to do, parsed from its ``params`` (see
    :mod:`kvtier.request_control` for the keys).

    ``load_from``: tier indices (0 = the CPU tier) its blocks may be loaded from;
    None: every tier. ``store``: whether its blocks are stored at all.
    ``cascade_to``: secondary tier indices (1-based) its stored blocks cascade to;
    None: every tier.
    """

    load_from: frozenset[int] | None = None
    store: bool = True
    cascade_to: frozenset[int] | None = None
    hints: RequestHints | None = None
    """What the serving stack told about the request's future (None: nothing); the manager
    passes them to the eviction policy when the request ends."""

    @property
    def is_default(self) -> bool:
        return self.load_from is None and self.store and self.cascade_to is None and self.hints is None


DEFAULT_CONTROL = RequestControl()


@dataclass
class RequestContext:
    """Identifies one engine request in every manager and tier call.

    ``params`` are the request's own settings (vLLM's ``kv_transfer_params``);
    ``control`` is what the manager parsed from them on first use (an engine
    integration may set it directly). Keep one context object per request so the
    parse happens once.
    """

    req_id: str
    params: dict[str, Any] = field(default_factory=dict)
    control: RequestControl | None = None

    def __post_init__(self) -> None:
        # The manager keeps per-request state by req_id: an unhashable one would fail deep inside
        # a later call. (Other hashable ids are tolerated, as engines' ids have been.)
        try:
            hash(self.req_id)
        except Exception:
            raise TypeError(f"RequestContext.req_id must be a str (the engine's request id), got "
                            f"{type(self.req_id).__name__}, which cannot be a key") from None


@dataclass(frozen=True, init=False)
class BlockEvent:
    """Blocks that were stored in, or removed from, one tier.

    ``tier`` is the tier's label: ``"0:primary"`` for the CPU tier, ``"<index>:<type>"``
    for a secondary tier (:func:`tier_label`); ``medium`` is ``"cpu"``, ``"disk"``, ``"remote"``...
    """

    keys: tuple[BlockKey, ...]
    tier: str
    medium: str
    removed: bool
    time: float = 0.0
    """When it happened (``time.time()``), for events of tiers other engines share (their
    order across engines); 0.0: not recorded (the CPU tier: its events are in order)."""

    def __init__(
        self, keys: tuple[BlockKey, ...], tier: str, medium: str, removed: bool, time: float = 0.0
    ) -> None:
        # The fields go straight into the instance dict: the generated frozen __init__ calls
        # object.__setattr__ per field, about three times slower, and the CPU tier makes an
        # event per promotion's eviction on the scheduler thread.
        values = self.__dict__
        values["keys"] = keys
        values["tier"] = tier
        values["medium"] = medium
        values["removed"] = removed
        values["time"] = time
