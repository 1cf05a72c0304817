"""The manager's snapshot (:class:`~kvtier.telemetry.ManagerSnapshot`), built by pure functions.

What the tiers themselves say (their counters, usage and health) is read through
each handle's guarded calls (:meth:`TierReading.of`) before these functions run,
so building a snapshot never raises because a tier misbehaves.

Lookup answers are counted without a counter per HIT (:class:`LookupTally`):
every HIT logs its key for the step's eviction protection, and the manager
counts the logged keys as it empties the log; every other answer is counted
where it is given, and each CPU miss ends as exactly one answer other than a
CPU tier's HIT_PENDING.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import asdict, fields, replace
from typing import Any, NamedTuple

from kvtier.manager.admission_guard import ReturnWatch
from kvtier.manager.handle import TierHandle
from kvtier.manager.tierset import TierSet
from kvtier.primary import PrimaryTier
from kvtier.telemetry import (
    AdmissionSnapshot,
    LookupCounts,
    ManagerSnapshot,
    PolicySnapshot,
    TierSnapshot,
    TierTelemetry,
    TransferTotals,
)
from kvtier.types import PRIMARY_LABEL, LookupResult


class LookupTally:
    """The manager's lookup answers other than HIT (see the module docstring). Scheduler thread only."""

    __slots__ = ("cpu_pending", "miss", "pending", "retry", "unasked")

    def __init__(self) -> None:
        self.cpu_pending = 0  # the CPU tier answered: write in flight
        self.unasked = 0  # MISS without asking the CPU tier (the request may load nothing)
        self.pending = 0  # the manager's answers: HIT_PENDING, RETRY, MISS
        self.retry = 0
        self.miss = 0

    def cpu_counts(self, hits: int) -> tuple[int, int, int]:
        """The CPU tier's answers to the manager, given the HITs answered: ``(hits, pending, misses)``."""
        misses = self.miss - self.unasked + self.retry + self.pending - self.cpu_pending
        return hits, self.cpu_pending, misses

    def answers(self, hits: int) -> dict[str, int]:
        """The manager's answers by :class:`~kvtier.types.LookupResult` value, given the HITs."""
        return {
            LookupResult.HIT.value: hits,
            LookupResult.HIT_PENDING.value: self.pending,
            LookupResult.RETRY.value: self.retry,
            LookupResult.MISS.value: self.miss,
        }


_Counters = tuple[dict[str, Any], dict[str, float], dict[str, str]]
"""A tier's own counters, its extra metrics, and the kind of each extra metric."""


class TierReading(NamedTuple):
    """What a secondary tier said about itself for one snapshot (safe defaults where it failed)."""

    counters: dict[str, Any]
    extra: dict[str, float]
    extra_kinds: dict[str, str]
    used_bytes: int | None
    capacity_bytes: int | None
    entries: int | None
    health: str

    @classmethod
    def of(cls, handle: TierHandle) -> TierReading:
        """Read ``handle``'s tier: its counters, and its usage and health while it is live (a shut
        down tier's health is ``down``, a failed ``health()`` gives ``unknown``). Counters that fail
        to read are the last ones read (``handle.last_counters``; none before the first): a counter
        never falls back to 0 for one snapshot."""
        read: _Counters | None = handle.guard("stats", lambda: _own_counters(handle.tier), None)
        if read is None:
            read = handle.last_counters
        else:
            handle.last_counters = read
        counters, extra, kinds = read
        usage: tuple[int | None, int | None, int | None] = (None, None, None)
        health = "down"
        if handle.live:
            usage = handle.guard("usage", lambda: _usage(handle.tier), usage)
            health = handle.guard("health", lambda: handle.tier.health().state.value, "unknown")
        return cls(counters, extra, kinds, *usage, health)


def _number(what: str, value: Any, optional: bool = False) -> Any:
    """``value`` as a plain ``int`` or finite ``float`` (None kept if ``optional``); TypeError naming
    ``what`` for anything else, so a tier's malformed figure takes its reading's safe default."""
    if value is None and optional:
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real) and math.isfinite(value):
        return float(value)
    shown = f"{value!r:.40}" if isinstance(value, float | str | type(None)) else f"a {type(value).__name__}"
    raise TypeError(f"{what} must be a finite number, got {shown}")


def _own_counters(tier: Any) -> _Counters:
    own = tier.stats
    counters = {f.name: _number(f"stats.{f.name}", getattr(own, f.name)) for f in fields(own) if f.name != "extra"}
    # dict() copies in one step (C, under the GIL): a tier's I/O thread may add a name meanwhile,
    # which an iteration of the live dict fails on ("changed size during iteration").
    extra = {str(k): float(v) for k, v in dict(own.extra).items()}
    declared = getattr(tier, "extra_metrics", {})
    return counters, extra, {name: getattr(declared.get(name), "kind", "gauge") for name in extra}


def _usage(tier: Any) -> tuple[int | None, int | None, int | None]:
    usage = tier.usage()
    return (int(_number("usage().used_bytes", usage.used_bytes)),
            None if (cap := _number("usage().capacity_bytes", usage.capacity_bytes, True)) is None else int(cap),
            None if (n := _number("usage().entries", usage.entries, True)) is None else int(n))


