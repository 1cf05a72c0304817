"""Cascade admission: whether a secondary tier takes a cascade (store) job now.

A cascade copies blocks that a device store just made ready in the CPU tier
down to a secondary tier. Each tier's :class:`~kvtier.manager.tierset.TierHandle`
holds one admission object, or None, which means the tier takes every cascade
("admission: all"). Promotions (loads) never ask: reads are what the engine
waits for, so they are never refused.

The contract of an admission (:class:`CascadeAdmission`). The manager calls every
method from the scheduler thread; none may block, and each should cost about a
dictionary operation, because ``admit`` runs once per cascade job and tier:

* ``admit(keys, request, stores_in_flight)``: whether the job of ``keys`` (ready
  CPU blocks of ``request`` in prefix order; ``request`` is None for a store without
  one) goes to the tier now. ``stores_in_flight`` is the number of the tier's
  cascade jobs that were submitted and not yet reported. Answering False skips the
  job: its blocks stay in the CPU tier only, and the manager counts them in
  ``cascades_skipped``. ``keys`` must not be modified; the key objects may be kept.
* ``finished(result, seconds)``: the tier reported one of its cascade jobs.
  ``seconds`` runs from submit to report (the tier's own figure when it gave one).
  Jobs that were skipped are never reported.
* ``snapshot()``: the state shown in the tier's :class:`~kvtier.telemetry.TierSnapshot`
  (its ``backpressure`` field), or None.

Backpressure (:mod:`kvtier.backpressure`) is the one admission built in. A learned
admission (issue 21: ``admission: all | learned`` per tier) implements the same
three methods, wraps the backpressure admission where it should still apply, and
is returned by :func:`cascade_admission` for the tiers that ask for it. To show its
own state in the snapshot, it adds a field next to ``backpressure``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvtier.backpressure import BackpressureSettings, StoreLatencyMonitor
from kvtier.keys import BlockKey
from kvtier.telemetry import BackpressureSnapshot
from kvtier.tiers.base import JobResult
from kvtier.types import RequestContext


class CascadeAdmission(Protocol):
    """Decides which cascade jobs one secondary tier takes; see the module docstring."""

    def admit(self, keys: Sequence[BlockKey], request: RequestContext | None, stores_in_flight: int) -> bool:
        """Whether the cascade of ``keys`` goes to the tier now (False: skipped and counted)."""

    def finished(self, result: JobResult, seconds: float) -> None:
        """The tier reported one cascade job, ``seconds`` after it was submitted."""

    def snapshot(self) -> BackpressureSnapshot | None:
        """The state to show in the tier's snapshot, or None."""


class BackpressureAdmission:
    """Backpressure as an admission: skips cascades while the tier's store latency is high.

    It takes one latency sample from each finished cascade job that reached the
    medium: the job moved bytes, or it failed after the tier spent time on it. Jobs
    that were skipped because the tier already held their keys, or shed at once, do
    not say anything about the tier's latency.
    """

    __slots__ = ("monitor",)

    def __init__(self, monitor: StoreLatencyMonitor) -> None:
        self.monitor = monitor

    def admit(self, keys: Sequence[BlockKey], request: RequestContext | None, stores_in_flight: int) -> bool:
        return self.monitor.admit(len(keys), stores_in_flight)

    def finished(self, result: JobResult, seconds: float) -> None:
        if result.bytes_moved > 0 or (not result.success and result.seconds > 0):
            self.monitor.observe(seconds)

    def snapshot(self) -> BackpressureSnapshot:
        return self.monitor.snapshot()


def cascade_admission(settings: BackpressureSettings, label: str) -> CascadeAdmission | None:
    """The admission of the tier labelled ``label``: backpressure when ``settings`` enable it, else
    None (every cascade is taken)."""
    return BackpressureAdmission(StoreLatencyMonitor(settings, label)) if settings.enabled else None


__all__ = ["BackpressureAdmission", "CascadeAdmission", "cascade_admission"]
