"""Per-request control: what one request lets kvtier do with its blocks.

A request carries its settings in :attr:`RequestContext.params` (under vLLM:
the request's ``kv_transfer_params``). The keys:

``kvtier_load_tiers``
    The tiers this request may load blocks from: a list of selectors (or one
    selector). Blocks held only in other tiers count as misses for it (they
    are recomputed, never promoted for it). Default: every tier.
``kvtier_store``
    ``false``: this request's blocks are not offloaded at all (neither to the
    CPU tier nor beyond), e.g. for a one-off prompt. Default ``true``.
``kvtier_cascade_tiers``
    The secondary tiers the blocks this request stores are cascaded to (a list
    of selectors); ``[]`` keeps them in the CPU tier only. Default: every tier.

A selector names tiers: ``"cpu"`` (also ``"primary"``, ``"0:primary"``) for the
CPU tier, a label such as ``"1:fs"``, a tier type such as ``"fs"`` or
``"redis"`` (every tier of that type), ``"local"`` or ``"remote"`` (by where a
tier keeps its data: the CPU tier and disk tiers are local, Redis and S3
remote), or ``"all"``. Excluding the CPU tier from ``kvtier_load_tiers`` means
nothing is loaded for the request (every block is the gateway's).

Pure functions; the manager parses a request's params once, on first use, from
its scheduler thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError
from kvtier.types import PRIMARY_LABEL, RequestControl

LOAD_TIERS_KEY = "kvtier_load_tiers"
STORE_KEY = "kvtier_store"
CASCADE_TIERS_KEY = "kvtier_cascade_tiers"
CONTROL_KEYS = (LOAD_TIERS_KEY, STORE_KEY, CASCADE_TIERS_KEY)

_CPU_NAMES = frozenset({"cpu", "primary", PRIMARY_LABEL})
_LOCALITIES = frozenset({"local", "remote"})


class RequestControlError(ConfigError):
    """A request's kvtier setting is malformed; the message names the key, the value and the choices."""


@dataclass(frozen=True)
class TierDescriptor:
    """What a selector can match of one tier: index (0 = CPU tier), label, type and locality."""

    index: int
    label: str
    tier_type: str
    locality: str


def tier_locality(medium: str, declared: object = None) -> str:
    """``"local"`` or ``"remote"``: a tier's declared ``locality``, else ``remote`` for the
    ``remote`` medium and ``local`` for every other (cpu, disk, memory)."""
    if isinstance(declared, str) and declared.lower() in _LOCALITIES:
        return declared.lower()
    return "remote" if medium == "remote" else "local"


def select_tiers(key: str, raw: Any, tiers: Sequence[TierDescriptor]) -> frozenset[int]:
    """The indices of ``tiers`` that the selectors ``raw`` (a string or a list of them) name.

    Raises :class:`RequestControlError` for anything else, naming the selectors
    this engine's tiers offer.
    """
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
        raise RequestControlError(
            f"{key} must be a list of tier selectors (strings), got {raw!r}: e.g. [\"cpu\", \"fs\"]"
        )
    chosen: set[int] = set()
    for item in items:
        name = item.strip().lower()
        if name == "all":
            matched = {t.index for t in tiers}
        elif name in _CPU_NAMES:
            matched = {0}
        elif name in _LOCALITIES:
            matched = {t.index for t in tiers if t.locality == name}
        else:
            matched = {t.index for t in tiers if name in (t.label.lower(), t.tier_type.lower())}
            if not matched:
                known = sorted({"cpu", "all", "local", "remote"} | {n for t in tiers for n in (t.label, t.tier_type)})
                raise RequestControlError(f"{key} names {item!r}, which is no tier of this engine: use one of {known}")
        chosen |= matched
    return frozenset(chosen)


def parse_control(params: Mapping[str, Any], tiers: Sequence[TierDescriptor]) -> tuple[RequestControl, list[str]]:
    """The :class:`RequestControl` that ``params`` ask for, and one message per malformed key.

    A malformed key falls back to its default (the others still apply); the
    caller logs the messages. ``tiers`` describes every tier, the CPU tier first.
    """
    errors: list[str] = []
    load_from: frozenset[int] | None = None
    cascade_to: frozenset[int] | None = None
    store = True
    raw = params.get(LOAD_TIERS_KEY)
    if raw is not None:
        try:
            load_from = select_tiers(LOAD_TIERS_KEY, raw, tiers)
        except RequestControlError as exc:
            errors.append(str(exc))
    raw = params.get(STORE_KEY)
    if raw is not None:
        if isinstance(raw, bool):
            store = raw
        else:
            errors.append(f"{STORE_KEY} must be true or false, got {raw!r}")
    raw = params.get(CASCADE_TIERS_KEY)
    if raw is not None:
        try:
            cascade_to = select_tiers(CASCADE_TIERS_KEY, raw, tiers) - {0}
        except RequestControlError as exc:
            errors.append(str(exc))
    if load_from is not None and load_from >= {t.index for t in tiers}:
        load_from = None
    if cascade_to is not None and cascade_to >= {t.index for t in tiers if t.index}:
        cascade_to = None
    return RequestControl(load_from=load_from, store=store, cascade_to=cascade_to), errors


__all__ = [
    "CASCADE_TIERS_KEY",
    "CONTROL_KEYS",
    "LOAD_TIERS_KEY",
    "STORE_KEY",
    "RequestControlError",
    "TierDescriptor",
    "parse_control",
    "select_tiers",
    "tier_locality",
]
