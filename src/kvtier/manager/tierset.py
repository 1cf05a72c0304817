"""The secondary tiers as the manager sees them together: the :class:`TierSet` of every tier's
:class:`~kvtier.manager.handle.TierHandle`.

The set asks the serving tiers after a CPU miss, broadcasts guarded calls, tracks
which tiers serve (live, not overdue) and shuts them all down under one shared
deadline. Every call of a tier is guarded: one that raises, or answers with a
value of the wrong type, is counted (``call_error``), logged once per call, and
answered with its safe default, so a tier never crashes the engine's scheduler.
Scheduler thread only, except :meth:`TierSet.shutdown` (the thread that shuts
down the manager).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from time import perf_counter
from typing import Any

from kvtier.backpressure import BackpressureSettings
from kvtier.errors import TierFailure
from kvtier.failures import log_failure
from kvtier.keys import BlockKey
from kvtier.manager.admission import tier_admission
from kvtier.manager.handle import TierHandle
from kvtier.manager.serial import OneCall
from kvtier.manager.waits import BlockWaits
from kvtier.primary import PrimaryTier
from kvtier.telemetry import ManagerCounters, TierTelemetry
from kvtier.tiers.base import SecondaryTier
from kvtier.types import LookupResult, OffloadPolicy, RequestContext, RequestControl

logger = logging.getLogger(__name__)

_HIT, _RETRY, _MISS = LookupResult.HIT, LookupResult.RETRY, LookupResult.MISS



class TierSet:
    """Every secondary tier's handle, in order, and what the manager asks of them together."""

    def __init__(self, tiers: Sequence[SecondaryTier], backpressure: BackpressureSettings,
                 counters: ManagerCounters, waits: BlockWaits, cpu: TierTelemetry,
                 primary: PrimaryTier | None = None) -> None:
        self.cpu = cpu  # the manager's telemetry of the CPU tier (index 0)
        self.handles = tuple(TierHandle(i, tier, tier_admission(tier, i, backpressure, primary), counters, waits)
                             for i, tier in enumerate(tiers, start=1))  # fmt: skip
        self.live = list(self.handles)
        """The handles of the tiers not shut down, in order."""
        self.serving = list(self.handles)
        """The live handles with no job past the wait deadline, in order (the lookup path iterates it)."""
        self._step_end = [handle for handle in self.handles if handle.has_step_end]
        self.telemetry = (self.cpu, *(handle.telemetry for handle in self.handles))
        """The manager's telemetry of every tier, the CPU tier first."""
        self.counters = counters  # the manager's own counters (its snapshot holds a copy)
        self.shutdown_call = OneCall()  # held through the manager's shutdown: one call at a time

    def lookup(self, key: BlockKey, request: RequestContext | None, allowed: frozenset[int] | None,
               now: float) -> TierHandle | LookupResult:
        """Ask the serving tiers ``allowed`` (indices; None: all) in order, after a CPU miss: the
        handle of the first that answers HIT, else RETRY if one answered RETRY, else MISS.

        A tier's HIT or RETRY for a block it may not promise now counts as its MISS
        (:class:`~kvtier.manager.waits.TierWaits`). ``now`` is when
        the first tier is asked if this lookup is timed (the per-tier ``lookup_seconds``), else
        0. A tier's RETRY, and its answer after one, are always timed (``lookup_async_seconds``).
        The hot path of a miss: its guard is written inline.
        """
        retry = False
        for handle in self.serving:
            if allowed is not None and handle.index not in allowed:
                continue
            try:
                answer = handle.tier.lookup(key, request)
            except Exception as exc:
                handle.failed("lookup", exc)
                continue
            if now:
                done = perf_counter()
                handle.telemetry.lookup_seconds.pending.append(done - now)
                now = done
            if answer is _MISS or (answer is not _HIT and answer is not _RETRY):  # (a broken tier's: its MISS)
                if answer is not _MISS:
                    handle.wrong_answer("lookup", answer, "LookupResult HIT, MISS or RETRY")
                if handle.retry_since:
                    handle.waits.answered(key, now or perf_counter())
                continue
            waits = handle.waits
            if waits.withheld and waits.withholds(key, now or perf_counter()):
                continue
            if answer is _RETRY:
                waits.retried(key, now or perf_counter())
                retry = True
                continue
            if handle.retry_since:
                waits.answered(key, now or perf_counter())
            if answer is _HIT:
                return handle
        return _RETRY if retry else _MISS

    def request_level(self, request: RequestContext) -> list[TierHandle]:
        """The live tiers whose ``on_new_request(request)`` asks for request-level cascades (one
        that raises or answers no :class:`OffloadPolicy` is counted and logged, and is block-level)."""
        asked = self.broadcast("on_new_request", request)
        for handle, policy in asked:
            if not isinstance(policy, OffloadPolicy):
                handle.wrong_answer("on_new_request", policy, "an OffloadPolicy")
        return [handle for handle, policy in asked if policy is OffloadPolicy.REQUEST_LEVEL]

    def broadcast(self, name: str, *args: Any,
                  among: Iterable[TierHandle] | None = None) -> list[tuple[TierHandle, Any]]:  # fmt: skip
        """``name(*args)`` on each live tier (or ``among``), guarded: ``(handle, answer)`` of each that returned."""
        failed = object()
        out = []
        for handle in self.live if among is None else among:
            answer = handle.call(name, *args, default=failed)
            if answer is not failed:
                out.append((handle, answer))
        return out

    def touch(self, keys: Sequence[BlockKey], request: RequestContext | None,
              control_of: Callable[[RequestContext], RequestControl]) -> None:
        """``touch(keys, request)`` on the live tiers the request may load from (all without one)."""
        if keys and self.live:  # the request's control only when there is something to send
            allowed = None if request is None else (request.control or control_of(request)).load_from
            among = None if allowed is None else [h for h in self.live if h.index in allowed]
            for handle, _ in self.broadcast("touch", keys, request, among=among):
                if handle.admission is not None:  # a use renews a block's stay: its admission follows
                    handle.admission.touched(keys)

    def targets(self, among: Iterable[TierHandle], wanted: frozenset[int] | None) -> list[TierHandle]:
        """The live handles of ``among`` with no job past the deadline, of an index in ``wanted`` (None: any)."""
        return [h for h in among if h.live and not h.overdue and (wanted is None or h.index in wanted)]

    def admit(self, among: list[TierHandle], keys: list[BlockKey], request: RequestContext | None) -> list[TierHandle]:
        """The handles of ``among`` whose admission takes a cascade of ``keys`` now (counted per tier)."""
        admitted = []
        for handle in among:
            admission, telemetry = handle.admission, handle.telemetry
            if admission is not None and not admission.admit(keys, request, telemetry.stores_in_flight):
                self.counters.cascades_skipped += len(keys)
                telemetry.declined_blocks += len(keys)
            else:
                telemetry.admitted_blocks += len(keys)
                admitted.append(handle)
        return admitted

    def has_pending_work(self) -> bool:
        """A live tier has work in flight (one that raises counts as busy: completions are still polled)."""
        return any(handle.call("has_pending_work", default=True) for handle in self.live)

    def end_step(self) -> None:
        """Step end: the tiers that want ``on_schedule_end`` get it; latencies are folded."""
        if self._step_end:
            self.broadcast("on_schedule_end", among=self._step_end)
        for telemetry in self.telemetry:
            telemetry.fold_full()

    def forget_retries(self) -> None:
        for handle in self.handles:
            handle.retry_since.clear()

    def job_overdue(self, handle: TierHandle, late: bool) -> None:
        """A job of ``handle``'s passed the deadline (``late``), or was reported; while any is: no lookup/cascade."""
        handle.overdue += 1 if late else -1
        if handle.overdue == int(late):  # its state changed
            self.serving = [h for h in self.live if not h.overdue]
            if late:
                logger.warning("secondary tier #%d (type=%s): a job is not reported within the wait deadline; no "
                               "lookup or cascade goes to it until it is", handle.index, handle.tier.tier_type)
            else:
                logger.info("secondary tier #%d (type=%s) reported its late jobs; serving again",
                            handle.index, handle.tier.tier_type)

    def mark_down(self, handle: TierHandle) -> None:
        """``handle``'s tier shut down: no call reaches it any more, and its view of the rows goes."""
        handle.live = False
        for among in (self.live, self.serving, self._step_end):
            if handle in among:
                among.remove(handle)
        if handle.context is not None:
            handle.context.release_rows()

    def shutdown(self, timeout: float | None) -> list[TierFailure]:
        """Shut down every live tier, even after earlier ones fail; the failures (each logged
        with the tier's index, type and class).

        ``timeout`` (None: no deadline) is shared: each tier waits at most the time left
        divided by the tiers left, and one that overruns fails with
        :class:`TierShutdownTimeout`. KeyboardInterrupt/SystemExit from a tier propagate.
        """
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        pending = list(self.live)
        failures: list[TierFailure] = []
        for done, handle in enumerate(pending):
            share = None if deadline is None else max(0.0, deadline - time.monotonic()) / (len(pending) - done)
            error = handle.shutdown(share)
            if error is None:
                self.mark_down(handle)
                continue
            tier = handle.tier
            # As text, its frames cleared: a handler that keeps records must not keep the rows
            # mapped. Its traceback stays: the error is raised again, chained to TierShutdownError.
            what = f"Failed to shut down secondary tier #{handle.index} (type={tier.tier_type}, " \
                   f"class={type(tier).__qualname__})"
            log_failure(logger, logging.ERROR, what, error, with_traceback=True, keep_traceback=True)
            failures.append(TierFailure(handle.index, tier.tier_type, type(tier).__qualname__, error))
        return failures


__all__ = ["TierSet"]
