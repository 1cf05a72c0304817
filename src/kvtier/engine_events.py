"""Block events a router can trust: one engine start's changes to its tiers, stamped and in order.

An engine integration wraps its :class:`~kvtier.manager.TieringManager` in an
:class:`EngineEventStream` and, on the scheduler thread, calls :meth:`EngineEventStream.take`
where it would call ``manager.take_events()``, :meth:`EngineEventStream.reset_cache` instead of
the manager's, and :meth:`EngineEventStream.has_pending_output` beside ``has_pending_work``. The
vLLM adapter sends the stream through vLLM's own KV event publisher
(:mod:`kvtier.integrations.vllm.manager`); :mod:`kvtier.fleet` reads it.

The stream is a sequence of :class:`ControlRecord` and :class:`~kvtier.types.BlockEvent` items:

* Every take that reports anything starts with a control record, and every control record
  names the engine, its **start** (random, new at every start of the engine) and its **seq**
  (0 for the start's first record, then +1 per record, never a gap), so a consumer that joins
  at any point knows whose events follow and can tell a lost record (a gap) and a restart (a
  new start) apart. Every record but ``events`` also lists the engine's tiers
  (:class:`TierInfo`) and ``info``. A record's ``time`` is when what follows it happened
  (wall clock): each change to a shared store comes after an ``events`` record of its own
  with the time of the change, so a consumer can order several engines' changes to one
  store.
* ``hello``: the first record of a start. The engine's private tiers are empty.
* ``events``: the block events that follow are changes this engine made.
* ``clear``: a private tier of this engine holds nothing now (``reset_cache`` cleared the CPU
  tier; its removals are reported too, for consumers that read only block events).
* ``snapshot``: part ``part`` of what a tier holds, its stored events follow (``last`` on the
  final part). Part 0 of a private tier's snapshot also clears it. ``complete``: the tier
  listed everything its store holds, other engines' blocks included (an fs root followed
  through the change journals), so a consumer may drop what it believed the store held
  beyond that and not stored since the snapshot began. Sent for each tier that can
  list its holdings when the engine starts (``reason="start"``: persistent tiers announce what
  they already hold, once their start-up scan is done), when a consumer asks
  (:meth:`EngineEventStream.request_snapshot`, ``reason="request"``) and when the CPU tier's
  bounded event queue may have lost events (``reason="overflow"``). Parts are at most
  ``part_keys`` keys, one batch per engine step, each key checked to be still held as it is
  sent, so the snapshot plus the events around it add up to what the tier holds.
* ``mark``: a marker a consumer asked for (:meth:`EngineEventStream.mark`): everything the
  engine did before it comes before it in the stream.

**Scopes.** A tier is private to the engine start (``scope="engine"``: the CPU tier, an
in-process memory tier; gone with the start) or a store other engines may share
(``scope="shared"``: an fs root, Redis, S3), named by a store id: a digest of the tier's
:meth:`~kvtier.tiers.base.SecondaryTier.store_location` and the namespace, the same in every
engine configured to share it. What a shared store holds is a fact about the store: any
engine's stored or removed events change it, and it outlives engine starts.

**Who emits what.** An engine reports only the changes it makes to storage: blocks it stored,
blocks it evicted (from a shared fs root, other engines' files included) and values it found
corrupt and deleted. What it learns about other engines' changes (an fs root's change
journals, a lookup that finds another engine's block) it does not report: the engine that made
the change did, and a second, later copy could arrive after a newer change and undo it. The
one exception: a value found missing when loading it (expired or evicted by Redis itself,
deleted by an S3 lifecycle rule, gone from an fs root) is reported removed, timed before the
read, since nobody else may ever report it; a newer store of the key still wins.

Threads: every method is called from the engine's scheduler thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.keys import BlockKey
from kvtier.manager import TieringManager
from kvtier.request_control import describe_value
from kvtier.types import PRIMARY_LABEL, BlockEvent

logger = logging.getLogger(__name__)

CONTROL_PREFIX = "kvtier-events/1 "
"""How a control record begins when it travels as a string (vLLM: an event's ``ownership``)."""

MAX_CONTROL_CHARS = 65536
"""A longer control string is refused when decoding (it comes from the network)."""

SCOPE_ENGINE = "engine"
SCOPE_SHARED = "shared"
OPS = frozenset({"hello", "events", "clear", "snapshot", "mark"})
SNAPSHOT_REASONS = frozenset({"start", "request", "overflow"})

_MAX_NAME = 256
_MAX_COUNT = (1 << 63) - 1  # a seq or a part number: an int64, as every consumer can hold it
_MAX_TIERS = 64
_MAX_INFO_ITEMS = 64
_MAX_INFO_TEXT = 1024


def is_info_value(value: Any) -> bool:
    """What a value of a control record's ``info`` may be: a string of at most 1024 characters,
    an integer that fits in 64 bits, a finite float, a boolean or null. Nothing nested: every
    consumer must be able to compare, hash and re-encode it (as strict JSON)."""
    if value is None or isinstance(value, bool):
        return True
    if isinstance(value, str):
        return len(value) <= _MAX_INFO_TEXT
    if isinstance(value, int):
        return -(1 << 63) <= value < 1 << 64
    return isinstance(value, float) and math.isfinite(value)


@dataclass(frozen=True)
class TierInfo:
    """One tier of an engine as its events name it: ``label`` (``"0:primary"``, ``"1:fs"``),
    type, medium, scope (:data:`SCOPE_ENGINE` or :data:`SCOPE_SHARED`) and, when shared, the
    store id."""

    label: str
    tier_type: str
    medium: str
    scope: str
    store: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "type": self.tier_type, "medium": self.medium, "scope": self.scope,
                "store": self.store}  # fmt: skip

    @classmethod
    def from_dict(cls, raw: Any) -> TierInfo:
        if not isinstance(raw, dict):
            raise ValueError(f"a tier must be an object, got {type(raw).__name__}")
        label, tier_type, medium = (_check_name(f"tier {k}", raw.get(k)) for k in ("label", "type", "medium"))
        scope, store = raw.get("scope"), raw.get("store")
        if scope not in (SCOPE_ENGINE, SCOPE_SHARED):
            raise ValueError(f"tier scope must be {SCOPE_ENGINE!r} or {SCOPE_SHARED!r}, got {scope!r}")
        if scope == SCOPE_SHARED:
            _check_name("tier store", store)
        elif store is not None:
            raise ValueError(f"a tier of scope {SCOPE_ENGINE!r} names no store, got {store!r}")
        return cls(label, tier_type, medium, scope, store)


