"""The secondary tiers as the manager sees them: a :class:`TierHandle` per tier, a :class:`TierSet` of all.

A handle holds all the manager keeps of one tier: its index (1-based, as in
labels, logs and errors), descriptor, telemetry, cascade admission, liveness,
RETRY state and a shutdown still running past a deadline. Every call of a tier
is guarded here: one that raises is counted (``call_error``), logged once per
call, and answered with its safe default, so a tier never crashes the engine's
scheduler. Scheduler thread only, except :meth:`TierSet.shutdown` (the thread
that calls the manager's ``shutdown()``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from time import perf_counter
from typing import Any, TypeVar

from kvtier.backpressure import BackpressureSettings
from kvtier.errors import TierFailure, TierShutdownTimeout
from kvtier.keys import BlockKey
from kvtier.manager.admission import CascadeAdmission, tier_admission
from kvtier.primary import PrimaryTier
from kvtier.request_control import TierDescriptor, tier_locality
from kvtier.telemetry import ManagerCounters, TierTelemetry
from kvtier.tiers.base import SecondaryTier, TransferJob
from kvtier.types import LookupResult, RequestContext, tier_label

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_HIT, _RETRY, _MISS = LookupResult.HIT, LookupResult.RETRY, LookupResult.MISS

MAX_PENDING_RETRIES = 65536
"""Keys per tier remembered between a RETRY and its answer; beyond it the oldest are forgotten."""


class _ShutdownRun:
    """One call of a tier's ``shutdown()`` on its own daemon thread, so the manager can stop
    waiting for it (a hung tier is abandoned, never waited on past its share of the deadline)."""

    def __init__(self, tier: SecondaryTier, index: int) -> None:
        self.error: BaseException | None = None
        self._done = threading.Event()
        thread = threading.Thread(target=self._run, args=(tier,), name=f"kvtier-shutdown-tier{index}", daemon=True)
        thread.start()

    def _run(self, tier: SecondaryTier) -> None:
        try:
            tier.shutdown()
        except BaseException as exc:  # handed to the manager's thread, KeyboardInterrupt included
            self.error = exc
        finally:
            self._done.set()

    def wait(self, timeout: float | None) -> bool:
        """True once the call returned or raised (``error`` then says which)."""
        return self._done.wait(timeout)


class TierHandle:
    """One secondary tier and the manager's state of it (see the module docstring)."""

    __slots__ = ("_counters", "_logged", "_shutdown_run", "admission", "descriptor", "has_step_end", "index", "live",
                 "retry_since", "telemetry", "tier")  # fmt: skip

    def __init__(self, index: int, tier: SecondaryTier, admission: CascadeAdmission | None,
                 counters: ManagerCounters) -> None:
        self.index = index
        self.tier = tier
        self.descriptor = TierDescriptor(index, tier_label(index, tier.tier_type), tier.tier_type,
                                         tier_locality(tier.medium, getattr(tier, "locality", None)))
        self.telemetry = TierTelemetry()
        self.admission = admission
        self.live = True
        self.retry_since: dict[BlockKey, float] = {}
        """When the tier first answered RETRY for a key, so the answer that follows is timed."""
        base = SecondaryTier.on_schedule_end  # the base class's does nothing: a call per step saved
        self.has_step_end = getattr(getattr(tier, "on_schedule_end", None), "__func__", None) is not base
        self._counters = counters
        self._logged: set[str] = set()
        self._shutdown_run: _ShutdownRun | None = None

    def failed(self, call: str) -> None:
        """The tier raised from ``call()``: count it, and log it the first time (call from an
        ``except`` block, so the log carries the traceback)."""
        self._counters.tier_call_errors += 1
        self.telemetry.fail("call_error")
        if call not in self._logged:
            self._logged.add(call)
            logger.exception(
                "secondary tier #%d (type=%s, class=%s) raised from %s(); treated as its safe default "
                "(further errors of this call are only counted)",
                self.index, self.tier.tier_type, type(self.tier).__qualname__, call,
            )

    def call(self, name: str, *args: Any, default: Any = None) -> Any:
        """The tier's method ``name`` called with ``args``, or ``default`` if it raised (see :meth:`failed`)."""
        try:
            return getattr(self.tier, name)(*args)
        except Exception:
            self.failed(name)
            return default

    def guard(self, call: str, fn: Callable[[], _T], default: _T) -> _T:
        """``fn()`` (which reads the tier), or ``default`` if it raised, counted as ``call()`` failing."""
        try:
            return fn()
        except Exception:
            self.failed(call)
            return default

    def submit(self, job: TransferJob) -> bool:
        """Hand ``job`` to the tier; False if it refused (logged, counted as ``submit_error``)."""
        try:
            (self.tier.submit_load if job.is_promotion else self.tier.submit_store)(job)
        except Exception:
            logger.exception("secondary tier #%d failed to accept %s job %d", self.index,
                             "load" if job.is_promotion else "store", job.job_id)
            self._counters.submit_errors += 1
            self.telemetry.fail("submit_error")
            return False
        return True

    def retried(self, key: BlockKey, now: float) -> None:
        """The tier answered RETRY for ``key`` at ``now`` (the first RETRY starts the clock)."""
        pending = self.retry_since
        if key not in pending:
            if len(pending) >= MAX_PENDING_RETRIES:
                del pending[next(iter(pending))]
            pending[key] = now

    def answered(self, key: BlockKey, now: float) -> None:
        """The tier answered HIT or MISS for ``key``; time it if it had answered RETRY before."""
        start = self.retry_since.pop(key, None)
        if start is not None:
            self.telemetry.lookup_async_seconds.observe(now - start)

    def shutdown(self, share: float | None) -> Exception | None:
        """Run (or keep waiting for) the tier's ``shutdown()``; its error, or None on success.

        Without a deadline (``share`` None) and with no earlier call still running, the call
        is made in this thread. KeyboardInterrupt/SystemExit raised by the tier propagate.
        """
        run = self._shutdown_run
        if share is None and run is None:
            try:
                self.tier.shutdown()
            except Exception as exc:
                return exc
            return None
        still = " (still running the shutdown() of an earlier attempt)" if run is not None else ""
        if run is None:
            run = self._shutdown_run = _ShutdownRun(self.tier, self.index)
        if not run.wait(share):
            return TierShutdownTimeout(
                f"secondary tier #{self.index} (type={self.tier.tier_type}) did not finish shutdown() within its "
                f"{share:.3g}s share of the deadline{still}; abandoned while still running, so the CPU "
                "tier stays mapped. Call shutdown() again to wait for it"
            )
        self._shutdown_run = None
        if run.error is None or isinstance(run.error, Exception):
            return run.error
        raise run.error  # KeyboardInterrupt / SystemExit inside the tier: stop here