def cpu_snapshot(primary: PrimaryTier, telemetry: TierTelemetry, answers: tuple[int, int, int],
                 alloc_failures: int) -> TierSnapshot:
    """The CPU tier: its own counters plus the manager's ``answers`` (hits, pending, misses)."""
    own = primary.stats  # its own lookup() calls; the manager's lookups are added
    hits, pending, misses = answers
    ps = replace(own, hits=own.hits + hits, hits_pending=own.hits_pending + pending, misses=own.misses + misses)
    stride = primary.region.row_stride
    return TierSnapshot(
        index=0,
        label=PRIMARY_LABEL,
        tier_type="primary",
        medium=primary.medium,
        locality="local",
        implementation=type(primary).__qualname__,
        lookups=LookupCounts(hit=ps.hits, hit_pending=ps.hits_pending, miss=ps.misses),
        lookup_seconds=telemetry.lookup_seconds.snapshot(),
        lookup_async_seconds=telemetry.lookup_async_seconds.snapshot(),
        promotion_wait_seconds=telemetry.promotion_wait_seconds.snapshot(),
        written=TransferTotals(blocks=ps.blocks_stored, bytes=ps.blocks_stored * primary.block_bytes),
        read=TransferTotals(**asdict(telemetry.read)),
        failures={
            **telemetry.failures,
            "store_failed": ps.store_failures,
            "store_rejected": ps.store_rejections,
            "stray_load_completion": ps.stray_load_completions,
            "promotion_alloc_failed": alloc_failures,
        },
        stores_in_flight=0,
        loads_in_flight=0,
        used_bytes=(len(primary) + primary.held_count) * stride,
        capacity_bytes=primary.num_blocks * stride,
        entries=len(primary),
        evictions=ps.evictions,
        health="down" if primary.is_shut_down else "closed",
        counters=asdict(ps),
        policy=PolicySnapshot.of(primary.policy),
        # Rows a reset holds out while an engine copy may still touch them (PrimaryTier.reset).
        extra={"held_rows": float(primary.held_count)},
        extra_kinds={"held_rows": "gauge"},
    )


def _admission(handle: TierHandle) -> AdmissionSnapshot:
    """How ``handle``'s tier admits cascades, with the learned rule's guard when it has one."""
    telemetry, admission = handle.telemetry, handle.admission
    snap = AdmissionSnapshot(
        rule=str(getattr(handle.context, "admission", "all")),  # (the handle's: a tier may drop its own)
        admitted_blocks=telemetry.admitted_blocks,
        declined_blocks=telemetry.declined_blocks,
        learned_declined=getattr(admission, "declined", 0),
    )
    watch = getattr(admission, "watch", None)
    if not isinstance(watch, ReturnWatch):
        return snap
    share = watch.sampled_share
    return replace(snap, guard=watch.state, hits_gained=watch.gained / share, hits_lost=watch.lost / share,
                   guard_fallbacks=watch.fallbacks, overridden_blocks=getattr(admission, "overridden", 0))


def tier_snapshot(handle: TierHandle, reading: TierReading) -> TierSnapshot:
    """One secondary tier: what it said of itself (``reading``) and what the manager observed."""
    counters, telemetry, descriptor = reading.counters, handle.telemetry, handle.descriptor
    failures = dict(telemetry.failures)
    for kind, name in (("store_failed", "stores_failed"), ("load_failed", "loads_failed"),
                       ("store_dropped", "stores_dropped"), ("corrupt_value", "corrupt_values")):
        failures[kind] = int(counters.get(name, 0))
    return TierSnapshot(
        index=handle.index,
        label=descriptor.label,
        tier_type=descriptor.tier_type,
        medium=str(getattr(handle.tier, "medium", "storage")),
        locality=descriptor.locality,
        implementation=type(handle.tier).__qualname__,
        lookups=LookupCounts(
            hit=int(counters.get("lookups_hit", 0)),
            retry=int(counters.get("lookups_retry", 0)),
            miss=int(counters.get("lookups_miss", 0)),
        ),
        lookup_seconds=telemetry.lookup_seconds.snapshot(),
        lookup_async_seconds=telemetry.lookup_async_seconds.snapshot(),
        promotion_wait_seconds=telemetry.promotion_wait_seconds.snapshot(),
        written=TransferTotals(**asdict(telemetry.written)),
        read=TransferTotals(**asdict(telemetry.read)),
        failures=failures,
        stores_in_flight=telemetry.stores_in_flight,
        loads_in_flight=telemetry.loads_in_flight,
        used_bytes=reading.used_bytes,
        capacity_bytes=reading.capacity_bytes,
        entries=reading.entries,
        evictions=int(counters.get("evictions", 0)),
        health=reading.health,
        backpressure=None if handle.admission is None else handle.admission.snapshot(),
        admission=_admission(handle),
        counters=counters,
        extra=reading.extra,
        extra_kinds=reading.extra_kinds,
    )


def manager_snapshot(primary: PrimaryTier, tiers: TierSet, tally: LookupTally, hits: int, jobs_in_flight: int,
                     active_requests: int, control_problems: dict[str, int]) -> ManagerSnapshot:
    """The whole snapshot: every tier's (each read through its guards first, so the calls that
    failed are in the copy of the manager's counters), the CPU tier's sizes, the lookup answers
    from ``tally`` and ``hits`` (the HITs answered), and the request-control problems by ``"<key>:<kind>"``."""
    counters = tiers.counters
    secondary = [tier_snapshot(handle, TierReading.of(handle)) for handle in tiers.handles]
    cpu = cpu_snapshot(primary, tiers.cpu, tally.cpu_counts(hits), counters.promotion_alloc_failures)
    return ManagerSnapshot(
        taken_at=time.monotonic(),
        block_bytes=primary.block_bytes,
        row_stride=primary.region.row_stride,
        cpu_blocks=primary.num_blocks,
        manager=replace(counters, lookups=tally.answers(hits), jobs_in_flight=jobs_in_flight,
                        active_requests=active_requests, request_control_problems=control_problems),
        tiers=(cpu, *secondary),
    )


__all__ = ["LookupTally", "TierReading", "cpu_snapshot", "manager_snapshot", "tier_snapshot"]