def store_id(location: str, namespace_hex: str) -> str:
    """The id of a shared store: engines whose tiers give the same location and namespace get the same id."""
    return hashlib.sha256(f"{location}\n{namespace_hex}".encode()).hexdigest()[:24]


def describe_tiers(manager: TieringManager) -> tuple[TierInfo, ...]:
    """The CPU tier and every secondary tier of ``manager`` as events name them."""
    tiers = [TierInfo(PRIMARY_LABEL, "cpu", manager.primary.medium, SCOPE_ENGINE)]
    for tier in manager.tiers:
        location = tier.store_location()
        if location is None:
            tiers.append(TierInfo(tier.label, tier.tier_type, tier.medium, SCOPE_ENGINE))
        else:
            store = store_id(location, tier.context.namespace.hexdigest)
            tiers.append(TierInfo(tier.label, tier.tier_type, tier.medium, SCOPE_SHARED, store))
    return tuple(tiers)


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond any float
        return False


def _check_name(what: str, value: Any) -> str:
    if type(value) is not str or not 0 < len(value) <= _MAX_NAME:  # a str subclass's len() is the caller's
        raise ValueError(f"{what} must be a string of 1 to {_MAX_NAME} characters, got {describe_value(value)}")
    return value


@dataclass(frozen=True)
class ControlRecord:
    """One control record of an engine's stream (see the module docstring for the ops).

    ``info`` is what the engine integration says about itself (vLLM: tokens per block, blocks
    per offloaded chunk, hash algorithm, model, namespace); ``tier`` names the tier of a
    ``clear`` or ``snapshot``; ``part``/``last``/``reason`` describe a snapshot part;
    ``marker`` is a ``mark``'s marker.
    """

    op: str
    engine: str
    start: str
    seq: int
    time: float
    tiers: tuple[TierInfo, ...] = ()
    info: Mapping[str, Any] = field(default_factory=dict)
    tier: str | None = None
    part: int = 0
    last: bool = False
    complete: bool = False
    reason: str | None = None
    marker: str | None = None

    def encode(self) -> str:
        """The record as a string: :data:`CONTROL_PREFIX` and compact JSON."""
        body: dict[str, Any] = {
            "op": self.op, "engine": self.engine, "start": self.start, "seq": self.seq, "time": round(self.time, 6),
        }  # fmt: skip
        if self.tiers:
            body["tiers"] = [t.as_dict() for t in self.tiers]
        if self.info:
            body["info"] = dict(self.info)
        if self.tier is not None:
            body["tier"] = self.tier
        if self.op == "snapshot":
            body.update(part=self.part, last=self.last, complete=self.complete, reason=self.reason)
        if self.marker is not None:
            body["marker"] = self.marker
        return CONTROL_PREFIX + json.dumps(body, separators=(",", ":"), sort_keys=True)

    @classmethod
    def decode(cls, text: str) -> ControlRecord | None:
        """Parse a string from the network: None if it is not a control record (no prefix);
        ValueError naming the problem if it is one but malformed."""
        if not isinstance(text, str) or not text.startswith(CONTROL_PREFIX):
            return None
        if len(text) > MAX_CONTROL_CHARS:
            raise ValueError(f"control record of {len(text)} characters (at most {MAX_CONTROL_CHARS})")
        try:
            body = json.loads(text[len(CONTROL_PREFIX) :])
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"control record is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ValueError("control record is not a JSON object")
        op = body.get("op")
        if op not in OPS:
            raise ValueError(f"control record op {op!r:.40} is not one of {sorted(OPS)}")
        seq = body.get("seq")
        stamp = body.get("time", 0.0)
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= _MAX_COUNT:
            raise ValueError(f"control record seq must be an integer in [0, 2**63), got {seq!r:.40}")
        if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not _finite(stamp):
            # (NaN would win every comparison of change times that decides a shared store's keys)
            raise ValueError(f"control record time must be a finite number, got {stamp!r:.40}")
        tiers_raw = body.get("tiers", [])
        if not isinstance(tiers_raw, list) or len(tiers_raw) > _MAX_TIERS:
            raise ValueError(f"control record tiers must be a list of at most {_MAX_TIERS} tiers")
        tiers = tuple(TierInfo.from_dict(t) for t in tiers_raw)
        if len({t.label for t in tiers}) != len(tiers):
            raise ValueError("control record names a tier label twice")
        info = body.get("info", {})
        if not isinstance(info, dict) or len(info) > _MAX_INFO_ITEMS:
            raise ValueError(f"control record info must be an object of at most {_MAX_INFO_ITEMS} items")
        for key, value in info.items():
            if len(key) > _MAX_NAME or not is_info_value(value):
                raise ValueError(f"control record info {key!r:.40} must be a string of at most {_MAX_INFO_TEXT} "
                                 f"characters, a 64-bit integer, a finite number, a boolean or null; got "
                                 f"{describe_value(value)}")  # fmt: skip
        tier = body.get("tier")
        if op in ("clear", "snapshot"):
            _check_name(f"{op} tier", tier)
            if tier not in {t.label for t in tiers}:
                raise ValueError(f"{op} names tier {tier!r}, which the record does not list")
        part, last, complete = body.get("part", 0), body.get("last", False), body.get("complete", False)
        reason, marker = body.get("reason"), body.get("marker")
        if op == "snapshot":
            if isinstance(part, bool) or not isinstance(part, int) or not 0 <= part <= _MAX_COUNT:
                raise ValueError(f"snapshot part must be an integer in [0, 2**63), got {part!r:.40}")
            if not isinstance(last, bool) or not isinstance(complete, bool):
                raise ValueError(f"snapshot last and complete must be booleans, got {last!r:.40}, {complete!r:.40}")
            if reason not in SNAPSHOT_REASONS:
                raise ValueError(f"snapshot reason {reason!r:.40} is not one of {sorted(SNAPSHOT_REASONS)}")
        if op == "mark":
            _check_name("mark marker", marker)
        return cls(
            op=op, engine=_check_name("engine", body.get("engine")), start=_check_name("start", body.get("start")),
            seq=seq, time=float(stamp), tiers=tiers, info=info, tier=tier if op in ("clear", "snapshot") else None,
            part=part if op == "snapshot" else 0, last=op == "snapshot" and last,
            complete=op == "snapshot" and complete,
            reason=reason if op == "snapshot" else None, marker=marker if op == "mark" else None,
        )  # fmt: skip