class TierSet:
    """Every secondary tier's handle, in order, and what the manager asks of them together."""

    def __init__(self, tiers: Sequence[SecondaryTier], backpressure: BackpressureSettings,
                 counters: ManagerCounters, primary: PrimaryTier | None = None) -> None:
        self.cpu = TierTelemetry()  # the manager's telemetry of the CPU tier (index 0)
        self.handles = tuple(TierHandle(i, tier, tier_admission(tier, i, backpressure, primary), counters)
                             for i, tier in enumerate(tiers, start=1))  # fmt: skip
        self.live = list(self.handles)
        """The handles of the tiers not shut down, in order (the lookup path iterates it)."""
        self._step_end = [handle for handle in self.handles if handle.has_step_end]
        self.telemetry = (self.cpu, *(handle.telemetry for handle in self.handles))
        """The manager's telemetry of every tier, the CPU tier first."""
        self._counters = counters

    def lookup(self, key: BlockKey, request: RequestContext | None, allowed: frozenset[int] | None,
               now: float) -> TierHandle | LookupResult:
        """Ask the live tiers ``allowed`` (indices; None: all) in order, after a CPU miss: the
        handle of the first that answers HIT, else RETRY if one answered RETRY, else MISS.

        ``now`` is when the first tier is asked if this lookup is timed (the per-tier
        ``lookup_seconds``), else 0. A tier's RETRY, and its answer after one, are always
        timed (``lookup_async_seconds``). The hot path of a miss: its guard is written inline.
        """
        retry = False
        for handle in self.live:
            if allowed is not None and handle.index not in allowed:
                continue
            try:
                answer = handle.tier.lookup(key, request)
            except Exception:
                handle.failed("lookup")
                continue
            if now:
                done = perf_counter()
                handle.telemetry.lookup_seconds.pending.append(done - now)
                now = done
            if answer is _MISS:
                if handle.retry_since:
                    handle.answered(key, now or perf_counter())
                continue
            if answer is _RETRY:
                handle.retried(key, now or perf_counter())
                retry = True
                continue
            if handle.retry_since:
                handle.answered(key, now or perf_counter())
            if answer is _HIT:
                return handle
        return _RETRY if retry else _MISS

    def broadcast(
        self, name: str, *args: Any, among: Iterable[TierHandle] | None = None
    ) -> list[tuple[TierHandle, Any]]:
        """Call ``name(*args)`` on every live tier (or those of ``among``), guarded; the
        ``(handle, answer)`` of each call that did not raise."""
        failed = object()
        out = []
        for handle in self.live if among is None else among:
            answer = handle.call(name, *args, default=failed)
            if answer is not failed:
                out.append((handle, answer))
        return out

    def targets(self, among: Iterable[TierHandle], wanted: frozenset[int] | None) -> list[TierHandle]:
        """The live handles of ``among`` whose index ``wanted`` has (None: every one)."""
        return [handle for handle in among if handle.live and (wanted is None or handle.index in wanted)]

    def admit(self, among: list[TierHandle], keys: list[BlockKey], request: RequestContext | None) -> list[TierHandle]:
        """The handles of ``among`` whose admission takes a cascade of ``keys`` now (counted per tier)."""
        admitted = []
        for handle in among:
            admission, telemetry = handle.admission, handle.telemetry
            if admission is not None and not admission.admit(keys, request, telemetry.stores_in_flight):
                self._counters.cascades_skipped += len(keys)
                telemetry.declined_blocks += len(keys)
            else:
                telemetry.admitted_blocks += len(keys)
                admitted.append(handle)
        return admitted

    def has_pending_work(self) -> bool:
        """A live tier has work in flight (one that raises counts as busy: completions are still polled)."""
        return any(handle.call("has_pending_work", default=True) for handle in self.live)

    def end_step(self) -> None:
        """Step end: the tiers that want ``on_schedule_end`` get it; lookup times are folded."""
        if self._step_end:
            self.broadcast("on_schedule_end", among=self._step_end)
        for telemetry in self.telemetry:
            if len(telemetry.lookup_seconds.pending) >= telemetry.lookup_seconds.FOLD_AT:
                telemetry.lookup_seconds.fold()

    def forget_retries(self) -> None:
        for handle in self.handles:
            handle.retry_since.clear()

    def mark_down(self, handle: TierHandle) -> None:
        """``handle``'s tier shut down: no call reaches it any more, and its view of the rows goes."""
        handle.live = False
        self.live.remove(handle)
        if handle in self._step_end:
            self._step_end.remove(handle)
        handle.tier.context.release_rows()

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
            logger.error(
                "Failed to shut down secondary tier #%d (type=%s, class=%s): %s",
                handle.index, tier.tier_type, type(tier).__qualname__, error, exc_info=error,
            )
            failures.append(TierFailure(handle.index, tier.tier_type, type(tier).__qualname__, error))
        return failures


__all__ = ["MAX_PENDING_RETRIES", "TierHandle", "TierSet"]