StreamItem = ControlRecord | BlockEvent


@dataclass
class _Snapshot:
    """A snapshot of one tier being sent part by part."""

    tier: TierInfo
    keys: list[BlockKey]
    holds: Callable[[BlockKey], bool]
    reason: str
    complete: bool
    pos: int = 0
    part: int = 0


@dataclass(frozen=True)
class _Op:
    """A control record to send in order with the queued events (seq assigned when sent)."""

    op: str
    tier: str | None = None
    marker: str | None = None


class EngineEventStream:
    """One engine start's event stream over a :class:`TieringManager` (see the module docstring).

    ``engine`` names the engine (vLLM: its engine id); ``info`` is sent in every control
    record. ``part_keys`` bounds the keys of snapshot parts sent per take; a consumer's
    snapshot requests closer than ``snapshot_interval`` seconds to the last one are
    ignored (a request costs the engine a pass over every tier's index). ``start`` is
    random unless given (tests).
    """

    def __init__(
        self,
        manager: TieringManager,
        *,
        engine: str,
        info: Mapping[str, Any] | None = None,
        part_keys: int = 4096,
        snapshot_interval: float = 5.0,
        start: str | None = None,
    ) -> None:
        if part_keys < 1:
            raise ValueError(f"part_keys must be >= 1, got {part_keys}")
        self.manager = manager
        self.engine = _check_name("engine", engine)
        self.start = start or os.urandom(8).hex()
        self.info = dict(info or {})
        self.tiers = describe_tiers(manager)
        self._shared = frozenset(t.label for t in self.tiers if t.scope == SCOPE_SHARED)
        self.part_keys = part_keys
        self.snapshot_interval = snapshot_interval
        self._seq = 0
        self._queue: list[BlockEvent | _Op] = []
        self._snapshots: list[_Snapshot] = []
        self._last_request = -float("inf")
        self._overflows = manager.primary.events_overflowed
        # Tiers that list their holdings announce them once they can (an fs tier: after its scan).
        self._announce = [
            (info_, tier) for info_, tier in zip(self.tiers[1:], manager.tiers, strict=True) if tier.lists_holdings
        ]

    # --- scheduler thread --------------------------------------------------------------------

    def take(self) -> list[StreamItem]:
        """Everything to report since the last call, in order; empty if nothing. At most
        ``part_keys`` snapshot keys per call (the rest follows in later calls)."""
        out: list[StreamItem] = []
        if self._seq == 0:
            out.append(self._record("hello"))
        self._flush()
        overflows = self.manager.primary.events_overflowed
        if overflows != self._overflows:
            self._overflows = overflows
            logger.warning("kvtier events: the CPU tier's event queue overflowed; sending a snapshot of it")
            self._snapshot_cpu("overflow")
        self._poll_announcements()
        stamped = bool(out)
        for item in self._queue:
            if isinstance(item, _Op):
                out.append(self._record(item.op, tier=item.tier, marker=item.marker))
                stamped = True
            elif not item.keys:
                continue
            elif item.tier in self._shared:
                # A shared store's change carries its own time: other engines change the store too.
                out.append(self._record("events", at=item.time or time.time()))
                out.append(item)
                stamped = True
            else:
                if not stamped:
                    out.append(self._record("events"))
                    stamped = True
                out.append(item)
        self._queue.clear()
        self._send_snapshot_parts(out)
        return out

    def has_pending_output(self) -> bool:
        """True while something is ready to send that needs an engine step to go out (the
        hello, queued records, snapshot parts). A tier still scanning does not count: its
        announcement goes out with the first step after the scan."""
        if self._seq == 0 or self._queue or self._snapshots:
            return True
        self._poll_announcements()
        return bool(self._snapshots)

    def reset_cache(self, drain_timeout: float | None = None) -> None:
        """``manager.reset_cache``, and a ``clear`` of the CPU tier once it is empty (also when
        the reset raised after clearing it)."""
        self._flush()
        try:
            self.manager.reset_cache(drain_timeout)
        finally:
            self._flush()
            if len(self.manager.primary) == 0:
                self._queue.append(_Op("clear", tier=PRIMARY_LABEL))

    def request_snapshot(self) -> bool:
        """Send a snapshot of the CPU tier and of every tier that lists its holdings; False
        (nothing queued) while one is being sent or within ``snapshot_interval`` seconds of
        the last request."""
        now = time.monotonic()
        if self._snapshots or now - self._last_request < self.snapshot_interval:
            return False
        self._last_request = now
        self._flush()
        self._snapshot_cpu("request")
        for info, tier in zip(self.tiers[1:], self.manager.tiers, strict=True):
            if tier.lists_holdings and (info, tier) not in self._announce:
                self._snapshot_tier(info, tier, "request")
        return True

    def mark(self, marker: str) -> None:
        """Queue a ``mark`` record after everything reported so far."""
        self._flush()
        self._queue.append(_Op("mark", marker=_check_name("marker", marker)))

    # --- internals --------------------------------------------------------------------------

    def _record(self, op: str, at: float | None = None, **fields: Any) -> ControlRecord:
        """The next control record; ``events`` records leave out the tiers and the info (every
        other record carries them)."""
        tiers: tuple[TierInfo, ...] = ()
        info: dict[str, Any] = {}
        if op != "events":
            tiers, info = self.tiers, self.info
        record = ControlRecord(op, self.engine, self.start, self._seq, time.time() if at is None else at, tiers, info,
                               **fields)  # fmt: skip
        self._seq += 1
        return record

    def _flush(self) -> None:
        self._queue.extend(self.manager.take_events())

    def _snapshot_cpu(self, reason: str) -> None:
        primary = self.manager.primary
        self._snapshots.append(_Snapshot(self.tiers[0], primary.ready_keys(), self._cpu_holds, reason, True))

    def _cpu_holds(self, key: BlockKey) -> bool:
        ref = self.manager.primary.ref_count(key)
        return ref is not None and ref >= 0

    def _snapshot_tier(self, info: TierInfo, tier: Any, reason: str) -> bool:
        try:
            keys = tier.held_keys()
        except Exception:
            logger.exception("kvtier events: tier %s could not list its holdings", info.label)
            return True  # never ask again
        if keys is None:
            return False
        self._snapshots.append(_Snapshot(info, keys, tier.holds, reason, bool(tier.holdings_complete())))
        return True

    def _poll_announcements(self) -> None:
        if self._announce:
            self._announce = [(i, t) for i, t in self._announce if not self._snapshot_tier(i, t, "start")]

    def _send_snapshot_parts(self, out: list[StreamItem]) -> None:
        budget = self.part_keys
        while self._snapshots and budget > 0:
            job = self._snapshots[0]
            chunk = job.keys[job.pos : job.pos + budget]
            job.pos += len(chunk)
            budget -= len(chunk)
            last = job.pos >= len(job.keys)
            out.append(self._record("snapshot", tier=job.tier.label, part=job.part, last=last, reason=job.reason,
                                    complete=job.complete))  # fmt: skip
            job.part += 1
            held = tuple(key for key in chunk if job.holds(key))
            if held:
                out.append(BlockEvent(held, job.tier.label, job.tier.medium, removed=False))
            if last:
                self._snapshots.pop(0)
